"""`cephalo plan --cluster --job job.yaml`: the plan the operator would choose now, on the
cluster's free GPUs, with the profiles it has cached (`CephaloClient.plan_on_cluster`);
says which GPUs are taken and by whom, and for a job of that name already on the cluster
with spec.elastic, its last rescale decision (what was free, the predicted gain, the saving
against the restart cost, why it did or did not rescale)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cephalo.cli import UserError
from cephalo.commands.cluster_args import add_cluster_arguments, client_from


def add_cluster_plan_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("on the live cluster (--cluster)")
    group.add_argument("--cluster", action="store_true",
                       help="plan on the free GPUs of the cluster (kubeconfig), as the operator "
                            "would now; needs --job")
    group.add_argument("--trainer-image", metavar="IMAGE",
                       help="the operator's trainer image, for a job without spec.image (it "
                            "keys the cached profiles)")
    add_cluster_arguments(group)  # type: ignore[arg-type]  # an argument group takes them too


def _elastic(client: Any, job: Any) -> list[str]:
    """The running job's rescale decision, when a job of this name is on the cluster."""
    from cephalo.client.errors import JobNotFound
    from cephalo.commands.jobview import elastic_lines

    try:
        existing = client.get(job.metadata.name, namespace=job.metadata.namespace)
    except JobNotFound:
        return []
    return elastic_lines(existing)


def run(args: argparse.Namespace) -> int:
    from cephalo.client import validate_job
    from cephalo.planner.outputs.report import format_plan

    if not args.job:
        raise UserError("--cluster needs --job JOB.yaml (the job to plan)")
    if args.gpus or args.profiles or args.model:
        raise UserError("--cluster takes the GPUs and profiles from the cluster: drop --gpus, "
                        "--profiles and --model")
    job = validate_job(args.job)
    client = client_from(args)
    found = client.plan_on_cluster(job, trainer_image=args.trainer_image)
    out = sys.stderr if args.json else sys.stdout
    print(f"Cluster ({client.target.where()}), planning {job.metadata.name} in namespace "
          f"{job.metadata.namespace or client.namespace}:", file=out)
    for pool in found.discovery.pools:
        reserved = f", {pool.reserved} reserved by other jobs" if pool.reserved else ""
        print(f"  free  {pool.product:<24} {pool.num_gpus:>3} GPU(s) on "
              f"{', '.join(pool.nodes)}{reserved}", file=out)
    for taken in found.taken:
        print(f"  taken {taken.where:<24} {taken.gpus:>3} GPU(s) by {taken.by}", file=out)
    for unusable in found.discovery.unusable:
        print(f"  not usable: {unusable}", file=out)
    for product, where in sorted(found.profiles.items()):
        print(f"  profile {product}: {where}", file=out)
    for note in found.notes:
        print(f"  note: {note}", file=out)
    for line in _elastic(client, job):
        print(f"  {line.strip()}", file=out)
    if found.plan is None:
        print(f"the operator would not plan now ({found.error_reason}): {found.error}",
              file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(found.plan.to_json())
    else:
        print(file=out)
        print(format_plan(found.plan, job.spec.model.preset or job.spec.model.family or "model"))
    return 0
