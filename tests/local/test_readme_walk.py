"""What the README walk on a clean checkout found (issue 26, "README walked end to end"):
`cephalo run --plan` as the README describes it, checked with the rank launcher replaced."""

from __future__ import annotations

from pathlib import Path

import pytest

from cephalo.api.plan import IdleGpus, Plan, RankPlan
from cephalo.local import runner
from cephalo.local.ranks import LaunchResult, RankEnv

from .test_newcomer import _given_plan, _options, _record


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


def _planned_with_idle(folder: Path, used: int) -> Path:
    """A plan as `cephalo run` writes it (runs/<job>/<timestamp>/plan.json) on RTX-A6000,P40
    when the planner left one of them idle: one rank naming its device by gpu_index."""
    gpus = ["RTX-A6000", "P40"]
    plan = Plan(global_batch_size=6, world_size=1, predicted_step_seconds=0.15,
                predicted_samples_per_second=40.0,
                ranks=[RankPlan(rank=0, gpu=gpus[used], pool="local", batch_size=6,
                                micro_batch_size=6, num_micro_batches=1, shard_ratio=1.0,
                                predicted_step_seconds=0.15, predicted_memory_bytes=30 << 20,
                                memory_capacity_bytes=40 << 20, gpu_index=used,
                                estimated=False)],
                idle_gpus=[IdleGpus(gpu=gpus[1 - used], pool="local", count=1,
                                    reason="fewer GPUs are faster")])
    path = folder / "plan.json"
    path.write_text(plan.to_json())
    return path


@pytest.mark.parametrize(("used", "label", "dilation"), [
    (0, "cpu:0 emulating RTX-A6000", 1.0),
    (1, "cpu:1 emulating P40", 3.29)])  # relative to the idle A6000, as when it was planned
def test_a_runs_own_plan_with_an_idle_gpu_runs_again(tmp_path, monkeypatch, used, label,
                                                     dilation) -> None:
    """The walk's `cephalo run examples/quickstart.yaml --plan runs/quickstart/<ts>/plan.json`
    (the planner had left the P40 idle) answered 'is for 1 ranks but 2 devices were
    selected': a run's own plan could not be run again on the devices it was planned for."""
    launched: list[list[RankEnv]] = []

    def launch(plan, ranks, run_dir: Path, *args, **kwargs) -> LaunchResult:
        launched.append(ranks)
        return _ran(run_dir, world=1)()
    monkeypatch.setattr(runner, "launch", launch)
    options = _options(tmp_path, emulate="RTX-A6000,P40")
    options.devices = None
    options.plan_path = str(_planned_with_idle(tmp_path, used))
    printed: list[str] = []
    assert runner.run_job(options, out=printed.append) == 0, printed
    (ranks,) = launched
    assert [r.device.label for r in ranks] == [label]
    assert ranks[0].dilation == pytest.approx(dilation, abs=0.005)
    assert ranks[0].memory_limit_bytes == 40 << 20


def test_a_plan_for_fewer_ranks_without_device_indices_is_refused_in_words(tmp_path) -> None:
    from cephalo.local.checks import RunError

    options = _options(tmp_path)  # cpu:2
    options.plan_path = str(_given_plan(tmp_path, (6,)))
    with pytest.raises(RunError, match=r"is for 1 rank but 2 devices were selected .*"
                                       r"with 1 device or re-plan"):
        runner.run_job(options, out=lambda *_: None)
