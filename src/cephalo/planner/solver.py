"""`solve(job, cluster, profiles) -> Plan`: the exact optimum of the cost model, then the
training-state partition that minimises the maximum memory utilisation."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from cephalo.api.cluster import ClusterSpec
from cephalo.api.job import CephaloJobSpec
from cephalo.api.plan import Plan, RankPlan
from cephalo.api.profile import GpuProfile
from cephalo.planner.baselines import compute_baselines
from cephalo.planner.costmodel import UNEVEN_COLLECTIVE_OVERHEAD
from cephalo.planner.evaluate import Evaluation, score
from cephalo.planner.problem import (
    InfeasibleError,
    Problem,
    build_problem,
    class_tables,
    gib,
)
from cephalo.planner.search import ClassTable, SearchResult, min_bottleneck


def solve(spec: CephaloJobSpec, cluster: ClusterSpec,
          profiles: Mapping[str, GpuProfile] | None = None) -> Plan:
    """The plan of least predicted step time; InfeasibleError (with numbers) if none fits."""
    problem = build_problem(spec, cluster, profiles)
    micro, ell, even, exact_memory = solve_problem(problem)
    evaluation = score(problem, micro, ell, even_shards=even)
    assert evaluation.feasible, evaluation.reason
    return _plan(problem, micro, ell, evaluation, exact_memory)


def solve_problem(problem: Problem) -> tuple[list[int], list[int], bool, bool]:
    """Per-rank (m, ℓ) of least bottleneck time, whether the shards are even, and whether
    the aggregate memory check went exact.

    Two partitions are searched: water-filled uneven shards (every collective pays the
    uneven overhead) and even 1/N shards (no overhead, but each GPU must fit 1/N of the
    state). The faster wins; a tie goes to even shards."""
    _precheck(problem)
    n = problem.world_size
    results = []
    for even in (True, False) if n > 1 else (True,):
        if even:
            tables = class_tables(problem, uneven=False, state_share_bytes=problem.state_bytes / n)
            room = float("inf")
        else:
            tables = class_tables(problem, uneven=True)
            room = problem.total_budget_bytes - problem.state_bytes
        found = min_bottleneck(tables, problem.global_batch_size, room)
        if found is not None:
            results.append((found.threshold_seconds, not even, tables, room, found))
    if not results:
        raise InfeasibleError(_no_split_message(problem))
    _, uneven, tables, room, result = min(results, key=lambda r: (r[0], r[1]))
    micro, ell = _pick_configs(problem, tables, room, result)
    return micro, ell, not uneven, result.memory_checked_exactly


def _pick_configs(problem: Problem, tables: list[ClassTable], room: float,
                  result: SearchResult) -> tuple[list[int], list[int]]:
    micro = [0] * problem.world_size
    ell = [0] * problem.world_size
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
            chosen_memory += float(table.memory_bytes[order[0]])
    # Spend leftover memory on speed: move each rank to its fastest configuration for the
    # same batch while the aggregate memory constraint still holds (ranks in order).
    for rank, table, order in sorted(picks, key=lambda p: p[0]):
        fastest = order[np.lexsort((table.memory_bytes[order], table.seconds[order]))][0]
        current = order[0]
        extra = float(table.memory_bytes[fastest] - table.memory_bytes[current])
        if fastest != current and chosen_memory + extra <= room:
            micro[rank], ell[rank] = int(table.micro[fastest]), int(table.ell[fastest])
            chosen_memory += extra
    return micro, ell


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
    msg = (f"needs {gib(state)} of training state ({_count(problem.model.total_parameters())} "
           f"parameters x 16 bytes) + at least {gib(minimum_compute)} of compute memory, the "
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


def _plan(problem: Problem, micro: list[int], ell: list[int], ev: Evaluation,
          exact_memory: bool) -> Plan:
    ranks = []
    notes = []
    for r, (gpu, pool) in enumerate(problem.ranks):
        cost = problem.rank_cost(r)
        batch = micro[r] * ell[r]
        ranks.append(RankPlan(
            rank=r, gpu=gpu, pool=pool, node=None, batch_size=batch,
            micro_batch_size=micro[r], num_micro_batches=ell[r],
            shard_ratio=ev.shard_ratios[r], predicted_step_seconds=ev.rank_seconds[r],
            predicted_memory_bytes=int(ev.rank_memory_bytes[r]),
            memory_capacity_bytes=int(cost.memory_capacity_bytes),
            compute_memory_bytes=int(ev.rank_compute_bytes[r]),
            estimated=cost.estimated))
        if batch == 0:
            notes.append(
                f"rank {r} ({gpu}) gets no samples: it holds {ev.shard_ratios[r]:.1%} of the "
                f"training state and joins every collective; giving it any samples would make "
                f"the step slower than {ev.step_seconds:.4g} s")
    baselines = compute_baselines(problem)
    even = baselines["even_fsdp"].predicted_samples_per_second
    sps = ev.samples_per_second
    if even and sps:
        notes.append(f"predicted {sps / even:.2f}x the throughput of even FSDP")
    estimated = sorted({gpu for r, (gpu, _) in enumerate(problem.ranks)
                        if problem.rank_cost(r).estimated})
    if estimated:
        notes.append("no measured profile for " + ", ".join(estimated) +
                     ": their times are catalog estimates")
    comm = problem.comm_model
    return Plan(
        global_batch_size=problem.global_batch_size, world_size=problem.world_size,
        predicted_step_seconds=ev.step_seconds, predicted_samples_per_second=sps,
        ranks=ranks, baselines=baselines,
        model=problem.model.model_dump(), precision=problem.precision,
        memory_fraction=problem.memory_fraction, state_bytes=problem.state_bytes,
        estimated_gpus=estimated,
        assumptions={
            "state_bytes_per_parameter": 16,
            "network_bandwidth_bytes_per_second": comm.bandwidth_bytes_per_second,
            "network_latency_seconds": comm.latency_seconds,
            "uneven_collective_overhead": UNEVEN_COLLECTIVE_OVERHEAD,
        },
        search={"exact": True, "aggregate_memory_constraint_binding": exact_memory},
        notes=notes,
    )
