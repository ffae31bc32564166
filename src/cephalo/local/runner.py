"""The `cephalo run` flow: job → devices → profiles → plan → ranks → summary.

Everything lands in a run directory (default `runs/<job>/<timestamp>`): job.yaml, plan.json,
profiles/, logs/rank-N.log, metrics.jsonl, checkpoints/, loss.png, time_breakdown.png,
tensorboard/ (spec.tracking.tensorboard), mlflow-run.json (spec.tracking.mlflow).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

import yaml
from pydantic.alias_generators import to_camel

from cephalo.api.cluster import ClusterSpec, GpuGroup
from cephalo.api.job import CephaloJob, CephaloJobSpec, TrainingSpec, load_job
from cephalo.api.plan import Plan, PlanError, load_plan
from cephalo.api.profile import GpuProfile
from cephalo.api.schedule import learning_rate
from cephalo.api.trainer_env import TrainerVars, to_environ
from cephalo.local.checks import (
    RunError,
    RunOptions,
    check_device_precisions,
    check_hostname_resolves,
    check_inputs,
    check_memory_scale,
    check_metrics_ports,
    check_plan,
    choose_run_dir,
    latest_complete_step,
    make_run_dir,
    plan_rank_devices,
    remove_created,
)
from cephalo.local.devices import DeviceError, LocalDevice, select_devices
from cephalo.local.emulate import (
    Emulation,
    emulated_profile,
    given_plan_emulation,
    plan_emulation,
)
from cephalo.local.ranks import RankEnv, launch, run_group
from cephalo.local.report import (
    Progress,
    format_summary,
    read_history,
    summarize,
    write_plots,
)
from cephalo.planner import solve
from cephalo.planner.cost.catalog import lookup_gpu, resolve_precision
from cephalo.planner.feedback.measured_sizes import describe_unmeasured, plan_on_measured_sizes
from cephalo.planner.feedback.recalibrate import split_step_seconds
from cephalo.planner.outputs.report import format_plan, model_title

# Collectives between local processes: gloo over loopback, or NCCL over PCIe.
LOOPBACK_BANDWIDTH_BYTES_PER_SECOND = 2e9
PCIE_BANDWIDTH_BYTES_PER_SECOND = 10e9
LOCAL_LATENCY_SECONDS = 1e-4


EMULATE_ANNOTATION = "cephalo.dev/local-emulate"


def contention_factor(devices: list[LocalDevice],
                      dilation: dict[str, float] | None = None) -> float:
    """CPU ranks that compute at the same time beyond the core count share cores: each runs
    this much slower than the profiler (which ran alone) measured. An emulated rank with
    time dilation d computes only 1/d of the time (it sleeps the rest), so it demands 1/d
    of a core."""
    demand = sum(1.0 / (dilation or {}).get(d.product, 1.0) for d in devices
                 if d.kind == "cpu")
    return max(1.0, demand / (os.cpu_count() or 1))


def slowed(profile: GpuProfile, factor: float) -> GpuProfile:
    if factor == 1.0:
        return profile
    points = [p.model_copy(update={
        k: getattr(p, k) * factor for k in ("block_forward_seconds", "block_backward_seconds",
                                            "other_forward_seconds", "other_backward_seconds")})
        for p in profile.points]
    # Per-step and per-pass work is CPU work too: the measured real step slows as a whole
    # (so the step overhead the planner derives from it scales by `factor` as well).
    scalars = {k: getattr(profile, k) * factor
               for k in ("block_forward_fixed_seconds", "other_forward_fixed_seconds",
                         "optimizer_seconds_fixed", "optimizer_seconds_per_parameter")
               if getattr(profile, k) is not None}
    if profile.single_rank_step is not None:
        scalars["single_rank_step"] = profile.single_rank_step.model_copy(
            update={"seconds": profile.single_rank_step.seconds * factor})
    return profile.model_copy(update={"points": points, **scalars})


def _threads_per_rank(devices: list[LocalDevice]) -> int:
    cpu_ranks = sum(d.kind == "cpu" for d in devices)
    return max(1, (os.cpu_count() or 1) // max(cpu_ranks, 1)) if cpu_ranks else 2


def write_job(job: CephaloJob, options: RunOptions, run_dir: Path) -> Path:
    """The job as the ranks see it: step override applied, relative paths made absolute
    (ranks run inside the run directory)."""
    data = job.model_dump(by_alias=True, exclude_none=True, mode="json")
    if options.steps is not None:
        data["spec"].setdefault("training", {})["steps"] = options.steps
    token = data["spec"].get("data", {}).get("tokenFile")
    if token and "://" not in token["path"]:  # a URL is fetched by the ranks as it is
        token["path"] = str(Path(token["path"]).resolve())
    text = data["spec"].get("data", {}).get("text")
    if text:  # data.text: its local path and tokenizer folder (not URLs, not "byte-level")
        if text.get("path"):
            text["path"] = str(Path(text["path"]).resolve())
        tokenizer = text.get("tokenizer")
        if tokenizer and "://" not in tokenizer and tokenizer != "byte-level":
            text["tokenizer"] = str(Path(tokenizer).resolve())
    model = data["spec"].get("model", {})
    if model.get("pretrained") and "://" not in model["pretrained"]:  # a local HF folder
        model["pretrained"] = str(Path(model["pretrained"]).resolve())
    data.pop("status", None)
    path = run_dir / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def profile_devices(devices: list[LocalDevice], job_file: Path, run_dir: Path,
                    threads: int, out=print) -> dict[str, GpuProfile]:
    """One profile per distinct real device type (cached between runs by the profiler)."""
    profiles: dict[str, GpuProfile] = {}
    folder = run_dir / "profiles"
    folder.mkdir(exist_ok=True)
    for device in devices:
        kind = "cpu" if device.kind == "cpu" else device.product
        if kind in profiles:
            continue
        output = folder / f"measured-{kind}.json"
        # The first profile also measures the collectives where there is more than one
        # device to measure them between.
        collectives = not profiles and len(devices) > 1
        command, visible = profile_command(device, devices, collectives, job_file, output)
        env = dict(os.environ, **to_environ(TrainerVars(num_threads=threads)),
                   OMP_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES=visible)
        profiles[kind] = _measure(command, env, run_dir, output, device.label, kind, out)
    measured = [p.collectives for p in profiles.values() if p.collectives is not None]
    if measured:  # the run's collectives hold for every device type in it
        profiles = {k: p.model_copy(update={"collectives": measured[0]})
                    for k, p in profiles.items()}
    return profiles


def profile_command(device: LocalDevice, devices: list[LocalDevice], collectives: bool,
                    job_file: Path, output: Path) -> tuple[list[str], str]:
    """The profiler's command for `device` and the CUDA_VISIBLE_DEVICES it runs with.

    `collectives`: torchrun with one process per device, which also measures the
    collectives; rank 0 then profiles its device. Every rank needs a GPU of its own (NCCL
    gives no two ranks one device, and rank r takes cuda:LOCAL_RANK): every device of the
    run is visible, the profiled one first so that it is rank 0's cuda:0 — on a
    workstation with two different GPUs, the other product's GPU is the second rank's."""
    command = [sys.executable, "-m", "cephalo.trainer.profile", "--job", str(job_file),
               "--output", str(output)]
    if device.kind == "cpu":
        visible = ""
    elif collectives:
        visible = ",".join(str(d.index) for d in [device, *[d for d in devices if d != device]])
    else:
        visible = str(device.index)
    if collectives:
        # CPU ranks beyond the core count would measure the scheduler, not the transport:
        # measure on at most one rank per core and let the ring model extend it to the
        # run's world size.
        ranks = len(devices) if device.kind != "cpu" else \
            max(2, min(len(devices), os.cpu_count() or 1))
        command[1:3] = ["-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={ranks}", "-m", "cephalo.trainer.profile",
                        "--collectives"]
    return command, visible


def _measure(command: list[str], env: dict[str, str], run_dir: Path, output: Path, label: str,
             kind: str, out) -> GpuProfile:
    """Run one profiler command and read the profile it wrote to `output`."""
    done = run_group(command, env, run_dir)
    if done.returncode != 0:
        raise RunError(f"profiling {label} failed: "
                       f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    said = [line for line in done.stderr.splitlines() if line.startswith("profile: wrote")]
    if said:  # what was measured, what came from the cache, and how long it took
        out("  " + said[-1].replace(f"profile: wrote {output}", f"profiled {kind}", 1))
    return GpuProfile.model_validate_json(output.read_text())


def emulation_cpu_profiles(cpu: GpuProfile, products: list[str], precision: str,
                           job_file: Path, run_dir: Path, threads: int,
                           out=print) -> dict[str, GpuProfile]:
    """The CPU's profile in each precision the emulated GPUs compute in ({precision:
    profile}): the job's, or under "auto" each GPU's fastest (an emulated V100 computes
    fp16 on the CPU, so its profile is the CPU's fp16 one, dilated). `cpu` is the measured
    one; the others are measured here (--precision)."""
    wanted = sorted({resolve_precision(precision, lookup_gpu(p)) for p in products})
    profiles: dict[str, GpuProfile] = {cpu.precision: cpu}
    env = dict(os.environ, **to_environ(TrainerVars(num_threads=threads)),
               OMP_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="")
    for other in (p for p in wanted if p not in profiles):
        output = run_dir / "profiles" / f"measured-cpu-{other}.json"
        command = [sys.executable, "-m", "cephalo.trainer.profile", "--job", str(job_file),
                   "--output", str(output), "--precision", other]
        measured = _measure(command, env, run_dir, output, f"the CPU in {other}",
                            f"cpu ({other})", out)
        # The run's collectives (measured with the first profile) hold in every precision.
        profiles[other] = measured.model_copy(update={"collectives": cpu.collectives})
    return profiles


def _as_planned(devices: list[LocalDevice],
                emulation: Emulation | None) -> Callable[[str, GpuProfile], GpuProfile]:
    """How a profile the profiler measured becomes the one the planner gets for `product`
    (as _run_in makes them): an emulated GPU's is the CPU's dilated, CPU ranks' the CPU's
    slowed by core sharing, a real GPU's as measured."""
    def convert(product: str, measured: GpuProfile) -> GpuProfile:
        if emulation is not None and product in emulation.dilation:
            return emulated_profile(measured, product, emulation,
                                    contention_factor(devices, emulation.dilation))
        if product == "cpu":
            return slowed(measured, contention_factor(devices))
        return measured
    return convert


def measure_micro_batch_sizes(wanted: Mapping[str, list[int]],
                              profiles: Mapping[str, GpuProfile], devices: list[LocalDevice],
                              precision: str, job_file: Path, run_dir: Path, threads: int,
                              as_planned: Callable[[str, GpuProfile], GpuProfile],
                              out=print) -> dict[str, GpuProfile]:
    """Measure the micro-batch sizes a plan assigns beyond its profiles ({product: sizes},
    cephalo.planner.feedback.measured_sizes): one profiler pass (--micro-batch-sizes) per
    device that measures them, cached by the profiler with the other sizes. An emulated GPU's
    sizes are measured on the CPU in the precision it computes in (one pass for every emulated
    GPU of that precision). Returns {product: profile with just those points}, as planned."""
    out(f"Measuring {describe_unmeasured(wanted, profiles)} …")
    passes: dict[tuple[str, str | None], tuple[LocalDevice, set[int], list[str]]] = {}
    for product, sizes in wanted.items():
        device = next(d for d in devices if d.product == product)
        # The CPU measures emulated GPUs in their own precision, plain CPU ranks in the job's.
        on = ("cpu", resolve_precision(precision, lookup_gpu(product)) if device.emulated
              else None) if device.kind == "cpu" else (product, None)
        _, held, products = passes.setdefault(on, (device, set(), []))
        held.update(sizes)
        products.append(product)
    extra: dict[str, GpuProfile] = {}
    for (kind, measured_in), (device, held_sizes, products) in passes.items():
        ordered = sorted(held_sizes)
        listed = ",".join(map(str, ordered))
        name = "-".join([kind, *([measured_in] if measured_in else []), "mbs",
                         *map(str, ordered)])
        output = run_dir / "profiles" / f"measured-{name}.json"
        env = dict(os.environ, **to_environ(TrainerVars(num_threads=threads)),
                   OMP_NUM_THREADS=str(threads),
                   CUDA_VISIBLE_DEVICES="" if device.kind == "cpu" else str(device.index))
        command = [sys.executable, "-m", "cephalo.trainer.profile", "--job", str(job_file),
                   "--output", str(output), "--micro-batch-sizes", listed]
        if measured_in:
            command += ["--precision", measured_in]
        measured = _measure(command, env, run_dir, output, device.label, kind, out)
        for product in products:
            extra[product] = as_planned(product, measured)
    return extra


def build_cluster(devices: list[LocalDevice], host_memory_bytes: int | None = None) -> ClusterSpec:
    """Consecutive devices of one product form a group (rank order = device order)."""
    groups: list[GpuGroup] = []
    cpu_ranks = sum(d.kind == "cpu" and not d.emulated for d in devices)
    for d in devices:
        memory = None
        if d.kind == "cpu" and not d.emulated and host_memory_bytes:
            memory = host_memory_bytes // cpu_ranks  # the ranks share the host's memory
        if groups and groups[-1].product == d.product and groups[-1].memory_bytes == memory:
            groups[-1].count += 1
        else:
            groups.append(GpuGroup(product=d.product, count=1, memory_bytes=memory,
                                   pool="local"))
    on_gpu = any(d.kind == "cuda" for d in devices)
    # The ranks' library, as the trainer picks it: emulated GPUs are CPU ranks (gloo).
    return ClusterSpec(groups=groups, network_latency_seconds=LOCAL_LATENCY_SECONDS,
                       network_bandwidth_bytes_per_second=PCIE_BANDWIDTH_BYTES_PER_SECOND
                       if on_gpu else LOOPBACK_BANDWIDTH_BYTES_PER_SECOND,
                       collective_backend="nccl" if on_gpu else "gloo")


def _mlflow_run_url(state_file: Path) -> str | None:
    """The MLflow UI's page of the run rank 0 logged to (trainer/mlflow_log.py's id file)."""
    try:
        saved = json.loads(state_file.read_text())
        return (f"{saved['tracking_uri'].rstrip('/')}/#/experiments/"
                f"{saved['experiment_id']}/runs/{saved['run_id']}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def resume_command(options: RunOptions, run_dir: Path) -> str:
    """The command that continues this run: the same job, devices, plan and step override."""
    given = [("--devices", options.devices), ("--emulate", options.emulate),
             ("--emulate-memory-scale", options.memory_scale), ("--plan", options.plan_path),
             ("--steps", options.steps)]
    extra = "".join(f" {flag} {value}" for flag, value in given if value is not None)
    return f"cephalo run {options.job_path}{extra} --resume --run-dir {run_dir}"


def interrupted_hint(options: RunOptions, spec: CephaloJobSpec, run_dir: Path) -> str:
    """After Ctrl-C: `--resume` only where there is something to resume, naming its step."""
    if spec.checkpoint.ephemeral:
        return ("Interrupted: all ranks stopped. The job keeps no checkpoints "
                "(checkpoint.ephemeral: true): run it again to start over.")
    if spec.checkpoint.uri:  # object storage: the ranks' checkpoints are not listed here
        return (f"Interrupted: all ranks stopped. Continue from the last complete checkpoint "
                f"under {spec.checkpoint.uri} with: {resume_command(options, run_dir)}")
    step = latest_complete_step(run_dir)
    if step is None:
        return ("Interrupted: all ranks stopped before any checkpoint was complete "
                f"(checkpoint.intervalSteps: {spec.checkpoint.interval_steps}), so there is "
                f"nothing to resume: run it again to start at step 0.")
    return (f"Interrupted: all ranks stopped; the last complete checkpoint is step {step}. "
            f"Continue from it with: {resume_command(options, run_dir)}")


SCHEDULE_FIELDS = ("steps", "learning_rate", "schedule", "warmup_steps", "min_learning_rate_ratio")


def schedule_change(run_dir: Path, training: TrainingSpec, steps: int | None) -> str | None:
    """On --resume: what a changed training section (say `--steps 60` after a 200-step run)
    does to the learning-rate schedule at the step the run continues from, or None."""
    step = latest_complete_step(run_dir)
    try:
        before = load_job(str(run_dir / "job.yaml")).spec.training
    except (OSError, ValueError):
        return None  # the run's own job.yaml is gone: nothing to compare with
    after = training if steps is None else training.model_copy(update={"steps": steps})
    changed = [(f, getattr(before, f), getattr(after, f)) for f in SCHEDULE_FIELDS
               if getattr(before, f) != getattr(after, f)]
    if step is None or not changed:
        return None
    what = ", ".join(f"training.{to_camel(f)} {new} (the run had {old})"
                     for f, old, new in changed)
    return (f"Resuming after step {step} with {what}: the learning-rate schedule now ends at "
            f"step {after.steps}; lr at step {step + 1} {learning_rate(before, step):.2e} -> "
            f"{learning_rate(after, step):.2e}")


def run_job(options: RunOptions, out=print) -> int:
    try:
        job = load_job(options.job_path)
    except ValueError as err:
        raise RunError(str(err)) from None
    annotations = (job.metadata.model_extra or {}).get("annotations") or {}
    emulate = options.emulate
    if emulate is None and options.devices is None and annotations.get(EMULATE_ANNOTATION):
        from cephalo.local.devices import cuda_products

        if not cuda_products():  # the job's suggestion for machines without a GPU
            emulate = annotations[EMULATE_ANNOTATION]
            out(f"No GPU here: emulating {emulate} on CPU ranks (annotation "
                f"{EMULATE_ANNOTATION}; override with --devices or --emulate)")
    try:
        devices = select_devices(options.devices, emulate)
    except (DeviceError, ValueError) as err:
        raise RunError(str(err)) from None
    # Everything that can be refused is refused before anything is written.
    check_inputs(job.spec, options)
    check_memory_scale(options.memory_scale, devices)
    if len(devices) > 1:  # one device runs no rendezvous
        check_hostname_resolves()
    given_plan: Plan | None = None
    emulation: Emulation | None = None  # a given plan's; else _run_in's, after profiling
    if options.plan_path:
        try:
            given_plan = load_plan(options.plan_path)
        except PlanError as err:
            raise RunError(str(err)) from None
        used = check_plan(given_plan, devices, options.plan_path, job.spec)
        check_device_precisions(job.spec, used, given_plan)
        if any(d.emulated for d in devices):
            try:
                emulation = given_plan_emulation(given_plan, [d.product for d in used],
                                                 job.spec.precision, options.plan_path,
                                                 options.memory_scale,
                                                 [d.product for d in devices])
            except ValueError as err:
                raise RunError(str(err)) from None
    if given_plan is None:
        check_device_precisions(job.spec, devices)
    run_dir = choose_run_dir(job, options)
    if options.resume:
        note = schedule_change(run_dir, job.spec.training, options.steps)
        if note:
            out(note)
    created = make_run_dir(run_dir)
    run_dir = run_dir.resolve()
    try:
        return _run_in(run_dir, job, options, devices, given_plan, emulation, out)
    except BaseException:
        remove_created(created)
        raise


def _run_in(run_dir: Path, job: CephaloJob, options: RunOptions, devices: list[LocalDevice],
            given_plan: Plan | None, emulation: Emulation | None, out) -> int:
    job_file = write_job(job, options, run_dir)
    spec = load_job(str(job_file)).spec
    threads = _threads_per_rank(devices)
    # The model's step for another split of the plan (None: a plan given by hand, whose
    # inputs are not known here).
    price_split: Callable[[list[int]], float] | None = None
    if given_plan is not None:
        plan = given_plan
        if emulation is not None:
            for product in sorted(emulation.dilation):
                out(f"  EMULATION: {emulation.describe(product)}")
    else:
        kinds = sorted({"cpu" if d.kind == "cpu" else d.product for d in devices})
        out(f"Profiling {', '.join(kinds)} (compute profiles are cached between runs; the "
            f"collectives are measured every run) …")
        measured = profile_devices(devices, job_file, run_dir, threads, out)
        profiles = dict(measured)
        if any(d.emulated for d in devices):
            model = spec.model.resolve()
            emulation = plan_emulation(measured["cpu"], [d.product for d in devices], model,
                                       spec.precision, spec.planner.memory_fraction,
                                       options.memory_scale)
            contention = contention_factor(devices, emulation.dilation)
            cpu_in = emulation_cpu_profiles(measured["cpu"], list(emulation.dilation),
                                            spec.precision, job_file, run_dir, threads, out)
            for product in sorted(emulation.dilation):
                cpu = cpu_in[resolve_precision(spec.precision, lookup_gpu(product))]
                profiles[product] = emulated_profile(cpu, product, emulation, contention)
                (run_dir / "profiles" / f"emulated-{product}.json").write_text(
                    profiles[product].to_compact_json())
                out(f"  EMULATION: {emulation.describe(product)}")
        elif "cpu" in measured:
            profiles["cpu"] = slowed(measured["cpu"], contention_factor(devices))
        cluster = build_cluster(devices, measured["cpu"].memory_capacity_bytes
                                if "cpu" in measured else None)
        as_planned = _as_planned(devices, emulation)

        def measure(wanted: Mapping[str, list[int]]) -> dict[str, GpuProfile]:
            return measure_micro_batch_sizes(wanted, profiles, devices, spec.precision,
                                             job_file, run_dir, threads, as_planned, out)

        try:
            settled = plan_on_measured_sizes(lambda p: solve(spec, cluster, p), measure,
                                             profiles)
        except ValueError as err:
            raise RunError(f"planning failed: {err}") from None
        plan = settled.plan
        price_split = partial(split_step_seconds, spec, cluster, settled.profiles, plan)
        for product in sorted(emulation.dilation if emulation else {}):  # with every point
            (run_dir / "profiles" / f"emulated-{product}.json").write_text(
                settled.profiles[product].to_compact_json())
    plan_file = run_dir / "plan.json"
    plan_file.write_text(plan.to_json())
    title = model_title(spec.model)
    if emulation:
        title += " (EMULATED GPUs on this CPU)"
    out(format_plan(plan, title))
    out(f"\nRun directory: {run_dir}")
    devices = plan_rank_devices(plan, devices, "the plan")
    cpu_ranks, cores = sum(d.kind == "cpu" for d in devices), os.cpu_count() or 1
    if cpu_ranks > cores:  # the profile measured one rank per core; the ranks will not get it
        out(f"note: {cpu_ranks} CPU ranks on {cores} cores: ranks share cores, and each "
            "collective waits for ranks the OS has not scheduled (expect slower steps than "
            f"predicted); --devices cpu:{cores} gives each its own")
    ranks = [RankEnv(d,
                     emulation.dilation[d.product] if emulation and d.emulated else 1.0,
                     emulation.capacity_bytes[d.product] if emulation and d.emulated else None)
             for d in devices]
    if options.metrics_port:
        check_metrics_ports(options.metrics_port, plan.world_size)
        last = options.metrics_port + plan.world_size - 1
        out(f"Prometheus /metrics: http://127.0.0.1:{options.metrics_port}/metrics (rank 0)"
            + (f" to :{last} (rank {plan.world_size - 1})" if plan.world_size > 1 else ""))
    progress = Progress(spec.training.steps)
    result = launch(plan, ranks, run_dir, job_file, plan_file, progress.update, threads,
                    options.stop_after_step, options.metrics_port)
    labels = [d.label for d in devices]
    if result.returncode in (130, 143):  # Ctrl-C or SIGTERM: stopped, resumable
        out("\n" + interrupted_hint(options, spec, run_dir))
        return result.returncode
    if result.returncode != 0:
        out(f"\nrank {result.failed_rank} ({labels[result.failed_rank or 0]}) failed with "
            f"exit code {result.returncode}; the other ranks were stopped. Its last lines:\n"
            f"{result.error_tail}\n(full logs in {run_dir / 'logs'})")
        return 1
    summary = summarize(result.records, plan)
    if summary is None:
        out("\nNo steps were run (the job was already complete?).")
        return 0
    if summary.final_split_samples_per_second is not None and price_split is not None and \
            summary.final_batch_sizes is not None:
        with contextlib.suppress(ValueError):  # a split the model cannot price: say none
            summary.final_split_predicted_samples_per_second = \
                plan.global_batch_size / price_split(summary.final_batch_sizes)
    out(format_summary(summary, plan, labels))
    plots = write_plots(read_history(run_dir / "metrics.jsonl") or result.records, summary,
                        labels, run_dir, plan.predicted_step_seconds)
    if plots:
        out("  plots       " + ", ".join(str(p) for p in plots))
    if (run_dir / "tensorboard").is_dir():  # spec.tracking.tensorboard (rank 0 wrote it)
        out(f"  tensorboard tensorboard --logdir {run_dir / 'tensorboard'}")
    mlflow_run = _mlflow_run_url(run_dir / "mlflow-run.json")
    if mlflow_run:  # spec.tracking.mlflow (rank 0 created or continued the run)
        out(f"  mlflow      {mlflow_run}")
    if result.checkpoint_dir:
        out(f"  checkpoints {result.checkpoint_dir}  (export: cephalo export "
            f"{result.checkpoint_dir} --output model.pt)")
    else:
        out("  checkpoints none (spec.checkpoint.ephemeral: true)")
    return 0
