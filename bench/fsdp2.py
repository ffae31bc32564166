"""Cephalo's engine against PyTorch's own FSDP2 (`torch.distributed.fsdp.fully_shard`) on 2
gloo CPU ranks (or one GPU: `--device cuda`, below), in one launch, contenders alternated
step by step.

Every contender trains its own copy of the same GPT (`cephalo.trainer.models`, seeded unit by
unit), on the same data (`DataSource`), with fp32 AdamW (Cephalo's `ShardedAdamW`; FSDP2:
`torch.optim.AdamW`, weight decay on matrices only), the same learning-rate schedule,
global-norm clipping and microbatching. Every step's global loss and gradient norm must
agree across all contenders (the run fails otherwise; AdamW is nearly blind to a gradient's
scale, the norm is not; some norms over the first steps only: `NORM_CHECKED_STEPS` in
`bench/fsdp2_report.py`, which also holds the summary and the text report).
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

On a GPU (`--device cuda`, issue 16 item 4; `bench/fsdp2_device.py`): one NCCL rank on one
GPU (NCCL refuses two ranks on one GPU; gloo has no all-gather or reduce-scatter of CUDA
tensors), the compute regime only, by default `gpt-1.3b` (`--preset`, `--micro-batch`,
`--micro-batches`, `--sequence-length` choose another size) and four contenders (every
contender keeps its own state on the GPU; `--contenders` chooses others); steps timed
between `torch.cuda.synchronize()` calls; memory is CUDA's peak allocated bytes over each
contender's build and first two steps (the equal-memory table uses it). Every contender's
useful TFLOP/s and MFU (against the GPU's dense peak at the run's precision, from the
planner's catalog) are reported. `--precision bf16` runs both engines under the same bf16
autocast over fp32 weights (FSDP2 without a MixedPrecisionPolicy: its bf16 gathers would be
other arithmetic, and one rank has no traffic to halve); losses are then held to a looser
tolerance. `--gather bf16` (with `--precision bf16`, on CPU ranks) gathers parameters in bf16
in both engines: Cephalo's gatherPrecision, FSDP2's MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32).

Run: `python bench/fsdp2.py [--regime compute|communication] [--rounds N]`; `--quick` is a
seconds-long smoke run on a tiny model (CI); `--json` prints the results as JSON. On a GPU:
`python bench/fsdp2.py --device cuda [--preset gpt-1.3b] [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import ModelConfig, preset
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Engine, Layout
from cephalo.trainer.models import UnitModel, build_unit
from cephalo.trainer.optim import learning_rate
from cephalo.trainer.spawn import spawn_ranks
from cephalo.trainer.unit_ops import autocast

# The device half and the report live beside this file (run as a script, or re-imported by
# its ranks).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp2_device import (
    CUDA_CONTENDERS,
    CUDA_DEFAULT_PRESET,
    MEASURED_STEPS,
    UnitCache,
    device_peak,
    measured_build,
    missing_device,
    peak_allocated_bytes,
    peak_memory_kib,
    run_single_gpu,
    synchronize,
    torch_device,
    world_size_for,
)
from fsdp2_report import loss_tolerance, report, summarise

MODEL = dict(family="gpt", num_layers=4, hidden_size=256, num_heads=4, ffn_hidden_size=1024,
             vocab_size=1024)
QUICK_MODEL = dict(family="gpt", num_layers=2, hidden_size=64, num_heads=4,
                   ffn_hidden_size=256, vocab_size=256)
# regime: (sequence length, microbatch size, microbatches per rank); quick sizes second.
REGIMES = {"compute": ((128, 2, 4), (16, 2, 2)), "communication": ((32, 1, 4), (8, 1, 2))}
SPEC = TrainingSpec(steps=10_000, learning_rate=1e-3, weight_decay=0.1, warmup_steps=2,
                    gradient_clip_norm=1.0)
MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class RunOptions:
    """What the command line chooses beyond the regimes (None: the device's default)."""
    device: str = "cpu"  # "cpu" | "cuda"
    precision: str = "fp32"  # "fp32" | "bf16"
    preset: str | None = None
    micro_batch_size: int | None = None
    num_micro_batches: int | None = None
    sequence_length: int | None = None
    contenders: tuple[str, ...] | None = None
    gather: str = "fp32"  # "fp32" | "bf16": what parameter all-gathers move, both engines


@dataclass(frozen=True)
class Setup:
    """Where and how every contender of a rank runs."""
    world: int
    device: torch.device
    precision: str
    units: UnitCache | None = None  # CUDA: seeded units drawn once, copied per contender
    gather: str = "fp32"  # bf16: Cephalo's gatherPrecision, FSDP2's MixedPrecisionPolicy


@dataclass(frozen=True)
class Contender:
    name: str
    kind: str  # "cephalo" | "fsdp2"
    recompute: bool = True  # cephalo
    kept_blocks: int = 0  # cephalo, recompute mode: graphs of the last k blocks kept
    variant: str = "per-microbatch"  # fsdp2
    one_microbatch: bool = False


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


def selected_contenders(num_layers: int, options: RunOptions, quick: bool) -> list[Contender]:
    """The contenders `options` asks for (in the order of `contenders()`), or the default:
    all of them, on a GPU `CUDA_CONTENDERS` unless the model is --quick's tiny one.
    ValueError for an unknown name, or without Cephalo recompute (every other contender's
    losses are held to its)."""
    every = contenders(num_layers)
    names = options.contenders
    if names is None and options.device == "cuda" and (options.preset or not quick):
        names = CUDA_CONTENDERS
    if names is None:
        return every
    unknown = sorted(set(names) - {c.name for c in every})
    if unknown:
        raise ValueError(f"unknown contenders {unknown}; known: "
                         f"{', '.join(c.name for c in every)}")
    if "cephalo recompute" not in names:
        raise ValueError("--contenders must include 'cephalo recompute' (the losses of every "
                         "other contender are compared with its)")
    return [c for c in every if c.name in names]


# A step: (its index, this rank's microbatches) -> (global mean loss, or this rank's loss
# sum as a tensor; gradient norm before clipping, or a DTensor): whatever still needs a
# collective gets it after the clock stopped (`_finish`).
StepFn = Callable[[int, MicroBatches], tuple[Any, Any]]


def model_config(regime: str, quick: bool, options: RunOptions = RunOptions()
                 ) -> tuple[ModelConfig, int, int]:
    """(Model, microbatch size, microbatches per rank): the regime's, unless `options` name a
    preset (with its own sequence length) or override them. ValueError for an unknown
    preset, or a sequence length for an image model."""
    sequence_length, micro, num_micro = REGIMES[regime][1 if quick else 0]
    name = options.preset or (CUDA_DEFAULT_PRESET if options.device == "cuda" and not quick
                              else None)
    fields = preset(name).model_dump() if name is not None else \
        {**(QUICK_MODEL if quick else MODEL), "sequence_length": sequence_length}
    if options.sequence_length is not None:
        if fields["sequence_length"] is None:
            raise ValueError(f"--sequence-length: {name} is not a text model")
        fields["sequence_length"] = options.sequence_length
    return (ModelConfig(**fields), options.micro_batch_size or micro,
            options.num_micro_batches or num_micro)


def cephalo_step(config: ModelConfig, batch: int, micro: int, recompute: bool,
                 kept_blocks: int, setup: Setup) -> StepFn:
    world = setup.world
    layout = Layout([batch] * world, [micro] * world, [1.0 / world] * world,
                    kept_blocks=[kept_blocks] * world)
    # No activation offload (the engine's default on CUDA): a plan offloads only boundaries
    # that do not fit, and FSDP2 offloads nothing.
    with setup.units.installed() if setup.units else contextlib.nullcontext():
        engine = Engine(config, SPEC, layout, recompute=recompute, device=setup.device,
                        precision=setup.precision, offload=False,
                        gather_precision=setup.gather)

    def step(i: int, batches: MicroBatches) -> tuple[float, float]:
        result = engine.step(batches)
        return result.loss, result.grad_norm

    return step


def fsdp2_step(config: ModelConfig, batch: int, variant: str, setup: Setup) -> StepFn:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world, device = setup.world, setup.device
    # --gather bf16: FSDP2's own policy, parameters gathered (and computed) in bf16, gradients
    # reduced in fp32; Cephalo gathers bf16 too (and widens, computing in its precision).
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if setup.gather == "bf16" else MixedPrecisionPolicy()
    mesh = init_device_mesh(device.type, (world,))
    keep = variant != "per-microbatch"  # the no-sync variants keep parameters after forward
    make_unit = setup.units.build_unit if setup.units else build_unit
    units = []
    for i in range(config.num_units):  # one full unit at a time, as the engine builds them
        unit = make_unit(config, i, seed=SPEC.seed).to(device)
        if 0 < i < config.num_units - 1:
            fully_shard(unit, mesh=mesh, reshard_after_forward=not keep, mp_policy=policy)
        units.append(unit)
    model = fully_shard(UnitModel(config, units), mesh=mesh, reshard_after_forward=not keep,
                        mp_policy=policy)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": SPEC.weight_decay},
                                   {"params": others, "weight_decay": 0.0}],
                                  lr=SPEC.learning_rate, betas=(SPEC.adam_beta1, SPEC.adam_beta2),
                                  eps=SPEC.adam_epsilon)
    # FSDP2 averages gradients over ranks; the engine sums per-sample losses weighted 1/B.
    weight = world / (world * batch)

    def step(i: int, batches: MicroBatches) -> tuple[torch.Tensor, Any]:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(SPEC, i)
        local = torch.zeros((), device=device)
        for k, (x, t) in enumerate(batches):
            last = k == len(batches) - 1
            if keep:
                model.set_requires_gradient_sync(last)
                if variant == "no-sync+keep":
                    model.set_reshard_after_backward(last)
            with autocast(device, setup.precision):  # the engine's own (bf16 or nothing)
                losses = model(x, t)
            (losses.sum() * weight).backward()
            local += losses.detach().sum()
        assert SPEC.gradient_clip_norm is not None
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), SPEC.gradient_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return local, norm

    return step


def build(contender: Contender, config: ModelConfig, micro: int, num_micro: int,
          setup: Setup) -> StepFn:
    batch = micro * num_micro
    if contender.kind == "cephalo":
        return cephalo_step(config, batch, batch if contender.one_microbatch else micro,
                            contender.recompute, contender.kept_blocks, setup)
    return fsdp2_step(config, batch, contender.variant, setup)


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


def build_and_step(contender: Contender, config: ModelConfig, micro: int, num_micro: int,
                   batches: list[MicroBatches], one: list[MicroBatches], setup: Setup
                   ) -> Callable[[], None]:
    """What the CPU memory measures wrap: `contender` built and stepped twice (its state is
    freed when the call returns)."""
    def run() -> None:
        step = build(contender, config, micro, num_micro, setup)
        for i in range(2):
            _finish(step(i, (one if contender.one_microbatch else batches)[i]), 1)
    return run


def _freeze_imports() -> None:
    """Move what the imports made (torch, FSDP2, Cephalo: some 300 000 objects) out of the
    collector's reach. The memory measures run `gc.collect()` before every contender, so
    that one's cycles are freed before, not during, the next one's measure; each full
    collection walked every imported object (4.2 of a --quick compute regime's 7.0 CPU
    seconds on one rank), and none of them is a contender's garbage. Contenders are built
    after this, so their cycles are still collected."""
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (imported by the first build)

    gc.collect()  # garbage from the imports goes now: frozen, it would stay for good
    gc.freeze()


def _worker(rank: int, world_size: int, regimes: dict[str, int], quick: bool,
            memory: bool, options: RunOptions) -> dict[str, dict[str, Any]]:
    """Every regime in turn (regime -> timed rounds), all in this one launch."""
    # Kineto (torch's profiler, peak_allocated_bytes) logs two lines to stderr per profile
    # at its default level; above its highest level (read at the first profile) it is quiet.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    if memory:  # only the memory measures collect
        _freeze_imports()
    device = torch_device(options.device)
    setup = Setup(world_size, device, options.precision,
                  UnitCache() if device.type == "cuda" else None, options.gather)
    return {regime: _regime(rank, regime, quick, rounds, memory, options, setup)
            for regime, rounds in regimes.items()}


def _on(device: torch.device, batches: MicroBatches) -> MicroBatches:
    return [(x.to(device), t.to(device)) for x, t in batches]


def _regime(rank: int, regime: str, quick: bool, rounds: int, memory: bool,
            options: RunOptions, setup: Setup) -> dict[str, Any]:
    config, micro, num_micro = model_config(regime, quick, options)
    batch, world, device = micro * num_micro, setup.world, setup.device
    cuda = device.type == "cuda"
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=SPEC.seed)
    start, end = rank * batch, (rank + 1) * batch
    # On CUDA each contender's first steps run inside its memory measure, before the rounds.
    first = MEASURED_STEPS if cuda else 0
    steps = first + rounds + 1  # the first round warms up (allocations, first collectives)
    batches = [_on(device, data.micro_batches(i, start, end, micro)) for i in range(steps)]
    one = [_on(device, data.micro_batches(i, start, end, batch)) for i in range(steps)]
    every = selected_contenders(config.num_layers, options, quick)
    seconds: dict[str, list[float]] = {c.name: [] for c in every}
    losses: dict[str, list[float]] = {c.name: [] for c in every}
    norms: dict[str, list[float]] = {c.name: [] for c in every}

    def take_step(c: Contender, fn: StepFn, r: int) -> float:
        """Step `r` of contender `c`: its seconds (the clock stops when the device is done;
        what `_finish` still needs, collectives, runs after)."""
        dist.barrier()
        synchronize(device)
        began = time.perf_counter()
        value = fn(r, (one if c.one_microbatch else batches)[r])
        synchronize(device)
        elapsed = time.perf_counter() - began
        loss, norm = _finish(value, world * batch)
        losses[c.name].append(loss)
        norms[c.name].append(norm)
        return elapsed

    cuda_peaks: dict[str, int] = {}
    if cuda:
        fns: dict[str, StepFn] = {}
        for c in every:
            fns[c.name], cuda_peaks[c.name] = measured_build(
                lambda c=c: build(c, config, micro, num_micro, setup),
                lambda fn, c=c: [take_step(c, fn, r) for r in range(first)], device)
    else:
        fns = {c.name: build(c, config, micro, num_micro, setup) for c in every}
    for r in range(first, steps):
        order = every[r % len(every):] + every[:r % len(every)]
        for c in order:
            elapsed = take_step(c, fns[c.name], r)
            if r > first:
                seconds[c.name].append(elapsed)
    # The slower rank's time of every step.
    names = [c.name for c in every]
    table = torch.tensor([seconds[n] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    del fns
    peaks: dict[str, list[int]] = {}
    allocated: dict[str, int] = {}
    if memory and cuda:
        allocated = cuda_peaks  # one rank: nothing to reduce
    elif memory:
        runs = [build_and_step(c, config, micro, num_micro, batches, one, setup)
                for c in every]
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
    device_name, peak_flops = device_peak(device, setup.precision)
    return {"seconds": dict(zip(names, table.tolist(), strict=True)), "losses": losses,
            "grad_norms": norms,
            "peak_kib": peaks, "peak_allocated_bytes": allocated,
            "model": config.model_dump(mode="json"),
            "micro_batch_size": micro, "num_micro_batches": num_micro,
            "parameters": config.total_parameters(),
            "device": device.type, "device_name": device_name, "peak_flops": peak_flops,
            "world_size": world, "backend": dist.get_backend(), "precision": setup.precision,
            "gather": setup.gather,
            "flops_per_step": config.training_flops_per_sample() * world * batch}


def _options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> RunOptions:
    """The run's options from the command line; parser.error (exit 2) on a bad one."""
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    for flag in ("micro_batch", "micro_batches", "sequence_length"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.device == "cuda" and args.regime in ("communication", "both"):
        parser.error(f"--regime {args.regime}: --device cuda runs one rank, which has no "
                     "communication; use --regime compute")
    names = None if args.contenders is None else \
        tuple(n.strip() for n in args.contenders.split(",") if n.strip())
    return RunOptions(args.device, args.precision, args.preset, args.micro_batch,
                      args.micro_batches, args.sequence_length, names, args.gather)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: 2 gloo ranks (default); cuda: one NCCL rank on GPU 0")
    parser.add_argument("--regime", choices=[*REGIMES, "both"], default=None,
                        help="default: both on cpu, compute on cuda")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds per regime (default: 6 compute, 12 communication; "
                             "2 with --quick)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds (CI smoke)")
    parser.add_argument("--preset", default=None,
                        help="a model preset (e.g. gpt-1.3b) instead of the bench's GPT; "
                             f"default on cuda without --quick: {CUDA_DEFAULT_PRESET}")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="microbatch size (default: the regime's)")
    parser.add_argument("--micro-batches", type=int, default=None,
                        help="microbatches per rank (default: the regime's)")
    parser.add_argument("--sequence-length", type=int, default=None,
                        help="default: the preset's, else the regime's")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: autocast over fp32 weights, in both engines")
    parser.add_argument("--gather", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: parameters all-gathered in bf16 by both engines (Cephalo's "
                             "gatherPrecision; FSDP2's MixedPrecisionPolicy(param bf16, reduce "
                             "fp32)); use with --precision bf16")
    parser.add_argument("--contenders", default=None,
                        help="comma-separated contender names, 'cephalo recompute' among them "
                             "(default: all; on cuda, but for --quick's tiny model: "
                             f"{', '.join(CUDA_CONTENDERS)})")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the memory measurements (peak RSS and peak allocated; "
                             "on cuda: CUDA peak allocated)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    options = _options(parser, args)
    regime = args.regime or ("compute" if args.device == "cuda" else "both")
    default_rounds = {"compute": 6, "communication": 12}
    rounds = {r: args.rounds or (2 if args.quick else default_rounds[r])
              for r in (REGIMES if regime == "both" else [regime])}
    try:  # the model and contenders every rank will build, checked before any starts
        for r in rounds:
            config = model_config(r, args.quick, options)[0]
            selected_contenders(config.num_layers, options, args.quick)
    except ValueError as e:
        parser.error(str(e).splitlines()[0] if "validation error" not in str(e)
                     else " ".join(str(e).split()))
    missing = missing_device(args.device)
    if missing is not None:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    world = world_size_for(args.device)
    # A compute round is 12 steps of up to ~2 s each on 2 loaded cores.
    timeout_seconds = 600 + 60 * sum(rounds.values())
    if args.device == "cuda":
        raw = run_single_gpu(_worker, rounds, args.quick, not args.no_memory, options,
                             timeout_seconds=timeout_seconds)[0]
    else:
        raw = spawn_ranks(_worker, world, rounds, args.quick, not args.no_memory, options,
                          timeout_seconds=timeout_seconds)[0]
    results = {regime: summarise(value) for regime, value in raw.items()}
    print(json.dumps(results, indent=1) if args.json else
          "\n".join(report(regime, value) for regime, value in results.items()))
    if not all(r["losses_equal"] for r in results.values()):
        print("error: losses differ across contenders beyond the tolerance "
              f"{loss_tolerance(options.precision)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
