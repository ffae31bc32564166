"""What the process kubelet makes of a pod before it starts the container's process: its
volumes mapped to local folders and its environment, as a kubelet would build them; and the
process itself (`start_process`).

* volumes: configMap and secret keys written as files, emptyDir a fresh folder, a
  persistentVolumeClaim one folder per claim shared by every pod (an RWX volume); the
  terminationMessagePath a file of the pod's own;
* env: `value`s with Kubernetes `$(VAR)` expansion, fieldRef (the downward API),
  configMapKeyRef/secretKeyRef, resourceFieldRef, and `envFrom`; a cluster DNS name
  (`*.svc`, `*.svc.cluster.local`) resolves to the shared loopback; MASTER_PORT is a free
  port per gang (job, attempt, plan): on a cluster each rank-0 pod has an IP of its own,
  here two gangs (or two test sessions on one machine) would both listen on 29500;
* every pod gets its own loopback address (127.x.y.z) as its pod IP, and a trainer's
  /metrics listens there (CEPHALO_METRICS_ADDRESS): on a cluster each pod has a network of
  its own, here two jobs' rank 0 would both want 0.0.0.0:<trainer metrics port>;
* a container path in env values or arguments is rewritten to the folder behind it.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from cephalo.api.trainer_env import METRICS_ADDRESS, METRICS_PORT
from cephalo.trainer.forked import ForkedModule, start_module

from .controlplane import dies_with_its_starter, free_port
from .kubelet_logs import ContainerLog
from .rest import Rest

POD_IP = "127.0.0.1"  # the node's address, and where cluster DNS names lead
CLUSTER_DNS = re.compile(r"^[a-z0-9.-]+\.svc(\.cluster\.local)?$")


@dataclass
class Container:
    pod: dict[str, Any]
    folder: Path
    proc: subprocess.Popen[bytes] | ForkedModule | None = None
    started_at: str = ""
    mounts: list[tuple[str, Path]] = field(default_factory=list)  # (container path, folder)
    deleting: bool = False
    log: ContainerLog | None = None
    pod_ip: str = POD_IP  # its own loopback address (PodSetup.environment)

    @property
    def key(self) -> str:
        return f"{self.pod['metadata']['namespace']}/{self.pod['metadata']['name']}"

    def host_path(self, path: str) -> str:
        """A container path, as the folder its volume is mapped to (else unchanged)."""
        for mount, folder in sorted(self.mounts, key=lambda m: -len(m[0])):
            if path == mount or path.startswith(mount.rstrip("/") + "/"):
                return str(folder) + path[len(mount.rstrip("/")):]
        return path


class PodSetup:
    """Volumes and environment of the pods on one process kubelet."""

    def __init__(self, rest: Rest, claims: Path) -> None:
        self.rest, self.claims = rest, claims
        self._master_ports: dict[tuple[str, ...], int] = {}  # per gang: see the docstring
        self._pods_started = 0  # numbers each pod's loopback address
        self._lock = threading.Lock()

    def claim_folder(self, namespace: str, claim: str) -> Path:
        """The local folder behind a PersistentVolumeClaim (shared by every pod)."""
        return self.claims / namespace / claim

    def prepare_volumes(self, c: Container) -> None:
        ns = c.pod["metadata"]["namespace"]
        volumes = {v["name"]: v for v in c.pod["spec"].get("volumes", [])}
        (spec_container,) = c.pod["spec"]["containers"]
        folders: dict[str, Path] = {}
        for name, volume in volumes.items():
            folder = c.folder / "volumes" / name
            if "persistentVolumeClaim" in volume:
                folder = self.claim_folder(ns, volume["persistentVolumeClaim"]["claimName"])
            folder.mkdir(parents=True, exist_ok=True)
            for kind, api in (("configMap", "configmaps"), ("secret", "secrets")):
                if kind in volume:
                    ref = volume[kind].get("name") or volume[kind].get("secretName")
                    obj = self.rest.must("GET", f"/api/v1/namespaces/{ns}/{api}/{ref}")
                    data = obj.get("data") or {}
                    items = volume[kind].get("items") or [{"key": k, "path": k} for k in data]
                    for item in items:
                        text = data[item["key"]]
                        raw = base64.b64decode(text) if kind == "secret" else text.encode()
                        (folder / item["path"]).parent.mkdir(parents=True, exist_ok=True)
                        (folder / item["path"]).write_bytes(raw)
            folders[name] = folder
        for mount in spec_container.get("volumeMounts", []):
            folder = folders[mount["name"]] / mount.get("subPath", "")
            folder.mkdir(parents=True, exist_ok=True)
            c.mounts.append((mount["mountPath"], folder))
        message_path = spec_container.get("terminationMessagePath", "/dev/termination-log")
        (c.folder / "termination-log").touch()
        c.mounts.append((message_path, c.folder / "termination-log"))

    def _field(self, c: Container, path: str) -> str:
        meta = c.pod["metadata"]
        if m := re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path):
            return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
        values = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                  "metadata.uid": meta["uid"], "spec.nodeName": c.pod["spec"]["nodeName"],
                  "spec.serviceAccountName": c.pod["spec"].get("serviceAccountName", ""),
                  "status.podIP": c.pod_ip, "status.podIPs": c.pod_ip, "status.hostIP": POD_IP,
                  "status.hostIPs": POD_IP}
        return values[path]

    def _key_ref(self, ns: str, ref: dict[str, Any], api: str) -> str | None:
        reply = self.rest.get(f"/api/v1/namespaces/{ns}/{api}/{ref['name']}")
        value = (reply.body.get("data") or {}).get(ref["key"]) if reply.ok else None
        if value is None:
            if ref.get("optional"):
                return None
            raise ValueError(f"{api} {ref['name']} has no key {ref['key']}")
        return base64.b64decode(value).decode() if api == "secrets" else str(value)

    def environment(self, c: Container, container: dict[str, Any]) -> dict[str, str]:
        """The container's environment; also gives the pod its own loopback address."""
        ns = c.pod["metadata"]["namespace"]
        with self._lock:
            self._pods_started += 1
            n = self._pods_started
        c.pod_ip = f"127.{(n >> 14) % 254 + 1}.{(n >> 6) & 255}.{(n & 63) + 2}"
        # The "image": this interpreter's environment (cephalo installed), nothing else.
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
               "HOSTNAME": c.pod["spec"].get("hostname", c.pod["metadata"]["name"]),
               "PYTHONUNBUFFERED": "1"}
        for source in container.get("envFrom", []):
            for kind, api in (("configMapRef", "configmaps"), ("secretRef", "secrets")):
                if kind in source:
                    reply = self.rest.get(f"/api/v1/namespaces/{ns}/{api}/{source[kind]['name']}")
                    for k, v in (reply.body.get("data") or {}).items() if reply.ok else []:
                        text = base64.b64decode(v).decode() if api == "secrets" else v
                        env[source.get("prefix", "") + k] = text
        for var in container.get("env", []):
            value: str | None = var.get("value", "")
            source = var.get("valueFrom")
            if source and "fieldRef" in source:
                value = self._field(c, source["fieldRef"]["fieldPath"])
            elif source and "configMapKeyRef" in source:
                value = self._key_ref(ns, source["configMapKeyRef"], "configmaps")
            elif source and "secretKeyRef" in source:
                value = self._key_ref(ns, source["secretKeyRef"], "secrets")
            elif source and "resourceFieldRef" in source:
                kind, _, name = source["resourceFieldRef"]["resource"].partition(".")
                value = str((container.get("resources", {}).get(kind) or {}).get(name, "0"))
            if value is None:
                continue
            value = self.expand(value, env, c)
            env[var["name"]] = POD_IP if CLUSTER_DNS.match(value) else value
        if METRICS_PORT in env:  # a trainer's /metrics on its pod's address, not all
            env.setdefault(METRICS_ADDRESS, c.pod_ip)
        if "MASTER_PORT" in env:
            meta = c.pod["metadata"]
            labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
            gang = ((ns, labels.get("cephalo.dev/job", ""), labels.get("cephalo.dev/attempt", ""),
                     notes.get("cephalo.dev/config-hash", ""))
                    if labels.get("cephalo.dev/role") in ("trainer", "netprobe")  # gangs
                    else (meta["uid"],))
            with self._lock:
                env["MASTER_PORT"] = str(self._master_ports.setdefault(gang, free_port()))
        return env

    @staticmethod
    def expand(text: str, env: dict[str, str], c: Container) -> str:
        """Kubernetes `$(VAR)` expansion (`$$` escapes), then container paths to folders."""
        expanded = re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", lambda m: "$" if m.group(0)
                          == "$$" else env.get(m.group(1), m.group(0)), text)
        return c.host_path(expanded) if expanded.startswith("/") else expanded


def start_process(argv: list[str], env: dict[str, str], cwd: Path
           ) -> tuple[subprocess.Popen[bytes] | ForkedModule, tuple[IO[bytes], IO[bytes]]]:
    """The container's process, in a process group of its own, and its stdout and stderr
    pipes. The project's `python -m MODULE` containers (trainer, profiler, network probe)
    fork from the fork server (trainer/forked.py), which imported torch once: started
    afresh each paid ~2.5 s of CPU for its imports, some 50 times a run of tests/realk8s.
    Any other command runs as itself."""
    if argv[:2] == ["python", "-m"] and len(argv) > 2:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            proc = start_module(argv[2], argv[3:], env, cwd=cwd, output=(out_w, err_w),
                                new_session=True)
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w):
                os.close(fd)
        return proc, (os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))
    popen = subprocess.Popen(dies_with_its_starter(argv), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=cwd,
                             start_new_session=True)
    assert popen.stdout is not None and popen.stderr is not None
    return popen, (popen.stdout, popen.stderr)
