"""What a checkpoint's meta.json must agree with before anything reads by it: the recorded
model's unit sizes, the shard bounds (each unit split into world-size consecutive ranges)
and each shard file's own offsets. The sizes and hashes in meta.json prove only that the
files are the ones it lists; a hand-edited or foreign meta.json is a `CheckpointError` here
(one line), never an assert (checks of input data must survive `python -O`) or a
reshape error deep in the reader."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from pydantic import ValidationError
from torch import nn

from cephalo.api.job import format_validation_error
from cephalo.api.models import ModelConfig
from cephalo.trainer.storage import CheckpointError

if TYPE_CHECKING:
    from cephalo.trainer.checkpoint import CheckpointInfo


def recorded_config(info: CheckpointInfo) -> ModelConfig:
    """The model meta.json records, or a CheckpointError saying what is wrong with it."""
    try:
        return ModelConfig(**info.meta["model"])
    except ValidationError as err:
        problem = format_validation_error(err)
    except (TypeError, KeyError) as err:
        problem = f"{type(err).__name__}: {err}"
    raise CheckpointError(f"{info.path}/meta.json: the recorded model is not valid "
                          f"({problem}); the checkpoint's metadata is corrupted")


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_layout(info: CheckpointInfo, unit_numels: list[int]) -> None:
    """meta.json's `unit_numels` and `bounds` against the model's unit sizes."""
    meta, where = info.meta, f"{info.path}/meta.json"
    recorded = meta.get("unit_numels")
    if recorded != unit_numels:
        config = recorded_config(info)
        listed = recorded if isinstance(recorded, list) else []
        differ = next((f"unit {i}: {r} elements recorded, the model's {m}"
                       for i, (r, m) in enumerate(zip(listed, unit_numels, strict=False))
                       if r != m), f"{len(listed)} units recorded, the model has "
                       f"{len(unit_numels)}")
        raise CheckpointError(
            f"{where}: the recorded model ({config.family}, {config.num_layers} layers, "
            f"hidden {config.hidden_size}) does not match its unit sizes (unit_numels: "
            f"{differ}); the checkpoint's metadata is corrupted")
    world = meta.get("world_size")
    bounds = meta.get("bounds")
    if not _is_index(world) or world < 1 or not isinstance(bounds, list) \
            or len(bounds) != len(unit_numels):
        raise CheckpointError(f"{where}: world_size and bounds do not describe "
                              f"{len(unit_numels)} units; the checkpoint's metadata is corrupted")
    for unit, (numel, ranges) in enumerate(zip(unit_numels, bounds, strict=True)):
        flat = [x for r in ranges for x in r] if isinstance(ranges, list) and all(
            isinstance(r, list) and len(r) == 2 for r in ranges) else []
        ok = len(flat) == 2 * world and all(_is_index(x) for x in flat) \
            and flat[0] == 0 and flat[-1] == numel \
            and all(flat[i] <= flat[i + 1] if i % 2 == 0 else flat[i] == flat[i + 1]
                    for i in range(len(flat) - 1))
        if not ok:
            raise CheckpointError(
                f"{where}: the bounds of unit {unit} do not split its {numel} elements into "
                f"{world} consecutive ranges; the checkpoint's metadata is corrupted")


def check_checkpoint(info: CheckpointInfo) -> list[nn.Module]:
    """The whole checkpoint against its meta.json, before any output is written: the
    layout, then every shard file opens as a Cephalo shard holding the ranges meta.json says
    (memory-mapped, so this reads little). Returns the model's units (on the meta device)."""
    from cephalo.trainer.checkpoint import ShardReader
    from cephalo.trainer.flat import param_specs
    from cephalo.trainer.models import build_model

    with torch.device("meta"):
        units = list(build_model(recorded_config(info)).units)
    check_layout(info, [sum(s.numel for s in param_specs(u)) for u in units])
    reader = ShardReader(info)
    try:
        for rank in range(int(info.meta["world_size"])):
            for unit, ranges in enumerate(info.meta["bounds"]):
                reader.entry(rank, unit, *ranges[rank])
    finally:
        reader.close()
    return units
