"""The trainer's environment (docs/architecture.md), validated up front on every rank.

Every check here runs *before* the process group forms, so a bad environment makes every
rank exit with the same one-line message instead of some ranks hanging in a collective.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from cephalo.api import trainer_env as names
from cephalo.api.job import CephaloJobSpec, JobFileError, load_job
from cephalo.api.plan import Plan, PlanError, load_plan
from cephalo.api.trainer_env import DEFAULT_COLLECTIVE_TIMEOUT_SECONDS, REQUIRED, EnvError
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Layout
from cephalo.trainer.replicas import check_groups

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT_SECONDS", "REQUIRED", "EnvError", "TrainerEnv",
           "cuda_device_index", "layout_from_plan", "read_env"]


@dataclass(frozen=True)
class TrainerEnv:
    rank: int
    world_size: int
    # LOCAL_RANK, None when unset: never the global rank (a rank's place in the gang says
    # nothing of which of its host's GPUs it drives); `cuda_device_index` decides the GPU.
    local_rank: int | None
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
    time_dilation_from_step: int = 0  # CEPHALO_TIME_DILATION_FROM_STEP: ...from this step
    memory_limit_bytes: int | None = None  # CEPHALO_MEMORY_LIMIT_BYTES: emulated capacity
    pod_uid: str | None = None  # CEPHALO_POD_UID: named on /metrics (whose page it is)
    metrics_address: str = ""  # CEPHALO_METRICS_ADDRESS: /metrics listens here ("": all)
    # CEPHALO_TERMINATION_LOG: rank 0 leaves its final progress there when it completes
    termination_log: str | None = None
    # CEPHALO_LINK_BYTES_PER_SECOND: an emulated slow network (collectives.py)
    link_bytes_per_second: float | None = None
    # Who the job is (its CEPHALO_JOB file's metadata; uid: the operator's copy has it) and
    # CEPHALO_RESTART_ATTEMPT: what an experiment tracker tags the run with.
    job_name: str | None = None
    job_namespace: str | None = None
    job_uid: str | None = None
    restart_attempt: int = 0

    @property
    def layout(self) -> Layout:
        return layout_from_plan(self.plan)


def cuda_device_index(local_rank: int | None, visible_gpus: int) -> int:
    """Which visible GPU (torch's cuda:<index>) a rank drives: its LOCAL_RANK (torchrun and
    the pod launcher set it; the operator's one-rank pods and `cephalo run`'s GPU ranks set
    0 and show the rank only its own GPU). Without LOCAL_RANK the only safe choice is the
    one GPU of a process that sees exactly one; the global rank would pick another rank's
    GPU (or, modulo the count, share one: NCCL refuses two ranks on one GPU). Raises
    EnvError, before the process group forms."""
    if visible_gpus < 1:
        raise EnvError("no CUDA GPU is visible to this rank")
    if local_rank is None:
        if visible_gpus == 1:
            return 0
        raise EnvError(f"{names.LOCAL_RANK} is not set and this rank sees {visible_gpus} "
                       f"GPUs: set {names.LOCAL_RANK} to the GPU it drives (torchrun and "
                       f"`python -m cephalo.trainer` do) or CUDA_VISIBLE_DEVICES to its one GPU")
    if local_rank >= visible_gpus:
        raise EnvError(f"{names.LOCAL_RANK}={local_rank} but this rank sees {visible_gpus} "
                       f"GPU(s) (cuda:0..cuda:{visible_gpus - 1}); start at most one rank per "
                       f"visible GPU, LOCAL_RANK 0..{visible_gpus - 1}")
    return local_rank


def rank_device(local_rank: int | None) -> torch.device:
    """The device a rank computes on: the CPU without CUDA, else `cuda_device_index`'s GPU.
    Raises EnvError (see there)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", cuda_device_index(local_rank, torch.cuda.device_count()))


def layout_from_plan(plan: Plan) -> Layout:
    """The engine's view of a plan (plus its optional per-unit ratio overrides)."""
    overrides = plan.unit_shard_ratios
    try:
        unit_ratios = {int(k): [float(r) for r in v] for k, v in overrides.items()}
    except (TypeError, ValueError, AttributeError):
        raise EnvError("plan unit_shard_ratios must map unit indices to lists of ratios, got "
                       f"{overrides!r}") from None
    groups = plan.replica_groups
    for unit, ratios in unit_ratios.items():
        if len(ratios) != plan.world_size or min(ratios) < 0 or (
                not groups and abs(sum(ratios) - 1) > 1e-9):
            within = " within each replica group" if groups else ""
            raise EnvError(f"plan unit_shard_ratios[{unit}] must hold {plan.world_size} "
                           f"non-negative ratios summing to 1{within}, got {ratios}")
        if groups:
            try:  # hybrid: ratios are shares within a group, the same at each position
                check_groups(groups, ratios, f"unit_shard_ratios[{unit}]")
            except ValueError as err:
                raise EnvError(f"plan {err}") from None
    return Layout(batch_sizes=[r.batch_size for r in plan.ranks],
                  micro_batch_sizes=[r.micro_batch_size for r in plan.ranks],
                  shard_ratios=[r.shard_ratio for r in plan.ranks],
                  unit_shard_ratios=unit_ratios,
                  kept_blocks=[r.kept_blocks for r in plan.ranks],
                  graph_bytes_per_sample=[r.block_graph_bytes_per_sample for r in plan.ranks],
                  precisions=[r.precision for r in plan.ranks],
                  replica_groups=[list(g) for g in groups],
                  replicated_fraction=plan.replicated_fraction or 0.0)


def read_env(env: Mapping[str, str] | None = None) -> TrainerEnv:
    """Parse (cephalo.api.trainer_env, the contract's one reader) and cross-check the
    environment, plan and job; raises EnvError."""
    env = os.environ if env is None else env
    raw = names.read_env(env)
    missing = names.missing(raw, REQUIRED)
    if missing:
        raise EnvError(f"missing environment variable(s) {', '.join(missing)}; run under "
                       f"torchrun ({names.RANK}, {names.WORLD_SIZE}, MASTER_*) with "
                       f"{names.PLAN} and {names.JOB} set ({names.CHECKPOINT_DIR}: where "
                       f"checkpoints go)")
    if (raw.ranks_per_pod or 1) > 1:  # the pod launcher gives each process its own rank
        raise EnvError(f"{names.RANKS_PER_POD}={raw.ranks_per_pod}: a pod of several ranks is "
                       "started with `python -m cephalo.trainer`, which starts one process "
                       "per rank; one rank's process must not see it")
    assert raw.rank is not None and raw.world_size is not None  # REQUIRED
    assert raw.plan is not None and raw.job is not None
    rank, world_size = raw.rank, raw.world_size
    try:
        plan = load_plan(raw.plan)
    except PlanError as err:
        raise EnvError(f"{names.PLAN} {err}") from None
    try:
        resource = load_job(raw.job)
    except JobFileError as err:
        raise EnvError(f"{names.JOB} {err}") from None
    job, meta = resource.spec, resource.metadata
    if plan.world_size != world_size:
        raise EnvError(f"the plan is for {plan.world_size} ranks (one batch size and shard "
                       f"ratio each) but {names.WORLD_SIZE}={world_size}; re-plan or launch "
                       f"{plan.world_size} ranks")
    if plan.global_batch_size != job.global_batch_size:
        raise EnvError(f"the plan's global_batch_size {plan.global_batch_size} differs from "
                       f"the job's globalBatchSize {job.global_batch_size}")
    mine = plan.ranks[rank]
    for name, given, planned in (
            (names.BATCH_SIZE, raw.batch_size, mine.batch_size),
            (names.MICRO_BATCH_SIZE, raw.micro_batch_size, mine.micro_batch_size),
            (names.NUM_MICRO_BATCHES, raw.num_micro_batches, mine.num_micro_batches)):
        if given is not None and given != planned:
            raise EnvError(f"{name}={given} but the plan gives rank {rank} {planned}")
    if raw.shard_ratio is not None and abs(raw.shard_ratio - mine.shard_ratio) > 1e-6:
        raise EnvError(f"{names.SHARD_RATIO}={raw.shard_ratio} but the plan gives rank {rank} "
                       f"{mine.shard_ratio}")
    for r in plan.ranks:
        if r.batch_size > 0 and r.micro_batch_size == 0:
            raise EnvError(f"plan rank {r.rank} has batch_size {r.batch_size} but "
                           f"micro_batch_size 0")
    layout_from_plan(plan)  # validates per-unit ratio overrides before any rank starts
    _check_kept_blocks(plan, job)
    _check_precisions(plan, job)
    try:  # a missing or unusable token file fails here, on every rank, before any collective
        DataSource(job.model.resolve(), job.data, job.training.seed)
    except ValueError as err:
        raise EnvError(f"{names.JOB} {raw.job}: {err}") from None
    checkpoint_dir = raw.checkpoint_dir or None  # set and empty: no checkpoints
    if checkpoint_dir is not None:
        _check_storage_backend(checkpoint_dir)
    return TrainerEnv(
        num_threads=raw.num_threads or None, time_dilation=raw.time_dilation or 1.0,
        time_dilation_from_step=raw.time_dilation_from_step or 0,
        memory_limit_bytes=raw.memory_limit_bytes or None, rank=rank,
        world_size=world_size, local_rank=raw.local_rank,
        plan=plan, job=job, checkpoint_dir=checkpoint_dir, metrics_port=raw.metrics_port or 0,
        metrics_file=_metrics_file(raw.metrics_file, checkpoint_dir),
        timeout_seconds=raw.collective_timeout_seconds or DEFAULT_COLLECTIVE_TIMEOUT_SECONDS,
        stop_after_step=raw.stop_after_step, pod_uid=raw.pod_uid,
        metrics_address=raw.metrics_address or "", termination_log=raw.termination_log,
        link_bytes_per_second=raw.link_bytes_per_second,
        job_name=meta.name, job_namespace=meta.namespace,
        job_uid=str((meta.model_extra or {}).get("uid") or "") or None,
        restart_attempt=raw.restart_attempt or 0)


def _check_kept_blocks(plan: Plan, job: CephaloJobSpec) -> None:
    """The engine's checks of the ranks' `kept_blocks`, on every rank before any collective."""
    kept = [r.kept_blocks for r in plan.ranks]
    if plan.recompute is False and any(kept):
        raise EnvError(f"the plan has recompute false (every block's graph kept) and "
                       f"kept_blocks {kept}, which is for recompute mode; re-plan")
    layers = job.model.resolve().num_layers
    if max(kept, default=0) > layers:
        raise EnvError(f"the plan's kept_blocks {kept} exceed the model's {layers} blocks; "
                       "re-plan for this model")


def _check_precisions(plan: Plan, job: CephaloJobSpec) -> None:
    """A job's `precision: auto` needs the planner's per-rank choice (every rank's)."""
    if job.precision == "auto":
        missing = [r.rank for r in plan.ranks if r.precision is None]
        if missing:
            raise EnvError(f"the job's precision is auto but the plan gives no precision for "
                           f"rank(s) {missing}; re-plan (the planner resolves auto per rank) "
                           "or set spec.precision to fp32, bf16 or fp16")


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
        raise EnvError(f"{names.CHECKPOINT_DIR}={location}: unknown storage scheme "
                       f"{protocol}://; use a shared folder or s3://, gs://, az://") from None
    except ImportError as err:
        raise EnvError(f"{names.CHECKPOINT_DIR}={location}: {' '.join(str(err).split())} "
                       f"(the trainer image lacks the fsspec package for {protocol}://)"
                       ) from None
