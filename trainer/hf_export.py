"""A Cephalo checkpoint as a Hugging Face checkpoint (`cephalo export --format hf`).

Writes ``config.json`` (`cephalo.api.hf_config.to_hf_config`), the weights as safetensors
under the names `hf_weights.unit_sources` gives (GPT-2's Conv1D weights transposed back)
— one ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` files plus
``model.safetensors.index.json`` when they exceed the shard size, like `transformers`'
``save_pretrained`` — and the tokenizer files the job started from. Reads one unit at a
time and holds at most one output shard, so a large model exports in bounded memory.
"""

from __future__ import annotations

import json
import os
import posixpath
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from cephalo.api.hf_config import CONFIG_FILE, to_hf_config
from cephalo.api.models import ModelConfig
from cephalo.tokenizer import special_token_ids
from cephalo.trainer.checkpoint import CheckpointInfo, ShardReader
from cephalo.trainer.flat import ParamSpec, param_specs
from cephalo.trainer.hf_weights import (
    INDEX_FILE,
    SINGLE_FILE,
    SOURCE_FILES,
    SOURCE_FOLDER,
    unit_sources,
)
from cephalo.trainer.models import build_unit
from cephalo.trainer.storage import Store

BYTES_PER_ELEMENT = 4  # fp32 masters are exported as they are


def tensor_plan(config: ModelConfig) -> list[tuple[int, ParamSpec, str, bool]]:
    """(unit, parameter, Hugging Face name, transpose) for every parameter, in order."""
    out = []
    for i in range(config.num_units):
        with torch.device("meta"):
            specs = param_specs(build_unit(config, i))
        sources = unit_sources(config, i)
        for spec in specs:
            source = sources[spec.name]
            out.append((i, spec, source.names[0], source.transpose))
    return out


def _shards(plan: list[Any], max_shard_bytes: int) -> list[list[Any]]:
    shards: list[list[Any]] = [[]]
    size = 0
    for entry in plan:
        nbytes = entry[1].numel * BYTES_PER_ELEMENT
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def source_files(info: CheckpointInfo) -> dict[str, bytes]:
    """config.json and tokenizer files kept under the checkpoint root's `pretrained/` by a
    job that started from a Hugging Face model (empty for one trained from scratch)."""
    store = info.store
    if not info.name:  # `info` is one step folder given directly: the root is its parent
        parent = posixpath.dirname(info.store.location.rstrip("/"))
        if not parent:
            return {}
        store = Store(parent)
    found = store.sizes(SOURCE_FOLDER)
    return {name: store.read_bytes(f"{SOURCE_FOLDER}/{name}") for name in SOURCE_FILES
            if name in found}


def export_hf(info: CheckpointInfo, output: Path, max_shard_bytes: int,
              tokenizer_dir: Path | None = None) -> list[str]:
    """Write `info` as a Hugging Face checkpoint into folder `output`; the file names."""
    config = info.config
    kept = source_files(info)
    base = json.loads(kept.pop(CONFIG_FILE)) if CONFIG_FILE in kept else None
    if tokenizer_dir is not None:
        kept = {name: (tokenizer_dir / name).read_bytes() for name in SOURCE_FILES
                if name != CONFIG_FILE and (tokenizer_dir / name).is_file()}
    hf_config = to_hf_config(config, base)
    for key, token_id in special_token_ids(kept, config.vocab_size or 0).items():
        if hf_config.get(key) is None:  # trained from scratch: its tokenizer names them
            hf_config[key] = token_id
    output.mkdir(parents=True, exist_ok=True)
    shards = _shards(tensor_plan(config), max_shard_bytes)
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    reader = ShardReader(info)
    cached: tuple[int, torch.Tensor] | None = None
    weight_map: dict[str, str] = {}
    try:
        for shard, file_name in zip(shards, names, strict=True):
            tensors: dict[str, torch.Tensor] = {}
            for unit, spec, hf_name, transpose in shard:
                if cached is None or cached[0] != unit:  # each unit is read once
                    cached = (unit, reader.read(unit, 0, info.meta["unit_numels"][unit]))
                value = cached[1][spec.offset:spec.offset + spec.numel].view(spec.shape)
                tensors[hf_name] = (value.T if transpose else value).contiguous().clone()
                weight_map[hf_name] = file_name
            _atomic(output / file_name, lambda p, t=tensors: save_file(
                t, str(p), metadata={"format": "pt"}))
            del tensors
    finally:
        reader.close()
    written = list(names)
    if len(shards) > 1:
        total = sum(e[1].numel for s in shards for e in s) * BYTES_PER_ELEMENT
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write(output / INDEX_FILE, json.dumps(index, indent=2).encode())
        written.append(INDEX_FILE)
    _write(output / CONFIG_FILE, json.dumps(hf_config, indent=2).encode())
    written.append(CONFIG_FILE)
    for name, data in kept.items():
        _write(output / name, data)
        written.append(name)
    return written


def _atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _write(path: Path, data: bytes) -> None:
    _atomic(path, lambda p: p.write_bytes(data))
