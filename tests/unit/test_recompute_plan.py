"""Recompute as a plan decision (issue 16 item 1): the planner prices both of the engine's
modes, keeps activations (no recompute, no second gather) where memory allows it and that
is faster, recomputes where memory needs it, and the plan and `cephalo plan` say which."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cephalo.api import ClusterSpec, GpuGroup, GpuProfile, ProfilePoint, load_job, memory
from cephalo.api.job import ModelSpec
from cephalo.api.models import ModelConfig
from cephalo.api.plan import Plan
from cephalo.api.profile import model_key
from cephalo.commands.plan import parse_gpus
from cephalo.planner import InfeasibleError, solve
from cephalo.planner.outputs.report import format_plan
from cephalo.planner.search.evaluate import evaluate, score
from cephalo.planner.search.offload import plan_fused_tail_blocks as fused_tail_blocks
from cephalo.planner.search.problem import build_problem, fused_everything, without_recompute
from cephalo.planner.search.solver import solve_fixed

from .planner_instances import MIB, job_spec, random_instance


def _mode_step(problem) -> float | None:  # type: ignore[no-untyped-def]
    try:
        sol = solve_fixed(problem)
    except InfeasibleError:
        return None
    return score(problem, sol.micro, sol.ell, even_units=sol.even_units,
                 kept=sol.kept).step_seconds


def _l4_profile(model: ModelConfig, graph_bytes_per_sample: float | None = None) -> GpuProfile:
    """A measured-looking L4 profile: linear times, 1 MiB + m/4 MiB of compute memory."""
    return GpuProfile(
        product="L4", memory_capacity_bytes=64 * MIB,
        model_key=model_key(model.architecture_key(), "fp32"),
        points=[ProfilePoint(micro_batch_size=m, block_forward_seconds=1e-3 * m,
                             block_backward_seconds=2.5e-3 * m, other_forward_seconds=3e-4 * m,
                             other_backward_seconds=6e-4 * m,
                             compute_memory_bytes=MIB + m * MIB // 4) for m in (1, 2, 4, 8)],
        block_graph_bytes_per_sample=graph_bytes_per_sample)


def test_ample_memory_keeps_activations_and_the_plan_says_so() -> None:
    # The quickstart's model and GPUs: a small GPT on 48 + 24 GB.
    spec = load_job("examples/quickstart.yaml").spec
    cluster = parse_gpus("1xRTX-A6000,1xP40")
    plan = solve(spec, cluster, choose_gpus=False)
    problem = build_problem(spec, cluster)
    recomputing, kept = _mode_step(problem), _mode_step(without_recompute(problem))
    assert recomputing is not None and kept is not None
    # No recompute drops a block forward (≈ a quarter of a block's compute) per microbatch
    # and the backward's second gather of every unit: never slower. The recompute mode can
    # only tie it by recomputing nothing, as here (the quickstart's batch 40: one microbatch
    # per rank with every block graph kept, the same work), and the tie goes to keeping
    # everything; gpt-small at batch 24 (the quickstart before) was strictly faster kept.
    assert kept <= recomputing
    if kept == recomputing:
        tied = solve_fixed(problem)
        assert tied.kept == [spec.model.resolve().num_layers] * 2 and tied.ell == [1, 1]
    older = spec.model_copy(update={"model": ModelSpec(preset="gpt-small"),
                                    "global_batch_size": 24})
    old = build_problem(older, cluster)
    old_recomputing, old_kept = _mode_step(old), _mode_step(without_recompute(old))
    assert old_recomputing is not None and old_kept is not None
    assert old_kept < old_recomputing
    assert plan.recompute is False
    assert plan.predicted_step_seconds == pytest.approx(kept, rel=1e-12)
    assert json.loads(plan.to_json())["recompute"] is False
    assert "activations: kept (no recompute" in format_plan(plan, "gpt-small")
    # It round-trips: the trainer reads the same choice back.
    assert Plan.model_validate_json(plan.to_json()).recompute is False


def test_tight_memory_recomputes_and_the_plan_keeps_its_bytes() -> None:
    # GPT-2.7B on the README's cluster: keeping every gathered block and graph does not fit.
    spec = load_job("examples/gpt-2.7b-cluster-a.yaml").spec
    cluster = parse_gpus("2xL4,1xRTX-A6000,3xP40,2xP100")
    with pytest.raises(InfeasibleError):
        solve_fixed(without_recompute(build_problem(spec, cluster)))
    plan = solve(spec, cluster, choose_gpus=False)
    assert plan.recompute is None
    assert "recompute" not in json.loads(plan.to_json())  # plans from before keep their bytes
    # Memory left over after the training state keeps a few blocks' graphs on some ranks
    # (the fastest GPUs, which take the most samples); the rest recompute.
    kept = [r.kept_blocks for r in plan.ranks]
    assert any(kept) and not all(k == plan.model["num_layers"] for k in kept)
    line = next(t for t in format_plan(plan, "gpt-2.7b").splitlines()
                if t.startswith("activations:"))
    assert line.startswith("activations: recomputed in the backward; ") and \
        "keep the graphs of" in line


def test_memory_decides_between_the_modes_for_the_same_model() -> None:
    # gpt-tiny, 16 samples on 2 GPUs with a measured-style profile (1 MiB + 1/4 MiB per
    # sample of compute memory): shrink the memory until keeping activations no longer
    # fits; the planner switches to recompute there, and not before.
    spec = job_spec(16)
    model = spec.model.resolve()
    profile = _l4_profile(model)
    graph_per_sample = memory.kept_graph_bytes(model.num_layers, 1, model.tokens_per_sample,
                                               model.hidden_size, model.ffn_hidden_size, 0)
    choices, steps, fused = [], [], []
    for mib in (64, 16, 8, 6, 4):
        cluster = ClusterSpec(groups=[GpuGroup(product="L4", count=2, memory_bytes=mib * MIB)])
        plan = solve(spec, cluster, {"L4": profile}, choose_gpus=False)
        choices.append((plan.recompute, [r.kept_blocks for r in plan.ranks]))
        problem = build_problem(spec, cluster, {"L4": profile})
        keep_all = _mode_step(without_recompute(problem))
        assert keep_all is None or plan.predicted_step_seconds <= keep_all * (1 + 1e-12)
        if plan.recompute is False:
            # Its prediction holds the graphs of every sample it runs.
            for r in plan.ranks:
                assert r.compute_memory_bytes >= graph_per_sample * r.batch_size
        steps.append(plan.predicted_step_seconds)
        fused.append(fused_tail_blocks(plan))
    # Measured here: kept down to 8 MiB (47.5 ms predicted; the fused tail ties with it,
    # the gathers hiding under compute, and a tie goes to keeping everything); at 6 MiB that
    # no longer fits, and both blocks run in the engine's fused tail on every rank at the
    # same 47.5 ms, holding one microbatch's graphs instead of eight (layered graphs of one
    # block per rank took 55.5 ms before the fused tail was priced); at 4 MiB only one rank
    # keeps one block's graph (62.4 ms; recompute alone: 63.5 ms).
    assert choices == [(False, [0, 0])] * 3 + [(None, [2, 2]), (None, [1, 0])]
    assert fused == [0, 0, 0, 2, 0]
    assert steps[3] == pytest.approx(steps[0], rel=1e-12)


@pytest.mark.parametrize("seed", range(25))
def test_plan_is_never_slower_than_either_mode_alone(seed: int) -> None:
    spec, cluster, profiles = random_instance(seed)
    problem = build_problem(spec, cluster, profiles)
    fused = fused_everything(problem)
    modes = [problem, without_recompute(problem), *([] if fused is None else [fused])]
    steps = [s for s in map(_mode_step, modes) if s is not None]
    if not steps:
        with pytest.raises(InfeasibleError):
            solve(spec, cluster, profiles, choose_gpus=False)
        return
    plan = solve(spec, cluster, profiles, choose_gpus=False)
    assert plan.predicted_step_seconds == pytest.approx(min(steps), rel=1e-12)
    # evaluate() scores the plan's assignment in the mode the plan chose.
    assignment = [(r.micro_batch_size, r.num_micro_batches) for r in plan.ranks]
    ev = evaluate(spec, cluster, profiles, assignment,
                  recompute=plan.recompute is not False,
                  kept_blocks=[r.kept_blocks for r in plan.ranks])
    assert ev.feasible and ev.step_seconds == pytest.approx(plan.predicted_step_seconds)


def test_no_recompute_prices_the_backward_without_the_forward_or_its_gathers() -> None:
    spec = load_job("examples/quickstart.yaml").spec
    problem = build_problem(spec, parse_gpus("2xL4"))
    cost = problem.classes[0].cost
    kept = cost.without_recompute(problem.model)
    no_comm = problem.unit_comm(uneven=False)
    silent = type(no_comm)(0.0, 0.0, 0.0, 0.0, 0.0)
    ell, m = np.array([3]), np.array([2])
    f = float(cost.compute_seconds(m)[0, 0])
    layers = problem.model.num_layers
    # Compute alone: the recompute mode pays each block's forward once more per microbatch.
    saved = float(cost.step_seconds(ell, m, silent)[0] - kept.step_seconds(ell, m, silent)[0])
    assert saved == pytest.approx(layers * 3 * f, rel=1e-9)
    # Memory: the same m costs more without recompute, and grows with ℓ (recompute: not).
    assert kept.compute_memory_bytes(m, 3)[0] > kept.compute_memory_bytes(m, 1)[0] > \
        cost.compute_memory_bytes(m)[0]
    assert cost.compute_memory_bytes(m, 3)[0] == cost.compute_memory_bytes(m, 1)[0]
    assert cost.recompute and not kept.recompute  # the original is untouched


def test_keeping_everything_is_priced_with_the_measured_graph_size() -> None:
    """A profile that measured its block graph (GpuProfile.block_graph_bytes_per_sample)
    prices `recompute: false` with it, as it does kept blocks, and the plan records the
    figure so that the trainer's memory check uses the same one."""
    spec = job_spec(16)
    model = spec.model.resolve()
    measured = 1000.0
    profile = _l4_profile(model, measured)
    cluster = ClusterSpec(groups=[GpuGroup(product="L4", count=2, memory_bytes=64 * MIB)])
    cost = without_recompute(build_problem(spec, cluster, {"L4": profile})).rank_cost(0)
    samples = np.array([8.0])
    extra = cost.compute_memory_bytes(samples, 1) - cost.compute_memory_bytes(samples * 0, 1)
    dims = (model.tokens_per_sample, model.hidden_size, model.ffn_hidden_size)
    assert float(extra[0]) == pytest.approx(memory.kept_graph_bytes(
        model.num_layers, 8, *dims, 0, measured) - memory.kept_graph_bytes(
        model.num_layers, 0, *dims, 0, measured) + float(cost.memory_slope_bytes) * 8)
    assert memory.kept_graph_bytes(model.num_layers, 8, *dims, 0, measured) < \
        memory.kept_graph_bytes(model.num_layers, 8, *dims, 0)  # the estimate is larger here
    plan = solve(spec, cluster, {"L4": profile}, choose_gpus=False)
    assert plan.recompute is False  # ample memory: everything kept
    assert {r.block_graph_bytes_per_sample for r in plan.ranks} == {measured}
