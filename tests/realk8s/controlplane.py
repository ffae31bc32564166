"""A real Kubernetes control plane on loopback for the realk8s tests: etcd, kube-apiserver
(client-certificate admin, RBAC, Pod Security admission, service-account tokens),
kube-controller-manager (garbage collector, namespace lifecycle, service accounts, node
lifecycle) and kube-scheduler, each a process with its log in the session's folder.

The binaries come from scripts/k8s-binaries.sh (built from their Go modules, cached outside
the repo); `binaries_or_reason` says where they are, or why there are none.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .pki import Pki, make_pki
from .rest import Rest, wait_until

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "k8s-binaries.sh"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl",
            "helm")
ISSUER = "https://kubernetes.default.svc.cluster.local"


def pinned_version(script: Path, name: str) -> str:
    """The version a build script pins on its `NAME=v...` line (one source of truth)."""
    match = re.search(rf"^{name}=(v[0-9.]+)", script.read_text(), re.M)
    assert match, f"{script} has no {name}= line"
    return match.group(1)


def k8s_version() -> str:
    return pinned_version(BUILD_SCRIPT, "K8S_VERSION")


def bin_dir() -> Path:
    root = os.environ.get("CEPHALO_K8S_CACHE") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cephalo-k8s")
    return Path(root) / k8s_version() / "bin"


def binaries_or_reason() -> tuple[Path | None, str]:
    """The folder of built binaries, or None and the one reason the suite skips."""
    folder = bin_dir()
    if (folder.parent / "BUILD-INFO").is_file() and all(
            os.access(folder / b, os.X_OK) for b in BINARIES):
        return folder, ""
    if shutil.which("go") is None:
        return None, (f"no Kubernetes {k8s_version()} binaries in {folder} and no `go` on PATH "
                      "to build them (install Go, then run scripts/k8s-binaries.sh)")
    return None, (f"no Kubernetes {k8s_version()} binaries in {folder}: run "
                  "scripts/k8s-binaries.sh (builds them from their Go modules once)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dies_with_its_starter(argv: list[str]) -> list[str]:
    """`argv` run so that the kernel kills it (SIGKILL) when the thread that started it
    ends: a test run killed before its teardown (SIGTERM, a CI timeout) leaves no etcd,
    API server, operator or trainer behind. The starting thread must outlive the process
    (the session's main thread; the kubelet's thread that waits for its container)."""
    setpriv = shutil.which("setpriv")  # util-linux; without it, teardown alone stops them
    return [setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv else argv


@dataclass
class Process:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str] | None = None) -> Process:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(dies_with_its_starter(self.argv), stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        log.close()
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_seconds: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_seconds)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()

    def log_tail(self, chars: int = 4000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"--- {self.name} ({self.log_path}) ---\n{text[-chars:]}"


def _https_ok(url: str) -> bool:
    """A component's /healthz (self-signed serving certificate: not verified, loopback)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _etcd(url: str, path: str, body: dict[str, object]) -> dict[str, Any]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        reply: dict[str, Any] = json.loads(resp.read())
        return reply


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


@dataclass
class ControlPlane:
    bin: Path
    folder: Path
    pki: Pki = field(init=False)
    processes: list[Process] = field(default_factory=list)
    server: str = ""
    kubeconfig: Path = field(init=False)
    etcd_url: str = ""
    api: Process | None = None

    def _process(self, name: str, *args: str) -> Process:
        proc = Process(name, [str(self.bin / name), *args], self.folder / f"{name}.log")
        self.processes.append(proc)
        return proc

    def _wait(self, what: str, proc: Process, probe: str, https: bool = True,
              timeout_seconds: float = 60.0) -> None:
        def ready() -> bool:
            if not proc.alive():
                raise AssertionError(f"{proc.name} exited while starting:\n{proc.log_tail()}")
            return _https_ok(probe) if https else _http_ok(probe)
        try:
            wait_until(what, ready, timeout_seconds, interval_seconds=0.05)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{proc.log_tail()}") from None

    def start(self) -> ControlPlane:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.pki = make_pki(self.folder / "pki")
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        etcd = self._process(
            "etcd", "--name", "test", "--data-dir", str(self.folder / "etcd"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"test=http://127.0.0.1:{peer_port}",
            "--unsafe-no-fsync", "--log-level", "warn").start()
        self._wait("etcd healthy", etcd, f"{etcd_url}/health", https=False)

        p = self.pki
        api = self._process(
            "kube-apiserver", f"--etcd-servers={etcd_url}", "--bind-address=127.0.0.1",
            f"--secure-port={api_port}", "--advertise-address=127.0.0.1",
            f"--cert-dir={self.folder / 'apiserver-certs'}",
            f"--tls-cert-file={p.server_cert}", f"--tls-private-key-file={p.server_key}",
            f"--client-ca-file={p.ca_cert}",
            f"--service-account-issuer={ISSUER}", f"--api-audiences={ISSUER}",
            f"--service-account-key-file={p.sa_pub}",
            f"--service-account-signing-key-file={p.sa_key}",
            "--authorization-mode=RBAC",
            # Pod logs: the process kubelet's endpoint at the node's InternalIP (the nodes'
            # Hostname addresses do not resolve), its certificate verified, ours presented.
            f"--kubelet-certificate-authority={p.ca_cert}",
            f"--kubelet-client-certificate={p.kubelet_client_cert}",
            f"--kubelet-client-key={p.kubelet_client_key}",
            "--kubelet-preferred-address-types=InternalIP",
            # PodSecurity is on by default; listed so that a reader sees it is the judge.
            "--enable-admission-plugins=NamespaceLifecycle,ServiceAccount,PodSecurity,"
            "DefaultTolerationSeconds,Priority",
            "--service-cluster-ip-range=10.96.0.0/16", "--profiling=false",
            "--enable-priority-and-fairness=false", "--event-ttl=30m").start()
        self.server = f"https://127.0.0.1:{api_port}"
        self.etcd_url, self.api = etcd_url, api
        self._wait("kube-apiserver ready", api, f"{self.server}/readyz")
        self.kubeconfig = self._write_kubeconfig()

        kcm_port, sched_port = free_port(), free_port()
        kcm = self._process(
            "kube-controller-manager", f"--kubeconfig={self.kubeconfig}", "--leader-elect=false",
            "--controllers=garbagecollector,namespace,serviceaccount,serviceaccount-token,"
            "root-ca-cert-publisher,nodelifecycle,podgc,taint-eviction-controller,"
            "persistentvolume-binder,"
            # type-checks ValidatingAdmissionPolicies (their status.typeChecking)
            "validatingadmissionpolicy-status-controller",
            f"--service-account-private-key-file={p.sa_key}", f"--root-ca-file={p.ca_cert}",
            "--use-service-account-credentials=false", "--bind-address=127.0.0.1",
            f"--secure-port={kcm_port}", "--kube-api-qps=100", "--kube-api-burst=200",
            # Node loss is noticed within seconds (the tests stop a node's heartbeat).
            "--node-monitor-period=2s", "--node-monitor-grace-period=12s").start()
        sched = self._process(
            "kube-scheduler", f"--kubeconfig={self.kubeconfig}", "--leader-elect=false",
            "--bind-address=127.0.0.1", f"--secure-port={sched_port}").start()
        self._wait("kube-controller-manager healthy", kcm,
                   f"https://127.0.0.1:{kcm_port}/healthz")
        self._wait("kube-scheduler healthy", sched, f"https://127.0.0.1:{sched_port}/healthz")
        return self

    def restart_apiserver_compacted(self) -> int:
        """Stop kube-apiserver, compact etcd past every revision any client has seen (a
        write, then compaction at its revision, through etcd's own gRPC gateway), start it
        again: every watch breaks, and resuming one from its last resourceVersion is now
        410 Gone. Returns the compacted revision."""
        assert self.api is not None
        self.api.kill()  # a crash: a graceful stop would wait for the open watches
        revision = int(_etcd(self.etcd_url, "/v3/kv/put", {
            "key": base64.b64encode(b"/cephalo-test/compaction").decode(),
            "value": base64.b64encode(str(time.time()).encode()).decode()})["header"]["revision"])
        _etcd(self.etcd_url, "/v3/kv/compaction", {"revision": revision, "physical": True})
        self.api.start()
        self._wait("kube-apiserver ready again", self.api, f"{self.server}/readyz")
        return revision

    def _write_kubeconfig(self, name: str = "admin.kubeconfig", token: str | None = None) -> Path:
        user: dict[str, str] = ({"token": token} if token else
                                {"client-certificate": str(self.pki.admin_cert),
                                 "client-key": str(self.pki.admin_key)})
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {
                "server": self.server, "certificate-authority": str(self.pki.ca_cert)}}],
            "users": [{"name": "test", "user": user}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
        }
        path = self.folder / name
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def token_kubeconfig(self, name: str, token: str) -> Path:
        """A kubeconfig that authenticates with a bearer token (a service account's)."""
        return self._write_kubeconfig(name, token)

    def admin(self) -> Rest:
        return Rest(self.server, self.pki.ca_cert, cert=self.pki.admin_cert,
                    key=self.pki.admin_key)

    def tool_env(self) -> dict[str, str]:
        """Environment for kubectl and helm: the admin kubeconfig, a private Helm home."""
        home = self.folder / "helm-home"
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig),
                "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
                "HELM_DATA_HOME": str(home / "data")}

    def logs(self) -> str:
        return "\n".join(p.log_tail() for p in self.processes)

    def stop(self) -> None:
        # Dependents first: the API server's clients, then the API server, then etcd.
        for proc in reversed(self.processes):
            started = time.monotonic()
            proc.stop()
            print(f"realk8s: {proc.name} stopped in {elapsed(started)}")

    def healthy(self) -> bool:
        return all(p.alive() for p in self.processes)


def elapsed(since: float) -> str:
    return f"{time.monotonic() - since:.1f} s"
