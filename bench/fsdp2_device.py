"""The device half of `bench/fsdp2.py`: its memory measures on CPU ranks, the run on one CUDA
GPU (issue 16 item 4), and the throughput figures (TFLOP/s, MFU) of every contender.

On CUDA the bench runs ONE rank on one GPU, in the calling process, over NCCL: NCCL refuses
two ranks on one GPU ("Duplicate GPU detected"), and gloo implements only broadcast and
all-reduce for CUDA tensors (torch.distributed's backend table), not the all-gather and
reduce-scatter FSDP2 and Cephalo need. One rank's collectives are copies, so what the GPU
run compares is each engine's single-GPU compute at the same model size: step time, useful
TFLOP/s and MFU.

Memory on CUDA: torch's allocator counts every byte exactly (`max_memory_allocated`), and a
contender's state does not move while the others step, so each contender is measured where
it is built: the peak of its build and first two steps above what was allocated before the
build (the other contenders' state). No second build is needed: a gpt-1.3b contender holds
~23 GB (fp32 weights, gradients and Adam moments), and its seeded initialisation draws 1.4
billion numbers on one CPU core (torch's CPU generator is serial: ~27 s on the development
machine). For the same reason the units are drawn once per process and copied for every
later contender (`UnitCache`): a copy is bit for bit what `build_unit` would draw again.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import datetime
import gc
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import cephalo.trainer.engine as engine_module
from cephalo.api.models import ModelConfig
from cephalo.planner.cost.catalog import GPU_CATALOG
from cephalo.trainer.device_info import device_facts
from cephalo.trainer.models import build_unit
from cephalo.trainer.spawn import free_port
from cephalo.trainer.torch_memory import live_bytes_peak

# Ranks per device kind: two gloo processes share the CPU; a GPU takes one NCCL rank.
WORLD_SIZES = {"cpu": 2, "cuda": 1}
# The model a GPU run trains unless --preset says otherwise (--quick: the tiny CPU model).
CUDA_DEFAULT_PRESET = "gpt-1.3b"
# The contenders of a full GPU run unless --contenders says otherwise: every contender keeps
# its own state on the one GPU (gpt-1.3b: ~23 GB each; all 56 of a 24-layer model would need
# 1.3 TB). Cephalo with and without recompute against FSDP2's default and its usual
# gradient-accumulation variant.
CUDA_CONTENDERS = ("cephalo recompute", "cephalo keep", "fsdp2 per-microbatch",
                   "fsdp2 no-sync")
# Steps each contender takes inside its CUDA memory measurement (before the timed rounds).
MEASURED_STEPS = 2


def world_size_for(device: str) -> int:
    return WORLD_SIZES[device]


def torch_device(device: str) -> torch.device:
    return torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")


def missing_device(device: str) -> str | None:
    """Why `device` cannot run here (one line), or None."""
    if device == "cuda" and not torch.cuda.is_available():
        return "--device cuda needs a CUDA GPU; this machine has none (torch " \
               f"{torch.__version__} sees no CUDA device)"
    return None


def run_single_gpu(worker: Callable[..., Any], *args: Any,
                   timeout_seconds: float = 600.0) -> list[Any]:
    """`worker(0, 1, *args)` as the one NCCL rank on GPU 0, in this process (the results
    list `spawn_ranks` would return)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    # Several contenders' ~23 GB states and their differently sized transients share one
    # GPU: growable segments keep the cache from fragmenting (allocated bytes, what is
    # measured, are the same either way). Read when CUDA first initialises, i.e. below.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    device = torch_device("cuda")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device,
                            timeout=datetime.timedelta(seconds=timeout_seconds))
    try:
        return [worker(0, 1, *args)]
    finally:
        dist.destroy_process_group()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU, where work runs as it is issued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- CPU memory (two measures; tracemalloc cannot see tensor storage) ---------------------
def _rss_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _release_freed_memory() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: a looser baseline
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_memory_kib(run: Callable[[], None]) -> tuple[int, int]:
    """(Peak RSS above the pre-run RSS, the process's peak RSS) while `run` runs."""
    _release_freed_memory()
    dist.barrier()
    before = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # reset VmHWM to the current RSS
    run()
    peak = _rss_kib("VmHWM")
    return peak - before, peak


def peak_allocated_bytes(run: Callable[[], None]) -> int:
    """Peak of the bytes torch allocates (net of frees) in this rank while `run` runs; gloo's
    worker threads included (their work carries the caller's profiler state: FSDP2's
    collectives allocate there)."""
    gc.collect()  # the previous contender's cycles: freed before, not during, the profile
    dist.barrier()
    return live_bytes_peak(run)


# ---- CUDA memory ----------------------------------------------------------------------------
def measured_build(build: Callable[[], Any], warm_up: Callable[[Any], object],
                   device: torch.device) -> tuple[Any, int]:
    """(`build()`, the peak CUDA bytes allocated by it and `warm_up(built)` above those
    allocated before it)."""
    gc.collect()  # a previous contender's cycles: freed before, not during, the measure
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    built = build()
    warm_up(built)
    synchronize(device)
    return built, torch.cuda.max_memory_allocated(device) - before


class UnitCache:
    """`build_unit` drawn once per (model, unit, seed) and copied for every later caller.
    `installed()` makes the engine's constructor use it too, for the duration."""

    def __init__(self) -> None:
        self._units: dict[tuple[str, int, int | None], nn.Module] = {}

    def build_unit(self, config: ModelConfig, index: int, seed: int | None = None
                   ) -> nn.Module:
        key = (config.architecture_key(), index, seed)
        if key not in self._units:
            self._units[key] = build_unit(config, index, seed)
        return copy.deepcopy(self._units[key])  # the engine flattens and frees its copy

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        original = engine_module.build_unit
        engine_module.build_unit = self.build_unit
        try:
            yield
        finally:
            engine_module.build_unit = original


def device_peak(device: torch.device, precision: str) -> tuple[str, float | None]:
    """(The device's name, its dense peak FLOP/s per device at `precision`, or None: CPUs
    and GPUs outside the catalog). The planner's catalog (`GpuType.peak_flops`, the vendors'
    dense figures) is the source: fp32 is the CUDA-core rate (PyTorch leaves TF32 off and
    Cephalo never turns it on), bf16 the tensor-core rate autocast runs its matmuls at."""
    facts = device_facts(device)
    if device.type != "cuda":
        return facts.device_name, None
    gpu = GPU_CATALOG.get(facts.product)
    return facts.device_name, (gpu.peak_flops(precision) if gpu is not None else None)


def throughput(flops_per_step: float, step_seconds: dict[str, float], num_devices: int,
               peak_flops: float | None) -> tuple[dict[str, float], dict[str, float] | None]:
    """Per contender: useful TFLOP/s of the whole run (model FLOPs of the global batch, from
    `ModelConfig.training_flops_per_sample` as `bench/engine_overhead.py` counts them:
    recompute not counted) and its MFU (that rate over the devices' peak; None without a
    peak)."""
    tflops = {name: flops_per_step / seconds / 1e12 for name, seconds in step_seconds.items()}
    if peak_flops is None:
        return tflops, None
    return tflops, {name: t * 1e12 / (num_devices * peak_flops) for name, t in tflops.items()}
