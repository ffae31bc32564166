"""Launch one trainer process per local device and watch them: progress from rank 0's
metrics file, a crashed rank stops the others (the root cause's error shown: see
cephalo.rootcause), Ctrl-C stops everyone.

Each rank runs in its own session so a terminal Ctrl-C reaches only this launcher, which
then terminates the ranks in order; checkpoints are atomic, so the last complete one stays.
Ranks start in the run directory (all paths they get are absolute): started from a source
checkout, the checkout's `operator/` folder must not shadow the standard library module.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cephalo.api.job import CephaloJobSpec, load_job
from cephalo.api.plan import Plan
from cephalo.api.trainer_env import TrainerVars, to_environ
from cephalo.errors import Terminated
from cephalo.local.devices import LocalDevice
from cephalo.rootcause import RankFailure, describe, root_cause

POLL_SECONDS = 0.2
TERMINATE_GRACE_SECONDS = 5.0
# After the first rank fails, how long the others get to fail on their own (the cause may
# exit a moment after the peers it broke) before the launcher stops them and reads the logs.
ROOT_CAUSE_GRACE_SECONDS = 3.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankEnv:
    device: LocalDevice
    dilation: float = 1.0
    memory_limit_bytes: int | None = None


@dataclass
class LaunchResult:
    # 0: all ranks finished; else the first failure's code (130: Ctrl-C, 143: SIGTERM)
    returncode: int
    failed_rank: int | None = None
    error_tail: str = ""
    records: list[dict] = field(default_factory=list)
    checkpoint_dir: str = ""  # where the ranks checkpointed ("" = nowhere: ephemeral job)


def checkpoint_location(spec: CephaloJobSpec, job_name: str, run_dir: Path) -> str:
    """Where a local run's ranks checkpoint (their checkpoint directory variable).

    `checkpoint.uri`: `<uri>/<job name>/<run directory name>`, one prefix per run like the
    run directory itself (so --resume, which reuses the run directory, finds it again);
    `checkpoint.ephemeral`: nowhere; otherwise the run directory's `checkpoints/` (a
    claimName is a cluster volume: on one machine the run directory stands in for it).
    """
    ckpt = spec.checkpoint
    if ckpt.uri:
        return f"{ckpt.uri.rstrip('/')}/{job_name}/{run_dir.name}"
    if ckpt.ephemeral:
        return ""
    return str(run_dir / "checkpoints")


def rank_environment(rank: int, plan: Plan, ranks: list[RankEnv], run_dir: Path,
                     job_file: Path, plan_file: Path, port: int,
                     threads_per_rank: int, checkpoint_dir: str | None = None,
                     stop_after_step: int | None = None,
                     metrics_port: int = 0) -> dict[str, str]:
    r = plan.ranks[rank]
    info = ranks[rank]
    gpu = info.device.kind != "cpu"
    # The trainer serves on its port + LOCAL_RANK: a CPU rank's LOCAL_RANK is its rank, a GPU
    # rank's is 0 (its one visible GPU); either way rank r ends up on metrics_port + r.
    port_base = (metrics_port + rank if gpu else metrics_port) if metrics_port else 0
    env = dict(os.environ)
    env.update(to_environ(TrainerVars(
        rank=rank, world_size=plan.world_size, local_rank=0 if gpu else rank,  # 0: its one GPU
        master_addr="127.0.0.1", master_port=port, job=str(job_file), plan=str(plan_file),
        batch_size=r.batch_size, micro_batch_size=r.micro_batch_size,
        num_micro_batches=r.num_micro_batches, shard_ratio=r.shard_ratio,
        checkpoint_dir=str(run_dir / "checkpoints") if checkpoint_dir is None
        else checkpoint_dir, metrics_port=port_base, metrics_file=str(run_dir / "metrics.jsonl"),
        metrics_address="127.0.0.1" if metrics_port else None,
        num_threads=threads_per_rank,
        time_dilation=info.dilation if info.dilation != 1.0 else None,
        memory_limit_bytes=info.memory_limit_bytes, stop_after_step=stop_after_step)))
    env.update({"OMP_NUM_THREADS": str(threads_per_rank), "PYTHONUNBUFFERED": "1",
                # a CPU rank must not grab a GPU; a GPU rank sees its one device
                "CUDA_VISIBLE_DEVICES": str(info.device.index) if gpu else ""})
    return env


def _follow(path: Path, offset: int) -> Iterator[list[dict]]:
    """Yields the complete JSON lines appended to `path` after byte `offset` since the last
    call."""
    buffer = ""
    while True:
        new: list[dict] = []
        if path.exists():
            with open(path, encoding="utf-8") as f:
                f.seek(offset)
                chunk = f.read()
                offset = f.tell()
            buffer += chunk
            *lines, buffer = buffer.split("\n")
            new = [json.loads(line) for line in lines if line.strip()]
        yield new


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _blame(procs: list[subprocess.Popen], logs: Path, result: LaunchResult) -> None:
    """Pick the rank that caused the failure (see cephalo.rootcause): give the others
    a moment to fail on their own, in the order they do, then read every log."""
    order = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
    deadline = time.monotonic() + ROOT_CAUSE_GRACE_SECONDS
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(POLL_SECONDS)
        order += [r for r, p in enumerate(procs) if p.poll() not in (None, 0) and r not in order]
    running = [r for r, p in enumerate(procs) if p.poll() is None]
    failures = [RankFailure(r, procs[r].poll(), _tail(logs / f"rank-{r}.log", 40))
                for r in [*order, *running]]
    cause = root_cause(failures)
    first = failures[0]
    result.returncode = cause.exit_code if cause.exit_code not in (None, 0) else 1
    result.failed_rank = cause.rank
    result.error_tail = _tail(logs / f"rank-{cause.rank}.log")
    if cause is not first:
        result.error_tail += (f"\n(rank {first.rank} failed first, with: {describe(first)}; "
                              f"a consequence of rank {cause.rank}'s error)")


def run_group(command: list[str], env: dict[str, str], cwd: Path
              ) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(..., capture_output=True, text=True)` in a session of its own, whose
    every process is stopped (SIGTERM, then SIGKILL) if this one is interrupted: a torchrun
    killed alone would leave its workers running."""
    proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate()
    except BaseException:
        _stop([proc])
        raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + TERMINATE_GRACE_SECONDS
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def launch(plan: Plan, ranks: list[RankEnv], run_dir: Path, job_file: Path, plan_file: Path,
           on_records: Callable[[list[dict]], None], threads_per_rank: int = 1,
           stop_after_step: int | None = None, metrics_port: int = 0) -> LaunchResult:
    """Run all ranks to completion; returns how it ended (never leaves a process behind)."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs: list[subprocess.Popen] = []
    job = load_job(str(job_file))
    result = LaunchResult(returncode=0, checkpoint_dir=checkpoint_location(
        job.spec, job.metadata.name or run_dir.parent.name, run_dir))
    metrics_file = run_dir / "metrics.jsonl"
    # Only this launch's records: a resumed run appends to the earlier segments' records,
    # which may come from another plan (another world size). Measured before any rank starts.
    follow = _follow(metrics_file, metrics_file.stat().st_size if metrics_file.exists() else 0)
    try:
        for rank in range(plan.world_size):
            env = rank_environment(rank, plan, ranks, run_dir, job_file, plan_file, port,
                                   threads_per_rank, result.checkpoint_dir, stop_after_step,
                                   metrics_port)
            with open(logs / f"rank-{rank}.log", "ab") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "cephalo.trainer"], env=env, stdout=log,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True, cwd=run_dir))
        while True:
            records = next(follow)
            if records:
                result.records.extend(records)
                on_records(records)
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                _blame(procs, logs, result)
                break
            if all(c == 0 for c in codes):
                records = next(follow)
                result.records.extend(records)
                if records:
                    on_records(records)
                break
            time.sleep(POLL_SECONDS)
    except KeyboardInterrupt as stopped:  # Ctrl-C, or SIGTERM (cephalo.errors.Terminated)
        result.returncode = 143 if isinstance(stopped, Terminated) else 130
    finally:
        _stop(procs)
    return result
