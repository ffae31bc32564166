"""What `cephalo run` shows: a live progress line, the final summary (measured vs predicted
throughput, per-rank time breakdown) and PNG plots in the run directory."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from cephalo.api.plan import Plan


class Progress:
    """One refreshed line on a terminal; one line per logged step elsewhere (CI, pipes)."""

    def __init__(self, total_steps: int, stream: TextIO = sys.stdout) -> None:
        self.total = total_steps
        self.stream = stream
        self.tty = stream.isatty()
        self.started = time.monotonic()
        self.first_step: int | None = None

    def update(self, records: Sequence[dict]) -> None:
        for rec in records:
            step = int(rec["step"])
            if self.first_step is None:
                self.first_step, self.started = step - 1, time.monotonic() - rec["step_seconds"]
            done = step - self.first_step
            left = self.total - step
            eta = (time.monotonic() - self.started) / max(done, 1) * left
            width = 24
            filled = int(width * step / self.total)
            bar = "#" * filled + "." * (width - filled)
            validation = rec.get("validation_loss")
            shown = "" if validation is None else f"  val-loss {validation:.4f}"
            line = (f"[{bar}] step {step}/{self.total}  loss {rec['loss']:.4f}{shown}  "
                    f"{rec['samples_per_second']:.1f} samples/s  ETA {eta:4.0f} s")
            if self.tty:
                self.stream.write("\r" + line)
                if step >= self.total:
                    self.stream.write("\n")
            else:
                self.stream.write(line + "\n")
        self.stream.flush()


@dataclass
class Summary:
    measured_samples_per_second: float
    predicted_samples_per_second: float | None
    first_loss: float
    last_loss: float
    steps: int
    rank_compute_seconds: list[float]
    rank_wait_seconds: list[float]
    rank_idle_seconds: list[float]
    step_seconds: float
    first_step: int = 1  # > 1: a resumed run segment
    # (step, mean loss on the held-out set) of every evaluation (training.evalIntervalSteps)
    validation: list[tuple[int, float]] = field(default_factory=list)
    # Live rebalancing (spec.planner.rebalance): every change of the split, as the trainer
    # recorded it (step, from, to, micro_batches, predicted_gain), and the split in force at
    # the end (None: the trainer recorded none, e.g. rebalancing off).
    rebalances: list[dict[str, Any]] = field(default_factory=list)
    final_batch_sizes: list[int] | None = None
    # After a change: the median samples/s over the steps of the split in force at the end
    # (the step a change lands on left out) and their span; its prediction, which only the
    # runner can price (cephalo.planner.feedback.recalibrate.split_step_seconds).
    final_split_samples_per_second: float | None = None
    final_split_steps: tuple[int, int] | None = None
    final_split_predicted_samples_per_second: float | None = None


def summarize(records: Sequence[dict], plan: Plan) -> Summary | None:
    """Median over the logged steps, skipping the first (warm-up: allocator, threads).

    Only records of this plan's world size count: a metrics file that a resumed run appends
    to may hold earlier segments' records, logged under another plan."""
    records = [r for r in records if len(r["ranks"]) == plan.world_size]
    if not records:
        return None
    steady = list(records[1:]) or list(records)
    step_s = statistics.median(r["step_seconds"] for r in steady)
    world = plan.world_size
    compute = [statistics.median(r["ranks"][i]["compute_seconds"] for r in steady)
               for i in range(world)]
    wait = [statistics.median(r["ranks"][i]["collective_wait_seconds"] for r in steady)
            for i in range(world)]
    idle = [max(0.0, step_s - c - w) for c, w in zip(compute, wait, strict=True)]
    last = records[-1]
    final = last.get("rebalanced", {}).get("to", last.get("batch_sizes"))
    rebalances = [r["rebalanced"] for r in records if r.get("rebalanced")]
    summary = Summary(plan.global_batch_size / step_s, plan.predicted_samples_per_second,
                      records[0]["loss"], last["loss"], int(last["step"]),
                      compute, wait, idle, step_s, int(records[0]["step"]),
                      validation_points(records), rebalances,
                      None if final is None else [int(b) for b in final])
    if rebalances and final is not None:
        # The final split's steps after the one its change landed on.
        changed = max(int(r["step"]) for r in rebalances)
        tail = [r for r in records if int(r["step"]) > changed + 1]
        if tail:
            summary.final_split_samples_per_second = plan.global_batch_size / \
                statistics.median(r["step_seconds"] for r in tail)
            summary.final_split_steps = (int(tail[0]["step"]), int(tail[-1]["step"]))
    return summary


def validation_points(records: Sequence[dict]) -> list[tuple[int, float]]:
    """(step, validation loss) of the records that carry one (trainer/eval.py)."""
    return [(int(r["step"]), float(r["validation_loss"])) for r in records
            if r.get("validation_loss") is not None]


def format_summary(summary: Summary, plan: Plan, labels: list[str]) -> str:
    lines = ["", "Summary"]
    predicted = summary.predicted_samples_per_second
    measured = f"  throughput  measured {summary.measured_samples_per_second:.2f} samples/s"
    if predicted:
        lines.append(f"{measured}, predicted {predicted:.2f} "
                     f"({summary.measured_samples_per_second / predicted:.2f}x the prediction)")
    else:  # a plan written by hand predicts nothing (was 'predicted nan')
        lines.append(f"{measured} (no prediction: the plan was given by hand)")
    span = (f"over {summary.steps} steps" if summary.first_step <= 1 else
            f"over steps {summary.first_step}-{summary.steps} (resumed after step "
            f"{summary.first_step - 1})")
    lines.append(f"  loss        {summary.first_loss:.4f} -> {summary.last_loss:.4f} {span}")
    if summary.validation:
        first, last = summary.validation[0], summary.validation[-1]
        trend = f"{last[1]:.4f} at step {last[0]}" if first == last else \
            f"{first[1]:.4f} (step {first[0]}) -> {last[1]:.4f} (step {last[0]})"
        lines.append(f"  validation  loss {trend} on the held-out set "
                     f"({len(summary.validation)} evaluations)")
    lines.append(f"  step time   {summary.step_seconds:.3f} s (median after the first step)")
    lines += split_history(summary, plan)
    lines.append("  per rank    compute / waiting on collectives / idle (seconds per step)")
    batches = summary.final_batch_sizes or [rp.batch_size for rp in plan.ranks]
    for r in range(plan.world_size):
        lines.append(f"    rank {r} {labels[r]:<28} batch {batches[r]:>4}  "
                     f"{summary.rank_compute_seconds[r]:.3f} / {summary.rank_wait_seconds[r]:.3f}"
                     f" / {summary.rank_idle_seconds[r]:.3f}")
    return "\n".join(lines)


def split_history(summary: Summary, plan: Plan) -> list[str]:
    """The split's changes by live rebalancing (none: one line saying it stayed)."""
    planned = [rp.batch_size for rp in plan.ranks]
    if summary.final_batch_sizes is None:
        return []
    if not summary.rebalances:
        return [f"  split       {planned} (the plan's) for the whole run: no rebalancing "
                f"predicted a gain"]
    lines = [f"  split       {planned} (the plan's), rebalanced {len(summary.rebalances)} "
             f"time(s) without a restart:"]
    for change in summary.rebalances:
        lines.append(f"    after step {change['step']:>5}: {change['from']} -> {change['to']} "
                     f"({change['micro_batches']} microbatches; the slowest rank's compute "
                     f"predicted {1 + change['predicted_gain']:.2f}x faster)")
    measured, span = summary.final_split_samples_per_second, summary.final_split_steps
    if measured is not None and span is not None:
        predicted = summary.final_split_predicted_samples_per_second
        versus = f", predicted {predicted:.2f} ({measured / predicted:.2f}x the prediction)" \
            if predicted else " (no prediction for it)"
        lines.append(f"  split in force at the end {summary.final_batch_sizes}: measured "
                     f"{measured:.2f} samples/s over steps {span[0]}-{span[1]}{versus}")
    return lines


def read_history(metrics_file: Path) -> list[dict]:
    """Every step the run has logged, over all its segments (a resumed run appends)."""
    try:
        lines = metrics_file.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def loss_figure(history: Sequence[dict]) -> Any:
    """The loss over the run's whole history (steps as whole numbers on the axis)."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in history], [r["loss"] for r in history], marker=".",
            label="training (mean over the global batch)")
    points = validation_points(history)
    if points:
        ax.plot([s for s, _ in points], [v for _, v in points], marker="o", linestyle="--",
                color="#dd8452", label="validation (held-out set)")
        ax.legend(fontsize="small")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def write_plots(history: Sequence[dict], summary: Summary, labels: list[str],
                run_dir: Path, predicted_step_seconds: float | None = None) -> list[Path]:
    """loss.png (the run's whole `history`) and time_breakdown.png (this segment's
    `summary`); nothing (and no error) without matplotlib."""
    try:
        plt = _pyplot()
    except ImportError:
        return []
    written = []
    fig = loss_figure(history)
    fig.savefig(run_dir / "loss.png", dpi=100)
    plt.close(fig)
    written.append(run_dir / "loss.png")
    fig = breakdown_figure(summary, labels, predicted_step_seconds)
    fig.savefig(run_dir / "time_breakdown.png", dpi=100)
    plt.close(fig)
    written.append(run_dir / "time_breakdown.png")
    return written


def breakdown_figure(summary: Summary, labels: list[str],
                     predicted_step_seconds: float | None = None) -> Any:
    """Each rank's median step split into compute / waiting / idle, with the plan's
    predicted step as a line; the legend in one row under the axis (constrained layout: the
    image holds no empty band, as the legend placed below by hand left a third of it)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(labels) + 1.6), layout="constrained")
    ys = list(range(len(labels)))
    left = [0.0] * len(labels)
    for name, values, color in (("compute", summary.rank_compute_seconds, "#4c72b0"),
                                ("waiting on collectives", summary.rank_wait_seconds, "#dd8452"),
                                ("idle", summary.rank_idle_seconds, "#cccccc")):
        ax.barh(ys, values, left=left, label=name, color=color)
        left = [a + b for a, b in zip(left, values, strict=True)]
    if predicted_step_seconds:
        ax.axvline(predicted_step_seconds, color="black", linestyle="--", linewidth=1,
                   label=f"predicted step {predicted_step_seconds:.3f} s")
    ax.set_yticks(ys, [f"rank {i}: {label}" for i, label in enumerate(labels)])
    ax.set_ylim(len(labels) - 0.5, -0.5)  # rank 0 on top
    ax.set_xlabel("seconds per step (median)")
    ax.set_xlim(0, max([*left, predicted_step_seconds or 0.0]) * 1.05 or 1.0)
    ax.set_title("Where each rank's step time goes")
    fig.legend(loc="outside lower center", ncol=4, fontsize="small", frameon=False)
    return fig
