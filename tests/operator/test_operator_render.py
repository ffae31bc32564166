"""Pure builders: GPU discovery, pool selection, profiler and rank manifests (golden files).

Regenerate the golden files only on purpose: CEPHALO_UPDATE_GOLDEN=1 pytest tests/operator.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from crd_schema import load_schema, pruned, type_errors
from kube_fixtures import cluster_a, gpu_node, job_body

from cephalo.api import Plan, parse_job
from cephalo.operator.config import OperatorConfig
from cephalo.operator.discovery import NoGpusError, discover_pools, plan_fits, select_cluster
from cephalo.operator.render import (
    check_job_name,
    config_hash,
    profile_config_map_name,
    render,
    render_profiler_pod,
    render_spec_config_map,
)
from cephalo.planner import solve

GOLDEN = Path(__file__).parent / "golden"
K8S_VERSION = "1.30.0"
UID = "0d5c2b1e-0000-4000-8000-000000000001"


def _job(**spec):
    return parse_job(job_body("gpt", uid=UID, **spec))


def _plan() -> Plan:
    """A hand-written two-pool plan: the golden files must not move when the planner improves."""
    return Plan.model_validate({
        "global_batch_size": 64, "world_size": 3, "predicted_step_seconds": 0.5,
        "predicted_samples_per_second": 128.0,
        "ranks": [
            {"rank": 0, "gpu": "RTX-A6000", "pool": "NVIDIA-RTX-A6000", "batch_size": 32,
             "micro_batch_size": 8, "num_micro_batches": 4, "shard_ratio": 0.5},
            {"rank": 1, "gpu": "L4", "pool": "NVIDIA-L4", "batch_size": 16,
             "micro_batch_size": 8, "num_micro_batches": 2, "shard_ratio": 0.25},
            {"rank": 2, "gpu": "L4", "pool": "NVIDIA-L4", "batch_size": 16,
             "micro_batch_size": 4, "num_micro_batches": 4, "shard_ratio": 0.25},
        ],
        "baselines": {"even_fsdp": {"predicted_samples_per_second": 100.0, "feasible": True}},
    })


def _check_golden(name: str, objects: list[dict]) -> None:
    text = yaml.safe_dump_all(objects, sort_keys=True)
    path = GOLDEN / name
    if os.environ.get("CEPHALO_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with CEPHALO_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), (
        f"{name} differs from the golden file; if the change is intended, regenerate with "
        "CEPHALO_UPDATE_GOLDEN=1 and review the diff")


def _validate(objects: list[dict]) -> None:
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


# ---- discovery ---------------------------------------------------------------------------
def test_cluster_a_pools() -> None:
    d = discover_pools(cluster_a())
    assert [(p.product, p.catalog_name, p.num_gpus) for p in d.pools] == [
        ("NVIDIA-L4", "L4", 2), ("NVIDIA-RTX-A6000", "RTX-A6000", 1),
        ("Tesla-P100-PCIE-16GB", "P100", 2), ("Tesla-P40", "P40", 3)]
    assert d.pools[3].nodes == ("a-p40", "b-p40")
    assert d.pools[0].memory_bytes == 23034 * 1024 * 1024


def test_unusable_nodes_are_skipped_and_explained() -> None:
    tainted = gpu_node("tainted", "NVIDIA-L4", 2)
    tainted["spec"]["taints"] = [{"key": "dedicated", "value": "infra", "effect": "NoSchedule"}]
    gpu_tainted = gpu_node("gputaint", "Tesla-T4", 1)  # the GPU taint itself is tolerated
    gpu_tainted["spec"]["taints"] = [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]
    assert [p.product for p in discover_pools([tainted, gpu_tainted]).pools] == ["Tesla-T4"]
    nodes = [tainted, gpu_node("down", "NVIDIA-L4", 2, ready=False),
             gpu_node("cordoned", "NVIDIA-L4", 2, unschedulable=True),
             gpu_node("nogpu", "NVIDIA-L4", 0), gpu_node("cpu", None, 0)]
    d = discover_pools(nodes)
    assert d.pools == []
    with pytest.raises(NoGpusError) as err:
        select_cluster(_job().spec, d, nodes)
    msg = str(err.value)
    assert "nvidia.com/gpu.product" in msg and "saw 5 node(s)" in msg
    assert "tainted: tainted dedicated:NoSchedule" in msg
    assert "down: not Ready" in msg and "cordoned: cordoned" in msg and "nogpu:" in msg


def test_pool_selection_by_catalog_name_max_gpus_and_memory_override() -> None:
    nodes = cluster_a()
    job = _job(gpuPools=[{"product": "P40", "maxGpus": 2},
                         {"product": "NVIDIA-L4", "memoryMiB": 20000}, {"product": "H100"}])
    cluster, _ = select_cluster(job.spec, discover_pools(nodes), nodes)
    assert [(g.product, g.pool, g.count) for g in cluster.groups] == [
        ("P40", "Tesla-P40", 2), ("L4", "NVIDIA-L4", 2)]
    assert cluster.groups[1].memory_bytes == 20000 * 1024 * 1024
    only_missing = _job(gpuPools=[{"product": "H100"}])
    with pytest.raises(NoGpusError, match="requested but not found: H100"):
        select_cluster(only_missing.spec, discover_pools(nodes), nodes)
    narrowed = _job(gpuPools=[{"product": "P40",
                               "nodeSelector": {"kubernetes.io/hostname": "b-p40"}}])
    cluster, _ = select_cluster(narrowed.spec, discover_pools(nodes), nodes)
    assert [(g.pool, g.count) for g in cluster.groups] == [("Tesla-P40", 2)]


def test_unknown_products_are_reported_not_planned() -> None:
    nodes = [gpu_node("x", "NVIDIA-Imaginary-9000", 4)]
    with pytest.raises(NoGpusError, match="not in the GPU catalog: NVIDIA-Imaginary-9000"):
        select_cluster(_job().spec, discover_pools(nodes), nodes)


def test_plan_fits_reports_lost_gpus() -> None:
    d = discover_pools([n for n in cluster_a() if n["metadata"]["name"] != "b-p40"])
    assert plan_fits({"Tesla-P40": 3, "NVIDIA-L4": 2}, d) == ["Tesla-P40: plan uses 3, 1 available"]


# ---- manifests ---------------------------------------------------------------------------
def test_render_matches_golden_and_validates() -> None:
    objects = render(_job(checkpoint={"claimName": "ckpt"}), _plan())
    assert [o["kind"] for o in objects] == ["ConfigMap", "Service", "Pod", "Pod", "Pod"]
    _validate(objects)
    _check_golden("render-gpt.yaml", objects)


def test_render_is_deterministic_and_pure() -> None:
    job, plan = _job(), _plan()
    first = json.dumps(render(job, plan), sort_keys=True)
    assert json.dumps(render(job, plan), sort_keys=True) == first
    assert job == _job() and plan == _plan()  # inputs untouched


def test_rank_pods_carry_the_plan() -> None:
    job, plan = _job(), _plan()
    cm, service, *pods = render(job, plan, OperatorConfig(trainer_metrics_port=9999), attempt=2)
    assert json.loads(cm["data"]["plan.json"]) == json.loads(plan.to_json())
    assert yaml.safe_load(cm["data"]["job.yaml"])["spec"]["globalBatchSize"] == 64
    assert service["spec"]["clusterIP"] == "None"
    for pod, rank in zip(pods, plan.ranks, strict=True):
        env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
        assert env["RANK"] == str(rank.rank) and env["WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] == "gpt-rank-0.gpt.default.svc"
        assert env["CEPHALO_BATCH_SIZE"] == str(rank.batch_size)
        assert env["CEPHALO_MICRO_BATCH_SIZE"] == str(rank.micro_batch_size)
        assert env["CEPHALO_NUM_MICRO_BATCHES"] == str(rank.num_micro_batches)
        assert float(env["CEPHALO_SHARD_RATIO"]) == rank.shard_ratio
        assert env["CEPHALO_METRICS_PORT"] == "9999" and env["CEPHALO_RESTART_ATTEMPT"] == "2"
        assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": rank.pool}
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits == {"nvidia.com/gpu": 1}
        sec = pod["spec"]["containers"][0]["securityContext"]
        assert sec["allowPrivilegeEscalation"] is False and sec["readOnlyRootFilesystem"]
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        assert pod["metadata"]["ownerReferences"][0]["uid"] == UID
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9999"
    # emptyDir checkpoints without a claim
    assert {"name": "checkpoints", "emptyDir": {}} in pods[0]["spec"]["volumes"]


def test_job_names_that_cannot_name_children_are_rejected() -> None:
    check_job_name("gpt-2-7b")
    with pytest.raises(ValueError, match="at most 47"):
        check_job_name("x" * 48)
    with pytest.raises(ValueError, match="start with a letter"):
        check_job_name("2-gpt")


def test_config_hash_ignores_suspend_but_not_the_model() -> None:
    plan = _plan()
    assert config_hash(_job(), plan) == config_hash(_job(suspend=True, backoffLimit=7), plan)
    assert config_hash(_job(), plan) != config_hash(_job(globalBatchSize=32), plan)


def test_profiler_pod_golden_and_cache_key() -> None:
    job = _job(gpuPools=[{"product": "L4", "nodeSelector": {"pool": "spot"}}])
    pod = render_profiler_pod(job, "NVIDIA-L4", attempt=1)
    objects = [render_spec_config_map(job), pod]
    _validate(objects)
    _check_golden("profiler-gpt.yaml", objects)
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4", "pool": "spot"}
    # The cache key changes with the model, its sequence length and the precision, not the name.
    base = profile_config_map_name("L4", job)
    assert base == profile_config_map_name("L4", parse_job(job_body("other", uid=UID)))
    assert base != profile_config_map_name("L4", _job(precision="bf16"))
    assert base != profile_config_map_name("L4", _job(model={"preset": "gpt-small",
                                                             "sequenceLength": 32}))
    assert len(base) <= 63


def test_render_of_a_solved_cluster_a_plan_validates() -> None:
    nodes = cluster_a()
    job = _job()
    cluster, _ = select_cluster(job.spec, discover_pools(nodes), nodes)
    plan = solve(job.spec, cluster)
    objects = render(job, plan)
    _validate(objects)
    pools = {o["spec"]["nodeSelector"]["nvidia.com/gpu.product"] for o in objects[2:]}
    assert pools <= {g.pool for g in cluster.groups}
    assert len(objects) == 2 + plan.world_size


def test_test_jobs_are_valid_for_the_crd() -> None:
    """The job bodies these tests apply would pass the real API server's CRD schema."""
    schema = load_schema()
    for body in (job_body("gpt"), job_body("sel", gpuPools=[
            {"product": "P40", "maxGpus": 2, "nodeSelector": {"a": "b"}, "memoryMiB": 1000}],
            checkpoint={"claimName": "ckpt"}, ttlSecondsAfterFinished=5, backoffLimit=1)):
        assert type_errors(body, schema) == [] and pruned(body, schema) == []
