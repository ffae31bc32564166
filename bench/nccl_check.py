"""Every collective the engine, the profiler and the probe issue, on one GPU under NCCL
(issue 43, item 7): the device check's NCCL step (`scripts/device-check.sh`).

With one GPU, NCCL has one rank (it refuses two ranks on one GPU, "Duplicate GPU detected"),
and at world size 1 the trainer's `UnevenCollectives` short-circuits: its all-gather hands
out the shard, its reduce-scatter a slice, its all-reduce nothing. So this check issues the
backend's calls itself, on CUDA tensors, as the trainer issues them (`async_op=True`, then
`wait()`): all_gather_into_tensor, reduce_scatter_tensor, broadcast, reduce, all_reduce and
barrier; then `UnevenCollectives`' paths as far as they go at world size 1 (its gather into
a buffer does reach the backend: `_gather_into`, NCCL's even all-gather), the profiler's
agreement scalars (`profile_collectives._agreed`, which must travel on the group's device)
and its timing loop, and the wait clock: a collective's wait timed with CUDA events on the
compute stream (`wait_clock.StreamWaitClock`) must read a positive time, where a host clock
reads about zero under NCCL.

The probe (`python -m cephalo.trainer.netprobe`) and `cephalo profile --collectives` refuse
fewer than 2 ranks (a link is measured between two), so they are not run here.

Last, a 2-rank engine step with CUDA tensors over gloo, both ranks on the one GPU (gloo
implements broadcast and all-reduce for CUDA tensors: the engine's uneven all-gather and its
gloo reduce-scatter), uneven shards, whose losses are compared with the same seeded run on
CPU ranks.

`--device cpu` runs the same code over gloo on the CPU (the dry run that
`tests/unit/test_device_check.py` runs): every path but NCCL's and CUDA's. Prints and
writes (--output) one JSON object; exits 1 if any check failed, 2 on bad options.

Run: `python bench/nccl_check.py --device cuda --output nccl.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import preset
from cephalo.trainer.collectives import Pending, UnevenCollectives
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Engine, Layout
from cephalo.trainer.nccl_env import init_group
from cephalo.trainer.precision import pin_fp32_math
from cephalo.trainer.profile_collectives import _agreed, _overlap_fraction, _per_op_seconds
from cephalo.trainer.spawn import free_port, spawn_ranks

# Elements of the buffers the single-rank collectives move (fp32): 64 MiB, a unit of a
# ~16M-parameter block, long enough on a GPU for the wait clock to see the copy.
ELEMENTS = 16 * 1024**2
# The two ranks' engine run: uneven shards and batches (as a mixed-GPU plan gives them).
TWO_RANK_LAYOUT = Layout(batch_sizes=[5, 3], micro_batch_sizes=[5, 1], shard_ratios=[0.7, 0.3])
ENGINE_STEPS = 3
# CUDA against CPU, fp32 with TF32 off (pin_fp32_math): summation order differs only.
LOSS_TOLERANCE = 1e-4


def _device(name: str) -> torch.device:
    return torch.device("cuda", 0) if name == "cuda" else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, issue: Callable[[], bool]) -> dict[str, Any]:
    """Run `issue` (True: its result is right) between device syncs: seconds, or the
    error it raised, one line."""
    _sync(device)
    began = time.perf_counter()
    try:
        right = issue()
        _sync(device)
    except Exception as err:  # a refused call is this check's finding, not its end
        return {"ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    return {"ok": bool(right), "seconds": time.perf_counter() - began}


def backend_calls(device: torch.device, numel: int) -> dict[str, dict[str, Any]]:
    """The backend's own calls at world size 1, as the engine issues them (async, waited),
    each checked: with one rank every SUM is the input and every gather a copy."""
    src = torch.arange(numel, dtype=torch.float32, device=device) % 251

    def all_gather() -> bool:
        out = torch.empty_like(src)
        dist.all_gather_into_tensor(out, src, async_op=True).wait()
        return torch.equal(out, src)

    def reduce_scatter() -> bool:
        out = torch.empty_like(src)
        dist.reduce_scatter_tensor(out, src.clone(), op=dist.ReduceOp.SUM,
                                   async_op=True).wait()
        return torch.equal(out, src)

    def in_place(call: Callable[[torch.Tensor], Any]) -> Callable[[], bool]:
        def run() -> bool:
            t = src.clone()
            call(t).wait()
            return torch.equal(t, src)
        return run

    def barrier() -> bool:
        dist.barrier()
        return True

    calls = {
        "all_gather_into_tensor": all_gather,
        "reduce_scatter_tensor": reduce_scatter,
        "broadcast": in_place(lambda t: dist.broadcast(t, src=0, async_op=True)),
        "reduce": in_place(lambda t: dist.reduce(t, dst=0, op=dist.ReduceOp.SUM,
                                                 async_op=True)),
        "all_reduce": in_place(lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM,
                                                         async_op=True)),
        "barrier": barrier,
    }
    results = {}
    for name, issue in calls.items():
        issue_first = _timed(device, issue)  # the first call of a kind sets up NCCL's
        results[name] = {"first": issue_first, **_timed(device, issue)}
    return results


def uneven_paths(device: torch.device, numel: int) -> dict[str, Any]:
    """`UnevenCollectives` at world size 1: what short-circuits (no backend call) and what
    reaches the backend, each result checked, and its wait clock over a real collective."""
    coll = UnevenCollectives()
    shard = torch.arange(numel, dtype=torch.float32, device=device) % 251
    bounds = [(0, numel)]
    out: dict[str, Any] = {"backend": coll.backend,
                           "wait_clock": type(coll.stats.clock).__name__}
    out["all_gather"] = _timed(device, lambda: torch.equal(
        coll.all_gather(shard, bounds, unit=0).wait(), shard))
    out["all_gather_bf16_out"] = _timed(device, lambda: torch.equal(
        coll.all_gather(shard, bounds, unit=0, dtype=torch.bfloat16).wait(),
        shard.to(torch.bfloat16)))
    out["reduce_scatter"] = _timed(device, lambda: torch.equal(
        coll.reduce_scatter(shard.clone(), bounds, unit=0, consume=False).wait(), shard))
    out["all_reduce_sum"] = _timed(device, lambda: torch.equal(
        coll.all_reduce_sum(shard.clone()), shard))
    short_circuited = dict(coll.stats.native_calls)

    # The gather the engine issues at world size > 1 (NCCL: all_gather_into_tensor of even
    # shards; gloo: a broadcast per shard), through a Pending whose wait is timed by the
    # group's clock: under NCCL the compute stream's, read after the sync (settle).
    def gather_waited() -> bool:
        full = torch.empty(numel, dtype=torch.float32, device=device)
        Pending(coll._gather_into(full, shard, bounds), full, "all_gather", coll.stats).wait()
        return torch.equal(full, shard)

    coll.stats.wait_seconds.clear()
    out["gather_into"] = _timed(device, gather_waited)
    coll.stats.settle()
    wait = coll.stats.wait_seconds["all_gather"]
    out["gather_into"]["wait_seconds"] = wait
    out["gather_into"]["backend_calls"] = coll.stats.native_calls["all_gather"]
    # A positive wait: the stream (or the host, on gloo) stood still for the transfer.
    out["gather_into"]["ok"] = out["gather_into"]["ok"] and wait > 0.0
    out["backend_calls_at_world_size_1"] = short_circuited
    return out


def profiler_helpers(device: torch.device) -> dict[str, Any]:
    """The profiler's and the probe's own helpers at world size 1: the agreement scalars
    (all-reduced on the group's device), the timing loop (barriers, syncs) and the overlap
    estimate, over the trainer's collectives."""
    coll = UnevenCollectives()
    out: dict[str, Any] = {}
    out["agreed_max"] = _timed(device, lambda: _agreed(
        [1.5, -2.0], dist.ReduceOp.MAX, device, None) == [1.5, -2.0])
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        seconds: list[float] = []

        def per_op(kind: str = kind, seconds: list[float] = seconds) -> bool:
            seconds.append(_per_op_seconds(coll, kind, 1 << 20, [1.0], device, repeats=2,
                                           ops=4))
            return seconds[0] > 0.0

        out[f"per_op_seconds_{kind}"] = {**_timed(device, per_op), "measured": seconds}
    overlap: list[float] = []

    def overlap_fraction() -> bool:
        overlap.append(_overlap_fraction(coll, 1 << 16, device, repeats=1))
        return 0.0 <= overlap[0] <= 1.0

    out["overlap_fraction"] = {**_timed(device, overlap_fraction), "measured": overlap}
    return out


def single_rank(device: torch.device, numel: int) -> dict[str, Any]:
    """Join a one-rank group the trainer's way (NCCL on a GPU, gloo on the CPU; TCP store
    on localhost) and run every single-rank check in it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_group(backend, timeout=timedelta(seconds=60), rank=0, world_size=1)
    try:
        return {"backend": dist.get_backend(), "elements": numel,
                "backend_calls": backend_calls(device, numel),
                "uneven_collectives": uneven_paths(device, numel),
                "profiler": profiler_helpers(device)}
    finally:
        dist.destroy_process_group()


def _engine_losses(rank: int, world_size: int, device_name: str, preset_name: str
                   ) -> list[float]:
    """One rank of the 2-rank run (spawn_ranks: gloo): the seeded engine's losses."""
    device = _device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pin_fp32_math()
    config = preset(preset_name)
    engine = Engine(config, TrainingSpec(steps=ENGINE_STEPS, learning_rate=1e-3, seed=0),
                    TWO_RANK_LAYOUT, device=device)
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    start, end = TWO_RANK_LAYOUT.sample_range(rank)
    micro = TWO_RANK_LAYOUT.micro_batch_sizes[rank]
    return [engine.step(data.micro_batches(s, start, end, micro)).loss
            for s in range(ENGINE_STEPS)]


def two_ranks(device: torch.device, preset_name: str) -> dict[str, Any]:
    """The 2-rank gloo engine run on `device` (both ranks on the one GPU) and on the CPU."""
    out: dict[str, Any] = {"preset": preset_name, "layout": {
        "batch_sizes": TWO_RANK_LAYOUT.batch_sizes,
        "micro_batch_sizes": TWO_RANK_LAYOUT.micro_batch_sizes,
        "shard_ratios": TWO_RANK_LAYOUT.shard_ratios}}
    runs: dict[str, list[float]] = {}
    for name in dict.fromkeys((device.type, "cpu")):
        began = time.perf_counter()
        try:
            by_rank = spawn_ranks(_engine_losses, 2, name, preset_name, timeout_seconds=180)
        except RuntimeError as err:
            out[name] = {"ok": False, "error": str(err).strip().splitlines()[-1]}
            continue
        # Every rank reports the global loss: the same on both.
        runs[name] = by_rank[0]
        out[name] = {"ok": by_rank[0] == by_rank[1], "losses": by_rank[0],
                     "seconds": time.perf_counter() - began}
    if device.type in runs and "cpu" in runs:
        worst = max(abs(a - b) / abs(b) for a, b in zip(runs[device.type], runs["cpu"],
                                                         strict=True))
        out["max_relative_loss_difference"] = worst
        out["ok"] = worst <= LOSS_TOLERANCE
    else:
        out["ok"] = False
    return out


def failures(node: Any, path: str = "") -> list[str]:
    """Paths of every {"ok": false} in the result tree."""
    if not isinstance(node, dict):
        return []
    found = [path or "."] if node.get("ok") is False else []
    for key, value in node.items():
        found += failures(value, f"{path}/{key}")
    return found


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--elements", type=int, default=ELEMENTS,
                        help="fp32 elements of the single-rank collectives' buffers")
    parser.add_argument("--preset", default="gpt-tiny",
                        help="the model of the 2-rank engine run")
    parser.add_argument("--skip-two-ranks", action="store_true",
                        help="only the single-rank checks")
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.elements < 1:
        parser.error("--elements must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda needs a CUDA GPU; torch {torch.__version__} sees none "
                     "(--device cpu runs the same checks over gloo)")
    try:
        preset(args.preset)
    except (KeyError, ValueError) as err:
        parser.error(f"--preset {args.preset}: {str(err).splitlines()[0]}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = _device(args.device)
    summary: dict[str, Any] = {
        "device": args.device, "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda"
        else None,
        "not_run": {"netprobe, profile --collectives": "refuse world size < 2 (a link is "
                    "measured between two ranks); one GPU gives one NCCL rank"}}
    summary["single_rank"] = single_rank(device, args.elements)
    if not args.skip_two_ranks:
        summary["two_ranks_gloo"] = two_ranks(device, args.preset)
    summary["failed"] = failures(summary)
    text = json.dumps(summary, indent=1)
    if args.output is not None:
        args.output.write_text(text + "\n")
    print(text)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
