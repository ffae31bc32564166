"""The planning problem as numbers: the GPUs (one slot per rank, grouped into classes of
identical GPUs), their cost models, memory budgets and the collectives' cost. Built once
from the job, cluster and profiles; used by the solver, `evaluate` and the baselines."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from cephalo.api.cluster import ClusterSpec
from cephalo.api.job import CephaloJobSpec
from cephalo.api.memory import state_bytes_per_parameter
from cephalo.api.models import ModelConfig
from cephalo.api.network import COLLECTIVE_EFFICIENCY
from cephalo.api.profile import CollectiveProfile, GpuProfile, model_key
from cephalo.errors import CephaloError
from cephalo.planner.cost.catalog import ComputePrecision, GpuType, resolve_gpu, resolve_precision
from cephalo.planner.cost.comm_model import UNEVEN_COLLECTIVE_OVERHEAD, CommModel, UnitComm
from cephalo.planner.cost.costmodel import GpuCostModel
from cephalo.planner.cost.estimate import estimate_profile
from cephalo.planner.cost.topology import JOB, MEASURED, Network, Topology, topology_network
from cephalo.planner.search.bottleneck import ClassTable
from cephalo.planner.search.hybrid import Layout, group_state_bytes, hybrid_unit_comm
from cephalo.planner.search.kept_blocks import kept_candidates

GIB = 1024**3
# planner.networkBandwidthGbps / networkLatencyMicroseconds when only one of them is given:
# the defaults they had before the topology model (a job stored then has both).
FLAT_GBPS = 10.0
# Bytes on the wire per parameter, by a collective's format (spec.gatherPrecision, ...).
WIRE_BYTES = {"fp32": 4, "bf16": 2}
FLAT_LATENCY_MICROSECONDS = 50.0


class InfeasibleError(CephaloError, ValueError):
    """The job cannot run on these GPUs; the message has the numbers and what would fit."""


class ProfileMismatchError(CephaloError, ValueError):
    """A given profile was measured for another model or precision than the job's."""


@dataclass
class GpuClass:
    gpu: GpuType
    cost: GpuCostModel
    budget_bytes: float  # memory the plan may use: capacity x memory fraction
    slots: list[int] = field(default_factory=list)  # rank indices


@dataclass
class Problem:
    model: ModelConfig
    precision: str  # the job's ("auto" too); each class computes in its profile's precision
    global_batch_size: int
    memory_fraction: float
    allow_state_only: bool
    comm_model: CommModel
    ranks: list[tuple[str, str]]  # (catalog gpu name, pool) per rank, in rank order
    classes: list[GpuClass]
    rank_class: list[int]  # class index of each rank
    # The network (topology.py): with a topology, `comm_model` is the ring over these
    # ranks' nodes (`rank_node`), rebuilt from `network.base` for every subset of them.
    network: Network | None = None
    rank_node: list[int] = field(default_factory=list)
    # Hybrid sharding (hybrid.py): replica groups of these ranks, each holding the whole
    # state sharded evenly among its own ranks; empty: flat, one group of every rank.
    groups: list[list[int]] = field(default_factory=list)
    # With groups: the share of every slice whose optimizer state each group keeps whole
    # (hybrid.py, Plan.replicated_fraction); 0: all of it sharded across the groups.
    replicated_fraction: float = 0.0

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def shard_group_size(self) -> int:
        """The ranks one copy of the training state is sharded over (a replica group's)."""
        return len(self.groups[0]) if self.groups else self.world_size

    @property
    def state_bytes(self) -> float:
        """The training state one copy of it takes over the ranks it is sharded on: flat,
        the whole model's; hybrid, one replica group's (hybrid.py: the slices' weights and
        1/G of the optimizer's state)."""
        if self.groups:
            return group_state_bytes(self.model, self.precision, len(self.groups),
                                     self.replicated_fraction)
        return state_bytes_per_parameter(self.precision) * self.model.total_parameters()

    @property
    def total_budget_bytes(self) -> float:
        return sum(c.budget_bytes * len(c.slots) for c in self.classes)

    def unit_comm(self, uneven: bool) -> UnitComm:
        if self.groups and self.topology is not None and self.network is not None:
            return hybrid_unit_comm(self.model, self.network.base, self.topology,
                                    self.rank_node, self.groups, uneven,
                                    self.replicated_fraction)
        return UnitComm.build(self.model, self.comm_model, self.world_size, uneven)

    def ring_bounds(self, least_ranks: int) -> list[tuple[CommModel, list[int]]]:
        """Flat rings no slower than any ring of at least `least_ranks` of these GPUs, each
        with the GPUs per class it may use: one without a topology; with one, a ring across
        nodes (every GPU) and one per kind of node that holds `least_ranks` (its GPUs)."""
        counts = [len(c.slots) for c in self.classes]
        topology = self.topology
        if topology is None:
            return [(self.comm_model, counts)]
        per_node = [[0] * len(self.classes) for _ in topology.nodes]
        for cls, node in zip(self.rank_class, self.rank_node, strict=True):
            per_node[node][cls] += 1
        used = sorted(set(self.rank_node))
        base = self.network.base if self.network is not None else self.comm_model
        cases = []
        if len(used) > 1:
            cases.append((topology.across_bound(base, used), counts))
        seen = set()
        for node in used:
            key = (topology.nodes[node], tuple(per_node[node]))
            if sum(per_node[node]) >= least_ranks and key not in seen:
                seen.add(key)
                cases.append((topology.inside_bound(base, node), per_node[node]))
        return cases or [(topology.across_bound(base, used), counts)]

    @property
    def topology(self) -> Topology | None:
        return None if self.network is None else self.network.topology

    def network_source(self) -> str:
        return "" if self.network is None else self.network.source_of(self.rank_node)

    def rank_budget(self, rank: int) -> float:
        return self.classes[self.rank_class[rank]].budget_bytes

    def rank_cost(self, rank: int) -> GpuCostModel:
        return self.classes[self.rank_class[rank]].cost

    def rank_precision(self, rank: int) -> ComputePrecision:
        """The precision a rank computes in: its GPU's profile's (measured or estimated in
        the job's precision, or under "auto" in the GPU's fastest)."""
        return self.rank_cost(rank).profile.precision


def build_problem(spec: CephaloJobSpec, cluster: ClusterSpec,
                  profiles: Mapping[str, GpuProfile] | None = None) -> Problem:
    model = spec.model.resolve()
    profiles = dict(profiles or {})
    network = calibrated_network(spec, cluster, profiles)
    # The bytes each collective moves per parameter: what the engine sends under the job's
    # gatherPrecision / reducePrecision (every subset's ring is rebuilt from this base).
    network = dataclasses.replace(network, base=dataclasses.replace(
        network.base, gather_bytes_per_parameter=WIRE_BYTES[spec.gather_precision],
        reduce_bytes_per_parameter=WIRE_BYTES[spec.reduce_precision]))
    comm = network.base
    classes: dict[tuple[str, int, int], GpuClass] = {}
    ranks: list[tuple[str, str]] = []
    rank_class: list[int] = []
    rank_node: list[int] = []
    kinds = _node_kinds(cluster, network)
    for group_index, node in _rank_order(cluster, network):
        group = cluster.groups[group_index]
        gpu = resolve_gpu(group.product, group.memory_bytes)  # outside the catalog: profiled
        # The precision this GPU's ranks compute in: the job's, or under "auto" the GPU's
        # fastest; its profile must have been measured in it.
        precision = resolve_precision(spec.precision, gpu)
        expected_key = model_key(model.architecture_key(), precision)
        given = profiles.get(gpu.name)
        if given is not None and given.model_key != expected_key:
            # Its times and memory are another model's: planning with them would be wrong
            # without a word (another model's capacity, a microbatch that does not fit).
            job = "" if precision == spec.precision else f"{spec.precision}: "
            raise ProfileMismatchError(
                f"the {gpu.name} profile was measured for another model or precision (its "
                f"model_key is {given.model_key}, {given.precision}; this job's "
                f"{model.family} model in {job}{precision} has {expected_key}); profile "
                f"this job: python -m cephalo.trainer.profile --job JOB.yaml --output "
                f"{gpu.name}.json")
        profile = given or estimate_profile(
            gpu, model, precision, spec.planner.profile_micro_batch_sizes)
        capacity = group.memory_bytes or profile.memory_capacity_bytes or gpu.memory_bytes
        # GPUs of one class are interchangeable: the same product and memory, and (with a
        # topology) nodes of the same kind, so that which k of a class a subset takes does
        # not change its ring (subset.py takes the first k, packed onto the fewest nodes).
        key = (gpu.name, capacity, kinds[node] if node >= 0 else 0)
        if key not in classes:
            classes[key] = GpuClass(gpu, GpuCostModel(gpu, profile, capacity, model.num_layers,
                                                      model),
                                    capacity * spec.planner.memory_fraction)
        index = list(classes).index(key)
        classes[key].slots.append(len(ranks))
        ranks.append((gpu.name, group.pool or gpu.name))
        rank_class.append(index)
        rank_node.append(node)
    probe = _probed_collectives(profiles)
    if probe is not None and probe.probe_step_seconds is not None:
        # A real step measured on the cluster: calibrate against it.
        comm = comm.calibrated(model, [c.cost for c in classes.values()],
                               probe.probe_step_seconds, probe.world_size)
        network = dataclasses.replace(network, base=comm)
    if network.topology is not None:
        comm = network.topology.comm(network.base, rank_node)
    else:
        rank_node = []
    return Problem(model, spec.precision, spec.global_batch_size, spec.planner.memory_fraction,
                   spec.planner.allow_state_only_ranks, comm, ranks, list(classes.values()),
                   rank_class, network, rank_node)


def _rank_order(cluster: ClusterSpec, network: Network) -> list[tuple[int, int]]:
    """(group index, node index) per rank: grouped by node with a topology (the ring
    crosses each NIC once), else the groups in order (node -1: not known)."""
    if network.placement is not None:
        return network.placement
    return [(g, -1) for g, group in enumerate(cluster.groups) for _ in range(group.count)]


def _node_kinds(cluster: ClusterSpec, network: Network) -> list[int]:
    """Per node, an index shared by nodes with the same GPUs and links."""
    if network.topology is None or network.placement is None:
        return []
    holds: list[dict[int, int]] = [{} for _ in network.topology.nodes]
    for group, node in network.placement:
        holds[node][group] = holds[node].get(group, 0) + 1
    seen: dict[object, int] = {}
    return [seen.setdefault((tuple(sorted(h.items())), links), len(seen))
            for h, links in zip(holds, network.topology.nodes, strict=True)]


def _probed_collectives(profiles: Mapping[str, GpuProfile]) -> CollectiveProfile | None:
    """The collective measurement with the slowest probe step, if any has one."""
    probed = [p.collectives for p in profiles.values()
              if p.collectives is not None and p.collectives.probe_step_seconds is not None]
    return max(probed, key=lambda c: c.probe_step_seconds or 0.0, default=None)


def calibrated_network(spec: CephaloJobSpec, cluster: ClusterSpec,
             profiles: Mapping[str, GpuProfile]) -> Network:
    """`network_of`, slowed by the cluster's calibrated collective_scale."""
    return network_of(spec, cluster, profiles).scaled(cluster.collective_scale)


def network_of(spec: CephaloJobSpec, cluster: ClusterSpec,
               profiles: Mapping[str, GpuProfile]) -> Network:
    """The network as described, before any calibration. Measured collectives win over a
    flat ring the cluster declares (a local run's bus), which wins over the job's flat
    planner.networkBandwidthGbps; without any of them the topology (topology.py): the
    cluster's nodes and links, the job's planner.network, the documented defaults."""
    measured = [p.collectives for p in profiles.values() if p.collectives is not None]
    if measured:
        slowest = min(measured, key=lambda c: c.bandwidth_bytes_per_second)
        overlap = min(1.0 if c.overlap_fraction is None else c.overlap_fraction
                      for c in measured)
        uneven = max((c.uneven_overhead for c in measured if c.uneven_overhead is not None),
                     default=UNEVEN_COLLECTIVE_OVERHEAD)
        return Network(CommModel(
            slowest.bandwidth_bytes_per_second, slowest.latency_seconds,
            uneven_overhead=uneven, overlap_fraction=overlap,
            reduce_scatter_bandwidth_bytes_per_second=(
                slowest.reduce_scatter_bandwidth_bytes_per_second),
            reduce_scatter_latency_seconds=slowest.reduce_scatter_latency_seconds,
            all_reduce_seconds=slowest.all_reduce_seconds), None, None, MEASURED,
            f"collectives measured on {slowest.world_size} ranks", backend=cluster.backend)
    planner = spec.planner
    # The probe's overlap is the GPUs' (compute beside a collective), whatever the links.
    overlap = 1.0 if cluster.collective_overlap_fraction is None else \
        cluster.collective_overlap_fraction
    if cluster.network_bandwidth_bytes_per_second is not None:
        source, why = cluster.network_source or "cluster", "the cluster's bus"
    elif planner.network_bandwidth_gbps is not None or \
            planner.network_latency_microseconds is not None:
        source, why = JOB, "planner.networkBandwidthGbps"
    else:
        return topology_network(spec, cluster, CommModel(1.0, 0.0, overlap_fraction=overlap))
    bandwidth = cluster.network_bandwidth_bytes_per_second or (
        (planner.network_bandwidth_gbps or FLAT_GBPS) * 1e9 / 8)
    latency = cluster.network_latency_seconds
    if latency is None:
        # (a latency of 0 is a figure, not a missing one)
        given = planner.network_latency_microseconds
        latency = (FLAT_LATENCY_MICROSECONDS if given is None else given) * 1e-6
    # A described rate: the collectives reach only part of it (cephalo.api.network).
    efficiency = COLLECTIVE_EFFICIENCY[cluster.backend]
    return Network(CommModel(bandwidth * efficiency, latency, overlap_fraction=overlap), None,
                   None, source, f"a flat ring ({why})", backend=cluster.backend,
                   flat_efficiency=efficiency)


def class_tables(problem: Problem, *, uneven: bool = True, max_ell: int | None = None,
                 micro_sizes: list[int] | None = None,
                 state_share_bytes: float = 0.0,
                 comm: UnitComm | None = None, kept_blocks: bool = False) -> list[ClassTable]:
    """Every (ℓ, m) each class may run within its own memory budget.

    `max_ell`/`micro_sizes` restrict the choices (for the baselines); `state_share_bytes`
    reserves a fixed training-state share on every GPU (even sharding, or the even units
    of a per-unit plan); `comm` overrides the collectives (a per-unit plan's mix).
    `kept_blocks` (recompute mode) adds each (ℓ, m) with k = 1 .. kmax kept blocks
    (kept_blocks.py), after the k = 0 candidates."""
    batch = problem.global_batch_size
    if comm is None:
        comm = problem.unit_comm(uneven)
    tables = []
    for cls in problem.classes:
        room = cls.budget_bytes - state_share_bytes
        sizes = np.arange(1, batch + 1) if micro_sizes is None else np.array(micro_sizes)
        sizes = sizes[cls.cost.compute_memory_bytes(sizes) <= room]
        # For each m, ℓ = 1 .. B // m (or max_ell): built flat, without a Python loop.
        ell_counts = batch // sizes if max_ell is None else np.minimum(max_ell, batch // sizes)
        micro = np.repeat(sizes, ell_counts)
        starts = np.repeat(np.cumsum(ell_counts) - ell_counts, ell_counts)
        ell = np.arange(micro.size) - starts + 1
        if problem.allow_state_only and cls.cost.compute_memory_bytes(np.zeros(1))[0] <= room:
            micro, ell = np.concatenate([[0], micro]), np.concatenate([[0], ell])
        micro, ell = micro.astype(np.int64), ell.astype(np.int64)
        memory_bytes = cls.cost.compute_memory_bytes(micro, ell)
        if not cls.cost.recompute:  # without recompute memory grows with ℓ too
            fits = memory_bytes <= room
            micro, ell, memory_bytes = micro[fits], ell[fits], memory_bytes[fits]
        seconds = cls.cost.step_seconds(ell, micro, comm)
        speed = _samples_per_second(cls.cost, comm, batch)
        kept, subset = None, False
        if kept_blocks and cls.cost.can_keep_blocks:
            more = kept_candidates(cls.cost, micro, ell, seconds, room, comm)
            if more.index.size:
                kept = np.concatenate([np.zeros(micro.size, dtype=np.int64), more.kept])
                micro = np.concatenate([micro, micro[more.index]])
                ell = np.concatenate([ell, ell[more.index]])
                seconds = np.concatenate([seconds, more.seconds])
                memory_bytes = np.concatenate([memory_bytes, more.memory_bytes])
            subset = more.subset
        tables.append(ClassTable(batch=ell * micro, ell=ell, micro=micro, seconds=seconds,
                                 memory_bytes=memory_bytes,
                                 count=len(cls.slots), speed_weight=speed, kept=kept,
                                 kept_subset=subset))
    return tables


def _samples_per_second(cost: GpuCostModel, comm: UnitComm, batch: int) -> float:
    m = np.arange(1, min(batch, 8) + 1)
    return float(np.max(m / cost.step_seconds(np.ones_like(m), m, comm)))


def gib(num_bytes: float) -> str:
    """Bytes for people: GiB, or MiB below 1 GiB (emulated and CPU runs are small)."""
    if abs(num_bytes) >= GIB:
        return f"{num_bytes / GIB:.1f} GiB"
    return f"{num_bytes / 1024**2:.1f} MiB"


def first_gpus(problem: Problem, counts: list[int]) -> list[int]:
    """The ranks of the first `counts[c]` GPUs of each class, in rank order."""
    return sorted(slot for cls, k in zip(problem.classes, counts, strict=True)
                  for slot in cls.slots[:k])


def subset_problem(problem: Problem, keep: list[int]) -> Problem:
    """The same job on the GPUs of ranks `keep` only (ascending), renumbered 0..len-1."""
    new_index = {old: new for new, old in enumerate(keep)}
    classes: list[GpuClass] = []
    class_index: dict[int, int] = {}
    for c, cls in enumerate(problem.classes):
        slots = [new_index[s] for s in cls.slots if s in new_index]
        if slots:
            class_index[c] = len(classes)
            classes.append(GpuClass(cls.gpu, cls.cost, cls.budget_bytes, slots))
    comm, rank_node = problem.comm_model, [problem.rank_node[r] for r in keep] \
        if problem.rank_node else []
    if problem.topology is not None and problem.network is not None:
        comm = problem.topology.comm(problem.network.base, rank_node)
    return Problem(problem.model, problem.precision, problem.global_batch_size,
                   problem.memory_fraction, problem.allow_state_only, comm,
                   [problem.ranks[r] for r in keep], classes,
                   [class_index[problem.rank_class[r]] for r in keep], problem.network,
                   rank_node)


def layout_problem(problem: Problem, layout: Layout) -> Problem:
    """The same job on `layout`'s GPUs only, in its replica groups (ranks renumbered as
    `subset_problem` does)."""
    keep = layout.ranks
    new_index = {old: new for new, old in enumerate(keep)}
    sub = subset_problem(problem, keep)
    return dataclasses.replace(sub, groups=[[new_index[r] for r in g] for g in layout.groups],
                               replicated_fraction=layout.replicated_fraction)


def fused_everything(problem: Problem) -> Problem | None:
    """The same job with every block in the engine's fused tail on every working rank
    (job-wide: the collectives change), GpuCostModel.fused_everything; None where a GPU
    type has no graph size to price it with."""
    classes = []
    for c in problem.classes:
        cost = c.cost.fused_everything(problem.model)
        if cost is None:
            return None
        classes.append(GpuClass(c.gpu, cost, c.budget_bytes, list(c.slots)))
    return dataclasses.replace(problem, classes=classes)


def without_recompute(problem: Problem) -> Problem:
    """The same job priced in the engine's no-recompute mode (job-wide: every rank's
    collectives change with it), GpuCostModel.without_recompute."""
    classes = [GpuClass(c.gpu, c.cost.without_recompute(problem.model), c.budget_bytes,
                        list(c.slots)) for c in problem.classes]
    return dataclasses.replace(problem, classes=classes)
