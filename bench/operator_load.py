"""Load benchmark: N CephaloJobs on a cluster of M GPU nodes, against the real operator process.

The operator (`kopf run -m cephalo.operator`) talks HTTP to the test API emulator; a fake
kubelet in this process lets profiler pods finish with a real (catalog) profile and holds
rank pods Running until released, then lets them succeed. Three phases, each measured from
the emulator's own record of the requests it served (not from anything the operator says):

1. jobs: every job applied at once, until all are Running. Requests per CephaloJob watch
   event (every create and status write of a job is one event the operator receives).
2. nodes: node events while every job runs: heartbeats (status), a label nobody reads,
   cordon/uncordon of a node whose pool has GPUs to spare. Requests per node event, and a
   quiet window of the same length just before for comparison. With the shared node view,
   node LISTs per node event must not grow with the number of jobs.
3. finish: ranks released; time until every job Succeeded, reconcile rate, operator RSS,
   objects created twice.

    .venv/bin/python bench/operator_load.py --jobs 200 --nodes 1000 --compare-jobs 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import kmock
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "operator"))

from conftest import write_kubeconfig
from kube_emulator import ApiEmulator
from kube_fixtures import CLUSTER_A, gpu_node, job_body
from kubelet import OperatorProcess, apply_job, apply_nodes, call, pod_status, real_profile_json

from cephalo.api import API_GROUP, API_VERSION, KIND, PLURAL

GPUS_PER_NODE = 8
NODE_EVENT_SPACING_SECONDS = 0.05  # 20 node events/s: a busy cluster's heartbeat rate
PRODUCTS = sorted({(product, mib) for _, product, _, mib in CLUSTER_A})


class Kubelet:
    """Pending profiler → Succeeded with a profile; Pending rank → Running; Running rank →
    Succeeded once `release` is set."""

    def __init__(self, api: ApiEmulator, bodies: dict[str, dict[str, Any]]) -> None:
        self.api, self.bodies = api, bodies
        self.release = asyncio.Event()
        self.stop = asyncio.Event()

    async def run(self) -> None:
        while not self.stop.is_set():
            for (_, plural, ns, name), pod in list(self.api._store.items()):
                if plural != "pods" or pod["metadata"].get("deletionTimestamp"):
                    continue
                labels = pod["metadata"].get("labels") or {}
                role, phase = labels.get("cephalo.dev/role"), (pod.get("status") or {}).get(
                    "phase")
                if role == "profiler" and phase == "Pending":
                    status = pod_status("Succeeded", message=real_profile_json(
                        pod, self.bodies[labels["cephalo.dev/job"]]))
                elif role == "trainer" and phase == "Pending":
                    status = pod_status("Running")
                elif role == "trainer" and phase == "Running" and self.release.is_set():
                    status = pod_status("Succeeded")
                else:
                    continue
                await call(self.api, "PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status",
                           {"status": status})
            await asyncio.sleep(0.1)


def cluster(num_nodes: int) -> list[dict[str, Any]]:
    """GPU nodes of the paper's Cluster A products in turn, GPUS_PER_NODE each."""
    return [gpu_node(f"node-{i:04d}", product, GPUS_PER_NODE, memory_mib)
            for i, (product, memory_mib) in ((i, PRODUCTS[i % len(PRODUCTS)])
                                             for i in range(num_nodes))]


def phases(api: ApiEmulator) -> dict[str, int]:
    return dict(Counter((j.get("status") or {}).get("phase") or "(none)"
                        for j in api.list_objects(PLURAL, group=API_GROUP)))


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())


def requests(api: ApiEmulator, since: int) -> Counter[str]:
    """The operator's requests (its client and kopf's, not this script's) since call `since`,
    as 'verb resource'."""
    return Counter(f"{c.verb} {c.resource}" for c in api.calls[since:]
                   if not c.user_agent.startswith("kmock/"))


def job_events(api: ApiEmulator, since_rv: int) -> int:
    """CephaloJob watch events since resourceVersion `since_rv` (creates and writes)."""
    return sum(1 for rv, group, plural, kind, _ in api._log
               if rv > since_rv and (group, plural) == (API_GROUP, PLURAL) and kind != "BOOKMARK")


def lists_and_watches(counts: Counter[str], per: int) -> dict[str, float]:
    return {k: round(v / max(per, 1), 3) for k, v in sorted(counts.items())
            if k.split()[0] in ("list", "watch") and v}


async def node_events(api: ApiEmulator, nodes: list[dict[str, Any]], count: int) -> None:
    for i in range(count):
        name = nodes[(i * 7919) % len(nodes)]["metadata"]["name"]  # spread over the cluster
        kind = i % 10
        if kind < 7:  # what most node events are: the kubelet's status heartbeat
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            status = {"conditions": [{"type": "Ready", "status": "True",
                                      "lastHeartbeatTime": now}]}
            await call(api, "PATCH", f"/api/v1/nodes/{name}/status", {"status": status})
        elif kind == 7:
            await call(api, "PATCH", f"/api/v1/nodes/{name}",
                       {"metadata": {"labels": {"example.com/rack": f"r{i}"}}})
        else:  # cordon (8), then uncordon (9): its pool keeps far more GPUs than jobs use
            await call(api, "PATCH", f"/api/v1/nodes/{nodes[0]['metadata']['name']}",
                       {"spec": {"unschedulable": kind == 8}})
        await asyncio.sleep(NODE_EVENT_SPACING_SECONDS)


async def settle(api: ApiEmulator, quiet_seconds: float = 2.0, limit_seconds: float = 120.0
                 ) -> float:
    """Wait until the operator has made no request for `quiet_seconds` (its backlog of
    wake-ups from the previous phase is done); returns the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < limit_seconds:
        mark = len(api.calls)
        await asyncio.sleep(quiet_seconds)
        if not requests(api, mark):
            break
    return round(time.monotonic() - started, 1)


async def wait_until(predicate: Any, timeout_seconds: float) -> bool:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.2)
    return False


async def main(num_jobs: int, num_nodes: int, num_node_events: int,
               timeout_seconds: float) -> dict[str, Any]:
    async with ApiEmulator() as api, kmock.Server(api) as server:
        api.add_resource(API_GROUP, API_VERSION, PLURAL, KIND)
        tmp = Path(tempfile.mkdtemp(prefix="cephalo-load-"))
        kubeconfig = write_kubeconfig(tmp / "kubeconfig", str(server.url).rstrip("/"))
        nodes = cluster(num_nodes)
        await apply_nodes(api, nodes)
        # No periodic passes (progress scrapes included) within the run: every request the
        # phases count was caused by an event. Real clusters add one pass per job per interval.
        proc = OperatorProcess(kubeconfig, tmp / "operator.log", CEPHALO_RECHECK_SECONDS="600",
                               CEPHALO_PROGRESS_INTERVAL_SECONDS="600",
                               CEPHALO_WATCH_TIMEOUT_SECONDS="300").start()
        bodies = {}
        for i in range(num_jobs):  # 1-4 GPUs of one product each: small plans, many jobs
            product = PRODUCTS[i % len(PRODUCTS)][0]
            bodies[f"job-{i:03d}"] = job_body(
                f"job-{i:03d}", namespace=f"team-{i % 4}",
                gpuPools=[{"product": product, "maxGpus": 1 + i % 4}])
        kubelet = Kubelet(api, bodies)
        fake = asyncio.create_task(kubelet.run())
        await asyncio.sleep(3.0)  # operator start-up (its initial LISTs) is not measured
        result: dict[str, Any] = {"jobs": num_jobs, "nodes": num_nodes}

        # 1. jobs: apply all, until every one runs
        mark, rv = len(api.calls), api._rv
        started = time.monotonic()
        await asyncio.gather(*(apply_job(api, b) for b in bodies.values()))
        running = await wait_until(lambda: phases(api).get("Running", 0) == num_jobs,
                                   timeout_seconds)
        events = job_events(api, rv)
        counts = requests(api, mark)
        result["phase_jobs"] = {
            "all_running": running, "seconds": round(time.monotonic() - started, 1),
            "job_events": events, "requests_per_job_event": round(sum(counts.values())
                                                                  / max(events, 1), 2),
            "lists_watches_per_job_event": lists_and_watches(counts, events)}

        # 2. nodes: a quiet window, then the same length of node events
        settled_after = await settle(api)
        window = num_node_events * NODE_EVENT_SPACING_SECONDS + 3.0
        mark = len(api.calls)
        await asyncio.sleep(window)
        quiet = requests(api, mark)
        mark = len(api.calls)
        await node_events(api, nodes, num_node_events)
        await asyncio.sleep(3.0)  # debounced wake-ups land
        busy = requests(api, mark)
        extra = Counter({k: busy[k] - quiet.get(k, 0) for k in busy})
        result["phase_nodes"] = {
            "settled_after_seconds": settled_after, "node_events": num_node_events,
            "node_lists": busy["list nodes"],
            "node_lists_per_node_event": round(busy["list nodes"] / num_node_events, 3),
            "requests_per_node_event": round(sum(busy.values()) / num_node_events, 2),
            "requests_per_node_event_over_quiet_window": round(
                sum(extra.values()) / num_node_events, 2),
            "lists_watches_per_node_event": lists_and_watches(busy, num_node_events),
            "quiet_window_requests": sum(quiet.values())}

        # 3. finish
        kubelet.release.set()
        done = await wait_until(lambda: phases(api).get("Succeeded", 0) == num_jobs,
                                timeout_seconds)
        elapsed = time.monotonic() - started
        async with aiohttp.ClientSession() as http, http.get(
                f"http://127.0.0.1:{proc.metrics_port}/metrics") as resp:
            text = await resp.text()
        kubelet.stop.set()
        await fake
        await proc.stop()
        reconciles = metric(text, "cephalo_operator_reconciles_total")
        result.update({
            "all_succeeded": done, "phases": phases(api),
            "seconds_to_all_succeeded": round(elapsed, 1),
            "reconciles": int(reconciles),
            "reconcile_errors": int(metric(text, "cephalo_operator_reconciles_total",
                                           outcome="error")),
            "operator_rss_mib": round(metric(text, "process_resident_memory_bytes") / 2**20, 1),
            "api_requests": len(api.calls),
            "objects_created_twice": {plural: sum(1 for n in api.created(plural).values()
                                                  if n > 1)
                                      for plural in ("pods", "configmaps", "services")},
            "operator_log": str(tmp / "operator.log")})
        return result


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [args.jobs] + ([args.compare_jobs] if args.compare_jobs else [])
    runs = [await main(jobs, args.nodes, args.node_events, args.timeout) for jobs in sizes]
    report: dict[str, Any] = {"runs": runs}
    if len(runs) == 2:
        big, small = (r["phase_nodes"]["node_lists_per_node_event"] for r in runs)
        # The claim: node LISTs per node event do not grow with jobs (O(1), not O(jobs)).
        report["node_lists_per_node_event_do_not_grow_with_jobs"] = big <= max(small, 0.05)
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--node-events", type=int, default=100)
    parser.add_argument("--compare-jobs", type=int, default=0,
                        help="run again with this many jobs and compare node-event costs")
    parser.add_argument("--timeout", type=float, default=600.0)
    print(json.dumps(asyncio.run(run_all(parser.parse_args())), indent=2))
