"""`precision: auto` on the planner's side (issue 36): the catalog's fp16 rates and the rule
for each GPU's fastest precision (held against the authors' fp16 and fp32 measurements), the
plan's per-rank precisions, profiles per precision, the warnings for a forced precision a GPU
cannot run fast, and the issue's target on Cluster B."""

from __future__ import annotations

import importlib.util
import json
import re
from functools import cache
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from cephalo.api import ClusterSpec, GpuGroup, parse_job
from cephalo.api.job import CephaloJob, CephaloJobSpec
from cephalo.api.plan import parse_plan
from cephalo.cli import main
from cephalo.operator.render import profile_config_map_name
from cephalo.planner import estimate_profile, solve
from cephalo.planner.cost.authors_profiles import (
    AUTHORS_GPUS,
    AUTHORS_MODELS,
    MissingMeasurement,
    layer_times_ms,
    measured_entry,
)
from cephalo.planner.cost.catalog import (
    GPU_CATALOG,
    fastest_precision,
    lookup_gpu,
    rank_compute_precision,
)
from cephalo.planner.search.problem import ProfileMismatchError

REPO = Path(__file__).resolve().parents[2]
# Every GPU given is used (the planner would leave most idle for so small a model).
TINY = {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 32, "planner": {"chooseGpus": False}}


def _spec(precision: str, **extra: object) -> CephaloJobSpec:
    return parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                      "metadata": {"name": "j"},
                      "spec": {**TINY, "precision": precision, **extra}}).spec


def _cluster(*groups: tuple[str, int], gbit: float = 100.0) -> ClusterSpec:
    return ClusterSpec(groups=[GpuGroup(product=g, count=n) for g, n in groups],
                       network_bandwidth_bytes_per_second=gbit * 1e9 / 8)


# ---- the catalog --------------------------------------------------------------------------

def test_fp16_peaks_and_compute_capabilities_of_the_older_gpus() -> None:
    v100, t4, p100, p40 = (lookup_gpu(n) for n in ("V100-16GB", "T4", "P100", "P40"))
    assert (v100.fp32_tflops, v100.fp16_tflops, v100.compute_capability) == (15.7, 125.0, (7, 0))
    assert (t4.fp32_tflops, t4.fp16_tflops, t4.compute_capability) == (8.1, 65.0, (7, 5))
    assert p100.fp16_tflops == pytest.approx(2 * p100.fp32_tflops, rel=0.01)
    assert p40.fp16_tflops == pytest.approx(p40.fp32_tflops / 64, rel=0.05)
    # The engine's fp16 on V100 and T4 runs on tensor cores; Pascal's torch fp16 matmuls
    # accumulate in fp32: fp32 speed whatever the native fp16 rate.
    assert v100.peak_flops("fp16") == 125e12 and t4.peak_flops("fp16") == 65e12
    assert p100.peak_flops("fp16") == p100.peak_flops("fp32")
    assert p40.peak_flops("fp16") == p40.peak_flops("fp32")
    for name in ("A10G", "L4", "RTX-A6000", "A100-80GB", "H100", "H200"):
        gpu = lookup_gpu(name)
        assert gpu.peak_flops("fp16") == gpu.peak_flops("bf16") > gpu.peak_flops("fp32")


def test_fastest_precision_follows_compute_capability() -> None:
    for gpu in GPU_CATALOG.values():
        cc = gpu.compute_capability
        expected = ("fp32" if cc is None or cc < (7, 0) else "fp16" if cc < (8, 0)
                    else "bf16")
        assert fastest_precision(gpu) == expected, (gpu.name, cc)
        assert gpu.peak_flops("auto") == gpu.peak_flops(expected)


@cache
def _latencies() -> dict:
    path = REPO / "bench" / "reference" / "authors_measured" / "model_latencies.json"
    return json.loads(path.read_text())


def _fp32_over_fp16(gpu: str) -> list[float]:
    """Per model, the authors' measured fp32 / fp16 time of one layer (forward + recompute +
    backward, m = 1..8 summed): how much faster their fp16 ran."""
    ratios = []
    for model in AUTHORS_MODELS:
        try:
            times = [layer_times_ms(measured_entry(_latencies(), model, gpu, p))
                     for p in ("fp32", "bf16")]  # "bf16" reads their float16 runs
        except MissingMeasurement:
            continue
        fp32, fp16 = ((2 * f + b).sum() for f, b in times)
        ratios.append(float(fp32 / fp16))
    return ratios


@pytest.mark.parametrize("gpu,faster", [("v100x16", True), ("t4", True), ("p100", False),
                                        ("p40", False)])
def test_the_rule_matches_what_the_authors_measured(gpu: str, faster: bool) -> None:
    # V100 and T4 ran fp16 2-5x faster than fp32 (median over models); P100 and P40 at
    # 0.9-1.2x: 16-bit is not faster there, so auto keeps them in fp32.
    ratios = _fp32_over_fp16(gpu)
    assert len(ratios) >= 2, gpu
    assert bool(np.median(ratios) >= 2.0) == faster, (gpu, ratios)
    assert (fastest_precision(lookup_gpu(AUTHORS_GPUS[gpu])) == "fp16") is faster


def test_fp16_estimate_against_the_authors_fp16_runs() -> None:
    # The fp16 efficiencies of V100 and T4 were fitted to the authors' fp16 language-model
    # runs: the estimate's per-layer time within 40 % of theirs (median over the models).
    for gpu in ("v100x16", "t4"):
        errors = []
        for model in ("deepspeedgpt_2.7b", "deepspeedgpt_6.7b", "deepspeedllama_3b",
                      "deepspeedllama_7b"):
            try:
                f, b = layer_times_ms(measured_entry(_latencies(), model, gpu, "bf16"))
            except MissingMeasurement:
                continue
            measured = (2 * f + b) / np.arange(1, 9) * 1e-3
            points = estimate_profile(AUTHORS_GPUS[gpu], AUTHORS_MODELS[model], "fp16").points
            estimated = np.array([(p.block_forward_seconds + p.block_backward_seconds)
                                  / p.micro_batch_size for p in points])
            errors.append(float(np.mean(np.abs(estimated / measured - 1))))
        assert len(errors) >= 2 and np.median(errors) <= 0.40, (gpu, errors)


def test_sixteen_bit_activations_in_the_estimate() -> None:
    model = AUTHORS_MODELS["deepspeedgpt_2.7b"]
    memory = {p: estimate_profile("T4", model, p).points[-1].compute_memory_bytes
              for p in ("fp32", "bf16", "fp16")}
    assert memory["fp16"] == memory["bf16"] < memory["fp32"]
    auto = estimate_profile("T4", model, "auto")
    assert auto.precision == "fp16" and auto.points[-1].compute_memory_bytes == memory["fp16"]


# ---- plans --------------------------------------------------------------------------------

def test_auto_gives_each_rank_its_gpus_fastest_precision() -> None:
    plan = solve(_spec("auto"), _cluster(("V100-16GB", 2), ("A10G", 1), ("P40", 1)))
    assert plan.precision == "auto"
    by_gpu = {r.gpu: r.precision for r in plan.ranks}
    assert by_gpu == {"V100-16GB": "fp16", "A10G": "bf16", "P40": "fp32"}
    # The trainer reads it back from the JSON; a forced precision leaves ranks unset, so
    # those plans keep their bytes.
    assert parse_plan(json.loads(plan.to_json())).ranks[0].precision == "fp16"
    forced = solve(_spec("bf16"), _cluster(("V100-16GB", 2), ("A10G", 1)))
    assert all(r.precision is None for r in forced.ranks)
    written = json.loads(forced.to_json())
    assert written["precision"] == "bf16"
    assert not any("precision" in rank for rank in written["ranks"])


def test_what_a_rank_computes_in() -> None:
    # The plan's own figure first; a hand-written plan under auto resolves as the planner.
    assert rank_compute_precision("auto", "V100-16GB", "bf16") == "bf16"
    assert rank_compute_precision("auto", "Tesla-V100-SXM2-16GB") == "fp16"
    assert rank_compute_precision("auto", "cpu") == "fp32"
    assert rank_compute_precision("auto", "NVIDIA-GeForce-RTX-4090") == "fp32"
    assert rank_compute_precision("bf16", "V100-16GB") == "bf16"


def test_a_profile_must_be_in_the_precision_auto_assigns(tmp_path: Path) -> None:
    model = _spec("auto").model.resolve()
    cluster = _cluster(("V100-16GB", 2))
    fp32 = estimate_profile("V100-16GB", model, "fp32").model_copy(update={"source": "measured"})
    with pytest.raises(ProfileMismatchError, match=r"in auto: fp16 has"):
        solve(_spec("auto"), cluster, {"V100-16GB": fp32})
    fp16 = estimate_profile("V100-16GB", model, "fp16").model_copy(update={"source": "measured"})
    plan = solve(_spec("auto"), cluster, {"V100-16GB": fp16})
    assert [r.precision for r in plan.ranks] == ["fp16", "fp16"] and not plan.estimated_gpus


def test_the_operator_caches_each_gpu_in_the_precision_auto_assigns() -> None:
    def job(precision: str) -> CephaloJob:
        return parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                          "metadata": {"name": "j", "namespace": "ns"},
                          "spec": {**TINY, "precision": precision}})

    for product, precision in (("V100-16GB", "fp16"), ("A10G", "bf16"), ("P40", "fp32")):
        assert profile_config_map_name(product, job("auto")) == \
            profile_config_map_name(product, job(precision))
    assert profile_config_map_name("V100-16GB", job("auto")) != \
        profile_config_map_name("V100-16GB", job("fp32"))


@pytest.mark.parametrize("precision,gpus,warned", [
    ("bf16", ("V100-16GB", "T4"), r"bf16 is emulated at fp32 speed on V100-16GB \(compute "
                                  r"capability 7\.0.*fp16, \d\.\dx faster"),
    ("bf16", ("P40",), r"bf16 is emulated at fp32 speed on P40 .*in fp32"),
    ("fp16", ("P40",), r"fp16 runs at fp32 speed on P40 \(compute capability 6\.1: no fp16 "
                       r"tensor cores; native fp16 peaks at 0\.18 TFLOPS against 11\.76"),
    ("fp16", ("P100",), r"fp16 runs at fp32 speed on P100"),
])
def test_a_forced_precision_a_gpu_cannot_run_fast_is_warned(
        precision: str, gpus: tuple[str, ...], warned: str) -> None:
    plan = solve(_spec(precision), _cluster(*((g, 1) for g in gpus), ("A10G", 1)))
    notes = [n for n in plan.notes if n.startswith("warning: ")]
    assert len(notes) == len(gpus) and any(re.search(warned, n) for n in notes), \
        notes
    # Each names its ranks and is priced at the speed it gets: fp32's.
    for gpu in gpus:
        forced = estimate_profile(gpu, _spec("fp32").model.resolve(), precision)
        fp32 = estimate_profile(gpu, _spec("fp32").model.resolve(), "fp32")
        assert forced.points[-1].block_forward_seconds >= fp32.points[-1].block_forward_seconds


def test_no_warning_where_the_precision_is_fast() -> None:
    for precision in ("auto", "fp32", "fp16", "bf16"):
        gpus = ("V100-16GB", "A10G") if precision != "bf16" else ("A10G", "L4")
        plan = solve(_spec(precision), _cluster(*((g, 1) for g in gpus)))
        assert not [n for n in plan.notes if n.startswith("warning: ")], (precision, plan.notes)


def test_cephalo_plan_prints_each_ranks_precision(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "gpt-1.3b", "--batch-size", "64", "--precision", "auto",
                 "--gpus", "2xV100-16GB,1xA10G", "--bandwidth-gbps", "100"]) == 0
    out = capsys.readouterr().out
    assert "precision: auto: fp16 on 2 V100-16GB, bf16 on 1 A10G" in out
    header = next(line for line in out.splitlines() if line.startswith("rank"))
    assert header.split()[:3] == ["rank", "GPU", "prec"]
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    assert [(row[1], row[2]) for row in rows] == [("V100-16GB", "fp16"), ("V100-16GB", "fp16"),
                                                  ("A10G", "bf16")]
    assert main(["plan", "--model", "gpt-1.3b", "--batch-size", "64", "--precision", "fp16",
                 "--gpus", "1xP40,1xA10G"]) == 0
    assert "note: warning: fp16 runs at fp32 speed on P40" in capsys.readouterr().out


# ---- the target -------------------------------------------------------------------

@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("precision_plans_bench",
                                                  REPO / "bench" / "precision_plans.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model,bf16_today", [("deepspeedgpt_2.7b", 98.3),
                                              ("deepspeedllama_7b", 39.7)])
def test_auto_predicts_at_least_one_and_a_half_times_bf16_on_cluster_b(
        bench: ModuleType, model: str, bf16_today: float) -> None:
    plans = {p: bench.plan(model, bench.CLUSTER_B, 100.0, 512, p) for p in ("bf16", "auto")}
    bf16, auto = plans["bf16"], plans["auto"]
    assert not isinstance(bf16, str) and not isinstance(auto, str), plans
    assert bf16.predicted_samples_per_second == pytest.approx(bf16_today, abs=0.05)
    assert auto.predicted_samples_per_second >= 1.5 * bf16.predicted_samples_per_second
    assert bench.used(auto) == "fp16 on 16 V100-16GB and 32 T4, bf16 on 16 A10G"
