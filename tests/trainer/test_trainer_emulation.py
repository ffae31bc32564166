"""`cephalo run --emulate` hooks: time dilation (a slower device) and a memory limit."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cephalo.api.job import CephaloJobSpec, DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import preset
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Engine, Layout
from cephalo.trainer.run import MemoryLimitError, train
from cephalo.trainer.spawn import spawn_ranks


def _dilation_worker(rank: int, world_size: int, dilation: float) -> dict:
    sleeps: list[float] = []
    real_sleep = time.sleep
    time.sleep = lambda seconds: sleeps.append(seconds)  # type: ignore[assignment]
    try:
        config = preset("gpt-tiny")
        engine = Engine(config, TrainingSpec(steps=1), Layout([4], [2], [1.0]),
                        time_dilation=dilation)
        data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
        loss = engine.step(data.micro_batches(0, 0, 4, 2)).loss
    finally:
        time.sleep = real_sleep  # type: ignore[assignment]
    return {"sleeps": sleeps, "loss": loss}


@pytest.mark.slow
def test_time_dilation_sleeps_after_every_unit_compute_and_changes_no_numbers() -> None:
    dilated = spawn_ranks(_dilation_worker, 1, 3.0)[0]
    normal = spawn_ranks(_dilation_worker, 1, 1.0)[0]
    # forward: embedding + 2 blocks; head fused fwd+bwd per microbatch (2);
    # backward: 2 blocks + embedding, per microbatch (2 each) -> 3 + 2 + 6 = 11.
    assert len(dilated["sleeps"]) == 11 and all(s > 0 for s in dilated["sleeps"])
    assert normal["sleeps"] == []
    assert dilated["loss"] == normal["loss"]


def _memory_worker(rank: int, world_size: int, limits: list[int], root: str) -> None:
    job = CephaloJobSpec.model_validate({"model": {"preset": "gpt-tiny"}, "globalBatchSize": 4,
                                         "training": {"steps": 1}})
    try:
        train(job, Layout([2, 2], [1, 2], [0.5, 0.5]), Path(root), verbose=False,
              memory_limit_bytes=limits[rank])
    except MemoryLimitError as err:
        return str(err)  # type: ignore[return-value]
    return None


@pytest.mark.slow
def test_memory_limit_fails_every_rank_together(tmp_path: Path) -> None:
    messages = spawn_ranks(_memory_worker, 2, [1 << 40, 1 << 10], str(tmp_path))
    assert "rank 1 needs at least" in messages[1] and "memory limit is 0.0 MiB" in messages[1]
    assert messages[0] == "another rank exceeds its memory limit (see its log)"
    assert spawn_ranks(_memory_worker, 2, [1 << 40, 1 << 40], str(tmp_path)) == [None, None]
