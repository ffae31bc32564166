"""`python -m cephalo.trainer.netprobe` (issue 35 items 1 and 4): behind a slow (emulated)
link a pod of two ranks (the intra-node probe) measures that link's rate and stays short, the
large size shrunk to the link; a malformed environment is refused before any rank starts.
(The operator's end-to-end test runs the inter-node gang on loopback:
tests/realk8s/test_operator_netprobe.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from cephalo.api.profile import CollectiveProfile
from cephalo.trainer.spawn import free_port

JOB = """apiVersion: cephalo.dev/v1alpha1
kind: CephaloJob
metadata: {name: t}
spec:
  model: {family: gpt, numLayers: 2, hiddenSize: 64, numHeads: 4, ffnHiddenSize: 256,
          vocabSize: 256, sequenceLength: 32}
  globalBatchSize: 8
"""


def _run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "job.yaml").write_text(JOB)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CEPHALO_", "RANK"))}
    return subprocess.run(
        [sys.executable, "-m", "cephalo.trainer.netprobe", *args],
        env={**base, "CEPHALO_JOB": str(tmp_path / "job.yaml"), "CEPHALO_NUM_THREADS": "1",
             "CEPHALO_TERMINATION_LOG": str(tmp_path / "termination-log"), **env},
        capture_output=True, text=True, timeout=300)


def test_a_slow_link_is_measured_at_its_rate_and_briefly(tmp_path: Path) -> None:
    """One pod of two ranks (the intra-node probe) behind a 50 Mbit/s link (the trainer's
    link emulation): 16 MiB would take 1.3 s an operation, the probe a minute; shrunk to the
    link, the probe takes seconds, and rank 0 reports the rate."""
    link = 6.25e6  # bytes/s
    started = time.monotonic()
    done = _run(tmp_path, "--repeats", "3", RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()), CEPHALO_RANKS_PER_POD="2",
                CEPHALO_LINK_BYTES_PER_SECOND=str(link))
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    fit = CollectiveProfile.model_validate_json((tmp_path / "termination-log").read_text())
    for bandwidth in (fit.bandwidth_bytes_per_second,
                      fit.reduce_scatter_bandwidth_bytes_per_second or 0.0):
        assert 0.75 * link <= bandwidth <= 1.25 * link, fit
    assert fit.world_size == 2 and "netprobe: gloo over 2 ranks" in done.stderr
    # How much of the all-gather hid under compute: measured, a fraction.
    assert fit.overlap_fraction is not None and 0.0 <= fit.overlap_fraction <= 1.0, fit
    # The timed operations: 2 x (8 small + 2 large) x 3 repeats, a large one at most a
    # quarter second, beside start-up; unshrunk, 48 s of large ones (a bound, not a timing).
    assert elapsed < 120, elapsed


def test_without_a_world_of_two_it_refuses_before_starting(tmp_path: Path) -> None:
    done = _run(tmp_path, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT="29500")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "netprobe: error: needs RANK and WORLD_SIZE >= 2 (the operator sets them)")
    assert not (tmp_path / "termination-log").exists()
