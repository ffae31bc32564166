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

from cephalo.api import JobFileError, Plan, parse_job
from cephalo.api.podtemplate import CONTRACT_ENV
from cephalo.operator.config import OperatorConfig
from cephalo.operator.discovery import NoGpusError, discover_pools, plan_fits, select_cluster
from cephalo.operator.render import (
    check_job_name,
    checkpoint_target,
    config_hash,
    config_identity,
    profile_config_map_name,
    render,
    render_profiler_pod,
    render_spec_config_map,
)
from cephalo.planner import solve

GOLDEN = Path(__file__).parent / "golden"
K8S_VERSION = "1.30.0"
UID = "0d5c2b1e-0000-4000-8000-000000000001"


NO_TARGET = {"intervalSteps": 100}  # a checkpoint spec without claimName, uri or ephemeral


def _job(**spec):
    """The test job; checkpoints on a PVC unless the test says otherwise (a multi-rank job
    without a shared checkpoint target is refused)."""
    return parse_job(job_body("gpt", uid=UID, **{"checkpoint": {"claimName": "ckpt"}, **spec}))


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


def test_unknown_products_are_planned_once_profiled() -> None:
    # Issue 12 item 4: a product outside the catalog is a pool like any other (the operator
    # profiles it; tests/operator/test_operator_unknown_gpu.py runs the whole path).
    nodes = [gpu_node("x", "NVIDIA-Imaginary-9000", 4)]
    d = discover_pools(nodes)
    assert d.unknown_products == ["NVIDIA-Imaginary-9000"]
    cluster, _ = select_cluster(_job().spec, d, nodes)
    assert [(g.product, g.pool, g.count) for g in cluster.groups] == [
        ("NVIDIA-Imaginary-9000", "NVIDIA-Imaginary-9000", 4)]
    missing = _job(gpuPools=[{"product": "H100"}])
    with pytest.raises(NoGpusError, match=r"not in the GPU catalog \(planned once profiled\): "
                                          "NVIDIA-Imaginary-9000"):
        select_cluster(missing.spec, d, nodes)


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
        env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]
               if "value" in e}
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
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}} in \
        pods[0]["spec"]["volumes"]


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


def test_config_hash_survives_an_operator_upgrade_that_adds_defaulted_fields() -> None:
    """A newer operator knows fields the running job's spec never named (their defaults): the
    hash must not move, or an upgrade re-plans and restarts every running job."""
    plan = _plan()
    job = _job(planner={})  # every planner field at its default
    spelled_out = parse_job({**job.model_dump(by_alias=True, mode="json", exclude_none=True),
                             "status": None})
    assert spelled_out.spec.planner.choose_gpus is True
    assert "chooseGpus" in spelled_out.spec.to_wire()["planner"]
    assert config_hash(spelled_out, plan) == config_hash(job, plan)
    # the operator that wrote the running job's hash did not know today's new fields: the
    # hash sees no field at its default, so it is the same to both operators
    identity = config_identity(job, plan)
    assert "planner" not in identity["spec"] and "podTemplate" not in identity["spec"]
    assert "idle_gpus" not in identity["plan"] and "optimality_gap_seconds" not in identity["plan"]
    # ... the same for the plan: a field a newer planner adds, left at its default
    newer_plan = Plan.model_validate({**plan.model_dump(mode="json"), "idle_gpus": []})
    assert config_hash(job, newer_plan) == config_hash(job, plan)
    # a value that differs from the default still counts
    assert config_hash(_job(planner={"chooseGpus": False}), plan) != config_hash(job, plan)


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


# ---- storage: checkpoints (issue 13), token-file volume, podTemplate --------------------
def _one_rank_plan() -> Plan:
    return Plan.model_validate({
        "global_batch_size": 64, "world_size": 1, "predicted_step_seconds": 0.5,
        "ranks": [{"rank": 0, "gpu": "L4", "pool": "NVIDIA-L4", "batch_size": 64,
                   "micro_batch_size": 8, "num_micro_batches": 8, "shard_ratio": 1.0}],
        "baselines": {}})


def _env(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def _mounts(pod: dict) -> dict[str, dict]:
    return {m["mountPath"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}


def _volumes(pod: dict) -> dict[str, dict]:
    return {v["name"]: v for v in pod["spec"]["volumes"]}


def test_multi_rank_job_without_a_shared_checkpoint_target_is_refused() -> None:
    """Regression (issue 13): each rank got its own emptyDir and ranks >= 1 crashed at the
    first checkpoint (FileNotFoundError in .step-N.partial); now nothing is rendered."""
    job = _job(checkpoint=NO_TARGET)
    target = checkpoint_target(job, _plan().world_size)
    assert target.refusal is not None and not target.durable
    assert target.refusal.startswith("3 ranks need a shared checkpoint target")
    for fix in ("spec.checkpoint.claimName (a ReadWriteMany PVC)",
                "spec.checkpoint.uri (s3://…, gs://…)", "spec.checkpoint.ephemeral: true"):
        assert fix in target.refusal
    assert "\n" not in target.refusal
    with pytest.raises(AssertionError, match="render of a refused job"):
        render(job, _plan())


def test_single_rank_without_a_target_keeps_an_emptydir_and_says_it_is_not_durable() -> None:
    job, plan = _job(checkpoint=NO_TARGET), _one_rank_plan()
    target = checkpoint_target(job, plan.world_size)
    assert target.refusal is None and not target.durable and target.reason == "EmptyDir"
    assert "will not survive a restart" in target.message
    objects = render(job, plan)
    _validate(objects)
    (pod,) = objects[2:]
    assert _volumes(pod)["checkpoints"] == {"name": "checkpoints", "emptyDir": {}}
    assert _env(pod)["CEPHALO_CHECKPOINT_DIR"] == "/checkpoints/gpt"
    _check_golden("render-single-emptydir.yaml", [pod])


def test_pvc_checkpoints_mount_the_claim_on_every_rank() -> None:
    job = _job(checkpoint={"claimName": "ckpt"})
    target = checkpoint_target(job, _plan().world_size)
    assert target.durable and target.reason == "PersistentVolumeClaim" and not target.refusal
    for pod in render(job, _plan())[2:]:
        assert _volumes(pod)["checkpoints"]["persistentVolumeClaim"] == {"claimName": "ckpt"}
        assert _mounts(pod)["/checkpoints"]["name"] == "checkpoints"
        assert _env(pod)["CEPHALO_CHECKPOINT_DIR"] == "/checkpoints/gpt"


def test_object_storage_checkpoints_need_no_volume_and_take_credentials_from_a_secret() -> None:
    job = _job(checkpoint={"uri": "s3://team-bucket/cephalo/"},
               podTemplate={"envFrom": [{"secretRef": {"name": "s3-credentials"}}],
                            "env": [{"name": "AWS_ENDPOINT_URL",
                                     "value": "http://minio.storage:9000"}]})
    target = checkpoint_target(job, _plan().world_size)
    assert target.durable and target.reason == "ObjectStorage"
    objects = render(job, _plan())
    _validate(objects)
    for pod in objects[2:]:
        env = _env(pod)
        assert env["CEPHALO_CHECKPOINT_DIR"] == "s3://team-bucket/cephalo/default/gpt"
        assert env["AWS_ENDPOINT_URL"] == "http://minio.storage:9000"
        assert "checkpoints" not in _volumes(pod) and "/checkpoints" not in _mounts(pod)
        assert pod["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name":
                                                                          "s3-credentials"}}]
    _check_golden("render-object-storage.yaml", objects[2:3])


def test_ephemeral_multi_rank_job_runs_without_checkpoints() -> None:
    job = _job(checkpoint={"ephemeral": True})
    target = checkpoint_target(job, _plan().world_size)
    assert target.refusal is None and not target.durable and target.reason == "Ephemeral"
    assert "step 0" in target.message
    objects = render(job, _plan())
    _validate(objects)
    for pod in objects[2:]:
        assert _env(pod)["CEPHALO_CHECKPOINT_DIR"] == ""
        assert "checkpoints" not in _volumes(pod)


def test_token_file_claim_is_mounted_read_only_in_rank_pods() -> None:
    """Regression (issue 13): data.tokenFile.claimName was never mounted, so every rank of
    examples/token-file.yaml failed with "token file … does not exist"."""
    data = {"tokenFile": {"path": "/data/owt/train.bin", "claimName": "datasets",
                          "mountPath": "/data"}}
    job = _job(data=data, checkpoint={"claimName": "ckpt"})
    objects = render(job, _plan())
    _validate(objects)
    for pod in objects[2:]:
        assert _volumes(pod)["dataset"] == {
            "name": "dataset", "persistentVolumeClaim": {"claimName": "datasets",
                                                         "readOnly": True}}
        assert _mounts(pod)["/data"] == {"name": "dataset", "mountPath": "/data",
                                         "readOnly": True}
    _check_golden("render-token-file.yaml", objects[2:3])
    # The profiler measures on synthetic data (trainer/profile_units.py): no data volume.
    profiler = render_profiler_pod(job, "NVIDIA-L4", attempt=0)
    assert "dataset" not in _volumes(profiler)


def test_token_file_mount_path_that_collides_is_refused() -> None:
    data = {"tokenFile": {"path": "/checkpoints/t.bin", "claimName": "datasets",
                          "mountPath": "/checkpoints"}}
    target = checkpoint_target(_job(data=data, checkpoint={"claimName": "ckpt"}), 3)
    assert target.refusal and "mountPath '/checkpoints' overlaps /checkpoints" in target.refusal
    clash = _job(data={"tokenFile": {"path": "/data/t.bin", "claimName": "datasets"}},
                 checkpoint={"claimName": "ckpt"},
                 podTemplate={"volumes": [{"name": "cache", "emptyDir": {}}],
                              "volumeMounts": [{"name": "cache", "mountPath": "/data/cache"}]})
    assert "overlaps /data/cache" in (checkpoint_target(clash, 3).refusal or "")


POD_TEMPLATE = {
    "labels": {"team": "nlp", "kueue.x-k8s.io/queue-name": "gpu"},
    "annotations": {"example.com/owner": "nlp"},
    "env": [{"name": "WANDB_PROJECT", "value": "cephalo"},
            {"name": "AWS_SECRET_ACCESS_KEY",
             "valueFrom": {"secretKeyRef": {"name": "s3", "key": "secret"}}}],
    "envFrom": [{"secretRef": {"name": "wandb"}}, {"configMapRef": {"name": "proxy",
                                                                     "optional": True}}],
    "volumes": [{"name": "hf-cache", "persistentVolumeClaim": {"claimName": "hf"}},
                {"name": "certs", "secret": {"secretName": "ca", "defaultMode": 0o444}}],
    "volumeMounts": [{"name": "hf-cache", "mountPath": "/cache/hf"},
                     {"name": "certs", "mountPath": "/etc/ssl/custom", "readOnly": True}],
    "imagePullSecrets": [{"name": "registry"}],
    "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": {"matchExpressions": [
            {"key": "zone", "operator": "In", "values": ["a"]}]}}]}},
    "priorityClassName": "training",
    "serviceAccountName": "trainer",
    "resources": {"requests": {"cpu": 8, "memory": "64Gi"}, "limits": {"memory": "64Gi"}},
}


def test_pod_template_is_merged_into_rank_and_profiler_pods() -> None:
    job = _job(checkpoint={"claimName": "ckpt"}, podTemplate=POD_TEMPLATE)
    plain = render(_job(checkpoint={"claimName": "ckpt"}), _plan())
    objects = render(job, _plan())
    profiler = render_profiler_pod(job, "NVIDIA-L4", attempt=0)
    _validate([*objects, profiler])
    _check_golden("render-pod-template.yaml", [objects[2], profiler])
    for pod, before in ((objects[2], plain[2]), (profiler, None)):
        meta, spec = pod["metadata"], pod["spec"]
        (container,) = spec["containers"]
        assert meta["labels"]["team"] == "nlp" and meta["labels"]["cephalo.dev/job"] == "gpt"
        assert meta["annotations"]["example.com/owner"] == "nlp"
        assert container["env"][-2:] == [
            {"name": "WANDB_PROJECT", "value": "cephalo"},
            {"name": "AWS_SECRET_ACCESS_KEY",
             "valueFrom": {"secretKeyRef": {"name": "s3", "key": "secret"}}}]
        assert [e.get("secretRef", e.get("configMapRef"))["name"]
                for e in container["envFrom"]] == ["wandb", "proxy"]
        assert _mounts(pod)["/cache/hf"]["name"] == "hf-cache"
        assert _volumes(pod)["certs"]["secret"]["secretName"] == "ca"
        assert spec["imagePullSecrets"] == [{"name": "registry"}]
        assert spec["priorityClassName"] == "training" and spec["affinity"]
        assert spec["serviceAccountName"] == "trainer"
        assert spec["automountServiceAccountToken"] is False  # the token stays unmounted
        assert {"key": "nvidia.com/gpu", "operator": "Exists",
                "effect": "NoSchedule"} in spec["tolerations"]
        assert {"key": "spot", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        # The operator's fields win: one GPU from the plan, its nodeSelector, security.
        assert container["resources"] == {
            "requests": {"cpu": 8, "memory": "64Gi", "nvidia.com/gpu": 1},
            "limits": {"memory": "64Gi", "nvidia.com/gpu": 1}}
        assert spec["nodeSelector"]["nvidia.com/gpu.product"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        if before is not None:  # everything the operator set is still there, unchanged
            assert container["env"][:len(before["spec"]["containers"][0]["env"])] == \
                before["spec"]["containers"][0]["env"]
            assert spec["volumes"][:len(before["spec"]["volumes"])] == before["spec"]["volumes"]


@pytest.mark.parametrize(("template", "message"), [
    ({"env": [{"name": "CEPHALO_CHECKPOINT_DIR", "value": "/x"}]},
     "env CEPHALO_CHECKPOINT_DIR is set by the operator (the trainer's environment contract)"),
    ({"env": [{"name": "RANK", "value": "0"}]}, "env RANK is set by the operator"),
    ({"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]},
     "env A given more than once"),
    ({"volumes": [{"name": "checkpoints", "emptyDir": {}}]},
     "volume name 'checkpoints' is used by the operator"),
    ({"volumes": [{"emptyDir": {}}]}, "every podTemplate volume needs a `name`"),
    ({"volumes": [{"name": "v", "emptyDir": {}}],
      "volumeMounts": [{"name": "v", "mountPath": "/tmp/x"}]},
     "mountPath '/tmp/x' overlaps /tmp, which the operator mounts"),
    ({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]},
     "volumeMount 'nope' names no volume in podTemplate.volumes"),
    ({"labels": {"cephalo.dev/job": "other"}}, "keys under cephalo.dev/ are set by the operator"),
    ({"labels": {"team": "n l p"}}, "value 'n l p' is not a Kubernetes label value"),
    ({"resources": {"limits": {"nvidia.com/gpu": 2}}}, "GPUs come from the plan"),
    ({"resources": {"requests": {"memory": "lots"}}}, "'lots' is not a Kubernetes quantity"),
    ({"envFrom": [{"prefix": "X_"}]}, "exactly one of secretRef or configMapRef"),
])
def test_pod_template_conflicts_are_refused_with_a_clear_message(template, message) -> None:
    with pytest.raises(JobFileError) as err:
        parse_job(job_body("gpt", uid=UID, podTemplate=template), source="job.yaml")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("job.yaml: spec.podTemplate")


def test_pod_template_bodies_are_valid_for_the_crd() -> None:
    schema = load_schema()
    body = job_body("pt", podTemplate=POD_TEMPLATE, checkpoint={"uri": "s3://b/p"})
    assert type_errors(body, schema) == [] and pruned(body, schema) == []


def test_cluster_examples_have_a_checkpoint_target_that_multi_rank_plans_accept() -> None:
    """Every example meant for `kubectl apply` runs on several GPUs (the chart's smoke test,
    custom-tiny-gpt.yaml, included): none may be refused for want of a shared target."""
    root = Path(__file__).resolve().parents[2] / "examples"
    applied = [p for p in sorted(root.glob("*.yaml"))
               if f"kubectl apply -f examples/{p.name}" in p.read_text()]
    assert {"custom-tiny-gpt.yaml", "object-storage.yaml", "token-file.yaml"} <= {
        p.name for p in applied}
    for path in applied:
        body = yaml.safe_load(path.read_text())
        body["metadata"].update(namespace="default", uid=UID)
        job = parse_job(body)
        target = checkpoint_target(job, _plan().world_size)
        assert target.refusal is None, (path.name, target.refusal)
        _validate(render(job, _plan())[2:3])
    tiny = parse_job({**yaml.safe_load((root / "custom-tiny-gpt.yaml").read_text())})
    assert tiny.spec.checkpoint.ephemeral  # the smoke test needs no storage on a bare cluster


def test_every_env_var_the_operator_sets_is_refused_in_the_pod_template() -> None:
    """CONTRACT_ENV (what podTemplate.env may not name) covers everything render sets, so a
    user variable can never silently shadow or be shadowed by the operator's."""
    job = _job(data={"tokenFile": {"path": "/data/t.bin", "claimName": "datasets"}})
    pods = [*render(job, _plan())[2:], render_profiler_pod(job, "NVIDIA-L4", attempt=0)]
    names = {e["name"] for pod in pods for e in pod["spec"]["containers"][0]["env"]}
    assert "CEPHALO_CHECKPOINT_DIR" in names and names <= CONTRACT_ENV


def _resources(pod: dict) -> dict:
    return pod["spec"]["containers"][0]["resources"]


def test_rank_and_profiler_pods_are_burstable_by_default_and_the_template_wins() -> None:
    """No BestEffort pods (the first evicted): CPU and memory requests sized from the plan's
    training state (the async checkpoint's host copy), no CPU/memory limits; the pod
    template's own request or limit replaces the default; the GPU stays the plan's."""
    plan = _plan().model_copy(update={"state_bytes": 16 * 2**30})  # 1 Gi parameters
    rank0 = next(o for o in render(_job(), plan) if o["kind"] == "Pod")
    requests = _resources(rank0)["requests"]
    # 3 GiB for the process + 12 of 16 bytes of its half of the state (0.5 x 12 GiB)
    assert requests == {"nvidia.com/gpu": 1, "cpu": "2", "memory": f"{3 * 1024 + 6 * 1024}Mi"}
    assert set(_resources(rank0)["limits"]) == {"nvidia.com/gpu"}
    profiler = render_profiler_pod(_job(), "NVIDIA-L4", attempt=0)
    assert _resources(profiler)["requests"]["memory"] == f"{3 * 1024}Mi"
    custom = _job(podTemplate={"resources": {"requests": {"cpu": "8"},
                                             "limits": {"memory": "64Gi"}}})
    pod = next(o for o in render(custom, plan) if o["kind"] == "Pod")
    assert _resources(pod)["requests"] == {"nvidia.com/gpu": 1, "cpu": "8"}  # limit = request
    assert _resources(pod)["limits"] == {"nvidia.com/gpu": 1, "memory": "64Gi"}
    for obj in (rank0, profiler, pod):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_mlflow_tracking_gets_the_operators_default_server_and_the_job_uid() -> None:
    """spec.tracking.mlflow without a trackingUri: the rank pods get the chart's
    tracking.mlflowUri as MLFLOW_TRACKING_URI; one with its own gets none (the job's wins);
    job.yaml carries the uid the trainer finds the job's MLflow run by across attempts."""
    plan, config = _plan(), OperatorConfig(mlflow_uri="http://mlflow.mlflow.svc:5000")

    def tracking_uris(job) -> list[str | None]:
        _, _, *pods = render(job, plan, config)
        return [{e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
                .get("MLFLOW_TRACKING_URI") for pod in pods]

    assert tracking_uris(_job(tracking={"mlflow": {"experiment": "e"}})) == \
        ["http://mlflow.mlflow.svc:5000"] * 3
    assert tracking_uris(_job(tracking={"mlflow": {"experiment": "e",
                                                   "trackingUri": "https://own:5000"}})) == \
        [None] * 3
    assert tracking_uris(_job()) == [None] * 3
    cm = render(_job(), plan)[0]
    assert yaml.safe_load(cm["data"]["job.yaml"])["metadata"]["uid"] == UID


@pytest.mark.parametrize("uri", ["http://user:secret@mlflow:5000", "file:///mlruns", "mlflow"])
def test_operator_refuses_an_mlflow_default_that_is_no_server_url(uri: str) -> None:
    with pytest.raises(ValueError, match=r"CEPHALO_MLFLOW_URI=.* must be an http"):
        OperatorConfig.from_env({"CEPHALO_MLFLOW_URI": uri})
    assert OperatorConfig.from_env({"CEPHALO_MLFLOW_URI": ""}).mlflow_uri == ""
