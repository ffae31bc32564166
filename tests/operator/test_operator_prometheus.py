"""A real Prometheus judges the Grafana dashboard and loads the alerting rules (issue 38).

The kopf operator process runs against the API emulator; the process kubelet runs the rank
pods of a two-GPU job (an L4 and an A10G, so the ranks differ by gpu_product) as real
`python -m cephalo.trainer` processes, every rank serving /metrics as a rank pod does. A real
Prometheus (tests/prometheus_server.py) scrapes the operator and every rank with the
relabelings of the chart's PodMonitor, and loads the chart's rules file. Then every panel
query and variable of the dashboard, and every rule, is checked as tests/dashboard_checks.py
says (tests/realk8s/test_operator_prometheus.py does the same under the real control plane).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from kube_emulator import ApiEmulator
from kube_fixtures import gpu_node, job_body
from kubelet import (
    ExtraPassKubelet,
    OperatorProcess,
    Scheduler,
    apply_job,
    apply_nodes,
    finish_profilers,
    job_status,
    pods,
    wait_for,
)
from operator_harness import NS
from process_kubelet import ProcessKubelet

from cephalo.api.replan import ReplanSpec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "chart"))
from chart_helpers import one, render  # noqa: E402 (after the path insert)
from dashboard_picture import PanelData, draw  # noqa: E402

from tests.dashboard_checks import (  # noqa: E402
    DASHBOARD,
    EMPTY_HERE,
    RULES,
    as_sent,
    check_panels,
    check_rules,
    check_variables,
    wait_for_panel_data,
)
from tests.ports import free_listen_ports  # noqa: E402
from tests.prometheus_server import (  # noqa: E402
    OPERATOR_JOB,
    PROMETHEUS,
    PrometheusServer,
    pod_target,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.slow, pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus not on PATH (Debian: apt-get install prometheus)")]
JOB = "tiny"
TINY = {"family": "gpt", "numLayers": 2, "hiddenSize": 64, "numHeads": 4,
        "ffnHiddenSize": 256, "vocabSize": 256, "sequenceLength": 32}


class Stack:
    def __init__(self, api: ApiEmulator, kubelet: ProcessKubelet, operator: OperatorProcess,
                 prometheus: PrometheusServer) -> None:
        self.api, self.kubelet, self.operator, self.prometheus = api, kubelet, operator, prometheus


async def _discover(api: ApiEmulator, kubelet: ProcessKubelet,
                    prometheus: PrometheusServer) -> None:
    """Pod discovery: the running trainer pods serving /metrics, as file_sd targets."""
    while True:
        served = kubelet.served
        prometheus.set_targets([pod_target(p, f"127.0.0.1:{served[p['metadata']['name']]}")
                                for p in pods(api, NS, "trainer", JOB)
                                if p["metadata"]["name"] in served])
        await asyncio.sleep(0.2)


@pytest_asyncio.fixture(name="stack")
async def stack_fixture(emulator: ApiEmulator, tmp_path: Path,
                        extra_passes: ExtraPassKubelet) -> AsyncIterator[Stack]:
    podmonitor = one(render({"metrics": {"podMonitor": {"enabled": True}}}), "PodMonitor")
    # Prometheus, the operator, rank 0, rank 1: ports polled before anything listens there,
    # so below the ephemeral range (tests/ports.py), and consecutive (never the same twice).
    base = free_listen_ports(4)
    kubelet = ProcessKubelet(emulator, tmp_path / "kubelet", jobs={JOB},
                             metrics_port=base + 2, every_rank_metrics=True).start()
    operator = OperatorProcess(emulator.kubeconfig, tmp_path / "operator.log",
                               CEPHALO_TRAINER_METRICS_PORT=str(kubelet.metrics_port),
                               CEPHALO_PROGRESS_INTERVAL_SECONDS="0.3",
                               CEPHALO_OPERATOR_METRICS_PORT=str(base + 1))
    operator.metrics_port = base + 1
    prometheus = PrometheusServer(tmp_path / "prometheus", base, operator.metrics_port,
                                  podmonitor, [RULES]).start()
    discovery = asyncio.get_running_loop().create_task(_discover(emulator, kubelet, prometheus))
    try:
        await prometheus.ready()
        operator.start()
        yield Stack(emulator, kubelet, operator, prometheus)
    finally:
        discovery.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await discovery
        await operator.stop()
        await kubelet.stop()
        await prometheus.stop()
        print(kubelet.logs(), operator.log()[-4000:], prometheus.log_tail())  # on failure


async def test_every_dashboard_panel_has_data_and_every_rule_loads(stack: Stack) -> None:
    api, prometheus = stack.api, stack.prometheus
    started = time.time()
    # The operator is scraped before the job exists: its histograms' first observations
    # (planning, profiling) are then increases rate() can see.
    await prometheus.wait_result(f'up{{job="{OPERATOR_JOB}"}} == 1')
    await apply_nodes(api, [gpu_node("l4-0", "NVIDIA-L4", 1, 23034),
                            gpu_node("a10g-0", "NVIDIA-A10G", 1, 23028),
                            gpu_node("cpu-0", None, 0)])
    Scheduler(api, run=False)
    body = job_body(JOB, model=TINY, globalBatchSize=8,
                    gpuPools=[{"product": "L4"}, {"product": "A10G"}],
                    training={"steps": 100_000, "learningRate": 1e-3, "schedule": "constant",
                              "evalIntervalSteps": 2, "evalSamples": 4},
                    data={"synthetic": {}},
                    planner={"chooseGpus": False, "profileMicroBatchSizes": [1, 2]},
                    checkpoint={"claimName": "ckpt", "intervalSteps": 100_000})
    await apply_job(api, body)
    # Profiling takes minutes on a cluster: Prometheus sees each product's series at 0 before
    # its profiler finishes. Here they finish at once, so wait for that scrape first.
    await wait_for("two profiler pods", lambda: len(pods(api, NS, "profiler", JOB)) == 2)
    await prometheus.wait_result(
        "count(cephalo_operator_profiling_duration_seconds_count == 0) == 2")
    await finish_profilers(api, NS, body, count=2)
    await wait_for("Running on both GPUs", lambda: (s := job_status(api, NS, JOB)).get(
        "phase") == "Running" and s["plan"]["worldSize"] == 2)

    await wait_for_panel_data(prometheus, NS, JOB, started)
    # Regression (a CI run): these ranks run on the CPU, not the GPUs their plan predicts, so
    # a calibration may re-plan; a re-planned gang that measures no gain stops re-planning,
    # and maxReplans bounds them all. It re-planned every ~5 s instead, restarting the ranks
    # each time. (Not "at most once": at load 8 a first re-plan measured at least the 10 %
    # minGain on these CPU ranks, so a second one was right to follow.)
    kept = await wait_for("a calibration that keeps the plan", lambda: (
        r if ((r := job_status(api, NS, JOB).get("replan") or {}).get("lastCalibration")
              or {}).get("verdict") == "Keep" else None))
    assert int(kept.get("replans") or 0) <= ReplanSpec().max_replans, kept
    with_data, total = await check_panels(prometheus, NS, JOB, started, time.time())
    print(f"real Prometheus: {with_data} of {total} panel queries returned series; "
          f"empty by design: {sorted(EMPTY_HERE)}")
    await check_variables(prometheus, NS, JOB)

    if os.environ.get("CEPHALO_DASHBOARD_PICTURE"):  # docs: what a user sees (not a check)
        await asyncio.sleep(float(os.environ.get("CEPHALO_DASHBOARD_PICTURE_SECONDS", "0")))
        await _picture(prometheus, started, Path(os.environ["CEPHALO_DASHBOARD_PICTURE"]))
    await check_rules(prometheus)


async def _picture(prometheus: PrometheusServer, start: float, path: Path) -> None:
    board = json.loads(DASHBOARD.read_text())
    end = time.time()
    panels: PanelData = []
    for panel in board["panels"]:
        targets = []
        for target in panel.get("targets", []):
            series = await prometheus.query_range(as_sent(target["expr"], NS, JOB), start,
                                                   end)
            targets.append((target.get("legendFormat", ""),
                            [(s["metric"], s["values"]) for s in series]))
        panels.append((panel, targets))
    draw(panels, f"{board['title']}: CephaloJob {NS}/{JOB} (an L4 and an A10G rank, run on "
         "the CPU), from a real Prometheus (tests/operator/test_operator_prometheus.py)", path)
