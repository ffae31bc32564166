"""What the elastic end-to-end tests share (issue 28): two nodes of 4 A10Gs (the second
NotReady until a test says otherwise), the real kopf operator process, cluster_sim's
TrainingSim playing kubelet and trainer (40 steps a second, whatever the plan), and readers
of the jobs' status."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest_asyncio
from cluster_sim import TrainingSim, operator_env
from kube_emulator import ApiEmulator
from kube_fixtures import gpu_node, job_body
from kubelet import WAIT_SECONDS, OperatorProcess, apply_job, apply_nodes, job_status, wait_for
from operator_harness import NS

from cephalo.api.network import NIC_GBPS_LABEL
from cephalo.operator.rbac import allowed

POOL = "NVIDIA-A10G"
# Big enough that 8 A10Gs are predicted much faster than 4 (a small model is not).
MODEL = {"preset": "gpt-1.3b"}
BATCH = 256
ELASTIC = {"enabled": True, "restartCostSeconds": 0.5, "cooldownSeconds": 300}
# A short growing job, held at step HELD_AT while the test waits on the operator (`hold`):
# STEPS only say how long it runs once released (a second at 40 steps a second). Growing
# from 4 to 8 A10Gs saves 0.44 s over its 30 steps left at the sim's measured 10240
# samples/s, so its assumed restart cost is scaled down with it (the decision's margin is
# about that of a 400-step job against 0.5 s).
STEPS, HELD_AT = 40, 10
SHORT_ELASTIC = {**ELASTIC, "restartCostSeconds": 0.05}


class Sim:
    def __init__(self, api: ApiEmulator, sim: TrainingSim, operator: OperatorProcess) -> None:
        self.api, self.sim, self.operator = api, sim, operator


@pytest_asyncio.fixture(name="sim")
async def sim_fixture(emulator: ApiEmulator, tmp_path: Path) -> AsyncIterator[Sim]:
    # A 100 Gbit/s NIC each (issue 35): across the assumed 10 Gbit/s, 8 A10Gs on two nodes
    # are predicted slower than 4 on one for this model, and the job rightly never grows.
    await apply_nodes(emulator, [fast_nic(gpu_node("a10g-0", POOL, 4, 23028)),
                                 fast_nic(gpu_node("a10g-1", POOL, 4, 23028, ready=False)),
                                 gpu_node("cpu-0", None, 0)])
    async with operated(emulator, tmp_path) as sim:
        yield sim


@asynccontextmanager
async def operated(emulator: ApiEmulator, tmp_path: Path) -> AsyncIterator[Sim]:
    """The sim and the operator process on the emulator's nodes; the operator's RBAC checked
    when they stop."""
    sim = await TrainingSim(emulator, steps_per_tick=2, tick_seconds=0.05).start()
    proc = OperatorProcess(emulator.kubeconfig, tmp_path / "operator.log",
                           CEPHALO_NODE_DEBOUNCE_SECONDS="0.2", **operator_env(sim)).start()
    try:
        yield Sim(emulator, sim, proc)
    finally:
        await proc.stop()
        await sim.stop()
        print(proc.log()[-8000:])  # shown only when the test failed
    used = emulator.rbac_rules(include_tests=False)
    missing = sorted(r for r in used if not allowed(r[0], r[1], r[2]))
    assert not missing, f"operator used permissions missing from cephalo.operator.rbac: {missing}"


def fast_nic(node: dict[str, Any]) -> dict[str, Any]:
    node["metadata"]["labels"][NIC_GBPS_LABEL] = "100"
    return node


def elastic_job(name: str, steps: int, **spec: Any) -> dict[str, Any]:
    return job_body(name, model=MODEL, globalBatchSize=BATCH, training={"steps": steps},
                    **spec)


def status_of(api: ApiEmulator, name: str) -> dict[str, Any]:
    return job_status(api, NS, name)


def world_sizes(api: ApiEmulator, name: str) -> list[int]:
    """Every world size the job's status ever reported (its plan summary's history)."""
    sizes: list[int] = []
    for version in api.history("cephalojobs", NS, name, group="cephalo.dev"):
        size = ((version.get("status") or {}).get("plan") or {}).get("worldSize")
        if size and (not sizes or sizes[-1] != size):
            sizes.append(size)
    return sizes


async def running_with_progress(api: ApiEmulator, name: str) -> dict[str, Any]:
    return await wait_for(f"{name} Running with progress", lambda: (
        s if (s := status_of(api, name)).get("phase") == "Running"
        and (s.get("progress") or {}).get("step") else None), WAIT_SECONDS)


async def running_on(api: ApiEmulator, name: str, gpus: int) -> dict[str, Any]:
    return await wait_for(f"{name} Running on {gpus} GPUs", lambda: (
        s if (s := status_of(api, name)).get("phase") == "Running"
        and (s.get("plan") or {}).get("worldSize") == gpus else None), WAIT_SECONDS)


async def succeeded(api: ApiEmulator, name: str) -> dict[str, Any]:
    return await wait_for(f"{name} Succeeded", lambda: (
        s if (s := status_of(api, name)).get("phase") == "Succeeded" else None), WAIT_SECONDS)


def hold(s: Sim, name: str, step: int = 0) -> None:
    """Job `name` steps up to `step` (0: no further), then its ranks keep running without
    stepping until `release`: a job of few steps is still Running when the operator has done
    what the test waits for next, however slow or loaded the machine (the job's length then
    only sets how long it runs once released). Called right after a wait returns (no await
    between), the job stays where that wait saw it."""
    s.sim.hold_at[name] = step


def release(s: Sim, name: str) -> None:
    s.sim.hold_at.pop(name, None)


async def hold_four_gpus(s: Sim, **spec: Any) -> None:
    """Job b: 4 of the 8 GPUs, ranks that run but never step (the test ends b)."""
    s.sim.idle_jobs.add("b")
    body = elastic_job("b", 10_000, maxGpus=4, **spec)
    await apply_job(s.api, body)
    await running_on(s.api, "b", 4)
