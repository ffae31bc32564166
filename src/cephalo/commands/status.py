"""`cephalo status [NAME]`: every job as a table, or one job in full (plan per rank,
conditions, recent events, the blamed rank and its reason when it failed)."""

from __future__ import annotations

import argparse
import datetime

from cephalo.commands.cluster_args import add_cluster_arguments, client_from
from cephalo.commands.jobview import job_details, jobs_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", nargs="?", help="one CephaloJob in full")
    add_cluster_arguments(parser)
    parser.add_argument("--all-namespaces", "-A", action="store_true",
                        help="jobs of every namespace")


def run(args: argparse.Namespace) -> int:
    client = client_from(args)
    now = datetime.datetime.now(datetime.timezone.utc)
    if args.name:
        job = client.get(args.name)
        print(job_details(job, client.plan(job), client.events(job), now))
        return 1 if job.phase == "Failed" else 0
    jobs = client.list(all_namespaces=args.all_namespaces)
    if not jobs:
        where = "any namespace" if args.all_namespaces else f"namespace {client.namespace}"
        print(f"no CephaloJobs in {where}")
        return 0
    print(jobs_table(jobs, now, namespaces=args.all_namespaces))
    return 0
