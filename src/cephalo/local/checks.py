"""What `cephalo run` checks before it writes anything: the run directory (never outside
runs/, --resume only onto a run with a checkpoint), the data and a given plan against the job
and the devices. A refused run leaves nothing behind (`make_run_dir` / `remove_created`).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from cephalo.api.job import CephaloJob, CephaloJobSpec, TrainingSpec, format_validation_error
from cephalo.api.plan import Plan, PlanError, check_replica_groups
from cephalo.corpus import check_remote_file, check_text
from cephalo.errors import CephaloError
from cephalo.local.devices import LocalDevice
from cephalo.planner.outputs.report import plural
from cephalo.tokenfile import sidecar_mismatch


class RunError(CephaloError, ValueError):
    """A `cephalo run` input that cannot work: one line, non-zero exit, nothing running."""


@dataclass
class RunOptions:
    job_path: str
    devices: str | None = None
    emulate: str | None = None
    plan_path: str | None = None
    run_dir: str | None = None
    resume: bool = False
    steps: int | None = None
    memory_scale: float | None = None
    stop_after_step: int | None = None
    runs_root: str = "runs"
    metrics_port: int = 0  # rank r serves Prometheus /metrics on 127.0.0.1:port+r; 0: none


def run_name(job: CephaloJob, job_path: str) -> str:
    """The folder name under runs/: metadata.name (validated: a DNS label), else the file's
    stem made into one, so that no name (`..`, `/etc/x`) can lead outside runs/."""
    if job.metadata.name:
        return job.metadata.name
    stem = re.sub(r"[^a-z0-9-]+", "-", Path(job_path).stem.lower()).strip("-")
    return stem[:47] or "job"


def has_complete_checkpoint(run_dir: Path) -> bool:
    """A checkpoint the ranks can resume from (its COMPLETE marker is written last)."""
    return latest_complete_step(run_dir) is not None


def latest_complete_step(run_dir: Path) -> int | None:
    """The step of the run directory's last complete checkpoint (`step-00000040/COMPLETE`,
    trainer/checkpoint.py), or None."""
    steps = [int(marker.parent.name[len("step-"):])
             for marker in (run_dir / "checkpoints").glob("step-*/COMPLETE")
             if marker.parent.name[len("step-"):].isdigit()]
    return max(steps, default=None)


def _check_resumable(run_dir: Path, spec: CephaloJobSpec, missing: str) -> None:
    """`missing`: the clause that says what lacks a complete checkpoint."""
    if spec.checkpoint.ephemeral:
        raise RunError("--resume: the job keeps no checkpoints (checkpoint.ephemeral: true); "
                       "run it again without --resume")
    if spec.checkpoint.uri is None and not has_complete_checkpoint(run_dir):
        raise RunError(f"--resume: {missing}, so it would start at step 0; run without "
                       "--resume to start afresh")


def choose_run_dir(job: CephaloJob, options: RunOptions) -> Path:
    """The run directory, checked but not created (`make_run_dir` does that)."""
    name = run_name(job, options.job_path)
    if options.run_dir:
        run_dir = Path(options.run_dir)
        if run_dir.exists() and not run_dir.is_dir():
            raise RunError(f"--run-dir {run_dir} is a file, not a folder")
        if options.resume:
            if not run_dir.is_dir():  # a typo must not start a fresh run silently
                raise RunError(f"--resume --run-dir {run_dir}: no such run folder; check the "
                               "path, or drop --resume to start a new run there")
            _check_resumable(run_dir, job.spec, f"{run_dir} holds no complete checkpoint")
        elif (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
            raise RunError(f"{run_dir} already holds checkpoints: pass --resume to continue "
                           f"that run, or choose another --run-dir")
    elif options.resume:
        root = Path(options.runs_root) / name
        runs = sorted(p for p in root.glob("*") if p.is_dir())
        resumable = [p for p in runs if has_complete_checkpoint(p)] \
            if job.spec.checkpoint.uri is None else runs
        if not resumable:
            _check_resumable(runs[-1] if runs else root, job.spec,
                             f"no earlier run of {name!r} under {root} holds a complete "
                             "checkpoint")
            raise RunError(f"--resume: no earlier run of {name!r} under {root}; start one "
                           "without --resume")
        run_dir = resumable[-1]
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = Path(options.runs_root) / name / stamp
        suffix = 1
        while run_dir.exists():
            suffix += 1
            run_dir = Path(options.runs_root) / name / f"{stamp}-{suffix}"
    return run_dir


def make_run_dir(run_dir: Path) -> list[Path]:
    """Create run_dir; the folders this created, deepest first (to remove on a refusal)."""
    created = []
    for folder in [run_dir, *run_dir.parents]:
        if folder.exists():
            break
        created.append(folder)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunError(f"cannot create run folder {run_dir}: {err.strerror or err}") from None
    return created


def remove_created(created: list[Path]) -> None:
    """Undo make_run_dir: a refused run leaves nothing behind (nor an empty folder that a
    later --resume would pick)."""
    if created:
        shutil.rmtree(created[0], ignore_errors=True)
        for folder in created[1:]:
            try:
                folder.rmdir()
            except OSError:
                break


def check_inputs(spec: CephaloJobSpec, options: RunOptions) -> None:
    """What would otherwise fail only after the profiler or the ranks started."""
    if options.steps is not None:  # the override meets the job's own limits
        try:
            TrainingSpec.model_validate({**spec.training.model_dump(by_alias=True),
                                         "steps": options.steps})
        except ValidationError as err:
            raise RunError(f"--steps {options.steps}: {format_validation_error(err)}") from None
    if spec.tracking is not None and spec.tracking.tensorboard and \
            importlib.util.find_spec("tensorboard") is None:
        raise RunError("spec.tracking.tensorboard: the tensorboard package is not installed "
                       "here; pip install 'cephalo[tracking]', or drop tracking.tensorboard")
    mlflow = spec.tracking.mlflow if spec.tracking is not None else None
    if mlflow is not None and importlib.util.find_spec("mlflow") is None:
        raise RunError("spec.tracking.mlflow: the mlflow package is not installed here; pip "
                       "install 'cephalo[tracking]' (mlflow-skinny), or drop tracking.mlflow")
    if mlflow is not None and not mlflow.tracking_uri and not os.environ.get(
            "MLFLOW_TRACKING_URI"):
        raise RunError("spec.tracking.mlflow: no tracking server: set "
                       "tracking.mlflow.trackingUri (e.g. http://127.0.0.1:5000) or "
                       "MLFLOW_TRACKING_URI")
    token = spec.data.token_file
    if token is not None and "://" in token.path:  # object storage: the ranks download it
        check_remote_file(token.path, "data.tokenFile.path")
    elif token is not None:  # local; a claimName's path too: the ranks read it from here
        path = Path(token.path)
        if not path.is_file():
            what = "is a folder" if path.is_dir() else "does not exist"
            raise RunError(f"data.tokenFile.path {token.path} {what}"
                           f"{_on_this_machine(token.claim_name)}; give the token file "
                           "(a flat binary of token ids) or use data: {synthetic: {}}")
        problem = sidecar_mismatch(path, token.dtype, spec.model.resolve().vocab_size)
        if problem is not None:
            raise RunError(problem)
    text = spec.data.text
    if text is not None:
        config = spec.model.resolve()
        if config.family not in ("gpt", "llama"):
            raise RunError(f"data.text needs a language model (gpt or llama), the job's "
                           f"model is {config.family}; use data: {{synthetic: {{}}}}")
        try:
            check_text(text.uri or text.path or "", text.format, text.field, text.tokenizer,
                       text.eos_id, config.vocab_size)
        except CephaloError as err:
            raise RunError(f"data.text: {err}{_on_this_machine(text.claim_name)}") from None


HOSTNAME_LOOKUP_SECONDS = 10.0  # a resolver that answers takes milliseconds


def check_metrics_ports(first: int, world_size: int) -> None:
    """`--metrics-port`: every rank's port (first + rank) exists and is free on loopback,
    before any rank starts (a rank that cannot bind only warns and serves nothing)."""
    last = first + world_size - 1
    if last > 65535:
        raise RunError(f"--metrics-port {first}: {world_size} ranks need ports {first} to "
                       f"{last}, past 65535; give a lower port")
    for rank, port in enumerate(range(first, last + 1)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError as err:
                raise RunError(f"--metrics-port {first}: port {port} (rank {rank}) is taken "
                               f"({err.strerror}); give another port") from None


def check_hostname_resolves(timeout_s: float = HOSTNAME_LOOKUP_SECONDS) -> None:
    """torchrun's agent looks up this machine's own name; where nothing resolves it (a
    container under `buildah run --isolation chroot` whose hostname is not in /etc/hosts,
    and no DNS), the rendezvous waits in gethostbyname without a word. Refuse instead."""
    name = socket.gethostname()
    failure: list[str] = []

    def lookup() -> None:
        try:
            socket.gethostbyname(name)
        except OSError as err:
            failure.append(str(err))

    thread = threading.Thread(target=lookup, daemon=True)  # gethostbyname cannot be cancelled
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive() or failure:
        why = failure[0] if failure else f"no answer in {timeout_s:g} s"
        raise RunError(f"this machine's hostname {name!r} does not resolve ({why}): torchrun's "
                       "rendezvous would wait for it; add it to /etc/hosts (127.0.1.1 "
                       f"{name}) or start the container with --hostname localhost")


def _on_this_machine(claim_name: str | None) -> str:
    """Why a cluster job's volume path is missing here: `cephalo run` mounts nothing."""
    if claim_name is None:
        return ""
    return (f" on this machine (cephalo run mounts no volume: claimName {claim_name!r} "
            "applies on a cluster; put the data at that path here)")


def check_memory_scale(scale: float | None, devices: list[LocalDevice]) -> None:
    """`--emulate-memory-scale`: a fraction of each emulated GPU's catalog memory, and only
    where GPUs are emulated (elsewhere it would be ignored without a word)."""
    if scale is None:
        return
    if not math.isfinite(scale) or not 0 < scale <= 1:
        raise RunError(f"--emulate-memory-scale {scale} must be in (0, 1]: the fraction of "
                       "each emulated GPU's catalog memory a CPU rank gets")
    if not any(d.emulated for d in devices):
        raise RunError("--emulate-memory-scale applies to emulated GPUs only; add --emulate "
                       "GPUS (e.g. RTX-A6000,P40) or leave it out")


def check_plan(plan: Plan, devices: list[LocalDevice], source: str,
               spec: CephaloJobSpec | None = None) -> list[LocalDevice]:
    """A given plan fits the job and the devices (checked before any rank starts); the
    device each of its ranks runs on."""
    if spec is not None:
        check_plan_fits_job(plan, spec, source)
    used = plan_rank_devices(plan, devices, source)
    for rank, device in zip(plan.ranks, used, strict=True):
        if rank.gpu not in ("cpu", device.product):
            raise RunError(f"{source}: rank {rank.rank} is planned for {rank.gpu} but runs on "
                           f"{device.label}; re-plan for these devices")
    return used


def check_device_precisions(spec: CephaloJobSpec, devices: list[LocalDevice],
                            plan: Plan | None = None) -> None:
    """Every device can run the precision its rank will compute in (the plan's, else the
    job's; `auto` is the planner's to resolve, and each rank checks again on start)."""
    wanted = [r.precision or spec.precision for r in plan.ranks] if plan is not None \
        else [spec.precision] * len(devices)
    # fp32 runs on every device (trainer.precision.precision_problem): nothing to probe, and
    # importing torch just to learn that costs this command ~2 s of CPU.
    if all(p in ("fp32", "auto") for p in wanted[:len(devices)]):
        return
    import torch

    from cephalo.trainer.precision import PrecisionError, check_precision

    for device, precision in zip(devices, wanted, strict=False):
        if precision == "auto":
            continue
        # An emulated GPU is a CPU rank: its catalog GPU's speed is the planner's concern.
        where = torch.device("cpu") if device.emulated or device.kind == "cpu" \
            else torch.device(device.kind, device.index)
        try:
            check_precision(where, precision)
        except PrecisionError as err:
            raise RunError(f"{device.label}: {err}") from None


def plan_rank_devices(plan: Plan, devices: list[LocalDevice],
                      source: str) -> list[LocalDevice]:
    """The device each rank of a plan runs on: the devices in order, or, where the plan left
    some of them idle (`idle_gpus`: fewer were faster), the one its `gpu_index` names (the
    position in `build_cluster`'s order, which is the device order). A run's own plan.json
    is such a plan whenever the planner idled a device, and `--plan` must take it back on
    the devices it was planned for."""
    indices = [r.gpu_index for r in plan.ranks]
    if plan.world_size == len(devices):
        return devices
    if plan.world_size < len(devices) and all(
            i is not None and i < len(devices) for i in indices) and \
            len(set(indices)) == len(indices):
        return [devices[i] for i in indices if i is not None]
    selected = f"{plural(len(devices), 'device')} {'was' if len(devices) == 1 else 'were'}"
    raise RunError(f"{source} is for {plural(plan.world_size, 'rank')} but {selected} selected "
                   f"({', '.join(d.label for d in devices)}); pass --devices/--emulate with "
                   f"{plural(plan.world_size, 'device')} or re-plan")


def check_plan_fits_job(plan: Plan, spec: CephaloJobSpec, source: str) -> None:
    if plan.global_batch_size != spec.global_batch_size:
        raise RunError(f"{source} is for global batch {plan.global_batch_size} but the job's "
                       f"globalBatchSize is {spec.global_batch_size}; re-plan for the job")
    units = spec.model.resolve().num_units
    overrides = plan.unit_shard_ratios
    if not isinstance(overrides, dict):
        raise RunError(f"{source}: unit_shard_ratios must map unit indices to lists of ratios")
    for unit, ratios in overrides.items():
        index = int(unit) if isinstance(unit, str) and unit.isdigit() else -1
        if not 0 <= index < units:
            raise RunError(f"{source}: unit_shard_ratios key {str(unit)[:20]!r} is not a unit "
                           f"index 0..{units - 1} of this model")
        groups = plan.replica_groups  # hybrid: ratios are shares within each group
        ok = isinstance(ratios, list) and len(ratios) == plan.world_size and all(
            isinstance(r, int | float) and not isinstance(r, bool) and 0 <= r <= 1
            for r in ratios) and (groups or abs(sum(ratios) - 1) <= 1e-9)
        if not ok:
            within = " within each replica group" if groups else ""
            raise RunError(f"{source}: unit_shard_ratios[{index}] must hold {plan.world_size} "
                           f"ratios in [0, 1] summing to 1{within}")
        if groups:
            try:
                check_replica_groups(groups, [float(r) for r in ratios],
                                     f"unit_shard_ratios[{index}]")
            except PlanError as err:
                raise RunError(f"{source}: {err}") from None
