"""The cluster commands with a kubeconfig that says `insecure-skip-tls-verify: true` (local
and lab clusters), against the API emulator served over TLS with a self-signed certificate:
nothing on stderr (urllib3 printed its InsecureRequestWarning twice a command; kubectl prints
nothing), and a job no operator has seen yet says so and how to check the operator (issue 39
item 8)."""

from __future__ import annotations

import ssl
import warnings
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
import yaml
from aiohttp.test_utils import RawTestServer
from kube_emulator import ApiEmulator
from kube_fixtures import job_body
from kubelet import apply_job
from test_client_cli import cephalo

from cephalo.api.job import API_GROUP, API_VERSION, KIND, PLURAL
from cephalo.client.connection import connect
from tests.realk8s.pki import make_pki


def _tls_server_class(context: ssl.SSLContext) -> type[RawTestServer]:
    class TlsServer(RawTestServer):
        async def start_server(self, loop: Any = None, **kwargs: Any) -> None:
            await super().start_server(loop=loop, ssl=context, **kwargs)

    return TlsServer


def _unverified_session(url: Any) -> aiohttp.ClientSession:
    """kmock's own client (unused here) trusts the self-signed certificate as kubectl would."""
    return aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(ssl=False))


def _insecure_kubeconfig(path: Path, url: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "lab",
        "clusters": [{"name": "lab", "cluster": {"server": url,
                                                 "insecure-skip-tls-verify": True}}],
        "users": [{"name": "tester", "user": {"token": "test-token"}}],
        "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "tester",
                                                 "namespace": "default"}}],
    }))
    return path


@pytest.mark.asyncio
async def test_insecure_kubeconfig_is_quiet_and_an_unseen_job_names_the_operator(
        tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    async with ApiEmulator() as api, kmock.Server(
            api, server_cls=_tls_server_class(context), client_fct=_unverified_session) as server:
        api.add_resource(API_GROUP, API_VERSION, PLURAL, KIND)
        url = str(server.url).rstrip("/")
        assert url.startswith("https://127.0.0.1:")
        kubeconfig = _insecure_kubeconfig(tmp_path / "kubeconfig", url)
        await apply_job(api, job_body("fresh"))  # no operator: no status at all
        home = {"HOME": str(tmp_path)}
        rc, out, err = await cephalo(kubeconfig, "status", env=home)
        assert (rc, err) == (0, ""), err
        assert "fresh" in out
        rc, out, err = await cephalo(kubeconfig, "status", "fresh", env=home)
    assert (rc, err) == (0, ""), err
    print(out)
    assert "no operator has written this job's status yet" in out, out
    assert ("kubectl get pods -A -l app.kubernetes.io/name=cephalo-operator,"
            "app.kubernetes.io/component=operator") in out, out


def test_only_the_insecure_hosts_warning_is_silenced(tmp_path: Path) -> None:
    """The filter names the kubeconfig's host: an unverified request elsewhere still warns."""
    from urllib3.exceptions import InsecureRequestWarning

    kubeconfig = _insecure_kubeconfig(tmp_path / "kubeconfig", "https://10.9.8.7:6443")
    with warnings.catch_warnings(record=True) as caught:  # restores the filters after
        warnings.simplefilter("always")
        connect(str(kubeconfig))
        for host in ("10.9.8.7", "10.9.8.70", "example.com"):
            warnings.warn(f"Unverified HTTPS request is being made to host '{host}'. Adding "
                          "certificate verification is strongly advised.",
                          InsecureRequestWarning, stacklevel=1)
    assert [str(w.message).split("'")[1] for w in caught] == ["10.9.8.70", "example.com"]
