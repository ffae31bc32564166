"""Hybrid sharding (issue 44, docs/hybrid-sharding.md): the training state sharded inside
replica groups of whole nodes and, across them, the optimizer's state sharded once more,
priced as the engine runs it (its second design, "sharded across groups").

The engine runs a hybrid plan as (api/plan.py, `Plan.replica_groups`; G groups of k
ranks): the rank at position j of a group keeps the fp32 slice j of every unit (what its
group's all-gathers read) and the optimizer state of only piece g of that slice (the slice
split evenly in G). Each unit's all-gathers and reduce-scatters run on the group's own
process group (a ring over the group's ranks: the intra-node link when the group is one
node). A unit's slice gradient is then reduce-scattered across the groups with the ranks
at the same position, to the piece's gradient, issued after the unit's reduce-scatter on
the same stream, so it overlaps the backward as the reduce-scatters do. After AdamW on the
pieces, every unit's updated piece is all-gathered across the groups back into the slice,
issued in forward order; the next step's forward waits for a unit's before its group
all-gather, so it hides under the forward of the units before it and the first unit's is
exposed. What this module prices:

* the group's rings: `Topology.ring` over each group's ranks; every rank at the pace of the
  slowest group's ring, since a unit's cross-group collectives wait for every group's;
* the cross-group collectives: k positions' rings of G members run at once, one per
  position; a ring reduce-scatter or all-gather over G members moves (G-1)/G of the slice
  per member, and a node's NIC carries the collectives of every position on it. With the
  state sharded evenly inside a group (below) a node holding g of a group's k ranks sends
  (G-1)/G · (g/k) · P · bytes per parameter for each of the two, gradients in
  reducePrecision under the backward and parameters in gatherPrecision under the next
  forward, at the slowest NIC of the nodes used. Where every group is one node the
  cross-group collectives run on their own process group and link (the NIC) beside the
  group's (the intra-node link): a unit's forward waits the slower of its cross and group
  all-gathers (pipelined: each cross all-gather was issued ahead of the units after it),
  its backward the slower of its cross-group collective and its group's gather and
  reduce-scatter (`UnitComm.cross_own_link`). Where a group's ring crosses the NICs too,
  they share them: the sums;
* the replicated fraction a (`Layout.replicated_fraction`, Plan.replicated_fraction): the
  leading a of every slice keeps its whole optimizer state in every group, so its gradient
  is all-reduced across the groups under the backward (two passes, 2 (G-1) hops) and
  nothing of it is gathered after the update: per unit (1 + a) times the reduce-scatter's
  bytes under the backward, (1 - a) times the all-gather's under the next forward;
* the optimizer: AdamW on the piece of the sharded part and the whole slice of the
  replicated part, P / (k·G) · (1 - a) + P / k · a parameters per rank;
* memory (`group_state_bytes`): a group holds the slices' fp32 weights (4 bytes a
  parameter) and a + (1 - a)/G of the optimizer's state
  (`cephalo.api.memory.hybrid_state_bytes`), plus the slice gradient of the unit being
  reduced across groups, each rank 1/k of it next to its compute memory.

The planner's space of hybrid plans (`layouts`): the nodes used are whole nodes, the first
c of each kind of node (nodes of a kind are interchangeable), all holding the same number
of GPUs g, grouped d consecutive nodes (rank order) a group, G = nodes / d ≥ 2 groups of
k = d·g ranks. Whole nodes may be left idle to keep the groups equal. Inside a group the
state is sharded evenly (1/k: no uneven-collective overhead, and the per-position ratios
then agree across groups of any GPUs); batches stay per rank over the whole job. For a
layout at each replicated fraction of a small grid (`hybrid_search.REPLICATED_FRACTIONS`)
the search is today's exact all-even search (`solver.solve_fixed`) with these
collectives; every pair is solved or proven unable to beat the best step found
(`subset.reachable_samples`), so the hybrid optimum over layouts x fractions is exact.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from cephalo.api.memory import COMM_BYTES_PER_PARAMETER, hybrid_state_bytes
from cephalo.api.models import ModelConfig
from cephalo.planner.cost.comm_model import CommModel, UnitComm
from cephalo.planner.cost.topology import ASSUMED, NodeLinks, Topology


class Placement(Protocol):
    """What `layouts` reads of a planning problem (`problem.Problem` is one): where each rank
    sits and which GPU class it is. A protocol, so that this module, which `problem` imports,
    never imports `problem` back."""

    @property
    def topology(self) -> Topology | None: ...

    @property
    def rank_node(self) -> Sequence[int]: ...

    @property
    def rank_class(self) -> Sequence[int]: ...


# Node selections tried in full up to this many (Π over kinds of (nodes + 1)); beyond, each
# kind's nodes all or none (the plan's search info says the layouts were a family).
EXHAUSTIVE_MAX_SELECTIONS = 512


@dataclass(frozen=True)
class Layout:
    """Replica groups over ranks of the full problem, in position order."""

    groups: tuple[tuple[int, ...], ...]
    nodes_per_group: int
    # The leading share of every slice whose optimizer state every group keeps whole
    # (Plan.replicated_fraction): its gradient all-reduced across groups, nothing gathered.
    replicated_fraction: float = 0.0

    @functools.cached_property
    def ranks(self) -> list[int]:
        # Cached (the search reads it for every layout at every fraction); frozen fields.
        return sorted(r for g in self.groups for r in g)


def hybrid_unit_comm(model: ModelConfig, base: CommModel, topology: Topology,
                     rank_node: Sequence[int], groups: Sequence[Sequence[int]],
                     uneven: bool = False, replicated_fraction: float = 0.0) -> UnitComm:
    """Seconds of each collective a hybrid step issues (module docstring): the group's
    rings for the gathers and reduce-scatters, the cross-group collectives of each slice
    gradient under the backward (`cross_rs_*`: beside the group's where they ride the NICs
    alone, after them where the group's ring crosses the NICs too), the cross-group
    all-gather of the sharded part of the piece before each unit's forward gather, the
    step's small all-reduces over every rank."""
    k, num_groups, world = len(groups[0]), len(groups), len(rank_node)
    a = replicated_fraction
    links = _group_links(model, base, topology.nodes, tuple(rank_node),
                         tuple(tuple(g) for g in groups), uneven)
    inside, share, nic, nic_latency = links.inside, links.share, links.nic, links.nic_latency
    spans_nodes = links.spans_nodes

    def across(params: int, bytes_per_parameter: float, passes: float, hops: int) -> float:
        """Ring collectives of every position's slice of a unit across the groups: each
        pass (a reduce-scatter or all-gather of all of it) moves (G-1)/G of it per member;
        `hops` rings of (G-1) hops of latency."""
        moved = (num_groups - 1) / num_groups * params * bytes_per_parameter * passes
        return moved * share / nic + hops * (num_groups - 1) * nic_latency

    def reduced(params: int) -> float:
        """The backward's: the sharded part (1 - a) reduce-scattered, one pass; the
        replicated part a all-reduced, two passes (a reduce-scatter and an all-gather) and
        twice the hops; each collective issued only where its part is not empty."""
        hops = int(a < 1.0) + 2 * int(a > 0.0)
        return across(params, base.reduce_bytes_per_parameter, (1.0 - a) + 2.0 * a, hops)

    def gathered(params: int) -> float:
        """The next forward's: the updated pieces of the sharded part (1 - a) only."""
        return across(params, base.gather_bytes_per_parameter, 1.0 - a, int(a < 1.0))

    def forward_gather(own: float, cross: float) -> float:
        """A unit's forward gather with its cross all-gather before it. The cross
        all-gathers are all in flight from the step's start, each ahead of the units after
        it, so on a NIC of their own they pipeline with the group's gathers (the slower of
        the two per unit); where the group's ring crosses the NICs too, they share them."""
        return own + cross if spans_nodes else max(own, cross)

    embedding, block, head = (model.embedding_parameters(), model.block_parameters(),
                              model.head_parameters())
    return replace(
        # The head's cross-group collective runs under the blocks' backward; the
        # embedding's, the backward's last, starts when nothing is left: exposed.
        inside, cross_rs_block=reduced(block), cross_rs_other=reduced(head),
        cross_rs_last=reduced(embedding), cross_own_link=not spans_nodes,
        # The head is gathered in the forward only; the first unit's cross all-gather has
        # nothing before it to hide under (exposed, with its own gather).
        ag_head=forward_gather(inside.ag_head, gathered(head)),
        cross_ag_block=forward_gather(inside.ag_block, gathered(block)) - inside.ag_block,
        cross_ag_first=gathered(embedding),
        state_share_parameters=optimizer_parameters(model.total_parameters(), k, num_groups,
                                                    a),
        all_reduce_seconds=links.all_reduce_seconds,
        step_overhead_seconds=base.step_overhead_seconds if world > 1 else 0.0)


@dataclass(frozen=True)
class _GroupLinks:
    """What `hybrid_unit_comm` reads of a layout's links, the same at every replicated
    fraction: the group's collectives (every rank at the slowest group ring's pace), the
    share of a group's cross-group bytes one NIC carries, the slowest NIC and its hop
    latency, whether a group's ring crosses the NICs, the step's small all-reduces."""

    inside: UnitComm
    share: float
    nic: float
    nic_latency: float
    spans_nodes: bool
    all_reduce_seconds: float


@functools.lru_cache(maxsize=1024)
def _group_links(model: ModelConfig, base: CommModel, nodes: tuple[NodeLinks, ...],
                 rank_node: tuple[int, ...], groups: tuple[tuple[int, ...], ...],
                 uneven: bool) -> _GroupLinks:
    """_GroupLinks, kept by its immutable arguments: the search prices every layout at
    each fraction (and a cluster's layouts hold hundreds of ranks to walk)."""
    topology = Topology(nodes, {})  # its rings read the nodes' links only
    rings = [topology.ring([rank_node[r] for r in g]) for g in groups]
    ring = replace(base, bandwidth_bytes_per_second=min(b for b, _ in rings),
                   latency_seconds=max(lat for _, lat in rings))
    used = set(rank_node)
    return _GroupLinks(
        inside=UnitComm.build(model, ring, len(groups[0]), uneven),
        share=node_share(rank_node, groups),
        nic=min(nodes[n].nic_bandwidth_bytes_per_second for n in used),
        nic_latency=max(nodes[n].nic_latency_seconds for n in used),
        spans_nodes=any(len({rank_node[r] for r in g}) > 1 for g in groups),
        all_reduce_seconds=2 * topology.comm(base, rank_node).small_all_reduce_seconds(
            len(rank_node)))


def optimizer_parameters(params: float, group_size: int, num_groups: int,
                         replicated_fraction: float = 0.0) -> float:
    """The parameters one rank's AdamW updates a step: its piece of the sharded part of
    its slice, P / (k G) (1 - a), and all of the replicated part, P / k a."""
    return params / (group_size * num_groups) * (1.0 - replicated_fraction) + \
        params / group_size * replicated_fraction


def group_state_bytes(model: ModelConfig, precision: str, num_groups: int,
                      replicated_fraction: float = 0.0) -> float:
    """The training state one replica group holds, over its ranks (module docstring): the
    state of the whole model (`hybrid_state_bytes` of all its parameters, the replicated
    fraction's optimizer state whole) and the slice gradient of the largest unit while it
    is reduced across the groups (none for G = 1: the slice gradient is the piece's)."""
    params = model.total_parameters()
    transient = COMM_BYTES_PER_PARAMETER * max(model.unit_parameters()) if num_groups > 1 \
        else 0
    return hybrid_state_bytes(params, num_groups, precision, replicated_fraction) + transient


def node_share(rank_node: Sequence[int], groups: Sequence[Sequence[int]]) -> float:
    """The largest share of one group's ranks on one node: with even shards, the share of
    each unit's cross-group bytes that node's NIC carries (1 for a group of one node)."""
    most = 0
    for g in groups:
        per: dict[int, int] = {}
        for r in g:
            per[rank_node[r]] = per.get(rank_node[r], 0) + 1
        most = max(most, *per.values())
    return most / len(groups[0])


def layouts(problem: Placement) -> tuple[list[Layout], bool]:
    """The hybrid layouts of `problem`'s GPUs (module docstring), most GPUs first, and
    whether they are every layout of that space; none without a topology or where which
    GPUs share a node is only assumed (each on its own: groups would be guesses)."""
    topology = problem.topology
    if topology is None or not problem.rank_node or \
            topology.sources.get("placement") == ASSUMED:
        return [], True
    node_ranks: dict[int, list[int]] = {}
    for rank, node in enumerate(problem.rank_node):
        node_ranks.setdefault(node, []).append(rank)
    kinds: dict[object, list[int]] = {}  # what a node holds -> its nodes, in rank order
    for node, ranks in node_ranks.items():
        held = tuple(sorted(problem.rank_class[r] for r in ranks))
        kinds.setdefault((held, topology.nodes[node]), []).append(node)
    per_kind = list(kinds.values())
    exhaustive = math.prod(len(n) + 1 for n in per_kind) <= EXHAUSTIVE_MAX_SELECTIONS
    if exhaustive:
        selections = _all_counts([len(n) for n in per_kind])
    else:
        selections = [[len(n) * on for n, on in zip(per_kind, mask, strict=True)]
                      for mask in _all_counts([1] * len(per_kind))]
    out: list[Layout] = []
    for counts in selections:
        chosen = sorted((n for nodes, c in zip(per_kind, counts, strict=True)
                         for n in nodes[:c]), key=lambda n: node_ranks[n][0])
        sizes = {len(node_ranks[n]) for n in chosen}
        if len(sizes) != 1:
            continue  # groups of whole nodes of unequal sizes cannot be equal
        for per_group in range(1, len(chosen) // 2 + 1):
            if len(chosen) % per_group:
                continue
            spans = [chosen[i:i + per_group] for i in range(0, len(chosen), per_group)]
            if any(len({topology.nodes[n].domain for n in nodes}) > 1 for nodes in spans):
                continue  # a group's rings stay inside one switch / zone (ClusterNode.domain)
            groups = tuple(tuple(r for n in nodes for r in node_ranks[n]) for nodes in spans)
            out.append(Layout(groups, per_group))
    out.sort(key=lambda lay: (-len(lay.ranks), lay.nodes_per_group))
    return out, exhaustive


def _all_counts(limits: list[int]) -> list[list[int]]:
    """Every vector 0 ≤ c_i ≤ limits[i] but all zeros."""
    return [list(c) for c in itertools.product(*(range(k + 1) for k in limits)) if any(c)]


def replicated_text(fraction: float) -> str:
    """'50 % of each slice's optimizer state kept in every group' (Plan.replicated_fraction)."""
    return f"{fraction * 100:g} % of each slice's optimizer state kept in every group"


@dataclass(frozen=True)
class LinkBytes:
    """Bytes one step puts on each kind of link: the intra-node link per GPU and the NIC
    per node (the busiest of each), for the printed plan."""

    intra_node_link_per_gpu: float
    nic_per_node: float


def link_bytes_per_step(model: ModelConfig, gather_bytes: float, reduce_bytes: float,
                        rank_node: Sequence[int], groups: Sequence[Sequence[int]],
                        regathered_parameters: int,
                        replicated_fraction: float = 0.0) -> LinkBytes:
    """What the step's big collectives move (ring all-gathers of every unit once, again
    for `regathered_parameters` in the backward, one reduce-scatter; hybrid: plus the
    cross-group reduce-scatter of the sharded part's gradients and all-gather of its
    parameters, and the all-reduce of the replicated part's gradients). A ring of n ranks
    moves (n-1)/n of a collective's bytes over each of its hops: every intra-node hop it
    has and, when it spans nodes, each node's NIC once out (topology.py). The replicated
    fraction a moves the parameters' pass to the gradients' (an all-reduce is two passes):
    the NIC's bytes are the same where gradients and parameters travel in one precision
    and grow by a (reduce - gather bytes) per parameter's pass where they do not."""
    params = model.total_parameters()
    if not groups:
        groups = [list(range(len(rank_node)))]
    k, num_groups = len(groups[0]), len(groups)
    ring = (k - 1) / k * ((params + regathered_parameters) * gather_bytes +
                          params * reduce_bytes)
    spans_nodes = any(len({rank_node[r] for r in g}) > 1 for g in groups)
    has_intra = any(len({rank_node[r] for r in g}) < len(g) for g in groups)
    nic = ring if spans_nodes else 0.0
    if num_groups > 1:
        a = replicated_fraction
        per_parameter = (1.0 + a) * reduce_bytes + (1.0 - a) * gather_bytes
        nic += (num_groups - 1) / num_groups * params * per_parameter * \
            node_share(rank_node, groups)
    return LinkBytes(ring if has_intra else 0.0, nic)
