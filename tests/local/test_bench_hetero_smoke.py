"""`bench/hetero_cpu.py --quick`: the planner's plan and the plans it rejected run on the
real engine (emulated RTX A6000 + P100 CPU ranks) and the bench prints one row per
contender and a verdict (issue 15). The verdict's value is not checked: on a shared machine
it is a measurement, not a property. What is checked: the planner's plan is, by the cost
model, no slower than any plan it rejected (it is exact for that model), and the rows are
real measurements."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from cephalo.api import parse_job
from cephalo.api.cluster import ClusterSpec, GpuGroup
from cephalo.planner.search.evaluate import score
from cephalo.planner.search.problem import build_problem
from cephalo.planner.search.unit_shards import EvenUnits

BENCH = Path(__file__).resolve().parents[2] / "bench" / "hetero_cpu.py"
NAME_WIDTH, PLAN_WIDTH = 28, 34  # the table's first two columns (bench/hetero_cpu.py)


def _rows(stdout: str) -> dict[str, list[str]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("contender"))
    rows = {}
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows[line[:NAME_WIDTH].strip()] = line[NAME_WIDTH + PLAN_WIDTH:].split()
    return rows


@pytest.mark.slow
def test_quick_bench_prints_every_contender_and_a_verdict() -> None:
    # Global batch 2: each contender is a launch whose every rank imports torch (~3 s of
    # CPU), and at 2 the compute-proportional split is the even one (named, not run): 7 rank
    # processes, 9 at batch 4. The field stays >= 4 rows whatever the load: the emulated
    # P100 is 4.16x slower than the A6000 by the catalog, so the chosen plan is the A6000
    # alone (one sample on the P100 costs more than two on the A6000), and the even split,
    # the other microbatching and recompute=on differ from it.
    done = subprocess.run([sys.executable, "-I", str(BENCH), "--quick", "--rounds", "1",
                           "--steps", "3", "--batch", "2"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = _rows(done.stdout)
    assert next(iter(rows)) == "cephalo (chosen)"
    # Both baselines appear, measured or named as the same plan as another contender.
    for baseline in ("even split", "compute-proportional"):
        assert baseline in rows or f"note: {baseline}: the same plan as" in done.stdout
    assert len(rows) >= 3
    chosen_predicted = float(rows["cephalo (chosen)"][0])
    for name, (predicted, measured, spread, round_range, runs, ratio) in rows.items():
        assert float(measured) > 0 and float(spread) >= 0 and int(runs) == 1, name
        low, high = (float(x) for x in round_range.split("-"))
        assert 0 < low <= high, name
        # Printed to 3 decimals: the chosen plan is the cost model's optimum.
        assert chosen_predicted <= float(predicted) + 0.0005, name
        assert float(ratio) > 0
    assert rows["cephalo (chosen)"][5] == "1.00"
    verdicts = [line for line in done.stdout.splitlines() if line.startswith("verdict: ")]
    assert len(verdicts) == 1
    assert verdicts[0] == "verdict: chosen plan is fastest within noise" or \
        verdicts[0].startswith("verdict: contenders beat the chosen plan: ")


def _bench_module():
    spec = importlib.util.spec_from_file_location("hetero_cpu_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("even", [EvenUnits(True, False, 1), EvenUnits(False, True, 3),
                                  EvenUnits.none(), EvenUnits.all(4)])
def test_a_per_unit_plan_runs_as_it_was_scored(even: EvenUnits) -> None:
    """The plan the bench launches carries the per-unit shards and recompute mode it was
    priced with: read back from the plan's own fields, it is the same candidate."""
    bench = _bench_module()
    spec = parse_job(bench.job_data("gpt-small", 32, 4, [1, 2, 4, 8])).spec
    cluster = ClusterSpec(groups=[GpuGroup(product="RTX-A6000", count=1),
                                  GpuGroup(product="P100", count=2)])
    full = build_problem(spec, cluster, None)
    for recompute in (True, False):
        problem = bench.mode_problem(full, [0, 1, 2], recompute)
        cand = bench.Candidate(problem, [0, 1, 2], [4, 2, 2], [4, 4, 4], even, recompute)
        plan = bench.to_plan(cand)
        assert not isinstance(plan, str), plan
        assert plan.recompute is (None if recompute else False)
        assert plan.unit_shard_ratios or even in (EvenUnits.none(), EvenUnits.all(4))
        back = bench.chosen_candidate(full, plan)
        assert back.key() == cand.key()
        assert plan.predicted_step_seconds == score(problem, [4, 2, 2], [4, 4, 4],
                                                    even_units=even).step_seconds
