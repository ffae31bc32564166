"""The operator describes the network it plans over (issue 35, pure): the nodes its
discovery found, packed as `pack_ranks` will pack the ranks into pods, each with its
pool's NIC from the node label cephalo.dev/nic-gbps; the plan says where that came from."""

from __future__ import annotations

from typing import Any

from kube_fixtures import gpu_node

from cephalo.api import parse_job
from cephalo.api.network import NIC_GBPS_LABEL
from cephalo.operator.discovery import NETWORK_SOURCE, discover_pools, select_cluster
from cephalo.planner import solve

GBIT = 1e9 / 8


def _cluster_b(nic_gbps: str | None) -> list[dict[str, Any]]:
    nodes = []
    for name, product, count in (("a10g", "NVIDIA-A10G", 2), ("v100", "Tesla-V100-SXM2-16GB", 2),
                                 ("t4", "Tesla-T4", 4)):
        for i in range(count):
            node = gpu_node(f"{name}-{i}", product, 8)
            if nic_gbps is not None:
                node["metadata"]["labels"][NIC_GBPS_LABEL] = nic_gbps
            nodes.append(node)
    return nodes


def _spec(ranks_per_pod: int = 0, **planner: Any):  # type: ignore[no-untyped-def]
    return parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                      "metadata": {"name": "t"}, "spec": {
                          "model": {"preset": "gpt-2.7b"}, "globalBatchSize": 256,
                          "ranksPerPod": ranks_per_pod, "planner": planner}}).spec


def test_labelled_nics_describe_cluster_b_and_the_plan_uses_every_gpu_type() -> None:
    nodes = _cluster_b("100")
    cluster, _ = select_cluster(_spec(), discover_pools(nodes), nodes)
    assert cluster.network_source == NETWORK_SOURCE
    assert cluster.nodes is not None
    assert [(n.gpus, n.nic_bandwidth_bytes_per_second, n.nic_share) for n in cluster.nodes] == \
        [({"NVIDIA-A10G": 8}, 100 * GBIT, 1.0)] * 2 + \
        [({"Tesla-T4": 8}, 100 * GBIT, 1.0)] * 4 + \
        [({"Tesla-V100-SXM2-16GB": 8}, 100 * GBIT, 1.0)] * 2
    plan = solve(_spec(network={"intraNodeGbps": 128.0}), cluster)
    assert {r.gpu for r in plan.ranks} == {"A10G", "V100-16GB", "T4"}
    # The placement and NICs are the operator's, the intra-node link the job's.
    assert plan.assumptions["network_source"] == f"{NETWORK_SOURCE} + job spec"
    assert plan.assumptions["network_nodes"] == 8


def test_unlabelled_nodes_leave_the_nic_assumed() -> None:
    nodes = _cluster_b(None)
    cluster, _ = select_cluster(_spec(), discover_pools(nodes), nodes)
    assert cluster.nodes is not None
    assert all(n.nic_bandwidth_bytes_per_second is None for n in cluster.nodes)
    plan = solve(_spec(), cluster)
    assert plan.assumptions["network_source"] == "assumed"
    # The job's own figure wins over the labels, and says so.
    labelled = _cluster_b("100")
    cluster, _ = select_cluster(_spec(), discover_pools(labelled), labelled)
    pinned = solve(_spec(network={"interNodeGbps": 1.0, "intraNodeGbps": 128.0}), cluster)
    assert pinned.assumptions["network_source"] == f"{NETWORK_SOURCE} + job spec"
    assert pinned.assumptions["network_nodes"] == 1  # 1 Gbit/s: one node's PCIe only


def test_one_rank_per_pod_shares_the_nodes_nic() -> None:
    """ranksPerPod 1: a node's eight pods may all land on it and the ring then crosses its
    NIC once per pod: each gets an eighth of it."""
    nodes = _cluster_b("100")
    cluster, _ = select_cluster(_spec(ranks_per_pod=1), discover_pools(nodes), nodes)
    assert cluster.nodes is not None and len(cluster.nodes) == 64
    assert {(n.nic_share, sum(n.gpus.values())) for n in cluster.nodes} == {(1 / 8, 1)}
    packed, _ = select_cluster(_spec(ranks_per_pod=4), discover_pools(nodes), nodes)
    assert packed.nodes is not None
    assert {(n.nic_share, sum(n.gpus.values())) for n in packed.nodes} == {(0.5, 4)}


def test_a_bad_label_is_not_a_speed() -> None:
    nodes = _cluster_b("fast")
    cluster, _ = select_cluster(_spec(), discover_pools(nodes), nodes)
    assert cluster.nodes is not None
    assert all(n.nic_bandwidth_bytes_per_second is None for n in cluster.nodes)
