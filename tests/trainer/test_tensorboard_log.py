"""When rank 0 writes TensorBoard event files, and when it says why not (never failing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cephalo.api.plan import Plan
from cephalo.api.tracking import TrackingSpec
from cephalo.trainer.tensorboard_log import FOLDER, open_log

PLAN = Plan.model_validate({
    "global_batch_size": 2, "world_size": 1, "predicted_samples_per_second": 4.0,
    "ranks": [{"rank": 0, "batch_size": 2, "micro_batch_size": 2, "num_micro_batches": 1,
               "shard_ratio": 1.0}]})


def test_only_rank_0_of_a_tracked_job_with_a_local_folder_writes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    progress = tmp_path / "metrics.jsonl"
    on = TrackingSpec(tensorboard=True)
    assert open_log(None, progress, PLAN, 0) is None
    assert open_log(TrackingSpec(), progress, PLAN, 0) is None
    assert open_log(on, progress, PLAN, 1) is None
    assert not (tmp_path / FOLDER).exists() and capsys.readouterr().err == ""
    # Checkpoints on object storage: no progress file, so no folder; said once, not fatal.
    assert open_log(on, None, PLAN, 0) is None
    assert "no local folder to write event files into" in capsys.readouterr().err
    log = open_log(on, progress, PLAN, 0)
    assert log is not None and log.folder == tmp_path / FOLDER
    log.close()
    assert list((tmp_path / FOLDER).glob("events.out.tfevents.*"))
