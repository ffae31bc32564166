"""spec.planner.network of a CephaloJob: the links the planner prices collectives over.

The planner's collectives are rings over the ranks in rank order, and rank order groups
ranks by node. A ring crosses each node's NIC once in and once out (when it spans more than
one node) and the intra-node link (NVLink or PCIe) between consecutive ranks of a node, so
its per-rank bandwidth is the slowest link it crosses: min(intra-node link, NIC) across
nodes, the intra-node link alone on one node (`cephalo.planner.cost.topology`, docs/network.md).

On a cluster the operator knows the nodes (GPU discovery) and reads each node's NIC speed
from its label `cephalo.dev/nic-gbps` (`ClusterSpec.nodes`); the fields here win over what
it found. Unset
figures fall back to the documented defaults below, and the plan says "assumed".
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field, model_validator

from cephalo.api.wire import CamelModel

# The defaults when nothing describes a figure (the plan then calls it "assumed"). A 10
# Gbit/s NIC keeps the per-rank bandwidth of a multi-node ring what the flat default was
# (10 Gbit/s per GPU); PCIe 3.0 x16 (16 GB/s nominal) is the slowest link a data-centre GPU
# sits on; 50 µs per hop across nodes is the flat default's latency (TCP, no RDMA), 10 µs
# inside one (a PCIe peer copy through NCCL or a shared-memory hop of gloo).
DEFAULT_INTER_NODE_GBPS = 10.0
DEFAULT_INTER_NODE_LATENCY_MICROSECONDS = 50.0
DEFAULT_INTRA_NODE_GBPS = 128.0
DEFAULT_INTRA_NODE_LATENCY_MICROSECONDS = 10.0
# What a collective library reaches of a described link's rate: the planner prices a
# described bandwidth (the job's planner.network / networkBandwidthGbps, the operator's node
# label, the defaults above, a local run's assumed bus) at this share of it. A measured one
# (the profiler's collectives, the operator's network probe) already is what the library
# reached and is used as measured. One figure for both collectives: the data does not tell
# them apart (docs/network.md, "Described or measured").
# gloo: this project's measurement, the median over 13 runs on a tc-shaped link (50-400
# Mbit/s, 1+1 and 2+2 ranks) of the harmonic mean of the all-gather's and the
# reduce-scatter's fit over the shaped rate (the table in docs/network.md; the test
# test_collective_efficiency recomputes it from there).
# NCCL: not measured here (no GPU). NCCL's maintainers' figure for a 100 / 200 Gbit/s
# NIC, 12 / 24 GB/s of nccl-tests' bus bandwidth (NVIDIA/nccl-tests issue 119), whose bus
# bandwidth is the ring model's per-rank bandwidth for all-gather and reduce-scatter.
GLOO_EFFICIENCY = 0.47
NCCL_EFFICIENCY = 0.96
COLLECTIVE_EFFICIENCY = {"gloo": GLOO_EFFICIENCY, "nccl": NCCL_EFFICIENCY}
# The node label the operator reads a node's NIC speed from (Gbit/s, a decimal number).
NIC_GBPS_LABEL = "cephalo.dev/nic-gbps"
MAX_GBPS = 100_000.0
MAX_LATENCY_MICROSECONDS = 10_000_000.0
MAX_NODES = 4096
MAX_GPUS_PER_NODE = 1024
_NO_GPUS = "planner.network.nodes[].gpus: name at least one pool's GPUs (e.g. NVIDIA-A10G: 8)"


class NodeGpus(CamelModel):
    """Some identical nodes: which GPUs each holds, and optionally its own links."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": "size(self.gpus) >= 1", "message": _NO_GPUS}]})

    gpus: dict[str, Annotated[int, Field(ge=1, le=MAX_GPUS_PER_NODE)]] = Field(
        max_length=16, description=(
        "GPUs on each of these nodes, by pool: a gpuPools product (e.g. NVIDIA-A10G: 8); "
        "at most 16 pools, 1024 GPUs each."))
    count: int = Field(default=1, ge=1, le=MAX_NODES, description=(
        "How many nodes like this one (at most 4096)."))

    @model_validator(mode="after")
    def _holds_gpus(self) -> NodeGpus:
        if not self.gpus:  # the same rule as the CEL above, in the same words
            raise ValueError(_NO_GPUS)
        return self
    inter_node_gbps: float | None = Field(default=None, gt=0, le=MAX_GBPS, description=(
        "This node's NIC, Gbit/s (default: planner.network.interNodeGbps)."))
    intra_node_gbps: float | None = Field(default=None, gt=0, le=MAX_GBPS, description=(
        "This node's GPU-to-GPU link (NVLink or PCIe), Gbit/s per GPU (default: "
        "planner.network.intraNodeGbps)."))


class NetworkSpec(CamelModel):
    """The nodes' links, for the planner's collectives (docs/network.md)."""

    inter_node_gbps: float | None = Field(default=None, gt=0, le=MAX_GBPS, description=(
        "Each node's NIC, Gbit/s (one direction; a ring crosses it once in and once out). "
        "Default: the node's label cephalo.dev/nic-gbps on a cluster, else 10 (assumed). "
        "At most 100000."))
    inter_node_latency_microseconds: float | None = Field(
        default=None, ge=0, le=MAX_LATENCY_MICROSECONDS, description=(
            "Latency of one hop between two nodes (default 50; at most 10 s)."))
    intra_node_gbps: float | None = Field(default=None, gt=0, le=MAX_GBPS, description=(
        "GPU-to-GPU link inside a node (NVLink or PCIe), Gbit/s per GPU. Default 128 "
        "(PCIe 3.0 x16, assumed). At most 100000."))
    intra_node_latency_microseconds: float | None = Field(
        default=None, ge=0, le=MAX_LATENCY_MICROSECONDS, description=(
            "Latency of one hop between two GPUs of a node (default 10; at most 10 s)."))
    nodes: list[NodeGpus] | None = Field(default=None, max_length=256, description=(
        "Which GPUs share a node: used when the GPUs planned on are exactly these (e.g. "
        "cephalo plan --job: each pool's maxGpus); otherwise, and by default, every GPU on "
        "a node of its own (assumed). At most 256 entries."))
