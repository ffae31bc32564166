"""Load benchmark: N CephaloJobs applied at once against the real operator process.

The operator (`kopf run -m cephalo.operator`) talks HTTP to the test API emulator; a fake
kubelet in this process lets profiler pods finish with a real (catalog) profile and rank
pods run, then succeed. Reports the time until every job Succeeded, the operator's
reconcile rate, its resident memory and API request counts, and checks that no object was
created twice. Not part of the unit suite.

    .venv/bin/python bench/operator_load.py --jobs 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import kmock
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "operator"))

from conftest import write_kubeconfig
from kube_emulator import ApiEmulator
from kube_fixtures import cluster_a, job_body
from kubelet import OperatorProcess, apply_job, apply_nodes, pod_status, real_profile_json

from cephalo.api import API_GROUP, API_VERSION, KIND, PLURAL

RUN_SECONDS = 1.0  # how long a fake rank "trains" before it succeeds


async def kubelet(api: ApiEmulator, bodies: dict[str, dict], stop: asyncio.Event) -> None:
    """Pending profiler → Succeeded with a profile; Pending rank → Running → Succeeded."""
    running_since: dict[str, float] = {}
    while not stop.is_set():
        for (_, plural, ns, name), pod in list(api._store.items()):
            if plural != "pods":
                continue
            labels = pod["metadata"].get("labels") or {}
            phase = (pod.get("status") or {}).get("phase")
            uid = pod["metadata"]["uid"]
            if labels.get("cephalo.dev/role") == "profiler" and phase == "Pending":
                body = bodies[labels["cephalo.dev/job"]]
                status = pod_status("Succeeded", message=real_profile_json(pod, body))
            elif labels.get("cephalo.dev/role") == "trainer" and phase == "Pending":
                running_since[uid] = time.monotonic()
                status = pod_status("Running")
            elif (labels.get("cephalo.dev/role") == "trainer" and phase == "Running"
                  and time.monotonic() - running_since.get(uid, 0) > RUN_SECONDS):
                status = pod_status("Succeeded")
            else:
                continue
            async with api.patch(f"/api/v1/namespaces/{ns}/pods/{name}/status",
                                 data=json.dumps({"status": status}),
                                 headers={"Content-Type": "application/merge-patch+json"}):
                pass
        await asyncio.sleep(0.1)


def phases(api: ApiEmulator) -> dict[str, int]:
    counts: dict[str, int] = {}
    for job in api.list_objects(PLURAL, group=API_GROUP):
        phase = (job.get("status") or {}).get("phase") or "(none)"
        counts[phase] = counts.get(phase, 0) + 1
    return counts


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())


async def main(num_jobs: int, timeout_seconds: float) -> dict:
    async with ApiEmulator() as api, kmock.Server(api) as server:
        api.add_resource(API_GROUP, API_VERSION, PLURAL, KIND)
        tmp = Path(tempfile.mkdtemp(prefix="cephalo-load-"))
        kubeconfig = write_kubeconfig(tmp / "kubeconfig", str(server.url).rstrip("/"))
        await apply_nodes(api, cluster_a())
        proc = OperatorProcess(kubeconfig, tmp / "operator.log",
                               CEPHALO_RECHECK_SECONDS="2").start()
        bodies = {f"job-{i:03d}": job_body(f"job-{i:03d}", namespace=f"team-{i % 4}")
                  for i in range(num_jobs)}
        stop = asyncio.Event()
        fake = asyncio.create_task(kubelet(api, bodies, stop))
        await asyncio.sleep(2.0)  # operator start-up is not what we measure
        started = time.monotonic()
        await asyncio.gather(*(apply_job(api, b) for b in bodies.values()))
        done = False
        while time.monotonic() - started < timeout_seconds:
            if phases(api).get("Succeeded", 0) == num_jobs:
                done = True
                break
            await asyncio.sleep(0.2)
        elapsed = time.monotonic() - started
        async with aiohttp.ClientSession() as http, http.get(
                f"http://127.0.0.1:{proc.metrics_port}/metrics") as resp:
            text = await resp.text()
        stop.set()
        await fake
        await proc.stop()
        duplicates = {plural: sum(1 for n in api.created(plural).values() if n > 1)
                      for plural in ("pods", "configmaps", "services")}
        reconciles = metric(text, "cephalo_operator_reconciles_total")
        return {
            "jobs": num_jobs, "all_succeeded": done, "phases": phases(api),
            "seconds_to_all_succeeded": round(elapsed, 2),
            "reconciles": int(reconciles),
            "reconciles_per_second": round(reconciles / elapsed, 1),
            "reconcile_errors": int(metric(text, "cephalo_operator_reconciles_total",
                                           outcome="error")),
            "mean_reconcile_seconds": round(
                metric(text, "cephalo_operator_reconcile_duration_seconds_sum")
                / max(1.0, metric(text, "cephalo_operator_reconcile_duration_seconds_count")), 4),
            "operator_rss_mib": round(metric(text, "process_resident_memory_bytes") / 2**20, 1),
            "api_requests": len(api.calls),
            "objects_created_twice": duplicates,
            "operator_log": str(tmp / "operator.log"),
        }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.jobs, args.timeout)), indent=2))
