"""`cephalo suspend|resume|delete NAME`: spec.suspend true/false, or delete the job."""

from __future__ import annotations

import argparse

from cephalo.commands.cluster_args import add_cluster_arguments, client_from


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="the CephaloJob")
    add_cluster_arguments(parser)


def run(args: argparse.Namespace) -> int:
    client = client_from(args)
    ns = client.namespace
    if args.command == "delete":
        client.delete(args.name)
        print(f"cephalojob {ns}/{args.name} deleted")
    elif args.command == "suspend":
        client.suspend(args.name)
        print(f"cephalojob {ns}/{args.name} suspended (its pods go; the last checkpoint stays)")
    else:
        client.resume(args.name)
        print(f"cephalojob {ns}/{args.name} resumed (from the last checkpoint)")
    return 0
