"""Issue 35, "a real network, shaped": the namespaces machinery of bench/shaped_network.py
(two "nodes" as network namespaces joined by a tc-shaped veth pair) and its timed processes.
The measurements across the shaped link (the link rate within 25 % of the shaped one, at
300, 100 and 50 Mbit/s) are asserted by tests/trainer/test_shaped_plan.py, which plans from
them."""

from __future__ import annotations

import json
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


@pytest.mark.skipif(shaped.unavailable() is not None, reason=str(shaped.unavailable()))
def test_a_timed_module_runs_in_its_namespace_at_its_niceness_with_only_its_env(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What the shaped-link runs start their trainer, profiler and probe ranks with: forked
    # from the fork server, yet placed as `ip netns exec` under `start_timed` would place
    # `python -m module`, with exactly the environment given, its exit code passed on.
    monkeypatch.setenv("CEPHALO_PLACEMENT_UNSET", "1")  # the test's own: not passed on
    log = tmp_path / "module.log"
    with shaped.shaped_nodes(100) as nodes:
        proc = shaped.start_timed_module("tests.placement_report", ["3", "x"],
                                         {"MARKER": "given", "OMP_NUM_THREADS": "1"},
                                         log=log, cwd=tmp_path, netns=nodes.b, niceness=-5)
        try:
            assert proc.wait(timeout=120) == 3 == proc.returncode, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    out, err = log.read_text().splitlines()[-2:]
    seen = json.loads(out)
    assert err == "exiting"
    assert seen["pid"] == proc.pid and seen["sid"] == proc.pid != os.getsid(0)
    assert seen["niceness"] == -5
    assert seen["autogroup"] in (None, "-5"), seen  # None: a kernel without autogroups
    assert seen["interfaces"] == sorted(["lo", shaped.DEVICE_B]), seen
    assert (seen["cwd"], seen["argv"], seen["marker"], seen["inherited"]) == (
        str(tmp_path), ["3", "x"], "given", False)
    # As a fresh interpreter under OMP_NUM_THREADS=1 would have them, not the fork server's
    # count (OpenMP read its own environment when the server imported torch).
    assert seen["threads"] == 1, seen
