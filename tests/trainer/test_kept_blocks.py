"""Kept blocks (a rank plan's `kept_blocks`): in recompute mode a rank keeps the autograd graphs
of its last k blocks to the backward instead of recomputing them. The last blocks every rank
keeps run per microbatch with the head, gathered once (the fused tail); the others free their
gathered parameters after the forward and gather them again for the backward. On real gloo
ranks with an uneven layout: every choice of k, per rank, trains to the losses and gradient
norms of recompute mode and of `recompute=False`, issues exactly recompute mode's collectives
less the fused tail's second gathers, and the measured peak grows with k, stays below keeping
everything and within the memory model (cephalo.api.memory.fused_tail_bytes, itself within
kept_blocks_bytes, the planner's price)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from cephalo.api import memory, preset
from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import ModelConfig
from cephalo.trainer.engine import Layout
from cephalo.trainer.spawn import spawn_ranks
from cephalo.trainer.torch_memory import live_bytes_peak

TOLERANCE = 1e-5
BF16_TOLERANCE = TOLERANCE  # the kept graph and the recompute run the same bf16 kernels
STEPS = 3
LAYERS = 3
CONFIGS = {name: preset(name).model_copy(update={"num_layers": LAYERS})
           for name in ("gpt-tiny", "llama-tiny")}
# Uneven: rank 0 has 3 microbatches of 1 and 30 % of most shards, rank 1 2 microbatches of 2;
# rank 0 owns nothing of the last block and rank 1 nothing of the first (an empty master
# shard must not be mistaken for a freed buffer).
UNEVEN = dict(batch_sizes=[3, 4], micro_batch_sizes=[1, 2], shard_ratios=[0.3, 0.7],
              unit_shard_ratios={LAYERS: [0.0, 1.0], 1: [1.0, 0.0]})
KEPT = ([0, 0], [LAYERS, 1], [0, LAYERS], [2, 0])
# The last blocks both ranks keep run per microbatch with the head (memory.fused_tail_blocks):
# with [3, 1] rank 0 runs one block so and keeps two more block graphs layered.
FUSED = {"[3, 1]": 1, "[0, 3]": 0, "[2, 0]": 0}
# Rank 1 holds state only: it computes nothing, so it does not hold back the tail rank 0 runs
# per microbatch; it still takes part in every collective (zero gradients).
STATE_ONLY = dict(batch_sizes=[4, 0], micro_batch_sizes=[2, 1], shard_ratios=[0.4, 0.6])
SPEC = TrainingSpec(steps=STEPS, learning_rate=3e-3, warmup_steps=1, weight_decay=0.1,
                    gradient_clip_norm=1.0)


def _run(rank: int, config: ModelConfig, kept: list[int] | None, precision: str,
         layout_fields: dict[str, Any] = UNEVEN) -> dict[str, Any]:
    """STEPS steps under `kept` (None: recompute=False); per step loss, norm, collectives."""
    from cephalo.trainer.data import DataSource
    from cephalo.trainer.engine import Engine

    layout = Layout(**layout_fields, kept_blocks=kept or [])
    engine = Engine(config, SPEC, layout, precision=precision, recompute=kept is not None)
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    start, end = layout.sample_range(rank)
    out: dict[str, Any] = {"loss": [], "norm": [], "log": [], "fused": engine.fused_tail,
                           "units": len(engine.units)}
    for step in range(STEPS):
        engine.comm.stats.reset()
        result = engine.step(data.micro_batches(step, start, end,
                                                layout.micro_batch_sizes[rank]))
        out["loss"].append(result.loss)
        out["norm"].append(result.grad_norm)
        out["log"].append(list(engine.comm.stats.log))
    return out


def _equivalence_worker(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, config in CONFIGS.items():
        for kept in (*KEPT, None):
            results[f"{name} fp32 {kept}"] = _run(rank, config, kept, "fp32")
    for kept in ([0, 0], [LAYERS, 2]):
        results[f"llama-tiny bf16 {kept}"] = _run(rank, CONFIGS["llama-tiny"], kept, "bf16")
    for kept in ([0, 0], [LAYERS, 0]):
        results[f"state-only rank {kept}"] = _run(rank, CONFIGS["gpt-tiny"], kept, "fp32",
                                                  STATE_ONLY)
    return results


@pytest.fixture(scope="module")
def equivalence() -> list[dict[str, Any]]:
    return spawn_ranks(_equivalence_worker, 2, timeout_seconds=240)


def _assert_close(a: list[float], b: list[float], tolerance: float, what: str) -> None:
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= tolerance * max(1.0, abs(y)), (what, a, b)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_kept_blocks_train_like_recompute_and_like_keeping_everything(
        equivalence: list[dict[str, Any]], name: str) -> None:
    for rank, results in enumerate(equivalence):
        reference = results[f"{name} fp32 [0, 0]"]
        everything = results[f"{name} fp32 None"]
        _assert_close(everything["loss"], reference["loss"], TOLERANCE, "recompute=False")
        _assert_close(everything["norm"], reference["norm"], TOLERANCE, "recompute=False")
        # Loss and norm change every step (so the optimizer state after step 1 matters).
        assert len(set(reference["loss"])) == STEPS
        for kept in KEPT[1:]:
            got = results[f"{name} fp32 {kept}"]
            _assert_close(got["loss"], reference["loss"], TOLERANCE, f"kept {kept}")
            _assert_close(got["norm"], reference["norm"], TOLERANCE, f"kept {kept}")
            # Each rank keeps its own number of blocks and the collectives do not change,
            # but for the second gathers of the tail every rank runs per microbatch.
            assert got["fused"] == FUSED[str(kept)], (kept, got["fused"])
            assert got["log"] == _without_second_gathers(reference, got["fused"]), (rank, kept)
        # ...while recompute=False does not gather the blocks again for the backward.
        assert len(everything["log"][0]) < len(reference["log"][0])


def _without_second_gathers(reference: dict[str, Any], fused: int) -> list[Any]:
    """Recompute mode's collectives less the backward's gathers of the last `fused` blocks."""
    last = reference["units"] - 1
    skipped = {("all_gather", u) for u in range(last - fused, last)}
    out = []
    for log in reference["log"]:
        forward, backward = log[:last + 1], log[last + 1:]
        out.append(forward + [entry for entry in backward if tuple(entry) not in skipped])
    return out


@pytest.mark.slow
def test_a_rank_without_samples_runs_the_fused_tail_with_the_others(
        equivalence: list[dict[str, Any]]) -> None:
    for results in equivalence:
        reference, got = results["state-only rank [0, 0]"], results["state-only rank [3, 0]"]
        assert got["fused"] == LAYERS
        _assert_close(got["loss"], reference["loss"], TOLERANCE, "state-only loss")
        _assert_close(got["norm"], reference["norm"], TOLERANCE, "state-only norm")
        assert got["log"] == _without_second_gathers(reference, LAYERS)


def _state_only_peak_worker(rank: int, world_size: int) -> dict[str, Any]:
    from cephalo.trainer.data import DataSource
    from cephalo.trainer.engine import Engine

    config = CONFIGS["gpt-tiny"]
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    out = {}
    for kept in ([0, 0], [LAYERS, 0]):
        layout = Layout(**STATE_ONLY, kept_blocks=kept)  # type: ignore[arg-type]
        engine = Engine(config, SPEC, layout)
        start, end = layout.sample_range(rank)

        def step(engine: Engine = engine, start: int = start, end: int = end) -> None:
            engine.step(data.micro_batches(engine.step_count, start, end,
                                           STATE_ONLY["micro_batch_sizes"][rank]))

        step()
        # The least of three: what the collectives' threads still hold when the step's own
        # allocations peak varies with the timing (more so on a loaded machine).
        out[str(kept)] = {"peak": min(live_bytes_peak(step) for _ in range(3)),
                          "estimate": engine.memory_estimate_bytes(),
                          "unit_bytes": 4 * max(u.numel for u in engine.units)}
    return out


@pytest.mark.slow
def test_a_rank_without_samples_holds_no_more_for_the_fused_tail() -> None:
    """It takes part in the tail's collectives one unit buffer at a time: no more memory
    than in recompute mode (within run-to-run noise), and its memory estimate does not
    change."""
    torch.set_num_threads(1)
    idle = spawn_ranks(_state_only_peak_worker, 2, timeout_seconds=120)[1]
    recompute, fused = idle["[0, 0]"], idle[f"[{LAYERS}, 0]"]
    print(f"rank without samples, peak bytes: recompute {recompute['peak']}, "
          f"fused tail {fused['peak']}")
    # Both peaks vary by a unit buffer or two from run to run (when a collective's buffers
    # are freed); holding the tail would add 2·3 + 2 of them.
    assert fused["peak"] <= recompute["peak"] + 2 * fused["unit_bytes"]
    assert fused["estimate"] == recompute["estimate"]


@pytest.mark.slow
def test_kept_blocks_under_bf16_autocast(equivalence: list[dict[str, Any]]) -> None:
    for results in equivalence:
        reference = results["llama-tiny bf16 [0, 0]"]
        got = results[f"llama-tiny bf16 {[LAYERS, 2]}"]
        _assert_close(got["loss"], reference["loss"], BF16_TOLERANCE, "bf16 loss")
        _assert_close(got["norm"], reference["norm"], BF16_TOLERANCE, "bf16 norm")
        assert got["fused"] == 2
        assert got["log"] == _without_second_gathers(reference, 2)


def _block_graph(full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A llama block bound to views of `full`, run with autograd: (x, y, grad_y)."""
    from cephalo.trainer.flat import FlatUnit
    from cephalo.trainer.models import build_unit

    config = CONFIGS["llama-tiny"]
    unit = FlatUnit(1, build_unit(config, 1, seed=0), [1.0], 0)
    unit.detach_parameters()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, config.sequence_length, config.hidden_size, generator=generator,
                    requires_grad=True)
    unit.bind(full)
    y = unit.module(x)
    unit.unbind()
    return x, y, torch.randn(y.shape, generator=generator)


def test_freed_parameters_restored_at_storage_level_give_the_same_gradients() -> None:
    from cephalo.trainer.flat import FlatUnit
    from cephalo.trainer.models import build_unit
    from cephalo.trainer.unit_ops import free_storage, restore_storage

    values = FlatUnit(1, build_unit(CONFIGS["llama-tiny"], 1, seed=0), [1.0], 0).flatten()
    reference = values.clone().requires_grad_(True)
    x0, y0, grad_y = _block_graph(reference)
    torch.autograd.backward(y0, grad_y)

    full = values.clone().requires_grad_(True)
    x, y, _ = _block_graph(full)
    free_storage(full)
    assert full.untyped_storage().nbytes() == 0  # the memory is gone, the graph stays
    with pytest.raises(RuntimeError, match="differ in layout"):  # not a gather of this unit
        restore_storage(full, values[1:].clone())
    restore_storage(full, values.clone())
    torch.autograd.backward(y, grad_y)
    assert full.grad is not None and reference.grad is not None
    assert x.grad is not None and x0.grad is not None
    assert torch.equal(full.grad, reference.grad) and torch.equal(x.grad, x0.grad)

    # Why the restore copies storage: an in-place copy into the tensor bumps the version
    # counter the saved views share, and autograd refuses the graph.
    full = values.clone().requires_grad_(True)
    x, y, _ = _block_graph(full)
    free_storage(full)
    full.untyped_storage().resize_(values.untyped_storage().nbytes())
    with torch.no_grad():
        full.copy_(values)
    with pytest.raises(RuntimeError, match=r"modified inplace|modified by an inplace"):
        torch.autograd.backward(y, grad_y)

    # And without the values (storage resized back but not refilled) the gradients differ.
    full = values.clone().requires_grad_(True)
    x, y, _ = _block_graph(full)
    free_storage(full)
    full.untyped_storage().resize_(values.untyped_storage().nbytes())
    full.untyped_storage().copy_(torch.zeros_like(values).untyped_storage())
    torch.autograd.backward(y, grad_y)
    assert full.grad is not None and not torch.equal(full.grad, reference.grad)


# ---- memory --------------------------------------------------------------------------------
MEMORY_CONFIG = preset("gpt-tiny").model_copy(update={"num_layers": 4})
BATCH, MICRO = 8, 2
UNDERSTATE_TOLERANCE = 0.02  # allocator rounding; never more (an OOM on a GPU)


def _peak_worker(rank: int, world_size: int) -> dict[str, Any]:
    from cephalo.trainer.data import DataSource
    from cephalo.trainer.engine import Engine

    config = MEMORY_CONFIG
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    out: dict[str, Any] = {}
    for kept in (0, config.num_layers // 2, config.num_layers, None):
        layout = Layout(batch_sizes=[BATCH] * world_size,
                        micro_batch_sizes=[MICRO] * world_size,
                        shard_ratios=[1 / world_size] * world_size,
                        kept_blocks=[] if kept is None else [kept] * world_size)
        engine = Engine(config, TrainingSpec(), layout, recompute=kept is not None)

        def step(engine: Engine = engine) -> None:
            engine.step(data.micro_batches(engine.step_count, rank * BATCH,
                                           (rank + 1) * BATCH, MICRO))

        step()  # the first step allocates nothing the later ones do not
        out[str(kept)] = {"peak": live_bytes_peak(step), "estimate":
                          engine.memory_estimate_bytes(),
                          "owned": sum(u.shard_numel for u in engine.units),
                          "fused": engine.fused_tail}
        del engine, step
    return out


@pytest.mark.slow
def test_peak_grows_with_kept_blocks_within_the_memory_model() -> None:
    from cephalo.trainer.profile_units import UnitProfiler

    torch.set_num_threads(1)
    c = MEMORY_CONFIG
    # Gathered unit buffers plus one unit's working set (as tests/unit/test_memory_model.py).
    compute = UnitProfiler(c, "fp32", torch.device("cpu")).measure(
        [MICRO], repeats=1, warmup=0).points[0].compute_memory_bytes
    half, whole = c.num_layers // 2, c.num_layers
    for r in spawn_ranks(_peak_worker, 2, timeout_seconds=180):
        peaks = {k: v["peak"] for k, v in r.items()}
        print(f"peak bytes by kept blocks (None: recompute=False): {peaks}")
        # Half the blocks in the fused tail hold about what recompute mode's own unit
        # working set does (one microbatch's graphs, four unit buffers): within its run-to-run
        # spread of about one unit buffer; all of them clearly more.
        assert max(peaks["0"], peaks[str(half)]) < peaks[str(whole)], peaks
        # Keeping every graph but freeing the parameters beats keeping the parameters too,
        # by most of the blocks' gathered parameters (the backward's re-gathered buffers
        # take back part of it: measured 67-76 %).
        freed = sum(c.unit_parameters()[1:-1]) * memory.FP32_BYTES
        assert peaks["None"] - peaks[str(whole)] >= 0.5 * freed, (peaks, freed)
        dims = (c.tokens_per_sample, c.hidden_size, c.ffn_hidden_size)
        for k in (0, half, whole):
            got = r[str(k)]
            # Both ranks keep the same blocks with 4 microbatches each: all of them run per
            # microbatch with the head (one microbatch's graphs, parameters held).
            assert got["fused"] == k
            measured = 3 * memory.FP32_BYTES * got["owned"] + got["peak"]
            # The fused blocks keep no boundaries of their own.
            boundaries = memory.kept_boundary_bytes(c.num_layers, BATCH, *dims[:2], False, k)
            kept = (boundaries + memory.fused_tail_bytes(k, MICRO, *dims, c.block_parameters()))
            # ...never more than their layered graphs, the planner's price of kept blocks.
            assert kept <= memory.kept_boundary_bytes(c.num_layers, BATCH, *dims[:2], False) \
                + memory.kept_blocks_bytes(k, BATCH, *dims)
            predicted = memory.state_bytes(got["owned"]) + compute + kept
            print(f"kept {k}: peak {measured} B, predicted {predicted} B "
                  f"({predicted / measured - 1:+.1%})")
            assert measured <= predicted * (1 + UNDERSTATE_TOLERANCE), (k, measured, predicted)
            # The engine's own minimum is the same model without the working set.
            assert got["estimate"] == memory.state_bytes(got["owned"]) + \
                memory.unit_buffer_bytes(max(c.unit_parameters())) + kept


# ---- from a plan to the engine -----------------------------------------------------------
def _plan(kept: list[int], recompute: bool | None = None) -> dict[str, Any]:
    ranks = [{"rank": r, "batch_size": 2, "micro_batch_size": 1, "num_micro_batches": 2,
              "shard_ratio": 0.5, "kept_blocks": k} for r, k in enumerate(kept)]
    return {"global_batch_size": 4, "world_size": 2, "ranks": ranks, "recompute": recompute}


def test_a_plans_kept_blocks_reach_the_layout_or_fail_every_rank(tmp_path: Path) -> None:
    from cephalo.api.trainer_env import TrainerVars, to_environ
    from cephalo.trainer.env import EnvError, read_env

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({  # gpt-tiny: 2 blocks
        "apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
        "metadata": {"name": "kept", "namespace": "team"},
        "spec": {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 4}}))
    plan = tmp_path / "plan.json"

    def env() -> dict[str, str]:
        return to_environ(TrainerVars(rank=1, world_size=2, master_addr="127.0.0.1",
                                      master_port=29500, job=str(job), plan=str(plan),
                                      checkpoint_dir=""))

    plan.write_text(json.dumps(_plan([2, 1])))
    assert read_env(env()).layout.kept_blocks == [2, 1]
    plan.write_text(json.dumps(_plan([0, 1], recompute=False)))
    with pytest.raises(EnvError, match="for recompute mode"):
        read_env(env())
    plan.write_text(json.dumps(_plan([3, 0])))
    with pytest.raises(EnvError, match=r"kept_blocks \[3, 0\] exceed the model's 2 blocks"):
        read_env(env())


@pytest.mark.parametrize(("kept", "recompute", "message"), [
    ([1, 1], True, "one count per rank"),
    ([3], True, "between 0 and the 2 blocks"),
    ([-1], True, "between 0 and the 2 blocks"),
    ([1], False, "recompute=False keeps every block's graph already")])
def test_engine_rejects_kept_blocks_it_cannot_honour(kept: list[int], recompute: bool,
                                                     message: str) -> None:
    from cephalo.trainer.engine import Engine

    layout = Layout([1], [1], [1.0], kept_blocks=kept)
    with pytest.raises(ValueError, match=message):
        Engine(preset("gpt-tiny"), TrainingSpec(), layout, recompute=recompute,
               standalone=True)


def test_one_rank_keeps_blocks_without_freeing_its_master_weights() -> None:
    """A single rank's gather hands out the master shard itself: freeing it would destroy
    the weights. Same losses as recompute mode, and the weights survive the step."""
    from cephalo.trainer.data import DataSource
    from cephalo.trainer.engine import Engine

    config = CONFIGS["gpt-tiny"]
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    losses = {}
    for kept in (0, LAYERS):
        engine = Engine(config, SPEC, Layout([4], [2], [1.0], kept_blocks=[kept]),
                        standalone=True)
        losses[kept] = [engine.step(data.micro_batches(s, 0, 4, 2)).loss for s in range(2)]
        assert all(m.untyped_storage().nbytes() == m.numel() * 4 for m in engine.master_shards)
    _assert_close(losses[LAYERS], losses[0], TOLERANCE, "one rank")


def test_the_memory_check_uses_the_graph_size_the_plan_priced() -> None:
    """A plan prices kept blocks with the profile's measured graph size (RankPlan
    block_graph_bytes_per_sample, in the layout); the engine's memory estimate, which the
    trainer checks against the rank's limit, must use the same figure, not the dimension
    estimate, and so must its choice of a fused tail: with the estimate's large graphs two
    blocks run per microbatch, with a small measured graph holding their parameters would
    cost more than the layered graphs, so none does."""
    from cephalo.api import memory
    from cephalo.trainer.engine import Engine

    config = preset("gpt-tiny")
    dims = (config.tokens_per_sample, config.hidden_size, config.ffn_hidden_size)
    estimated = Engine(config, TrainingSpec(), Layout([4], [2], [1.0], kept_blocks=[2]),
                       standalone=True)
    measured = Engine(config, TrainingSpec(), Layout([4], [2], [1.0], kept_blocks=[2],
                                                     graph_bytes_per_sample=[1000.0]),
                      standalone=True)
    assert (estimated.fused_tail, measured.fused_tail) == (2, 0)
    fused = memory.fused_tail_bytes(2, 2, *dims, config.block_parameters())
    assert fused < memory.kept_blocks_bytes(2, 4, *dims)
    # ...and the fused blocks keep no boundaries of their own.
    boundaries = 2 * memory.boundary_bytes(4, *dims[:2])
    assert estimated.memory_estimate_bytes() - measured.memory_estimate_bytes() == (
        fused - memory.kept_blocks_bytes(2, 4, *dims, 1000.0) - boundaries)
    assert memory.kept_blocks_bytes(2, 4, *dims, 1000.0) == 8000
