"""Sharded atomic checkpoints: resume under the same and a different plan / world size ends
with the weights of an uninterrupted run; torn checkpoints are never loaded; export gives a
plain state_dict."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from cephalo.api.job import CephaloJobSpec
from cephalo.cli import main as cli_main
from cephalo.trainer import checkpoint
from cephalo.trainer.engine import Engine, Layout
from cephalo.trainer.models import build_model
from cephalo.trainer.run import train
from cephalo.trainer.spawn import spawn_ranks
from tests.checkpoint_weights import latest_weights, max_relative

STEPS = 4


def _job(interval: int = 2, precision: str = "fp32") -> CephaloJobSpec:
    return CephaloJobSpec.model_validate({
        "model": {"preset": "llama-tiny"}, "globalBatchSize": 8, "precision": precision,
        "training": {"steps": STEPS, "learningRate": 1e-3, "weightDecay": 0.1,
                     "adamEpsilon": 1e-6, "warmupSteps": 1},
        "checkpoint": {"intervalSteps": interval, "keep": 3}})


def _train_worker(rank: int, world_size: int, layout: Layout, ckpt: str,
                  stop_after_step: int | None, interval: int) -> dict:
    outcome = train(_job(interval), layout, Path(ckpt), stop_after_step=stop_after_step,
                    verbose=False)
    return {"first": outcome.first_step, "last": outcome.last_step, "losses": outcome.losses}


UNEVEN = Layout([5, 2, 1], [1, 2, 1], [0.5, 0.3, 0.2])
OTHER = Layout([3, 5], [3, 1], [0.7, 0.3])


@pytest.mark.slow
def test_resume_same_and_other_plan_matches_uninterrupted(tmp_path: Path) -> None:
    full, first, other = tmp_path / "full", tmp_path / "first", tmp_path / "other"
    ref = spawn_ranks(_train_worker, 3, UNEVEN, str(full), None, 2)
    stopped = spawn_ranks(_train_worker, 3, UNEVEN, str(first), 2, 2)
    assert stopped[0]["last"] == 2
    assert checkpoint.find_latest(first).step == 2  # type: ignore[union-attr]
    shutil.copytree(first, other)
    same = spawn_ranks(_train_worker, 3, UNEVEN, str(first), None, 2)
    moved = spawn_ranks(_train_worker, 2, OTHER, str(other), None, 2)
    assert same[0]["first"] == 2 and moved[0]["first"] == 2
    assert same[0]["last"] == moved[0]["last"] == STEPS
    want = latest_weights(full)
    assert max_relative(latest_weights(first), want) <= 1e-6  # same plan: same arithmetic
    assert max_relative(latest_weights(other), want) <= 1e-5  # 2 ranks, other shards/batches
    assert same[0]["losses"] == pytest.approx(ref[0]["losses"][2:], rel=1e-6)
    assert moved[0]["losses"] == pytest.approx(ref[0]["losses"][2:], rel=1e-5)
    # Optimizer state came back too: Adam moments of the resumed run match.
    info_full, info_other = checkpoint.find_latest(full), checkpoint.find_latest(other)
    assert info_full is not None and info_other is not None
    a, b = checkpoint.ShardReader(info_full), checkpoint.ShardReader(info_other)
    for unit, numel in enumerate(info_full.meta["unit_numels"]):
        m_a, m_b = a.read(unit, 0, numel, "exp_avg"), b.read(unit, 0, numel, "exp_avg")
        assert float((m_a - m_b).norm() / m_a.norm()) <= 1e-5

    # Export: a plain state_dict that build_model loads strictly.
    out = tmp_path / "model.pt"
    assert cli_main(["export", str(full), "--output", str(out)]) == 0
    model = build_model(_job().model.resolve())
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want[name])


OVERFLOW_RANK, OVERFLOW_STEP = 1, 0


def _fp16_worker(rank: int, world_size: int, layout: Layout, ckpt: str,
                 stop_after_step: int | None) -> dict:
    """fp16 training with an overflow written into rank 1's gradient in the first step (the
    engine's reduce-scatter patched in this process only), so that the checkpoint of step
    2 holds a scale that is not the initial one."""
    original = Engine._reduce_scatter

    def injected(engine: Engine, u: int, grad: torch.Tensor):  # type: ignore[no-untyped-def]
        if (engine.rank, engine.step_count, u) == (OVERFLOW_RANK, OVERFLOW_STEP, 0):
            grad[0] = float("inf")
        return original(engine, u, grad)

    Engine._reduce_scatter = injected  # type: ignore[method-assign]
    outcome = train(_job(2, "fp16"), layout, Path(ckpt), stop_after_step=stop_after_step,
                    verbose=False)
    return {"first": outcome.first_step, "losses": outcome.losses}


@pytest.mark.slow
def test_fp16_resume_matches_uninterrupted_with_the_loss_scale(tmp_path: Path) -> None:
    """Kill (stop) an fp16 run after step 2, whose checkpoint holds the halved loss scale
    and its count of good steps: resumed under the same plan or another one, the run ends
    with the uninterrupted run's weights and loss scale."""
    full, first, other = tmp_path / "full", tmp_path / "first", tmp_path / "other"
    ref = spawn_ranks(_fp16_worker, 3, UNEVEN, str(full), None)
    spawn_ranks(_fp16_worker, 3, UNEVEN, str(first), 2)
    stopped = checkpoint.find_latest(first)
    assert stopped is not None and stopped.step == 2
    assert stopped.meta["loss_scale"] == {"scale": 2.0 ** 15, "growth_tracker": 1}
    shutil.copytree(first, other)
    same = spawn_ranks(_fp16_worker, 3, UNEVEN, str(first), None)
    moved = spawn_ranks(_fp16_worker, 2, OTHER, str(other), None)
    assert same[0]["first"] == moved[0]["first"] == 2
    want = latest_weights(full)
    assert max_relative(latest_weights(first), want) <= 1e-6
    assert max_relative(latest_weights(other), want) <= FP16_OTHER_PLAN_TOLERANCE
    assert same[0]["losses"] == pytest.approx(ref[0]["losses"][2:], rel=1e-6)
    for root in (full, first, other):
        info = checkpoint.find_latest(root)
        assert info is not None and info.step == STEPS
        assert info.meta["loss_scale"] == {"scale": 2.0 ** 15, "growth_tracker": 3}


# 2 ranks with other batches: fp16 products rounded at other places (measured 6.4e-6).
FP16_OTHER_PLAN_TOLERANCE = 5e-5


@pytest.mark.slow
def test_torn_checkpoints_are_skipped(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    spawn_ranks(_train_worker, 1, Layout([8], [4], [1.0]), str(root), 3, 1)
    steps = sorted(p.name for p in root.glob("step-*"))
    assert steps == ["step-00000001", "step-00000002", "step-00000003"]
    assert checkpoint.find_latest(root).step == 3  # type: ignore[union-attr]

    # Truncated shard (marker present): detected by size, step 2 is used.
    shard = root / "step-00000003" / "rank-00000.pt"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert checkpoint.find_latest(root).step == 2  # type: ignore[union-attr]
    # Same size but corrupted bytes: detected by the hash.
    shard2 = root / "step-00000002" / "rank-00000.pt"
    data = bytearray(shard2.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard2.write_bytes(bytes(data))
    assert checkpoint.find_latest(root).step == 1  # type: ignore[union-attr]
    # Missing completion marker (a crash before rank 0 finished): skipped as well.
    (root / "step-00000001" / "COMPLETE").unlink()
    assert checkpoint.find_latest(root) is None
    assert cli_main(["export", str(root), "--output", str(tmp_path / "x.pt")]) == 2


@pytest.mark.slow
def test_resume_uses_previous_complete_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    spawn_ranks(_train_worker, 1, Layout([8], [8], [1.0]), str(root), 2, 1)
    (root / "step-00000002" / "COMPLETE").unlink()  # torn newest
    resumed = spawn_ranks(_train_worker, 1, Layout([8], [8], [1.0]), str(root), 3, 1)
    assert resumed[0]["first"] == 1 and resumed[0]["last"] == 3
    assert checkpoint.find_latest(root).step == 3  # type: ignore[union-attr]
