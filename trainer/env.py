"""The trainer's environment (DESIGN.md), validated up front on every rank.

Every check here runs *before* the process group forms, so a bad environment makes every
rank exit with the same one-line message instead of some ranks hanging in a collective.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cephalo.api.job import CephaloJobSpec, JobFileError, load_job
from cephalo.api.plan import Plan, PlanError, load_plan
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Layout

REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CEPHALO_PLAN", "CEPHALO_JOB")
DEFAULT_COLLECTIVE_TIMEOUT_SECONDS = 600.0


class EnvError(ValueError):
    """A trainer environment that cannot work; the message says what to set."""


@dataclass(frozen=True)
class TrainerEnv:
    rank: int
    world_size: int
    local_rank: int
    plan: Plan
    job: CephaloJobSpec
    # CEPHALO_CHECKPOINT_DIR: a shared folder or an fsspec URL (s3://bucket/prefix/ns/job);
    # empty or unset = this job explicitly keeps no checkpoints (nothing saved or resumed).
    checkpoint_dir: str | None
    metrics_port: int
    metrics_file: Path | None  # None: no progress file (checkpoints on object storage/none)
    # CEPHALO_COLLECTIVE_TIMEOUT_SECONDS (default 600): how long a training collective may
    # wait for the slowest rank before the job fails (a hung rank is found this fast).
    # Checkpoint agreements, where a rank may be hashing or uploading gigabytes, wait
    # max(this, 60 s + training-state bytes / 50 MB/s): checkpoint.storage_timeout_seconds.
    timeout_seconds: float
    stop_after_step: int | None
    num_threads: int | None = None  # CEPHALO_NUM_THREADS (local runs share the CPU)
    time_dilation: float = 1.0  # CEPHALO_TIME_DILATION: emulate a device this much slower
    memory_limit_bytes: int | None = None  # CEPHALO_MEMORY_LIMIT_BYTES: emulated capacity

    @property
    def layout(self) -> Layout:
        return layout_from_plan(self.plan)


def layout_from_plan(plan: Plan) -> Layout:
    """The engine's view of a plan (plus its optional per-unit ratio overrides)."""
    overrides = getattr(plan, "unit_shard_ratios", None) or {}
    try:
        unit_ratios = {int(k): [float(r) for r in v] for k, v in overrides.items()}
    except (TypeError, ValueError, AttributeError):
        raise EnvError("plan unit_shard_ratios must map unit indices to lists of ratios, got "
                       f"{overrides!r}") from None
    for unit, ratios in unit_ratios.items():
        if len(ratios) != plan.world_size or abs(sum(ratios) - 1) > 1e-9 or min(ratios) < 0:
            raise EnvError(f"plan unit_shard_ratios[{unit}] must hold {plan.world_size} "
                           f"non-negative ratios summing to 1, got {ratios}")
    return Layout(batch_sizes=[r.batch_size for r in plan.ranks],
                  micro_batch_sizes=[r.micro_batch_size for r in plan.ranks],
                  shard_ratios=[r.shard_ratio for r in plan.ranks],
                  unit_shard_ratios=unit_ratios)


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise EnvError(f"{name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not an integer") from None


def read_env(env: Mapping[str, str] | None = None) -> TrainerEnv:
    """Parse and cross-check the environment, plan and job; raises EnvError."""
    env = os.environ if env is None else env
    missing = [n for n in REQUIRED if not env.get(n)]
    if missing:
        raise EnvError(f"missing environment variable(s) {', '.join(missing)}; run under "
                       f"torchrun (RANK, WORLD_SIZE, MASTER_*) with CEPHALO_PLAN and "
                       f"CEPHALO_JOB set (CEPHALO_CHECKPOINT_DIR: where checkpoints go)")
    rank, world_size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if world_size < 1 or not 0 <= rank < world_size:
        raise EnvError(f"RANK={rank} must be in [0, WORLD_SIZE={world_size})")
    _int(env, "MASTER_PORT")
    try:
        plan = load_plan(env["CEPHALO_PLAN"])
    except PlanError as err:
        raise EnvError(f"CEPHALO_PLAN {err}") from None
    try:
        job = load_job(env["CEPHALO_JOB"]).spec
    except JobFileError as err:
        raise EnvError(f"CEPHALO_JOB {err}") from None
    if plan.world_size != world_size:
        raise EnvError(f"the plan is for {plan.world_size} ranks (one batch size and shard "
                       f"ratio each) but WORLD_SIZE={world_size}; re-plan or launch "
                       f"{plan.world_size} ranks")
    if plan.global_batch_size != job.global_batch_size:
        raise EnvError(f"the plan's global_batch_size {plan.global_batch_size} differs from "
                       f"the job's globalBatchSize {job.global_batch_size}")
    mine = plan.ranks[rank]
    for name, planned in (("CEPHALO_BATCH_SIZE", mine.batch_size),
                          ("CEPHALO_MICRO_BATCH_SIZE", mine.micro_batch_size),
                          ("CEPHALO_NUM_MICRO_BATCHES", mine.num_micro_batches)):
        if env.get(name) and _int(env, name) != planned:
            raise EnvError(f"{name}={env[name]} but the plan gives rank {rank} {planned}")
    if env.get("CEPHALO_SHARD_RATIO"):
        try:
            ratio = float(env["CEPHALO_SHARD_RATIO"])
        except ValueError:
            raise EnvError(f"CEPHALO_SHARD_RATIO={env['CEPHALO_SHARD_RATIO']!r} is not a "
                           f"number") from None
        if abs(ratio - mine.shard_ratio) > 1e-6:
            raise EnvError(f"CEPHALO_SHARD_RATIO={ratio} but the plan gives rank {rank} "
                           f"{mine.shard_ratio}")
    for r in plan.ranks:
        if r.batch_size > 0 and r.micro_batch_size == 0:
            raise EnvError(f"plan rank {r.rank} has batch_size {r.batch_size} but "
                           f"micro_batch_size 0")
    layout_from_plan(plan)  # validates per-unit ratio overrides before any rank starts
    try:  # a missing or unusable token file fails here, on every rank, before any collective
        DataSource(job.model.resolve(), job.data, job.training.seed)
    except ValueError as err:
        raise EnvError(f"CEPHALO_JOB {env['CEPHALO_JOB']}: {err}") from None
    port = _int(env, "CEPHALO_METRICS_PORT", 0)
    if not 0 <= port < 65536:
        raise EnvError(f"CEPHALO_METRICS_PORT={port} is not a port (0 disables metrics)")
    checkpoint_dir = (env.get("CEPHALO_CHECKPOINT_DIR") or "").strip() or None
    if checkpoint_dir is not None:
        _check_storage_backend(checkpoint_dir)
    metrics_file = _metrics_file(env.get("CEPHALO_METRICS_FILE"), checkpoint_dir)
    timeout_raw = env.get("CEPHALO_COLLECTIVE_TIMEOUT_SECONDS") or ""
    try:
        timeout = float(timeout_raw) if timeout_raw else DEFAULT_COLLECTIVE_TIMEOUT_SECONDS
    except ValueError:
        raise EnvError(f"CEPHALO_COLLECTIVE_TIMEOUT_SECONDS={timeout_raw!r} is not a "
                       f"number") from None
    if not 0 < timeout < 10**7:  # also refuses nan and inf, which timedelta cannot hold
        raise EnvError(f"CEPHALO_COLLECTIVE_TIMEOUT_SECONDS={timeout} must be a number of "
                       f"seconds > 0 (default {DEFAULT_COLLECTIVE_TIMEOUT_SECONDS:.0f})")
    stop = env.get("CEPHALO_STOP_AFTER_STEP")
    dilation_raw = env.get("CEPHALO_TIME_DILATION") or "1"
    try:
        dilation = float(dilation_raw)
    except ValueError:
        raise EnvError(f"CEPHALO_TIME_DILATION={dilation_raw!r} is not a number") from None
    if dilation < 1.0:
        raise EnvError(f"CEPHALO_TIME_DILATION={dilation} must be >= 1 (1 = real speed)")
    threads = _int(env, "CEPHALO_NUM_THREADS", 0) or None
    limit = _int(env, "CEPHALO_MEMORY_LIMIT_BYTES", 0) or None
    return TrainerEnv(
        num_threads=threads, time_dilation=dilation, memory_limit_bytes=limit, rank=rank,
        world_size=world_size, local_rank=_int(env, "LOCAL_RANK", rank),
        plan=plan, job=job, checkpoint_dir=checkpoint_dir, metrics_port=port,
        metrics_file=metrics_file,
        timeout_seconds=timeout,
        stop_after_step=_int(env, "CEPHALO_STOP_AFTER_STEP") if stop else None)


def _metrics_file(explicit: str | None, checkpoint_dir: str | None) -> Path | None:
    """CEPHALO_METRICS_FILE, else `metrics.jsonl` next to a local checkpoint folder (what
    `cephalo run` reads), else none: an object-store URL has no local "next to"."""
    if explicit:
        return Path(explicit)
    is_url = checkpoint_dir is not None and "://" in checkpoint_dir
    if checkpoint_dir is None or (is_url and not checkpoint_dir.startswith("file://")):
        return None
    return Path(checkpoint_dir.removeprefix("file://")).parent / "metrics.jsonl"


def _check_storage_backend(location: str) -> None:
    """An fsspec URL whose scheme is unknown or whose package is missing fails here, on every
    rank, before the process group forms (no network access: credentials are checked by the
    trainer's start-up probe)."""
    if "://" not in location:
        return
    import fsspec

    protocol = location.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise EnvError(f"CEPHALO_CHECKPOINT_DIR={location}: unknown storage scheme "
                       f"{protocol}://; use a shared folder or s3://, gs://, az://") from None
    except ImportError as err:
        raise EnvError(f"CEPHALO_CHECKPOINT_DIR={location}: {' '.join(str(err).split())} "
                       f"(the trainer image lacks the fsspec package for {protocol}://)"
                       ) from None
