"""Layered gradient accumulation vs per-microbatch (FSDP-style) accumulation on CPU/gloo.

Both modes run the same engine, model, plan and data (so their training math is the same:
the script checks that the losses agree); only the schedule differs:

* layered:  every unit gathered once per pass for all ℓ microbatches, reduce-scattered once
  per step (Cephalo);
* per-microbatch: a full forward + backward per microbatch, gathering every unit for each
  microbatch and reduce-scattering after each (FSDP's gradient accumulation).

Run: `python bench/layered_accumulation.py [--ranks 4 --microbatches 8 --steps 3]`.
Prints collectives issued and wall time per step, and their ratios, measured in this run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import ModelConfig
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Engine, Layout
from cephalo.trainer.spawn import spawn_ranks

# A model whose units are large enough that moving them costs about as much as computing
# a microbatch on a CPU core: the regime FSDP lives in on real clusters.
CONFIG = dict(family="gpt", num_layers=4, hidden_size=256, num_heads=4, ffn_hidden_size=1024,
              vocab_size=1024, sequence_length=32)


def _per_microbatch_step(engine: Engine, batches: list[tuple[torch.Tensor, torch.Tensor]]):
    """FSDP-style accumulation built from the engine's own pieces: one whole pass (with its
    gathers) and one ReduceScatter per microbatch; shard gradients summed locally."""
    total_loss = torch.zeros(())
    summed: list[torch.Tensor] | None = None
    for x, t in batches:
        loss, scatters = engine._forward_backward_recompute([x], [t])
        grads = [p.wait() for p in scatters]
        summed = grads if summed is None else [a + b for a, b in zip(summed, grads, strict=True)]
        total_loss += loss
    assert summed is not None

    class Done:  # the engine's optimizer step takes pending collectives
        def __init__(self, g: torch.Tensor) -> None:
            self.g = g

        def wait(self) -> torch.Tensor:
            return self.g

    return engine._optimizer_step(total_loss, [Done(g) for g in summed])  # type: ignore[misc]


def _worker(rank: int, world_size: int, mode: str, micro: int, steps: int) -> dict:
    config = ModelConfig(**CONFIG)
    layout = Layout([micro] * world_size, [1] * world_size, [1.0 / world_size] * world_size)
    engine = Engine(config, TrainingSpec(steps=steps + 1), layout)
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    start, end = layout.sample_range(rank)
    times, losses = [], []
    calls: dict = {}
    for step in range(steps + 1):  # step 0 warms up
        batches = data.micro_batches(step, start, end, 1)
        engine.comm.stats.reset()
        torch.distributed.barrier()
        began = time.perf_counter()
        if mode == "layered":
            result = engine.step(batches)
        else:
            result = _per_microbatch_step(engine, batches)
        torch.distributed.barrier()
        if step:
            times.append(time.perf_counter() - began)
            calls = {"logical": dict(engine.comm.stats.calls),
                     "native": dict(engine.comm.stats.native_calls)}
        losses.append(result.loss)
    return {"seconds": statistics.median(times), "calls": calls, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    config = ModelConfig(**CONFIG)
    print(f"model: gpt, {config.total_parameters():,} parameters in {config.num_units} units; "
          f"{args.ranks} gloo ranks x {args.microbatches} microbatches of 1 "
          f"(B={args.ranks * args.microbatches}), 1 thread per rank")
    results = {}
    for mode in ("layered", "per-microbatch"):
        results[mode] = spawn_ranks(_worker, args.ranks, mode, args.microbatches, args.steps,
                                  timeout_seconds=300)[0]
        r = results[mode]
        print(f"{mode:>15}: {r['seconds']:.3f} s/step | collectives per step (rank 0): "
              f"logical {r['calls']['logical']} | backend calls {r['calls']['native']}")
    lay, fsdp = results["layered"], results["per-microbatch"]
    agree = max(abs(a - b) / abs(b) for a, b in zip(lay["losses"], fsdp["losses"], strict=True))
    gathers = fsdp["calls"]["logical"]["all_gather"] / lay["calls"]["logical"]["all_gather"]
    scatters = (fsdp["calls"]["logical"]["reduce_scatter"]
                / lay["calls"]["logical"]["reduce_scatter"])
    print(f"losses agree to {agree:.1e} (relative)")
    print(f"ratio per-microbatch / layered: AllGathers {gathers:.1f}x, ReduceScatters "
          f"{scatters:.1f}x, wall time {fsdp['seconds'] / lay['seconds']:.2f}x")


if __name__ == "__main__":
    main()
