"""Issue 35, "a real network, shaped": the namespaces machinery of bench/shaped_network.py
(two "nodes" as network namespaces joined by a tc-shaped veth pair) and its timed processes.
The measurements across the shaped link (the link rate within 25 % of the shaped one, at
300, 100 and 50 Mbit/s) are asserted by tests/trainer/test_shaped_plan.py, which plans from
them."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.load_file import load_file

BENCH = Path(__file__).resolve().parents[2] / "bench" / "shaped_network.py"


shaped = load_file(BENCH, "shaped_network")


@pytest.mark.skipif(shaped.unavailable() is not None, reason=str(shaped.unavailable()))
def test_namespaces_are_removed_even_when_the_body_fails() -> None:
    made = []
    with pytest.raises(RuntimeError, match="body failed"), shaped.shaped_nodes(100) as nodes:
        made = [nodes.a, nodes.b]
        raise RuntimeError("body failed")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            check=True).stdout
    assert made and not any(name in listed for name in made)


@pytest.mark.skipif(shaped.unavailable() is not None, reason=str(shaped.unavailable()))
def test_a_timed_process_runs_first_in_a_session_of_its_own() -> None:
    # Niceness alone ranks a process only inside its autogroup (its session): a timed
    # process gets a session, and that session's autogroup the niceness too.
    proc = shaped.start_timed(["sleep", "30"], niceness=-5)
    try:
        comm = Path(f"/proc/{proc.pid}/comm")
        deadline = time.monotonic() + 20
        while comm.read_text().strip() != "sleep":  # `nice` has set it and exec'd
            assert time.monotonic() < deadline, comm.read_text()
            time.sleep(0.01)
        assert os.getsid(proc.pid) == proc.pid != os.getsid(0)
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == -5
        autogroup = Path(f"/proc/{proc.pid}/autogroup")
        if autogroup.exists():  # a kernel with autogroups (Linux's default)
            assert autogroup.read_text().split()[-1] == "-5", autogroup.read_text()
    finally:
        proc.kill()
        proc.wait()
