"""The Grafana dashboard queries only metrics (and labels) the code actually exports.

Names are read at test time from the metric registries themselves (the operator's module
metrics on prometheus-client's default registry, the trainer's per-rank registry), so the
check stays true as the code evolves. Labels a query groups or filters by must be the
metric's own or a target label Prometheus adds (the chart's PodMonitor relabelings).
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
from chart_helpers import CHART_DIR, one, render

DASHBOARD = CHART_DIR / "dashboards" / "cephalo.json"
# Labels Prometheus puts on every scraped series (service/pod discovery), and `le`.
DISCOVERY_LABELS = {"namespace", "pod", "container", "endpoint", "service", "instance", "job"}
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and",
    "or", "unless", "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk",
    "quantile", "count_values", "group", "inf", "nan",
}
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^}]*)\}")
IDENT = re.compile(r"(?<![\w$.\"])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w\"])")


@dataclass
class Exported:
    """Sample names a registry exposes, mapped to the label names of their metric."""

    labels: dict[str, set[str]] = field(default_factory=dict)
    histograms: set[str] = field(default_factory=set)

    def add(self, collector: Any) -> None:
        labelnames = set(getattr(collector, "_labelnames", ()))  # prometheus-client attribute
        describe = getattr(collector, "describe", None)
        families = describe() if describe else collector.collect()
        for family in families:
            suffixes = {"counter": ["_total", "_created"],
                        "histogram": ["_bucket", "_sum", "_count", "_created"],
                        "summary": ["", "_sum", "_count", "_created"],
                        "info": ["_info"]}.get(family.type, [""])
            for suffix in suffixes:
                self.labels[family.name + suffix] = labelnames | (
                    {"le"} if suffix == "_bucket" else set())
            for sample in getattr(family, "samples", []):  # collect()-only collectors
                self.labels.setdefault(sample.name, set()).update(sample.labels)


def _collectors(registry: Any) -> list[Any]:
    # The registry's own index of what it exposes (prometheus-client keeps it private).
    return list(registry._collector_to_names)


def _import_or_skip(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name == module:
            pytest.skip(f"{module} does not exist yet: its dashboard queries cannot be checked")
        raise


def operator_exports() -> Exported:
    module = _import_or_skip("cephalo.operator.metrics")
    from prometheus_client import REGISTRY

    exported = Exported()
    for collector in _collectors(REGISTRY):
        exported.add(collector)
    assert any(name.startswith("cephalo_operator_") for name in exported.labels), \
        f"{module.__name__} registered no cephalo_operator_* metric on the default registry"
    return exported


def trainer_exports() -> Exported:
    module = _import_or_skip("cephalo.trainer.metrics")
    # Every rank builds its own registry; port 0 serves nothing.
    try:
        registry = module.TrainerMetrics(rank=0, port=0, predicted_step_seconds=1.0).registry
    except (AttributeError, TypeError) as err:
        raise AssertionError(f"cannot build the trainer's metric registry ({err}): update "
                             "trainer_exports() in tests/chart/test_chart_dashboard.py") from err
    exported = Exported()
    for collector in _collectors(registry):
        exported.add(collector)
    return exported


def podmonitor_target_labels() -> set[str]:
    monitor = one(render({"metrics": {"podMonitor": {"enabled": True}}}), "PodMonitor")
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    return {r["targetLabel"] for r in endpoint.get("relabelings", []) if "targetLabel" in r}


def queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target and query variable."""
    board = json.loads(DASHBOARD.read_text())
    found = [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            inner = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query)
            assert inner, f"variable {var['name']}: expected label_values(selector, label)"
            found.append((f"variable {var['name']}", inner.group(1) + f" by ({inner.group(2)})"))
    return found


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers outside selectors, groupings, ranges."""
    text = re.sub(r"\{[^}]*\}", " ", expr)
    text = GROUPING.sub(" ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    names = set()
    for m in IDENT.finditer(text):
        rest = text[m.end():].lstrip()
        if rest.startswith("(") or m.group(1).lower() in PROMQL_WORDS:
            continue  # a function or keyword
        names.add(m.group(1))
    return names


def labels_used(expr: str) -> dict[str, set[str]]:
    """Label names each metric is filtered by, and (for the whole query) grouped by."""
    used: dict[str, set[str]] = {"*": set()}
    for m in SELECTOR.finditer(expr):
        names = {part.split("=")[0].strip(" !~") for part in m.group(2).split(",") if part.strip()}
        used.setdefault(m.group(1) or "*", set()).update(names)
    for m in GROUPING.finditer(expr):
        used["*"].update(x.strip() for x in m.group(1).split(",") if x.strip())
    return used


def test_query_parser_finds_metrics_and_labels() -> None:
    expr = ('sum by (rank, op) (rate(cephalo_x_total{namespace=~"$ns", rank="0"}'
            '[$__rate_interval])) / max by (rank) (cephalo_y)')
    assert metric_names(expr) == {"cephalo_x_total", "cephalo_y"}
    used = labels_used(expr)
    assert used["cephalo_x_total"] == {"namespace", "rank"} and used["*"] == {"rank", "op"}
    assert metric_names("histogram_quantile(0.5, sum by (le) (rate(a_bucket[5m])))") == {"a_bucket"}


def test_dashboard_queries_use_exported_metrics_and_labels() -> None:
    exported = Exported()
    for source in (operator_exports(), trainer_exports()):
        exported.labels.update(source.labels)
    target_labels = DISCOVERY_LABELS | podmonitor_target_labels()
    checked: set[str] = set()
    for title, expr in queries():
        names = metric_names(expr)
        assert names, f"panel {title!r}: no metric in {expr!r}"
        unknown = names - set(exported.labels)
        assert not unknown, (f"panel {title!r} queries {sorted(unknown)}, which no registry "
                             f"exports; exported: {sorted(exported.labels)}")
        allowed = target_labels.union(*(exported.labels[n] for n in names))
        for metric, labels in labels_used(expr).items():
            own = exported.labels.get(metric, set()) | target_labels if metric != "*" else allowed
            assert labels <= own, (f"panel {title!r}: {metric} has no label(s) "
                                   f"{sorted(labels - own)}")
        checked |= names
    # The panels the issue asks for are there (by the metrics they read).
    for needed in ("cephalo_samples_per_second", "cephalo_operator_predicted_samples_per_second",
                   "cephalo_step_seconds_sum", "cephalo_memory_used_bytes",
                   "cephalo_memory_capacity_bytes", "cephalo_collective_wait_seconds_total",
                   "cephalo_loss", "cephalo_operator_gang_restarts_total",
                   "cephalo_operator_jobs", "cephalo_operator_planning_duration_seconds_bucket",
                   "cephalo_operator_reconciles_total", "cephalo_operator_rank_replica_group"):
        assert needed in checked, f"the dashboard has no panel reading {needed}"


def test_dashboard_is_grafana_json_with_a_datasource_variable() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in board["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            assert p["targets"] and p["description"], p["title"]
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24, f"panel {p['title']!r} overflows the 24-column grid"


def test_dashboard_configmap_carries_the_json_and_sidecar_label() -> None:
    objects = render({"dashboards": {"enabled": True, "namespace": "monitoring",
                                     "annotations": {"grafana_folder": "Cephalo"}}})
    cm = one(objects, "ConfigMap")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Cephalo"}
    assert json.loads(cm["data"]["cephalo.json"]) == json.loads(DASHBOARD.read_text())
    assert not [o for o in render() if o["kind"] == "ConfigMap"], "off by default"


# ---- one label name for the job across operator and trainer series (issue 11, defect 10) ----
JOB_LABELS = {"cephalo_namespace", "cephalo_job"}
RATE_FUNCTIONS = re.compile(r"\b(?:rate|irate|increase)\s*\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)")


def test_operator_series_never_carry_a_label_prometheus_sets_on_targets() -> None:
    """Such a label is renamed `exported_<name>` (or, with honorLabels, wins over the
    target's own): either way a query by it breaks. Job and namespace use JOB_LABELS."""
    exported = operator_exports()
    clashes = {name: sorted(labels & DISCOVERY_LABELS) for name, labels in
               exported.labels.items() if labels & DISCOVERY_LABELS}
    assert not clashes, f"operator series with target labels: {clashes}"
    per_job = {name for name, labels in exported.labels.items() if labels & JOB_LABELS}
    assert "cephalo_operator_predicted_samples_per_second" in per_job
    assert all(exported.labels[name] >= JOB_LABELS for name in per_job), \
        "a per-job operator series must carry both cephalo_namespace and cephalo_job"


def test_trainer_series_get_the_same_job_labels_and_monitors_honor_no_labels() -> None:
    assert podmonitor_target_labels() >= JOB_LABELS
    objects = render({"metrics": {"serviceMonitor": {"enabled": True},
                                  "podMonitor": {"enabled": True}}})
    endpoints = one(objects, "ServiceMonitor")["spec"]["endpoints"] + \
        one(objects, "PodMonitor")["spec"]["podMetricsEndpoints"]
    assert not any(e.get("honorLabels") for e in endpoints), \
        "honorLabels lets a scraped page overwrite target labels; no series needs it"


def test_dashboard_joins_jobs_by_the_shared_labels_and_rates_only_counters() -> None:
    exported = Exported()
    for source in (operator_exports(), trainer_exports()):
        exported.labels.update(source.labels)
    for title, expr in queries():
        used = labels_used(expr)
        by_job = set().union(*used.values()) & {"job", "namespace", *JOB_LABELS}
        assert by_job <= JOB_LABELS, f"panel {title!r} selects jobs by {sorted(by_job)}"
        rated = set(RATE_FUNCTIONS.findall(expr))
        for name in metric_names(expr):
            if name.endswith("_total"):
                assert name in rated, f"panel {title!r} reads counter {name} without rate()"
            elif not name.endswith(("_sum", "_count", "_bucket")):
                assert name not in rated, f"panel {title!r} takes rate() of gauge {name}"
