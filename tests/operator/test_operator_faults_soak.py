"""Fault soak: under 10 % failed or lost writes and watch streams closed every second, one job
per seed converges to Succeeded with no gang restart and no object created twice.

The real kopf operator over HTTP against the emulator; each seed is a fresh job (profiling
included: the profile cache is cleared between seeds) run by the same operator process.
"""

from __future__ import annotations

import asyncio

import pytest
from kube_emulator import ApiEmulator
from kube_faults import Faults
from kube_fixtures import job_body
from kubelet import apply_job, call, finish_profilers, job_status, pods, set_pod, wait_for
from operator_harness import (  # noqa: F401 (fixtures)
    NS,
    SMALL,
    events,
    start_operator_fixture,
    wait_phase,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]
SEEDS = range(20)
WRITE_ERROR_FRACTION = 0.10
WATCH_DROP_SECONDS = 1.0


async def _clear_profile_cache(api: ApiEmulator) -> None:
    for cm in api.list_objects("configmaps", NS):
        if cm["metadata"].get("labels", {}).get("cephalo.dev/profile") == "true":
            await call(api, "DELETE", f"/api/v1/namespaces/{NS}/configmaps/"
                       f"{cm['metadata']['name']}")


async def _kubelet(api: ApiEmulator, name: str) -> None:
    """Start every rank pod as soon as it exists, as a kubelet does: a gang is often partly
    running while the operator is still creating (or failing to create) the rest."""
    while True:
        for pod in pods(api, NS, "trainer", name):
            if ((pod.get("status") or {}).get("phase") == "Pending"
                    and not pod["metadata"].get("deletionTimestamp")):
                await set_pod(api, NS, pod["metadata"]["name"], "Running")
        await asyncio.sleep(0.02)


async def test_one_job_per_seed_converges_under_write_faults_and_watch_drops(
        emulator: ApiEmulator, start_operator) -> None:
    start_operator()
    injected = 0
    for seed in SEEDS:
        emulator.faults = Faults(seed=seed, write_error_fraction=WRITE_ERROR_FRACTION,
                                 watch_drop_seconds=WATCH_DROP_SECONDS)
        name = f"soak-{seed}"
        await _clear_profile_cache(emulator)
        body = job_body(name, backoffLimit=0, **SMALL)
        await apply_job(emulator, body)
        await finish_profilers(emulator, NS, body, count=2)
        kubelet = asyncio.create_task(_kubelet(emulator, name))
        try:
            status = await wait_for(f"{name} Running (or Failed)", lambda n=name: (
                s if (s := job_status(emulator, NS, n)).get("phase") in ("Running", "Failed")
                else None))
        finally:
            kubelet.cancel()
        assert status["phase"] == "Running", (seed, status["message"])
        ranks = sorted(pods(emulator, NS, "trainer", name), key=lambda p: p["metadata"]["name"])
        for pod in ranks:
            await set_pod(emulator, NS, pod["metadata"]["name"], "Succeeded")
        status = await wait_phase(emulator, name, "Succeeded")
        assert not status.get("restarts") and not status.get("preemptions"), (seed, status)
        assert [p["metadata"]["uid"] for p in ranks] == [
            p["metadata"]["uid"] for p in sorted(pods(emulator, NS, "trainer", name),
                                                  key=lambda p: p["metadata"]["name"])]
        await wait_for("events posted", lambda n=name: any(
            r == "Succeeded" for _, r, _ in events(emulator, n)))
        assert not [r for _, r, _ in events(emulator, name) if r in (
            "GangRestart", "BackoffLimitExceeded", "Preempted")], (seed, events(emulator, name))
        assert job_status(emulator, NS, name)["phase"] == "Succeeded"
        injected += len(emulator.faults.injected)
    # No object was ever created twice (a create whose reply was lost counts as created).
    for plural in ("pods", "configmaps", "services"):
        dup = {k: n for k, n in emulator.created(plural).items() if n > 1
               and not k[1].startswith("cephalo-profile-")}  # the cache is cleared each seed
        assert not dup, f"{plural} created twice: {dup}"
    print(f"{injected} write faults injected over {len(SEEDS)} seeds")
    assert injected >= 2 * len(SEEDS), f"only {injected} faults injected: the soak proved little"
