"""`solve(job, cluster, profiles) -> Plan`: the exact optimum of the cost model, then the
training-state partition that minimises the maximum memory utilisation."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from cephalo.api.cluster import ClusterSpec
from cephalo.api.job import CephaloJobSpec
from cephalo.api.memory import hybrid_state_bytes, state_bytes_per_parameter
from cephalo.api.plan import IdleGpus, Plan, RankPlan
from cephalo.api.profile import GpuProfile
from cephalo.planner.cost.comm_model import UNEVEN_COLLECTIVE_OVERHEAD
from cephalo.planner.cost.topology import network_assumptions
from cephalo.planner.search.baselines import compute_baselines
from cephalo.planner.search.bottleneck import ClassTable, SearchResult, min_bottleneck
from cephalo.planner.search.evaluate import Evaluation, score
from cephalo.planner.search.hybrid_search import (
    HybridInfeasibleError,
    hybrid_must_beat,
    no_layout_message,
    record_sharding,
    search_layouts,
)
from cephalo.planner.search.margins import cost_idle_reason, every_gpu, faster_miss, note_min_gain
from cephalo.planner.search.offload import offload_plan, plan_fused_tail_blocks
from cephalo.planner.search.precision import precision_notes, rank_precisions
from cephalo.planner.search.pricing import (
    THROUGHPUT,
    FloorNotMetError,
    Objective,
    floor_message,
    objective_for,
    plan_cost,
)
from cephalo.planner.search.problem import (
    InfeasibleError,
    Problem,
    build_problem,
    class_tables,
    fused_everything,
    gib,
    without_recompute,
)
from cephalo.planner.search.subset import Choice, idle_counts, search_subsets
from cephalo.planner.search.unit_search import search_even_sets
from cephalo.planner.search.unit_shards import EvenUnits, unit_shard_ratios


def solve(spec: CephaloJobSpec, cluster: ClusterSpec,
          profiles: Mapping[str, GpuProfile] | None = None, *,
          choose_gpus: bool | None = None, remaining_steps: int | None = None) -> Plan:
    """The plan of least predicted step time (or, `planner.objective: cost`, of least price
    per sample within the throughput floor); InfeasibleError (with numbers) if none fits.

    `choose_gpus` (default: the job's `planner.chooseGpus`, true unless set) also chooses
    which GPUs to use (subset.py) and leaves the rest idle, named in the plan with the
    reason; false gives every GPU a rank. `remaining_steps`: the steps a deadline covers
    (default: the job's training.steps)."""
    if choose_gpus is None:
        choose_gpus = spec.planner.choose_gpus
    problem = build_problem(spec, cluster, profiles)
    objective = objective_for(spec, problem, remaining_steps)
    try:
        return _solve(spec, problem, choose_gpus, objective)
    except FloorNotMetError as err:
        fastest = err.fastest_step_seconds
        if fastest is None:  # every choice was proven too slow unsolved: find the fastest
            exact = spec.planner.model_copy(update={"min_gain_to_idle_gpus": 0.0})
            fastest = _solve(spec.model_copy(update={"planner": exact}), problem, choose_gpus,
                             THROUGHPUT).predicted_step_seconds
        raise InfeasibleError(floor_message(spec, objective, fastest,
                                            problem.global_batch_size)) from None


def _solve(spec: CephaloJobSpec, problem: Problem, choose_gpus: bool,
           objective: Objective) -> Plan:
    # Keeping everything (no recompute) is job-wide (it changes every rank's collectives);
    # recompute mode chooses per rank how many blocks keep their graphs. Each mode is solved
    # exactly and the faster kept, so the plan is the optimum over both. Keeping everything
    # is tried only where it can fit, and wins a tie: recompute mode ties it only by
    # keeping blocks whose second gather the model hides under compute, which the engine
    # still issues (bench/hetero_cpu.py measured keep-all faster in such a tie).
    # Between them, every block in the engine's fused tail (job-wide too: all L blocks kept
    # on every working rank, run per microbatch with the head): no recompute, no second
    # gather, one microbatch's graphs. It beats a tie of recompute mode (it gathers less) and
    # loses one to keeping everything (which does not gather the embedding again).
    modes: list[tuple[Choice, int, bool]] = []
    floor_missed: FloorNotMetError | None = None
    hybrid_missed: HybridInfeasibleError | None = None
    sharding = spec.planner.sharding
    if sharding == "hybrid" and objective.is_cost:
        raise InfeasibleError("planner.sharding: hybrid plans for throughput only: set "
                              "planner.objective: throughput, or sharding auto or flat")
    if objective.is_cost:
        sharding = "flat"  # the cost objective ranks flat GPU subsets only (for now)
    flats: list[tuple[Problem, tuple[Choice, int, bool]]] = []  # auto: each mode's flat
    for priced in (problem, fused_everything(problem), without_recompute(problem)):
        if priced is None:
            continue
        try:
            if sharding == "hybrid":
                mode = _solve_hybrid(priced, choose_gpus)
            else:
                flats.append((priced, _solve_flat(priced, choose_gpus, objective)))
                continue
        except FloorNotMetError as err:
            floor_missed = faster_miss(floor_missed, err)
            continue
        except HybridInfeasibleError as err:
            hybrid_missed = hybrid_missed or err
            continue
        except InfeasibleError:
            if priced is problem:
                raise  # recompute mode fits wherever any mode does: its error says why
            continue
        modes.append(mode)
    if sharding == "auto":
        modes = _with_hybrid(flats, choose_gpus)
    elif sharding == "flat":
        modes = [flat for _, flat in flats]
    if not modes and hybrid_missed is not None:
        raise hybrid_missed
    if not modes:
        assert floor_missed is not None
        raise floor_missed
    best = modes[0]
    for mode in modes[1:]:
        if objective.key(mode[0].counts, mode[0].step_seconds) <= objective.key(
                best[0].counts, best[0].step_seconds) * (1 + 1e-12):
            best = mode
    fastest = best[0]
    everything = every_gpu(modes) if choose_gpus and not objective.is_cost else None
    min_gain = spec.planner.min_gain_to_idle_gpus
    kept_every_gpu = everything is not None and everything[0] is not fastest and \
        everything[0].step_seconds <= fastest.step_seconds * (1 + min_gain)
    if kept_every_gpu:
        assert everything is not None
        best = everything  # fewer GPUs gain less than the margin: every GPU gets a rank
    choice, solved, exhaustive = best
    # Every GPU's step (the idle GPUs' reason): the faster mode there, whichever won here.
    full = [c.full_step_seconds for c, _, _ in modes if c.full_step_seconds is not None]
    choice.full_step_seconds = min(full, default=None)
    sol: Solution = choice.solution  # type: ignore[assignment]
    # A proven gap holds over every mode: measured from the least lower bound of any, over
    # every subset of the GPUs, or on every GPU when the margin kept them all.
    if kept_every_gpu:
        lower = min(_gap_free(m[0].full) for m in modes if m[0].full is not None)
    else:
        lower = min(c.step_seconds - (c.gap_seconds if choose_gpus else _gap(c))
                    for c, _, _ in modes)
    gap = max(0.0, choice.step_seconds - lower)
    if choose_gpus:
        choice.gap_seconds = max(choice.gap_seconds, gap)
    sol.gap_seconds = max(sol.gap_seconds, gap)
    evaluation = score(choice.problem, sol.micro, sol.ell, even_units=sol.even_units,
                       kept=sol.kept)
    assert evaluation.feasible, evaluation.reason
    plan = _plan(problem, choice, sol, evaluation, solved, exhaustive, choose_gpus)
    if sharding != "flat":
        record_sharding(plan, choice, problem, sharding, spec.gather_precision,
                        spec.reduce_precision)
    if choose_gpus:
        note_min_gain(plan, choice, fastest, min_gain, kept_every_gpu)
    plan.cost = plan_cost(spec, problem, choice.counts, evaluation.step_seconds, objective)
    if objective.is_cost:
        plan.search["objective"] = "cost"
        if choice.full_step_seconds is not None and plan.idle_gpus:
            cost_idle_reason(plan, objective, problem, choice)
    if choice.problem.rank_cost(0).fused_all:
        # The engine decides the fused tail from the plan alone: it must run what was priced.
        assert plan_fused_tail_blocks(plan) == problem.model.num_layers, plan.ranks
    # Last: where each rank keeps its boundary activations (offload only where they do not
    # fit; per rank, the collectives do not change). `choice.problem`: the GPUs used.
    return offload_plan(plan, choice.problem)


def _gap_free(choice: Choice | None) -> float:
    """The least step `choice`'s GPUs can take (its step less its solution's gap)."""
    assert choice is not None
    return choice.step_seconds - _gap(choice)


def _gap(choice: Choice) -> float:
    solution: Solution = choice.solution  # type: ignore[assignment]
    return solution.gap_seconds


def _solve_hybrid(problem: Problem, choose_gpus: bool) -> tuple[Choice, int, bool]:
    """The best hybrid choice of GPUs and split for `problem`'s recompute mode
    (planner.sharding: hybrid), how many layouts were solved and whether that was all."""
    search = search_layouts(problem, solve_fixed, _solution_step, every_gpu=not choose_gpus)
    if search.best is None:
        raise HybridInfeasibleError(no_layout_message(problem, search))
    search.best.full = search.full
    search.best.full_step_seconds = None if search.full is None else search.full.step_seconds
    return search.best, search.solved, search.exhaustive


def _with_hybrid(flats: list[tuple[Problem, tuple[Choice, int, bool]]],
                 choose_gpus: bool) -> list[tuple[Choice, int, bool]]:
    """planner.sharding: auto. Each recompute mode's flat choice, replaced by the mode's
    fastest hybrid layout where that is predicted HYBRID_MIN_GAIN faster than the fastest
    flat plan of any mode (on any GPUs, and on every GPU for the idle margin's
    comparison): the margin weighs the best of each sharding, not mode by mode."""
    if not flats:
        return []
    flat_best = min(flat.step_seconds for _, (flat, _, _) in flats)
    flat_full = min((flat.full.step_seconds for _, (flat, _, _) in flats
                     if flat.full is not None), default=math.inf)
    bar, bar_full = hybrid_must_beat(flat_best), hybrid_must_beat(flat_full)
    modes = []
    for problem, (flat, solved, exhaustive) in flats:
        search = search_layouts(problem, solve_fixed, _solution_step,
                                every_gpu=not choose_gpus, beat_seconds=bar,
                                beat_full_seconds=bar_full)
        # (gpu_subsets_solved and _exhaustive stay the flat search's: a plan flat wins
        # keeps its bytes; the layouts are every one of their space unless a cluster has
        # too many.)
        exhaustive = exhaustive and search.exhaustive
        full = flat.full
        if search.full is not None and search.full.step_seconds < bar_full:
            full = search.full
            # What it beat, for its sharding_reason where the idle margin keeps every GPU
            # (it is then the plan, not `search.best`): flat on every GPU.
            full.other_sharding_step_seconds = flat_full
        chosen = flat if search.best is None else search.best
        if chosen is not flat:
            # The proven bound holds over both spaces: the flat search's and the layouts'.
            lower = min(flat.step_seconds - flat.gap_seconds,
                        chosen.step_seconds - chosen.gap_seconds)
            chosen.gap_seconds = max(0.0, chosen.step_seconds - lower)
            chosen.other_sharding_step_seconds = flat_best
        chosen.full = full
        chosen.full_step_seconds = None if full is None else full.step_seconds
        modes.append((chosen, solved, exhaustive))
    return modes


def _solve_flat(problem: Problem, choose_gpus: bool,
                objective: Objective) -> tuple[Choice, int, bool]:
    """The best flat choice of GPUs and split for `problem`'s recompute mode, how many GPU
    sets were solved and whether that was all of them (today's search)."""
    if choose_gpus:
        return search_subsets(problem, solve_fixed, _solution_step, objective)
    fixed = solve_fixed(problem)
    everything = list(range(problem.world_size))
    choice = Choice([len(c.slots) for c in problem.classes], problem, everything, fixed,
                    _solution_step(problem, fixed))
    choice.full = choice
    if not objective.meets_floor(choice.step_seconds):
        raise FloorNotMetError(choice.step_seconds)
    return choice, 1, True  # exact for the GPUs given: no other set was asked


@dataclass
class Solution:
    micro: list[int]
    ell: list[int]
    even_units: EvenUnits  # sharded 1/N each; the others water-filled
    memory_binding: bool  # the aggregate memory constraint decided the search
    gap_seconds: float  # proven distance to the optimum of this GPU set (0: exact)
    num_layers: int = 0
    # Per rank, the blocks whose graphs it keeps (recompute mode; RankPlan.kept_blocks).
    kept: list[int] | None = None
    # Only some kept-block counts were offered to the search (kept_blocks.py): exact over
    # those only.
    kept_subset: bool = False

    @property
    def even(self) -> bool:
        """Every unit sharded evenly."""
        return self.even_units.is_all(self.num_layers)


def _solution_step(problem: Problem, sol: Solution) -> float:
    return score(problem, sol.micro, sol.ell, even_units=sol.even_units,
                 kept=sol.kept).step_seconds


def solve_problem(problem: Problem) -> tuple[list[int], list[int], bool, bool]:
    """Per-rank (m, ℓ) of least bottleneck time on all of `problem`'s GPUs, whether all
    shards are even, and whether the aggregate memory check decided the search (a per-unit
    mix reads as not even: `solve_fixed` says which units are)."""
    sol = solve_fixed(problem)
    return sol.micro, sol.ell, sol.even, sol.memory_binding


def solve_fixed(problem: Problem) -> Solution:
    """The least bottleneck on exactly `problem`'s GPUs (in its replica groups, if any).

    Every unit is sharded evenly (1/N: no uneven-collective overhead, but each GPU holds
    1/N of it) or skewed (water-filled over the memory left). Each distinct even set
    (unit_shards.py: embedding/head even or not, k of the L identical blocks) is searched
    exactly: its even units reserve their 1/N share on every GPU, its collectives are
    priced per unit, and the skewed units need the aggregate memory room. All-even and
    all-skewed are two of the sets. The fastest wins; a tie goes to more even units."""
    if problem.groups:
        return _solve_groups(problem)
    _precheck(problem)
    found, lower, _ = search_even_sets(problem)
    if found is None:
        raise InfeasibleError(_no_split_message(problem))
    result = found.result
    micro, ell, kept = _pick_configs(problem, found.tables, found.room_bytes, result)
    # The optimum is at least the least lower bound over all even sets.
    gap = max(0.0, result.threshold_seconds - lower)
    return Solution(micro, ell, found.even, result.memory_checked_exactly, gap,
                    problem.model.num_layers, kept,
                    any(t.kept_subset for t in found.tables))


def _solve_groups(problem: Problem) -> Solution:
    """Hybrid (hybrid.py): every unit sharded evenly inside each replica group, each rank
    holding 1/k of the state; the all-even search, exact (no aggregate memory constraint:
    the per-rank one implies it)."""
    layers = problem.model.num_layers
    tables = class_tables(problem, uneven=False, kept_blocks=True,
                          state_share_bytes=problem.state_bytes / problem.shard_group_size)
    result = min_bottleneck(tables, problem.global_batch_size, math.inf)
    if result is None:
        raise InfeasibleError(_no_split_message(problem))
    micro, ell, kept = _pick_configs(problem, tables, math.inf, result)
    return Solution(micro, ell, EvenUnits.all(layers), False, result.gap_seconds, layers,
                    kept, any(t.kept_subset for t in tables))


def _pick_configs(problem: Problem, tables: list[ClassTable], room: float,
                  result: SearchResult) -> tuple[list[int], list[int], list[int]]:
    """Per rank (m, ℓ, kept blocks) for the search's batch split: the least memory within
    the threshold, then, ranks in order, the fastest for the same batch (more kept blocks,
    a larger microbatch) while the aggregate memory still fits. The slowest ranks go first:
    the step does not get slower either way, but the ranks nearest the bottleneck are where
    the speed matters if the cost model is off."""
    micro = [0] * problem.world_size
    ell = [0] * problem.world_size
    kept = [0] * problem.world_size
    chosen_memory = 0.0
    picks: list[tuple[int, ClassTable, np.ndarray]] = []
    for c, (cls, table) in enumerate(zip(problem.classes, tables, strict=True)):
        for rank, batch in zip(cls.slots, result.batches[c], strict=True):
            ok = np.flatnonzero((table.batch == batch) &
                                (table.seconds <= result.threshold_seconds))
            # Least memory first (that is what the search guaranteed fits), then fastest.
            order = ok[np.lexsort((table.seconds[ok], table.memory_bytes[ok]))]
            picks.append((rank, table, order))
            micro[rank], ell[rank] = int(table.micro[order[0]]), int(table.ell[order[0]])
            kept[rank] = table.kept_at(order[0])
            chosen_memory += float(table.memory_bytes[order[0]])
    # Spend leftover memory on speed: move each rank to its fastest configuration for the
    # same batch while the aggregate memory constraint still holds (slowest ranks first).
    for rank, table, order in sorted(picks, key=lambda p: (-float(p[1].seconds[p[2][0]]),
                                                           p[0])):
        fastest = order[np.lexsort((table.memory_bytes[order], table.seconds[order]))][0]
        current = order[0]
        extra = float(table.memory_bytes[fastest] - table.memory_bytes[current])
        if fastest != current and chosen_memory + extra <= room:
            micro[rank], ell[rank] = int(table.micro[fastest]), int(table.ell[fastest])
            kept[rank] = table.kept_at(fastest)
            chosen_memory += extra
    return micro, ell, kept


def _precheck(problem: Problem) -> None:
    """Clear errors for the common impossible cases, before any search."""
    n, batch = problem.world_size, problem.global_batch_size
    if not problem.allow_state_only and batch < n:
        raise InfeasibleError(
            f"global batch {batch} is smaller than the {n} GPUs and state-only ranks are "
            f"disabled (planner.allowStateOnlyRanks: false): raise globalBatchSize to at "
            f"least {n}, use fewer GPUs, or allow state-only ranks")
    for cls in problem.classes:
        smallest = 0 if problem.allow_state_only else 1
        need = float(cls.cost.compute_memory_bytes(np.array([smallest]))[0])
        if need > cls.budget_bytes:
            what = "the gathered unit buffers" if smallest == 0 else "a microbatch of 1 sample"
            raise InfeasibleError(
                f"{cls.gpu.name} cannot hold {what}: needs {gib(need)} beyond the training "
                f"state, its budget is {gib(cls.budget_bytes)} at "
                f"{problem.memory_fraction:.0%} of {gib(cls.cost.memory_capacity_bytes)}; "
                f"leave it out (gpuPools) or raise planner.memoryFraction")
    minimum = _min_compute_bytes(problem)
    if problem.state_bytes + minimum > problem.total_budget_bytes:
        raise InfeasibleError(_memory_message(problem, minimum))


def _min_compute_bytes(problem: Problem) -> float:
    """Least total compute memory of any split (smallest microbatches everywhere)."""
    per_class = []
    for cls in problem.classes:
        sizes = np.array([0, 1] if problem.allow_state_only else [1])
        per_class.append(float(cls.cost.compute_memory_bytes(sizes).min()) * len(cls.slots))
    return sum(per_class)


def _memory_message(problem: Problem, minimum_compute: float) -> str:
    state = problem.state_bytes
    per_parameter = state_bytes_per_parameter(problem.precision)
    msg = (f"needs {gib(state)} of training state ({_count(problem.model.total_parameters())} "
           f"parameters x {per_parameter} bytes) + at least {gib(minimum_compute)} of compute "
           "memory, the "
           f"selected GPUs offer {gib(problem.total_budget_bytes)} at "
           f"{problem.memory_fraction:.0%}")
    biggest = max(problem.classes, key=lambda c: c.budget_bytes)
    room_each = biggest.budget_bytes - float(biggest.cost.compute_memory_bytes(np.array([1]))[0])
    if room_each > 0:
        have = sum(len(c.slots) for c in problem.classes if c is biggest)
        need = math.ceil(state / room_each)
        msg += (f"; {need} x {biggest.gpu.name} alone would fit (the cluster has {have}), "
                f"or lower the training state with a smaller model")
    return msg


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def _no_split_message(problem: Problem) -> str:
    return (f"no split of the global batch {problem.global_batch_size} over "
            f"{problem.world_size} GPUs fits: the training state ({gib(problem.state_bytes)}) "
            f"plus compute memory exceeds the {gib(problem.total_budget_bytes)} the GPUs offer "
            f"at {problem.memory_fraction:.0%}; use more or larger GPUs or a smaller model")


def _plan(full: Problem, choice: Choice, sol: Solution, ev: Evaluation, solved: int,
          exhaustive: bool, chose_gpus: bool) -> Plan:
    problem, micro, ell = choice.problem, sol.micro, sol.ell
    layers = problem.model.num_layers
    rank_ratios, per_unit = unit_shard_ratios(ev.even_units or EvenUnits.none(), layers,
                                              problem.world_size, ev.shard_ratios)
    ranks = []
    notes = precision_notes(problem)
    precisions = rank_precisions(problem)
    for r, (gpu, pool) in enumerate(problem.ranks):
        cost = problem.rank_cost(r)
        batch = micro[r] * ell[r]
        kept = sol.kept[r] if sol.kept and cost.recompute else 0
        if cost.fused_all and batch:
            kept = layers  # every block: the engine runs them all per microbatch
        ranks.append(RankPlan(
            rank=r, gpu=gpu, pool=pool, node=None, batch_size=batch,
            micro_batch_size=micro[r], num_micro_batches=ell[r],
            shard_ratio=rank_ratios[r], predicted_step_seconds=ev.rank_seconds[r],
            predicted_memory_bytes=int(ev.rank_memory_bytes[r]),
            memory_capacity_bytes=int(cost.memory_capacity_bytes),
            compute_memory_bytes=int(ev.rank_compute_bytes[r]),
            estimated=cost.estimated, gpu_index=choice.keep[r],
            extrapolated=True if batch and micro[r] > cost.largest_profiled_size else None,
            kept_blocks=kept, precision=precisions[r],
            block_graph_bytes_per_sample=cost.profile.block_graph_bytes_per_sample
            if kept or not cost.recompute else None))
        if batch == 0:
            held = ev.shard_ratios[r] if ev.even_units is None else (
                ev.rank_memory_bytes[r] - ev.rank_compute_bytes[r]) / problem.state_bytes
            notes.append(
                f"rank {r} ({gpu}) gets no samples: it holds {held:.1%} of the "
                f"training state and joins every collective; giving it any samples would make "
                f"the step slower than {ev.step_seconds:.4g} s")
    idle = _idle_gpus(full, choice, ev.step_seconds)
    # Baselines run every GPU given (that is what they are): the full problem.
    baselines = compute_baselines(full)
    even = baselines["even_fsdp"].predicted_samples_per_second
    sps = ev.samples_per_second
    if even and sps:
        notes.append(f"predicted {sps / even:.2f}x the throughput of even FSDP")
    estimated = sorted({gpu for r, (gpu, _) in enumerate(problem.ranks)
                        if problem.rank_cost(r).estimated})
    if estimated:
        notes.append("no measured profile for " + ", ".join(estimated) +
                     ": their times are catalog estimates")
    comm = problem.comm_model  # the ring over the GPUs used
    # Plan.state_bytes: the whole model's state (a hybrid group's share is in each rank's
    # predicted memory).
    whole_state = state_bytes_per_parameter(problem.precision) * problem.model.total_parameters()
    return Plan(
        global_batch_size=problem.global_batch_size, world_size=problem.world_size,
        predicted_step_seconds=ev.step_seconds, predicted_samples_per_second=sps,
        ranks=ranks, baselines=baselines,
        model=problem.model.model_dump(), precision=problem.precision,
        memory_fraction=problem.memory_fraction, state_bytes=whole_state,
        estimated_gpus=estimated, idle_gpus=idle, unit_shard_ratios=per_unit,
        replica_groups=[list(g) for g in problem.groups],
        # None (omitted) when 0 or flat: such plans keep their bytes.
        replicated_fraction=problem.replicated_fraction
        if problem.groups and problem.replicated_fraction else None,
        optimality_gap_seconds=choice.gap_seconds if chose_gpus else sol.gap_seconds,
        assumptions={
            # A hybrid plan's per replica group (4 + 16 (a + (1 - a) / G): hybrid.py).
            "state_bytes_per_parameter": hybrid_state_bytes(
                1, len(problem.groups), problem.precision, problem.replicated_fraction)
            if problem.groups else
            state_bytes_per_parameter(problem.precision),
            "network_bandwidth_bytes_per_second": comm.bandwidth_bytes_per_second,
            "network_latency_seconds": comm.latency_seconds,
            **network_assumptions(problem.network, problem.rank_node),
            "uneven_collective_overhead": UNEVEN_COLLECTIVE_OVERHEAD,
        },
        search={"exact": (choice.gap_seconds if chose_gpus else sol.gap_seconds) == 0.0
                and not sol.kept_subset,
                "gpu_subsets_chosen": chose_gpus,
                # The gap on the GPUs used alone (optimality_gap_seconds: over all subsets).
                "used_gpus_gap_seconds": sol.gap_seconds,
                "aggregate_memory_constraint_binding": sol.memory_binding,
                "gpu_subsets_solved": solved,
                "gpu_subsets_exhaustive": exhaustive,
                **_kept_search_info(sol)},
        notes=notes,
        # None (omitted): the engine's default, recompute (the fused tail is recompute mode
        # keeping every block); plans keep their bytes.
        recompute=None if problem.rank_cost(0).recompute or problem.rank_cost(0).fused_all
        else False,
    )


def _kept_search_info(sol: Solution) -> dict[str, str]:
    """Only where the kept-block counts searched were a subset (kept_blocks.py): plans that
    searched every count keep their bytes."""
    if not sol.kept_subset:
        return {}
    return {"kept_blocks_candidates": "a subset: too many (ℓ, m, k) candidates, so each "
                                      "(ℓ, m) was offered k in {ceil(kmax/2), kmax} only, "
                                      "kmax the most blocks that fit; exact over those"}


def _idle_gpus(full: Problem, choice: Choice, step_seconds: float) -> list[IdleGpus]:
    left = idle_counts(full, choice.counts)
    if not left:
        return []
    used = choice.problem.world_size
    if choice.problem.groups and choice.full_step_seconds is not None:
        groups = choice.problem.groups
        reason = (f"whole nodes left idle to keep the replica groups equal and the step "
                  f"short: {len(groups)} groups of {len(groups[0])} ({used} of the "
                  f"{full.world_size} GPUs) take {step_seconds:.4g} s per step, all of them "
                  f"{choice.full_step_seconds:.4g} s")
    elif choice.full_step_seconds is None:
        reason = (f"the job does not fit on all {full.world_size} GPUs (see the error "
                  f"without them); it runs on {used}")
    else:
        reason = (f"fewer GPUs are faster: {used} of the {full.world_size} take "
                  f"{step_seconds:.4g} s per step, all of them {choice.full_step_seconds:.4g} "
                  f"s (a ring over n GPUs pays n-1 latency hops per collective and moves "
                  f"(n-1)/n of each unit's bytes)")
    return [IdleGpus(gpu=gpu, pool=pool, count=n, reason=reason) for gpu, pool, n in left]
