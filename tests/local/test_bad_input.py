"""Bad input to the real `cephalo` command, as a new user (or an attacker) would give it
(issue 17): every case exits with code 2 and one stderr line, shows no traceback, starts no
process and writes nothing — checked on the whole working folder, before and after. Every
case runs the command's main() in the test's process (a Python process started fails it);
a case of each kind also runs as its own `cephalo` process (each process costs about a
second of an interpreter's and the libraries' start-up: 53 of them were 47 s of the suite)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from .cli_helpers import TINY_JOB, run_cephalo

Setup = Callable[[Path], list[str]]  # prepares files in the folder, returns the arguments


def _job(path: Path, text: str) -> str:
    path.write_text(text)
    return path.name


def _tiny(**replace: str) -> str:
    text = TINY_JOB.format(name="tiny", batch=8, steps=2)
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    return text


def _plan(batch_sizes: list[int], **extra: object) -> dict:
    n = len(batch_sizes)
    return {"global_batch_size": sum(batch_sizes), "world_size": n,
            "ranks": [{"rank": i, "batch_size": b, "micro_batch_size": b,
                       "num_micro_batches": 1, "shard_ratio": 1 / n}
                      for i, b in enumerate(batch_sizes)], **extra}


# The 578-byte "billion laughs" of issue 17, in metadata: 9^9 expansions.
ALIAS_BOMB = """\
apiVersion: cephalo.dev/v1alpha1
kind: CephaloJob
metadata:
  name: bomb
  a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
  b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
  c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
  d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
  e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
  f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
  g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
  h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
  i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
spec: {model: {preset: gpt-tiny}, globalBatchSize: 8}
"""


def folder_as_job(d: Path) -> list[str]:
    (d / "job.yaml").mkdir()
    return ["run", "job.yaml", "--devices", "cpu:2"]


def deep_yaml(d: Path) -> list[str]:
    return ["run", _job(d / "deep.yaml", "metadata: " + "[" * 20_000 + "]" * 20_000 + "\n"),
            "--devices", "cpu:2"]


def alias_bomb(d: Path) -> list[str]:
    assert len(ALIAS_BOMB) < 700
    return ["run", _job(d / "bomb.yaml", ALIAS_BOMB), "--devices", "cpu:2"]


def alias_bomb_plan(d: Path) -> list[str]:
    return ["plan", "--gpus", "2xL4", "--job", _job(d / "bomb.yaml", ALIAS_BOMB)]


def huge_scalar(d: Path) -> list[str]:
    with (d / "big.yaml").open("w") as f:
        f.write(_tiny() + "  note: ")
        chunk = "x" * 2**20
        for _ in range(100):  # 100 MB on one line
            f.write(chunk)
        f.write("\n")
    return ["run", "big.yaml", "--devices", "cpu:2"]


def batch_1e9(d: Path) -> list[str]:
    text = _tiny(**{"globalBatchSize: 8": "globalBatchSize: 1000000000"})
    return ["run", _job(d / "j.yaml", text), "--devices", "cpu:2"]


def batch_1e9_plan(d: Path) -> list[str]:
    return ["plan", "--gpus", "2xL4", "--model", "gpt-tiny", "--batch-size", "1000000000"]


def batch_exponent(d: Path) -> list[str]:
    return ["run", _job(d / "j.yaml", _tiny(**{"globalBatchSize: 8": "globalBatchSize: 1e9"})),
            "--devices", "cpu:2"]


def batch_true(d: Path) -> list[str]:
    return ["run", _job(d / "j.yaml", _tiny(**{"globalBatchSize: 8": "globalBatchSize: true"})),
            "--devices", "cpu:2"]


def learning_rate_inf(d: Path) -> list[str]:
    return ["run", _job(d / "j.yaml", _tiny(**{"learningRate: 1.0e-2": "learningRate: .inf"})),
            "--devices", "cpu:2"]


def profile_size_zero(d: Path) -> list[str]:
    return ["run", _job(d / "j.yaml", _tiny(**{"[1, 2, 4]": "[0]"})), "--devices", "cpu:2"]


def name_escapes_runs(d: Path) -> list[str]:
    return ["run", _job(d / "j.yaml", _tiny(**{"name: tiny": "name: ../../escape"})),
            "--devices", "cpu:2"]


def name_absolute(d: Path) -> list[str]:
    return ["run", _job(d / "j.yaml", _tiny(**{"name: tiny": f"name: {d / 'abs'}"})),
            "--devices", "cpu:2"]


def many_errors_one_line(d: Path) -> list[str]:
    text = ("apiVersion: cephalo.dev/v1alpha1\nkind: CephaloJob\nmetadata: {name: m}\n"
            "spec:\n  model: {family: gpt, numLayers: x, hiddenSize: [1], numHeads: -1}\n"
            "  globalBatchSize: '8'\n  training: {steps: 0, seed: -1, schedule: wavy}\n"
            "  precision: fp8\n")
    return ["run", _job(d / "j.yaml", text), "--devices", "cpu:2"]


def not_utf8(d: Path) -> list[str]:
    (d / "j.yaml").write_bytes(b"\xff\xfe" + _tiny().encode("utf-16-le"))
    return ["run", "j.yaml", "--devices", "cpu:2"]


def resume_empty_run(d: Path) -> list[str]:
    """A rejected run (of an older version) left an empty folder: --resume must not pick
    it and silently start at step 0."""
    (d / "runs" / "tiny" / "20250101-000000").mkdir(parents=True)
    return ["run", _job(d / "j.yaml", _tiny()), "--devices", "cpu:2", "--resume"]


def resume_mistyped_run_dir(d: Path) -> list[str]:
    (d / "runs" / "tiny").mkdir(parents=True)
    return ["run", _job(d / "j.yaml", _tiny()), "--devices", "cpu:2", "--resume",
            "--run-dir", "runs/tiny/2025O101-000000"]


def plan_batch_mismatch(d: Path) -> list[str]:
    (d / "plan.json").write_text(json.dumps(_plan([2, 2])))
    return ["run", _job(d / "j.yaml", _tiny()), "--devices", "cpu:2", "--plan", "plan.json"]


def plan_bad_unit_ratios(d: Path) -> list[str]:
    (d / "plan.json").write_text(json.dumps(_plan([4, 4], unit_shard_ratios={"0": [0.9, 0.9]})))
    return ["run", _job(d / "j.yaml", _tiny()), "--devices", "cpu:2", "--plan", "plan.json"]


def plan_unit_out_of_range(d: Path) -> list[str]:
    (d / "plan.json").write_text(json.dumps(_plan([4, 4], unit_shard_ratios={"99": [0.5, 0.5]})))
    return ["run", _job(d / "j.yaml", _tiny()), "--devices", "cpu:2", "--plan", "plan.json"]


def plan_is_a_folder(d: Path) -> list[str]:
    (d / "plan.json").mkdir()
    return ["run", _job(d / "j.yaml", _tiny()), "--devices", "cpu:2", "--plan", "plan.json"]


def plan_deep_json(d: Path) -> list[str]:
    (d / "plan.json").write_text("[" * 100_000 + "]" * 100_000)
    return ["run", _job(d / "j.yaml", _tiny()), "--devices", "cpu:2", "--plan", "plan.json"]


def plan_emulated_without_capacity(d: Path) -> list[str]:
    """A hand-written plan for emulated GPUs says nothing to cap their memory at."""
    (d / "plan.json").write_text(json.dumps(_plan([4, 4])))
    return ["run", _job(d / "j.yaml", _tiny()), "--emulate", "RTX-A6000,P40", "--plan",
            "plan.json"]


def plan_of_real_gpus_under_emulation(d: Path) -> list[str]:
    """A plan `cephalo plan --json` made from catalog estimates of real GPUs (issue 26
    item 3: run on emulated ones it printed 'compute x1.00 slower', capped memory at the real
    card's 22 GiB and reported 0.06x its prediction)."""
    plan = _plan([4, 4])
    for rank, gpu in zip(plan["ranks"], ["RTX-A6000", "P40"], strict=True):
        rank.update(gpu=gpu, estimated=True, memory_capacity_bytes=24 * 2**30)
    (d / "plan.json").write_text(json.dumps(plan))
    return ["run", _job(d / "j.yaml", _tiny()), "--emulate", "RTX-A6000,P40", "--plan",
            "plan.json"]


def steps_beyond_the_limit(d: Path) -> list[str]:
    """--steps overrides the job's steps within the job's own limits (the error named the
    job.yaml of a run folder it had written and then removed)."""
    return ["run", _job(d / "j.yaml", _tiny()), "--devices", "cpu:2", "--steps", str(10**11)]


def memory_scale_nan(d: Path) -> list[str]:
    return ["run", _job(d / "j.yaml", _tiny()), "--emulate", "RTX-A6000,P40",
            "--emulate-memory-scale", "nan"]


def memory_scale_negative(d: Path) -> list[str]:
    return ["run", _job(d / "j.yaml", _tiny()), "--emulate", "RTX-A6000,P40",
            "--emulate-memory-scale", "-1"]


def memory_scale_without_emulation(d: Path) -> list[str]:
    return ["run", _job(d / "j.yaml", _tiny()), "--devices", "cpu:2",
            "--emulate-memory-scale", "0.001"]


def missing_token_file(d: Path) -> list[str]:
    text = _tiny(**{"checkpoint:": "data: {tokenFile: {path: missing.bin}}\n  checkpoint:"})
    return ["run", _job(d / "j.yaml", text), "--devices", "cpu:2"]


def missing_token_file_with_a_plan(d: Path) -> list[str]:
    """The same pre-flight checks with --plan (issue 26 item 6: the ranks started, exited 1
    with the error on stdout and left a run folder)."""
    (d / "plan.json").write_text(json.dumps(_plan([4, 4])))
    text = _tiny(**{"checkpoint:": "data: {tokenFile: {path: missing.bin}}\n  checkpoint:"})
    return ["run", _job(d / "j.yaml", text), "--devices", "cpu:2", "--plan", "plan.json"]


def missing_token_file_on_a_claim(d: Path) -> list[str]:
    """A cluster job (its token file on a PVC) run with `cephalo run`, which mounts no
    volume and reads the path on this machine (issue 26: it profiled gpt-1.3b for minutes,
    then the ranks failed on the missing file)."""
    text = _tiny(**{"checkpoint:": "data: {tokenFile: {path: /data/cephalo-no-such/train.bin,"
                                   " claimName: datasets}}\n  checkpoint:"})
    return ["run", _job(d / "j.yaml", text), "--devices", "cpu:2"]


def missing_text_on_a_claim(d: Path) -> list[str]:
    text = _tiny(**{"checkpoint:": "data: {text: {path: /data/cephalo-no-such/corpus.jsonl,"
                                   " claimName: corpora}}\n  checkpoint:"})
    return ["run", _job(d / "j.yaml", text), "--devices", "cpu:2"]


def token_file_is_a_folder(d: Path) -> list[str]:
    (d / "tokens").mkdir()
    text = _tiny(**{"checkpoint:": "data: {tokenFile: {path: tokens}}\n  checkpoint:"})
    return ["run", _job(d / "j.yaml", text), "--devices", "cpu:2"]


def plan_job_is_a_folder(d: Path) -> list[str]:
    (d / "job").mkdir()
    return ["plan", "--gpus", "2xL4", "--job", "job"]


def plan_unknown_gpu(d: Path) -> list[str]:
    return ["plan", "--gpus", "2xVoodoo-5", "--model", "gpt-tiny", "--batch-size", "8"]


def plan_too_many_gpus(d: Path) -> list[str]:
    return ["plan", "--gpus", "99999999999xL4", "--model", "gpt-tiny", "--batch-size", "8"]


def profile_is_a_folder(d: Path) -> list[str]:
    (d / "profiles" / "L4.json").mkdir(parents=True)
    return ["plan", "--gpus", "2xL4", "--model", "gpt-tiny", "--batch-size", "8",
            "--profiles", "profiles"]


def profile_is_garbage(d: Path) -> list[str]:
    (d / "profiles").mkdir()
    (d / "profiles" / "L4.json").write_text(json.dumps({"product": 7, "points": "many"}))
    return ["plan", "--gpus", "2xL4", "--model", "gpt-tiny", "--batch-size", "8",
            "--profiles", "profiles"]


def profile_of_another_model(d: Path) -> list[str]:
    """A profile measured for gpt-small, given to plan gpt-tiny: its times and memory are
    another model's (it planned with them without a word)."""
    from cephalo.api import preset
    from cephalo.planner import estimate_profile
    from cephalo.planner.cost.catalog import lookup_gpu

    (d / "profiles").mkdir()
    other = estimate_profile(lookup_gpu("L4"), preset("gpt-small"), "fp32", [1, 2])
    (d / "profiles" / "L4.json").write_text(other.model_dump_json())
    return ["plan", "--gpus", "2xL4", "--model", "gpt-tiny", "--batch-size", "8",
            "--profiles", "profiles"]


def crd_output_is_a_folder(d: Path) -> list[str]:
    (d / "out").mkdir()
    return ["crd", "--output", "out"]


def export_into_the_checkpoint(d: Path) -> list[str]:
    (d / "ckpt" / "step-00000004").mkdir(parents=True)
    return ["export", "ckpt", "--output", "ckpt/step-00000004/rank-00000.pt"]


def export_output_is_a_folder(d: Path) -> list[str]:
    (d / "ckpt").mkdir()
    (d / "out").mkdir()
    return ["export", "ckpt", "--output", "out"]


def export_pt_with_a_shard_size(d: Path) -> list[str]:
    (d / "ckpt").mkdir()
    return ["export", "ckpt", "--output", "m.pt", "--max-shard-size", "1GB"]


def export_pt_with_a_tokenizer(d: Path) -> list[str]:
    (d / "ckpt").mkdir()
    (d / "tok").mkdir()
    return ["export", "ckpt", "--output", "m.pt", "--tokenizer", "tok"]


def plan_model_without_gpus(d: Path) -> list[str]:
    return ["plan", "--model", "gpt-tiny", "--batch-size", "8"]


def plan_job_without_pools(d: Path) -> list[str]:
    """Without --gpus a job's gpuPools are the cluster; this job lists none."""
    return ["plan", "--job", _job(d / "j.yaml", _tiny())]


def export_config_output_is_a_folder(d: Path) -> list[str]:
    (d / "ckpt").mkdir()
    (d / "cfg").mkdir()
    return ["export", "ckpt", "--output", "m.pt", "--config-output", "cfg"]


def export_config_output_into_the_checkpoint(d: Path) -> list[str]:
    (d / "ckpt").mkdir()
    return ["export", "ckpt", "--output", "m.pt", "--config-output", "ckpt/config.json"]


def export_over_an_existing_output(d: Path) -> list[str]:
    (d / "ckpt").mkdir()
    (d / "m.pt").write_bytes(b"an earlier export")
    return ["export", "ckpt", "--output", "m.pt"]


def export_missing_checkpoint(d: Path) -> list[str]:
    return ["export", "no-such-ckpt", "--output", "model.pt"]


CASES: list[tuple[Setup, str]] = [  # (setup, a phrase the one line must contain)
    (folder_as_job, "is a folder"),
    (deep_yaml, "nested deeper than"),
    (alias_bomb, "through aliases"),
    (alias_bomb_plan, "through aliases"),
    (huge_scalar, "larger than 1 MiB"),
    (batch_1e9, "globalBatchSize: Input should be less than or equal to 65536"),
    (batch_1e9_plan, "globalBatchSize: Input should be less than or equal to 65536"),
    (batch_exponent, "globalBatchSize: Input should be a valid integer"),
    (batch_true, "globalBatchSize: Input should be a valid integer"),
    (learning_rate_inf, "learningRate: Input should be a finite number"),
    (profile_size_zero, "profileMicroBatchSizes.0: Input should be greater than or equal to 1"),
    (name_escapes_runs, "is not a job name"),
    (name_absolute, "is not a job name"),
    (many_errors_one_line, "and 3 more"),
    (not_utf8, "not UTF-8 text"),
    (resume_empty_run, "no earlier run of 'tiny' under runs/tiny holds a complete checkpoint"),
    (resume_mistyped_run_dir, "no such run folder"),
    (plan_batch_mismatch, "is for global batch 4 but the job's globalBatchSize is 8"),
    (plan_bad_unit_ratios, "unit_shard_ratios[0] must hold 2 ratios"),
    (plan_unit_out_of_range, "is not a unit index 0..3"),
    (plan_is_a_folder, "is a folder"),
    (plan_deep_json, "not valid JSON"),
    (plan_emulated_without_capacity, "rank 0 (emulated RTX-A6000) records no "
     "memory_capacity_bytes"),
    (plan_of_real_gpus_under_emulation, "rank 0's times are catalog estimates for a real "
     "RTX-A6000"),
    (steps_beyond_the_limit, "--steps 100000000000: steps: Input should be less than or equal "
     "to 100000000"),
    (memory_scale_nan, "--emulate-memory-scale nan must be in (0, 1]"),
    (memory_scale_negative, "--emulate-memory-scale -1.0 must be in (0, 1]"),
    (memory_scale_without_emulation, "--emulate-memory-scale applies to emulated GPUs only"),
    (missing_token_file, "missing.bin does not exist"),
    (missing_token_file_with_a_plan, "missing.bin does not exist"),
    (token_file_is_a_folder, "tokens is a folder"),
    (missing_token_file_on_a_claim, "/data/cephalo-no-such/train.bin does not exist on this "
     "machine (cephalo run mounts no volume"),
    (missing_text_on_a_claim, "/data/cephalo-no-such/corpus.jsonl"),
    (plan_job_is_a_folder, "is a folder"),
    (plan_unknown_gpu, "unknown GPU 'Voodoo-5'"),
    (plan_too_many_gpus, "count must be 1 to 100000"),
    (profile_is_a_folder, "is a folder"),
    (profile_is_garbage, "is not a GpuProfile: product: Input should be a valid string"),
    (profile_of_another_model, "the L4 profile was measured for another model or precision"),
    (crd_output_is_a_folder, "--output out: Is a directory"),
    (export_into_the_checkpoint, "lies inside the checkpoint directory ckpt"),
    (export_output_is_a_folder, "--output out is a directory"),
    (export_pt_with_a_shard_size, "--max-shard-size applies to --format hf only"),
    (export_pt_with_a_tokenizer, "--tokenizer applies to --format hf only"),
    (export_missing_checkpoint, "no-such-ckpt: no such checkpoint directory"),
    (plan_model_without_gpus, "--gpus is required with --model"),
    (plan_job_without_pools, "--gpus is required: the job lists no gpuPools"),
    (export_config_output_is_a_folder, "--config-output cfg is a directory"),
    (export_config_output_into_the_checkpoint, "--config-output ckpt/config.json lies inside "
     "the checkpoint directory ckpt"),
    (export_over_an_existing_output, "--output m.pt exists; pass --force to overwrite it"),
]


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*")}


_POPEN = subprocess.Popen


def _refuse_python_processes(args: object, *rest: object, **kwargs: object) -> object:
    """subprocess.Popen that fails on a Python process (a rank, torchrun, a profiler pass):
    library lookups (ctypes' `ldconfig -p` while finding NVML) may still run."""
    first = args[0] if isinstance(args, (list, tuple)) else str(args).split()[0]
    program = Path(str(first)).name
    if program.startswith("python") or program in {"torchrun", "cephalo"}:
        raise AssertionError(f"a rejected input started a process: {args}")
    return _POPEN(args, *rest, **kwargs)  # type: ignore[call-overload]


def _check(folder: Path, args: list[str], phrase: str, code: int | str | None, stdout: str,
           stderr: str, before: dict[str, tuple[int, int]]) -> None:
    lines = stderr.splitlines()
    assert code == 2, (code, stderr[-2000:])
    assert len(lines) == 1, stderr[-2000:]
    assert "Traceback" not in stderr
    assert lines[0].startswith(f"cephalo {args[0]}: error: "), lines[0]
    assert phrase in lines[0], lines[0]
    assert len(lines[0]) < 1500
    assert stdout == "" or "Profiling" not in stdout  # no process was started
    assert _snapshot(folder) == before, "a rejected input wrote files"


@pytest.mark.parametrize(("setup", "phrase"), CASES, ids=[c[0].__name__ for c in CASES])
def test_bad_input_is_one_clean_line_and_writes_nothing(
        tmp_path: Path, setup: Setup, phrase: str, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """The command's main() in this process (what `cephalo` runs, without an interpreter's
    start-up per case: the real process is checked on a few cases below), where starting
    a Python process (a rank, a profiler) fails the test."""
    from cephalo.cli import main

    args = setup(tmp_path)
    before = _snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / ".cache"))
    monkeypatch.setattr(subprocess, "Popen", _refuse_python_processes)
    capfd.readouterr()
    try:
        code: int | str | None = main(args)
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    out, err = capfd.readouterr()
    _check(tmp_path, args, phrase, code, out, err, before)


# The real process, on a case of each kind: a job file, a plan file, a resumed run, export.
THROUGH_A_PROCESS = {"alias_bomb", "not_utf8", "plan_deep_json", "resume_empty_run",
                     "export_missing_checkpoint"}


@pytest.mark.parametrize(("setup", "phrase"),
                         [c for c in CASES if c[0].__name__ in THROUGH_A_PROCESS],
                         ids=sorted(THROUGH_A_PROCESS, key=[c[0].__name__ for c in CASES].index))
def test_bad_input_through_the_real_command(tmp_path: Path, setup: Setup, phrase: str) -> None:
    args = setup(tmp_path)
    before = _snapshot(tmp_path)
    done = run_cephalo(tmp_path, *args, timeout=600)
    _check(tmp_path, args, phrase, done.returncode, done.stdout, done.stderr, before)


def test_an_internal_bug_keeps_its_traceback(tmp_path: Path) -> None:
    """Only CephaloError is the user's: a ValueError from a bug is not hidden as one line."""
    code = ("import sys; import cephalo.commands.crd as c; "
            "c.crd_yaml = lambda: (_ for _ in ()).throw(ValueError('bug')); "
            "from cephalo.cli import main; sys.exit(main(['crd']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ))
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "ValueError: bug" in done.stderr


@pytest.mark.parametrize(("argv", "unknown"), [
    (["export", "ckpt", "--output", "m.pt", "--bogus", "1"], "--bogus 1"),
    (["crd", "--nope"], "--nope"),
])
def test_an_unknown_option_is_named_by_its_command(argv: list[str], unknown: str,
                                                   capsys) -> None:
    """With that command's usage (argparse left it to the top-level parser: `cephalo:
    error: unrecognized arguments` under `usage: cephalo [-h] COMMAND ...`)."""
    from cephalo.cli import main

    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith(f"usage: cephalo {argv[0]} ")
    assert lines[-1] == f"cephalo {argv[0]}: error: unrecognized arguments: {unknown}"
