"""Pure helpers of the operator: status conditions, progress parsing, settings, import hygiene."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cephalo.operator.config import OperatorConfig
from cephalo.operator.reconcile import _replacing
from cephalo.operator.status import (
    failure_summary,
    merge_conditions,
    parse_progress,
    pod_state,
    tail,
)


def test_conditions_keep_their_transition_time_until_the_status_flips() -> None:
    first = merge_conditions(None, {"Planned": ("False", "Planning", "…")}, "t1")
    same = merge_conditions(first, {"Planned": ("False", "Planning", "still")}, "t2")
    assert same[0]["lastTransitionTime"] == "t1" and same[0]["message"] == "still"
    flipped = merge_conditions(same, {"Planned": ("True", "Planned", "ok"),
                                      "Failed": ("False", "x", "y")}, "t3")
    assert [c["type"] for c in flipped] == ["Failed", "Planned"]
    assert flipped[1]["lastTransitionTime"] == "t3"


def test_merge_patch_that_replaces_nested_dicts() -> None:
    old = {"pools": {"L4": 2, "A6000": 1}, "worldSize": 3}
    assert _replacing(old, {"pools": {"A6000": 1}, "worldSize": 1}) == {
        "pools": {"A6000": 1, "L4": None}, "worldSize": 1}
    assert _replacing(None, {"a": 1}) == {"a": 1}


def test_failure_summary_names_rank_exit_code_and_message_tail() -> None:
    pod = {"metadata": {"name": "j-rank-3"}, "status": {"phase": "Failed", "containerStatuses": [
        {"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
                                  "message": "x" * 1000 + "CUDA out of memory"}}}]}}
    state = pod_state(pod)
    text = failure_summary(3, "Tesla-P40", state)
    assert "rank 3" in text and "exit code 137" in text and "OOMKilled" in text
    assert text.endswith("CUDA out of memory") and len(text) < 600
    assert tail("abc", 10) == "abc" and tail("abcdef", 3) == "…def"


def test_progress_from_prometheus_text() -> None:
    text = ("# HELP cephalo_step Optimizer steps done\n# TYPE cephalo_step gauge\n"
            'cephalo_step{rank="0"} 17\ncephalo_samples_per_second{rank="0"} 88.5\n'
            "unrelated_metric 1\n")
    assert parse_progress(text) == {"step": 17, "samplesPerSecond": 88.5}
    assert parse_progress("") == {}


def test_config_from_environment_and_bad_values() -> None:
    cfg = OperatorConfig.from_env({"CEPHALO_RECHECK_SECONDS": "0.5",
                                   "CEPHALO_OPERATOR_METRICS_PORT": "0",
                                   "CEPHALO_TRAINER_IMAGE": "img:1"})
    assert cfg.recheck_seconds == 0.5 and cfg.metrics_port == 0 and cfg.trainer_image == "img:1"
    assert OperatorConfig.from_env({}) == OperatorConfig()
    with pytest.raises(ValueError, match="CEPHALO_PROFILE_RETRIES='many' is not a valid int"):
        OperatorConfig.from_env({"CEPHALO_PROFILE_RETRIES": "many"})


@pytest.mark.parametrize(("name", "raw", "problem"), [
    ("CEPHALO_RECHECK_SECONDS", "0", "must be > 0"),
    ("CEPHALO_RECHECK_SECONDS", "nan", "must be a finite number"),
    ("CEPHALO_PROGRESS_INTERVAL_SECONDS", "31", "must be > 0 and <= 30"),
    ("CEPHALO_PROFILE_RETRIES", "-1", "must be >= 0"),
    ("CEPHALO_MASTER_PORT", "70000", "must be >= 1 and <= 65535"),
    ("CEPHALO_RUN_AS_USER", "0", "must be >= 1"),
    ("CEPHALO_DISCOVERY_TIMEOUT_SECONDS", "inf", "must be a finite number"),
])
def test_config_out_of_range_is_refused(name: str, raw: str, problem: str) -> None:
    with pytest.raises(ValueError) as caught:
        OperatorConfig.from_env({name: raw})
    assert str(caught.value) == f"{name}={raw!r} {problem}"


@pytest.mark.parametrize(("raw", "problem"), [
    ("[0.8]", "must be a JSON object of at most 64 GPU types"),
    ("{L4: 0.8}", "is not a JSON object such as"),
    ('{"L4": 0}', "the price of 'L4' must be a number in (0, 100000], not 0"),
    ('{"L4": true}', "the price of 'L4' must be a number"),
    ('{"L4": "cheap"}', "the price of 'L4' must be a number"),
])
def test_a_bad_price_list_stops_the_operator_at_startup(raw: str, problem: str) -> None:
    with pytest.raises(ValueError) as caught:
        OperatorConfig.from_env({"CEPHALO_GPU_PRICES_PER_HOUR": raw})
    assert str(caught.value).startswith("CEPHALO_GPU_PRICES_PER_HOUR: ")
    assert problem in str(caught.value)


def test_the_price_list_fills_in_for_jobs_without_prices_of_their_own() -> None:
    from cephalo.api import parse_job
    from cephalo.operator.planning import with_price_list

    cfg = OperatorConfig.from_env({"CEPHALO_GPU_PRICES_PER_HOUR": '{"NVIDIA-L4": 0.8}'})
    assert cfg.prices() == {"NVIDIA-L4": 0.8} and OperatorConfig().prices() == {}

    def spec(**planner: object):
        return parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                          "metadata": {"name": "p"}, "spec": {
                              "model": {"preset": "gpt-tiny"}, "globalBatchSize": 8,
                              "planner": planner}}).spec

    filled = with_price_list(spec(objective="cost"), cfg.prices())
    assert filled.planner.gpu_prices_per_hour == {"NVIDIA-L4": 0.8}
    own = spec(objective="cost", gpuPricesPerHour={"Tesla-T4": 0.35})
    assert with_price_list(own, cfg.prices()) is own  # the job's own list wins whole
    plain = spec()
    assert with_price_list(plain, {}) is plain


def test_config_defaults_are_in_range() -> None:
    from dataclasses import fields

    from cephalo.operator.config import BOUNDS, _out_of_range

    defaults = OperatorConfig()
    numeric = {f.name for f in fields(defaults) if type(f.default) in (int, float)}
    assert set(BOUNDS) == numeric  # every number has its range
    assert all(_out_of_range(name, getattr(defaults, name)) is None for name in BOUNDS)


def test_operator_never_imports_torch_and_is_not_a_top_level_operator_module() -> None:
    code = ("import sys, operator, cephalo.operator; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert operator.__file__ != cephalo.operator.__file__; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
