"""How the cluster commands show jobs (pure text: tables, one job in full, progress lines)."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cephalo.api import Plan
from cephalo.planner.outputs.report import format_plan

if TYPE_CHECKING:  # cephalo.client imports the kubernetes client: only a command that connects
    from cephalo.client import Job

BAR_CELLS = 24
# The chart's operator pods carry these labels (charts/cephalo-operator/_helpers.tpl); the
# namespace is the release's, which the client cannot know: -A.
OPERATOR_PODS = ("kubectl get pods -A -l app.kubernetes.io/name=cephalo-operator,"
                 "app.kubernetes.io/component=operator")


def unseen() -> str:
    """What to check when no operator has written a job's status (a function: importing
    cephalo.client.errors runs cephalo.client's __init__, the kubernetes client and kopf,
    which `cephalo --help` and the commands that do not connect should not pay for)."""
    from cephalo.client.errors import HELM_INSTALL

    return ("Operator:    no operator has written this job's status yet: is one running, and "
            "does it watch this namespace (chart value watchNamespaces)?\n"
            f"             {OPERATOR_PODS}, then kubectl logs -n ITS-NAMESPACE POD; none "
            f"installed: {HELM_INSTALL}")


def age(since: datetime.datetime | None, now: datetime.datetime) -> str:
    """kubectl's AGE: 45s, 12m, 3h, 5d."""
    if since is None:
        return "-"
    seconds = max(0, int((now - since).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds < 0:
        return "-"
    s = int(seconds + 0.5)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def gpus(job: Job) -> str:
    """GPUs per type in the plan: 2xNVIDIA-L4,1xNVIDIA-RTX-A6000."""
    pools = (job.status.plan.pools if job.status.plan else None) or {}
    return ",".join(f"{n}x{pool}" for pool, n in sorted(pools.items())) or "-"


def percent(job: Job) -> int | None:
    """status.progress.percent; from an operator that writes none, the step over the total."""
    progress = job.status.progress
    if progress is None:
        return None
    if progress.percent is not None:
        return progress.percent
    total = job.total_steps
    return min(100, progress.step * 100 // total) if progress.step is not None and total \
        else None


def eta_seconds(job: Job, now: datetime.datetime) -> float | None:
    """Seconds from `now` to status.progress.estimatedEndTime (the operator's, from the
    running gang's measured step time), 0 once past it; None when there is none."""
    progress = job.status.progress
    end = _when(progress.estimated_end_time if progress else None)
    return None if end is None else max(0.0, (end - now).total_seconds())


def _when(text: str | None) -> datetime.datetime | None:
    """An RFC 3339 time from the status; None when absent or unreadable."""
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def steps(job: Job) -> str:
    progress = job.status.progress
    step = progress.step if progress else None
    total = job.total_steps
    if step is None:
        return f"-/{total}" if total else "-"
    return f"{step}/{total}" if total else str(step)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None or value != value else format(value, fmt)


def throughput(job: Job) -> str:
    """samples/s measured/predicted."""
    measured = job.status.progress.samples_per_second if job.status.progress else None
    predicted = job.status.plan.predicted_samples_per_second if job.status.plan else None
    return f"{_num(measured, '.1f')}/{_num(predicted, '.1f')}"


def jobs_table(jobs: Sequence[Job], now: datetime.datetime, namespaces: bool = False) -> str:
    header = ["NAME", "PHASE", "GPUS", "STEP", "PROGRESS", "ETA", "LOSS",
              "SAMPLES/S (MEAS/PRED)", "RESTARTS/PREEMPT", "AGE"]
    if namespaces:
        header.insert(0, "NAMESPACE")
    rows = [header]
    for job in jobs:
        progress = job.status.progress
        done = percent(job)
        row = [job.name, job.phase, gpus(job), steps(job), "-" if done is None else f"{done}%",
               duration(eta_seconds(job, now)),
               _num(progress.loss if progress else None, ".4f"), throughput(job),
               f"{job.status.restarts or 0}/{job.status.preemptions or 0}",
               age(job.created, now)]
        rows.append([job.namespace, *row] if namespaces else row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def job_details(job: Job, plan: Plan | None, events: Sequence[dict[str, Any]],
                now: datetime.datetime) -> str:
    """One job in full: phase, progress, plan per rank, conditions, recent events, and on
    failure the rank blamed and why."""
    s = job.status
    loss = _num(s.progress.loss if s.progress else None, ".4f")
    lines = [f"Name:        {job.namespace}/{job.name}",
             f"Phase:       {job.phase}" + (f"  ({s.message})" if s.message else ""),
             f"Age:         {age(job.created, now)}",
             f"GPUs:        {gpus(job)}",
             *sharding_lines(job),
             f"Step:        {steps(job)}{_percent_text(job)}   loss {loss}"
             f"   samples/s measured/predicted {throughput(job)}",
             *eta_lines(job, now),
             f"Restarts:    {s.restarts or 0} (backoffLimit "
             f"{job.spec.backoff_limit if job.spec else '?'}), preemptions {s.preemptions or 0}"]
    if job.unseen:
        lines.append(unseen())
    lines += elastic_lines(job)
    lines += replan_lines(job)
    lines += rebalance_lines(job, plan)
    if job.spec_error:
        lines.append(f"Invalid spec: {job.spec_error}")
    if job.phase == "Failed":
        lines.append(f"Failed:      {job.failure_reason}")
        blamed = job.condition("Running")
        if blamed and blamed.reason in ("RankFailed", "RankDisrupted") and blamed.message:
            lines.append(f"Blamed rank: {blamed.message}")
    if plan is not None:
        model = (job.spec.model.preset or job.spec.model.family or "model") if job.spec \
            else "model"
        lines += ["", format_plan(plan, model)]
    if s.conditions:
        lines += ["", "Conditions:"]
        width = max(len(c.type) for c in s.conditions)
        for c in s.conditions:
            lines.append(f"  {c.type.ljust(width)}  {c.status:<5}  {c.reason or ''}: "
                         f"{c.message or ''}".rstrip(": "))
    if events:
        lines += ["", "Recent events:"]
        for e in events:
            count = f" (x{e['count']})" if (e.get("count") or 1) > 1 else ""
            lines.append(f"  {e.get('type', ''):<7}  {e.get('reason', ''):<20}  "
                         f"{e.get('message', '')}{count}")
    return "\n".join(lines)


def _percent_text(job: Job) -> str:
    done = percent(job)
    return "" if done is None else f" ({done}%)"


def eta_lines(job: Job, now: datetime.datetime) -> list[str]:
    """`ETA:` and when, while the job can have one (not once finished)."""
    if job.finished:
        return []
    progress = job.status.progress
    left = eta_seconds(job, now)
    if progress is None or progress.step is None:
        return []
    if left is None:
        return ["ETA:         - (no step timed yet by this gang)"]
    return [f"ETA:         {progress.estimated_end_time} (in {duration(left)})"]


def elastic_lines(job: Job) -> list[str]:
    """spec.elastic and the last rescale decision in two lines (none without elastic): what
    was free, the predicted gain, the saving against the restart cost, and the verdict."""
    spec = job.spec.elastic if job.spec else None
    status = job.status.elastic
    if (spec is None or not spec.enabled) and status is None:
        return []
    if spec is not None and spec.enabled:
        bound = spec.max_gpus if spec.max_gpus is not None else "-"
        setting = (f"on (minGain {spec.min_gain:.0%}, cooldown {spec.cooldown_seconds} s, "
                   f"maxGpus {bound})")
    else:
        setting = "off"
    rescales = (status.rescales if status else None) or 0
    measured = status.restart_seconds if status else None
    cost = (f", restart measured {max(measured):.1f} s" if measured else
            f", restart assumed {spec.restart_cost_seconds:g} s" if spec else "")
    rollbacks = (status.rollbacks if status else None) or 0
    rolled = f" ({rollbacks} rolled back: not admitted)" if rollbacks else ""
    lines = [f"Elastic:     {setting}; {rescales} rescale(s){rolled}{cost}"]
    d = status.last_decision if status else None
    if d is not None and d.verdict:
        free = ", ".join(f"{p} x{n}" for p, n in sorted((d.free_gpus or {}).items())) or "-"
        verdict = "rescaled" if d.verdict == "Rescale" else "not decided yet" if \
            d.reason_code == "Profiling" else f"not rescaled ({d.reason_code})"
        lines.append(f"  {d.time or ''} {verdict}; could use {free}: {d.reason}")
    for product, f in sorted(((status.profile_failures if status else None) or {}).items()):
        lines.append(f"  profiling {product} failed {f.failures or 0} time(s) in a row; left "
                     f"out until {f.retry_time or '-'}: {f.reason or ''}")
    return lines


def sharding_lines(job: Job) -> list[str]:
    """A hybrid plan's replica groups from status.plan (docs/hybrid-sharding.md), so they
    show even when the plan ConfigMap cannot be read; none for a flat plan."""
    plan = job.status.plan
    if plan is None or not plan.replica_groups:
        return []
    size = plan.replica_group_size or "?"
    kept = plan.replicated_fraction or 0.0
    split = (f"{kept * 100:g} % of the optimizer state kept in every group, the rest split "
             "across them") if kept else "the optimizer state is split across them"
    return [f"Sharding:    hybrid, {plan.replica_groups} replica groups of {size} ranks "
            f"(each holds the weights; {split})"]


def replan_lines(job: Job) -> list[str]:
    """spec.planner.replan and the last calibration (docs/replanning.md): what was measured
    against what was predicted, and what became of it; nothing before any calibration."""
    status = job.status.replan
    c = status.last_calibration if status else None
    if c is None:
        return []
    spec = job.spec.planner.replan if job.spec else None
    setting = "off" if spec is not None and not spec.enabled else "on" if spec is None else \
        f"on (minGain {spec.min_gain:.0%}, after {spec.after_steps} timed steps)"
    verdict = "re-planned" if c.verdict == "Replan" else f"kept ({c.reason_code})"
    return [f"Re-plan:     {setting}; {(status.replans if status else None) or 0} re-plan(s)",
            f"  {c.time or ''} step {c.step}: measured {_num(c.measured_step_seconds, '.3g')} "
            f"s/step, predicted {_num(c.predicted_step_seconds, '.3g')}; {verdict}: {c.reason}"]


def rebalance_lines(job: Job, plan: Plan | None) -> list[str]:
    """spec.planner.rebalance and the split in force (docs/rebalancing.md): each rank's batch
    and microbatches against the plan's, the changes made without a restart, the last
    one's step and reason, and why memory keeps the split short while it does; nothing
    before rank 0 has shown a split."""
    status = job.status.rebalance
    if status is None or not status.batch_sizes:
        return []
    spec = job.spec.planner.rebalance if job.spec else None
    setting = "on" if spec is None else (
        f"on (every {spec.interval_steps} steps, minGain {spec.min_gain:.0%})"
        if spec.enabled else "off")
    planned = f" (plan {[r.batch_size for r in plan.ranks]})" if plan is not None else ""
    lines = [f"Rebalance:   {setting}; split {status.batch_sizes}{planned}, microbatches "
             f"{status.micro_batches or '-'}; {status.changes or 0} change(s) without a "
             "restart"]
    if status.last_change_step is not None:
        lines.append(f"  {status.last_change_time or ''} after step {status.last_change_step}: "
                     f"{status.last_change_reason or ''}")
    if status.held_step is not None:
        lines.append(f"  held by memory since step {status.held_step}: "
                     f"{status.held_reason or ''} (a smaller microbatch or shard needs a "
                     f"restart: re-planning)")
    return lines


def progress_text(job: Job, bar: bool, now: datetime.datetime | None = None) -> str:
    """`Running [#####---] 40/100 40% loss 3.1 samples/s 120.5 (pred 130.2) ETA 1m20s`: the
    ETA is the time from `now` (default: the clock) to the operator's estimated end."""
    progress = job.status.progress
    step = progress.step if progress else None
    total = job.total_steps
    parts = [job.phase]
    predicted = job.status.plan.predicted_samples_per_second if job.status.plan else None
    if step is None:  # nothing measured yet: no row of dashes ("loss - samples/s -")
        parts.append("no step yet")
        if predicted is not None:
            parts.append(f"(predicted {predicted:.1f} samples/s)")
        return "  ".join(parts)
    done = percent(job)
    if total and done is not None:
        if bar:
            full = done * BAR_CELLS // 100
            parts.append("[" + "█" * full + "░" * (BAR_CELLS - full) + "]")
        parts.append(f"step {step}/{total} ({done}%)")
    parts.append(f"loss {_num(progress.loss if progress else None, '.4f')}")
    measured = progress.samples_per_second if progress else None
    parts.append(f"samples/s {_num(measured, '.1f')} (predicted {_num(predicted, '.1f')})")
    now = now or datetime.datetime.now(datetime.timezone.utc)
    parts.append(f"ETA {duration(eta_seconds(job, now))}")
    return "  ".join(parts)
