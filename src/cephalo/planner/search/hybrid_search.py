"""The choice between flat and hybrid sharding in one mode of the solver (`spec.planner.
sharding`): every hybrid layout (hybrid.py) solved by the exact all-even search or proven
unable to beat the best step found, then the faster of flat and hybrid, hybrid only where
it is predicted at least `HYBRID_MIN_GAIN` faster."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from cephalo.api.memory import COMM_BYTES_PER_PARAMETER
from cephalo.api.plan import Plan
from cephalo.planner.search.hybrid import layouts, link_bytes_per_step, replicated_text
from cephalo.planner.search.problem import WIRE_BYTES, InfeasibleError, Problem, gib, layout_problem
from cephalo.planner.search.subset import Choice, cannot_beat

_TIE_RTOL = 1e-12
# `sharding: auto` takes hybrid over flat only where it is predicted at least this much more
# throughput: below, the cost model cannot tell them apart (its error is about the 5 % of
# planner.minGainToIdleGpus' default), and hybrid runs more (a second kind of collective on
# the NICs, the pieces' bookkeeping) on a pipelined model of the cross-group collectives.
# A 0.2 % predicted gain once switched ViT-e on 100 Gbit/s NICs to hybrid.
HYBRID_MIN_GAIN = 0.05
# The replicated fractions every layout is solved at (Plan.replicated_fraction). In the
# fraction a the step is a sum of max(compute, collective) terms, piecewise linear: the
# backward's cross-group bytes grow as (1 + a), the forward's shrink as (1 - a) and each
# rank's optimizer work grows, so the best a balances the two passes' windows; a = 0 and 1
# are the ends (the state sharded across groups as before; every group the whole state).
# Quarters come within the cost model's error (about 5 %, HYBRID_MIN_GAIN) of a fine grid:
# on Cluster B (bench/hybrid_sharding.py) a grid of twentieths gained at most 1.4 %
# (Llama-7B at 10 Gbit/s: 51.9 samples/s at a = 0.05 to 0.2, 51.2 at 0; GPT-2.7B at
# 25 Gbit/s 154.1 at 0.4 against 154.0 at 0.5). Five points keep the exact search over
# layouts x fractions at most 5x the layouts' work, most of it pruned by each point's
# collectives-alone bound.
REPLICATED_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)  # ascending: search_layouts relies on it


def hybrid_must_beat(flat_step_seconds: float) -> float:
    """The step a hybrid plan must be predicted below to be chosen over a flat one."""
    return flat_step_seconds / (1 + HYBRID_MIN_GAIN)


class HybridInfeasibleError(InfeasibleError):
    """`planner.sharding: hybrid` and no hybrid layout fits the job."""


@dataclass
class LayoutSearch:
    best: Choice | None  # the fastest layout that beat `beat_seconds`
    full: Choice | None  # the fastest on every GPU that beat `beat_full_seconds`
    solved: int
    exhaustive: bool
    considered: int  # layouts of the space (0: no topology, or one node)


def search_layouts(problem: Problem, solve_fixed: Callable[[Problem], Any],
                   score_step: Callable[[Problem, Any], float], *, every_gpu: bool,
                   beat_seconds: float = math.inf,
                   beat_full_seconds: float = math.inf) -> LayoutSearch:
    """The fastest hybrid layout of `problem`'s GPUs below `beat_seconds` (the flat plan's
    step: a layout that cannot beat it is pruned unsolved), and the fastest on every GPU
    below `beat_full_seconds`. `every_gpu`: only layouts that use every GPU."""
    found, exhaustive = layouts(problem)
    if every_gpu:
        found = [lay for lay in found if len(lay.ranks) == problem.world_size]
    # Each layout at each replicated fraction with its collectives-alone bound, least first:
    # the likely fastest are solved first and their steps prune the rest (at a tie, more
    # GPUs first, then the least replicated: less memory for the same step).
    candidates = []
    for layout in found:
        on_layout = layout_problem(problem, layout)  # its GPUs once, at each fraction below
        for fraction in REPLICATED_FRACTIONS:
            sub = replace(on_layout, replicated_fraction=fraction)
            if not _holds_state(sub):
                break  # a larger fraction holds more state: no more fit
            candidates.append((_collectives_alone_seconds(sub), -len(layout.ranks),
                               layout.nodes_per_group, fraction, layout, sub))
    candidates.sort(key=lambda c: c[:4])
    best: Choice | None = None
    full: Choice | None = None
    solved = 0
    for bound, _, _, _, layout, sub in candidates:
        whole = len(layout.ranks) == problem.world_size
        beat = min(beat_seconds, math.inf if best is None else best.step_seconds)
        if whole:  # worth solving if it may be the best, or the best on every GPU
            beat = max(beat, min(beat_full_seconds,
                                 math.inf if full is None else full.step_seconds))
        if beat < math.inf and (bound >= beat or cannot_beat(sub, beat)):
            continue
        try:
            solution = solve_fixed(sub)
        except InfeasibleError:
            continue
        solved += 1
        counts = [0] * len(problem.classes)
        for rank in layout.ranks:
            counts[problem.rank_class[rank]] += 1
        choice = Choice(counts, sub, layout.ranks, solution, score_step(sub, solution),
                        gap_seconds=getattr(solution, "gap_seconds", 0.0))
        if whole and (full is None or _faster(choice, full)):
            full = choice
        if (best is None or _faster(choice, best)) and choice.step_seconds < beat_seconds:
            best = choice
    return LayoutSearch(best, full, solved, exhaustive, len(found))


def _holds_state(problem: Problem) -> bool:
    """Whether every GPU holds its 1/k of the state next to its least compute memory (a
    state-only rank, or one sample): the quick test that rules out groups too small for
    the model (a 16 GB node and Llama-7B) before any search."""
    share = problem.state_bytes / problem.shard_group_size
    smallest = np.array([0 if problem.allow_state_only else 1])
    return all(float(cls.cost.compute_memory_bytes(smallest)[0]) + share <= cls.budget_bytes
               for cls in problem.classes)


def _collectives_alone_seconds(problem: Problem) -> float:
    """A lower bound of any split's step on `problem`: the slowest GPU's step with no
    samples (a unit takes at least its collectives: max(compute, collective) + ...), the
    quick test that prunes most layouts where the NICs are slow before `cannot_beat`."""
    comm = problem.unit_comm(uneven=False)
    none = np.zeros(1)
    return max(float(cls.cost.step_seconds(none, none, comm)[0]) for cls in problem.classes)


def _faster(a: Choice, b: Choice) -> bool:
    return a.step_seconds < b.step_seconds * (1 - _TIE_RTOL)


def no_layout_message(problem: Problem, search: LayoutSearch) -> str:
    """Why `planner.sharding: hybrid` has no plan, in one line."""
    if search.considered == 0:
        return ("planner.sharding: hybrid needs at least two nodes of GPUs the planner knows "
                "of (planner.network.nodes, or the cluster's nodes); these GPUs are on one "
                "node or on no known node: use sharding auto or flat")
    weights = COMM_BYTES_PER_PARAMETER * problem.model.total_parameters()
    return (f"planner.sharding: hybrid: no replica groups of whole nodes fit the job (a "
            f"group holds the fp32 weights, {gib(weights)}, and 1/G of the optimizer's "
            f"state, {gib(problem.state_bytes - weights)} in all, next to its ranks' compute "
            "memory); use sharding auto or flat, larger nodes or a smaller model")


def record_sharding(plan: Plan, choice: Choice, problem: Problem, sharding: str,
                    gather_precision: str, reduce_precision: str) -> None:
    """What the plan says of its sharding (Plan.assumptions, printed by report.py): the
    choice, why, and the bytes each link carries per step."""
    used = choice.problem
    other = choice.other_sharding_step_seconds
    step = choice.step_seconds
    if used.groups:
        k, num = len(used.groups[0]), len(used.groups)
        what = f"hybrid: {num} replica groups of {k} GPUs ({_group_nodes(used)}" + \
            (f", {replicated_text(used.replicated_fraction)})" if used.replicated_fraction
             else ")")
        if sharding == "hybrid":
            why = f"{what}, as planner.sharding asks"
        elif other is not None:
            why = f"{what} predicted {step:.4g} s per step, flat sharding {other:.4g} s"
        else:
            why = f"{what}: no flat plan fits"
    elif not layouts(problem)[0]:
        why = ("flat: no replica groups to form (the GPUs share one node, or which GPUs "
               "share a node is not known)")
    else:
        why = (f"flat: no hybrid layout (replica groups of whole nodes) is predicted "
               f"at least {HYBRID_MIN_GAIN:.0%} faster than flat's {step:.4g} s per step")
    plan.assumptions["sharding"] = "hybrid" if used.groups else "flat"
    plan.assumptions["sharding_reason"] = why
    if not used.rank_node:
        return  # no nodes known: no links to count bytes on
    cost = used.rank_cost(0)
    model = used.model
    regathered = 0 if not cost.recompute and not cost.fused_all else (
        model.embedding_parameters() if cost.fused_all else
        model.embedding_parameters() + model.num_layers * model.block_parameters())
    moved = link_bytes_per_step(model, WIRE_BYTES[gather_precision],
                                WIRE_BYTES[reduce_precision], used.rank_node, used.groups,
                                regathered, used.replicated_fraction)
    plan.assumptions["link_bytes_per_step"] = {
        "intra_node_link_per_gpu": moved.intra_node_link_per_gpu,
        "nic_per_node": moved.nic_per_node}


def _group_nodes(problem: Problem) -> str:
    """'one node each' or 'N nodes each'."""
    nodes = len({problem.rank_node[r] for r in problem.groups[0]})
    return "one node each" if nodes == 1 else f"{nodes} nodes each"
