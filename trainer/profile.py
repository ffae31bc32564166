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
* what keeping one block's autograd graph (instead of recomputing it) holds per sample:
  the distinct storages autograd saves in one block's forward, the block's parameters left
  out, counted at the smallest microbatch size and twice it (`block_graph_bytes_per_sample`);
* the AdamW step (per parameter and fixed), and one real single-rank training step with one
  sample, kept as measured (`single_rank_step`): what it takes beyond the cost model's
  prediction from the above is the engine's own per-step work (inputs, buffers, logging),
  which the planner derives when it plans (a cached profile bakes in no planner version);
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
from pathlib import Path

import torch
from pydantic import ValidationError

from cephalo.api import trainer_env
from cephalo.api.job import (
    CephaloJobSpec,
    PlannerSpec,
    TrainingSpec,
    format_validation_error,
    load_job,
)
from cephalo.api.memory import state_bytes
from cephalo.api.models import ModelConfig
from cephalo.api.profile import (
    TERMINATION_MESSAGE_LIMIT_BYTES,
    CollectiveProfile,
    GpuProfile,
    ProfileMergeError,
    SingleRankStep,
    merge_points,
    model_key,
    profile_cache_key,
)
from cephalo.trainer.data import DataSource
from cephalo.trainer.device_info import DeviceFacts, device_facts
from cephalo.trainer.host_link import measure_host_link_bytes_per_second
from cephalo.trainer.optim import ShardedAdamW
from cephalo.trainer.precision import pin_fp32_math
from cephalo.trainer.profile_units import UnitProfiler

# A probe step holds the training state of the whole model (or of an even shard across the
# probing ranks): measured only where that is at most this share of the device's memory.
PROBE_MEMORY_FRACTION = 0.25
TERMINATION_LOG = "/dev/termination-log"


def _median(fn: Callable[[], float], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(fn() for _ in range(repeats))


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
    from cephalo.trainer.step_log import StepLogger

    layout = Layout(batch_sizes=[1], micro_batch_sizes=[1], shard_ratios=[1.0])
    engine = Engine(config, training, layout, device=device, precision=precision,
                    standalone=True)
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    logger = StepLogger(rank=0, global_batch_size=1, local_batch_size=1,
                        tokens_per_sample=config.tokens_per_sample, flops_per_sample=0.0,
                        total_steps=0)

    def step() -> None:
        result = engine.step(data.micro_batches(engine.step_count, 0, 1, 1))
        logger.log(result)

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
    fits = state_bytes(config.total_parameters(), precision) <= \
        PROBE_MEMORY_FRACTION * facts.memory_bytes
    extra = {"step": engine_step(config, training, precision, device)} if fits else {}
    measured = UnitProfiler(config, precision, device).measure(micro_batch_sizes, repeats,
                                                               warmup, extra)
    per_parameter, fixed = optimizer_timing(config, training, device, repeats, warmup)
    step = None
    if "step" in measured.extra_seconds:
        step = SingleRankStep(seconds=measured.extra_seconds["step"], micro_batch_size=1,
                              num_blocks=config.num_layers,
                              parameters=config.total_parameters())
    return GpuProfile(product=facts.product, device_name=facts.device_name,
                      memory_capacity_bytes=facts.memory_bytes, source="measured",
                      model_key=model_key(config.architecture_key(), precision),
                      precision=precision,  # type: ignore[arg-type]
                      compute_capability=facts.compute_capability,
                      driver_version=facts.driver_version, torch_version=torch.__version__,
                      points=measured.points,
                      block_forward_fixed_seconds=measured.block_forward_fixed_seconds,
                      other_forward_fixed_seconds=measured.other_forward_fixed_seconds,
                      optimizer_seconds_per_parameter=per_parameter,
                      optimizer_seconds_fixed=fixed, single_rank_step=step,
                      block_graph_bytes_per_sample=measured.block_graph_bytes_per_sample,
                      host_link_bytes_per_second=measure_host_link_bytes_per_second(device))


def cache_path(cache_dir: Path, product: str, config: ModelConfig, precision: str) -> Path:
    """This environment's cache file (cephalo.api.profile.profile_cache_key: the operator's
    key too)."""
    key = profile_cache_key(product, config, precision, runtime=f"torch={torch.__version__}")
    return cache_dir / f"{key}.json"


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


def _read_cached(path: Path) -> GpuProfile | None:
    """The cached profile at `path`; None when there is none or it cannot be read (an older
    format the key did not tell apart, a torn file): then the GPU is measured again."""
    try:
        return GpuProfile.model_validate_json(path.read_text())
    except (OSError, ValueError):  # pydantic's ValidationError is a ValueError
        return None


def usable_cached(path: Path | None, sizes: Sequence[int]) -> GpuProfile | None:
    """The cached profile at `path` if it covers every micro-batch size wanted."""
    cached = _read_cached(path) if path is not None else None
    if cached is not None and {p.micro_batch_size for p in cached.points} >= set(sizes):
        return cached
    return None


def in_measured_precision(spec: CephaloJobSpec, product: str,
                          precision: str | None = None) -> CephaloJobSpec:
    """The job as the profiler measures it on a `product` GPU: in `precision` (--precision)
    when given, else in the job's, where "auto" is the precision the planner will assign
    this GPU (cephalo.planner.cost.catalog.resolve_precision: bf16 from 8.0, fp16 on 7.x, else
    fp32), so the profile's model_key is the one the planner expects of it."""
    from cephalo.planner.cost.catalog import resolve_gpu, resolve_precision

    wanted = precision or resolve_precision(spec.precision, resolve_gpu(product))
    return spec if wanted == spec.precision else spec.model_copy(update={"precision": wanted})


def profile_job(spec: CephaloJobSpec, *, device: torch.device | None = None,
                micro_batch_sizes: Sequence[int] | None = None, repeats: int = 5,
                warmup: int = 2, cache_dir: Path | None = None,
                collectives: CollectiveProfile | None = None) -> GpuProfile:
    """Profile (or load from cache) the job's model on `device` (default: cuda if present).
    The cache holds compute only; `collectives` (measured for this run's ranks) is attached
    to whichever profile is returned."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pin_fp32_math()  # measure fp32 as the trainer computes it
    facts = device_facts(device)
    spec = in_measured_precision(spec, facts.product)
    config = spec.model.resolve()
    sizes = list(micro_batch_sizes or spec.planner.profile_micro_batch_sizes)
    path = cache_path(cache_dir, facts.product, config, spec.precision) if cache_dir else None
    cached = usable_cached(path, sizes)
    if cached is not None:
        return cached.model_copy(update={"collectives": collectives})
    profile = profile_device(config, spec.precision, sizes, device, facts, repeats, warmup,
                             spec.training)
    if path is not None:
        # Sizes beyond the cached ones (a plan's extra pass,
        # cephalo.planner.feedback.measured_sizes) join the cached points rather than replace
        # them: the next run needs both.
        before = _read_cached(path)
        try:
            kept = profile if before is None else merge_points(before, profile)
        except ProfileMergeError:  # another GPU under a colliding key: this one wins
            kept = profile
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(kept.to_compact_json())
            os.replace(tmp, path)
        except OSError as err:  # e.g. a read-only root filesystem in a pod: still useful
            print(f"profile: not cached ({err})", file=sys.stderr)
    return profile.model_copy(update={"collectives": collectives})


MAX_REPEATS = 1000


def _micro_batch_sizes(text: str | None, spec: CephaloJobSpec) -> list[int] | None:
    """--micro-batch-sizes, held to the job's own limits (planner.profileMicroBatchSizes)."""
    if not text:
        return None
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"--micro-batch-sizes {text!r}: give comma-separated positive "
                         "integers, e.g. 1,2,4") from None
    if min(sizes) < 1:
        raise ValueError("--micro-batch-sizes must be positive integers")
    try:
        PlannerSpec.model_validate({**spec.planner.model_dump(by_alias=True),
                                    "profileMicroBatchSizes": sizes})
    except ValidationError as err:
        raise ValueError(f"--micro-batch-sizes {text}: {format_validation_error(err)}") from None
    return sizes


def _device(name: str | None) -> torch.device | None:
    """--device: cpu, cuda or cuda:N, and only a GPU this process can see."""
    if name is None:
        return None
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: give cuda, cuda:N or cpu")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {name}: no CUDA GPU is visible (torch "
                             f"{torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name}: only {count} GPU(s) are visible "
                             f"(cuda:0..cuda:{count - 1})")
    return device


def _check_output(output: str) -> None:
    """--output must be a file in an existing folder (found before measuring, not after)."""
    if output == "-" or output.startswith("/dev/"):
        return
    path = Path(output)
    if path.is_dir():
        raise ValueError(f"--output {output} is a folder; give a file such as "
                         f"{path / 'profile.json'}")
    if not path.parent.is_dir():
        raise ValueError(f"--output {output}: folder {path.parent} does not exist")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cephalo.trainer.profile",
                                     description=__doc__.split("\n\n")[0])
    try:
        env = trainer_env.read_env()
    except trainer_env.EnvError as err:
        print(f"profile: error: {err}", file=sys.stderr)
        return 2
    parser.add_argument("--job", default=env.job,
                        help=f"CephaloJob YAML (default: ${trainer_env.JOB})")
    parser.add_argument("--output", "-o", default="-",
                        help="file for the GpuProfile JSON ('-' = stdout, the default)")
    parser.add_argument("--micro-batch-sizes", default=None,
                        help="comma-separated sizes (default: the job's planner setting)")
    parser.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: auto)")
    parser.add_argument("--repeats", type=int, default=5,
                        help=f"timed runs per measurement, 1 to {MAX_REPEATS} (default 5)")
    parser.add_argument("--cache-dir", default=None,
                        help=f"profile cache folder (default {default_cache_dir()}; "
                             "'none' disables)")
    parser.add_argument("--collectives", action="store_true",
                        help="under torchrun: also measure AllGather/ReduceScatter")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                        help="measure in this precision (default: the job's; under auto the "
                             "one the planner assigns this GPU)")
    args = parser.parse_args(argv)
    if not args.job:
        parser.error(f"--job is required (or set {trainer_env.JOB})")
    try:
        spec = load_job(args.job).spec
        sizes = _micro_batch_sizes(args.micro_batch_sizes, spec)
        device = _device(args.device)
        if not 1 <= args.repeats <= MAX_REPEATS:
            raise ValueError(f"--repeats {args.repeats}: give 1 to {MAX_REPEATS}")
        _check_output(args.output)
    except ValueError as err:
        print(f"profile: error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(env.num_threads or torch.get_num_threads())
    spec = in_measured_precision(spec, device_facts(device or torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")).product, args.precision)
    collectives = None
    if args.collectives:
        from cephalo.trainer.profile_collectives import measure_collectives

        collectives = measure_collectives(spec.model.resolve(), repeats=max(5, args.repeats),
                                          precision=spec.precision)
        if collectives is None:  # not rank 0
            return 0
    cache = None if args.cache_dir == "none" else Path(args.cache_dir or default_cache_dir())
    started = time.monotonic()
    sizes = list(sizes or spec.planner.profile_micro_batch_sizes)
    key = cache_path(cache, device_facts(device or torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")).product, spec.model.resolve(),
        spec.precision) if cache else None
    from_cache = usable_cached(key, sizes) is not None
    profile = profile_job(spec, device=device, micro_batch_sizes=sizes, repeats=args.repeats,
                          cache_dir=cache, collectives=collectives)
    write_profile(profile, args.output)
    # What it did, on stderr (stdout may be the profile itself).
    how = f"compute from the cache {key}" if from_cache else \
        f"measured in {time.monotonic() - started:.1f} s"
    if collectives is not None:
        how += f", collectives measured over {collectives.world_size} ranks"
    where = "stdout" if args.output == "-" else args.output
    print(f"profile: wrote {where} ({profile.product}, "
          f"{spec.model.preset or spec.model.family or 'model'}, micro-batch sizes "
          f"{', '.join(map(str, sizes))}, {how})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
