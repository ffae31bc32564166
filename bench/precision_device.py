"""fp32, bf16 and fp16 on one device with the engine: step time, TFLOP/s, MFU, loss agreement.

One rank (the engine standalone: no process group, as the profiler times a step) trains the
same seeded model on the same synthetic batches once per compute precision: fp32, bf16
autocast, and fp16 autocast with the engine's dynamic loss scale (issue 36). The three
engines live side by side and take their steps **alternated**, step by step, in an order
that rotates every step (fp32/bf16/fp16, then bf16/fp16/fp32, ...), so warming, clocks and
background load hit each alike; their loss curves are independent (each engine its own
weights and optimizer), so the alternation changes no figure but the timing's fairness.
`--alive K` keeps at most K engines at once (the precisions in groups of K, alternated
within a group): three gpt-1.3b engines (~23 GB each, with their steps' transients) do not
fit one 80 GB H100 safely, and `--alive 1` measures each engine's own peak memory.

On CUDA, per precision: the peak bytes allocated over its group's build and steps
(`max_memory_allocated` above what was allocated before) against the engine's
`memory_estimate_bytes` (the planner's memory model, `cephalo.api.memory`: state, two
gathered units, kept activations; the working set inside one unit comes on top).

Per precision it prints the median seconds of the steps after `--warmup` (the first steps
compile kernels and fill caches), useful TFLOP/s (the model FLOPs of the global batch per
step, `ModelConfig.training_flops_per_sample` as every bench counts them: recompute not
counted, over the median step), MFU against the catalog's dense peak for that precision of
the GPU resolved from its name (`cephalo.planner.cost.catalog`; fp32 is the CUDA-core rate since
TF32 is off for matmuls and convolutions, `pin_fp32_math`, as in the trainer; n/a on a CPU
or a GPU outside the catalog), and the loss agreement with the fp32 run: the largest and the
mean relative per-step loss difference over all steps. For
fp16, the loss scale at the end and the steps the scale skipped (an overflow skips the
optimizer step, so the curve lags fp32 by that many steps).

Run: `python bench/precision_device.py --device cuda --preset gpt-1.3b --batch 8 --steps 8
--alive 1 --output F.json` (what `scripts/device-check.sh` runs on an H100: one ~23 GB engine
at a time, the seeded weights drawn once); `--quick` is gpt-tiny for a few steps on CPU, in seconds
(`tests/trainer/test_bench_precision_device.py`); `--json` prints the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import preset
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Engine, Layout
from cephalo.trainer.precision import (
    PRECISIONS,
    PrecisionError,
    check_precision,
    pin_fp32_math,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp2_device import (  # the bench folder is not a package: its path, above
    UnitCache,
    device_peak,
    measured_build,
    missing_device,
    synchronize,
    throughput,
    torch_device,
)

QUICK = dict(preset="gpt-tiny", batch=8, micro_batch=4, steps=8, warmup=1)


def rotated(names: tuple[str, ...], step: int) -> list[str]:
    """The contenders' order at `step`: rotated by one each step."""
    k = step % len(names)
    return list(names[k:] + names[:k])


def loss_agreement(losses: list[float], reference: list[float]) -> tuple[float, float]:
    """(Largest, mean) relative per-step difference of `losses` to the reference curve."""
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True)]
    return max(rel), sum(rel) / len(rel)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch_device(args.device)
    config = preset(args.preset)
    spec = TrainingSpec(steps=args.steps, learning_rate=args.learning_rate, warmup_steps=1,
                        weight_decay=0.1, adam_epsilon=1e-6, gradient_clip_norm=1.0, seed=0)
    layout = Layout([args.batch], [args.micro_batch], [1.0])
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    cache = UnitCache()  # the seeded units drawn once (1.4 billion numbers for gpt-1.3b)
    losses: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    seconds: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    skipped = dict.fromkeys(PRECISIONS, 0)
    memory: dict[str, dict[str, Any]] = {}
    scales: dict[str, float | None] = {}
    # At most `alive` engines at once (each gpt-1.3b one holds ~23 GB): the precisions in
    # groups of that many, alternated within a group; every curve is compared with fp32's
    # all the same (each engine is seeded alike and sees the same batches).
    groups = [PRECISIONS[i:i + args.alive] for i in range(0, len(PRECISIONS), args.alive)]
    for group in groups:
        def build(group: tuple[str, ...] = group) -> dict[str, Engine]:
            with cache.installed():
                return {p: Engine(config, spec, layout, device=device, precision=p,
                                  standalone=True) for p in group}

        def train(engines: dict[str, Engine]) -> None:
            for step in range(args.steps):
                batches = [(x.to(device), t.to(device)) for x, t in
                           data.micro_batches(step, 0, args.batch, args.micro_batch)]
                for p in rotated(tuple(engines), step):
                    synchronize(device)
                    began = time.perf_counter()
                    result = engines[p].step(batches)  # its loss is a float: synchronised
                    if step >= args.warmup:
                        seconds[p].append(time.perf_counter() - began)
                    losses[p].append(result.loss)
                    skipped[p] += result.skipped
                # Progress on stderr, as it comes: a run cut short still shows it.
                print(f"[step {step + 1}/{args.steps}] " + ", ".join(
                    f"{p} loss {losses[p][-1]:.5f}" + (f" {seconds[p][-1]:.4f} s"
                                                       if step >= args.warmup else "")
                    for p in engines), file=sys.stderr, flush=True)

        # CUDA: the group's peak allocated bytes over its build and its steps, above what
        # was allocated before (torch's exact count); on a CPU not measured (None).
        if device.type == "cuda":
            engines, peak_bytes = measured_build(build, train, device)
        else:
            engines, peak_bytes = build(), None
            train(engines)
        for p, engine in engines.items():
            # The group's peak (its engines' build and steps) against their estimates
            # together: per engine where one is alive at a time (--alive 1).
            memory[p] = {"engines_alive": len(group), "peak_allocated_bytes": peak_bytes,
                         "memory_estimate_bytes": engine.memory_estimate_bytes(),
                         "group_memory_estimate_bytes": sum(
                             e.memory_estimate_bytes() for e in engines.values())}
            scales[p] = engine.scaler.scale if engine.loss_scaling else None
        del engines
    flops_per_step = config.training_flops_per_sample() * args.batch
    median = {p: statistics.median(s) for p, s in seconds.items()}
    rows = {}
    for p in PRECISIONS:
        device_name, peak = device_peak(device, p)
        tflops, mfu = throughput(flops_per_step, {p: median[p]}, 1, peak)
        worst, mean = loss_agreement(losses[p], losses["fp32"])
        rows[p] = {"step_seconds_median": median[p], "tflops": tflops[p],
                   "mfu": None if mfu is None else mfu[p],
                   "peak_tflops": None if peak is None else peak / 1e12,
                   "losses": losses[p], "max_relative_loss_difference": worst,
                   "mean_relative_loss_difference": mean,
                   "loss_scale": scales[p], "skipped_steps": skipped[p], **memory[p]}
    return {"device": device.type, "device_name": device_name,
            "model": {"preset": args.preset, "parameters": config.total_parameters(),
                      "sequence_length": config.sequence_length},
            "batch": args.batch, "micro_batch": args.micro_batch, "steps": args.steps,
            "warmup_steps": args.warmup, "flops_per_step": flops_per_step,
            "order": f"in groups of {args.alive}, alternated step by step, rotating",
            "precisions": rows}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The run's options; parser.error (exit 2, one line) on a bad one, before any work."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--preset", default="gpt-1.3b")
    parser.add_argument("--batch", type=int, default=8, help="samples per step")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="samples per microbatch (default: the whole batch)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="first steps not timed")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="default 3e-3 with --quick (the tiny loss falls), else 3e-4")
    parser.add_argument("--quick", action="store_true",
                        help="gpt-tiny, batch 8 in microbatches of 4, 8 steps, 1 warm-up "
                        "(each where not given)")
    parser.add_argument("--alive", type=int, default=len(PRECISIONS),
                        help="engines alive at once (default all three, alternated): the "
                        "precisions run in groups of this many; 1 gives each engine's own "
                        "peak memory against its estimate")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's; 1 on a shared machine)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--output", type=Path, default=None,
                        help="also write the figures as JSON to this file")
    args = parser.parse_args(argv)
    if args.quick:  # its sizes, where the command line does not give its own
        for key, value in QUICK.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    args.micro_batch = args.micro_batch or args.batch
    args.learning_rate = args.learning_rate or (3e-3 if args.quick else 3e-4)
    for flag in ("batch", "micro_batch", "steps", "threads", "alive"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be 0 or more and below --steps ({args.steps}), "
                     f"got {args.warmup}")
    try:
        preset(args.preset)
    except (KeyError, ValueError) as e:
        parser.error(f"--preset {args.preset}: {str(e).splitlines()[0]}")
    missing = missing_device(args.device)
    if missing is not None:
        parser.error(missing)
    try:
        for p in PRECISIONS:
            check_precision(torch_device(args.device), p)
    except PrecisionError as e:
        parser.error(str(e))
    return args


def report(summary: dict[str, Any]) -> None:
    model = summary["model"]
    timed = summary["steps"] - summary["warmup_steps"]
    print(f"{summary['device_name']} ({summary['device']}): {model['preset']} "
          f"{model['parameters']:,} parameters, batch {summary['batch']} x "
          f"{model['sequence_length']} tokens in microbatches of {summary['micro_batch']}; "
          f"{summary['steps']} steps, median of the last {timed}, "
          f"precisions {summary['order']}")
    print(f"{'precision':<10}{'step s':>9}{'TFLOP/s':>9}{'MFU':>7}{'peak TF':>9}"
          f"{'max rel':>10}{'mean rel':>10}{'final loss':>11}{'scale':>9}{'skipped':>8}")
    for p, r in summary["precisions"].items():
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        peak = "n/a" if r["peak_tflops"] is None else f"{r['peak_tflops']:.1f}"
        print(f"{p:<10}{r['step_seconds_median']:>9.4f}{r['tflops']:>9.3g}{mfu:>7}{peak:>9}"
              f"{r['max_relative_loss_difference']:>10.2e}"
              f"{r['mean_relative_loss_difference']:>10.2e}{r['losses'][-1]:>11.4f}"
              f"{r['loss_scale'] or 'off':>9}{r['skipped_steps']:>8}")
    print("(rel: relative per-step loss difference to fp32 over every step; MFU: useful "
          "TFLOP/s over the catalog's dense peak for that precision)")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    pin_fp32_math()  # fp32 as the trainer computes it (TF32 off), the catalog's fp32 peak
    summary = measure(args)
    if args.output is not None:
        args.output.write_text(json.dumps(summary, indent=1) + "\n")
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        report(summary)


if __name__ == "__main__":
    main()
