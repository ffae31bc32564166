"""The plan on a real, shaped network (issue 35): profile the CPU once (the real profiler,
one thread); for each link rate, measure the collectives across two network namespaces
joined by a tc-shaped veth pair (bench/shaped_network.py: the profiler's measurement, or
the operator's network probe with `--probe netprobe`), plan a small GPT on two CPU "GPUs"
(one rank in each namespace) from both, run the plan's real trainer ranks across the
namespaces, and compare the predicted step time with the measured one. Run by hand as root:
`python bench/shaped_plan.py [--rates 300,100,40] [--batch 128] [--steps 12]`.

Each rank computes with one thread (CEPHALO_NUM_THREADS=1), as the profile measured: two
ranks on this 2-core machine then each have a core. A one-rank plan runs in namespace A
alone (no link). `--run both` (default) also runs the other choice (the two-rank plan where
the planner chose one rank, and the reverse) to check the choice against a measurement.
Every timed process starts through `start_timed_module` (niceness -20 in a session and
autogroup of its own, root): other sessions' load then leaves the profile and the runs alone;
forked from one fork server that imported torch once, none pays the imports again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from cephalo.api.cluster import ClusterSpec
from cephalo.api.job import CephaloJobSpec, load_job
from cephalo.api.plan import Plan
from cephalo.api.profile import CollectiveProfile, GpuProfile
from cephalo.api.trainer_env import TrainerVars, to_environ
from cephalo.local.devices import select_devices
from cephalo.local.ranks import RankEnv, rank_environment
from cephalo.local.runner import build_cluster
from cephalo.planner import evaluate, solve
from cephalo.planner.feedback.recalibrate import Measured, recalibrate, scale_profile
from cephalo.trainer.forked import ForkedModule

# The namespaces machinery lives beside this file (run as a script or loaded from its path).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from shaped_network import (
    ADDRESS_A,
    DEVICE_A,
    DEVICE_B,
    PROBES,
    Nodes,
    link_figures,
    measure,
    shaped_nodes,
    start_timed_module,
    unavailable,
    wait_all,
)

WARMUP_STEPS = 2  # left out of the measured median: allocator, connections, first gathers
THREADS = 1
MASTER_PORT = 29512


def job_data(preset: str, batch: int, steps: int) -> dict:
    return {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
            "metadata": {"name": "shaped-plan"},
            "spec": {"model": {"preset": preset}, "globalBatchSize": batch,
                     "training": {"steps": steps, "learningRate": 1e-3},
                     "data": {"synthetic": {}},
                     "planner": {"profileMicroBatchSizes": [1, 2, 4, 8, 16, 32]},
                     "checkpoint": {"ephemeral": True}}}


def _one_thread_env() -> dict[str, str]:
    return dict(os.environ, **to_environ(TrainerVars(num_threads=THREADS)),
                OMP_NUM_THREADS=str(THREADS), CUDA_VISIBLE_DEVICES="")


def cpu_profile(job_file: Path, work: Path) -> GpuProfile:
    """The real profiler on this machine's CPU with one thread, measured now (a fresh
    cache): on a shared machine the prediction then sees the load the run will see."""
    output = Path(tempfile.mkdtemp(prefix="profile-", dir=work))
    log = output / "profile.log"
    wait_all(lambda _: start_timed_module("cephalo.trainer.profile", [
        "--job", str(job_file), "--output", str(output / "cpu.json"), "--cache-dir",
        str(output / "cache")], _one_thread_env(), log=log, cwd=work), [log], 600)
    return GpuProfile.model_validate_json((output / "cpu.json").read_text())


@dataclass
class Planned:
    plan: Plan
    cluster: ClusterSpec
    profile: GpuProfile  # the CPU's, with the measured collectives


def plan_with(spec: CephaloJobSpec, cpu: GpuProfile, fit: dict[str, float],
              ranks: int | None = None) -> Planned:
    """The planner's plan with the measured collectives: on two CPU ranks, using one or
    both as it chooses (`ranks` None), or on exactly `ranks` of them."""
    devices = select_devices(f"cpu:{ranks or 2}", None)
    cluster = build_cluster(devices, cpu.memory_capacity_bytes)
    profile = cpu.model_copy(update={"collectives": CollectiveProfile(**fit)})
    plan = solve(spec, cluster, {"cpu": profile}, choose_gpus=ranks is None)
    if plan.predicted_step_seconds is None:
        raise RuntimeError("the plan carries no predicted step time")
    return Planned(plan, cluster, profile)


def run_plan(plan: Plan, nodes: Nodes, job_file: Path, work: Path,
             timeout_seconds: float = 300.0, ranks_per_node: int = 1) -> list[dict]:
    """Run the plan's trainer ranks (the first `ranks_per_node` in A, the rest in B); rank
    0's step records, warm-up steps left out."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"run-{plan.world_size}-", dir=work))
    plan_file = run_dir / "plan.json"
    plan_file.write_text(plan.to_json())
    devices = select_devices(f"cpu:{plan.world_size}", None)
    ranks = [RankEnv(d) for d in devices]

    def start(rank: int) -> ForkedModule:
        env = rank_environment(rank, plan, ranks, run_dir, job_file, plan_file,
                               MASTER_PORT, THREADS, checkpoint_dir="")
        in_a = rank < ranks_per_node
        env.update(MASTER_ADDR=ADDRESS_A, GLOO_SOCKET_IFNAME=DEVICE_A if in_a else DEVICE_B)
        return start_timed_module("cephalo.trainer", [], env, log=run_dir / f"rank-{rank}.log",
                                  cwd=run_dir, netns=nodes.a if in_a else nodes.b)

    wait_all(start, [run_dir / f"rank-{rank}.log" for rank in range(plan.world_size)],
             timeout_seconds)
    records = [json.loads(line) for line in
               (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return records[WARMUP_STEPS:]


@dataclass
class Outcome:
    """One plan run across the link: predicted and measured step seconds (medians over
    the timed steps), and the prediction with its compute made what the ranks measured
    in the same steps (the planner's recalibration, compute only: collectives as modelled):
    on a shared machine the load moves compute by ±35 % from minute to minute, which says
    nothing about the model of the link."""

    ranks: int
    batches: list[int]
    predicted_seconds: float
    measured_seconds: float
    compute_scale: float  # measured compute / the profile's
    normalised_seconds: float  # predicted, compute as measured
    # The same plan as the planner prices it when told the shaped rate rather than given a
    # measurement (planner.networkBandwidthGbps, 50 us): at gloo's efficiency of the rate,
    # and at the rate itself (as it priced a described link before issue 46).
    described_seconds: float = 0.0
    line_rate_seconds: float = 0.0
    described_normalised_seconds: float = 0.0  # both, compute as measured
    line_rate_normalised_seconds: float = 0.0

    @property
    def ratio(self) -> float:
        return self.predicted_seconds / self.measured_seconds

    @property
    def normalised_ratio(self) -> float:
        return self.normalised_seconds / self.measured_seconds

    @property
    def described_ratio(self) -> float:
        return self.described_seconds / self.measured_seconds

    @property
    def line_rate_ratio(self) -> float:
        return self.line_rate_seconds / self.measured_seconds

    @property
    def described_normalised_ratio(self) -> float:
        return self.described_normalised_seconds / self.measured_seconds

    @property
    def line_rate_normalised_ratio(self) -> float:
        return self.line_rate_normalised_seconds / self.measured_seconds


DESCRIBED_LATENCY_MICROSECONDS = 50.0  # the flat default: a job that gives the rate alone


def described(spec: CephaloJobSpec, rate_mbit: float) -> CephaloJobSpec:
    """The job told the link's rate (planner.networkBandwidthGbps) instead of measuring it."""
    return spec.model_copy(update={"planner": spec.planner.model_copy(update={
        "network_bandwidth_gbps": rate_mbit / 1000,
        "network_latency_microseconds": DESCRIBED_LATENCY_MICROSECONDS})})


def described_predictions(spec: CephaloJobSpec, planned: Planned, rate_mbit: float,
                          profile: GpuProfile | None = None) -> tuple[float, float]:
    """The planner's step for `planned`'s assignment when told the rate: (priced at the
    backend's efficiency, priced at the rate itself as measured collectives would be), with
    the CPU's `profile` (default: the plan's)."""
    plan = planned.plan
    assignment: list[tuple[int, int] | None] = [
        (r.micro_batch_size, r.num_micro_batches) for r in plan.ranks]
    assignment += [None] * (sum(g.count for g in planned.cluster.groups) - plan.world_size)
    cpu = (profile or planned.profile).model_copy(update={"collectives": None})
    recompute = plan.recompute is not False
    # Without the local run's assumed bus (build_cluster), which wins over the job's figure.
    cluster = planned.cluster.model_copy(update={"network_bandwidth_bytes_per_second": None,
                                                 "network_latency_seconds": None})
    told = evaluate(described(spec, rate_mbit), cluster, {"cpu": cpu}, assignment,
                    recompute=recompute).step_seconds
    line = cpu.model_copy(update={"collectives": CollectiveProfile(
        bandwidth_bytes_per_second=rate_mbit * 1e6 / 8,
        latency_seconds=DESCRIBED_LATENCY_MICROSECONDS * 1e-6, world_size=2)})
    at_rate = evaluate(spec, planned.cluster, {"cpu": line}, assignment,
                       recompute=recompute).step_seconds
    return told, at_rate


def run_and_score(spec: CephaloJobSpec, planned: Planned, nodes: Nodes, job_file: Path,
                  work: Path, rate_mbit: float) -> Outcome:
    plan = planned.plan
    steps = run_plan(plan, nodes, job_file, work)
    measured = Measured(
        step_seconds=statistics.median(r["step_seconds"] for r in steps),
        compute_seconds=[statistics.median(r["ranks"][i]["compute_seconds"] for r in steps)
                         for i in range(plan.world_size)])
    profiles = {"cpu": planned.profile}
    scale = recalibrate(spec, planned.cluster, profiles, plan, measured).compute_scale["cpu"]
    assignment: list[tuple[int, int] | None] = [
        (r.micro_batch_size, r.num_micro_batches) for r in plan.ranks]
    assignment += [None] * (sum(g.count for g in planned.cluster.groups) - plan.world_size)
    normalised = evaluate(spec, planned.cluster, {"cpu": scale_profile(planned.profile, scale)},
                          assignment, recompute=plan.recompute is not False)
    assert plan.predicted_step_seconds is not None  # plan_with checked
    told, at_rate = described_predictions(spec, planned, rate_mbit)
    told_normalised, at_rate_normalised = described_predictions(
        spec, planned, rate_mbit, scale_profile(planned.profile, scale))
    return Outcome(plan.world_size, [r.batch_size for r in plan.ranks],
                   plan.predicted_step_seconds, measured.step_seconds, scale,
                   normalised.step_seconds, told, at_rate, told_normalised,
                   at_rate_normalised)


@dataclass
class Shape:
    rate_mbit: float
    all_gather_mbit: float  # the profiler's fits across the link
    reduce_scatter_mbit: float
    chosen_ranks: int  # the planner's choice: one or both ranks, per-rank batch, step
    chosen_batches: list[int]
    chosen_predicted_seconds: float
    runs: list[Outcome]  # the plans run, the chosen one first where it ran
    fit: dict[str, float]  # the measured collectives (CollectiveProfile fields)
    cpu: GpuProfile  # the CPU's profile, measured for this shape


RUNS = ("chosen", "both", "two")  # the chosen plan; it and the other; the two-rank plan


def shape(rate_mbit: float, spec: CephaloJobSpec, job_file: Path, work: Path, preset: str,
          run: str = "chosen", probe: str = "full", repeats: int = 3,
          cpu: GpuProfile | None = None) -> Shape:
    """Profile the CPU (unless given its profile), measure the link shaped to `rate_mbit`,
    plan from both, run the plans `run` names (RUNS) across the link."""
    with shaped_nodes(rate_mbit) as nodes:
        cpu = cpu or cpu_profile(job_file, work)
        fit = measure(nodes, ranks_per_node=1, big_elements=256 * 1024, probe=probe,
                      repeats=repeats, model=preset, timeout_seconds=300)
        chosen = plan_with(spec, cpu, fit)
        plans = {"chosen": [chosen], "two": [plan_with(spec, cpu, fit, ranks=2)],
                 "both": [chosen, plan_with(spec, cpu, fit, ranks=3 - chosen.plan.world_size)]
                 }[run]
        outcomes = [run_and_score(spec, p, nodes, job_file, work, rate_mbit) for p in plans]
    plan = chosen.plan
    assert plan.predicted_step_seconds is not None  # plan_with checked
    return Shape(rate_mbit, fit["bandwidth_bytes_per_second"] * 8e-6,
                 fit["reduce_scatter_bandwidth_bytes_per_second"] * 8e-6, plan.world_size,
                 [r.batch_size for r in plan.ranks], plan.predicted_step_seconds, outcomes,
                 fit, cpu)


def prepare(work: Path, preset: str, batch: int, steps: int) -> tuple[CephaloJobSpec, Path]:
    job_file = work / "job.yaml"
    job_file.write_text(yaml.safe_dump(job_data(preset, batch, steps), sort_keys=False))
    return load_job(str(job_file)).spec, job_file


def _row(o: Outcome) -> str:
    return (f"{o.ranks} ({'+'.join(map(str, o.batches))}) | {o.predicted_seconds:.3f} | "
            f"{o.measured_seconds:.3f} | {o.ratio:.2f} | {o.compute_scale:.2f} | "
            f"{o.normalised_ratio:.2f} | {o.described_ratio:.2f} | {o.line_rate_ratio:.2f} | "
            f"{o.described_normalised_ratio:.2f} | {o.line_rate_normalised_ratio:.2f}")


def table(shapes: list[Shape]) -> list[str]:
    rows = ["| shaped | AG / RS fit, Mbit/s (link implied / shaped) | plan | ranks (batch) | "
            "predicted s | measured s | predicted / measured | compute measured / profile | "
            "same, compute as measured | told the rate: predicted / measured | same, at the "
            "full rate | told, compute as measured | at the full rate, compute as measured |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in shapes:
        link = link_figures(s.fit, s.rate_mbit)["link_vs_shaped"]
        fits = f"{s.all_gather_mbit:.0f} / {s.reduce_scatter_mbit:.0f} (link {link:.2f}x)"
        for i, o in enumerate(s.runs):
            which = "chosen" if (o.ranks, o.batches) == (s.chosen_ranks, s.chosen_batches) \
                else "other"
            rows.append(f"| {s.rate_mbit:g} Mbit/s | {fits} | {which} | {_row(o)} |" if i == 0
                        else f"| | | {which} | {_row(o)} |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="300,100,40", help="Mbit/s, comma-separated")
    parser.add_argument("--model", default="gpt-small", help="a preset")
    parser.add_argument("--batch", type=int, default=128, help="global batch size")
    parser.add_argument("--steps", type=int, default=12, help="training steps per run")
    parser.add_argument("--run", choices=RUNS, default="both",
                        help="which plans run: the chosen one, it and the other choice, "
                             "or the two-rank plan")
    parser.add_argument("--probe", choices=PROBES, default="quick",
                        help="how the link is measured: the profiler's measurement without "
                             "(quick, as the test) or with (full) its training-step probe, or "
                             "the operator's network probe")
    args = parser.parse_args()
    reason = unavailable()
    if reason:
        print(f"shaped_plan: {reason}", file=sys.stderr)
        return 2
    shapes = []
    with tempfile.TemporaryDirectory(prefix="shaped-plan-") as tmp:
        spec, job_file = prepare(Path(tmp), args.model, args.batch, args.steps)
        cpu = cpu_profile(job_file, Path(tmp))  # once: start_timed keeps the load out
        for rate in (float(r) for r in args.rates.split(",")):
            shapes.append(shape(rate, spec, job_file, Path(tmp), args.model, args.run,
                                args.probe, cpu=cpu))
            print(json.dumps({k: v for k, v in asdict(shapes[-1]).items() if k != "cpu"}),
                  flush=True)
    print("\n".join(table(shapes)))
    print(f"loadavg {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
