"""Which GPU a rank drives (issue 43, item 6): LOCAL_RANK, never the global rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from cephalo.trainer import run
from cephalo.trainer.env import EnvError, cuda_device_index

JOB = {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob", "metadata": {"name": "t"},
       "spec": {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 8,
                "training": {"steps": 2}}}
PLAN = {"global_batch_size": 8, "world_size": 4, "ranks": [
    {"rank": i, "batch_size": 2, "micro_batch_size": 2, "num_micro_batches": 1,
     "shard_ratio": 0.25} for i in range(4)]}


@pytest.mark.parametrize(("local_rank", "visible", "index"), [
    (None, 1, 0),  # a pod or process shown only its own GPU
    (0, 1, 0), (1, 2, 1), (3, 4, 3)])
def test_the_gpu_a_rank_drives(local_rank: int | None, visible: int, index: int) -> None:
    assert cuda_device_index(local_rank, visible) == index


@pytest.mark.parametrize(("local_rank", "visible", "message"), [
    (None, 2, "LOCAL_RANK is not set and this rank sees 2 GPUs: set LOCAL_RANK"),
    (2, 2, "LOCAL_RANK=2 but this rank sees 2 GPU(s) (cuda:0..cuda:1)"),
    (0, 0, "no CUDA GPU is visible")])
def test_no_guess_at_a_gpu(local_rank: int | None, visible: int, message: str) -> None:
    with pytest.raises(EnvError) as err:
        cuda_device_index(local_rank, visible)
    assert message in str(err.value) and "\n" not in str(err.value)


def _gpus_without_local_rank(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                             gpus: int) -> list[object]:
    """`env` set, LOCAL_RANK unset, `gpus` fake CUDA GPUs visible, and no process group may
    form: returns the list of GPUs the code under test claims."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    claimed: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", claimed.append)

    def no_group(*args: object, **kwargs: object) -> None:
        raise AssertionError("the process group formed")

    monkeypatch.setattr(torch.distributed, "init_process_group", no_group)
    return claimed


def test_a_rank_without_local_rank_on_a_multi_gpu_host_stops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 3 of 4, no LOCAL_RANK, on a host whose 4 GPUs it sees: exit 2 with one line,
    before any GPU is claimed or the process group forms (it used to take GPU 3 % 4)."""
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(JOB))
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    claimed = _gpus_without_local_rank(monkeypatch, {
        "RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
        "CEPHALO_JOB": str(tmp_path / "job.yaml"), "CEPHALO_PLAN": str(tmp_path / "plan.json"),
        "CEPHALO_CHECKPOINT_DIR": ""}, gpus=4)
    monkeypatch.setattr(run, "check_precision", lambda device, precision: None)
    monkeypatch.setattr(run.signal, "signal", lambda *args: None)  # pytest keeps its own
    assert run.main() == 2
    assert claimed == []
    err = capsys.readouterr().err.strip()
    assert err.startswith("cephalo trainer (rank 3): error: LOCAL_RANK is not set and this "
                          "rank sees 4 GPUs") and "\n" not in err


def test_the_network_probe_takes_no_gpu_without_local_rank(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The probe's rank picks its GPU by the same rule (it took GPU 0 on every rank without
    LOCAL_RANK): exit 2 with one line before any GPU is claimed or a group forms."""
    from cephalo.trainer import netprobe

    claimed = _gpus_without_local_rank(monkeypatch, {
        "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"},
        gpus=2)
    assert netprobe.main(["--output", "-"]) == 2
    assert claimed == []
    err = capsys.readouterr().err.strip()
    assert err.startswith("netprobe: error: LOCAL_RANK is not set and this rank sees 2 GPUs") \
        and "\n" not in err
