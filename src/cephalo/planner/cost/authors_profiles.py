"""The Cephalo authors' measured per-layer data as this project's GpuProfiles (pure).

The authors' repository (`data/model_latencies.json`, `data/model_memory.json`; vendored
with its MIT licence in `bench/reference/authors_measured/`) holds real measurements on the
paper's GPUs.
This module turns one (model, GPU) entry into a `GpuProfile`, so that the planner can plan
the paper's clusters from what was actually measured, and so that the catalog's estimates can
be checked against it. It takes the parsed JSON (dicts), never reads files itself.

Conversions (the authors' format is described in that folder's README):

* times are ms per transformer layer for microbatch m; a value is either two linear fits
  `[[slope_f, icpt_f], [slope_b, icpt_b]]` or `[fit_f, fit_b, per_m_f, per_m_b]` with
  measured per-m arrays, which are preferred (a fit is used for m beyond them);
* the authors' backward is the layer's backward alone, while this engine's block backward
  re-runs the forward first (activation recompute): block_backward = forward + backward;
* embedding + head are not measured separately (the authors' cost model leaves them out):
  they are charged at the block's measured FLOP rate on the same GPU, i.e. the block forward
  time scaled by the FLOP ratio, backward twice the forward;
* compute memory is the authors' profiled GiB per m plus the fixed 2 GiB they add for
  communication buffers; sizes they did not profile follow the least-squares line;
* `float16` measurements stand for this engine's bf16 (the same tensor-core rate).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from cephalo.api.memory import STATE_BYTES_PER_PARAMETER
from cephalo.api.models import ModelConfig, preset
from cephalo.api.profile import GpuProfile, ProfilePoint, model_key
from cephalo.planner.cost.catalog import GpuType, lookup_gpu

GIB = 1024**3
COMMUNICATION_BUFFER_BYTES = 2 * GIB  # what the authors add to their profiled memory

# The authors' GPU keys → catalog names. `v100x16` are AWS p3 boards (SXM2);
# `v100-pciex16` is the PCIe board; the paper's P100s are PCIe.
AUTHORS_GPUS: dict[str, str] = {
    "a6000": "RTX-A6000", "l4": "L4", "p40": "P40", "p100": "P100", "a10g": "A10G",
    "v100x16": "V100-16GB", "v100x32": "V100-32GB", "v100-pciex16": "V100-PCIe-16GB",
    "t4": "T4", "l40s": "L40S", "a100x40": "A100-40GB", "a100x80": "A100-80GB",
    "h100-nvl": "H100-NVL",
}


def _vit_e() -> ModelConfig:
    # ViT-e as the authors profiled it: 384 px in 16 px patches (577 tokens), which their
    # parameter count (3,806,319,105 with a 1-output head) pins down exactly.
    return preset("vit-e").model_copy(update={"image_size": 384, "patch_size": 16})


# The models of the paper's evaluation (the `deepspeed*` entries) → this project's configs.
AUTHORS_MODELS: dict[str, ModelConfig] = {
    "deepspeedgpt_2.7b": preset("gpt-2.7b"),
    "deepspeedgpt_6.7b": preset("gpt-6.7b"),
    "deepspeedllama_3b": preset("llama-3b"),
    "deepspeedllama_7b": preset("llama-7b"),
    "deepspeedvit_g": preset("vit-g"),
    "deepspeedvit_e": _vit_e(),
}

PRECISIONS = {"fp32": "float32", "bf16": "float16"}


class MissingMeasurement(KeyError):
    """The authors did not measure this (model, GPU, precision)."""


def layer_times_ms(entry: Any, max_micro_batch: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) ms of one layer for m = 1 … max_micro_batch from one entry."""
    if not isinstance(entry, list) or len(entry) not in (2, 4) or \
            not all(isinstance(x, list) for x in entry):
        raise MissingMeasurement("not a per-microbatch entry (a bare number or pair)")
    m = np.arange(1, max_micro_batch + 1, dtype=np.float64)
    (sf, cf), (sb, cb) = entry[0], entry[1]
    # A fit with a negative intercept would go below zero at small m: use its slope there.
    forward = np.where(sf * m + cf > 0, sf * m + cf, sf * m)
    backward = np.where(sb * m + cb > 0, sb * m + cb, sb * m)
    if len(entry) == 4:  # measured per-m arrays win where they exist
        for out, measured in ((forward, entry[2]), (backward, entry[3])):
            k = min(len(measured), max_micro_batch)
            out[:k] = measured[:k]
    return forward, backward


def measured_entry(latencies: Mapping[str, Any], model: str, gpu: str, precision: str,
                   sequence_length: int = 512) -> Any:
    try:
        return latencies[model][gpu][str(sequence_length)][PRECISIONS[precision]]
    except KeyError:
        raise MissingMeasurement(f"{model} on {gpu} in {precision}") from None


def memory_gib(memory: Mapping[str, Any], cluster: str, model: str,
               precision: str) -> list[float]:
    """The authors' profiled compute memory (GiB) for m = 1, 2, … (without their 2 GiB)."""
    try:
        return list(memory[cluster][model]["profiled_compute_memory"][PRECISIONS[precision]])
    except KeyError:
        raise MissingMeasurement(f"memory of {model} on cluster {cluster} in {precision}") \
            from None


def authors_profile(latencies: Mapping[str, Any], memory: Mapping[str, Any], *, model: str,
                    gpu: str, cluster: str, precision: str = "fp32",
                    config: ModelConfig | None = None,
                    micro_batch_sizes: range = range(1, 9)) -> GpuProfile:
    """The GpuProfile (source 'measured') of `model` on the authors' `gpu`, with the compute
    memory profiled for `cluster` ('paper' is Cluster A, 'aws-16gpu' Cluster B)."""
    config = config or AUTHORS_MODELS[model]
    gpu_type: GpuType = lookup_gpu(AUTHORS_GPUS[gpu])
    top = max(micro_batch_sizes)
    forward_ms, backward_ms = layer_times_ms(
        measured_entry(latencies, model, gpu, precision, config.sequence_length or 512), top)
    gib = memory_gib(memory, cluster, model, precision)
    sizes = np.arange(1, len(gib) + 1, dtype=np.float64)
    slope, intercept = np.polyfit(sizes, gib, 1) if len(gib) > 1 else (0.0, gib[0])
    other_ratio = config.other_forward_flops() / config.block_forward_flops()
    points = []
    for m in micro_batch_sizes:
        forward = float(forward_ms[m - 1]) * 1e-3
        backward = float(backward_ms[m - 1]) * 1e-3
        used = gib[m - 1] if m <= len(gib) else intercept + slope * m
        points.append(ProfilePoint(
            micro_batch_size=m, block_forward_seconds=forward,
            block_backward_seconds=forward + backward,
            other_forward_seconds=forward * other_ratio,
            other_backward_seconds=2 * forward * other_ratio,
            compute_memory_bytes=int(used * GIB + COMMUNICATION_BUFFER_BYTES)))
    adam = 2 * STATE_BYTES_PER_PARAMETER / (gpu_type.memory_bandwidth_gbps * 1e9)
    return GpuProfile(product=gpu_type.name, device_name=f"authors' {gpu}",
                      memory_capacity_bytes=gpu_type.memory_bytes, source="measured",
                      model_key=model_key(config.architecture_key(), precision),
                      precision=precision,  # type: ignore[arg-type]
                      points=points, optimizer_seconds_per_parameter=adam)
