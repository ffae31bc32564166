"""What a real Prometheus must answer for the chart's Grafana dashboard and alerting rules
(issue 38), once it has scraped the operator and the ranks of a running two-GPU job; shared by
tests/realk8s/test_operator_prometheus.py (the real control plane) and
tests/local/test_run_prometheus.py (the ranks of a local `cephalo run`, no operator).

Every panel query is sent as Grafana sends it (a range query, $namespace/$job set to the job,
$__rate_interval 4 x the scrape interval) and must return a series with a number in it,
carrying every label the query groups by and its legend names; each variable query must list
the job. Panels that cannot have data in such a run are listed with the reason, and checked
to be empty (so the list cannot go stale). Every rule must load and evaluate without error,
and those a healthy run must not trip be inactive.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

from tests.prometheus_server import RATE_INTERVAL, PrometheusServer

CHART_DIR = Path(__file__).resolve().parents[1] / "charts" / "cephalo-operator"
DASHBOARD = CHART_DIR / "dashboards" / "cephalo.json"
RULES = CHART_DIR / "alerts" / "cephalo.rules.yaml"
RULE_COUNT = 10
# Panel queries that have no series in these runs (those naming a key), and why. Each is
# checked to be empty, and each key to be in some panel query.
EMPTY_HERE = {
    "cephalo_memory_used_bytes": "GPU memory comes from NVML; these ranks run on the CPU",
    "cephalo_memory_capacity_bytes": "GPU memory comes from NVML; these ranks run on the CPU",
}
# A local `cephalo run` (no operator): its ranks' series only.
EMPTY_LOCAL = {**EMPTY_HERE, "cephalo_operator_": "the operator's series: a local run has none"}
# Alerts that must be inactive in a healthy run (the others may be pending: the plan's
# prediction is for the GPUs, the steps run on this CPU; `for` keeps them from firing).
HEALTHY = {"CephaloJobNotProgressing", "CephaloOperatorDown", "CephaloOperatorNotReconciling",
           "CephaloOperatorReconcileErrors", "CephaloJobRestartingRepeatedly",
           "CephaloJobPreemptedRepeatedly", "CephaloGangUnschedulable"}


def as_sent(expr: str, ns: str, job: str) -> str:
    """A panel's query as Grafana sends it with this job picked."""
    return (expr.replace("$namespace", ns).replace("$job", job)
            .replace("$__rate_interval", RATE_INTERVAL))


def panel_queries(ns: str, job: str) -> list[tuple[str, str, str]]:
    """(panel title, PromQL as Grafana sends it for this job, legend) of every panel target."""
    board = json.loads(DASHBOARD.read_text())
    found = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = as_sent(target["expr"], ns, job)
            assert "$" not in expr, f"panel {panel['title']!r}: unset variable in {expr}"
            found.append((panel["title"], expr, target.get("legendFormat", "")))
    return found


def shown_labels(expr: str, legend: str) -> set[str]:
    """Labels each series of a panel must carry: those its query groups by (but `le`, which
    histogram_quantile consumes) and those its legend names."""
    by = {label.strip() for group in re.findall(r"\bby\s*\(([^)]*)\)", expr)
          for label in group.split(",") if label.strip()}
    return (by - {"le"}) | set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))


def expected_empty(expr: str, empty: dict[str, str] = EMPTY_HERE) -> bool:
    return any(metric in expr for metric in empty)


async def wait_for_panel_data(prometheus: PrometheusServer, ns: str, job: str, since: float,
                              timeout: float = 60, empty: dict[str, str] = EMPTY_HERE) -> None:
    """Until every panel that should have data has it (waits on the data, not a clock)."""
    deadline = time.monotonic() + timeout
    missing = [(t, q) for t, q, _ in panel_queries(ns, job) if not expected_empty(q, empty)]
    while missing:
        missing = [(t, q) for t, q in missing
                   if not await prometheus.query_range(q, since, time.time())]
        if not missing or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    assert not missing, "panels without data: " + "; ".join(f"{t}: {q}" for t, q in missing)


async def check_panels(prometheus: PrometheusServer, ns: str, job: str, since: float,
                       until: float, empty: dict[str, str] = EMPTY_HERE) -> tuple[int, int]:
    """Every panel's series between `since` and `until` carry the labels it shows; the ones
    `empty` names have none. (panel queries with series, all panel queries)"""
    queries = panel_queries(ns, job)
    unused = [m for m in empty if not any(m in expr for _, expr, _ in queries)]
    assert not unused, f"no panel query reads {unused}: drop them from the empty list"
    with_data = 0
    for title, expr, legend in queries:
        series = await prometheus.query_range(expr, since, until)
        if expected_empty(expr, empty):
            assert not series, f"panel {title!r} has data now: drop it from the empty list " \
                f"({expr})"
            continue
        assert series, f"panel {title!r} lost its data: {expr}"
        with_data += 1
        for s in series:  # the labels the panel groups (and names its legend) by are there
            assert shown_labels(expr, legend) <= s["metric"].keys(), (title, expr, s["metric"])
    return with_data, len(queries)


async def check_variables(prometheus: PrometheusServer, ns: str, job: str) -> None:
    """The dashboard's variables (Grafana's label_values: the series API) list the job."""
    board = json.loads(DASHBOARD.read_text())
    for var in board["templating"]["list"]:
        if var["type"] != "query":
            continue
        found = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["query"]["query"])
        assert found, var
        selector, label = found.groups()
        values = await prometheus.get(f"/api/v1/label/{label}/values",
                                      **{"match[]": selector.replace("$namespace", ns)})
        assert {"cephalo_namespace": ns, "cephalo_job": job}[label] in values, (var, values)


# How long a HEALTHY rule may stay pending or firing before the verdict: a rule Prometheus
# evaluated before the series it reads existed is pending until its next evaluations (a CI run:
# the session's operator restarted just before the test, and CephaloOperatorDown, absent() of
# a counter that appears at its first reconcile, was still pending at the check). One that a
# real fault trips stays so.
SETTLE_SECONDS = 15.0


async def check_rules(prometheus: PrometheusServer) -> dict[str, dict[str, Any]]:
    """The rules loaded, every one evaluated without error; a healthy run trips none of
    HEALTHY (within SETTLE_SECONDS). The rules by name."""
    def evaluated(data: Any) -> bool:
        rules = [r for g in data["groups"] for r in g["rules"]]
        return bool(rules) and all(not r["lastEvaluation"].startswith("0001") for r in rules)

    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        groups = await prometheus.until("/api/v1/rules", evaluated)
        rules = {r["name"]: r for g in groups["groups"] for r in g["rules"]}
        tripped = {n: (rules[n]["state"], rules[n].get("alerts"))
                   for n in HEALTHY & set(rules) if rules[n]["state"] != "inactive"}
        if not tripped or time.monotonic() > deadline:
            break
        await asyncio.sleep(1.0)
    assert set(rules) >= HEALTHY and len(rules) == RULE_COUNT, sorted(rules)
    for name, rule in rules.items():
        assert rule["health"] == "ok" and not rule.get("lastError"), (name, rule)
    assert not tripped, f"a healthy run tripped {tripped}"
    return rules
