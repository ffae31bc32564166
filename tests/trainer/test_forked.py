"""trainer/forked.py: a module forked from the fork server writes to the pipes it was handed,
leads a session of its own when asked (os.killpg reaches it), reports Popen's exit codes,
and dies with the fork server (which ends with the process that started it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cephalo.trainer.forked import ForkedModule, start_module

ROOT = Path(__file__).resolve().parents[2]
SLEEP = ["-n", "1", "-r", "1", "import time; time.sleep(120)"]  # python -m timeit ...


def _read_all(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as pipe:
        return pipe.read()


def test_output_goes_to_the_pipes_handed_and_the_exit_code_comes_back(tmp_path: Path) -> None:
    (tmp_path / "good.json").write_text('{"b": 1}')
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    proc = start_module("json.tool", ["good.json", "--sort-keys"], {"PATH": "/usr/bin"},
                        cwd=tmp_path, output=(out_w, err_w))
    os.close(out_w)
    os.close(err_w)
    assert proc.wait(60) == 0
    assert _read_all(out_r) == b'{\n    "b": 1\n}\n' and _read_all(err_r) == b""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    failed = start_module("json.tool", ["missing.json"], {}, cwd=tmp_path,
                          output=(out_w, err_w))
    os.close(out_w)
    os.close(err_w)
    assert failed.wait(60) == 2  # argparse's usage error
    assert _read_all(out_r) == b"" and b"missing.json" in _read_all(err_r)


def test_one_of_log_and_output_is_given(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="exactly one of log and output"):
        start_module("json.tool", [], {}, cwd=tmp_path)


def test_a_new_session_is_reached_by_killpg_and_reports_the_signal(tmp_path: Path) -> None:
    proc = start_module("timeit", SLEEP, {}, cwd=tmp_path, log=tmp_path / "log",
                        new_session=True)
    try:
        deadline = time.monotonic() + 60
        while os.getpgid(proc.pid) != proc.pid:  # setsid runs first thing in the child
            assert time.monotonic() < deadline, "never led a process group of its own"
            time.sleep(0.05)
        assert os.getsid(proc.pid) == proc.pid
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == -signal.SIGTERM  # as Popen reports a signal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


SCRIPT = """
import sys
from pathlib import Path
import cephalo.trainer.forked as forked
forked.FORK_SERVER_PRELOAD = []  # this test's server needs no torch
proc = forked.start_module("timeit", sys.argv[2:], {}, cwd=Path(sys.argv[1]),
                           log=Path(sys.argv[1]) / "log")
print(proc.pid, flush=True)
sys.stdin.read()  # until the test kills this process
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def test_a_forked_module_dies_with_the_process_that_started_the_server(tmp_path: Path) -> None:
    """Regression: killed (SIGKILL) before its teardown, a test left its forked ranks running;
    now the fork server ends with it and takes them along."""
    starter = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path), *SLEEP],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT / "src")
    assert starter.stdout is not None
    pid = int(starter.stdout.readline())
    try:
        assert not _gone(pid)
        starter.kill()
        starter.wait()
        deadline = time.monotonic() + 60
        while not _gone(pid):
            assert time.monotonic() < deadline, f"forked process {pid} outlived its starter"
            time.sleep(0.05)
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def _exit_codes_seen_at_once(proc: ForkedModule) -> list[int]:
    """The exit code as three threads waiting and one polling all read it."""
    seen: list[int] = []

    def polled() -> int:
        while (code := proc.poll()) is None:
            time.sleep(0.001)
        return code

    threads = [threading.Thread(target=lambda: seen.append(proc.wait(60))) for _ in range(3)]
    threads.append(threading.Thread(target=lambda: seen.append(polled())))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return seen


def test_threads_waiting_and_polling_at_once_all_read_the_exit_code(tmp_path: Path) -> None:
    """Regression: multiprocessing reads a forked process's exit code from the server's pipe
    once; a thread that read it beside another got 255 (a kubelet's waiting thread beside
    the one stopping the pod)."""
    for _ in range(5):
        proc = start_module("json.tool", ["missing.json"], {}, cwd=tmp_path,
                            log=tmp_path / "log")
        assert _exit_codes_seen_at_once(proc) == [2, 2, 2, 2] and proc.returncode == 2


def test_a_module_that_leaves_an_idle_executor_thread_exits(tmp_path: Path) -> None:
    """Regression: the forked process joined every non-daemon thread before the threading
    atexit calls that stop an executor's idle workers, and waited on them forever (a kopf
    operator stopped with SIGINT never exited). It ends as the interpreter would."""
    statement = ("import builtins, concurrent.futures as f; "  # kept: never collected
                 "builtins.pool = f.ThreadPoolExecutor(max_workers=1); "
                 "builtins.pool.submit(int).result()")
    proc = start_module("timeit", ["-n", "1", "-r", "1", statement], {}, cwd=tmp_path,
                        log=tmp_path / "log")
    try:
        assert proc.wait(60) == 0, (tmp_path / "log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
