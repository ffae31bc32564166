"""What `cephalo` imports to start: commands that do not talk to a cluster (help, version,
`run` and `plan` on bad input) never load the kubernetes client or kopf (about half a
second of start-up, paid by every command before this was lazy)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# Prints the cluster libraries loaded when the command ends (atexit runs after argparse's
# SystemExit from --help too), on stderr's last line.
_REPORT = ("import atexit, sys; atexit.register(lambda: print('loaded:', sorted(m for m in "
           "sys.modules if m.split('.')[0] in ('kopf', 'kubernetes')), file=sys.stderr)); "
           "from cephalo.cli import main; sys.exit(main())")


@pytest.mark.parametrize("args", [
    ["--help"],
    ["--version"],
    ["run", "missing.yaml"],
    ["plan", "--gpus", "2xL4", "--job", "missing.yaml"],
])
def test_a_command_that_does_not_connect_loads_no_cluster_library(
        tmp_path: Path, args: list[str]) -> None:
    out = subprocess.run([sys.executable, "-c", _REPORT, *args], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode in (0, 2), out.stderr
    assert out.stderr.splitlines()[-1] == "loaded: []", out.stderr
