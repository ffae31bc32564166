"""Real Kueue beside the real control plane (scripts/kueue-binary.sh builds it): its CRDs, its
manager as a local process with the plain-pod integration only, and its webhook
configurations. The released manifests point each webhook at a Service in kueue-system; the
manager runs on loopback here, so each clientConfig becomes a URL on 127.0.0.1 with the test
CA (what `url:` webhooks are for), and the pod webhooks act only in namespaces labelled
KUEUE_NAMESPACE_LABEL: the other realk8s tests' pods never wait on Kueue."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from .cluster import Cluster, run_tool
from .controlplane import REPO, Process, bin_dir, free_port, pinned_version
from .rest import wait_until

SCRIPT = REPO / "scripts" / "kueue-binary.sh"
KUEUE_NAMESPACE_LABEL = "cephalo-test/kueue"
API = "/apis/kueue.x-k8s.io/v1beta2"


def kueue_version() -> str:
    return pinned_version(SCRIPT, "KUEUE_VERSION")


def kueue_dir() -> Path:
    """The build's cache folder, beside the control plane's (bin/, crds/, webhooks.yaml)."""
    return bin_dir().parent.parent / f"kueue-{kueue_version()}"


def kueue_or_reason() -> tuple[Path | None, str]:
    folder = kueue_dir()
    if (folder / "BUILD-INFO").is_file() and (folder / "bin" / "kueue").is_file():
        return folder, ""
    how = "run scripts/kueue-binary.sh (builds it from its Go module once)" \
        if shutil.which("go") else "install Go, then run scripts/kueue-binary.sh"
    return None, f"no Kueue {kueue_version()} in {folder}: {how}"


def webhook_configurations(manifests: str, port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    """The released webhook configurations for Kueue's own kinds and plain pods (the other
    frameworks' kinds do not exist here), each calling the manager at 127.0.0.1:`port`."""
    out = []
    for doc in yaml.safe_load_all(manifests):
        if not doc:
            continue
        kept = []
        for hook in doc.get("webhooks") or []:
            path = hook["clientConfig"]["service"]["path"]
            if not (path.endswith("-v1-pod") or "-kueue-x-k8s-io-" in path):
                continue
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}",
                                    "caBundle": base64.b64encode(ca_pem).decode()}
            if path.endswith("-v1-pod"):
                hook["namespaceSelector"] = {"matchLabels": {KUEUE_NAMESPACE_LABEL: "true"}}
            kept.append(hook)
        doc["webhooks"] = kept
        doc["metadata"] = {"name": f"cephalo-test-kueue-{doc['metadata']['name']}"}
        out.append(doc)
    return out


def private_etc(folder: Path, certs: Path) -> list[str]:
    """The command prefix that gives Kueue a private /etc holding its metrics certificate.

    With its own certificate management off (the webhook serves ours), Kueue v0.17 loads the
    metrics server's certificate from the fixed path /etc/kueue/metrics/certs and exits
    without it (cmd/kueue/main.go), even with metrics off. So it runs in a mount namespace of
    its own (unshare; a user namespace too when not root) where /etc is an overlay with that
    folder added: nothing changes on the machine, and no other process sees it."""
    upper, work = folder / "etc-upper", folder / "etc-work"
    upper.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    script = (f"mount -t overlay overlay -o lowerdir=/etc,upperdir={upper},workdir={work} /etc"
              f" && mkdir -p /etc/kueue/metrics/certs"
              f" && cp {certs}/tls.crt {certs}/tls.key /etc/kueue/metrics/certs/"
              ' && exec "$@"')
    user = [] if os.getuid() == 0 else ["--map-root-user"]
    return ["unshare", "--mount", "--propagation", "private", *user, "sh", "-c", script, "kueue"]


def private_etc_or_reason() -> str:
    """Why Kueue cannot get its private /etc here ("" when it can)."""
    if shutil.which("unshare") is None:
        return "no `unshare` (util-linux) to give Kueue its private /etc"
    user = [] if os.getuid() == 0 else ["--map-root-user"]
    done = subprocess.run(["unshare", "--mount", *user, "true"], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        return (f"cannot make a mount namespace for Kueue's private /etc (unshare: "
                f"{done.stderr.strip() or done.returncode}); run as root or allow user "
                "namespaces")
    return ""


class Kueue:
    """The Kueue manager (controllers and webhooks) against the cluster, as its admin."""

    def __init__(self, cluster: Cluster, folder: Path, home: Path) -> None:
        self.cluster, self.home = cluster, home
        folder.mkdir(parents=True, exist_ok=True)
        self.webhook_port, self.health_port = free_port(), free_port()
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
            "namespace": "kueue-system",
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": "0"},  # controller-runtime: no metrics server
            "webhook": {"port": self.webhook_port, "host": "127.0.0.1",
                        "certDir": str(cluster.plane.pki.webhook_dir)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "integrations": {"frameworks": ["pod"]},
        }
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        self.hooks = webhook_configurations((home / "webhooks.yaml").read_text(),
                                            self.webhook_port,
                                            cluster.plane.pki.ca_cert.read_bytes())
        # The on-demand visibility API would need an APIService and a port of its own.
        kueue = [str(home / "bin" / "kueue"), f"--config={folder / 'config.yaml'}",
                 "--feature-gates=VisibilityOnDemand=false"]
        self.process = Process("kueue", [*private_etc(folder, cluster.plane.pki.webhook_dir),
                                         *kueue], folder / "kueue.log")

    def start(self) -> Kueue:
        rest = self.cluster.rest
        run_tool(self.cluster, "kubectl", "apply", "--server-side", "-f",
                 str(self.home / "crds"))
        for crd in sorted((self.home / "crds").glob("*.yaml")):
            name = yaml.safe_load(crd.read_text())["metadata"]["name"]
            wait_until(f"CRD {name} Established", lambda n=name: any(
                c["type"] == "Established" and c["status"] == "True" for c in (rest.get(
                    f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{n}").body.get(
                    "status") or {}).get("conditions") or []), 60)
        if not rest.get("/api/v1/namespaces/kueue-system").ok:
            rest.create("/api/v1/namespaces", {"metadata": {"name": "kueue-system"}})
        self.process.start({"KUBECONFIG": str(self.cluster.plane.kubeconfig), "HOME": "/tmp"})
        wait_until("Kueue ready (its webhook server up)", self._ready, 120)
        for hook in self.hooks:
            rest.create(f"/apis/admissionregistration.k8s.io/v1/{hook['kind'].lower()}s", hook)
        return self

    def _ready(self) -> bool:
        assert self.process.alive(), self.process.log_tail()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz",
                                        timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        """The webhooks first: with the manager gone, a pod they match could not be made."""
        for hook in self.hooks:
            self.cluster.rest.request(
                "DELETE", f"/apis/admissionregistration.k8s.io/v1/{hook['kind'].lower()}s/"
                f"{hook['metadata']['name']}")
        self.process.stop()

    def logs(self) -> str:
        return self.process.log_tail(8000)
