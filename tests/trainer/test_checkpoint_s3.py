"""Checkpoints on object storage, against a real S3-compatible server (moto in server mode,
over HTTP, with IAM authentication enforced) started here: save and resume under another
world size, pruning, a rank killed mid-upload (torn checkpoint skipped), bad credentials and
a missing bucket (one clear line on every rank), export from a URL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("s3fs")
boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: moto_s3

from moto_s3 import moto_server  # noqa: E402

from cephalo.api.job import CephaloJobSpec  # noqa: E402
from cephalo.cli import main as cli_main  # noqa: E402
from cephalo.trainer import checkpoint  # noqa: E402
from cephalo.trainer.engine import Layout  # noqa: E402
from cephalo.trainer.models import build_model  # noqa: E402
from cephalo.trainer.spawn import free_port, spawn_ranks  # noqa: E402
from cephalo.trainer.storage import Store  # noqa: E402

# Ranks import their function's module: this one imports no boto3 (rank_workers.py).
from tests.rank_workers import train_on_object_storage as _worker  # noqa: E402

BUCKET = "checkpoints"
STEPS = 4
JOB = {"model": {"preset": "llama-tiny"}, "globalBatchSize": 6,
       "training": {"steps": STEPS, "learningRate": 1e-3, "adamEpsilon": 1e-6},
       "checkpoint": {"intervalSteps": 1, "keep": 2}}
TWO = Layout([4, 2], [2, 1], [0.6, 0.4])
THREE = Layout([1, 2, 3], [1, 2, 3], [0.2, 0.3, 0.5])


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    """A moto S3 server that checks signatures: the first requests (creating the user, its
    key and policy) run unauthenticated, every later one needs the user's key."""
    with moto_server({"INITIAL_NO_AUTH_ACTION_COUNT": "3"}) as url:
        boot = {"endpoint_url": url, "region_name": "us-east-1",
                "aws_access_key_id": "bootstrap", "aws_secret_access_key": "bootstrap"}
        iam = boto3.client("iam", **boot)
        iam.create_user(UserName="trainer")
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps(
            {"Version": "2012-10-17",
             "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
               "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
               "AWS_DEFAULT_REGION": "us-east-1"}
        boto3.client("s3", **{**boot, "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
                              "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"]}
                     ).create_bucket(Bucket=BUCKET)
        yield env


@pytest.fixture
def s3_env(s3: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for name, value in s3.items():
        monkeypatch.setenv(name, value)
    return s3


def _complete_steps(url: str) -> list[int]:
    store = Store(url)
    return [int(n.split("-")[1]) for n in store.folders("step-")
            if store.exists(f"{n}/{checkpoint.MARKER}")]


@pytest.mark.slow
def test_save_on_two_ranks_resume_on_three_prunes_and_exports(s3_env: dict[str, str],
                                                              tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/resume/team-a/job"
    first = spawn_ranks(_worker, 2, s3_env, JOB, TWO, url, 2)
    assert first[0]["last"] == 2 and first[0]["checkpoints"] == [f"{url}/step-00000001",
                                                                 f"{url}/step-00000002"]
    assert _complete_steps(url) == [1, 2]
    resumed = spawn_ranks(_worker, 3, s3_env, JOB, THREE, url, None)
    assert [r["first"] for r in resumed] == [2, 2, 2] and resumed[0]["last"] == STEPS
    assert _complete_steps(url) == [3, 4]  # keep: 2, older ones pruned from the bucket
    assert not [n for n in Store(url).folders("") if n.startswith(".cephalo-probe")]

    reference = spawn_ranks(_worker, 2, s3_env, JOB, TWO, str(tmp_path / "reference"), None)
    assert resumed[0]["losses"] == pytest.approx(reference[0]["losses"][2:], rel=1e-5)
    info = checkpoint.find_latest(url)
    assert info is not None and info.step == STEPS and info.meta["world_size"] == 3
    want = checkpoint.full_state_dict(checkpoint.find_latest(tmp_path / "reference"))  # type: ignore[arg-type]
    got = checkpoint.full_state_dict(info)
    for name, tensor in want.items():
        assert torch.allclose(got[name], tensor, rtol=1e-5, atol=1e-6), name

    out = tmp_path / "model.pt"
    assert cli_main(["export", url, "--output", str(out)]) == 0
    model = build_model(CephaloJobSpec.model_validate(JOB).model.resolve())
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)


@pytest.mark.slow
def test_rank_killed_mid_upload_leaves_a_torn_checkpoint_that_is_skipped(
        s3_env: dict[str, str]) -> None:
    url = f"s3://{BUCKET}/killed/team-a/job"
    with pytest.raises(RuntimeError):  # rank 1 dies in its third checkpoint write
        spawn_ranks(_worker, 2, s3_env, JOB, TWO, url, None, 3)
    store = Store(url)
    assert _complete_steps(url) == [1, 2]
    assert store.folders("step-") == ["step-00000001", "step-00000002", "step-00000003"]
    assert "rank-00001.pt" not in store.sizes("step-00000003")  # never became visible
    assert checkpoint.find_latest(url).step == 2  # type: ignore[union-attr]

    resumed = spawn_ranks(_worker, 2, s3_env, JOB, TWO, url, None)
    assert resumed[0]["first"] == 2 and resumed[0]["last"] == STEPS
    assert _complete_steps(url) == [3, 4]
    # A checkpoint whose marker exists but whose shard was altered is skipped on resume,
    # found by the rank that reads that shard.
    store.write_bytes("step-00000004/rank-00000.pt",
                      b"\0" * store.sizes("step-00000004")["rank-00000.pt"])
    again = spawn_ranks(_worker, 2, s3_env, JOB, TWO, url, None)
    assert again[0]["first"] == 3


@pytest.mark.slow
def test_bad_credentials_and_missing_bucket_are_one_clear_line_on_every_rank(
        s3_env: dict[str, str]) -> None:
    wrong = {**s3_env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    url = f"s3://{BUCKET}/denied/job"
    results = spawn_ranks(_worker, 2, wrong, JOB, TWO, url, None)
    for result in results:
        message = result["error"]
        assert "\n" not in message
        assert f"rank 0 cannot write to {url}/.cephalo-probe-" in message
        assert "rank 1 cannot write" in message
        assert "check the storage credentials" in message
    results = spawn_ranks(_worker, 2, s3_env, JOB, TWO, "s3://no-such-bucket/job", None)
    for result in results:
        assert "bucket does not exist" in result["error"]
        assert "check that the bucket" in result["error"]


@pytest.mark.slow
def test_entrypoint_reports_one_ranks_root_cause_on_every_rank_and_exits_4(
        s3: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(
        {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
         "metadata": {"name": "t"}, "spec": JOB}))
    (tmp_path / "plan.json").write_text(json.dumps(
        {"global_batch_size": 6, "world_size": 2, "ranks": [
            {"rank": r, "batch_size": b, "micro_batch_size": b, "num_micro_batches": 1,
             "shard_ratio": 0.5} for r, b in enumerate([4, 2])]}))
    base = {**os.environ, **s3, "OMP_NUM_THREADS": "1",
            "CEPHALO_JOB": str(tmp_path / "job.yaml"),
            "CEPHALO_PLAN": str(tmp_path / "plan.json"),
            "CEPHALO_CHECKPOINT_DIR": f"s3://{BUCKET}/entry/job", "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, "-m", "cephalo.trainer"],
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r),
                                   # only rank 1's secret is wrong (a typo in one pod)
                                   **({"AWS_SECRET_ACCESS_KEY": "wrong"} if r else {})},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        outputs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 4, err
        lines = [line for line in err.splitlines() if line.startswith("cephalo trainer")]
        assert len(lines) == 1, err
        assert lines[0].startswith(f"cephalo trainer (rank {rank}): error: checking the "
                                   f"checkpoint storage failed: rank 1 cannot write to "
                                   f"s3://{BUCKET}/entry/job/.cephalo-probe-")
        assert "PermissionError" in lines[0] and "Connection closed" not in err


def test_a_write_that_fails_midway_leaves_no_object(s3_env: dict[str, str]) -> None:
    store = Store(f"s3://{BUCKET}/midway")

    def half_then_fail(f: object) -> None:
        f.write(b"x" * 1000)  # type: ignore[attr-defined]
        raise OSError("the producer failed")

    with pytest.raises(OSError, match="the producer failed"):
        store.write_stream("step-00000001/rank-00000.pt", half_then_fail)
    assert store.sizes("step-00000001") == {}
    facts = store.write_stream("step-00000001/rank-00000.pt", lambda f: f.write(b"y" * 10))
    assert store.sizes("step-00000001") == {"rank-00000.pt": 10} and facts["size_bytes"] == 10
