"""A real Prometheus judges the Grafana dashboard and loads the alerting rules under the real
control plane (issue 38).

The session's operator (kopf, authenticated as the chart's ServiceAccount, so the chart's
RBAC decides its requests) runs a two-GPU job in a namespace of its own: real profiler pods,
then two rank pods the real scheduler puts one on each GPU node (an RTX-A6000 and a P40, so
the ranks differ by gpu_product), real trainer processes started by the process kubelet,
each serving /metrics on its own pod IP. A real Prometheus (tests/prometheus_server.py)
scrapes the operator's /metrics as the chart's ServiceMonitor would and every pod of the
namespace as Kubernetes pod discovery lists it (read from the real API server: pod IP, the
container port named `metrics`, labels) through the chart PodMonitor's relabelings; it loads
the chart's rules file. Then every panel query and variable of the dashboard, and every
rule, is checked as tests/dashboard_checks.py says.

`CEPHALO_DASHBOARD_PICTURE=PATH` (and `CEPHALO_DASHBOARD_PICTURE_SECONDS`, more seconds of
data first) also draws every panel from Prometheus's answers into PATH: docs/dashboard.png.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import urllib3

from cephalo.planner.cost.catalog import gpu_key
from tests import dashboard_checks as checks
from tests.chart.chart_helpers import one, render
from tests.dashboard_picture import PanelData, draw
from tests.ports import free_listen_ports
from tests.prometheus_server import OPERATOR_JOB, PROMETHEUS, PrometheusServer, discovered_target

from .cluster import NODES, Cluster
from .operator_run import JOB_SECONDS, JOBS, Operator, make_claim, tiny_job
from .rest import Rest, wait_until

pytestmark = [pytest.mark.asyncio, pytest.mark.slow, pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus not on PATH (Debian: apt-get install prometheus)")]
JOB = "watched"
PROFILED = "cephalo_operator_profiling_duration_seconds_count"  # the operator's, per product


class PodDiscovery:
    """Kubernetes pod discovery for one namespace, stood in for by a thread: every pod the
    real API server lists there, as file_sd targets (the PodMonitor's relabelings keep the
    trainer ranks)."""

    def __init__(self, rest: Rest, ns: str, prometheus: PrometheusServer) -> None:
        self.rest, self.ns, self.prometheus = rest, ns, prometheus
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pod-discovery", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.3):
            try:
                listing = self.rest.get(f"/api/v1/namespaces/{self.ns}/pods")
            except (urllib3.exceptions.HTTPError, OSError):
                continue
            if listing.ok:
                self.prometheus.set_targets([t for p in listing.body["items"]
                                             if (t := discovered_target(p)) is not None])

    def __enter__(self) -> PodDiscovery:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest_asyncio.fixture(name="prometheus")
async def prometheus_fixture(operator: Operator, tmp_path: Path,
                             on_failure: Any) -> AsyncIterator[PrometheusServer]:
    podmonitor = one(render({"metrics": {"podMonitor": {"enabled": True}}}), "PodMonitor")
    prometheus = PrometheusServer(tmp_path / "prometheus", free_listen_ports(1),
                                  operator.metrics_port, podmonitor, [checks.RULES]).start()
    on_failure(prometheus.log_tail)
    try:
        await prometheus.ready()
        yield prometheus
    finally:
        await prometheus.stop()


def _status(cluster: Cluster, ns: str) -> dict[str, Any]:
    return cluster.rest.get(f"{JOBS.format(ns=ns)}/{JOB}").body.get("status") or {}


async def test_every_dashboard_panel_has_data_and_every_rule_loads(
        cluster: Cluster, operator: Operator, prometheus: PrometheusServer) -> None:
    started, log_from = time.time(), operator.log_size()
    # A namespace of its own: no cached GPU profile, so this job profiles both products.
    ns = cluster.namespace("prom")
    make_claim(cluster, ns, "ckpt")
    await prometheus.wait_result(f'up{{job="{OPERATOR_JOB}"}} == 1')
    # Profiled so far, per product (the session's operator may have profiled these products
    # for an earlier test; a fresh one has no series yet).
    before = {s["metric"]["product"]: float(s["value"][1])
              for s in await prometheus.query(PROFILED)}
    # A product's profiling histogram starts at 0 when its profiler pod is created; held
    # here until Prometheus has scraped that 0, so rate() sees the observation that follows
    # (profiling takes minutes on a cluster; here a profiler might finish within a scrape).
    cluster.kubelet.hold(lambda pod: pod["metadata"]["namespace"] == ns and (
        pod["metadata"].get("labels") or {}).get("cephalo.dev/role") == "profiler")
    try:
        body = tiny_job(JOB, ns, training={
            "steps": 1_000_000, "learningRate": 1e-3, "schedule": "constant", "seed": 1,
            "evalIntervalSteps": 2, "evalSamples": 4})
        body["spec"]["checkpoint"]["intervalSteps"] = 1_000_000
        # Calibrate and report, never re-plan: these ranks run on the CPU, not the GPUs
        # their plan predicts, so a calibration may re-plan (a rescale: both trainer
        # processes started again, tens of seconds here) and a lucky measured gain may
        # re-plan again (the default allows 3). Re-planning is tested on the emulator and
        # rescaling under this control plane (test_operator_elastic.py); the panels it
        # feeds read the same here either way.
        body["spec"]["planner"]["replan"] = {"maxReplans": 0}
        cluster.rest.create(JOBS.format(ns=ns), body, fieldValidation="Strict")
        wait_until("both profiler pods held", lambda: len(cluster.kubelet.held()) == len(NODES),
                   JOB_SECONDS)
        # Each product's series is there, its profiler not counted yet (at 0 on a fresh
        # operator), before its profiler finishes.
        for product in sorted({gpu_key(node.product) for node in NODES}):
            await prometheus.wait_result(
                f'{PROFILED}{{product="{product}"}} == {before.get(product, 0.0):g}')
        cluster.kubelet.release()
        with PodDiscovery(cluster.plane.admin(), ns, prometheus):
            await _judge(cluster, ns, prometheus, started)
        # The chart's RBAC sufficed: the real authorizer refused the operator nothing.
        assert "forbidden" not in operator.log_text(log_from).lower(), operator.log()
    finally:
        cluster.kubelet.release()
        # The GPUs go back to the session's other tests: the job and its pods gone.
        cluster.rest.request("DELETE", f"{JOBS.format(ns=ns)}/{JOB}")
        wait_until("the job's pods gone", lambda: not cluster.rest.must(
            "GET", f"/api/v1/namespaces/{ns}/pods")["items"], JOB_SECONDS)


async def _judge(cluster: Cluster, ns: str, prometheus: PrometheusServer,
                 started: float) -> None:
    wait_until("Running on both GPUs", lambda: (s := _status(cluster, ns)).get(
        "phase") == "Running" and (s.get("plan") or {}).get("worldSize") == 2, JOB_SECONDS)
    await checks.wait_for_panel_data(prometheus, ns, JOB, started, JOB_SECONDS)
    # Judged once the operator has calibrated the plan on the measured steps and kept it
    # (maxReplans 0), as the emulator test is.
    kept = wait_until("a calibration that keeps the plan", lambda: (
        r if ((r := _status(cluster, ns).get("replan") or {}).get("lastCalibration")
              or {}).get("verdict") == "Keep" else None), JOB_SECONDS)
    # maxReplans bounds re-planning: with 0, the calibration keeps the plan for that reason.
    assert not kept.get("replans") and kept["lastCalibration"]["reasonCode"] == "ReplanLimit", \
        kept
    with_data, total = await checks.check_panels(prometheus, ns, JOB, started, time.time())
    print(f"real Prometheus under the real control plane: {with_data} of {total} panel "
          f"queries returned series; empty by design: {sorted(checks.EMPTY_HERE)}")
    await checks.check_variables(prometheus, ns, JOB)
    if os.environ.get("CEPHALO_DASHBOARD_PICTURE"):  # docs: what a user sees (not a check)
        await asyncio.sleep(float(os.environ.get("CEPHALO_DASHBOARD_PICTURE_SECONDS", "0")))
        await _picture(prometheus, ns, started, Path(os.environ["CEPHALO_DASHBOARD_PICTURE"]))
    await checks.check_rules(prometheus)


async def _picture(prometheus: PrometheusServer, ns: str, start: float, path: Path) -> None:
    board = json.loads(checks.DASHBOARD.read_text())
    end = time.time()
    panels: PanelData = []
    for panel in board["panels"]:
        targets = []
        for target in panel.get("targets", []):
            series = await prometheus.query_range(checks.as_sent(target["expr"], ns, JOB),
                                                  start, end)
            targets.append((target.get("legendFormat", ""),
                            [(s["metric"], s["values"]) for s in series]))
        panels.append((panel, targets))
    draw(panels, f"{board['title']}: CephaloJob {ns}/{JOB} (an RTX-A6000 and a P40 rank, run "
         "on the CPU), from a real Prometheus under the real control plane "
         "(tests/realk8s/test_operator_prometheus.py)", path)
