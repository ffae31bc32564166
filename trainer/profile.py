"""The profiler: `python -m cephalo.trainer.profile --job JOB.yaml --output profile.json`.

Measures, on the local device, what the planner's cost model needs for one GPU type and one
model (paper: "The profiler…", "Compute Latency Model", "Memory Utilization Model"):

* for each microbatch size m: one block's checkpointed forward and recompute+backward
  seconds, and the embedding + head + loss + data seconds, all through the engine's own unit
  functions (`cephalo.trainer.unit_ops`), median of repeats after a warm-up; GPU timing is
  synchronised around CUDA work, CPU uses a monotonic clock;
* compute memory per m: on GPU the allocator's peak beyond what was allocated before (the
  training state), on CPU the bytes a step really holds — tensors saved by autograd during the
  recompute, plus the boundary tensors and the gathered unit buffers — counted exactly;
* device facts from NVML (nvidia-ml-py) where a GPU exists; the product normalised to the
  planner's catalog name;
* with `--collectives` under torchrun: AllGather/ReduceScatter seconds for a unit's size at
  two sizes, even and uneven shards, fitted to the ring model's bandwidth and latency.

Profiles are cached by (product, architecture, precision, torch version).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
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
from cephalo.trainer.data import DataSource
from cephalo.trainer.device_info import DeviceFacts, device_facts
from cephalo.trainer.flat import FlatUnit
from cephalo.trainer.models import build_model
from cephalo.trainer.optim import ShardedAdamW
from cephalo.trainer.unit_ops import (
    backward_unit,
    forward_unit,
    head_forward_backward,
    run_unit_for_profile,
)

FP32_BYTES = 4
TERMINATION_LOG = "/dev/termination-log"
# Part of the cache key: bump it whenever what a profile measures changes, so that profiles
# cached by an older profiler are measured again instead of silently lacking fields.
PROFILE_FORMAT = 2


def _median(fn: Callable[[], float], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(fn() for _ in range(repeats))


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


class UnitProfiler:
    """Times the units of one model on one device through the engine's unit functions."""

    def __init__(self, config: ModelConfig, precision: str, device: torch.device,
                 seed: int = 0) -> None:
        self.config = config
        self.precision = precision
        self.device = device
        model = build_model(config, seed=seed)
        # run_unit_for_profile flattens the block it is given: keep a pristine copy.
        self.block_module = copy.deepcopy(model.units[1]).to(device)
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

    def point(self, m: int, repeats: int, warmup: int) -> ProfilePoint:
        emb, _, head = self.units
        emb_full, _, head_full = self.fulls
        inputs, targets = self.data.batch(0, 0, m)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        (hidden,) = forward_unit(emb, emb_full, [inputs], self.device, self.precision)
        block_timing = run_unit_for_profile(copy.deepcopy(self.block_module), hidden,
                                            self.device, self.precision, repeats=repeats,
                                            warmup=warmup)

        def other_forward() -> float:
            start = time.perf_counter()
            self.data.micro_batches(0, 0, m, m)  # the data a rank reads for m samples
            data_seconds = time.perf_counter() - start
            return data_seconds + self._timed(
                lambda: forward_unit(emb, emb_full, [inputs], self.device, self.precision))

        def other_backward() -> float:
            def run() -> None:
                _, grad = head_forward_backward(head, head_full, hidden, targets, 1.0 / m,
                                                self.device, self.precision)
                backward_unit(emb, emb_full, inputs, grad, self.device, self.precision,
                              needs_input_grad=False)
                head_full.grad = None
                emb_full.grad = None
            return self._timed(run)

        other_f = _median(other_forward, repeats, warmup)
        other_b = _median(other_backward, repeats, warmup)
        return ProfilePoint(
            micro_batch_size=m, block_forward_seconds=block_timing.forward_seconds,
            block_backward_seconds=block_timing.backward_seconds,
            other_forward_seconds=other_f, other_backward_seconds=other_b,
            compute_memory_bytes=self.compute_memory_bytes(m, inputs, targets, hidden))

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


def profile_device(config: ModelConfig, precision: str, micro_batch_sizes: Sequence[int],
                   device: torch.device, facts: DeviceFacts, repeats: int = 5,
                   warmup: int = 2, training: TrainingSpec | None = None) -> GpuProfile:
    profiler = UnitProfiler(config, precision, device)
    points = [profiler.point(m, repeats, warmup) for m in sorted(set(micro_batch_sizes))]
    per_parameter, fixed = optimizer_timing(config, training or TrainingSpec(), device,
                                            repeats, warmup)
    return GpuProfile(product=facts.product, device_name=facts.device_name,
                      memory_capacity_bytes=facts.memory_bytes, source="measured",
                      model_key=model_key(config.architecture_key(), precision),
                      precision=precision,  # type: ignore[arg-type]
                      compute_capability=facts.compute_capability,
                      driver_version=facts.driver_version, torch_version=torch.__version__,
                      points=points, optimizer_seconds_per_parameter=per_parameter,
                      optimizer_seconds_fixed=fixed)


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

        collectives = measure_collectives(spec.model.resolve(), repeats=max(5, args.repeats))
        if collectives is None:  # not rank 0
            return 0
    cache = None if args.cache_dir == "none" else Path(args.cache_dir or default_cache_dir())
    profile = profile_job(spec, device=device, micro_batch_sizes=sizes, repeats=args.repeats,
                          cache_dir=cache, collectives=collectives)
    write_profile(profile, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
