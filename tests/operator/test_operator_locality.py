"""Which nodes share a switch or zone, from the labels the cluster publishes (issue 44 item
4): the operator's pools ordered and described by it (pure, operator/locality.py), and the
planner's replica groups of several nodes kept inside one domain."""

from __future__ import annotations

import time
from typing import Any

import pytest
from kube_fixtures import gpu_node

from cephalo.api import parse_job
from cephalo.operator.config import OperatorConfig
from cephalo.operator.discovery import discover_pools, select_cluster
from cephalo.operator.locality import DEFAULT_LOCALITY_LABELS, by_domain, shared_domain
from cephalo.planner import InfeasibleError, solve

ZONE, LEAF = "topology.kubernetes.io/zone", "network.topology.nvidia.com/leaf"


def _node(name: str, product: str, gpus: int = 8, **labels: str) -> dict[str, Any]:
    node = gpu_node(name, product, gpus)
    node["metadata"]["labels"].update(labels)
    return node


def test_a_pools_domain_is_what_all_its_nodes_share_outermost_first() -> None:
    nodes = {n["metadata"]["name"]: n for n in (
        _node("a", "T4", **{ZONE: "z1", LEAF: "s1"}), _node("b", "T4", **{ZONE: "z1", LEAF: "s1"}),
        _node("c", "T4", **{ZONE: "z1", LEAF: "s2"}), _node("d", "T4"))}
    assert shared_domain(["a", "b"], nodes, DEFAULT_LOCALITY_LABELS) == f"{ZONE}=z1/{LEAF}=s1"
    assert shared_domain(["a", "c"], nodes, DEFAULT_LOCALITY_LABELS) == f"{ZONE}=z1"
    # An unlabelled node: the pool's domain is not known at any level the others publish.
    assert shared_domain(["a", "d"], nodes, DEFAULT_LOCALITY_LABELS) is None
    assert shared_domain(["a"], nodes, [LEAF]) == f"{LEAF}=s1"
    assert shared_domain(["a"], nodes, []) is None
    assert by_domain([f"{ZONE}=z2", None, f"{ZONE}=z1/{LEAF}=s2", f"{ZONE}=z2",
                      f"{ZONE}=z1"]) == [4, 2, 0, 3, 1]


# Llama-7B's dimensions with 44 blocks (9.6 billion parameters): a replica group of one node
# of eight 16 GB GPUs cannot hold its share of the state (the fp32 weights and 1/G of the
# optimizer's, docs/hybrid-sharding.md) with four groups, a group of two nodes can with two.
BIG_LLAMA = {"family": "llama", "numLayers": 44, "hiddenSize": 4096, "numHeads": 32,
             "ffnHiddenSize": 11008, "vocabSize": 32000, "sequenceLength": 2048}


def _llama(**planner: Any):  # type: ignore[no-untyped-def]
    return parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                      "metadata": {"name": "t"}, "spec": {
                          "model": BIG_LLAMA, "globalBatchSize": 256,
                          "ranksPerPod": 0, "planner": {
                              "sharding": "hybrid", "chooseGpus": False,
                              "network": {"interNodeGbps": 10.0, "intraNodeGbps": 100.0},
                              **planner}}}).spec


# Four nodes of eight 16 GB GPUs: BIG_LLAMA needs two such nodes a replica group. By
# product the pools interleave the zones (P100 in a, T4 in b, V100 in a).
INTERLEAVED = [_node("p100-0", "Tesla-P100-PCIE-16GB", **{ZONE: "a"}),
               _node("t4-0", "Tesla-T4", **{ZONE: "b"}), _node("t4-1", "Tesla-T4", **{ZONE: "b"}),
               _node("v100-0", "Tesla-V100-SXM2-16GB", **{ZONE: "a"})]


def test_pools_are_ordered_by_zone_so_groups_of_two_nodes_stay_in_one() -> None:
    spec = _llama()
    cluster, pools = select_cluster(spec, discover_pools(INTERLEAVED), INTERLEAVED)
    assert [p.product for p in pools] == ["Tesla-P100-PCIE-16GB", "Tesla-V100-SXM2-16GB",
                                          "Tesla-T4"]
    assert cluster.nodes is not None
    assert [n.domain for n in cluster.nodes] == [f"{ZONE}=a", f"{ZONE}=a", f"{ZONE}=b",
                                                 f"{ZONE}=b"]
    started = time.monotonic()
    plan = solve(spec, cluster)
    zone_of = {r.rank: "a" if r.gpu in ("P100", "V100-16GB") else "b" for r in plan.ranks}
    assert [len(g) for g in plan.replica_groups] == [16, 16], plan.replica_groups
    assert [{zone_of[r] for r in g} for g in plan.replica_groups] == [{"a"}, {"b"}]
    print(f"planned in {time.monotonic() - started:.1f} s")


def test_a_group_of_nodes_is_never_formed_across_zones() -> None:
    """The same nodes with the zones as the product order has them (P100 and T4 in a, the
    other T4 and the V100 in b): the T4 pool spans both zones, so its pods' zone is unknown
    (either node may take either pod) and goes last; the P100 and the V100 are in different
    zones: no two pairs of nodes share a zone each, so hybrid is refused rather than a
    group formed across zones."""
    split = [_node("p100-0", "Tesla-P100-PCIE-16GB", **{ZONE: "a"}),
             _node("t4-0", "Tesla-T4", **{ZONE: "a"}), _node("t4-1", "Tesla-T4", **{ZONE: "b"}),
             _node("v100-0", "Tesla-V100-SXM2-16GB", **{ZONE: "b"})]
    spec = _llama()
    cluster, _ = select_cluster(spec, discover_pools(split), split)
    assert cluster.nodes is not None
    assert [n.domain for n in cluster.nodes] == [f"{ZONE}=a", f"{ZONE}=b", None, None]
    with pytest.raises(InfeasibleError, match="no replica groups of whole nodes"):
        solve(spec, cluster)
    # Without locality labels the operator knows no zones: groups form as before.
    blind, _ = select_cluster(spec, discover_pools(split), split, ())
    assert all(n.domain is None for n in blind.nodes or [])
    assert [len(g) for g in solve(spec, blind).replica_groups] == [16, 16]


def test_the_locality_labels_are_label_keys_checked_at_startup() -> None:
    assert OperatorConfig().locality_label_keys() == DEFAULT_LOCALITY_LABELS
    assert OperatorConfig.from_env({"CEPHALO_LOCALITY_LABELS": f"{LEAF}, {ZONE}"}) \
        .locality_label_keys() == (LEAF, ZONE)
    assert OperatorConfig.from_env({"CEPHALO_LOCALITY_LABELS": ""}).locality_label_keys() == ()
    with pytest.raises(ValueError, match="CEPHALO_LOCALITY_LABELS: 'zone=a' is not a node label"):
        OperatorConfig.from_env({"CEPHALO_LOCALITY_LABELS": "zone=a"})
