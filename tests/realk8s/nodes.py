"""GPU nodes as API objects, kept Ready by a heartbeat (node status + Lease), as a kubelet
would: capacity `nvidia.com/gpu` and GPU Feature Discovery labels (the ones
cephalo.operator.discovery reads). A node whose heartbeat is paused goes NotReady by the
real node-lifecycle controller's verdict, not ours; one set not ready reports Ready=False
itself (KubeletNotReady, as a kubelet whose container runtime is down does), and the real
node-lifecycle controller taints it."""

from __future__ import annotations

import datetime as dt
import sys
import threading
from dataclasses import dataclass
from typing import Any

from .rest import Rest

LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
HEARTBEAT_SECONDS = 2.0  # the controller-manager's grace period is 12 s (controlplane.py)


@dataclass(frozen=True)
class GpuNode:
    name: str
    product: str  # nvidia.com/gpu.product, e.g. NVIDIA-RTX-A6000
    gpus: int
    memory_mib: int


def _now(micro: bool = False) -> str:
    now = dt.datetime.now(dt.timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def node_object(node: GpuNode) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node.name, "labels": {
        "kubernetes.io/hostname": node.name, "kubernetes.io/os": "linux",
        "nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": node.product,
        "nvidia.com/gpu.count": str(node.gpus), "nvidia.com/gpu.memory": str(node.memory_mib)}},
        "spec": {}}


def node_status(node: GpuNode, kubelet_port: int | None = None,
                ready: bool = True) -> dict[str, Any]:
    now = _now()
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti",
                 "nvidia.com/gpu": str(node.gpus)}
    def condition(kind: str, status: str, reason: str) -> dict[str, str]:
        return {"type": kind, "status": status, "reason": reason, "message": reason,
                "lastHeartbeatTime": now, "lastTransitionTime": now}
    return {"status": {
        "capacity": resources, "allocatable": resources,
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                      {"type": "Hostname", "address": node.name}],
        "conditions": [condition("Ready", "True", "KubeletReady") if ready else
                       condition("Ready", "False", "KubeletNotReady"),
                       condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                       condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                       condition("PIDPressure", "False", "KubeletHasSufficientPID")],
        "nodeInfo": {"kubeletVersion": "v0.0.0-process-kubelet", "operatingSystem": "linux",
                     "architecture": "amd64", "containerRuntimeVersion": "process://local",
                     "kernelVersion": "", "osImage": "", "kubeProxyVersion": "",
                     "machineID": "", "systemUUID": "", "bootID": ""},
        # Where the API server finds this node's kubelet (pods/log), as a kubelet reports it.
        **({"daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}}}
           if kubelet_port else {})}}


class NodeHeartbeat:
    """Registers the nodes and renews their status and Lease every HEARTBEAT_SECONDS."""

    def __init__(self, rest: Rest, nodes: list[GpuNode],
                 kubelet_ports: dict[str, int] | None = None) -> None:
        self.rest, self.nodes = rest, {n.name: n for n in nodes}
        self.kubelet_ports = kubelet_ports or {}
        self.paused: set[str] = set()  # no heartbeat at all
        self.not_ready: set[str] = set()  # heartbeats that say Ready=False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-heartbeat", daemon=True)

    def register(self, node: GpuNode) -> None:
        self.nodes[node.name] = node
        self.rest.create("/api/v1/nodes", node_object(node))
        self._beat(node)

    def start(self) -> NodeHeartbeat:
        for node in list(self.nodes.values()):
            self.rest.create("/api/v1/nodes", node_object(node))
            self._beat(node)
        self._thread.start()
        return self

    def set_ready(self, name: str, ready: bool) -> None:
        """From now on the node reports Ready=`ready` (at once, then every heartbeat)."""
        (self.not_ready.discard if ready else self.not_ready.add)(name)
        self._beat(self.nodes[name])

    def _beat(self, node: GpuNode) -> None:
        status = node_status(node, self.kubelet_ports.get(node.name),
                             ready=node.name not in self.not_ready)
        reply = self.rest.request("PATCH", f"/api/v1/nodes/{node.name}/status", status,
                                  ctype="application/strategic-merge-patch+json")
        if reply.status == 404:  # deleted by a test: a kubelet would re-register; we do not
            return
        lease = {"spec": {"holderIdentity": node.name, "leaseDurationSeconds": 40,
                          "renewTime": _now(micro=True)}}
        if self.rest.request("PATCH", f"{LEASES}/{node.name}", lease,
                             ctype="application/merge-patch+json").status == 404:
            self.rest.request("POST", LEASES, {"metadata": {"name": node.name}, **lease})

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            for node in list(self.nodes.values()):
                if node.name not in self.paused:
                    try:
                        self._beat(node)
                    except Exception as err:  # the API server restarting: beat again next time
                        print(f"node heartbeat: {node.name}: {err}", file=sys.stderr)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
