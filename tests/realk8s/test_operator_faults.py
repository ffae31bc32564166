"""One long job through what a real cluster does to it, under the real control plane: a rank
process killed (gang restart), suspend and resume (the pods really deleted and recreated),
a node NotReady (re-plan on the GPU left), the node in use deleted (re-plan onto the one
Ready again), and delete while running (kopf's finalizer, then the real garbage collector
removes every object the job owned, and the process kubelet stops the processes); then the
API server restarted over a compacted etcd (every watch 410 Gone): the operator still takes
up new jobs and lets deleted ones go. Until the long job is deleted, `cephalo logs long --all
-f` (the real command, a process of its own) follows the ranks' logs through the real API
server and the process kubelet's log endpoint: into each next attempt's pods."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from .cluster import NODES, Cluster
from .operator_run import JOBS, Operator, phases_until, profiles_cached_for, tiny_job
from .rest import wait_until

STEP_SECONDS = 120.0  # a phase change on two shared cores (profiling included)


def _status(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    return cluster.rest.get(f"{JOBS.format(ns=ns)}/{name}").body.get("status") or {}


def _ranks(cluster: Cluster, ns: str, name: str) -> list[dict[str, Any]]:
    return cluster.rest.must("GET", f"/api/v1/namespaces/{ns}/pods", params={
        "labelSelector": f"cephalo.dev/job={name},cephalo.dev/role=trainer"})["items"]


def _running_ranks(cluster: Cluster, ns: str, name: str, count: int) -> list[dict[str, Any]]:
    """`count` rank pods Running (their processes started by the process kubelet)."""
    return wait_until(f"{count} running rank pods of {name}", lambda: (
        ps if len(ps := _ranks(cluster, ns, name)) == count and all(
            (p.get("status") or {}).get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp") for p in ps) else None),
        STEP_SECONDS, interval_seconds=0.2)


def _watch_gone(cluster: Cluster, path: str, resource_version: str) -> bool | None:
    """Is a watch from `resource_version` refused as too old (410 Gone: an ERROR event, or
    the status itself)? None while the API server cannot say yet (its watch cache is still
    initializing after a restart: 429)."""
    reply = cluster.rest.request("GET", path, params={
        "watch": "1", "resourceVersion": resource_version, "timeoutSeconds": "5"})
    if reply.status == 429 or reply.status >= 500:
        return None
    if reply.status == 410:
        return True
    event = reply.body if "type" in reply.body else {}
    assert event.get("type") == "ERROR", f"watch from {resource_version}: {reply}"
    return bool(event["object"].get("code") == 410)


def _phase(cluster: Cluster, ns: str, name: str, phase: str) -> dict[str, Any]:
    return wait_until(f"{name} {phase} (now {_status(cluster, ns, name).get('phase')})",
                      lambda: s if (s := _status(cluster, ns, name)).get("phase") == phase
                      else None, STEP_SECONDS, interval_seconds=0.2)


def test_killed_rank_suspend_resume_node_loss_and_delete_while_running(
        cluster: Cluster, operator: Operator, job_namespace: str, tmp_path: Path) -> None:
    ns, name = job_namespace, "long"
    body = tiny_job(name, ns, terminationGracePeriodSeconds=10, backoffLimit=3)
    cached = profiles_cached_for(cluster, ns, body)  # the job test's, when it ran first
    body["spec"]["training"]["steps"] = 1_000_000  # runs until the test ends it
    created = cluster.rest.create(JOBS.format(ns=ns), body, fieldValidation="Strict")
    follow_log = tmp_path / "cephalo-logs-f.txt"
    with follow_log.open("w") as out:
        follower = subprocess.Popen(
            [str(Path(sys.executable).parent / "cephalo"), "logs", name, "--all", "-f", "-n",
             ns, "--kubeconfig", str(cluster.plane.kubeconfig)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    # Profiled (unless cached), planned, running: every phase from a watch.
    phases, _ = phases_until(cluster, ns, name, created["metadata"]["resourceVersion"],
                             {"Running", "Failed"}, STEP_SECONDS)
    assert [p for p in phases if p in ("Profiling", "Planning", "Running")] == (
        ["Planning", "Running"] if cached else ["Profiling", "Planning", "Running"]), phases

    # A rank dies (SIGKILL): the whole gang restarts, as new pods.
    first = _running_ranks(cluster, ns, name, 2)
    # ... once the follower reads the first gang's logs (kubelet's side: a follow stream).
    wait_until("cephalo logs -f following both ranks", lambda: all(
        cluster.kubelet.newest(ns, f"{name}-rank-{r}").followers for r in (0, 1)), STEP_SECONDS)
    _phase(cluster, ns, name, "Running")
    cluster.kubelet.kill(ns, f"{name}-rank-1")
    wait_until("a gang restart counted", lambda: (_status(cluster, ns, name).get("restarts")
                                                  or 0) >= 1, STEP_SECONDS)
    second = _running_ranks(cluster, ns, name, 2)
    assert not {p["metadata"]["uid"] for p in first} & {p["metadata"]["uid"] for p in second}
    # The follower looks for new pods once a second and the test moves on within one: wait
    # until it follows the new gang too (else a pod living under a second may be missed).
    new_uids = {p["metadata"]["uid"] for p in second}
    wait_until("cephalo logs -f following the restarted gang", lambda: all(
        (c := cluster.kubelet.containers.get(uid)) is not None and c.log is not None
        and c.log.followers for uid in new_uids), STEP_SECONDS)
    _phase(cluster, ns, name, "Running")

    # Suspend: every rank pod really goes (terminated by the kubelet, deleted for good).
    cluster.rest.merge_patch(f"{JOBS.format(ns=ns)}/{name}", {"spec": {"suspend": True}})
    _phase(cluster, ns, name, "Suspended")
    wait_until("no rank pods while suspended", lambda: not _ranks(cluster, ns, name),
               STEP_SECONDS)
    # Resume: the ranks come back.
    cluster.rest.merge_patch(f"{JOBS.format(ns=ns)}/{name}", {"spec": {"suspend": False}})
    _running_ranks(cluster, ns, name, 2)
    _phase(cluster, ns, name, "Running")

    # A node goes NotReady (its kubelet reports Ready=False; the real node-lifecycle
    # controller taints it): the job re-plans without that node's GPU, one rank on the other.
    sick, well = NODES[1], NODES[0]
    try:
        cluster.heartbeat.set_ready(sick.name, False)
        wait_until("a re-plan without the NotReady node", lambda: (
            _status(cluster, ns, name).get("plan") or {}).get("worldSize") == 1, STEP_SECONDS)
        (survivor,) = _running_ranks(cluster, ns, name, 1)
        assert survivor["spec"]["nodeName"] == well.name
        _phase(cluster, ns, name, "Running")
    finally:
        cluster.heartbeat.set_ready(sick.name, True)

    # The node in use is lost (deleted): the job re-plans onto the one that is Ready again
    # (the controller lifted its taints).
    try:
        cluster.rest.must("DELETE", f"/api/v1/nodes/{well.name}")
        wait_until(f"the rank re-planned onto {sick.name}", lambda: [
            p["spec"]["nodeName"] for p in _running_ranks(cluster, ns, name, 1)] == [sick.name],
            STEP_SECONDS)
        _phase(cluster, ns, name, "Running")
    finally:  # the node comes back for the tests after this one
        if not cluster.rest.get(f"/api/v1/nodes/{well.name}").ok:
            cluster.heartbeat.register(well)

    # The follower went on into each next attempt's pods: the last one's rank 0 training.
    # Waited on the kubelet's newest rank 0 container, not on the follower's last announced
    # attempt: a fresh-clone CI run at load 8 read the previous attempt's steps there, deleted
    # the job before the newest pod wrote a line, and found that pod's log missing.
    def newest_step_followed() -> bool:
        newest = cluster.kubelet.newest(ns, f"{name}-rank-0")
        steps = [line for line in newest.text().splitlines() if line.startswith("step ")]
        return bool(steps and newest.followers) and \
            f"[rank 0] {steps[0]}" in follow_log.read_text()
    wait_until("cephalo logs -f showing the newest rank 0 pod's steps", newest_step_followed,
               STEP_SECONDS)

    # Delete while running: the job goes, and the garbage collector takes what it owned.
    owned = cluster.rest.must("GET", f"/api/v1/namespaces/{ns}/configmaps", params={
        "labelSelector": f"cephalo.dev/job={name}"})["items"]
    assert owned, "the job's ConfigMaps (spec, plan) carry its label"
    cluster.rest.must("DELETE", f"{JOBS.format(ns=ns)}/{name}")
    wait_until("the job gone", lambda: cluster.rest.get(
        f"{JOBS.format(ns=ns)}/{name}").status == 404, STEP_SECONDS)

    def leftovers() -> list[str]:
        found = []
        for kind in ("pods", "configmaps", "services"):
            items = cluster.rest.must("GET", f"/api/v1/namespaces/{ns}/{kind}", params={
                "labelSelector": f"cephalo.dev/job={name}"})["items"]
            found += [f"{kind}/{i['metadata']['name']}" for i in items]
        return found
    wait_until("the garbage collector removing the job's objects",
               lambda: not leftovers(), STEP_SECONDS)
    alive = [c.key for c in cluster.kubelet.containers.values()
             if c.key.startswith(f"{ns}/") and c.proc is not None and c.proc.poll() is None]
    assert not alive, f"processes still running after their pods were deleted: {alive}"
    _check_followed_logs(cluster, ns, name, follower, follow_log)

    # Every watch breaks and cannot resume (the API server restarted, etcd compacted past
    # every resourceVersion): a watch from before is 410 Gone. The operator re-lists and
    # goes on: it takes up a job created after the restart, and lets one from before go.
    cluster.rest.create(JOBS.format(ns=ns), tiny_job("kept", ns, suspend=True))
    _phase(cluster, ns, "kept", "Suspended")
    before = cluster.rest.must("GET", JOBS.format(ns=ns))["metadata"]["resourceVersion"]
    cluster.plane.restart_apiserver_compacted()
    wait_until(f"an answer to a watch from resourceVersion {before}", lambda: _watch_gone(
        cluster, JOBS.format(ns=ns), before) is not None, STEP_SECONDS)
    assert _watch_gone(cluster, JOBS.format(ns=ns), before)
    cluster.rest.create(JOBS.format(ns=ns), tiny_job("later", ns, suspend=True))
    _phase(cluster, ns, "later", "Suspended")
    kept = f"{JOBS.format(ns=ns)}/kept"
    assert "cephalo.dev/operator" in cluster.rest.must("GET", kept)["metadata"]["finalizers"]
    cluster.rest.must("DELETE", kept)  # kopf must see it to remove its finalizer
    wait_until("the job from before the restart deleted", lambda: cluster.rest.get(
        kept).status == 404, STEP_SECONDS)
    cluster.rest.must("DELETE", f"{JOBS.format(ns=ns)}/later")  # leave no job behind
    wait_until("the job from after the restart deleted", lambda: cluster.rest.get(
        f"{JOBS.format(ns=ns)}/later").status == 404, STEP_SECONDS)


def _check_followed_logs(cluster: Cluster, ns: str, name: str,
                         follower: subprocess.Popen[bytes], follow_log: Path) -> None:
    """`cephalo logs --all -f` ended by itself once the job was gone (exit 0), and printed
    rank 0's lines exactly as the kubelet kept them, for every incarnation of its pod (the
    gang restart, resume and re-plan made new ones), each later attempt announced."""
    try:
        follower.wait(STEP_SECONDS)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    text = follow_log.read_text()
    assert follower.returncode == 0, text[-3000:]
    printed: dict[str, list[str]] = {}
    for line in text.splitlines():
        assert line.startswith("[rank ") or line.startswith("[profiler "), line
        label, _, rest = line[1:].partition("] ")
        printed.setdefault(label, []).append(rest)
    marker = "--- attempt 1: pod {pod} (the gang restarted) ---"
    for rank in (0, 1):
        assert marker.format(pod=f"{name}-rank-{rank}") in printed.get(f"rank {rank}", []), (
            rank, text[-6000:])
    # Rank 0's output: each incarnation's log in full, in order (whichever node ran it). The
    # follower looks for new pods once a second, so a pod that lived less than that may be
    # missed whole (never cut short); the last one's is there (the test waited for its steps).
    ran = [c.log.text().splitlines() for c in cluster.kubelet.containers.values()
           if c.key == f"{ns}/{name}-rank-0" and c.log is not None]
    assert len(ran) >= 3, len(ran)  # the first gang, after the kill, after the resume, ...
    shown = [x for x in printed["rank 0"] if not x.startswith("--- attempt ")]
    at, found = 0, []
    for i, lines in enumerate(ran):
        if lines and shown[at:at + len(lines)] == lines:
            at += len(lines)
            found.append(i)
    assert at == len(shown), f"lines no kubelet log has: {shown[at:at + 5]}"
    assert found and found[-1] == len(ran) - 1, (found, len(ran))
