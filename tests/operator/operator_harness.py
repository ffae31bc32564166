"""Shared by the end-to-end operator tests: the operator-process fixtures and job read-outs.

Test modules import the fixtures under their `*_fixture` names; pytest registers them as
`start_operator` and `operator`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest_asyncio
from kube_emulator import ApiEmulator
from kube_fixtures import cluster_a
from kubelet import (
    WAIT_SECONDS,
    ExtraPassKubelet,
    OperatorProcess,
    apply_nodes,
    job_status,
    pods,
    set_pod,
    wait_for,
)

from cephalo.api import parse_plan
from cephalo.operator.rbac import allowed
from cephalo.operator.render import ANNOTATION_PROFILE_EXTRA_SIZES

NS = "default"
SMALL = {"gpuPools": [{"product": "L4"}, {"product": "RTX-A6000"}]}  # 2 profilers, 3 ranks


@pytest_asyncio.fixture(name="start_operator")
async def start_operator_fixture(emulator: ApiEmulator, tmp_path: Path,
                                 extra_passes: ExtraPassKubelet):
    """Factory: start the operator process (with extra env); every process is stopped after.
    Extra profiler passes are answered (conftest's extra_passes)."""
    await apply_nodes(emulator, cluster_a())
    started: list[OperatorProcess] = []

    def start(**env: str) -> OperatorProcess:
        proc = OperatorProcess(emulator.kubeconfig, tmp_path / "operator.log", **env).start()
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            await proc.stop()
        if started:
            print(started[0].log()[-8000:])  # shown by pytest only when the test failed
    # Every request the operator made is one its ClusterRole (cephalo.operator.rbac) grants.
    used = emulator.rbac_rules(include_tests=False)
    assert used, "no operator requests recorded"
    missing = sorted(r for r in used if not allowed(r[0], r[1], r[2]))
    assert not missing, f"operator used permissions missing from cephalo.operator.rbac: {missing}"


@pytest_asyncio.fixture(name="operator")
async def operator_fixture(start_operator) -> OperatorProcess:
    return start_operator()


def phases(api: ApiEmulator, name: str) -> list[str]:
    seen: list[str] = []
    for version in api.history("cephalojobs", NS, name, group="cephalo.dev"):
        phase = (version.get("status") or {}).get("phase")
        if phase and (not seen or seen[-1] != phase):
            seen.append(phase)
    return seen


def extra_passes_asked(api: ApiEmulator, name: str) -> dict[str, Any]:
    """The extra profiler passes the operator asked for (sizes a plan assigned beyond the
    profiled ones; the job's annotation): {"rounds": n, "passes": {product: [sizes, ...]}}."""
    job = next(j for j in api.list_objects("cephalojobs", NS, group="cephalo.dev")
               if j["metadata"]["name"] == name)
    state = (job["metadata"].get("annotations") or {}).get(ANNOTATION_PROFILE_EXTRA_SIZES)
    return json.loads(state) if state else {"rounds": 0, "passes": {}}


def events(api: ApiEmulator, name: str) -> list[tuple[str, str, str]]:
    return [(e.get("type"), e.get("reason"), e.get("message", ""))
            for e in api.list_objects("events", NS)
            if e.get("involvedObject", {}).get("name") == name]


def plan_of(api: ApiEmulator, name: str):
    cms = [c for c in api.list_objects("configmaps", NS) if c["metadata"]["name"] == f"{name}-plan"]
    return parse_plan(json.loads(cms[0]["data"]["plan.json"])) if cms else None


async def run_ranks(api: ApiEmulator, name: str, phase: str = "Running") -> list[dict]:
    """Wait for every rank pod of the current plan, then set them all to `phase`."""
    plan = await wait_for("a plan", lambda: plan_of(api, name))
    ranks = await wait_for(f"{plan.world_size} rank pods", lambda: (
        ps if len(ps := pods(api, NS, "trainer", name)) == plan.world_size
        and all((p.get("status") or {}).get("phase") == "Pending" for p in ps) else None))
    for pod in ranks:
        await set_pod(api, NS, pod["metadata"]["name"], phase)
    return sorted(ranks, key=lambda p: p["metadata"]["name"])


def cond(api: ApiEmulator, name: str, ctype: str) -> dict:
    for c in job_status(api, NS, name).get("conditions") or []:
        if c["type"] == ctype:
            return c
    return {}


async def wait_phase(api: ApiEmulator, name: str, phase: str,
                     timeout: float = WAIT_SECONDS) -> dict:
    return await wait_for(f"{name} {phase}", lambda: (
        s if (s := job_status(api, NS, name)).get("phase") == phase else None), timeout)
