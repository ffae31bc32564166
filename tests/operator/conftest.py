"""Fixtures for the operator tests: the API emulator served over HTTP, a kubeconfig for it."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import kmock
import pytest
import pytest_asyncio
import yaml

sys.path.insert(0, str(Path(__file__).parent))  # kube_emulator, kube_selectors, kubelet

from kube_emulator import ApiEmulator
from kubelet import ExtraPassKubelet

from cephalo.api import API_GROUP, API_VERSION, KIND, PLURAL


def write_kubeconfig(path: Path, url: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {"token": "test-token"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester",
                                                      "namespace": "default"}}],
    }))
    return path


@pytest_asyncio.fixture()
async def emulator(tmp_path: Path) -> AsyncIterator[ApiEmulator]:
    """The emulator with the CephaloJob resource declared, served on a random local port."""
    async with ApiEmulator() as api, kmock.Server(api) as server:
        api.add_resource(API_GROUP, API_VERSION, PLURAL, KIND, shortnames=("cjob",))
        api.kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", str(server.url).rstrip("/"))
        yield api


@pytest.fixture(autouse=True)
def _no_ambient_kubeconfig(monkeypatch: pytest.MonkeyPatch) -> None:
    """Never let a test reach a real cluster through the developer's kubeconfig."""
    monkeypatch.delenv("KUBECONFIG", raising=False)
    if "KUBERNETES_SERVICE_HOST" in os.environ:
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST")


@pytest_asyncio.fixture(name="extra_passes")
async def extra_passes_fixture(emulator: ApiEmulator) -> AsyncIterator[ExtraPassKubelet]:
    """The extra profiler passes run in the background (the test plays each first pass)."""
    kubelet = ExtraPassKubelet(emulator).start()
    try:
        yield kubelet
    finally:
        await kubelet.stop()
