"""Pure helpers for status: conditions, pod classification, failure summaries, progress."""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from cephalo.api.replan import MAX_TIMED_RANKS

MESSAGE_TAIL_CHARS = 400

class StrEnum(str, Enum):
    """enum.StrEnum for Python 3.10 (added in 3.11): a member is its value, in str() too."""

    def __str__(self) -> str:
        return str(self.value)


class JobPhase(StrEnum):
    """status.phase of a CephaloJob: the one set every module uses (`cephalo.api.job.Phase`
    lists the same names for the CRD; a unit test keeps the two equal)."""

    PENDING = "Pending"
    PROFILING = "Profiling"
    PLANNING = "Planning"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


TERMINAL_PHASES = frozenset({JobPhase.SUCCEEDED, JobPhase.FAILED})


class PodPhase(StrEnum):
    """status.phase of a Pod (a different set: never compare it with a JobPhase)."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNKNOWN = "Unknown"


POD_DONE = frozenset({PodPhase.SUCCEEDED, PodPhase.FAILED})
# Pod status.reason values that mean "taken away", not "crashed" (kubelet node-pressure
# eviction, preemption, node shutdown or loss); newer clusters also set DisruptionTarget.
DISRUPTION_POD_REASONS = frozenset({"Evicted", "Preempting", "NodeLost", "NodeShutdown",
                                    "Shutdown", "Terminated", "UnexpectedAdmissionError"})

# Condition types (each True/False with a reason and a message that says what to do).
GPUS_AVAILABLE = "GpusAvailable"
PROFILED = "Profiled"
PLANNED = "Planned"
RUNNING = "Running"
SUSPENDED = "Suspended"
SUCCEEDED = "Succeeded"
FAILED = "Failed"


def now_iso(clock_seconds: float) -> str:
    return datetime.datetime.fromtimestamp(clock_seconds, datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def merge_conditions(current: list[dict[str, Any]] | None,
                     updates: dict[str, tuple[str, str, str]],
                     now: str) -> list[dict[str, Any]]:
    """Apply {type: (status, reason, message)}; lastTransitionTime moves only on a flip."""
    by_type = {c["type"]: dict(c) for c in current or []}
    for ctype, (status, reason, message) in updates.items():
        old = by_type.get(ctype)
        changed = old is None or old.get("status") != status
        since = now if old is None or changed else old.get("lastTransitionTime", now)
        by_type[ctype] = {"type": ctype, "status": status, "reason": reason, "message": message,
                          "lastTransitionTime": since}
    return [by_type[t] for t in sorted(by_type)]


@dataclass(frozen=True)
class PodState:
    name: str
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    deleting: bool
    exit_code: int | None
    reason: str | None
    message: str | None
    pod_ip: str | None
    finished_at: str | None
    disruption: str | None = None  # why the pod was taken away (preempted, evicted …), if so
    uid: str | None = None


def pod_state(pod: dict[str, Any]) -> PodState:
    status = pod.get("status") or {}
    terminated: dict[str, Any] = {}
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        terminated = state.get("terminated") or terminated
    return PodState(
        name=pod["metadata"]["name"], phase=status.get("phase", "Pending"),
        deleting=bool(pod["metadata"].get("deletionTimestamp")),
        exit_code=terminated.get("exitCode"), reason=terminated.get("reason")
        or status.get("reason"),
        message=terminated.get("message") or status.get("message"),
        pod_ip=status.get("podIP"), finished_at=terminated.get("finishedAt"),
        disruption=disruption(pod), uid=pod["metadata"].get("uid"))


def disruption(pod: dict[str, Any]) -> str | None:
    """Why a pod was disrupted (a `DisruptionTarget` condition: PreemptionByScheduler,
    EvictionByEvictionAPI, DeletionByTaintManager, TerminationByKubelet, DeletionByPodGC …;
    or an eviction/shutdown reason), None when nothing took it away."""
    status = pod.get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True":
            reason = c.get("reason") or "DisruptionTarget"
            return f"{reason}: {c['message']}" if c.get("message") else reason
    if status.get("reason") in DISRUPTION_POD_REASONS:
        return str(status["reason"]) + (f": {status['message']}" if status.get("message") else "")
    return None


def tail(text: str | None, limit: int = MESSAGE_TAIL_CHARS) -> str:
    text = (text or "").strip()
    return text if len(text) <= limit else "…" + text[-limit:]


def failure_summary(rank: int, pool: str, state: PodState) -> str:
    code = "unknown" if state.exit_code is None else str(state.exit_code)
    parts = [f"rank {rank} (pool {pool}, pod {state.name}) failed with exit code {code}"]
    if state.reason:
        parts.append(f"reason {state.reason}")
    message = tail(state.message)
    return ", ".join(parts) + (f": {message}" if message else "")


# Metrics a trainer's /metrics exposes (cephalo.trainer.metrics) → status.progress fields.
TRAINER_METRICS = {
    "cephalo_step": "step",
    "cephalo_loss": "loss",
    "cephalo_validation_loss": "validationLoss",
    "cephalo_samples_per_second": "samplesPerSecond",
}


# The trainer's info metric: its pod_uid label names the pod serving the page.
TRAINER_INFO = "cephalo_trainer_info"
SERVED_BY = "servedBy"  # parse_progress's key for that uid (not a status field)


# Rank 0's timing sums (cephalo.trainer.metrics.TrainerMetrics.time_ranks).
TIMED_STEPS = "cephalo_timed_steps_total"
TIMED_STEP_SECONDS = "cephalo_timed_step_seconds_total"
RANK_SPLIT = {"cephalo_rank_compute_seconds_total": "computeSeconds",
              "cephalo_rank_wait_seconds_total": "waitSeconds"}


# Rank 0's split in force (cephalo.trainer.metrics.TrainerMetrics.show_split) → the
# scraped "rebalance" figures (cephalo.operator.rebalance_status makes status.rebalance).
SPLIT_SERIES = {"cephalo_split_batch_size": "batchSizes",
                "cephalo_split_micro_batches": "microBatches"}
SPLIT_CHANGES = "cephalo_split_changes_total"
SPLIT_LAST_CHANGE = "cephalo_split_last_change_step"
SPLIT_HELD = "cephalo_split_held_step"  # memory keeps the split short of the one wanted
REBALANCE = "rebalance"  # parse_progress's key for them (not a status.progress field)
MAX_REASON_CHARS = 1024  # the reason is the trainer's sentence: bounded in status


def parse_progress(metrics_text: str) -> dict[str, Any]:
    """Prometheus text from rank 0 → status.progress fields (missing metrics are left out),
    plus SERVED_BY: the uid of the pod the page names, when it names one. `timing`: the
    means over the timed steps (step time, each rank's compute and waiting), when the page
    has every rank's split. REBALANCE: the split of the global batch in force, when the page
    shows it (`_rebalance`)."""
    found: dict[str, Any] = {}
    sums: dict[str, float] = {}
    split: dict[str, dict[int, float]] = {k: {} for k in (*RANK_SPLIT.values(),
                                                          *SPLIT_SERIES.values())}
    last_change: dict[str, Any] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == SPLIT_CHANGES:
                last_change["changes"] = sample.value
            if sample.name == SPLIT_LAST_CHANGE:
                last_change.update(step=sample.value, reason=sample.labels.get("reason", ""))
            if sample.name == SPLIT_HELD:
                last_change.update(held_step=sample.value,
                                   held_reason=sample.labels.get("reason", ""))
            per_rank = SPLIT_SERIES.get(sample.name)
            rank_label = sample.labels.get("of_rank", "")
            if per_rank is not None and rank_label.isdigit() and \
                    int(rank_label) < MAX_TIMED_RANKS:
                split[per_rank][int(rank_label)] = float(sample.value)
            if sample.name == TRAINER_INFO and sample.labels.get("pod_uid"):
                found[SERVED_BY] = sample.labels["pod_uid"]
            if sample.name in (TIMED_STEPS, TIMED_STEP_SECONDS):
                sums[sample.name] = float(sample.value)
            kind = RANK_SPLIT.get(sample.name)
            of_rank = sample.labels.get("of_rank", "")
            if kind is not None and of_rank.isdigit() and int(of_rank) < MAX_TIMED_RANKS:
                split[kind][int(of_rank)] = float(sample.value)
            field = TRAINER_METRICS.get(sample.name)
            if field is not None:
                value = sample.value
                found[field] = int(value) if field == "step" else float(value)
    timing = _timing(sums, split)
    if timing is not None:
        found["timing"] = timing
    rebalance = _rebalance(split, last_change)
    if rebalance is not None:
        found[REBALANCE] = rebalance
    return found


def _counts(values: dict[int, float]) -> list[int] | None:
    """Per-rank whole counts 0..n-1; None with a rank missing or a value not a count."""
    if not values or set(values) != set(range(len(values))) or \
            not all(math.isfinite(v) and 0 <= v < 2**53 and v == int(v)
                    for v in values.values()):
        return None
    return [int(values[r]) for r in range(len(values))]


def _rebalance(split: dict[str, dict[int, float]],
               last_change: dict[str, Any]) -> dict[str, Any] | None:
    """The split in force as the page shows it: every rank's batch and microbatch count,
    this gang's changes, the last change's step and reason, and why memory keeps the split
    short of the one wanted, while it does (held); None when the page shows
    no whole split (a trainer older than live rebalancing, or a gang of over
    MAX_TIMED_RANKS ranks)."""
    batches, micro = _counts(split["batchSizes"]), _counts(split["microBatches"])
    changes = last_change.get("changes", 0.0)
    if batches is None or micro is None or len(micro) != len(batches) or \
            not (math.isfinite(changes) and 0 <= changes < 2**53):
        return None
    found: dict[str, Any] = {"batchSizes": batches, "microBatches": micro,
                             "changes": int(changes)}
    for step_key, reason_key, step_field, reason_field in (
            ("step", "reason", "lastChangeStep", "lastChangeReason"),
            ("held_step", "held_reason", "heldStep", "heldReason")):
        step = last_change.get(step_key)
        if step is not None and math.isfinite(step) and 0 <= step < 2**63:
            found[step_field] = int(step)
            found[reason_field] = str(last_change.get(reason_key, ""))[:MAX_REASON_CHARS]
    return found


def _timing(sums: dict[str, float], split: dict[str, dict[int, float]]) -> dict[str, Any] | None:
    """Means per timed step; None without timed steps or with a rank missing or not finite."""
    steps = sums.get(TIMED_STEPS, 0.0)
    compute, wait = split["computeSeconds"], split["waitSeconds"]
    world = len(compute)
    if not 1 <= steps < 2**53 or TIMED_STEP_SECONDS not in sums or world == 0 or \
            set(compute) != set(range(world)) or set(wait) != set(compute):
        return None
    values = [sums[TIMED_STEP_SECONDS], *compute.values(), *wait.values()]
    if not all(math.isfinite(v) and v >= 0 for v in values):
        return None
    return {"steps": int(steps), "stepSeconds": sums[TIMED_STEP_SECONDS] / steps,
            "computeSeconds": [compute[r] / steps for r in range(world)],
            "waitSeconds": [wait[r] / steps for r in range(world)]}
