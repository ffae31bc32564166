"""A real Prometheus (Debian's `prometheus` package) for the tests, on loopback (used by
tests/realk8s/test_operator_prometheus.py and, scraping a local `cephalo run`,
tests/local/test_run_prometheus.py).

It scrapes what the chart's monitors would have it scrape, the way the Prometheus Operator
turns them into scrape configs: the operator's /metrics (the ServiceMonitor) and every trainer
rank pod's (the PodMonitor: Kubernetes pod discovery stood in for by a file_sd file whose
targets carry the `__meta_kubernetes_*` labels pod discovery would give, then the
PodMonitor's own relabelings, read from the rendered chart). Queried through its HTTP API.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from aiohttp import ClientSession

PROMETHEUS = shutil.which("prometheus")
SCRAPE_SECONDS = 1
# Grafana's $__rate_interval for this scrape interval at a fine resolution: 4 x scrape.
RATE_INTERVAL = f"{4 * SCRAPE_SECONDS}s"
TRAINERS_JOB = "podMonitor/cephalo-system/cephalo-cephalo-operator-trainers/0"
OPERATOR_JOB = "serviceMonitor/cephalo-system/cephalo-cephalo-operator/0"


def meta_label(label: str) -> str:
    """A pod label's name in Kubernetes discovery (`cephalo.dev/job` ->
    `__meta_kubernetes_pod_label_cephalo_dev_job`)."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)


def pod_target(pod: dict[str, Any], address: str) -> dict[str, Any]:
    """One file_sd target group: what Kubernetes pod discovery says of this pod, scraped at
    `address` (host:port)."""
    meta = pod["metadata"]
    labels = {meta_label(k): v for k, v in (meta.get("labels") or {}).items()}
    labels.update({"__meta_kubernetes_namespace": meta["namespace"],
                   "__meta_kubernetes_pod_name": meta["name"],
                   "__meta_kubernetes_pod_node_name": pod["spec"].get("nodeName", "")})
    return {"targets": [address], "labels": labels}


def discovered_target(pod: dict[str, Any], port_name: str = "metrics") -> dict[str, Any] | None:
    """A pod as Kubernetes pod discovery gives it to a PodMonitor's `port: <port_name>`
    endpoint: its pod IP and the container port of that name; None while it has no IP (not
    started) or is not Running (discovery lists it, but nothing answers there)."""
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or not status.get("podIP"):
        return None
    ports = [p["containerPort"] for c in pod["spec"]["containers"]
             for p in c.get("ports", []) if p.get("name") == port_name]
    return pod_target(pod, f"{status['podIP']}:{ports[0]}") if ports else None


def podmonitor_relabel_configs(podmonitor: dict[str, Any]) -> list[dict[str, Any]]:
    """The scrape config's relabel_configs for a PodMonitor: what the Prometheus Operator
    generates first (keep the selected pods; namespace and pod labels), then the monitor's
    own relabelings, camelCase to snake_case."""
    spec = podmonitor["spec"]
    configs: list[dict[str, Any]] = [
        {"source_labels": [meta_label(k)], "regex": re.escape(v), "action": "keep"}
        for k, v in spec["selector"]["matchLabels"].items()]
    configs += [{"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}]
    for relabel in spec["podMetricsEndpoints"][0].get("relabelings", []):
        configs.append({re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), k): v
                        for k, v in relabel.items()})
    return configs


class PrometheusServer:
    """Scraping the operator (at `operator_port`) and the trainer pods (set_targets) as the
    chart's monitors would have it; or, with `static_configs` ({job name: static_configs}),
    only those targets, as a user's hand-written scrape config would (a local `cephalo run`)."""

    def __init__(self, folder: Path, port: int, operator_port: int | None,
                 podmonitor: dict[str, Any] | None, rule_files: list[Path], *,
                 static_configs: dict[str, list[dict[str, Any]]] | None = None) -> None:
        self.folder, self.port = folder, port
        self.url = f"http://127.0.0.1:{port}"
        folder.mkdir(parents=True, exist_ok=True)
        self.targets_file = folder / "trainers.json"
        self.targets_file.write_text("[]")
        self._targets: list[dict[str, Any]] = []
        scrape_configs: list[dict[str, Any]] = [
            {"job_name": name, "static_configs": configs}
            for name, configs in (static_configs or {}).items()]
        if operator_port is not None:
            scrape_configs.append({"job_name": OPERATOR_JOB, "static_configs": [{
                "targets": [f"127.0.0.1:{operator_port}"],
                "labels": {"namespace": "cephalo-system", "endpoint": "metrics"}}]})
        if podmonitor is not None:
            scrape_configs.append({
                "job_name": TRAINERS_JOB,
                "file_sd_configs": [{"files": [str(self.targets_file)],
                                     "refresh_interval": "1s"}],
                "relabel_configs": podmonitor_relabel_configs(podmonitor)})
        config = {
            "global": {"scrape_interval": f"{SCRAPE_SECONDS}s",
                       "scrape_timeout": f"{SCRAPE_SECONDS}s",
                       "evaluation_interval": f"{SCRAPE_SECONDS}s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": scrape_configs}
        self.config_file = folder / "prometheus.yml"
        self.config_file.write_text(yaml.safe_dump(config))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PrometheusServer:
        assert PROMETHEUS
        self.log = (self.folder / "prometheus.log").open("ab")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={self.config_file}",
             f"--storage.tsdb.path={self.folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self

    def set_targets(self, groups: list[dict[str, Any]]) -> None:
        """Replace the trainer targets (atomically: Prometheus never reads half a file)."""
        if groups != self._targets:
            tmp = self.targets_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(groups))
            os.replace(tmp, self.targets_file)
            self._targets = groups

    async def get(self, path: str, **params: Any) -> Any:
        async with ClientSession() as http, http.get(self.url + path, params=params) as resp:
            body = await resp.json(content_type=None)
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    async def ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log_tail()
            try:
                async with ClientSession() as http, http.get(self.url + "/-/ready") as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            await asyncio.sleep(0.1)
        raise AssertionError(f"prometheus not ready after {timeout} s: {self.log_tail()}")

    async def query(self, expr: str) -> list[dict[str, Any]]:
        return list((await self.get("/api/v1/query", query=expr))["result"])

    async def wait_result(self, expr: str, timeout: float = 60) -> None:
        """Until an instant query of `expr` returns something."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self.query(expr):
                return
            await asyncio.sleep(0.2)
        raise AssertionError(f"no result for {expr} in {timeout} s: {self.log_tail()}")

    async def until(self, path: str, ready: Callable[[Any], bool], timeout: float = 60) -> Any:
        """An API answer once `ready` says it is."""
        deadline = time.monotonic() + timeout
        while True:
            data = await self.get(path)
            if ready(data):
                return data
            if time.monotonic() > deadline:
                raise AssertionError(f"{path} not ready in {timeout} s: {data}")
            await asyncio.sleep(0.2)

    async def query_range(self, expr: str, start: float, end: float) -> list[dict[str, Any]]:
        """Series of a range query (what a Grafana panel sends), each with its (time, value)
        points that are numbers (NaN is a point Grafana draws nothing for)."""
        data = await self.get("/api/v1/query_range", query=expr, start=f"{start:.3f}",
                              end=f"{end:.3f}", step=f"{SCRAPE_SECONDS}s")
        series = []
        for s in data["result"]:
            points = [(float(t), float(v)) for t, v in s["values"] if not math.isnan(float(v))]
            if points:
                series.append({"metric": s["metric"], "values": points})
        return series

    def log_tail(self, chars: int = 3000) -> str:
        path = self.folder / "prometheus.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    async def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), 10)
            except asyncio.TimeoutError:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        if getattr(self, "log", None):
            self.log.close()
