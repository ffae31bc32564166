"""Asynchronous checkpoints: training goes on while a shard uploads, the checkpoint becomes
visible only once every rank's upload is done, and it holds the state of its own step (a
snapshot, not whatever the optimizer has made of the tensors since)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from cephalo.api.job import CephaloJobSpec
from cephalo.trainer import checkpoint
from cephalo.trainer.engine import Layout
from cephalo.trainer.run import train
from cephalo.trainer.spawn import spawn_ranks

JOB = {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 4,
       "training": {"steps": 6, "learningRate": 1e-3},
       "checkpoint": {"intervalSteps": 2, "keep": 3}}
LAYOUT = Layout([3, 1], [1, 1], [0.7, 0.3])


def _worker(rank: int, world_size: int, root: str, held: bool) -> dict:
    from cephalo.trainer import checkpoint_write

    marker = Path(root) / "step-00000002" / checkpoint.MARKER
    gate = threading.Event()
    real_write = checkpoint_write._write_shard

    def held_write(*args: object) -> object:
        gate.wait()  # the upload of step 2 "takes" until the main thread lets it go
        return real_write(*args)  # type: ignore[arg-type]

    boundaries: list[tuple[int, bool]] = []

    def at_step_boundary() -> bool:  # runs on the training thread at every step boundary
        boundaries.append((len(boundaries) + 1, marker.exists()))
        if len(boundaries) == 4:
            gate.set()
        return False

    if held:
        checkpoint_write._write_shard = held_write  # type: ignore[assignment]
    else:
        gate.set()
    outcome = train(CephaloJobSpec.model_validate(JOB), LAYOUT, root, verbose=False,
                    stop_requested=at_step_boundary, async_checkpoints=held)
    return {"boundaries": boundaries, "checkpoints": outcome.checkpoints,
            "last": outcome.last_step}


@pytest.mark.slow
def test_training_continues_while_uploading_and_the_marker_waits_for_every_rank(
        tmp_path: Path) -> None:
    held = spawn_ranks(_worker, 2, str(tmp_path / "async"), True)
    sync = spawn_ranks(_worker, 2, str(tmp_path / "sync"), False)
    for result in held:
        # Step 3 was trained while step 2's shards were still held back, and step 2 was not
        # visible then; it was committed once the uploads finished.
        assert result["boundaries"][:3] == [(1, False), (2, False), (3, False)]
        assert result["last"] == 6
        assert [Path(p).name for p in result["checkpoints"]] == [
            "step-00000002", "step-00000004", "step-00000006"]
    assert sync[0]["boundaries"][2] == (3, True)  # synchronous: visible right away
    for step in (2, 4, 6):
        name = f"step-{step:08d}"
        a = checkpoint.find_latest(tmp_path / "async" / name)
        b = checkpoint.find_latest(tmp_path / "sync" / name)
        assert a is not None and b is not None and a.step == b.step == step
        got, want = checkpoint.full_state_dict(a), checkpoint.full_state_dict(b)
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor), (step, key)
        reader_a, reader_b = checkpoint.ShardReader(a), checkpoint.ShardReader(b)
        for unit, numel in enumerate(a.meta["unit_numels"]):
            assert torch.equal(reader_a.read(unit, 0, numel, "exp_avg_sq"),
                               reader_b.read(unit, 0, numel, "exp_avg_sq"))
