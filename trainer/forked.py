"""The fork server that tests and benchmarks start torch processes from, and `start_module`:
`python -m MODULE` (the trainer, the profiler, the network probe) in a process forked from
it, optionally in a network namespace at a niceness of its own (the shaped-link benchmarks,
bench/shaped_network.py). Without torch itself: a caller that only starts processes does
not import it.

The server (one per process, multiprocessing's "forkserver") imports FORK_SERVER_PRELOAD
once; every process then forks from it in milliseconds instead of paying ~2-4 s of CPU for
its imports. Nothing has run a kernel in the server, so the forked processes start with
fresh thread pools (`trainer.spawn.spawn_ranks` uses the same server).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import runpy
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from multiprocessing import forkserver, reduction
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any

# One list for every caller: the server is started by whichever comes first. torch, the
# lazily imported sympy that the first backward-with-gradient pulls in, and what the
# modules start_module runs import (not those modules: runpy runs them afresh as __main__).
FORK_SERVER_PRELOAD = ["torch", "torch.distributed", "cephalo.trainer.engine",
                       "torch.fx.experimental.symbolic_shapes", "cephalo.trainer.run",
                       "cephalo.trainer.profile_units", "cephalo.trainer.profile_collectives"]
CLONE_NEWNET = 0x40000000  # sched.h: setns(2) into a network namespace
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def fork_server() -> ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(FORK_SERVER_PRELOAD)
    return ctx


class ForkedModule:
    """A module run by `start_module`, with the subprocess.Popen calls its callers make
    (pid, poll, wait, kill, send_signal, returncode) on the fork server's child, safe from
    several threads as Popen's are: multiprocessing reads the exit code from the server's
    pipe, and two threads reading it at once left one of them 255 (a kubelet's waiting
    thread beside the one that stops the pod)."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        if process.pid is None:
            raise RuntimeError(f"{process.name} was never started")
        self._process = process
        self._lock = threading.Lock()
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self.poll()

    @property
    def sentinel(self) -> int:
        """A descriptor that becomes readable when the process ends (an event loop's
        add_reader), as multiprocessing's Process.sentinel."""
        return self._process.sentinel

    def poll(self) -> int | None:
        with self._lock:  # exitcode reads the code once it is there
            return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            multiprocessing.connection.wait([self._process.sentinel], timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(["forked", self._process.name], timeout or 0.0)
        return code

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, signum: int) -> None:
        with self._lock:  # as Popen: never a pid that may have been reused
            if self._process.exitcode is None:
                os.kill(self.pid, signum)


def stop_all(procs: Sequence[ForkedModule]) -> None:
    """Kill and reap every process of `procs` still running."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_for_all(procs: Sequence[ForkedModule], timeout_seconds: float) -> None:
    """Wait for every process, each up to `timeout_seconds`; none is left running, also when
    a wait times out (stop_all)."""
    try:
        for proc in procs:
            proc.wait(timeout=timeout_seconds)
    finally:
        stop_all(procs)


class _HandedFd:
    """A file descriptor of this process handed to the forked one: multiprocessing sends it
    to the fork server with the process's arguments, as it sends a Pipe's ends
    (reduction.DupFd), and the forked process receives its own copy."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[object, tuple[object]]:
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(handed: Any) -> int:
    return int(handed.detach())


def start_module(module: str, args: Sequence[str], env: Mapping[str, str], *, cwd: Path,
                 log: Path | None = None, output: tuple[int, int] | None = None,
                 netns: str | None = None, niceness: int | None = None,
                 new_session: bool = False) -> ForkedModule:
    """`python -m module args` with exactly `env`, forked from the fork server, its stdout
    and stderr appended to `log`, or written to the two file descriptors of `output` (pipes
    its caller reads, as subprocess.PIPE; the caller closes its copies once this returns):
    in the network namespace `netns` (as `ip netns` names it); with `niceness` (root for a
    negative one) at that niceness in a session and autogroup of its own; with
    `new_session`, in a session and process group of its own (Popen's start_new_session:
    os.killpg(pid, ...) reaches what it starts too). It dies with the fork server, which
    ends with the process that started it: a test killed before its teardown leaves none
    behind. For tests and benchmarks that start many torch processes whose start-up is not
    what they measure."""
    where: str | tuple[_HandedFd, _HandedFd]
    if log is not None and output is None:
        where = str(log.absolute())
    elif output is not None and log is None:
        where = (_HandedFd(output[0]), _HandedFd(output[1]))
    else:
        raise ValueError("start_module: give exactly one of log and output")
    process = fork_server().Process(
        target=_run_module, name=module,
        args=(module, list(args), dict(env), str(cwd), where, netns, niceness, new_session))
    process.start()
    return ForkedModule(process)


def _run_module(module: str, args: list[str], env: dict[str, str], cwd: str,
                where: str | tuple[int, int], netns: str | None, niceness: int | None,
                new_session: bool) -> None:
    """The forked process: its output where asked first (so a failure to place it is there
    too), placed as asked, then the module as `python -m` runs it; exits with its exit
    code."""
    _dies_with_parent()
    if isinstance(where, str):
        out = os.open(where, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        where = (out, out)
    for fd, target in zip(where, (1, 2), strict=True):
        os.dup2(fd, target)
    for fd in set(where):
        os.close(fd)
    code: str | int | None = 0
    try:
        if new_session and niceness is None:
            os.setsid()
        if niceness is not None:
            _own_session_at(niceness)
        if netns is not None:
            _enter_network_namespace(netns)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        _threads_as_started_with(env)
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        code = done.code
    except BaseException:
        traceback.print_exc()
        code = 1
    # Then multiprocessing ends the process as the interpreter would (threading._shutdown:
    # the threading atexit calls, such as an executor's shutdown, then every non-daemon thread
    # joined). Joining them here first waited forever on an asyncio executor's idle workers
    # (a kopf operator stopped with SIGINT).
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(ValueError):  # a module may close its own (json.tool does)
            stream.flush()
    sys.exit(code)


def _dies_with_parent() -> None:
    """SIGKILL when the parent (the fork server) ends, and the server ends with the process
    that started it: a forked process is the server's child, not that process's. The
    server ends when every holder of its "alive" pipe's write end has closed it, and
    multiprocessing hands that end to every process it forks (forkserver.py, _serve_one),
    so that any of them kept it running; this one closes its copy (starting a process of its
    own, it starts a server of its own: the handed one's pid is not its to check)."""
    server = forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        server._forkserver_alive_fd = None  # type: ignore[attr-defined]
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getppid()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the server ended before the line above: end now
        os._exit(1)


def _threads_as_started_with(env: Mapping[str, str]) -> None:
    """torch's intra-op threads as a fresh interpreter with `env` would have them. OpenMP
    read OMP_NUM_THREADS when the server loaded torch, from the server's environment: a
    forked process keeps that count whatever its own says (measured: 2 threads under
    OMP_NUM_THREADS=1, which moved a resumed run's weights off a one-thread reference)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    value = env.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(value) if value.isdigit() and int(value) > 0
                          else len(os.sched_getaffinity(0)))  # OpenMP's default: the CPUs


def _own_session_at(niceness: int) -> None:
    """A session of its own whose autogroup (sched(7)) runs at `niceness` too: with the
    kernel's autogroups a process's niceness ranks it only inside its session, and each
    other session gets an equal share of the cores whatever its niceness."""
    os.setsid()
    os.setpriority(os.PRIO_PROCESS, 0, niceness)  # threads started later inherit it
    with contextlib.suppress(OSError):  # no autogroups here: niceness alone
        Path(f"/proc/{os.getpid()}/autogroup").write_text(f"{niceness}\n")


def _enter_network_namespace(name: str) -> None:
    """Join the namespace `ip netns add NAME` made (the networking `ip netns exec` gives)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)
