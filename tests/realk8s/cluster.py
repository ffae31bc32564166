"""What the realk8s tests get from the session fixture: the control plane, an admin REST
client, the nodes and the process kubelet; kubectl and helm from the built binaries."""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

from .controlplane import ControlPlane
from .kubelet import ProcessKubelet
from .nodes import GpuNode, NodeHeartbeat
from .rest import Rest, wait_until

# Two GPU products, so that a job profiles and plans a heterogeneous pool (Cluster A-like).
NODES = [GpuNode("gpu-a6000", "NVIDIA-RTX-A6000", 1, 49140),
         GpuNode("gpu-p40", "Tesla-P40", 1, 24576)]
RESTRICTED = "pod-security.kubernetes.io/enforce"
CHART = Path(__file__).resolve().parents[2] / "charts" / "cephalo-operator"
OPERATOR_NAMESPACE = "cephalo-system"
RELEASE = "cephalo"
CRD = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/cephalojobs.cephalo.dev"



class Cluster:
    """What the tests get: the control plane, an admin REST client, nodes and the kubelet."""

    def __init__(self, plane: ControlPlane, heartbeat: NodeHeartbeat,
                 kubelet: ProcessKubelet) -> None:
        self.plane, self.heartbeat, self.kubelet = plane, heartbeat, kubelet
        self.rest: Rest = plane.admin()
        self.bin = plane.bin
        self._names = itertools.count()

    def namespace(self, prefix: str = "t", *, level: str = "restricted") -> str:
        """A fresh namespace enforcing Pod Security `level`, its default ServiceAccount
        made (pods need it) by the real serviceaccount controller."""
        name = f"{prefix}-{next(self._names)}"
        self.rest.create("/api/v1/namespaces", {"metadata": {"name": name, "labels": {
            RESTRICTED: level, "pod-security.kubernetes.io/enforce-version": "latest"}}})
        wait_until(f"ServiceAccount {name}/default", lambda: self.rest.get(
            f"/api/v1/namespaces/{name}/serviceaccounts/default").ok, 30)
        return name

    def logs(self) -> str:
        return f"{self.plane.logs()}\n{self.kubelet.logs()}"


def run_tool(cluster: Cluster, *argv: str, check: bool = True,
             timeout_seconds: float = 120) -> subprocess.CompletedProcess[str]:
    """kubectl or helm from the built binaries, as the admin; output kept for the report."""
    done = subprocess.run([str(cluster.bin / argv[0]), *argv[1:]], env=cluster.plane.tool_env(),
                          capture_output=True, text=True, timeout=timeout_seconds, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n"
                             f"{done.stderr}")
    return done
