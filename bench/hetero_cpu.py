"""The benefit of heterogeneous planning, measured on the real engine (issue 5).

CPU ranks emulate GPUs of the paper's Cluster A (speed by time dilation from the catalog's
peak FLOP/s), scaled to this machine: one rank per core, taking Cluster A's types from the
fastest and the slowest inwards (2 cores: RTX A6000 + P100; 4 cores: A6000, P100, L4, P40).
More ranks than cores measure the CPU scheduler rather than the plan: ranks that finish
together then fight over the cores inside their collectives (`--mix` still allows it). In one run
it profiles the CPU, measures the collectives, plans with Cephalo, and trains the same job
under three plans — Cephalo's, the even split (B/N each, even shards) and compute-
proportional batches with even shards (Whale-like) — then prints measured samples/s, the
measured and predicted ratios, and how well they agree (target: within 15%).

Run: python bench/hetero_cpu.py [--steps 10] [--preset gpt-small] [--batch 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

from cephalo.api import Plan, RankPlan, parse_job
from cephalo.local.devices import select_devices
from cephalo.local.emulate import emulated_profile, plan_emulation
from cephalo.local.launcher import RankEnv, launch
from cephalo.local.runner import build_cluster, contention_factor, profile_devices
from cephalo.planner.baselines import even_assignment, proportional_assignment
from cephalo.planner.evaluate import score
from cephalo.planner.problem import build_problem
from cephalo.planner.solver import solve_problem

# Cluster A's GPU types, fastest and slowest first, so any prefix spans the heterogeneity.
CLUSTER_A_TYPES = ["RTX-A6000", "P100", "L4", "P40"]


def default_mix() -> str:
    cores = max(2, min(len(CLUSTER_A_TYPES), os.cpu_count() or 2))
    return ",".join(CLUSTER_A_TYPES[:cores])
# Emulated memory that fits every plan: this benchmark isolates compute balancing, which
# is what can be measured on a CPU (memory limits would only make the baselines fail).
AMPLE_MEMORY_SCALE = 1e-2


def job_data(preset: str, batch: int, steps: int) -> dict:
    return {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
            "metadata": {"name": "hetero"},
            "spec": {"model": {"preset": preset}, "globalBatchSize": batch,
                     "training": {"steps": steps, "learningRate": 1e-3},
                     "planner": {"profileMicroBatchSizes": [1, 2, 3, 4, 6, 8, 12, 16]},
                     "checkpoint": {"intervalSteps": 10**6}}}


def run_plan(name: str, plan: Plan, ranks: list[RankEnv], work: Path, job_file: Path) -> float:
    run_dir = work / name
    run_dir.mkdir()
    plan_file = run_dir / "plan.json"
    plan_file.write_text(plan.to_json())
    result = launch(plan, ranks, run_dir, job_file, plan_file, lambda records: None,
                    threads_per_rank=1)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed: {result.error_tail}")
    steady = result.records[2:] or result.records
    compute = [statistics.median(r["ranks"][i]["compute_seconds"] for r in steady)
               for i in range(plan.world_size)]
    wait = [statistics.median(r["ranks"][i]["collective_wait_seconds"] for r in steady)
            for i in range(plan.world_size)]
    print(f"  {name}: per-rank compute s " + " ".join(f"{c:.3f}" for c in compute) +
          " | waiting s " + " ".join(f"{w:.3f}" for w in wait) + " | predicted s " +
          " ".join(f"{r.predicted_step_seconds or 0:.3f}"
                   for r in plan.ranks))
    return plan.global_batch_size / statistics.median(r["step_seconds"] for r in steady)


def to_plan(problem, micro: list[int], ell: list[int], even: bool) -> Plan:
    ev = score(problem, micro, ell, even_shards=even)
    if not ev.feasible:
        raise RuntimeError(ev.reason)
    return Plan(global_batch_size=problem.global_batch_size, world_size=problem.world_size,
                predicted_step_seconds=ev.step_seconds,
                predicted_samples_per_second=ev.samples_per_second,
                ranks=[RankPlan(rank=r, gpu=problem.ranks[r][0], batch_size=m * n,
                                micro_batch_size=m, num_micro_batches=n,
                                shard_ratio=ev.shard_ratios[r],
                                predicted_step_seconds=ev.rank_seconds[r])
                       for r, (m, n) in enumerate(zip(micro, ell, strict=True))])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt-small")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--mix", default=default_mix(),
                        help="emulated GPUs, one CPU rank each (default: Cluster A's types, "
                             "one rank per core)")
    args = parser.parse_args()
    devices = select_devices(None, args.mix, gpus=[])
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # Profile afresh: a profile cached while the machine was busy would skew the plan.
        os.environ["XDG_CACHE_HOME"] = str(work / "cache")
        job_file = work / "job.yaml"
        job_file.write_text(yaml.safe_dump(job_data(args.preset, args.batch, args.steps)))
        spec = parse_job(job_data(args.preset, args.batch, args.steps)).spec
        measured = profile_devices(devices, job_file, work, threads=1)
        emu = plan_emulation(measured["cpu"], [d.product for d in devices],
                             spec.model.resolve(), spec.precision,
                             spec.planner.memory_fraction, AMPLE_MEMORY_SCALE)
        contention = contention_factor(devices, emu.dilation)
        profiles = {p: emulated_profile(measured["cpu"], p, emu, contention)
                    for p in emu.dilation}
        for p in sorted(emu.dilation):
            print(f"EMULATION: {emu.describe(p)}")
        problem = build_problem(spec, build_cluster(devices), profiles)
        micro, ell, even, _ = solve_problem(problem)
        plans = {"cephalo": to_plan(problem, micro, ell, even),
                 "even split": to_plan(problem, *even_assignment(problem), True),
                 "compute-proportional": to_plan(problem, *proportional_assignment(problem),
                                                 True)}
        ranks = [RankEnv(d, emu.dilation[d.product], None) for d in devices]
        speed = {}
        print(f"\n{args.preset}, global batch {args.batch}, {len(devices)} emulated GPUs "
              f"({args.mix}) on {len(devices)} CPU ranks, {args.steps} steps per plan")
        print(f"{'plan':<22}{'batches':<18}{'predicted/s':>12}{'measured/s':>12}")
        for name, plan in plans.items():
            speed[name] = run_plan(name.replace(" ", "-"), plan, ranks, work, job_file)
            batches = "/".join(str(r.batch_size) for r in plan.ranks)
            print(f"{name:<22}{batches:<18}{plan.predicted_samples_per_second:>12.2f}"
                  f"{speed[name]:>12.2f}")
    print()
    worst = 0.0
    for base in ("even split", "compute-proportional"):
        predicted = plans["cephalo"].predicted_samples_per_second / \
            plans[base].predicted_samples_per_second
        measured_ratio = speed["cephalo"] / speed[base]
        gap = measured_ratio / predicted - 1
        worst = max(worst, abs(gap))
        print(f"Cephalo vs {base:<21} measured {measured_ratio:.2f}x, predicted "
              f"{predicted:.2f}x (agreement {gap:+.1%})")
    print(f"worst disagreement {worst:.1%} (target 15%: {'met' if worst <= 0.15 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
