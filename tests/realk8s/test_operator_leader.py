"""Two operator replicas under leader election (cephalo.operator.leader) on the real control
plane: the Lease is a real `coordination.k8s.io/v1` object of the real kube-apiserver, written
under the chart's RBAC (the operator's ServiceAccount token; get/update limited to the chart's
Lease name).

While a job trains, the leader is SIGKILLed five times (a replacement candidate started after
each kill, as the Deployment would): each time the standby takes the Lease and its handlers
run within lease duration + retry period + start-up; never two replicas Ready at one
sample; the rank pods the first leader created run on (none duplicated, no gang restart);
the job still Succeeds. The failover times (SIGKILL to the new leader's Lease, to its
/readyz, to its first write to the job) are printed: median and worst of the five. Last, a
clean stop releases the Lease and the standby takes it at once.
"""

from __future__ import annotations

import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .cluster import OPERATOR_NAMESPACE, Cluster
from .controlplane import free_port
from .operator_auth import operator_kubeconfig
from .operator_run import JOBS, Operator, phases_until, tiny_job
from .rest import wait_until

KILLS = 5
# Short durations keep the test quick; the chart's defaults are 15 / 10 / 2 s.
LEASE_SECONDS, RENEW_DEADLINE_SECONDS, RETRY_SECONDS = 6, 4.0, 0.5
# Lease + retry, plus the new leader's kopf start (seconds of two shared cores).
TAKEOVER_SECONDS = LEASE_SECONDS + RETRY_SECONDS + 30.0
STEP_SECONDS = 180.0


class Replica:
    """One operator replica as the chart runs it (leader election on), its probes' port."""

    def __init__(self, cluster: Cluster, folder: Path, index: int, lease: str,
                 trainer_metrics_port: str) -> None:
        self.probe_port, self.metrics_port = free_port(), free_port()
        self.operator = Operator(operator_kubeconfig(cluster), folder / f"replica-{index}.log", {
            "CEPHALO_LEADER_ELECTION_NAMESPACE": OPERATOR_NAMESPACE,
            "CEPHALO_LEADER_ELECTION_LEASE": lease,
            "CEPHALO_LEASE_DURATION_SECONDS": str(LEASE_SECONDS),
            "CEPHALO_RENEW_DEADLINE_SECONDS": str(RENEW_DEADLINE_SECONDS),
            "CEPHALO_RETRY_PERIOD_SECONDS": str(RETRY_SECONDS),
            "CEPHALO_PROBE_PORT": str(self.probe_port),
            "CEPHALO_OPERATOR_METRICS_PORT": str(self.metrics_port),
            # One configuration for all replicas, as one Deployment gives them.
            "CEPHALO_TRAINER_METRICS_PORT": trainer_metrics_port})

    def _get(self, port: int, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                return int(r.status), r.read().decode()
        except urllib.error.HTTPError as err:
            return int(err.code), err.read().decode()
        except OSError:
            return 0, ""  # not serving (yet, or any more)

    def ready(self) -> bool:
        return self._get(self.probe_port, "/readyz")[0] == 200

    def alive(self) -> bool:
        return self._get(self.probe_port, "/healthz")[0] == 200

    def leader_gauge(self) -> float | None:
        code, text = self._get(self.metrics_port, "/metrics")
        for line in text.splitlines() if code == 200 else []:
            if line.startswith("cephalo_operator_leader "):
                return float(line.split()[1])
        return None


def _holder(cluster: Cluster, lease: str) -> str:
    got = cluster.rest.get(
        f"/apis/coordination.k8s.io/v1/namespaces/{OPERATOR_NAMESPACE}/leases/{lease}")
    return str(((got.body or {}).get("spec") or {}).get("holderIdentity") or "") if got.ok \
        else ""


def _ranks(cluster: Cluster, ns: str, name: str) -> list[dict[str, Any]]:
    return cluster.rest.must("GET", f"/api/v1/namespaces/{ns}/pods", params={
        "labelSelector": f"cephalo.dev/job={name},cephalo.dev/role=trainer"})["items"]


@pytest.fixture
def no_session_operator(operator_process: Operator) -> Iterator[None]:
    """The session's single operator (no election) is stopped for this test: it would
    reconcile the same jobs. It comes back for the tests after this one."""
    operator_process.stop()
    try:
        yield
    finally:
        operator_process.restart()


def test_standby_takes_over_a_running_job_when_the_leader_is_killed(
        cluster: Cluster, installed_chart: object, job_namespace: str,
        no_session_operator: None, tmp_path: Path, on_failure: Any) -> None:
    ns, name = job_namespace, "ha"
    deployment = cluster.rest.must(
        "GET", f"/apis/apps/v1/namespaces/{OPERATOR_NAMESPACE}/deployments")["items"][0]
    env = {e["name"]: e.get("value") for e in
           deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    lease = env["CEPHALO_LEADER_ELECTION_LEASE"]  # the name the chart's Role allows
    assert env["CEPHALO_LEADER_ELECTION_NAMESPACE"] == OPERATOR_NAMESPACE
    trainer_port = str(free_port())
    replicas = [Replica(cluster, tmp_path, i, lease, trainer_port) for i in range(2)]
    for r in replicas:
        on_failure(r.operator.log)
    try:
        _run(cluster, ns, name, lease, replicas, tmp_path, trainer_port)
    finally:
        for r in replicas:
            r.operator.stop()


def _one_leader(replicas: list[Replica]) -> Replica | None:
    """The one Ready replica (None: none yet); two at once fails the test."""
    ready = [r for r in replicas if r.operator.proc.poll() is None and r.ready()]
    assert len(ready) <= 1, f"{len(ready)} replicas Ready (leading) at once"
    return ready[0] if ready else None


def _run(cluster: Cluster, ns: str, name: str, lease: str, replicas: list[Replica],
         folder: Path, trainer_port: str) -> None:
    leader = wait_until("a leader", lambda: _one_leader(replicas), TAKEOVER_SECONDS)
    standby = next(r for r in replicas if r is not leader)
    wait_until("the standby's /healthz", standby.alive, TAKEOVER_SECONDS)
    assert not standby.ready() and _one_leader(replicas) is leader
    assert leader.leader_gauge() == 1.0 and standby.leader_gauge() == 0.0
    body = tiny_job(name, ns, terminationGracePeriodSeconds=10)
    # Seconds of steps on two shared cores: the first kills come mid-run, the job ends after.
    body["spec"]["training"]["steps"] = 40
    created = cluster.rest.create(JOBS.format(ns=ns), body, fieldValidation="Strict")
    phases_until(cluster, ns, name, created["metadata"]["resourceVersion"],
                 {"Running", "Failed"}, STEP_SECONDS)
    first = wait_until("2 running rank pods", lambda: (
        ps if len(ps := _ranks(cluster, ns, name)) == 2 and all(
            (p.get("status") or {}).get("phase") == "Running" for p in ps) else None),
        STEP_SECONDS, interval_seconds=0.2)
    uids = {p["metadata"]["uid"] for p in first}
    wait_until("rank 0 training (a step done)", lambda: any(
        line.startswith("step ") for line in cluster.kubelet.log_of(
            ns, f"{name}-rank-0").splitlines()), STEP_SECONDS)

    to_lease, to_ready, to_write, steps_at_kill = [], [], [], []
    job_path = f"{JOBS.format(ns=ns)}/{name}"
    for kill in range(KILLS):
        old_holder = _holder(cluster, lease)
        assert old_holder, "the leader holds the Lease"
        before = cluster.rest.must("GET", job_path)
        steps_at_kill.append(sum(line.startswith("step ") for line in cluster.kubelet.log_of(
            ns, f"{name}-rank-0").splitlines()))
        killed_at = time.monotonic()
        leader.operator.proc.kill()  # SIGKILL: no release, the standby waits the lease out
        leader.operator.proc.wait()
        # The Deployment's replacement: a new candidate, with the old one's log kept.
        replicas.remove(leader)
        replicas.append(Replica(cluster, folder, KILLS + kill + 2, lease, trainer_port))
        wait_until("the Lease taken by another replica", lambda old=old_holder: _holder(
            cluster, lease) not in ("", old), TAKEOVER_SECONDS, interval_seconds=0.05)
        to_lease.append(time.monotonic() - killed_at)
        leader = wait_until("the new leader Ready", lambda: _one_leader(replicas),
                            TAKEOVER_SECONDS, interval_seconds=0.05)
        to_ready.append(time.monotonic() - killed_at)
        assert leader.leader_gauge() == 1.0
        # The new leader reconciles the job: its first write to it (status, progress) after
        # the kill (the old leader's writes all came before: it is dead).
        job = wait_until("the new leader writing the job", lambda rv=before["metadata"][
            "resourceVersion"]: j if (j := cluster.rest.must("GET", job_path))["metadata"][
            "resourceVersion"] != rv or (j.get("status") or {}).get("phase") == "Succeeded"
            else None, STEP_SECONDS, interval_seconds=0.05)
        if (before.get("status") or {}).get("phase") != "Succeeded":
            to_write.append(time.monotonic() - killed_at)
        assert {p["metadata"]["uid"] for p in _ranks(cluster, ns, name)} <= uids, job

    print(f"\nleader failover under lease {LEASE_SECONDS} s / renew deadline "
          f"{RENEW_DEADLINE_SECONDS:g} s / retry {RETRY_SECONDS:g} s, {KILLS} SIGKILLs "
          f"(rank 0's steps done at each kill: {steps_at_kill}):\n"
          f"  to the Lease:  median {statistics.median(to_lease):.2f} s, "
          f"worst {max(to_lease):.2f} s  {[round(x, 2) for x in to_lease]}\n"
          f"  to /readyz:    median {statistics.median(to_ready):.2f} s, "
          f"worst {max(to_ready):.2f} s  {[round(x, 2) for x in to_ready]}\n"
          f"  to its first write to the running job: "
          + (f"median {statistics.median(to_write):.2f} s, worst {max(to_write):.2f} s  "
             f"{[round(x, 2) for x in to_write]}" if to_write else "(the job had ended)"))
    assert steps_at_kill[0] < 40, "the first kill came mid-run"
    assert max(to_lease) <= LEASE_SECONDS + RETRY_SECONDS + 5.0, to_lease
    done = wait_until("the job Succeeded", lambda: (
        s if (s := cluster.rest.must("GET", f"{JOBS.format(ns=ns)}/{name}").get("status")
              or {}).get("phase") in ("Succeeded", "Failed") else None), STEP_SECONDS * 2,
        interval_seconds=0.5)
    assert done["phase"] == "Succeeded", done
    assert not done.get("restarts"), f"a failover restarted the gang: {done}"
    # No rank pod duplicated: the kubelet ran exactly the first leader's two pods.
    ran = {c.pod["metadata"]["uid"] for c in cluster.kubelet.containers.values()
           if c.key.startswith(f"{ns}/{name}-rank-")}
    assert ran == uids, f"rank pods created after a failover: {ran - uids}"

    # A clean stop (SIGTERM of a rollout; SIGINT here, kopf treats both alike) hands the
    # Lease over: kopf stops the handlers, empties the holder, and the standby takes it at
    # its next look (its log says why: released, not expired).
    old_holder = _holder(cluster, lease)
    stopped_at = time.monotonic()
    leader.operator.stop()
    assert leader.operator.proc.returncode == 0, leader.operator.log()
    exited_at = time.monotonic()
    wait_until("the Lease taken after a release", lambda: _holder(cluster, lease) not in (
        "", old_holder), LEASE_SECONDS, interval_seconds=0.05)
    taken_at = time.monotonic()
    print(f"  a clean stop: the leader exited {exited_at - stopped_at:.2f} s after SIGINT, the "
          f"standby held the Lease {taken_at - exited_at:.2f} s later")
    new_holder = _holder(cluster, lease)
    (successor,) = [r for r in replicas if f"acquired by {new_holder} " in r.operator.log_text()]
    assert f"acquired by {new_holder} (released by its last holder)" in \
        successor.operator.log_text()
