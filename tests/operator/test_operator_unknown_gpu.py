"""Any NVIDIA GPU (issue 12, item 4): a product missing from the GPU catalog is profiled and
planned like any other. The real kopf operator over HTTP against the emulator; the test plays
the profiler pod on the unknown GPU, whose termination message is a GpuProfile named as NVML
names the card, with NVML's memory, as `python -m cephalo.trainer.profile` writes it there.
"""

from __future__ import annotations

from typing import Any

import pytest
from kube_emulator import ApiEmulator
from kube_fixtures import gpu_node, job_body
from kubelet import (
    apply_job,
    apply_nodes,
    pods,
    real_profile_json,
    set_pod,
    wait_for,
)
from operator_harness import (  # noqa: F401 (fixtures)
    NS,
    plan_of,
    run_ranks,
    start_operator_fixture,
    wait_phase,
)

from cephalo.api import GpuProfile, parse_job
from cephalo.planner import estimate_profile

pytestmark = pytest.mark.asyncio
PRODUCT = "NVIDIA-GeForce-RTX-4090"  # GFD's label; NVML says "NVIDIA GeForce RTX 4090"
LABEL_MIB = 24564  # nvidia.com/gpu.memory on the node
NVML_BYTES = 25_757_220_864  # what the profiler reads from NVML (a little more than the label)


def rtx4090_profile_json(job: dict[str, Any]) -> str:
    """What the profiler prints on a 4090: measured times (here: an L4's estimate at twice the
    speed, standing in for a measurement), its NVML name and memory; no catalog entry."""
    spec = parse_job(job).spec
    base = estimate_profile("L4", spec.model.resolve(), spec.precision,
                            spec.planner.profile_micro_batch_sizes)
    points = [p.model_copy(update={
        "block_forward_seconds": p.block_forward_seconds / 2,
        "block_backward_seconds": p.block_backward_seconds / 2,
        "other_forward_seconds": p.other_forward_seconds / 2,
        "other_backward_seconds": p.other_backward_seconds / 2}) for p in base.points]
    profile = GpuProfile(product=PRODUCT, device_name="NVIDIA GeForce RTX 4090",
                         memory_capacity_bytes=NVML_BYTES, source="measured",
                         model_key=base.model_key, precision=base.precision, points=points,
                         compute_capability="8.9",
                         optimizer_seconds_per_parameter=base.optimizer_seconds_per_parameter)
    return profile.to_compact_json()


async def test_unknown_gpu_is_profiled_planned_and_gets_ranks(emulator: ApiEmulator,
                                                              start_operator) -> None:
    await apply_nodes(emulator, [gpu_node("c-4090", PRODUCT, 2, LABEL_MIB)])
    start_operator()
    # A model big enough that every GPU is worth its collectives (the planner may leave
    # GPUs idle when fewer are faster).
    body = job_body("any", model={"preset": "gpt-1.3b"},
                    gpuPools=[{"product": PRODUCT}, {"product": "L4"}])
    await apply_job(emulator, body)
    profilers = await wait_for("2 profiler pods", lambda: (
        ps if len(ps := pods(emulator, NS, "profiler", "any")) == 2 else None))
    by_product = {p["spec"]["nodeSelector"]["nvidia.com/gpu.product"]: p for p in profilers}
    assert set(by_product) == {PRODUCT, "NVIDIA-L4"}  # the unknown product is profiled too
    await set_pod(emulator, NS, by_product[PRODUCT]["metadata"]["name"], "Succeeded",
                  message=rtx4090_profile_json(body))
    await set_pod(emulator, NS, by_product["NVIDIA-L4"]["metadata"]["name"], "Succeeded",
                  message=real_profile_json(by_product["NVIDIA-L4"], body))
    ranks = await run_ranks(emulator, "any")
    plan = plan_of(emulator, "any")
    used = [r for r in plan.ranks if r.gpu == PRODUCT]
    assert len(used) == 2, [(r.gpu, r.batch_size) for r in plan.ranks]
    for rank in used:
        assert rank.pool == PRODUCT
        assert rank.memory_capacity_bytes == LABEL_MIB * 1024**2  # the label wins over NVML
        assert rank.batch_size > 0 and not rank.estimated
    assert PRODUCT not in plan.estimated_gpus
    selectors = {p["spec"]["nodeSelector"]["nvidia.com/gpu.product"] for p in ranks}
    assert PRODUCT in selectors
    status = await wait_phase(emulator, "any", "Running")
    assert status["plan"]["pools"][PRODUCT] == 2
    # The measured profile is cached under the product's name for later jobs.
    cached = [c for c in emulator.list_objects("configmaps", NS)
              if c["metadata"]["name"].startswith("cephalo-profile-nvidia-geforce-rtx-4090")]
    assert len(cached) == 1 and cached[0]["data"]["product"] == PRODUCT
