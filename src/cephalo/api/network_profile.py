"""NetworkProfile: the collectives the operator's network probe measured on the cluster
(issue 35, item 1; docs/network.md), and how a plan uses them.

A probe is a two-rank gang of the job's trainer image running `python -m
cephalo.trainer.netprobe`: **inter-node**, one pod on a node of pool A and one on another
node of pool B (A may be B, the pods on different nodes), or **intra-node**, one pod with two
GPUs of one node of pool A. Rank 0 fits the engine's own all-gather and reduce-scatter to the
ring model (`cephalo.trainer.profile_collectives`) and hands the `CollectiveProfile` to the
operator in its termination message; the operator caches it as a NetworkProfile in a
ConfigMap of its own namespace (one cache for every namespace's jobs) and plans with it until
it is older than its maximum age.

How a measurement becomes the planner's topology (`with_measured_network`): a two-rank ring
between nodes runs at min(NIC a, NIC b) — the slower NIC it crosses, as the transport sees it.
A pool's NIC is then at least the fastest pair it was measured in, and taking that figure
for every node of the pool reproduces each measured pair exactly (the slower pool of the pair
keeps its own, smaller figure); its latency is that pair's (a hop in the model costs the mean
of its two NICs' latencies, so a pool measured in two pairs gets one of them: latency is
reproduced to within the pairs' spread, bandwidth exactly). An intra-node probe gives its
pool's GPU-to-GPU link. One
bandwidth stands for both collectives: the harmonic mean of the all-gather's and the
reduce-scatter's (a unit's collectives are both kinds, so their times add). How much of a
collective hid under compute on the probe's GPUs (its `overlap_fraction`) becomes the
cluster's `collective_overlap_fraction`: the least any probe measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cephalo.api.cluster import ClusterNode, ClusterSpec
from cephalo.api.profile import CollectiveProfile

INTER, INTRA = "inter-node", "intra-node"
ProbeKind = Literal["inter-node", "intra-node"]
MEASURED_SOURCE = "measured (the operator's network probe)"
NETWORK_PROFILE_KEY = "network.json"  # the ConfigMap key of the JSON


class NetworkProfile(BaseModel):
    """One probe's measurement: where, when, for which job (its uid), and the fitted
    collectives."""

    model_config = ConfigDict(extra="forbid")

    kind: ProbeKind
    pools: list[str] = Field(min_length=1, max_length=2, description=(
        "The pool (product label) of each rank's node: two for inter-node, one for "
        "intra-node."))
    nodes: list[str] = Field(default_factory=list, max_length=2,
                             description="The nodes the ranks ran on.")
    nics: list[str] = Field(default_factory=list, max_length=2, description=(
        "Each pool's NIC identity when measured (its nodes' instance-type / nic-gbps "
        "labels; empty: none): the cache's key with the pools."))
    collectives: CollectiveProfile
    measured_at: float = Field(ge=0, description="When, in Unix seconds (operator's clock).")
    measured_for: str = Field(default="", description=(
        "The uid of the job it ran for: no namespace or name, as the cache is shared by "
        "every namespace."))

    @property
    def bandwidth_bytes_per_second(self) -> float:
        """Per-rank ring bandwidth for the planner: the harmonic mean of the two fits."""
        c = self.collectives
        return statistics.harmonic_mean([c.bandwidth_bytes_per_second,
                                         c.reduce_scatter_bandwidth_bytes_per_second
                                         or c.bandwidth_bytes_per_second])

    @property
    def latency_seconds(self) -> float:
        c = self.collectives
        rs = c.reduce_scatter_latency_seconds
        return (c.latency_seconds + (c.latency_seconds if rs is None else rs)) / 2

    def age_seconds(self, now: float | None = None) -> float:
        return max(0.0, (time.time() if now is None else now) - self.measured_at)

    def describe(self, now: float | None = None) -> str:
        """'inter-node L4 <-> A10G: 9.41 Gbit/s, 52 us, 0.93 hidden under compute (measured
        3 h ago)'."""
        where = " <-> ".join(self.pools) if self.kind == INTER else f"{self.pools[0]} x2"
        overlap = self.collectives.overlap_fraction
        hidden = "" if overlap is None else f", {overlap:.2f} hidden under compute"
        return (f"{self.kind} {where}: {self.bandwidth_bytes_per_second * 8 / 1e9:.3g} Gbit/s, "
                f"{self.latency_seconds * 1e6:.3g} us{hidden} "
                f"(measured {_ago(self.age_seconds(now))})")


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def with_measured_network(cluster: ClusterSpec,
                          profiles: Sequence[NetworkProfile]) -> ClusterSpec:
    """`cluster` with each node's links taken from the measurements of its pool (nodes are
    named by their pool, as the operator's discovery describes them); a node no measurement
    covers keeps what it had. Unchanged without profiles or nodes."""
    if not profiles or cluster.nodes is None:
        return cluster
    nic: dict[str, tuple[float, float]] = {}  # pool -> (bandwidth, latency): fastest pair
    intra: dict[str, tuple[float, float]] = {}
    for p in profiles:
        figure = (p.bandwidth_bytes_per_second, p.latency_seconds)
        table = nic if p.kind == INTER else intra
        for pool in set(p.pools):
            old = table.get(pool)
            if old is None or figure[0] > old[0]:
                table[pool] = figure
    nodes: list[ClusterNode] = []
    for node in cluster.nodes:
        update: dict[str, float | bool] = {}
        if node.name in nic:
            update.update(nic_bandwidth_bytes_per_second=nic[node.name][0],
                          nic_latency_seconds=nic[node.name][1], nic_measured=True)
        if node.name in intra:
            update.update(intra_bandwidth_bytes_per_second=intra[node.name][0],
                          intra_latency_seconds=intra[node.name][1], intra_measured=True)
        nodes.append(node.model_copy(update=update) if update else node)
    # A node left to its label (or the default) says so beside the measurement.
    whole = all(n.name in nic for n in cluster.nodes) or len(cluster.nodes) == 1
    source = MEASURED_SOURCE if whole or not cluster.network_source else \
        f"{MEASURED_SOURCE} + {cluster.network_source}"
    overlaps = [p.collectives.overlap_fraction for p in profiles
                if p.collectives.overlap_fraction is not None]
    return cluster.model_copy(update={
        "nodes": nodes, "network_source": source,
        "collective_overlap_fraction": min(overlaps, default=cluster.collective_overlap_fraction)})


__all__ = ["INTER", "INTRA", "MEASURED_SOURCE", "NETWORK_PROFILE_KEY", "NetworkProfile",
           "ProbeKind", "with_measured_network"]
