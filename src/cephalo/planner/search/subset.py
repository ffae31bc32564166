"""Which GPUs to use: with real collective latency a ring over more GPUs can make the step
slower (every AllGather/ReduceScatter pays (n−1) latency hops), so the planner may choose
how many GPUs of each class to use and leave the rest idle (no rank, no pod); `solve(...,
choose_gpus=True)` asks for it, `cephalo plan` does.

A choice is a count k_c ≤ count_c per class of identical GPUs (which k GPUs of a class
does not matter: with a topology a class is also of one kind of node, and the first k, in
rank order, fill its nodes one after the other; packed onto the fewest nodes, the ring
crosses the fewest NICs, which is never slower while the intra-node links are at least as
fast as the NICs, with no more latency: topology.py). Every choice is solved by
`solve_fixed` (exact, or with its stated gap); the best wins, ties going to more GPUs.
When the number of choices is small (Π(count_c + 1) − 1 ≤ EXHAUSTIVE_MAX_CHOICES) all are
tried, so the result is the optimum over every subset of the cluster (tests check it
against brute force) and adding GPUs never makes the plan slower. Larger clusters try a
family that always contains the whole cluster (so the plan is never slower than using
every GPU): sets of classes at halving fractions of their counts, smallest first. The plan
then states a proven gap to the optimum over every subset (`subset_lower_bound`: a
relaxation per world-size interval).

A choice is skipped without solving when its GPUs cannot process B samples within the best
step found so far: Σ_c k_c · (largest batch class c finishes in time) < B is a proof.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from cephalo.planner.cost.comm_model import UnitComm
from cephalo.planner.search.pricing import THROUGHPUT, FloorNotMetError, Objective
from cephalo.planner.search.problem import (
    InfeasibleError,
    Problem,
    class_tables,
    first_gpus,
    subset_problem,
)

EXHAUSTIVE_MAX_CHOICES = 256
# Relative slack of the sample-count bounds below: a float sum of counts may round low.
_BOUND_RTOL = 1e-9
# Class sets tried in full when there are few classes (2^C − 1 of them); beyond, the whole
# set, each class alone and the prefixes by memory and by speed.
_MAX_CLASSES_FOR_ALL_SETS = 6


@dataclass
class Choice:
    counts: list[int]  # GPUs used per class of the full problem
    problem: Problem  # the job on those GPUs only
    keep: list[int]  # per rank of `problem`: its rank in the full problem
    solution: object  # solver.Solution (typed loosely: solver imports this module)
    step_seconds: float
    full_step_seconds: float | None = None  # every GPU used (None: that does not fit)
    # The whole cluster's choice in the same mode (None: it does not fit); `solve` keeps it
    # over a faster subset that gains less than planner.minGainToIdleGpus.
    full: Choice | None = None
    # Proven distance of step_seconds to the least step over every subset of the GPUs.
    gap_seconds: float = 0.0
    # The best step of the sharding not chosen in this mode (flat for a hybrid choice and
    # the reverse; None: none fits, or proven no faster unsolved): the plan's reason.
    other_sharding_step_seconds: float | None = None


def choices(problem: Problem) -> tuple[list[list[int]], bool]:
    """The per-class counts to try (whole cluster first) and whether they are all."""
    full = [len(c.slots) for c in problem.classes]
    total = math.prod(k + 1 for k in full)
    if total - 1 <= EXHAUSTIVE_MAX_CHOICES:
        every = [list(k) for k in itertools.product(*(range(k, -1, -1) for k in full))]
        return [k for k in every if any(k)], True
    # A class that cannot hold even its smallest configuration next to nothing is never
    # worth trying; among the rest, every set of classes when few, else the whole set, each
    # class alone, and the prefixes of the classes by memory budget and by speed.
    capable = [c for c, cls in enumerate(problem.classes) if _can_hold_anything(problem, cls)]
    num = len(full)
    masks: list[tuple[int, ...]]
    if len(capable) <= _MAX_CLASSES_FOR_ALL_SETS:
        masks = [tuple(int(c in chosen) for c in range(num))
                 for size in range(len(capable), 0, -1)
                 for chosen in itertools.combinations(capable, size)]
    else:
        speed = [s.speed_weight for s in class_tables(problem, uneven=False,
                                                       micro_sizes=[1])]
        orders = [sorted(capable, key=lambda c: -problem.classes[c].budget_bytes),
                  sorted(capable, key=lambda c: -speed[c])]
        masks = [tuple(int(c in capable) for c in range(num))]
        masks += [tuple(int(c in order[:size]) for c in range(num))
                  for order in orders for size in range(1, len(order))]
        masks += [tuple(int(c == one) for c in range(num)) for one in capable]
    out: list[list[int]] = [full]
    seen = {tuple(full)}
    for mask in masks:
        scale = 1.0
        while True:
            counts = [math.ceil(k * scale) if on else 0 for k, on in zip(full, mask, strict=True)]
            if tuple(counts) not in seen:
                seen.add(tuple(counts))
                out.append(counts)
            if all(c <= 1 for c, on in zip(counts, mask, strict=True) if on):
                break
            scale /= 2
    return out, False


def _can_hold_anything(problem: Problem, cls) -> bool:
    smallest = np.array([0 if problem.allow_state_only else 1])
    return float(cls.cost.compute_memory_bytes(smallest)[0]) <= cls.budget_bytes


def cannot_beat(sub: Problem, step_seconds: float) -> bool:
    """True when no split of B on `sub`'s GPUs finishes below `step_seconds` with either
    sharding: even under even shards' collectives (uneven ones only cost more) and with no
    state share in any GPU's memory (looser than both partitions), the largest batch each
    GPU finishes in time does not add up to B (kept blocks: `reachable_samples`)."""
    comm = sub.unit_comm(uneven=False)
    counts = [len(cls.slots) for cls in sub.classes]
    reach = reachable_samples(sub, counts, comm, step_seconds, strict=True)
    # A proof must survive rounding: the bound is a float sum of sample counts (fractional
    # only in the knapsack's last GPU), so a shortfall within rounding proves nothing.
    return reach < sub.global_batch_size * (1 - _BOUND_RTOL)


def reachable_samples(problem: Problem, counts: list[int], comm: UnitComm,
                      step_seconds: float, strict: bool, may_idle: bool = False) -> float:
    """An upper bound of the samples `counts[c]` GPUs of each class process within
    `step_seconds` (-1: a GPU can run nothing in time and, unless `may_idle`, must run).
    Each GPU's largest batch without kept blocks counts in full. Keeping blocks (recompute
    mode) lets a GPU go beyond it, up to its largest batch with as many kept blocks as its
    whole budget holds, but then it holds at least one block graph for that many samples,
    and all the graphs together fit in the GPUs' budgets less the training state: a
    fractional knapsack over the classes (most samples per byte first) bounds what they
    add."""
    batch = problem.global_batch_size
    plain = [_largest_batch(cls, comm, batch, step_seconds, problem.allow_state_only, strict)
             if n else 0 for cls, n in zip(problem.classes, counts, strict=True)]
    total = float(sum(n * max(most, 0) for n, most in zip(counts, plain, strict=True)))
    if total >= batch and min(plain) >= 0:
        return total  # enough without kept blocks: no need to price them
    # (samples per byte, bytes per GPU, samples per GPU, GPUs)
    gains: list[tuple[float, float, float, int]] = []
    smallest = 0 if problem.allow_state_only else 1
    for cls, n, most in zip(problem.classes, counts, plain, strict=True):
        if not n:
            continue
        kept = most
        if cls.cost.can_keep_blocks:
            kept = max(most, _largest_batch(cls, comm, batch, step_seconds,
                                            problem.allow_state_only, strict, kept=True))
        if kept < 0 and not may_idle:
            return -1.0
        extra = kept - max(most, 0)
        if extra > 0:
            # At least one graph for its samples, and a microbatch's compute memory beyond
            # the least any used GPU holds (counted in the room below).
            least, one = cls.cost.compute_memory_bytes(np.array([smallest, 1]))
            graph = float(cls.cost.block_graph_bytes(np.array([max(most, 0) + 1]))[0]) + \
                max(0.0, float(one - least))
            gains.append((extra / graph, graph, float(extra), n))
    # What the GPUs leave beyond their least compute memory and the training state (an
    # idle GPU adds nothing, so none adds less than nothing).
    room = -float(problem.state_bytes)
    for cls, n in zip(problem.classes, counts, strict=True):
        least = float(cls.cost.compute_memory_bytes(np.array([smallest]))[0])
        room += n * max(0.0, cls.budget_bytes - least)
    for _, graph, samples, n in sorted(gains, reverse=True):
        if room <= 0:
            break
        # Whole GPUs add their extra samples exactly (graph x (extra / graph) may round
        # below it, and a bound of 1.9999999999999998 samples for B = 2 pruned a subset
        # that was the optimum: seed 14863 of the oracle tests); the last one a fraction.
        if n * graph <= room:
            total += n * samples
            room -= n * graph
        else:
            total += samples * (room / graph)
            room = 0.0
    return total


def _largest_batch(cls, comm, batch: int, step_seconds: float, state_only: bool,
                   strict: bool, kept: bool = False) -> int:
    """max ℓ·m with T(ℓ, m) < step_seconds (≤ unless strict) and m within memory (0: state
    only; -1: nothing in time). T grows with ℓ, so the largest ℓ for every m at once is a
    vectorised bisection. `kept`: each (ℓ, m) keeps as many blocks as fit the whole budget
    (a relaxation: the fastest it can be), only over the sizes that keep one at ℓ = 1 (the
    count falls as ℓ grows, so T still grows; the others are the plain answer's)."""
    sizes = np.arange(1, batch + 1)
    base = cls.cost.compute_memory_bytes(sizes)
    sizes, base = sizes[base <= cls.budget_bytes], base[base <= cls.budget_bytes]
    if kept:
        some = cls.cost.max_kept_blocks(sizes, np.ones_like(sizes), cls.budget_bytes,
                                        base) > 0
        sizes, base = sizes[some], base[some]
    per_micro = cls.cost.compute_seconds(sizes)  # the same for every ℓ: once
    lo = np.zeros(sizes.size, dtype=np.int64)  # largest ℓ known in time (0: none)
    hi = batch // sizes  # largest ℓ that may be
    while np.any(lo < hi):
        mid = (lo + hi + 1) // 2
        most = cls.cost.max_kept_blocks(sizes, mid, cls.budget_bytes, base) if kept else None
        seconds = cls.cost.step_seconds(mid, sizes, comm, most, per_micro)
        fast = seconds < step_seconds if strict else seconds <= step_seconds
        lo = np.where(fast & (lo < hi), mid, lo)
        hi = np.where(~fast & (lo < hi), mid - 1, hi)
    largest = int((lo * sizes).max(initial=0))
    if largest == 0 and kept:
        return -1  # no size in time even keeping blocks: the plain answer stands
    if largest == 0:
        zero_fits = state_only and float(cls.cost.compute_memory_bytes(np.zeros(1))[0]) <= \
            cls.budget_bytes and float(cls.cost.step_seconds(
                np.zeros(1), np.zeros(1), comm)[0]) < step_seconds
        return 0 if zero_fits else -1
    return largest


def search_subsets(problem: Problem, solve_fixed, score_step,
                   objective: Objective = THROUGHPUT) -> tuple[Choice, int, bool]:
    """The best choice, how many choices were solved, and whether all were considered.

    `solve_fixed(problem) -> Solution` raises InfeasibleError; `score_step(problem,
    solution) -> seconds`. `objective` (pricing.py): the least step time, or the least price
    per sample among the choices within the throughput floor (FloorNotMetError: none)."""
    candidates, exhaustive = choices(problem)
    # The whole cluster first (its time is the idle GPUs' reason), then the smallest choices:
    # they are quick to solve, and their step time prunes most of the larger ones unsolved.
    candidates = candidates[:1] + sorted(candidates[1:], key=sum)
    best: Choice | None = None
    first_error: InfeasibleError | None = None
    solved = 0
    full: Choice | None = None
    fastest = math.inf  # least step of any choice solved (the floor's error says it)
    floor_pruned = False  # a choice was proven slower than the floor before any fit
    lowest = float("inf")  # least proven lower bound among the choices solved
    for counts in candidates:
        keep = first_gpus(problem, counts)
        sub = subset_problem(problem, keep)

        # A choice that cannot run B samples below the step it must beat (or the floor's)
        # is pruned unsolved.
        beat = objective.step_to_beat(counts, math.inf if best is None else
                                      objective.key(best.counts, best.step_seconds))
        if beat < math.inf and cannot_beat(sub, beat):
            floor_pruned = floor_pruned or best is None
            continue
        try:
            solution = solve_fixed(sub)
        except InfeasibleError as err:
            if counts == candidates[0]:
                first_error = err
            continue
        solved += 1
        step = score_step(sub, solution)
        lowest = min(lowest, step - solution.gap_seconds)
        choice = Choice(counts, sub, keep, solution, step)
        if counts == candidates[0]:
            full = choice
        fastest = min(step, fastest)
        if not objective.meets_floor(step):
            continue
        if best is None or _better(objective, choice, best):
            best = choice
    if best is None:
        if fastest < math.inf or floor_pruned:
            raise FloorNotMetError(fastest if fastest < math.inf else None)
        raise first_error or InfeasibleError("no subset of the GPUs fits the job")
    best.full = full
    best.full_step_seconds = None if full is None else full.step_seconds
    if objective.is_cost:
        # The bounds below are of step times, not prices: the cost search is exact over the
        # choices it considered (all of them when `exhaustive`), each to its solution's gap.
        best.gap_seconds = best.solution.gap_seconds  # type: ignore[attr-defined]
        return best, solved, exhaustive
    # Every choice is solved (bounded by its own gap) or proven unable to beat the best; a
    # partial search adds the bound over every subset.
    bound = lowest if exhaustive else min(lowest, subset_lower_bound(problem, best.step_seconds))
    best.gap_seconds = max(0.0, best.step_seconds - bound)
    return best, solved, exhaustive


def _better(objective: Objective, choice: Choice, best: Choice) -> bool:
    """Strictly better by the objective; at a tie faster, then on more GPUs (choices that
    could only tie are pruned unsolved, so a tie may also go to fewer GPUs)."""
    key = objective.key(choice.counts, choice.step_seconds)
    best_key = objective.key(best.counts, best.step_seconds)
    if key < best_key * (1 - 1e-12):
        return True
    if key > best_key * (1 + 1e-12):
        return False
    if choice.step_seconds < best.step_seconds * (1 - 1e-12):
        return True
    return choice.step_seconds <= best.step_seconds * (1 + 1e-12) and \
        sum(choice.counts) > sum(best.counts)


# Bisection steps on the time threshold of one world-size interval's bound.
_BOUND_STEPS = 40
# World-size intervals [n1, n1·1.25]: collectives are priced at n1 for the whole interval,
# so narrower intervals give a tighter bound (at more intervals to bound).
_INTERVAL_RATIO_PERCENT = 125


def subset_lower_bound(problem: Problem, best_seconds: float) -> float:
    """A proven lower bound of the least step time over *every* subset of the GPUs, for a
    non-exhaustive search: the plan is within `best_seconds − bound` of the optimum.

    Subsets are grouped by world size n into intervals [n1, 1.25·n1] (1, 2, 3, 4–5, 6–7, …). For an
    interval [n1, n2] the relaxation prices the collectives at n1 (ring time grows with n),
    the optimizer's share at P/n2, ignores the uneven shards' overhead, lets every GPU idle,
    and uses at most min(count, n2) GPUs per class. Its least threshold at which the
    classes' largest batches add up to B is at most the step time of any subset in the
    interval; an interval whose GPUs cannot hold the training state has no subset at all.
    With a topology a ring of n1 is priced at the fastest link and least hop latency a ring
    of at least n1 of the GPUs may have across nodes, or on one node of each kind with that
    node's GPUs only (`Problem.ring_bounds`)."""
    batch = problem.global_batch_size
    params = problem.model.total_parameters()
    bound = best_seconds
    n1 = 1
    while n1 <= problem.world_size:
        n2 = min(max(n1, n1 * _INTERVAL_RATIO_PERCENT // 100), problem.world_size)
        if _memory_room(problem, n2) < problem.state_bytes:
            n1 = n2 + 1  # no n2 GPUs hold the training state: nothing here fits
            continue
        # Each way a ring of n1..n2 GPUs may run (one flat ring without a topology; with
        # one, across nodes or on one node of a kind): its fastest ring and the GPUs it may
        # use. A subset in the interval runs one of them.
        cases = [(replace(UnitComm.build(problem.model, ring, n1, uneven=False),
                          state_share_parameters=params / n2),
                  [min(k, n2) for k in counts]) for ring, counts in problem.ring_bounds(n1)]

        def reaches(threshold: float, cases: list = cases) -> bool:  # type: ignore[type-arg]
            # Every GPU may idle: a class that runs nothing in time adds nothing.
            return any(reachable_samples(problem, counts, comm, threshold, strict=False,
                                         may_idle=True) >= batch * (1 - _BOUND_RTOL)
                       for comm, counts in cases)

        if reaches(bound * (1 - 1e-9)):  # this interval may beat the bound so far
            lo, hi = 0.0, bound
            for _ in range(_BOUND_STEPS):
                mid = 0.5 * (lo + hi)
                if reaches(mid):
                    hi = mid
                else:
                    lo = mid
            bound = min(bound, lo)
        n1 = n2 + 1
    return bound


def _memory_room(problem: Problem, n2: int) -> float:
    """The most memory any set of at most n2 GPUs per class leaves for the training state:
    each GPU's budget less its least compute memory (state only, or one sample)."""
    smallest = np.array([0 if problem.allow_state_only else 1])
    return sum(min(len(cls.slots), n2) * max(0.0, cls.budget_bytes - float(
        cls.cost.compute_memory_bytes(smallest)[0])) for cls in problem.classes)


def idle_counts(problem: Problem, counts: list[int]) -> list[tuple[str, str, int]]:
    """(gpu, pool, idle count) per (gpu, pool), in cluster order."""
    used = {slot for cls, k in zip(problem.classes, counts, strict=True)
            for slot in cls.slots[:k]}
    idle: dict[tuple[str, str], int] = {}
    for rank, (gpu, pool) in enumerate(problem.ranks):
        if rank not in used:
            idle[(gpu, pool)] = idle.get((gpu, pool), 0) + 1
    return [(gpu, pool, n) for (gpu, pool), n in idle.items()]
