"""What a newcomer trips over (issue 26), checked at the unit level where a real run is not
needed: the runner with its rank launcher replaced, the report and export helpers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from cephalo.api.plan import Plan
from cephalo.local import runner
from cephalo.local.checks import RunOptions
from cephalo.local.ranks import LaunchResult

from .cli_helpers import TINY_JOB


def _given_plan(folder: Path, batch_sizes: tuple[int, ...] = (4, 2)) -> Path:
    n = len(batch_sizes)
    plan = {"global_batch_size": sum(batch_sizes), "world_size": n,
            "ranks": [{"rank": i, "gpu": "cpu", "batch_size": b, "micro_batch_size": b,
                       "num_micro_batches": 1, "shard_ratio": 1 / n}
                      for i, b in enumerate(batch_sizes)]}
    path = folder / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def _options(tmp_path: Path, job_text: str | None = None, **extra) -> RunOptions:
    job = tmp_path / "tiny.yaml"
    job.write_text(job_text or TINY_JOB.format(name="tiny", batch=6, steps=4))
    return RunOptions(job_path=str(job), devices="cpu:2",
                      plan_path=str(_given_plan(tmp_path)),
                      runs_root=str(tmp_path / "runs"), **extra)


def _interrupted_after(checkpoint_steps: list[int]):
    """A launcher that "ran" until Ctrl-C, leaving these complete checkpoints."""
    def launch(plan, ranks, run_dir: Path, *args, **kwargs) -> LaunchResult:
        for step in checkpoint_steps:
            folder = run_dir / "checkpoints" / f"step-{step:08d}"
            folder.mkdir(parents=True)
            (folder / "COMPLETE").write_text("")
        return LaunchResult(returncode=130, checkpoint_dir=str(run_dir / "checkpoints"))
    return launch


@pytest.mark.parametrize(("steps", "expected", "absent"), [
    ([], "stopped before any checkpoint was complete", "--resume"),
    ([2, 4], "the last complete checkpoint is step 4. Continue from it with: cephalo run ",
     "nothing to resume"),
])
def test_ctrl_c_offers_resume_only_with_a_checkpoint(tmp_path, monkeypatch, steps, expected,
                                                     absent) -> None:
    """Issue 26 item 1: Ctrl-C before the first checkpoint offered `--resume`, which then
    answered "holds no complete checkpoint"."""
    monkeypatch.setattr(runner, "launch", _interrupted_after(steps))
    printed: list[str] = []
    assert runner.run_job(_options(tmp_path), out=printed.append) == 130
    last = printed[-1]
    assert expected in last and absent not in last, last
    if steps:  # the same devices and plan again
        assert (f"--devices cpu:2 --plan {tmp_path / 'plan.json'} --resume "
                f"--run-dir {tmp_path / 'runs' / 'tiny'}/") in last, last


def test_tokenize_defaults_to_byte_level(tmp_path, capsys) -> None:
    """Issue 26 item 10: `cephalo tokenize` required --tokenizer, though byte-level is the
    default everywhere else (data.text.tokenizer, scripts/text_to_tokens.py)."""
    from cephalo.cli import main

    (tmp_path / "a.txt").write_text("hi\n")
    out = tmp_path / "t.bin"
    assert main(["tokenize", str(tmp_path / "a.txt"), "--output", str(out)]) == 0
    said = capsys.readouterr().out
    assert "tokenizer byte-level" in said
    assert "of 1 document from 1 file to" in said, said  # issue 26 item 13: '1 documents'
    assert np.fromfile(out, dtype=np.uint16).tolist() == [*b"hi\n", 10]  # text, then EOS


def _finished(run_dir: Path):
    def launch(*args, **kwargs) -> LaunchResult:
        return LaunchResult(returncode=0, checkpoint_dir=str(run_dir / "checkpoints"))
    return launch


def test_resume_with_other_steps_says_how_the_schedule_changes(tmp_path, monkeypatch) -> None:
    """Issue 26 item 5: `--resume --steps 60` after a 200-step run changed the cosine
    schedule without a word (lr 2.91e-03 -> 1.95e-03 at the step it resumed from)."""
    run_dir = tmp_path / "runs" / "tiny" / "20260101-000000"
    (run_dir / "checkpoints" / "step-00000040").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-00000040" / "COMPLETE").write_text("")
    first = _options(tmp_path, TINY_JOB.format(name="tiny", batch=6, steps=200))
    runner.write_job(runner.load_job(first.job_path), first, run_dir)  # as the first run did
    monkeypatch.setattr(runner, "launch", _finished(run_dir))
    printed: list[str] = []
    options = _options(tmp_path, TINY_JOB.format(name="tiny", batch=6, steps=200),
                       resume=True, steps=60)
    assert runner.run_job(options, out=printed.append) == 0
    from cephalo.api.job import TrainingSpec
    from cephalo.trainer.optim import learning_rate

    before = learning_rate(TrainingSpec(steps=200, learningRate=1e-2), 40)
    after = learning_rate(TrainingSpec(steps=60, learningRate=1e-2), 40)
    note = [line for line in printed if "learning-rate schedule" in line]
    assert note == [f"Resuming after step 40 with training.steps 60 (the run had 200): the "
                    f"learning-rate schedule now ends at step 60; lr at step 41 "
                    f"{before:.2e} -> {after:.2e}"], printed
    # The same steps again: nothing to say.
    printed.clear()
    assert runner.run_job(_options(tmp_path, resume=True, steps=60),
                          out=printed.append) == 0
    assert not [line for line in printed if "learning-rate schedule" in line], printed


@pytest.mark.parametrize("extra_ranks", [0, 1])
def test_more_cpu_ranks_than_cores_is_said(tmp_path, monkeypatch, extra_ranks) -> None:
    """Issue 26 item 4: `--devices cpu:8` on 2 cores started the ranks without a word (0.30 s
    of a 0.37 s step then waited on collectives)."""
    cores = os.cpu_count() or 1
    ranks = cores + extra_ranks
    options = _options(tmp_path, TINY_JOB.format(name="tiny", batch=ranks, steps=4))
    options.devices = f"cpu:{ranks}"
    _given_plan(tmp_path, (1,) * ranks)
    monkeypatch.setattr(runner, "launch", _finished(tmp_path))
    printed: list[str] = []
    assert runner.run_job(options, out=printed.append) == 0
    warned = [line for line in printed if "share" in line and "cores" in line]
    assert warned == ([f"note: {ranks} CPU ranks on {cores} cores: ranks share cores, and "
                       "each collective waits for ranks the OS has not scheduled (expect "
                       f"slower steps than predicted); --devices cpu:{cores} gives each its "
                       "own"] if extra_ranks else []), printed


def _record(step: int, world: int = 2) -> dict:
    rank = {"compute_seconds": 0.1, "collective_wait_seconds": 0.02}
    return {"step": step, "loss": 6.0 - step / 100, "step_seconds": 0.15,
            "samples_per_second": 40.0, "ranks": [rank] * world}


def test_loss_plot_shows_the_whole_history_with_whole_steps(tmp_path) -> None:
    """Issue 26 item 2: after --resume loss.png showed only the resumed steps (61-80 of 80 in
    metrics.jsonl), with ticks at 62.5 and 67.5."""
    from cephalo.local.report import loss_figure, read_history

    history = [_record(s) for s in range(1, 81)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    figure = loss_figure(read_history(tmp_path / "metrics.jsonl"))
    ax = figure.axes[0]
    assert list(ax.lines[0].get_xdata()) == list(range(1, 81))
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    short = loss_figure([_record(s) for s in range(61, 81)]).axes[0]  # was 62.5, 67.5, ...
    ticks = [t for t in short.get_xticks() if short.get_xlim()[0] <= t <= short.get_xlim()[1]]
    assert all(float(t).is_integer() for t in ticks), ticks


def test_resume_plots_the_runs_whole_history(tmp_path, monkeypatch) -> None:
    run_dir = tmp_path / "runs" / "tiny" / "20260101-000000"
    (run_dir / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-00000002" / "COMPLETE").write_text("")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(_record(s)) + "\n"
                                                   for s in (1, 2, 3, 4)))

    def launch(*args, **kwargs) -> LaunchResult:  # this segment: steps 3-4
        return LaunchResult(0, records=[_record(3), _record(4)],
                            checkpoint_dir=str(run_dir / "checkpoints"))
    plotted: list[list[int]] = []
    monkeypatch.setattr(runner, "launch", launch)
    monkeypatch.setattr(runner, "write_plots", lambda history, *a, **k: plotted.append(
        [r["step"] for r in history]) or [])
    assert runner.run_job(_options(tmp_path, resume=True), out=lambda *_: None) == 0
    assert plotted == [[1, 2, 3, 4]]


def test_version(capsys) -> None:
    """Issue 26 item 13: no `cephalo --version`."""
    from importlib.metadata import version

    from cephalo.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"cephalo {version('cephalo')}"


def test_time_breakdown_fills_its_image_and_shows_the_predicted_step(tmp_path) -> None:
    """Issue 26 item 13: a third of time_breakdown.png was empty between the axis and the
    legend below it, and the predicted step was not shown."""
    from cephalo.local.report import breakdown_figure, summarize

    plan = Plan.model_validate(json.loads(_given_plan(tmp_path).read_text()) | {
        "predicted_step_seconds": 0.13})
    summary = summarize([_record(s) for s in (1, 2, 3)], plan)
    assert summary is not None
    figure = breakdown_figure(summary, ["cpu:0", "cpu:1"], plan.predicted_step_seconds)
    ax = figure.axes[0]
    assert [line.get_label() for line in ax.lines] == ["predicted step 0.130 s"]
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    (legend,) = [*figure.legends, *filter(None, [ax.get_legend()])]
    box, image = legend.get_window_extent(renderer), figure.bbox
    assert image.x0 <= box.x0 and box.x1 <= image.x1 and image.y0 <= box.y0  # on the image
    used = box.union([box, ax.get_tightbbox(renderer)])  # axes, labels, title and legend
    assert used.height >= 0.9 * image.height, (used.height, image.height)
