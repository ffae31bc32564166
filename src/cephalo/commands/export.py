"""`cephalo export CKPT_DIR --output model.pt`: a sharded checkpoint as one plain PyTorch
state_dict that `cephalo.trainer.models.build_model(config).load_state_dict` accepts.

`--format hf --output DIR` writes a Hugging Face checkpoint instead (config.json,
model.safetensors or shards + model.safetensors.index.json above --max-shard-size, and the
tokenizer files of the pretrained model the job started from): `transformers` loads it with
`AutoModelForCausalLM.from_pretrained(DIR)`. llama exports as Llama (or Mistral when it
started from one), gpt as GPT-2; vit and bert have no Hugging Face counterpart here.

CKPT_DIR is a checkpoint root (its newest intact checkpoint is used) or one checkpoint
folder, on local disk or object storage (an fsspec URL such as s3://bucket/prefix/ns/job,
with the backend's usual credentials in the environment). torch is imported only when this
command runs. `--mlflow` also logs the export to the job's MLflow run (spec.tracking.mlflow).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from cephalo.errors import CephaloError


class ExportError(CephaloError):
    """A checkpoint location or output that `cephalo export` cannot use."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", metavar="CKPT_DIR",
                        help="checkpoint root (newest complete checkpoint) or one step-* folder; "
                             "a local path or a URL such as s3://bucket/prefix/ns/job")
    parser.add_argument("--output", "-o", required=True,
                        help="where to write the state_dict (.pt), or the folder for --format hf")
    parser.add_argument("--config-output", default=None,
                        help="also write the model architecture (ModelConfig) as JSON here")
    parser.add_argument("--format", choices=("pt", "hf"), default="pt",
                        help="pt: one PyTorch state_dict (default); hf: a Hugging Face "
                             "checkpoint folder (config.json + safetensors) transformers loads")
    parser.add_argument("--max-shard-size", default=None,
                        help="--format hf: split the safetensors above this size, with an "
                             "index (default 5GB, as transformers; units B, KB, MB, GB)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="--format hf: copy tokenizer files from this folder (default: "
                             "those of the pretrained model the job started from, if any)")
    parser.add_argument("--mlflow", action="store_true",
                        help="also log the export as the `model` artifact of the job's MLflow "
                             "run (spec.tracking.mlflow): the run named by mlflow-run.json "
                             "beside the checkpoint root (a `cephalo run` run directory, the "
                             "job's folder on a checkpoint volume)")
    parser.add_argument("--force", action="store_true",
                        help="overwrite an existing --output (a file, or a folder that is not "
                             "empty)")


DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size_bytes(text: str) -> int:
    """'5GB' -> 5_000_000_000 (decimal units, like transformers' max_shard_size)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in SIZE_UNITS:
        raise ExportError(f"--max-shard-size {text!r} is not a size such as 5GB or 500MB")
    size = int(float(match.group(1)) * SIZE_UNITS[match.group(2).upper()])
    if size < 1:
        raise ExportError(f"--max-shard-size {text!r} must be at least 1 byte")
    return size


def run(args: argparse.Namespace) -> int:
    # torch and the checkpoint readers load once the arguments are checked: a refused
    # argument is answered without them (importing torch is seconds of CPU).
    from cephalo.trainer.storage import CheckpointError, Store, describe

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
    hf = args.format == "hf"
    for option, value in (("--max-shard-size", args.max_shard_size),
                          ("--tokenizer", args.tokenizer)):
        if value is not None and not hf:  # else ignored without a word
            raise ExportError(f"{option} applies to --format hf only; add --format hf or "
                              f"leave {option} out")
    if hf:
        max_shard_bytes = parse_size_bytes(args.max_shard_size or DEFAULT_MAX_SHARD_SIZE)
        if output.exists() and not output.is_dir():
            raise ExportError(f"--output {output} is a file; --format hf writes a folder")
        tokenizer = Path(args.tokenizer) if args.tokenizer else None
        if tokenizer is not None and not tokenizer.is_dir():
            raise ExportError(f"--tokenizer {tokenizer} is not a folder")
    elif output.is_dir():
        raise ExportError(f"--output {output} is a directory; give a file name such as "
                          f"{output / 'model.pt'}")
    if not args.force and (output.is_file() or (output.is_dir() and any(output.iterdir()))):
        raise ExportError(f"--output {output} exists; pass --force to overwrite it")
    check_writable("--output", output)
    config_output = Path(args.config_output) if args.config_output else None
    if config_output is not None:  # checked with --output, before either is written
        check_writable("--config-output", config_output)
        if not hf and config_output.resolve() == output.resolve():
            raise ExportError(f"--config-output {config_output} is --output too; give the "
                              "architecture JSON another name")
        if hf and config_output.resolve() == (output / "config.json").resolve():
            raise ExportError(f"--config-output {config_output} is the config.json --format hf "
                              "writes (the Hugging Face config); give the architecture JSON "
                              "another path")
        if config_output.is_dir():
            raise ExportError(f"--config-output {config_output} is a directory; give a file "
                              f"name such as {config_output / 'config.json'}")
        if store.is_local and config_output.resolve().is_relative_to(
                Path(store.root).resolve()):
            raise ExportError(f"--config-output {config_output} lies inside the checkpoint "
                              f"directory {root}; write it somewhere else")
    mlflow_run = _mlflow_run_file(store.is_local, Path(store.root)) if args.mlflow else None
    import torch

    from cephalo.trainer.checkpoint import find_latest, full_state_dict
    from cephalo.trainer.checkpoint_check import check_checkpoint

    try:
        info = find_latest(store)
    except OSError as err:  # credentials, missing bucket, network
        raise ExportError(f"{root}: cannot read checkpoints: {describe(err)}") from None
    if info is None:
        raise ExportError(f"{root}: no complete checkpoint (a checkpoint needs its COMPLETE "
                          f"marker, meta.json and intact rank-*.pt shards)")
    try:  # meta.json is trusted only as far as it fits the model and the shards
        check_checkpoint(info)
        if hf and tokenizer is not None:
            check_tokenizer(tokenizer, args.tokenizer, info.config.vocab_size)
        if hf:
            _export_hf(info, output, max_shard_bytes, tokenizer, config_output)
            return _log_to_mlflow(mlflow_run, output)
        state = full_state_dict(info)
    except CheckpointError as err:
        raise ExportError(str(err)) from None
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, output)
    write_config(info, config_output)
    numel = sum(t.numel() for t in state.values())
    print(f"exported step {info.step} of {info.path} ({len(state)} tensors, {numel:,} "
          f"parameters, {info.config.family}) to {output}")
    return _log_to_mlflow(mlflow_run, output)


def _mlflow_run_file(is_local: bool, root: Path) -> Path:
    """--mlflow: the mlflow-run.json rank 0 left beside the checkpoint root (CKPT_DIR is the
    root or one step-* folder in it); checked before anything is exported."""
    import importlib.util

    from cephalo.trainer.mlflow_log import RUN_ID_FILE

    if importlib.util.find_spec("mlflow") is None:
        raise ExportError("--mlflow: the mlflow package is not installed here; pip install "
                          "'cephalo[tracking]'")
    found = [folder / RUN_ID_FILE for folder in (root.parent, root.parent.parent)
             if is_local and (folder / RUN_ID_FILE).is_file()]
    if not found:
        raise ExportError(f"--mlflow: no {RUN_ID_FILE} beside {root} (rank 0 writes it next "
                          "to a local checkpoint root of a job with spec.tracking.mlflow); "
                          "leave --mlflow out")
    return found[0]


def _log_to_mlflow(run_file: Path | None, output: Path) -> int:
    if run_file is None:
        return 0
    from cephalo.trainer.mlflow_log import log_model

    try:
        where = log_model(run_file, output)
    except Exception as err:  # the export is written: say why the upload failed, exit 1
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        print(f"cephalo export: error: --mlflow: logging {output} to the run of {run_file} "
              f"failed: {first[:300]}", file=sys.stderr)
        return 1
    print(f"logged {output} to MLflow: {where}")
    return 0


def check_writable(option: str, path: Path) -> None:
    """Refuse an output path that cannot be made, before anything is written: a file stands
    where one of its folders must be (mkdir said only "File exists" or "Not a directory"),
    or the nearest existing folder is not writable."""
    for parent in path.parents:
        if not parent.exists():  # also false below a file (ENOTDIR): the next one says so
            continue
        if not parent.is_dir():
            raise ExportError(f"{option} {path}: {parent} is a file, where a folder must be; "
                              "move that file or choose another path")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ExportError(f"{option} {path}: cannot write in {parent} (permission "
                              "denied); choose a folder you can write in")
        return


def check_tokenizer(folder: Path, given: str, model_vocab_size: int | None) -> None:
    """--tokenizer: a folder holding tokenizer files, whose ids the model's vocabulary
    covers (else `generate` emits ids the tokenizer cannot decode, or the other way round)."""
    from cephalo.tokenizer import TOKENIZER_FILE
    from cephalo.trainer.hf_weights import SOURCE_FILES

    names = [n for n in SOURCE_FILES if n not in ("config.json", "generation_config.json")]
    if not any((folder / name).is_file() for name in names):
        raise ExportError(f"--tokenizer {given} holds no tokenizer files (any of "
                          f"{', '.join(names)}); give the folder a tokenizer was saved to")
    if model_vocab_size and (folder / TOKENIZER_FILE).is_file():
        from tokenizers import Tokenizer

        try:
            vocab = Tokenizer.from_file(str(folder / TOKENIZER_FILE)).get_vocab(
                with_added_tokens=True)
        except Exception as err:  # tokenizers raises a bare Exception on a bad definition
            raise ExportError(f"--tokenizer {given}: {TOKENIZER_FILE} is not a tokenizers "
                              f"tokenizer.json: {str(err)[:200]}") from None
        ids = max(vocab.values(), default=-1) + 1
        if ids > model_vocab_size:
            raise ExportError(f"--tokenizer {given} has {ids} token ids, more than the model's "
                              f"vocabulary of {model_vocab_size}; export with the tokenizer "
                              "the model was trained with")


def write_config(info: Any, config_output: Path | None) -> None:
    """--config-output: the ModelConfig as JSON (its folder made as --output's is; checked
    with --output before anything was written)."""
    if config_output is None:
        return
    try:
        config_output.parent.mkdir(parents=True, exist_ok=True)
        config_output.write_text(json.dumps(info.meta["model"], indent=2) + "\n")
    except OSError as err:
        raise ExportError(f"--config-output {config_output}: {err.strerror or err}") from None


def _export_hf(info: Any, output: Path, max_shard_bytes: int, tokenizer: Path | None,
               config_output: Path | None) -> int:
    from cephalo.api.hf_config import PretrainedError
    from cephalo.trainer.hf_export import export_hf

    try:
        written = export_hf(info, output, max_shard_bytes, tokenizer)
    except PretrainedError as err:
        raise ExportError(f"{info.path}: {err}") from None
    write_config(info, config_output)
    print(f"exported step {info.step} of {info.path} ({info.config.family}) as a Hugging Face "
          f"checkpoint to {output}: {', '.join(written)}")
    return 0
