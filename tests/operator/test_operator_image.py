"""Smoke tests inside the operator image (scripts/build-images.sh builds it): as the image's
user, cephalo.operator imports without torch, and the image's own `kopf run` command starts
against the API emulator (loopback; chroot isolation shares the host's network) and serves
/healthz and /metrics. Size budget, labels, SBOM and writable paths are checked too."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kube_emulator import ApiEmulator

from tests.image_helpers import (
    CACHE,
    container,
    free_port,
    image_config,
    image_info,
    image_name,
    run,
    run_argv,
    writable_paths,
)

pytestmark = pytest.mark.images
OPERATOR_BUDGET_BYTES = 500_000_000  # on the Debian stand-in base (scripts/standin-bases.sh)
USER = "1000:1000"


@pytest.fixture(scope="module")
def image() -> str:
    return image_name("operator")


@pytest.fixture(scope="module")
def ctr(image: str) -> Iterator[str]:
    yield from container(image)


def test_operator_imports_without_torch_as_its_user(ctr: str) -> None:
    done = run(ctr, ["python", "-I", "-c",
                     "import sys, importlib.util as u, cephalo.operator; "
                     "print(u.find_spec('torch'), 'torch' in sys.modules, "
                     "u.find_spec('pip'), u.find_spec('setuptools'))"], user=USER)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["None", "False", "None", "None"], done.stdout


def test_operator_user_writes_only_tmp(ctr: str) -> None:
    """The chart mounts an emptyDir at /tmp on a read-only root: nothing else may need writing."""
    assert writable_paths(ctr, USER) <= {"/tmp", "/var/tmp", "/run/lock"}


def test_operator_image_size_labels_and_sbom(image: str) -> None:
    info = image_info("operator")
    assert int(str(info["bytes"])) <= OPERATOR_BUDGET_BYTES, \
        f"operator image is {info['bytes']} bytes, over the {OPERATOR_BUDGET_BYTES} budget"
    labels = image_config(image)["Labels"]
    assert isinstance(labels, dict)
    for key in ("title", "description", "version", "revision", "source", "licenses",
                "base.name"):
        assert labels.get(f"org.opencontainers.image.{key}"), f"label {key} empty: {labels}"
    assert labels["org.opencontainers.image.base.name"] == info["base"]
    sbom = json.loads((CACHE / "out" / "operator.cdx.json").read_text())
    names = {c["name"].lower() for c in sbom["components"]}
    assert sbom["bomFormat"] == "CycloneDX" and {"kopf", "kubernetes", "cephalo"} <= names
    assert "torch" not in names


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status, response.read().decode()


async def _wait_http(url: str, proc: subprocess.Popen[str], seconds: float) -> tuple[int, str]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        assert proc.poll() is None, "kopf run exited"
        try:
            return await asyncio.to_thread(_get, url)
        except OSError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.5)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_kopf_run_serves_healthz_and_metrics(image: str, ctr: str, emulator: ApiEmulator,
                                                   tmp_path: Path) -> None:
    config = image_config(image)
    command = [*config["Entrypoint"], *config["Cmd"]]  # type: ignore[misc]
    health, metrics = free_port(), free_port()
    # The image's own command; only the liveness port moves off 8081 (a shared machine).
    command = [a.replace(":8081/", f":{health}/") for a in command]
    kubeconfig = Path(emulator.kubeconfig)
    os.chmod(tmp_path, 0o755)
    os.chmod(kubeconfig, 0o644)
    argv = run_argv(ctr, command, user=USER, volumes=[f"{kubeconfig}:/kube/config:ro"],
                    env={"KUBECONFIG": "/kube/config",
                         "CEPHALO_OPERATOR_METRICS_PORT": str(metrics)})
    log = (tmp_path / "kopf.log").open("w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        status, body = await _wait_http(f"http://127.0.0.1:{health}/healthz", proc, 120)
        assert status == 200, body
        status, body = await _wait_http(f"http://127.0.0.1:{metrics}/metrics", proc, 60)
        assert status == 200 and "cephalo_operator_" in body, body[:2000]
        print(f"kopf run in the image: /healthz 200, /metrics {len(body)} bytes")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        print((tmp_path / "kopf.log").read_text()[-3000:])
