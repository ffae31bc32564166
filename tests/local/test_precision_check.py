"""`cephalo run` refuses a precision a local device cannot run, in one line, before anything
is written: the job's on every device, or a given plan's per rank (the device probe is
patched to say no: every precision runs on this machine's CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cephalo.cli import main as cli_main
from cephalo.trainer import precision

from .cli_helpers import TINY_JOB


def _no_fp16_here(monkeypatch: pytest.MonkeyPatch) -> None:
    real = precision.autocast_engages
    monkeypatch.setattr(precision, "autocast_engages",
                        lambda device, p: p != "fp16" and real(device, p))


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, job_precision: str,
         *extra: str) -> int:
    text = TINY_JOB.format(name="tiny", batch=8, steps=2).replace(
        "  globalBatchSize: 8", f"  globalBatchSize: 8\n  precision: {job_precision}")
    (tmp_path / "job.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    return cli_main(["run", "job.yaml", "--devices", "cpu:2", *extra])


def test_the_jobs_fp16_on_a_device_without_it_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _no_fp16_here(monkeypatch)
    assert _run(tmp_path, monkeypatch, "fp16") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "cpu:0" in err
    assert f"fp16 autocast does not run on cpu devices with torch {torch.__version__}" in err
    assert not (tmp_path / "runs").exists()


def test_a_plans_fp16_rank_is_refused_and_its_fp32_ranks_are_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _no_fp16_here(monkeypatch)
    plan = {"global_batch_size": 8, "world_size": 2, "ranks": [
        {"rank": i, "batch_size": 4, "micro_batch_size": 4, "num_micro_batches": 1,
         "shard_ratio": 0.5, "precision": p} for i, p in enumerate(["bf16", "fp16"])]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert _run(tmp_path, monkeypatch, "fp32", "--plan", "plan.json") == 2
    err = capsys.readouterr().err.strip()
    assert "cpu:1" in err and "fp16 autocast does not run" in err and "\n" not in err
    assert not (tmp_path / "runs").exists()
