"""A whole emulated cluster for the client and CLI tests (and `scripts/demo-cluster.sh`):
the API emulator, the real operator process, and `TrainingSim`, which plays the kubelet and
the trainer for the operator's pods.

`TrainingSim` drives pods only through the emulator's HTTP API, as a kubelet would:
* a profiler pod logs a few lines and succeeds with a GpuProfile as its termination message:
  the catalog's estimate with its block times scaled by `speed[product]` (so a cached
  profile differs from what the planner would estimate without it);
* a pod with scheduling gates (Kueue's admission gate) is left alone, as no kubelet sees it;
* a rank pod starts (Running), logs what it runs, and while every rank of its job runs, the
  job advances `steps_per_tick` steps a tick; rank 0's `/metrics` (the page the operator
  scrapes, on 127.0.0.1) serves step, loss and samples/s; at the last step every rank
  succeeds, once the operator has scraped that step (a real trainer does not wait: here it
  keeps the tests' verdicts off the scrape interval); `hold_at` stops a job at a step until
  the test lets it go on. `fail_at`: {(job, attempt): (rank,
  step)} fails that rank there (exit code 1), so the operator restarts the gang; the next
  attempt resumes from the last multiple of `checkpoint_steps`;
* `netprobe_gbps`: a network probe's pods succeed at once, rank 0 with a two-rank fit of
  that rate (None: they are left alone, as without the operator's probe);
* `scheduled_only`: a pod starts only once a scheduler (kubelet.Scheduler with run=False)
  has bound it to a node with room for its GPUs, so pods compete for GPUs as on a cluster.

Run standalone (`python tests/operator/cluster_sim.py --kubeconfig FILE`) it serves until
interrupted: point KUBECONFIG at FILE and use `cephalo submit … --watch`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # run as a script too

import kmock
from aiohttp import web
from kube_emulator import ApiEmulator
from kube_fixtures import cluster_a
from kubelet import (
    OperatorProcess,
    apply_nodes,
    cancel_task,
    free_port,
    probe_fit_json,
    real_profile,
    set_pod,
    stored_job,
)

from cephalo.api import API_GROUP, API_VERSION, KIND, PLURAL, parse_job

ROLE, JOB, RANK, ATTEMPT = ("cephalo.dev/role", "cephalo.dev/job", "cephalo.dev/rank",
                            "cephalo.dev/attempt")


@dataclass
class JobRun:
    step: int = 0
    attempt: int = -1
    samples_per_second: float = 0.0
    scraped_step: int = -1  # the step rank 0's /metrics last served to the operator


@dataclass
class TrainingSim:
    api: ApiEmulator
    steps_per_tick: int = 2
    tick_seconds: float = 0.1
    checkpoint_steps: int = 10
    speed: dict[str, float] = field(default_factory=lambda: {"NVIDIA-L4": 0.6})
    fail_at: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    # A profiler pod runs until a client has read its log (a condition, not a race with the
    # operator deleting it once planned): the log tests set it.
    hold_profilers_until_read: bool = False
    # Jobs whose ranks run (hold their GPUs) but never step: another workload the test ends.
    idle_jobs: set[str] = field(default_factory=set)
    # Jobs the test holds still: each steps up to its step here (0: where it is), then its
    # ranks keep running without stepping until the test removes it, so a short job cannot
    # finish before the operator has done what the test waits for, however slow the machine.
    hold_at: dict[str, int] = field(default_factory=dict)
    netprobe_gbps: float | None = None
    scheduled_only: bool = False
    metrics_port: int = field(default_factory=free_port)
    runs: dict[str, JobRun] = field(default_factory=dict)
    _latest: str | None = None
    _task: asyncio.Task[None] | None = None
    _runner: web.AppRunner | None = None

    async def start(self) -> TrainingSim:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.metrics_port).start()
        self._task = asyncio.create_task(self._loop())
        return self

    async def stop(self) -> None:
        await cancel_task(self._task)
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        run = self.runs.get(self._latest or "")
        if run is None:
            return web.Response(status=503, text="not training yet\n")
        run.scraped_step = run.step
        loss = 5.5 * math.exp(-run.step / 40) + 1.0
        text = (f'cephalo_step{{rank="0"}} {run.step}\ncephalo_loss{{rank="0"}} {loss:.4f}\n'
                f'cephalo_samples_per_second{{rank="0"}} {run.samples_per_second:.2f}\n')
        return web.Response(text=text)

    def _pods(self) -> list[dict[str, Any]]:
        return [p for (g, plural, _, _), p in list(self.api._store.items())
                if (g, plural) == ("", "pods") and ROLE in (p["metadata"].get("labels") or {})
                and not p["metadata"].get("deletionTimestamp")]

    async def _loop(self) -> None:
        while True:
            # a pod that went between reading and writing it: the next tick sees why
            with contextlib.suppress(AssertionError):
                await self._tick()
            await asyncio.sleep(self.tick_seconds)

    async def _tick(self) -> None:
        gangs: dict[str, list[dict[str, Any]]] = {}
        for pod in self._pods():
            labels, ns, name = pod["metadata"]["labels"], pod["metadata"]["namespace"], \
                pod["metadata"]["name"]
            phase = (pod.get("status") or {}).get("phase")
            if (pod.get("spec") or {}).get("schedulingGates"):
                continue  # no kubelet runs a gated pod: the scheduler does not place it
            if self.scheduled_only and not (pod.get("spec") or {}).get("nodeName"):
                continue  # not bound to a node (yet): no kubelet runs it
            if labels[ROLE] == "netprobe" and phase == "Pending" and \
                    self.netprobe_gbps is not None:
                first = name.endswith("-0")  # rank 0 reports the fit, its peer nothing
                await set_pod(self.api, ns, name, "Succeeded",
                              message=probe_fit_json(self.netprobe_gbps) if first else "")
                continue
            if labels[ROLE] == "profiler" and phase == "Pending":
                await set_pod(self.api, ns, name, "Running")
                self.api.write_log(ns, name, f"profiling {pod['spec']['nodeSelector']}")
            elif labels[ROLE] == "profiler" and phase == "Running" and (
                    not self.hold_profilers_until_read or self._log_read(ns, name)):
                await self._profile(pod)
            elif labels[ROLE] == "trainer" and phase == "Pending":
                await set_pod(self.api, ns, name, "Running")
                self.api.write_log(ns, name, f"rank {labels[RANK]}: attempt {labels[ATTEMPT]} "
                                   f"started on {pod['spec']['nodeSelector']}")
            elif labels[ROLE] == "trainer" and phase == "Running":
                gangs.setdefault(f"{ns}/{labels[JOB]}", []).append(pod)
        for key, ranks in gangs.items():
            await self._train(key, ranks)

    async def _profile(self, pod: dict[str, Any]) -> None:
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        product = pod["spec"]["nodeSelector"]["nvidia.com/gpu.product"]
        # the product's first pass or an extra one (--micro-batch-sizes) alike
        profile = real_profile(pod, self._job(ns, pod["metadata"]["labels"][JOB]))
        factor = self.speed.get(product, 1.0)
        profile = profile.model_copy(update={"points": [
            p.model_copy(update={"block_forward_seconds": p.block_forward_seconds * factor,
                                 "block_backward_seconds": p.block_backward_seconds * factor})
            for p in profile.points]})
        self.api.write_log(ns, name, f"profiling {product}: microbatch sizes "
                           f"{[p.micro_batch_size for p in profile.points]}\n"
                           f"profile written ({len(profile.points)} points)")
        await set_pod(self.api, ns, name, "Succeeded", message=profile.to_compact_json())

    def _log_read(self, ns: str, name: str) -> bool:
        return any(c.resource == "pods/log" and c.namespace == ns and c.name == name
                   for c in self.api.calls)

    def _job(self, ns: str, name: str) -> dict[str, Any]:
        job = stored_job(self.api, ns, name)
        if job is None:
            raise KeyError(name)
        return job

    async def _train(self, key: str, ranks: list[dict[str, Any]]) -> None:
        ns, name = key.split("/", 1)
        if name in self.idle_jobs:
            return
        try:
            body = self._job(ns, name)
        except KeyError:
            return
        spec = parse_job(body).spec
        plan_cm = self.api._store.get(("", "configmaps", ns, f"{name}-plan"))
        plan = json.loads(plan_cm["data"]["plan.json"]) if plan_cm else {}
        world = plan.get("world_size", 0)
        attempts = {int(p["metadata"]["labels"][ATTEMPT]) for p in ranks}
        if len(ranks) < world or len(attempts) != 1:
            return  # not the whole gang of one attempt (yet)
        attempt = attempts.pop()
        run = self.runs.setdefault(key, JobRun())
        if attempt != run.attempt:  # a new gang: resume from the last checkpoint
            run.attempt = attempt
            run.step = run.step // self.checkpoint_steps * self.checkpoint_steps
        total = spec.training.steps
        if run.step >= total:  # done, once the operator has scraped the last step
            if run.scraped_step >= total:
                for pod in ranks:
                    self.api.write_log(ns, pod["metadata"]["name"], "training done; final "
                                       "checkpoint written")
                    await set_pod(self.api, ns, pod["metadata"]["name"], "Succeeded")
            return
        held = self.hold_at.get(name, total)
        if run.step >= held:
            return  # held there by the test
        run.step = min(total, held, run.step + self.steps_per_tick)
        # what the sim really does (global batch x steps a tick / tick), not a GPU's speed
        run.samples_per_second = spec.global_batch_size * self.steps_per_tick / self.tick_seconds
        self._latest = key
        for pod in ranks:
            rank = pod["metadata"]["labels"][RANK]
            self.api.write_log(ns, pod["metadata"]["name"],
                               f"step {run.step}/{total} loss "
                               f"{5.5 * math.exp(-run.step / 40) + 1.0:.4f} rank {rank}")
        fail = self.fail_at.get((name, attempt))
        if fail is not None and run.step >= fail[1]:
            pod = next(p for p in ranks if p["metadata"]["labels"][RANK] == str(fail[0]))
            self.api.write_log(ns, pod["metadata"]["name"], "RuntimeError: CUDA error: an "
                               "illegal memory access was encountered")
            await set_pod(self.api, ns, pod["metadata"]["name"], "Failed", exit_code=1,
                          message="RuntimeError: CUDA error: an illegal memory access")
            return


async def declare_crd(api: ApiEmulator) -> None:
    api.add_resource(API_GROUP, API_VERSION, PLURAL, KIND, shortnames=("cjob",))


def operator_env(sim: TrainingSim) -> dict[str, str]:
    """What the operator needs to scrape the sim's rank 0 (pod IP 127.0.0.1)."""
    return {"CEPHALO_TRAINER_METRICS_PORT": str(sim.metrics_port),
            "CEPHALO_PROGRESS_INTERVAL_SECONDS": "0.3"}


async def serve(kubeconfig: Path, operator_log: Path | None = None) -> None:
    from conftest import write_kubeconfig

    async with ApiEmulator() as api, kmock.Server(api) as server:
        await declare_crd(api)
        write_kubeconfig(kubeconfig, str(server.url).rstrip("/"))
        await apply_nodes(api, cluster_a())
        sim = await TrainingSim(api, tick_seconds=0.25).start()
        log = operator_log or Path(tempfile.mkdtemp(prefix="cephalo-sim-")) / "operator.log"
        operator = OperatorProcess(kubeconfig, log, **operator_env(sim)).start()
        print(f"emulated cluster ready: KUBECONFIG={kubeconfig} (operator log {log})",
              flush=True)
        stop = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):  # stop the operator with us
            asyncio.get_running_loop().add_signal_handler(signum, stop.set)
        try:
            await stop.wait()
        finally:
            await operator.stop()
            await sim.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kubeconfig", required=True, type=Path)
    parser.add_argument("--operator-log", type=Path,
                        help="the operator's log (default: in a new temporary folder, kept)")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.kubeconfig, args.operator_log))
