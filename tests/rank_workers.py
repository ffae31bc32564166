"""Rank functions for `spawn_ranks`, kept out of the test modules that start them.

A spawned rank finds its function by importing the function's module: a function defined in
a test module makes every rank import that module and everything it imports. The Hugging
Face tests import transformers (1.35 CPU seconds per rank on this machine), the S3 tests
boto3 and moto (0.66 s): more than a tiny model's whole training on that rank. This module
imports only what a training rank needs anyway."""

from __future__ import annotations

from typing import Any

from cephalo.api.job import CephaloJobSpec
from cephalo.trainer.engine import Layout


def train_job(rank: int, world_size: int, job: CephaloJobSpec, ckpt: str, layout: Layout,
              stop_after_step: int | None = None) -> dict[str, Any]:
    """`run.train` of `job` on this rank; its first step and losses."""
    from cephalo.trainer.run import train

    outcome = train(job, layout, ckpt, stop_after_step=stop_after_step, verbose=False)
    return {"first": outcome.first_step, "losses": outcome.losses}
