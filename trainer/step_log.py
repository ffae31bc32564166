"""What the trainer reports about its steps: a `StepLogger` that, every `interval_steps`
steps (and at the last), turns a `StepResult` into throughput figures, Prometheus series,
one JSON line of the progress file (and the same record to each experiment tracker of
spec.tracking: TensorBoard scalars, an MLflow run's metrics) and a console line.

It runs no collective: every rank's timings arrive in the `StepResult`, carried by the
engine's end-of-step all-reduce (engine.py). So logging costs a rank only its own
arithmetic and I/O, and a step that is not logged costs nothing at all.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from cephalo.trainer.engine import StepResult
from cephalo.trainer.metrics import ProgressFile, TrainerMetrics


class Tracker(Protocol):
    """An experiment tracker fed rank 0's progress records (tensorboard_log, mlflow_log)."""

    def write(self, record: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Throughput:
    samples_per_second: float  # the whole job's
    tokens_per_second: float  # the whole job's
    tflops: float  # this rank's useful TFLOP/s (its own samples)


def throughput(*, step_seconds: float, global_batch_size: int, local_batch_size: int,
               tokens_per_sample: int, flops_per_sample: float) -> Throughput:
    samples_per_second = global_batch_size / step_seconds
    return Throughput(samples_per_second=samples_per_second,
                      tokens_per_second=samples_per_second * tokens_per_sample,
                      tflops=flops_per_sample * local_batch_size / step_seconds / 1e12)


def rank_timings(result: StepResult) -> list[dict[str, float | int]]:
    """Every rank's compute and collective-wait seconds of the step, as the progress file
    stores them."""
    return [{"rank": r, "compute_seconds": compute, "collective_wait_seconds": wait}
            for r, (compute, wait) in enumerate(zip(result.rank_compute_seconds,
                                                    result.rank_wait_seconds, strict=True))]


def progress_record(result: StepResult, rate: Throughput,
                    validation_loss: float | None = None,
                    batch_sizes: Sequence[int] | None = None,
                    rebalanced: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One line of the progress file (`cephalo run` and local/report.py read it);
    `validation_loss` only on the steps that measured it (trainer/eval.py); `batch_sizes`:
    the split the step ran under (with live rebalancing); `rebalanced`: the new split
    decided after it (trainer/rebalancing.decision_record)."""
    record = {"step": result.step, "loss": result.loss,
              "samples_per_second": rate.samples_per_second,
              "tokens_per_second": rate.tokens_per_second, "step_seconds": result.step_seconds,
              "learning_rate": result.learning_rate, "grad_norm": result.grad_norm,
              "tflops": rate.tflops, "time": time.time(), "ranks": rank_timings(result)}
    if validation_loss is not None:
        record["validation_loss"] = validation_loss
    if batch_sizes is not None:
        record["batch_sizes"] = list(batch_sizes)
    if rebalanced is not None:
        record["rebalanced"] = dict(rebalanced)
    if result.skipped:
        record.update(skipped=True, loss_scale=result.loss_scale)
    return record


class WaitDelta:
    """Seconds waited per collective kind since the last call, read from the engine's
    running counter without resetting it (others read the same counter)."""

    def __init__(self, totals: Mapping[str, float]) -> None:
        self._totals = totals
        self._seen: dict[str, float] = dict(totals)

    def take(self) -> dict[str, float]:
        now = dict(self._totals)
        delta = {op: seconds - self._seen.get(op, 0.0) for op, seconds in now.items()}
        self._seen = now
        return delta


class StepLogger:
    """Logs one rank's steps: `due(step)` says whether a step is logged, `log(result)` does
    it. Rank 0 alone writes the progress file and prints; every rank updates its own
    Prometheus series."""

    def __init__(self, *, rank: int, global_batch_size: int, local_batch_size: int,
                 tokens_per_sample: int, flops_per_sample: float, total_steps: int,
                 interval_steps: int = 1, progress: ProgressFile | None = None,
                 metrics: TrainerMetrics | None = None,
                 wait_seconds: Mapping[str, float] | None = None, local_rank: int = 0,
                 verbose: bool = False, trackers: Sequence[Tracker] = (),
                 batch_sizes: Sequence[int] | None = None) -> None:
        if interval_steps < 1:
            raise ValueError(f"interval_steps must be >= 1, got {interval_steps}")
        self.rank = rank
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        # The split in force (live rebalancing moves it; None: the plan's, never recorded).
        self.batch_sizes = list(batch_sizes) if batch_sizes is not None else None
        self.tokens_per_sample = tokens_per_sample
        self.flops_per_sample = flops_per_sample
        self.total_steps = total_steps
        self.interval_steps = interval_steps
        self.progress = progress if rank == 0 else None
        self.trackers = list(trackers) if rank == 0 else []
        self.metrics = metrics
        self.local_rank = local_rank
        self.verbose = verbose and rank == 0
        self._waits = WaitDelta(wait_seconds) if wait_seconds is not None else None
        self._started = False  # this process's first logged step is start-up: not timed

    def due(self, step: int, *, final: bool = False) -> bool:
        """Whether step `step` is logged: every `interval_steps`, and the run's last one."""
        return final or step % self.interval_steps == 0

    def log(self, result: StepResult, validation_loss: float | None = None,
            rebalanced: Mapping[str, Any] | None = None) -> None:
        rate = throughput(step_seconds=result.step_seconds,
                          global_batch_size=self.global_batch_size,
                          local_batch_size=self.local_batch_size,
                          tokens_per_sample=self.tokens_per_sample,
                          flops_per_sample=self.flops_per_sample)
        if self.metrics is not None:
            self.observe(result, rate, validation_loss)
        if self.progress is not None or self.trackers:
            record = progress_record(result, rate, validation_loss, self.batch_sizes,
                                     rebalanced)
            if self.progress is not None:
                self.progress.write(record)
            for tracker in self.trackers:
                tracker.write(record)
        if self.verbose:
            print(self.line(result, rate, validation_loss), flush=True)

    def observe(self, result: StepResult, rate: Throughput,
                validation_loss: float | None = None) -> None:
        """This rank's Prometheus series (collective waits since the last logged step)."""
        assert self.metrics is not None
        waits = self._waits.take() if self._waits is not None else {}
        self.metrics.observe(step=result.step, loss=result.loss,
                             step_seconds=result.step_seconds,
                             samples_per_second=rate.samples_per_second,
                             tokens_per_second=rate.tokens_per_second, tflops=rate.tflops,
                             wait_seconds_by_op=waits, local_rank=self.local_rank,
                             validation_loss=validation_loss, loss_scale=result.loss_scale,
                             skipped=result.skipped)
        if self._started:
            self.metrics.time_ranks(result.step_seconds, result.rank_compute_seconds,
                                    result.rank_wait_seconds)
        self._started = True

    def line(self, result: StepResult, rate: Throughput,
             validation_loss: float | None = None) -> str:
        validation = "" if validation_loss is None else f" val-loss {validation_loss:.4f}"
        if result.skipped:  # loss scaling: some rank's gradient overflowed
            validation += f" (skipped: gradient overflow at loss scale {result.loss_scale:g})"
        return (f"step {result.step}/{self.total_steps} loss {result.loss:.4f}{validation} "
                f"lr {result.learning_rate:.2e} grad-norm {result.grad_norm:.3f} | "
                f"{rate.samples_per_second:.1f} samples/s | step {result.step_seconds:.3f} s "
                f"(waited {result.collective_wait_seconds:.3f} s on collectives)")
