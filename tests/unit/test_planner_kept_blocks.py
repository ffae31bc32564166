"""Kept blocks in recompute mode (issue 16 item 1): each rank may keep the autograd graphs of
its last k blocks instead of recomputing them; the planner prices and chooses k per rank
from the memory and time of each choice, `cephalo plan` shows it. Checked against brute
force over every (m, ℓ, k) per rank, and against the API's memory function."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest

from cephalo.api import ClusterSpec, GpuGroup, GpuProfile, ProfilePoint, memory, parse_job
from cephalo.api.profile import model_key
from cephalo.planner import InfeasibleError, solve
from cephalo.planner.cost.comm_model import UnitComm
from cephalo.planner.outputs.report import format_plan
from cephalo.planner.search import kept_blocks as kept_module
from cephalo.planner.search.evaluate import evaluate, score
from cephalo.planner.search.offload import plan_fused_tail_blocks as fused_tail_blocks
from cephalo.planner.search.problem import build_problem, without_recompute
from cephalo.planner.search.solver import solve_fixed

from .planner_brute import Optimum, brute_force_optimum, brute_force_seconds
from .planner_instances import MIB, with_min_gain

# Four blocks, so that kept counts have room to vary (gpt-tiny has two).
MODEL = {"family": "gpt", "numLayers": 4, "hiddenSize": 64, "numHeads": 4,
         "ffnHiddenSize": 256, "vocabSize": 256, "sequenceLength": 32}


def _spec(batch: int, allow_state_only: bool = True, bandwidth_gbps: float = 100.0):
    return parse_job({
        "apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob", "metadata": {"name": "k"},
        "spec": {"model": MODEL, "globalBatchSize": batch,
                 "planner": {"allowStateOnlyRanks": allow_state_only,
                             "networkBandwidthGbps": bandwidth_gbps}}}).spec


def _profile(product: str, capacity: int, per_sample_seconds: float, base_bytes: int,
             slope_bytes: int, graph_bytes_per_sample: float | None = None) -> GpuProfile:
    model = _spec(1).model.resolve()
    points = [ProfilePoint(
        micro_batch_size=m, block_forward_seconds=2e-4 + per_sample_seconds * m,
        block_backward_seconds=2.5 * (2e-4 + per_sample_seconds * m),
        other_forward_seconds=0.3 * per_sample_seconds * m,
        other_backward_seconds=0.6 * per_sample_seconds * m,
        compute_memory_bytes=base_bytes + slope_bytes * m) for m in (1, 2, 4)]
    return GpuProfile(product=product, memory_capacity_bytes=capacity,
                      model_key=model_key(model.architecture_key(), "fp32"), points=points,
                      block_graph_bytes_per_sample=graph_bytes_per_sample)


def _instance(seed: int):  # type: ignore[no-untyped-def]
    """2-3 GPUs of two types, B ≤ 6, memory so tight that kept counts vary."""
    rng = random.Random(seed)
    spec = _spec(rng.randint(2, 6), allow_state_only=rng.random() < 0.6,
                 bandwidth_gbps=rng.choice([0.05, 1.0, 100.0]))
    model = spec.model.resolve()
    state = memory.STATE_BYTES_PER_PARAMETER * model.total_parameters()
    graph = memory.block_graph_bytes(1, model.tokens_per_sample, model.hidden_size,
                                     model.ffn_hidden_size)
    groups, profiles = [], {}
    counts = rng.choice([(1, 1), (2, 1), (1, 2)])
    for product, count in zip(("L4", "T4"), counts, strict=True):
        capacity = int((state * rng.uniform(0.5, 1.2) + graph * rng.uniform(2, 12)) / 0.8)
        groups.append(GpuGroup(product=product, count=count, memory_bytes=capacity))
        profiles[product] = _profile(
            product, capacity, rng.uniform(0.5, 3.0) * 1e-3, int(rng.uniform(0.05, 0.2) *
                                                                 capacity),
            int(rng.uniform(0.01, 0.05) * capacity),
            None if rng.random() < 0.5 else graph * rng.uniform(0.5, 1.5))
    return spec, ClusterSpec(groups=groups), profiles


SEEDS = range(30)


@functools.cache
def _optimum(seed: int) -> Optimum | None:
    spec, cluster, profiles = _instance(seed)
    return brute_force_optimum(build_problem(spec, cluster, profiles))


@pytest.mark.parametrize("seed", SEEDS)
def test_solver_matches_brute_force_over_kept_counts(seed: int) -> None:
    spec, cluster, profiles = _instance(seed)
    problem = build_problem(spec, cluster, profiles)
    best = _optimum(seed)
    if best is None:
        with pytest.raises(InfeasibleError):
            solve_fixed(problem)
        return
    sol = solve_fixed(problem)
    ev = score(problem, sol.micro, sol.ell, even_units=sol.even_units, kept=sol.kept)
    assert ev.feasible, ev.reason
    assert ev.step_seconds == pytest.approx(best.step_seconds, rel=1e-12)
    # Never slower than recomputing every block (what the planner did before).
    recompute_only = brute_force_seconds(problem, kept_blocks=False)
    assert recompute_only is None or ev.step_seconds <= recompute_only * (1 + 1e-12)
    # The plan carries the counts; its memory holds their graphs and fits every budget.
    plan = solve(spec, cluster, profiles, choose_gpus=False)
    if plan.recompute is not False:
        assert plan.predicted_step_seconds <= ev.step_seconds * (1 + 1e-12)
        layers = problem.model.num_layers
        dims = (problem.model.tokens_per_sample, problem.model.hidden_size,
                problem.model.ffn_hidden_size)
        # The engine's fused tail: its blocks keep no boundaries; every block in it (a mode
        # of its own) is priced with one microbatch's graphs.
        tail = fused_tail_blocks(plan)
        fused = tail == layers
        for r in plan.ranks:
            cost = problem.rank_cost(r.rank)
            graph = cost.profile.block_graph_bytes_per_sample
            assert 0 <= r.kept_blocks <= layers
            assert r.kept_blocks == 0 or r.batch_size > 0
            assert r.compute_memory_bytes == pytest.approx(int(
                float(cost.compute_memory_bytes(np.array([r.micro_batch_size]))[0])
                + (memory.fused_tail_bytes(r.kept_blocks, r.micro_batch_size, *dims,
                                           problem.model.block_parameters(), graph)
                   if fused else memory.kept_blocks_bytes(r.kept_blocks, r.batch_size,
                                                          *dims, graph))
                # boundary activations the offload decision keeps on the device
                + (memory.kept_boundary_bytes(layers, r.batch_size,
                                              problem.model.tokens_per_sample,
                                              problem.model.hidden_size, offload=False,
                                              fused_blocks=tail)
                   if r.offload_activations is False and r.batch_size else 0)), abs=1)
            assert r.predicted_memory_bytes <= r.memory_capacity_bytes * 0.8 + 1


def test_the_oracle_instances_choose_partial_kept_counts() -> None:
    """The brute-force optimum keeps some but not all blocks on some rank in several of the
    instances above: the oracle exercises the choice, not only its two ends."""
    partial = 0
    for seed in SEEDS:
        best = _optimum(seed)
        if best is not None and any(0 < k < 4 for k in best.kept):
            partial += 1
    assert partial >= 8


def _two_gpus(mib: int, graph_bytes_per_sample: float | None = None,
              batch: int = 8) -> tuple:
    spec = _spec(batch)
    profile = _profile("L4", mib * MIB, 1e-3, MIB, MIB // 4, graph_bytes_per_sample)
    cluster = ClusterSpec(groups=[GpuGroup(product="L4", count=2, memory_bytes=mib * MIB)])
    return spec, cluster, {"L4": profile}


def test_memory_to_spare_keeps_every_block_or_everything() -> None:
    spec, cluster, profiles = _two_gpus(512)
    plan = solve(spec, cluster, profiles, choose_gpus=False)
    assert plan.recompute is False or all(r.kept_blocks == 4 for r in plan.ranks
                                          if r.batch_size)
    problem = build_problem(spec, cluster, profiles)
    keep_all = solve_fixed(without_recompute(problem))
    keep_all_step = score(without_recompute(problem), keep_all.micro, keep_all.ell,
                          even_units=keep_all.even_units).step_seconds
    assert plan.predicted_step_seconds <= keep_all_step * (1 + 1e-12)


def test_memory_for_recompute_only_keeps_nothing() -> None:
    # One block's measured graph per sample is larger than a GPU: nothing can be kept.
    spec, cluster, profiles = _two_gpus(8, graph_bytes_per_sample=64 * MIB)
    plan = solve(spec, cluster, profiles, choose_gpus=False)
    assert plan.recompute is None and all(r.kept_blocks == 0 for r in plan.ranks)
    assert "kept_blocks" not in plan.to_json()  # plans from before keep their bytes
    # The dimension estimate (no measurement) is small enough to keep blocks here.
    spec, cluster, profiles = _two_gpus(8)
    plan = solve(spec, cluster, profiles, choose_gpus=False)
    assert any(r.kept_blocks for r in plan.ranks)


def test_the_measured_graph_size_prices_the_memory() -> None:
    spec, cluster, profiles = _two_gpus(64, graph_bytes_per_sample=12_345.5)
    cost = build_problem(spec, cluster, profiles).classes[0].cost
    m, ell, k = np.array([3]), np.array([2]), np.array([3])
    extra = cost.compute_memory_bytes(m, ell, k)[0] - cost.compute_memory_bytes(m)[0]
    model = spec.model.resolve()
    assert extra == memory.kept_blocks_bytes(3, 6, model.tokens_per_sample, model.hidden_size,
                                             model.ffn_hidden_size, 12_345.5)
    # The most that fit a room, exactly at the boundary.
    room = float(cost.compute_memory_bytes(m)[0]) + 2 * round(6 * 12_345.5)
    assert cost.max_kept_blocks(m, ell, room)[0] == 2
    assert cost.max_kept_blocks(m, ell, room - 1)[0] == 1


def test_a_kept_block_skips_its_recompute_but_not_its_gathers() -> None:
    spec, cluster, profiles = _two_gpus(64)
    problem = build_problem(spec, cluster, profiles)
    cost = problem.classes[0].cost
    ell, m = np.array([3]), np.array([2])
    f = float(cost.compute_seconds(m)[0, 0]) * 3
    silent = UnitComm(0.0, 0.0, 0.0, 0.0, 0.0)
    base = float(cost.step_seconds(ell, m, silent)[0])
    for k in range(5):  # compute alone: each kept block saves one forward per microbatch
        assert float(cost.step_seconds(ell, m, silent, np.array([k]))[0]) == pytest.approx(
            base - k * f, rel=1e-12)
    # Communication-bound (nothing overlaps): a kept block still pays both gathers, so it
    # saves exactly its recompute; keep-all also drops the second gather.
    comm = UnitComm(ag_block=1.0, rs_block=1.0, ag_first=1.0, ag_head=1.0, rs_other=1.0,
                    overlap_fraction=0.0)
    full = float(cost.step_seconds(ell, m, comm, np.array([4]))[0])
    assert float(cost.step_seconds(ell, m, comm)[0]) - full == pytest.approx(4 * f)
    keep_all = cost.without_recompute(problem.model)
    assert full - float(keep_all.step_seconds(ell, m, comm)[0]) == pytest.approx(4 + 1)


def test_even_and_kept_blocks_are_priced_by_their_overlap() -> None:
    """Even blocks are the first e, kept ones the last k: max(0, e + k - L) are both."""
    spec, cluster, profiles = _two_gpus(64)
    cost = build_problem(spec, cluster, profiles).classes[0].cost
    ell, m = np.array([2]), np.array([2])
    skewed, flat = (1e-2, 2e-2), (1e-3, 2e-3)  # (all-gather, reduce-scatter) seconds
    mixed = UnitComm(ag_block=skewed[0], rs_block=skewed[1], ag_first=0.0, ag_head=0.0,
                     rs_other=0.0, overlap_fraction=0.0, even_blocks=3,
                     ag_block_even=flat[0], rs_block_even=flat[1])

    def block(collectives: tuple[float, float], kept: bool) -> float:
        f, b = (cost.compute_seconds(m)[:2, 0] * 2).tolist()
        back = b - f if kept else b
        return f + collectives[0] + back + collectives[0] + collectives[1]

    rest = float(cost.step_seconds(ell, m, mixed, np.array([0]))[0]) - 3 * block(flat, False) \
        - block(skewed, False)
    for k in range(5):
        both = max(0, 3 + k - 4)
        expected = rest + (3 - both) * block(flat, False) + both * block(flat, True) + \
            (4 - 3 - (k - both)) * block(skewed, False) + (k - both) * block(skewed, True)
        got = float(cost.step_seconds(ell, m, mixed, np.array([k]))[0])
        assert got == pytest.approx(expected, rel=1e-12), k


def test_plan_and_report_say_which_ranks_keep_blocks() -> None:
    spec, cluster, profiles = _two_gpus(6)
    plan = solve(spec, cluster, profiles, choose_gpus=False)
    kept = [r.kept_blocks for r in plan.ranks]
    assert plan.recompute is None and any(kept) and not all(k == 4 for k in kept)
    text = format_plan(plan, "gpt-4-layers")
    line = next(t for t in text.splitlines() if t.startswith("activations:"))
    assert line.startswith("activations: recomputed in the backward; ")
    if kept[0] == kept[1]:
        assert f"ranks 0-1 keep the graphs of {kept[0]} of 4 blocks" in line
    assert "parameters gathered again" in line
    # evaluate() scores the plan's own choice back to its prediction.
    assignment = [(r.micro_batch_size, r.num_micro_batches) for r in plan.ranks]
    ev = evaluate(spec, cluster, profiles, assignment, recompute=True, kept_blocks=kept)
    assert ev.feasible and ev.step_seconds == pytest.approx(plan.predicted_step_seconds)
    # Keeping one more block on a rank than the plan does no longer fits its memory.
    more = [k + (r == 0) for r, k in enumerate(kept)]
    if more[0] <= 4:
        over = evaluate(spec, cluster, profiles, assignment, recompute=True,
                        kept_blocks=more)
        assert not over.feasible or over.step_seconds >= ev.step_seconds * (1 - 1e-12)


def test_too_many_candidates_offer_a_subset_and_the_plan_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Recompute mode keeping one block per rank (the fused and keep-all modes do not fit).
    spec, cluster, profiles = _two_gpus(6, batch=8)
    exact = solve(spec, cluster, profiles, choose_gpus=False)
    assert [r.kept_blocks for r in exact.ranks] == [1, 1]
    assert exact.recompute is None and "kept_blocks_candidates" not in exact.search
    monkeypatch.setattr(kept_module, "KEPT_CANDIDATES_MAX", 10)
    plan = solve(spec, cluster, profiles, choose_gpus=False)
    assert plan.recompute is None
    assert "subset" in plan.search["kept_blocks_candidates"]
    assert plan.search["exact"] is False
    assert plan.predicted_step_seconds >= exact.predicted_step_seconds * (1 - 1e-12)
    assert plan.predicted_step_seconds < plan.baselines["memory_balance_only"] \
        .predicted_step_seconds


@pytest.mark.parametrize("seed", [0, 4, 5, 8])  # plans keeping blocks on some ranks
def test_partial_subset_search_bounds_plans_that_keep_blocks(
        monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """The bound over every GPU subset (subset.py) prices kept blocks too: with memory so
    tight that keeping everything does not fit and kept counts vary, the optimum over every
    subset (all tried) lies within the gap the partial search states."""
    from cephalo.planner.search import subset

    rng = random.Random(seed)
    # The exact search's own optimum (no margin for keeping every GPU): the bound's subject.
    spec = with_min_gain(_spec(rng.randint(6, 12), bandwidth_gbps=rng.choice([0.2, 5.0])), 0.0)
    model = spec.model.resolve()
    state = memory.STATE_BYTES_PER_PARAMETER * model.total_parameters()
    graph = memory.block_graph_bytes(1, model.tokens_per_sample, model.hidden_size,
                                     model.ffn_hidden_size)
    groups, profiles = [], {}
    for product in ("L4", "T4", "A10G"):
        capacity = int((state * rng.uniform(0.15, 0.35) + graph * rng.uniform(3, 10)) / 0.8)
        groups.append(GpuGroup(product=product, count=3, memory_bytes=capacity))
        profiles[product] = _profile(product, capacity, rng.uniform(0.5, 3.0) * 1e-3,
                                     int(0.05 * capacity), int(0.02 * capacity))
    cluster = ClusterSpec(groups=groups)
    monkeypatch.setattr(subset, "EXHAUSTIVE_MAX_CHOICES", 10**6)
    everything = solve(spec, cluster, profiles, choose_gpus=True)
    assert everything.search["gpu_subsets_exhaustive"] is True
    monkeypatch.setattr(subset, "EXHAUSTIVE_MAX_CHOICES", 0)
    partial = solve(spec, cluster, profiles, choose_gpus=True)
    gap = partial.optimality_gap_seconds or 0.0
    assert partial.predicted_step_seconds - gap <= everything.predicted_step_seconds * (
        1 + 1e-12)
    assert everything.predicted_step_seconds <= partial.predicted_step_seconds * (1 + 1e-12)
    assert everything.recompute is None and any(r.kept_blocks for r in everything.ranks)


def test_the_report_says_which_kept_blocks_run_per_microbatch() -> None:
    """`cephalo plan` names the fused tail the engine will run (memory.fused_tail_blocks on
    the plan's own fields): the blocks both ranks keep, with several microbatches; all of
    them in the fused-everything mode."""
    from cephalo.planner.outputs.report import kept_blocks_phrase

    spec, cluster, profiles = _two_gpus(24, batch=32)
    plan = solve(spec, cluster, profiles, choose_gpus=False)
    assert [r.kept_blocks for r in plan.ranks] == [4, 4] and fused_tail_blocks(plan) == 4
    assert "every block (4) runs per microbatch" in kept_blocks_phrase(plan)
    # By hand, ranks keeping 3 and 2 blocks: the last 2 run per microbatch on both.
    ranks = [r.model_copy(update={"kept_blocks": k}) for r, k in zip(plan.ranks, (3, 2),
                                                                     strict=True)]
    partial = plan.model_copy(update={"ranks": ranks})
    model = spec.model.resolve()
    expected = memory.fused_tail_blocks(
        [3, 2], [r.batch_size for r in ranks], [r.micro_batch_size for r in ranks],
        model.tokens_per_sample, model.hidden_size, model.ffn_hidden_size,
        model.block_parameters())
    assert fused_tail_blocks(partial) == expected == 2
    phrase = kept_blocks_phrase(partial)
    assert "rank 0 keeps the graphs of 3 of 4 blocks" in phrase
    assert "the last 2 on every rank run per microbatch with the head" in phrase
    # Both keeping 2: every kept block is in the fused tail.
    both = plan.model_copy(update={"ranks": [r.model_copy(update={"kept_blocks": 2})
                                             for r in plan.ranks]})
    assert kept_blocks_phrase(both) == (
        "; ranks 0-1 keep the graphs of 2 of 4 blocks (their last blocks: no recompute, run "
        "per microbatch with the head, parameters gathered once)")
    no_model = partial.model_copy(update={"model": None})
    assert fused_tail_blocks(no_model) == 0
    assert "per microbatch" not in kept_blocks_phrase(no_model)
