"""Hybrid sharding in the planner (issue 44): the spec field, the pricing against the
issue's formulas, the layout search against brute force, flat kept as it was, the printed
plan, and the predicted targets on the paper's Cluster B."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import random
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from cephalo.api import ClusterSpec, parse_job
from cephalo.api.cluster import ClusterNode
from cephalo.api.crd import open_api_v3_schema
from cephalo.api.job import CephaloJobSpec, JobFileError
from cephalo.commands.plan import pools_as_cluster
from cephalo.planner import InfeasibleError, solve
from cephalo.planner.outputs.report import format_plan
from cephalo.planner.search.hybrid import Layout, hybrid_unit_comm, link_bytes_per_step
from cephalo.planner.search.hybrid_search import (
    HYBRID_MIN_GAIN,
    REPLICATED_FRACTIONS,
    hybrid_must_beat,
)
from cephalo.planner.search.problem import Problem, build_problem, layout_problem

from .planner_brute import brute_force_seconds
from .planner_instances import random_instance, with_min_gain
from .test_planner_oracle import brute_force, expected_step

ROOT = Path(__file__).resolve().parents[2]
GBIT = 1e9 / 8
ORACLE_INSTANCES = int(os.environ.get("CEPHALO_ORACLE_INSTANCES", "150"))


def _with_sharding(spec: CephaloJobSpec, sharding: str) -> CephaloJobSpec:
    return spec.model_copy(update={"planner": spec.planner.model_copy(
        update={"sharding": sharding})})


def _bench_module() -> ModuleType:
    """bench/hybrid_sharding.py, whose job builder the docs' table is generated with."""
    found = importlib.util.spec_from_file_location(
        "bench_hybrid_sharding", ROOT / "bench" / "hybrid_sharding.py")
    assert found is not None and found.loader is not None
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


_BENCH = _bench_module()


def cluster_b(preset: str, batch: int, gbps: float, sharding: str = "auto") -> CephaloJobSpec:
    """The issue's job: examples/llama-7b-cluster-b.yaml with this model and batch,
    precision auto, bf16 gathers and reduce-scatters, every NIC at `gbps` (the bench's)."""
    spec: CephaloJobSpec = _BENCH.job(preset, batch, gbps, sharding)
    return spec


# --- the spec field ------------------------------------------------------------------

def test_sharding_defaults_to_auto_and_the_crd_lists_the_three_values() -> None:
    spec = cluster_b("gpt-2.7b", 512, 100)
    assert _with_sharding(spec, "auto").planner.sharding == "auto"
    field = open_api_v3_schema()["properties"]["spec"]["properties"]["planner"][
        "properties"]["sharding"]
    assert field["enum"] == ["auto", "flat", "hybrid"] and field["default"] == "auto"


def test_an_unknown_sharding_is_refused_in_one_line() -> None:
    wire = cluster_b("gpt-2.7b", 512, 100).to_wire()
    wire["planner"]["sharding"] = "ring"
    with pytest.raises(JobFileError) as err:
        parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                   "metadata": {"name": "b"}, "spec": wire})
    assert "sharding" in str(err.value) and "\n" not in str(err.value)


# --- pricing -------------------------------------------------------------------------

def _two_nodes_problem(nic_gbps: float = 10.0, per_node: int = 2,
                       gather: str = "bf16") -> Problem:
    wire = cluster_b("gpt-2.7b", 8, nic_gbps).to_wire()
    wire["gpuPools"] = [{"product": "NVIDIA-A10G", "maxGpus": 2 * per_node}]
    wire["gatherPrecision"] = gather
    wire["planner"]["network"] = {"interNodeGbps": nic_gbps, "intraNodeGbps": 256,
                                  "nodes": [{"gpus": {"NVIDIA-A10G": per_node}, "count": 2}]}
    spec = parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                      "metadata": {"name": "b"}, "spec": wire}).spec
    return build_problem(spec, pools_as_cluster(spec))


def test_hybrid_collectives_are_the_group_ring_plus_the_cross_group_halves() -> None:
    """Two nodes of two A10Gs, a group per node, fp32 gathers and bf16 reduce-scatters:
    the group's gathers and reduce-scatters on the intra-node link alone; each gradient's
    cross-group reduce-scatter of the slice, (G-1)/G of a unit's gradient bytes per node
    NIC, on a link of its own (beside the group's); each forward gather after the
    cross-group all-gather of the piece, (G-1)/G of the parameter bytes, pipelined with the
    group's gathers (the slower of the two) and the first unit's exposed; AdamW on
    P / (k G)."""
    problem = _two_nodes_problem(gather="fp32")
    assert problem.network is not None and problem.topology is not None
    links = problem.topology.nodes[0]
    model = problem.model
    groups = [[0, 1], [2, 3]]
    comm = hybrid_unit_comm(model, problem.network.base, problem.topology,
                            problem.rank_node, groups)
    block, embedding, head = (model.block_parameters(), model.embedding_parameters(),
                              model.head_parameters())
    gathered, reduced = 4, 2  # fp32, bf16 bytes per parameter

    # Ring of 2 on the intra-node link: (n-1)/n of the bytes, (n-1) hops of latency.
    def inside(params: int, wire: int) -> float:
        return 0.5 * params * wire / links.intra_bandwidth_bytes_per_second + \
            links.intra_latency_seconds

    # G = 2 groups, all of a group on one node: each NIC carries (G-1)/G = 1/2 of the
    # unit's bytes, (G-1) = 1 hop of latency.
    def across(params: int, wire: int, share: float = 1.0) -> float:
        return 0.5 * params * wire * share / links.nic_bandwidth_bytes_per_second + \
            links.nic_latency_seconds

    assert comm.ag_block == pytest.approx(inside(block, gathered), rel=1e-12)
    assert comm.rs_block == pytest.approx(inside(block, reduced), rel=1e-12)
    assert comm.cross_rs_block == pytest.approx(across(block, reduced), rel=1e-12)
    assert comm.rs_other == pytest.approx(inside(embedding, reduced) + inside(head, reduced),
                                          rel=1e-12)
    assert comm.cross_rs_other == pytest.approx(across(head, reduced), rel=1e-12)
    # The embedding's comes after the whole backward (the engine's last): exposed.
    assert comm.cross_rs_last == pytest.approx(across(embedding, reduced), rel=1e-12)
    assert comm.cross_own_link  # each group one node: its rings never cross a NIC
    # 10 Gbit/s NICs against a 256 Gbit/s link: the cross all-gather is the slower stage.
    assert across(block, gathered) > inside(block, gathered)
    assert comm.ag_block + comm.cross_ag_block == pytest.approx(across(block, gathered),
                                                                rel=1e-12)
    assert comm.ag_head == pytest.approx(max(inside(head, gathered), across(head, gathered)),
                                         rel=1e-12)
    assert comm.cross_ag_first == pytest.approx(across(embedding, gathered), rel=1e-12)
    assert comm.ag_first == pytest.approx(inside(embedding, gathered), rel=1e-12)
    assert comm.state_share_parameters == model.total_parameters() / 4
    # A group of two nodes (one GPU of each): its ring crosses both NICs, which its cross
    # all-gathers then share (each NIC carries one position's, half a group's): a forward
    # gather waits both, one after the other.
    crossing = hybrid_unit_comm(model, problem.network.base, problem.topology,
                                problem.rank_node, [[0, 2], [1, 3]])
    assert crossing.ag_block > comm.ag_block
    assert crossing.cross_ag_block == pytest.approx(across(block, gathered, 0.5), rel=1e-12)
    assert crossing.cross_rs_block == pytest.approx(across(block, reduced, 0.5), rel=1e-12)
    assert not crossing.cross_own_link


def test_the_step_charges_the_cross_all_gather_to_the_forward_only() -> None:
    """T(l, m) with the cross-group all-gathers against without them: each of the L
    blocks' forward pays max(f, AG + X) for max(f, AG) (perfect overlap), and the first
    unit's X is exposed; the backward's gathers and the head's are unchanged."""
    import numpy as np

    from cephalo.planner.cost.comm_model import UnitComm
    problem = _two_nodes_problem()
    cost = problem.rank_cost(0)
    plain = UnitComm(ag_block=0.001, rs_block=0.02, ag_first=0.03, ag_head=0.04,
                     rs_other=0.05, state_share_parameters=1e6)
    crossed = UnitComm(ag_block=0.001, rs_block=0.02, ag_first=0.03, ag_head=0.04,
                       rs_other=0.05, state_share_parameters=1e6, cross_ag_block=0.5,
                       cross_ag_first=0.25)
    ell, m = np.array([1]), np.array([1])
    f = float(cost.compute_seconds(m)[0, 0])  # one block's forward of one microbatch
    assert 0.001 < f < 0.501  # the forward hides its gather alone, not with the cross one
    extra = float(cost.step_seconds(ell, m, crossed)[0] - cost.step_seconds(ell, m, plain)[0])
    layers = problem.model.num_layers
    assert extra == pytest.approx(layers * (max(f, 0.501) - max(f, 0.001)) + 0.25, rel=1e-9)


@pytest.mark.parametrize("fraction", REPLICATED_FRACTIONS)
def test_the_replicated_fraction_moves_bytes_from_the_forward_to_the_backward(
        fraction: float) -> None:
    """Replicated fraction a: each unit's cross-group bytes under the backward are (1 + a)
    times the reduce-scatter's (a reduce-scatter of 1 - a, an all-reduce of a: 2 (G-1)/G of
    it, 2 (G-1) hops), under the next forward (1 - a) times the all-gather's (none at all
    for a = 1); every rank's AdamW updates P / (k G) (1 - a) + P / k a parameters; the
    group's own collectives are unchanged. a = 0 is the plan before the fraction, exactly."""
    problem = _two_nodes_problem(gather="fp32")
    assert problem.network is not None and problem.topology is not None
    links = problem.topology.nodes[0]
    model = problem.model
    groups = [[0, 1], [2, 3]]
    base = hybrid_unit_comm(model, problem.network.base, problem.topology, problem.rank_node,
                            groups)
    comm = hybrid_unit_comm(model, problem.network.base, problem.topology, problem.rank_node,
                            groups, replicated_fraction=fraction)
    a, nic, hop = fraction, links.nic_bandwidth_bytes_per_second, links.nic_latency_seconds
    block, embedding = model.block_parameters(), model.embedding_parameters()
    gathered, reduced = 4, 2  # fp32, bf16 bytes per parameter
    # G = 2: (G-1)/G = 1/2 of a unit's bytes per NIC a pass, G - 1 = 1 hop a ring.
    backward = (1 + a) * 0.5 * block * reduced / nic + ((a < 1) + 2 * (a > 0)) * hop
    forward = (1 - a) * 0.5 * block * gathered / nic + (a < 1) * hop
    assert comm.cross_rs_block == pytest.approx(backward, rel=1e-12)
    assert comm.ag_block + comm.cross_ag_block == pytest.approx(
        max(base.ag_block, forward), rel=1e-12)
    assert comm.cross_ag_first == pytest.approx(
        (1 - a) * 0.5 * embedding * gathered / nic + (a < 1) * hop, rel=1e-12)
    for name in ("ag_block", "rs_block", "ag_first", "rs_other", "all_reduce_seconds"):
        assert getattr(comm, name) == getattr(base, name), name
    params = model.total_parameters()
    assert comm.state_share_parameters == pytest.approx(
        params / 4 * (1 - a) + params / 2 * a, rel=1e-12)
    if a == 0:
        assert comm == base  # the default is the plan without the fraction, to the bit
    if a == 1:
        assert comm.cross_ag_block == comm.cross_ag_first == 0.0


def test_a_blocks_backward_waits_the_slower_of_its_group_and_cross_collectives() -> None:
    """T(l, m) with a cross-group collective X under each backward, against without: where
    it rides a link of its own (every group one node), a block's backward waits
    max(b, max(AG + RS, X)), where it shares the NICs with the group's ring
    max(b, AG + RS + X); the same for the embedding and head's term, for kept blocks (no
    recompute, still a gather), and without recompute (no gather). Silent: none of it."""
    import numpy as np

    from cephalo.planner.cost.comm_model import UnitComm
    from cephalo.planner.search.problem import without_recompute
    problem = _two_nodes_problem()
    plain = UnitComm(ag_block=0.001, rs_block=0.02, ag_first=0.03, ag_head=0.04,
                     rs_other=0.05, state_share_parameters=1e6)
    layers = problem.model.num_layers
    ell, m = np.array([1]), np.array([1])
    for own in (True, False):
        crossed = dataclasses.replace(plain, cross_rs_block=0.5, cross_rs_other=0.25,
                                      cross_own_link=own)

        def waits(ag: float, rs: float, cross: float, own: bool = own) -> float:
            return max(ag + rs, cross) if own else ag + rs + cross

        for cost in (problem.rank_cost(0), without_recompute(problem).rank_cost(0)):
            f, b, _, bo = (float(x) for x in cost.compute_seconds(m)[:, 0])
            ag = 0.001 if cost.recompute else 0.0  # no recompute: the backward gathers none
            ag_first = 0.03 if cost.recompute else 0.0
            if not cost.recompute:
                b = max(b - f, 0.0)
            extra = float(cost.step_seconds(ell, m, crossed)[0] -
                          cost.step_seconds(ell, m, plain)[0])
            assert extra == pytest.approx(
                layers * (max(b, waits(ag, 0.02, 0.5)) - max(b, ag + 0.02)) +
                max(bo, waits(ag_first, 0.05, 0.25)) - max(bo, ag_first + 0.05),
                rel=1e-9, abs=1e-12), (own, cost.recompute)
            silent = cost.step_seconds(ell, m, crossed.silent())
            assert silent == cost.step_seconds(ell, m, plain.silent())
        # The embedding's cross-group collective, started after the whole backward: exposed
        # in full, whatever the compute.
        last = dataclasses.replace(crossed, cross_rs_last=0.3)
        for cost in (problem.rank_cost(0), without_recompute(problem).rank_cost(0)):
            assert float(cost.step_seconds(ell, m, last)[0] -
                         cost.step_seconds(ell, m, crossed)[0]) == pytest.approx(0.3,
                                                                                 rel=1e-12)
            assert cost.step_seconds(ell, m, last.silent()) == \
                cost.step_seconds(ell, m, plain.silent())
        # One kept block: its backward skips the recompute, not the gather.
        cost = problem.rank_cost(0)
        f, b, _, _ = (float(x) for x in cost.compute_seconds(m)[:, 0])
        kept = np.array([1])
        extra = float(cost.step_seconds(ell, m, crossed, kept)[0] -
                      cost.step_seconds(ell, m, plain, kept)[0]) - float(
            cost.step_seconds(ell, m, crossed)[0] - cost.step_seconds(ell, m, plain)[0])
        # The kept block's term replaces one recomputed block's.
        b_kept = max(b - f, 0.0)
        assert extra == pytest.approx(
            (max(b_kept, waits(0.001, 0.02, 0.5)) - max(b_kept, 0.021)) -
            (max(b, waits(0.001, 0.02, 0.5)) - max(b, 0.021)), rel=1e-9, abs=1e-12), own


def test_a_group_holds_the_slices_and_one_gth_of_the_optimizer_state() -> None:
    """Memory under hybrid (docs/hybrid-sharding.md): per parameter a group holds 4 bytes
    of slice weights and 16 / G of master, moments and piece gradient, plus the slice
    gradient of the largest unit while it is reduced across groups; G = 1 is flat's."""
    from cephalo.api.memory import hybrid_state_bytes, state_bytes
    from cephalo.planner.search.hybrid import group_state_bytes
    assert hybrid_state_bytes(1000, 1, "bf16") == state_bytes(1000, "bf16") == 16_000
    assert hybrid_state_bytes(1000, 4, "auto") == 4_000 + 16_000 / 4
    problem = _two_nodes_problem()
    model = problem.model
    params, largest = model.total_parameters(), max(model.unit_parameters())
    assert group_state_bytes(model, "auto", 8) == pytest.approx(
        4 * params + 16 * params / 8 + 4 * largest, rel=1e-12)
    assert group_state_bytes(model, "auto", 1) == 16 * params
    # A replicated fraction a: its optimizer state whole in every group, 16 a + 16 (1-a)/G.
    assert group_state_bytes(model, "auto", 8, 0.5) == pytest.approx(
        4 * params + 16 * params * (0.5 + 0.5 / 8) + 4 * largest, rel=1e-12)
    half = layout_problem(problem, Layout(((0, 1), (2, 3)), 1, replicated_fraction=0.5))
    assert half.replicated_fraction == 0.5
    assert half.state_bytes == pytest.approx(4 * params + 12 * params + 4 * largest, rel=1e-12)
    two = layout_problem(problem, Layout(((0, 1), (2, 3)), 1))
    assert two.state_bytes == pytest.approx(4 * params + 8 * params + 4 * largest, rel=1e-12)
    # A plan's ranks hold the group's state evenly (1/k) next to their compute memory.
    spec = _with_sharding(cluster_b("gpt-2.7b", 8, 10), "hybrid")
    wire = spec.to_wire()
    wire["gpuPools"] = [{"product": "NVIDIA-A10G", "maxGpus": 8}]
    wire["planner"]["network"] = {"interNodeGbps": 10, "intraNodeGbps": 256,
                                  "nodes": [{"gpus": {"NVIDIA-A10G": 4}, "count": 2}]}
    spec = parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                      "metadata": {"name": "b"}, "spec": wire}).spec
    plan = solve(spec, pools_as_cluster(spec), choose_gpus=False)
    assert plan.replica_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for r in plan.ranks:
        assert r.predicted_memory_bytes - r.compute_memory_bytes == pytest.approx(
            (4 * params + 8 * params + 4 * largest) / 4, abs=2)
    assert plan.state_bytes == 16 * params  # the whole model's, as for flat plans


def test_link_bytes_follow_the_issue_formulas() -> None:
    """Flat over 2 nodes of 2: each collective moves 3/4 of the bytes over every link;
    hybrid per node: 1/2 on the intra-node link, and on the NIC (G-1)/G of the gradient
    (reduce-scatter) and of the parameters (all-gather)."""
    problem = _two_nodes_problem()
    model, params = problem.model, problem.model.total_parameters()
    flat = link_bytes_per_step(model, 4, 2, problem.rank_node, [], 0)
    assert flat.intra_node_link_per_gpu == flat.nic_per_node == \
        pytest.approx(0.75 * (params * 4 + params * 2))
    hybrid = link_bytes_per_step(model, 4, 2, problem.rank_node, [[0, 1], [2, 3]], params)
    assert hybrid.intra_node_link_per_gpu == pytest.approx(0.5 * (2 * params * 4 + params * 2))
    assert hybrid.nic_per_node == pytest.approx(0.5 * params * (2 + 4))


# --- the search against brute force -----------------------------------------------------

def _every_layout(problem: Problem):
    """Every way to put whole nodes of one size into groups of d consecutive nodes (any
    subset of the nodes, not only the first of each kind as the planner takes them)."""
    nodes: dict[int, list[int]] = {}
    for rank, node in enumerate(problem.rank_node):
        nodes.setdefault(node, []).append(rank)
    order = sorted(nodes, key=lambda n: nodes[n][0])
    for size in range(2, len(order) + 1):
        for chosen in itertools.combinations(order, size):
            if len({len(nodes[n]) for n in chosen}) != 1:
                continue
            for d in range(1, size // 2 + 1):
                if size % d == 0:
                    yield Layout(tuple(tuple(r for n in chosen[i:i + d] for r in nodes[n])
                                       for i in range(0, size, d)), d)


def _modes(problem: Problem) -> list[Problem]:
    from cephalo.planner.search.problem import fused_everything, without_recompute
    fused = fused_everything(problem)
    return [problem, *([] if fused is None else [fused]), without_recompute(problem)]


def _hybrid_brute_force(spec: CephaloJobSpec, cluster: ClusterSpec,
                        profiles) -> tuple[float | None, float | None]:
    """The least step time over every layout at every replicated fraction of the grid,
    and over the layouts on every GPU (None: none fits), from one search of each in each
    mode."""
    problem = build_problem(spec, cluster, profiles)
    found = [(brute_force_seconds(layout_problem(
                mode, dataclasses.replace(layout, replicated_fraction=fraction))),
              len(layout.ranks) == problem.world_size)
             for layout in _every_layout(problem) for mode in _modes(problem)
             for fraction in REPLICATED_FRACTIONS]
    return (min((f for f, _ in found if f is not None), default=None),
            min((f for f, every in found if f is not None and every), default=None))


def _with_nodes(seed: int, cluster: ClusterSpec) -> ClusterSpec:
    """The instance's GPUs on nodes of one or two GPUs (the last may hold fewer), each
    node with random links: 2 to 4 nodes, so that layouts of 2 to 4 groups and groups of
    two nodes exist."""
    rng = random.Random(seed * 31 + 7)
    gpus = [g.key for g in cluster.groups for _ in range(g.count)]
    rng.shuffle(gpus)
    per = rng.choice([1, 1, 2]) if len(gpus) > 2 else 1  # 2 to 4 nodes
    nodes = []
    for i in range(0, len(gpus), per):
        held: dict[str, int] = {}
        for key in gpus[i:i + per]:
            held[key] = held.get(key, 0) + 1
        nodes.append(ClusterNode(
            gpus=held, nic_bandwidth_bytes_per_second=rng.choice([0.01, 1.0, 25.0]) * GBIT,
            nic_latency_seconds=rng.choice([20e-6, 200e-6]),
            intra_bandwidth_bytes_per_second=rng.choice([50.0, 1000.0]) * GBIT,
            intra_latency_seconds=rng.choice([1e-6, 10e-6])))
    return cluster.model_copy(update={"nodes": nodes, "network_source": "test"})


def _instance(seed: int) -> tuple[CephaloJobSpec, ClusterSpec, Any]:
    spec, flat, profiles = random_instance(seed, max_gpus=4, max_batch=6)
    planner = spec.planner.model_copy(update={"network_bandwidth_gbps": None})
    spec = with_min_gain(spec.model_copy(update={"planner": planner}), 0.0)
    if sum(g.count for g in flat.groups) < 2:
        flat = flat.model_copy(update={"groups": [flat.groups[0].model_copy(
            update={"count": 2})]})
    return spec, _with_nodes(seed, flat), profiles


def _check(seed: int) -> bool:
    """hybrid = the brute-force optimum over every layout; auto = the faster of it and
    flat's over every subset. True when some layout fits (the check was not vacuous)."""
    spec, cluster, profiles = _instance(seed)
    hybrid, hybrid_every_gpu = _hybrid_brute_force(spec, cluster, profiles)
    if hybrid is None:
        with pytest.raises(InfeasibleError):
            solve(_with_sharding(spec, "hybrid"), cluster, profiles, choose_gpus=True)
    else:
        plan = solve(_with_sharding(spec, "hybrid"), cluster, profiles, choose_gpus=True)
        assert plan.predicted_step_seconds == pytest.approx(hybrid, rel=1e-12), seed
        assert plan.replica_groups and plan.search["exact"] is True
    assert cluster.nodes is not None
    # Keyed by the subset as the planner reads it: the subset of every GPU is the cluster
    # itself, searched once for both uses below (a third of this test's brute force).
    flat_by_gpus = {sub.model_dump_json(): brute_force(spec, sub, profiles)
                    for sub in sub_clusters_on_nodes(cluster)}
    flat = [f for f in flat_by_gpus.values() if f is not None]
    best = _auto_pick(min(flat, default=None), hybrid)
    if best is not None:
        auto = solve(spec, cluster, profiles, choose_gpus=True)
        assert auto.predicted_step_seconds == pytest.approx(best, rel=1e-12), seed
        assert bool(auto.replica_groups) == (best == hybrid and (
            not flat or hybrid < hybrid_must_beat(min(flat)))), seed
        # planner.minGainToIdleGpus: every GPU (flat or hybrid, as auto picks between
        # them) unless fewer are more than 5 % faster.
        whole_key = cluster.model_dump_json()
        whole_flat = flat_by_gpus[whole_key] if whole_key in flat_by_gpus \
            else brute_force(spec, cluster, profiles)
        whole = _auto_pick(whole_flat, hybrid_every_gpu)
        margin = solve(with_min_gain(spec, 0.05), cluster, profiles, choose_gpus=True)
        assert margin.predicted_step_seconds == pytest.approx(
            expected_step(best, whole, 0.05), rel=1e-12), seed
    return hybrid is not None


def _auto_pick(flat: float | None, hybrid: float | None) -> float | None:
    """The step `sharding: auto` keeps: hybrid where it fits and flat does not, or where it
    is predicted HYBRID_MIN_GAIN faster than flat; else flat."""
    if hybrid is not None and (flat is None or hybrid < hybrid_must_beat(flat)):
        return hybrid
    return flat


def sub_clusters_on_nodes(cluster: ClusterSpec):
    from .test_planner_oracle_topology import sub_clusters as on_nodes
    return on_nodes(cluster)


_CHUNK = 50


@pytest.mark.parametrize("first", range(0, ORACLE_INSTANCES, _CHUNK))
def test_hybrid_and_auto_match_brute_force_on_small_instances(first: int) -> None:
    failed, fitted = [], 0
    for seed in range(40_000 + first, 40_000 + first + _CHUNK):
        try:
            fitted += _check(seed)
        except AssertionError as err:
            failed.append(f"seed {seed}: {str(err).splitlines()[0]}")
    assert not failed, f"{len(failed)} of {_CHUNK} instances disagree: " + "; ".join(failed)
    assert fitted >= _CHUNK // 5  # enough instances with a hybrid layout to mean something


# --- flat as it was; the forced and automatic choices ----------------------------------------

def test_flat_is_the_auto_plan_without_the_sharding_record_where_flat_wins() -> None:
    auto = solve(cluster_b("gpt-2.7b", 512, 100), pools_as_cluster(cluster_b("gpt-2.7b", 512,
                                                                              100)))
    flat_spec = cluster_b("gpt-2.7b", 512, 100, "flat")
    flat = solve(flat_spec, pools_as_cluster(flat_spec))
    assert not auto.replica_groups and auto.assumptions["sharding"] == "flat"
    assert "sharding" not in flat.assumptions and "replica_groups" not in flat.to_json()
    for key in ("sharding", "sharding_reason", "link_bytes_per_step"):
        auto.assumptions.pop(key)
    assert auto.to_json() == flat.to_json()


def test_auto_keeps_flat_where_hybrid_gains_less_than_the_margin() -> None:
    """Llama-7B on Cluster B at 25 Gbit/s: hybrid is predicted a little faster than flat,
    less than HYBRID_MIN_GAIN (5 %): auto keeps flat and says why."""
    spec = cluster_b("llama-7b", 1024, 25)
    cluster = pools_as_cluster(spec)
    flat = solve(_with_sharding(spec, "flat"), cluster).predicted_step_seconds
    hybrid = solve(_with_sharding(spec, "hybrid"), cluster).predicted_step_seconds
    assert flat is not None and hybrid is not None
    assert flat / (1 + HYBRID_MIN_GAIN) <= hybrid < flat
    auto = solve(spec, cluster)
    assert not auto.replica_groups and auto.predicted_step_seconds == flat
    reason = auto.assumptions["sharding_reason"]
    assert f"predicted at least {HYBRID_MIN_GAIN:.0%} faster" in reason


def test_hybrid_is_refused_in_one_line_where_no_group_can_form() -> None:
    spec = _with_sharding(cluster_b("gpt-2.7b", 512, 10), "hybrid")
    one_node = spec.model_copy(update={"gpu_pools": spec.gpu_pools[1:2]})
    wire = one_node.to_wire()
    wire["planner"]["network"]["nodes"] = [{"gpus": {"NVIDIA-A10G": 16}}]
    one_node = parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                          "metadata": {"name": "b"}, "spec": wire}).spec
    with pytest.raises(InfeasibleError, match=r"planner\.sharding: hybrid needs") as err:
        solve(one_node, pools_as_cluster(one_node))
    assert "\n" not in str(err.value)


def test_without_choosing_gpus_hybrid_groups_every_gpu() -> None:
    spec = cluster_b("gpt-2.7b", 512, 10, "hybrid")
    plan = solve(spec, pools_as_cluster(spec), choose_gpus=False)
    assert plan.world_size == 64 and not plan.idle_gpus
    assert sorted(r for g in plan.replica_groups for r in g) == list(range(64))


def test_llama_7b_fits_a_16_gb_node_a_group_from_three_groups_on() -> None:
    """Llama-7B on 8 x 16 GB nodes (80 % of memory): a rank of a one-node group holds
    (4 P + 16 P / G + 4 U) / 8 bytes of state (U: the largest unit), 9.5 GiB for G = 2, too
    much next to its least compute memory (4.0 GiB) on a V100 or T4, 7.4 GiB for G = 3, not.
    The planner's quick test agrees on every such layout, and at 10 Gbit/s hybrid groups
    every node on its own (8 groups of 8, all 64 GPUs) within every GPU's memory."""
    import numpy as np

    from cephalo.planner.search.hybrid import layouts
    from cephalo.planner.search.hybrid_search import _holds_state
    spec = cluster_b("llama-7b", 1024, 10, "hybrid")
    problem = build_problem(spec, pools_as_cluster(spec))
    params = problem.model.total_parameters()
    largest = max(problem.model.unit_parameters())
    least = min(float(c.cost.compute_memory_bytes(np.array([0]))[0]) for c in problem.classes)
    sixteen = min(c.budget_bytes for c in problem.classes)  # the T4's 80 % of 15 GiB
    checked = set()
    for layout in layouts(problem)[0]:
        if layout.nodes_per_group != 1:
            continue
        sub = layout_problem(problem, layout)
        num = len(layout.groups)
        per_rank = (4 * params + 16 * params / num + 4 * largest) / 8
        assert sub.state_bytes / 8 == pytest.approx(per_rank, rel=1e-12)
        small = {problem.ranks[r][0] for r in layout.ranks} != {"A10G"}
        if small:
            assert _holds_state(sub) == (per_rank + least <= sixteen), num
            checked.add((num, _holds_state(sub)))
    assert (2, False) in checked and (3, True) in checked
    plan = solve(spec, pools_as_cluster(spec))
    assert plan.world_size == 64 and len(plan.replica_groups) == 8
    for r in plan.ranks:
        assert r.predicted_memory_bytes <= r.memory_capacity_bytes * 0.8 * (1 + 1e-9)
        assert r.shard_ratio == pytest.approx(1 / 8)


def test_the_printed_plan_shows_the_groups_the_choice_and_each_links_bytes() -> None:
    spec = cluster_b("gpt-2.7b", 512, 10)
    plan = solve(spec, pools_as_cluster(spec))
    text = format_plan(plan, "gpt-2.7b")
    assert plan.replica_groups and plan.assumptions["sharding"] == "hybrid"
    assert f"sharding: hybrid, {len(plan.replica_groups)} replica groups" in text
    assert "bytes per step: intra-node link" in text and "NIC" in text
    assert plan.assumptions["sharding_reason"] in text
    # Each group holds 4 bytes of weights and 16 (a + (1 - a) / G) of optimizer state per
    # parameter (a: the replicated fraction, which the sharding line names).
    a = plan.replicated_fraction
    assert a, "the case: a plan that keeps part of the state in every group"
    per_parameter = 4 + 16 * (a + (1 - a) / len(plan.replica_groups))
    assert f"{per_parameter:g} bytes of training state per parameter in each replica " \
        "group" in text
    kept = f"{a * 100:g} % of each slice's optimizer state kept in every group"
    sharding_line = next(line for line in text.splitlines() if line.startswith("sharding:"))
    assert sharding_line.endswith(f"; {kept}") and kept in plan.assumptions["sharding_reason"]


# --- the issue's targets (predictions: deterministic) --------------------------------------

# The issue's table (today's planner, flat): GPT-2.7B at B = 512 on Cluster B at 10 Gbit/s.
FLAT_10_GBIT_SAMPLES_PER_SECOND = 41.5


def test_targets_at_100_gbit_never_below_flat_and_at_10_gbit_beyond_1_5x() -> None:
    flat_100 = solve(cluster_b("gpt-2.7b", 512, 100, "flat"),
                     pools_as_cluster(cluster_b("gpt-2.7b", 512, 100)))
    auto_100 = solve(cluster_b("gpt-2.7b", 512, 100),
                     pools_as_cluster(cluster_b("gpt-2.7b", 512, 100)))
    assert auto_100.predicted_samples_per_second >= flat_100.predicted_samples_per_second
    auto_10 = solve(cluster_b("gpt-2.7b", 512, 10),
                    pools_as_cluster(cluster_b("gpt-2.7b", 512, 10)))
    assert auto_10.predicted_samples_per_second >= 1.5 * FLAT_10_GBIT_SAMPLES_PER_SECOND


def test_target_at_25_gbit_0_75x_of_the_100_gbit_plan() -> None:
    """Issue 44: at 25 Gbit/s at least 0.75x the 100 Gbit/s plan. Met once a block's
    cross-group backward collective runs beside its group's (one node a group) and part of
    each slice is all-reduced under the backward instead of gathered under the forward:
    154.0 samples/s on 8 groups of 8 with half of each slice replicated, 0.81x of 189.2
    (131.0, 0.69x, before)."""
    cluster = pools_as_cluster(cluster_b("gpt-2.7b", 512, 100))
    at_100 = solve(cluster_b("gpt-2.7b", 512, 100), cluster).predicted_samples_per_second
    at_25 = solve(cluster_b("gpt-2.7b", 512, 25), cluster)
    assert at_100 is not None and at_25.predicted_samples_per_second is not None
    assert at_25.replica_groups and at_25.replicated_fraction
    assert at_25.predicted_samples_per_second >= 0.75 * at_100


def _best_on_at_least(spec: CephaloJobSpec, gpus: int) -> tuple[float, Problem]:
    """The fastest hybrid plan's step on at least `gpus` GPUs, over every recompute mode,
    layout and replicated fraction the planner searches (each solved exactly), and its
    problem."""
    from cephalo.planner.search.hybrid import layouts
    from cephalo.planner.search.hybrid_search import _holds_state
    from cephalo.planner.search.solver import _solution_step, solve_fixed
    best: tuple[float, Problem] | None = None
    for mode in _modes(build_problem(spec, pools_as_cluster(spec))):
        for layout in layouts(mode)[0]:
            if len(layout.ranks) < gpus:
                continue
            for fraction in REPLICATED_FRACTIONS:
                sub = layout_problem(mode, dataclasses.replace(
                    layout, replicated_fraction=fraction))
                if not _holds_state(sub):
                    continue
                try:
                    step = _solution_step(sub, solve_fixed(sub))
                except InfeasibleError:
                    continue
                if best is None or step < best[0]:
                    best = (step, sub)
    assert best is not None
    return best


def _nic_floor_seconds(problem: Problem, gather: int = 2, reduce: int = 2) -> float:
    """The least step any schedule of `problem`'s collectives takes: each node's NIC bytes
    of one step (2 (G-1)/G of the gradient and parameter bytes, bf16) at its rate."""
    assert problem.topology is not None
    moved = link_bytes_per_step(problem.model, gather, reduce, problem.rank_node,
                                problem.groups, 0, problem.replicated_fraction)
    nic = min(problem.topology.nodes[n].nic_bandwidth_bytes_per_second
              for n in set(problem.rank_node))
    return moved.nic_per_node / nic


def test_at_10_gbit_beyond_1_5x_on_48_gpus_too_but_fastest_on_fewer() -> None:
    """Issue 44 at 10 Gbit/s: at least 1.5x its 41.5 samples/s, on 48 GPUs or more as well
    (the best such plan: 6 groups of a node, 66.0 samples/s, 1.59x). The fastest plan uses
    fewer (24 GPUs, 82.6 samples/s): every node's NIC carries 2 (G-1)/G of the gradient and
    parameter bytes a step whatever the schedule, so more groups put more bytes on each
    NIC, and the 48-GPU layout's NIC alone (its floor, 7.71 s) takes longer than the whole
    24-GPU step (6.20 s)."""
    spec = cluster_b("gpt-2.7b", 512, 10)
    fastest = solve(spec, pools_as_cluster(spec))
    assert fastest.predicted_samples_per_second is not None
    assert fastest.predicted_samples_per_second >= 1.5 * FLAT_10_GBIT_SAMPLES_PER_SECOND
    step_48, on_48 = _best_on_at_least(cluster_b("gpt-2.7b", 512, 10, "hybrid"), 48)
    assert 512 / step_48 >= 1.5 * FLAT_10_GBIT_SAMPLES_PER_SECOND
    floor_48 = _nic_floor_seconds(on_48)
    print(f"10 Gbit/s: fastest {fastest.predicted_samples_per_second:.1f} samples/s on "
          f"{fastest.world_size} GPUs ({len(fastest.replica_groups)} groups, a = "
          f"{fastest.replicated_fraction or 0}); best on >= 48 GPUs "
          f"{512 / step_48:.1f} samples/s on {on_48.world_size} ({len(on_48.groups)} groups, "
          f"a = {on_48.replicated_fraction}); its NIC floor {floor_48:.3f} s, "
          f"{512 / floor_48:.1f} samples/s")
    assert fastest.predicted_step_seconds is not None
    assert step_48 >= floor_48 > fastest.predicted_step_seconds
    assert fastest.world_size < 48
    # A job that asks for every GPU (planner.chooseGpus: false) gets all 64 busy, beyond
    # 1.5x too: 8 groups of a node.
    every = solve(spec, pools_as_cluster(spec), choose_gpus=False)
    assert every.world_size == 64 and len(every.replica_groups) == 8
    assert every.predicted_samples_per_second is not None
    print(f"every GPU: {every.predicted_samples_per_second:.1f} samples/s")
    assert every.predicted_samples_per_second >= 1.5 * FLAT_10_GBIT_SAMPLES_PER_SECOND


# --- re-planning: a running hybrid plan is priced as hybrid -------------------------------

def test_recalibration_prices_a_running_hybrid_plan_in_its_groups() -> None:
    """Re-planning (planner/feedback/recalibrate.py) scores the running plan under the model: a
    hybrid plan's own prediction, not the flat sharding of the same split."""
    from cephalo.planner.feedback.recalibrate import Measured, recalibrate
    spec = cluster_b("gpt-2.7b", 512, 10)
    cluster = pools_as_cluster(spec)
    plan = solve(spec, cluster)
    assert plan.replica_groups and plan.predicted_step_seconds is not None
    calibration = recalibrate(spec, cluster, None, plan,
                              Measured(step_seconds=plan.predicted_step_seconds))
    assert calibration.predicted_step_seconds == pytest.approx(plan.predicted_step_seconds,
                                                               rel=1e-9)
    assert calibration.collective_scale == pytest.approx(1.0, rel=1e-3)
    # With its replicated fraction: the same plan without it is another step (its
    # collectives and optimizer differ), which recalibration must not price.
    assert plan.replicated_fraction
    other = plan.model_copy(update={"replicated_fraction": None})
    unfractioned = recalibrate(spec, cluster, None, other,
                               Measured(step_seconds=plan.predicted_step_seconds))
    assert unfractioned.predicted_step_seconds != pytest.approx(
        plan.predicted_step_seconds, rel=1e-6)


def test_a_hybrid_plan_with_a_replicated_fraction_round_trips_through_json(
        tmp_path: Path) -> None:
    """The fraction a plan was priced with travels in its JSON (what the engine reads);
    a flat plan and a hybrid one at a = 0 omit it, byte for byte as before."""
    from cephalo.api.plan import load_plan
    spec = cluster_b("gpt-2.7b", 512, 25)
    plan = solve(spec, pools_as_cluster(spec))
    assert plan.replica_groups and plan.replicated_fraction in REPLICATED_FRACTIONS[1:]
    text = plan.to_json()
    (tmp_path / "plan.json").write_text(text)
    again = load_plan(str(tmp_path / "plan.json"))
    assert again.replicated_fraction == plan.replicated_fraction
    assert again.to_json() == text
    flat_spec = cluster_b("gpt-2.7b", 512, 25, "flat")
    assert "replicated_fraction" not in solve(flat_spec, pools_as_cluster(flat_spec)).to_json()
    assert "replicated_fraction" not in plan.model_copy(
        update={"replicated_fraction": None}).to_json()


def test_recalibration_counts_each_ranks_optimizer_on_its_piece() -> None:
    """Every rank of a hybrid plan updates its piece, P / (k G) = P / world parameters:
    where each rank measures the model's own compute (its step with collectives free, less
    that update), the compute correction is none (it once took P / k off instead)."""
    from cephalo.planner.feedback.recalibrate import (
        Measured,
        _assignment,
        complete_profiles,
        recalibrate,
    )
    from cephalo.planner.search.evaluate import evaluate
    spec = cluster_b("gpt-2.7b", 512, 10)
    cluster = pools_as_cluster(spec)
    plan = solve(spec, cluster)
    assert plan.replica_groups and plan.predicted_step_seconds is not None
    profiles = complete_profiles(spec, cluster, None)
    assignment, order = _assignment(plan, cluster, [r.batch_size for r in plan.ranks])
    position = {rank: i for i, rank in enumerate(order)}
    groups = [[position[r] for r in g] for g in plan.replica_groups]
    free = evaluate(spec, cluster.model_copy(update={
        "network_bandwidth_bytes_per_second": 1e20, "network_latency_seconds": 0.0}),
        profiles, assignment, recompute=plan.recompute is not False,
        kept_blocks=[plan.ranks[r].kept_blocks for r in order], replica_groups=groups,
        replicated_fraction=plan.replicated_fraction or 0.0)
    params = spec.model.resolve().total_parameters()
    # P / (k G) of the sharded part, P / k of the replicated part a.
    a, size, num = plan.replicated_fraction or 0.0, len(groups[0]), len(groups)
    assert a, "the case: a plan with a replicated fraction"
    updated = params / (size * num) * (1 - a) + params / size * a
    compute = [0.0] * plan.world_size
    for k, rank in enumerate(order):
        p = profiles[plan.ranks[rank].gpu]
        assert p.optimizer_seconds_per_parameter  # the case: the update takes time
        compute[rank] = free.rank_seconds[k] - (p.optimizer_seconds_fixed or 0.0) - \
            p.optimizer_seconds_per_parameter * updated
    calibration = recalibrate(spec, cluster, None, plan,
                              Measured(plan.predicted_step_seconds, compute))
    for gpu in {r.gpu for r in plan.ranks}:
        assert calibration.compute_scale[gpu] == pytest.approx(1.0, rel=1e-9), gpu


def _described(nodes: int, sharding: str, min_gain: float = 0.05) -> CephaloJobSpec:
    """GPT-2.7B, B = 2048, on `nodes` nodes of 8 A10G and as many of 8 T4 at 25 Gbit/s."""
    return parse_job({
        "apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob", "metadata": {"name": "b"},
        "spec": {"model": {"preset": "gpt-2.7b"}, "globalBatchSize": 2048, "precision": "auto",
                 "gatherPrecision": "bf16", "reducePrecision": "bf16",
                 "gpuPools": [{"product": "NVIDIA-A10G", "maxGpus": 8 * nodes},
                              {"product": "Tesla-T4", "maxGpus": 8 * nodes}],
                 "planner": {"sharding": sharding, "minGainToIdleGpus": min_gain,
                             "network": {"interNodeGbps": 25, "nodes": [
                                 {"gpus": {"NVIDIA-A10G": 8}, "count": nodes},
                                 {"gpus": {"Tesla-T4": 8}, "count": nodes}]}}}}).spec


def test_the_idle_margin_weighs_the_fastest_plan_on_every_gpu_hybrid_included() -> None:
    """planner.minGainToIdleGpus keeps every GPU unless fewer are more than 5 % faster;
    "every GPU" is the faster of flat and hybrid on all of them, found even where a
    layout on fewer GPUs was solved first (it once pruned the whole-cluster layouts)."""
    def step(spec: CephaloJobSpec, choose: bool = True) -> float:
        plan = solve(spec, pools_as_cluster(spec), choose_gpus=choose)
        assert plan.predicted_step_seconds is not None
        return plan.predicted_step_seconds

    fastest = step(_described(21, "auto", 0.0))
    everything = min(step(_described(21, "flat"), False), step(_described(21, "hybrid"), False))
    expected = everything if everything <= fastest * 1.05 else fastest
    assert step(_described(21, "auto")) == pytest.approx(expected, rel=1e-12)
