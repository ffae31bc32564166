"""Compute precisions: autocast per rank, what a device can run, and the job's loss scale.

A rank computes in fp32, bf16 or fp16 (its plan entry's `precision`, else the job's
`spec.precision`); every rank keeps fp32 master weights, gathers and reduces fp32 (the
collectives do not depend on the mix). fp16's narrow range needs **dynamic loss scaling**:
an fp16 rank multiplies its loss by the job's one scale S, so its gradients are S x the true
ones, and divides them by S before its reduce-scatter, so the reduced gradient is the true
sum whatever mix of ranks contributed to it. Any non-finite value in any rank's gradient
lands, by the reduce-scatter's sum, in its owner's shard, so the global squared norm the
end-of-step all-reduce already carries is non-finite exactly when some rank overflowed
(or the fp32 sum itself did): every rank sees the same verdict from the same all-reduce,
skips the optimizer step together and updates the same scale (`LossScaler`, the semantics
of `torch.amp.GradScaler`). The scale is job-wide state, saved in meta.json.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import TypedDict

import torch

from cephalo.errors import CephaloError

PRECISIONS = ("fp32", "bf16", "fp16")
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class PrecisionError(CephaloError, ValueError):
    """A precision this device cannot run (or runs far slower than fp32)."""


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 or fp16 autocast (fp32 master weights stay untouched), nothing for fp32."""
    dtype = _AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def autocast_engages(device: torch.device, precision: str) -> bool:
    """True when torch's autocast really runs `precision` on this kind of device (torch
    turns an unsupported autocast dtype into a warning and fp32, silently slower)."""
    if precision == "fp32":
        return True
    if not torch.amp.is_autocast_available(device.type):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with autocast(device, precision):
            return torch.is_autocast_enabled(device.type) and \
                torch.get_autocast_dtype(device.type) == _AUTOCAST_DTYPES[precision]


def precision_problem(precision: str, device_type: str, capability: tuple[int, int] | None,
                      engages: bool) -> str | None:
    """Why `precision` should not run on this device, or None. Pure (the caller probes the
    device): `capability` is a CUDA device's compute capability (None elsewhere)."""
    if precision not in PRECISIONS:
        return f"precision {precision!r} is not one of {', '.join(PRECISIONS)}"
    if precision == "fp32":
        return None
    if not engages:
        return (f"{precision} autocast does not run on {device_type} devices with torch "
                f"{torch.__version__}; use precision fp32")
    # Consumer Pascal (6.1: P40, P4, GTX 10xx) runs fp16 arithmetic at 1/64 of fp32, and
    # Maxwell before 5.3 has none: fp16 there is a 64x slowdown, not a speed-up.
    if device_type == "cuda" and capability is not None and precision == "fp16" and \
            (capability == (6, 1) or capability < (5, 3)):
        major, minor = capability
        return (f"fp16 on this GPU (compute capability {major}.{minor}) runs at a small "
                "fraction of fp32 speed; use precision fp32 (or auto) for it")
    return None


def precision_notice(precision: str, device_type: str, capability: tuple[int, int] | None
                     ) -> str | None:
    """A one-line warning or note on how `precision` runs on this device, or None. Pure.

    * bf16 below compute capability 8.0 (V100, T4) has no bf16 tensor cores: torch emulates
      it at about fp32 speed. It runs correctly, so it is not refused (the planner plans it
      at that speed and warns in the plan, docs/precision.md), but the rank says so and
      names fp16, which runs on those GPUs' tensor cores.
    * fp32 from 8.0 on: Cephalo computes fp32 as IEEE fp32 on CUDA cores, TF32 off for
      matmuls and convolutions (`pin_fp32_math`), which is what the catalog's fp32 peak
      (cephalo.planner.cost.catalog, the CUDA-core rate) assumes; the note says so and that
      bf16 runs on the tensor cores."""
    if device_type != "cuda" or capability is None:
        return None
    major, minor = capability
    if precision == "bf16" and capability < (8, 0):
        return (f"warning: bf16 on this GPU (compute capability {major}.{minor}) has no bf16 "
                "tensor cores and is emulated at about fp32 speed; use precision fp16 (its "
                "tensor cores, with loss scaling) or auto, which picks fp16 here")
    if precision == "fp32" and capability >= (8, 0):
        return (f"note: fp32 on this GPU (compute capability {major}.{minor}) is IEEE fp32 on "
                "CUDA cores, TF32 off for matmuls and convolutions (the catalog's fp32 "
                "peak); bf16 or auto runs on its tensor cores")
    return None


def pin_fp32_math() -> None:
    """fp32 means IEEE fp32 in every op: TF32 off for CUDA matmuls (torch's default too)
    and for cuDNN convolutions (torch's default there is on: a ViT's patch embedding would
    run in TF32). Profiles, plans and training then compute fp32 alike, at the rate the
    catalog's fp32 peak states. Set by every process that measures or trains."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def check_precision(device: torch.device, precision: str) -> str | None:
    """Raise a one-line PrecisionError when `device` cannot run `precision` usefully;
    return `precision_notice`'s line (for the caller to print), if any."""
    capability = torch.cuda.get_device_capability(device) \
        if device.type == "cuda" and torch.cuda.is_available() else None
    problem = precision_problem(precision, device.type, capability,
                                autocast_engages(device, precision))
    if problem is not None:
        raise PrecisionError(problem)
    return precision_notice(precision, device.type, capability)


class LossScaleState(TypedDict):
    scale: float
    growth_tracker: int  # good steps in a row since the last change of scale


@dataclass
class LossScaler:
    """The job's dynamic loss scale, `torch.amp.GradScaler`'s defaults and update rule:
    an overflow halves the scale and restarts the count; `growth_interval` good steps in a
    row double it (unless that would overflow fp32). Identical on every rank: each updates
    it from the same all-reduced verdict."""

    scale: float = 2.0 ** 16
    growth_tracker: int = 0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = torch.tensor(self.scale * self.growth_factor, dtype=torch.float32)
            if bool(torch.isfinite(grown)):  # as GradScaler: never grow into inf
                self.scale = float(grown)
            self.growth_tracker = 0

    def state_dict(self) -> LossScaleState:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: LossScaleState) -> None:
        scale, tracker = float(state["scale"]), int(state["growth_tracker"])
        if not (scale > 0 and scale != float("inf")) or tracker < 0:
            raise ValueError(f"loss scale state {state} is not a positive finite scale and "
                             "a non-negative count")
        self.scale, self.growth_tracker = scale, tracker
