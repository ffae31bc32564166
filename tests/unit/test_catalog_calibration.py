"""The catalog's estimates against the Cephalo authors' measurements (issue 15, item 3).

Reads `bench/reference/authors_measured/` (the authors' real per-layer times and compute
memory on the paper's GPUs, vendored from their repository) and compares the *estimated*
profile the planner uses when nothing was profiled. Per GPU type it reports the error of
the per-layer training time (forward + recompute + backward, per sample, m = 1…8) for each
of the paper's six models; the target is ≤ 20 % per GPU type (median over the models),
with no model off by more than 40 %. Run with `-s` to see the table.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cephalo.planner.cost.authors_profiles import (
    AUTHORS_GPUS,
    AUTHORS_MODELS,
    MissingMeasurement,
    authors_profile,
    layer_times_ms,
    measured_entry,
    memory_gib,
)
from cephalo.planner.cost.catalog import lookup_gpu
from cephalo.planner.cost.estimate import estimate_profile

# Vendored with its licence and provenance (bench/reference/authors_measured/README.md).
REFERENCE = Path(__file__).resolve().parents[2] / "bench" / "reference" / "authors_measured"
MICRO = np.arange(1, 9)
TARGET, WORST = 0.20, 0.40


@cache
def _data() -> tuple[dict[str, Any], dict[str, Any]]:
    return (json.loads((REFERENCE / "model_latencies.json").read_text()),
            json.loads((REFERENCE / "model_memory.json").read_text()))


def _measured_seconds(model: str, gpu: str, precision: str) -> np.ndarray:
    """Per-sample seconds of one layer as this engine runs it: forward, then the backward
    pass's recompute of the forward and the backward itself."""
    forward, backward = layer_times_ms(measured_entry(_data()[0], model, gpu, precision))
    return (2 * forward + backward) / MICRO * 1e-3


def _estimated_seconds(model: str, gpu: str, precision: str) -> np.ndarray:
    profile = estimate_profile(lookup_gpu(AUTHORS_GPUS[gpu]), AUTHORS_MODELS[model], precision)
    return np.array([(p.block_forward_seconds + p.block_backward_seconds) / p.micro_batch_size
                     for p in profile.points])


def calibration_errors(precision: str) -> dict[str, dict[str, float]]:
    """{catalog GPU: {model: mean |estimate / measured - 1| over m = 1…8}}."""
    table: dict[str, dict[str, float]] = {}
    for gpu, name in AUTHORS_GPUS.items():
        for model in AUTHORS_MODELS:
            try:
                measured = _measured_seconds(model, gpu, precision)
            except MissingMeasurement:
                continue
            error = np.abs(_estimated_seconds(model, gpu, precision) / measured - 1)
            table.setdefault(name, {})[model.removeprefix("deepspeed")] = float(error.mean())
    return table


def _report(table: dict[str, dict[str, float]], precision: str) -> str:
    lines = [f"{precision}: estimate vs measured per-layer time (mean |error| over m=1..8)"]
    for gpu, errors in table.items():
        values = list(errors.values())
        lines.append(f"  {gpu:<15} median {np.median(values):5.1%}  mean {np.mean(values):5.1%}"
                     f"  worst {max(values):5.1%}  " +
                     " ".join(f"{m}={e:.0%}" for m, e in errors.items()))
    return "\n".join(lines)


def test_fp32_estimate_is_within_20_percent_per_gpu_type() -> None:
    table = calibration_errors("fp32")
    print("\n" + _report(table, "fp32"))
    # Every GPU type of the paper's two clusters is measured, each on all six models.
    for gpu in ("RTX-A6000", "L4", "P40", "P100", "A10G", "V100-16GB", "T4"):
        assert len(table[gpu]) == 6, (gpu, table[gpu])
    for gpu, errors in table.items():
        assert np.median(list(errors.values())) <= TARGET, (gpu, errors)
        assert max(errors.values()) <= WORST, (gpu, errors)


def test_bf16_estimate_on_tensor_core_gpus() -> None:
    # The authors' fp16 runs stand for bf16 (same tensor-core rate); their GPT fp16 blocks
    # are 1.5-2x slower per FLOP than their Llama/ViT ones on A6000 and L4, which no
    # FLOP-based estimate can know. bf16 is not the paper's precision (its figures are fp32):
    # the bound is looser, 30 % on the median.
    table = {gpu: errors for gpu, errors in calibration_errors("bf16").items()
             if lookup_gpu(gpu).bf16_tflops}
    print("\n" + _report(table, "bf16"))
    assert {"RTX-A6000", "L4", "A10G", "A100-40GB", "H100-NVL"} <= set(table)
    for gpu, errors in table.items():
        assert np.median(list(errors.values())) <= 0.30, (gpu, errors)


def test_small_microbatches_are_nearly_as_efficient_in_fp32() -> None:
    # Authors: per-sample time at m = 1 within ~5 % of m = 8 (V100, GPT-6.7B: 17.3 vs 17.4 ms
    # forward); the estimate used to charge 2.4x at m = 1.
    measured = _measured_seconds("deepspeedgpt_6.7b", "v100x16", "fp32")
    assert measured[0] / measured[7] == pytest.approx(1.0, abs=0.06)
    for model in AUTHORS_MODELS:
        estimated = _estimated_seconds(model, "a6000", "fp32")
        assert 1.0 <= estimated[0] / estimated[7] <= 1.12, model


def test_relative_speeds_match_the_measured_ones() -> None:
    # Speed relative to the A6000 on GPT-2.7B (authors): L4 0.44, V100 0.80, P100 0.38,
    # A10G 0.92. The estimate keeps each within 20 %.
    model = "deepspeedgpt_2.7b"
    a6000 = _estimated_seconds(model, "a6000", "fp32").mean()
    a6000_measured = _measured_seconds(model, "a6000", "fp32").mean()
    for gpu in ("l4", "v100x16", "p100", "a10g"):
        estimated = a6000 / _estimated_seconds(model, gpu, "fp32").mean()
        measured = a6000_measured / _measured_seconds(model, gpu, "fp32").mean()
        assert estimated == pytest.approx(measured, rel=0.20), gpu


# (model, cluster whose memory was profiled at the paper's input size, bounds of the
# estimated / measured compute-memory slope per sample). The estimate used to be 1.3-5x too
# high (GPT-2.7B 1.3x, GPT-6.7B 1.6x, Llama-3B 3.6x, Llama-7B 5.0x, ViT-e 3.7x). GPT: the
# loss's logits dominate. Llama: the authors' runs hold less than one fp32 logits copy per
# sample where this engine's cross-entropy holds three; an estimate that must not
# under-estimate memory (an OOM costs more than a smaller microbatch) keeps them: 2.2-3x.
# (`paper` ViT-G was profiled at 224 px; `paper_4gpu` holds the 384 px one.)
MEMORY_CASES = [
    ("deepspeedgpt_2.7b", "paper", 0.8, 1.15), ("deepspeedgpt_6.7b", "aws-16gpu", 0.8, 1.15),
    ("deepspeedllama_3b", "paper", 1.0, 3.1), ("deepspeedllama_7b", "aws-16gpu", 1.0, 3.1),
    ("deepspeedvit_g", "paper_4gpu", 0.75, 1.3), ("deepspeedvit_e", "paper", 0.75, 1.3)]


@pytest.mark.parametrize("model,cluster,low,high", MEMORY_CASES)
def test_compute_memory_slope(model: str, cluster: str, low: float, high: float) -> None:
    gib = memory_gib(_data()[1], cluster, model, "fp32")
    measured = np.polyfit(np.arange(1, len(gib) + 1), gib, 1)[0] * 2**30
    profile = estimate_profile(lookup_gpu("A10G"), AUTHORS_MODELS[model], "fp32")
    points = profile.points
    estimated = (points[-1].compute_memory_bytes - points[0].compute_memory_bytes) / (
        points[-1].micro_batch_size - points[0].micro_batch_size)
    print(f"\n{model} memory slope: estimated {estimated / 2**30:.3f} GiB/sample, "
          f"measured {measured / 2**30:.3f}")
    assert low <= estimated / measured <= high


def test_authors_profile_converts_every_paper_gpu() -> None:
    latencies, memory = _data()
    for gpu in ("a6000", "l4", "p40", "p100"):
        profile = authors_profile(latencies, memory, model="deepspeedgpt_2.7b", gpu=gpu,
                                  cluster="paper")
        forward, backward = layer_times_ms(measured_entry(latencies, "deepspeedgpt_2.7b",
                                                          gpu, "fp32"))
        first = profile.points[0]
        assert first.block_forward_seconds == pytest.approx(forward[0] * 1e-3)
        assert first.block_backward_seconds == pytest.approx((forward[0] + backward[0]) * 1e-3)
        assert first.compute_memory_bytes == pytest.approx(
            (memory_gib(memory, "paper", "deepspeedgpt_2.7b", "fp32")[0] + 2) * 2**30, rel=1e-9)
        assert profile.product == AUTHORS_GPUS[gpu] and profile.source == "measured"


def test_vendored_data_is_the_authors_bytes_under_their_licence() -> None:
    """The copies are unchanged (the README's checksums, taken from the authors' commit) and
    carry the MIT notice the licence requires with every copy."""
    import hashlib
    import re

    readme = (REFERENCE / "README.md").read_text()
    sums = {name: digest for digest, name in
            re.findall(r"^([0-9a-f]{64})  (\S+)$", readme, flags=re.MULTILINE)}
    assert set(sums) == {"model_latencies.json", "model_memory.json", "LICENSE"}
    for name, digest in sums.items():
        assert hashlib.sha256((REFERENCE / name).read_bytes()).hexdigest() == digest, name
    licence = (REFERENCE / "LICENSE").read_text()
    assert licence.startswith("MIT License\n\nCopyright (c) 2025 Benson Guo\n")
    assert "a8c75d3ca8b54fbc3578d9a4cdce8a7f86a0ad0c" in readme
