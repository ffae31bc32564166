"""Trainer loop overhead: wall time per step spent *outside* `Engine.step` (data, logging,
metrics file, stop vote, checkpoint bookkeeping) against the step itself, on the quickstart.

Runs the real `cephalo.trainer.run.train` on 2 gloo ranks with examples/quickstart.yaml and
the layout `cephalo run` plans for it on a CPU (README: rank 0 19x1, rank 1 1x5, shards
50/50), a progress file, Prometheus metrics (no port), a stop-request callback (as `main()`
passes for SIGTERM), asynchronous interval checkpoints and a verbose rank 0 (its log goes to
a file, as under `cephalo run`). `Engine.step` is wrapped to time each call; the gap between
one call's end and the next one's start is the loop's own per-step cost.

Run: `python bench/loop_overhead.py [--steps 30 --log-interval 1]`. Target (issue 16): the
gap is at most 1 % of the median step. Checkpoint work in a gap (the snapshot every 10 steps,
the commit once the upload is done) is timed and reported apart: it is not per-step cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from cephalo.api.job import load_job

QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart.yaml"


def _worker(rank: int, world_size: int, job_path: str, steps: int, log_interval: int,
            folder: str) -> dict:
    from cephalo.trainer import engine as engine_module
    from cephalo.trainer.checkpoint_write import CheckpointWriter
    from cephalo.trainer.engine import Layout
    from cephalo.trainer.metrics import TrainerMetrics
    from cephalo.trainer.run import train

    spec = load_job(job_path).spec
    layout = Layout(batch_sizes=[19, 5], micro_batch_sizes=[19, 1], shard_ratios=[0.5, 0.5])
    # The layout's batch of 24 (the quickstart's until it went to 32 samples, issue 39).
    spec = spec.model_copy(update={"global_batch_size": sum(layout.batch_sizes),
                                   "training": spec.training.model_copy(
        update={"steps": steps, "log_interval_steps": log_interval})})
    spans: list[tuple[float, float]] = []
    original = engine_module.Engine.step

    def timed_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        began = time.perf_counter()
        result = original(self, *args, **kwargs)
        spans.append((began, time.perf_counter()))
        return result

    engine_module.Engine.step = timed_step  # type: ignore[method-assign]
    # Seconds of checkpoint saving / committing in the gap after each step (by step index):
    # a checkpoint's cost every intervalSteps, reported apart from the per-step overhead.
    checkpointing: dict[int, float] = {}

    def timed(method):  # type: ignore[no-untyped-def]
        def wrapper(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            began = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                k = len(spans) - 1
                checkpointing[k] = checkpointing.get(k, 0.0) + time.perf_counter() - began
        return wrapper

    CheckpointWriter.start = timed(CheckpointWriter.start)  # type: ignore[method-assign]
    CheckpointWriter.finish = timed(CheckpointWriter.finish)  # type: ignore[method-assign]
    stop = threading.Event()
    log = open(Path(folder) / f"rank-{rank}.log", "w", encoding="utf-8")  # noqa: SIM115
    sys.stdout = log  # the trainer's progress lines go to a log file, as under `cephalo run`
    try:
        train(spec, layout, Path(folder) / "ckpt", progress_file=Path(folder) / "metrics.jsonl",
              metrics=TrainerMetrics(rank, 0, None), local_rank=rank, verbose=True,
              stop_requested=stop.is_set)
    finally:
        sys.stdout = sys.__stdout__
        log.close()
    return {"spans": spans, "checkpointing": checkpointing}


def summarise(results: list[dict]) -> dict[str, float]:
    """Per step: the slowest rank's gap before the next step without checkpoint work, the
    checkpoint work apart, and the step time."""
    gaps: list[float] = []
    checkpoint_seconds: list[float] = []
    steps: list[float] = []
    spans = [r["spans"] for r in results]
    for k in range(1, len(spans[0]) - 1):  # step 1 warms up (allocator, first collectives)
        saving = [r["checkpointing"].get(k, 0.0) for r in results]
        gaps.append(max(s[k + 1][0] - s[k][1] - c for s, c in zip(spans, saving, strict=True)))
        if max(saving) > 0:
            checkpoint_seconds.append(max(saving))
        steps.append(max(s[k][1] - s[k][0] for s in spans))
    median_gap, median_step = statistics.median(gaps), statistics.median(steps)
    return {"median_gap_ms": 1e3 * median_gap, "mean_gap_ms": 1e3 * statistics.mean(gaps),
            "p90_gap_ms": 1e3 * _quantile(gaps, 0.9), "max_gap_ms": 1e3 * max(gaps),
            "median_step_ms": 1e3 * median_step,
            "overhead_percent": 100 * median_gap / median_step,
            "mean_overhead_percent": 100 * statistics.mean(gaps) / median_step,
            "checkpoint_ms": 1e3 * statistics.median(checkpoint_seconds)
            if checkpoint_seconds else 0.0, "steps": len(steps)}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    from cephalo.trainer.spawn import spawn_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job", default=str(QUICKSTART))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--log-interval", type=int, default=1,
                        help="training.logIntervalSteps (the quickstart's default is 1)")
    parser.add_argument("--show-gaps", action="store_true",
                        help="also print every rank's gap after each step, in ms")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cephalo-loop-") as folder:
        results = spawn_ranks(_worker, 2, args.job, args.steps, args.log_interval, folder,
                            timeout_seconds=600)
    s = summarise(results)
    if args.show_gaps:
        for rank, r in enumerate(results):
            spans = r["spans"]
            print(f"rank {rank} gaps ms:", " ".join(
                f"{1e3 * (spans[k + 1][0] - spans[k][1]):.1f}" for k in range(len(spans) - 1)))
    print(f"quickstart loop, 2 gloo ranks, {s['steps']:.0f} timed steps, log interval "
          f"{args.log_interval}: outside the step (checkpoint work apart) median "
          f"{s['median_gap_ms']:.2f} ms, mean {s['mean_gap_ms']:.2f} (p90 {s['p90_gap_ms']:.2f}, "
          f"max {s['max_gap_ms']:.2f}); step median {s['median_step_ms']:.1f} ms -> overhead "
          f"{s['overhead_percent']:.2f} % of a step (mean {s['mean_overhead_percent']:.2f} %); "
          f"checkpoint save/commit median {s['checkpoint_ms']:.1f} ms where one happened")


if __name__ == "__main__":
    main()
