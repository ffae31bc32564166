"""Hybrid sharding (docs/hybrid-sharding.md): 4 gloo ranks as 2 replica groups of 2, the
state sharded unevenly inside each group, uneven batches over the whole job, train as plain
PyTorch trains one model on the global batch."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cephalo.api import memory
from cephalo.api.job import CephaloJobSpec, DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import preset
from cephalo.trainer import checkpoint
from cephalo.trainer.collectives import CROSS_ALL_GATHER, CROSS_ALL_REDUCE, CROSS_REDUCE_SCATTER
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Engine, Layout
from cephalo.trainer.flat import param_specs, unflatten
from cephalo.trainer.models import build_model
from cephalo.trainer.replicas import (
    file_bounds,
    file_index,
    file_ranges,
    group_ratios,
    locate,
    master_ranges,
    piece_bounds,
    piece_index,
    positions,
)
from cephalo.trainer.run import train
from cephalo.trainer.spawn import spawn_ranks
from tests.checkpoint_weights import latest_weights, max_relative
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
# With bf16 gathers as well (the slices all-gathered across groups in bf16, then inside
# the group: every rank computes from bf16-rounded weights, the masters stay fp32):
# measured 1.1e-5 on the loss and 1.9e-3 on a unit's weights; the loss bound is the same,
# the weights' leaves about 2.5x.
BF16_GATHER_UNIT_TOLERANCE = 5e-3

# Groups of different batch sizes (8 and 7 samples), uneven batches and microbatches inside
# them, shards 0.7/0.3 in every group; block 1 sharded evenly and block 2 owned by position 1
# alone (per-unit ratios: shares within the group, the same at each position).
HYBRID = Layout(batch_sizes=[5, 3, 6, 1], micro_batch_sizes=[5, 1, 3, 1],
                shard_ratios=[0.7, 0.3, 0.7, 0.3],
                unit_shard_ratios={1: [0.5, 0.5, 0.5, 0.5], 2: [0.0, 1.0, 0.0, 1.0]},
                replica_groups=[[0, 1], [2, 3]])
# Kept blocks (the last block of every working rank runs per microbatch with the head: the
# fused tail, whose reduce-scatters are issued from autograd hooks) and a rank without
# samples, which runs its group's and its position's collectives on zeros.
HYBRID_TAIL = Layout(batch_sizes=[6, 0, 6, 3], micro_batch_sizes=[2, 0, 3, 1],
                     shard_ratios=[0.6, 0.4, 0.6, 0.4], kept_blocks=[2, 0, 2, 1],
                     replica_groups=[[0, 1], [2, 3]])
# Two groups of one rank (every rank's slice is the whole model, its state split in two)
# and one group of four (flat: no cross-group collective at all).
TWO_OF_ONE = Layout(batch_sizes=[5, 2], micro_batch_sizes=[5, 1], shard_ratios=[1.0, 1.0],
                    replica_groups=[[0], [1]])
ONE_OF_FOUR = Layout(batch_sizes=[4, 2, 6, 3], micro_batch_sizes=[2, 1, 3, 3],
                     shard_ratios=[0.45, 0.2, 0.1, 0.25], replica_groups=[[0, 1, 2, 3]])
# A replicated prefix (the plan's replicated_fraction): half of every slice keeps its whole
# state in both groups, its gradient all-reduced across them; and all of it (every group
# the whole state of its slices: nothing gathered across groups after the update).
HYBRID_HALF = dataclasses.replace(HYBRID, replicated_fraction=0.5)
TWO_OF_ONE_WHOLE = dataclasses.replace(TWO_OF_ONE, replicated_fraction=1.0)


def test_positions_and_group_ratios() -> None:
    groups = [[1, 3], [0, 2]]
    assert positions(groups) == [[1, 0], [3, 2]]  # a rank of each group per position
    assert [locate(groups, r) for r in range(4)] == [(1, 0), (0, 0), (1, 1), (0, 1)]
    assert group_ratios(groups, [0.7, 0.7, 0.3, 0.3]) == [0.7, 0.3]
    # The state of a slice is split evenly across groups; torch numbers a position's ranks
    # in global order, and so do the pieces: rank 0 owns piece 0 of slice 0.
    assert [piece_index(groups, r) for r in range(4)] == [0, 1, 0, 1]
    assert piece_bounds(7, 2) == [(0, 4), (4, 7)] and piece_bounds(5, 1) == [(0, 5)]
    assert [file_index(p, g, 2) for p in (0, 1) for g in (0, 1)] == [0, 1, 2, 3]
    # Slices [0, 7) and [7, 10) of a unit: their pieces in file order cover it once.
    assert file_bounds([(0, 7), (7, 10)], 2) == [(0, 4), (4, 7), (7, 9), (9, 10)]
    assert file_bounds([(0, 7), (7, 10)], 1) == [(0, 7), (7, 10)]
    # A replicated prefix of 40 % (4 of a 10-element slice, rounded): piece 0's file holds
    # it with its piece of the rest; the master of piece 1 is the prefix and its piece.
    assert file_ranges(10, 2, 0.4) == [(0, 7), (7, 10)]
    assert master_ranges(10, 2, 0, 0.4) == [(0, 7)]
    assert master_ranges(10, 2, 1, 0.4) == [(0, 4), (7, 10)]
    assert master_ranges(10, 2, 1) == [(5, 10)] and file_ranges(10, 2) == [(0, 5), (5, 10)]
    assert file_ranges(6, 3, 1.0) == [(0, 6), (6, 6), (6, 6)]  # all replicated
    assert file_bounds([(0, 7), (7, 10)], 2, 0.5) == [(0, 6), (6, 7), (7, 9), (9, 10)]
    with pytest.raises(ValueError, match="rank 4 is in no replica group"):
        locate(groups, 4)


@pytest.mark.parametrize(("layout", "message"), [
    (Layout([2, 2], [1, 1], [1.0, 1.0], replica_groups=[[0], [2]]),
     r"replica_groups must list every rank 0\.\.1 exactly once"),
    (Layout([2, 2], [1, 1], [0.5, 0.5], replica_groups=[[0], [1]]),
     r"shard ratios of replica group \[0\] sum to 0\.5, not 1"),
    (Layout([2, 2], [1, 1], [1.0, 1.0], unit_shard_ratios={1: [1.0, 0.0]},
            replica_groups=[[0], [1]]),
     r"unit_shard_ratios\[1\] of replica group \[1\] sum to 0\.0"),
])
def test_the_engine_refuses_groups_that_break_the_rules(layout: Layout, message: str,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Checked before any process group is made (the world is faked: none exists here)."""
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    with pytest.raises(ValueError, match=message):
        Engine(preset(MODEL), _spec(), layout)


def _spec() -> TrainingSpec:
    # adam_epsilon 1e-6 as in test_trainer_invariance (the key bias's zero gradient).
    return TrainingSpec(steps=STEPS, learning_rate=1e-3, weight_decay=0.1, warmup_steps=1,
                        adam_epsilon=1e-6, gradient_clip_norm=1.0, seed=0)


def _hybrid_worker(rank: int, world_size: int, layout: Layout, reduce_precision: str,
                   recompute: bool = True, gather_precision: str = "fp32") -> dict:
    config = preset(MODEL)
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    # Without recompute, boundary activations offloaded to host as on a GPU.
    engine = Engine(config, _spec(), layout, reduce_precision=reduce_precision,
                    gather_precision=gather_precision, recompute=recompute,
                    offload=not recompute)
    start, end = layout.sample_range(rank)
    losses, norms = [], []
    for step in range(STEPS):
        result = engine.step(data.micro_batches(step, start, end,
                                                layout.micro_batch_sizes[rank]))
        losses.append(result.loss)
        norms.append(result.grad_norm)
    shards = sum(u.shard_numel for u in engine.units)
    sent = dict(engine.comm.stats.payload_bytes)  # the steps' (full_parameters adds its own)
    heads = engine.cross.heads if engine.cross is not None else [0] * len(engine.units)
    return {"losses": losses, "norms": norms, "params": engine.full_parameters(),
            "cross_bytes": (sent.get(CROSS_REDUCE_SCATTER, 0), sent.get(CROSS_ALL_GATHER, 0)),
            "all_reduced_bytes": sent.get(CROSS_ALL_REDUCE, 0),
            "cross_calls": engine.comm.stats.calls[CROSS_REDUCE_SCATTER] +
            engine.comm.stats.calls[CROSS_ALL_GATHER],
            "shard_elements": shards, "replicated_elements": sum(heads),
            "prefixes": [m[:h].clone() for m, h in zip(engine.master_shards, heads,
                                                        strict=True)],
            "position": engine.position, "fused_tail": engine.fused_tail}


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
@pytest.mark.parametrize(("layout", "recompute", "fused_tail", "positions_"), [
    (HYBRID, True, 0, [0, 1, 0, 1]), (HYBRID_TAIL, True, 1, [0, 1, 0, 1]),
    (HYBRID, False, 0, [0, 1, 0, 1]), (TWO_OF_ONE, True, 0, [0, 0]),
    (ONE_OF_FOUR, True, 0, [0, 1, 2, 3]), (HYBRID_HALF, True, 0, [0, 1, 0, 1]),
    (TWO_OF_ONE_WHOLE, True, 0, [0, 0])])
def test_hybrid_fp32_equals_plain_pytorch_on_the_global_batch(layout: Layout, recompute: bool,
                                                              fused_tail: int,
                                                              positions_: list[int]) -> None:
    world = layout.world_size
    results = spawn_ranks(_hybrid_worker, world, layout, "fp32", recompute,
                          timeout_seconds=120)
    rank0 = results[0]
    for r in results[1:]:  # every rank of every group ends with the same model
        assert all(torch.equal(a, b) for a, b in zip(r["params"], rank0["params"], strict=True))
        assert r["losses"] == rank0["losses"] and r["norms"] == rank0["norms"]
    assert [r["position"] for r in results] == positions_
    assert [r["fused_tail"] for r in results] == [fused_tail] * world
    ref_losses, ref_params = pytorch_training(preset(MODEL), _spec(), STEPS,
                                              layout.global_batch_size)
    assert rank0["losses"] == pytest.approx(ref_losses, rel=TOLERANCE)
    assert _max_relative_by_parameter(rank0["params"], ref_params) <= TOLERANCE
    assert rank0["losses"][-1] != rank0["losses"][0]  # it trained
    # Per step across the groups: one fp32 reduce-scatter of each slice's gradient and one
    # fp32 all-gather of each slice, but for the replicated prefix, whose gradient is
    # all-reduced instead; none with one group.
    cross = 4 * STEPS if len(layout.replica_groups) > 1 else 0
    for r in results:
        sharded = r["shard_elements"] - r["replicated_elements"]
        assert r["cross_bytes"] == (cross * sharded,) * 2
        assert r["all_reduced_bytes"] == cross * r["replicated_elements"]
        assert (r["replicated_elements"] > 0) == bool(layout.replicated_fraction)
        if r["replicated_elements"] == r["shard_elements"] > 0:
            # All of it replicated: no empty reduce-scatter or all-gather is issued (the
            # collectives of full_parameters included).
            assert r["cross_calls"] == 0
    # Every group computed the same replicated prefix, bit for bit (one all-reduce's result
    # on every rank, one AdamW on it): the copies never drift apart.
    for a in results:
        for b in results:
            if a["position"] == b["position"]:
                assert all(torch.equal(x, y) for x, y in zip(a["prefixes"], b["prefixes"],
                                                             strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("gather_precision", ["fp32", "bf16"])
def test_hybrid_bf16_reduce_precision_stays_close(gather_precision: str) -> None:
    results = spawn_ranks(_hybrid_worker, 4, HYBRID, "bf16", True, gather_precision,
                          timeout_seconds=120)
    rank0 = results[0]
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], rank0["params"], strict=True))
    gather_bytes = 2 if gather_precision == "bf16" else 4
    for r in results:  # the cross-group sums travel in bf16, the gathers as asked
        assert r["cross_bytes"] == (2 * r["shard_elements"] * STEPS,
                                    gather_bytes * r["shard_elements"] * STEPS)
    ref_losses, ref_params = pytorch_training(preset(MODEL), _spec(), STEPS,
                                              HYBRID.global_batch_size)
    unit_tolerance = BF16_UNIT_TOLERANCE if gather_precision == "fp32" else \
        BF16_GATHER_UNIT_TOLERANCE
    assert rank0["losses"] == pytest.approx(ref_losses, rel=BF16_LOSS_TOLERANCE)
    for got, want in zip(rank0["params"], ref_params, strict=True):
        assert _relative(got, want) <= unit_tolerance
    assert rank0["losses"] != pytest.approx(ref_losses, rel=1e-7)  # rounding happened


# Another split of the same 15 samples (live rebalancing's move), microbatch sizes kept.
REBALANCED = [2, 6, 6, 1]
EVAL_STEP = 100  # a batch no training step reads


def _around_training_worker(rank: int, world_size: int) -> dict:
    """Two steps, a rebalanced split for three more, an evaluation of the global batch and
    the memory estimate, under HYBRID."""
    config = preset(MODEL)
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    engine = Engine(config, _spec(), HYBRID)
    losses = []
    for step in range(STEPS):
        if step == 2:
            engine.set_batch_sizes(REBALANCED)
        start, end = engine.layout.sample_range(rank)
        losses.append(engine.step(data.micro_batches(
            step, start, end, HYBRID.micro_batch_sizes[rank])).loss)
    start, end = HYBRID.sample_range(rank)
    loss_sum, count = engine.evaluate(data.micro_batches(EVAL_STEP, start, end, 2))
    # What the engine holds between steps: its slices, and its pieces' masters and moments.
    opt = engine.optimizer
    tensors = [*engine.slices, *opt.params, *opt.exp_avg, *opt.exp_avg_sq]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return {"losses": losses, "eval": (loss_sum, count), "params": engine.full_parameters(),
            "memory": [engine.memory_estimate_bytes(b) for b in (1, 6)],
            "held_bytes": sum(storages.values()),
            "piece_elements": sum(int(p.numel()) for p in opt.params),
            "largest_slice": max(u.shard_numel for u in engine.units),
            "shard_elements": sum(u.shard_numel for u in engine.units)}


@pytest.mark.slow
def test_evaluation_rebalancing_and_memory_under_hybrid() -> None:
    results = spawn_ranks(_around_training_worker, 4, timeout_seconds=120)
    rank0 = results[0]
    # A moved split is the same global batch: still plain PyTorch's step.
    ref_losses, ref_params = pytorch_training(preset(MODEL), _spec(), STEPS,
                                              HYBRID.global_batch_size)
    assert rank0["losses"] == pytest.approx(ref_losses, rel=TOLERANCE)
    assert _max_relative_by_parameter(rank0["params"], ref_params) <= TOLERANCE
    # Evaluation: every rank's samples, the world over, as the trained model computes them.
    model = build_model(preset(MODEL))
    state: dict[str, torch.Tensor] = {}
    for u, (unit, flat) in enumerate(zip(model.units, rank0["params"], strict=True)):
        state.update(unflatten(param_specs(unit), flat, f"units.{u}."))
    model.load_state_dict(state)
    data = DataSource(preset(MODEL), DataSpec(synthetic=SyntheticData()), seed=0)
    with torch.no_grad():
        want = float(model(*data.batch(EVAL_STEP, 0, HYBRID.global_batch_size)).double().sum())
    for r in results:
        loss_sum, count = r["eval"]
        assert count == HYBRID.global_batch_size
        assert loss_sum == pytest.approx(want, rel=TOLERANCE)
    # Memory: each rank holds its group share of the state, so one position's ranks need
    # the same, and a group's shards add up to the whole model.
    total = sum(int(p.numel()) for p in model.parameters())
    assert results[0]["memory"] == results[2]["memory"]
    assert results[1]["memory"] == results[3]["memory"]
    assert results[0]["memory"] != results[1]["memory"]
    for group in HYBRID.replica_groups:
        assert sum(results[r]["shard_elements"] for r in group) == total
    # The state: 4 n_j of slice + 16 n_j / G of master, moments and piece gradient (which
    # exists from the cross-group reduce-scatter to the update), as the engine holds it (a
    # piece differs from n_j / G by under an element per unit).
    config = preset(MODEL)
    for r in results:
        n_j = r["shard_elements"]
        state = memory.hybrid_state_bytes(n_j, 2, "fp32")
        assert state == 4 * n_j + 16 * n_j / 2 < memory.state_bytes(n_j)
        assert abs(r["held_bytes"] + 4 * r["piece_elements"] - state) <= 16 * config.num_units
        # The estimate: that state, the slice gradient in flight across the groups, the
        # unit buffers and the boundary activations kept (no offload on CPU).
        for samples, estimate in zip((1, 6), r["memory"], strict=True):
            rest = memory.unit_buffer_bytes(max(config.unit_parameters())) + \
                memory.kept_boundary_bytes(config.num_layers, samples,
                                           config.tokens_per_sample, config.hidden_size,
                                           offload=False)
            assert estimate == int(state + 4 * r["largest_slice"] + rest)


def _order_worker(rank: int, world_size: int) -> list[tuple[str, int]]:
    """Two steps under TWO_OF_ONE with a log of: each update, each cross-group all-gather
    issued and waited for, and each gather inside the group issued (by unit)."""
    config = preset(MODEL)
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    engine = Engine(config, _spec(), TWO_OF_ONE)
    assert engine.cross is not None
    log: list[tuple[str, int]] = []
    cross_gather, group_gather = engine.cross.comm.all_gather, engine.shard_comm.all_gather
    update = engine.optimizer.step

    def logged_cross_gather(piece, bounds, unit, dtype=None, wire_dtype=None):  # type: ignore[no-untyped-def]
        pending = cross_gather(piece, bounds, unit, dtype=dtype, wire_dtype=wire_dtype)
        log.append(("cross issued", unit))
        wait = pending.wait

        def logged_wait() -> torch.Tensor:
            if not pending.done:
                log.append(("cross waited", unit))
            return wait()

        pending.wait = logged_wait  # type: ignore[method-assign]
        return pending

    def logged_group_gather(shard, bounds, unit, **kwargs):  # type: ignore[no-untyped-def]
        log.append(("gather", unit))
        return group_gather(shard, bounds, unit, **kwargs)

    def logged_update(*args, **kwargs):  # type: ignore[no-untyped-def]
        log.append(("update", -1))
        return update(*args, **kwargs)

    engine.cross.comm.all_gather = logged_cross_gather  # type: ignore[method-assign]
    engine.shard_comm.all_gather = logged_group_gather  # type: ignore[method-assign]
    engine.optimizer.step = logged_update  # type: ignore[method-assign]
    start, end = TWO_OF_ONE.sample_range(rank)
    for step in range(2):
        log.append(("step", step))
        engine.step(data.micro_batches(step, start, end, TWO_OF_ONE.micro_batch_sizes[rank]))
    return log


@pytest.mark.slow
def test_each_cross_group_gather_is_waited_just_before_its_unit_s_next_forward() -> None:
    units = preset(MODEL).num_units
    for log in spawn_ranks(_order_worker, 2, timeout_seconds=120):
        first_update = log.index(("update", -1))
        second_step = log.index(("step", 1))
        # Right after the update: every unit's all-gather issued, unit 0 first, none waited.
        assert log[first_update + 1:second_step] == [("cross issued", u) for u in range(units)]
        # The next forward: each unit's wait comes just before its first gather, not before.
        forward = log[second_step + 1:]
        for u in range(units):
            waited = forward.index(("cross waited", u))
            assert forward[waited + 1] == ("gather", u)
            assert ("gather", u) not in forward[:waited]
        assert forward.index(("cross waited", units - 1)) < forward.index(("update", -1))
        # Step 0 gathers the initial slices: nothing to wait for.
        assert not any(kind == "cross waited" for kind, _ in log[:first_update])


# ---- checkpoints across flat <-> hybrid and group counts ------------------------------
CKPT_STEPS = 4
FLAT = Layout([5, 3], [5, 1], [0.6, 0.4])
# Group 0 is ranks 1 and 3; groups of 3 and 5 samples. Every rank writes its piece.
TWO_GROUPS = Layout([2, 1, 3, 2], [2, 1, 3, 1], [0.7, 0.7, 0.3, 0.3],
                    replica_groups=[[1, 3], [0, 2]])
# Four groups of one rank: every rank holds the whole state (data parallel).
FOUR_GROUPS = Layout([2, 2, 2, 2], [1, 2, 1, 2], [1.0, 1.0, 1.0, 1.0],
                     replica_groups=[[0], [1], [2], [3]])


def _job() -> CephaloJobSpec:
    return CephaloJobSpec.model_validate({
        "model": {"preset": "llama-tiny"}, "globalBatchSize": 8, "precision": "fp32",
        "training": {"steps": CKPT_STEPS, "learningRate": 1e-3, "weightDecay": 0.1,
                     "adamEpsilon": 1e-6, "warmupSteps": 1},
        "checkpoint": {"intervalSteps": 2, "keep": 3}})


def _run_worker(rank: int, world_size: int, layout: Layout, root: str,
                stop_after_step: int | None) -> dict:
    outcome = train(_job(), layout, Path(root), stop_after_step=stop_after_step,
                    verbose=False)
    return {"first": outcome.first_step, "last": outcome.last_step, "losses": outcome.losses}


@dataclasses.dataclass
class _Resumed:
    """`_resume_three_ways`: the uninterrupted flat run and its checkpoints (`full`), the
    checkpoint saved at step 2 under the hybrid layout (`saved`), and three resumed runs
    with the folder each wrote to: that checkpoint resumed flat and under another layout,
    and the flat run's step 2 resumed under that other layout."""

    full: Path
    reference: list[dict]
    saved: checkpoint.CheckpointInfo
    runs: list[tuple[list[dict], Path]]


def _resume_three_ways(tmp_path: Path, hybrid: Layout, regrouped: Layout) -> _Resumed:
    full, saved_root, flat_first = tmp_path / "full", tmp_path / "hybrid", tmp_path / "flat"
    regrouped_root = tmp_path / "regrouped"
    ref = spawn_ranks(_run_worker, 2, FLAT, str(full), None, timeout_seconds=120)
    spawn_ranks(_run_worker, 4, hybrid, str(saved_root), 2, timeout_seconds=120)
    saved = checkpoint.find_latest(saved_root)
    assert saved is not None and saved.step == 2
    shutil.copytree(saved_root, regrouped_root)
    to_flat = spawn_ranks(_run_worker, 2, FLAT, str(saved_root), None, timeout_seconds=120)
    to_regrouped = spawn_ranks(_run_worker, 4, regrouped, str(regrouped_root), None,
                               timeout_seconds=120)
    # Saved flat (the reference's step 2), resumed under the other layout.
    shutil.copytree(full, flat_first)
    shutil.rmtree(flat_first / checkpoint.step_dir_name(CKPT_STEPS))
    from_flat = spawn_ranks(_run_worker, 4, regrouped, str(flat_first), None,
                            timeout_seconds=120)
    return _Resumed(full, ref, saved, [(to_flat, saved_root), (to_regrouped, regrouped_root),
                                        (from_flat, flat_first)])


def _check_resumed(resumed: _Resumed) -> None:
    """Every resumed run within 1e-5 of the uninterrupted one: losses and final weights."""
    want = latest_weights(resumed.full)
    for runs, root in resumed.runs:
        assert runs[0]["first"] == 2 and runs[0]["last"] == CKPT_STEPS
        assert runs[0]["losses"] == pytest.approx(resumed.reference[0]["losses"][2:],
                                                  rel=TOLERANCE)
        assert max_relative(latest_weights(root), want) <= TOLERANCE


@pytest.mark.slow
def test_checkpoints_resume_across_flat_and_hybrid_and_group_counts(tmp_path: Path) -> None:
    # Saved under two groups of two, resumed flat on two ranks and as four groups of one; a
    # flat checkpoint resumed as four groups of one.
    resumed = _resume_three_ways(tmp_path, TWO_GROUPS, FOUR_GROUPS)
    saved = resumed.saved
    # Every rank's piece: position-major files, slice 0's two pieces, then slice 1's.
    assert sorted(saved.meta["files"]) == [f"rank-0000{i}.pt" for i in range(4)]
    assert saved.meta["world_size"] == 4 and saved.meta["replica_groups"] == [[1, 3], [0, 2]]
    last = checkpoint.find_latest(resumed.runs[2][1])
    assert last is not None and last.step == CKPT_STEPS
    assert last.meta["world_size"] == 4 and len(last.meta["files"]) == 4  # a piece each
    _check_resumed(resumed)
    # The Adam moments came back too.
    a = checkpoint.ShardReader(checkpoint.find_latest(resumed.full))  # type: ignore[arg-type]
    for _, root in resumed.runs:
        b = checkpoint.ShardReader(checkpoint.find_latest(root))  # type: ignore[arg-type]
        for unit, numel in enumerate(last.meta["unit_numels"]):
            m_a, m_b = a.read(unit, 0, numel, "exp_avg"), b.read(unit, 0, numel, "exp_avg")
            assert _relative(m_b, m_a) <= TOLERANCE


# A replicated prefix in the checkpoint (the owner of piece 0 writes it with its piece).
TWO_GROUPS_HALF = dataclasses.replace(TWO_GROUPS, replicated_fraction=0.5)
FOUR_GROUPS_MOST = dataclasses.replace(FOUR_GROUPS, replicated_fraction=0.75)


@pytest.mark.slow
def test_checkpoints_with_a_replicated_prefix_resume_flat_and_back(tmp_path: Path) -> None:
    """Saved under two groups of two keeping half of every slice whole in both, resumed
    flat and as four groups keeping three quarters; a flat checkpoint resumed as the
    latter: every one within 1e-5 of an uninterrupted run, Adam moments included."""
    resumed = _resume_three_ways(tmp_path, TWO_GROUPS_HALF, FOUR_GROUPS_MOST)
    assert resumed.saved.meta["world_size"] == 4
    _check_resumed(resumed)
    a = checkpoint.ShardReader(checkpoint.find_latest(resumed.full))  # type: ignore[arg-type]
    for _, root in resumed.runs:
        last = checkpoint.find_latest(root)
        assert last is not None
        b = checkpoint.ShardReader(last)
        for unit, numel in enumerate(last.meta["unit_numels"]):
            for key in ("exp_avg", "exp_avg_sq"):
                assert _relative(b.read(unit, 0, numel, key),
                                 a.read(unit, 0, numel, key)) <= TOLERANCE


def _load_worker(rank: int, world_size: int, layout: Layout) -> dict:
    """Weights set from one function of the global offset (as a checkpoint or a Hugging
    Face folder sets them) under two groups of one gathering in bf16; then the pieces
    gathered across the groups in bf16, as after an update."""
    engine = Engine(preset(MODEL), _spec(), layout, gather_precision="bf16")
    assert engine.cross is not None

    def values(unit: int, start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end, dtype=torch.float32) * 1e-3 + unit + 1 / 3

    engine.load_parameters(values)
    masters = [m.clone() for m in engine.master_shards]
    engine.cross.publish(engine.master_shards)
    return {"owned": [engine.owned_ranges(u) for u in range(len(engine.units))],
            "files": [engine.file_range(u)[:2] for u in range(len(engine.units))],
            "heads": list(engine.cross.heads),
            "masters": masters, "params": engine.full_parameters(),
            "slices": [s.clone() for s in engine.slices],
            "want": [values(u, 0, unit.numel) for u, unit in enumerate(engine.units)]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [TWO_OF_ONE, dataclasses.replace(TWO_OF_ONE,
                                                                     replicated_fraction=0.3)])
def test_loaded_weights_fill_slice_and_piece_and_full_parameters_stay_exact(layout: Layout
                                                                           ) -> None:
    results = spawn_ranks(_load_worker, 2, layout, timeout_seconds=120)
    for r in results:
        for u, want in enumerate(r["want"]):
            held = torch.cat([want[a:b] for a, b in r["owned"][u]])
            assert torch.equal(r["masters"][u], held)  # the prefix's and the piece's master
            # The slice gathered in bf16 holds rounded weights (but for the prefix, copied
            # from the master); full_parameters does not.
            head = r["heads"][u]
            assert torch.equal(r["slices"][u][:head], want[:head])
            assert torch.equal(r["slices"][u][head:], want[head:].to(torch.bfloat16).float())
            assert torch.equal(r["params"][u], want)
    # The two files split every unit between the ranks; the prefix is piece 0's.
    assert [a[1] for a in results[0]["files"]] == [b[0] for b in results[1]["files"]]
    if layout.replicated_fraction:
        assert all(r["heads"][u] > 0 and r["owned"][u][0] == (0, r["heads"][u])
                   for r in results[1:] for u in range(len(r["heads"])))
