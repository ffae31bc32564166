"""A process kubelet for the API emulator: the rank pods of chosen jobs run as real
`python -m cephalo.trainer` processes (CPU, gloo), and so do their network probe pods
(`python -m cephalo.trainer.netprobe`); other pods bound to a node just run
(Running until the test ends them). Runs in the test's event loop (the emulator's), off
`ApiEmulator.on_change`, writing status straight into the emulator's store as a kubelet's
status updates would arrive.

What it emulates, as tests/realk8s/kubelet.py does under a real API server:
* the container: its command (`python` is this interpreter) with the pod's env; volume mounts
  mapped to local folders (configMap keys written as files, a persistentVolumeClaim one
  folder per claim shared by every pod, emptyDir a fresh folder), container paths in env
  values rewritten to them;
* the network: every pod is 127.0.0.1; MASTER_ADDR (the rank-0 pod's DNS name) resolves
  there, MASTER_PORT is a free port per gang (job, attempt, plan), and rank 0 serves
  /metrics on `metrics_port` (what the operator scrapes: CEPHALO_TRAINER_METRICS_PORT);
* the termination message: the container's terminationMessagePath is a file of its own
  (env values naming it rewritten), read back at exit, the log's tail on a failure that
  wrote none (FallbackToLogsOnError);
* emulated GPUs: CEPHALO_TIME_DILATION and one thread a rank (CEPHALO_NUM_THREADS), each
  gang's progress file apart (metrics-<attempt>-<config hash>.jsonl);
* deletion: a running pod being deleted gets SIGTERM (the trainer checkpoints at the next
  step boundary and exits 143), SIGKILL after its grace period; then it is reported Failed
  with its exit code and removed, as the real kubelet does. The emulator's own stand-in for
  this (`kubelet_stop_seconds`) is pushed out of the way for these pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import re
import signal
import sys
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kube_emulator import ApiEmulator
from kubelet import ExtraPassKubelet, OperatorProcess, free_port, pod_status

from cephalo.trainer.forked import ForkedModule, start_module

ROLE, JOB, ATTEMPT = "cephalo.dev/role", "cephalo.dev/job", "cephalo.dev/attempt"
HASH = "cephalo.dev/config-hash"
RUN_ROLES = ("trainer", "netprobe")  # rank pods and network probe pods (a gang each)
MAX_MESSAGE_BYTES = 4096  # the kubelet's termination-message limit
CLUSTER_DNS = re.compile(r"^[a-z0-9.-]+\.svc(\.cluster\.local)?$")


@dataclass
class Container:
    key: tuple[Any, ...]
    uid: str
    folder: Path
    proc: asyncio.subprocess.Process | ForkedModule | None = None
    stopping: bool = False


async def _start(argv: list[str], env: dict[str, str], folder: Path
                 ) -> asyncio.subprocess.Process | ForkedModule:
    """The container's process in a process group of its own, its output in the folder's
    container.log. `python -m MODULE` (the trainer, the network probe) forks from the fork
    server that imported torch once (trainer/forked.py) instead of paying ~2.5 s of CPU for
    its imports; any other command runs as itself."""
    log = folder / "container.log"
    if argv[:2] == ["python", "-m"] and len(argv) > 2:
        return start_module(argv[2], argv[3:], env, cwd=folder, log=log, new_session=True)
    if argv and argv[0] == "python":
        argv = [sys.executable, *argv[1:]]  # the "image": this interpreter's environment
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            *argv, env=env, stdout=out, stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL, cwd=folder, start_new_session=True)


# One future per forked process, resolved with its exit code: one reader per descriptor (a
# second add_reader would replace the first waiter's).
_ENDINGS: weakref.WeakKeyDictionary[ForkedModule, asyncio.Future[int]] = \
    weakref.WeakKeyDictionary()


def _ending(proc: ForkedModule) -> asyncio.Future[int]:
    future = _ENDINGS.get(proc)
    if future is None:
        loop = asyncio.get_running_loop()
        future = _ENDINGS[proc] = loop.create_future()

        def check(future: asyncio.Future[int] = future) -> None:
            code = proc.poll()  # its sentinel becomes readable when it ends
            if code is not None:
                loop.remove_reader(proc.sentinel)
                if not future.done():
                    future.set_result(code)

        loop.add_reader(proc.sentinel, check)
        check()  # it may have ended already
    return future


async def exited(proc: asyncio.subprocess.Process | ForkedModule) -> int:
    """The process's exit code once it has exited, waited for in the event loop (no thread
    waits on a forked one: the loop watches its sentinel)."""
    if isinstance(proc, asyncio.subprocess.Process):
        return await proc.wait()
    return await asyncio.shield(_ending(proc))  # a cancelled waiter leaves the others


@dataclass
class ProcessKubelet:
    api: ApiEmulator
    folder: Path
    jobs: set[str]  # jobs whose rank pods run as real trainers
    metrics_port: int
    time_dilation: float = 1.0
    extra_env: dict[str, str] = field(default_factory=dict)  # e.g. an emulated slow link
    containers: dict[str, Container] = field(default_factory=dict)  # by pod uid
    exits: list[tuple[str, int]] = field(default_factory=list)  # (pod name, exit code)
    _ports: dict[tuple[str, str, str], int] = field(default_factory=dict)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def start(self) -> ProcessKubelet:
        # Graceful deletion is this kubelet's job: the emulator's timer must not report a
        # process that is still writing its checkpoint as gone.
        self.api.kubelet_stop_seconds = 1e6
        self.api.on_change.append(self._changed)
        return self

    def claim_folder(self, namespace: str, claim: str) -> Path:
        return self.folder / "claims" / namespace / claim

    def metrics_files(self, job: str) -> list[Path]:
        """Each gang's progress file of `job`, oldest first."""
        return sorted((self.folder / "metrics" / job).glob("*.jsonl"),
                      key=lambda p: p.stat().st_mtime)

    def _changed(self, key: tuple[Any, ...], kind: str, obj: dict[str, Any]) -> None:
        if key[:2] == ("", "pods"):
            asyncio.get_running_loop().call_soon(self._handle, key)

    def _handle(self, key: tuple[Any, ...]) -> None:
        pod = self.api._store.get(key)
        if pod is None:
            return
        meta, spec = pod["metadata"], pod.get("spec") or {}
        labels = meta.get("labels") or {}
        known = self.containers.get(meta["uid"])
        if known is not None:
            if meta.get("deletionTimestamp") and not known.stopping:
                known.stopping = True
                grace = float(meta.get("deletionGracePeriodSeconds") or 30)
                self._spawn(self._terminate(known, grace))
            return
        if not spec.get("nodeName") or meta.get("deletionTimestamp") or (
                pod.get("status") or {}).get("phase") != "Pending":
            return
        if labels.get(ROLE) in RUN_ROLES and labels.get(JOB) in self.jobs:
            c = self.containers[meta["uid"]] = Container(
                key, meta["uid"], self.folder / "pods" / meta["uid"])
            self._spawn(self._run(c, copy.deepcopy(pod)))
        elif labels.get(ROLE) in RUN_ROLES:
            self._report(key, meta["uid"], pod_status("Running"))  # runs until ended

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _report(self, key: tuple[Any, ...], uid: str, status: dict[str, Any]) -> None:
        pod = self.api._store.get(key)
        if pod is None or pod["metadata"]["uid"] != uid:
            return
        pod = copy.deepcopy(pod)
        status["conditions"] = [{"type": "PodScheduled", "status": "True"}]
        pod["status"] = status
        self.api.replace_object(key, pod)

    def _environment(self, c: Container, pod: dict[str, Any]) -> dict[str, str]:
        ns, labels = pod["metadata"]["namespace"], pod["metadata"]["labels"]
        (container,) = pod["spec"]["containers"]
        mounts: list[tuple[str, Path]] = []
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "persistentVolumeClaim" in volume:
                folder = self.claim_folder(ns, volume["persistentVolumeClaim"]["claimName"])
            else:
                folder = c.folder / "volumes" / mount["name"]
            folder.mkdir(parents=True, exist_ok=True)
            if "configMap" in volume:
                cm = self.api._store[("", "configmaps", ns, volume["configMap"]["name"])]
                for name, text in (cm.get("data") or {}).items():
                    (folder / name).write_text(text)
            mounts.append((mount["mountPath"], folder))
        # The container's terminationMessagePath: a file of its own, read back at exit.
        c.folder.mkdir(parents=True, exist_ok=True)
        (c.folder / "termination-log").touch()
        mounts.append((container.get("terminationMessagePath", "/dev/termination-log"),
                       c.folder / "termination-log"))

        def local(value: str) -> str:
            for path, folder in sorted(mounts, key=lambda m: -len(m[0])):
                if value == path or value.startswith(path.rstrip("/") + "/"):
                    return str(folder) + value[len(path.rstrip("/")):]
            return value

        env = {"PATH": os.environ.get("PATH", ""), "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": "1"}
        for var in container.get("env", []):
            value = str(var.get("value", ""))
            ref = (var.get("valueFrom") or {}).get("fieldRef") or {}
            if ref.get("fieldPath") == "metadata.uid":  # the downward API's pod uid
                value = pod["metadata"]["uid"]
            env[var["name"]] = "127.0.0.1" if CLUSTER_DNS.match(value) else local(value)
        gang = (labels[JOB], labels.get(ATTEMPT, "0"), pod["metadata"]["annotations"][HASH])
        env["MASTER_PORT"] = str(self._ports.setdefault(gang, free_port()))
        rank = int(env.get("RANK", "0"))
        # Rank 0 alone serves /metrics, for the operator (every rank pod does on a cluster:
        # tests/realk8s/test_operator_prometheus.py scrapes them all).
        env["CEPHALO_METRICS_PORT"] = str(self.metrics_port if rank == 0 else 0)
        env["CEPHALO_METRICS_ADDRESS"] = "127.0.0.1"
        env["CEPHALO_NUM_THREADS"] = "1"
        env["CEPHALO_TIME_DILATION"] = str(self.time_dilation)
        progress = self.folder / "metrics" / labels[JOB] / f"metrics-{gang[1]}-{gang[2]}.jsonl"
        progress.parent.mkdir(parents=True, exist_ok=True)
        env["CEPHALO_METRICS_FILE"] = str(progress)
        return {**env, **self.extra_env}

    async def _run(self, c: Container, pod: dict[str, Any]) -> None:
        (container,) = pod["spec"]["containers"]
        env = self._environment(c, pod)
        argv = [*container.get("command", []), *container.get("args", [])]
        c.folder.mkdir(parents=True, exist_ok=True)
        c.proc = await _start(argv, env, c.folder)
        self._report(c.key, c.uid, pod_status("Running"))
        code = await exited(c.proc)
        self.exits.append((pod["metadata"]["name"], code))
        phase = "Succeeded" if code == 0 else "Failed"
        self._report(c.key, c.uid, pod_status(phase, exit_code=code,
                                               message=self._message(c, container, code)))
        if c.stopping:  # deleted: gone once its process is (grace 0, as the kubelet asks)
            with contextlib.suppress(KeyError):
                if self.api._store[c.key]["metadata"]["uid"] == c.uid:
                    self.api._remove(c.key)

    async def _terminate(self, c: Container, grace_seconds: float) -> None:
        while c.proc is None:  # deleted while starting: let it start, then stop it
            await asyncio.sleep(0.01)
        if c.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(exited(c.proc)), max(grace_seconds, 0.1))
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
        else:  # it had already exited: the deletion only removes the object
            with contextlib.suppress(KeyError):
                if self.api._store[c.key]["metadata"]["uid"] == c.uid:
                    self.api._remove(c.key)

    def _message(self, c: Container, container: dict[str, Any], code: int) -> str | None:
        """The kubelet's termination message: the terminationMessagePath file (at most 4096
        bytes), else on failure under FallbackToLogsOnError the log's tail."""
        text = (c.folder / "termination-log").read_bytes()[:MAX_MESSAGE_BYTES].decode(
            errors="replace")
        if not text and code and container.get(
                "terminationMessagePolicy") == "FallbackToLogsOnError":
            return self.log_tail(c)
        return text or None

    @staticmethod
    def log_tail(c: Container, chars: int = 2000) -> str:
        log = c.folder / "container.log"
        return log.read_text(errors="replace")[-chars:] if log.exists() else ""

    def logs(self, chars: int = 2000) -> str:
        return "\n".join(f"--- pod {c.key[3]} ({c.uid[:8]}) ---\n{self.log_tail(c, chars)}"
                         for c in self.containers.values())

    async def stop(self) -> None:
        with contextlib.suppress(ValueError):
            self.api.on_change.remove(self._changed)
        for c in list(self.containers.values()):
            if c.proc is not None and c.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                await exited(c.proc)
        deadline = time.monotonic() + 10
        while self._tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def trainers_and_operator(
        api: ApiEmulator, folder: Path, jobs: set[str],
        profile_json: Callable[[dict[str, Any], dict[str, Any]], str],
        operator_env: dict[str, str] | None = None, **kubelet: Any,
) -> AsyncIterator[ProcessKubelet]:
    """The tests' real-trainer cluster around `api`: a ProcessKubelet running `jobs`' rank
    pods, the kopf operator as a process (reading the ranks' metrics from the kubelet's port
    unless `operator_env` says otherwise), and the operator's extra profiler passes answered
    with `profile_json` as the test answers the first. Logs are printed on the way out
    (shown only when the test failed)."""
    ranks = ProcessKubelet(api, folder / "kubelet", jobs=jobs, metrics_port=free_port(),
                           **kubelet).start()
    env = {"CEPHALO_TRAINER_METRICS_PORT": str(ranks.metrics_port), **(operator_env or {})}
    proc = OperatorProcess(api.kubeconfig, folder / "operator.log", **env).start()
    extra_passes = ExtraPassKubelet(api, profile_json).start()
    try:
        yield ranks
    finally:
        await extra_passes.stop()
        await proc.stop()
        print(ranks.logs())
        await ranks.stop()
        print(proc.log()[-8000:])
