"""`cephalo run` end to end on CPU ranks: the real profiler, planner and trainer processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .cli_helpers import (
    TINY_JOB,
    cephalo_cmd,
    run_cephalo,
    run_cephalo_in_process,
    trainer_pids,
)

pytestmark = pytest.mark.slow


def _run_dir(cwd: Path, name: str) -> Path:
    (run_dir,) = sorted((cwd / "runs" / name).iterdir())
    return run_dir


@pytest.fixture(scope="module")
def emulated_auto_run(tmp_path_factory: pytest.TempPathFactory
                      ) -> tuple[Path, subprocess.CompletedProcess]:
    """One profiled `cephalo run` that two tests read (each profiling pass is a torchrun
    and a profiler per precision, each importing torch): three emulated GPUs of the three
    precisions `precision: auto` gives (bf16 RTX A6000, fp16 V100, fp32 P40), 6 steps.
    Profiled up to the global batch (6), the most one rank can take (a loaded machine's
    measured latency made the planner put all 6 on the A6000, the others holding state
    only): no plan needs a size above the profiled ones, so none needs an extra profiler
    pass (a process of its own, whose use depended on the measured speeds, so on load; it
    has its own test: test_run_extra_sizes.py). Returns (the working folder, the run)."""
    cwd = tmp_path_factory.mktemp("emulated-auto")
    job = cwd / "tiny.yaml"
    job.write_text(TINY_JOB.format(name="tiny", batch=6, steps=6).replace(
        "  globalBatchSize:", "  precision: auto\n  globalBatchSize:").replace(
        "[1, 2, 4]", "[1, 2, 4, 6]"))
    return cwd, run_cephalo(cwd, "run", str(job), "--emulate", "RTX-A6000,V100-16GB,P40")


def test_run_trains_and_leaves_a_complete_run_directory(emulated_auto_run) -> None:
    cwd, done = emulated_auto_run
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "EMULATION: emulated P40" in out and "(EMULATED GPUs on this CPU)" in out
    # What the profiler did (issue 26 item 13: 'Profiling 2 device type(s)', then silence)
    assert "Profiling cpu (compute profiles are cached" in out, out
    assert "  profiled cpu (cpu, gpt-tiny, micro-batch sizes 1, 2, 4, 6, measured in " in out, out
    assert "Measuring micro-batch size" not in out, out
    assert "Summary" in out and "measured" in out and "predicted" in out
    run_dir = _run_dir(cwd, "tiny")
    for name in ("job.yaml", "plan.json", "metrics.jsonl", "loss.png", "time_breakdown.png",
                 "logs/rank-0.log", "logs/rank-1.log", "logs/rank-2.log",
                 "profiles/measured-cpu.json", "profiles/emulated-P40.json"):
        assert (run_dir / name).is_file(), name
    plan = json.loads((run_dir / "plan.json").read_text())
    assert [r["gpu"] for r in plan["ranks"]] == ["RTX-A6000", "V100-16GB", "P40"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["loss"] < records[0]["loss"]
    assert any((run_dir / "checkpoints").iterdir())
    assert trainer_pids(str(cwd)) == []


def test_auto_profiles_the_cpu_per_precision_and_plans_each_rank_in_its_own(
        emulated_auto_run) -> None:
    """`cephalo run` under `precision: auto` on emulated GPUs (issue 36): the CPU is profiled
    in each precision the emulated GPUs compute in, each emulated GPU's profile is that one
    (so the planner accepts it), and the plan gives each rank its GPU's fastest precision."""
    cwd, done = emulated_auto_run
    assert done.returncode == 0, done.stdout + done.stderr
    assert "precision: auto: bf16 on 1 RTX-A6000, fp16 on 1 V100-16GB, fp32 on 1 P40" \
        in done.stdout, done.stdout
    profiles = _run_dir(cwd, "tiny") / "profiles"
    measured = {name: json.loads((profiles / f"{name}.json").read_text())
                for name in ("measured-cpu", "measured-cpu-bf16", "measured-cpu-fp16")}
    # The CPU's own precision under auto is fp32; the others were measured for the GPUs.
    assert [p["precision"] for p in measured.values()] == ["fp32", "bf16", "fp16"]
    for gpu, source in (("RTX-A6000", "measured-cpu-bf16"), ("V100-16GB", "measured-cpu-fp16"),
                        ("P40", "measured-cpu")):
        emulated = json.loads((profiles / f"emulated-{gpu}.json").read_text())
        assert (emulated["precision"], emulated["model_key"]) == (
            measured[source]["precision"], measured[source]["model_key"]), gpu
    plan = json.loads((_run_dir(cwd, "tiny") / "plan.json").read_text())
    assert plan["precision"] == "auto"
    assert [(r["gpu"], r["precision"]) for r in plan["ranks"]] == [
        ("RTX-A6000", "bf16"), ("V100-16GB", "fp16"), ("P40", "fp32")]


@pytest.mark.parametrize("content,args,message", [
    ("spec: [unclosed", (), "not valid YAML"),
    ("apiVersion: cephalo.dev/v1alpha1\nkind: CephaloJob\nspec:\n  model: {preset: gpt-99}\n"
     "  globalBatchSize: 4\n", (), "unknown model preset 'gpt-99'"),
    (None, ("--devices", "cuda"), "no CUDA GPU is visible"),
    (None, ("--emulate", "L4,L4,L4", "--devices", "cpu:2"), "names 3 GPUs"),
])
def test_bad_input_is_one_clear_line(tmp_path, tiny_job, content, args, message) -> None:
    job = tiny_job() if content is None else tmp_path / "bad.yaml"
    if content is not None:
        job.write_text(content)
    done = run_cephalo(tmp_path, "run", str(job), *args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert trainer_pids(str(tmp_path)) == []


def _plan_file(tmp_path: Path, ranks: list[tuple[str, int]]) -> Path:
    plan = {"global_batch_size": sum(b for _, b in ranks), "world_size": len(ranks),
            "ranks": [{"rank": i, "gpu": gpu, "batch_size": b, "micro_batch_size": b,
                       "num_micro_batches": 1, "shard_ratio": 1 / len(ranks)}
                      for i, (gpu, b) in enumerate(ranks)]}
    plan["ranks"][-1]["shard_ratio"] = 1 - sum(r["shard_ratio"] for r in plan["ranks"][:-1])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def test_plan_for_more_ranks_than_devices_is_refused(tmp_path, tiny_job) -> None:
    plan = _plan_file(tmp_path, [("cpu", 2), ("cpu", 2), ("cpu", 2)])
    done = run_cephalo(tmp_path, "run", str(tiny_job()), "--plan", str(plan),
                       "--devices", "cpu:2")
    assert done.returncode == 2
    assert "is for 3 ranks but 2 devices were selected" in done.stderr


def test_plan_for_other_gpus_is_refused(tmp_path, tiny_job) -> None:
    plan = _plan_file(tmp_path, [("A10G", 3), ("A10G", 3)])
    done = run_cephalo(tmp_path, "run", str(tiny_job()), "--plan", str(plan),
                       "--devices", "cpu:2")
    assert done.returncode == 2
    assert "rank 0 is planned for A10G but runs on cpu:0 (cpu)" in done.stderr


def test_given_plan_runs_under_the_emulation_it_was_planned_for(tmp_path, tiny_job) -> None:
    """`--plan` on emulated GPUs keeps the emulation: each rank's time dilation and the
    memory capacity the plan recorded (here the P40's is far below its training state, so
    the rank must refuse to start; before, it ran at the CPU's speed with no cap)."""
    plan = json.loads(_plan_file(tmp_path, [("RTX-A6000", 4), ("P40", 2)]).read_text())
    for rank, capacity in zip(plan["ranks"], [2**30, 2**20], strict=True):
        rank["memory_capacity_bytes"] = capacity
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    done = run_cephalo(tmp_path, "run", str(tiny_job()), "--plan", "plan.json",
                       "--emulate", "RTX-A6000,P40")
    assert "EMULATION: emulated P40: compute 3.29x slower than this CPU, memory 24 GiB -> " \
           "1.0 MiB" in done.stdout, done.stdout
    assert done.returncode == 1, done.stdout + done.stderr
    assert "rank 1 (cpu:1 emulating P40) failed" in done.stdout, done.stdout
    assert "its memory limit is 1.0 MiB" in done.stdout, done.stdout


def _wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError("condition not reached in time")


def _start(tmp_path: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / ".cache"))
    # A shell runs background jobs (`.ci/run &`) with SIGINT ignored, and a child inherits
    # that: Python then never raises KeyboardInterrupt. Ctrl-C is what the tests send, so
    # the command starts with SIGINT at its default, as in a terminal.
    return subprocess.Popen(cephalo_cmd(*args), cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _metrics_lines(tmp_path: Path) -> int:
    files = list((tmp_path / "runs").glob("*/*/metrics.jsonl"))
    return len(files[0].read_text().splitlines()) if files else 0


def test_a_crashed_rank_stops_the_others_with_its_error(tmp_path, tiny_job) -> None:
    # A given plan: profiling (a torchrun of its own, ~15 s) is not what this test is about
    # (test_run_trains_and_leaves_a_complete_run_directory profiles).
    plan = _plan_file(tmp_path, [("cpu", 3), ("cpu", 3)])
    proc = _start(tmp_path, "run", str(tiny_job(steps=400)), "--plan", str(plan),
                  "--devices", "cpu:2")
    try:
        _wait_for(lambda: _metrics_lines(tmp_path) >= 1)
        victims = [p for p in trainer_pids(str(tmp_path))
                   if b"RANK=1\x00" in Path(f"/proc/{p}/environ").read_bytes()]
        assert victims
        os.kill(victims[0], signal.SIGKILL)  # what the OOM killer does
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 1, out + err
    assert "rank 1 (cpu:1 (cpu)) failed with exit code -9" in out
    assert "the other ranks were stopped" in out
    _wait_for(lambda: trainer_pids(str(tmp_path)) == [], timeout=600)


def test_ctrl_c_stops_cleanly_and_resume_finishes_the_run(tmp_path, tiny_job) -> None:
    # enough steps that Ctrl-C lands mid-run: a tiny step takes ~30-40 ms, so 30 steps were
    # over before the signal. A checkpoint every 10 steps, not 2: the resumed run saves ~19
    # instead of ~95 (~25 ms each).
    job = tiny_job(steps=200)
    job.write_text(job.read_text().replace("intervalSteps: 2}", "intervalSteps: 10}"))
    # A given plan for both launches: what is tested is the stop and the resume, and each
    # profiling would be a torchrun of its own (~15 s; the first test here profiles).
    plan = str(_plan_file(tmp_path, [("cpu", 3), ("cpu", 3)]))
    proc = _start(tmp_path, "run", str(job), "--plan", plan, "--devices", "cpu:2")
    try:
        # Once a checkpoint is complete (what `--resume` needs; cephalo.local.checks).
        _wait_for(lambda: any((tmp_path / "runs").glob("*/*/checkpoints/step-*/COMPLETE")))
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 130, out + err
    assert "--resume" in out
    _wait_for(lambda: trainer_pids(str(tmp_path)) == [], timeout=600)
    run_dir = _run_dir(tmp_path, "tiny")
    done = run_cephalo(tmp_path, "run", str(job), "--plan", plan, "--devices", "cpu:2",
                       "--resume")
    assert done.returncode == 0, done.stdout + done.stderr
    assert _run_dir(tmp_path, "tiny") == run_dir  # continued the same run
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert "resumed from" in log
    steps = [json.loads(line)["step"] for line in
             (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 200


def test_sigterm_while_profiling_stops_the_profilers_too(tmp_path, tiny_job) -> None:
    # Session 9's README walk: `kill <cephalo run>` during profiling exited at once and left
    # the torchrun profiler and its workers running. SIGTERM is now handled as Ctrl-C is.
    job = tiny_job()
    proc = _start(tmp_path, "run", str(job), "--devices", "cpu:2")
    try:
        # the collectives profile: torchrun and its workers, each `cephalo.trainer.profile`
        _wait_for(lambda: len(trainer_pids(str(tmp_path))) >= 2, timeout=300)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 143, out + err
    assert "terminated" in err
    _wait_for(lambda: trainer_pids(str(tmp_path)) == [], timeout=30)


def test_given_plan_runs_real_text_without_profiling(tmp_path) -> None:
    """A given plan (`--plan`) runs as written with no profiling, on a token file's text,
    with a validation loss every 2 steps and at the last (issue 14). One launch for both
    verdicts: each launch costs ~8 s of CPU (every rank imports torch), whatever it tests."""
    repo = Path(__file__).resolve().parents[2]
    tokens = tmp_path / "data" / "bytes.bin"
    made = subprocess.run([sys.executable, str(repo / "scripts" / "text_to_tokens.py"),
                           str(repo / "README.md"), "--output", str(tokens)],
                          capture_output=True, text=True, check=True)
    assert "byte tokens" in made.stdout
    job = tmp_path / "text.yaml"
    job.write_text((repo / "examples" / "local-text.yaml").read_text()
                   .replace("steps: 40", "steps: 3")
                   .replace("warmupSteps: 4", "warmupSteps: 4\n    evalIntervalSteps: 2"))
    # The example's batch, split unevenly by the plan as written.
    plan = _plan_file(tmp_path, [("cpu", 16), ("cpu", 8)])
    done = run_cephalo(tmp_path, "run", str(job), "--plan", str(plan), "--devices", "cpu:2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Profiling" not in done.stdout
    assert "loss" in done.stdout and "over 3 steps" in done.stdout
    run_dir = _run_dir(tmp_path, "local-text")
    assert not (run_dir / "profiles").exists()
    written = (run_dir / "job.yaml").read_text()
    assert str(tokens) in written  # the relative path was made absolute for the ranks
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["batch_sizes"] == [16, 8]  # the plan as written
    measured = [(r["step"], r["validation_loss"]) for r in records if "validation_loss" in r]
    assert [step for step, _ in measured] == [2, 3]
    assert f"validation  loss {measured[0][1]:.4f} (step 2) -> {measured[1][1]:.4f} (step 3)" \
        in done.stdout


def test_resume_onto_more_ranks_summarizes_only_the_new_segment(tmp_path, tiny_job) -> None:
    """Issue 13: resuming a 1-rank run on 2 ranks trained, then crashed in the summary
    (the metrics file still held the first segment's 1-rank records)."""
    job = tiny_job(steps=4)
    one = _plan_file(tmp_path, [("cpu", 6)])
    first = run_cephalo(tmp_path, "run", str(job), "--plan", str(one), "--devices", "cpu:1",
                        "--steps", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    two = _plan_file(tmp_path, [("cpu", 4), ("cpu", 2)])
    done = run_cephalo(tmp_path, "run", str(job), "--plan", str(two), "--devices", "cpu:2",
                       "--resume")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "over steps 3-4 (resumed after step 2)" in done.stdout
    assert "rank 1 cpu:1" in done.stdout
    run_dir = _run_dir(tmp_path, "tiny")
    steps = [json.loads(line)["step"] for line in
             (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # the run's whole history stays in the metrics file


def test_hand_written_hybrid_plan_runs_end_to_end(tmp_path, tiny_job) -> None:
    """Hybrid sharding through `cephalo run`: two replica groups of two CPU ranks, the state
    sharded 0.6/0.4 in each (one block evenly), batches uneven over the job."""
    plan = json.loads(_plan_file(tmp_path, [("cpu", 2), ("cpu", 1), ("cpu", 2),
                                            ("cpu", 1)]).read_text())
    for rank, ratio in zip(plan["ranks"], [0.6, 0.4, 0.6, 0.4], strict=True):
        rank["shard_ratio"] = ratio
    plan["replica_groups"] = [[0, 1], [2, 3]]
    plan["unit_shard_ratios"] = {"1": [0.5, 0.5, 0.5, 0.5]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    done = run_cephalo(tmp_path, "run", str(tiny_job(steps=3)), "--plan", "plan.json",
                       "--devices", "cpu:4")
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = _run_dir(tmp_path, "tiny")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == 3
    (meta,) = [json.loads(p.read_text()) for p in run_dir.rglob("meta.json")
               if json.loads(p.read_text())["step"] == 3]
    assert meta["replica_groups"] == [[0, 1], [2, 3]]
    # Every rank wrote its piece of its slice (the optimizer state is split across groups).
    assert sorted(meta["files"]) == [f"rank-0000{r}.pt" for r in range(4)]
    # Per-unit ratios that differ between the groups at one position: refused up front
    # (main() in this process: a refusal's exit code and one line are the same there, and
    # test_bad_input_is_one_clear_line runs refusals through the real process).
    plan["unit_shard_ratios"] = {"1": [0.5, 0.5, 0.4, 0.6]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    bad = run_cephalo_in_process(tmp_path, "run", str(tiny_job(steps=3)), "--plan", "plan.json",
                      "--devices", "cpu:4")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "cephalo run: error: plan.json: unit_shard_ratios[1]: rank 2 holds 0.4 but rank 0 at "
        "the same position of replica group [0, 1] holds 0.5; ranks at one position hold the "
        "same slice"]
