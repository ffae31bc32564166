"""Facts about the local device: NVML (nvidia-ml-py) on GPUs, the OS on CPUs.

The product name is normalised to the planner's catalog name (`NVIDIA A10G` -> `A10G`) so
profiles, plans and node labels agree; an unknown GPU keeps its NVML name."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceFacts:
    product: str  # catalog name, e.g. "A10G", or "cpu"
    device_name: str  # as the driver / OS reports it
    memory_bytes: int
    compute_capability: str | None = None
    driver_version: str | None = None


def catalog_name(device_name: str) -> str:
    # The catalog is plain data in the (torch-free) planner; importing it here adds no weight.
    from cephalo.planner.cost.catalog import lookup_gpu

    try:
        return lookup_gpu(device_name).name
    except ValueError:
        return device_name.replace(" ", "-")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 1024**3


def _nvml_facts(index: int) -> tuple[str, int, str] | None:
    """(name, total memory bytes, driver version) from NVML of the GPU torch calls
    cuda:<index>, or None without a driver. Found by UUID / PCI bus id (nvml_device: NVML's
    own index ignores CUDA_VISIBLE_DEVICES)."""
    try:
        import pynvml
    except ImportError:
        return None
    from cephalo.trainer.nvml_device import nvml_handle

    try:
        pynvml.nvmlInit()
        try:
            handle = nvml_handle(pynvml, torch.cuda.get_device_properties(index))
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            driver = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
    return _text(name), int(memory), _text(driver)


def _text(value: bytes | str) -> str:
    """nvidia-ml-py returns bytes in old releases and str in new ones."""
    return value.decode() if isinstance(value, bytes) else str(value)


def device_facts(device: torch.device) -> DeviceFacts:
    if device.type != "cuda":
        return DeviceFacts("cpu", _cpu_name(), _host_memory_bytes())
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    capability = f"{props.major}.{props.minor}"
    nvml = _nvml_facts(index)
    if nvml is None:
        return DeviceFacts(catalog_name(props.name), props.name, int(props.total_memory),
                           capability)
    name, memory, driver = nvml
    return DeviceFacts(catalog_name(name), name, memory, capability, driver)
