"""The operator as a local process (`kopf run`), authenticated as the chart's ServiceAccount
with a real token (so the chart's RBAC decides every request), runs a small job under the
real control plane: real profiler and trainer processes (CPU, gloo) started by the process
kubelet on GPU-labelled nodes the real scheduler picked; Profiling -> Planning -> Running ->
Succeeded; the checkpoint the ranks wrote on the shared claim exports."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from .cluster import Cluster
from .controlplane import free_port
from .operator_auth import operator_kubeconfig
from .rest import wait_until

JOBS = "/apis/cephalo.dev/v1alpha1/namespaces/{ns}/cephalojobs"
JOB_SECONDS = 300.0  # profiling two tiny models and six steps on two shared cores


class Operator:
    """`kopf run -m cephalo.operator -A --standalone` against a kubeconfig."""

    def __init__(self, kubeconfig: Path, log_path: Path) -> None:
        self.log_path = log_path
        env = {"KUBECONFIG": str(kubeconfig), "CEPHALO_OPERATOR_METRICS_PORT": "0",
               "CEPHALO_RECHECK_SECONDS": "1", "CEPHALO_PROGRESS_INTERVAL_SECONDS": "1",
               "CEPHALO_WATCH_TIMEOUT_SECONDS": "60", "CEPHALO_NODE_DEBOUNCE_SECONDS": "0.2"}
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kopf", "run", "-m", "cephalo.operator", "-A",
                 "--standalone", "--liveness", f"http://127.0.0.1:{free_port()}/healthz"],
                env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return f"--- operator ---\n{self.log_path.read_text(errors='replace')[-8000:]}"


@pytest.fixture
def operator(cluster: Cluster, installed_chart: object, tmp_path: Path,
             on_failure: Any) -> Iterator[Operator]:
    proc = Operator(operator_kubeconfig(cluster), tmp_path / "operator.log")
    on_failure(proc.log)
    try:
        yield proc
    finally:
        proc.stop()


def _claim(cluster: Cluster, ns: str, name: str) -> None:
    """A ReadWriteMany claim bound to a PersistentVolume by the real PV controller (the
    process kubelet maps the claim to one local folder for every pod)."""
    pv = f"{ns}-{name}"
    cluster.rest.create("/api/v1/persistentvolumes", {"metadata": {"name": pv}, "spec": {
        "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
        "persistentVolumeReclaimPolicy": "Delete", "storageClassName": "",
        "hostPath": {"path": f"/nonexistent/{pv}"},
        "claimRef": {"namespace": ns, "name": name}}})
    cluster.rest.create(f"/api/v1/namespaces/{ns}/persistentvolumeclaims", {
        "metadata": {"name": name}, "spec": {"accessModes": ["ReadWriteMany"],
                                             "storageClassName": "", "volumeName": pv,
                                             "resources": {"requests": {"storage": "1Gi"}}}})
    wait_until(f"claim {ns}/{name} Bound", lambda: cluster.rest.get(
        f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{name}").body.get(
        "status", {}).get("phase") == "Bound", 60)


def tiny_job(name: str, ns: str, **spec: Any) -> dict[str, Any]:
    """examples/custom-tiny-gpt.yaml, scaled down: six steps, two ranks (one a GPU node)."""
    return {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"model": {"family": "gpt", "numLayers": 2, "hiddenSize": 64,
                               "numHeads": 4, "ffnHiddenSize": 256, "vocabSize": 256,
                               "sequenceLength": 32},
                     "globalBatchSize": 8, "training": {"steps": 6, "learningRate": 1.0e-3,
                                                        "schedule": "constant", "seed": 1},
                     "data": {"synthetic": {}},
                     "planner": {"profileMicroBatchSizes": [1, 2, 4], "chooseGpus": False},
                     "ranksPerPod": 1, "checkpoint": {"claimName": "ckpt", "intervalSteps": 3},
                     "backoffLimit": 1, **spec}}


def _phases(cluster: Cluster, ns: str, name: str, until: set[str],
            timeout_seconds: float) -> list[str]:
    seen: list[str] = []

    def done() -> bool:
        status = cluster.rest.get(f"{JOBS.format(ns=ns)}/{name}").body.get("status") or {}
        phase = status.get("phase")
        if phase and (not seen or seen[-1] != phase):
            seen.append(phase)
        return phase in until
    wait_until(f"job {name} in {sorted(until)} (phases so far: {seen})", done, timeout_seconds,
               interval_seconds=0.2)
    return seen


def test_job_trains_under_the_real_api_server_and_exports(
        cluster: Cluster, operator: Operator, tmp_path: Path) -> None:
    ns = cluster.namespace("e2e")
    _claim(cluster, ns, "ckpt")
    started = time.monotonic()
    cluster.rest.create(JOBS.format(ns=ns), tiny_job("tiny", ns), fieldValidation="Strict")
    phases = _phases(cluster, ns, "tiny", {"Succeeded", "Failed"}, JOB_SECONDS)
    status = cluster.rest.must("GET", f"{JOBS.format(ns=ns)}/tiny")["status"]
    assert phases[-1] == "Succeeded", f"{phases}: {status.get('message')}"
    order = [p for p in ("Profiling", "Planning", "Running", "Succeeded") if p in phases]
    assert order == ["Profiling", "Planning", "Running", "Succeeded"], phases
    print(f"realk8s: job tiny {' -> '.join(phases)} in {time.monotonic() - started:.0f} s")
    # Real pods ran where the real scheduler put them: one rank on each GPU node.
    pods = cluster.rest.must("GET", f"/api/v1/namespaces/{ns}/pods",
                             params={"labelSelector": "cephalo.dev/role=trainer"})["items"]
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["gpu-a6000", "gpu-p40"], pods
    assert all(p["status"]["phase"] == "Succeeded" for p in pods)
    # The chart's RBAC sufficed: the real authorizer refused the operator nothing.
    assert "forbidden" not in operator.log_path.read_text().lower(), operator.log()
    # The checkpoint the ranks wrote on the shared claim is a model that exports.
    folder = cluster.kubelet.claim_folder(ns, "ckpt") / "tiny"
    out = tmp_path / "model.pt"
    cephalo = Path(sys.executable).parent / "cephalo"
    done = subprocess.run([str(cephalo), "export", str(folder), "--output", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    state = torch.load(out, weights_only=True)
    assert state and all(isinstance(v, torch.Tensor) for v in state.values())
