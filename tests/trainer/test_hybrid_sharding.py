"""Hybrid sharding (docs/hybrid-sharding.md): 4 gloo ranks as 2 replica groups of 2, the
state sharded unevenly inside each group, uneven batches over the whole job, train as plain
PyTorch trains one model on the global batch."""

from __future__ import annotations

import pytest
import torch

from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import preset
from cephalo.trainer.collectives import CROSS_ALL_REDUCE
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Engine, Layout
from cephalo.trainer.models import build_model
from cephalo.trainer.spawn import spawn_ranks
from tests.pytorch_reference import pytorch_training

STEPS = 5
MODEL = "gpt-tiny"
# fp32 everywhere: only the order of the sums differs from plain PyTorch.
TOLERANCE = 1e-5
# bf16 gradient sums (the reduce-scatter in the group, then the all-reduce across groups):
# each gradient element is rounded to bf16's 8 significant bits (relative 2^-9, 2e-3) per
# collective, and Adam's normalised update passes that on. Measured over these 5 steps:
# 1.2e-5 relative on the loss, 8.5e-4 on a whole unit's weights; the bounds leave about 8x
# and 2x. Per parameter it is no bound: biases start at 0, so their few 1e-3-sized updates
# differ by up to 7 % relative.
BF16_LOSS_TOLERANCE = 1e-4
BF16_UNIT_TOLERANCE = 2e-3

# Groups of different batch sizes (8 and 7 samples), uneven batches and microbatches inside
# them, shards 0.7/0.3 in every group; block 1 sharded evenly and block 2 owned by position 1
# alone (per-unit ratios: shares within the group, the same at each position).
HYBRID = Layout(batch_sizes=[5, 3, 6, 1], micro_batch_sizes=[5, 1, 3, 1],
                shard_ratios=[0.7, 0.3, 0.7, 0.3],
                unit_shard_ratios={1: [0.5, 0.5, 0.5, 0.5], 2: [0.0, 1.0, 0.0, 1.0]},
                replica_groups=[[0, 1], [2, 3]])


def _spec() -> TrainingSpec:
    # adam_epsilon 1e-6 as in test_trainer_invariance (the key bias's zero gradient).
    return TrainingSpec(steps=STEPS, learning_rate=1e-3, weight_decay=0.1, warmup_steps=1,
                        adam_epsilon=1e-6, gradient_clip_norm=1.0, seed=0)


def _hybrid_worker(rank: int, world_size: int, layout: Layout, reduce_precision: str
                   ) -> dict:
    config = preset(MODEL)
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    engine = Engine(config, _spec(), layout, reduce_precision=reduce_precision)
    start, end = layout.sample_range(rank)
    losses, norms = [], []
    for step in range(STEPS):
        result = engine.step(data.micro_batches(step, start, end,
                                                layout.micro_batch_sizes[rank]))
        losses.append(result.loss)
        norms.append(result.grad_norm)
    shards = sum(u.shard_numel for u in engine.units)
    return {"losses": losses, "norms": norms, "params": engine.full_parameters(),
            "cross_bytes": engine.comm.stats.payload_bytes[CROSS_ALL_REDUCE],
            "shard_elements": shards, "position": engine.position}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _max_relative_by_parameter(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Per parameter tensor, not per flat unit, so a small tensor cannot hide in a big one."""
    with torch.device("meta"):
        units = build_model(preset(MODEL)).units
    worst = 0.0
    for u, (g, w) in enumerate(zip(got, want, strict=True)):
        offset = 0
        for _, p in units[u].named_parameters():
            n = p.numel()
            worst = max(worst, _relative(g[offset:offset + n], w[offset:offset + n]))
            offset += n
    return worst


@pytest.mark.slow
def test_hybrid_fp32_equals_plain_pytorch_on_the_global_batch() -> None:
    results = spawn_ranks(_hybrid_worker, 4, HYBRID, "fp32", timeout_seconds=120)
    rank0 = results[0]
    for r in results[1:]:  # every rank of every group ends with the same model
        assert all(torch.equal(a, b) for a, b in zip(r["params"], rank0["params"], strict=True))
        assert r["losses"] == rank0["losses"] and r["norms"] == rank0["norms"]
    assert [r["position"] for r in results] == [0, 1, 0, 1]
    ref_losses, ref_params = pytorch_training(preset(MODEL), _spec(), STEPS,
                                              HYBRID.global_batch_size)
    assert rank0["losses"] == pytest.approx(ref_losses, rel=TOLERANCE)
    assert _max_relative_by_parameter(rank0["params"], ref_params) <= TOLERANCE
    assert rank0["losses"][-1] != rank0["losses"][0]  # it trained
    # One fp32 all-reduce of each shard per step across the groups.
    for r in results:
        assert r["cross_bytes"] == 4 * r["shard_elements"] * STEPS


@pytest.mark.slow
def test_hybrid_bf16_reduce_precision_stays_close() -> None:
    results = spawn_ranks(_hybrid_worker, 4, HYBRID, "bf16", timeout_seconds=120)
    rank0 = results[0]
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], rank0["params"], strict=True))
    for r in results:  # the cross-group sums travel in bf16: 2 bytes an element
        assert r["cross_bytes"] == 2 * r["shard_elements"] * STEPS
    ref_losses, ref_params = pytorch_training(preset(MODEL), _spec(), STEPS,
                                              HYBRID.global_batch_size)
    assert rank0["losses"] == pytest.approx(ref_losses, rel=BF16_LOSS_TOLERANCE)
    for got, want in zip(rank0["params"], ref_params, strict=True):
        assert _relative(got, want) <= BF16_UNIT_TOLERANCE
    assert rank0["losses"] != pytest.approx(ref_losses, rel=1e-7)  # rounding happened
