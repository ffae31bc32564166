"""The comm model counts the bytes the engine actually sends (issue 36 item 4): under
spec.gatherPrecision / reducePrecision bf16 a parameter moves 2 bytes, not 4. The engine's own
count of what it hands the backend is checked in tests/trainer/test_gather_precision.py."""

from __future__ import annotations

import pytest

from cephalo.api import ClusterSpec, GpuGroup, parse_job
from cephalo.planner import solve
from cephalo.planner.search.problem import build_problem

CLUSTER = ClusterSpec(groups=[GpuGroup(product="A10G", count=4)])


def _spec(**extra: str):
    return parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                      "metadata": {"name": "w"}, "spec": {
                          "model": {"preset": "gpt-small"}, "globalBatchSize": 32,
                          "planner": {"networkBandwidthGbps": 1.0, "chooseGpus": False,
                                      "networkLatencyMicroseconds": 0.0}, **extra}}).spec


@pytest.mark.parametrize("field,kinds", [
    ("gatherPrecision", ("ag_block", "ag_first", "ag_head")),
    ("reducePrecision", ("rs_block", "rs_other")),
])
def test_a_16_bit_collective_moves_half_the_bytes(field: str, kinds: tuple[str, ...]) -> None:
    wide = build_problem(_spec(), CLUSTER).unit_comm(uneven=True)
    narrow = build_problem(_spec(**{field: "bf16"}), CLUSTER).unit_comm(uneven=True)
    for kind in kinds:  # no latency: the seconds are the bytes over the bandwidth
        assert getattr(narrow, kind) == pytest.approx(getattr(wide, kind) / 2, rel=1e-12)
    others = {"ag_block", "ag_first", "ag_head", "rs_block", "rs_other"} - set(kinds)
    for kind in others:
        assert getattr(narrow, kind) == getattr(wide, kind)


def test_bf16_gathers_predict_a_faster_step_on_a_slow_network() -> None:
    fp32 = solve(_spec(), CLUSTER)
    bf16 = solve(_spec(gatherPrecision="bf16", reducePrecision="bf16"), CLUSTER)
    assert bf16.predicted_step_seconds < fp32.predicted_step_seconds
