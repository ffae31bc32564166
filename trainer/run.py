"""The training loop and `python -m cephalo.trainer`'s main()."""

from __future__ import annotations

import datetime
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from cephalo.api import trainer_env
from cephalo.api.job import CephaloJobSpec
from cephalo.api.plan import Plan
from cephalo.planner.feedback.rebalance import Decision, Hold, Rebalancer, micro_batch_counts
from cephalo.trainer import checkpoint
from cephalo.trainer.checkpoint_write import CheckpointWriter
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Engine, Layout
from cephalo.trainer.env import EnvError, rank_device, read_env
from cephalo.trainer.eval import evaluator
from cephalo.trainer.hf_weights import init_from_pretrained
from cephalo.trainer.metrics import ProgressFile, TrainerMetrics, write_final_progress
from cephalo.trainer.mlflow_log import RUN_ID_FILE, RunIdentity, open_mlflow
from cephalo.trainer.nccl_env import init_group
from cephalo.trainer.precision import PrecisionError, check_precision, pin_fp32_math
from cephalo.trainer.rebalancing import LiveSplit, decision_record, max_samples
from cephalo.trainer.step_log import StepLogger, Tracker
from cephalo.trainer.storage import CheckpointError, Store, check_shared
from cephalo.trainer.tensorboard_log import open_log


@dataclass
class TrainOutcome:
    first_step: int  # step the run started from (0, or the checkpoint it resumed)
    last_step: int
    losses: list[float] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    stopped_by_signal: bool = False  # every rank agreed to stop early (SIGTERM)
    # This rank's memory: the engine's estimate (the planner's model, cephalo.api.memory)
    # and, on CUDA, torch's peak allocated bytes over the run (None on a CPU).
    memory_estimate_bytes: int | None = None
    peak_memory_bytes: int | None = None


def _storage_group(engine: Engine, timeout_seconds: float) -> dist.ProcessGroup | None:
    """A gloo group over the engine's ranks for checkpoint agreements: CPU objects on any
    backend, and a timeout sized for storage rather than for compute."""
    world = engine.comm.world_size
    if world == 1:
        return None
    group = engine.comm.group
    ranks = None if group is None else [dist.get_global_rank(group, r) for r in range(world)]
    return dist.new_group(ranks, backend="gloo",
                          timeout=datetime.timedelta(seconds=timeout_seconds))


def _votes(stop_requested: Callable[[], bool] | None, writer: CheckpointWriter | None,
           live: LiveSplit | None = None) -> Callable[[], list[float]]:
    """This rank's step-boundary votes, summed over ranks by the engine's end-of-step
    all-reduce: [wants to stop, still uploading a checkpoint, live rebalancing's figures].
    Read at that all-reduce, so every rank sees the same sums after the same step: no
    collective of the loop's own."""
    def votes() -> list[float]:
        return [1.0 if stop_requested is not None and stop_requested() else 0.0,
                1.0 if writer is not None and writer.busy else 0.0,
                *(live.votes() if live is not None else [])]
    return votes


def _follow_split(engine: Engine, logger: StepLogger,
                  decision: Decision | None = None) -> tuple[int, int]:
    """The split in force from the next step (`decision`: the change that made it): the
    logger's figures, rank 0's /metrics, and this rank's range [start, end) of each global
    batch."""
    layout = engine.layout
    if logger.batch_sizes is not None:
        logger.batch_sizes = list(layout.batch_sizes)
    logger.local_batch_size = layout.batch_sizes[engine.rank]
    if logger.metrics is not None:
        logger.metrics.show_split(
            layout.batch_sizes, micro_batch_counts(layout.batch_sizes, layout.micro_batch_sizes),
            None if decision is None else decision.step,
            "" if decision is None else decision.describe())
    return layout.sample_range(engine.rank)


def _hold_key(held: Hold | None) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    return None if held is None else (held.kept_batch_sizes, held.wanted_batch_sizes)


def _show_held(live: LiveSplit, shown: Hold | None, logger: StepLogger, verbose: bool
               ) -> Hold | None:
    """Rank 0's /metrics (and the log) follow why memory keeps the split short of the one
    the ranks' speeds want, when that changes; returns what is shown now."""
    held = live.rebalancer.held
    if _hold_key(held) == _hold_key(shown):  # a later decision finding the same
        return shown
    if logger.metrics is not None:
        logger.metrics.show_held(None if held is None else held.step,
                                 "" if held is None else held.reason)
    if verbose and held is not None:
        print(f"cephalo trainer: rebalancing held by memory: {held.reason} (a smaller "
              f"microbatch or shard needs a restart: re-planning)", flush=True)
    return held


def _live_split(job: CephaloJobSpec, engine: Engine, memory_limit_bytes: int | None,
                memory_headroom_bytes: int | None) -> LiveSplit | None:
    """Live rebalancing for this run: None when the job opts out or one rank holds the
    whole batch (nothing to move)."""
    settings = job.planner.rebalance
    working = sum(1 for m in engine.layout.micro_batch_sizes if m > 0)
    if not settings.enabled or engine.comm.world_size < 2 or working < 2:
        return None
    layout = engine.layout
    rebalancer = Rebalancer(layout.batch_sizes, layout.micro_batch_sizes,
                            interval_steps=settings.interval_steps, min_gain=settings.min_gain)
    return LiveSplit(engine, rebalancer,
                     max_samples(engine, memory_limit_bytes, memory_headroom_bytes))


def memory_headroom_bytes(plan: Plan, rank: int, memory_fraction: float) -> int | None:
    """What rank's plan leaves of its memory budget (capacity x planner.memoryFraction)
    above its predicted peak; None where the plan does not say (a plan written by hand)."""
    mine = plan.ranks[rank]
    if mine.memory_capacity_bytes is None or mine.predicted_memory_bytes is None:
        return None
    return int(mine.memory_capacity_bytes * memory_fraction) - mine.predicted_memory_bytes


def train(job: CephaloJobSpec, layout: Layout, checkpoint_dir: str | Path | None, *,
          group: dist.ProcessGroup | None = None, device: torch.device | None = None,
          stop_after_step: int | None = None, progress_file: Path | None = None,
          metrics: TrainerMetrics | None = None, local_rank: int = 0,
          verbose: bool = True, time_dilation: float = 1.0,
          memory_limit_bytes: int | None = None, collective_timeout_seconds: float = 600.0,
          stop_requested: Callable[[], bool] | None = None,
          async_checkpoints: bool = True, recompute: bool | None = None,
          offload: bool | None = None,
          trackers: Sequence[Tracker] = (),
          link_bytes_per_second: float | None = None,
          time_dilation_from_step: int = 0,
          memory_headroom_bytes: int | None = None) -> TrainOutcome:
    """Train `job` under `layout`, resuming from the newest intact checkpoint in
    `checkpoint_dir` (a shared folder or an fsspec URL; None or "" = no checkpoints at all);
    checkpoints every `intervalSteps` and always at the end (or at `stop_after_step`, which
    simulates a preemption). With `stop_requested` (e.g. set by SIGTERM), the ranks vote at
    every step boundary (on the engine's end-of-step all-reduce); when any rank asks, all
    write a checkpoint of the same step and return together. Steps are logged every
    `training.logIntervalSteps` and at the last, without a collective (step_log).
    `async_checkpoints`: interval checkpoints upload in the background while training goes
    on (see checkpoint_write); the final one and a requested stop's are synchronous.
    `recompute`: the plan's job-wide choice (None: the engine's default, recompute).
    `offload`: this rank's plan choice for its boundary activations (None: the engine's
    default, offloaded to host on CUDA devices only). The block graph sizes the plan priced kept
    blocks with travel in `layout` (the memory check uses this rank's). `trackers`: rank
    0's experiment trackers (spec.tracking: TensorBoard, MLflow), fed as steps are logged.
    `link_bytes_per_second`: emulate a network this slow (collectives.py).
    `time_dilation_from_step`: the dilation applies from this step (0-based) on, real speed
    before it (a device that slows down mid-run, for live rebalancing's tests).
    Live rebalancing (spec.planner.rebalance, trainer/rebalancing.py) moves samples between
    the ranks at step boundaries; a rank's batch grows only as far as `memory_limit_bytes`
    and the plan's `memory_headroom_bytes` on this rank (its memory budget minus its
    predicted peak) allow."""
    config = job.model.resolve()
    spec = job.training
    engine = Engine(config, spec, layout, group=group, device=device,
                    precision=job.precision, gather_precision=job.gather_precision,
                    reduce_precision=job.reduce_precision,
                    time_dilation=time_dilation if time_dilation_from_step <= 0 else 1.0,
                    recompute=True if recompute is None else recompute, offload=offload)
    for comm in engine.collectives:  # every group's collectives cross the emulated link
        comm.link_bytes_per_second = link_bytes_per_second
    if memory_limit_bytes is not None:
        _check_memory(engine, memory_limit_bytes)
    data = DataSource(config, job.data, spec.seed)
    # None when training.evalIntervalSteps is off; else holds out the validation data now.
    validation = evaluator(engine, data, spec, job.data, verbose)
    world = engine.comm.world_size
    live = _live_split(job, engine, memory_limit_bytes, memory_headroom_bytes)
    storage_group = _storage_group(
        engine, checkpoint.storage_timeout_seconds(engine, collective_timeout_seconds))
    store = Store(checkpoint_dir) if checkpoint_dir and str(checkpoint_dir).strip() else None
    cache_dir = Path(tempfile.mkdtemp(prefix="cephalo-checkpoint-"))
    progress = None
    writer = None
    try:
        if store is None:
            if verbose and engine.rank == 0:
                print(f"cephalo trainer: no checkpoint target ({trainer_env.CHECKPOINT_DIR} "
                      "is empty): training without saving or resuming checkpoints", flush=True)
        else:
            check_shared(store, engine.rank, world, storage_group)
            found = checkpoint.resume_point(store, engine, storage_group, cache_dir)
            if found is not None:
                info, reader = found
                checkpoint.restore(engine, info, reader)
                split = checkpoint.split_in_force(info, engine)
                if live is not None and split is not None:
                    live.adopt(split)  # the same plan: go on under the split it had reached
                if verbose and engine.rank == 0:
                    print(f"cephalo trainer: resumed from {info.path} at step {info.step}",
                          flush=True)
            shutil.rmtree(cache_dir, ignore_errors=True)  # verified copies are loaded now
            writer = CheckpointWriter(store, engine, job.checkpoint.keep, storage_group,
                                      asynchronous=async_checkpoints)
        # model.pretrained starts step 0 only: a resumed checkpoint above takes precedence.
        init_from_pretrained(engine, job.model, store, verbose)
        outcome = TrainOutcome(first_step=engine.step_count, last_step=engine.step_count)
        progress = ProgressFile(progress_file) if progress_file and engine.rank == 0 else None
        micro = layout.micro_batch_sizes[engine.rank]
        last = spec.steps if stop_after_step is None else min(spec.steps, stop_after_step)
        logger = StepLogger(rank=engine.rank, global_batch_size=layout.global_batch_size,
                            local_batch_size=layout.batch_sizes[engine.rank],
                            batch_sizes=layout.batch_sizes if live is not None else None,
                            tokens_per_sample=config.tokens_per_sample,
                            flops_per_sample=config.training_flops_per_sample(),
                            total_steps=spec.steps, interval_steps=spec.log_interval_steps,
                            progress=progress, metrics=metrics,
                            wait_seconds=engine.comm.stats.wait_seconds,
                            local_rank=local_rank, verbose=verbose,
                            trackers=trackers)
        start, end = _follow_split(engine, logger)  # a resumed run's split may be another
        votes = _votes(stop_requested, writer, live)
        held: Hold | None = None  # shown so far: why memory keeps the split short
        while engine.step_count < last:
            step = engine.step_count
            if time_dilation_from_step > 0 and step >= time_dilation_from_step:
                engine.time_dilation = time_dilation
            result = engine.step(data.micro_batches(step, start, end, micro), votes)
            outcome.losses.append(result.loss)
            stop, uploading = result.votes[0] > 0, result.votes[1] > 0
            decision = live.after_step(result, result.votes[2:]) if live is not None else None
            final = stop or result.step == last
            # Every rank evaluates together (a collective) on the same steps; not on a stop
            # request, whose grace period is for the checkpoint.
            val_loss = validation.loss() if validation is not None and \
                validation.due(result.step, final=result.step == last) else None
            rebalanced = None if decision is None else \
                decision_record(decision, engine.layout.micro_batch_sizes)
            if val_loss is not None or result.skipped or decision is not None or \
                    logger.due(result.step, final=final):
                logger.log(result, val_loss, rebalanced)
            if decision is not None:  # from the next step on, on every rank
                start, end = _follow_split(engine, logger, decision)
                if verbose and engine.rank == 0:
                    print(f"cephalo trainer: rebalanced: {decision.describe()}", flush=True)
            if live is not None:
                held = _show_held(live, held, logger, verbose and engine.rank == 0)
            if writer is not None:
                if writer.has_pending and not uploading:  # every rank's upload is done
                    outcome.checkpoints.append(writer.finish())
                if final or result.step % job.checkpoint.interval_steps == 0:
                    outcome.checkpoints += writer.start(wait=final)
            if stop:
                outcome.stopped_by_signal = True
                if verbose and engine.rank == 0:
                    print(f"cephalo trainer: stopping at step {result.step} on request "
                          f"(SIGTERM)", flush=True)
                break
        outcome.last_step = engine.step_count
        outcome.memory_estimate_bytes = engine.memory_estimate_bytes()
        if engine.device.type == "cuda":
            outcome.peak_memory_bytes = torch.cuda.max_memory_allocated(engine.device)
    finally:
        if writer is not None:
            writer.close()
        shutil.rmtree(cache_dir, ignore_errors=True)
        if progress is not None:
            progress.close()
        if storage_group is not None:
            dist.destroy_process_group(storage_group)
    return outcome


def memory_report(outcome: TrainOutcome, predicted_bytes: int | None) -> str | None:
    """A GPU rank's peak memory against the plan (None on a CPU, where torch counts none):
    `key=value` bytes, read by `scripts/device-check.sh` (bench/device_check_summary.py)."""
    if outcome.peak_memory_bytes is None:
        return None
    mib = 2**20
    text = (f"peak GPU memory {outcome.peak_memory_bytes / mib:.1f} MiB allocated, the "
            f"engine's estimate {(outcome.memory_estimate_bytes or 0) / mib:.1f} MiB")
    if predicted_bytes is not None:
        text += f", the plan's prediction {predicted_bytes / mib:.1f} MiB"
    return (f"{text} (peak_memory_bytes={outcome.peak_memory_bytes} "
            f"memory_estimate_bytes={outcome.memory_estimate_bytes} "
            f"predicted_memory_bytes={predicted_bytes})")


class MemoryLimitError(RuntimeError):
    """A rank's plan does not fit its (emulated) memory capacity."""


def _check_memory(engine: Engine, limit_bytes: int) -> None:
    """Collective: every rank fails together (no hang) if any rank's estimate exceeds its
    limit; the rank that is over says by how much."""
    need = engine.memory_estimate_bytes()
    over = torch.tensor([1.0 if need > limit_bytes else 0.0], dtype=torch.float64)
    if engine.comm.world_size > 1:
        over = engine.comm.all_reduce_sum(over.to(engine.device)).cpu()
    if need > limit_bytes:
        raise MemoryLimitError(f"rank {engine.rank} needs at least {need / 2**20:.1f} MiB "
                               f"(training state, two gathered units, kept activations) but "
                               f"its memory limit is {limit_bytes / 2**20:.1f} MiB; re-plan "
                               f"with less batch or state on this rank")
    if float(over[0]) > 0:
        raise MemoryLimitError("another rank exceeds its memory limit (see its log)")


EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, what Kubernetes and shells expect
EXIT_CHECKPOINT_ERROR = 4


def main() -> int:
    try:
        env = read_env()
    except EnvError as err:
        import os
        print(f"cephalo trainer (rank {os.environ.get('RANK', '?')}): error: {err}",
              file=sys.stderr, flush=True)
        return 2
    # SIGTERM (pod deletion, preemption, node drain) only raises a flag: the ranks agree at
    # the next step boundary, write a checkpoint and exit 143 together.
    terminated = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: terminated.set())
    torch.manual_seed(env.job.training.seed)
    if env.num_threads:
        torch.set_num_threads(env.num_threads)
    try:
        device = rank_device(env.local_rank)
    except EnvError as err:
        print(f"cephalo trainer (rank {env.rank}): error: {err}", file=sys.stderr, flush=True)
        return 2
    use_cuda = device.type == "cuda"
    if use_cuda:
        torch.cuda.set_device(device)
    precision = env.plan.ranks[env.rank].precision or env.job.precision
    try:  # before the process group forms (the others wait there until the gang goes)
        notice = check_precision(device, precision)
    except PrecisionError as err:
        print(f"cephalo trainer (rank {env.rank}): error: {err}", file=sys.stderr, flush=True)
        return 2
    if notice is not None:  # every rank: ranks of one job may run different GPUs
        print(f"cephalo trainer (rank {env.rank}): {notice}", file=sys.stderr, flush=True)
    pin_fp32_math()
    init_group("nccl" if use_cuda else "gloo", rank=env.rank, world_size=env.world_size,
               timeout=datetime.timedelta(seconds=env.timeout_seconds))
    try:
        port = env.metrics_port + (env.local_rank or 0) if env.metrics_port else 0
        metrics = TrainerMetrics(env.rank, port, env.plan.predicted_step_seconds,
                                 pod_uid=env.pod_uid, address=env.metrics_address)
        tensorboard = open_log(env.job.tracking, env.metrics_file, env.plan, env.rank)
        mlflow = open_mlflow(env.job.tracking, env.job, env.plan, env.rank, RunIdentity(
            job=env.job_name, namespace=env.job_namespace, uid=env.job_uid,
            attempt=env.restart_attempt,
            state_file=env.metrics_file.parent / RUN_ID_FILE if env.metrics_file else None))
        outcome = None
        try:
            outcome = train(env.job, env.layout, env.checkpoint_dir, device=device,
                            stop_after_step=env.stop_after_step,
                            progress_file=env.metrics_file, metrics=metrics,
                            local_rank=device.index or 0, time_dilation=env.time_dilation,
                            memory_limit_bytes=env.memory_limit_bytes,
                            collective_timeout_seconds=env.timeout_seconds,
                            stop_requested=terminated.is_set,
                            recompute=env.plan.recompute,
                            offload=env.plan.ranks[env.rank].offload_activations,
                            trackers=[t for t in (tensorboard, mlflow) if t is not None],
                            link_bytes_per_second=env.link_bytes_per_second,
                            time_dilation_from_step=env.time_dilation_from_step,
                            memory_headroom_bytes=memory_headroom_bytes(
                                env.plan, env.rank, env.job.planner.memory_fraction))
        except MemoryLimitError as err:
            print(f"cephalo trainer (rank {env.rank}): error: {err}", file=sys.stderr,
                  flush=True)
            return 3
        except CheckpointError as err:  # the same root cause on every rank
            print(f"cephalo trainer (rank {env.rank}): error: {err}", file=sys.stderr,
                  flush=True)
            return EXIT_CHECKPOINT_ERROR
        finally:
            if tensorboard is not None:
                tensorboard.close()
            if mlflow is not None:  # KILLED: stopped or failed (a later attempt resumes it)
                mlflow.close("FINISHED" if outcome is not None and
                             not outcome.stopped_by_signal and
                             outcome.last_step >= env.job.training.steps else "KILLED")
        if env.rank == 0 and env.termination_log and not outcome.stopped_by_signal:
            # The operator reads it when the pod completes: its last scrape may be steps old.
            write_final_progress(env.termination_log, metrics.final_progress(outcome.last_step))
        report = memory_report(outcome, env.plan.ranks[env.rank].predicted_memory_bytes)
        if report is not None:
            print(f"cephalo trainer (rank {env.rank}): {report}", flush=True)
        if env.rank == 0:
            print(f"cephalo trainer: {'stopped' if outcome.stopped_by_signal else 'done'} at "
                  f"step {outcome.last_step}; checkpoint "
                  f"{outcome.checkpoints[-1] if outcome.checkpoints else '(none new)'}",
                  flush=True)
    finally:
        dist.destroy_process_group()
    return EXIT_TERMINATED if outcome.stopped_by_signal else 0
