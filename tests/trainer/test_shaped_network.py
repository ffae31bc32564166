"""Issue 35, "a real network, shaped": two "nodes" as network namespaces joined by a veth pair
shaped with tc (bench/shaped_network.py), one gloo rank in each, the profiler's own
collective measurement (trainer/profile_collectives.py) across them. The link rate the
measurement implies is within 25 % of the rate tc shapes, at two rates: 100 and 200 Mbit/s
(on this 2-core machine 800 Mbit/s measured 211 Mbit/s: CPU-bound, not the link; and a CI
run at load 15 measured 300 Mbit/s as 186: the two ranks' CPU, not the link, so 300 is left
to bench/shaped_network.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.load_file import load_file

BENCH = Path(__file__).resolve().parents[2] / "bench" / "shaped_network.py"


shaped = load_file(BENCH, "shaped_network")


@pytest.mark.slow  # two gloo processes per shape, ~25 s in all
@pytest.mark.skipif(shaped.unavailable() is not None, reason=str(shaped.unavailable()))
@pytest.mark.parametrize("rate_mbit", [100, 200])
def test_profiler_measures_the_shaped_link_between_two_namespaces(rate_mbit: int) -> None:
    with shaped.shaped_nodes(rate_mbit) as nodes:
        fit = shaped.measure(nodes, ranks_per_node=1, quick=True, timeout_seconds=90)
    figures = shaped.link_figures(fit, rate_mbit)
    assert 0.75 <= figures["link_vs_shaped"] <= 1.25, figures
    # The all-gather's two broadcasts cross the link one way each: at most both directions
    # at once (the ring's figure, the rate), at least one after the other (half of it).
    assert 0.75 * 0.5 <= figures["all_gather_vs_shaped"] <= 1.25, figures


@pytest.mark.skipif(shaped.unavailable() is not None, reason=str(shaped.unavailable()))
def test_namespaces_are_removed_even_when_the_body_fails() -> None:
    made = []
    with pytest.raises(RuntimeError, match="body failed"), shaped.shaped_nodes(100) as nodes:
        made = [nodes.a, nodes.b]
        raise RuntimeError("body failed")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            check=True).stdout
    assert made and not any(name in listed for name in made)
