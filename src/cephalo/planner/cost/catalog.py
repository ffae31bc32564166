"""GPU catalog: memory, peak throughput, memory bandwidth and *measured efficiency* of common
GPUs, and the product label spellings NVIDIA GPU Feature Discovery (`nvidia.com/gpu.product`)
and NVML use for them.

Peaks are the vendors' dense (no sparsity) figures for the exact SKU: PCIe and SXM boards of
one chip differ in clocks, power and memory (H100 PCIe has 76 % of the SXM's FLOP/s and 60 %
of its bandwidth), so each has its own entry and labels. The efficiencies are the fraction of
peak a transformer block's training pass reaches, calibrated against the Cephalo authors'
per-layer measurements (`tests/unit/test_catalog_calibration.py` keeps the errors); GPUs they
did not measure take the figure of the closest measured GPU of the same architecture.

The catalog only feeds *estimates* (the cost model when no profile was measured) and the
memory capacity when no node label or profile says otherwise: a GPU missing from it is still
usable once profiled (`resolve_gpu`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from cephalo.errors import CephaloError

MIB = 1024**2


# The precisions a rank computes in (`RankPlan.precision`); a job's `precision` may also be
# "auto": each rank in its GPU's fastest one (`fastest_precision`).
ComputePrecision = Literal["fp32", "bf16", "fp16"]
COMPUTE_PRECISIONS: tuple[ComputePrecision, ...] = get_args(ComputePrecision)
# A 16-bit precision is chosen over fp32 only where it is predicted at least this much faster
# (it gives up fp32's range and precision, and fp16 needs loss scaling): a tie is fp32.
MIN_16BIT_SPEEDUP = 1.2


@dataclass(frozen=True)
class GpuType:
    name: str  # short catalog name used in plans and on the command line
    memory_bytes: int  # 0: unknown (a product outside the catalog)
    fp32_tflops: float
    bf16_tflops: float | None  # tensor-core bf16 peak; None: no native bf16 (Pascal, Volta, T4)
    # The board's native fp16 peak: tensor cores from Volta (7.0) on; Pascal's fp16 units
    # (P100: 2x fp32, P40: 1/64 of fp32), which torch's fp16 matmuls do not use (they
    # accumulate in fp32: fp32 speed, `peak_flops`).
    fp16_tflops: float
    memory_bandwidth_gbps: float  # GB/s
    labels: tuple[str, ...] = ()  # GFD / NVML spellings that mean this GPU
    # Fraction of the fp32 / bf16 peak a transformer block's forward+backward reaches at a
    # large microbatch (measured: L4 ~0.3, A6000 ~0.5, V100 ~0.9 of fp32 peak).
    fp32_efficiency: float = 0.6
    bf16_efficiency: float = 0.45
    in_catalog: bool = True  # False: known only by its label; speed must come from a profile
    # Usable host<->device copy bandwidth (GB/s) of the board's PCIe link, for activation
    # offload (planner/search/offload.py); None: unknown (the planner assumes PCIe 3.0 x16).
    host_link_gbps: float | None = None
    # CUDA compute capability (major, minor); None: not a CUDA GPU or unknown. bf16 tensor
    # cores from 8.0 (Ampere) on, fp16 tensor cores from 7.0 (Volta) on.
    compute_capability: tuple[int, int] | None = None
    # Fraction of the fp16 tensor-core peak a block reaches where fp16 has tensor cores and
    # bf16 does not (V100, T4: fitted to the authors' fp16 runs); None: bf16_efficiency
    # (Ampere and later run both 16-bit formats on the same tensor cores at one rate).
    fp16_efficiency: float | None = None

    def has_tensor_cores(self, precision: str) -> bool:
        """Does `precision` run on this GPU's tensor cores (a 16-bit rate above fp32)?"""
        if precision == "auto":
            precision = fastest_precision(self)
        if precision == "bf16":
            return bool(self.bf16_tflops)
        if precision == "fp16":
            return self.bf16_tflops is not None or (
                self.compute_capability is not None and self.compute_capability >= (7, 0))
        return False

    def peak_flops(self, precision: str) -> float:
        """Peak FLOP/s the engine can use: fp32 runs on CUDA cores (the trainer and the
        profiler turn TF32 off, cephalo.trainer.precision.pin_fp32_math); bf16 and fp16
        autocast use tensor cores where the GPU has them for that
        format, else fp32 speed (bf16 is emulated before 8.0; torch's fp16 matmuls
        accumulate in fp32, so Pascal's fp16 units do not speed them up: the paper's authors
        measured fp16 at 0.9-1.2x fp32 on P100 and P40). "auto": `fastest_precision`'s."""
        if precision == "auto":
            precision = fastest_precision(self)
        if precision == "bf16" and self.bf16_tflops:
            return self.bf16_tflops * 1e12
        if precision == "fp16" and self.has_tensor_cores("fp16"):
            return self.fp16_tflops * 1e12
        return self.fp32_tflops * 1e12

    def achieved_flops(self, precision: str) -> float:
        """FLOP/s a large transformer block actually reaches (peak x measured efficiency)."""
        if precision == "auto":
            precision = fastest_precision(self)
        if precision == "bf16" and self.bf16_tflops:
            return self.bf16_tflops * 1e12 * self.bf16_efficiency
        if precision == "fp16" and self.has_tensor_cores("fp16"):
            efficiency = self.fp16_efficiency
            return self.fp16_tflops * 1e12 * (self.bf16_efficiency if efficiency is None
                                              else efficiency)
        return self.fp32_tflops * 1e12 * self.fp32_efficiency


def fastest_precision(gpu: GpuType) -> ComputePrecision:
    """The precision `auto` gives a rank on this GPU: bf16 where bf16 has tensor cores
    (compute capability >= 8.0), fp16 where only fp16 has them (7.0, 7.5: V100, T4), fp32
    where 16-bit is not predicted faster (Pascal; the CPU; a GPU outside the catalog, whose
    figures are unknown). Decided on the achieved rate (catalog peak x measured efficiency),
    16-bit only when at least MIN_16BIT_SPEEDUP x fp32; bf16 before fp16 on a tie (bf16 has
    fp32's range: no loss scaling)."""
    rates = {p: gpu.achieved_flops(p) for p in COMPUTE_PRECISIONS
             if p == "fp32" or gpu.has_tensor_cores(p)}
    best: ComputePrecision = "fp32"
    for precision in COMPUTE_PRECISIONS[1:]:
        if precision in rates and rates[precision] >= MIN_16BIT_SPEEDUP * rates[best]:
            best = precision
    return best


def resolve_precision(precision: str, gpu: GpuType) -> str:
    """The precision a rank on `gpu` computes in under a job's `precision`: the job's own,
    or for "auto" the GPU's fastest (what the planner assigns and the profiler measures)."""
    return fastest_precision(gpu) if precision == "auto" else precision


def rank_compute_precision(job_precision: str, gpu: str,
                           rank_precision: str | None = None) -> str:
    """What a plan's rank computes in: its own `RankPlan.precision` when the plan gives one
    (the planner always does under "auto"), else the job's, "auto" resolved for the rank's
    `gpu` as the planner would (a plan written by hand)."""
    return rank_precision or resolve_precision(job_precision, resolve_gpu(gpu))


def _gpu(name: str, mib: int, fp32: float, bf16: float | None, fp16: float, bw: float,
         eff: tuple[float, ...], *labels: str, link: float | None = None,
         cc: tuple[int, int] | None = None) -> GpuType:
    """eff: (fp32, bf16) efficiencies, or (fp32, bf16, fp16) where fp16 has its own."""
    return GpuType(name, mib * MIB, fp32, bf16, fp16, bw, labels, eff[0], eff[1],
                   host_link_gbps=link, compute_capability=cc,
                   fp16_efficiency=eff[2] if len(eff) > 2 else None)


# Usable pinned-memory copy bandwidth of an x16 link, about 3/4 of the raw per-direction
# rate (PCIe 3.0: 15.75 GB/s raw, 4.0: 31.5, 5.0: 63). SXM boards (V100 SXM2, A100 SXM4,
# H100 SXM5, H200) talk to other GPUs over NVLink but to the host over the same PCIe x16.
_PCIE3, _PCIE4, _PCIE5 = 12.0, 24.0, 48.0


# (fp32, bf16) efficiencies, fitted per GPU to the authors' per-layer times of the paper's
# six models (GPT-2.7B/6.7B, Llama-3B/7B, ViT-G/e at m = 1…8; least mean error). bf16 from
# their fp16 runs where they have them (tensor cores, same rate); else the architecture's.
_PASCAL_P40, _PASCAL_P100 = (0.49, 0.45), (0.65, 0.45)
# Volta and Turing have fp16 tensor cores but no bf16 ones: their third figure is the fp16
# efficiency, fitted to the authors' fp16 runs of the language models (V100: GPT-2.7B and
# 6.7B, 0.37-0.45; its Llama-7B PCIe run wants more. T4: GPT-2.7B 0.27, Llama 0.45; GPT-6.7B
# measured no faster than fp32). Their ViT fp16 runs on V100 are 12x their fp32 ones, beyond
# the 8x of the peaks, so are left out of the fit.
_VOLTA_SXM2, _VOLTA_PCIE = (0.82, 0.45, 0.40), (0.90, 0.45, 0.40)  # PCIe: lower peak, same speed
_TURING = (0.50, 0.45, 0.35)  # T4 (power-capped at 70 W: the figure is its sustained clock)
_AMPERE_A10G, _AMPERE_A6000 = (0.54, 0.79), (0.48, 0.54)
_AMPERE_A100 = (0.90, 0.60)
_ADA_L4, _ADA_L40S = (0.29, 0.33), (0.36, 0.33)  # Ada's fp32 peak counts dual-issue FMAs
_HOPPER = (0.67, 0.43)  # H100 NVL measured; SXM/PCIe/H200 share the architecture

GPU_CATALOG: dict[str, GpuType] = {g.name: g for g in (
    _gpu("P40", 24576, 11.76, None, 0.18, 346, _PASCAL_P40, "Tesla-P40", "NVIDIA-Tesla-P40",
         link=_PCIE3, cc=(6, 1)),
    # The paper's Cluster A P100s are PCIe boards (a workstation): "P100" is the PCIe SKU.
    _gpu("P100", 16384, 9.3, None, 18.7, 732, _PASCAL_P100, "Tesla-P100-PCIE-16GB",
         "P100-16GB", "P100-PCIe-16GB", link=_PCIE3, cc=(6, 0)),
    _gpu("P100-12GB", 12288, 9.3, None, 18.7, 549, _PASCAL_P100, "Tesla-P100-PCIE-12GB",
         link=_PCIE3, cc=(6, 0)),
    _gpu("P100-SXM2", 16384, 10.6, None, 21.2, 732, _PASCAL_P100, "Tesla-P100-SXM2-16GB",
         link=_PCIE3, cc=(6, 0)),
    # "V100-16GB"/"V100-32GB" are the SXM2 boards (AWS p3, DGX-1: the paper's Cluster B).
    _gpu("V100-16GB", 16384, 15.7, None, 125.0, 900, _VOLTA_SXM2, "Tesla-V100-SXM2-16GB", "V100",
         "V100-SXM2-16GB", link=_PCIE3, cc=(7, 0)),
    _gpu("V100-32GB", 32768, 15.7, None, 125.0, 900, _VOLTA_SXM2, "Tesla-V100-SXM2-32GB",
         "V100-SXM2-32GB", link=_PCIE3, cc=(7, 0)),
    _gpu("V100-PCIe-16GB", 16384, 14.0, None, 112.0, 900, _VOLTA_PCIE, "Tesla-V100-PCIE-16GB",
         link=_PCIE3, cc=(7, 0)),
    _gpu("V100-PCIe-32GB", 32768, 14.0, None, 112.0, 900, _VOLTA_PCIE, "Tesla-V100-PCIE-32GB",
         link=_PCIE3, cc=(7, 0)),
    _gpu("V100S-32GB", 32768, 16.4, None, 130.0, 1134, _VOLTA_SXM2, "Tesla-V100S-PCIE-32GB",
         link=_PCIE3, cc=(7, 0)),
    _gpu("T4", 15360, 8.1, None, 65.0, 320, _TURING, "Tesla-T4", "NVIDIA-T4",
         link=_PCIE3, cc=(7, 5)),
    _gpu("A10G", 23028, 31.2, 70.0, 70.0, 600, _AMPERE_A10G, "NVIDIA-A10G", link=_PCIE4, cc=(8, 6)),
    _gpu("L4", 23034, 30.3, 121.0, 121.0, 300, _ADA_L4, "NVIDIA-L4", link=_PCIE4, cc=(8, 9)),
    _gpu("RTX-A6000", 49140, 38.7, 154.8, 154.8, 768, _AMPERE_A6000, "NVIDIA-RTX-A6000",
         "A6000", "RTXA6000", link=_PCIE4, cc=(8, 6)),
    _gpu("A100-40GB", 40960, 19.5, 312.0, 312.0, 1555, _AMPERE_A100, "NVIDIA-A100-SXM4-40GB",
         "NVIDIA-A100-PCIE-40GB", "A100", link=_PCIE4, cc=(8, 0)),
    _gpu("A100-80GB", 81920, 19.5, 312.0, 312.0, 2039, _AMPERE_A100, "NVIDIA-A100-SXM4-80GB",
         "NVIDIA-A100-80GB-PCIe", link=_PCIE4, cc=(8, 0)),
    # "H100" is the SXM5 board; the PCIe and NVL boards have their own clocks and memory.
    _gpu("H100", 81559, 67.0, 989.0, 989.0, 3350, _HOPPER, "NVIDIA-H100-80GB-HBM3",
         "NVIDIA-H100-SXM5-80GB", "H100-80GB", "H100-SXM", link=_PCIE5, cc=(9, 0)),
    _gpu("H100-PCIe", 81559, 51.0, 756.0, 756.0, 2000, _HOPPER, "NVIDIA-H100-PCIe",
         "NVIDIA-H100-PCIE-80GB", link=_PCIE5, cc=(9, 0)),
    _gpu("H100-NVL", 95830, 60.0, 835.0, 835.0, 3900, _HOPPER, "NVIDIA-H100-NVL",
         link=_PCIE5, cc=(9, 0)),
    _gpu("H200", 143771, 67.0, 989.0, 989.0, 4800, _HOPPER, "NVIDIA-H200",
         "NVIDIA-H200-141GB-HBM3e", link=_PCIE5, cc=(9, 0)),
    _gpu("L40S", 46068, 91.6, 362.0, 362.0, 864, _ADA_L40S, "NVIDIA-L40S", link=_PCIE4, cc=(8, 9)),
    # The host CPU for `cephalo run --devices cpu:N`; always replaced by a measured profile.
    _gpu("cpu", 16384, 0.2, None, 0.2, 20, (0.6, 0.45), "CPU"),
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


def _find(label_or_name: str) -> GpuType | None:
    key = _normalize(label_or_name)
    for candidate in (key, key.removeprefix("nvidia"), key.removeprefix("nvidiatesla"),
                      key.removeprefix("tesla")):
        if candidate in _INDEX:
            return _INDEX[candidate]
    return None


def lookup_gpu(label_or_name: str) -> GpuType:
    """The catalog entry for a catalog name ('A10G'), a GFD label ('NVIDIA-A10G') or an NVML
    device name ('NVIDIA A10G', 'Tesla T4'); UnknownGpuError listing the known names otherwise."""
    found = _find(label_or_name)
    if found is not None:
        return found
    raise UnknownGpuError(f"unknown GPU {label_or_name[:64]!r}; known GPUs: {known_names()} "
                          "(GPU Feature Discovery labels such as NVIDIA-A10G or Tesla-T4 work "
                          "too; any other GPU works from a measured profile)")


def known_names() -> str:
    return ", ".join(n for n in GPU_CATALOG if n != "cpu")


def gpu_key(label_or_name: str) -> str:
    """The name plans and profiles use for a GPU: its catalog name, or for a product outside
    the catalog its label with blanks as dashes, the spelling the profiler gives it
    (`cephalo.trainer.device_info`): NVML's 'NVIDIA GeForce RTX 4090' and GFD's
    'NVIDIA-GeForce-RTX-4090' both give 'NVIDIA-GeForce-RTX-4090'. Never raises."""
    found = _find(label_or_name)
    if found is not None:
        return found.name
    return re.sub(r"\s+", "-", label_or_name.strip())[:63] or "unknown-gpu"


def resolve_gpu(label_or_name: str, memory_bytes: int | None = None) -> GpuType:
    """The catalog entry, or for a product outside the catalog a GpuType that only knows its
    name and memory (`in_catalog` False): planning then needs a measured profile of it, and
    `estimate_profile` refuses it with a message saying so."""
    found = _find(label_or_name)
    if found is not None:
        return found
    return GpuType(gpu_key(label_or_name), memory_bytes or 0, 0.0, None, 0.0, 0.0,
                   (label_or_name,), in_catalog=False)


def same_gpu(a: str, b: str) -> bool:
    """Do two spellings name the same GPU (catalog SKU, or the same unknown product up to
    case and punctuation)?"""
    found_a, found_b = _find(a), _find(b)
    if found_a is not None or found_b is not None:
        return found_a is found_b
    return _normalize(a) == _normalize(b)
