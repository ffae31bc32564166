"""Device selection for `cephalo run` (pure: GPU lists are passed in)."""

from __future__ import annotations

import pytest

from cephalo.local.devices import DeviceError, select_devices


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
