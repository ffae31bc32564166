"""The operator's client (`cephalo.operator.kube.Kube`, also the `cephalo` client's) against
errors whose body is not JSON: the real kube-apiserver answers a path no API group serves
(e.g. /apis/cephalo.dev/v1alpha1 before the CRD is installed) with `404 page not found`
as text/plain, and a proxy in front of it may answer 502 with an HTML page. Found under
tests/realk8s, where `cephalo status` crashed (JSONDecodeError) instead of saying that the
CRD is missing."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import kubernetes
import pytest

from cephalo.operator.kube import ApiError, Kube


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        status, body = {"/apis/cephalo.dev/v1alpha1": (404, b"404 page not found\n"),
                        "/api/v1/pods": (502, b"<html>Bad Gateway</html>")}[self.path]
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def kube() -> Iterator[Kube]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    config = kubernetes.client.Configuration()
    config.host = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield Kube(kubernetes.client.ApiClient(config))
    finally:
        server.shutdown()
        server.server_close()


def test_a_plain_text_404_is_not_found(kube: Kube) -> None:
    assert kube.get("/apis/cephalo.dev/v1alpha1") is None


def test_a_plain_text_error_keeps_its_status_and_text(kube: Kube) -> None:
    with pytest.raises(ApiError) as raised:
        kube.get("/api/v1/pods")
    assert raised.value.status == 502
    assert str(raised.value) == "HTTP 502 Bad Gateway: <html>Bad Gateway</html>"
