"""GPU catalog: memory, peak throughput and memory bandwidth of common GPUs, and the product
label spellings NVIDIA GPU Feature Discovery (`nvidia.com/gpu.product`) and NVML use for them.

Figures are the vendors' dense (no sparsity) peaks. They feed the *estimated* cost model used
when no measured profile exists, and the memory capacity when no node label says otherwise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cephalo.errors import CephaloError

MIB = 1024**2


@dataclass(frozen=True)
class GpuType:
    name: str  # short catalog name used in plans and on the command line
    memory_bytes: int
    fp32_tflops: float
    bf16_tflops: float | None  # tensor-core bf16 peak; None: no native bf16 (Pascal, Volta, T4)
    fp16_tflops: float
    memory_bandwidth_gbps: float  # GB/s
    labels: tuple[str, ...] = ()  # GFD / NVML spellings that mean this GPU

    def peak_flops(self, precision: str) -> float:
        """Peak FLOP/s the engine can use: fp32 runs on CUDA cores (TF32 is off by default in
        PyTorch); bf16 autocast uses tensor cores where the GPU has them, else fp32 speed."""
        if precision == "bf16" and self.bf16_tflops:
            return self.bf16_tflops * 1e12
        return self.fp32_tflops * 1e12


def _gpu(name: str, mib: int, fp32: float, bf16: float | None, fp16: float, bw: float,
         *labels: str) -> GpuType:
    return GpuType(name, mib * MIB, fp32, bf16, fp16, bw, labels)


GPU_CATALOG: dict[str, GpuType] = {g.name: g for g in (
    _gpu("P40", 24576, 11.76, None, 0.18, 346, "Tesla-P40", "NVIDIA-Tesla-P40"),
    _gpu("P100", 16384, 9.3, None, 18.7, 732, "Tesla-P100-PCIE-16GB", "Tesla-P100-SXM2-16GB",
         "P100-16GB"),
    _gpu("V100-16GB", 16384, 15.7, None, 125.0, 900, "Tesla-V100-SXM2-16GB",
         "Tesla-V100-PCIE-16GB", "V100"),
    _gpu("V100-32GB", 32768, 15.7, None, 125.0, 900, "Tesla-V100-SXM2-32GB",
         "Tesla-V100-PCIE-32GB", "Tesla-V100S-PCIE-32GB"),
    _gpu("T4", 15360, 8.1, None, 65.0, 320, "Tesla-T4", "NVIDIA-T4"),
    _gpu("A10G", 23028, 31.2, 70.0, 70.0, 600, "NVIDIA-A10G"),
    _gpu("L4", 23034, 30.3, 121.0, 121.0, 300, "NVIDIA-L4"),
    _gpu("RTX-A6000", 49140, 38.7, 154.8, 154.8, 768, "NVIDIA-RTX-A6000", "A6000",
         "RTXA6000"),
    _gpu("A100-40GB", 40960, 19.5, 312.0, 312.0, 1555, "NVIDIA-A100-SXM4-40GB",
         "NVIDIA-A100-PCIE-40GB", "A100"),
    _gpu("A100-80GB", 81920, 19.5, 312.0, 312.0, 2039, "NVIDIA-A100-SXM4-80GB",
         "NVIDIA-A100-80GB-PCIe"),
    _gpu("H100", 81559, 67.0, 989.0, 989.0, 3350, "NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe",
         "NVIDIA-H100-SXM5-80GB", "H100-80GB"),
    _gpu("H200", 143771, 67.0, 989.0, 989.0, 4800, "NVIDIA-H200", "NVIDIA-H200-141GB-HBM3e"),
    _gpu("L40S", 46068, 91.6, 362.0, 362.0, 864, "NVIDIA-L40S"),
    # The host CPU for `cephalo run --devices cpu:N`; always replaced by a measured profile.
    _gpu("cpu", 16384, 0.2, None, 0.2, 20, "CPU"),
)}


def _normalize(text: str) -> str:
    """Case/punctuation-free form: 'NVIDIA RTX A6000' == 'NVIDIA-RTX-A6000' == 'rtx_a6000'."""
    return re.sub(r"[^a-z0-9]", "", text.lower())


_INDEX: dict[str, GpuType] = {}
for _g in GPU_CATALOG.values():
    for _spelling in (_g.name, *_g.labels):
        _INDEX[_normalize(_spelling)] = _g
        _INDEX.setdefault(_normalize(_spelling).removeprefix("nvidia"), _g)
        _INDEX.setdefault(_normalize(_spelling).removeprefix("tesla"), _g)


class UnknownGpuError(CephaloError, ValueError):
    """A GPU name that is not in the catalog; the message lists the known ones."""


def lookup_gpu(label_or_name: str) -> GpuType:
    """The catalog entry for a catalog name ('A10G'), a GFD label ('NVIDIA-A10G') or an NVML
    device name ('NVIDIA A10G', 'Tesla T4'); UnknownGpuError listing the known names otherwise."""
    key = _normalize(label_or_name)
    for candidate in (key, key.removeprefix("nvidia"), key.removeprefix("nvidiatesla"),
                      key.removeprefix("tesla")):
        if candidate in _INDEX:
            return _INDEX[candidate]
    known = ", ".join(n for n in GPU_CATALOG if n != "cpu")
    raise UnknownGpuError(f"unknown GPU {label_or_name[:64]!r}; known GPUs: {known} "
                     "(GPU Feature Discovery labels such as NVIDIA-A10G or Tesla-T4 work too)")
