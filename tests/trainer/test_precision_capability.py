"""What a precision does on a GPU by compute capability (issue 43, item 5), with faked
devices: bf16 below 8.0 is emulated (a warning naming fp16, not a silent slowdown or a
crash); fp32 from 8.0 on is IEEE fp32, TF32 off, as the catalog's fp32 peak assumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from cephalo.planner.cost.catalog import GPU_CATALOG
from cephalo.trainer import precision, run
from cephalo.trainer.precision import check_precision, pin_fp32_math, precision_notice


@pytest.mark.parametrize("capability", [(7, 0), (7, 5)])
def test_bf16_below_ampere_warns_with_fp16(capability: tuple[int, int]) -> None:
    notice = precision_notice("bf16", "cuda", capability)
    assert notice is not None and notice.startswith("warning: bf16 on this GPU (compute "
                                                    f"capability {capability[0]}.")
    assert "use precision fp16" in notice and "\n" not in notice


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (9, 0)])
def test_fp32_from_ampere_says_tf32_is_off(capability: tuple[int, int]) -> None:
    notice = precision_notice("fp32", "cuda", capability)
    assert notice is not None and "TF32 off" in notice and "\n" not in notice


@pytest.mark.parametrize(("p", "device", "capability"), [
    ("bf16", "cuda", (8, 0)), ("fp16", "cuda", (7, 0)), ("fp32", "cuda", (7, 5)),
    ("bf16", "cpu", None), ("fp32", "cpu", None)])
def test_nothing_to_say(p: str, device: str, capability: tuple[int, int] | None) -> None:
    assert precision_notice(p, device, capability) is None


def test_check_precision_returns_the_warning_and_does_not_refuse(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A V100 (7.0) where torch's bf16 autocast engages by emulation."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(precision, "autocast_engages", lambda device, p: True)
    notice = check_precision(torch.device("cuda", 0), "bf16")
    assert notice is not None and "fp16" in notice


def test_the_catalogs_fp32_peak_is_the_cuda_core_rate() -> None:
    """TF32 off (pin_fp32_math) means fp32 runs at the catalog's fp32 figure on every GPU
    with tensor cores: below its bf16 peak, never the TF32 rate (half the bf16 dense)."""
    ampere_on = [g for g in GPU_CATALOG.values()
                 if g.compute_capability is not None and g.compute_capability >= (8, 0)]
    assert ampere_on
    for gpu in ampere_on:
        assert gpu.peak_flops("fp32") == gpu.fp32_tflops * 1e12
        assert gpu.bf16_tflops is not None and gpu.fp32_tflops < 0.5 * gpu.bf16_tflops, gpu.name


@pytest.fixture
def tf32_flags():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_pin_fp32_math_turns_tf32_off_for_matmuls_and_convolutions(tf32_flags) -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True  # torch's default for convolutions
    pin_fp32_math()
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (
        False, False)


def test_a_bf16_rank_on_a_v100_warns_and_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tf32_flags) -> None:
    """The trainer's rank start: the warning on stderr, then on to the process group (with
    fp32 math pinned), not an error and not silence."""
    job = {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
           "metadata": {"name": "t"},
           "spec": {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 2, "precision": "bf16",
                    "training": {"steps": 1}}}
    plan = {"global_batch_size": 2, "world_size": 1, "ranks": [
        {"rank": 0, "batch_size": 2, "micro_batch_size": 2, "num_micro_batches": 1,
         "shard_ratio": 1.0}]}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
                        "CEPHALO_JOB": str(tmp_path / "job.yaml"),
                        "CEPHALO_PLAN": str(tmp_path / "plan.json"),
                        "CEPHALO_CHECKPOINT_DIR": ""}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(precision, "autocast_engages", lambda device, p: True)
    monkeypatch.setattr(run.signal, "signal", lambda *args: None)
    torch.backends.cudnn.allow_tf32 = True

    class GroupReached(Exception):
        pass

    def group(*args: object, **kwargs: object) -> None:
        raise GroupReached

    monkeypatch.setattr(run.dist, "init_process_group", group)
    with pytest.raises(GroupReached):
        run.main()
    err = capsys.readouterr().err.strip()
    assert err.startswith("cephalo trainer (rank 0): warning: bf16 on this GPU (compute "
                          "capability 7.0)") and "\n" not in err
    assert torch.backends.cudnn.allow_tf32 is False
