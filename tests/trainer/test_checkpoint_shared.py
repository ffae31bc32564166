"""Checkpoints need one storage that every rank sees. Ranks that each get their own folder
(an emptyDir per pod) must all stop with one clear message before training, not die with a
FileNotFoundError on rank >= 1 at the first checkpoint (issue 13)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cephalo.api.job import CephaloJobSpec
from cephalo.trainer.engine import Layout
from cephalo.trainer.run import train
from cephalo.trainer.spawn import spawn_ranks

JOB = {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 4,
       "training": {"steps": 2, "learningRate": 1e-3},
       "checkpoint": {"intervalSteps": 1, "keep": 2}}


def _own_folder_worker(rank: int, world_size: int, base: str) -> str:
    from cephalo.trainer.storage import CheckpointError

    root = Path(base) / f"node-{rank}" / "checkpoints"  # nothing shared between ranks
    try:
        train(CephaloJobSpec.model_validate(JOB), Layout([2, 2], [1, 1], [0.5, 0.5]), root,
              verbose=False)
    except CheckpointError as err:
        return str(err)
    return "trained"


@pytest.mark.slow
def test_ranks_without_a_shared_folder_stop_with_one_clear_message(tmp_path: Path) -> None:
    messages = spawn_ranks(_own_folder_worker, 2, str(tmp_path))
    for rank, message in enumerate(messages):
        assert message != "trained", rank
        assert "\n" not in message
        assert "rank 1" in message and "not shared" in message, message
        assert "ReadWriteMany" in message and "s3://" in message, message
    # Nothing was trained, so no checkpoint appeared anywhere.
    assert not list(tmp_path.rglob("COMPLETE"))


def _no_target_worker(rank: int, world_size: int, target: str | None, cwd: str) -> dict:
    import os

    os.chdir(cwd)  # a "" path must not turn into the current folder
    outcome = train(CephaloJobSpec.model_validate(JOB), Layout([2, 2], [1, 1], [0.5, 0.5]),
                    target, verbose=False)
    return {"first": outcome.first_step, "last": outcome.last_step,
            "checkpoints": outcome.checkpoints}


@pytest.mark.slow
@pytest.mark.parametrize("target", [None, "", "  "])
def test_no_checkpoint_target_trains_without_saving_or_resuming(
        tmp_path: Path, target: str | None) -> None:
    results = spawn_ranks(_no_target_worker, 2, target, str(tmp_path))
    assert results == [{"first": 0, "last": 2, "checkpoints": []}] * 2
    assert not list(tmp_path.iterdir())


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    import json

    import yaml

    (tmp_path / "job.yaml").write_text(yaml.safe_dump(
        {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob", "metadata": {"name": "t"},
         "spec": JOB}))
    (tmp_path / "plan.json").write_text(json.dumps(
        {"global_batch_size": 4, "world_size": 1, "ranks": [
            {"rank": 0, "batch_size": 4, "micro_batch_size": 4, "num_micro_batches": 1,
             "shard_ratio": 1.0}]}))
    return {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
            "CEPHALO_JOB": str(tmp_path / "job.yaml"),
            "CEPHALO_PLAN": str(tmp_path / "plan.json"), **extra}


def test_env_checkpoint_target_is_optional_and_may_be_a_url(tmp_path: Path) -> None:
    from cephalo.trainer.env import EnvError, read_env

    none = read_env(_env(tmp_path))
    assert none.checkpoint_dir is None and none.metrics_file is None
    assert read_env(_env(tmp_path, CEPHALO_CHECKPOINT_DIR="")).checkpoint_dir is None
    url = read_env(_env(tmp_path, CEPHALO_CHECKPOINT_DIR="s3://bucket/p/ns/job"))
    assert url.checkpoint_dir == "s3://bucket/p/ns/job" and url.metrics_file is None
    local = read_env(_env(tmp_path, CEPHALO_CHECKPOINT_DIR=str(tmp_path / "ckpt")))
    assert local.metrics_file == tmp_path / "metrics.jsonl"
    explicit = read_env(_env(tmp_path, CEPHALO_CHECKPOINT_DIR="s3://b/j",
                             CEPHALO_METRICS_FILE=str(tmp_path / "m.jsonl")))
    assert explicit.metrics_file == tmp_path / "m.jsonl"
    assert read_env(_env(tmp_path)).timeout_seconds == 600
    with pytest.raises(EnvError, match="CEPHALO_COLLECTIVE_TIMEOUT_SECONDS='soon' is not"):
        read_env(_env(tmp_path, CEPHALO_COLLECTIVE_TIMEOUT_SECONDS="soon"))
    for bad in ("0", "-5", "nan", "inf"):
        with pytest.raises(EnvError, match="must be a number of seconds > 0"):
            read_env(_env(tmp_path, CEPHALO_COLLECTIVE_TIMEOUT_SECONDS=bad))


def _disk_full_worker(rank: int, world_size: int, root: str) -> str:
    import errno

    import torch

    calls = [0]
    real_save = torch.save

    def filling_save(obj: object, f: object, *args: object, **kwargs: object) -> None:
        calls[0] += 1
        if rank == 1 and calls[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f, *args, **kwargs)  # type: ignore[arg-type]

    torch.save = filling_save  # type: ignore[assignment]
    from cephalo.trainer.storage import CheckpointError

    try:
        train(CephaloJobSpec.model_validate(JOB), Layout([2, 2], [1, 1], [0.5, 0.5]), root,
              verbose=False)
    except CheckpointError as err:
        return str(err)
    return "trained"


@pytest.mark.slow
def test_a_failed_write_on_one_rank_is_the_same_root_cause_on_every_rank(tmp_path: Path
                                                                         ) -> None:
    messages = spawn_ranks(_disk_full_worker, 2, str(tmp_path / "ckpt"))
    shard = tmp_path / "ckpt" / "step-00000002" / "rank-00001.pt"
    assert messages[0] == messages[1]
    assert messages[0] == (f"checkpoint at step 2 failed: rank 1 could not write {shard}: "
                           f"OSError: [Errno 28] No space left on device (the volume is "
                           f"full: free space, use a bigger volume or lower checkpoint.keep)")
    assert not (shard.parent / "COMPLETE").exists()
    assert (tmp_path / "ckpt" / "step-00000001" / "COMPLETE").exists()
    assert not list((tmp_path / "ckpt").glob(".cephalo-probe*"))  # the start-up probe


def test_env_rejects_an_unusable_storage_url_before_the_process_group(tmp_path: Path) -> None:
    from cephalo.trainer.env import EnvError, read_env

    with pytest.raises(EnvError, match=r"CEPHALO_CHECKPOINT_DIR=nope://b/j: unknown storage "
                                       r"scheme nope://; use a shared folder or s3://"):
        read_env(_env(tmp_path, CEPHALO_CHECKPOINT_DIR="nope://b/j"))
