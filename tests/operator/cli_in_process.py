"""`cephalo` commands run in the test's own process: `cephalo.cli.main` (the same parser,
handlers and one-line errors as the console script) in a worker thread, the emulator serving
from the test's event loop. A fresh interpreter importing the kubernetes client costs about
a CPU-second a command; tests of the console script itself (its exit status, a terminal)
still start one."""

from __future__ import annotations

import asyncio
import contextlib
import io
from pathlib import Path

import pytest

from cephalo.cli import main as cli_main


async def cephalo_in_process(kubeconfig: Path | None, *args: str,
                             env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`cephalo.cli.main(args)` with `env` (and KUBECONFIG) set in this process while it
    runs: (exit code, stdout, stderr), as `cephalo` returns them. An exception main() lets
    through (a traceback a user would see) fails the test; argparse's SystemExit is its exit
    code."""
    environ = {**(env or {})}
    if kubeconfig is not None:
        environ["KUBECONFIG"] = str(kubeconfig)
    out, err = io.StringIO(), io.StringIO()

    def run() -> int:
        try:
            return cli_main(list(args))
        except SystemExit as exc:
            return int(exc.code or 0) if not isinstance(exc.code, str) else 2

    with pytest.MonkeyPatch.context() as patch:
        for key, value in environ.items():
            patch.setenv(key, value)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = await asyncio.to_thread(run)
    return rc, out.getvalue(), err.getvalue()
