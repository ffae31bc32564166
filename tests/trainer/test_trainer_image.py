"""Smoke tests inside the trainer image (scripts/build-images.sh builds it), as the image's user
(uid 1000, the chart's trainerRunAsUser): the profiler on CPU writes a valid GpuProfile, and
`python -m cephalo.trainer` under torchrun trains a 2-rank gloo job from a given plan, writes
a checkpoint to a volume, logs the run to a real MLflow server (the image carries the
`tracking` extra) and exits 0; the user writes nothing else but /work and /tmp."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cephalo.api.profile import GpuProfile
from cephalo.trainer import checkpoint
from tests.image_helpers import CACHE, container, image_config, image_name, run, writable_paths
from tests.mlflow_server import running_mlflow_server

pytestmark = pytest.mark.images
UID = 1000
USER = f"{UID}:{UID}"
JOB = {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob", "metadata": {"name": "img"},
       "spec": {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 8,
                "training": {"steps": 4, "learningRate": 1e-3},
                "checkpoint": {"intervalSteps": 2, "keep": 2}}}
# Uneven on purpose: rank 0 takes 5 samples in 5 microbatches, rank 1 3 in one, shards 60/40.
PLAN = {"global_batch_size": 8, "world_size": 2, "ranks": [
    {"rank": 0, "batch_size": 5, "micro_batch_size": 1, "num_micro_batches": 5,
     "shard_ratio": 0.6},
    {"rank": 1, "batch_size": 3, "micro_batch_size": 3, "num_micro_batches": 1,
     "shard_ratio": 0.4}]}


@pytest.fixture(scope="module")
def image() -> str:
    return image_name("trainer")


@pytest.fixture(scope="module")
def ctr(image: str) -> Iterator[str]:
    yield from container(image)


@pytest.fixture()
def inputs(tmp_path: Path) -> Path:
    """job.yaml and plan.json, readable by the image's user (mounted read-only at /in)."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "job.yaml").write_text(yaml.safe_dump(JOB))
    (folder / "plan.json").write_text(json.dumps(PLAN))
    for path in (tmp_path, folder, *folder.iterdir()):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return folder


def _volume(tmp_path: Path, name: str) -> Path:
    """A folder owned by the image's user, as a pod's volume with fsGroup would be."""
    path = tmp_path / name
    path.mkdir()
    os.chown(path, UID, UID)
    return path


def test_trainer_user_writes_only_work_and_tmp(image: str, ctr: str) -> None:
    assert image_config(image)["WorkingDir"] == "/work"
    assert writable_paths(ctr, USER) <= {"/work", "/tmp", "/var/tmp", "/run/lock"}
    assert "/work" in writable_paths(ctr, USER)


def test_sbom_lists_torch_and_the_trainer_stack(image: str) -> None:
    sbom = json.loads((CACHE / "out" / "trainer.cdx.json").read_text())
    names = {c["name"].lower() for c in sbom["components"]}
    # and the light experiment-tracking clients (the `tracking` extra: spec.tracking)
    assert {"torch", "cephalo", "safetensors", "datasets", "mlflow-skinny", "tensorboard"} \
        <= names


@pytest.mark.slow
def test_profiler_on_cpu_writes_a_gpu_profile(ctr: str, inputs: Path, tmp_path: Path) -> None:
    out = _volume(tmp_path, "out")
    done = run(ctr, ["python", "-m", "cephalo.trainer.profile", "--job", "/in/job.yaml",
                     "--device", "cpu", "--micro-batch-sizes", "1,2", "--repeats", "2",
                     "--cache-dir", "none", "--output", "/out/profile.json"],
               user=USER, volumes=[f"{inputs}:/in:ro", f"{out}:/out"],
               env={"OMP_NUM_THREADS": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    profile = GpuProfile.model_validate_json((out / "profile.json").read_text())
    assert [p.micro_batch_size for p in profile.points] == [1, 2]
    print(f"profiler in the image: {profile.product}, {len(profile.points)} points")


@pytest.mark.slow
def test_two_rank_gloo_job_trains_checkpoints_is_tracked_and_exits_0(ctr: str, inputs: Path,
                                                                     tmp_path: Path) -> None:
    """...and rank 0 logs the run to a real MLflow tracking server on this machine's
    loopback (spec.tracking.mlflow) with the image's own client, read back with MLflow's."""
    from mlflow import MlflowClient

    ckpt = _volume(tmp_path, "checkpoints")
    (tmp_path / "mlflow").mkdir()
    with running_mlflow_server(tmp_path / "mlflow") as uri:
        tracked = {**JOB, "spec": {**JOB["spec"], "tracking": {"mlflow": {
            "trackingUri": uri, "experiment": "image"}}}}
        (inputs / "tracked.yaml").write_text(yaml.safe_dump(tracked))
        os.chmod(inputs / "tracked.yaml", 0o644)
        done = run(ctr, ["python", "-m", "torch.distributed.run", "--standalone",
                         "--nproc-per-node", "2", "-m", "cephalo.trainer"],
                   user=USER, volumes=[f"{inputs}:/in:ro", f"{ckpt}:/checkpoints"],
                   env={"CEPHALO_JOB": "/in/tracked.yaml", "CEPHALO_PLAN": "/in/plan.json",
                        "CEPHALO_CHECKPOINT_DIR": "/checkpoints/img",
                        "CEPHALO_NUM_THREADS": "1", "CEPHALO_METRICS_PORT": "0",
                        "OMP_NUM_THREADS": "1"}, timeout=600)
        print(done.stdout[-3000:], done.stderr[-3000:])
        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name("image")
        runs = client.search_runs([experiment.experiment_id]) if experiment else []
        steps = [m.step for r in runs for m in client.get_metric_history(r.info.run_id, "loss")]
    assert done.returncode == 0, done.stderr[-3000:]
    latest = checkpoint.find_latest(ckpt / "img")
    assert latest is not None and latest.step == 4, latest
    owners = {p.stat().st_uid for p in (ckpt / "img").rglob("*")}
    assert owners == {UID}, f"checkpoint files owned by {owners}"
    assert len(runs) == 1 and sorted(steps) == [1, 2, 3, 4], (runs, steps)
    assert runs[0].info.status == "FINISHED" and runs[0].data.params["world_size"] == "2"

