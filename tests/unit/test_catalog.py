"""The GPU catalog: label rules for PCIe/SXM variants, and GPUs outside the catalog that are
planned from a measured profile (issue 12, item 4; issue 15, item 3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cephalo.api import ClusterSpec, GpuGroup, parse_job
from cephalo.api.models import preset
from cephalo.api.profile import GpuProfile, ProfilePoint, model_key
from cephalo.cli import main
from cephalo.operator.discovery import discover_pools, product_matches, select_cluster
from cephalo.planner import estimate_profile, solve
from cephalo.planner.cost.catalog import (
    UnknownGpuError,
    gpu_key,
    lookup_gpu,
    resolve_gpu,
    same_gpu,
)

MODEL = preset("gpt-tiny")
GIB = 1024**3


@pytest.mark.parametrize("label,name", [
    # H100: the PCIe and NVL boards are not the SXM5 one.
    ("NVIDIA-H100-PCIe", "H100-PCIe"), ("NVIDIA H100 PCIe", "H100-PCIe"),
    ("NVIDIA-H100-80GB-HBM3", "H100"), ("NVIDIA-H100-SXM5-80GB", "H100"),
    ("NVIDIA-H100-NVL", "H100-NVL"),
    # V100: PCIe vs SXM2 (GFD labels and NVML names).
    ("Tesla-V100-PCIE-16GB", "V100-PCIe-16GB"), ("Tesla V100-PCIE-32GB", "V100-PCIe-32GB"),
    ("Tesla-V100-SXM2-16GB", "V100-16GB"), ("Tesla-V100-SXM2-32GB", "V100-32GB"),
    ("Tesla-V100S-PCIE-32GB", "V100S-32GB"),
    # P100: SXM2 vs PCIe 16 GB vs PCIe 12 GB.
    ("Tesla-P100-SXM2-16GB", "P100-SXM2"), ("Tesla-P100-PCIE-16GB", "P100"),
    ("Tesla-P100-PCIE-12GB", "P100-12GB"),
])
def test_variant_labels_map_to_their_own_sku(label: str, name: str) -> None:
    assert lookup_gpu(label).name == name


def test_variants_carry_their_own_figures() -> None:
    sxm, pcie = lookup_gpu("NVIDIA-H100-80GB-HBM3"), lookup_gpu("NVIDIA-H100-PCIe")
    assert pcie.fp32_tflops < sxm.fp32_tflops and pcie.memory_bandwidth_gbps == 2000
    assert sxm.fp32_tflops / pcie.fp32_tflops == pytest.approx(1.31, abs=0.01)
    assert lookup_gpu("Tesla-V100-PCIE-16GB").fp32_tflops == 14.0
    assert lookup_gpu("Tesla-V100-SXM2-16GB").fp32_tflops == 15.7
    assert lookup_gpu("Tesla-P100-SXM2-16GB").fp32_tflops == 10.6
    assert lookup_gpu("Tesla-P100-PCIE-16GB").fp32_tflops == 9.3
    # The SXM estimate is faster than the PCIe one for the same model.
    fast = estimate_profile(sxm, MODEL, "bf16").points[-1].block_forward_seconds
    slow = estimate_profile(pcie, MODEL, "bf16").points[-1].block_forward_seconds
    assert fast < slow
    assert not product_matches("NVIDIA-H100-PCIe", "H100")
    assert product_matches("NVIDIA-H100-PCIe", "H100-PCIe")


def test_names_outside_the_catalog_get_one_spelling() -> None:
    assert gpu_key("NVIDIA GeForce RTX 4090") == "NVIDIA-GeForce-RTX-4090"
    assert gpu_key("NVIDIA-GeForce-RTX-4090") == "NVIDIA-GeForce-RTX-4090"
    assert gpu_key("Tesla T4") == "T4"
    # Blanks become dashes, nothing else changes: the spelling the profiler reports
    # (cephalo.trainer.device_info.catalog_name), so profiles and ranks meet.
    assert gpu_key("Some GPU (MIG 1g.10gb)") == "Some-GPU-(MIG-1g.10gb)"
    assert same_gpu("NVIDIA A40", "NVIDIA-A40") and not same_gpu("NVIDIA-A40", "A10G")
    a40 = resolve_gpu("NVIDIA-A40", 46068 * 1024**2)
    assert not a40.in_catalog and a40.name == "NVIDIA-A40"
    assert a40.memory_bytes == 46068 * 1024**2
    with pytest.raises(UnknownGpuError, match="unknown GPU 'NVIDIA-A40'"):
        lookup_gpu("NVIDIA-A40")  # the strict lookup (emulation, typos) still refuses


def test_estimate_refuses_a_gpu_outside_the_catalog_with_what_to_do() -> None:
    with pytest.raises(UnknownGpuError, match=r"not in the catalog.*measure a profile"):
        estimate_profile(resolve_gpu("NVIDIA-A40"), MODEL, "fp32")


def _measured(product: str, memory_bytes: int, seconds: float = 0.002) -> GpuProfile:
    """A profile as the profiler writes it on an unknown GPU (product = its NVML name)."""
    points = [ProfilePoint(micro_batch_size=m, block_forward_seconds=seconds * m,
                           block_backward_seconds=3 * seconds * m, compute_memory_bytes=
                           2**28 + m * 2**24) for m in (1, 2, 4)]
    return GpuProfile(product=product, device_name=product.replace("-", " "),
                      memory_capacity_bytes=memory_bytes,
                      model_key=model_key(MODEL.architecture_key(), "fp32"), points=points)


def _spec(batch: int = 16):
    return parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                      "spec": {"model": {"preset": "gpt-tiny"},
                               "globalBatchSize": batch}}).spec


def test_an_unknown_gpu_is_planned_from_its_profile_and_label_memory() -> None:
    key = "NVIDIA-GeForce-RTX-4090"
    # Two 4090s with a measured profile next to an L4 estimated from the catalog; the node
    # label's memory (20 GiB here) wins over the profile's NVML figure (24 GiB).
    cluster = ClusterSpec(groups=[GpuGroup(product=key, count=2, memory_bytes=20 * GIB),
                                  GpuGroup(product="NVIDIA-L4", count=1)],
                          network_bandwidth_bytes_per_second=1e12, network_latency_seconds=0.0)
    plan = solve(_spec(), cluster, {key: _measured(key, 24 * GIB, seconds=1e-6)})
    assert [r.gpu for r in plan.ranks][:2] == [key, key]  # the planner may leave the L4 idle
    assert plan.ranks[0].memory_capacity_bytes == 20 * GIB
    assert key not in plan.estimated_gpus  # the 4090's times are measured
    # Without the label the profile's memory is the capacity.
    alone = ClusterSpec(groups=[GpuGroup(product=key, count=2)],
                        network_bandwidth_bytes_per_second=1e12, network_latency_seconds=0.0)
    plan = solve(_spec(), alone, {key: _measured(key, 24 * GIB)})
    assert [r.gpu for r in plan.ranks] == [key, key]
    assert plan.ranks[0].memory_capacity_bytes == 24 * GIB
    # Without a profile: no estimate is possible, and the error says to profile it.
    with pytest.raises(UnknownGpuError, match="measure a profile"):
        solve(_spec(), alone, {})


def test_discovery_plans_unknown_products_with_label_memory() -> None:
    node = {"metadata": {"name": "n1", "labels": {
        "nvidia.com/gpu.product": "NVIDIA-A40", "nvidia.com/gpu.memory": "46068"}},
        "spec": {}, "status": {"allocatable": {"nvidia.com/gpu": "2"},
                               "conditions": [{"type": "Ready", "status": "True"}]}}
    discovery = discover_pools([node])
    assert discovery.unknown_products == ["NVIDIA-A40"]
    cluster, pools = select_cluster(_spec().model_copy(), discovery, [node])
    assert [(g.product, g.pool, g.count, g.memory_bytes) for g in cluster.groups] == [
        ("NVIDIA-A40", "NVIDIA-A40", 2, 46068 * 1024**2)]
    assert pools[0].catalog_name == "NVIDIA-A40"


def test_cli_plans_an_unknown_gpu_from_a_profile_file(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "profiles"
    folder.mkdir()
    profile = _measured("NVIDIA-GeForce-RTX-4090", 24 * GIB)
    (folder / "rtx4090.json").write_text(profile.model_dump_json())
    # The NVML spelling, the GFD label and a suffix of it all name the profiled GPU.
    for name in ("NVIDIA-GeForce-RTX-4090", "NVIDIA GeForce RTX 4090", "RTX-4090"):
        code = main(["plan", "--gpus", f"2x{name},1xL4", "--model", "gpt-tiny",
                     "--batch-size", "16", "--profiles", str(folder), "--json"])
        out = capsys.readouterr().out
        assert code == 0, out
        assert '"gpu":"NVIDIA-GeForce-RTX-4090"' in out.replace(" ", "")
    code = main(["plan", "--gpus", "2xNVIDIA-A40", "--model", "gpt-tiny", "--batch-size", "16",
                 "--profiles", str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "unknown GPU 'NVIDIA-A40': not in the catalog and no profile" in err
    assert "--profiles DIR" in err


def test_authors_format_converts_to_a_profile() -> None:
    """The converter on a hand-made entry in each of the authors' two shapes (the real data
    is checked in test_catalog_calibration.py against the vendored bench/reference data)."""
    from cephalo.planner.cost.authors_profiles import (
        MissingMeasurement,
        authors_profile,
        layer_times_ms,
    )

    # Linear fits only; the forward fit's negative intercept would go below zero at m = 1.
    forward, backward = layer_times_ms([[2.0, -3.0], [4.0, 1.0]], max_micro_batch=3)
    assert forward.tolist() == [2.0, 1.0, 3.0] and backward.tolist() == [5.0, 9.0, 13.0]
    # Fits plus measured per-m arrays: the measurements win where they exist.
    forward, _ = layer_times_ms([[2.0, 0.0], [4.0, 0.0], [1.5, 3.5], [3.0]], max_micro_batch=3)
    assert forward.tolist() == [1.5, 3.5, 6.0]
    with pytest.raises(MissingMeasurement):
        layer_times_ms(3.25)
    latencies = {"deepspeedgpt_2.7b": {"a10g": {"512": {"float32": [[10.0, 0.0], [20.0, 0.0]]}}}}
    memory = {"aws-16gpu": {"deepspeedgpt_2.7b": {"profiled_compute_memory": {
        "float32": [1.0, 1.5]}}}}
    profile = authors_profile(latencies, memory, model="deepspeedgpt_2.7b", gpu="a10g",
                              cluster="aws-16gpu", micro_batch_sizes=range(1, 5))
    config = preset("gpt-2.7b")
    first, last = profile.points[0], profile.points[-1]
    assert profile.product == "A10G" and profile.precision == "fp32"
    assert first.block_forward_seconds == pytest.approx(0.010)
    assert first.block_backward_seconds == pytest.approx(0.030)  # recompute + backward
    assert first.other_forward_seconds == pytest.approx(
        0.010 * config.other_forward_flops() / config.block_forward_flops())
    assert first.compute_memory_bytes == 3 * GIB  # 1 GiB profiled + the authors' 2 GiB
    assert last.compute_memory_bytes == int(4.5 * GIB)  # m = 4 follows the fitted line
    assert profile.model_key == model_key(config.architecture_key(), "fp32")
    with pytest.raises(MissingMeasurement):
        authors_profile(latencies, memory, model="deepspeedgpt_2.7b", gpu="t4",
                        cluster="aws-16gpu")
