"""Scale end to end: node events cost O(1) API requests whatever the number of jobs.

The real operator process against the emulator; requests are counted from the emulator's own
record of what it served (`calls`), not from anything the operator reports about itself.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from kube_emulator import ApiEmulator
from kube_fixtures import cluster_a, job_body
from kubelet import OperatorProcess, apply_job, apply_nodes, call, job_status, wait_for

from cephalo.operator.render import LABEL_JOB

pytestmark = pytest.mark.asyncio
NS = "default"
NUM_JOBS = 8
NUM_NODE_EVENTS = 20


def operator_calls(api: ApiEmulator, verb: str, resource: str, since: int = 0) -> list:
    return [c for c in api.calls[since:] if c.verb == verb and c.resource == resource
            and not c.user_agent.startswith("kmock/")]


async def test_node_events_with_many_jobs_cost_o1_node_lists(emulator: ApiEmulator,
                                                             tmp_path: Path) -> None:
    await apply_nodes(emulator, cluster_a())
    # A long recheck period: every pass below is one an event caused, not the timer.
    proc = OperatorProcess(emulator.kubeconfig, tmp_path / "operator.log",
                           CEPHALO_RECHECK_SECONDS="120").start()
    try:
        names = [f"wait-{i}" for i in range(NUM_JOBS)]
        for name in names:  # T4s: not in this cluster, so every job waits for GPUs
            await apply_job(emulator, job_body(name, gpuPools=[{"product": "Tesla-T4"}]))
        await wait_for("every job waiting for GPUs", lambda: all(
            "waiting for GPUs" in job_status(emulator, NS, n).get("message", "") for n in names))
        mark = len(emulator.calls)
        for i in range(NUM_NODE_EVENTS):  # cordon/uncordon: what discovery reads changes
            await call(emulator, "PATCH", "/api/v1/nodes/a-l4",
                       {"spec": {"unschedulable": i % 2 == 1}})
            await asyncio.sleep(0.05)
        # The last event cordoned a-l4: every job must still notice (woken, fresh view).
        await wait_for("every job seeing a-l4 cordoned", lambda: all(
            "a-l4: cordoned" in job_status(emulator, NS, n).get("message", "") for n in names))
        lists = operator_calls(emulator, "list", "nodes", mark)
        assert len(lists) <= 2, (f"{NUM_NODE_EVENTS} node events with {NUM_JOBS} jobs made "
                                 f"{len(lists)} node LISTs; expected O(1)")
    finally:
        await proc.stop()
        print(proc.log()[-6000:])
    # Pods are watched with the operator's label selector, sent to the API server.
    pod_watches = operator_calls(emulator, "watch", "pods")
    assert pod_watches and all(c.label_selector == LABEL_JOB for c in pod_watches), pod_watches


async def test_node_view_stays_true_through_dropped_watches(emulator: ApiEmulator,
                                                            tmp_path: Path) -> None:
    """Watch streams end every 0.5 s (as load balancers end them); kopf resumes from its last
    resourceVersion. A node deleted and one cordoned meanwhile must reach every waiting job
    through the view, with no node LIST per job."""
    await apply_nodes(emulator, cluster_a())
    emulator.faults.watch_drop_seconds = 0.5
    proc = OperatorProcess(emulator.kubeconfig, tmp_path / "operator.log",
                           CEPHALO_RECHECK_SECONDS="120").start()
    try:
        names = ["drop-0", "drop-1", "drop-2"]
        for name in names:
            await apply_job(emulator, job_body(name, gpuPools=[{"product": "Tesla-T4"}]))
        await wait_for("every job waiting for GPUs", lambda: all(
            "saw 6 node(s)" in job_status(emulator, NS, n).get("message", "") for n in names))
        mark = len(emulator.calls)
        await asyncio.sleep(1.5)  # several watch streams ended and were resumed meanwhile
        await call(emulator, "DELETE", "/api/v1/nodes/a-l4")
        await asyncio.sleep(0.7)
        await call(emulator, "PATCH", "/api/v1/nodes/b-p40", {"spec": {"unschedulable": True}})
        await wait_for("every job seeing the deletion and the cordon", lambda: all(
            "saw 5 node(s)" in (m := job_status(emulator, NS, n).get("message", ""))
            and "b-p40: cordoned" in m and "NVIDIA-L4" not in m for n in names))
        resumed = operator_calls(emulator, "watch", "nodes", mark)
        assert len(resumed) >= 2, "the fault did not drop the node watch"
        assert len(operator_calls(emulator, "list", "nodes", mark)) <= 1
    finally:
        await proc.stop()
        print(proc.log()[-6000:])
