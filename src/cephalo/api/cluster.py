"""ClusterSpec: the GPUs a plan may use, grouped into pools of one product each, and
optionally the nodes they sit on with each node's links (the planner's topology,
`cephalo.planner.cost.topology`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_GPUS_PER_GROUP = 100_000


class GpuGroup(BaseModel):
    model_config = ConfigDict(extra="forbid")

    product: str = Field(description="catalog name (e.g. L4) or a discovery label")
    # The same bound as a job's gpuPools[].maxGpus: beyond any real cluster.
    count: int = Field(ge=1, le=MAX_GPUS_PER_GROUP)
    pool: str | None = Field(default=None, description="pool name; default: the product")
    memory_bytes: int | None = Field(default=None, ge=1, description="override the catalog")

    @property
    def key(self) -> str:
        """What a node's `gpus` names this group by."""
        return self.pool or self.product


class ClusterNode(BaseModel):
    """One machine (or `count` identical ones): its GPUs by group key, and its links where
    known (None: the job's figure, else the documented default)."""

    model_config = ConfigDict(extra="forbid")

    gpus: dict[str, int] = Field(min_length=1)
    count: int = Field(default=1, ge=1)
    name: str | None = None
    nic_bandwidth_bytes_per_second: float | None = Field(default=None, gt=0)
    nic_latency_seconds: float | None = Field(default=None, ge=0)
    intra_bandwidth_bytes_per_second: float | None = Field(default=None, gt=0)
    intra_latency_seconds: float | None = Field(default=None, ge=0)
    # The part of the NIC a ring over these GPUs gets: a pod of a job's ranks that may share
    # its node with others of the same job shares the node's NIC with them.
    nic_share: float = Field(default=1.0, gt=0, le=1)
    # The NIC's / the intra-node link's figures were measured (the operator's network
    # probe): the planner uses them as measured; any other figure is described and priced
    # at the collective library's efficiency (cephalo.api.network).
    nic_measured: bool = False
    intra_measured: bool = False
    # Which switch / zone the node sits in, as the cluster publishes it (the operator's
    # locality labels, e.g. "topology.kubernetes.io/zone=a/network.topology.nvidia.com/leaf=s1",
    # outermost first): nodes with the same value share it. None: not known. A hybrid plan's
    # replica group of several nodes stays inside one domain (docs/hybrid-sharding.md).
    domain: str | None = Field(default=None, max_length=1024)

    @model_validator(mode="after")
    def _positive(self) -> ClusterNode:
        if any(n < 1 for n in self.gpus.values()):
            raise ValueError("a node holds at least one GPU of each group it names")
        return self


class ClusterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    groups: list[GpuGroup] = Field(min_length=1)
    # A flat ring: every hop at this bandwidth and latency (a local run's bus, a bench).
    network_bandwidth_bytes_per_second: float | None = Field(default=None, gt=0)
    network_latency_seconds: float | None = Field(default=None, ge=0)
    # Which GPUs share a node, in rank order (None: not known here).
    nodes: list[ClusterNode] | None = None
    # Who described the nodes' links (the plan's assumptions name it), e.g. the operator's
    # node labels.
    network_source: str | None = None
    # A running job's recalibration (cephalo.planner.feedback.recalibrate): every collective of the
    # declared network (flat or topology) takes this many times as long as described.
    collective_scale: float = Field(default=1.0, gt=0)
    # How much of a collective hides under compute issued while it is in flight, as the
    # operator's network probe measured it on these GPUs (None: not measured; the planner
    # then assumes all of it, 1.0).
    collective_overlap_fraction: float | None = Field(default=None, ge=0, le=1)
    # The library the ranks' collectives run on, as the trainer picks it: NCCL between GPUs,
    # gloo between CPU ranks (`cephalo run` on the CPU, emulated GPUs included). None: NCCL
    # unless every group is the CPU. A described network is priced at the library's
    # efficiency (cephalo.api.network.COLLECTIVE_EFFICIENCY).
    collective_backend: Literal["nccl", "gloo"] | None = None

    @model_validator(mode="after")
    def _nodes_hold_the_groups(self) -> ClusterSpec:
        # The nodes may hold more than the groups (a caller narrowed the groups of a
        # described cluster: the planner keeps each group's first GPUs, `fit_nodes`), never
        # fewer: GPUs that sit on no node.
        if self.nodes is not None and fit_nodes(self.groups, self.nodes) is None:
            raise ValueError("nodes must hold every GPU of each group")
        return self

    @property
    def num_gpus(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def backend(self) -> Literal["nccl", "gloo"]:
        if self.collective_backend is not None:
            return self.collective_backend
        return "gloo" if all(g.product.lower() == "cpu" for g in self.groups) else "nccl"


def check_placement(counts: dict[str, int], nodes: list[tuple[dict[str, int], int]],
                    where: str) -> None:
    """ValueError unless the nodes hold exactly each group's GPUs (and nothing else)."""
    placed: dict[str, int] = {}
    for gpus, repeat in nodes:
        for key, n in gpus.items():
            placed[key] = placed.get(key, 0) + n * repeat
    unknown = sorted(set(placed) - set(counts))
    if unknown:
        raise ValueError(f"{where} name GPUs of no pool: {', '.join(unknown)} (pools: "
                         f"{', '.join(counts)})")
    wrong = [f"{key}: {placed.get(key, 0)} on nodes, {n} in the pool"
             for key, n in counts.items() if placed.get(key, 0) != n]
    if wrong:
        raise ValueError(f"{where} must hold every GPU of each pool once: {'; '.join(wrong)}")


def fit_nodes(groups: list[GpuGroup], nodes: list[ClusterNode]) -> list[ClusterNode] | None:
    """The nodes as they hold exactly `groups`' GPUs: each group's first `count` GPUs in node
    order (a described cluster whose groups a caller narrowed with model_copy: a pool left
    out, fewer GPUs of one); None when the nodes hold fewer of some group than it counts."""
    want = {g.key: g.count for g in groups}
    out = []
    for node in nodes:
        for _ in range(node.count):
            held = {}
            for key, n in node.gpus.items():
                take = min(n, want.get(key, 0))
                if take:
                    held[key] = take
                    want[key] -= take
            if held:
                out.append(node.model_copy(update={"gpus": held, "count": 1}))
    return None if any(want.values()) else out
