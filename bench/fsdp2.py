"""Cephalo's engine against PyTorch's own FSDP2 (`torch.distributed.fsdp.fully_shard`) on 2
gloo CPU ranks, in one launch, contenders alternated step by step.

Every contender trains its own copy of the same GPT (`cephalo.trainer.models`, seeded unit by
unit), on the same data (`DataSource`), with fp32 AdamW (Cephalo's `ShardedAdamW`; FSDP2:
`torch.optim.AdamW`, weight decay on matrices only), the same learning-rate schedule,
global-norm clipping and microbatching. Every step's global loss and gradient norm must
agree across all contenders (the run fails otherwise; AdamW is nearly blind to a gradient's
scale, the norm is not; some norms over the first steps only, see NORM_CHECKED_STEPS).
Contenders, per regime:

* Cephalo, unit-boundary recompute (its default), `keep k/L`: recompute mode with the graphs
  of the last k of the L blocks kept to the backward (a plan's `kept_blocks`, the same on
  both ranks: with several microbatches they run per microbatch with the head, gathered
  once, `cephalo.api.memory.fused_tail_blocks`; with one, their parameters are freed after
  the forward and gathered again), for every k, and without recompute (`recompute=False`:
  every graph and every gathered unit kept);
* FSDP2 (each block `fully_shard`ed, then the root):
  - `per-microbatch`: forward+backward per microbatch, default resharding (gradients
    reduce-scattered after every microbatch);
  - `no-sync`: `reshard_after_forward=False`, `set_requires_gradient_sync(False)` until the
    last microbatch;
  - `no-sync+keep`: the same and `set_reshard_after_backward(False)` until the last one;
  - `one-microbatch`: the rank's whole batch as one microbatch (Cephalo likewise).

Regimes (issue 16): `compute` — 4 layers, hidden 256, seq 128, 4 microbatches of 2 per rank;
`communication` — the same model at seq 32, 4 microbatches of 1 per rank.

Timing: each round every contender takes one step (order rotated per round), after a barrier;
a step's time is the slower rank's. Ratios are Cephalo ÷ FSDP2 per round (paired: same
background load), reported as median and interquartile range.

Memory, two measures (not tracemalloc: it cannot see tensor storage), afterwards, in the
same processes, each contender alone, built and stepped twice, the larger of the two ranks:
* peak RSS: freed heap returned to the OS (`malloc_trim`), the peak-RSS mark reset
  (/proc/self/clear_refs); reported is the rank's peak RSS above its RSS before the build
  (state + transient step memory; and the process's whole peak RSS, torch included, for
  comparison with other reports). Coarse: glibc keeps freed blocks, so a contender that frees
  and re-allocates can show more RSS than one whose allocations peak higher;
* peak allocated: the peak of the bytes torch allocates, net of frees, over the same build
  and two steps (`cephalo.trainer.torch_memory.live_bytes_peak`, torch's profiler memory
  events: the CPU analogue of CUDA's `max_memory_allocated`), in a second pass.

Equal memory budget (issue 16's target): for each FSDP2 variant, the fastest Cephalo
contender (by median step time) with the same microbatching whose peak is at most the
variant's, and its paired step-time ratio; once by peak RSS growth, once by peak allocated.

Run: `python bench/fsdp2.py [--regime compute|communication] [--rounds N]`; `--quick` is a
seconds-long smoke run on a tiny model (CI); `--json` prints the results as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import ModelConfig
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Engine, Layout
from cephalo.trainer.models import UnitModel, build_unit
from cephalo.trainer.optim import learning_rate
from cephalo.trainer.spawn import spawn_ranks
from cephalo.trainer.torch_memory import live_bytes_peak

WORLD = 2
MODEL = dict(family="gpt", num_layers=4, hidden_size=256, num_heads=4, ffn_hidden_size=1024,
             vocab_size=1024)
QUICK_MODEL = dict(family="gpt", num_layers=2, hidden_size=64, num_heads=4,
                   ffn_hidden_size=256, vocab_size=256)
# regime: (sequence length, microbatch size, microbatches per rank); quick sizes second.
REGIMES = {"compute": ((128, 2, 4), (16, 2, 2)), "communication": ((32, 1, 4), (8, 1, 2))}
SPEC = TrainingSpec(steps=10_000, learning_rate=1e-3, weight_decay=0.1, warmup_steps=2,
                    gradient_clip_norm=1.0)
LOSS_RELATIVE_TOLERANCE = 1e-4
# The gradient norms of contenders that round differently from Cephalo recompute (FSDP2's,
# and the one-microbatch ones: other matmul shapes) are held to the tolerance over the first
# steps only: later, AdamW amplifies the rounding differences (measured, communication
# regime: ≤ 8e-6 up to step 12, 1e-4 to 1.3e-3 by step 40; losses ≤ 3e-5 throughout). The
# other Cephalo contenders (recompute, keep k/L, keep: the same arithmetic) are held to
# Cephalo recompute's losses and norms at every step.
NORM_CHECKED_STEPS = 12
MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Contender:
    name: str
    kind: str  # "cephalo" | "fsdp2"
    recompute: bool = True  # cephalo
    kept_blocks: int = 0  # cephalo, recompute mode: graphs of the last k blocks kept
    variant: str = "per-microbatch"  # fsdp2
    one_microbatch: bool = False


FSDP2_VARIANTS = ("fsdp2 per-microbatch", "fsdp2 no-sync", "fsdp2 no-sync+keep")


def contenders(num_layers: int) -> list[Contender]:
    """Every contender for a model of `num_layers` blocks."""
    kept = [Contender(f"cephalo keep {k}/{num_layers}", "cephalo", kept_blocks=k)
            for k in range(1, num_layers + 1)]
    return [
        Contender("cephalo recompute", "cephalo", recompute=True), *kept,
        Contender("cephalo keep", "cephalo", recompute=False),
        Contender("fsdp2 per-microbatch", "fsdp2", variant="per-microbatch"),
        Contender("fsdp2 no-sync", "fsdp2", variant="no-sync"),
        Contender("fsdp2 no-sync+keep", "fsdp2", variant="no-sync+keep"),
        Contender("cephalo recompute 1mb", "cephalo", recompute=True, one_microbatch=True),
        *[Contender(f"{c.name} 1mb", "cephalo", kept_blocks=c.kept_blocks, one_microbatch=True)
          for c in kept],
        Contender("cephalo keep 1mb", "cephalo", recompute=False, one_microbatch=True),
        Contender("fsdp2 one-microbatch", "fsdp2", variant="per-microbatch",
                  one_microbatch=True),
    ]


def pairs(names: list[str]) -> list[tuple[str, str]]:
    """(Cephalo contender, FSDP2 contender) pairs whose step-time ratio is reported: every
    Cephalo contender against every FSDP2 variant with the same microbatching."""
    cephalo = [n for n in names if n.startswith("cephalo") and not n.endswith("1mb")]
    one = [n for n in names if n.startswith("cephalo") and n.endswith("1mb")]
    return [(c, f) for f in FSDP2_VARIANTS for c in cephalo] + \
        [(c, "fsdp2 one-microbatch") for c in one]

# A step: (its index, this rank's microbatches) -> (global mean loss, or this rank's loss
# sum as a tensor; gradient norm before clipping, or a DTensor): whatever still needs a
# collective gets it after the clock stopped (`_finish`).
StepFn = Callable[[int, MicroBatches], tuple[Any, Any]]


def model_config(regime: str, quick: bool) -> tuple[ModelConfig, int, int]:
    sequence_length, micro, num_micro = REGIMES[regime][1 if quick else 0]
    config = ModelConfig(**(QUICK_MODEL if quick else MODEL), sequence_length=sequence_length)
    return config, micro, num_micro


def cephalo_step(config: ModelConfig, batch: int, micro: int, recompute: bool,
                 kept_blocks: int = 0) -> StepFn:
    layout = Layout([batch] * WORLD, [micro] * WORLD, [1.0 / WORLD] * WORLD,
                    kept_blocks=[kept_blocks] * WORLD)
    engine = Engine(config, SPEC, layout, recompute=recompute)

    def step(i: int, batches: MicroBatches) -> tuple[float, float]:
        result = engine.step(batches)
        return result.loss, result.grad_norm

    return step


def fsdp2_step(config: ModelConfig, batch: int, variant: str) -> StepFn:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    keep = variant != "per-microbatch"  # the no-sync variants keep parameters after forward
    units = []
    for i in range(config.num_units):  # one full unit at a time, as the engine builds them
        unit = build_unit(config, i, seed=SPEC.seed)
        if 0 < i < config.num_units - 1:
            fully_shard(unit, mesh=mesh, reshard_after_forward=not keep)
        units.append(unit)
    model = fully_shard(UnitModel(config, units), mesh=mesh, reshard_after_forward=not keep)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": SPEC.weight_decay},
                                   {"params": others, "weight_decay": 0.0}],
                                  lr=SPEC.learning_rate, betas=(SPEC.adam_beta1, SPEC.adam_beta2),
                                  eps=SPEC.adam_epsilon)
    # FSDP2 averages gradients over ranks; the engine sums per-sample losses weighted 1/B.
    weight = WORLD / (WORLD * batch)

    def step(i: int, batches: MicroBatches) -> tuple[torch.Tensor, Any]:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(SPEC, i)
        local = torch.zeros(())
        for k, (x, t) in enumerate(batches):
            last = k == len(batches) - 1
            if keep:
                model.set_requires_gradient_sync(last)
                if variant == "no-sync+keep":
                    model.set_reshard_after_backward(last)
            losses = model(x, t)
            (losses.sum() * weight).backward()
            local += losses.detach().sum()
        assert SPEC.gradient_clip_norm is not None
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), SPEC.gradient_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return local, norm

    return step


def build(contender: Contender, config: ModelConfig, micro: int, num_micro: int) -> StepFn:
    batch = micro * num_micro
    if contender.kind == "cephalo":
        return cephalo_step(config, batch, batch if contender.one_microbatch else micro,
                            contender.recompute, contender.kept_blocks)
    return fsdp2_step(config, batch, contender.variant)


def _finish(value: tuple[Any, Any], global_batch: int) -> tuple[float, float]:
    """(global mean loss, gradient norm) of a step's return value."""
    loss, norm = value
    if not isinstance(loss, float):
        total = loss.detach().double().clone()
        dist.all_reduce(total)
        loss = float(total) / global_batch
    if not isinstance(norm, float):
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return loss, norm


def _rss_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _release_freed_memory() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: a looser baseline
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def build_and_step(contender: Contender, config: ModelConfig, micro: int, num_micro: int,
                   batches: list[MicroBatches], one: list[MicroBatches]) -> Callable[[], None]:
    """What the memory measures wrap: `contender` built and stepped twice (its state is
    freed when the call returns)."""
    def run() -> None:
        step = build(contender, config, micro, num_micro)
        for i in range(2):
            _finish(step(i, (one if contender.one_microbatch else batches)[i]), 1)
    return run


def peak_memory_kib(run: Callable[[], None]) -> tuple[int, int]:
    """(Peak RSS above the pre-run RSS, the process's peak RSS) while `run` runs."""
    _release_freed_memory()
    dist.barrier()
    before = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # reset VmHWM to the current RSS
    run()
    peak = _rss_kib("VmHWM")
    return peak - before, peak


def peak_allocated_bytes(run: Callable[[], None]) -> int:
    """Peak of the bytes torch allocates (net of frees) in this rank while `run` runs; gloo's
    worker threads included (their work carries the caller's profiler state: FSDP2's
    collectives allocate there)."""
    gc.collect()  # the previous contender's cycles: freed before, not during, the profile
    dist.barrier()
    return live_bytes_peak(run)


def _worker(rank: int, world_size: int, regimes: dict[str, int], quick: bool,
            memory: bool) -> dict[str, dict[str, Any]]:
    """Every regime in turn (regime -> timed rounds), all in this one launch."""
    # Kineto (torch's profiler, peak_allocated_bytes) logs two lines to stderr per profile
    # at its default level; above its highest level (read at the first profile) it is quiet.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    return {regime: _regime(rank, regime, quick, rounds, memory)
            for regime, rounds in regimes.items()}


def _regime(rank: int, regime: str, quick: bool, rounds: int, memory: bool
            ) -> dict[str, Any]:
    config, micro, num_micro = model_config(regime, quick)
    batch = micro * num_micro
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=SPEC.seed)
    start, end = rank * batch, (rank + 1) * batch
    steps = rounds + 1  # round 0 warms up (allocations, first collectives)
    batches = [data.micro_batches(i, start, end, micro) for i in range(steps)]
    one = [data.micro_batches(i, start, end, batch) for i in range(steps)]
    every = contenders(config.num_layers)
    fns = {c.name: build(c, config, micro, num_micro) for c in every}
    seconds: dict[str, list[float]] = {c.name: [] for c in every}
    losses: dict[str, list[float]] = {c.name: [] for c in every}
    norms: dict[str, list[float]] = {c.name: [] for c in every}
    for r in range(steps):
        order = every[r % len(every):] + every[:r % len(every)]
        for c in order:
            dist.barrier()
            began = time.perf_counter()
            value = fns[c.name](r, (one if c.one_microbatch else batches)[r])
            elapsed = time.perf_counter() - began
            if r:
                seconds[c.name].append(elapsed)
            loss, norm = _finish(value, WORLD * batch)
            losses[c.name].append(loss)
            norms[c.name].append(norm)
    # The slower rank's time of every step.
    names = [c.name for c in every]
    table = torch.tensor([seconds[n] for n in names], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    del fns
    peaks: dict[str, list[int]] = {}
    allocated: dict[str, int] = {}
    if memory:
        runs = [build_and_step(c, config, micro, num_micro, batches, one) for c in every]
        rss = [peak_memory_kib(run) for run in runs]
        # A second pass, not the same one: the profiler's own records are host memory outside
        # torch's allocator and would inflate the RSS peak (measured at --quick sizes: +5 to
        # +18 MiB per contender, FSDP2's many small ops twice Cephalo's, +40 on the first).
        torch_peaks = [peak_allocated_bytes(run) for run in runs]
        peak_table = torch.tensor([[*kib, b] for kib, b in zip(rss, torch_peaks, strict=True)],
                                  dtype=torch.float64)
        dist.all_reduce(peak_table, op=dist.ReduceOp.MAX)
        rows = dict(zip(names, peak_table.tolist(), strict=True))
        peaks = {n: [int(row[0]), int(row[1])] for n, row in rows.items()}
        allocated = {n: int(row[2]) for n, row in rows.items()}
    return {"seconds": dict(zip(names, table.tolist(), strict=True)), "losses": losses,
            "grad_norms": norms,
            "peak_kib": peaks, "peak_allocated_bytes": allocated,
            "model": config.model_dump(mode="json"),
            "micro_batch_size": micro, "num_micro_batches": num_micro,
            "parameters": config.total_parameters()}


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 \
        else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


def _worst_difference(values: dict[str, list[float]], other_steps: int | None = None
                      ) -> float:
    """Largest relative difference of any contender's step value from Cephalo recompute's
    (over the first `other_steps` steps, when given, for contenders that round
    differently: FSDP2 and one microbatch)."""
    reference = values["cephalo recompute"]

    def steps(name: str) -> int | None:
        return other_steps if name.startswith("fsdp2") or name.endswith("1mb") else None

    return max(abs(v - ref) / abs(ref) for name, series in values.items()
               for v, ref in list(zip(series, reference, strict=True))[:steps(name)])


def _ratio(cephalo: list[float], fsdp: list[float]) -> dict[str, float]:
    """Quartiles and range of the per-round ratios (paired: same round, same load)."""
    paired = [c / f for c, f in zip(cephalo, fsdp, strict=True)]
    low, median, high = _quantiles(paired)
    return {"median": median, "p25": low, "p75": high, "min": min(paired), "max": max(paired)}


def _equal_memory(seconds: dict[str, list[float]], medians: dict[str, float],
                  peak_mib: dict[str, float], measure: str) -> dict[str, dict[str, Any]]:
    """FSDP2 variant -> the fastest Cephalo contender with the same microbatching whose peak
    (`peak_mib`, the `measure`: "rss" or "allocated") is at most the variant's, and its
    ratio (none fits: `cephalo` is None)."""
    out: dict[str, dict[str, Any]] = {}
    for fsdp in [n for n in seconds if n.startswith("fsdp2") and n in peak_mib]:  # --no-memory
        one = fsdp == "fsdp2 one-microbatch"
        fits = [n for n in seconds if n.startswith("cephalo") and n.endswith("1mb") == one
                and peak_mib[n] <= peak_mib[fsdp]]
        best = min(fits, key=lambda n: medians[n], default=None)
        out[fsdp] = {"cephalo": best, f"fsdp2_peak_{measure}_mib": peak_mib[fsdp],
                     f"cephalo_peak_{measure}_mib": None if best is None else peak_mib[best],
                     "ratio": None if best is None else _ratio(seconds[best], seconds[fsdp])}
    return out


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    seconds, losses = result["seconds"], result["losses"]
    worst = max(_worst_difference(losses),
                _worst_difference(result["grad_norms"], NORM_CHECKED_STEPS))
    ratios = {f"{cephalo} / {fsdp}": _ratio(seconds[cephalo], seconds[fsdp])
              for cephalo, fsdp in pairs(list(seconds))}
    medians = {n: statistics.median(s) for n, s in seconds.items()}
    rss_mib = {n: kib[0] / 1024 for n, kib in result["peak_kib"].items()}
    allocated_mib = {n: b / 2**20 for n, b in result["peak_allocated_bytes"].items()}
    return {"step_seconds_median": medians, "ratios": ratios,
            "equal_memory": _equal_memory(seconds, medians, rss_mib, "rss"),
            "equal_memory_allocated": _equal_memory(seconds, medians, allocated_mib,
                                                    "allocated"),
            "max_relative_difference": worst,
            "losses_equal": worst <= LOSS_RELATIVE_TOLERANCE,
            "peak_rss_mib": rss_mib, "peak_allocated_mib": allocated_mib,
            "process_peak_rss_mib": {n: kib[1] / 1024 for n, kib in result["peak_kib"].items()},
            "rounds": len(next(iter(seconds.values()))), "model": result["model"],
            "parameters": result["parameters"], "micro_batch_size": result["micro_batch_size"],
            "num_micro_batches": result["num_micro_batches"]}


def report(regime: str, s: dict[str, Any]) -> str:
    m = s["model"]
    lines = [f"== {regime}: gpt {m['num_layers']} layers, hidden {m['hidden_size']}, seq "
             f"{m['sequence_length']}, {s['parameters']:,} parameters; {WORLD} gloo ranks x "
             f"{s['num_micro_batches']} microbatches of {s['micro_batch_size']}; "
             f"{s['rounds']} alternated rounds",
             f"losses (and gradient norms; FSDP2's and one microbatch's over the first "
             f"{NORM_CHECKED_STEPS} steps) equal across contenders: {s['losses_equal']} "
             f"(max relative difference {s['max_relative_difference']:.1e})"]
    for name, value in s["step_seconds_median"].items():
        memory = s["peak_rss_mib"].get(name)
        extra = (f", peak RSS +{memory:6.1f} MiB/rank over the pre-build RSS (process "
                 f"{s['process_peak_rss_mib'][name]:.0f} MiB), peak allocated "
                 f"{s['peak_allocated_mib'][name]:6.1f} MiB") if memory is not None else ""
        lines.append(f"  {name:>22}: step {1e3 * value:8.1f} ms (median){extra}")
    for pair, r in s["ratios"].items():
        lines.append(f"  {pair:>45}: {_format_ratio(r)}")
    for key, measure, what in [("equal_memory", "rss", "peak RSS growth"),
                               ("equal_memory_allocated", "allocated", "peak allocated")]:
        if s[key]:
            lines.append(f"at equal memory budget by {what} (fastest Cephalo contender whose "
                         f"{what} per rank is at most the FSDP2 variant's):")
        for fsdp, e in s[key].items():
            best = "no Cephalo contender fits" if e["cephalo"] is None else (
                f"{e['cephalo']} ({e[f'cephalo_peak_{measure}_mib']:.1f} MiB) "
                f"{_format_ratio(e['ratio'])}")
            lines.append(f"  {fsdp:>22} ({e[f'fsdp2_peak_{measure}_mib']:.1f} MiB): {best}")
    return "\n".join(lines)


def _format_ratio(r: dict[str, float]) -> str:
    return (f"{r['median']:.2f} (IQR {r['p25']:.2f}-{r['p75']:.2f}, "
            f"range {r['min']:.2f}-{r['max']:.2f})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--regime", choices=[*REGIMES, "both"], default="both")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds per regime (default: 6 compute, 12 communication; "
                             "2 with --quick)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds (CI smoke)")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip both memory measurements (peak RSS, peak allocated)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    default_rounds = {"compute": 6, "communication": 12}
    rounds = {r: args.rounds or (2 if args.quick else default_rounds[r])
              for r in (REGIMES if args.regime == "both" else [args.regime])}
    # A compute round is 12 steps of up to ~2 s each on 2 loaded cores.
    raw = spawn_ranks(_worker, WORLD, rounds, args.quick, not args.no_memory,
                      timeout_seconds=600 + 60 * sum(rounds.values()))[0]
    results = {regime: summarise(value) for regime, value in raw.items()}
    print(json.dumps(results, indent=1) if args.json else
          "\n".join(report(regime, value) for regime, value in results.items()))
    if not all(r["losses_equal"] for r in results.values()):
        print("error: losses differ across contenders beyond the tolerance "
              f"{LOSS_RELATIVE_TOLERANCE}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
