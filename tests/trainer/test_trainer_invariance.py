"""Plan invariance: uneven batches, uneven shards and mixed microbatching on 3 gloo ranks
give the same losses and weights as one rank training on the whole global batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import preset
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Engine, Layout
from cephalo.trainer.models import build_model
from cephalo.trainer.spawn import spawn_ranks
from tests.pytorch_reference import pytorch_training

STEPS = 3
TOLERANCE = 1e-5


def _spec() -> TrainingSpec:
    # adam_epsilon 1e-6: the gradient of the attention *key* bias is analytically zero
    # (softmax ignores a per-query constant), so its float value is pure rounding noise
    # (~1e-10); with eps 1e-8 Adam turns that noise into ~1% of lr per step and *no*
    # two summation orders agree on it to 1e-5. eps 1e-6 keeps the check meaningful.
    return TrainingSpec(steps=STEPS, learning_rate=1e-3, weight_decay=0.1, warmup_steps=1,
                        adam_epsilon=1e-6, gradient_clip_norm=1.0, seed=0)


def _train(name: str, layout: Layout, rank: int, group: dist.ProcessGroup | None = None,
           precision: str = "fp32", offload: bool = False, by_owner: bool = False
           ) -> tuple[list[float], list[torch.Tensor]]:
    config = preset(name)
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    engine = Engine(config, _spec(), layout, group=group, precision=precision, offload=offload)
    engine.comm.reduce_by_owner = by_owner
    start, end = layout.sample_range(rank)
    losses = []
    for step in range(STEPS):
        batches = data.micro_batches(step, start, end, layout.micro_batch_sizes[rank])
        losses.append(engine.step(batches).loss)
    return losses, engine.full_parameters()


def _worker(rank: int, world_size: int, name: str, layout: Layout, offload: bool,
            by_owner: bool) -> dict:
    losses, params = _train(name, layout, rank, offload=offload, by_owner=by_owner)
    solo = dist.new_group([0])  # every rank must create it; only rank 0 uses it
    out: dict = {"losses": losses, "params": params}
    if rank == 0:
        out["ref_losses"], out["ref_params"] = _train(name, Layout([8], [8], [1.0]), 0, solo)
    dist.barrier()
    return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


UNEVEN = Layout(batch_sizes=[5, 2, 1], micro_batch_sizes=[1, 2, 1], shard_ratios=[0.5, 0.3, 0.2])
# Rank 2 only holds state; the embedding and head units are sharded evenly, the blocks
# skewed (per-unit ratios, as the paper does to avoid uneven collectives where they cost).
STATE_ONLY = Layout(batch_sizes=[6, 2, 0], micro_batch_sizes=[3, 1, 0],
                    shard_ratios=[0.2, 0.3, 0.5],
                    unit_shard_ratios={0: [1 / 3, 1 / 3, 1 / 3], 3: [1 / 3, 1 / 3, 1 / 3]})
# Blocks owned whole by one rank (the paper's 1:0 splits): empty shards on the others.
OWNED = Layout(batch_sizes=[5, 2, 1], micro_batch_sizes=[1, 2, 1], shard_ratios=[0.5, 0.3, 0.2],
               unit_shard_ratios={1: [1.0, 0.0, 0.0], 2: [0.0, 0.0, 1.0]})


@pytest.mark.slow
@pytest.mark.parametrize(("name", "layout", "offload", "by_owner"), [
    ("gpt-tiny", UNEVEN, False, False),
    ("llama-tiny", UNEVEN, True, False),
    ("gpt-tiny", STATE_ONLY, True, False),
    # NCCL's uneven reduce-scatter (a reduce per owner), run on gloo.
    ("gpt-tiny", OWNED, False, True),
])
def test_uneven_plan_matches_single_rank(name: str, layout: Layout, offload: bool,
                                         by_owner: bool) -> None:
    results = spawn_ranks(_worker, 3, name, layout, offload, by_owner, timeout_seconds=120)
    rank0 = results[0]
    for r in results[1:]:  # every rank ends with the same full model
        assert all(torch.equal(a, b) for a, b in zip(r["params"], rank0["params"], strict=True))
    assert rank0["losses"] == pytest.approx(rank0["ref_losses"], rel=TOLERANCE)
    # Per parameter tensor (not per flat unit), so a small tensor cannot hide in a big one.
    config = preset(name)
    with torch.device("meta"):
        units = build_model(config).units
    for u, (got, want) in enumerate(zip(rank0["params"], rank0["ref_params"], strict=True)):
        offset = 0
        for pname, p in units[u].named_parameters():
            n = p.numel()
            rel = _relative(got[offset:offset + n], want[offset:offset + n])
            assert rel <= TOLERANCE, f"unit {u} {pname}: relative difference {rel:.2e}"
            offset += n
    assert rank0["losses"][-1] != rank0["losses"][0]  # it trained


def test_single_rank_engine_matches_plain_pytorch() -> None:
    """The engine on one rank (microbatches of 2, recompute, offload) is AdamW + clipping on
    the mean loss of the global batch, as plain PyTorch computes it."""
    torch.set_num_threads(1)
    results = spawn_ranks(_single_worker, 1, timeout_seconds=60)
    losses, params = results[0]
    ref_losses, ref_params = pytorch_training(preset("gpt-tiny"), _spec(), STEPS, 8)
    assert losses == pytest.approx(ref_losses, rel=TOLERANCE)
    for got, want in zip(params, ref_params, strict=True):
        assert _relative(got, want) <= TOLERANCE


def _single_worker(rank: int, world_size: int) -> tuple[list[float], list[torch.Tensor]]:
    return _train("gpt-tiny", Layout([8], [2], [1.0]), rank, offload=True)


def _bf16_worker(rank: int, world_size: int) -> dict:
    layout = Layout([5, 3], [5, 1], [0.6, 0.4])
    losses, params = _train("llama-tiny", layout, rank, precision="bf16", offload=True)
    solo = dist.new_group([0])
    out: dict = {"losses": losses, "params": params}
    if rank == 0:
        out["fp32_losses"], out["fp32_params"] = _train("llama-tiny", Layout([8], [8], [1.0]),
                                                        0, solo)
    dist.barrier()
    return out


@pytest.mark.slow
def test_bf16_autocast_trains_close_to_fp32_with_fp32_master_weights() -> None:
    rank0 = spawn_ranks(_bf16_worker, 2, timeout_seconds=120)[0]
    assert all(p.dtype == torch.float32 for p in rank0["params"])  # fp32 master shards
    # bf16 matmuls: same trajectory to bf16 precision (~3 significant digits), not bitwise.
    assert rank0["losses"] == pytest.approx(rank0["fp32_losses"], rel=2e-2)
    for got, want in zip(rank0["params"], rank0["fp32_params"], strict=True):
        assert _relative(got, want) < 2e-2
    assert rank0["losses"] != rank0["fp32_losses"]  # autocast really ran in bf16
