"""Issue 28 end to end with real trainers: the kopf operator process against the API
emulator, the emulated scheduler placing pods by their GPU requests, and the process kubelet
(process_kubelet.py) running the elastic job's ranks as `python -m cephalo.trainer`
processes (CPU, gloo), one per emulated GPU.

Job b holds half of the GPUs; job a (spec.elastic) is planned on the other half. b ends; a
drains at its next step boundary (SIGTERM, checkpoint), re-plans onto all of them and
resumes from that checkpoint. The suite runs it on 4 GPUs (2 -> 4: ten trainer processes in
all); CEPHALO_ELASTIC_E2E_GPUS=8 runs the issue's 4 -> 8 (measured: see the closing notes).
Nothing beyond the last step is lost, and its losses after the resume
equal those of an uninterrupted run under the all-GPU plan to 1e-5 (the trainer's sample
order and weights do not depend on the plan). The throughput of both gangs is measured and
printed; that it rises is asserted only where every rank has a core of its own (on two
shared cores eight CPU ranks are slower than four whatever the plan)."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from kube_emulator import ApiEmulator
from kube_fixtures import gpu_node, job_body
from kubelet import (
    WAIT_SECONDS,
    ExtraPassKubelet,
    OperatorProcess,
    Scheduler,
    apply_job,
    apply_nodes,
    free_port,
    job_status,
    pods,
    profiler_sizes,
    set_pod,
    wait_for,
)
from operator_harness import NS, events, plan_of
from process_kubelet import ProcessKubelet, exited

from cephalo.api import parse_job
from cephalo.api.network import NIC_GBPS_LABEL
from cephalo.operator.rbac import allowed
from cephalo.planner import estimate_profile, lookup_gpu
from cephalo.trainer.forked import start_module, stop_all

pytestmark = pytest.mark.asyncio
POOL = "NVIDIA-A10G"
GPUS = int(os.environ.get("CEPHALO_ELASTIC_E2E_GPUS", "4"))  # even: two nodes of GPUS / 2
HALF = GPUS // 2
DILATION = float(os.environ.get("CEPHALO_ELASTIC_E2E_DILATION", "4"))
STEPS = 30
RESCALE_AFTER_STEP = 3  # b ends once a has logged this many steps on 4 GPUs
TINY = {"family": "gpt", "numLayers": 2, "hiddenSize": 64, "numHeads": 4,
        "ffnHiddenSize": 256, "vocabSize": 256, "sequenceLength": 32}
# A compute-bound profile, seconds per sample (the catalog's estimate of a tiny model is
# launch overhead only, the same for any batch, for which no planner adds GPUs): what the
# rescale decision's predictions come from.
SECONDS_PER_SAMPLE = {"block_forward_seconds": 2e-3, "block_backward_seconds": 4e-3,
                      "other_forward_seconds": 1e-3, "other_backward_seconds": 2e-3}


def _job(name: str, steps: int = STEPS, **spec: Any) -> dict[str, Any]:
    return job_body(name, model=TINY, globalBatchSize=32,
                    training={"steps": steps, "learningRate": 1e-3, "schedule": "constant",
                              "seed": 1},
                    data={"synthetic": {}},
                    planner={"chooseGpus": False, "profileMicroBatchSizes": [1, 2, 4]},
                    checkpoint={"claimName": f"ckpt-{name}", "intervalSteps": 1000}, **spec)


def _profile(pod: dict[str, Any], body: dict[str, Any]) -> str:
    """What the profiler pod prints, at its sizes (the job's, or an extra pass's)."""
    spec = parse_job(body).spec
    p = estimate_profile(lookup_gpu(POOL).name, spec.model.resolve(), spec.precision,
                         profiler_sizes(pod, body))
    p = p.model_copy(update={"source": "measured", "points": [q.model_copy(update={
        k: v * q.micro_batch_size for k, v in SECONDS_PER_SAMPLE.items()}) for q in p.points]})
    return p.to_compact_json()


class Cluster:
    def __init__(self, api: ApiEmulator, kubelet: ProcessKubelet,
                 operator: OperatorProcess) -> None:
        self.api, self.kubelet, self.operator = api, kubelet, operator


@pytest_asyncio.fixture(name="cluster")
async def cluster_fixture(emulator: ApiEmulator, tmp_path: Path) -> AsyncIterator[Cluster]:
    # A 100 Gbit/s NIC each (issue 35: at the assumed 10 Gbit/s, growing across the two
    # nodes may not pay), as elastic_harness.fast_nic.
    nodes = [gpu_node("a10g-0", POOL, HALF, 23028), gpu_node("a10g-1", POOL, HALF, 23028)]
    for node in nodes:
        node["metadata"]["labels"][NIC_GBPS_LABEL] = "100"
    await apply_nodes(emulator, [*nodes, gpu_node("cpu-0", None, 0)])
    Scheduler(emulator, run=False)
    # Time dilation 4 (emulated GPUs a quarter of this CPU's speed): steps long enough that
    # job a is still training when the operator has decided, whatever the machine's load.
    # CEPHALO_ELASTIC_E2E_DILATION sets another (session 9 on 2 cores, 4 -> 8 GPUs: 0.52x at
    # 100, 1.07x at 25 with a 4x wider model; the rise needs a core per rank).
    kubelet = ProcessKubelet(emulator, tmp_path / "kubelet", jobs={"a"},
                             metrics_port=free_port(), time_dilation=DILATION).start()
    proc = OperatorProcess(emulator.kubeconfig, tmp_path / "operator.log",
                           CEPHALO_TRAINER_METRICS_PORT=str(kubelet.metrics_port),
                           CEPHALO_PROGRESS_INTERVAL_SECONDS="0.3",
                           CEPHALO_NODE_DEBOUNCE_SECONDS="0.2").start()
    # b's plan takes microbatches above its profiled sizes: the extra pass, answered as
    # the test answers the first.
    extra_passes = ExtraPassKubelet(emulator, _profile).start()
    try:
        yield Cluster(emulator, kubelet, proc)
    finally:
        await extra_passes.stop()
        await proc.stop()
        print(kubelet.logs())
        await kubelet.stop()
        print(proc.log()[-8000:])  # shown only when the test failed
    used = emulator.rbac_rules(include_tests=False)
    missing = sorted(r for r in used if not allowed(r[0], r[1], r[2]))
    assert not missing, f"operator used permissions missing from cephalo.operator.rbac: {missing}"


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _logged(kubelet: ProcessKubelet, job: str) -> int:
    files = kubelet.metrics_files(job)
    return len(_records(files[-1])) if files else 0


def _steady_rate(records: list[dict[str, Any]]) -> float:
    """Median samples/s, the gang's first two steps (start-up, a resume) left out."""
    rates = [r["samples_per_second"] for r in records[2:]] or [
        r["samples_per_second"] for r in records]
    return float(statistics.median(rates))


async def _uninterrupted(folder: Path, job_yaml: str, plan_json: str) -> list[dict[str, Any]]:
    """The same job from step 0 under the all-GPU plan, never stopped (real trainers)."""
    from cephalo.trainer.spawn import free_port

    folder.mkdir(parents=True)
    (folder / "job.yaml").write_text(job_yaml)
    (folder / "plan.json").write_text(plan_json)
    world = json.loads(plan_json)["world_size"]
    base = {**os.environ, "OMP_NUM_THREADS": "1", "CEPHALO_NUM_THREADS": "1",
            "WORLD_SIZE": str(world), "CEPHALO_JOB": str(folder / "job.yaml"),
            "CEPHALO_PLAN": str(folder / "plan.json"),
            "CEPHALO_CHECKPOINT_DIR": str(folder / "ckpt"), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), "CEPHALO_METRICS_FILE": str(folder / "m.jsonl")}
    logs = [folder / f"rank-{r}.log" for r in range(world)]
    procs = [start_module("cephalo.trainer", [], {**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                          cwd=folder, log=logs[r]) for r in range(world)]
    try:  # eight processes on a loaded machine: once measured at 90 s for 60 steps
        codes = await asyncio.wait_for(asyncio.gather(*(exited(p) for p in procs)),
                                       WAIT_SECONDS * 4)
    finally:
        stop_all(procs)
    assert codes == [0] * world, [log.read_text()[-2000:] for log in logs]
    return _records(folder / "m.jsonl")


@pytest.mark.slow  # 10 trainer processes (16 with 8 GPUs: about 2 min on two shared cores)
async def test_job_a_grows_onto_every_gpu_when_job_b_ends(cluster: Cluster,
                                                          tmp_path: Path) -> None:
    api, kubelet = cluster.api, cluster.kubelet
    b = _job("b", 100_000, maxGpus=HALF)
    await apply_job(api, b)
    profiler = await wait_for("b's profiler", lambda: pods(api, NS, "profiler", "b"))
    await set_pod(api, NS, profiler[0]["metadata"]["name"], "Succeeded",
                  message=_profile(profiler[0], b))
    await wait_for("b Running on half the GPUs", lambda: (s := job_status(api, NS, "b")).get(
        "phase") == "Running" and s["plan"]["worldSize"] == HALF)
    # a: the same model, so b's cached profile serves it (no profiler pod while b runs)
    # No assumed restart cost: what is tested is the rescale, not the decision's arithmetic
    # (unit-tested). With 1 s, an idle machine's fast steps saved 0.8 s over the remaining
    # steps and job a rightly skipped (session 9); a loaded one's saved more.
    await apply_job(api, _job("a", elastic={"enabled": True, "restartCostSeconds": 0.0}))
    status = await wait_for("a Running on the other half", lambda: (
        s if (s := job_status(api, NS, "a")).get("phase") == "Running" else None))
    assert status["plan"]["worldSize"] == HALF
    await wait_for(f"a at step {RESCALE_AFTER_STEP}", lambda: _logged(
        kubelet, "a") >= RESCALE_AFTER_STEP and (job_status(api, NS, "a").get(
            "progress") or {}).get("step"))

    b_ended = time.monotonic()
    b_ended_wall = time.time()
    for pod in pods(api, NS, "trainer", "b"):  # b's ranks complete: b Succeeded
        await set_pod(api, NS, pod["metadata"]["name"], "Succeeded")
    try:
        await wait_for("the Rescaled event", lambda: any(
            r == "Rescaled" for _, r, _ in events(api, "a")))
    except AssertionError as err:  # say what the operator decided instead
        raise AssertionError(f"{err}; a's status: {job_status(api, NS, 'a')}") from None
    decided = time.monotonic() - b_ended
    status = await wait_for("a Succeeded", lambda: (
        s if (s := job_status(api, NS, "a")).get("phase") in ("Succeeded", "Failed")
        else None), WAIT_SECONDS * 2)
    assert status["phase"] == "Succeeded", status.get("message")
    assert status["plan"]["worldSize"] == GPUS and plan_of(api, "a").world_size == GPUS
    elastic = status["elastic"]
    decision = elastic["lastDecision"]
    assert elastic["rescales"] == 1 and decision["verdict"] == "Rescale"
    assert (decision["currentGpus"], decision["candidateGpus"]) == (HALF, GPUS)
    assert not status.get("restarts") and not status.get("preemptions")  # a rescale only

    # Two gangs, one progress file each; the second starts right after the first's last
    # step (its SIGTERM checkpoint): nothing beyond the last step was lost.
    first, second = (_records(f) for f in kubelet.metrics_files("a"))
    resume = first[-1]["step"]
    assert second[0]["step"] == resume + 1 and second[-1]["step"] == STEPS
    assert ("a-rank-0", 143) in kubelet.exits  # the drain: SIGTERM, checkpoint, exit 143
    first_step_seconds = second[0]["time"] - b_ended_wall
    restart = elastic["restartSeconds"][-1]

    cm = next(c for c in api.list_objects("configmaps", NS) if c["metadata"]["name"] == "a-plan")
    reference = await _uninterrupted(tmp_path / "reference", cm["data"]["job.yaml"],
                                     cm["data"]["plan.json"])
    expected = {r["step"]: r["loss"] for r in reference}
    worst = max(abs(r["loss"] - expected[r["step"]]) for r in second)
    assert worst <= 1e-5, [(r["step"], r["loss"], expected[r["step"]]) for r in second]

    before, after = _steady_rate(first), _steady_rate(second)
    predicted = decision["candidateSamplesPerSecond"] / decision["currentSamplesPerSecond"]
    print(f"elastic e2e: Rescaled event {decided:.1f} s after b ended; the {GPUS}-GPU gang's "
          f"first step {first_step_seconds:.1f} s after; measured restart "
          f"{restart:.1f} s (drain to first step); resumed after step {resume}; losses after "
          f"it within {worst:.1e} of the uninterrupted {GPUS}-GPU run; throughput {before:.1f} -> "
          f"{after:.1f} samples/s measured ({after / before:.2f}x), {predicted:.2f}x "
          f"predicted; {os.cpu_count()} CPUs")
    if (os.cpu_count() or 1) >= 16:  # a core per rank and to spare
        assert after > before * (1 + 0.5 * (predicted - 1)), (before, after, predicted)
