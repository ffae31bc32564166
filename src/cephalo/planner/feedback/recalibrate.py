"""Recalibrate the cost model from a running job's measured steps (issue 35, item 3).

A running plan measures, per step, its wall time and every rank's split into compute and
waiting on collectives (rank 0's timing sums, cephalo.trainer.metrics). Against what the
model predicted for the same plan, two corrections follow:

* **compute**, per GPU type: the ranks' measured compute over the compute the model
  predicts for their (ℓ, m) with free collectives (the optimizer update left out: the
  trainer's split is taken before it). Applied by scaling that type's profile times.
* **collectives**, one factor c for the network: the model's collective seconds times c
  (bandwidth / c, latency x c) such that the current plan's predicted step, with compute
  already corrected, equals the measured step. The predicted step grows with c, so c is
  found by bisection; the measured waits need not be modelled rank by rank (a rank waits
  for its collectives and for slower ranks alike, and the model's max over ranks has both).

The correction is expressed as planner inputs — scaled profiles and the network as the
cluster declares it (or, where profiles carry measured collectives, those scaled) — so the
re-solve is the ordinary `solve` and needs nothing new from the planner or its child process.
A measured step the model cannot reproduce at any c (a single GPU whose step is slower than
its compute explains, say) is `explained` False: no re-plan can be trusted then.

Under live rebalancing (spec.planner.rebalance) the steps ran under the split in force, not
the plan's: a rank measured with more samples than the plan gave it computed more. The
measurement then carries that split (`Measured.batch_sizes`), and the plan is priced under it:
each rank keeps the plan's microbatch size m, its ℓ = ⌈b / m⌉ (the planner's evaluation of
that assignment, its state partitioned as the planner would), and a smaller last microbatch
counts as its share of a full one in the compute correction (as the rebalancer prices it).
Both the prediction and the calibrated step are then the split in force's, so the gain a
rebalance already took is not promised again by a re-plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cephalo.api.cluster import ClusterSpec
from cephalo.api.job import CephaloJobSpec
from cephalo.api.plan import Plan, RankPlan
from cephalo.api.profile import GpuProfile
from cephalo.planner.cost.catalog import resolve_gpu, resolve_precision
from cephalo.planner.cost.estimate import estimate_profile
from cephalo.planner.search.evaluate import evaluate
from cephalo.planner.search.hybrid import optimizer_parameters
from cephalo.planner.search.problem import calibrated_network as planner_network

# The range searched for the collective factor c, and how close the calibrated prediction
# of the current plan must come to the measured step to count as explained.
MIN_COLLECTIVE_SCALE = 1e-6
MAX_COLLECTIVE_SCALE = 1e9  # 100 Tbit/s assumed (the spec's bound) vs 0.1 Mbit/s measured
MIN_COMPUTE_SCALE, MAX_COMPUTE_SCALE = 1e-6, 1e6
EXPLAINED_TOLERANCE = 0.1
_BISECTIONS = 45  # the log-range of c halved to ~1e-12
_FREE_BANDWIDTH = 1e18  # bytes/s: collectives priced at nothing (compute alone)


@dataclass(frozen=True)
class Measured:
    """Means over a plan's timed steps; per-rank lists in the plan's rank order (None: the
    trainer exported no split, e.g. a gang over MAX_TIMED_RANKS)."""

    step_seconds: float
    compute_seconds: Sequence[float] | None = None
    wait_seconds: Sequence[float] | None = None
    # The split of the global batch the steps ran under, by plan rank (live rebalancing;
    # None: the plan's own).
    batch_sizes: Sequence[int] | None = None


@dataclass(frozen=True)
class Calibration:
    # Per GPU (catalog name): measured / modelled compute, measured now or carried from an
    # earlier calibration of the job (recalibrate's known_compute_scale).
    compute_scale: dict[str, float]
    collective_scale: float  # c: measured collective time / the model's
    bandwidth_bytes_per_second: float  # the network after calibration (declared form)
    latency_seconds: float
    predicted_step_seconds: float  # the current plan under the model it was planned with
    calibrated_step_seconds: float  # the current plan under the calibrated model
    explained: bool  # calibrated within EXPLAINED_TOLERANCE of the measured step
    cluster: ClusterSpec  # the calibrated inputs: solve(spec, cluster, profiles)
    profiles: dict[str, GpuProfile]

    def describe(self) -> str:
        compute = ", ".join(f"{gpu} {s:.2f}x" for gpu, s in sorted(self.compute_scale.items()))
        return (f"compute {compute} the profile; collectives {self.collective_scale:.3g}x the "
                f"model (effective {self.bandwidth_bytes_per_second * 8 / 1e9:.3g} Gbit/s, "
                f"{self.latency_seconds * 1e6:.3g} µs)")


def recalibrate(spec: CephaloJobSpec, cluster: ClusterSpec,
                profiles: Mapping[str, GpuProfile] | None, plan: Plan,
                measured: Measured,
                known_compute_scale: Mapping[str, float] | None = None) -> Calibration:
    """The model corrected by `measured` (of `plan`, which runs on `cluster`'s GPUs).

    `known_compute_scale`: what earlier calibrations of the job measured per GPU type
    (their `compute_scale`). A type the running plan does not compute on keeps it: a re-plan
    onto fewer GPUs measures only those, and the others at their raw profile would look as
    fast as the profile says, however slow the job measured them (seen on CPU ranks under
    load: the one-GPU plan a re-plan made measured far slower than profiled, and its
    calibration re-planned onto the other, equally profiled GPU at its raw profile). A type
    measured now takes the new figure."""
    if not measured.step_seconds > 0 or not math.isfinite(measured.step_seconds):
        raise ValueError(f"measured step {measured.step_seconds} s is not a positive time")
    given = complete_profiles(spec, cluster, profiles)
    split = split_in_force(plan, measured.batch_sizes)
    spec, assignment, order = _priced(spec, cluster, plan, split)
    ranks = [plan.ranks[r] for r in order]
    recompute = plan.recompute is not False
    kept = [r.kept_blocks for r in ranks] if recompute else None
    # A hybrid plan's groups over the GPUs used, in the assignment's order.
    position = {rank: i for i, rank in enumerate(order)}
    groups = [[position[r] for r in g] for g in plan.replica_groups] or None
    fraction = plan.replicated_fraction or 0.0  # priced as it runs (hybrid.py)

    def step(c: float, scale: Mapping[str, float]) -> float:
        inputs = _calibrated(spec, cluster, given, scale, c)
        ev = evaluate(spec, inputs[0], inputs[1], assignment, recompute=recompute,
                      kept_blocks=kept, replica_groups=groups, replicated_fraction=fraction)
        if not ev.feasible:  # the plan runs, so only a changed memory figure refuses it
            raise ValueError(f"the running plan does not fit the calibrated model: {ev.reason}")
        return ev.step_seconds

    predicted = step(1.0, {})
    scale = _compute_scale(spec, cluster, given, assignment, ranks, kept, recompute,
                           measured, predicted, split, groups, fraction)
    scale = {**{gpu: _clamp(s, MIN_COMPUTE_SCALE, MAX_COMPUTE_SCALE)
                for gpu, s in (known_compute_scale or {}).items()
                if gpu in given and math.isfinite(s) and s > 0}, **scale}
    target = measured.step_seconds
    lo, hi = math.log(MIN_COLLECTIVE_SCALE), math.log(MAX_COLLECTIVE_SCALE)
    if len(ranks) == 1 or step(math.exp(lo), scale) >= target:
        c = 1.0 if len(ranks) == 1 else math.exp(lo)
    elif step(math.exp(hi), scale) <= target:
        c = math.exp(hi)
    else:
        for _ in range(_BISECTIONS):  # step(c) grows with c: T(lo) < target < T(hi)
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if step(math.exp(mid), scale) < target else (lo, mid)
        c = math.exp((lo + hi) / 2)
    calibrated = step(c, scale)
    cal_cluster, cal_profiles = _calibrated(spec, cluster, given, scale, c)
    bandwidth, latency = _network(spec, cal_cluster, cal_profiles)
    return Calibration(
        compute_scale=dict(scale), collective_scale=c, bandwidth_bytes_per_second=bandwidth,
        latency_seconds=latency, predicted_step_seconds=predicted,
        calibrated_step_seconds=calibrated,
        explained=abs(calibrated - target) <= EXPLAINED_TOLERANCE * target,
        cluster=cal_cluster, profiles=cal_profiles)


def complete_profiles(spec: CephaloJobSpec, cluster: ClusterSpec,
                      profiles: Mapping[str, GpuProfile] | None) -> dict[str, GpuProfile]:
    """Every GPU type of `cluster` with a profile: the given one, else the catalog estimate
    the planner would use (so that it can be scaled)."""
    model = spec.model.resolve()
    out = dict(profiles or {})
    for group in cluster.groups:
        gpu = resolve_gpu(group.product, group.memory_bytes)
        if gpu.name not in out:
            out[gpu.name] = estimate_profile(gpu, model, resolve_precision(spec.precision, gpu),
                                             spec.planner.profile_micro_batch_sizes)
    return out


def split_step_seconds(spec: CephaloJobSpec, cluster: ClusterSpec,
                       profiles: Mapping[str, GpuProfile] | None, plan: Plan,
                       batch_sizes: Sequence[int] | None) -> float:
    """The model's step for `plan` run under the split `batch_sizes` (None: the plan's own),
    priced as `recalibrate` prices the split in force, with the profiles it was planned
    with: what `cephalo run` compares a rebalanced run's end against."""
    given = complete_profiles(spec, cluster, profiles)
    spec, assignment, order = _priced(spec, cluster, plan, split_in_force(plan, batch_sizes))
    recompute = plan.recompute is not False
    kept = [plan.ranks[r].kept_blocks for r in order] if recompute else None
    ev = evaluate(spec, cluster, given, assignment, recompute=recompute, kept_blocks=kept)
    if not ev.feasible:
        raise ValueError(f"the plan under the split {batch_sizes} does not fit the model: "
                         f"{ev.reason}")
    return ev.step_seconds


def _priced(spec: CephaloJobSpec, cluster: ClusterSpec, plan: Plan, split: Sequence[int]
            ) -> tuple[CephaloJobSpec, list[tuple[int, int] | None], list[int]]:
    """(spec, assignment, plan rank per GPU used) pricing `plan` under `split`. The model
    prices whole microbatches: a split with a smaller last microbatch is priced as the
    global batch of its whole ones (its compute share is corrected in the compute scale;
    the step's over-statement, under one microbatch per such rank, goes to c)."""
    assignment, order = _assignment(plan, cluster, split)
    whole = sum(m * count for m, count in (a for a in assignment if a is not None))
    if whole != spec.global_batch_size:
        spec = spec.model_copy(update={"global_batch_size": whole})
    return spec, assignment, order


def split_in_force(plan: Plan, batch_sizes: Sequence[int] | None) -> list[int]:
    """The batch per plan rank the measured steps ran under: `batch_sizes` (checked: one per
    rank, the same global batch, none on a rank the plan gives no microbatch size), else the
    plan's."""
    planned = [r.batch_size for r in plan.ranks]
    if batch_sizes is None:
        return planned
    split = [int(b) for b in batch_sizes]
    if len(split) != len(planned) or sum(split) != sum(planned) or any(
            b < 0 or (b > 0 and r.micro_batch_size < 1) for b, r in zip(split, plan.ranks,
                                                                         strict=True)):
        raise ValueError(f"the split in force {split} is not one of the plan's "
                         f"{sum(planned)} samples over its {len(planned)} ranks")
    return split


def _assignment(plan: Plan, cluster: ClusterSpec, split: Sequence[int]
                ) -> tuple[list[tuple[int, int] | None], list[int]]:
    """The (m, ℓ) per GPU in the cluster's order (None: idle) under `split` (the plan's m,
    ℓ = ⌈b / m⌉) and, per GPU used, the plan rank on it. A rank belongs to the group of its
    pool (default: the GPU's catalog name) and GPU: one pool may hold groups of several
    GPUs (`cephalo run` puts every local device in pool "local")."""
    by_pool: dict[tuple[str, str], list[int]] = {}
    for r in plan.ranks:
        by_pool.setdefault((r.pool or r.gpu, r.gpu), []).append(r.rank)
    assignment: list[tuple[int, int] | None] = []
    order: list[int] = []
    for group in cluster.groups:
        gpu = resolve_gpu(group.product, group.memory_bytes).name
        pool = (group.pool or gpu, gpu)
        ranks = by_pool.pop(pool, [])
        for k in range(group.count):
            if k < len(ranks):
                rank = plan.ranks[ranks[k]]
                b, m = split[rank.rank], rank.micro_batch_size
                assignment.append((m, -(-b // m) if b > 0 else 0))
                order.append(rank.rank)
            else:
                assignment.append(None)
        if len(ranks) > group.count:
            raise ValueError(f"the plan has {len(ranks)} {gpu} ranks in pool {pool[0]}, which "
                             f"has {group.count} of them")
    if by_pool:
        raise ValueError(f"the plan uses pools the cluster lacks: "
                         f"{', '.join(sorted(f'{p} ({g})' for p, g in by_pool))}")
    return assignment, order


def _compute_scale(spec: CephaloJobSpec, cluster: ClusterSpec,
                   profiles: Mapping[str, GpuProfile], assignment: list[tuple[int, int] | None],
                   plan_ranks: Sequence[RankPlan], kept: list[int] | None, recompute: bool,
                   measured: Measured, predicted_step: float,
                   split: Sequence[int],
                   groups: list[list[int]] | None = None,
                   replicated_fraction: float = 0.0) -> dict[str, float]:
    """Per GPU type, measured compute / modelled compute of its ranks with samples under
    `split` (a smaller last microbatch priced as its share of a full one). Without a
    compute split: no correction. One GPU: its whole step against its prediction (it has no
    collectives, and its optimizer update and per-step overhead are compute too)."""
    if len(plan_ranks) == 1:
        s = _clamp(measured.step_seconds / predicted_step, MIN_COMPUTE_SCALE, MAX_COMPUTE_SCALE)
        return {plan_ranks[0].gpu: s}
    if not measured.compute_seconds:
        return {}
    if len(measured.compute_seconds) != len(plan_ranks):
        raise ValueError(f"the split has {len(measured.compute_seconds)} ranks, the plan "
                         f"{len(plan_ranks)}")
    silent_cluster, silent_profiles = _free_collectives(cluster, profiles)
    ev = evaluate(spec, silent_cluster, silent_profiles, assignment, recompute=recompute,
                  kept_blocks=kept, replica_groups=groups,
                  replicated_fraction=replicated_fraction)
    measured_sum: dict[str, float] = {}
    modelled_sum: dict[str, float] = {}
    # Every rank updates its 1/world of the optimizer's state, flat or hybrid (a rank of a
    # hybrid plan its piece: 1/G of its slice, planner/search/hybrid.py), and of a hybrid
    # plan's replicated fraction its whole slice (1/k).
    world = len(plan_ranks)
    params = spec.model.resolve().total_parameters()
    updated = params / world if not groups else optimizer_parameters(
        params, len(groups[0]), len(groups), replicated_fraction)
    # plan_ranks[k] runs on the k-th GPU used (ev.rank_seconds[k]): assignment[gpus[k]].
    gpus = [i for i, a in enumerate(assignment) if a is not None]
    for k, rank in enumerate(plan_ranks):
        b = split[rank.rank]
        if b == 0:
            continue  # state only: nothing of its own to time
        p = profiles[rank.gpu]
        optimizer = (p.optimizer_seconds_fixed or 0.0) + \
            (p.optimizer_seconds_per_parameter or 0.0) * updated
        m, count = assignment[gpus[k]] or (1, 1)
        modelled = (ev.rank_seconds[k] - optimizer) * b / (m * count)
        if modelled > 0:
            measured_sum[rank.gpu] = measured_sum.get(rank.gpu, 0.0) + \
                measured.compute_seconds[rank.rank]
            modelled_sum[rank.gpu] = modelled_sum.get(rank.gpu, 0.0) + modelled
    return {gpu: _clamp(measured_sum[gpu] / modelled_sum[gpu], MIN_COMPUTE_SCALE,
                        MAX_COMPUTE_SCALE) for gpu in modelled_sum}


def _clamp(x: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, x))


def scale_profile(profile: GpuProfile, s: float) -> GpuProfile:
    """`profile` with every compute time times `s` (memory and collectives unchanged)."""
    if s == 1.0:
        return profile
    times = ("block_forward_seconds", "block_backward_seconds", "other_forward_seconds",
             "other_backward_seconds")
    points = [q.model_copy(update={k: getattr(q, k) * s for k in times})
              for q in profile.points]
    update: dict[str, object] = {"points": points}
    for name in ("block_forward_fixed_seconds", "other_forward_fixed_seconds",
                 "optimizer_seconds_per_parameter", "optimizer_seconds_fixed"):
        if getattr(profile, name) is not None:
            update[name] = getattr(profile, name) * s
    if profile.single_rank_step is not None:
        update["single_rank_step"] = profile.single_rank_step.model_copy(
            update={"seconds": profile.single_rank_step.seconds * s})
    return profile.model_copy(update=update)


def _calibrated(spec: CephaloJobSpec, cluster: ClusterSpec,
                profiles: Mapping[str, GpuProfile], scale: Mapping[str, float],
                c: float) -> tuple[ClusterSpec, dict[str, GpuProfile]]:
    """The planner's inputs with compute scaled per GPU type and collectives by c. Measured
    collectives in profiles win over the declared network (problem._network), so they
    are scaled there (their probe step dropped: this calibration replaces it); else the
    declared network, flat or topology, is slowed by c (ClusterSpec.collective_scale)."""
    out = {gpu: scale_profile(p, scale.get(gpu, 1.0)) for gpu, p in profiles.items()}
    if any(p.collectives is not None for p in out.values()):
        for gpu, p in out.items():
            k = p.collectives
            if k is None:
                continue
            out[gpu] = p.model_copy(update={"collectives": k.model_copy(update={
                "bandwidth_bytes_per_second": k.bandwidth_bytes_per_second / c,
                "latency_seconds": k.latency_seconds * c,
                "reduce_scatter_bandwidth_bytes_per_second":
                    None if k.reduce_scatter_bandwidth_bytes_per_second is None
                    else k.reduce_scatter_bandwidth_bytes_per_second / c,
                "reduce_scatter_latency_seconds": None if k.reduce_scatter_latency_seconds
                is None else k.reduce_scatter_latency_seconds * c,
                "all_reduce_seconds": None if k.all_reduce_seconds is None
                else k.all_reduce_seconds * c,
                "probe_step_seconds": None})})
        return cluster, out
    return cluster.model_copy(update={"collective_scale": cluster.collective_scale * c}), out


def _network(spec: CephaloJobSpec, cluster: ClusterSpec,
             profiles: Mapping[str, GpuProfile]) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of a ring over every GPU of these inputs, as the
    planner prices it (problem._network, the one owner: measured collectives, a flat ring,
    or the topology, calibrated by cluster.collective_scale)."""
    return planner_network(spec, cluster, profiles).ring_over_all()


def _free_collectives(cluster: ClusterSpec, profiles: Mapping[str, GpuProfile]
                      ) -> tuple[ClusterSpec, dict[str, GpuProfile]]:
    """Inputs whose collectives cost nothing: the model's compute alone (and optimizer)."""
    out = {gpu: p.model_copy(update={"collectives": None}) for gpu, p in profiles.items()}
    return cluster.model_copy(update={"network_bandwidth_bytes_per_second": _FREE_BANDWIDTH,
                                      "network_latency_seconds": 0.0}), out


__all__ = ["Calibration", "Measured", "complete_profiles", "recalibrate", "scale_profile",
           "split_in_force"]
