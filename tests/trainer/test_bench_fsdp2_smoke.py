"""`bench/fsdp2.py --quick`: Cephalo and PyTorch's FSDP2 (`fully_shard`, each variant) train
the same tiny GPT on 2 gloo ranks to the same losses and gradient norms, and the bench
reports ratios and peak RSS for both regimes (issue 16 item 3). Timings are not checked:
they are measurements, not properties."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fsdp2.py"


@pytest.mark.slow
def test_quick_bench_runs_every_contender_to_equal_losses() -> None:
    done = subprocess.run([sys.executable, "-I", str(BENCH), "--quick", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert set(results) == {"compute", "communication"}
    for regime in results.values():
        assert regime["losses_equal"] and regime["max_relative_difference"] <= 1e-4
        medians = regime["step_seconds_median"]
        assert {"cephalo recompute", "cephalo keep", "fsdp2 per-microbatch", "fsdp2 no-sync",
                "fsdp2 no-sync+keep", "fsdp2 one-microbatch"} <= set(medians)
        assert all(v > 0 for v in medians.values())
        layers = regime["model"]["num_layers"]
        assert {f"cephalo keep {k}/{layers}" for k in range(1, layers + 1)} <= set(medians)
        # Each multi-microbatch Cephalo contender (recompute, keep k/L, keep) against each of
        # the three FSDP2 variants, and each one-microbatch one against FSDP2's.
        assert len(regime["ratios"]) == 3 * (layers + 2) + layers + 2
        assert all(0 < r["min"] <= r["median"] <= r["max"] for r in regime["ratios"].values())
        assert set(regime["peak_rss_mib"]) == set(medians)
        assert all(v > 0 for v in regime["peak_rss_mib"].values())
        # Equal memory budget: for each FSDP2 variant, a Cephalo contender within its memory.
        assert set(regime["equal_memory"]) == {n for n in medians if n.startswith("fsdp2")}
        for e in regime["equal_memory"].values():
            assert e["cephalo"] is None or (
                e["cephalo_peak_rss_mib"] <= e["fsdp2_peak_rss_mib"] and e["ratio"]["median"] > 0)
