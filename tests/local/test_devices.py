"""Device selection for `cephalo run` (pure: GPU lists are passed in)."""

from __future__ import annotations

import ctypes
import sys
import types

import pytest

from cephalo.local.devices import DeviceError, cuda_driver_missing, cuda_products, select_devices


def test_default_without_gpu_is_two_cpu_ranks() -> None:
    devices = select_devices(None, None, gpus=[])
    assert [(d.kind, d.index, d.product) for d in devices] == [("cpu", 0, "cpu"),
                                                                ("cpu", 1, "cpu")]


def test_default_with_gpus_uses_every_gpu() -> None:
    devices = select_devices(None, None, gpus=["RTX-A6000", "L4"])
    assert [(d.kind, d.index, d.product) for d in devices] == [("cuda", 0, "RTX-A6000"),
                                                                ("cuda", 1, "L4")]


def test_emulation_gives_one_cpu_rank_per_name_in_catalog_spelling() -> None:
    devices = select_devices(None, "A6000,NVIDIA-L4,Tesla-P40", gpus=[])
    assert [d.product for d in devices] == ["RTX-A6000", "L4", "P40"]
    assert all(d.emulated and d.kind == "cpu" for d in devices)
    assert devices[0].label == "cpu:0 emulating RTX-A6000"


@pytest.mark.parametrize("devices,emulate,gpus,message", [
    ("cpu:2", "L4,L4,P40", [], "names 3 GPUs but --devices gives 2"),
    ("cuda", None, [], "no CUDA GPU is visible"),
    ("cuda:3", None, ["L4"], "asks for GPU 3 but only 1 GPU"),
    ("cuda:0,0", None, ["L4", "L4"], "lists a GPU twice"),
    ("tpu:1", None, [], "use cpu:N, cuda, or cuda:0,1"),
    ("cuda", "L4", ["L4"], "CPU ranks only"),
    ("cpu:0", None, [], "N >= 1"),
])
def test_bad_device_selection_is_one_clear_error(devices, emulate, gpus, message) -> None:
    with pytest.raises(DeviceError, match=message):
        select_devices(devices, emulate, gpus=gpus)


def test_unknown_emulated_gpu() -> None:
    with pytest.raises(ValueError, match="unknown GPU 'GTX-1'"):
        select_devices(None, "GTX-1", gpus=[])


class _TorchNotToBeImported(types.ModuleType):
    def __getattr__(self, name: str):
        raise AssertionError(f"torch.{name} used: the GPU lookup imported torch")


def test_no_cuda_driver_means_no_gpus_without_importing_torch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where libcuda.so.1 cannot be loaded (a machine without the NVIDIA driver) there is no
    CUDA GPU, and the lookup says so without importing torch (~2 s of CPU)."""
    def no_driver(name: str, *args: object, **kwargs: object) -> ctypes.CDLL:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    monkeypatch.setitem(sys.modules, "torch", _TorchNotToBeImported("torch"))
    assert cuda_driver_missing()
    assert cuda_products() == []
    with pytest.raises(DeviceError, match="no CUDA GPU is visible"):
        select_devices("cuda", None)
