"""Baselines scored by the same cost model as Cephalo's plan, reported in every plan.

* even_fsdp            B/N samples per GPU in one microbatch, even shards (plain FSDP).
* fsdp_grad_accum      B/N per GPU, FSDP's own accumulation (every microbatch re-gathers
                       every unit), the fewest microbatches that fit, even shards.
* compute_proportional batches proportional to each GPU's speed (Whale-like), one microbatch,
                       even shards.
* compute_balance_only the paper's Cephalo-CB: the exact best batch split without gradient
                       accumulation, with even shards.
* memory_balance_only  the paper's Cephalo-MB: B/N per GPU as microbatches of 1 with layered
                       accumulation, state partitioned to balance memory.
"""

from __future__ import annotations

import numpy as np

from cephalo.api.plan import BaselineResult
from cephalo.planner.search.bottleneck import min_bottleneck
from cephalo.planner.search.evaluate import Evaluation, score
from cephalo.planner.search.problem import Problem, class_tables


def _even_batches(problem: Problem) -> list[int]:
    n, batch = problem.world_size, problem.global_batch_size
    return [batch // n + (1 if r < batch % n else 0) for r in range(n)]


def _result(ev: Evaluation | None, reason: str | None = None) -> BaselineResult:
    if ev is None or not ev.feasible:
        return BaselineResult(predicted_samples_per_second=None, feasible=False,
                              reason=reason or (ev.reason if ev else None))
    return BaselineResult(predicted_samples_per_second=ev.samples_per_second, feasible=True,
                          reason=None, predicted_step_seconds=ev.step_seconds)


Assignment = tuple[list[int], list[int]]  # per rank: microbatch sizes, microbatch counts


def even_assignment(problem: Problem) -> Assignment:
    """B/N samples per GPU in one microbatch (what plain FSDP runs)."""
    batches = _even_batches(problem)
    return batches, [1 if b else 0 for b in batches]


def even_fsdp(problem: Problem) -> BaselineResult:
    micro, ell = even_assignment(problem)
    return _result(score(problem, micro, ell, even_shards=True))


def fsdp_grad_accum(problem: Problem) -> BaselineResult:
    share = problem.state_bytes / problem.world_size
    micro, ell = [], []
    for rank, batch in enumerate(_even_batches(problem)):
        if batch == 0:
            micro.append(0)
            ell.append(0)
            continue
        cost, budget = problem.rank_cost(rank), problem.rank_budget(rank)
        fits = [m for m in range(batch, 0, -1) if batch % m == 0
                and cost.compute_memory_bytes(np.array([m]))[0] + share <= budget]
        m = fits[0] if fits else 1  # nothing fits: score microbatch 1 to report the overflow
        micro.append(m)
        ell.append(batch // m)
    return _result(score(problem, micro, ell, even_shards=True, layered=False))


def proportional_assignment(problem: Problem) -> Assignment:
    """Batches proportional to each GPU's speed, one microbatch each (Whale-like)."""
    tables = class_tables(problem, uneven=False)
    speeds = np.array([tables[problem.rank_class[r]].speed_weight
                       for r in range(problem.world_size)])
    exact = speeds / speeds.sum() * problem.global_batch_size
    batches = np.floor(exact).astype(int)
    if not problem.allow_state_only and problem.global_batch_size >= problem.world_size:
        # The job forbids state-only ranks: every rank computes at least one sample, taken
        # from the ranks given the most beyond their exact share.
        batches = np.maximum(batches, 1)
        while batches.sum() > problem.global_batch_size:
            over = max((r for r in range(len(exact)) if batches[r] > 1),
                       key=lambda r: (batches[r] - exact[r], -r))
            batches[over] -= 1
    # Largest remainders get the leftover samples (ties to the lower rank).
    leftover = problem.global_batch_size - int(batches.sum())
    for r in sorted(range(len(exact)), key=lambda r: (-(exact[r] - batches[r]), r))[:leftover]:
        batches[r] += 1
    return [int(b) for b in batches], [1 if b else 0 for b in batches]


def compute_proportional(problem: Problem) -> BaselineResult:
    micro, ell = proportional_assignment(problem)
    return _result(score(problem, micro, ell, even_shards=True))


def compute_balance_only(problem: Problem) -> BaselineResult:
    share = problem.state_bytes / problem.world_size
    tables = class_tables(problem, uneven=False, max_ell=1, state_share_bytes=share)
    found = min_bottleneck(tables, problem.global_batch_size, float("inf"))
    if found is None:
        return _result(None, f"no split of {problem.global_batch_size} samples in single "
                             "microbatches fits next to an even 1/N state shard")
    micro = [0] * problem.world_size
    for c, cls in enumerate(problem.classes):
        for rank, batch in zip(cls.slots, found.batches[c], strict=True):
            micro[rank] = batch
    return _result(score(problem, micro, [1 if m else 0 for m in micro], even_shards=True))


def memory_balance_only(problem: Problem) -> BaselineResult:
    batches = _even_batches(problem)
    micro = [1 if b else 0 for b in batches]
    return _result(score(problem, micro, batches))


BASELINES = {
    "even_fsdp": even_fsdp,
    "fsdp_grad_accum": fsdp_grad_accum,
    "compute_proportional": compute_proportional,
    "compute_balance_only": compute_balance_only,
    "memory_balance_only": memory_balance_only,
}


def compute_baselines(problem: Problem) -> dict[str, BaselineResult]:
    return {name: fn(problem) for name, fn in BASELINES.items()}
