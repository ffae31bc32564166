"""`cephalo crd`: print the CephaloJob CustomResourceDefinition generated from the API models.

`cephalo crd > crds/cephalojob.yaml` regenerates the committed copy; `cephalo crd | kubectl
apply -f -` installs it. Imports only `cephalo.api` (no torch, no Kubernetes client).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from cephalo.api.crd import crd_yaml
from cephalo.cli import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output", "-o", metavar="FILE", default=None,
        help="write the YAML to FILE instead of standard output")


def _write_atomically(path: str, text: str) -> None:
    """Write then rename, so an interrupted run never leaves a half-written CRD behind."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UserError(f"--output {path}: directory {directory} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=".cephalo-crd-", suffix=".yaml", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a CRD file is for everyone to read
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def run(args: argparse.Namespace) -> int:
    text = crd_yaml()
    if args.output:
        try:
            _write_atomically(args.output, text)
        except OSError as err:  # a folder, a read-only place: the user's to fix
            raise UserError(f"--output {args.output}: {err.strerror or err}") from None
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
