"""`cephalo logs NAME [--rank N | --all] [-f]`: rank pods' logs, each line prefixed by its
rank; `-f` follows them, into the next attempt's pods after a gang restart, until the job
ends (or is deleted). Default: rank 0; `--all`: every rank and the profilers."""

from __future__ import annotations

import argparse
import sys

from cephalo.commands.cluster_args import add_cluster_arguments, client_from


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="the CephaloJob")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, metavar="N", help="only rank N (default 0)")
    which.add_argument("--all", action="store_true", help="every rank and profiler pod")
    parser.add_argument("--follow", "-f", action="store_true",
                        help="keep reading as the ranks write, until the job ends (or is deleted)")
    add_cluster_arguments(parser)


def run(args: argparse.Namespace) -> int:
    client = client_from(args)
    rank = None if args.all else (args.rank if args.rank is not None else 0)
    for line in client.logs(args.name, rank=rank, follow=args.follow):
        sys.stdout.write(f"{line}\n")
        sys.stdout.flush()
    return 0
