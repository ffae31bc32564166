"""`cephalo submit job.yaml`: validate locally (the admission types; nothing is sent when
it would be refused), create the CephaloJob, print the plan once the operator decided it;
`--watch` then follows the job to its end (exit 0 Succeeded, 1 Failed)."""

from __future__ import annotations

import argparse
import sys

from cephalo.commands.cluster_args import add_cluster_arguments, client_from
from cephalo.commands.watch import follow
from cephalo.planner.outputs.report import format_plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="JOB.yaml", help="a CephaloJob YAML file")
    add_cluster_arguments(parser)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--watch", "-w", action="store_true",
                      help="follow the job to its end: progress, phase changes, ETA")
    mode.add_argument("--detach", action="store_true",
                      help="return once created, without waiting for the plan")


def run(args: argparse.Namespace) -> int:
    from cephalo.client import validate_job  # the kubernetes client only when the command runs

    job = validate_job(args.file)  # before any connection: a bad file sends nothing
    client = client_from(args)
    created = client.submit(job, namespace=args.namespace)
    print(f"cephalojob {created.namespace}/{created.name} created ({client.target.where()})")
    if args.watch:
        return follow(client, created.name, created.namespace)
    if args.detach:
        return 0
    print("waiting for the plan (Ctrl-C leaves the job running) ...", file=sys.stderr)
    last = created
    for last in client.watch(created.name, namespace=created.namespace):
        if last.finished or (last.status.plan and last.status.plan.world_size):
            plan = client.plan(last)
            if plan is not None:
                print(format_plan(plan, job.spec.model.preset or job.spec.model.family
                                  or "model"))
            break
        gpus = last.condition("GpusAvailable")
        if gpus is not None and gpus.status == "False":  # waiting for GPUs: say so, return
            print(f"{last.phase}: {last.status.message}")
            break
    if last.phase == "Failed":
        print(f"Failed: {last.failure_reason}", file=sys.stderr)
        return 1
    print(f"follow it: cephalo watch {created.name} -n {created.namespace}; logs: "
          f"cephalo logs {created.name} -n {created.namespace} -f")
    return 0
