"""`cephalo export CKPT_DIR --output model.pt`: a sharded checkpoint as one plain PyTorch
state_dict that `cephalo.trainer.models.build_model(config).load_state_dict` accepts.

CKPT_DIR is a checkpoint root (its newest intact checkpoint is used) or one checkpoint
folder, on local disk or object storage (an fsspec URL such as s3://bucket/prefix/ns/job,
with the backend's usual credentials in the environment). torch is imported only when this
command runs.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from cephalo.errors import CephaloError


class ExportError(CephaloError):
    """A checkpoint location or output that `cephalo export` cannot use."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", metavar="CKPT_DIR",
                        help="checkpoint root (newest complete checkpoint) or one step-* folder; "
                             "a local path or a URL such as s3://bucket/prefix/ns/job")
    parser.add_argument("--output", "-o", required=True, help="where to write the state_dict (.pt)")
    parser.add_argument("--config-output", default=None,
                        help="also write the model architecture (ModelConfig) as JSON here")


def run(args: argparse.Namespace) -> int:
    import torch

    from cephalo.trainer.checkpoint import find_latest, full_state_dict
    from cephalo.trainer.storage import Store, describe

    root = args.checkpoint_dir
    try:
        store = Store(root)
    except (ImportError, ValueError) as err:  # unknown scheme, backend not installed
        raise ExportError(f"{root}: unusable checkpoint location: {describe(err)}") from None
    if store.is_local and not Path(store.root).is_dir():
        raise ExportError(f"{root}: no such checkpoint directory")
    output = Path(args.output)
    if store.is_local and output.resolve().is_relative_to(Path(store.root).resolve()):
        # writing into the checkpoint root could replace a shard or meta.json of the very
        # checkpoint being read, or make the root look torn
        raise ExportError(f"--output {output} lies inside the checkpoint directory {root}; "
                          "write the export somewhere else")
    if output.is_dir():
        raise ExportError(f"--output {output} is a directory; give a file name such as "
                          f"{output / 'model.pt'}")
    try:
        info = find_latest(store)
    except OSError as err:  # credentials, missing bucket, network
        raise ExportError(f"{root}: cannot read checkpoints: {describe(err)}") from None
    if info is None:
        raise ExportError(f"{root}: no complete checkpoint (a checkpoint needs its COMPLETE "
                          f"marker, meta.json and intact rank-*.pt shards)")
    try:
        info.config  # noqa: B018 - validates the model recorded in meta.json
    except (ValueError, TypeError, KeyError) as err:
        raise ExportError(f"{info.path}/meta.json: the recorded model is not valid "
                          f"({err}); the checkpoint's metadata is corrupted") from None
    state = full_state_dict(info)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, output)
    if args.config_output:
        Path(args.config_output).write_text(json.dumps(info.meta["model"], indent=2) + "\n")
    numel = sum(t.numel() for t in state.values())
    print(f"exported step {info.step} of {info.path} ({len(state)} tensors, {numel:,} "
          f"parameters, {info.config.family}) to {output}")
    return 0
