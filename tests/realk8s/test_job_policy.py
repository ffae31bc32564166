"""Issue 39 item 9, the operator as a confused deputy, with the real kube-apiserver as the
judge: the chart's ValidatingAdmissionPolicy (installed by real `helm install` with the
default values) refuses at `kubectl apply` a CephaloJob with a hostPath volume or a
serviceAccountName, saying what is refused and which chart value allows it, and admits an
emptyDir; rendered by real `helm template` with values that opt in, it admits hostPath and
the listed service account only. Its CEL type-checks against the chart's CRD. Issue 46 item
7: rendered with lists of allowed image registries, PriorityClasses and tolerations, it
refuses an image, a PriorityClass and a toleration outside them (dry runs: no job runs) and
admits those on them."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cephalo.operator.policy import RESTRICTED_VOLUME_TYPES

from .cluster import CHART, OPERATOR_NAMESPACE, RELEASE, Cluster, run_tool
from .controlplane import k8s_version
from .operator_run import tiny_job
from .rest import wait_until

JOBS = "/apis/cephalo.dev/v1alpha1/namespaces/{ns}/cephalojobs"
POLICIES = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
POLICY = f"{RELEASE}-cephalo-operator-job-policy"
HOST_PATH = {"name": "h", "hostPath": {"path": "/"}}
MOUNT = [{"name": "h", "mountPath": "/host"}]
OPT_IN = ["--set", "jobPolicy.allowedVolumeTypes={emptyDir,persistentVolumeClaim,hostPath}",
          "--set", "jobPolicy.serviceAccountName.allowed=true",
          "--set", "jobPolicy.serviceAccountName.names={trainer}"]


@pytest.fixture(scope="module")
def policy_namespace(cluster: Cluster, crd: dict[str, Any]) -> str:
    ns = cluster.namespace("policy")
    wait_until("the CephaloJob endpoint served", lambda: cluster.rest.get(
        JOBS.format(ns=ns)).ok, 30)
    return ns


def _job(ns: str, name: str, **template: Any) -> dict[str, Any]:
    return tiny_job(name, ns, podTemplate=template)


def _dry_run(cluster: Cluster, job: dict[str, Any]) -> tuple[bool, str]:
    ns = job["metadata"]["namespace"]
    reply = cluster.rest.request("POST", JOBS.format(ns=ns), job, params={"dryRun": "All"})
    assert reply.status < 500, reply.message
    return reply.ok, reply.message


def _apply(cluster: Cluster, job: dict[str, Any], folder: Path) -> subprocess.CompletedProcess[str]:
    """Real `kubectl apply -f` of the job (the user's path), its output kept."""
    path = folder / f"{job['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(job))
    return run_tool(cluster, "kubectl", "apply", "-f", str(path), check=False)


def _render_policy(cluster: Cluster, folder: Path, *values: str,
                   kube_version: str | None = None) -> Path:
    done = run_tool(cluster, "helm", "template", RELEASE, str(CHART), "-n", OPERATOR_NAMESPACE,
                    "--kube-version", kube_version or k8s_version().lstrip("v"),
                    "--show-only", "templates/jobpolicy.yaml", *values)
    path = folder / f"policy-{len(values)}.yaml"
    path.write_text(done.stdout)
    return path


def _enforced(cluster: Cluster, job: dict[str, Any], admitted: bool) -> None:
    """Wait until the API server's policy informer has the current policy (a new policy is
    picked up asynchronously), judged by a dry run of `job`."""
    wait_until(f"{job['metadata']['name']} {'admitted' if admitted else 'refused'}",
               lambda: _dry_run(cluster, job)[0] == admitted, 30)


def test_policy_type_checks_against_the_crd(cluster: Cluster, crd: dict[str, Any]) -> None:
    def checked() -> dict[str, Any] | None:
        body = cluster.rest.get(f"{POLICIES}/{POLICY}").body
        status = body.get("status") or {}
        done = status.get("observedGeneration") == body["metadata"]["generation"]
        return status if done else None
    status = wait_until("the policy type-checked", checked, 30)
    assert not (status.get("typeChecking") or {}).get("expressionWarnings"), status
    assert not [c for c in status.get("conditions") or [] if c.get("status") == "False"], status


def test_default_policy_refuses_host_path_and_service_account_at_kubectl_apply(
        cluster: Cluster, policy_namespace: str, tmp_path: Path) -> None:
    ns = policy_namespace
    host = _job(ns, "host", volumes=[HOST_PATH, {"name": "e", "emptyDir": {}}],
                volumeMounts=MOUNT)
    _enforced(cluster, host, admitted=False)
    refused = _apply(cluster, host, tmp_path)
    assert refused.returncode != 0, refused.stdout
    assert "ValidatingAdmissionPolicy" in refused.stderr, refused.stderr
    # the offending volume and its type named, the allowed ones and the value to change
    assert "volume h is hostPath" in refused.stderr and "volume e" not in refused.stderr, \
        refused.stderr
    assert "allowed: configMap, csi, downwardAPI, emptyDir, ephemeral, " \
           "persistentVolumeClaim, projected, secret" in refused.stderr, refused.stderr
    assert "jobPolicy.allowedVolumeTypes" in refused.stderr, refused.stderr

    identity = _job(ns, "identity", serviceAccountName="default")
    refused = _apply(cluster, identity, tmp_path)
    assert refused.returncode != 0, refused.stdout
    assert "podTemplate.serviceAccountName default is not allowed" in refused.stderr, \
        refused.stderr
    assert "jobPolicy.serviceAccountName.allowed" in refused.stderr, refused.stderr

    scratch = _job(ns, "scratch", volumes=[{"name": "e", "emptyDir": {}}],
                   volumeMounts=[{"name": "e", "mountPath": "/scratch"}])
    created = _apply(cluster, scratch, tmp_path)
    assert created.returncode == 0, created.stderr
    assert "created" in created.stdout, created.stdout
    # An edit that adds hostPath to the admitted job is refused too (UPDATE is judged) ...
    scratch["spec"]["podTemplate"]["volumes"].append(HOST_PATH)
    scratch["spec"]["podTemplate"]["volumeMounts"].append(MOUNT[0])
    edited = _apply(cluster, scratch, tmp_path)
    assert edited.returncode != 0 and "volume h is hostPath" in edited.stderr, edited.stderr
    # ... while an update that leaves the spec alone is not judged (finalizers, labels).
    labelled = run_tool(cluster, "kubectl", "label", "-n", ns, "cephalojob", "scratch", "a=b",
                        check=False)
    assert labelled.returncode == 0, labelled.stderr
    run_tool(cluster, "kubectl", "delete", "-n", ns, "cephalojob", "scratch")


@pytest.fixture
def opted_in(cluster: Cluster, crd: dict[str, Any], policy_namespace: str,
             tmp_path: Path) -> Iterator[None]:
    """The policy rendered with values that opt in, applied over the chart's; the chart's
    default policy put back afterwards (later tests share the API server)."""
    probe = _job(policy_namespace, "probe", volumes=[HOST_PATH], volumeMounts=MOUNT)
    run_tool(cluster, "kubectl", "apply", "-f", str(_render_policy(cluster, tmp_path, *OPT_IN)))
    try:
        _enforced(cluster, probe, admitted=True)
        yield
    finally:
        run_tool(cluster, "kubectl", "apply", "-f", str(_render_policy(cluster, tmp_path)))
        _enforced(cluster, probe, admitted=False)


def test_values_that_opt_in_admit_host_path_and_the_listed_service_account(
        cluster: Cluster, policy_namespace: str, opted_in: None, tmp_path: Path) -> None:
    ns = policy_namespace
    host = _job(ns, "host-allowed", volumes=[HOST_PATH], volumeMounts=MOUNT,
                serviceAccountName="trainer")
    created = _apply(cluster, host, tmp_path)
    assert created.returncode == 0, created.stderr
    run_tool(cluster, "kubectl", "delete", "-n", ns, "cephalojob", "host-allowed")
    other = _job(ns, "other-account", serviceAccountName="default")
    refused = _apply(cluster, other, tmp_path)
    assert refused.returncode != 0, refused.stdout
    assert "podTemplate.serviceAccountName default is not one this cluster's Cephalo " \
           "policy allows (trainer)" in refused.stderr, refused.stderr
    assert "jobPolicy.serviceAccountName.names" in refused.stderr, refused.stderr
    # configMap is no longer in the (narrowed) list: refused, the list said
    config = _job(ns, "config-volume", volumes=[{"name": "c", "configMap": {"name": "x"}}])
    refused = _apply(cluster, config, tmp_path)
    assert refused.returncode != 0 and "volume c is configMap" in refused.stderr and \
        "allowed: emptyDir, persistentVolumeClaim, hostPath" in refused.stderr, refused.stderr


# One valid volume of each type the default allows, and two it refuses.
VOLUMES = {"configMap": {"name": "x"}, "csi": {"driver": "example.com"},
           "downwardAPI": {"items": []}, "emptyDir": {},
           "ephemeral": {"volumeClaimTemplate": {"spec": {
               "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}},
           "persistentVolumeClaim": {"claimName": "x"}, "projected": {"sources": []},
           "secret": {"secretName": "x"}, "hostPath": {"path": "/"},
           "nfs": {"server": "nfs.example.com", "path": "/"}}


def test_default_volume_types_are_what_pod_security_restricted_allows(
        cluster: Cluster, policy_namespace: str) -> None:
    """The default list is the real Pod Security `restricted` one: of a pod per volume type
    (otherwise restricted-clean) in a namespace that enforces it, the API server admits
    exactly those the default allows."""
    admitted = []
    for kind, source in VOLUMES.items():
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": kind.lower(), "namespace": policy_namespace},
               "spec": {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                            "seccompProfile": {"type": "RuntimeDefault"}},
                        "containers": [{"name": "c", "image": "x", "securityContext": {
                            "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}}}],
                        "volumes": [{"name": "v", kind: source}]}}
        reply = cluster.rest.request("POST", f"/api/v1/namespaces/{policy_namespace}/pods",
                                     pod, params={"dryRun": "All"})
        assert reply.ok or (reply.status == 403 and "restricted" in reply.message), \
            f"{kind}: {reply.status} {reply.message}"
        if reply.ok:
            admitted.append(kind)
    assert tuple(admitted) == RESTRICTED_VOLUME_TYPES


def test_clusters_older_than_1_30_get_no_admission_policy(cluster: Cluster,
                                                         tmp_path: Path) -> None:
    """admissionregistration.k8s.io/v1 policies are GA from 1.30: real Helm renders none for
    an older cluster (the chart still installs there; the operator's check remains)."""
    assert _render_policy(cluster, tmp_path, kube_version="1.30.0").read_text().strip()
    older = run_tool(cluster, "helm", "template", RELEASE, str(CHART), "-n", OPERATOR_NAMESPACE,
                     "--kube-version", "1.29.0")
    kinds = {d["kind"] for d in yaml.safe_load_all(older.stdout) if d}
    assert "Deployment" in kinds and not kinds & {"ValidatingAdmissionPolicy",
                                                  "ValidatingAdmissionPolicyBinding"}, kinds


RESTRICT = ["--set", "jobPolicy.allowedVolumeTypes={emptyDir,image}",
            "--set", "jobPolicy.allowedImagePrefixes={registry.example.com,"
            "ghcr.io/cephalo/cephalo-trainer}",
            "--set", "jobPolicy.allowedPriorityClassNames={batch}",
            "--set", "jobPolicy.allowedTolerations[0].key=dedicated",
            "--set", "jobPolicy.allowedTolerations[0].effect=NoSchedule",
            "--set", "jobPolicy.allowedTolerations[1].key=example.com/spot"]


def _type_checked(cluster: Cluster) -> dict[str, Any]:
    """The policy's status once the API server has type-checked its current generation."""
    def checked() -> dict[str, Any] | None:
        body = cluster.rest.get(f"{POLICIES}/{POLICY}").body
        status = body.get("status") or {}
        return status if status.get("observedGeneration") == \
            body["metadata"]["generation"] else None
    return wait_until("the policy type-checked", checked, 30)


@pytest.fixture
def restricted(cluster: Cluster, crd: dict[str, Any], policy_namespace: str,
               tmp_path: Path) -> Iterator[None]:
    """The policy rendered with image, PriorityClass and toleration lists, applied over the
    chart's; the chart's default policy (no such lists) put back afterwards."""
    probe = tiny_job("probe", policy_namespace, image="docker.io/evil/trainer:1")
    run_tool(cluster, "kubectl", "apply", "-f",
             str(_render_policy(cluster, tmp_path, *RESTRICT)))
    try:
        _enforced(cluster, probe, admitted=False)
        yield
    finally:
        run_tool(cluster, "kubectl", "apply", "-f", str(_render_policy(cluster, tmp_path)))
        _enforced(cluster, probe, admitted=True)


def test_lists_refuse_images_priority_classes_and_tolerations_outside_them(
        cluster: Cluster, policy_namespace: str, restricted: None) -> None:
    ns = policy_namespace
    status = _type_checked(cluster)  # the new CEL type-checks against the CRD
    assert not (status.get("typeChecking") or {}).get("expressionWarnings"), status
    refusals = {
        "image": (tiny_job("image", ns, image="docker.io/evil/trainer:1"),
                  "spec.image docker.io/evil/trainer:1: not from a registry this cluster's "
                  "Cephalo policy allows (allowed: registry.example.com, "
                  "ghcr.io/cephalo/cephalo-trainer)", "jobPolicy.allowedImagePrefixes"),
        "look-alike": (tiny_job("look-alike", ns, image="registry.example.com.evil.io/t:1"),
                       "spec.image registry.example.com.evil.io/t:1: not from a registry",
                       "jobPolicy.allowedImagePrefixes"),
        # podTemplate's own image: an `image` volume (an OCI artifact)
        "image-volume": (_job(ns, "image-volume", volumes=[
                             {"name": "w", "image": {"reference": "evil.io/w:1"}}]),
                         "podTemplate.volumes: volume w image evil.io/w:1: not from a registry",
                         "jobPolicy.allowedImagePrefixes"),
        "priority": (tiny_job("priority", ns, schedulingPolicy={
                         "priorityClassName": "system-node-critical"}),
                     "schedulingPolicy.priorityClassName system-node-critical: not a "
                     "PriorityClass this cluster's Cephalo policy allows (allowed: batch)",
                     "jobPolicy.allowedPriorityClassNames"),
        "toleration": (_job(ns, "toleration", tolerations=[
                           {"key": "dedicated", "operator": "Exists", "effect": "NoExecute"}]),
                       "podTemplate.tolerations: key dedicated effect NoExecute: not a "
                       "toleration this cluster's Cephalo policy allows (allowed: "
                       "dedicated:NoSchedule, example.com/spot)",
                       "jobPolicy.allowedTolerations"),
        "every-taint": (_job(ns, "every-taint", tolerations=[{"operator": "Exists"}]),
                        "podTemplate.tolerations: one without a key (it tolerates every "
                        "taint)", "jobPolicy.allowedTolerations"),
    }
    for what, (job, said, value) in refusals.items():
        ok, message = _dry_run(cluster, job)
        assert not ok, f"{what}: admitted"
        assert said in message and value in message, f"{what}: {message}"
    allowed = tiny_job("allowed", ns, image="ghcr.io/cephalo/cephalo-trainer:0.1.0",
                       schedulingPolicy={"priorityClassName": "batch"},
                       podTemplate={"priorityClassName": "batch", "volumes": [
                           {"name": "w", "image": {"reference": "registry.example.com/w:1"}}],
                                    "tolerations": [
                           {"key": "dedicated", "operator": "Equal", "value": "ml",
                            "effect": "NoSchedule"},
                           {"key": "example.com/spot", "operator": "Exists"}]})
    ok, message = _dry_run(cluster, allowed)
    assert ok, message
    ok, message = _dry_run(cluster, tiny_job("registry", ns,
                                             image="registry.example.com/ml/trainer:1"))
    assert ok, message
