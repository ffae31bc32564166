"""Writing checkpoints (the protocol is in `checkpoint`'s docstring), synchronously or in the
background while training continues.

A save has three parts: `_prepare` (collective: rank 0 makes an earlier attempt at the step
invisible), the shard write (I/O only, no collective: safe on a background thread) and
`_commit` (collective: all ranks report size + sha256 or their error, rank 0 checks the
listing, writes ``meta.json`` then ``COMPLETE``, prunes, all agree on the outcome).

`CheckpointWriter(asynchronous=False)` does the three in a row;
`CheckpointWriter(asynchronous=True)` snapshots the rank's shard (a CPU copy of the fp32
master weights and Adam moments, 12 bytes per element of host memory while it uploads) and
hands serialisation + upload to one background thread. Training goes on; at each step
boundary the ranks vote (`busy`, one tiny all-reduce that also carries the SIGTERM vote)
and commit together once every rank's upload is done, so the marker still comes last and
only after every shard is durable. A checkpoint is visible a few steps after its step, never
before it is complete; the final checkpoint and one asked for by SIGTERM are written
synchronously before the process exits.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from cephalo.trainer.checkpoint import FORMAT_VERSION, MARKER, META, rank_file_name, step_dir_name
from cephalo.trainer.storage import CheckpointError, Store, describe, gather, raise_if_failed

if TYPE_CHECKING:
    from cephalo.trainer.engine import Engine

Report = tuple[str, dict[str, Any] | None, str | None]  # file name, facts, error


def _prepare(store: Store, name: str, step: int, rank: int, world: int,
             group: dist.ProcessGroup | None) -> None:
    error = None
    if rank == 0:  # an earlier attempt at this step must not look complete while we rewrite
        try:
            store.remove(f"{name}/{MARKER}")
            store.remove(f"{name}/{META}")
        except Exception as err:
            error = f"rank 0 could not clear {store.url(name)}: {describe(err)}"
    raise_if_failed(gather(group, world, error), f"checkpoint at step {step}")


def _snapshot(engine: Engine, copy: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's shard (from the engine's `state_dict()`, copied when it must outlive the
    next optimizer step) and the rank-independent part of meta.json, both as of now."""
    state = engine.state_dict()
    opt = state["optimizer"]

    def cpu(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device.type != "cpu":
            return t.cpu()  # a copy already
        return t.clone() if copy else t  # the optimizer updates its tensors in place

    # Every rank writes what it owns: its slice when flat (file = rank), its piece of its
    # slice under hybrid sharding (file = position x groups + group: replicas.file_index).
    # (A replicated prefix, which every group holds, is written by the owner of piece 0.)
    def part(key: str, unit: int) -> torch.Tensor:
        start, end, skip = engine.file_range(unit)
        whole = opt[key][unit]  # type: ignore[literal-required]
        if end - start == whole.numel():
            return cpu(whole)
        # A copy, not a view: torch.save would write the view's whole storage.
        return whole[skip:skip + end - start].detach().to("cpu", copy=True)

    shard = {"rank": engine.file_index, "rng": torch.get_rng_state(), "units": [
        {"start": engine.file_range(i)[0], "end": engine.file_range(i)[1],
         "param": part("param", i), "exp_avg": part("exp_avg", i),
         "exp_avg_sq": part("exp_avg_sq", i)}
        for i in range(len(engine.units))]}
    meta = {"format_version": FORMAT_VERSION, "step": state["step_count"],
            # world_size: how many shard files (one a rank); bounds: the global [start, end)
            # of each file's shard of each unit, which is all a reader needs whatever plan
            # it runs (flat, hybrid, another group count).
            "optimizer_steps": opt["num_steps"], "world_size": engine.comm.world_size,
            "model": engine.config.model_dump(mode="json"),
            "unit_numels": [u.numel for u in engine.units],
            "bounds": [engine.file_bounds(i) for i in range(len(engine.units))],
            "global_batch_size": engine.layout.global_batch_size,
            # The split in force for the steps after this one (live rebalancing moves it),
            # the plan's, and the microbatch sizes: a resume under the same plan goes on
            # under `batch_sizes` (checkpoint.split_in_force); any split reads the same
            # samples (data.py).
            "batch_sizes": list(engine.layout.batch_sizes),
            "planned_batch_sizes": list(engine.planned_batch_sizes),
            "micro_batch_sizes": list(engine.layout.micro_batch_sizes),
            "loss_scale": dict(state["loss_scale"])}
    if engine.layout.replica_groups:  # for humans: who wrote it (readers use the bounds)
        meta["replica_groups"] = [list(g) for g in engine.layout.replica_groups]
    return shard, meta


def _write_shard(store: Store, name: str, rank: int, shard: dict[str, Any]) -> Report:
    """I/O only (no collective): this rank's file (`rank`: the file's number, the shard's
    "rank"), or the one-line reason it failed."""
    file_name = rank_file_name(rank)
    try:
        store.makedirs(name)  # every rank makes its own folder: nothing relies on rank 0
        return file_name, store.write_stream(f"{name}/{file_name}",
                                             lambda f: torch.save(shard, f)), None
    except Exception as err:
        return file_name, None, (f"rank {rank} could not write {store.url(name, file_name)}: "
                                 f"{describe(err)}")


def _commit(store: Store, name: str, meta: dict[str, Any], mine: Report, keep: int,
            rank: int, world: int, group: dist.ProcessGroup | None) -> str:
    step = meta["step"]
    reports = gather(group, world, mine)
    raise_if_failed([e for _, _, e in reports], f"checkpoint at step {step}")
    error = None
    if rank == 0:
        try:
            files = {n: f for n, f, _ in reports if f is not None}
            listed = store.sizes(name)
            absent = [n for n, f in files.items() if listed.get(n) != f["size_bytes"]]
            if absent:  # storage that is not shared (or lost writes): never write a marker
                raise CheckpointError(
                    f"{', '.join(absent)} reported written by their ranks but not visible to "
                    f"rank 0 in {store.url(name)}; the checkpoint storage must be shared by "
                    f"all ranks")
            store.write_bytes(f"{name}/{META}",
                              json.dumps({**meta, "files": files}, indent=1).encode())
            store.write_bytes(f"{name}/{MARKER}", f"{step}\n".encode())
            prune(store, keep)
        except Exception as err:
            error = f"rank 0 could not complete {store.url(name)}: {describe(err)}"
    raise_if_failed(gather(group, world, error), f"checkpoint at step {step}")
    return store.url(name)


def prune(store: Store, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; drop torn leftovers older than the newest
    complete one (a crashed attempt) and the old format's partial folders."""
    names = store.folders("step-")
    complete = [n for n in names if store.exists(f"{n}/{MARKER}")]
    newest = complete[-1] if complete else ""
    doomed = complete[:-keep] + [n for n in names if n not in complete and n < newest]
    for n in doomed:
        store.remove(f"{n}/{MARKER}")  # invisible first, so a half-deleted one is torn
        store.remove(n, recursive=True)
    for n in store.folders(".step-"):
        if n.endswith(".partial"):
            store.remove(n, recursive=True)


class CheckpointWriter:
    """Saves checkpoints of one engine, optionally uploading in the background."""

    def __init__(self, store: Store, engine: Engine, keep: int,
                 group: dist.ProcessGroup | None, asynchronous: bool) -> None:
        self.store, self.engine, self.keep, self.group = store, engine, keep, group
        self.asynchronous = asynchronous
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="cephalo-checkpoint") \
            if asynchronous else None
        self._pending: tuple[str, dict[str, Any], Future[Report]] | None = None

    @property
    def busy(self) -> bool:
        """This rank still uploads a checkpoint that is not committed yet (local view)."""
        return self._pending is not None and not self._pending[2].done()

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    def start(self, wait: bool) -> list[str]:
        """Collective: begin a checkpoint of the engine now (committing an earlier pending one
        first); with `wait` (or when synchronous) it is complete on return. Returns the
        locations committed by this call."""
        committed = [self.finish()] if self._pending is not None else []
        engine = self.engine
        rank, world = engine.rank, engine.comm.world_size
        name = step_dir_name(engine.step_count)
        _prepare(self.store, name, engine.step_count, rank, world, self.group)
        if self._executor is None or wait:
            shard, meta = _snapshot(engine, copy=False)
            report = _write_shard(self.store, name, engine.file_index, shard)
            return [*committed, _commit(self.store, name, meta, report, self.keep, rank,
                                        world, self.group)]
        shard, meta = _snapshot(engine, copy=True)
        future: Future[Report] = self._executor.submit(
            _write_shard, self.store, name, engine.file_index, shard)
        self._pending = (name, meta, future)
        return committed

    def finish(self) -> str:
        """Collective: wait for this rank's pending upload and commit it with the others."""
        assert self._pending is not None, "no checkpoint upload to finish"
        name, meta, future = self._pending
        self._pending = None
        engine = self.engine
        return _commit(self.store, name, meta, future.result(), self.keep, engine.rank,
                       engine.comm.world_size, self.group)

    def close(self) -> None:
        """Stop the background thread (after an error: the pending upload stays torn)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
