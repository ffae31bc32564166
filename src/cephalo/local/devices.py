"""Local devices for `cephalo run`: CUDA GPUs (one rank each, NCCL) or CPU ranks (gloo),
optionally emulating catalog GPUs on CPU ranks (`--emulate`)."""

from __future__ import annotations

import ctypes
import os
import re
import sys
from dataclasses import dataclass

from cephalo.errors import CephaloError
from cephalo.planner.cost.catalog import lookup_gpu


class DeviceError(CephaloError, ValueError):
    """A device selection that cannot work on this machine; the message says what to use."""


@dataclass(frozen=True)
class LocalDevice:
    kind: str  # "cpu" or "cuda"
    index: int  # CUDA ordinal, or the CPU rank's number
    product: str  # catalog name the plan uses ("cpu", "A10G", or the emulated GPU)
    emulated: bool = False

    @property
    def label(self) -> str:
        if self.emulated:
            return f"cpu:{self.index} emulating {self.product}"
        return f"{self.kind}:{self.index} ({self.product})"


def cuda_driver_missing() -> bool:
    """True where no CUDA GPU can be visible, known without importing torch (~2 s of CPU,
    paid by `cephalo run` on every machine without a GPU before this): on Linux, torch finds
    GPUs through the driver's libcuda.so.1, so where it cannot be loaded there are none.
    False where that cannot be told (another OS): then torch is asked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return True
    return False


def cuda_products() -> list[str]:
    """Catalog names of the visible CUDA GPUs, in ordinal order (empty without CUDA)."""
    if cuda_driver_missing():
        return []
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    from cephalo.trainer.device_info import device_facts

    return [device_facts(torch.device("cuda", i)).product
            for i in range(torch.cuda.device_count())]


def select_devices(devices: str | None, emulate: str | None,
                   gpus: list[str] | None = None) -> list[LocalDevice]:
    """Parse `--devices` (cpu:N | cuda | cuda:0,2) and `--emulate A6000,L4,…`."""
    names = [lookup_gpu(n.strip()).name for n in emulate.split(",") if n.strip()] \
        if emulate else []
    if emulate is not None and not names:
        raise DeviceError("--emulate needs GPU names, e.g. --emulate RTX-A6000,L4,L4,P40")
    if devices is None:
        gpus = cuda_products() if gpus is None and not names else (gpus or [])
        devices = "cuda" if gpus and not names else f"cpu:{len(names) or 2}"
    match = re.fullmatch(r"cpu(?::(\d+))?", devices)
    if match:
        count = int(match.group(1) or (len(names) or 2))
        if count < 1:
            raise DeviceError("--devices cpu:N needs N >= 1")
        cores = os.cpu_count() or 1
        if count > 4 * cores:
            raise DeviceError(f"--devices cpu:{count} asks for {count} ranks on {cores} cores; "
                              f"use at most {4 * cores}")
        if names and len(names) != count:
            raise DeviceError(f"--emulate names {len(names)} GPUs but --devices gives {count} "
                              f"CPU ranks; give one GPU name per rank")
        if names:
            return [LocalDevice("cpu", i, n, emulated=True) for i, n in enumerate(names)]
        return [LocalDevice("cpu", i, "cpu") for i in range(count)]
    if names:
        raise DeviceError("--emulate runs on CPU ranks only (use --devices cpu:N or omit it)")
    match = re.fullmatch(r"cuda(?::([\d,]+))?", devices)
    if not match:
        raise DeviceError(f"--devices {devices!r}: use cpu:N, cuda, or cuda:0,1")
    gpus = cuda_products() if gpus is None else gpus
    if not gpus:
        raise DeviceError("--devices cuda: no CUDA GPU is visible here; use --devices cpu:N")
    wanted = [int(i) for i in match.group(1).split(",")] if match.group(1) \
        else list(range(len(gpus)))
    bad = [i for i in wanted if i >= len(gpus)]
    if bad:
        raise DeviceError(f"--devices asks for GPU {bad[0]} but only {len(gpus)} GPU(s) exist "
                          f"(cuda:0..{len(gpus) - 1})")
    if len(set(wanted)) != len(wanted):
        raise DeviceError(f"--devices lists a GPU twice: {devices}")
    return [LocalDevice("cuda", i, gpus[i]) for i in wanted]
