"""A real MLflow tracking server for the tests (issue 38): `python -m mlflow server` with a
SQLite store on loopback, in a folder of its own; skipped with one reason where it cannot be
had (the `dev` extra brings it: mlflow-skinny, sqlalchemy, alembic, flask)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.ports import free_listen_ports

SERVER_START_SECONDS = 120  # a cold import of the server under a loaded 2-core machine: ~20 s


@contextmanager
def running_mlflow_server(folder: Path) -> Iterator[str]:
    """The server's URI while it runs (waited on by its /health, not a sleep)."""
    if importlib.util.find_spec("mlflow.server") is None or \
            importlib.util.find_spec("sqlalchemy") is None:
        pytest.skip("no MLflow tracking server here: pip install 'cephalo[dev]' (mlflow)")
    port = free_listen_ports(1)
    log = (folder / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
         f"sqlite:///{folder / 'mlflow.db'}", "--default-artifact-root",
         str(folder / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        cwd=folder, start_new_session=True,  # its own group: its uvicorn worker goes with it
        # No job runner: MLflow's server-side jobs (GenAI scorers and the like) are not what
        # Cephalo logs to, and the runner is one more process importing MLflow (~3 s of CPU).
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    uri = f"http://127.0.0.1:{port}"
    try:
        if not _healthy(uri, server):
            pytest.skip(f"mlflow server did not start: "
                        f"{(folder / 'server.log').read_text()[-500:]}")
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def _healthy(uri: str, server: subprocess.Popen) -> bool:
    """Waits on the server's /health: True once it answers OK."""
    deadline = time.monotonic() + SERVER_START_SECONDS
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            time.sleep(0.2)  # polling interval of the condition, not a wait for it
    return False
