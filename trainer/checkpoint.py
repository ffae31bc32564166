"""Sharded, atomic checkpoints on a shared volume or object storage, resumable under any plan
or world size.

Layout of a checkpoint root (a folder every rank sees, or an fsspec URL such as
``s3://bucket/prefix/namespace/job``; see `storage.Store`)::

    step-00000040/
        rank-00000.pt   one file per rank: for every unit its global [start, end) offsets,
        rank-00001.pt   fp32 master shard and Adam moments; the rank's RNG state
        meta.json       step, model config, unit sizes and bounds, every file's size and
                        sha256, the job's loss scale (fp16 ranks)
        COMPLETE        written last; its presence (and matching files) = loadable

Every rank writes one file of what it owns: flat, its shard of every unit (file = rank);
under hybrid sharding (docs/hybrid-sharding.md) its piece of its slice, the master and Adam
moments only it holds (file = position x G + group, so the files' ranges follow each other:
slice 0's G pieces, then slice 1's...). meta.json's ``world_size`` counts the files and
``bounds`` gives each file's global range per unit. Readers go by the offsets, so any plan
(flat, hybrid, another group count) reads any checkpoint; a hybrid rank reads its whole
slice's weights and its piece's moments.

Protocol (the same on POSIX and object storage, because object stores have no rename;
written by `checkpoint_write`, optionally in the background while training goes on):

1. rank 0 deletes a stale ``COMPLETE`` / ``meta.json`` of an earlier attempt at the same
   step, and every rank agrees (one object all-gather) before anything is written;
2. every rank writes its own ``rank-NNNNN.pt`` straight into ``step-N/`` (creating the
   folder itself where folders exist; a local file goes temp -> fsync -> rename -> fsync
   folder, an object appears only when its upload completes), hashing while it writes;
3. all ranks gather every rank's (size, sha256) or its error; any error stops every rank
   with the same one line naming the failing rank, the path and the cause;
4. rank 0 lists ``step-N/`` and checks that every reported file is there with its size
   (so storage that is not shared cannot produce a marker), writes ``meta.json``, then
   ``COMPLETE`` last, prunes, and all ranks agree on that outcome.

With asynchronous checkpoints, 2 runs on a background thread from a snapshot of the shard
and 3-4 happen at the first step boundary where every rank's upload is done (one tiny
all-reduce per step decides), so the marker still comes last.

A folder without ``COMPLETE``, or whose files' sizes (cheap listing) or hashes (when read)
disagree with ``meta.json``, is torn and skipped. Pruning deletes a checkpoint's marker
first, so a half-deleted checkpoint is never taken for a complete one.

Resume (`resume_point`): rank 0 lists the candidates (marker + meta + sizes, no reading);
every rank then hashes only the shard files it will read under the *new* plan (in parallel
across ranks; on object storage the hash is taken while downloading the local copy it
then memory-maps), and one all-gather decides: the newest candidate that every rank
verified wins. The agreement runs on a gloo group whose timeout is the larger of
CEPHALO_COLLECTIVE_TIMEOUT_SECONDS and the time to move the whole training state at
50 MB/s (`storage_timeout_seconds`), so a rank reading a large checkpoint is not cut off.

Why plain fsspec + torch.save and not torch.distributed.checkpoint (DCP): DCP's
FsspecWriter gives a similar one-file-per-rank layout, but its commit point is a
``.metadata`` written to a temp name and renamed (a copy + delete on object stores), it keeps
no per-file hashes (a corrupted shard shows only on load), it has no torn-folder skipping or
pruning, and it reshards through its own planner rather than the global offsets this format
already carries (and that `cephalo export` and existing checkpoints use). Adding fsspec I/O
to this format keeps every guarantee above at one PUT per rank and one GET per file a rank
needs. (Not benchmarked against DCP: the choice follows from the guarantees.)
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from cephalo.api.models import ModelConfig
from cephalo.trainer.storage import CheckpointError, Store, describe, gather

if TYPE_CHECKING:
    from cephalo.trainer.engine import Engine

FORMAT_VERSION = 1
MARKER = "COMPLETE"
META = "meta.json"
STATE_BYTES_PER_ELEMENT = 12  # fp32 master weight + two fp32 Adam moments
SLOWEST_STORAGE_BYTES_PER_SECOND = 50e6


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def as_store(root: str | Path | Store) -> Store:
    return root if isinstance(root, Store) else Store(root)


@dataclass(frozen=True)
class CheckpointInfo:
    store: Store
    name: str  # the checkpoint's folder below the store's root ("" = the root itself)
    meta: dict[str, Any]

    @property
    def path(self) -> str:
        return self.store.url(self.name) if self.name else self.store.url()

    def rel(self, file_name: str) -> str:
        return f"{self.name}/{file_name}" if self.name else file_name

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def config(self) -> ModelConfig:
        from cephalo.trainer.checkpoint_check import recorded_config

        return recorded_config(self)


def _listed(store: Store, name: str) -> CheckpointInfo | None:
    """The checkpoint in folder `name` if its marker, meta and file sizes agree (no reading
    of shards), else None. Never raises for a torn or foreign folder."""
    try:
        sizes = store.sizes(name)
        if MARKER not in sizes or META not in sizes:
            return None
        meta = json.loads(store.read_bytes(f"{name}/{META}" if name else META))
        if meta.get("format_version") != FORMAT_VERSION:
            return None
        for file_name, facts in meta["files"].items():
            if sizes.get(file_name) != facts["size_bytes"]:
                return None
        return CheckpointInfo(store, name, meta)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def candidates(root: str | Path | Store) -> list[CheckpointInfo]:
    """Complete-looking checkpoints, newest first (the root itself if it is one)."""
    store = as_store(root)
    here = store.sizes()
    if META in here or MARKER in here:
        info = _listed(store, "")
        return [info] if info is not None else []
    found = []
    for name in reversed(store.folders("step-")):
        info = _listed(store, name)
        if info is None:
            print(f"cephalo trainer: skipping torn checkpoint {store.url(name)} (missing "
                  f"marker or a shard of the wrong size)", file=sys.stderr)
        else:
            found.append(info)
    return found


def verify_files(info: CheckpointInfo, ranks: set[int], cache_dir: Path
                 ) -> tuple[dict[int, Path], str | None]:
    """Local copies of the given ranks' files, or an error if one is missing or altered."""
    local: dict[int, Path] = {}
    for r in sorted(ranks):
        file_name = rank_file_name(r)
        want = info.meta["files"].get(file_name)
        try:
            local[r], got = info.store.local_copy(info.rel(file_name), cache_dir)
        except Exception as err:
            return local, f"{info.store.url(info.rel(file_name))}: {describe(err)}"
        if want is None or got != want:
            return local, f"{info.store.url(info.rel(file_name))} does not match meta.json"
    return local, None


def find_latest(root: str | Path | Store, check_hashes: bool = True,
                cache_dir: Path | None = None) -> CheckpointInfo | None:
    """Newest intact checkpoint under `root` (or `root` itself if it is one); one process."""
    for info in candidates(root):
        if not check_hashes:
            return info
        scratch = cache_dir or Path(tempfile.mkdtemp(prefix="cephalo-verify-"))
        try:
            _, error = verify_files(info, set(range(int(info.meta["world_size"]))), scratch)
        finally:
            if cache_dir is None:
                shutil.rmtree(scratch, ignore_errors=True)
        if error is None:
            return info
        print(f"cephalo trainer: skipping torn checkpoint {info.path} ({error})",
              file=sys.stderr)
    return None


def storage_timeout_seconds(engine: Engine, configured_seconds: float) -> float:
    """Timeout for checkpoint agreements: time to move the whole training state at the
    slowest storage we support, never less than the configured collective timeout."""
    total = sum(u.numel for u in engine.units) * STATE_BYTES_PER_ELEMENT
    return max(configured_seconds, 60.0 + total / SLOWEST_STORAGE_BYTES_PER_SECOND)


def rng_file(meta: dict[str, Any], file_index: int) -> int:
    """The file whose RNG state a rank takes: the one of its own file's number
    (`Engine.file_index`: its rank when flat) where it exists."""
    return file_index if file_index < int(meta["world_size"]) else 0


def files_needed(meta: dict[str, Any], ranges: list[tuple[int, int]], file_index: int
                 ) -> set[int]:
    """Old files that hold any element in `ranges` (per unit: the rank's slices), plus the
    RNG's."""
    need = {rng_file(meta, file_index)}
    for unit, (start, end) in enumerate(ranges):
        for old, (s, e) in enumerate(meta["bounds"][unit]):
            if max(s, start) < min(e, end):
                need.add(old)
    return need


class ShardReader:
    """Reads global element ranges of a unit from a checkpoint's shard files (lazily, each
    file memory-mapped once from local storage or a verified local copy). Files of an object
    store are downloaded into `cache_dir`, or into a temporary folder of its own that
    close() (or leaving a `with` block) deletes; local files are read where they are."""

    def __init__(self, info: CheckpointInfo, local_files: dict[int, Path] | None = None,
                 cache_dir: Path | None = None) -> None:
        self.info = info
        self._local = dict(local_files or {})
        self._cache_dir = cache_dir
        self._own_cache_dir: Path | None = None  # made here, so removed by close()
        self._files: dict[int, dict[str, Any]] = {}

    def close(self) -> None:
        """Forget the mapped files and delete downloads this reader made itself."""
        self._files.clear()
        if self._own_cache_dir is not None:
            shutil.rmtree(self._own_cache_dir, ignore_errors=True)
            self._own_cache_dir = None

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _file(self, rank: int) -> dict[str, Any]:
        if rank not in self._files:
            if rank not in self._local and self.info.store.is_local:
                # Read in place: no copy, no temporary folder, no hashing of the file.
                self._local[rank] = Path(self.info.store.path(
                    self.info.rel(rank_file_name(rank))))
            if rank not in self._local:
                if self._cache_dir is None:
                    self._cache_dir = Path(tempfile.mkdtemp(prefix="cephalo-read-"))
                    self._own_cache_dir = self._cache_dir
                self._local[rank], _ = self.info.store.local_copy(
                    self.info.rel(rank_file_name(rank)), self._cache_dir)
            try:
                data = torch.load(self._local[rank], map_location="cpu", mmap=True,
                                  weights_only=True)
            except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
                data = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
            if not (isinstance(data, dict) and isinstance(data.get("units"), list)
                    and "rng" in data):
                raise CheckpointError(
                    f"{self.info.path}: {rank_file_name(rank)} is not a Cephalo checkpoint "
                    f"shard ({data if isinstance(data, str) else 'no units and rng state'})")
            self._files[rank] = data
        return self._files[rank]

    def entry(self, rank: int, unit: int, start: int, end: int) -> dict[str, Any]:
        """Rank `rank`'s shard of `unit`, which meta.json says holds [start, end)."""
        units = self._file(rank)["units"]
        entry = units[unit] if unit < len(units) else None
        where = f"{self.info.path}: {rank_file_name(rank)}"
        if not isinstance(entry, dict) or "start" not in entry or "end" not in entry:
            raise CheckpointError(f"{where} holds no shard of unit {unit}")
        if (entry["start"], entry["end"]) != (start, end):
            raise CheckpointError(f"{where} holds unit {unit} at [{entry['start']}, "
                                  f"{entry['end']}), meta.json says [{start}, {end})")
        for key in ("param", "exp_avg", "exp_avg_sq"):
            tensor = entry.get(key)
            if not isinstance(tensor, torch.Tensor) or tensor.numel() != end - start:
                raise CheckpointError(f"{where}: unit {unit}'s {key} is not a tensor of "
                                      f"{end - start} elements")
        return entry

    def read(self, unit: int, start: int, end: int, key: str = "param") -> torch.Tensor:
        out = torch.empty(end - start, dtype=torch.float32)
        covered = 0
        for rank, (s, e) in enumerate(self.info.meta["bounds"][unit]):
            lo, hi = max(s, start), min(e, end)
            if hi <= lo:
                continue
            entry = self.entry(rank, unit, s, e)
            out[lo - start:hi - start].copy_(entry[key][lo - s:hi - s])
            covered += hi - lo
        if covered != end - start:
            raise CheckpointError(f"{self.info.path}: the shards cover {covered} of unit "
                                  f"{unit}'s elements [{start}, {end})")
        return out

    def rng_state(self, rank: int) -> torch.Tensor:
        return self._file(rank)["rng"]


def restore(engine: Engine, info: CheckpointInfo, reader: ShardReader | None = None) -> None:
    """Load `info` into `engine` (whose plan and world size may differ from the writer's):
    this rank's global element ranges are read into the tensors of the engine's
    `state_dict()` in place (one unit at a time, no second copy of the state), which is then
    handed back through `load_state_dict`, as torch.distributed.checkpoint loads a
    `Stateful`."""
    from cephalo.trainer.checkpoint_check import check_layout

    saved = info.config
    if saved != engine.config:
        raise ValueError(f"checkpoint {info.path} holds a different model ({saved.family}, "
                         f"{saved.num_layers} layers, hidden {saved.hidden_size}) than the job")
    numels = [u.numel for u in engine.units]
    if info.meta["unit_numels"] != numels:
        raise ValueError(f"checkpoint {info.path} unit sizes {info.meta['unit_numels']} "
                         f"differ from the model's {numels}")
    check_layout(info, numels)
    reader = reader or ShardReader(info)
    state = engine.state_dict()
    opt = state["optimizer"]
    try:
        # The weights of this rank's whole slice (the masters of its piece among them)...
        engine.load_parameters(lambda i, start, end: reader.read(i, start, end))
        with torch.no_grad():  # ... and the moments of what it owns
            for i in range(len(engine.units)):
                ranges = engine.owned_ranges(i)
                for key, target in (("exp_avg", opt["exp_avg"][i]),
                                    ("exp_avg_sq", opt["exp_avg_sq"][i])):
                    target.copy_(torch.cat([reader.read(i, start, end, key)
                                            for start, end in ranges]).to(target.device))
        torch.set_rng_state(reader.rng_state(rng_file(info.meta, engine.file_index)))
    finally:
        reader.close()
    opt["num_steps"] = int(info.meta["optimizer_steps"])
    state["step_count"] = info.step
    if "loss_scale" in info.meta:  # job-wide; older checkpoints: the scaler starts afresh
        state["loss_scale"] = info.meta["loss_scale"]
    engine.load_state_dict(state)


def split_in_force(info: CheckpointInfo, engine: Engine) -> list[int] | None:
    """The split of the global batch `info` was written under, where it is the same plan
    that `engine` runs (the same ranks' planned batches and microbatch sizes) and that split
    differs from the plan's; None otherwise (another plan starts from its own split, as does
    a checkpoint older than live rebalancing). Every rank reads the same meta.json, so every
    rank takes the same answer."""
    meta = info.meta
    split = meta.get("batch_sizes")
    if split is None or meta.get("planned_batch_sizes") != engine.planned_batch_sizes or \
            meta.get("micro_batch_sizes") != engine.layout.micro_batch_sizes or \
            sum(split) != engine.layout.global_batch_size or \
            split == engine.layout.batch_sizes:
        return None
    return [int(b) for b in split]


def full_state_dict(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The whole model as a plain state_dict for `build_model(info.config)`."""
    from cephalo.trainer.checkpoint_check import check_checkpoint
    from cephalo.trainer.flat import param_specs, unflatten

    units = check_checkpoint(info)
    reader = ShardReader(info)
    state: dict[str, torch.Tensor] = {}
    try:
        for i, unit in enumerate(units):
            flat = reader.read(i, 0, info.meta["unit_numels"][i])
            state.update(unflatten(param_specs(unit), flat, f"units.{i}."))
    finally:
        reader.close()
    return state


def resume_point(store: Store, engine: Engine, group: dist.ProcessGroup | None,
                 cache_dir: Path) -> tuple[CheckpointInfo, ShardReader] | None:
    """Collective: the newest checkpoint whose files every rank verified (each rank hashes
    only the files it will read), with a reader over this rank's verified local copies."""
    rank, world = engine.rank, engine.comm.world_size
    found: list[tuple[str, dict[str, Any]]] | str | None = None  # str: rank 0's error
    if rank == 0:
        try:
            found = [(info.name, info.meta) for info in candidates(store)]
        except Exception as err:
            found = f"rank 0 could not list {store.url()}: {describe(err)}"
    listed = gather(group, world, found)[0]
    if isinstance(listed, str):
        raise CheckpointError(f"resuming failed: {listed}")
    ranges = [(u.start, u.end) for u in engine.units]
    for name, meta in listed:
        info = CheckpointInfo(store, name, meta)
        local, error = verify_files(info, files_needed(meta, ranges, engine.file_index),
                                    cache_dir)
        errors = gather(group, world, error)
        if not any(errors):
            return info, ShardReader(info, local, cache_dir)
        if not store.is_local:  # downloaded copies of a torn checkpoint
            for path in local.values():
                path.unlink(missing_ok=True)
        if rank == 0:
            bad = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
            print(f"cephalo trainer: skipping torn checkpoint {info.path} ({bad})",
                  file=sys.stderr, flush=True)
    return None
