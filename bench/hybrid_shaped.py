"""Hybrid against flat sharding on a real, shaped network (issue 44): four gloo ranks as two
"nodes" of two (Linux network namespaces A and B, bench/shaped_network.py), the ranks of a
node talking over its loopback, the link between the nodes a veth pair shaped with tc. The
job describes that topology (planner.network: two nodes of two CPU ranks, interNodeGbps the
shaped rate, intraNodeGbps the local runner's loopback figure); the real profiler measures
this machine's CPU (one thread) once. At each link rate the planner plans the job on all
four ranks with `sharding: auto`, `flat` and `hybrid`; the flat and the hybrid plan's real
trainer ranks then run alternately on the same link, `--repeats` times. Printed per link:
what auto chose, each plan's predicted and measured step seconds (median, min-max over the
repeats), the ratio hybrid / flat measured, and predicted / measured of each. Run by hand
as root: `python bench/hybrid_shaped.py [--rates 50,10000] [--repeats 3]`.

Each rank computes with one thread, as profiled: four ranks on this 2-core machine share
the cores two to one, so compute runs up to twice as long as the profile says; on the slow
link the collectives dominate both plans' steps, and that error is a small part of them.
Every timed process starts through `start_timed_module` (niceness -20 in a session of its own,
forked from a fork server that imported torch once).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cephalo.api.job import load_job
from cephalo.api.plan import Plan
from cephalo.api.profile import GpuProfile
from cephalo.local.devices import select_devices
from cephalo.local.runner import LOOPBACK_BANDWIDTH_BYTES_PER_SECOND, build_cluster
from cephalo.planner import solve

# The namespaces machinery and the plan runner live beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from shaped_network import shaped_nodes, unavailable
from shaped_plan import WARMUP_STEPS, cpu_profile, job_data, run_plan

PRESET = "gpt-small"
RANKS_PER_NODE = 2
NODES = 2
SHARDINGS = ("auto", "flat", "hybrid")
# The loopback a node's ranks share, as the local runner prices it (Gbit/s).
INTRA_NODE_GBPS = LOOPBACK_BANDWIDTH_BYTES_PER_SECOND * 8 / 1e9


def write_job(work: Path, rate_mbit: float, batch: int, steps: int) -> Path:
    """The job file at one link rate: the two nodes of two CPU ranks, described."""
    data = job_data(PRESET, batch, steps)
    data["spec"]["planner"]["network"] = {
        "interNodeGbps": rate_mbit / 1000, "intraNodeGbps": INTRA_NODE_GBPS,
        "nodes": [{"gpus": {"cpu": RANKS_PER_NODE}, "count": NODES}]}
    job_file = work / f"job-{rate_mbit:g}.yaml"
    job_file.write_text(yaml.safe_dump(data, sort_keys=False))
    return job_file


def plan(job_file: Path, cpu: GpuProfile, sharding: str) -> Plan:
    """The planner's plan on all four ranks with `sharding`, priced from the described
    network alone: no measured collectives in the profile, no local bus on the cluster
    (build_cluster's figure would win over the job's)."""
    spec = load_job(str(job_file)).spec
    spec = spec.model_copy(update={"planner": spec.planner.model_copy(
        update={"sharding": sharding})})
    cluster = build_cluster(select_devices(f"cpu:{RANKS_PER_NODE * NODES}", None),
                            cpu.memory_capacity_bytes).model_copy(update={
        "network_bandwidth_bytes_per_second": None, "network_latency_seconds": None})
    chosen = solve(spec, cluster, {"cpu": cpu.model_copy(update={"collectives": None})},
                   choose_gpus=False)
    if chosen.predicted_step_seconds is None:
        raise RuntimeError("the plan carries no predicted step time")
    return chosen


def sharding_of(p: Plan) -> str:
    return "hybrid" if len(p.replica_groups) > 1 else "flat"


def described(p: Plan) -> str:
    """'flat', 'hybrid' or 'hybrid, a = 0.25' (its replicated fraction)."""
    a = p.replicated_fraction
    return f"{sharding_of(p)}, a = {a:g}" if a else sharding_of(p)


@dataclass
class Runs:
    """One plan's runs on one link: its predicted step and each run's measured median."""

    predicted_seconds: float
    measured_seconds: list[float] = field(default_factory=list)

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.measured_seconds)

    def ratios(self) -> list[float]:
        return [self.predicted_seconds / m for m in self.measured_seconds]


@dataclass
class Link:
    rate_mbit: float
    auto_sharding: str  # what `sharding: auto` chose
    auto_reason: str
    flat: Runs
    hybrid: Runs
    hybrid_plan: str = "hybrid"  # `described`

    def hybrid_over_flat(self) -> list[float]:
        """Measured hybrid / flat, per repeat (the two runs of a repeat back to back)."""
        return [h / f for h, f in zip(self.hybrid.measured_seconds,
                                      self.flat.measured_seconds, strict=True)]


def compare(rate_mbit: float, cpu: GpuProfile, work: Path, batch: int, steps: int,
            repeats: int) -> Link:
    """Plan at `rate_mbit`, then run the hybrid and the flat plan alternately on a link
    shaped to it, `repeats` times each."""
    job_file = write_job(work, rate_mbit, batch, steps)
    plans = {s: plan(job_file, cpu, s) for s in SHARDINGS}
    if sharding_of(plans["hybrid"]) != "hybrid":
        raise RuntimeError(f"no hybrid plan at {rate_mbit:g} Mbit/s")
    runs = {s: Runs(_predicted(plans[s])) for s in ("hybrid", "flat")}
    with shaped_nodes(rate_mbit) as nodes:
        for _ in range(repeats):
            for s in ("hybrid", "flat"):
                records = run_plan(plans[s], nodes, job_file, work,
                                   ranks_per_node=RANKS_PER_NODE)
                runs[s].measured_seconds.append(
                    statistics.median(r["step_seconds"] for r in records))
    reason = str(plans["auto"].assumptions.get("sharding_reason", ""))
    return Link(rate_mbit, sharding_of(plans["auto"]), reason, runs["flat"], runs["hybrid"],
                described(plans["hybrid"]))


def _predicted(p: Plan) -> float:
    assert p.predicted_step_seconds is not None  # plan() checked
    return p.predicted_step_seconds


def _spread(values: list[float], digits: int = 3) -> str:
    return (f"{statistics.median(values):.{digits}f} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})")


def table(links: list[Link]) -> list[str]:
    rows = ["| link Mbit/s | auto chose | plan | predicted s | measured s, median (min-max) | "
            "predicted / measured | hybrid / flat measured |",
            "|---|---|---|---|---|---|---|"]
    for link in links:
        for name, runs in (("hybrid", link.hybrid), ("flat", link.flat)):
            first = name == "hybrid"
            rows.append(f"| {f'{link.rate_mbit:g}' if first else ''} | "
                        f"{link.auto_sharding if first else ''} | "
                        f"{link.hybrid_plan if first else name} | "
                        f"{runs.predicted_seconds:.3f} | {_spread(runs.measured_seconds)} | "
                        f"{_spread(runs.ratios(), 2)} | "
                        f"{_spread(link.hybrid_over_flat(), 2) if first else ''} |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="50,10000", help="Mbit/s, comma-separated")
    parser.add_argument("--batch", type=int, default=32, help="global batch size")
    parser.add_argument("--steps", type=int, default=6,
                        help=f"training steps per run (the first {WARMUP_STEPS} untimed)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each plan per link, alternating")
    args = parser.parse_args()
    reason = unavailable()
    if reason:
        print(f"hybrid_shaped: {reason}", file=sys.stderr)
        return 2
    if args.steps <= WARMUP_STEPS or args.repeats < 1:
        print(f"hybrid_shaped: --steps must exceed {WARMUP_STEPS} and --repeats be at least 1",
              file=sys.stderr)
        return 2
    print(f"loadavg before {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    links = []
    with tempfile.TemporaryDirectory(prefix="hybrid-shaped-") as tmp:
        work = Path(tmp)
        cpu = cpu_profile(write_job(work, 1000, args.batch, args.steps), work)
        for rate in (float(r) for r in args.rates.split(",")):
            links.append(compare(rate, cpu, work, args.batch, args.steps, args.repeats))
            print(f"{rate:g} Mbit/s: auto -> {links[-1].auto_sharding}: "
                  f"{links[-1].auto_reason}", flush=True)
    print("\n".join(table(links)))
    print(f"loadavg after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
