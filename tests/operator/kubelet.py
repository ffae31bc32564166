"""Play the kubelet (and the operator process) against the emulator, over HTTP.

The emulator runs in the test's event loop, so everything here is async and talks to it
through its own aiohttp client: the real operator, a subprocess, sees exactly these writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kube_emulator import ApiEmulator

from cephalo.api import API_GROUP, PLURAL, GpuProfile, parse_job
from cephalo.api.profile import CollectiveProfile
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
    pod = api._store.get(("", "pods", ns, name))  # one lookup: no copy of every pod
    if phase != "Pending" and pod is not None and (pod.get("spec") or {}).get("schedulingGates"):
        # A kubelet never runs a gated pod: the scheduler does not even try to place it.
        raise AssertionError(f"pod {ns}/{name} still has scheduling gates "
                             f"{pod['spec']['schedulingGates']}: it cannot be {phase}")
    await call(api, "PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status",
               {"status": pod_status(phase, **kw)})


def pods(api: ApiEmulator, ns: str, role: str, job: str | None = None) -> list[dict[str, Any]]:
    def wanted(p: dict[str, Any]) -> bool:
        labels = p["metadata"]["labels"]
        return labels.get("cephalo.dev/role") == role and (
            job is None or labels.get("cephalo.dev/job") == job)
    return api.list_objects("pods", ns, where=wanted)


def job_status(api: ApiEmulator, ns: str, name: str) -> dict[str, Any]:
    jobs = api.list_objects("cephalojobs", ns, group="cephalo.dev",
                            where=lambda j: j["metadata"]["name"] == name)
    return (jobs[0].get("status") or {}) if jobs else {}


# How long a test waits for the operator (another process) to act before it fails. Generous on
# purpose: a wait returns as soon as its condition holds, so only a failing test pays it,
# and a loaded machine (a parallel build, CI's two cores) must not turn "slow" into "failed";
# a run of the suite under a parallel CPU load once saw a job take over 20 s to succeed.
WAIT_SECONDS = 120.0


async def wait_for(what: str, predicate: Callable[[], Any],
                   timeout: float = WAIT_SECONDS) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


# The profiler's flag for an extra pass: sizes a plan assigned beyond the profiled ones
# (operator/render.py render_profiler_pod; cephalo.trainer.profile reads it).
MICRO_BATCH_SIZES_FLAG = "--micro-batch-sizes"


def profiler_sizes(pod: dict[str, Any], job_body: dict[str, Any]) -> list[int]:
    """The micro-batch sizes a profiler pod measures: its --micro-batch-sizes (an extra
    pass), else the job's profileMicroBatchSizes (the product's first pass)."""
    command = pod["spec"]["containers"][0]["command"]
    if MICRO_BATCH_SIZES_FLAG in command:
        return [int(m) for m in command[command.index(MICRO_BATCH_SIZES_FLAG) + 1].split(",")]
    return list(parse_job(job_body).spec.planner.profile_micro_batch_sizes)


def is_extra_pass(pod: dict[str, Any]) -> bool:
    return MICRO_BATCH_SIZES_FLAG in pod["spec"]["containers"][0]["command"]


def real_profile(pod: dict[str, Any], job_body: dict[str, Any]) -> GpuProfile:
    """What a profiler pod would measure: the catalog's estimate of the product it is
    pinned to, at the sizes it was told (profiler_sizes), as measured (a profiler's
    output is: the operator measures sizes beyond it, never beyond an estimate)."""
    product = pod["spec"]["nodeSelector"]["nvidia.com/gpu.product"]
    spec = parse_job(job_body).spec
    return estimate_profile(lookup_gpu(product).name, spec.model.resolve(), spec.precision,
                            profiler_sizes(pod, job_body)).model_copy(
                                update={"source": "measured"})


def real_profile_json(pod: dict[str, Any], job_body: dict[str, Any]) -> str:
    """What a profiler pod would print: real_profile as its termination message."""
    text = real_profile(pod, job_body).to_compact_json()
    assert len(text.encode()) <= 4096, "a termination message holds at most 4096 bytes"
    return text


def stored_job(api: ApiEmulator, ns: str, name: str) -> dict[str, Any] | None:
    """The CephaloJob as applied (no status), None once deleted."""
    job = api._store.get((API_GROUP, PLURAL, ns, name))
    return None if job is None else {
        k: v for k, v in job.items() if k in ("apiVersion", "kind", "metadata", "spec")}


async def cancel_task(task: asyncio.Task[None] | None) -> None:
    """Stop a background loop (a kubelet's, a sim's) and wait until it has."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class ExtraPassKubelet:
    """Runs every extra profiler pass (a profiler pod with --micro-batch-sizes) as the test
    runs the first: Succeeded with real_profile_json at the asked sizes. The tests that play
    profiler pods by hand script each product's first pass; the extra one comes only after
    the operator planned on it, so this answers it in the background. `answered`: the pods
    it ran, in order. `profile_json(pod, job body)`: what a pass prints, for a test that
    plays its first passes with a profile of its own."""

    def __init__(self, api: ApiEmulator,
                 profile_json: Callable[[dict[str, Any], dict[str, Any]], str] = real_profile_json
                 ) -> None:
        self.api, self.profile_json = api, profile_json
        self.answered: list[str] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> ExtraPassKubelet:
        self._task = asyncio.create_task(self._loop())
        return self

    async def stop(self) -> None:
        await cancel_task(self._task)

    async def _loop(self) -> None:
        while True:
            for pod in self.api.list_objects("pods", where=_unanswered_extra_pass):
                # a pod that went between reading and writing it: the next look sees why
                with contextlib.suppress(AssertionError):
                    await self._answer(pod)
            await asyncio.sleep(0.05)

    async def _answer(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        job = stored_job(self.api, meta["namespace"], meta["labels"]["cephalo.dev/job"])
        if job is None:
            return
        await set_pod(self.api, meta["namespace"], meta["name"], "Succeeded",
                      message=self.profile_json(pod, job))
        self.answered.append(meta["name"])


def _unanswered_extra_pass(pod: dict[str, Any]) -> bool:
    """A profiler pod of an extra pass that a kubelet may run and has not finished."""
    meta = pod["metadata"]
    return meta.get("labels", {}).get("cephalo.dev/role") == "profiler" \
        and is_extra_pass(pod) and not meta.get("deletionTimestamp") \
        and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed") \
        and not (pod.get("spec") or {}).get("schedulingGates")


async def finish_profilers(api: ApiEmulator, ns: str, job_body: dict[str, Any],
                           count: int, timeout: float = WAIT_SECONDS) -> set[str]:
    """Wait for `count` profiler pods of the job and let each succeed with a real profile."""
    name = job_body["metadata"]["name"]
    found = await wait_for(f"{count} profiler pods", lambda: (
        ps if len(ps := pods(api, ns, "profiler", name)) >= count else None), timeout)
    for pod in found:
        await set_pod(api, ns, pod["metadata"]["name"], "Succeeded",
                      message=real_profile_json(pod, job_body))
    return {p["spec"]["nodeSelector"]["nvidia.com/gpu.product"] for p in found}


def probe_fit_json(gbps: float = 10.0, latency_us: float = 50.0) -> str:
    """What a network probe's rank 0 would print: a two-rank ring fit (both collectives)."""
    bandwidth, latency = gbps * 1e9 / 8, latency_us * 1e-6
    return CollectiveProfile(bandwidth_bytes_per_second=bandwidth, latency_seconds=latency,
                             reduce_scatter_bandwidth_bytes_per_second=bandwidth,
                             reduce_scatter_latency_seconds=latency,
                             world_size=2).model_dump_json(exclude_none=True)


async def finish_netprobes(api: ApiEmulator, ns: str, job: str, count: int,
                           timeout: float = WAIT_SECONDS) -> None:
    """Let the job's next `count` network probes (one at a time, as the operator runs them)
    succeed: rank 0's pod with a fit, the other pod of the gang with nothing."""
    done: set[str] = set()
    for _ in range(count):
        found = await wait_for("a network probe's pods", lambda: [
            p for p in pods(api, ns, "netprobe", job)
            if p["metadata"]["labels"]["cephalo.dev/netprobe"] not in done
            and not p["metadata"].get("deletionTimestamp")] or None, timeout)
        done.add(found[0]["metadata"]["labels"]["cephalo.dev/netprobe"])
        for pod in sorted(found, key=lambda p: p["metadata"]["name"], reverse=True):
            first = pod["metadata"]["name"].endswith("-0")
            await set_pod(api, ns, pod["metadata"]["name"], "Succeeded",
                          message=probe_fit_json() if first else "")


class OperatorProcess:
    """`kopf run -m cephalo.operator -A --standalone` against the emulator's kubeconfig."""

    def __init__(self, kubeconfig: Path, log_path: Path, **env: str) -> None:
        self.kubeconfig, self.log_path = kubeconfig, log_path
        self.metrics_port = free_port()
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig),
                    "CEPHALO_OPERATOR_METRICS_PORT": str(self.metrics_port),
                    "CEPHALO_RECHECK_SECONDS": "0.5", "CEPHALO_PROGRESS_INTERVAL_SECONDS": "0.5",
                    "CEPHALO_WATCH_TIMEOUT_SECONDS": "60",
                    # The network probe is its own tests' (test_operator_netprobe*): elsewhere
                    # a job is planned as soon as profiled, as these tests script it.
                    "CEPHALO_NETWORK_PROBE": "false", **env}
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


# ---- the scheduler -------------------------------------------------------------------------
GPU = "nvidia.com/gpu"


def _gpus_of(pod: dict[str, Any]) -> int:
    """The pod's GPU request as kube-scheduler's NodeResourcesFit counts it (written here
    from the Kubernetes docs, independently of the operator's gpu_usage): app containers
    summed, init containers at their peak (sidecars aside: the tests use none), a limit
    alone standing for the request of an extended resource."""
    def one(c: dict[str, Any]) -> int:
        res = c.get("resources") or {}
        value = (res.get("requests") or {}).get(GPU, (res.get("limits") or {}).get(GPU, 0))
        return int(str(value))
    spec = pod.get("spec") or {}
    return max(sum(one(c) for c in spec.get("containers") or []),
               max((one(c) for c in spec.get("initContainers") or []), default=0))


def _tolerated(taint: dict[str, Any], tolerations: list[dict[str, Any]]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("key") and t["key"] != taint.get("key"):
            continue
        if t.get("operator") == "Exists" or t.get("value", "") == taint.get("value", ""):
            return True
    return False


class Scheduler:
    """kube-scheduler for the emulator, as strict as the real one where the tests look:
    a Pending, ungated pod of the default scheduler is bound (`spec.nodeName`, PodScheduled
    True) to the first node by name that is Ready, not cordoned, carries every nodeSelector
    label, has no NoSchedule/NoExecute taint the pod does not tolerate, and has room for its
    GPUs next to every non-terminal pod already bound there. Otherwise it stays Pending with
    PodScheduled=False, reason Unschedulable. With `run`, a bound pod also starts (Running),
    as its kubelet would. Runs in the test's event loop after every change (no polling)."""

    def __init__(self, api: ApiEmulator, *, run: bool = True, paused: bool = False) -> None:
        self.api, self.run, self.paused = api, run, paused
        self._due = False
        api.on_change.append(self._changed)

    def resume(self) -> None:
        self.paused = False
        self._kick()

    def _changed(self, key: tuple[Any, ...], kind: str, obj: dict[str, Any]) -> None:
        if key[:2] in (("", "pods"), ("", "nodes")):
            self._kick()

    def _kick(self) -> None:
        if not self._due and not self.paused:
            self._due = True
            asyncio.get_running_loop().call_soon(self._pass)

    def _pass(self) -> None:
        self._due = False
        if self.paused:
            return
        store = self.api._store
        nodes = [o for (g, p, _, _), o in store.items() if (g, p) == ("", "nodes")]
        used: dict[str, int] = {}
        for (g, p, _, _), pod in store.items():
            node = (pod.get("spec") or {}).get("nodeName")
            if (g, p) == ("", "pods") and node and (pod.get("status") or {}).get(
                    "phase") not in ("Succeeded", "Failed"):
                used[node] = used.get(node, 0) + _gpus_of(pod)
        for key, pod in list(store.items()):
            spec = pod.get("spec") or {}
            if (key[:2] != ("", "pods") or spec.get("nodeName") or spec.get("schedulingGates")
                    or spec.get("schedulerName") not in (None, "default-scheduler")
                    or pod["metadata"].get("deletionTimestamp")
                    or (pod.get("status") or {}).get("phase") != "Pending"):
                continue
            gpus, why = _gpus_of(pod), Counter[str]()
            chosen = None
            for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
                reason = self._misfit(node, spec, gpus, used)
                if reason is None:
                    chosen = node["metadata"]["name"]
                    break
                why[reason] += 1
            if chosen is not None:
                used[chosen] = used.get(chosen, 0) + gpus
                self._bind(key, pod, chosen)
            else:
                self._unschedulable(key, pod, len(nodes), why)

    @staticmethod
    def _misfit(node: dict[str, Any], spec: dict[str, Any], gpus: int,
                used: dict[str, int]) -> str | None:
        labels = node["metadata"].get("labels") or {}
        if (node.get("spec") or {}).get("unschedulable"):
            return "node(s) were unschedulable"
        if not any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in (node.get("status") or {}).get("conditions") or []):
            return "node(s) were not ready"
        if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
            return "node(s) didn't match Pod's node affinity/selector"
        for taint in (node.get("spec") or {}).get("taints") or []:
            if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(
                    taint, spec.get("tolerations") or []):
                return "node(s) had untolerated taint"
        free = int(str((node.get("status") or {}).get("allocatable", {}).get(GPU, 0)))
        if gpus > free - used.get(node["metadata"]["name"], 0):
            return f"Insufficient {GPU}"
        return None

    def _bind(self, key: tuple[Any, ...], pod: dict[str, Any], node: str) -> None:
        pod = copy.deepcopy(pod)
        pod["spec"]["nodeName"] = node
        status = pod_status("Running") if self.run else dict(pod.get("status") or {})
        status["conditions"] = [{"type": "PodScheduled", "status": "True"}]
        pod["status"] = status
        self.api.replace_object(key, pod)

    def _unschedulable(self, key: tuple[Any, ...], pod: dict[str, Any], num_nodes: int,
                       why: Counter[str]) -> None:
        message = f"0/{num_nodes} nodes are available: " + ", ".join(
            f"{n} {reason}" for reason, n in sorted(why.items())) + "."
        condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": message}
        if condition in ((pod.get("status") or {}).get("conditions") or []):
            return  # nothing new to say: no write, no event (the pass would never settle)
        pod = copy.deepcopy(pod)
        pod.setdefault("status", {})["conditions"] = [condition]
        self.api.replace_object(key, pod)
