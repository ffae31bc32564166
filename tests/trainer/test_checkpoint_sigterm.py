"""SIGTERM (pod deletion, preemption, drain) on one rank: every rank agrees at the next step
boundary, a checkpoint of that step is written, all ranks exit 143, and the next run resumes
from it (issue 11, defect 8). Real `python -m cephalo.trainer` rank processes on gloo, forked
from the tests' fork server (tests/trainer_ranks.py: none pays torch's imports again)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import yaml

from cephalo.trainer import checkpoint
from cephalo.trainer.forked import ForkedModule
from cephalo.trainer.spawn import free_port
from tests.trainer_ranks import finish, start_ranks

STEPS = 500  # far more than the test waits for: the run only ends by the signal
JOB = {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob", "metadata": {"name": "t"},
       "spec": {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 4,
                "training": {"steps": STEPS, "learningRate": 1e-3},
                "checkpoint": {"intervalSteps": 10000, "keep": 2}}}
PLAN = {"global_batch_size": 4, "world_size": 2, "ranks": [
    {"rank": r, "batch_size": 2, "micro_batch_size": 1, "num_micro_batches": 2,
     "shard_ratio": 0.5} for r in range(2)]}


def _launch(tmp_path: Path, tag: str, extra: dict[str, str] | None = None
            ) -> list[ForkedModule]:
    base = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2",
            "CEPHALO_JOB": str(tmp_path / "job.yaml"),
            "CEPHALO_PLAN": str(tmp_path / "plan.json"),
            "CEPHALO_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), **(extra or {})}
    return start_ranks([{**base, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(2)],
                       tmp_path, tag)


def _logged_steps(tmp_path: Path) -> int:
    progress = tmp_path / "metrics.jsonl"
    if not progress.exists():
        return 0
    lines = [line for line in progress.read_text().splitlines() if line.endswith("}")]
    return json.loads(lines[-1])["step"] if lines else 0


@pytest.mark.slow
def test_sigterm_on_one_rank_checkpoints_the_agreed_step_and_exits_143(tmp_path: Path
                                                                       ) -> None:
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(JOB))
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    procs = _launch(tmp_path, "stopped")
    try:
        deadline = time.monotonic() + 120
        while _logged_steps(tmp_path) < 3:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)  # only one rank hears it
    finally:
        outputs = finish(procs, tmp_path, "stopped")
    assert [p.returncode for p in procs] == [143, 143], outputs
    stopped = re.search(r"stopping at step (\d+) on request", outputs[0])
    assert stopped is not None, outputs[0]
    step = int(stopped.group(1))
    assert 3 <= step < STEPS
    info = checkpoint.find_latest(tmp_path / "ckpt")
    assert info is not None and info.step == step  # the interval never fired: SIGTERM's
    assert _logged_steps(tmp_path) == step  # nobody trained past the agreed boundary

    procs = _launch(tmp_path, "resumed", {"CEPHALO_STOP_AFTER_STEP": str(step + 1)})
    outputs = finish(procs, tmp_path, "resumed")
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert f"at step {step}" in outputs[0] and "resumed from" in outputs[0], outputs
