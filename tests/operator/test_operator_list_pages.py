"""LISTs in pages, as a real API server serves them (`limit`, `continue`, 410 on an expired
token), through the operator's real client over HTTP against the emulator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kube_emulator import ApiEmulator
from kubelet import call

from cephalo.operator import kube as kube_module
from cephalo.operator.gpu_usage import PodLister
from cephalo.operator.kube import AsyncKube, Kube

pytestmark = pytest.mark.asyncio
GPU = "nvidia.com/gpu"


def _client(kubeconfig: Path) -> AsyncKube:
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(kubeconfig),
                                       client_configuration=configuration)
    return AsyncKube(Kube(kubernetes.client.ApiClient(configuration)))


async def _pod(api: ApiEmulator, namespace: str, name: str, gpus: int) -> None:
    resources = {"limits": {GPU: str(gpus)}} if gpus else {}
    await call(api, "POST", f"/api/v1/namespaces/{namespace}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"nodeName": "n0", "containers": [
            {"name": "main", "image": "x", "resources": resources}]}}, "application/json")


async def test_every_page_is_read_and_only_what_is_kept_is_held(
        emulator: ApiEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube_module, "LIST_PAGE_SIZE", 3)
    for i in range(8):
        await _pod(emulator, "team-b" if i % 3 else "team-a", f"p{i}", gpus=i % 2)
    kube = _client(emulator.kubeconfig)
    names = [p["metadata"]["name"] for p in await kube.list("/api/v1/pods")]
    assert sorted(names) == [f"p{i}" for i in range(8)] and len(names) == 8
    lists = [c for c in emulator.calls if c.verb == "list" and c.resource == "pods"]
    assert len(lists) == 3  # 3 + 3 + 2
    lister = PodLister()  # the operator's GPU view keeps only pods that can hold GPUs
    held = await lister.pods(kube, {"team-a", "team-b"})
    assert sorted(p["metadata"]["name"] for p in held) == ["p1", "p3", "p5", "p7"]


async def test_an_expired_continue_token_starts_the_list_again(
        emulator: ApiEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube_module, "LIST_PAGE_SIZE", 2)
    for i in range(5):
        await _pod(emulator, "default", f"p{i}", gpus=1)
    kube = _client(emulator.kubeconfig)
    real_request = Kube.request
    expired = [True]

    def request(self: Kube, method: str, path: str, body: Any = None,
                query: dict[str, str] | None = None, **kw: Any) -> dict[str, Any]:
        if query and "continue" in query and expired[0]:  # the server compacted it away
            expired[0] = False
            raise kube_module.ApiError(410, "Expired", "The provided continue parameter is "
                                       "too old to display a consistent list result.")
        return real_request(self, method, path, body, query, **kw)

    monkeypatch.setattr(Kube, "request", request)
    names = [p["metadata"]["name"] for p in await kube.list("/api/v1/namespaces/default/pods")]
    assert names == [f"p{i}" for i in range(5)]  # no duplicates from the first attempt
