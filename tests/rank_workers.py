"""Rank functions for `spawn_ranks`, kept out of the test modules that start them.

A spawned rank finds its function by importing the function's module: a function defined in
a test module makes every rank import that module and everything it imports. The Hugging
Face tests import transformers (1.35 CPU seconds per rank on this machine), the S3 tests
boto3 and moto (0.66 s): more than a tiny model's whole training on that rank. This module
imports only what a training rank needs anyway."""

from __future__ import annotations

import os
from typing import Any

import torch

from cephalo.api.job import CephaloJobSpec
from cephalo.trainer.engine import Layout


def train_job(rank: int, world_size: int, job: CephaloJobSpec, ckpt: str, layout: Layout,
              stop_after_step: int | None = None) -> dict[str, Any]:
    """`run.train` of `job` on this rank; its first step and losses."""
    from cephalo.trainer.run import train

    outcome = train(job, layout, ckpt, stop_after_step=stop_after_step, verbose=False)
    return {"first": outcome.first_step, "losses": outcome.losses}


def train_on_object_storage(rank: int, world_size: int, env: dict[str, str],
                            job: dict[str, Any], layout: Layout, url: str,
                            stop_after_step: int | None,
                            die_in_save: int | None = None) -> dict[str, Any]:
    """`run.train` of `job` with its checkpoints at `url`, under the storage credentials
    `env`; with `die_in_save`, the last rank writes half a shard in its `die_in_save`-th
    checkpoint write and dies. An error is returned as its one-line message."""
    from cephalo.trainer.run import train

    # Ranks fork from a server started before the test set its environment: pass it on.
    os.environ.update(env)
    if die_in_save is not None and rank == world_size - 1:
        calls = [0]
        real_save = torch.save

        def save_then_die(obj: object, f: object, *args: object, **kwargs: object) -> None:
            calls[0] += 1
            if calls[0] == die_in_save:  # half a shard has gone out, then the rank dies
                f.write(b"\0" * 4096)  # type: ignore[attr-defined]
                os._exit(9)
            real_save(obj, f, *args, **kwargs)  # type: ignore[arg-type]

        torch.save = save_then_die  # type: ignore[assignment]
    try:
        outcome = train(CephaloJobSpec.model_validate(job), layout, url,
                        stop_after_step=stop_after_step, verbose=False)
    except Exception as err:
        return {"error": str(err)}
    return {"first": outcome.first_step, "last": outcome.last_step, "losses": outcome.losses,
            "checkpoints": outcome.checkpoints}
