"""What the README walk on a clean checkout found (issue 26, "README walked end to end"):
`cephalo run --plan` as the README describes it, checked with the rank launcher replaced."""

from __future__ import annotations

from pathlib import Path

from cephalo.local import runner
from cephalo.local.ranks import LaunchResult

from .test_newcomer import _options, _record


def _ran(run_dir: Path, world: int = 2):
    def launch(*args, **kwargs) -> LaunchResult:
        return LaunchResult(0, records=[_record(s, world) for s in (1, 2, 3)],
                            checkpoint_dir=str(run_dir / "checkpoints"))
    return launch


def test_a_hand_written_plan_on_cpu_ranks_says_cpu_ranks_and_no_made_up_figures(
        tmp_path, monkeypatch) -> None:
    """The walk's `cephalo run --devices cpu:3 --plan plan.json` (a plan written by hand)
    printed 'global batch 24 on 3 GPUs', rows of '0.0 MiB / 0.0 MiB' and '0.000' s, and a
    summary ending 'predicted nan'."""
    monkeypatch.setattr(runner, "launch", _ran(tmp_path))
    printed: list[str] = []
    assert runner.run_job(_options(tmp_path), out=printed.append) == 0
    text = "\n".join(printed)
    assert "Plan for gpt-tiny: global batch 6 on 2 CPU ranks (memory fraction 80%)" in text
    rows = [line for line in text.splitlines() if line.startswith(("   0  cpu", "   1  cpu"))]
    assert len(rows) == 2 and all("0.0 MiB" not in r and "0.000" not in r for r in rows), rows
    assert all(r.split()[-3:] == ["/", "-", "-"] for r in rows), rows  # memory, cap, step s
    (throughput,) = [line for line in text.splitlines() if "throughput" in line]
    assert throughput == ("  throughput  measured 40.00 samples/s (no prediction: the plan "
                          "was given by hand)"), throughput
    assert "nan" not in text
