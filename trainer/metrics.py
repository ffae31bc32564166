"""Trainer metrics: Prometheus on every rank, a JSON-lines progress file from rank 0.

The JSONL file (one object per logged step: step, loss, samples_per_second,
tokens_per_second, step_seconds, learning_rate, grad_norm, tflops, per-rank
compute / collective-wait seconds, validation_loss on the steps that evaluated, and
skipped + loss_scale on a step an fp16 overflow skipped) is what
`cephalo run` reads to show progress.

Rank 0 also shows the split of the global batch in force (live rebalancing,
docs/rebalancing.md): each rank's batch and microbatch count, how often this gang changed it,
and after which step and why it last did. Its timing sums restart at each change, so they are
always the figures of one split: re-planning calibrates from them (the compute it measures
belongs to the split in force, not the plan's).

Rank r serves Prometheus on CEPHALO_METRICS_PORT + LOCAL_RANK: one rank per pod (LOCAL_RANK
0) keeps the configured port, several local ranks on one machine do not collide; on
CEPHALO_METRICS_ADDRESS if set (else every interface). In a pod, `cephalo_trainer_info`
names the pod (CEPHALO_POD_UID), so the operator's scrape can tell its rank 0's page from
another pod's at the same address.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from cephalo.api.replan import MAX_TIMED_RANKS
from cephalo.api.status import FinalProgress, FinalSplit

# Rank 0's final message (FinalProgress) is a termination message, at most 4 KiB: the split
# in force goes in while it takes at most 3 KiB, its reason cut to FINAL_REASON_CHARS.
FINAL_SPLIT_BYTES = 3072
FINAL_REASON_CHARS = 512
STEP_BUCKETS_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
# Rank 0 exports every rank's compute / collective-wait split (the operator's re-planning
# reads it, docs/replanning.md) for gangs of at most MAX_TIMED_RANKS ranks: two series per
# rank, so the page stays far below the operator's 1 MiB scrape limit.


@functools.cache
def _nvml_handle(cuda_index: int) -> Any:
    """NVML's handle of the GPU torch calls cuda:<cuda_index> (this rank's LOCAL_RANK), or
    None without a GPU/driver; initialised once per process (nvmlInit on every logged step
    costs more than the rest of the logging). Found by UUID / PCI bus id, not NVML's index
    (nvml_device: NVML ignores CUDA_VISIBLE_DEVICES)."""
    try:
        import pynvml
    except ImportError:
        return None
    import torch

    if not torch.cuda.is_available() or not 0 <= cuda_index < torch.cuda.device_count():
        return None
    from cephalo.trainer.nvml_device import nvml_handle

    try:
        pynvml.nvmlInit()
        return nvml_handle(pynvml, torch.cuda.get_device_properties(cuda_index))
    except pynvml.NVMLError:
        return None


def gpu_memory_bytes(cuda_index: int) -> tuple[int, int] | None:
    """(used, capacity) of the GPU torch calls cuda:<cuda_index> via NVML, or None without
    a GPU/driver."""
    handle = _nvml_handle(cuda_index)
    if handle is None:
        return None
    import pynvml

    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.used), int(info.total)
    except pynvml.NVMLError:
        return None


class TrainerMetrics:
    def __init__(self, rank: int, port: int, predicted_step_seconds: float | None,
                 pod_uid: str | None = None, address: str = "") -> None:
        self.rank = rank
        self.registry = CollectorRegistry()
        labels = {"rank": str(rank)}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["rank"], registry=r)

        self.step_seconds = Histogram("cephalo_step_seconds", "Optimizer step wall time",
                                      ["rank"], buckets=STEP_BUCKETS_SECONDS, registry=r)
        self.step = gauge("cephalo_step", "Optimizer steps done")
        self.loss = gauge("cephalo_loss", "Mean loss over the global batch")
        # Absent until the first evaluation (training.evalIntervalSteps), then the latest.
        self.validation_loss = gauge("cephalo_validation_loss",
                                     "Mean loss over the held-out validation set")
        self.samples_per_second = gauge("cephalo_samples_per_second", "Global samples/s")
        self.tokens_per_second = gauge("cephalo_tokens_per_second", "Global tokens/s")
        self.tflops = gauge("cephalo_achieved_tflops", "This rank's useful TFLOP/s")
        self.memory_used = gauge("cephalo_memory_used_bytes", "GPU memory used")
        self.memory_capacity = gauge("cephalo_memory_capacity_bytes", "GPU memory capacity")
        self.predicted = gauge("cephalo_predicted_step_seconds", "The plan's predicted step time")
        self.loss_scale = gauge("cephalo_loss_scale",
                                "The job's fp16 loss scale (1: no rank computes in fp16)")
        self.skipped_steps = Counter(
            "cephalo_skipped_steps", "Steps no rank applied: a gradient overflowed under fp16",
            ["rank"], registry=r)
        self.collective_seconds = Counter(
            "cephalo_collective_wait_seconds", "Seconds compute waited on collectives",
            ["rank", "op"], registry=r)
        self.labels = labels
        # Rank 0: sums over the logged steps of this process but its first (start-up), of
        # the step time and of every rank's compute and waiting; means are sum / steps.
        self.timed_steps = self.timed_step_seconds = None
        self.rank_compute = self.rank_wait = None
        if rank == 0:
            self.timed_steps = Counter("cephalo_timed_steps", "Steps in the timing sums",
                                       ["rank"], registry=r)
            self.timed_step_seconds = Counter(
                "cephalo_timed_step_seconds", "Step wall time, summed over the timed steps",
                ["rank"], registry=r)
            self.rank_compute = Counter(
                "cephalo_rank_compute_seconds", "Each rank's compute over the timed steps "
                "(up to the end-of-step all-reduce)", ["rank", "of_rank"], registry=r)
            self.rank_wait = Counter(
                "cephalo_rank_wait_seconds", "Each rank's waiting on collectives over the "
                "timed steps", ["rank", "of_rank"], registry=r)
        # Rank 0: the split in force (set by `show_split`; per-rank series up to
        # MAX_TIMED_RANKS ranks, as the timing sums).
        self.split_batch = self.split_micro_batches = self.split_changes = None
        self.split_last_change = self.split_held = None
        self.split: FinalSplit | None = None  # the same figures, for the final message
        if rank == 0:
            self.split_batch = Gauge(
                "cephalo_split_batch_size", "Samples each rank takes of the global batch "
                "under the split in force", ["rank", "of_rank"], registry=r)
            self.split_micro_batches = Gauge(
                "cephalo_split_micro_batches", "Each rank's microbatches per step under the "
                "split in force", ["rank", "of_rank"], registry=r)
            self.split_changes = Counter(
                "cephalo_split_changes", "Changes of the split by live rebalancing in this "
                "gang", ["rank"], registry=r)
            self.split_changes.labels(**labels)  # 0 from the start: "none yet" reads as 0
            self.split_last_change = Gauge(
                "cephalo_split_last_change_step", "The step after which live rebalancing "
                "last changed the split (no series: never in this gang); `reason` says why",
                ["rank", "reason"], registry=r)
            self.split_held = Gauge(
                "cephalo_split_held_step", "The decision (step) at which memory last kept "
                "the split short of the one the ranks' speeds want (no series: it does not "
                "now); `reason` says which rank needs how many samples", ["rank", "reason"],
                registry=r)
        if pod_uid:  # whose page this is: the operator checks it against the pod it scrapes
            Gauge("cephalo_trainer_info", "The pod serving this page (always 1)",
                  ["rank", "pod_uid"], registry=r).labels(**labels, pod_uid=pod_uid).set(1)
        if predicted_step_seconds is not None:
            self.predicted.labels(**labels).set(predicted_step_seconds)
        self.port = port
        if port:
            try:
                start_http_server(port, addr=address or "0.0.0.0", registry=r)
            except OSError as err:  # metrics are not worth killing a training run for
                print(f"cephalo trainer (rank {rank}): warning: metrics port "
                      f"{address + ':' if address else ''}{port}: {err}; "
                      f"serving no metrics", file=sys.stderr, flush=True)
                self.port = 0

    def time_ranks(self, step_seconds: float, compute_seconds: list[float],
                   wait_seconds: list[float]) -> None:
        """Add one step to rank 0's timing sums (every rank's split; none past
        MAX_TIMED_RANKS ranks)."""
        if self.timed_steps is None or not compute_seconds or \
                len(compute_seconds) > MAX_TIMED_RANKS:
            return
        assert self.timed_step_seconds is not None and self.rank_compute is not None
        assert self.rank_wait is not None
        lb = self.labels
        self.timed_steps.labels(**lb).inc()
        self.timed_step_seconds.labels(**lb).inc(max(0.0, step_seconds))
        for r, (compute, wait) in enumerate(zip(compute_seconds, wait_seconds, strict=True)):
            self.rank_compute.labels(rank=lb["rank"], of_rank=str(r)).inc(max(0.0, compute))
            self.rank_wait.labels(rank=lb["rank"], of_rank=str(r)).inc(max(0.0, wait))

    def show_split(self, batch_sizes: Sequence[int], micro_batches: Sequence[int],
                   changed_after_step: int | None = None, reason: str = "") -> None:
        """Rank 0: the split in force from now. With `changed_after_step`, live rebalancing
        has just changed it: the change is counted and the timing sums start afresh, so that
        they never mix the steps of two splits."""
        if self.split_batch is None or len(batch_sizes) > MAX_TIMED_RANKS:
            return
        assert self.split_micro_batches is not None and self.split_changes is not None
        assert self.split_last_change is not None
        before = self.split
        self.split = FinalSplit(
            batch_sizes=list(batch_sizes), micro_batches=list(micro_batches),
            changes=(before.changes if before else 0) + (changed_after_step is not None),
            last_change_step=changed_after_step if changed_after_step is not None
            else before.last_change_step if before else None,
            last_change_reason=reason[:FINAL_REASON_CHARS] if changed_after_step is not None
            else before.last_change_reason if before else None)
        lb = self.labels
        for r, (b, count) in enumerate(zip(batch_sizes, micro_batches, strict=True)):
            self.split_batch.labels(rank=lb["rank"], of_rank=str(r)).set(b)
            self.split_micro_batches.labels(rank=lb["rank"], of_rank=str(r)).set(count)
        if changed_after_step is None:
            return
        self.split_changes.labels(**lb).inc()
        self.split_last_change.clear()  # one series: the last change's reason
        self.split_last_change.labels(rank=lb["rank"], reason=reason).set(changed_after_step)
        for counter in (self.timed_steps, self.timed_step_seconds, self.rank_compute,
                        self.rank_wait):
            if counter is not None:
                counter.clear()  # a counter reset, as a restarted process's: rate() copes

    def show_held(self, step: int | None, reason: str) -> None:
        """Rank 0: memory keeps the split short of the one wanted since decision `step`,
        for `reason` (cephalo.planner.feedback.rebalance.Hold); None: it does not (no series)."""
        if self.split_held is None:
            return
        self.split_held.clear()  # one series: the latest reason
        if step is not None:
            self.split_held.labels(rank=self.labels["rank"],
                                   reason=reason[:FINAL_REASON_CHARS]).set(step)

    def observe(self, *, step: int, loss: float, step_seconds: float, samples_per_second: float,
                tokens_per_second: float, tflops: float, wait_seconds_by_op: dict[str, float],
                local_rank: int, validation_loss: float | None = None,
                loss_scale: float = 1.0, skipped: bool = False) -> None:
        lb = self.labels
        self.loss_scale.labels(**lb).set(loss_scale)
        if skipped:  # every skipped step is logged (run.py), so the count is whole
            self.skipped_steps.labels(**lb).inc()
        if validation_loss is not None:
            self.validation_loss.labels(**lb).set(validation_loss)
        self.step_seconds.labels(**lb).observe(step_seconds)
        self.step.labels(**lb).set(step)
        self.loss.labels(**lb).set(loss)
        self.samples_per_second.labels(**lb).set(samples_per_second)
        self.tokens_per_second.labels(**lb).set(tokens_per_second)
        self.tflops.labels(**lb).set(tflops)
        for op, seconds in wait_seconds_by_op.items():
            if seconds > 0:
                self.collective_seconds.labels(rank=lb["rank"], op=op).inc(seconds)
        memory = gpu_memory_bytes(local_rank)
        if memory is not None:
            self.memory_used.labels(**lb).set(memory[0])
            self.memory_capacity.labels(**lb).set(memory[1])


    def final_progress(self, last_step: int) -> FinalProgress:
        """What rank 0 leaves when it completes at `last_step` (its termination message):
        the figures its /metrics page shows for that step, non-finite ones left out; only
        the step when it logged none there (it resumed from a checkpoint of its last step)."""
        def value(name: str) -> float | None:
            found = self.registry.get_sample_value(name, self.labels)
            return found if found is not None and math.isfinite(found) else None

        # The split in force, where the message stays within the kubelet's 4 KiB with it.
        split = self.split if self.split is not None and \
            len(self.split.model_dump_json()) <= FINAL_SPLIT_BYTES else None
        if value("cephalo_step") != last_step:
            return FinalProgress(step=last_step, rebalance=split)
        return FinalProgress(step=last_step, loss=value("cephalo_loss"),
                             samples_per_second=value("cephalo_samples_per_second"),
                             validation_loss=value("cephalo_validation_loss"),
                             rebalance=split)


def write_final_progress(path: str, progress: FinalProgress) -> None:
    """Rank 0's termination message (CEPHALO_TERMINATION_LOG). Best effort: a message that
    cannot be written costs the operator only the final figures, not the job."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(progress.model_dump_json(by_alias=True, exclude_none=True))
    except OSError as err:
        print(f"cephalo trainer: warning: cannot write the final progress to {path}: "
              f"{err.strerror or err}", file=sys.stderr, flush=True)


class ProgressFile:
    """Appends one JSON object per logged step (rank 0 only). Each line is flushed to the
    OS, so `cephalo run` reading the file sees it at once and a crashed trainer loses
    nothing; it is fsynced only on close (an fsync per step would pay for surviving a
    machine crash, which loses the run anyway)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
