"""The network the collectives cross: which node each rank sits on and each node's links,
and the flat ring (`CommModel`) that prices a ring over given ranks (docs/network.md).

The engine's collectives are torch.distributed all_gather / reduce_scatter on one process
group: NCCL and gloo run them as a ring over the ranks in rank order, and rank order
groups ranks by node. Each ring step every rank sends 1/n of the bytes to the next rank:
between two ranks of a node over the node's intra-node link (NVLink or PCIe), between nodes
out of one NIC and into the next. A ring over ranks grouped by node therefore crosses each
NIC once out and once in, and a step takes as long as its slowest hop:

    bandwidth = min over hops: intra-node link (same node), min(NIC a, NIC b) (across)
    latency   = (n-1)/n · Σ_hops hop latency  (a chunk travels n-1 of the n hops; averaged
                over where it starts), a hop across nodes costing the mean of its two NICs'

so a ring on one node uses its intra-node link only, and one across nodes with several
ranks each runs at min(intra-node link, NIC) per rank. As a flat ring that is (bandwidth,
latency per hop = Σ_hops / n): `CommModel.ring_seconds` keeps the one formula
(n-1)/n · bytes / bandwidth + (n-1) · latency. Both figures depend only on which nodes the
ranks use and how many on each, not on the order of the nodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from cephalo.api.cluster import ClusterNode, ClusterSpec, check_placement, fit_nodes
from cephalo.api.job import CephaloJobSpec
from cephalo.api.network import (
    COLLECTIVE_EFFICIENCY,
    DEFAULT_INTER_NODE_GBPS,
    DEFAULT_INTER_NODE_LATENCY_MICROSECONDS,
    DEFAULT_INTRA_NODE_GBPS,
    DEFAULT_INTRA_NODE_LATENCY_MICROSECONDS,
)
from cephalo.errors import CephaloError
from cephalo.planner.cost.catalog import same_gpu
from cephalo.planner.cost.comm_model import CommModel

GBIT = 1e9 / 8  # bytes per second in one Gbit/s
MEASURED, JOB, ASSUMED = "measured", "job spec", "assumed"


class NetworkSpecError(CephaloError, ValueError):
    """planner.network names nodes that do not match the job's pools."""


@dataclass(frozen=True)
class NodeLinks:
    """One node's links as the planner prices them: a described bandwidth (not measured)
    already times the collective library's efficiency, which `*_efficiency` records (1.0:
    measured, used as measured)."""

    nic_bandwidth_bytes_per_second: float
    nic_latency_seconds: float
    intra_bandwidth_bytes_per_second: float
    intra_latency_seconds: float
    nic_efficiency: float = 1.0
    intra_efficiency: float = 1.0
    domain: str | None = None  # ClusterNode.domain: the switch / zone it shares with others


@dataclass(frozen=True)
class Topology:
    """Each node's links (index = node), and where each figure came from."""

    nodes: tuple[NodeLinks, ...]
    # figure ('inter_node_bandwidth', ...) -> source ('job spec', 'assumed', the cluster's)
    sources: Mapping[str, str]

    def ring(self, rank_nodes: Sequence[int]) -> tuple[float, float]:
        """(bandwidth, latency per hop) of the flat ring equivalent to a ring over ranks on
        `rank_nodes` (rank order, grouped by node)."""
        per_node: dict[int, int] = {}
        for node in rank_nodes:
            per_node[node] = per_node.get(node, 0) + 1
        n = len(rank_nodes)
        if n <= 1:
            return self.nodes[rank_nodes[0]].intra_bandwidth_bytes_per_second if n else 1.0, 0.0
        bandwidth = float("inf")
        hop_latency_sum = 0.0
        for node, ranks in per_node.items():
            links = self.nodes[node]
            if ranks > 1:  # ranks - 1 hops inside the node
                bandwidth = min(bandwidth, links.intra_bandwidth_bytes_per_second)
                hop_latency_sum += (ranks - 1) * links.intra_latency_seconds
            if len(per_node) > 1:  # one hop out of its NIC and one in: half of each
                bandwidth = min(bandwidth, links.nic_bandwidth_bytes_per_second)
                hop_latency_sum += links.nic_latency_seconds
        if len(per_node) == 1:  # the ring closes inside the node: its n-th hop
            hop_latency_sum += self.nodes[rank_nodes[0]].intra_latency_seconds
        return bandwidth, hop_latency_sum / n

    def comm(self, base: CommModel, rank_nodes: Sequence[int]) -> CommModel:
        bandwidth, latency = self.ring(rank_nodes)
        return replace(base, bandwidth_bytes_per_second=bandwidth, latency_seconds=latency)

    def across_bound(self, base: CommModel, used: Sequence[int]) -> CommModel:
        """A flat ring no slower than any ring across two or more of the nodes `used`: it
        crosses their NICs, so no hop is faster than the fastest NIC nor cheaper than the
        least hop latency (subset.subset_lower_bound's relaxation)."""
        nodes = [self.nodes[n] for n in used]
        return replace(base, bandwidth_bytes_per_second=max(
            n.nic_bandwidth_bytes_per_second for n in nodes), latency_seconds=min(
            min(n.nic_latency_seconds, n.intra_latency_seconds) for n in nodes))

    def inside_bound(self, base: CommModel, node: int) -> CommModel:
        """The ring on one node (its intra-node link only)."""
        links = self.nodes[node]
        return replace(base, bandwidth_bytes_per_second=links.intra_bandwidth_bytes_per_second,
                       latency_seconds=links.intra_latency_seconds)


@dataclass(frozen=True)
class Network:
    """What `build_problem` prices collectives with: a flat ring (measured, or a bandwidth
    given per GPU), or a topology with the node of every rank."""

    base: CommModel
    topology: Topology | None
    # Per GPU, in cluster order of groups (group index, node index); None: flat.
    placement: list[tuple[int, int]] | None
    source: str  # measured, job spec, the cluster's describer (flat rings: the only one)
    flat_reason: str = ""  # what gave a flat ring its figures
    # The library the collectives run on ('nccl', 'gloo'), and for a flat ring the share of
    # its described rate it was priced at (1.0: measured; a topology's nodes say per link).
    backend: str = ""
    flat_efficiency: float = 1.0

    def scaled(self, c: float) -> Network:
        """Every link c times slower (bandwidth / c, latency x c): a running job's
        calibration of a declared network (ClusterSpec.collective_scale)."""
        if c == 1.0:
            return self
        base = replace(self.base, bandwidth_bytes_per_second=self.base.bandwidth_bytes_per_second
                       / c, latency_seconds=self.base.latency_seconds * c)
        topology = self.topology
        if topology is not None:
            topology = replace(topology, nodes=tuple(replace(
                n, nic_bandwidth_bytes_per_second=n.nic_bandwidth_bytes_per_second / c,
                nic_latency_seconds=n.nic_latency_seconds * c,
                intra_bandwidth_bytes_per_second=n.intra_bandwidth_bytes_per_second / c,
                intra_latency_seconds=n.intra_latency_seconds * c) for n in topology.nodes))
        return replace(self, base=base, topology=topology)

    def ring_over_all(self) -> tuple[float, float]:
        """(bandwidth, latency per hop) of a ring over every GPU described."""
        if self.topology is None or self.placement is None:
            return self.base.bandwidth_bytes_per_second, self.base.latency_seconds
        return self.topology.ring([node for _, node in self.placement])

    def efficiency_of(self, rank_nodes: Sequence[int]) -> float:
        """The share of a described rate a ring over these ranks was priced at where it
        crosses a described bandwidth (the backend's efficiency); 1.0 where every bandwidth
        it crosses was measured."""
        if self.topology is None:
            return self.flat_efficiency
        per_node: dict[int, int] = {}
        for node in rank_nodes:
            per_node[node] = per_node.get(node, 0) + 1
        crossed = [1.0]
        for node, ranks in per_node.items():
            links = self.topology.nodes[node]
            if len(per_node) > 1:
                crossed.append(links.nic_efficiency)
            if ranks > 1:
                crossed.append(links.intra_efficiency)
        return min(crossed)

    def source_of(self, rank_nodes: Sequence[int]) -> str:
        """Where the figures a ring over these ranks crosses came from ('job spec', the
        cluster's describer, both joined by ' + '): 'assumed' when a bandwidth it crosses or
        the placement itself was a default."""
        if self.topology is None:
            return self.source
        sources = self.topology.sources
        crossed = [sources["placement"]] if len(rank_nodes) > 1 else []
        if len(set(rank_nodes)) > 1:
            crossed.append(sources["inter_node_bandwidth"])
        if len(set(rank_nodes)) < len(rank_nodes):
            crossed.append(sources["intra_node_bandwidth"])
        if ASSUMED in crossed:
            return ASSUMED
        return " + ".join(dict.fromkeys(crossed)) if crossed else "unused (one rank)"


def job_nodes(spec: CephaloJobSpec, cluster: ClusterSpec) -> list[ClusterNode] | None:
    """planner.network.nodes as the cluster's nodes (keys matched to the groups: a pool
    label, a product or its catalog name), or None when the job names none."""
    network = spec.planner.network
    if network is None or network.nodes is None:
        return None
    nodes = []
    for entry in network.nodes:
        gpus: dict[str, int] = {}
        for name, count in entry.gpus.items():
            key = _group_key(cluster, name)
            gpus[key] = gpus.get(key, 0) + count
        nodes.append(ClusterNode(
            gpus=gpus, count=entry.count,
            nic_bandwidth_bytes_per_second=_gbps(entry.inter_node_gbps),
            intra_bandwidth_bytes_per_second=_gbps(entry.intra_node_gbps)))
    try:
        check_placement({g.key: g.count for g in cluster.groups},
                        [(n.gpus, n.count) for n in nodes], "planner.network.nodes")
    except ValueError:
        # Fewer GPUs free than the nodes list (a shared cluster, an elastic re-plan): the
        # placement is not known, and the plan says "assumed" (each GPU on its own node).
        return None
    return nodes


def _group_key(cluster: ClusterSpec, name: str) -> str:
    for group in cluster.groups:
        if name in (group.key, group.product):
            return group.key
    matches = [g.key for g in cluster.groups if same_gpu(name, g.product)]
    if len(matches) != 1:
        raise NetworkSpecError(
            f"planner.network.nodes names {name[:64]!r}, which is no single pool of the "
            f"job's (pools: {', '.join(g.key for g in cluster.groups)})")
    return matches[0]


def _gbps(value: float | None) -> float | None:
    return None if value is None else value * GBIT


def topology_network(spec: CephaloJobSpec, cluster: ClusterSpec, base: CommModel) -> Network:
    """The nodes (the cluster's, else the job's, else one GPU per node) and each figure:
    the job's planner.network, else the node's own (the operator's node label), else the
    documented default (assumed)."""
    # What the collective library reaches of a described rate; a measured one is its own.
    efficiency = COLLECTIVE_EFFICIENCY[cluster.backend]
    nodes = None if cluster.nodes is None else fit_nodes(cluster.groups, cluster.nodes)
    describer = cluster.network_source or "cluster"
    if nodes is None:
        nodes = job_nodes(spec, cluster)
        describer = JOB
    placed_by = describer
    if nodes is None:  # nothing says which GPUs share a node: each on its own
        nodes = [ClusterNode(gpus={g.key: 1}, count=g.count) for g in cluster.groups]
        placed_by = ASSUMED
    given = spec.planner.network
    sources: dict[str, str] = {"placement": placed_by}
    job_figures = {
        "inter_node_bandwidth": _gbps(given.inter_node_gbps) if given else None,
        "inter_node_latency": _micro(given.inter_node_latency_microseconds) if given else None,
        "intra_node_bandwidth": _gbps(given.intra_node_gbps) if given else None,
        "intra_node_latency": _micro(given.intra_node_latency_microseconds) if given else None}
    defaults = {"inter_node_bandwidth": DEFAULT_INTER_NODE_GBPS * GBIT,
                "inter_node_latency": DEFAULT_INTER_NODE_LATENCY_MICROSECONDS * 1e-6,
                "intra_node_bandwidth": DEFAULT_INTRA_NODE_GBPS * GBIT,
                "intra_node_latency": DEFAULT_INTRA_NODE_LATENCY_MICROSECONDS * 1e-6}

    def figure(name: str, own: float | None, own_source: str) -> tuple[float, bool]:
        """The figure, and whether it is the cluster's own for this node. The job pins by
        hand (a node entry of its own first, then job-wide); then what the cluster said of
        this node; then the default."""
        for value, source in ((own if own_source == JOB else None, JOB),
                              (job_figures[name], JOB), (own, own_source)):
            if value is not None:
                _note(sources, name, source)
                return value, source == own_source and own_source != JOB
        _note(sources, name, ASSUMED)
        return defaults[name], False

    def bandwidth(name: str, own: float | None, measured: bool) -> tuple[float, float]:
        """(priced bandwidth, the share of the described rate it is priced at): what the
        cluster measured as measured, any other figure at the library's efficiency."""
        value, is_own = figure(name, own, describer)
        share = 1.0 if is_own and measured else efficiency
        return value * share, share

    links: list[NodeLinks] = []
    placement: list[tuple[int, int]] = []
    index = {g.key: i for i, g in enumerate(cluster.groups)}
    for node in nodes:
        nic, nic_share = bandwidth("inter_node_bandwidth", node.nic_bandwidth_bytes_per_second,
                                   node.nic_measured)
        intra, intra_share = bandwidth("intra_node_bandwidth",
                                       node.intra_bandwidth_bytes_per_second,
                                       node.intra_measured)
        link = NodeLinks(
            nic * node.nic_share, figure("inter_node_latency", node.nic_latency_seconds,
                                         describer)[0],
            intra, figure("intra_node_latency", node.intra_latency_seconds, describer)[0],
            nic_share, intra_share, node.domain)
        for _ in range(node.count):
            for key in sorted(node.gpus, key=index.__getitem__):  # groups in cluster order
                placement += [(index[key], len(links))] * node.gpus[key]
            links.append(link)
    return Network(base, Topology(tuple(links), sources), placement, placed_by,
                   backend=cluster.backend)


def _micro(value: float | None) -> float | None:
    return None if value is None else value * 1e-6


def _note(sources: dict[str, str], name: str, source: str) -> None:
    """The least certain source any node's figure came from."""
    order = [ASSUMED, JOB]
    old = sources.get(name)
    if old is None or (source in order and (old not in order or order.index(source) <
                                            order.index(old))):
        sources[name] = source



def network_assumptions(network: Network | None, rank_nodes: Sequence[int]) -> dict[str, object]:
    """What a plan over ranks on `rank_nodes` records of its network (Plan.assumptions): the
    source in one word ('assumed': a default; the printed plan says how to set it), and for
    a topology the nodes the ring spans and where each figure came from."""
    if network is None:
        return {}
    out: dict[str, object] = {"network_source": network.source_of(rank_nodes)}
    if network.backend:
        out["collective_backend"] = network.backend
    efficiency = network.efficiency_of(rank_nodes)
    if efficiency != 1.0:  # a described bandwidth, priced at what the library reaches of it
        out["collective_efficiency"] = efficiency
    topology = network.topology
    if topology is None:
        out["network_model"] = network.flat_reason
        return out
    used = sorted(set(rank_nodes))
    out["network_model"] = "topology"
    out["network_nodes"] = len(used)
    out["network_figures"] = {
        "inter_node_gbps": sorted({topology.nodes[n].nic_bandwidth_bytes_per_second / GBIT
                                   for n in used}),
        "intra_node_gbps": sorted({topology.nodes[n].intra_bandwidth_bytes_per_second / GBIT
                                   for n in used}),
        "sources": dict(topology.sources)}
    return out
