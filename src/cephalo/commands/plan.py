"""`cephalo plan`: solve and print a plan (a table, or the Plan JSON with --json)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import get_args

from pydantic import ValidationError

from cephalo.api import ClusterSpec, GpuGroup, GpuProfile, load_job, parse_job
from cephalo.api.cluster import MAX_GPUS_PER_GROUP
from cephalo.api.job import CephaloJobSpec, format_validation_error
from cephalo.api.safeyaml import YamlError, read_text_file
from cephalo.cli import UserError
from cephalo.commands.plan_cluster import add_cluster_plan_arguments
from cephalo.planner.outputs.report import format_plan, model_title


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", default=None, metavar="LIST",
                        help="GPUs as COUNTxNAME, comma-separated: 2xL4,1xRTX-A6000,3xP40 "
                             "(catalog names or GPU Feature Discovery labels; default with "
                             "--job: the job's gpuPools, maxGpus of each)")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="PRESET", help="model preset, e.g. gpt-2.7b")
    src.add_argument("--job", metavar="FILE", help="take model, batch and options from a "
                                                   "CephaloJob YAML")
    parser.add_argument("--batch-size", type=int, metavar="B",
                        help="global batch size (required with --model)")
    parser.add_argument("--precision", choices=get_args(
        CephaloJobSpec.model_fields["precision"].annotation), default=None,
        help="the job's precision (default: the job's, else fp32); auto: each GPU in its "
             "fastest")
    parser.add_argument("--memory-fraction", type=float, default=None,
                        help="fraction of each GPU's memory the plan may use (default 0.8)")
    parser.add_argument("--bandwidth-gbps", type=float, default=None,
                        help="a flat ring at this bandwidth per GPU for collectives "
                             "(planner.networkBandwidthGbps; replaces the job's "
                             "planner.network). Default: the job's network (docs/network.md)")
    parser.add_argument("--profiles", metavar="DIR",
                        help="folder of measured GpuProfile JSON files (else catalog estimates)")
    parser.add_argument("--json", action="store_true",
                        help="print the Plan JSON and nothing else on stdout")
    add_cluster_plan_arguments(parser)  # --cluster: the operator's plan on the live cluster


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
    from cephalo.planner.cost.catalog import gpu_key

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


def pools_as_cluster(spec: CephaloJobSpec) -> ClusterSpec:
    """Without --gpus: the job's gpuPools as the cluster, each pool's maxGpus GPUs of its
    product (what the operator would plan on a cluster where all of them are free)."""
    if not spec.gpu_pools:
        raise UserError("--gpus is required: the job lists no gpuPools (give the GPUs, e.g. "
                        "--gpus 2xL4,1xRTX-A6000)")
    groups = []
    for i, pool in enumerate(spec.gpu_pools):
        if pool.product is None or pool.max_gpus is None:
            missing = "product" if pool.product is None else "maxGpus to count its GPUs"
            raise UserError(f"--gpus is required: the job's gpuPools[{i}] "
                            f"({pool.product or 'any product'}) gives no {missing}")
        groups.append(GpuGroup(product=pool.product, count=pool.max_gpus,
                               memory_bytes=pool.memory_mi_b * 2**20 if pool.memory_mi_b
                               else None))
    return ClusterSpec(groups=groups)


def match_profiles(cluster: ClusterSpec, profiles: dict[str, GpuProfile]) -> ClusterSpec:
    """Each --gpus name resolved against the catalog and the profiles: a GPU outside the
    catalog is usable from its measured profile (named as NVML or GFD spell it, or by a
    shorter suffix of that: RTX-4090 for NVIDIA-GeForce-RTX-4090); without one, a clear
    error saying to profile it (a typo of a catalog name gets the same list)."""
    from cephalo.planner.cost.catalog import gpu_key, known_names, resolve_gpu

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
        planner.pop("network", None)
    return parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                      "spec": data}, source="plan options").spec


def run(args: argparse.Namespace) -> int:
    from cephalo.planner import solve

    if args.cluster:
        from cephalo.commands import plan_cluster
        return plan_cluster.run(args)
    if args.gpus is None and not args.job:
        raise UserError("--gpus is required with --model (e.g. --gpus 2xL4,1xRTX-A6000), or "
                        "give --job JOB.yaml (its gpuPools, or --cluster for the plan on the "
                        "cluster's free GPUs)")
    spec = _spec(args)
    profiles = load_profiles(args.profiles) if args.profiles else {}
    cluster = match_profiles(parse_gpus(args.gpus) if args.gpus is not None
                             else pools_as_cluster(spec), profiles)
    plan = solve(spec, cluster, profiles)  # planner.chooseGpus (default true)
    if args.json:
        sys.stdout.write(plan.to_json())
    else:
        print(format_plan(plan, model_title(spec.model)))
    return 0
