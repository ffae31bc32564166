"""`cephalo run` refuses, in one line, a machine whose own hostname does not resolve: torchrun's
rendezvous would wait in gethostbyname without a word (issue 24: a container under
`buildah run --isolation chroot`, whose hostname is not in /etc/hosts)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from cephalo.local import checks
from cephalo.local.checks import RunError, check_hostname_resolves

from .cli_helpers import TINY_JOB, cephalo_cmd


def test_a_name_that_resolves_passes() -> None:
    check_hostname_resolves()  # this machine's own name resolves (the suite's premise)


def test_a_lookup_that_fails_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(name: str) -> str:
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(checks.socket, "gethostname", lambda: "box-7")
    monkeypatch.setattr(checks.socket, "gethostbyname", fail)
    with pytest.raises(RunError, match=r"hostname 'box-7' does not resolve \(.*not known\).*"
                                        r"--hostname localhost"):
        check_hostname_resolves()


def test_a_lookup_that_never_answers_is_refused_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    monkeypatch.setattr(checks.socket, "gethostbyname", lambda name: release.wait(60))
    try:
        with pytest.raises(RunError, match=r"no answer in 0.2 s"):
            check_hostname_resolves(timeout_s=0.2)
    finally:
        release.set()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare to give a process a hostname of its own")
def test_cephalo_run_refuses_an_unresolvable_hostname_before_starting(tmp_path: Path) -> None:
    """The real command in a UTS namespace whose hostname nothing resolves: exit 2, one
    line, no run folder, no process started."""
    (tmp_path / "job.yaml").write_text(TINY_JOB.format(name="host", batch=4, steps=2))
    name = "cephalo-test-unresolvable.invalid"  # .invalid never resolves (RFC 2606)
    argv = ["unshare", "--uts", "sh", "-c", f'hostname {name} && exec "$@"', "sh",
            *cephalo_cmd("run", "job.yaml", "--devices", "cpu:2")]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, XDG_CACHE_HOME=str(tmp_path / ".cache")),
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"hostname {name!r} does not resolve" in lines[0], done.stderr
    assert not (tmp_path / "runs").exists()
