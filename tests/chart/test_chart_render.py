"""The chart rendered and linted by the real Helm engine (helm-python-sdk), default and
non-default values; every object validated strictly against the Kubernetes schemas."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from chart_helpers import (
    CHART_DIR,
    RELEASE_NAMESPACE,
    ROOT,
    by_kind,
    chart,
    container_env,
    load_yaml,
    one,
    pyproject,
    render,
    strip,
)
from kubernetes_validate import utils as kubernetes_validate

sys.path.insert(0, str(ROOT / "tests" / "operator"))
from kube_fixtures import job_body

from cephalo.api import Plan, parse_job
from cephalo.operator.config import OperatorConfig
from cephalo.operator.render import render as render_job

# The oldest Kubernetes the chart declares (Chart.yaml kubeVersion) and the newest schema set.
K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
MONITORING = "monitoring.coreos.com/v1"

EVERYTHING_ON: dict[str, Any] = {
    "image": {"repository": "registry.example/cephalo-operator", "tag": "0.2.0-rc.1",
              "pullPolicy": "Always"},
    "trainerImage": {"repository": "registry.example/cephalo-trainer",
                     "digest": "sha256:" + "a" * 64},
    "imagePullSecrets": [{"name": "regcred"}],
    "watchNamespaces": ["team-a", "team-b"],
    "logLevel": "debug", "logFormat": "plain",
    "operator": {"recheckSeconds": 5, "progressIntervalSeconds": 30, "profileRetries": 0,
                 "masterPort": 29600, "trainerMetricsPort": 9500, "trainerRunAsUser": 2000},
    "rbac": {"scope": "namespaced"},
    "serviceAccount": {"annotations": {"iam.example/role": "cephalo"}},
    "resources": {"requests": {"cpu": "200m", "memory": "300Mi"},
                  "limits": {"cpu": 1, "memory": "1Gi"}},
    "podLabels": {"team": "ml"}, "podAnnotations": {"example/annotated": "yes"},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops",
                     "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
    "priorityClassName": "system-cluster-critical",
    "extraEnv": [{"name": "TZ", "value": "UTC"}],
    "health": {"port": 9081},
    "metrics": {"port": 9080, "service": {"type": "NodePort", "annotations": {"a": "b"}},
                "serviceMonitor": {"enabled": True, "interval": "1m", "labels": {"release": "kps"}},
                "podMonitor": {"enabled": True, "interval": "5s", "scrapeTimeout": "4s"},
                "prometheusRule": {"enabled": True, "labels": {"release": "kps"}}},
    "dashboards": {"enabled": True},
    "jobPolicy": {"allowedVolumeTypes": ["emptyDir", "hostPath", "nfs"],
                  "serviceAccountName": {"allowed": True, "names": ["trainer"]},
                  "allowedImagePrefixes": ["registry.example/", "ghcr.io/cephalo/cephalo-trainer"],
                  "allowedPriorityClassNames": ["batch", "batch-low"],
                  "allowedTolerations": [{"key": "dedicated", "effect": "NoSchedule"},
                                         {"key": "example.com/spot"}]},
}


ADMISSION_POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def _older(version: str, than: str) -> bool:
    def key(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in v.split("."))
    return key(version) < key(than)


def _validate_all(objects: list[dict[str, Any]]) -> set[str]:
    kinds = set()
    for obj in objects:
        if obj["apiVersion"] == MONITORING:
            continue  # Prometheus Operator CRs: no bundled schema; checked structurally below
        for version in K8S_VERSIONS:
            if obj["kind"] in ADMISSION_POLICY_KINDS and _older(version, "1.30.0"):
                continue  # admissionregistration.k8s.io/v1 from 1.30 (jobPolicy says so)
            try:
                kubernetes_validate.validate(strip(obj), version, strict=True)
            except kubernetes_validate.ValidationError as err:
                raise AssertionError(f"{obj['__template__']}: {obj['kind']} "
                                     f"{obj['metadata']['name']} is invalid for Kubernetes "
                                     f"{version}: {err.message} at {list(err.path)}") from None
        kinds.add(obj["kind"])
    return kinds


def _env(deployment: dict[str, Any]) -> dict[str, str]:
    return container_env(deployment)


def test_default_values_render_valid_objects() -> None:
    objects = render()
    assert _validate_all(objects) == {"Deployment", "ServiceAccount", "ClusterRole",
                                      "ClusterRoleBinding", "Service", "Role", "RoleBinding",
                                      *ADMISSION_POLICY_KINDS}
    for obj in objects:
        if obj["kind"] not in ("ClusterRole", "ClusterRoleBinding", *ADMISSION_POLICY_KINDS):
            assert obj["metadata"]["namespace"] == RELEASE_NAMESPACE, obj["kind"]


def test_non_default_values_render_valid_objects() -> None:
    objects = render(EVERYTHING_ON)
    assert _validate_all(objects) == {"Deployment", "ServiceAccount", "ClusterRole",
                                      "ClusterRoleBinding", "Role", "RoleBinding", "Service",
                                      "ConfigMap", *ADMISSION_POLICY_KINDS}
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "registry.example/cephalo-operator:0.2.0-rc.1"
    assert _env(deployment)["CEPHALO_TRAINER_IMAGE"] == \
        "registry.example/cephalo-trainer@sha256:" + "a" * 64
    assert "--namespace=team-a" in container["args"] and "--namespace=team-b" in container["args"]
    assert "--all-namespaces" not in container["args"] and "--debug" in container["args"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert deployment["spec"]["template"]["metadata"]["labels"]["team"] == "ml"
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == \
        {"metrics": 9080, "health": 9081}
    assert _env(deployment)["CEPHALO_PROBE_PORT"] == "9081"


@pytest.mark.parametrize("values", [{}, EVERYTHING_ON], ids=["default", "everything-on"])
def test_strict_lint_passes(values: dict[str, Any]) -> None:
    report = helm.lint(CHART_DIR, values, strict=True, namespace=RELEASE_NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report


@pytest.mark.parametrize(("values", "message"), [
    ({"logLevel": "loud"}, "at '/logLevel': value must be one of"),
    ({"imagee": {"tag": "x"}}, "additional properties 'imagee' not allowed"),
    ({"image": {"tag": "has space"}}, "at '/image/tag'"),
    ({"trainerImage": {"digest": "sha256:short"}}, "at '/trainerImage/digest'"),
    ({"metrics": {"port": 70000}}, "at '/metrics/port'"),
    ({"metrics": {"port": "8080"}}, "at '/metrics/port': got string, want integer"),
    ({"operator": {"progressIntervalSeconds": 60}}, "at '/operator/progressIntervalSeconds'"),
    ({"operator": {"trainerRunAsUser": 0}}, "at '/operator/trainerRunAsUser'"),
    ({"watchNamespaces": ["Team_A"]}, "at '/watchNamespaces/0'"),
    ({"rbac": {"scope": "global"}}, "at '/rbac/scope'"),
    ({"metrics": {"serviceMonitor": {"interval": "often"}}},
     "at '/metrics/serviceMonitor/interval'"),
    ({"metrics": {"prometheusRule": {"ruleLabels": {"bad-name": "x"}}}},
     "additional properties 'bad-name' not allowed"),
    ({"rbac": {"scope": "namespaced"}}, "rbac.scope=namespaced needs watchNamespaces"),
    ({"metrics": {"port": 8081}}, "metrics.port and health.port are both 8081"),
    ({"jobPolicy": {"allowedVolumeTypes": ["hostpath"]}}, "at '/jobPolicy/allowedVolumeTypes/0'"),
    ({"jobPolicy": {"serviceAccountName": {"names": ["Trainer"]}}},
     "at '/jobPolicy/serviceAccountName/names/0'"),
    # Docker Hub's user "myregistry", not a registry host
    ({"jobPolicy": {"allowedImagePrefixes": ["myregistry/ml"]}},
     "at '/jobPolicy/allowedImagePrefixes/0'"),
    ({"jobPolicy": {"allowedPriorityClassNames": ["Batch"]}},
     "at '/jobPolicy/allowedPriorityClassNames/0'"),
    ({"jobPolicy": {"allowedTolerations": [{"key": "dedicated", "effect": "NoSchedul"}]}},
     "at '/jobPolicy/allowedTolerations/0/effect'"),
    ({"jobPolicy": {"allowedTolerations": [{"effect": "NoSchedule"}]}},
     "at '/jobPolicy/allowedTolerations/0'"),
    ({"placement": {"kueueTopologyLevel": "zone=a"}}, "at '/placement/kueueTopologyLevel'"),
    ({"placement": {"localityLabels": ["/leaf"]}}, "at '/placement/localityLabels/0'"),
    ({"serviceAccount": {"create": False}}, "serviceAccount.name is required"),
    ({"replicas": 0}, "at '/replicas'"),
    ({"leaderElection": {"leaseDurationSeconds": 10}},
     "leaderElection.leaseDurationSeconds (10) must be longer than"),
    ({"leaderElection": {"renewDeadlineSeconds": 2.4}},
     "leaderElection.renewDeadlineSeconds (2.4) must be longer than 1.2 x"),
    ({"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}},
     "needs metrics.service.enabled=true"),
])
def test_bad_values_fail_with_a_clear_message(values: dict[str, Any], message: str) -> None:
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as err:
        render(values)
    assert message in str(err.value), str(err.value)


def test_chart_crd_is_the_generated_one() -> None:
    generated = (ROOT / "crds" / "cephalojob.yaml").read_bytes()
    shipped = (CHART_DIR / "crds" / "cephalojob.yaml").read_bytes()
    assert shipped == generated, ("charts/cephalo-operator/crds/cephalojob.yaml differs from "
                                  "crds/cephalojob.yaml: cp crds/cephalojob.yaml "
                                  "charts/cephalo-operator/crds/")
    crds = chart().crds
    assert [c["filename"] for c in crds] == ["cephalo-operator/crds/cephalojob.yaml"]
    crd = yaml.safe_load(crds[0]["data"])
    kubernetes_validate.validate(crd, K8S_VERSIONS[0], strict=True)
    assert crd["spec"]["names"]["shortNames"] == ["cjob"]


def test_operator_pod_is_hardened() -> None:
    deployment = one(render(), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["privileged"] is False
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    # Probes hit the election's endpoints (cephalo.operator.leader), on the port it serves.
    assert not [a for a in container["args"] if a.startswith("--liveness")]
    env = _env(deployment)
    port_name = container["livenessProbe"]["httpGet"]["port"]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == port_name)
    assert env["CEPHALO_PROBE_PORT"] == str(port)
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port_name}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port_name}


def test_replicas_elect_a_leader_and_roll_one_at_a_time() -> None:
    """Two replicas by default, each a candidate for the release's Lease; a rollout never
    waits for a new pod to be Ready before removing an old one (new pods are standbys)."""
    deployment = one(render(), "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    env = _env(deployment)
    assert env["CEPHALO_LEADER_ELECTION_NAMESPACE"] == deployment["metadata"]["namespace"]
    assert env["CEPHALO_LEADER_ELECTION_LEASE"] == deployment["metadata"]["name"]
    config = OperatorConfig.from_env(env)
    assert config.election_timing().problem() is None
    # The Role: create any Lease (a name cannot limit create), get/update only this one.
    (role,) = [r for r in render() if r["kind"] == "Role"
               and r["metadata"]["name"].endswith("-leader-election")]
    assert role["metadata"]["namespace"] == config.leader_election_namespace
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "resourceNames": [config.leader_election_lease], "verbs": ["get", "update"]}]
    anti = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"][
        "topologyKey"] == "kubernetes.io/hostname"
    assert one(render({"replicas": 1}), "Deployment")["spec"]["replicas"] == 1


@pytest.mark.parametrize("values", [{}, EVERYTHING_ON], ids=["default", "everything-on"])
def test_kopf_accepts_the_command_line(values: dict[str, Any]) -> None:
    import kopf.cli

    container = one(render(values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["kopf", "run"]
    ctx = kopf.cli.run.make_context("run", list(container["args"]))  # parses, runs nothing
    assert ctx.params["modules"] == ("cephalo.operator",) and ctx.params["standalone"]
    assert ctx.params["clusterwide"] == (not values.get("watchNamespaces"))


def _bumped(name: str, value: str) -> str:
    """Another valid value of the same type (a number moves towards 1, inside every range
    of cephalo.operator.config.BOUNDS that holds the value itself)."""
    if value in ("true", "false"):
        return {"true": "false", "false": "true"}[value]
    if value == "":  # an empty list (jobPolicy.serviceAccountName.names): one name; an
        # optional URL left empty (tracking.mlflowUri): a valid one
        return {"CEPHALO_MLFLOW_URI": "http://mlflow.example:5000",
                "CEPHALO_ALLOWED_IMAGE_PREFIXES": "registry.example.com"}.get(name, "other")
    if "," in value:  # a list (jobPolicy.allowedVolumeTypes): one fewer
        return value.rsplit(",", 1)[0]
    if value.startswith("{"):  # a JSON object (gpuPricesPerHour): another valid one
        return '{"NVIDIA-L4": 0.8}' if value == "{}" else "{}"
    for kind in (int, float):
        try:
            number = kind(value)
        except ValueError:
            continue
        return str(number - 1 if number > 1 else number + 1)
    return value + "-other"


@pytest.mark.parametrize("values", [{}, EVERYTHING_ON], ids=["default", "everything-on"])
def test_operator_env_is_exactly_its_config(values: dict[str, Any]) -> None:
    """Every CEPHALO_* variable the chart sets is one OperatorConfig reads, and every
    OperatorConfig field is set by the chart (no knob left out)."""
    env = {k: v for k, v in _env(one(render(values), "Deployment")).items()
           if k.startswith("CEPHALO_")}
    base = OperatorConfig.from_env(env)
    fields = set(vars(base))
    covered: set[str] = set()
    for name, value in env.items():
        changed = {f for f in fields if getattr(OperatorConfig.from_env(
            {**env, name: _bumped(name, value)}), f) != getattr(base, f)}
        assert len(changed) == 1, f"{name}: OperatorConfig does not read it ({changed})"
        covered |= changed
    assert covered == fields, f"no chart value sets OperatorConfig {sorted(fields - covered)}"
    merged = chart().merge_values(values)
    assert base.metrics_port == merged["metrics"]["port"]
    assert base.trainer_metrics_port == merged["operator"]["trainerMetricsPort"]
    assert base.run_as_user == merged["operator"]["trainerRunAsUser"]
    assert base.progress_interval_seconds == merged["operator"]["progressIntervalSeconds"]


def test_chart_schema_is_no_looser_than_the_operators_ranges() -> None:
    """Every number values.schema.json lets through for a CEPHALO_* setting lies in the
    operator's own range (cephalo.operator.config.BOUNDS): Helm refuses the rest earlier,
    the operator never has to."""
    import json

    from cephalo.operator.config import BOUNDS

    template = (CHART_DIR / "templates" / "deployment.yaml").read_text()
    pairs = re.findall(r"- name: (CEPHALO_\w+)\s+value: \{\{ \.Values\.([\w.]+)", template)
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    env_field = {("CEPHALO_OPERATOR_METRICS_PORT" if f == "metrics_port"
                  else "CEPHALO_" + f.upper()): f for f in BOUNDS}
    checked = set()
    for env, path in pairs:
        if env not in env_field:
            continue
        node = schema
        for key in path.split("."):
            node = node["properties"][key]
        low, inclusive, high = BOUNDS[env_field[env]]
        if "minimum" in node:
            assert node["minimum"] > low or (inclusive and node["minimum"] == low), env
        else:
            assert node.get("exclusiveMinimum", -float("inf")) >= low, env
        if high is not None:
            assert node.get("maximum", float("inf")) <= high, env
        checked.add(env_field[env])
    assert checked == set(BOUNDS), f"not set from the chart: {set(BOUNDS) - checked}"


def _seconds(duration: str) -> float:
    """A Prometheus Operator duration (e.g. 1m30s) in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+)(ms|s|m|h)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"bad duration {duration!r}"
    return sum(int(n) * units[u] for n, u in parts)


@pytest.mark.parametrize("values", [
    {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}},
    EVERYTHING_ON], ids=["defaults", "everything-on"])
def test_monitors_are_well_formed(values: dict[str, Any]) -> None:
    """No schema ships for Prometheus Operator kinds: check what it would reject."""
    objects = render(values)
    endpoints = one(objects, "ServiceMonitor")["spec"]["endpoints"] + \
        one(objects, "PodMonitor")["spec"]["podMetricsEndpoints"]
    for endpoint in endpoints:
        assert endpoint["port"] and endpoint["path"].startswith("/")
        interval = _seconds(endpoint["interval"])
        if "scrapeTimeout" in endpoint:
            assert _seconds(endpoint["scrapeTimeout"]) <= interval, endpoint
        for relabel in endpoint.get("relabelings", []):
            assert re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", relabel["targetLabel"])
    for monitor in by_kind(objects, "ServiceMonitor") + by_kind(objects, "PodMonitor"):
        assert monitor["spec"]["selector"]["matchLabels"]
        assert set(monitor["spec"]["namespaceSelector"]) <= {"any", "matchNames"}


def test_monitors_match_the_operator_and_its_trainer_pods() -> None:
    objects = render(EVERYTHING_ON)
    service = one(objects, "Service")
    monitor = one(objects, "ServiceMonitor")
    deployment = one(objects, "Deployment")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["metadata"]["labels"]["release"] == "kps"
    # The PodMonitor must select the rank pods the operator renders, on their metrics port.
    config = OperatorConfig.from_env(_env(deployment))
    job = parse_job(job_body("gpt", namespace="team-a", uid="00000000-0000-4000-8000-0000000000aa"))
    plan = Plan.model_validate({
        "global_batch_size": 64, "world_size": 1, "predicted_step_seconds": 1.0,
        "predicted_samples_per_second": 64.0,
        "ranks": [{"rank": 0, "gpu": "L4", "pool": "NVIDIA-L4", "batch_size": 64,
                   "micro_batch_size": 8, "num_micro_batches": 8, "shard_ratio": 1.0}]})
    rank_pod = by_kind(render_job(job, plan, config), "Pod")[0]
    podmonitor = one(objects, "PodMonitor")["spec"]
    assert podmonitor["selector"]["matchLabels"].items() <= rank_pod["metadata"]["labels"].items()
    assert job.metadata.namespace in podmonitor["namespaceSelector"]["matchNames"]
    ports = {p["name"]: p["containerPort"] for p in rank_pod["spec"]["containers"][0]["ports"]}
    endpoint = podmonitor["podMetricsEndpoints"][0]
    assert ports[endpoint["port"]] == EVERYTHING_ON["operator"]["trainerMetricsPort"]
    # Relabelings read pod labels the rank pod really has (Prometheus' meta label spelling).
    meta = {"__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", k)
            for k in rank_pod["metadata"]["labels"]} | {"__meta_kubernetes_pod_node_name",
                                                        "__meta_kubernetes_namespace"}
    for relabel in endpoint["relabelings"]:
        assert set(relabel["sourceLabels"]) <= meta, relabel
    assert one(render({"metrics": {"podMonitor": {"enabled": True}}}), "PodMonitor")[
        "spec"]["namespaceSelector"] == {"any": True}


def _documented_keys(schema: dict[str, Any], prefix: str = "") -> list[str]:
    """Value keys down to the schema's leaves (maps like `podLabels` are one key)."""
    keys = []
    for key, sub in schema.get("properties", {}).items():
        if key == "global":
            continue
        path = f"{prefix}{key}"
        keys += _documented_keys(sub, path + ".") if "properties" in sub else [path]
    return keys


def test_readme_documents_every_value_and_schema_describes_it() -> None:
    readme = (CHART_DIR / "README.md").read_text()
    schema = chart().schema
    assert schema is not None
    keys = _documented_keys(schema)
    missing = [k for k in keys if f"| `{k}` |" not in readme]
    assert not missing, f"charts/cephalo-operator/README.md does not document: {missing}"
    table = readme.split("## Values", 1)[1]
    documented = re.findall(r"^\| `([\w.]+)` \|", table, flags=re.MULTILINE)
    assert sorted(set(documented) - set(keys)) == [], "README documents values the chart lacks"

    def described(node: dict[str, Any], path: list[str]) -> None:
        for key, sub in node.get("properties", {}).items():
            assert sub.get("description") or sub.get("properties"), \
                f"values.schema.json: {'.'.join([*path, key])} has no description"
            described(sub, [*path, key])
    described(schema, [])
    # Every default in values.yaml is reachable through the schema (additionalProperties off).
    values = load_yaml(CHART_DIR / "values.yaml")
    chart().validate_schema(values)


def test_chart_version_matches_the_package() -> None:

    meta = chart().metadata
    project = pyproject()["project"]
    assert meta["appVersion"] == project["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+(-[\w.]+)?", meta["version"])
    values = load_yaml(CHART_DIR / "values.yaml")
    assert values["trainerImage"]["repository"] + ":" + meta["appVersion"] == \
        OperatorConfig().trainer_image, "the chart's default trainer image drifted from the " \
        "operator's built-in default (cephalo.operator.config.DEFAULT_TRAINER_IMAGE)"


def test_chart_packages_with_its_crd_dashboard_rules_and_readme(tmp_path: Path) -> None:
    archive = helm.package(CHART_DIR, destination=tmp_path)
    assert Path(archive).name == f"cephalo-operator-{chart().version}.tgz"
    with helm.Chart.load(archive) as packaged:
        names = {f["name"] for f in packaged.files}
        assert {"README.md", "dashboards/cephalo.json", "alerts/cephalo.rules.yaml"} <= names
        assert len(packaged.crds) == 1 and packaged.schema == chart().schema
        assert packaged.render({}, name="cephalo", namespace="x").keys() == \
            chart().render({}, name="cephalo", namespace="x").keys()
