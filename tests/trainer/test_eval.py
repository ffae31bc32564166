"""Validation loss (issue 14 item 4): a fixed held-out set, measured every
`training.evalIntervalSteps` steps and at the last, the same whatever the plan.

Real gloo ranks run the real training loop (`train`); the reference is one rank on the whole
global batch, and the plain (unsharded) model's forward on the same samples."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from prometheus_client import generate_latest

from cephalo.api.job import CephaloJobSpec, DataSpec, SyntheticData, TokenFileData
from cephalo.api.models import preset
from cephalo.api.status import Progress
from cephalo.operator.progress import parse_progress_checked
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Engine, Layout, StepResult
from cephalo.trainer.eval import VALIDATION_STEP, Evaluator, hold_out
from cephalo.trainer.metrics import TrainerMetrics
from cephalo.trainer.models import build_model
from cephalo.trainer.run import train
from cephalo.trainer.spawn import spawn_ranks
from cephalo.trainer.step_log import StepLogger

UNEVEN = Layout(batch_sizes=[5, 3], micro_batch_sizes=[2, 3], shard_ratios=[0.7, 0.3])
SOLO = Layout(batch_sizes=[8], micro_batch_sizes=[8], shard_ratios=[1.0])
TOLERANCE = 1e-5


def _job(eval_samples: int = 11) -> CephaloJobSpec:
    # 11 validation samples over a global batch of 8: two passes, the second partial (rank 1
    # gets nothing in it, still joins every gather).
    return CephaloJobSpec.model_validate({
        "model": {"preset": "gpt-tiny"}, "globalBatchSize": 8,
        "training": {"steps": 3, "learningRate": 1e-3, "seed": 5, "logIntervalSteps": 10,
                     "evalIntervalSteps": 2, "evalSamples": eval_samples}})


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _token_job(path: Path) -> CephaloJobSpec:
    # Llama on a token file: the last 20 % of the stream is the validation set (12 windows
    # of 32 tokens; evalSamples defaults to the global batch, 8).
    return CephaloJobSpec.model_validate({
        "model": {"preset": "llama-tiny"}, "globalBatchSize": 8,
        "training": {"steps": 2, "learningRate": 1e-3, "evalIntervalSteps": 1},
        "data": {"tokenFile": {"path": str(path)}, "validationFraction": 0.2}})


def _worker(rank: int, world_size: int, folder: str) -> dict:
    job = _job()
    tokens = _token_job(Path(folder) / "tokens.bin")
    solo = dist.new_group([0])  # every rank must create it; only rank 0 uses it
    for name, spec in (("", job), ("tokens-", tokens)):
        train(spec, UNEVEN, None, progress_file=Path(folder) / f"{name}uneven.jsonl",
              verbose=False)
        if rank == 0:
            train(spec, SOLO, None, group=solo, progress_file=Path(folder) / f"{name}solo.jsonl",
                  verbose=False)
        dist.barrier()
    out: dict = {}
    # Before any step: the engine's sharded evaluation against the plain model's forward.
    config = job.model.resolve()
    engine = Engine(config, job.training, UNEVEN)
    data = DataSource(config, job.data, job.training.seed)
    validation = hold_out(data, job.data, 11)
    out["initial"] = Evaluator(engine, validation, 1).loss()
    if rank == 0:
        model = build_model(config, seed=job.training.seed)
        with torch.no_grad():
            losses = [model(*(t.unsqueeze(0) for t in validation.sample(j))).double()
                      for j in range(11)]
        out["plain"] = float(torch.cat(losses).mean())
    dist.barrier()
    return out


@pytest.mark.slow
def test_validation_loss_is_the_same_for_any_plan(tmp_path: Path) -> None:
    np.random.default_rng(1).integers(0, 256, 2000).astype(np.uint16).tofile(
        tmp_path / "tokens.bin")
    results = spawn_ranks(_worker, 2, str(tmp_path), timeout_seconds=180)
    uneven, solo = _records(tmp_path / "uneven.jsonl"), _records(tmp_path / "solo.jsonl")
    # Evaluated at step 2 (the interval) and at the last step, 3; logged on those steps
    # although logIntervalSteps is 10.
    assert [r["step"] for r in uneven] == [2, 3] == [r["step"] for r in solo]
    tokens_uneven = _records(tmp_path / "tokens-uneven.jsonl")
    tokens_solo = _records(tmp_path / "tokens-solo.jsonl")
    assert [r["step"] for r in tokens_uneven] == [1, 2] == [r["step"] for r in tokens_solo]
    for a, b in zip(uneven + tokens_uneven, solo + tokens_solo, strict=True):
        assert abs(a["validation_loss"] - b["validation_loss"]) <= TOLERANCE * b["validation_loss"]
    assert uneven[1]["validation_loss"] != uneven[0]["validation_loss"]  # weights moved
    assert results[0]["initial"] == results[1]["initial"]  # all-reduced: every rank agrees
    assert results[0]["initial"] == pytest.approx(results[0]["plain"], rel=TOLERANCE)
    assert results[0]["initial"] == pytest.approx(np.log(256), rel=0.1)  # untrained


def _token_file(tmp_path: Path, train_tokens: int, tail_tokens: int) -> Path:
    # Training part: ids 0..99; held-out tail: ids 200..255, so a window shows its origin.
    rng = np.random.default_rng(0)
    tokens = np.concatenate([rng.integers(0, 100, train_tokens),
                             rng.integers(200, 256, tail_tokens)]).astype(np.uint16)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    return path


def test_token_stream_tail_is_held_out_from_training(tmp_path: Path) -> None:
    path = _token_file(tmp_path, 900, 100)
    spec = DataSpec(token_file=TokenFileData(path=str(path)), validation_fraction=0.1)
    config = preset("gpt-tiny")  # sequence length 32
    data = DataSource(config, spec, seed=1, verbose=False)
    validation = hold_out(data, spec, 1000)
    assert validation.num_samples == (100 - 1) // 32 == 3  # the windows the tail holds
    for j in range(validation.num_samples):
        x, y = validation.sample(j)
        assert int(x.min()) >= 200 and int(y.min()) >= 200
    seen = torch.cat([data.batch(step, 0, 64)[1].flatten() for step in range(20)])
    assert int(seen.max()) < 100  # 1280 training windows, none reaching into the tail
    assert torch.equal(validation.sample(1)[0], validation.sample(1)[0])  # fixed set


def test_synthetic_validation_samples_are_not_training_samples() -> None:
    config = preset("gpt-tiny")
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    validation = hold_out(data, DataSpec(synthetic=SyntheticData()), 16)
    held_out = {tuple(validation.sample(j)[0][:2].tolist()) for j in range(16)}
    assert held_out == {tuple(data.sample(VALIDATION_STEP, j)[0][:2].tolist())
                        for j in range(16)}
    trained = {tuple(data.sample(s, j)[0][:2].tolist()) for s in range(4) for j in range(16)}
    assert len(held_out - trained) >= 14  # (a, b) pairs drawn from 256x256: rare clashes


def test_a_tail_too_short_for_one_sample_is_a_clear_error(tmp_path: Path) -> None:
    path = _token_file(tmp_path, 990, 10)
    spec = DataSpec(token_file=TokenFileData(path=str(path)), validation_fraction=0.01)
    data = DataSource(preset("gpt-tiny"), spec, seed=1, verbose=False)
    with pytest.raises(ValueError, match="held-out tail of the token stream has 10 tokens"):
        hold_out(data, spec, 8)


def test_validation_loss_reaches_the_progress_file_and_prometheus(tmp_path: Path) -> None:
    from cephalo.trainer.metrics import ProgressFile

    metrics = TrainerMetrics(0, 0, None)
    progress = ProgressFile(tmp_path / "p.jsonl")
    logger = StepLogger(rank=0, global_batch_size=4, local_batch_size=4, tokens_per_sample=32,
                        flops_per_sample=1e6, total_steps=2, progress=progress,
                        metrics=metrics)
    result = StepResult(step=1, loss=3.0, grad_norm=1.0, learning_rate=1e-3, step_seconds=0.5,
                        collective_wait_seconds=0.0, rank_compute_seconds=[0.4],
                        rank_wait_seconds=[0.0])
    logger.log(result)
    assert b"cephalo_validation_loss{" not in generate_latest(metrics.registry)
    logger.log(result, validation_loss=2.75)
    progress.close()
    first, second = _records(tmp_path / "p.jsonl")
    assert "validation_loss" not in first and second["validation_loss"] == 2.75
    page = generate_latest(metrics.registry).decode()
    assert 'cephalo_validation_loss{rank="0"} 2.75' in page
    # What the operator makes of this page: status.progress.validationLoss.
    found = parse_progress_checked(page)
    # (the second logged step is the first timed one: the first is left out as a warm-up)
    assert found == {"step": 1, "loss": 3.0, "samplesPerSecond": 8.0, "validationLoss": 2.75,
                     "timing": {"steps": 1, "stepSeconds": 0.5, "computeSeconds": [0.4],
                                "waitSeconds": [0.0]}}
    assert Progress.model_validate(found).validation_loss == 2.75
    assert "validationLoss" not in parse_progress_checked(
        page.replace("cephalo_validation_loss", "other_gauge"))


def test_spec_fields_and_their_bounds() -> None:
    job = _job()
    assert job.training.eval_interval_steps == 2 and job.training.eval_samples == 11
    assert CephaloJobSpec.model_validate({"model": {"preset": "gpt-tiny"},
                                          "globalBatchSize": 8}).training.eval_interval_steps \
        is None
    with pytest.raises(ValueError, match="validationFraction"):
        DataSpec.model_validate({"synthetic": {}, "validationFraction": 0.9})
