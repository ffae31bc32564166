"""spec.tracking.tensorboard on a real `cephalo run` (issue 38): rank 0's event files read back
with TensorBoard's own reader (EventAccumulator) agree with the run's progress file and plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .cli_helpers import run_cephalo

pytestmark = pytest.mark.slow


def test_rank_0_writes_event_files_tensorboard_reads_back(tmp_path: Path, tiny_job) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = tiny_job(steps=4)
    job.write_text(job.read_text().replace("seed: 3}", "seed: 3, evalIntervalSteps: 2}")
                   + "  tracking: {tensorboard: true}\n")
    # A given plan (no profiling: the test stays short); its prediction is what TensorBoard
    # must show next to the measured throughput.
    (tmp_path / "plan.json").write_text(json.dumps({
        "global_batch_size": 6, "world_size": 2, "predicted_step_seconds": 0.5,
        "predicted_samples_per_second": 12.0,
        "ranks": [{"rank": i, "batch_size": 3, "micro_batch_size": 3, "num_micro_batches": 1,
                   "shard_ratio": 0.5} for i in range(2)]}))
    done = run_cephalo(tmp_path, "run", str(job), "--devices", "cpu:2", "--plan", "plan.json")
    assert done.returncode == 0, done.stdout + done.stderr
    (run_dir,) = (tmp_path / "runs" / "tiny").iterdir()
    assert f"tensorboard --logdir {run_dir / 'tensorboard'}" in done.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((run_dir / "plan.json").read_text())

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()

    def scalars(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in events.Scalars(tag)]

    for key, tag in (("loss", "loss/train"), ("samples_per_second",
                                              "throughput/samples_per_second"),
                     ("learning_rate", "optimizer/learning_rate")):
        assert scalars(tag) == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records]
    assert [s for s, _ in scalars("loss/validation")] == [2, 4]
    assert scalars("loss/validation") == [
        (r["step"], pytest.approx(r["validation_loss"], rel=1e-6)) for r in records
        if "validation_loss" in r]
    assert scalars("throughput/predicted_samples_per_second") == [(r["step"], 12.0)
                                                                   for r in records]
    for rank in range(plan["world_size"]):  # every rank's compute and wait, from rank 0
        assert [s for s, _ in scalars(f"ranks/compute_seconds/rank{rank}")] == [1, 2, 3, 4]
    (text,) = events.Tensors("plan/text_summary")
    assert f'"world_size": {plan["world_size"]}' in text.tensor_proto.string_val[0].decode()


def test_without_tracking_no_event_files_and_missing_package_is_refused(tmp_path: Path,
                                                                       tiny_job) -> None:
    """No tracking: nothing written (the same run as every other local test, which asserts
    its files); asked for without the package: one line before anything starts."""
    import subprocess
    import sys

    job = tiny_job(steps=1)
    job.write_text(job.read_text() + "  tracking: {tensorboard: true}\n")
    # The `tensorboard` module hidden from this one process, as on a machine without it.
    code = ("import sys, importlib.util as u; real = u.find_spec; u.find_spec = lambda n, *a: "
            "None if n == 'tensorboard' else real(n, *a); from cephalo.cli import main; "
            f"sys.argv = ['cephalo', 'run', {str(job)!r}]; sys.exit(main())")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "spec.tracking.tensorboard: the tensorboard package is not installed" in done.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("rank-*.log"))
