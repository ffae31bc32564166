"""The GPU-subset choice against brute force on a topology (issue 35): random small
instances whose GPUs sit on 1 to 3 random nodes (several products on one node too), with
random links (every intra-node link at least as fast as every NIC, with no more latency:
the condition under which packing a class onto its first nodes is optimal, subset.py).
The brute force solves every subset of the individual GPUs (up to GPUs of one product on
one node, which are identical) as a cluster of its own, with exactly the nodes it uses;
`solve` must find the least step time of all of them, exactly."""

from __future__ import annotations

import itertools
import os
import random

import pytest

from cephalo.api import ClusterSpec
from cephalo.api.cluster import ClusterNode
from cephalo.planner import InfeasibleError, solve

from .planner_instances import random_instance, with_min_gain
from .test_planner_oracle import brute_force

ORACLE_INSTANCES = int(os.environ.get("CEPHALO_ORACLE_INSTANCES", "150"))
GBIT = 1e9 / 8


def with_random_nodes(seed: int, cluster: ClusterSpec) -> ClusterSpec:
    """`cluster` with its GPUs dealt onto 1..3 nodes at random, each with its own links."""
    rng = random.Random(seed * 7919 + 1)
    gpus = [g.key for g in cluster.groups for _ in range(g.count)]
    rng.shuffle(gpus)
    num_nodes = rng.randint(1, min(3, len(gpus)))
    cuts = sorted(rng.sample(range(1, len(gpus)), num_nodes - 1))
    nodes = []
    slowest_intra = rng.choice([50.0, 200.0, 1000.0])
    for part in (gpus[a:b] for a, b in zip([0, *cuts], [*cuts, len(gpus)], strict=True)):
        held: dict[str, int] = {}
        for key in part:
            held[key] = held.get(key, 0) + 1
        nodes.append(ClusterNode(
            gpus=held,
            nic_bandwidth_bytes_per_second=rng.choice([0.01, 1.0, 25.0]) * GBIT,
            nic_latency_seconds=rng.choice([20e-6, 200e-6]),
            intra_bandwidth_bytes_per_second=slowest_intra * rng.choice([1, 4]) * GBIT,
            intra_latency_seconds=rng.choice([1e-6, 10e-6])))
    return cluster.model_copy(update={"nodes": nodes, "network_source": "test"})


def sub_clusters(cluster: ClusterSpec):
    """Every nonempty subset of the GPUs, up to identical ones (a product on one node), as
    a cluster of those GPUs on the nodes they use, in the same order."""
    assert cluster.nodes is not None
    slots = [(n, key, count) for n, node in enumerate(cluster.nodes)
             for key, count in node.gpus.items()]
    for counts in itertools.product(*(range(c + 1) for _, _, c in slots)):
        if not any(counts):
            continue
        nodes: dict[int, dict[str, int]] = {}
        for (n, key, _), k in zip(slots, counts, strict=True):
            if k:
                nodes.setdefault(n, {})[key] = k
        groups = []
        for group in cluster.groups:
            k = sum(held.get(group.key, 0) for held in nodes.values())
            if k:
                groups.append(group.model_copy(update={"count": k}))
        yield ClusterSpec(groups=groups, network_source="test", nodes=[
            cluster.nodes[n].model_copy(update={"gpus": held}) for n, held in nodes.items()])


def _check(seed: int) -> None:
    spec, flat, profiles = random_instance(seed, max_gpus=4, max_batch=6)
    # The flat networkBandwidthGbps would win over the nodes: the topology is the job's.
    # Flat sharding: this oracle is of the flat GPU-subset choice (hybrid and auto have
    # their own, tests/unit/test_hybrid_planner.py).
    planner = spec.planner.model_copy(update={"network_bandwidth_gbps": None,
                                              "sharding": "flat"})
    spec = with_min_gain(spec.model_copy(update={"planner": planner}), 0.0)
    cluster = with_random_nodes(seed, flat)
    found = [brute_force(spec, sub, profiles) for sub in sub_clusters(cluster)]
    finite = [f for f in found if f is not None]
    if not finite:
        with pytest.raises(InfeasibleError):
            solve(spec, cluster, profiles, choose_gpus=True)
        return
    plan = solve(spec, cluster, profiles, choose_gpus=True)
    assert plan.predicted_step_seconds == pytest.approx(min(finite), rel=1e-12), seed
    assert plan.search["exact"] is True and plan.optimality_gap_seconds == 0.0
    assert plan.assumptions["network_model"] == "topology"


_CHUNK = 50


@pytest.mark.parametrize("first", range(0, ORACLE_INSTANCES, _CHUNK))
def test_subset_choice_on_a_topology_matches_brute_force(first: int) -> None:
    failed = []
    for seed in range(20_000 + first, 20_000 + first + _CHUNK):
        try:
            _check(seed)
        except AssertionError as err:
            failed.append(f"seed {seed}: {str(err).splitlines()[0]}")
    assert not failed, f"{len(failed)} of {_CHUNK} instances disagree: " + "; ".join(failed)
