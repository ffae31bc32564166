"""Planning that no job can use to take the operator down (issue 11, defect 4).

`solve` runs in a child process with a memory allowance (RLIMIT_AS) and a time limit; a
time-out, a MemoryError, an OOM-kill or any exception of the planner becomes a
`PlanningFailed` with a one-line message and a reason for the job's Failed condition,
while the operator process (and every other job) carries on.

Children come from a *forkserver*: the operator never forks itself while kopf's threads
run (a fork copies locks held by other threads). The forkserver is a fresh single-threaded
interpreter that preloads the planner once, so each planning child is a cheap fork of it.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from cephalo.api import ClusterSpec, GpuProfile, Plan
from cephalo.api.job import CephaloJobSpec
from cephalo.api.plan import parse_plan
from cephalo.operator.config import OperatorConfig
from cephalo.operator.elastic import capped_spec
from cephalo.planner.worker import child_main, encode_request

# Seconds a killed child gets to exit before the parent stops waiting for it.
REAP_SECONDS = 5.0
# Planning children at once: each may use the whole memory allowance, so this bounds what
# planning adds to the operator pod's memory, however many jobs arrive together.
MAX_CONCURRENT_PLANS = 2
_slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None  # per event loop


class PlanningFailed(Exception):
    """Planning this job failed; `reason` is the Failed condition's reason (`Infeasible`,
    `InvalidSpec` or `PlanningFailed`), the message one line saying what to change."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


_context: Any = None  # a ForkServerContext, else a SpawnContext


def _mp_context() -> Any:
    global _context
    if _context is None:
        ctx: Any
        if "forkserver" in multiprocessing.get_all_start_methods():
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["cephalo.planner.worker"])
        else:  # no forkserver (not Linux): a fresh interpreter per plan
            ctx = multiprocessing.get_context("spawn")
        _context = ctx
    return _context


def _start(request: str, memory_bytes: int, cpu_seconds: int) -> tuple[BaseProcess, Connection]:
    ctx = _mp_context()
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=child_main, args=(sender, request, memory_bytes, cpu_seconds),
                          name="cephalo-planner", daemon=True)
    process.start()
    sender.close()  # only the child writes: EOF here once it is gone
    return process, receiver


def _receive(receiver: Connection, timeout_seconds: float) -> tuple[Any, ...] | str:
    """The child's outcome, "timeout", or "died" (it exited without one)."""
    deadline = time.monotonic() + timeout_seconds
    try:
        if not receiver.poll(max(0.0, deadline - time.monotonic())):
            return "timeout"
        return tuple(receiver.recv())
    except (EOFError, OSError):
        return "died"


def _stop(process: BaseProcess) -> None:
    if process.is_alive():
        process.kill()
    process.join(REAP_SECONDS)


def with_price_list(spec: CephaloJobSpec, prices: dict[str, float]) -> CephaloJobSpec:
    """The job as planned: its own planner.gpuPricesPerHour, else the operator's price list
    (the chart's gpuPricesPerHour); a job's own list wins whole, it is not merged."""
    if spec.planner.gpu_prices_per_hour is not None or not prices:
        return spec
    planner = spec.planner.model_copy(update={"gpu_prices_per_hour": dict(prices)})
    return spec.model_copy(update={"planner": planner})


async def plan_for(config: OperatorConfig, spec: CephaloJobSpec, cluster: ClusterSpec,
                   profiles: Mapping[str, GpuProfile] | None) -> Plan:
    """The job's plan as the operator makes it (first plan, rescale, rollback alike): capped
    by spec.elastic.maxGpus, priced from the operator's list unless the job has its own,
    solved in a child under the operator's planning time and memory limits."""
    return await plan_job(with_price_list(capped_spec(spec), config.prices()), cluster,
                          profiles, timeout_seconds=config.planning_timeout_seconds,
                          memory_bytes=config.planning_memory_bytes)


async def plan_job(spec: CephaloJobSpec, cluster: ClusterSpec,
                   profiles: Mapping[str, GpuProfile] | None, *,
                   timeout_seconds: float, memory_bytes: int) -> Plan:
    """`solve(spec, cluster, profiles)` in a limited child process, off the event loop."""
    global _slots
    loop = asyncio.get_running_loop()
    if _slots is None or _slots[0] is not loop:
        _slots = (loop, asyncio.Semaphore(MAX_CONCURRENT_PLANS))
    request = encode_request(spec, cluster, dict(profiles or {}))
    cpu_seconds = max(1, int(timeout_seconds) + 1)
    async with _slots[1]:  # the time limit starts once a slot is free
        process, receiver = await asyncio.to_thread(_start, request, memory_bytes, cpu_seconds)
        try:
            outcome = await asyncio.to_thread(_receive, receiver, timeout_seconds)
        finally:  # also on cancellation (operator shutdown): never leave a planner running
            receiver.close()
            await asyncio.to_thread(_stop, process)
    if outcome == "timeout":
        raise PlanningFailed("PlanningFailed", (
            f"planning took longer than {timeout_seconds:g} s "
            "(CEPHALO_PLANNING_TIMEOUT_SECONDS) and was stopped; lower globalBatchSize or use "
            "fewer GPU pools"))
    if outcome == "died":
        code = process.exitcode
        why = "killed, out of memory or CPU time?" if code is not None and code < 0 else \
            "no result"
        raise PlanningFailed("PlanningFailed",
                             f"the planner process ended with exit code {code} ({why})")
    if outcome[0] == "ok":
        return parse_plan(json.loads(outcome[1]))
    raise PlanningFailed(str(outcome[1]), str(outcome[2]))
