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


def test_rank_zero_shows_the_split_in_force_and_restarts_its_timing_at_a_change() -> None:
    metrics = TrainerMetrics(rank=0, port=0, predicted_step_seconds=None)

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"rank": "0", **labels})

    metrics.show_split([32, 8], [4, 1])
    assert value("cephalo_split_batch_size", of_rank="1") == 8
    assert value("cephalo_split_micro_batches", of_rank="0") == 4
    assert value("cephalo_split_changes_total") == 0  # none yet reads 0, not "no data"
    metrics.time_ranks(1.0, [0.6, 0.9], [0.4, 0.1])
    metrics.time_ranks(1.2, [0.7, 1.1], [0.5, 0.1])
    assert value("cephalo_timed_steps_total") == 2
    metrics.show_split([34, 6], [5, 1], changed_after_step=10, reason="split [32, 8] -> [34, 6]")
    assert value("cephalo_split_batch_size", of_rank="0") == 34
    assert value("cephalo_split_micro_batches", of_rank="0") == 5
    assert value("cephalo_split_changes_total") == 1
    assert value("cephalo_split_last_change_step", reason="split [32, 8] -> [34, 6]") == 10
    # The timing sums are the new split's alone: the old split's steps are gone.
    assert value("cephalo_timed_steps_total") is None
    metrics.time_ranks(0.9, [0.8, 0.8], [0.1, 0.1])
    assert value("cephalo_timed_steps_total") == 1
    assert value("cephalo_rank_compute_seconds_total", of_rank="1") == 0.8
    metrics.show_split([35, 5], [5, 1], changed_after_step=20, reason="again")
    text = generate_latest(metrics.registry).decode()
    assert text.count("cephalo_split_last_change_step{") == 1  # the last change's reason only
    assert value("cephalo_split_changes_total") == 2


def test_rank_zero_says_why_memory_kept_the_split_short() -> None:
    metrics = TrainerMetrics(rank=0, port=0, predicted_step_seconds=None)
    reason = ("split [32, 32] kept short of [48, 16] after step 10: rank 0 would need 48 "
              "samples, its memory holds 32 at microbatch 4")
    metrics.show_split([32, 32], [8, 8])
    assert "cephalo_split_held_step{" not in generate_latest(metrics.registry).decode()
    metrics.show_held(10, reason)
    assert metrics.registry.get_sample_value(
        "cephalo_split_held_step", {"rank": "0", "reason": reason}) == 10
    metrics.show_held(20, "another")
    text = generate_latest(metrics.registry).decode()
    assert text.count("cephalo_split_held_step{") == 1  # the latest reason only
    metrics.show_held(None, "")  # memory binds no more
    assert "cephalo_split_held_step{" not in generate_latest(metrics.registry).decode()


def test_other_ranks_show_no_split() -> None:
    metrics = TrainerMetrics(rank=1, port=0, predicted_step_seconds=None)
    metrics.show_split([32, 8], [4, 1], changed_after_step=10, reason="x")
    metrics.show_held(10, "x")
    assert "cephalo_split" not in generate_latest(metrics.registry).decode()
