"""`precision: auto` through the real kopf operator (issue 36): each GPU product is profiled
and cached in the precision the planner assigns it, so the cached profiles are the ones an
fp16 or bf16 job of the same model uses, and the plan the ranks get names each rank's
precision. The test plays the profiler pods (`real_profile_json`: the estimate in the job's
precision, `auto` resolved per product as `python -m cephalo.trainer.profile` does)."""

from __future__ import annotations

import pytest
from kube_emulator import ApiEmulator
from kube_fixtures import gpu_node, job_body
from kubelet import apply_job, apply_nodes, finish_profilers
from operator_harness import (  # noqa: F401 (fixtures)
    NS,
    plan_of,
    run_ranks,
    start_operator_fixture,
)

from cephalo.api import GpuProfile, parse_job
from cephalo.operator.render import profile_config_map_name

pytestmark = pytest.mark.asyncio


async def test_auto_profiles_each_product_in_its_precision(emulator: ApiEmulator,
                                                           start_operator) -> None:
    await apply_nodes(emulator, [gpu_node("v100", "Tesla-V100-SXM2-16GB", 2),
                                 gpu_node("a10g", "NVIDIA-A10G", 1)])
    start_operator()
    body = job_body("mixed", model={"preset": "gpt-1.3b"}, precision="auto",
                    gpuPools=[{"product": "Tesla-V100-SXM2-16GB"}, {"product": "NVIDIA-A10G"}])
    await apply_job(emulator, body)
    assert await finish_profilers(emulator, NS, body, 2) == {"Tesla-V100-SXM2-16GB",
                                                             "NVIDIA-A10G"}
    await run_ranks(emulator, "mixed")
    plan = plan_of(emulator, "mixed")
    assert plan is not None and plan.precision == "auto"
    assert [(r.gpu, r.precision) for r in plan.ranks] == [
        ("V100-16GB", "fp16"), ("V100-16GB", "fp16"), ("A10G", "bf16")]
    # Cached under the precision measured: the very entries an fp16 (V100) or bf16 (A10G)
    # job of this model reads.
    cached = {c["metadata"]["name"]: GpuProfile.model_validate_json(c["data"]["profile.json"])
              for c in emulator.list_objects("configmaps", NS)
              if c["metadata"]["name"].startswith("cephalo-profile-")}
    for product, precision in (("V100-16GB", "fp16"), ("A10G", "bf16")):
        forced = parse_job({**body, "spec": {**body["spec"], "precision": precision}})
        name = profile_config_map_name(product, forced)
        assert name in cached and cached[name].precision == precision, (name, list(cached))
