"""Play the kubelet (and the operator process) against the emulator, over HTTP.

The emulator runs in the test's event loop, so everything here is async and talks to it
through its own aiohttp client: the real operator, a subprocess, sees exactly these writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kube_emulator import ApiEmulator

from cephalo.api import parse_job
from cephalo.planner import estimate_profile, lookup_gpu

JOBS = "/apis/cephalo.dev/v1alpha1/namespaces/{ns}/cephalojobs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def call(api: ApiEmulator, method: str, url: str, body: Any = None,
               ctype: str = "application/merge-patch+json") -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if body is not None:
        kwargs = {"data": json.dumps(body), "headers": {"Content-Type": ctype}}
    async with api.request(method, url, **kwargs) as resp:
        data = json.loads(await resp.read() or b"{}")
        assert resp.status < 400, f"{method} {url} -> {resp.status}: {data.get('message')}"
        return data


async def apply_nodes(api: ApiEmulator, nodes: list[dict[str, Any]]) -> None:
    for node in nodes:
        await call(api, "POST", "/api/v1/nodes", node, "application/json")


async def apply_job(api: ApiEmulator, body: dict[str, Any]) -> dict[str, Any]:
    ns = body["metadata"]["namespace"]
    return await call(api, "POST", JOBS.format(ns=ns), body, "application/json")


def pod_status(phase: str, *, exit_code: int | None = None, message: str | None = None,
               ip: str = "127.0.0.1") -> dict[str, Any]:
    """A pod status the kubernetes client's models accept (image, imageID, ready, …)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if phase == "Running":
        state: dict[str, Any] = {"running": {"startedAt": now}}
    elif phase in ("Succeeded", "Failed"):
        state = {"terminated": {"exitCode": exit_code if exit_code is not None else
                                (0 if phase == "Succeeded" else 1),
                                "reason": "Completed" if phase == "Succeeded" else "Error",
                                "startedAt": now, "finishedAt": now}}
        if message is not None:
            state["terminated"]["message"] = message
    else:
        state = {"waiting": {"reason": "ContainerCreating"}}
    return {"phase": phase, "podIP": ip, "hostIP": ip, "containerStatuses": [{
        "name": "trainer", "image": "trainer", "imageID": "sha256:0", "ready": phase == "Running",
        "restartCount": 0, "started": phase == "Running", "state": state}]}


async def set_pod(api: ApiEmulator, ns: str, name: str, phase: str, **kw: Any) -> None:
    await call(api, "PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status",
               {"status": pod_status(phase, **kw)})


def pods(api: ApiEmulator, ns: str, role: str, job: str | None = None) -> list[dict[str, Any]]:
    return [p for p in api.list_objects("pods", ns)
            if p["metadata"]["labels"].get("cephalo.dev/role") == role
            and (job is None or p["metadata"]["labels"].get("cephalo.dev/job") == job)]


def job_status(api: ApiEmulator, ns: str, name: str) -> dict[str, Any]:
    jobs = [j for j in api.list_objects("cephalojobs", ns, group="cephalo.dev")
            if j["metadata"]["name"] == name]
    return (jobs[0].get("status") or {}) if jobs else {}


async def wait_for(what: str, predicate: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def real_profile_json(pod: dict[str, Any], job_body: dict[str, Any]) -> str:
    """What a profiler pod would print: a GpuProfile of the product it is pinned to."""
    product = pod["spec"]["nodeSelector"]["nvidia.com/gpu.product"]
    spec = parse_job(job_body).spec
    profile = estimate_profile(lookup_gpu(product).name, spec.model.resolve(), spec.precision,
                               spec.planner.profile_micro_batch_sizes)
    text = profile.to_compact_json()
    assert len(text.encode()) <= 4096, "a termination message holds at most 4096 bytes"
    return text


async def finish_profilers(api: ApiEmulator, ns: str, job_body: dict[str, Any],
                           count: int, timeout: float = 20.0) -> set[str]:
    """Wait for `count` profiler pods of the job and let each succeed with a real profile."""
    name = job_body["metadata"]["name"]
    found = await wait_for(f"{count} profiler pods", lambda: (
        ps if len(ps := pods(api, ns, "profiler", name)) >= count else None), timeout)
    for pod in found:
        await set_pod(api, ns, pod["metadata"]["name"], "Succeeded",
                      message=real_profile_json(pod, job_body))
    return {p["spec"]["nodeSelector"]["nvidia.com/gpu.product"] for p in found}


class OperatorProcess:
    """`kopf run -m cephalo.operator -A --standalone` against the emulator's kubeconfig."""

    def __init__(self, kubeconfig: Path, log_path: Path, **env: str) -> None:
        self.kubeconfig, self.log_path = kubeconfig, log_path
        self.metrics_port = free_port()
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig),
                    "CEPHALO_OPERATOR_METRICS_PORT": str(self.metrics_port),
                    "CEPHALO_RECHECK_SECONDS": "0.5", "CEPHALO_PROGRESS_INTERVAL_SECONDS": "0.5",
                    "CEPHALO_WATCH_TIMEOUT_SECONDS": "60", **env}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kopf", "run", "-m", "cephalo.operator", "-A", "--standalone",
             "--liveness", f"http://127.0.0.1:{free_port()}/healthz"],
            env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self

    async def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        for _ in range(100):
            if self.proc.poll() is not None:
                return
            await asyncio.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await asyncio.to_thread(self.proc.wait)

    async def kill(self) -> None:
        """An abrupt crash (no cleanup): what a restart mid-phase must survive."""
        assert self.proc is not None
        self.proc.kill()
        await asyncio.to_thread(self.proc.wait)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
