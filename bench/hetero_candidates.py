"""The plans bench/hetero_cpu.py runs besides the planner's: candidates (an assignment on
some GPUs, a recompute mode, kept blocks per rank, the units sharded evenly), read back from
a plan, turned into one, and perturbed (one sample moved, another microbatching, one kept
block more or fewer on a rank). Split out of hetero_cpu.py to keep it small."""

from __future__ import annotations

from dataclasses import dataclass, field

from cephalo.api import Plan, RankPlan
from cephalo.planner.search.evaluate import score
from cephalo.planner.search.problem import Problem, subset_problem, without_recompute
from cephalo.planner.search.unit_shards import EvenUnits, unit_shard_ratios


@dataclass
class Candidate:
    """One assignment on GPUs `keep` (indices into the devices) in one recompute mode."""

    problem: Problem  # on the kept GPUs, priced in this candidate's recompute mode
    keep: list[int]
    micro: list[int]
    ell: list[int]
    even: EvenUnits
    recompute: bool
    kept: list[int] = field(default_factory=list)  # kept blocks per rank (recompute mode)

    def key(self) -> tuple:
        return (tuple(self.keep), tuple(self.micro), tuple(self.ell), self.even, self.recompute,
                tuple(k for k in self.kept if any(self.kept)))

    def scored(self, micro: list[int] | None = None, ell: list[int] | None = None):
        """The cost model's score of this candidate (or of other batches on it)."""
        return score(self.problem, self.micro if micro is None else micro,
                     self.ell if ell is None else ell, even_units=self.even,
                     kept=self.kept or None)


def mode_problem(full: Problem, keep: list[int], recompute: bool) -> Problem:
    problem = full if keep == list(range(full.world_size)) else subset_problem(full, keep)
    return problem if recompute else without_recompute(problem)


def even_units_of(plan: Plan, num_layers: int) -> EvenUnits:
    """The units a plan shards evenly (1/N), read back from its ratios and overrides."""
    n = plan.world_size

    def flat(ratios: list[float]) -> bool:
        return all(abs(x - 1.0 / n) < 1e-12 for x in ratios)

    default_even = flat([r.shard_ratio for r in plan.ranks])
    even = {u for u in range(num_layers + 2)
            if (flat(plan.unit_shard_ratios[str(u)]) if str(u) in plan.unit_shard_ratios
                else default_even)}
    return EvenUnits(0 in even, num_layers + 1 in even,
                     sum(1 for u in range(1, num_layers + 1) if u in even))


def chosen_candidate(full: Problem, plan: Plan) -> Candidate:
    keep = [r.gpu_index if r.gpu_index is not None else r.rank for r in plan.ranks]
    recompute = plan.recompute is not False
    return Candidate(mode_problem(full, keep, recompute), keep,
                     [r.micro_batch_size for r in plan.ranks],
                     [r.num_micro_batches for r in plan.ranks],
                     even_units_of(plan, full.model.num_layers), recompute,
                     [r.kept_blocks for r in plan.ranks] if recompute else [])


def to_plan(c: Candidate) -> Plan | str:
    """The plan the engine runs for a candidate, or why it does not fit."""
    ev = c.scored()
    if not ev.feasible:
        return ev.reason or "infeasible"
    layers, n = c.problem.model.num_layers, c.problem.world_size
    ratios, per_unit = unit_shard_ratios(c.even, layers, n, ev.shard_ratios)
    return Plan(global_batch_size=c.problem.global_batch_size, world_size=n,
                predicted_step_seconds=ev.step_seconds,
                predicted_samples_per_second=ev.samples_per_second,
                unit_shard_ratios=per_unit, recompute=None if c.recompute else False,
                ranks=[RankPlan(rank=r, gpu=c.problem.ranks[r][0], batch_size=m * count,
                                micro_batch_size=m, num_micro_batches=count,
                                shard_ratio=ratios[r], gpu_index=c.keep[r],
                                predicted_step_seconds=ev.rank_seconds[r],
                                kept_blocks=c.kept[r] if c.kept else 0)
                       for r, (m, count) in enumerate(zip(c.micro, c.ell, strict=True))])


def moved_sample(c: Candidate, src: int, dst: int) -> Candidate | None:
    """`c` with one sample moved from rank `src` to `dst`, each of the two given the
    microbatching of its new batch that the cost model prices fastest."""
    batch = [m * count for m, count in zip(c.micro, c.ell, strict=True)]
    if batch[src] == 0:
        return None
    batch[src] -= 1
    batch[dst] += 1
    best: Candidate | None = None
    best_seconds = float("inf")
    for m_src in _divisors(batch[src]):
        for m_dst in _divisors(batch[dst]):
            micro, ell = list(c.micro), list(c.ell)
            micro[src], ell[src] = m_src, batch[src] // m_src if m_src else 0
            micro[dst], ell[dst] = m_dst, batch[dst] // m_dst
            trial = Candidate(c.problem, c.keep, micro, ell, c.even, c.recompute, c.kept)
            try:
                ev = trial.scored()
            except (ValueError, IndexError, KeyError):  # microbatch outside the profile
                continue
            if ev.feasible and ev.step_seconds < best_seconds:
                best, best_seconds = trial, ev.step_seconds
    return best


def other_microbatching(c: Candidate, rank: int) -> Candidate | None:
    """`c` with rank `rank`'s batch split into microbatches the next-best way (the one
    microbatch size the cost model prices fastest after the chosen one)."""
    batch = c.micro[rank] * c.ell[rank]
    best: Candidate | None = None
    best_seconds = float("inf")
    for m in _divisors(batch):
        if m in (0, c.micro[rank]):
            continue
        micro, ell = list(c.micro), list(c.ell)
        micro[rank], ell[rank] = m, batch // m
        try:
            ev = c.scored(micro, ell)
        except (ValueError, IndexError, KeyError):  # microbatch outside the profile
            continue
        if ev.feasible and ev.step_seconds < best_seconds:
            best = Candidate(c.problem, c.keep, micro, ell, c.even, c.recompute, c.kept)
            best_seconds = ev.step_seconds
    return best


def _divisors(b: int) -> list[int]:
    return [0] if b == 0 else [m for m in range(1, b + 1) if b % m == 0]


def kept_variants(c: Candidate, slow: int) -> list[tuple[str, Candidate | None]]:
    """In recompute mode: one more kept block on the slowest rank (if it has samples and
    blocks left to keep), one fewer on the rank keeping the most and every block
    recomputed (if any rank keeps one)."""
    if not c.recompute or c.micro[slow] == 0:
        return []
    kept = c.kept or [0] * len(c.micro)
    out: list[tuple[str, Candidate | None]] = []
    if kept[slow] < c.problem.model.num_layers:
        more = list(kept)
        more[slow] += 1
        out.append((f"1 more kept block, rank {slow}",
                    Candidate(c.problem, c.keep, c.micro, c.ell, c.even, True, more)))
    most = max(range(len(kept)), key=lambda r: kept[r])
    if kept[most]:
        fewer = list(kept)
        fewer[most] -= 1
        out.append((f"1 fewer kept block, rank {most}",
                    Candidate(c.problem, c.keep, c.micro, c.ell, c.even, True, fewer)))
        out.append(("every block recomputed",
                    Candidate(c.problem, c.keep, c.micro, c.ell, c.even, True, [])))
    return out
