"""NVML is asked about the GPU torch runs on, not the one NVML numbers alike (issue 43,
item 3): a fake `pynvml` holds a host of two different GPUs in PCI order, fake torch
properties say which of them the process sees under CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest
import torch

from cephalo.trainer import device_info, metrics

GIB = 1024**3


@dataclass(frozen=True)
class FakeGpu:
    name: str
    memory_bytes: int
    uuid: str  # as torch prints it: no "GPU-" prefix
    pci_bus_id: int
    used_bytes: int
    major: int = 8
    minor: int = 6


# NVML's order is PCI order: GPU 0 on bus 0x17, GPU 1 on bus 0x65.
HOST = [FakeGpu("Tesla T4", 16 * GIB, "0b1e6f2a-1111-2222-3333-444455556666", 0x17, 1 * GIB,
                7, 5),
        FakeGpu("NVIDIA A10G", 24 * GIB, "7c9d0e4b-aaaa-bbbb-cccc-ddddeeeeffff", 0x65, 3 * GIB)]


class FakeNVMLError(Exception):
    pass


def fake_pynvml(host: list[FakeGpu], known_uuids: bool = True) -> types.ModuleType:
    """A pynvml over `host` (NVML index = position). known_uuids False: the driver finds
    no device by UUID (a MIG slice's, an old driver), so only the PCI bus id finds it."""
    nvml = types.ModuleType("pynvml")

    def by_uuid(uuid: str) -> FakeGpu:
        for gpu in host:
            if known_uuids and uuid == f"GPU-{gpu.uuid}":
                return gpu
        raise FakeNVMLError(f"no GPU with UUID {uuid}")

    def by_bus(bus_id: str) -> FakeGpu:
        for gpu in host:
            if bus_id == f"00000000:{gpu.pci_bus_id:02X}:00.0":
                return gpu
        raise FakeNVMLError(f"no GPU on bus {bus_id}")

    nvml.NVMLError = FakeNVMLError  # type: ignore[attr-defined]
    nvml.nvmlInit = lambda: None  # type: ignore[attr-defined]
    nvml.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = lambda i: host[i]  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByUUID = by_uuid  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByPciBusId = by_bus  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetName = lambda gpu: gpu.name  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetMemoryInfo = lambda gpu: types.SimpleNamespace(  # type: ignore[attr-defined]
        total=gpu.memory_bytes, used=gpu.used_bytes)
    nvml.nvmlSystemGetDriverVersion = lambda: "580.159.04"  # type: ignore[attr-defined]
    return nvml


def torch_properties(gpu: FakeGpu) -> types.SimpleNamespace:
    """What torch.cuda.get_device_properties says of `gpu` (uuid prints without "GPU-")."""
    return types.SimpleNamespace(
        name=gpu.name, total_memory=gpu.memory_bytes, major=gpu.major, minor=gpu.minor,
        uuid=gpu.uuid, pci_domain_id=0, pci_bus_id=gpu.pci_bus_id, pci_device_id=0)


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch):
    """Install the fake NVML host; returns a function that makes torch see `visible`
    (NVML indices, in CUDA_VISIBLE_DEVICES order) and a uuid switch."""
    metrics._nvml_handle.cache_clear()

    def see(visible: list[int], known_uuids: bool = True) -> None:
        metrics._nvml_handle.cache_clear()
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(HOST, known_uuids))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible))
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda i: torch_properties(HOST[visible[i]]))

    yield see
    metrics._nvml_handle.cache_clear()


@pytest.mark.parametrize("known_uuids", [True, False], ids=["by-uuid", "by-pci-bus-id"])
def test_one_visible_gpu_is_the_one_nvml_reports(host, known_uuids: bool) -> None:
    """CUDA_VISIBLE_DEVICES=1 (what the local runner gives the A10G's rank): torch's cuda:0
    is NVML's GPU 1, so the facts and the metrics are the A10G's, not the T4's."""
    host([1], known_uuids)
    facts = device_info.device_facts(torch.device("cuda", 0))
    assert (facts.product, facts.memory_bytes, facts.compute_capability) == (
        "A10G", 24 * GIB, "8.6")
    assert metrics.gpu_memory_bytes(0) == (3 * GIB, 24 * GIB)


def test_reordered_visible_gpus_follow_torch(host) -> None:
    """CUDA_VISIBLE_DEVICES=1,0: torch's cuda:0 is the A10G and cuda:1 the T4."""
    host([1, 0])
    assert [device_info.device_facts(torch.device("cuda", i)).product for i in (0, 1)] == [
        "A10G", "T4"]
    assert [metrics.gpu_memory_bytes(i) for i in (0, 1)] == [(3 * GIB, 24 * GIB),
                                                             (1 * GIB, 16 * GIB)]


def test_a_gpu_nvml_cannot_find_reads_as_no_nvml(host, monkeypatch) -> None:
    """Neither UUID nor bus id known (a driver mismatch): torch's own figures, no crash."""
    host([1], known_uuids=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(
        **{**vars(torch_properties(HOST[1])), "pci_bus_id": 0x99}))
    facts = device_info.device_facts(torch.device("cuda", 0))
    assert (facts.product, facts.driver_version) == ("A10G", None)
    assert metrics.gpu_memory_bytes(0) is None


def test_torch_has_the_identity_the_lookup_reads() -> None:
    """The installed torch's device properties carry what nvml_device reads (a torch that
    dropped them would make every lookup fall through to no NVML at all)."""
    names = set(dir(torch._C._CudaDeviceProperties))
    assert {"uuid", "pci_bus_id", "pci_device_id", "pci_domain_id"} <= names
