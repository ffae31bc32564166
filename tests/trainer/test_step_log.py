"""The training loop runs no collective of its own between steps: logs, the progress file
and the SIGTERM stop vote ride on the engine's end-of-step all-reduce; steps are logged
every `logIntervalSteps` and at the last (issue 16 item 2, issue 17 "a step logger").

Real gloo ranks; every `torch.distributed` collective is counted where it is issued."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from prometheus_client import generate_latest

from cephalo.api.job import CephaloJobSpec
from cephalo.trainer import checkpoint
from cephalo.trainer.engine import Layout, StepResult
from cephalo.trainer.spawn import spawn_ranks
from cephalo.trainer.step_log import StepLogger, throughput

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
               "broadcast", "broadcast_object_list", "barrier", "gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "scatter_object_list")
LAYOUT = Layout(batch_sizes=[3, 1], micro_batch_sizes=[1, 1], shard_ratios=[0.6, 0.4])


def _job(steps: int, log_interval: int) -> CephaloJobSpec:
    return CephaloJobSpec.model_validate({
        "model": {"preset": "gpt-tiny"}, "globalBatchSize": 4,
        "training": {"steps": steps, "learningRate": 1e-3, "logIntervalSteps": log_interval},
        "checkpoint": {"intervalSteps": 1000, "keep": 2}})


def _worker(rank: int, world_size: int, folder: str, steps: int, log_interval: int,
            stop_on_call: int | None) -> dict:
    """Train, counting each collective issued outside `Engine.step` by the number of steps
    done when it was issued."""
    from cephalo.trainer import engine as engine_module
    from cephalo.trainer.metrics import TrainerMetrics
    from cephalo.trainer.run import train

    steps_done = [0]
    inside = [False]
    outside: list[tuple[str, int]] = []
    original_step = engine_module.Engine.step

    def step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        inside[0] = True
        try:
            return original_step(self, *args, **kwargs)
        finally:
            inside[0] = False
            steps_done[0] += 1

    def counting(name: str):  # type: ignore[no-untyped-def]
        issue = getattr(dist, name)

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            if not inside[0]:
                outside.append((name, steps_done[0]))
            return issue(*args, **kwargs)
        return counted

    engine_module.Engine.step = step  # type: ignore[method-assign]
    for name in COLLECTIVES:
        setattr(dist, name, counting(name))

    calls = [0]

    def stop_requested() -> bool:  # asked once per step; only rank 1 ever wants to stop
        calls[0] += 1
        return rank == 1 and stop_on_call is not None and calls[0] >= stop_on_call

    metrics = TrainerMetrics(rank, 0, None)
    outcome = train(_job(steps, log_interval), LAYOUT, Path(folder) / "ckpt",
                    progress_file=Path(folder) / "metrics.jsonl", metrics=metrics,
                    local_rank=rank, verbose=rank == 0, stop_requested=stop_requested)
    return {"last": outcome.last_step, "stopped": outcome.stopped_by_signal,
            "outside": outside, "prometheus": generate_latest(metrics.registry).decode()}


def _progress(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_stop_vote_rides_on_the_step_and_all_ranks_stop_at_the_same_step(tmp_path: Path
                                                                         ) -> None:
    results = spawn_ranks(_worker, 2, str(tmp_path), 50, 1, 3, timeout_seconds=120)
    # Rank 1 alone asked, in step 3's all-reduce: both ranks stop after step 3.
    assert [(r["last"], r["stopped"]) for r in results] == [(3, True), (3, True)]
    info = checkpoint.find_latest(tmp_path / "ckpt")
    assert info is not None and info.step == 3
    for r in results:
        # Collectives outside the steps: setup before step 1 (shared-storage check, resume
        # point, group creation) and the stop's checkpoint after step 3; none in between.
        assert {done for _, done in r["outside"]} <= {0, 3}, r["outside"]
        assert any(done == 3 for _, done in r["outside"])  # the checkpoint did agree
    progress = _progress(tmp_path)
    assert [p["step"] for p in progress] == [1, 2, 3]  # interval 1, and the stop step
    for p in progress:
        assert [t["rank"] for t in p["ranks"]] == [0, 1]
        assert all(t["compute_seconds"] > 0 and t["collective_wait_seconds"] >= 0
                   for t in p["ranks"])
        assert p["samples_per_second"] == pytest.approx(4 / p["step_seconds"])


@pytest.mark.slow
def test_logs_every_interval_and_the_last_step(tmp_path: Path) -> None:
    results = spawn_ranks(_worker, 2, str(tmp_path), 7, 3, None, timeout_seconds=120)
    assert [(r["last"], r["stopped"]) for r in results] == [(7, False), (7, False)]
    assert [p["step"] for p in _progress(tmp_path)] == [3, 6, 7]
    for rank, r in enumerate(results):
        assert {done for _, done in r["outside"]} <= {0, 7}, r["outside"]  # final checkpoint
        text = r["prometheus"]
        assert f'cephalo_step{{rank="{rank}"}} 7.0' in text
        assert f'cephalo_step_seconds_count{{rank="{rank}"}} 3.0' in text  # 3 logged steps
        assert f'cephalo_collective_wait_seconds_total{{op="all_gather",rank="{rank}"}}' in text


def test_step_logger_is_keyword_only_and_rejects_a_zero_interval() -> None:
    with pytest.raises(TypeError):
        StepLogger(0, 4, 4, 32, 1.0, 10)  # type: ignore[misc]
    with pytest.raises(ValueError, match="interval_steps"):
        StepLogger(rank=0, global_batch_size=4, local_batch_size=4, tokens_per_sample=32,
                   flops_per_sample=1.0, total_steps=10, interval_steps=0)
    logger = StepLogger(rank=0, global_batch_size=4, local_batch_size=1, tokens_per_sample=32,
                        flops_per_sample=3e12, total_steps=10, interval_steps=4)
    assert [s for s in range(1, 11) if logger.due(s, final=s == 10)] == [4, 8, 10]
    rate = throughput(step_seconds=0.5, global_batch_size=4, local_batch_size=1,
                      tokens_per_sample=32, flops_per_sample=3e12)
    assert (rate.samples_per_second, rate.tokens_per_second, rate.tflops) == (8.0, 256.0, 6.0)
    result = StepResult(step=4, loss=2.0, grad_norm=1.0, learning_rate=1e-3, step_seconds=0.5,
                        collective_wait_seconds=0.1, rank_compute_seconds=[0.4],
                        rank_wait_seconds=[0.1])
    assert "step 4/10 loss 2.0000" in logger.line(result, rate)
