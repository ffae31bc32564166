"""NVML's handle of the GPU that torch calls `cuda:<index>`.

NVML numbers GPUs in PCI order and ignores CUDA_VISIBLE_DEVICES, while torch numbers only
the visible ones (the local runner gives each rank CUDA_VISIBLE_DEVICES=<i> and device 0):
`nvmlDeviceGetHandleByIndex(cuda_index)` then reads another GPU (on a workstation with
mixed GPUs, every rank would report GPU 0's product and memory). So the device is looked up
by torch's identity of it: its UUID, else its PCI bus id (a MIG slice's UUID is not a
GPU's, and old drivers may not know it)."""

from __future__ import annotations

from typing import Any, Protocol


class CudaProperties(Protocol):
    """What this module reads of `torch.cuda.get_device_properties(i)`."""

    pci_domain_id: int
    pci_bus_id: int
    pci_device_id: int

    @property
    def uuid(self) -> object: ...


def nvml_uuid(props: CudaProperties) -> str | None:
    """NVML's spelling of the device's UUID ("GPU-xxxxxxxx-..."), or None when torch gives
    none. torch prints a CUDA UUID without NVML's "GPU-" prefix."""
    raw = getattr(props, "uuid", None)
    if raw is None:
        return None
    text = str(raw)
    if not text:
        return None
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def nvml_pci_bus_id(props: CudaProperties) -> str:
    """NVML's PCI bus id of the device, "domain:bus:device.function" in hex
    (nvmlDeviceGetPciInfo's busId form; a CUDA device is always function 0)."""
    return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"


def nvml_handle(pynvml: Any, props: CudaProperties) -> Any:
    """NVML's handle of the device `props` describes (NVML initialised by the caller).
    Raises pynvml.NVMLError when NVML knows neither its UUID nor its PCI bus id."""
    uuid = nvml_uuid(props)
    if uuid is not None:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except pynvml.NVMLError:
            pass  # e.g. a MIG slice, or a driver that does not know it: try the bus id
    return pynvml.nvmlDeviceGetHandleByPciBusId(nvml_pci_bus_id(props))
