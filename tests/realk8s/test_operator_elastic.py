"""Issue 28 under the real control plane: an elastic job grows onto the GPU another job lets
go. Job `hold` (maxGpus 1) trains on one of the two GPU nodes; job `grow` (spec.elastic) is
planned on the other. `hold` is deleted (kopf's finalizer, the real garbage collector, the
process kubelet stopping its rank); the operator sees the GPU free, re-plans `grow` on both
products (A6000 + P40: a heterogeneous plan), drains its rank at a step boundary (SIGTERM,
checkpoint on the shared claim, exit 143) and starts the two-rank gang, which the real
scheduler puts one rank on each node and which resumes from that checkpoint. Counted as a
rescale (status.elastic, the Rescaled Event), never as a restart or a preemption.

Rank 0 of each job serves /metrics on its own pod IP (the process kubelet gives each pod a
loopback address): when both served the same 127.0.0.1 port, the operator read `hold`'s
page as `grow`'s and drained `grow` before it had trained a step (now also refused by the
pod uid each page names).

Both "GPUs" are this machine's CPU cores, so their profiles differ by the load each was
measured under and nothing else: a CI run at load 8 measured the A6000 so much slower than
the P40 that the two-rank plan was predicted 40 % slower than the P40 alone, and the job
rightly did not grow. So the second product is given the first one's profile
(`_share_profile`: what the same cores measure without load's noise), and the two-rank plan
is predicted faster for the planner's own reason, half the batch on each rank."""

from __future__ import annotations

import re
from typing import Any

from cephalo.api import parse_job
from cephalo.api.profile import GpuProfile
from cephalo.operator.config import OperatorConfig
from cephalo.operator.render import PROFILE_KEY, profile_config_map_name
from cephalo.planner.cost.catalog import lookup_gpu

from .cluster import NODES, Cluster
from .operator_run import JOBS, Operator, tiny_job
from .rest import wait_until

STEP_SECONDS = 120.0  # a phase change on two shared cores (profiling included)
LONG = 1_000_000  # steps: the jobs run until the test ends them


def _status(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    return cluster.rest.get(f"{JOBS.format(ns=ns)}/{name}").body.get("status") or {}


def _ranks(cluster: Cluster, ns: str, name: str) -> list[dict[str, Any]]:
    return cluster.rest.must("GET", f"/api/v1/namespaces/{ns}/pods", params={
        "labelSelector": f"cephalo.dev/job={name},cephalo.dev/role=trainer"})["items"]


def _running(cluster: Cluster, ns: str, name: str, world_size: int) -> dict[str, Any] | None:
    """The job's status once it is Running under a plan of `world_size` ranks, every one
    of them a live pod Running, and rank 0 has reported a step (else None)."""
    status = _status(cluster, ns, name)
    pods = _ranks(cluster, ns, name)
    if (status.get("phase") == "Running" and (status.get("plan") or {}).get(
            "worldSize") == world_size and (status.get("progress") or {}).get("step")
            and len(pods) == world_size and all(
                (p.get("status") or {}).get("phase") == "Running"
                and not p["metadata"].get("deletionTimestamp") for p in pods)):
        return status
    return None


def _reasons(cluster: Cluster, ns: str, name: str) -> list[str]:
    return [e["reason"] for e in cluster.rest.must("GET", f"/api/v1/namespaces/{ns}/events",
            params={"fieldSelector": f"involvedObject.name={name}"})["items"]]


def _job(name: str, ns: str, **spec: Any) -> dict[str, Any]:
    body = tiny_job(name, ns, globalBatchSize=16, **spec)
    body["spec"]["training"]["steps"] = LONG
    body["spec"]["checkpoint"]["intervalSteps"] = 10_000  # the drain's checkpoint only
    return body


def _delete(cluster: Cluster, ns: str, name: str) -> None:
    cluster.rest.request("DELETE", f"{JOBS.format(ns=ns)}/{name}")  # 404: already gone
    wait_until(f"{name} deleted", lambda: cluster.rest.get(
        f"{JOBS.format(ns=ns)}/{name}").status == 404, STEP_SECONDS)
    wait_until(f"{name}'s pods gone", lambda: not _ranks(cluster, ns, name), STEP_SECONDS)


def _share_profile(cluster: Cluster, ns: str, held: dict[str, Any]) -> None:
    """The profile of the product `hold` runs on, put in the other product's cache entry
    (replacing one an earlier test measured: the namespace's cache is shared), as if measured
    there: grow then plans with no profiler run and with both products alike."""
    job = parse_job(_job("grow", ns))
    config = OperatorConfig.from_env()  # the operator's own: it runs with this environment
    product = {n.name: lookup_gpu(n.product).name for n in NODES}
    mine = product[held["spec"]["nodeName"]]
    (other,) = set(product.values()) - {mine}
    path = f"/api/v1/namespaces/{ns}/configmaps"
    measured = cluster.rest.must("GET", f"{path}/{profile_config_map_name(mine, job, config)}")
    profile = GpuProfile.model_validate_json(measured["data"][PROFILE_KEY])
    name = profile_config_map_name(other, job, config)
    cluster.rest.request("DELETE", f"{path}/{name}")  # 404: none yet
    cluster.rest.create(path, {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": ns, "labels": measured["metadata"]["labels"]},
        "data": {**measured["data"], "product": other, PROFILE_KEY: profile.model_copy(
            update={"product": other}).to_compact_json()}}, fieldValidation="Strict")


def test_elastic_job_grows_onto_the_gpu_a_deleted_job_let_go(
        cluster: Cluster, operator: Operator, job_namespace: str) -> None:
    ns = job_namespace
    try:
        _grow(cluster, ns)
    finally:  # the GPUs are the next test's: never leave a job holding them
        for name in ("hold", "grow"):
            _delete(cluster, ns, name)


def _grow(cluster: Cluster, ns: str) -> None:
    cluster.rest.create(JOBS.format(ns=ns), _job("hold", ns, maxGpus=1),
                        fieldValidation="Strict")
    wait_until("hold Running on one GPU", lambda: _running(cluster, ns, "hold", 1),
               STEP_SECONDS * 2, interval_seconds=0.2)
    (held,) = _ranks(cluster, ns, "hold")
    _share_profile(cluster, ns, held)
    # No assumed restart cost and no minimum gain: what is tested is the rescale through a
    # real API server and scheduler, not the decision's arithmetic (unit-tested).
    cluster.rest.create(JOBS.format(ns=ns), _job("grow", ns, elastic={
        "enabled": True, "restartCostSeconds": 0.0, "minGain": 0.0}), fieldValidation="Strict")
    first = wait_until("grow Running on the other GPU", lambda: _running(
        cluster, ns, "grow", 1), STEP_SECONDS, interval_seconds=0.2)
    # Its progress is its own rank's: the drain must come after a step it trained (else
    # nothing is checkpointed), and its log says it trained one.
    wait_until("grow's rank 0 logs a step", lambda: re.search(
        r"^step \d+/", cluster.kubelet.log_of(ns, "grow-rank-0"), re.M), STEP_SECONDS,
        interval_seconds=0.2)
    (rank,) = _ranks(cluster, ns, "grow")
    assert rank["spec"]["nodeName"] != held["spec"]["nodeName"]
    assert not (first.get("elastic") or {}).get("rescales")

    cluster.rest.must("DELETE", f"{JOBS.format(ns=ns)}/hold")
    try:
        grown = wait_until("grow re-planned and Running on both GPUs", lambda: _running(
            cluster, ns, "grow", 2), STEP_SECONDS * 2, interval_seconds=0.2)
    except AssertionError as err:  # say what the operator decided instead
        raise AssertionError(f"{err}; grow's status: {_status(cluster, ns, 'grow')}") from None
    elastic = grown["elastic"]
    decision = elastic["lastDecision"]
    assert elastic["rescales"] == 1 and decision["verdict"] == "Rescale", elastic
    assert (decision["currentGpus"], decision["candidateGpus"]) == (1, 2), decision
    assert not grown.get("restarts") and not grown.get("preemptions"), grown
    wait_until("the Rescaled Event", lambda: "Rescaled" in _reasons(cluster, ns, "grow"),
               STEP_SECONDS)
    # The real scheduler put one rank on each node; the products are mixed.
    pods = _ranks(cluster, ns, "grow")
    assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(n.name for n in NODES)
    assert grown["plan"]["pools"] == {n.product: 1 for n in NODES}, grown["plan"]
    # The drain: the one-rank gang's process took SIGTERM, checkpointed, and exited 143;
    # the new rank 0 resumed from that checkpoint past the step the drain began at.
    exits = cluster.kubelet.exits(ns, "grow-rank-0")
    assert len(exits) == 2 and exits[0] == 143, exits
    wait_until("the rescale measured (a step past the drain)", lambda: (
        _status(cluster, ns, "grow").get("elastic") or {}).get("restartSeconds"),
        STEP_SECONDS, interval_seconds=0.2)
    resumed = wait_until("the new rank 0 resumed from the drain's checkpoint", lambda: [
        line for line in cluster.kubelet.log_of(ns, "grow-rank-0").splitlines()
        if "resumed from" in line], STEP_SECONDS, interval_seconds=0.2)
    print(f"realk8s elastic: {decision['reason']}; {resumed[0]}")
