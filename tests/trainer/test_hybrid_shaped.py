"""Issue 44, "measured on a real shaped network" (bench/hybrid_shaped.py): four gloo ranks as
two nodes of two (network namespaces, each node's ranks on its loopback), the link between
the nodes shaped with tc. On a slow link the planner (`sharding: auto`, the link described
in planner.network) chooses hybrid sharding, the hybrid plan's real ranks run faster than
the flat plan's on the same link, and its predicted step is within 25 % of the measured one;
on a fast link auto keeps flat (planned only here: the bench measures both plans there).

Why the verdicts hold on a machine twice as fast or slow, or loaded. gpt-small (0.93 M
parameters) at 50 Mbit/s, 6.25 MB/s each way: the planner's own byte count per step
(the plans' `link_bytes_per_step`) is 3.7 MB across each node's NIC for hybrid (half the
fp32 gradient reduce-scattered, half the parameters gathered across the two groups) and
5.6 MB for flat (every gather and reduce-scatter on a ring through both nodes): at least
0.60 s and 0.90 s at the line rate, and gloo's collectives cross more (measured 1.2 s and
2.3 s). Both plans do the same compute (the same four batches of 8), about 0.2 s a step
with four one-thread ranks on 2 cores (measured on the unshaped 10 Gbit/s link): a machine
twice as slow adds the same 0.2 s to both, well under the 1.1 s between them, and moves
the hybrid prediction (1.27 s) against its measurement from 1.06 to about 0.9."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.load_file import load_file

BENCH = Path(__file__).resolve().parents[2] / "bench" / "hybrid_shaped.py"
bench = load_file(BENCH, "hybrid_shaped")

SLOW_MBIT = 50.0
FAST_MBIT = 10_000.0
BATCH = 32
STEPS = 5  # the first 2 untimed: 3 timed steps per run


@pytest.mark.slow  # a profile and one hybrid and one flat run on the slow link: about 40 s
@pytest.mark.skipif(bench.unavailable() is not None, reason=str(bench.unavailable()))
def test_hybrid_is_chosen_and_measured_faster_than_flat_on_a_slow_shaped_link(
        tmp_path: Path) -> None:
    cpu = bench.cpu_profile(bench.write_job(tmp_path, FAST_MBIT, BATCH, STEPS), tmp_path)
    fast = bench.plan(bench.write_job(tmp_path, FAST_MBIT, BATCH, STEPS), cpu, "auto")
    assert bench.sharding_of(fast) == "flat", fast.assumptions.get("sharding_reason")
    link = bench.compare(SLOW_MBIT, cpu, tmp_path, BATCH, STEPS, repeats=1)
    table = "\n".join(bench.table([link]))
    assert link.auto_sharding == "hybrid", (link.auto_reason, table)
    assert link.hybrid.median_seconds < link.flat.median_seconds, table
    assert 0.75 <= link.hybrid.ratios()[0] <= 1.25, table
    print(table)
