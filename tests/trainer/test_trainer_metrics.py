"""Trainer metrics: Prometheus series and the JSON-lines progress file."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import generate_latest

from cephalo.trainer.metrics import ProgressFile, TrainerMetrics


def test_prometheus_series_after_a_step() -> None:
    metrics = TrainerMetrics(rank=2, port=0, predicted_step_seconds=1.5)
    metrics.observe(step=7, loss=2.5, step_seconds=0.3, samples_per_second=26.7,
                    tokens_per_second=854.0, tflops=0.01,
                    wait_seconds_by_op={"all_gather": 0.05, "reduce_scatter": 0.0},
                    local_rank=0)
    text = generate_latest(metrics.registry).decode()
    assert 'cephalo_step{rank="2"} 7.0' in text
    assert 'cephalo_step_seconds_count{rank="2"} 1.0' in text
    assert 'cephalo_predicted_step_seconds{rank="2"} 1.5' in text
    assert 'cephalo_collective_wait_seconds_total{op="all_gather",rank="2"} 0.05' in text
    assert 'op="reduce_scatter"' not in text  # nothing waited: no series yet
    assert 'cephalo_tokens_per_second{rank="2"} 854.0' in text
    assert "cephalo_trainer_info" not in text  # no pod to name (a local run)
    named = TrainerMetrics(rank=2, port=0, predicted_step_seconds=None, pod_uid="5f0c-uid")
    assert 'cephalo_trainer_info{pod_uid="5f0c-uid",rank="2"} 1.0' in \
        generate_latest(named.registry).decode()


def test_progress_file_appends_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "metrics.jsonl"
    progress = ProgressFile(path)
    progress.write({"step": 1, "loss": 3.0})
    progress.write({"step": 2, "loss": 2.0})
    progress.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]


def test_progress_lines_are_visible_to_a_reader_before_close(tmp_path: Path) -> None:
    # `cephalo run` follows the file while the trainer writes it (no per-line fsync needed).
    path = tmp_path / "metrics.jsonl"
    progress = ProgressFile(path)
    progress.write({"step": 1, "loss": 3.0})
    assert json.loads(path.read_text())["step"] == 1
    progress.close()
    progress.close()  # idempotent: the trainer's finally may close after an error path
