"""Cephalo's alerting rules (issue 38): one rules file, shipped by the chart as a
PrometheusRule, checked by Prometheus' own `promtool`.

`charts/cephalo-operator/alerts/cephalo.rules.yaml` is the one copy; the PrometheusRule
template reads it. `promtool test rules` runs `alerts/cephalo.rules.test.yaml` (series that
fire each alert and series that do not) against that file AND against the rules the chart
renders, so the template cannot drift from what was tested. The rules may read only metrics
and labels the registries export (the same check as the dashboard's).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import CHART_DIR, by_kind, load_yaml, one, render, strip
from test_chart_dashboard import (
    DISCOVERY_LABELS,
    Exported,
    labels_used,
    metric_names,
    operator_exports,
    podmonitor_target_labels,
    trainer_exports,
)

RULES_FILE = CHART_DIR / "alerts" / "cephalo.rules.yaml"
UNIT_TESTS = Path(__file__).parent / "alerts" / "cephalo.rules.test.yaml"
PROMTOOL = shutil.which("promtool")
NEEDS_PROMTOOL = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not on PATH (Debian: apt-get install prometheus)")
# The alerts, by what they watch.
EXPECTED = {"CephaloJobNotProgressing", "CephaloStragglerRank",
            "CephaloThroughputBelowPrediction", "CephaloJobRestartingRepeatedly",
            "CephaloJobPreemptedRepeatedly", "CephaloGangUnschedulable", "CephaloJobsPending",
            "CephaloOperatorReconcileErrors", "CephaloOperatorNotReconciling",
            "CephaloOperatorDown"}


def rules() -> list[dict[str, Any]]:
    return [r for g in load_yaml(RULES_FILE)["groups"] for r in g["rules"]]


def test_every_rule_has_a_severity_a_summary_and_a_runbook() -> None:
    found = rules()
    assert {r["alert"] for r in found} == EXPECTED
    for rule in found:
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert set(rule["annotations"]) == {"summary", "runbook"}, rule["alert"]
        # runbooks are plain text: the unit tests fill them in from here
        assert "{{" not in rule["annotations"]["runbook"], rule["alert"]


def test_rules_read_only_exported_metrics_and_labels() -> None:
    exported = Exported()
    for source in (operator_exports(), trainer_exports()):
        exported.labels.update(source.labels)
    targets = DISCOVERY_LABELS | podmonitor_target_labels()
    for rule in rules():
        expr = rule["expr"]
        names = metric_names(expr)
        assert names and names <= set(exported.labels), \
            f"{rule['alert']} reads {sorted(names - set(exported.labels))}, exported by no registry"
        allowed = targets.union(*(exported.labels[n] for n in names))
        for metric, labels in labels_used(expr).items():
            own = exported.labels[metric] | targets if metric != "*" else allowed
            assert labels <= own, f"{rule['alert']}: {metric} has no label(s) {labels - own}"
        shown = set(re.findall(r"\$labels\.(\w+)", rule["annotations"]["summary"]))
        assert shown <= allowed, f"{rule['alert']}'s summary names labels {shown - allowed}"


def _unit_tests(rules_file: Path, folder: Path) -> Path:
    """The unit tests with each expected runbook taken from the rules (plain text, which
    promtool passes through) and `rule_files` pointing at `rules_file`."""
    runbook = {r["alert"]: r["annotations"]["runbook"] for r in rules()}
    tests = load_yaml(UNIT_TESTS)
    tests["rule_files"] = [str(rules_file)]
    for case in tests["tests"]:
        for check in case["alert_rule_test"]:
            for alert in check["exp_alerts"]:
                assert alert["exp_annotations"]["runbook"] == "RUNBOOK"
                alert["exp_annotations"]["runbook"] = runbook[check["alertname"]]
    path = folder / "cephalo.rules.test.yaml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    return path


def test_unit_tests_fire_and_spare_every_alert() -> None:
    fired, spared = set(), set()
    for case in load_yaml(UNIT_TESTS)["tests"]:
        for check in case["alert_rule_test"]:
            (fired if check["exp_alerts"] else spared).add(check["alertname"])
    assert fired == spared == EXPECTED, (EXPECTED - fired, EXPECTED - spared)


def _promtool(*args: str) -> str:
    assert PROMTOOL
    proc = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@NEEDS_PROMTOOL
def test_promtool_checks_and_unit_tests_the_rules_file(tmp_path: Path) -> None:
    assert f"SUCCESS: {len(EXPECTED)} rules found" in _promtool("check", "rules", str(RULES_FILE))
    assert "SUCCESS" in _promtool("test", "rules", str(_unit_tests(RULES_FILE, tmp_path)))


@NEEDS_PROMTOOL
def test_promtool_unit_tests_pass_on_the_rules_the_chart_renders(tmp_path: Path) -> None:
    rule = one(render({"metrics": {"prometheusRule": {"enabled": True}}}), "PrometheusRule")
    rendered = tmp_path / "rendered.rules.yaml"
    rendered.write_text(yaml.safe_dump(rule["spec"]))
    assert "SUCCESS" in _promtool("test", "rules", str(_unit_tests(rendered, tmp_path)))


def test_prometheusrule_is_the_rules_file_with_the_values_applied() -> None:
    assert not by_kind(render(), "PrometheusRule"), "off by default"
    values = {"metrics": {"prometheusRule": {
        "enabled": True, "namespace": "monitoring", "labels": {"release": "kps"},
        "ruleLabels": {"team": "ml", "severity": "page"}}}}
    rule = strip(one(render(values), "PrometheusRule"))
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "monitoring"
    assert rule["metadata"]["labels"]["release"] == "kps"
    expected = load_yaml(RULES_FILE)
    for group in expected["groups"]:
        for r in group["rules"]:
            r["labels"] = {**r.get("labels", {}), "team": "ml", "severity": "page"}
    assert rule["spec"] == expected
