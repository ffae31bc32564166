"""A small Kubernetes REST client over urllib3 (client certificate or bearer token): status
codes and the server's own messages, unmodelled, which is what admission tests compare, and
line-delimited watch streams for the process kubelet."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import urllib3


class ApiError(AssertionError):
    """A request the caller expected to succeed did not; carries the server's answer."""

    def __init__(self, method: str, path: str, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"{method} {path} -> {status}: {body.get('message', body)}")
        self.status, self.body = status, body


@dataclass
class Reply:
    status: int
    body: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.status < 400

    @property
    def message(self) -> str:
        return str(self.body.get("message", ""))


class Rest:
    def __init__(self, server: str, ca_cert: Path, *, cert: Path | None = None,
                 key: Path | None = None, token: str | None = None) -> None:
        self.server = server.rstrip("/")
        self.token = token
        self._streams: set[Any] = set()
        self.pool = urllib3.PoolManager(
            num_pools=4, maxsize=8, cert_reqs="CERT_REQUIRED", ca_certs=str(ca_cert),
            cert_file=str(cert) if cert else None, key_file=str(key) if key else None,
            retries=False, timeout=urllib3.Timeout(connect=5.0, read=60.0))

    def as_token(self, token: str) -> Rest:
        """The same server, authenticated as a service account (a bearer token) instead."""
        clone = Rest.__new__(Rest)
        clone.server, clone.token, clone._streams = self.server, token, set()
        clone.pool = urllib3.PoolManager(
            num_pools=4, maxsize=8, cert_reqs="CERT_REQUIRED",
            ca_certs=self.pool.connection_pool_kw["ca_certs"], retries=False,
            timeout=urllib3.Timeout(connect=5.0, read=60.0))
        return clone

    def _headers(self, ctype: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if ctype:
            headers["Content-Type"] = ctype
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def request(self, method: str, path: str, body: Any = None, *,
                params: dict[str, Any] | None = None,
                ctype: str = "application/json") -> Reply:
        url = self.server + path + (f"?{urlencode(params)}" if params else "")
        data = None if body is None else json.dumps(body).encode()
        resp = self.pool.request(method, url, body=data,
                                 headers=self._headers(ctype if data is not None else None))
        try:
            parsed = json.loads(resp.data or b"{}")
        except json.JSONDecodeError:
            parsed = {"message": resp.data.decode(errors="replace")}
        return Reply(resp.status, parsed if isinstance(parsed, dict) else {"items": parsed})

    def must(self, method: str, path: str, body: Any = None, **kw: Any) -> dict[str, Any]:
        reply = self.request(method, path, body, **kw)
        if not reply.ok:
            raise ApiError(method, path, reply.status, reply.body)
        return reply.body

    def get(self, path: str, **params: Any) -> Reply:
        return self.request("GET", path, params=params or None)

    def create(self, path: str, body: Any, **params: Any) -> dict[str, Any]:
        return self.must("POST", path, body, params=params or None)

    def merge_patch(self, path: str, body: Any) -> dict[str, Any]:
        return self.must("PATCH", path, body, ctype="application/merge-patch+json")

    def watch(self, path: str, resource_version: str,
              stop: Callable[[], bool]) -> Iterator[dict[str, Any]]:
        """Watch events after `resource_version`, until the server ends the stream (a
        timeout, 410 Gone as an ERROR event) or `stop()` is true between events."""
        params = {"watch": "1", "resourceVersion": resource_version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": "30"}
        resp = self.pool.request("GET", f"{self.server}{path}?{urlencode(params)}",
                                 headers=self._headers(None), preload_content=False,
                                 timeout=urllib3.Timeout(connect=5.0, read=45.0))
        self._streams.add(resp)
        try:
            buffer = b""
            for chunk in resp.stream(4096, decode_content=True):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
                if stop():
                    return
        finally:
            self._streams.discard(resp)
            resp.release_conn()

    def close_watches(self) -> None:
        """End every open watch stream now (from another thread): the API server then shuts
        down at once instead of waiting for them."""
        for resp in list(self._streams):
            with contextlib.suppress(Exception):
                resp.shutdown()


def wait_until(what: str, predicate: Callable[[], Any], timeout_seconds: float = 60.0,
               interval_seconds: float = 0.1) -> Any:
    """Poll `predicate` until it returns something truthy (a condition, never a bare sleep)."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_seconds:.0f} s waiting for {what}")
        time.sleep(interval_seconds)
