"""Shared by test_operator_shared_gpus*.py: a shared cluster (4xA10G + 4xT4 on four nodes),
the operator process, the strict emulated scheduler and the checks on what it placed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest_asyncio
from kube_emulator import ApiEmulator
from kube_fixtures import gpu_node
from kubelet import ExtraPassKubelet, OperatorProcess, Scheduler, apply_nodes, call, set_pod

from cephalo.operator.rbac import allowed

NS = "default"
GPU = "nvidia.com/gpu"


def shared_cluster() -> list[dict[str, Any]]:
    return [gpu_node("a10g-0", "NVIDIA-A10G", 2, 23028),
            gpu_node("a10g-1", "NVIDIA-A10G", 2, 23028),
            gpu_node("t4-0", "Tesla-T4", 2, 15360), gpu_node("t4-1", "Tesla-T4", 2, 15360),
            gpu_node("cpu-0", None, 0)]


class Cluster:
    def __init__(self, api: ApiEmulator, tmp_path: Path) -> None:
        self.api, self.tmp_path = api, tmp_path
        self.scheduler = Scheduler(api, paused=True)
        self.procs: list[OperatorProcess] = []

    def start_operator(self, **env: str) -> OperatorProcess:
        proc = OperatorProcess(self.api.kubeconfig, self.tmp_path / "operator.log", **env).start()
        self.procs.append(proc)
        return proc

    async def foreign_pod(self, name: str, node: str, *, limits: int = 0, requests: int = 0,
                          phase: str = "Running", namespace: str = "other") -> None:
        """Another team's pod, already placed on `node` (a real scheduler placed it)."""
        resources: dict[str, Any] = {}
        if limits:
            resources["limits"] = {GPU: str(limits)}
        if requests:
            resources["requests"] = {GPU: str(requests)}
        await call(self.api, "POST", f"/api/v1/namespaces/{namespace}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"team": "x"}},
            "spec": {"nodeName": node, "containers": [
                {"name": "main", "image": "other-team/train", "resources": resources}]}},
            "application/json")
        await set_pod(self.api, namespace, name, phase)

    def placed(self) -> dict[str, int]:
        """GPUs requested by non-terminal pods per node, as they stand."""
        used: dict[str, int] = {}
        for pod in self.api.list_objects("pods"):
            node = (pod.get("spec") or {}).get("nodeName")
            if node and pod["status"].get("phase") not in ("Succeeded", "Failed"):
                res = pod["spec"]["containers"][0].get("resources") or {}
                gpus = int((res.get("requests") or res.get("limits") or {}).get(GPU, 0))
                used[node] = used.get(node, 0) + gpus
        return used

    def assert_not_overcommitted(self) -> None:
        allocatable = {n["metadata"]["name"]: int(n["status"]["allocatable"][GPU])
                       for n in self.api.list_objects("nodes")}
        for node, used in self.placed().items():
            assert used <= allocatable[node], f"{node}: {used} GPUs placed of {allocatable[node]}"

    def ever_unschedulable(self, job: str) -> list[str]:
        """Rank pods of `job` that the scheduler ever left Unschedulable (any version)."""
        names = {e[4]["metadata"]["name"] for e in self.api._log
                 if e[2] == "pods" and (e[4]["metadata"].get("labels") or {}).get(
                     "cephalo.dev/job") == job}
        # a set: one pod has several versions marked Unschedulable (its deletion, a new
        # scheduler message), and it still counts once
        return sorted({n for n in names for v in self.api.history("pods", NS, n)
                       if any(c.get("reason") == "Unschedulable"
                              for c in (v.get("status") or {}).get("conditions") or [])})


@pytest_asyncio.fixture(name="cluster")
async def cluster_fixture(emulator: ApiEmulator, tmp_path: Path,
                          extra_passes: ExtraPassKubelet) -> AsyncIterator[Cluster]:
    """The shared cluster; the tests play each product's first profiler pass, extra_passes
    (conftest) the others."""
    await apply_nodes(emulator, shared_cluster())
    cluster = Cluster(emulator, tmp_path)
    try:
        yield cluster
    finally:
        for proc in cluster.procs:
            await proc.stop()
        if cluster.procs:
            print(cluster.procs[0].log()[-8000:])  # shown by pytest only when the test failed
    used = emulator.rbac_rules(include_tests=False)
    missing = sorted(r for r in used if not allowed(r[0], r[1], r[2]))
    assert not missing, f"operator used permissions missing from cephalo.operator.rbac: {missing}"


def plan_pools(status: dict[str, Any]) -> dict[str, int]:
    return dict((status.get("plan") or {}).get("pools") or {})


Predicate = Callable[[], Any]
