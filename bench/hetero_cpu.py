"""Is the planner's choice right on the real engine? (issue 5, issue 15)

CPU ranks emulate GPUs of the paper's Cluster A (speed by time dilation from the catalog's
peak FLOP/s), scaled to this machine: one rank per core, taking Cluster A's types from the
fastest and the slowest inwards (2 cores: RTX A6000 + P100; 4 cores: A6000, P100, L4, P40).
More ranks than cores measure the CPU scheduler rather than the plan (`--mix` still allows
it). In one run it profiles the CPU, measures the collectives, plans with Cephalo
(`cephalo.planner.solve`: its GPU subset, per-unit shards and recompute mode, run as
returned) and trains the same job under that plan and under plans it rejected:

- baselines on every GPU: the even split (B/N each, even shards) and compute-proportional
  batches with even shards (Whale-like);
- perturbations close to the choice: one sample moved from the slowest rank to the fastest
  and back, one kept block more on the slowest rank and one fewer on the rank keeping the
  most, every block recomputed, the other recompute mode (its best plan on the same GPUs),
  the other sharding (all-even against the chosen) and, if the planner left a GPU idle, its
  plan on all GPUs.

Contenders alternate in rounds (A B C, B C A, ...: drift on a shared machine hits them all
alike). Each launch's first steps are warm-up; the rest are pooled per contender. Printed:
predicted and measured (median, IQR, min-max of the round medians) step seconds, the ratio
to the chosen plan, and a verdict: a contender beats the chosen plan only if its median is
below the chosen's by more than the noise, the larger of the two IQRs. An absolute
cost-model target is not checked here: a shared 2-core machine cannot measure it.

Run: python bench/hetero_cpu.py [--quick] [--all-gpus] [--rounds 3] [--steps 6]
                                [--preset gpt-small] [--batch 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cephalo.api import Plan, parse_job
from cephalo.local.devices import LocalDevice, select_devices
from cephalo.local.emulate import emulated_profile, plan_emulation
from cephalo.local.ranks import RankEnv, launch
from cephalo.local.runner import build_cluster, contention_factor, profile_devices
from cephalo.planner import solve
from cephalo.planner.search.baselines import even_assignment, proportional_assignment
from cephalo.planner.search.problem import build_problem
from cephalo.planner.search.solver import solve_fixed
from cephalo.planner.search.unit_shards import EvenUnits

# The candidates live beside this file (run as a script or loaded from its path).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hetero_candidates import (
    Candidate,
    chosen_candidate,
    even_units_of,
    kept_variants,
    mode_problem,
    moved_sample,
    other_microbatching,
    to_plan,
)

__all__ = ["Candidate", "chosen_candidate", "even_units_of", "mode_problem", "to_plan"]

# Cluster A's GPU types, fastest and slowest first, so any prefix spans the heterogeneity.
CLUSTER_A_TYPES = ["RTX-A6000", "P100", "L4", "P40"]
# Emulated memory that fits every plan: this benchmark isolates compute balancing, which
# is what can be measured on a CPU (memory limits would only make the baselines fail).
AMPLE_MEMORY_SCALE = 1e-2
WARMUP_STEPS = 2  # per launch: first steps pay allocation and thread start-up
CHOSEN = "cephalo (chosen)"
# A contender whose best round is this much slower than the chosen plan's worst is not run
# again: more rounds cannot change the verdict, and launches are what a run's time goes on.
CLEARLY_SLOWER = 1.5


def default_mix() -> str:
    cores = max(2, min(len(CLUSTER_A_TYPES), os.cpu_count() or 2))
    return ",".join(CLUSTER_A_TYPES[:cores])


def job_data(preset: str, batch: int, steps: int, micro_sizes: list[int],
             choose_gpus: bool = True) -> dict:
    return {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
            "metadata": {"name": "hetero"},
            "spec": {"model": {"preset": preset}, "globalBatchSize": batch,
                     "training": {"steps": steps, "learningRate": 1e-3},
                     "planner": {"profileMicroBatchSizes": micro_sizes,
                                 "chooseGpus": choose_gpus},
                     "checkpoint": {"intervalSteps": 10**6}}}


@dataclass
class Contender:
    name: str
    plan: Plan
    ranks: list[RankEnv]
    samples: list[float] = field(default_factory=list)  # steady step seconds, all rounds
    round_medians: list[float] = field(default_factory=list)
    rank_compute: dict[int, list[float]] = field(default_factory=dict)  # steady steps

    def per_rank(self) -> str:
        return " ".join(
            f"r{r} {statistics.median(self.rank_compute[r]):.3f}/"
            f"{p.predicted_step_seconds or 0:.3f}" for r, p in enumerate(self.plan.ranks)
            if self.rank_compute.get(r))


def contenders(spec, cluster, profiles, devices: list[LocalDevice],
               rank_env) -> tuple[list[Contender], list[str]]:
    """The chosen plan first, then every distinct rejected one that fits; and notes."""
    full = build_problem(spec, cluster, profiles)
    everything = list(range(full.world_size))
    chosen_plan = solve(spec, cluster, profiles)
    chosen = chosen_candidate(full, chosen_plan)
    notes: list[str] = []
    rebuilt = to_plan(chosen)
    if isinstance(rebuilt, str) or abs(rebuilt.predicted_step_seconds -
                                      chosen_plan.predicted_step_seconds) > 1e-9 * max(
                                          1.0, chosen_plan.predicted_step_seconds):
        notes.append("warning: the chosen plan read back does not score as the planner "
                     "priced it; perturbations may be off")
    found: list[tuple[str, Candidate | None]] = []
    for name, assign in (("even split", even_assignment(full)),
                         ("compute-proportional", proportional_assignment(full))):
        found.append((name, Candidate(full, everything, *assign,
                                      EvenUnits.all(full.model.num_layers), True)))
    secs = chosen.scored().rank_seconds
    slow = max(range(len(secs)), key=lambda r: secs[r])
    fast = min(range(len(secs)), key=lambda r: secs[r])
    if slow != fast:
        found.append(("1 sample slowest->fastest", moved_sample(chosen, slow, fast)))
        found.append(("1 sample fastest->slowest", moved_sample(chosen, fast, slow)))
    found.append((f"next microbatching, rank {slow}", other_microbatching(chosen, slow)))
    found.extend(kept_variants(chosen, slow))
    other = mode_problem(full, chosen.keep, not chosen.recompute)
    try:
        sol = solve_fixed(other)
        found.append((f"recompute={'off' if chosen.recompute else 'on'} (its best)",
                      Candidate(other, chosen.keep, sol.micro, sol.ell, sol.even_units,
                                not chosen.recompute, sol.kept or [])))
    except Exception as exc:  # the other mode may not fit: say so, go on
        notes.append(f"other recompute mode skipped: {exc}")
    layers = full.model.num_layers
    flipped = EvenUnits.none() if chosen.even.is_all(layers) else EvenUnits.all(layers)
    if len(chosen.keep) > 1:  # one rank holds everything: no sharding to vary
        found.append(("all-skewed shards" if flipped == EvenUnits.none() else
                      "all-even shards", Candidate(chosen.problem, chosen.keep, chosen.micro,
                                                   chosen.ell, flipped, chosen.recompute,
                                                   chosen.kept)))
    if chosen_plan.idle_gpus:
        all_plan = solve(spec, cluster, profiles, choose_gpus=False)
        found.append(("planner on all GPUs", chosen_candidate(full, all_plan)))
    result = [Contender(CHOSEN, chosen_plan, [rank_env(devices[i]) for i in chosen.keep])]
    seen = {chosen.key(): CHOSEN}
    for name, cand in found:
        if cand is None:
            notes.append(f"{name}: no such plan")
            continue
        if cand.key() in seen:
            notes.append(f"{name}: the same plan as {seen[cand.key()]}")
            continue
        plan = to_plan(cand)
        if isinstance(plan, str):
            notes.append(f"{name}: does not fit ({plan})")
            continue
        seen[cand.key()] = name
        result.append(Contender(name, plan, [rank_env(devices[i]) for i in cand.keep]))
    return result, notes


def run_once(c: Contender, round_no: int, work: Path, job_file: Path) -> None:
    run_dir = work / f"{c.name.replace(' ', '_').replace('>', '')[:40]}-{round_no}"
    run_dir.mkdir()
    plan_file = run_dir / "plan.json"
    plan_file.write_text(c.plan.to_json())
    result = launch(c.plan, c.ranks, run_dir, job_file, plan_file, lambda records: None,
                    threads_per_rank=1)
    if result.returncode != 0:
        raise RuntimeError(f"{c.name} failed: {result.error_tail}")
    steady = [r["step_seconds"] for r in result.records[WARMUP_STEPS:]] or \
        [r["step_seconds"] for r in result.records]
    c.samples.extend(steady)
    c.round_medians.append(statistics.median(steady))
    for r in range(c.plan.world_size):  # why a plan is slow: which rank computes longest
        c.rank_compute.setdefault(r, []).extend(
            rec["ranks"][r]["compute_seconds"] for rec in result.records[WARMUP_STEPS:])


def clearly_slower(c: Contender, chosen: Contender) -> bool:
    """Decided without more rounds: even its fastest round is slower than the chosen
    plan's slowest by CLEARLY_SLOWER, over two rounds of each (one round can be a load
    spike on a shared machine), or by twice that after one."""
    if c is chosen or not c.round_medians or not chosen.round_medians:
        return False
    rounds = min(len(c.round_medians), len(chosen.round_medians))
    factor = CLEARLY_SLOWER if rounds >= 2 else 2 * CLEARLY_SLOWER
    return min(c.round_medians) > factor * max(chosen.round_medians)


def iqr(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[2] - q[0]


def describe(plan: Plan) -> str:
    shards = "even" if all(abs(r.shard_ratio - 1 / plan.world_size) < 1e-12
                           for r in plan.ranks) and not plan.unit_shard_ratios else (
        f"mixed({len(plan.unit_shard_ratios)} units listed)" if plan.unit_shard_ratios
        else "skewed")
    batches = "/".join(f"{r.micro_batch_size}x{r.num_micro_batches}" for r in plan.ranks)
    kept = "" if not any(r.kept_blocks for r in plan.ranks) else \
        " kept " + "/".join(str(r.kept_blocks) for r in plan.ranks)
    return f"{batches} {shards}{' norecomp' if plan.recompute is False else kept}"


def report(field_: list[Contender]) -> list[str]:
    chosen = field_[0]
    base = statistics.median(chosen.samples)
    lines = [f"{'contender':<28}{'plan (m x l per rank)':<34}{'pred s':>8}{'meas s':>8}"
             f"{'IQR':>7}{'round min-max':>16}{'runs':>5}{'ratio':>7}"]
    beaten = []
    for c in field_:
        med = statistics.median(c.samples)
        spread = f"{min(c.round_medians):.3f}-{max(c.round_medians):.3f}"
        lines.append(f"{c.name:<28}{describe(c.plan):<34}{c.plan.predicted_step_seconds:>8.3f}"
                     f"{med:>8.3f}{iqr(c.samples):>7.3f}{spread:>16}{len(c.round_medians):>5}"
                     f"{med / base:>7.2f}")
        noise = max(iqr(c.samples), iqr(chosen.samples))
        if c is not chosen and med < base - noise:
            predicted_gap = c.plan.predicted_step_seconds / \
                chosen.plan.predicted_step_seconds - 1
            beaten.append(f"{c.name} ({med:.3f} s < {base:.3f} - {noise:.3f} s; predicted "
                          f"{predicted_gap:+.1%})")
    lines.append("")
    lines.append("per rank, compute s measured/predicted step s (median of steady steps):")
    lines.extend(f"  {c.name:<28}{c.per_rank()}" for c in field_)
    lines.append("")
    lines.append("verdict: chosen plan is fastest within noise" if not beaten else
                 "verdict: contenders beat the chosen plan: " + "; ".join(beaten))
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=None, help="default gpt-small (--quick: gpt-tiny)")
    parser.add_argument("--batch", type=int, default=None, help="default 32 (--quick: 8)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps per launch, the first {WARMUP_STEPS} warm-up "
                             "(default 6; --quick: 4)")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (--quick: 2)")
    parser.add_argument("--all-gpus", action="store_true",
                        help="plan with planner.chooseGpus false: every GPU gets a rank (the "
                             "perturbations then vary a multi-rank plan)")
    parser.add_argument("--quick", action="store_true", help="a short run (~40 s)")
    parser.add_argument("--mix", default=default_mix(),
                        help="emulated GPUs, one CPU rank each (default: Cluster A's types, "
                             "one rank per core)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.preset = args.preset or ("gpt-tiny" if quick else "gpt-small")
    args.batch = args.batch or (8 if quick else 32)
    args.steps = args.steps or (4 if quick else 6)
    args.rounds = args.rounds or (2 if quick else 3)
    if args.steps <= WARMUP_STEPS or args.rounds < 1 or args.batch < 1:
        parser.error(f"--steps must exceed {WARMUP_STEPS}; --rounds and --batch at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    devices = select_devices(None, args.mix, gpus=[])
    # Profiling every size costs seconds each: --quick profiles the powers of two only.
    sizes = [1, 2, 4, 8] if args.quick else [1, 2, 3, 4, 6, 8, 12, 16]
    # No rank's microbatch exceeds the global batch: profiling larger sizes is wasted time.
    sizes = [s for s in sizes if s <= args.batch] or [1]
    data = job_data(args.preset, args.batch, args.steps, sizes, not args.all_gpus)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # Profile afresh: a profile cached while the machine was busy would skew the plan.
        os.environ["XDG_CACHE_HOME"] = str(work / "cache")
        job_file = work / "job.yaml"
        job_file.write_text(yaml.safe_dump(data))
        spec = parse_job(data).spec
        measured = profile_devices(devices, job_file, work, threads=1)
        emu = plan_emulation(measured["cpu"], [d.product for d in devices],
                             spec.model.resolve(), spec.precision,
                             spec.planner.memory_fraction, AMPLE_MEMORY_SCALE)
        contention = contention_factor(devices, emu.dilation)
        profiles = {p: emulated_profile(measured["cpu"], p, emu, contention)
                    for p in emu.dilation}
        for p in sorted(emu.dilation):
            print(f"EMULATION: {emu.describe(p)}")
        print(f"profiled in {time.monotonic() - started:.0f} s")
        field_, notes = contenders(spec, build_cluster(devices), profiles, devices,
                                   lambda d: RankEnv(d, emu.dilation[d.product], None))
        print(f"\n{args.preset}, global batch {args.batch}, {len(devices)} emulated GPUs "
              f"({args.mix}) on {len(devices)} CPU ranks; {len(field_)} contenders x "
              f"{args.rounds} rounds x {args.steps} steps ({WARMUP_STEPS} warm-up)")
        for idle in field_[0].plan.idle_gpus:
            print(f"planner left {idle.count} {idle.gpu} idle: {idle.reason}")
        for note in notes:
            print(f"  note: {note}")
        for round_no in range(args.rounds):
            shift = round_no % len(field_)  # rotate who goes first: drift hits all alike
            for c in field_[shift:] + field_[:shift]:
                if round_no and clearly_slower(c, field_[0]):
                    continue
                run_once(c, round_no, work, job_file)
    print(f"\nmeasured in {time.monotonic() - started:.0f} s in all")
    print("\n".join(report(field_)))
    print("(meas s: median of the steady steps of all runs; runs: launches, fewer where "
          f"a contender was already clearly slower, {CLEARLY_SLOWER}x over two rounds or "
          f"{2 * CLEARLY_SLOWER}x over one; ratio: measured median / the chosen plan's; "
          "noise per pair: the larger IQR)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
