"""Issue 39 item 10: a Succeeded job says its last step, not the last one a progress scrape
saw (a real cluster showed `Step: 28/30` and "step 27" for a finished 30-step job).

Real trainers (process_kubelet.py: `python -m cephalo.trainer` processes, CPU, gloo) under
the real kopf operator process and the API emulator. The operator cannot reach rank 0's
/metrics here (its scrape port is not the one the trainers serve on, as when a
NetworkPolicy or an authenticating sidecar is in the way), so only what rank 0 leaves when
it completes (its termination message) can tell the operator the final step, loss and
throughput; they must equal the trainer's own last progress record."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from kube_emulator import ApiEmulator
from kube_fixtures import gpu_node
from kubelet import (
    WAIT_SECONDS,
    Scheduler,
    apply_job,
    apply_nodes,
    free_port,
    job_status,
    pods,
    set_pod,
    wait_for,
)
from operator_harness import NS, events
from process_kubelet import ProcessKubelet, trainers_and_operator
from test_operator_elastic_e2e import POOL, _job, _profile

pytestmark = pytest.mark.asyncio
STEPS = 12


@pytest_asyncio.fixture(name="cluster")
async def cluster_fixture(emulator: ApiEmulator,
                          tmp_path: Path) -> AsyncIterator[tuple[ApiEmulator, ProcessKubelet]]:
    await apply_nodes(emulator, [gpu_node("a10g-0", POOL, 2, 23028)])
    Scheduler(emulator, run=False)
    # The operator scrapes a port no rank serves: the last step comes from the final message.
    async with trainers_and_operator(emulator, tmp_path, {"done"}, _profile, {
            "CEPHALO_TRAINER_METRICS_PORT": str(free_port())}) as kubelet:
        yield emulator, kubelet


async def test_a_succeeded_job_reports_its_last_step_loss_and_throughput(cluster) -> None:
    api, kubelet = cluster
    body = _job("done", STEPS)
    await apply_job(api, body)
    profiler = await wait_for("the profiler pod", lambda: pods(api, NS, "profiler", "done"))
    await set_pod(api, NS, profiler[0]["metadata"]["name"], "Succeeded",
                  message=_profile(profiler[0], body))
    status = await wait_for("Succeeded", lambda: (
        s if (s := job_status(api, NS, "done")).get("phase") in ("Succeeded", "Failed")
        else None), WAIT_SECONDS * 2)
    assert status["phase"] == "Succeeded", status.get("message")
    assert status["plan"]["worldSize"] == 2
    [records] = [[json.loads(line) for line in f.read_text().splitlines()]
                 for f in kubelet.metrics_files("done")]
    last = records[-1]  # the trainer's own record of its last step
    assert last["step"] == STEPS
    progress = status.get("progress") or {}
    assert (progress.get("step"), progress.get("totalSteps")) == (STEPS, STEPS), status
    assert progress["loss"] == pytest.approx(last["loss"], rel=1e-6)
    assert progress["samplesPerSecond"] == pytest.approx(last["samples_per_second"], rel=1e-6)
    await wait_for("the Succeeded event", lambda: any(
        r == "Succeeded" for _, r, _ in events(api, "done")))
    succeeded = next(m for _, r, m in events(api, "done") if r == "Succeeded")
    assert f"step {STEPS}/{STEPS}, loss {last['loss']:.4f}" in succeeded, succeeded
