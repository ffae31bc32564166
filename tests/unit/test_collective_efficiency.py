"""A described network is priced at what the collective library reaches of it (issue 46,
item 6; docs/network.md, "Described or measured"): told a link's rate (the job's
planner.network*, a node label, the defaults), the planner prices its collectives at the
backend's efficiency of that rate (gloo between CPU ranks, NCCL between GPUs); a measured
network (the profiler's collectives, the operator's network probe) is used as measured."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import numpy as np
import pytest

from cephalo.api import ClusterSpec, GpuGroup, parse_job
from cephalo.api.cluster import ClusterNode
from cephalo.api.job import CephaloJobSpec
from cephalo.api.network import GLOO_EFFICIENCY, NCCL_EFFICIENCY
from cephalo.api.network_profile import INTER, NetworkProfile, with_measured_network
from cephalo.api.profile import CollectiveProfile, GpuProfile
from cephalo.local.devices import LocalDevice
from cephalo.local.runner import build_cluster
from cephalo.planner import estimate_profile, solve
from cephalo.planner.cost.comm_model import UnitComm
from cephalo.planner.outputs.report import format_plan
from cephalo.planner.search.problem import build_problem, network_of

GBIT = 1e9 / 8
ROOT = Path(__file__).resolve().parents[2]
# One product per backend: the CPU's ranks run gloo, GPUs run NCCL.
BACKENDS = [("cpu", "gloo", GLOO_EFFICIENCY), ("A10G", "nccl", NCCL_EFFICIENCY)]


def _job(batch: int = 64, **planner: object) -> CephaloJobSpec:
    return parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                      "metadata": {"name": "t"}, "spec": {
                          "model": {"preset": "gpt-small"}, "globalBatchSize": batch,
                          "planner": {"chooseGpus": False, **planner}}}).spec


def _profile(product: str, spec: CephaloJobSpec,
             collectives: CollectiveProfile | None = None) -> dict[str, GpuProfile]:
    profile = estimate_profile(product, spec.model.resolve(), spec.precision)
    return {product: profile.model_copy(update={"collectives": collectives})}


@pytest.mark.parametrize(("product", "backend", "efficiency"), BACKENDS)
def test_a_described_link_is_priced_as_a_measured_one_at_the_backends_efficiency(
        product: str, backend: str, efficiency: float) -> None:
    """Told 1 Gbit/s and 50 us (planner.networkBandwidthGbps), the plan is the one the
    planner makes from collectives measured at efficiency x 1 Gbit/s and 50 us: the same
    step to the last bit, and slower than one measured at the full rate."""
    spec = _job(networkBandwidthGbps=1.0, networkLatencyMicroseconds=50.0)
    cluster = ClusterSpec(groups=[GpuGroup(product=product, count=2)])
    assert cluster.backend == backend

    def measured_at(gbps: float) -> float | None:
        fit = CollectiveProfile(bandwidth_bytes_per_second=gbps * GBIT, latency_seconds=50e-6,
                                world_size=2)
        return solve(spec, cluster, _profile(product, spec, fit)).predicted_step_seconds

    described = solve(spec, cluster, _profile(product, spec))
    assert described.predicted_step_seconds == pytest.approx(measured_at(efficiency),
                                                             rel=1e-12)
    line_rate = measured_at(1.0)
    assert line_rate is not None and described.predicted_step_seconds > line_rate
    assert described.assumptions["collective_backend"] == backend
    assert described.assumptions["collective_efficiency"] == efficiency


def test_collectives_the_profiler_measured_are_used_as_measured() -> None:
    spec = _job(networkBandwidthGbps=1.0)
    cluster = ClusterSpec(groups=[GpuGroup(product="cpu", count=2)])
    fit = CollectiveProfile(bandwidth_bytes_per_second=0.3 * GBIT, latency_seconds=1e-4,
                            world_size=2)
    plan = solve(spec, cluster, _profile("cpu", spec, fit))
    assert plan.assumptions["network_bandwidth_bytes_per_second"] == 0.3 * GBIT
    assert plan.assumptions["network_source"] == "measured"
    assert "collective_efficiency" not in plan.assumptions
    assert "of the described rate" not in format_plan(plan, "gpt-small")


def _two_pools(**node: object) -> ClusterSpec:
    """Two A10G nodes of one GPU each (pools P0 and P1), as the operator describes them,
    each with a 25 Gbit/s NIC label."""
    return ClusterSpec(groups=[GpuGroup(product="A10G", count=1, pool=p) for p in ("P0", "P1")],
                       nodes=[ClusterNode(gpus={p: 1}, name=p, **node) for p in ("P0", "P1")],
                       network_source="operator (node label)")


def _probe(gbps: float) -> NetworkProfile:
    fit = CollectiveProfile(bandwidth_bytes_per_second=gbps * GBIT, latency_seconds=40e-6,
                            reduce_scatter_bandwidth_bytes_per_second=gbps * GBIT,
                            reduce_scatter_latency_seconds=40e-6, world_size=2)
    return NetworkProfile(kind=INTER, pools=["P0", "P1"], collectives=fit, measured_at=0.0)


def test_the_network_probes_figures_are_used_as_measured_and_a_labels_as_described() -> None:
    spec = _job()
    labelled = _two_pools(nic_bandwidth_bytes_per_second=25 * GBIT)
    probed = with_measured_network(labelled, [_probe(9.0)])
    label_plan, probe_plan = solve(spec, labelled), solve(spec, probed)
    assert label_plan.assumptions["network_bandwidth_bytes_per_second"] == pytest.approx(
        NCCL_EFFICIENCY * 25 * GBIT)
    assert label_plan.assumptions["collective_efficiency"] == NCCL_EFFICIENCY
    assert probe_plan.assumptions["network_bandwidth_bytes_per_second"] == pytest.approx(
        9.0 * GBIT)
    assert "collective_efficiency" not in probe_plan.assumptions


def test_a_measured_nic_beside_a_described_intra_node_link_prices_each_as_it_came() -> None:
    """The probe measured the NICs; no probe measured the link inside a node (the
    default, described): a ring across nodes crosses the measured NIC as measured, one
    inside a node the default's rate at the efficiency."""
    cluster = ClusterSpec(groups=[GpuGroup(product="A10G", count=2, pool=p)
                                  for p in ("P0", "P1")],
                          nodes=[ClusterNode(gpus={p: 2}, name=p) for p in ("P0", "P1")],
                          network_source="operator (node label)")
    network = network_of(_job(), with_measured_network(cluster, [_probe(9.0)]), {})
    assert network.topology is not None
    nic, inside = network.topology.ring([0, 1])[0], network.topology.ring([0, 0])[0]
    assert nic == pytest.approx(9.0 * GBIT)
    assert inside == pytest.approx(NCCL_EFFICIENCY * 128 * GBIT)  # the documented default


def test_the_plan_says_it_priced_the_described_link_at_the_efficiency() -> None:
    spec = _job(networkBandwidthGbps=1.0)
    plan = solve(spec, ClusterSpec(groups=[GpuGroup(product="cpu", count=2)]),
                 _profile("cpu", spec))
    header = format_plan(plan, "gpt-small").splitlines()[1]
    assert "network 0.47 Gbit/s per GPU for collectives" in header
    assert "0.47 of the described rate (what gloo reaches of a link" in header


@pytest.mark.parametrize(("devices", "backend"), [
    ([LocalDevice("cpu", 0, "cpu"), LocalDevice("cpu", 1, "cpu")], "gloo"),
    ([LocalDevice("cpu", 0, "A10G", emulated=True), LocalDevice("cpu", 1, "T4", emulated=True)],
     "gloo"),
    ([LocalDevice("cuda", 0, "A10G"), LocalDevice("cuda", 1, "A10G")], "nccl")])
def test_a_local_run_plans_on_the_library_its_ranks_run(devices: list[LocalDevice],
                                                        backend: str) -> None:
    """Emulated GPUs are CPU ranks: gloo, although their groups name GPUs."""
    assert build_cluster(devices).backend == backend


def _documented_runs() -> list[tuple[float, float]]:
    """(all-gather fit / shaped rate, reduce-scatter fit / shaped rate) per row of the
    table of runs in docs/network.md's "Described or measured"."""
    text = (ROOT / "docs" / "network.md").read_text()
    section = text.split("## Described or measured", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) Mbit/s \| (\d\+\d) \| [^|]+ \| ([\d.]+) \| ([\d.]+) \|",
                      section, re.MULTILINE)
    return [(float(ag), float(rs)) for _, _, ag, rs in rows]


def test_the_gloo_figure_is_the_median_of_the_documented_runs() -> None:
    """The constant is what docs/network.md says it is computed from: per run the harmonic
    mean of both collectives' share of the shaped rate (a unit issues both; their times
    add), the median over the runs."""
    runs = _documented_runs()
    assert len(runs) == 13
    median = statistics.median(statistics.harmonic_mean(run) for run in runs)
    assert round(median, 2) == GLOO_EFFICIENCY



def _measured_link(mbit: float, probe_vs_model: float | None, spec: CephaloJobSpec,
                   cluster: ClusterSpec) -> CollectiveProfile:
    """Collectives measured at `mbit` (the reduce-scatter a little slower, as on gloo) with,
    unless `probe_vs_model` is None, a probe step that many times what the model predicts of
    it on that link: a real probe step slows with the link as the collectives do."""
    fit = CollectiveProfile(
        bandwidth_bytes_per_second=mbit * 1e6 / 8, latency_seconds=2e-4,
        reduce_scatter_bandwidth_bytes_per_second=mbit * 0.8e6 / 8,
        reduce_scatter_latency_seconds=5e-4, all_reduce_seconds=1e-3, world_size=2,
        overlap_fraction=0.3, uneven_overhead=0.05)
    if probe_vs_model is None:
        return fit
    problem = build_problem(spec, cluster, _profile("cpu", spec, fit))
    unit = UnitComm.build(problem.model, problem.comm_model, 2, uneven=False)
    one = np.ones(1)
    predicted = float(problem.classes[0].cost.step_seconds(one, one, unit)[0])
    return fit.model_copy(update={"probe_step_seconds": probe_vs_model * predicted})


@pytest.mark.parametrize("probe_vs_model", [None, 0.5, 1.3])
def test_a_slower_measured_link_never_predicts_a_faster_step(
        probe_vs_model: float | None) -> None:
    """The planner's best step on two CPU ranks (using one or both, as it chooses) with the
    collectives measured ever slower: never faster, both ranks on the fastest link and one
    alone on the slowest; with a measured probe step the model under- or over-predicts too.
    (tests/trainer/test_shaped_plan.py plans from real measurements on a shaped link, where
    each shape's figures carry their own noise.)"""
    spec = _job(batch=128, chooseGpus=True)
    cluster = ClusterSpec(groups=[GpuGroup(product="cpu", count=2)])
    steps, ranks = [], []
    for mbit in (3000, 1000, 300, 150, 100, 50, 20, 5):
        fit = _measured_link(mbit, probe_vs_model, spec, cluster)
        plan = solve(spec, cluster, _profile("cpu", spec, fit))
        assert plan.predicted_step_seconds is not None
        steps.append(plan.predicted_step_seconds)
        ranks.append(plan.world_size)
    assert steps == sorted(steps), (steps, ranks)
    assert ranks == sorted(ranks, reverse=True) and ranks[0] == 2 and ranks[-1] == 1, ranks
