"""Per-unit sharding on the real engine: a plan the solver made with some units even and
others skewed trains on 3 gloo ranks exactly as one rank does on the whole batch, every
unit sharded as the plan says; a checkpoint written under one per-unit layout resumes under
another (other world size, other units even) with the weights of an uninterrupted run."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cephalo.api.job import CephaloJobSpec, DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import ModelConfig, preset
from cephalo.api.plan import Plan, parse_plan
from cephalo.api.sharding import is_even, shard_bounds
from cephalo.planner import solve
from cephalo.trainer import checkpoint
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Engine, Layout
from cephalo.trainer.env import layout_from_plan
from cephalo.trainer.models import build_model
from cephalo.trainer.run import train
from cephalo.trainer.spawn import spawn_ranks

STEPS = 3
TOLERANCE = 1e-5
# random_instance(173, 3 GPUs, B <= 8): the solver's optimum shards the embedding, the head
# and block 1 evenly and block 2 skewed (tests/unit/test_unit_shards.py checks such optima
# against brute force).
MIXED_SEED = 173


def _instances():
    path = Path(__file__).parents[1] / "unit" / "planner_instances.py"
    spec = importlib.util.spec_from_file_location("planner_instances", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _solver_plan() -> tuple[Plan, ModelConfig]:
    job, cluster, profiles = _instances().random_instance(MIXED_SEED, max_gpus=3, max_batch=8)
    plan = solve(job, cluster, profiles, choose_gpus=False)
    config = job.model.resolve()
    assert config == preset("gpt-tiny")  # what the workers train
    return parse_plan(json_roundtrip(plan)), config


def json_roundtrip(plan: Plan) -> dict:
    return json.loads(plan.to_json())


def _training() -> TrainingSpec:
    # adam_epsilon 1e-6 as in test_trainer_invariance (the attention key bias's gradient is
    # rounding noise that Adam would amplify with a smaller epsilon).
    return TrainingSpec(steps=STEPS, learning_rate=1e-3, weight_decay=0.1, warmup_steps=1,
                        adam_epsilon=1e-6, gradient_clip_norm=1.0, seed=0)


def _train(config: ModelConfig, layout: Layout, rank: int,
           group: dist.ProcessGroup | None = None) -> tuple[list[float], list[torch.Tensor],
                                                           list[tuple[int, int]]]:
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    engine = Engine(config, _training(), layout, group=group, offload=False)
    start, end = layout.sample_range(rank)
    losses = [engine.step(data.micro_batches(step, start, end,
                                             layout.micro_batch_sizes[rank])).loss
              for step in range(STEPS)]
    shards = [(u.start, u.end) for u in engine.units]
    return losses, engine.full_parameters(), shards


def _worker(rank: int, world_size: int, plan_json: dict) -> dict:
    plan = parse_plan(plan_json)
    config = preset("gpt-tiny")
    losses, params, shards = _train(config, layout_from_plan(plan), rank)
    solo = dist.new_group([0])  # every rank must create it; only rank 0 uses it
    out: dict = {"losses": losses, "params": params, "shards": shards}
    if rank == 0:
        batch = plan.global_batch_size
        out["ref_losses"], out["ref_params"], _ = _train(
            config, Layout([batch], [batch], [1.0]), 0, solo)
    dist.barrier()
    return out


@pytest.mark.slow
def test_solver_mixed_plan_matches_single_rank() -> None:
    plan, config = _solver_plan()
    layout = layout_from_plan(plan)
    assert plan.world_size == 3 and plan.unit_shard_ratios
    evenness = []
    with torch.device("meta"):
        units = build_model(config).units
    numels = [sum(p.numel() for p in u.parameters()) for u in units]
    for u, numel in enumerate(numels):
        evenness.append(is_even(shard_bounds(numel, layout.ratios_for(u))))
    assert any(evenness) and not all(evenness)  # mixed: some units even, some skewed

    results = spawn_ranks(_worker, 3, json_roundtrip(plan), timeout_seconds=120)
    rank0 = results[0]
    # Each rank owns exactly the slice of each unit that the plan's per-unit ratios give it.
    for rank, res in enumerate(results):
        assert res["shards"] == [shard_bounds(n, layout.ratios_for(u))[rank]
                                 for u, n in enumerate(numels)]
        assert all(torch.equal(a, b) for a, b in zip(res["params"], rank0["params"],
                                                     strict=True))
    assert rank0["losses"] == pytest.approx(rank0["ref_losses"], rel=TOLERANCE)
    for u, (got, want) in enumerate(zip(rank0["params"], rank0["ref_params"], strict=True)):
        rel = float((got - want).norm() / want.norm().clamp_min(1e-12))
        assert rel <= TOLERANCE, f"unit {u}: relative difference {rel:.2e}"
    assert rank0["losses"][-1] != rank0["losses"][0]  # it trained


# llama-tiny has 4 units (embedding, 2 blocks, head).
MIXED = Layout([5, 2, 1], [1, 2, 1], [1 / 3, 1 / 3, 1 / 3],
               unit_shard_ratios={2: [0.6, 0.3, 0.1]})  # block 2 skewed, the rest even
OTHER_MIXED = Layout([3, 5], [3, 1], [0.8, 0.2],
                     unit_shard_ratios={0: [0.5, 0.5], 3: [0.5, 0.5]})  # embedding/head even
UNIFORM = Layout([4, 4], [2, 4], [0.5, 0.5])


def _job() -> CephaloJobSpec:
    return CephaloJobSpec.model_validate({
        "model": {"preset": "llama-tiny"}, "globalBatchSize": 8,
        "training": {"steps": 4, "learningRate": 1e-3, "weightDecay": 0.1,
                     "adamEpsilon": 1e-6, "warmupSteps": 1},
        "checkpoint": {"intervalSteps": 2, "keep": 3}})


def _ckpt_worker(rank: int, world_size: int, layout: Layout, ckpt: str,
                 stop_after_step: int | None) -> dict:
    outcome = train(_job(), layout, Path(ckpt), stop_after_step=stop_after_step, verbose=False)
    return {"first": outcome.first_step, "last": outcome.last_step, "losses": outcome.losses}


def _weights(root: Path) -> dict[str, torch.Tensor]:
    info = checkpoint.find_latest(root)
    assert info is not None
    return checkpoint.full_state_dict(info)


@pytest.mark.slow
def test_checkpoint_resumes_under_another_per_unit_layout(tmp_path: Path) -> None:
    full, first, moved = tmp_path / "full", tmp_path / "first", tmp_path / "moved"
    ref = spawn_ranks(_ckpt_worker, 2, UNIFORM, str(full), None)
    stopped = spawn_ranks(_ckpt_worker, 3, MIXED, str(first), 2)
    assert stopped[0]["last"] == 2
    shutil.copytree(first, moved)
    resumed = spawn_ranks(_ckpt_worker, 2, OTHER_MIXED, str(moved), None)
    assert resumed[0]["first"] == 2 and resumed[0]["last"] == 4
    assert resumed[0]["losses"] == pytest.approx(ref[0]["losses"][2:], rel=TOLERANCE)
    want, got = _weights(full), _weights(moved)
    assert want.keys() == got.keys()
    for name in want:
        rel = float((got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-12))
        assert rel <= TOLERANCE, f"{name}: relative difference {rel:.2e}"
