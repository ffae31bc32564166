"""The network probe's pure parts (issue 35 item 1): which probes a job needs, how a
measurement becomes the planner's topology (checked against the planner's own ring over the
measured nodes), and the probe pods as rendered."""

from __future__ import annotations

import itertools
import random

import pytest
from kube_fixtures import job_body

from cephalo.api import ClusterSpec, GpuGroup, parse_job
from cephalo.api.cluster import ClusterNode
from cephalo.api.network_profile import (
    INTER,
    INTRA,
    MEASURED_SOURCE,
    NetworkProfile,
    with_measured_network,
)
from cephalo.api.profile import CollectiveProfile
from cephalo.operator.discovery import Pool
from cephalo.operator.netprobe import Probe, probes_needed
from cephalo.operator.netprobe_choice import Background, answer, background_probe, nic_identity
from cephalo.operator.netprobe_render import render_netprobe
from cephalo.planner import solve
from cephalo.planner.cost.comm_model import CommModel
from cephalo.planner.cost.topology import topology_network

UID = "0a1b2c3d-0000-4000-8000-000000000001"


def _job(**spec: object):
    return parse_job(job_body("gpt", uid=UID, **spec))


def _pool(product: str, node_gpus: tuple[int, ...]) -> Pool:
    return Pool(product, product.removeprefix("NVIDIA-"), sum(node_gpus), None,
                tuple(f"{product}-{i}" for i in range(len(node_gpus))), node_gpus)


def _cluster(pools: list[Pool]) -> ClusterSpec:
    return ClusterSpec(groups=[GpuGroup(product=p.catalog_name or p.product, count=p.num_gpus,
                                        pool=p.product) for p in pools])


def test_probes_cover_neighbouring_pools_and_multi_gpu_nodes() -> None:
    pools = [_pool("NVIDIA-L4", (2,)), _pool("NVIDIA-A10G", (1, 1)), _pool("NVIDIA-T4", (4,))]
    probes = probes_needed(_job().spec, _cluster(pools), pools)
    assert probes == [Probe(INTER, ("NVIDIA-A10G", "NVIDIA-L4")),
                      Probe(INTER, ("NVIDIA-L4", "NVIDIA-T4")),
                      Probe(INTRA, ("NVIDIA-L4",)), Probe(INTRA, ("NVIDIA-T4",))]
    one_pool = [_pool("NVIDIA-A10G", (1, 1, 1))]  # alone on three nodes: two of them
    assert probes_needed(_job().spec, _cluster(one_pool), one_pool) == [
        Probe(INTER, ("NVIDIA-A10G", "NVIDIA-A10G"))]


def test_what_the_job_pins_or_cannot_use_is_not_probed() -> None:
    pools = [_pool("NVIDIA-L4", (2,)), _pool("NVIDIA-A10G", (1,))]
    cluster = _cluster(pools)
    assert probes_needed(_job(planner={"networkBandwidthGbps": 25}).spec, cluster, pools) == []
    assert probes_needed(_job(planner={"network": {"interNodeGbps": 25}}).spec, cluster,
                         pools) == [Probe(INTRA, ("NVIDIA-L4",))]
    assert probes_needed(_job(planner={"network": {"intraNodeGbps": 300}}).spec, cluster,
                         pools) == [Probe(INTER, ("NVIDIA-A10G", "NVIDIA-L4"))]
    single = [_pool("NVIDIA-L4", (1,))]
    assert probes_needed(_job().spec, _cluster(single), single) == []  # one GPU: no ring


def _measurement(kind: str, pools: list[str], gbps: float, latency_us: float) -> NetworkProfile:
    bandwidth = gbps * 1e9 / 8
    return NetworkProfile.model_validate({
        "kind": kind, "pools": pools, "measured_at": 0.0,
        "collectives": CollectiveProfile(bandwidth_bytes_per_second=bandwidth,
                                         latency_seconds=latency_us * 1e-6,
                                         reduce_scatter_bandwidth_bytes_per_second=bandwidth,
                                         reduce_scatter_latency_seconds=latency_us * 1e-6,
                                         world_size=2)})


@pytest.mark.parametrize("seed", range(20))
def test_the_topology_reproduces_every_measured_pair(seed: int) -> None:
    """Pools with NICs the test alone knows; each probe measures min(NIC a, NIC b), as a
    two-rank ring over those NICs runs. From the measurements alone, the planner's ring over
    one GPU of each measured pair must run at exactly what was measured."""
    rng = random.Random(seed)
    names = sorted(f"P{i}" for i in range(rng.randint(2, 5)))
    nic = {name: rng.choice([1.0, 10.0, 25.0, 100.0]) for name in names}
    latency = {name: rng.uniform(5, 80) for name in names}
    cluster = ClusterSpec(
        groups=[GpuGroup(product="A10G", count=2, pool=n) for n in names],
        nodes=[ClusterNode(gpus={n: 1}, name=n, count=2) for n in names],
        network_source="operator (GPU discovery)")
    pairs = list(itertools.pairwise(names))
    measured = [_measurement(INTER, [a, b], min(nic[a], nic[b]),
                             (latency[a] + latency[b]) / 2) for a, b in pairs]
    planned = with_measured_network(cluster, measured)
    assert planned.network_source == MEASURED_SOURCE
    network = topology_network(_job().spec, planned, CommModel(1.0, 0.0))
    assert network.topology is not None
    node_of = {name: 4 * i // 2 for i, name in enumerate(names)}  # first node of each pool
    for (a, b), m in zip(pairs, measured, strict=True):
        bandwidth, per_hop = network.topology.ring([node_of[a], node_of[b]])
        assert bandwidth == pytest.approx(m.bandwidth_bytes_per_second)
        # Latency is per node in the model (a hop costs the mean of its two NICs'), one
        # figure per measured pair here: a pool between two pairs keeps one of them, so the
        # hop lies within the latencies measured next to it.
        near = [x.latency_seconds for x in measured if {a, b} & set(x.pools)]
        assert min(near) - 1e-12 <= per_hop <= max(near) + 1e-12


def test_an_intra_node_probe_prices_a_ring_inside_its_node() -> None:
    cluster = ClusterSpec(groups=[GpuGroup(product="L4", count=4, pool="NVIDIA-L4")],
                          nodes=[ClusterNode(gpus={"NVIDIA-L4": 4}, name="NVIDIA-L4")])
    planned = with_measured_network(cluster, [_measurement(INTRA, ["NVIDIA-L4"], 96.0, 12.0)])
    network = topology_network(_job().spec, planned, CommModel(1.0, 0.0))
    assert network.topology is not None
    bandwidth, _ = network.topology.ring([0, 0, 0, 0])
    assert bandwidth * 8 / 1e9 == pytest.approx(96.0)
    assert with_measured_network(cluster, []) is cluster  # nothing measured: as it was


def test_the_least_overlap_measured_is_the_clusters_and_the_plan_pays_for_it() -> None:
    """How much of a collective hid under compute on the probe's GPUs (measured: 0.21-0.82
    for gloo on shared CPU cores, bench/shaped_plan.py) becomes the cluster's overlap; a plan
    priced with it is slower than one that assumes every collective hidden (1.0)."""
    cluster = ClusterSpec(groups=[GpuGroup(product="L4", count=1, pool="P0"),
                                  GpuGroup(product="A10G", count=1, pool="P1")],
                          nodes=[ClusterNode(gpus={"P0": 1}, name="P0"),
                                 ClusterNode(gpus={"P1": 1}, name="P1")])

    def probe(overlap: float | None, pools: list[str]) -> NetworkProfile:
        m = _measurement(INTER, pools, 1.0, 50.0)
        return m.model_copy(update={"collectives": m.collectives.model_copy(
            update={"overlap_fraction": overlap})})

    measured = with_measured_network(cluster, [probe(0.6, ["P0", "P1"]), probe(0.3, ["P1"])])
    assert measured.collective_overlap_fraction == 0.3
    unmeasured = with_measured_network(cluster, [probe(None, ["P0", "P1"])])
    assert unmeasured.collective_overlap_fraction is None  # the planner assumes 1.0
    spec = _job(planner={"chooseGpus": False}).spec
    hidden = solve(spec, unmeasured).predicted_step_seconds
    exposed = solve(spec, measured).predicted_step_seconds
    assert hidden is not None and exposed is not None and exposed > hidden


def test_probe_pods_inter_node_gang_and_intra_node_pair() -> None:
    job = _job()
    service, a, b = render_netprobe(job, "0123456789", ["NVIDIA-L4", "NVIDIA-A10G"], 60.0)
    assert service["spec"]["clusterIP"] == "None" and len(service["metadata"]["name"]) <= 63
    for index, pod in enumerate((a, b)):
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["RANK"] == str(index) and env["WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"].startswith("netprobe-0123456789-0.gpt-netprobe.")
        assert float(env["CEPHALO_COLLECTIVE_TIMEOUT_SECONDS"]) == 60
        assert pod["spec"]["containers"][0]["command"][:3] == [
            "python", "-m", "cephalo.trainer.netprobe"]
        assert len(pod["spec"]["hostname"]) <= 63
        anti = pod["spec"]["affinity"]["podAntiAffinity"]
        assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == \
            "kubernetes.io/hostname"  # the two ranks on two nodes
    assert a["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-L4"
    assert b["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-A10G"
    _service, pair = render_netprobe(job, "abcdefabcd", ["NVIDIA-L4"], 60.0)
    env = {e["name"]: e.get("value") for e in pair["spec"]["containers"][0]["env"]}
    assert env["CEPHALO_RANKS_PER_POD"] == "2"
    assert pair["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert "affinity" not in pair["spec"]


def test_probe_pods_are_a_kueue_gang_like_the_ranks() -> None:
    body = job_body("gpt", uid=UID)
    body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    _service, a, b = render_netprobe(parse_job(body), "0123456789",
                                     ["NVIDIA-L4", "NVIDIA-A10G"], 60.0)
    for pod in (a, b):
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "gpt-np-0123456789"
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "2"


# ---- issue 46 items 5 and 8: what the cluster-wide cache answers ---------------------------
def _cached(kind: str, pools: list[str], gbps: float, nics: list[str] | None = None,
            at: float = 1000.0) -> NetworkProfile:
    return _measurement(kind, pools, gbps, 50.0).model_copy(
        update={"nics": nics or [], "measured_at": at})


A10G, T4 = "NVIDIA-A10G", "Tesla-T4"


def test_a_pool_measured_in_any_pair_answers_every_pair_it_is_in() -> None:
    pair = _cached(INTER, [A10G, T4], 10.0)
    intra = _cached(INTRA, [A10G], 100.0)
    # The node lost: A10G alone on two nodes needs an A10G <-> A10G probe; its NIC is known.
    needed = [Probe(INTER, (A10G, A10G)), Probe(INTRA, (A10G,))]
    got = answer(needed, [pair, intra], now=2000.0, max_age_seconds=3600.0)
    assert got.to_probe == [] and got.measured == [pair, intra]
    # A pool never measured is probed, with the pair that has it.
    got = answer([Probe(INTER, ("NVIDIA-L4", T4))], [pair], now=2000.0, max_age_seconds=3600.0)
    assert got.to_probe == [Probe(INTER, ("NVIDIA-L4", T4))] and got.measured == []
    # The fastest pair a pool was in gives its NIC (as with_measured_network does).
    fast = _cached(INTER, [A10G, "NVIDIA-L4"], 25.0)
    got = answer([Probe(INTER, (A10G, A10G))], [pair, fast], now=2000.0,
                 max_age_seconds=3600.0)
    assert got.measured == [fast]


def test_the_cache_answers_only_young_measurements_of_the_same_nics() -> None:
    pair = _cached(INTER, [A10G, T4], 10.0, nics=["g5.xlarge", "g4dn.xlarge"], at=1000.0)
    same = Probe(INTER, (A10G, T4), ("g5.xlarge", "g4dn.xlarge"))
    assert answer([same], [pair], now=1500.0, max_age_seconds=600.0).measured == [pair]
    assert answer([same], [pair], now=1700.0, max_age_seconds=600.0).to_probe == [same]  # old
    other = Probe(INTER, (A10G, T4), ("g5.48xlarge", "g4dn.xlarge"))  # a 100 Gbit/s A10G
    assert answer([other], [pair], now=1500.0, max_age_seconds=600.0).to_probe == [other]
    # The T4 side is known (same instance type), the A10G side is not: still a probe.
    assert other.key != same.key and other.config_map_name != same.config_map_name


def test_the_nic_identity_is_the_nodes_machine_type_and_nic_label() -> None:
    pool = _pool(A10G, (4, 4))
    nodes = [{"metadata": {"name": f"{A10G}-{i}", "labels": labels}} for i, labels in enumerate([
        {"node.kubernetes.io/instance-type": "g5.12xlarge"},
        {"node.kubernetes.io/instance-type": "g5.12xlarge", "cephalo.dev/nic-gbps": "40"}])]
    assert nic_identity(pool, nodes) == "g5.12xlarge,g5.12xlarge/40"
    assert nic_identity(pool, nodes[:1]) == "g5.12xlarge"  # node names play no part
    assert nic_identity(pool, []) == ""
    job, cluster = _job(), _cluster([pool])
    (probe,) = [p for p in probes_needed(job.spec, cluster, [pool], {A10G: "g5.12xlarge"})
                if p.kind == INTER]
    assert probe.nics == ("g5.12xlarge", "g5.12xlarge")
    assert "team" not in probe.key and "gpt" not in probe.key  # no job or namespace in it


# ---- issue 46 item 8: what a Running job probes beside its gang ---------------------------
L4 = "NVIDIA-L4"
PAIR = Probe(INTER, (A10G, L4))  # the L4 pool's NIC never measured


def test_a_background_probe_runs_only_on_gpus_free_of_everyone() -> None:
    # Free of every pod (the job's own ranks counted): 2 A10G GPUs and the L4 node's spare.
    free = [_pool(A10G, (2, 0)), _pool(L4, (1,))]
    assert background_probe([PAIR], {}, free) == Background(PAIR, {})
    # The job's ranks hold every L4 GPU: nothing runs, and the condition says why.
    held = [_pool(A10G, (2, 0))]
    assert background_probe([PAIR], {}, held) == Background(None, {
        f"inter-node {A10G} <-> {L4}": f"not measured: no free GPUs to probe inter-node "
        f"{A10G} <-> {L4} without the job's own"})
    # A free L4 GPU another job planned and has not placed yet is not free for a probe.
    reserved = [_pool(A10G, (2, 0)), Pool(L4, "L4", 0, None, ("l4-0",), (1,), 1)]
    assert background_probe([PAIR], {}, reserved).probe is None


def test_a_background_probe_fits_its_shape_on_nodes() -> None:
    same = Probe(INTER, (A10G, A10G))
    assert background_probe([same], {}, [_pool(A10G, (2, 0))]).probe is None  # one node
    assert background_probe([same], {}, [_pool(A10G, (1, 1))]).probe == same  # two nodes
    intra = Probe(INTRA, (A10G,))
    assert background_probe([intra], {}, [_pool(A10G, (1, 1))]).probe is None  # 1 a node
    assert background_probe([intra], {}, [_pool(A10G, (0, 2))]).probe == intra


def test_one_background_probe_at_a_time_and_none_retried_after_a_failure() -> None:
    intra = Probe(INTRA, (A10G,))
    free = [_pool(A10G, (2, 2)), _pool(L4, (1,))]
    got = background_probe([PAIR, intra], {}, free)
    assert got.probe == PAIR
    assert got.left == {f"intra-node {A10G} x2": "not measured yet: one probe at a time"}
    # A probe that runs keeps its turn although its own pods now hold the GPUs it needed.
    assert background_probe([PAIR, intra], {}, [_pool(A10G, (0, 0))],
                            running=frozenset({intra.digest})).probe == intra
    # A failed probe is never tried again for the job; the next one is.
    got = background_probe([PAIR, intra], {PAIR.key: "timed out"}, free)
    assert got.probe == intra
    assert got.left == {f"inter-node {A10G} <-> {L4}": "probe failed: timed out"}
    assert background_probe([PAIR], {PAIR.key: "timed out"}, free).probe is None
