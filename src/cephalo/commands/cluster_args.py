"""What every cluster command takes: which kubeconfig, context and namespace."""


from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cephalo.client import CephaloClient


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", "-n", metavar="NS",
                        help="namespace (default: the context's, else default)")
    parser.add_argument("--context", metavar="NAME",
                        help="kubeconfig context (default: the current one)")
    parser.add_argument("--kubeconfig", metavar="FILE",
                        help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)")


def client_from(args: argparse.Namespace) -> CephaloClient:
    from cephalo.client import CephaloClient  # the kubernetes client only when used

    return CephaloClient(context=args.context, namespace=args.namespace,
                         kubeconfig=args.kubeconfig)
