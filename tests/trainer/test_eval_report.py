"""`cephalo run`'s report of the validation loss (issue 14 item 4): the summary line and the
validation points on loss.png (read back as pixels with matplotlib)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cephalo.api.plan import Plan
from cephalo.local.report import format_summary, summarize, write_plots

VALIDATION_RGB = (0xDD, 0x84, 0x52)  # the colour report.py draws validation points in


def _plan() -> Plan:
    return Plan.model_validate({
        "global_batch_size": 4, "world_size": 1, "predicted_step_seconds": 0.5,
        "predicted_samples_per_second": 8.0,
        "ranks": [{"rank": 0, "gpu": "cpu", "batch_size": 4, "micro_batch_size": 4,
                   "num_micro_batches": 1, "shard_ratio": 1.0,
                   "predicted_step_seconds": 0.5, "predicted_memory_bytes": 1,
                   "memory_capacity_bytes": 2}]})


def _records(with_validation: bool) -> list[dict]:
    records = []
    for step in range(1, 7):
        record = {"step": step, "loss": 5.0 - 0.5 * step, "step_seconds": 0.5,
                  "samples_per_second": 8.0,
                  "ranks": [{"rank": 0, "compute_seconds": 0.4, "collective_wait_seconds": 0.0}]}
        if with_validation and step % 3 == 0:
            record["validation_loss"] = 5.2 - 0.5 * step
        records.append(record)
    return records


def _validation_pixels(png: Path) -> int:
    import matplotlib.image

    rgb = (matplotlib.image.imread(png)[..., :3] * 255).round().astype(int)
    return int((np.abs(rgb - np.array(VALIDATION_RGB)).max(axis=-1) <= 8).sum())


@pytest.mark.parametrize("with_validation", [True, False])
def test_summary_and_loss_plot_show_the_validation_loss(tmp_path: Path,
                                                        with_validation: bool) -> None:
    plan = _plan()
    summary = summarize(_records(with_validation), plan)
    assert summary is not None
    text = format_summary(summary, plan, ["cpu"])
    (tmp_path / str(with_validation)).mkdir()
    written = write_plots(_records(with_validation), summary, ["cpu"],
                          tmp_path / str(with_validation))
    loss_png = tmp_path / str(with_validation) / "loss.png"
    assert loss_png in written
    if with_validation:
        assert summary.validation == [(3, 3.7), (6, 2.2)]
        assert "validation  loss 3.7000 (step 3) -> 2.2000 (step 6) on the held-out set " \
               "(2 evaluations)" in text
        assert _validation_pixels(loss_png) > 50
    else:
        assert summary.validation == [] and "validation" not in text
        assert _validation_pixels(loss_png) == 0


def test_summary_shows_the_split_history_of_live_rebalancing() -> None:
    from dataclasses import replace

    plan = Plan.model_validate({
        "global_batch_size": 8, "world_size": 2, "predicted_samples_per_second": 8.0,
        "ranks": [{"rank": r, "gpu": "cpu", "batch_size": 4, "micro_batch_size": 2,
                   "num_micro_batches": 2, "shard_ratio": 0.5} for r in range(2)]})
    timing = [{"rank": r, "compute_seconds": 0.4, "collective_wait_seconds": 0.0}
              for r in range(2)]
    records = [{"step": s, "loss": 1.0, "step_seconds": 1.0, "samples_per_second": 8.0,
                "ranks": timing, "batch_sizes": [4, 4] if s <= 4 else [6, 2]}
               for s in range(1, 9)]
    records[3]["rebalanced"] = {"step": 4, "from": [4, 4], "to": [6, 2],
                                "micro_batches": [3, 1], "predicted_gain": 0.5,
                                "seconds_per_sample": [0.1, 0.3]}
    summary = summarize(records, plan)
    assert summary is not None and summary.final_batch_sizes == [6, 2]
    text = format_summary(summary, plan, ["cpu", "cpu"])
    assert "split       [4, 4] (the plan's), rebalanced 1 time(s) without a restart:" in text
    assert "after step     4: [4, 4] -> [6, 2] ([3, 1] microbatches; the slowest rank's " \
           "compute predicted 1.50x faster)" in text
    assert "rank 1 cpu                          batch    2" in text
    # The split in force at the end against its own prediction (the runner prices it).
    for r in records[5:]:
        r.update(step_seconds=0.5, samples_per_second=16.0)
    summary = summarize(records, plan)
    assert summary is not None
    summary = replace(summary, final_split_predicted_samples_per_second=12.0)
    assert summary.final_split_samples_per_second == 16.0
    assert "  split in force at the end [6, 2]: measured 16.00 samples/s over steps 6-8, " \
           "predicted 12.00 (1.33x the prediction)" in format_summary(summary, plan, ["c"] * 2)
    # Rebalancing on but never moved: said so; off (no split recorded): nothing said.
    for r in records:
        r.pop("rebalanced", None)
        r["batch_sizes"] = [4, 4]
    summary = summarize(records, plan)
    assert summary is not None
    assert "for the whole run: no rebalancing" in format_summary(summary, plan, ["cpu"] * 2)
    for r in records:
        del r["batch_sizes"]
    summary = summarize(records, plan)
    assert summary is not None and "split " not in format_summary(summary, plan, ["cpu"] * 2)
