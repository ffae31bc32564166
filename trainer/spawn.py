"""Spawn a function on N local gloo ranks, for tests and benchmarks (a job's ranks start
with `python -m cephalo.trainer`): a free port, a timeout, results back by rank, and no
process left behind whatever happens."""

from __future__ import annotations

import datetime
import io
import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from cephalo.api.trainer_env import TrainerVars, to_environ
from cephalo.trainer.forked import fork_server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple,
           results: Any, timeout_seconds: float, num_threads: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(num_threads)
    os.environ.update(to_environ(TrainerVars(rank=rank, world_size=world_size, local_rank=rank,
                                             master_addr="127.0.0.1", master_port=port)))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_seconds))
        try:
            # Bytes, not tensors: torch's queue reducers pass tensors as shared-memory
            # handles that die with this process, which may exit before the parent reads.
            buffer = io.BytesIO()
            torch.save(fn(rank, world_size, *args), buffer)
            results.put((rank, "ok", buffer.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report everything to the parent, which raises it
        results.put((rank, "error", traceback.format_exc()))


def spawn_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout_seconds: float = 120.0, num_threads: int = 1) -> list[Any]:
    """`fn(rank, world_size, *args)` on `world_size` spawned gloo ranks; results by rank.

    `fn` must be importable (module level). Raises RuntimeError with the first failing
    rank's traceback, or on timeout (all ranks are then killed).
    """
    ctx = fork_server()  # torch imported once; each rank forks from it in milliseconds
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, daemon=True,
                         args=(fn, r, world_size, port, args, results,
                               max(10.0, timeout_seconds / 2), num_threads))
             for r in range(world_size)]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_seconds
    try:
        while len(collected) < world_size:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue_module.Empty:
                missing = sorted(set(range(world_size)) - set(collected))
                died = [r for r in missing if procs[r].exitcode not in (None, 0)]
                if died:  # crashed before it could report (e.g. at import)
                    raise RuntimeError(f"ranks {died} exited with codes "
                                       f"{[procs[r].exitcode for r in died]}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ranks {missing} gave no result within "
                                       f"{timeout_seconds} s") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [collected[r] for r in range(world_size)]
