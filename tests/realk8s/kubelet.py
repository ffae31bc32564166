"""A process kubelet: runs each pod bound to its nodes as local processes and reports what
happened through the real API, so the operator's own pods (profilers, ranks) train under a
real API server.

What it emulates, and how:
* the container: its command + args as one local process (own process group), the image's
  environment being this interpreter's bin folder on PATH (a `python -m MODULE` container
  forks from the fork server that imported torch once: trainer/forked.py); the pod's `env` (values,
  `$(VAR)` expansion, fieldRef/downward API, configMapKeyRef/secretKeyRef) and `envFrom`;
* volumes mapped to local folders: configMap and secret keys written as files, emptyDir a
  fresh folder, a persistentVolumeClaim one folder per claim shared by every pod (an RWX
  volume); a container path in env values or arguments is rewritten to its folder, and so is
  the terminationMessagePath (read back as the termination message, with the log tail under
  FallbackToLogsOnError);
* the network: every pod shares the host's loopback and a cluster DNS
  name (`*.svc`, `*.svc.cluster.local`) in an env value resolves to it; MASTER_PORT is a
  free port per gang (job, attempt, plan): on a cluster each rank-0 pod has an IP of its
  own, here two gangs (or two test sessions on one machine) would both listen on 29500.
  Each pod's IP is a loopback address of its own, where its trainer's /metrics listens
  (tests/realk8s/pod_setup.py);
* logs: stdout and stderr kept in the CRI log format and served at the kubelet's log
  endpoint for `kubectl logs` through the API server (tests/realk8s/kubelet_logs.py);
* status: Running with a running containerStatus, then Succeeded or Failed with the exit
  code (128 + N for a process ended by signal N, as container runtimes report it); a pod
  being deleted gets SIGTERM, SIGKILL after its grace period, then the final delete (grace
  0, uid precondition), as the real kubelet does;
* a test may hold pods it picks (hold/release): bound, Pending, their process not started
  until it releases them (as a slow image pull would keep them).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import urllib3

from .kubelet_logs import ContainerLog, LogServer
from .pki import Pki
from .pod_setup import POD_IP, Container, PodSetup, start_process
from .rest import Reply, Rest

MAX_MESSAGE_BYTES = 4096  # the kubelet's termination-message limit
FALLBACK_LOG_LINES = 80
API_OUTAGE_SECONDS = 120.0  # how long a status write is retried while the API server is down


def exit_code(returncode: int) -> int:
    """What a container runtime reports for a process's Popen returncode: 128 + N for one
    ended by signal N (Popen's -N), as containerd and Docker do."""
    return 128 - returncode if returncode < 0 else returncode


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ProcessKubelet:
    def __init__(self, rest: Rest, folder: Path, node_names: set[str], pki: Pki) -> None:
        self.rest, self.folder, self.node_names = rest, folder, node_names
        self.containers: dict[str, Container] = {}  # by pod uid
        self.setup = PodSetup(rest, folder / "claims")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch_loop, name="kubelet", daemon=True)
        self._hold: Callable[[dict[str, Any]], bool] | None = None  # see hold()
        # Env a test adds to one pod by (namespace, name), over the pod's own: e.g. one rank
        # that slows down mid-run (CEPHALO_TIME_DILATION, CEPHALO_TIME_DILATION_FROM_STEP).
        self.pod_env: dict[tuple[str, str], dict[str, str]] = {}
        self._held: list[Container] = []
        # Each node's log endpoint: its port goes into the node's status (daemonEndpoints).
        self.log_servers = {node: LogServer(functools.partial(self._log_of, node),
                                            pki.kubelet_cert, pki.kubelet_key, pki.ca_cert)
                            for node in sorted(node_names)}

    @property
    def ports(self) -> dict[str, int]:
        return {node: server.port for node, server in self.log_servers.items()}

    # ---- the watch ---------------------------------------------------------------------------
    def start(self) -> ProcessKubelet:
        for server in self.log_servers.values():
            server.start()
        self._thread.start()
        return self

    def _watch_loop(self) -> None:
        while not self._stop.is_set():
            try:
                listing = self.rest.get("/api/v1/pods")
            except (urllib3.exceptions.HTTPError, OSError):  # the API server restarting
                self._stop.wait(0.5)
                continue
            if not listing.ok:
                self._stop.wait(0.5)
                continue
            for pod in listing.body.get("items", []):
                self._handle(pod)
            version = listing.body["metadata"]["resourceVersion"]
            try:
                for event in self.rest.watch("/api/v1/pods", version, self._stop.is_set):
                    if event["type"] == "ERROR":  # 410 Gone: list again
                        break
                    if event["type"] == "BOOKMARK":
                        continue
                    self._handle(event["object"], deleted=event["type"] == "DELETED")
            except Exception as err:
                if not self._stop.is_set():
                    print(f"process kubelet: watch ended ({err}); relisting", file=sys.stderr)

    def _handle(self, pod: dict[str, Any], deleted: bool = False) -> None:
        if (pod.get("spec") or {}).get("nodeName") not in self.node_names:
            return
        uid = pod["metadata"]["uid"]
        with self._lock:
            known = self.containers.get(uid)
            if known is None and not deleted and not pod["metadata"].get("deletionTimestamp") \
                    and (pod.get("status") or {}).get("phase", "Pending") == "Pending":
                known = self.containers[uid] = Container(pod, self.folder / "pods" / uid)
                if self._hold is not None and self._hold(pod):
                    self._held.append(known)
                else:
                    self._start_container(known)
                return
        if known is not None and (deleted or pod["metadata"].get("deletionTimestamp")):
            self._terminate(known, pod, final=not deleted)
        elif known is None and pod["metadata"].get("deletionTimestamp") and not deleted:
            self._final_delete(pod)  # never started here (e.g. terminal): just let it go

    def _start_container(self, c: Container) -> None:
        threading.Thread(target=self._run, args=(c,), daemon=True,
                         name=f"pod-{c.pod['metadata']['name']}").start()

    def hold(self, which: Callable[[dict[str, Any]], bool]) -> None:
        """Pods `which` picks, bound here from now on, are not started (they stay Pending)
        until release(): a test's say in when a pod's process runs, where it must observe
        what comes before (a real kubelet may take as long pulling an image)."""
        with self._lock:
            self._hold = which

    @contextlib.contextmanager
    def pod_env_for(self, pods: Iterable[tuple[str, str]],
                    env: dict[str, str]) -> Iterator[None]:
        """`env` added to the pods named (namespace, name), every incarnation started while
        inside (rank pods keep their names across restarts), none after."""
        pods = list(pods)
        for pod in pods:
            self.pod_env[pod] = env
        try:
            yield
        finally:
            for pod in pods:
                self.pod_env.pop(pod, None)

    def held(self) -> list[str]:
        """namespace/name of the pods held now."""
        with self._lock:
            return [c.key for c in self._held if not c.deleting]

    def release(self) -> None:
        """Start the held pods (those not deleted meanwhile); hold no more."""
        with self._lock:
            self._hold, held, self._held = None, self._held, []
            for c in held:
                if not c.deleting:
                    self._start_container(c)

    # ---- one pod -----------------------------------------------------------------------------
    def _run(self, c: Container) -> None:
        pod = c.pod
        (spec_container,) = pod["spec"]["containers"]
        try:
            self.setup.prepare_volumes(c)
            env = self.setup.environment(c, spec_container)
            meta = pod["metadata"]
            env.update(self.pod_env.get((meta["namespace"], meta["name"]), {}))
        except Exception as err:
            self._report(c, "Failed", exit_code=128, reason="CreateContainerConfigError",
                         message=str(err)[:MAX_MESSAGE_BYTES])
            return
        argv = [PodSetup.expand(a, env, c) for a in
                [*spec_container.get("command", []), *spec_container.get("args", [])]]
        with self._lock:
            if c.deleting:
                return
            c.started_at = _now()
            c.proc, pipes = start_process(argv, env, c.folder)
            c.log = ContainerLog(c.folder / "container.log")
            for pipe, stream in zip(pipes, ("stdout", "stderr"), strict=True):
                c.log.pump(pipe, stream)
        (c.folder / "pid").write_text(str(c.proc.pid))
        self._report(c, "Running")
        code = exit_code(c.proc.wait())
        c.log.close()  # the whole log is written before the container is reported ended
        if c.deleting:
            return  # _terminate reports and deletes
        self._report(c, "Succeeded" if code == 0 else "Failed", exit_code=code,
                     message=self._termination_message(c, spec_container, code))
        print(f"process kubelet: {c.key} exited {code}", file=sys.stderr)


    def _termination_message(self, c: Container, container: dict[str, Any], code: int) -> str:
        text = (c.folder / "termination-log").read_bytes()[:MAX_MESSAGE_BYTES].decode(
            errors="replace")
        if not text and code != 0 and \
                container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            lines = c.log.text().splitlines() if c.log else []
            text = "\n".join(lines[-FALLBACK_LOG_LINES:])[-MAX_MESSAGE_BYTES:]
        return text

    # ---- status and deletion -----------------------------------------------------------------
    def _report(self, c: Container, phase: str, *, exit_code: int | None = None,
                reason: str | None = None, message: str = "") -> None:
        meta, (container,) = c.pod["metadata"], c.pod["spec"]["containers"]
        now, running = _now(), phase == "Running"
        if running:
            state: dict[str, Any] = {"running": {"startedAt": c.started_at}}
        else:
            state = {"terminated": {
                "exitCode": exit_code, "reason": reason or ("Completed" if exit_code == 0
                                                           else "Error"),
                "startedAt": c.started_at or now, "finishedAt": now}}
            if message:
                state["terminated"]["message"] = message
        ready = "True" if running else "False"
        conditions = [{"type": t, "status": s, "lastTransitionTime": now} for t, s in (
            ("PodReadyToStartContainers", "True"), ("Initialized", "True"), ("Ready", ready),
            ("ContainersReady", ready), ("PodScheduled", "True"))]
        status = {"phase": phase, "hostIP": POD_IP, "hostIPs": [{"ip": POD_IP}],
                  "podIP": c.pod_ip, "podIPs": [{"ip": c.pod_ip}],
                  "startTime": c.started_at or now,
                  "conditions": conditions, "containerStatuses": [{
                      "name": container["name"], "image": container["image"],
                      "imageID": f"process://{container['image']}", "ready": running,
                      "restartCount": 0, "started": running, "state": state}]}
        reply = self._retrying(lambda: self.rest.request(
            "PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
            {"metadata": {"uid": meta["uid"]}, "status": status},
            ctype="application/strategic-merge-patch+json"))
        if not reply.ok and reply.status != 404:
            print(f"process kubelet: status of {c.key} -> {reply.status}: {reply.message}",
                  file=sys.stderr)

    def _terminate(self, c: Container, pod: dict[str, Any], *, final: bool) -> None:
        with self._lock:
            if c.deleting:
                return
            c.deleting = True
        grace = pod["metadata"].get("deletionGracePeriodSeconds") or 0

        def stop() -> None:
            code = self._signal(c, grace)
            if final:
                if code is not None:
                    self._report(c, "Failed" if code else "Succeeded", exit_code=code,
                                 reason="Error" if code else "Completed")
                self._final_delete(pod)
        threading.Thread(target=stop, daemon=True, name=f"stop-{c.key}").start()

    @staticmethod
    def _signal(c: Container, grace_seconds: float) -> int | None:
        if c.proc is None:
            return None
        if c.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, signal.SIGTERM)
            try:
                c.proc.wait(max(grace_seconds, 0.1))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
        code = exit_code(c.proc.wait())
        if c.log is not None:
            c.log.close()
        return code

    def _log_of(self, node: str, namespace: str, pod: str,
                container: str) -> ContainerLog | tuple[int, str]:
        """The log the kubelet of `node` has for a container, or (status, message) as the
        kubelet answers: the pod's newest incarnation here (rank pods keep their names)."""
        with self._lock:
            mine = [c for c in self.containers.values() if c.key == f"{namespace}/{pod}"
                    and c.pod["spec"].get("nodeName") == node]
        if not mine:
            return 404, f'pod "{pod}" does not exist\n'
        c = mine[-1]
        if container not in {s["name"] for s in c.pod["spec"]["containers"]}:
            return 404, f'container "{container}" not found in pod "{pod}"\n'
        if c.log is None:
            return 400, (f'container "{container}" in pod "{pod}" is waiting to start: '
                         "ContainerCreating")
        return c.log

    def _final_delete(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        self._retrying(lambda: self.rest.request(
            "DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
            {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}))

    def _retrying(self, send: Callable[[], Reply]) -> Reply:
        """A status write or final delete, sent again while the API server does not answer
        (a test restarts it), as the kubelet's status manager keeps trying."""
        deadline = time.monotonic() + API_OUTAGE_SECONDS
        while True:
            try:
                return send()
            except (urllib3.exceptions.HTTPError, OSError):
                if time.monotonic() > deadline or self._stop.wait(0.2):
                    raise

    def claim_folder(self, namespace: str, claim: str) -> Path:
        """The local folder behind a PersistentVolumeClaim (shared by every pod)."""
        return self.setup.claim_folder(namespace, claim)

    def kill(self, namespace: str, name: str) -> int:
        """SIGKILL a running pod's process (a crashed rank); its pid."""
        for c in list(self.containers.values()):
            if c.key == f"{namespace}/{name}" and c.proc is not None and c.proc.poll() is None:
                os.killpg(c.proc.pid, signal.SIGKILL)
                return c.proc.pid
        raise AssertionError(f"no running process for pod {namespace}/{name}")

    def newest(self, namespace: str, name: str) -> ContainerLog:
        """The log of pod `name`'s newest container that has started."""
        logs = [c.log for c in list(self.containers.values())
                if c.key == f"{namespace}/{name}" and c.log is not None]
        assert logs, f"no container of pod {namespace}/{name} has started"
        return logs[-1]

    def log_of(self, namespace: str, name: str) -> str:
        """What the newest container of pod `name` has written (as the kubelet keeps it)."""
        return self.newest(namespace, name).text()

    def exits(self, namespace: str, name: str) -> list[int | None]:
        """The exit codes of every container this kubelet ran for pod `name`, oldest first
        (None: still running). A rank pod keeps its name across gangs, so two entries mean
        its process was replaced (a drain, a restart), one that it ran throughout."""
        return [None if c.proc.returncode is None else exit_code(c.proc.returncode)
                for c in list(self.containers.values())
                if c.key == f"{namespace}/{name}" and c.proc is not None]

    def stop(self) -> None:
        """Kill every container and end the watch."""
        self._stop.set()
        self.rest.close_watches()
        for server in self.log_servers.values():
            server.stop()
        for c in list(self.containers.values()):
            c.deleting = True
            if c.proc is not None and c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()

    def join(self, timeout_seconds: float = 10.0) -> None:
        self._thread.join(timeout_seconds)

    def logs(self, chars: int = 3000) -> str:
        parts = []
        for c in self.containers.values():
            if c.log is not None:
                parts.append(f"--- pod {c.key} ---\n{c.log.text()[-chars:]}")
        return "\n".join(parts)

    def cleanup(self) -> None:
        shutil.rmtree(self.folder / "pods", ignore_errors=True)
