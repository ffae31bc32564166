"""`python -m cephalo.trainer.netprobe` (issue 35 item 1): one pod of two ranks (the
intra-node probe) measures gloo on loopback and writes a CollectiveProfile; a malformed
environment is refused before any rank starts. (The operator's end-to-end test runs the
inter-node gang: tests/operator/test_operator_netprobe.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
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


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "job.yaml").write_text(JOB)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CEPHALO_", "RANK"))}
    return subprocess.run(
        [sys.executable, "-m", "cephalo.trainer.netprobe"],
        env={**base, "CEPHALO_JOB": str(tmp_path / "job.yaml"), "CEPHALO_NUM_THREADS": "1",
             "CEPHALO_TERMINATION_LOG": str(tmp_path / "termination-log"), **env},
        capture_output=True, text=True, timeout=300)


def test_a_two_rank_pod_measures_and_rank_0_reports(tmp_path: Path) -> None:
    done = _run(tmp_path, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()), CEPHALO_RANKS_PER_POD="2",
                CEPHALO_COLLECTIVE_TIMEOUT_SECONDS="60")
    assert done.returncode == 0, done.stderr
    fit = CollectiveProfile.model_validate_json((tmp_path / "termination-log").read_text())
    assert fit.world_size == 2 and fit.bandwidth_bytes_per_second > 0
    assert fit.reduce_scatter_bandwidth_bytes_per_second is not None
    assert "netprobe: gloo over 2 ranks" in done.stderr


def test_without_a_world_of_two_it_refuses_before_starting(tmp_path: Path) -> None:
    done = _run(tmp_path, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT="29500")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "netprobe: error: needs RANK and WORLD_SIZE >= 2 (the operator sets them)")
    assert not (tmp_path / "termination-log").exists()
