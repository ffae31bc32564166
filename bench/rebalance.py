"""Live rebalancing on the real engine (issue 45): one of two CPU ranks slows down mid-run.

Two gloo ranks, one CPU thread each, train the same job from the same even split; rank 1's
time dilation (`train(time_dilation_from_step=...)`, the engine's emulation of a slower
device: its CPU time x D) switches on at step SLOW_FROM. Three contenders per round, each
its own launch:

- off:   rebalancing off (`spec.planner.rebalance.enabled: false`), the plan's split to the
         end;
- on:    rebalancing on (the default), the same job;
- fresh: a fresh plan for the new speeds: the split that minimises the slowest rank's
         compute for the per-sample compute the last `off` launch measured while slowed
         (`cephalo.planner.feedback.rebalance.best_split`, as a plan for those speeds would
         split the batch with the microbatch sizes fixed), run with rank 1 slowed from its
         first step and rebalancing off.

Contenders alternate in rotated rounds (off on fresh, on fresh off, fresh off on: drift on a
shared machine hits them alike); `fresh` uses the newest `off` figures, from this round or
the one before. Throughput per launch is the median samples/s over its steps (the first
step of a launch and of a split left out: start-up, and the step a change lands on);
"before" is each launch's own steps before the slowdown, "slowed" its steps from the second
slowed one on (for `on` its moves included: what a job gets). Printed per round and as the
median with min-max over rounds:

- off and on during the slowdown over before (same launch): what the slowdown costs;
- on over off during the slowdown: what rebalancing recovers;
- on over fresh, measured (adjacent launches: the machine's load between them counts too);
- on, once its split settled, over what a fresh plan predicts for the speeds the on launch
  measured then (`fresh_prediction`: its step with the slowest rank's compute replaced by the fresh
  split's, same launch): issue 45's ">= 0.9x of a fresh plan for the new speeds".

Run: python bench/rebalance.py [--rounds 3] [--steps 24] [--dilation 6] [--batch 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cephalo.api.job import CephaloJobSpec
from cephalo.planner.feedback.rebalance import best_split, predicted_compute_seconds
from cephalo.trainer.engine import Layout
from cephalo.trainer.run import train
from cephalo.trainer.spawn import spawn_ranks

MICRO_BATCH = 4  # both ranks: the split moves microbatch counts, not sizes
INTERVAL = 2  # steps between rebalancing decisions
SLOW_RANK = 1
CONTENDERS = ("off", "on", "fresh")


def job(batch: int, steps: int, rebalance: bool) -> CephaloJobSpec:
    # A narrow GPT on long samples (the quickstart's shape, smaller): compute per step
    # grows with the batch, so moving samples moves compute.
    return CephaloJobSpec.model_validate({
        "model": {"family": "gpt", "numLayers": 2, "hiddenSize": 96, "numHeads": 4,
                  "ffnHiddenSize": 384, "vocabSize": 256, "sequenceLength": 128},
        "globalBatchSize": batch,
        "training": {"steps": steps, "learningRate": 1e-3, "warmupSteps": 1,
                     "logIntervalSteps": 1, "seed": 0},
        "checkpoint": {"intervalSteps": 100_000},
        "planner": {"rebalance": {"enabled": rebalance, "intervalSteps": INTERVAL,
                                  "minGain": 0.05}}})


def _rank(rank: int, world_size: int, spec: dict[str, Any], split: list[int],
          slow_from: int, dilation: float, progress: str) -> None:
    torch.set_num_threads(1)  # the dilation scales this thread's CPU time
    layout = Layout(batch_sizes=split, micro_batch_sizes=[MICRO_BATCH] * world_size,
                    shard_ratios=[1 / world_size] * world_size)
    train(CephaloJobSpec.model_validate(spec), layout, None, verbose=False,
          progress_file=Path(progress) if rank == 0 else None,
          time_dilation=dilation if rank == SLOW_RANK else 1.0,
          time_dilation_from_step=slow_from, memory_limit_bytes=1 << 40)


@dataclass(frozen=True)
class Launch:
    records: list[dict[str, Any]]

    def rate(self, first: int, last: int) -> float | None:
        """Median samples/s over steps first..last (1-based), leaving out the first step of
        the launch and the first step under each split (a change lands on it)."""
        rates = [r["samples_per_second"] for k, r in enumerate(self.records)
                 if first <= r["step"] <= last and k > 0 and
                 r["batch_sizes"] == self.records[k - 1]["batch_sizes"]]
        return statistics.median(rates) if rates else None

    def final_split(self) -> list[int]:
        return list(self.records[-1]["batch_sizes"])

    def changes(self) -> list[str]:
        return [f"{r['rebalanced']['from']}->{r['rebalanced']['to']}@{r['step']}"
                for r in self.records if "rebalanced" in r]

    def seconds_per_sample(self, first: int) -> list[float | None]:
        """Each rank's median compute seconds per sample over the steps from `first` on."""
        steps = [r for r in self.records if r["step"] >= first]
        return [statistics.median(r["ranks"][i]["compute_seconds"] / r["batch_sizes"][i]
                                  for r in steps)
                for i in range(len(steps[0]["batch_sizes"]))]

    def settled(self, first: int) -> int:
        """The first step from `first` on after the launch's last change of split."""
        moves = [r["step"] for r in self.records if "rebalanced" in r]
        return max([first, *[m + 2 for m in moves]])


def launch(spec: CephaloJobSpec, split: list[int], slow_from: int, dilation: float,
           workdir: Path, name: str) -> Launch:
    progress = workdir / f"{name}.jsonl"
    spawn_ranks(_rank, len(split), spec.model_dump(by_alias=True), split, slow_from, dilation,
                str(progress), timeout_seconds=600)
    records = [json.loads(line) for line in progress.read_text().splitlines() if line.strip()]
    for r in records:
        r.setdefault("batch_sizes", split)  # rebalancing off: the split never moves
    return Launch(records)


def fresh_split(launch: Launch, first: int, batch: int) -> list[int]:
    """The split a fresh plan gives the speeds `launch` measured from step `first` on: the
    least slowest-rank compute for each rank's median compute per sample (microbatch sizes
    fixed, every rank keeping a sample, as the rebalancer solves it)."""
    times = launch.seconds_per_sample(first)
    return best_split(times, batch, [batch] * len(times), [1] * len(times))


def fresh_prediction(launch: Launch, first: int, batch: int) -> float:
    """What a fresh plan for the speeds `launch` measured from step `first` on predicts, in
    samples/s: the launch's median step there with its slowest rank's predicted compute
    replaced by the fresh split's (the rest of the step, collectives and the update, kept
    as measured). From the same launch as the throughput it is compared with, so the
    machine's load moves both alike."""
    times = launch.seconds_per_sample(first)
    split = fresh_split(launch, first, batch)
    in_force = [r for r in launch.records if r["step"] >= first]
    step = statistics.median(r["step_seconds"] for r in in_force)
    rest = step - statistics.median(predicted_compute_seconds(times, r["batch_sizes"])
                                    for r in in_force)
    return batch / (rest + predicted_compute_seconds(times, split))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _spread(values: Sequence[float | None]) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    return f"{statistics.median(got):.2f}x (min {min(got):.2f}, max {max(got):.2f})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--slow-from", type=int, default=6,
                        help="0-based step from which rank 1 is slowed")
    parser.add_argument("--dilation", type=float, default=6.0)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.dilation < 1 or not 2 <= args.slow_from < args.steps - 8 or \
            args.batch < 2 * MICRO_BATCH:
        print(f"bench/rebalance.py: need --rounds >= 1, --dilation >= 1, 2 <= --slow-from < "
              f"--steps - 8 and --batch >= {2 * MICRO_BATCH}; got {vars(args)}", file=sys.stderr)
        return 2
    even = [args.batch // 2, args.batch - args.batch // 2]
    load = os.getloadavg()[0]
    print(f"two gloo CPU ranks, B={args.batch} from {even} (microbatch {MICRO_BATCH}), rank "
          f"{SLOW_RANK} {args.dilation:g}x slower from step {args.slow_from + 1}, {args.steps} "
          f"steps, rebalancing every {INTERVAL} steps; load {load:.2f}", flush=True)
    began = time.monotonic()
    ratios: dict[str, list[float | None]] = {}
    slowed = args.slow_from + 2  # the first slowed step's figures are left out
    with tempfile.TemporaryDirectory() as tmp:
        last_off: Launch | None = None
        for rnd in range(args.rounds):
            got: dict[str, Launch] = {}
            order = CONTENDERS[rnd % 3:] + CONTENDERS[:rnd % 3]
            if last_off is None:  # fresh needs an off launch first
                order = ("off", *[c for c in order if c != "off"])
            for name in order:
                if name == "fresh":
                    assert last_off is not None
                    split = fresh_split(last_off, slowed, args.batch)
                    got[name] = launch(job(args.batch, args.steps, False), split, 0,
                                       args.dilation, Path(tmp), f"{rnd}-{name}")
                else:
                    got[name] = launch(job(args.batch, args.steps, name == "on"), even,
                                       args.slow_from, args.dilation, Path(tmp), f"{rnd}-{name}")
                    if name == "off":
                        last_off = got[name]
            off, on, fresh = got["off"], got["on"], got["fresh"]
            before = {k: got[k].rate(1, args.slow_from) for k in ("off", "on")}
            during_off = off.rate(slowed, args.steps)
            # With rebalancing: every slowed step, its moves included (what a job gets).
            during_on = on.rate(slowed, args.steps)
            during_fresh = fresh.rate(1, args.steps)
            # A fresh plan for the speeds the on launch measured under the split it settled
            # on (all its slowed steps when it never settled).
            settled = on.settled(slowed)
            if settled >= args.steps:
                settled = slowed
            predicted_fresh = fresh_prediction(on, settled, args.batch)
            settled_on = on.rate(settled, args.steps)
            row = {"off slowed / before": _ratio(during_off, before["off"]),
                   "on slowed / before": _ratio(during_on, before["on"]),
                   "on / off, slowed": _ratio(during_on, during_off),
                   "on / fresh measured": _ratio(during_on, during_fresh),
                   "on settled / fresh predicted": _ratio(settled_on, predicted_fresh)}
            for key, value in row.items():
                ratios.setdefault(key, []).append(value)
            changes = ", ".join(on.changes()) or "no change"
            print(f"round {rnd + 1} ({' '.join(order)}): samples/s before {before['off']:.1f} "
                  f"(off) {before['on']:.1f} (on); slowed: off {during_off:.1f}, on "
                  f"{during_on:.1f} ({settled_on:.1f} from step {settled}) on "
                  f"{on.final_split()} ({changes}); fresh "
                  f"{fresh.final_split()} measured {during_fresh:.1f}, predicted for the on "
                  f"launch's speeds {predicted_fresh:.1f}", flush=True)
    print(f"\nover {args.rounds} round(s), median (min, max) of the per-round ratios; "
          f"{time.monotonic() - began:.0f} s, load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    for key, values in ratios.items():
        print(f"  {key:<28} {_spread(values)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
