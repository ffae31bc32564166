"""`python -m cephalo.trainer`: environment validation fails fast on every rank, and a run
killed (SIGKILL) after a checkpoint resumes to the weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from cephalo.trainer import checkpoint
from cephalo.trainer.engine import Layout
from cephalo.trainer.env import EnvError, read_env
from cephalo.trainer.run import train
from cephalo.trainer.spawn import free_port, spawn_ranks
from tests.trainer_ranks import finish, start_ranks

JOB = {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob", "metadata": {"name": "t"},
       "spec": {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 8,
                "training": {"steps": 20, "learningRate": 1e-3, "adamEpsilon": 1e-6},
                "checkpoint": {"intervalSteps": 1, "keep": 2}}}


def _plan(batches: list[int], micro: list[int], ratios: list[float], total: int = 8) -> dict:
    return {"global_batch_size": total, "world_size": len(batches), "ranks": [
        {"rank": i, "batch_size": b, "micro_batch_size": m,
         "num_micro_batches": b // m if m else 0, "shard_ratio": r}
        for i, (b, m, r) in enumerate(zip(batches, micro, ratios, strict=True))]}


def _files(tmp_path: Path, plan: dict) -> dict[str, str]:
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(JOB))
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    return {"CEPHALO_JOB": str(tmp_path / "job.yaml"), "CEPHALO_PLAN": str(tmp_path / "plan.json"),
            "CEPHALO_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}


def _env(base: dict[str, str], rank: int, world: int) -> dict[str, str]:
    return {**base, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}


def test_read_env_accepts_a_good_environment(tmp_path: Path) -> None:
    base = _files(tmp_path, _plan([5, 3], [5, 1], [0.6, 0.4]))
    env = read_env({**_env(base, 1, 2), "CEPHALO_BATCH_SIZE": "3", "CEPHALO_SHARD_RATIO": "0.4",
                    "CEPHALO_TIME_DILATION": "2.5", "CEPHALO_NUM_THREADS": "1",
                    "CEPHALO_MEMORY_LIMIT_BYTES": "1000000"})
    assert env.layout.batch_sizes == [5, 3] and env.rank == 1
    assert (env.time_dilation, env.num_threads, env.memory_limit_bytes) == (2.5, 1, 1_000_000)
    assert env.metrics_file == tmp_path / "metrics.jsonl"


@pytest.mark.parametrize(("change", "message"), [
    (lambda e: e.pop("RANK"), "missing environment variable(s) RANK"),
    (lambda e: e.update(RANK="x"), "RANK='x' is not an integer"),
    (lambda e: e.update(RANK="2"), "RANK=2 must be in [0, WORLD_SIZE=2)"),
    (lambda e: e.update(WORLD_SIZE="3"), "the plan is for 2 ranks"),
    (lambda e: e.update(CEPHALO_BATCH_SIZE="4"), "CEPHALO_BATCH_SIZE=4 but the plan"),
    (lambda e: e.update(CEPHALO_PLAN="/nonexistent.json"), "no such file"),
    (lambda e: e.update(CEPHALO_TIME_DILATION="0.5"), "must be >= 1"),
    (lambda e: e.update(CEPHALO_MEMORY_LIMIT_BYTES="lots"), "is not an integer"),
])
def test_read_env_rejects(tmp_path: Path, change, message: str) -> None:  # type: ignore[no-untyped-def]
    env = _env(_files(tmp_path, _plan([5, 3], [5, 1], [0.6, 0.4])), 0, 2)
    change(env)
    with pytest.raises(EnvError) as err:
        read_env(env)
    assert message in str(err.value)


def test_missing_token_file_is_rejected_before_training(tmp_path: Path) -> None:
    env = _env(_files(tmp_path, _plan([5, 3], [5, 1], [0.6, 0.4])), 0, 2)
    job = {**JOB, "spec": {**JOB["spec"], "data": {"tokenFile": {"path": "/nope.bin"}}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    with pytest.raises(EnvError, match=r"token file /nope.bin does not exist"):
        read_env(env)


def test_plan_batches_not_summing_to_global_batch_is_rejected(tmp_path: Path) -> None:
    env = _env(_files(tmp_path, _plan([5, 2], [5, 1], [0.6, 0.4])), 0, 2)
    with pytest.raises(EnvError, match="rank batch sizes sum to 7, not global_batch_size 8"):
        read_env(env)


@pytest.mark.slow
def test_bad_environment_fails_fast_on_every_rank(tmp_path: Path) -> None:
    # A shard-ratio list (plan ranks) of the wrong length for WORLD_SIZE=2.
    base = _files(tmp_path, _plan([4, 2, 2], [4, 2, 2], [0.5, 0.3, 0.2]))
    procs = [subprocess.Popen([sys.executable, "-m", "cephalo.trainer"],
                              env={**os.environ, **_env(base, r, 2)}, stderr=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for r in range(2)]
    try:
        for r, p in enumerate(procs):
            _, err = p.communicate(timeout=600)
            assert p.returncode == 2
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"cephalo trainer (rank {r}): error:")
            assert "the plan is for 3 ranks" in lines[0] and "WORLD_SIZE=2" in lines[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _reference_worker(rank: int, world_size: int, job: dict, layout: Layout, ckpt: str) -> int:
    from cephalo.api.job import CephaloJobSpec

    spec = CephaloJobSpec.model_validate(job["spec"])
    return train(spec, layout, Path(ckpt), verbose=False).last_step


@pytest.mark.slow
def test_sigkill_after_checkpoint_then_resume_matches_uninterrupted(tmp_path: Path) -> None:
    plan = _plan([5, 3], [1, 3], [0.35, 0.65])
    base = _files(tmp_path, plan)
    ckpt = Path(base["CEPHALO_CHECKPOINT_DIR"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Real rank processes (forked, tests/trainer_ranks.py): SIGKILL ends them as it would
    # an interpreter, and the resumed ones start from what is on disk alone.
    procs = start_ranks([{**env, **_env(base, r, 2)} for r in range(2)], tmp_path, "killed")
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            info = checkpoint.find_latest(ckpt, check_hashes=False) if ckpt.exists() else None
            if info is not None and info.step >= 3:
                break
            time.sleep(0.02)
        for p in procs:  # no warning, no final checkpoint
            p.kill()
    finally:
        finish(procs, tmp_path, "killed", timeout_seconds=30)
    killed_at = checkpoint.find_latest(ckpt)
    assert killed_at is not None and 3 <= killed_at.step < 20

    base["MASTER_PORT"] = str(free_port())
    procs = start_ranks([{**env, **_env(base, r, 2)} for r in range(2)], tmp_path, "resumed")
    outputs = finish(procs, tmp_path, "resumed")
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "resumed from" in outputs[0] and "step 20/20" in outputs[0]
    progress = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert progress[-1]["step"] == 20 and len(progress[-1]["ranks"]) == 2

    reference = tmp_path / "reference"
    layout = Layout([5, 3], [1, 3], [0.35, 0.65])
    assert spawn_ranks(_reference_worker, 2, JOB, layout, str(reference)) == [20, 20]
    got = checkpoint.full_state_dict(checkpoint.find_latest(ckpt))  # type: ignore[arg-type]
    want = checkpoint.full_state_dict(checkpoint.find_latest(reference))  # type: ignore[arg-type]
    for name, tensor in want.items():
        assert torch.allclose(got[name], tensor, rtol=1e-6, atol=1e-7), name


def test_plan_unit_shard_ratios_are_read_and_checked(tmp_path: Path) -> None:
    plan = {**_plan([5, 3], [5, 1], [0.6, 0.4]), "unit_shard_ratios": {"0": [0.5, 0.5]}}
    env = read_env(_env(_files(tmp_path, plan), 0, 2))
    assert env.layout.ratios_for(0) == [0.5, 0.5] and env.layout.ratios_for(1) == [0.6, 0.4]
    plan["unit_shard_ratios"] = {"0": [1.0]}
    with pytest.raises(EnvError, match=r"unit_shard_ratios\[0\] must hold 2"):
        read_env(_env(_files(tmp_path, plan), 0, 2))


def test_plan_precisions_are_read_and_auto_needs_them(tmp_path: Path) -> None:
    plan = _plan([5, 3], [5, 1], [0.6, 0.4])
    plan["ranks"][1]["precision"] = "fp16"
    env = read_env(_env(_files(tmp_path, plan), 0, 2))
    assert env.layout.precisions == [None, "fp16"]  # rank 0: the job's (fp32)
    base = _files(tmp_path, plan)
    job = {**JOB, "spec": {**JOB["spec"], "precision": "auto"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    with pytest.raises(EnvError, match=r"precision is auto but the plan gives no precision "
                                       r"for rank\(s\) \[0\]; re-plan"):
        read_env(_env(base, 0, 2))
    plan["ranks"][0]["precision"] = "fp8"
    with pytest.raises(EnvError, match=r"ranks.0.precision: Input should be 'fp32', 'bf16' or"):
        read_env(_env(_files(tmp_path, plan), 0, 2))


def test_plan_replica_groups_are_read_and_checked(tmp_path: Path) -> None:
    """Hybrid sharding: the groups reach the layout; groups that do not partition the world,
    and per-unit ratios that break the group invariants, are one line each."""
    plan = {**_plan([5, 3, 6, 2], [5, 1, 3, 1], [0.7, 0.3, 0.7, 0.3], total=16),
            "replica_groups": [[0, 1], [2, 3]], "unit_shard_ratios": {"1": [1, 0, 1, 0]}}
    job = {**JOB, "spec": {**JOB["spec"], "globalBatchSize": 16}}

    def read(plan: dict) -> Layout:
        base = _files(tmp_path, plan)
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
        return read_env(_env(base, 2, 4)).layout

    layout = read(plan)
    assert layout.replica_groups == [[0, 1], [2, 3]]
    assert layout.group_ratios_for(0) == [0.7, 0.3] and layout.group_ratios_for(1) == [1, 0]
    for change, message in [
        ({"replica_groups": [[0, 1], [2]]},
         "replica_groups must list every rank 0..3 exactly once, got [[0, 1], [2]]"),
        ({"replica_groups": [[0, 1, 2], [3]]},
         "replica_groups must all have the same number of ranks, got sizes [3, 1]"),
        ({"unit_shard_ratios": {"1": [0.5, 0.5, 0.4, 0.6]}},
         "unit_shard_ratios[1]: rank 2 holds 0.4 but rank 0 at the same position"),
        ({"unit_shard_ratios": {"1": [0.25, 0.25, 0.25, 0.25]}},
         "unit_shard_ratios[1] of replica group [0, 1] sum to 0.5, not 1"),
        ({"unit_shard_ratios": {"1": [1, 0]}},
         "unit_shard_ratios[1] must hold 4 non-negative ratios summing to 1 within each "
         "replica group"),
    ]:
        with pytest.raises(EnvError) as err:
            read({**plan, **change})
        assert message in str(err.value) and "\n" not in str(err.value)
