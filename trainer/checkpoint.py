"""Sharded, atomic checkpoints that resume under any plan or world size.

Layout of a checkpoint root::

    step-00000040/
        rank-00000.pt   one file per rank: for every unit its global [start, end) offsets,
        rank-00001.pt   fp32 master shard and Adam moments; the rank's RNG state
        meta.json       step, model config, unit sizes, every file's size and sha256
        COMPLETE        written last; its presence (and matching files) = loadable

Writing: every rank writes into ``.step-00000040.partial/`` (each file via temp + fsync +
rename), rank 0 collects sizes and hashes, writes ``meta.json``, renames the folder, and
writes ``COMPLETE`` last. Reading: the newest folder whose marker exists and whose files
all have the recorded size (and hash) wins; anything else is torn and skipped. Because
shards carry global offsets, a rank of a new plan reads exactly the element ranges it now
owns from whichever old files overlap them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cephalo.api.models import ModelConfig

FORMAT_VERSION = 1
MARKER = "COMPLETE"
META = "meta.json"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _fsync_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def config(self) -> ModelConfig:
        return ModelConfig(**self.meta["model"])


def verify(path: Path, check_hashes: bool = True) -> CheckpointInfo | None:
    """The checkpoint at `path` if it is complete and intact, else None (never raises)."""
    try:
        if not (path / MARKER).is_file():
            return None
        meta = json.loads((path / META).read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            return None
        for name, facts in meta["files"].items():
            f = path / name
            if not f.is_file() or f.stat().st_size != facts["size_bytes"]:
                return None
            if check_hashes and _sha256(f) != facts["sha256"]:
                return None
        return CheckpointInfo(path, meta)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find_latest(root: str | Path, check_hashes: bool = True) -> CheckpointInfo | None:
    """Newest intact checkpoint under `root` (or `root` itself if it is one)."""
    root = Path(root)
    if (root / META).exists() or (root / MARKER).exists():
        return verify(root, check_hashes)
    if not root.is_dir():
        return None
    for d in sorted(root.glob("step-*"), reverse=True):
        info = verify(d, check_hashes)
        if info is not None:
            return info
        print(f"cephalo trainer: skipping torn checkpoint {d} (missing marker or bad shard)",
              file=sys.stderr)
    return None


def save(root: str | Path, engine: Any, keep: int, extra: dict[str, Any] | None = None
         ) -> Path:
    """Collective: every rank of `engine` writes its shard; returns the checkpoint folder."""
    root = Path(root)
    step = engine.step_count
    final = root / step_dir_name(step)
    partial = root / f".{step_dir_name(step)}.partial"
    rank, comm = engine.rank, engine.comm
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # leftovers of a crashed attempt
        partial.mkdir()
    _barrier(engine)
    opt = engine.optimizer
    shard = {"rank": rank, "rng": torch.get_rng_state(), "units": [
        {"start": u.start, "end": u.end, "param": opt.params[i].detach().cpu(),
         "exp_avg": opt.exp_avg[i].cpu(), "exp_avg_sq": opt.exp_avg_sq[i].cpu()}
        for i, u in enumerate(engine.units)]}
    path = partial / rank_file_name(rank)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(shard, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    facts = (rank_file_name(rank), {"size_bytes": path.stat().st_size, "sha256": _sha256(path)})
    everyone: list[Any] = [facts] * comm.world_size
    if comm.world_size > 1:
        dist.all_gather_object(everyone, facts, group=comm.group)
    if rank == 0:
        meta = {"format_version": FORMAT_VERSION, "step": step,
                "optimizer_steps": opt.num_steps, "world_size": comm.world_size,
                "model": engine.config.model_dump(mode="json"),
                "unit_numels": [u.numel for u in engine.units],
                "bounds": [u.bounds for u in engine.units],
                "global_batch_size": engine.layout.global_batch_size,
                "files": dict(everyone), **(extra or {})}
        _fsync_write(partial / META, json.dumps(meta, indent=1).encode())
        if final.exists():
            shutil.rmtree(final)  # a torn folder of the same step from an earlier attempt
        os.replace(partial, final)
        _fsync_write(final / MARKER, f"{step}\n".encode())
        _prune(root, keep)
    _barrier(engine)
    return final


def _barrier(engine: Any) -> None:
    if engine.comm.world_size > 1:
        dist.barrier(group=engine.comm.group)


def _prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; drop torn leftovers older than the newest
    complete one and stale partial folders (the current save has been renamed already)."""
    complete = [d for d in sorted(root.glob("step-*")) if (d / MARKER).exists()]
    for d in complete[:-keep]:
        shutil.rmtree(d, ignore_errors=True)
    newest = complete[-1].name if complete else ""
    for d in root.glob("step-*"):
        if not (d / MARKER).exists() and d.name < newest:
            shutil.rmtree(d, ignore_errors=True)
    for d in root.glob(".step-*.partial"):
        shutil.rmtree(d, ignore_errors=True)


class ShardReader:
    """Reads global element ranges of a unit from a checkpoint's shard files (lazily, each
    file memory-mapped once)."""

    def __init__(self, info: CheckpointInfo) -> None:
        self.info = info
        self._files: dict[int, dict[str, Any]] = {}

    def _file(self, rank: int) -> dict[str, Any]:
        if rank not in self._files:
            path = self.info.path / rank_file_name(rank)
            self._files[rank] = torch.load(path, map_location="cpu", mmap=True,
                                           weights_only=True)
        return self._files[rank]

    def read(self, unit: int, start: int, end: int, key: str = "param") -> torch.Tensor:
        out = torch.empty(end - start, dtype=torch.float32)
        covered = 0
        for rank, (s, e) in enumerate(self.info.meta["bounds"][unit]):
            lo, hi = max(s, start), min(e, end)
            if hi <= lo:
                continue
            entry = self._file(rank)["units"][unit]
            assert (entry["start"], entry["end"]) == (s, e), "shard offsets disagree with meta"
            out[lo - start:hi - start].copy_(entry[key][lo - s:hi - s])
            covered += hi - lo
        assert covered == end - start, "checkpoint shards do not cover the requested range"
        return out

    def rng_state(self, rank: int) -> torch.Tensor:
        return self._file(rank)["rng"]


def restore(engine: Any, info: CheckpointInfo) -> None:
    """Load `info` into `engine` (whose plan and world size may differ from the writer's)."""
    saved = info.config
    if saved != engine.config:
        raise ValueError(f"checkpoint {info.path} holds a different model ({saved.family}, "
                         f"{saved.num_layers} layers, hidden {saved.hidden_size}) than the job")
    numels = [u.numel for u in engine.units]
    if info.meta["unit_numels"] != numels:
        raise ValueError(f"checkpoint {info.path} unit sizes {info.meta['unit_numels']} "
                         f"differ from the model's {numels}")
    reader = ShardReader(info)
    opt = engine.optimizer
    with torch.no_grad():
        for i, u in enumerate(engine.units):
            for key, target in (("param", opt.params), ("exp_avg", opt.exp_avg),
                                ("exp_avg_sq", opt.exp_avg_sq)):
                target[i].copy_(reader.read(i, u.start, u.end, key).to(target[i].device))
    opt.num_steps = int(info.meta["optimizer_steps"])
    engine.step_count = info.step
    same_rank_exists = engine.rank < int(info.meta["world_size"])
    torch.set_rng_state(reader.rng_state(engine.rank if same_rank_exists else 0))


def full_state_dict(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The whole model as a plain state_dict for `build_model(info.config)`."""
    from cephalo.trainer.flat import param_specs
    from cephalo.trainer.models import build_model

    with torch.device("meta"):
        units = build_model(info.config).units
    reader = ShardReader(info)
    state: dict[str, torch.Tensor] = {}
    for i, unit in enumerate(units):
        flat = reader.read(i, 0, info.meta["unit_numels"][i])
        for spec in param_specs(unit):
            state[f"units.{i}.{spec.name}"] = (
                flat[spec.offset:spec.offset + spec.numel].view(spec.shape).clone())
    return state
