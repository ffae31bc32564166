"""`cephalo plan`: solve and print a plan (a table, or the Plan JSON with --json)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from pydantic import ValidationError

from cephalo.api import ClusterSpec, GpuGroup, GpuProfile, Plan, load_job, parse_job
from cephalo.api.cluster import MAX_GPUS_PER_GROUP
from cephalo.api.job import CephaloJobSpec, format_validation_error
from cephalo.api.plan import SHARD_RATIO_TOLERANCE
from cephalo.api.safeyaml import YamlError, read_text_file
from cephalo.cli import UserError

GIB = 1024**3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", required=True, metavar="LIST",
                        help="GPUs as COUNTxNAME, comma-separated: 2xL4,1xRTX-A6000,3xP40 "
                             "(catalog names or GPU Feature Discovery labels)")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="PRESET", help="model preset, e.g. gpt-2.7b")
    src.add_argument("--job", metavar="FILE", help="take model, batch and options from a "
                                                   "CephaloJob YAML")
    parser.add_argument("--batch-size", type=int, metavar="B",
                        help="global batch size (required with --model)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default=None)
    parser.add_argument("--memory-fraction", type=float, default=None,
                        help="fraction of each GPU's memory the plan may use (default 0.8)")
    parser.add_argument("--bandwidth-gbps", type=float, default=None,
                        help="network bandwidth per GPU for collectives (default 10)")
    parser.add_argument("--profiles", metavar="DIR",
                        help="folder of measured GpuProfile JSON files (else catalog estimates)")
    parser.add_argument("--json", action="store_true",
                        help="print the Plan JSON and nothing else on stdout")


def parse_gpus(text: str) -> ClusterSpec:
    groups = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(?:(\d+)\s*[xX*]\s*)?(.+)", item)
        assert match is not None
        count = int(match.group(1) or 1)
        if not 1 <= count <= MAX_GPUS_PER_GROUP:
            raise UserError(f"--gpus: count must be 1 to {MAX_GPUS_PER_GROUP} in {item[:40]!r}")
        groups.append(GpuGroup(product=match.group(2).strip(), count=count))
    if not groups:
        raise UserError("--gpus: give at least one GPU, e.g. --gpus 2xL4,1xRTX-A6000")
    return ClusterSpec(groups=groups)


def load_profiles(folder: str) -> dict[str, GpuProfile]:
    from cephalo.planner.catalog import gpu_key

    path = Path(folder)
    if not path.is_dir():
        raise UserError(f"--profiles: {folder} is not a folder")
    profiles = {}
    for file in sorted(path.glob("*.json")):
        try:
            profile = GpuProfile.model_validate_json(
                read_text_file(str(file), 16 * 1024**2, what="GpuProfile JSON file"))
        except YamlError as err:
            raise UserError(f"--profiles: {err}") from None
        except ValidationError as err:
            raise UserError(f"--profiles: {file} is not a GpuProfile: "
                            f"{format_validation_error(err)}") from None
        profiles[gpu_key(profile.product)] = profile
    return profiles


def match_profiles(cluster: ClusterSpec, profiles: dict[str, GpuProfile]) -> ClusterSpec:
    """Each --gpus name resolved against the catalog and the profiles: a GPU outside the
    catalog is usable from its measured profile (named as NVML or GFD spell it, or by a
    shorter suffix of that: RTX-4090 for NVIDIA-GeForce-RTX-4090); without one, a clear
    error saying to profile it (a typo of a catalog name gets the same list)."""
    from cephalo.planner.catalog import gpu_key, known_names, resolve_gpu

    groups = []
    for group in cluster.groups:
        key = gpu_key(group.product)
        if not resolve_gpu(group.product).in_catalog and key not in profiles:
            wanted = _letters(group.product)
            found = [k for k in profiles if _letters(k).endswith(wanted)]
            if len(found) != 1:
                raise UserError(
                    f"--gpus: unknown GPU {group.product[:64]!r}: not in the catalog and no "
                    "profile of it was given: measure one on that GPU (`python -m "
                    "cephalo.trainer.profile --job JOB.yaml --output DIR/gpu.json`) and "
                    f"pass --profiles DIR; catalog GPUs: {known_names()}")
            key = found[0]
        groups.append(group.model_copy(update={"product": key}))
    return cluster.model_copy(update={"groups": groups})


def _letters(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def _spec(args: argparse.Namespace) -> CephaloJobSpec:
    if args.job:
        spec = load_job(args.job).spec
        data = spec.model_dump(by_alias=True, exclude_none=True)
    else:
        if args.batch_size is None:
            raise UserError("--batch-size is required with --model")
        data = {"model": {"preset": args.model}, "globalBatchSize": args.batch_size}
    if args.batch_size is not None:
        data["globalBatchSize"] = args.batch_size
    if args.precision:
        data["precision"] = args.precision
    planner = data.setdefault("planner", {})
    if args.memory_fraction is not None:
        planner["memoryFraction"] = args.memory_fraction
    if args.bandwidth_gbps is not None:
        planner["networkBandwidthGbps"] = args.bandwidth_gbps
    return parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                      "spec": data}, source="plan options").spec


def run(args: argparse.Namespace) -> int:
    from cephalo.planner import solve

    spec = _spec(args)
    profiles = load_profiles(args.profiles) if args.profiles else {}
    cluster = match_profiles(parse_gpus(args.gpus), profiles)
    plan = solve(spec, cluster, profiles)  # planner.chooseGpus (default true)
    if args.json:
        sys.stdout.write(plan.to_json())
    else:
        print(format_plan(plan, spec.model.preset or spec.model.family or "model"))
    return 0


def format_plan(plan: Plan, model_name: str) -> str:
    """The human-readable table: one row per rank, totals, baselines side by side."""
    extra = plan.model_extra or {}
    lines = [f"Plan for {model_name}: global batch {plan.global_batch_size} on "
             f"{plan.world_size} GPUs (memory fraction {extra.get('memory_fraction', 0.8):.0%})",
             ""]
    header = f"{'rank':>4}  {'GPU':<10} {'batch':>5}  {'micro x n':>9}  {'shard':>6}  " \
             f"{'memory used / cap':>19}  {'step s':>8}"
    lines += [header, "-" * len(header)]
    smallest = min((r.memory_capacity_bytes or GIB) for r in plan.ranks)
    unit, scale = ("GiB", GIB) if smallest >= GIB else ("MiB", 1024**2)
    for r in plan.ranks:
        est = "*" if (r.model_extra or {}).get("estimated") else " "
        mem = (f"{(r.predicted_memory_bytes or 0) / scale:7.1f} / "
               f"{(r.memory_capacity_bytes or 0) / scale:5.1f} {unit}")
        micro = f"{r.micro_batch_size}x{r.num_micro_batches}" if r.batch_size else "state"
        seconds = r.predicted_step_seconds or 0.0
        lines.append(f"{r.rank:>4}  {r.gpu:<10} {r.batch_size:>5}  {micro:>9}  "
                     f"{r.shard_ratio:>6.1%}  {mem:>19}  {seconds:>8.3f}{est}")
    lines.append("-" * len(header))
    if plan.predicted_step_seconds and plan.predicted_samples_per_second:
        lines.append(f"predicted step {plan.predicted_step_seconds:.3f} s, "
                     f"{plan.predicted_samples_per_second:.2f} samples/s")
    else:
        lines.append("no prediction (a plan given by hand)")
    if plan.unit_shard_ratios:
        lines.append(unit_sharding_line(plan))
    for idle in plan.idle_gpus:
        lines.append(f"idle: {idle.count} x {idle.gpu} (pool {idle.pool}): {idle.reason}")
    if plan.optimality_gap_seconds:
        lines.append(f"optimality gap: at most {plan.optimality_gap_seconds:.4g} s per step "
                     "above the cost model's optimum (proven bound)")
    if plan.baselines:
        lines += ["", f"{'baseline':<22} {'samples/s':>10}  {'Cephalo is':>10}"]
    for name, base in plan.baselines.items():
        if base.feasible and base.predicted_samples_per_second:
            ratio = (plan.predicted_samples_per_second or 0) / base.predicted_samples_per_second
            lines.append(f"{name:<22} {base.predicted_samples_per_second:>10.2f}  {ratio:>9.2f}x")
        else:
            lines.append(f"{name:<22} {'does not fit':>10}  ({base.reason})")
    notes = extra.get("notes") or []
    if any((r.model_extra or {}).get("estimated") for r in plan.ranks):
        notes = [*notes, "* = estimated from the GPU catalog; measure with "
                         "`python -m cephalo.trainer.profile` and pass --profiles"]
    if notes:
        lines += ["", *(f"note: {n}" for n in notes)]
    return "\n".join(lines)




def unit_sharding_line(plan: Plan) -> str:
    """How many units are sharded evenly (no uneven-collective overhead) and how many
    skewed, for a plan with per-unit ratios."""
    flat = 1.0 / plan.world_size

    def even(ratios: list[float]) -> bool:
        return all(abs(r - flat) <= SHARD_RATIO_TOLERANCE for r in ratios)

    layers = ((plan.model_extra or {}).get("model") or {}).get("num_layers")
    listed = plan.unit_shard_ratios
    listed_even = sum(even(v) for v in listed.values())
    if isinstance(layers, int):
        others = layers + 2 - len(listed)
        rank_even = even([r.shard_ratio for r in plan.ranks])
        num_even = listed_even + (others if rank_even else 0)
        return (f"units: {num_even} of {layers + 2} sharded evenly, "
                f"{layers + 2 - num_even} skewed where memory needs it (only those pay the "
                f"uneven-collective overhead; 'shard' is for the units not in "
                f"unit_shard_ratios)")
    return (f"units: {len(listed)} with their own ratios (unit_shard_ratios), "
            f"{listed_even} of them even")
