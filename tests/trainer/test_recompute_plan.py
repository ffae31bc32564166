"""A plan's `recompute: false` on real gloo ranks: the trainer honours it (no recompute, so
each block is gathered once per step instead of twice), trains to the same losses as the
default recompute mode, and the engine's measured peak stays within the memory model's
no-recompute figure (the one the planner adds to the state: cephalo.api.memory)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from cephalo.api import memory, preset
from cephalo.api.job import CephaloJobSpec, DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import ModelConfig
from cephalo.trainer.engine import Layout
from cephalo.trainer.spawn import spawn_ranks
from cephalo.trainer.torch_memory import live_bytes_peak

TOLERANCE = 1e-5
LAYOUT = Layout(batch_sizes=[3, 1], micro_batch_sizes=[1, 1], shard_ratios=[0.6, 0.4])
STEPS = 3
# As tests/unit/test_memory_model.py: the largest unit is a block, with blocks on both sides.
CONFIGS = {name: preset(name).model_copy(update={"num_layers": 5})
           for name in ("gpt-tiny", "llama-tiny")}
BATCH, MICRO = 4, 2
UNDERSTATE_TOLERANCE = 0.02  # allocator rounding; never more (an OOM on a GPU)


def _job() -> CephaloJobSpec:
    return CephaloJobSpec.model_validate({
        "model": {"preset": "gpt-tiny"}, "globalBatchSize": 4,
        "training": {"steps": STEPS, "learningRate": 1e-3, "adamEpsilon": 1e-6,
                     "logIntervalSteps": 1},
        "checkpoint": {"intervalSteps": 1000, "keep": 1}})


def _train_worker(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """`run.train` twice, as a plan says: recompute (default) and recompute false; counts
    the all-gathers each issues."""
    from cephalo.trainer import collectives
    from cephalo.trainer.run import train

    gathers = [0]
    original = collectives.UnevenCollectives.all_gather

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        gathers[0] += 1
        return original(self, *args, **kwargs)

    collectives.UnevenCollectives.all_gather = counted  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    for name, recompute in (("default", None), ("kept", False)):
        gathers[0] = 0
        train(_job(), LAYOUT, None, progress_file=Path(folder) / f"{name}.jsonl",
              local_rank=rank, verbose=False, recompute=recompute)
        out[name] = gathers[0]
    return out


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()
            if "loss" in json.loads(line)]


@pytest.mark.slow
def test_no_recompute_plan_trains_identically_with_one_gather_per_unit(tmp_path: Path
                                                                       ) -> None:
    results = spawn_ranks(_train_worker, 2, str(tmp_path), timeout_seconds=180)
    default, kept = _losses(tmp_path / "default.jsonl"), _losses(tmp_path / "kept.jsonl")
    assert len(default) == len(kept) == STEPS
    for a, b in zip(default, kept, strict=True):
        assert abs(a - b) <= TOLERANCE * max(1.0, abs(a)), (default, kept)
    units = 2 + 2  # gpt-tiny: embedding, 2 blocks, head
    for r in results:
        # Recompute gathers every unit but the head twice per step; without, once.
        assert r["default"] >= STEPS * (2 * units - 1), r
        assert r["kept"] == r["default"] - STEPS * (units - 1), r


def _peak_worker(rank: int, world_size: int, config: ModelConfig) -> dict[str, Any]:
    from cephalo.trainer.data import DataSource
    from cephalo.trainer.engine import Engine

    layout = Layout(batch_sizes=[BATCH] * world_size, micro_batch_sizes=[MICRO] * world_size,
                    shard_ratios=[1 / world_size] * world_size)
    engine = Engine(config, TrainingSpec(), layout, precision="fp32", recompute=False)
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)

    def step() -> None:
        engine.step(data.micro_batches(engine.step_count, rank * BATCH, (rank + 1) * BATCH,
                                       MICRO))

    step()
    return {"peak": live_bytes_peak(step), "owned": sum(u.shard_numel for u in engine.units),
            "estimate": engine.memory_estimate_bytes()}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_no_recompute_peak_stays_within_the_memory_model(name: str) -> None:
    from cephalo.trainer.profile_units import UnitProfiler

    torch.set_num_threads(1)
    c = CONFIGS[name]
    compute = UnitProfiler(c, "fp32", torch.device("cpu")).measure(
        [MICRO], repeats=1, warmup=0).points[0].compute_memory_bytes
    kept = memory.kept_graph_bytes(c.num_layers, BATCH, c.tokens_per_sample, c.hidden_size,
                                   c.ffn_hidden_size, sum(c.unit_parameters()[:-1]))
    for r in spawn_ranks(_peak_worker, 2, c, timeout_seconds=180):
        measured = 3 * memory.FP32_BYTES * r["owned"] + r["peak"]
        predicted = memory.state_bytes(r["owned"]) + compute + kept
        print(f"no-recompute peak {measured} B, predicted {predicted} B "
              f"({predicted / measured - 1:+.1%})")
        assert measured <= predicted * (1 + UNDERSTATE_TOLERANCE), (measured, predicted)
        # The model is an estimate from the dimensions: it may overstate, not wildly.
        assert measured >= predicted * 0.5, (measured, predicted)
        assert r["estimate"] == memory.state_bytes(r["owned"]) + memory.unit_buffer_bytes(
            max(c.unit_parameters())) + kept
