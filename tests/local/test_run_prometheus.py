"""A real Prometheus judges the dashboard for a local `cephalo run` (issue 38), as
docs/monitoring.md promises: rank r of `cephalo run --metrics-port PORT` serves /metrics on
PORT+r; "point a Prometheus at them with the labels the PodMonitor would give" and the
dashboard shows the run's trainer panels, the operator panels empty.

The run: two CPU ranks emulating an L4 and an A10G (so the ranks differ by gpu_product) on a
given plan (no profiling: the test stays short), trained until the checks are done, then
stopped with Ctrl-C. A real Prometheus (tests/prometheus_server.py) scrapes every rank from a
static scrape config carrying exactly the labels the docs name, with the values the chart's
PodMonitor relabelings give a rank pod of this job (applied here to the pod's discovery
labels). Then every panel query and variable is checked as tests/dashboard_checks.py says,
with the panels a local run cannot fill (EMPTY_LOCAL) checked empty.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.dashboard_checks import (
    EMPTY_LOCAL,
    check_panels,
    check_variables,
    wait_for_panel_data,
)
from tests.ports import free_listen_ports
from tests.prometheus_server import PROMETHEUS, PrometheusServer, pod_target

from .cli_helpers import REPO, cephalo_cmd, trainer_pids

sys.path.insert(0, str(REPO / "tests" / "chart"))
from chart_helpers import one, render  # (after the path insert)

pytestmark = [pytest.mark.asyncio, pytest.mark.slow, pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus not on PATH (Debian: apt-get install prometheus)")]
JOB, NS = "tiny", "default"  # the namespace `kubectl apply` would give this job
GPUS = ["L4", "A10G"]
LOCAL_JOB = "cephalo-run"  # the user's scrape job name (any)
MIN_SCRAPES = 5  # of each rank while it trains (1 s apart; the rate panels span 4 s)
JOB_YAML = f"""\
apiVersion: cephalo.dev/v1alpha1
kind: CephaloJob
metadata: {{name: {JOB}}}
spec:
  model: {{preset: gpt-tiny}}
  globalBatchSize: 6
  training: {{steps: 1000000, learningRate: 1.0e-2, seed: 3, evalIntervalSteps: 10}}
  checkpoint: {{ephemeral: true}}
"""


def promised_labels() -> list[str]:
    """The labels docs/monitoring.md tells a local run's user to give its ranks."""
    text = (REPO / "docs" / "monitoring.md").read_text()
    found = re.search(r"labels\s+the\s+PodMonitor\s+would\s+give\s+\(([^)]*)\)", text)
    assert found, "docs/monitoring.md no longer says which labels a local run needs"
    return re.findall(r"`(\w+)`", found.group(1))


def podmonitor_labels(podmonitor: dict[str, Any], pod: dict[str, Any]) -> dict[str, str]:
    """The target labels the PodMonitor's relabelings give `pod` (each a plain copy of a
    discovery label, Prometheus's default `replace`; an empty value sets no label)."""
    meta = pod_target(pod, "unused:0")["labels"]
    labels = {}
    for relabel in podmonitor["spec"]["podMetricsEndpoints"][0]["relabelings"]:
        assert set(relabel) == {"sourceLabels", "targetLabel"}, relabel  # a copy, nothing else
        value = ";".join(meta.get(s, "") for s in relabel["sourceLabels"])
        if value:
            labels[relabel["targetLabel"]] = value
    return labels


def static_configs(ports: list[int]) -> list[dict[str, Any]]:
    """Each rank's target with the docs' labels, valued as the PodMonitor values them for a
    rank pod of this job as the operator labels it (cephalo.operator.render)."""
    podmonitor = one(render({"metrics": {"podMonitor": {"enabled": True}}}), "PodMonitor")
    promised = promised_labels()
    configs = []
    for port, gpu in zip(ports, GPUS, strict=True):
        pod = {"metadata": {"name": f"{JOB}-rank", "namespace": NS, "labels": {
            "cephalo.dev/role": "trainer", "cephalo.dev/job": JOB,
            "cephalo.dev/gpu-product": gpu}}, "spec": {}}
        given = podmonitor_labels(podmonitor, pod)
        assert set(promised) <= set(given), f"the PodMonitor gives {sorted(given)}, not all " \
            f"of the {promised} docs/monitoring.md names"
        configs.append({"targets": [f"127.0.0.1:{port}"],
                        "labels": {k: given[k] for k in promised}})
    return configs


def _plan(path: Path) -> Path:
    path.write_text(json.dumps({
        "global_batch_size": 6, "world_size": 2, "predicted_step_seconds": 0.05,
        "predicted_samples_per_second": 120.0,
        "ranks": [{"rank": i, "gpu": gpu, "batch_size": 3, "micro_batch_size": 3,
                   "num_micro_batches": 1, "shard_ratio": 0.5, "memory_capacity_bytes": 1 << 30}
                  for i, gpu in enumerate(GPUS)]}))
    return path


async def test_every_trainer_panel_of_a_local_run_has_data(tmp_path: Path) -> None:
    base = free_listen_ports(3)  # Prometheus, rank 0, rank 1 (consecutive)
    ranks = [base + 1, base + 2]
    prometheus = PrometheusServer(tmp_path / "prometheus", base, None, None, [],
                                  static_configs={LOCAL_JOB: static_configs(ranks)}).start()
    job = tmp_path / f"{JOB}.yaml"
    job.write_text(JOB_YAML)
    out = tmp_path / "cephalo-run.out"
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / ".cache"))
    try:
        await prometheus.ready()
        started = time.time()
        with out.open("w") as log:
            # SIGINT at its default (a background shell job ignores it; tests/local/test_run.py)
            proc = subprocess.Popen(
                cephalo_cmd("run", str(job), "--plan", str(_plan(tmp_path / "plan.json")),
                            "--emulate", ",".join(GPUS), "--metrics-port", str(ranks[0])),
                cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            # A few scrapes of each training rank (each a point of every panel), then
            # every panel that should have data has it.
            await prometheus.wait_result(
                f'count(count_over_time(cephalo_step{{job="{LOCAL_JOB}"}}[10m]) '
                f'>= {MIN_SCRAPES}) == 2', timeout=120)
            await wait_for_panel_data(prometheus, NS, JOB, started, empty=EMPTY_LOCAL)
            with_data, total = await check_panels(prometheus, NS, JOB, started, time.time(),
                                                  empty=EMPTY_LOCAL)
            await check_variables(prometheus, NS, JOB)
            steps = await prometheus.query(f'cephalo_step{{job="{LOCAL_JOB}"}}')
            assert {s["metric"]["gpu_product"] for s in steps} == set(GPUS), steps
            scrapes = await prometheus.query(
                f'count_over_time(cephalo_step{{job="{LOCAL_JOB}"}}[10m])')
            trained = (f"{max(float(s['value'][1]) for s in steps):.0f} steps, "
                       f"{min(float(s['value'][1]) for s in scrapes):.0f}+ scrapes per rank, "
                       f"{time.time() - started:.0f} s after the launch")
            assert proc.poll() is None, out.read_text()  # still training: all was live data
        finally:
            proc.send_signal(signal.SIGINT)
            returncode = await asyncio.to_thread(proc.wait, 120)
    finally:
        await prometheus.stop()
        print(out.read_text()[-4000:] if out.exists() else "", prometheus.log_tail())
    assert returncode == 130, out.read_text()  # stopped by Ctrl-C, resumable
    assert f"Prometheus /metrics: http://127.0.0.1:{ranks[0]}/metrics (rank 0) to " \
           f":{ranks[1]} (rank 1)" in out.read_text()
    print(f"real Prometheus, local run: {with_data} of {total} panel queries returned series;"
          f" empty by design: {sorted(EMPTY_LOCAL)} ({trained})")
    deadline = time.monotonic() + 60
    while trainer_pids(str(tmp_path)) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert not trainer_pids(str(tmp_path)), "ranks left running after Ctrl-C"
