"""A real S3-compatible server for tests and benches: moto in server mode on loopback.

One place starts it (a subprocess on a free 127.0.0.1 port, waited for until it accepts
connections) so tests of the trainer, of `cephalo run` and `bench/checkpoint.py` talk HTTP
to the same kind of server the trainer's s3fs would reach on a cluster.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

START_TIMEOUT_SECONDS = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def moto_server(extra_env: dict[str, str] | None = None) -> Iterator[str]:
    """Yields the server's endpoint URL; the server is killed on exit. `extra_env` reaches
    the server process (e.g. INITIAL_NO_AUTH_ACTION_COUNT to make it check signatures)."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, **(extra_env or {})},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the moto server did not start") from None
                time.sleep(0.1)
        _forget_s3_clients()
        yield f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()
        _forget_s3_clients()


def _forget_s3_clients() -> None:
    """fsspec caches filesystem instances by their arguments, not by AWS_ENDPOINT_URL: an
    S3FileSystem made while an earlier test's server ran would still point at its dead
    port (connection refused, only when the whole suite runs)."""
    try:
        import s3fs
    except ImportError:
        return
    s3fs.S3FileSystem.clear_instance_cache()
