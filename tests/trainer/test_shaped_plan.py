"""Issue 35, "a real network, shaped": the plan on a real, shaped link (bench/shaped_plan.py).
At each of three link rates the CPU is profiled and the profiler measures the collectives
across two network namespaces joined by a tc-shaped veth pair; the planner plans gpt-small
(global batch 32) on one or two CPU ranks from them, and the two-rank plan (the one that
crosses the link) trains across the namespaces. The planner's choice moves the right way:
never more ranks on a slower link, the one rank (nothing across the link) on the slowest,
predicted steps that grow as it slows; the two-rank plan is measured slower on the slow
link too. The predicted / measured ratios are the bench's figures (docs/network.md): on
this shared machine they depend on the load, so they are printed, not asserted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.load_file import load_file

BENCH = Path(__file__).resolve().parents[2] / "bench" / "shaped_plan.py"
shaped = load_file(BENCH, "shaped_plan")


@pytest.mark.slow  # per shape: a profile, the collective measurement, a 5-step run
@pytest.mark.skipif(shaped.unavailable() is not None, reason=str(shaped.unavailable()))
@pytest.mark.skipif(os.environ.get("CEPHALO_SHAPED_PLAN") != "1", reason=(
    "the shaped-link plan check takes 2-5 minutes of both cores (269 s at load 10), more "
    "than the default suite's budget: CEPHALO_SHAPED_PLAN=1 runs it (bench/shaped_plan.py "
    "has the figures)"))
def test_plan_predicts_the_step_and_moves_as_the_shaped_link_slows(tmp_path: Path) -> None:
    # 5 steps, the first 2 left out: 3 timed steps per shape keep the test short.
    spec, job_file = shaped.prepare(tmp_path, "gpt-small", batch=32, steps=5)
    shapes = [shaped.shape(rate, spec, job_file, tmp_path, "gpt-small", run="two", repeats=2)
              for rate in (300, 100, 50)]
    table = "\n".join(shaped.table(shapes))
    runs = [s.runs[0] for s in shapes]
    # No bound on predicted / measured here: on this shared 2-core machine both the raw
    # ratio and the compute-normalised one strayed past 25 % in some runs (docs/network.md);
    # the bench reports them.
    assert all(run.ranks == 2 for run in runs), table
    # The link slows: the two-rank plan is measured slower.
    assert runs[0].measured_seconds < runs[2].measured_seconds, table
    # The planner on the three measured links with one CPU profile (each shape profiled
    # the CPU afresh, and the load moves it): never predicted faster on a slower link,
    # never more ranks on it, the one rank alone on the slowest (its collectives alone
    # outlast a one-rank step). Whether 300 Mbit/s gets both ranks depends on how fast
    # the CPU profiled (both happened, docs/network.md): not asserted.
    cpu = shapes[0].cpu
    two = [shaped.plan_with(spec, cpu, s.fit, ranks=2).plan for s in shapes]
    chosen = [shaped.plan_with(spec, cpu, s.fit).plan for s in shapes]
    assert two[0].predicted_step_seconds < two[1].predicted_step_seconds < \
        two[2].predicted_step_seconds, table
    predicted = [p.predicted_step_seconds for p in chosen]
    assert predicted == sorted(predicted), table
    used = [p.world_size for p in chosen]
    assert used == sorted(used, reverse=True) and used[-1] == 1, (used, table)
