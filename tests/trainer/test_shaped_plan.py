"""Issue 35, "a real network, shaped": the plan on a real, shaped link (bench/shaped_plan.py).
The real profiler measures this machine's CPU (one thread) once; at each of three link
rates the operator's network probe (`python -m cephalo.trainer.netprobe`: bandwidth,
latency and the overlap with compute) runs across two network namespaces joined by a
tc-shaped veth pair; the planner plans gpt-small (global batch 128) on one or two CPU
ranks from both, and the chosen plan's real trainer ranks train across the namespaces.

Asserted: the link rate the measurement implies is within 25 % of the shaped rate; the
chosen plan's predicted step, with the compute time its run measured, is within 25 % of the
measured one at every shape (the raw prediction, from the one-rank profile, is printed: how
two ranks share this machine's cores moves it); the plan
moves the right way (both ranks on the fastest link, never more ranks on a slower one,
one rank alone and a slower prediction on the slowest); and on the slowest link the
two-rank plan the planner turned down is measured slower than the one it chose, and the
planner told that link's rate (rather than measuring it) prices that plan nearer its measured
step than the rate itself would (gloo's efficiency, docs/network.md).

Every timed process runs at niceness -20 in a session (autogroup) of its own
(`shaped_network.start_timed_module`): with the kernel's autogroups the other sessions'
load (the suite's other worker, a control plane) otherwise moved the predicted / measured
ratio from 1.02 to 1.34 (four busy loops in other sessions; 1.07 with start_timed). Each
forks from one fork server that imported torch once (79.5 -> 42.7 CPU s for this test)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.load_file import load_file

BENCH = Path(__file__).resolve().parents[2] / "bench" / "shaped_plan.py"
shaped = load_file(BENCH, "shaped_plan")

# 128 samples: two ranks beat one by about 1.5x on the fastest link (predicted here: 0.50 s
# against 0.78 s) and lose on the slowest (their collectives alone outlast most of the one
# rank's whole step). With fewer samples the two-rank step is mostly collectives, whose
# gloo threads share the ranks' cores: 96 samples measured 0.79-0.87 at 300 Mbit/s, 128
# measured 0.89-0.98.
RATES_MBIT = (300, 150, 50)
BATCH = 128
STEPS = 5  # the first 2 left out (shaped.WARMUP_STEPS): 3 timed steps per run


@pytest.mark.exclusive  # its verdict is a timing on this machine's two cores
@pytest.mark.slow  # a profile, 3 link measurements and 4 short runs: about 90 s
@pytest.mark.skipif(shaped.unavailable() is not None, reason=str(shaped.unavailable()))
def test_chosen_plan_predicts_its_step_and_moves_as_the_shaped_link_slows(
        tmp_path: Path) -> None:
    spec, job_file = shaped.prepare(tmp_path, "gpt-small", batch=BATCH, steps=STEPS)
    cpu = shaped.cpu_profile(job_file, tmp_path)
    shapes = [shaped.shape(rate, spec, job_file, tmp_path, "gpt-small",
                           run="both" if rate == RATES_MBIT[-1] else "chosen",
                           probe="netprobe", repeats=3, cpu=cpu)
              for rate in RATES_MBIT]
    table = "\n".join(shaped.table(shapes))
    for s in shapes:
        figures = shaped.link_figures(s.fit, s.rate_mbit)
        assert 0.75 <= figures["link_vs_shaped"] <= 1.25, (s.rate_mbit, figures, table)
        # The all-gather's two broadcasts cross the link one way each: at most both
        # directions at once (the ring's figure, the rate), at least one after the other.
        assert 0.75 * 0.5 <= figures["all_gather_vs_shaped"] <= 1.25, (figures, table)
        chosen = s.runs[0]
        assert (chosen.ranks, chosen.batches) == (s.chosen_ranks, s.chosen_batches), table
        # The prediction with the compute the run measured (the CPU profile's figures scaled
        # by the run's own compute time): the network's part of the model against the shaped
        # link. The raw ratio (the table's "predicted / measured") also carries how this
        # machine runs two ranks at once against the one-rank profile: two CI runs read
        # compute 1.5x the profile's with the ranks on sibling cores, 0.71 and 0.72 raw.
        assert 0.75 <= chosen.normalised_ratio <= 1.25, (s.rate_mbit, chosen.normalised_ratio,
                                                         table)
    used = [s.chosen_ranks for s in shapes]
    assert used == sorted(used, reverse=True) and used[0] == 2 and used[-1] == 1, \
        (used, table)
    # A slower link's prediction: the slowest link's above the fastest's (a factor 6 in rate).
    # Between neighbouring shapes each plan carries its own measurement's noise (a CI run
    # predicted 0.663 s at 300 Mbit/s and 0.621 s at 150, the probe step and overlap measured
    # anew at each): the planner's "never faster on a slower link" with every other figure
    # the same is tests/unit/test_collective_efficiency.py's.
    assert shapes[-1].chosen_predicted_seconds > shapes[0].chosen_predicted_seconds, table
    # The choice checked against a measurement: on the slowest link the two-rank plan the
    # planner turned down is slower than the one rank it chose.
    one, two = shapes[-1].runs
    assert two.ranks == 2 and two.measured_seconds > one.measured_seconds, table
    # Told the rate instead of measuring it (planner.networkBandwidthGbps), the planner
    # prices the collectives at gloo's efficiency of it (issue 46 item 6). The turned-down
    # two-rank plan is mostly collectives: priced so, it lands nearer its measured step than
    # priced at the rate itself (measured in two runs: 0.95 and 0.99 of it, against 0.45 and
    # 0.50).
    assert two.described_seconds > two.line_rate_seconds, table
    assert abs(math.log(two.described_ratio)) < abs(math.log(two.line_rate_ratio)), table
    print(table)
