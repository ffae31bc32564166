"""`cephalo run` with `checkpoint.uri`: the ranks checkpoint to `<uri>/<job>/<run timestamp>`
on a real S3-compatible server (moto in server mode, over HTTP) and `--resume` finds them
there. (`checkpoint.ephemeral`, no checkpoints at all: test_run_extra_sizes.py, whose job
is ephemeral.)"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..moto_s3 import moto_server
from .cli_helpers import TINY_JOB, cephalo_cmd

boto3 = pytest.importorskip("boto3")
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

pytestmark = pytest.mark.slow
BUCKET = "team-checkpoints"


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    with moto_server() as url:
        env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "test",
               "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
        _client(env).create_bucket(Bucket=BUCKET)
        yield env


def _client(env: dict[str, str]):
    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])


def _run(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(cephalo_cmd(*args), cwd=cwd, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL,
                          env={**os.environ, "XDG_CACHE_HOME": str(cwd / ".cache"), **env})


def _plan(tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"global_batch_size": 6, "world_size": 2, "ranks": [
        {"rank": 0, "gpu": "cpu", "batch_size": 4, "micro_batch_size": 4,
         "num_micro_batches": 1, "shard_ratio": 0.5},
        {"rank": 1, "gpu": "cpu", "batch_size": 2, "micro_batch_size": 2,
         "num_micro_batches": 1, "shard_ratio": 0.5}]}))
    return path


def test_run_checkpoints_to_the_uri_and_resumes_from_it(tmp_path, s3_env) -> None:
    job = tmp_path / "tiny.yaml"
    job.write_text(TINY_JOB.format(name="tiny", batch=6, steps=4).replace(
        "checkpoint: {intervalSteps: 2}",
        f"checkpoint: {{intervalSteps: 2, uri: 's3://{BUCKET}/runs/'}}"))
    first = _run(tmp_path, s3_env, "run", str(job), "--plan", str(_plan(tmp_path)),
                 "--devices", "cpu:2", "--steps", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    (run_dir,) = (tmp_path / "runs" / "tiny").iterdir()
    uri = f"s3://{BUCKET}/runs/tiny/{run_dir.name}"
    assert f"checkpoints {uri}  (export: cephalo export {uri}" in first.stdout
    assert not (run_dir / "checkpoints").exists()
    keys = [o["Key"] for o in _client(s3_env).list_objects_v2(
        Bucket=BUCKET, Prefix=f"runs/tiny/{run_dir.name}/")["Contents"]]
    assert any("step-00000002" in k for k in keys), keys
    done = _run(tmp_path, s3_env, "run", str(job), "--plan", str(_plan(tmp_path)),
                "--devices", "cpu:2", "--resume")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resumed from {uri}" in (run_dir / "logs" / "rank-0.log").read_text()
    assert "over steps 3-4 (resumed after step 2)" in done.stdout
