"""The profiler: `python -m cephalo.trainer.profile --job JOB.yaml --output profile.json`.

Measures, on the local device, what the planner's cost model needs for one GPU type and one
model (paper: "The profiler…", "Compute Latency Model", "Memory Utilization Model"):

* for each microbatch size m: one block's checkpointed forward and recompute+backward
  seconds, and the embedding + head + loss + data seconds, all through the engine's own unit
  functions (`cephalo.trainer.unit_ops`), median of repeats after a warm-up, the sizes
  interleaved; GPU timing is synchronised around CUDA work, CPU uses a monotonic clock;
  forward passes also run with two microbatches, which separates what the engine pays once
  per unit pass from what it pays per microbatch;
* compute memory per m: on GPU the allocator's peak beyond what was allocated before (the
  training state), on CPU the bytes a step really holds — tensors saved by autograd during the
  recompute, plus the boundary tensors and the gathered unit buffers — counted exactly;
* the AdamW step (per parameter and fixed), and one real single-rank training step with one
  sample: what it takes beyond the cost model's prediction from the above is the engine's own
  per-step work (inputs, buffers, logging), kept as the profile's step overhead;
* device facts from NVML (nvidia-ml-py) where a GPU exists; the product normalised to the
  planner's catalog name;
* with `--collectives` under torchrun: AllGather and ReduceScatter seconds at a unit's size
  and a large size, even and uneven shards, each fitted to the ring model's bandwidth and
  latency, the step's small all-reduce, and a probe: real training steps with one sample per
  rank, which the planner uses to calibrate its collective model.

Profiles are cached by (product, architecture, precision, torch version).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from cephalo.api.job import CephaloJobSpec, TrainingSpec, load_job
from cephalo.api.models import ModelConfig
from cephalo.api.profile import (
    TERMINATION_MESSAGE_LIMIT_BYTES,
    CollectiveProfile,
    GpuProfile,
    ProfilePoint,
    model_key,
    profile_cache_key,
)
from cephalo.planner.costmodel import STATE_BYTES_PER_PARAMETER, single_rank_step_seconds
from cephalo.trainer.data import DataSource
from cephalo.trainer.device_info import DeviceFacts, device_facts
from cephalo.trainer.flat import FlatUnit
from cephalo.trainer.models import build_model
from cephalo.trainer.optim import ShardedAdamW
from cephalo.trainer.unit_ops import (
    backward_unit,
    forward_unit,
    head_forward_backward,
)

FP32_BYTES = 4
# A probe step holds the training state of the whole model (or of an even shard across the
# probing ranks): measured only where that is at most this share of the device's memory.
PROBE_MEMORY_FRACTION = 0.25
TERMINATION_LOG = "/dev/termination-log"
# Part of the cache key: bump it whenever what a profile measures changes, so that profiles
# cached by an older profiler are measured again instead of silently lacking fields.
PROFILE_FORMAT = 4


def _median(fn: Callable[[], float], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(fn() for _ in range(repeats))


def _once_per_pass(med: dict[tuple[str, int], float], series: str, sizes) -> float:
    """The part of a one-microbatch pass that a second microbatch does not repeat:
    t1 - (t2 - t1) per size, the median over sizes, within [0, the smallest t1]."""
    fixed = statistics.median(2 * med[f"{series}1", m] - med[f"{series}2", m] for m in sizes)
    return min(max(0.0, fixed), min(med[f"{series}1", m] for m in sizes))


class SavedBytes:
    """Counts the distinct storage bytes autograd saves for backward (CPU memory model)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._seen: set[int] = set()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return tensor

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class Measured:
    """What `UnitProfiler.measure` found: one point per microbatch size, and the parts of a
    forward pass paid once per unit pass whatever the number of microbatches."""

    points: list[ProfilePoint]
    block_forward_fixed_seconds: float
    other_forward_fixed_seconds: float
    extra_seconds: dict[str, float]  # median of each extra run (see `measure`)


class UnitProfiler:
    """Times the units of one model on one device through the engine's unit functions."""

    def __init__(self, config: ModelConfig, precision: str, device: torch.device,
                 seed: int = 0) -> None:
        self.config = config
        self.precision = precision
        self.device = device
        model = build_model(config, seed=seed)
        self.units = []
        self.fulls = []
        # Profile the embedding, the first block and the head; blocks are identical.
        for index in (0, 1, config.num_layers + 1):
            flat = FlatUnit(index, model.units[index], [1.0], 0)
            self.fulls.append(flat.flatten().to(device))
            flat.detach_parameters()
            flat.module.to(device)
            self.units.append(flat)
        from cephalo.api.job import DataSpec, SyntheticData

        self.data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed)
        self.max_unit_bytes = max(u.numel for u in self.units) * FP32_BYTES

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, fn: Callable[[], object]) -> float:
        self._sync()
        started = time.perf_counter()
        fn()
        self._sync()
        return time.perf_counter() - started

    def measure(self, sizes: Sequence[int], repeats: int, warmup: int,
                extra: dict[str, Callable[[], object]] | None = None) -> Measured:
        """Median seconds per microbatch size of a block's forward and recompute+backward,
        and of the embedding + data + head + loss, as the engine runs them.

        Repeats go round-robin over the sizes, so that a machine whose speed drifts (clock
        boost, a neighbour on a shared core) shifts every size alike instead of bending the
        curve. Forward passes run once with one microbatch and once with two: the engine
        runs all of a rank's microbatches through a unit in one pass, so what the second
        microbatch adds is the per-microbatch cost and the rest is paid once per pass.
        `extra` runs are timed once per round too, so they see the same drift."""
        emb, block, head = self.units
        emb_full, block_full, head_full = self.fulls
        cases = {}
        for m in sorted(set(sizes)):
            inputs, targets = self.data.batch(0, 0, 2 * m)
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            xs, ts = [inputs[:m], inputs[m:]], [targets[:m], targets[m:]]
            hiddens = forward_unit(emb, emb_full, xs, self.device, self.precision)
            cases[m] = (xs, ts, hiddens, torch.ones_like(hiddens[0]))
        samples: dict[tuple[str, int], list[float]] = {}

        def block_forward(m: int, ell: int) -> None:
            forward_unit(block, block_full, cases[m][2][:ell], self.device, self.precision)

        def block_backward(m: int) -> None:
            _, _, hiddens, grad = cases[m]
            backward_unit(block, block_full, hiddens[0], grad, self.device, self.precision,
                          needs_input_grad=True)
            block_full.grad = None

        def other_forward(m: int, ell: int) -> None:
            self.data.micro_batches(0, 0, ell * m, m)  # the data a rank reads
            forward_unit(emb, emb_full, cases[m][0][:ell], self.device, self.precision)

        def other_backward(m: int) -> None:
            xs, ts, hiddens, _ = cases[m]
            _, grad = head_forward_backward(head, head_full, hiddens[0], ts[0], 1.0 / m,
                                            self.device, self.precision)
            backward_unit(emb, emb_full, xs[0], grad, self.device, self.precision,
                          needs_input_grad=False)
            head_full.grad = None
            emb_full.grad = None

        runs: list[tuple[str, Callable[[int], None]]] = [
            ("bf1", lambda m: block_forward(m, 1)), ("bf2", lambda m: block_forward(m, 2)),
            ("bb", block_backward),
            ("of1", lambda m: other_forward(m, 1)), ("of2", lambda m: other_forward(m, 2)),
            ("ob", other_backward)]
        for i in range(warmup + repeats):
            for m in cases:
                for name, run in runs:
                    seconds = self._timed(lambda run=run, m=m: run(m))
                    if i >= warmup:
                        samples.setdefault((name, m), []).append(seconds)
            for name, fn in (extra or {}).items():
                seconds = self._timed(fn)
                if i >= warmup:
                    samples.setdefault((name, 0), []).append(seconds)
        med = {key: statistics.median(values) for key, values in samples.items()}
        points = [ProfilePoint(
            micro_batch_size=m, block_forward_seconds=med["bf1", m],
            block_backward_seconds=med["bb", m], other_forward_seconds=med["of1", m],
            other_backward_seconds=med["ob", m],
            compute_memory_bytes=self.compute_memory_bytes(m, cases[m][0][0], cases[m][1][0],
                                                           cases[m][2][0]))
            for m in cases]
        return Measured(points, _once_per_pass(med, "bf", cases), _once_per_pass(med, "of", cases),
                        {name: med[name, 0] for name in extra or {}})

    def compute_memory_bytes(self, m: int, inputs: torch.Tensor, targets: torch.Tensor,
                             hidden: torch.Tensor) -> int:
        """Peak bytes of a step beyond the training state, for microbatch size m.

        The engine holds at most the gathered current unit, the prefetched next one and the
        current unit's full gradient (3 unit buffers), plus the larger of a block's and the
        head's working set for one microbatch (they never overlap)."""
        fixed = 3 * self.max_unit_bytes
        if self.device.type == "cuda":
            return fixed + max(self._cuda_peak(lambda: self._block_step(hidden)),
                               self._cuda_peak(lambda: self._head_step(hidden, targets, m)))
        block_bytes = self._counted(lambda: self._block_step(hidden))
        head_bytes = self._counted(lambda: self._head_step(hidden, targets, m))
        return fixed + max(block_bytes, head_bytes)

    def _block_step(self, hidden: torch.Tensor) -> int:
        _, block, _ = self.units
        full = self.fulls[1]
        (out,) = forward_unit(block, full, [hidden], self.device, self.precision)
        grad_out = torch.ones_like(out)
        grad_in = backward_unit(block, full, hidden, grad_out, self.device, self.precision,
                                needs_input_grad=True)
        full.grad = None
        # Boundary tensors alive during the backward: input, output gradient, input gradient.
        return _nbytes(hidden, grad_out, grad_in)

    def _head_step(self, hidden: torch.Tensor, targets: torch.Tensor, m: int) -> int:
        _, _, head = self.units
        full = self.fulls[2]
        _, grad = head_forward_backward(head, full, hidden, targets, 1.0 / m, self.device,
                                        self.precision)
        full.grad = None
        return _nbytes(hidden, grad)

    def _counted(self, step: Callable[[], int]) -> int:
        counter = SavedBytes()
        with counter.hooks():
            boundary = step()
        return counter.bytes + boundary

    def _cuda_peak(self, step: Callable[[], int]) -> int:
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        step()
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - before)


OPTIMIZER_PROBE_ELEMENTS = 4 * 1024**2


def optimizer_timing(config: ModelConfig, spec: TrainingSpec, device: torch.device,
                     repeats: int, warmup: int) -> tuple[float, float]:
    """(seconds per parameter, fixed seconds per step) of the engine's AdamW + gradient norm
    with the job's settings: one large shard gives the slope, one tiny shard per unit the
    per-step overhead."""
    def seconds(sizes: list[int]) -> float:
        shards = [torch.zeros(n, device=device) for n in sizes]
        grads = [torch.full((n,), 1e-3, device=device) for n in sizes]
        masks = [torch.ones(n, dtype=torch.bool, device=device) for n in sizes]
        opt = ShardedAdamW(shards, masks, spec)

        def run() -> float:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            float(ShardedAdamW.squared_norm(grads))
            opt.step(grads, 1e-3)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - started

        return _median(run, repeats, warmup)

    fixed = seconds([1] * config.num_units)
    big = min(config.total_parameters(), OPTIMIZER_PROBE_ELEMENTS)
    per_parameter = max(0.0, seconds([big]) - seconds([1])) / big
    return per_parameter, fixed


def engine_step(config: ModelConfig, training: TrainingSpec, precision: str,
                device: torch.device) -> Callable[[], None]:
    """One real training step on this device alone with one sample, as a function: reading
    the data, `Engine.step` and the trainer's per-step logging. Beyond the units and the
    optimizer that the profile times, a step also moves inputs, keeps the activation store,
    makes gradient buffers and logs; at small sizes that is a noticeable share."""
    from cephalo.api.job import DataSpec, SyntheticData
    from cephalo.trainer.engine import Engine, Layout
    from cephalo.trainer.run import log_step

    layout = Layout(batch_sizes=[1], micro_batch_sizes=[1], shard_ratios=[1.0])
    engine = Engine(config, training, layout, device=device, precision=precision,
                    standalone=True)
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)

    def step() -> None:
        result = engine.step(data.micro_batches(engine.step_count, 0, 1, 1))
        log_step(engine, result, config.tokens_per_sample, 0.0, None, None, 0, False, 0)

    for _ in range(3):  # first steps allocate the optimizer's moments and buffers
        step()
    return step


def profile_device(config: ModelConfig, precision: str, micro_batch_sizes: Sequence[int],
                   device: torch.device, facts: DeviceFacts, repeats: int = 5,
                   warmup: int = 2, training: TrainingSpec | None = None) -> GpuProfile:
    training = training or TrainingSpec()
    # The real step runs in the same rounds as the unit timings it is compared with. It
    # holds the whole training state, so only where that takes a small part of the device
    # (a large model's per-step overhead is negligible beside its step anyway).
    fits = STATE_BYTES_PER_PARAMETER * config.total_parameters() <= \
        PROBE_MEMORY_FRACTION * facts.memory_bytes
    extra = {"step": engine_step(config, training, precision, device)} if fits else {}
    measured = UnitProfiler(config, precision, device).measure(micro_batch_sizes, repeats,
                                                               warmup, extra)
    per_parameter, fixed = optimizer_timing(config, training, device, repeats, warmup)
    profile = GpuProfile(product=facts.product, device_name=facts.device_name,
                      memory_capacity_bytes=facts.memory_bytes, source="measured",
                      model_key=model_key(config.architecture_key(), precision),
                      precision=precision,  # type: ignore[arg-type]
                      compute_capability=facts.compute_capability,
                      driver_version=facts.driver_version, torch_version=torch.__version__,
                      points=measured.points,
                      block_forward_fixed_seconds=measured.block_forward_fixed_seconds,
                      other_forward_fixed_seconds=measured.other_forward_fixed_seconds,
                      optimizer_seconds_per_parameter=per_parameter,
                      optimizer_seconds_fixed=fixed)
    # What the real step took beyond the cost model's own prediction of it.
    if "step" not in measured.extra_seconds:
        return profile
    overhead = max(0.0, measured.extra_seconds["step"] - single_rank_step_seconds(profile,
                                                                                  config))
    return profile.model_copy(update={"step_overhead_seconds": overhead})


def cache_path(cache_dir: Path, product: str, config: ModelConfig, precision: str) -> Path:
    arch = f"{config.architecture_key()}|torch={torch.__version__}|format={PROFILE_FORMAT}"
    return cache_dir / f"{profile_cache_key(product, arch, precision)}.json"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cephalo" / "profiles"


def write_profile(profile: GpuProfile, output: str | None) -> str:
    """Write the compact JSON to `output` (and to the termination log inside a pod)."""
    text = profile.to_compact_json()
    if len(text.encode()) > TERMINATION_MESSAGE_LIMIT_BYTES:
        raise RuntimeError(f"profile JSON is {len(text.encode())} bytes, over Kubernetes' "
                           f"{TERMINATION_MESSAGE_LIMIT_BYTES}-byte termination message limit")
    targets = [output] if output else []
    if os.path.exists(TERMINATION_LOG) and os.access(TERMINATION_LOG, os.W_OK) \
            and TERMINATION_LOG not in targets:
        targets.append(TERMINATION_LOG)
    for target in targets:
        if target == "-":
            sys.stdout.write(text + "\n")
            continue
        tmp = f"{target}.tmp" if not target.startswith("/dev/") else target
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        if tmp != target:
            os.replace(tmp, target)
    return text


def profile_job(spec: CephaloJobSpec, *, device: torch.device | None = None,
                micro_batch_sizes: Sequence[int] | None = None, repeats: int = 5,
                warmup: int = 2, cache_dir: Path | None = None,
                collectives: CollectiveProfile | None = None) -> GpuProfile:
    """Profile (or load from cache) the job's model on `device` (default: cuda if present).
    The cache holds compute only; `collectives` (measured for this run's ranks) is attached
    to whichever profile is returned."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    facts = device_facts(device)
    config = spec.model.resolve()
    sizes = list(micro_batch_sizes or spec.planner.profile_micro_batch_sizes)
    path = cache_path(cache_dir, facts.product, config, spec.precision) if cache_dir else None
    if path is not None and path.exists():
        cached = GpuProfile.model_validate_json(path.read_text())
        if {p.micro_batch_size for p in cached.points} >= set(sizes):
            return cached.model_copy(update={"collectives": collectives})
    profile = profile_device(config, spec.precision, sizes, device, facts, repeats, warmup,
                             spec.training)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(profile.to_compact_json())
            os.replace(tmp, path)
        except OSError as err:  # e.g. a read-only root filesystem in a pod: still useful
            print(f"profile: not cached ({err})", file=sys.stderr)
    return profile.model_copy(update={"collectives": collectives})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cephalo.trainer.profile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default=os.environ.get("CEPHALO_JOB"),
                        help="CephaloJob YAML (default: $CEPHALO_JOB)")
    parser.add_argument("--output", "-o", default="-",
                        help="file for the GpuProfile JSON ('-' = stdout, the default)")
    parser.add_argument("--micro-batch-sizes", default=None,
                        help="comma-separated sizes (default: the job's planner setting)")
    parser.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: auto)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache-dir", default=None,
                        help=f"profile cache folder (default {default_cache_dir()}; "
                             "'none' disables)")
    parser.add_argument("--collectives", action="store_true",
                        help="under torchrun: also measure AllGather/ReduceScatter")
    args = parser.parse_args(argv)
    if not args.job:
        parser.error("--job is required (or set CEPHALO_JOB)")
    try:
        spec = load_job(args.job).spec
        sizes = ([int(s) for s in args.micro_batch_sizes.split(",")]
                 if args.micro_batch_sizes else None)
        if sizes is not None and min(sizes) < 1:
            raise ValueError("--micro-batch-sizes must be positive integers")
    except ValueError as err:
        print(f"profile: error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(int(os.environ.get("CEPHALO_NUM_THREADS", torch.get_num_threads())))
    device = torch.device(args.device) if args.device else None
    collectives = None
    if args.collectives:
        from cephalo.trainer.profile_collectives import measure_collectives

        collectives = measure_collectives(spec.model.resolve(), repeats=max(5, args.repeats),
                                          precision=spec.precision)
        if collectives is None:  # not rank 0
            return 0
    cache = None if args.cache_dir == "none" else Path(args.cache_dir or default_cache_dir())
    profile = profile_job(spec, device=device, micro_batch_sizes=sizes, repeats=args.repeats,
                          cache_dir=cache, collectives=collectives)
    write_profile(profile, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
