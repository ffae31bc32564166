"""Helpers to run the real `cephalo` command in a subprocess, outside the source tree (the
checkout's `operator/` folder must not shadow the standard library)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY_JOB = """\
apiVersion: cephalo.dev/v1alpha1
kind: CephaloJob
metadata: {{name: {name}}}
spec:
  model: {{preset: gpt-tiny}}
  globalBatchSize: {batch}
  training: {{steps: {steps}, learningRate: 1.0e-2, seed: 3}}
  # gpt-tiny is fastest on one device; these tests need every rank (chooseGpus: false)
  planner: {{profileMicroBatchSizes: [1, 2, 4], chooseGpus: false}}
  checkpoint: {{intervalSteps: 2}}
"""


def cephalo_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from cephalo.cli import main; "
            "sys.exit(main())", *args]


def run_cephalo(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, XDG_CACHE_HOME=str(cwd / ".cache"))
    return subprocess.run(cephalo_cmd(*args), cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def run_cephalo_in_process(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`cephalo ARGS` as run_cephalo runs it (in `cwd`, the profile cache under it), but
    through `cephalo.cli.main` in this process: the same parser, handlers, one-line errors
    and exit codes, without an interpreter importing torch and the command's libraries again
    (~2-4 s of CPU). For commands whose process boundary is not what the test checks."""
    from cephalo.cli import main

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        patch.setenv("XDG_CACHE_HOME", str(cwd / ".cache"))
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exit_:  # argparse's usage errors
                code = exit_.code if isinstance(exit_.code, int) else 2
    return subprocess.CompletedProcess(["cephalo", *args], code, out.getvalue(),
                                       err.getvalue())


def run_without_module(cwd: Path, module: str, job: Path) -> subprocess.CompletedProcess:
    """`cephalo run job --devices cpu:2` with `module` hidden from that one process
    (importlib finds no spec for it), as on a machine without the package. CPU devices named:
    finding the default ones would import torch (~2 s of CPU) to look for a GPU first."""
    code = ("import sys, importlib.util as u; real = u.find_spec; u.find_spec = lambda n, *a: "
            f"None if n == {module!r} else real(n, *a); from cephalo.cli import main; "
            f"sys.argv = ['cephalo', 'run', {str(job)!r}, '--devices', 'cpu:2']; "
            "sys.exit(main())")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def trainer_pids(marker: str) -> list[int]:
    """PIDs of live trainer processes whose environment mentions `marker` (a tmp path)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"cephalo.trainer" in cmdline and marker.encode() in environ:
            pids.append(int(entry.name))
    return pids


@pytest.fixture
def tiny_job(tmp_path: Path):
    def write(name: str = "tiny", batch: int = 6, steps: int = 4) -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(TINY_JOB.format(name=name, batch=batch, steps=steps))
        return path
    return write
