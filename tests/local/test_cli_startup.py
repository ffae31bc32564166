"""What `cephalo` imports to start: commands that do not talk to a cluster (help, version,
`run` and `plan` on bad input) never load the kubernetes client or kopf (about half a
second of start-up, paid by every command before this was lazy), and `cephalo export`
refuses bad arguments before it loads torch (about 2 s of CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .cli_helpers import TINY_JOB

# Prints which of `libraries` were loaded when the command ends (atexit runs after
# argparse's SystemExit from --help too), on stderr's last line.
_REPORT = ("import atexit, sys; atexit.register(lambda: print('loaded:', sorted(m for m in "
           "sys.modules if m.split('.')[0] in {libraries!r}), file=sys.stderr)); "
           "from cephalo.cli import main; sys.exit(main())")


def _loaded(cwd: Path, args: list[str], libraries: tuple[str, ...]) -> str:
    """Runs `cephalo ARGS` in a fresh interpreter; the last stderr line (what it loaded)."""
    out = subprocess.run([sys.executable, "-c", _REPORT.format(libraries=libraries), *args],
                         cwd=cwd, capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert out.returncode in (0, 2), out.stderr
    return out.stderr.splitlines()[-1]


@pytest.mark.parametrize("args", [
    ["--help"],
    ["--version"],
    ["run", "missing.yaml"],
    ["plan", "--gpus", "2xL4", "--job", "missing.yaml"],
])
def test_a_command_that_does_not_connect_loads_no_cluster_library(
        tmp_path: Path, args: list[str]) -> None:
    assert _loaded(tmp_path, args, ("kopf", "kubernetes")) == "loaded: []"


def test_export_refuses_bad_arguments_before_loading_torch(tmp_path: Path) -> None:
    """A missing checkpoint folder (tests/local/test_bad_input.py has the other refusals,
    all checked before the checkpoint is read): one line, and torch never imported."""
    args = ["export", "no-such-ckpt", "--output", "model.pt"]
    assert _loaded(tmp_path, args, ("torch",)) == "loaded: []"


def test_run_on_cpu_ranks_in_fp32_never_loads_torch_in_the_command(tmp_path: Path) -> None:
    """`cephalo run` checks each device can run its precision before anything starts; fp32
    runs anywhere, so on CPU ranks in fp32 the command (not its ranks) needs no torch: ~2 s
    of CPU saved on every such run. Refused right after that check (nothing to resume)."""
    job = tmp_path / "tiny.yaml"
    job.write_text(TINY_JOB.format(name="tiny", batch=6, steps=2))
    out = subprocess.run([sys.executable, "-c", _REPORT.format(libraries=("torch",)), "run",
                          str(job), "--devices", "cpu:2", "--resume"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out.stderr
    assert "--resume" in out.stderr.splitlines()[0], out.stderr  # refused after the check
    assert out.stderr.splitlines()[-1] == "loaded: []", out.stderr
