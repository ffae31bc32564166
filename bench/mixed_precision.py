"""Per-rank compute precisions against one fp32 device: the loss curve over 50 steps.

Three uneven gloo ranks (batches 5/2/1, shards 0.5/0.3/0.2) train gpt-tiny with each rank in
its own precision, parameters all-gathered and gradients reduce-scattered in fp32 or bf16:
every mix below against a single fp32 device on the same global batch, in the same run.
Prints, per mix, the largest per-step relative loss difference, the mean over the last 10
steps, the loss scale at the end, the steps loss scaling skipped, and the bytes rank 0's
gathers and reduce-scatters fill per step (the buffers handed to the backend).
`tests/trainer/test_precision.py` checks fewer steps; this is the long figure.

Run: `python bench/mixed_precision.py [--steps 50] [--json]`.
"""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist

from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import preset
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Engine, Layout
from cephalo.trainer.spawn import spawn_ranks

# name -> (each rank's precision, the job's gatherPrecision, its reducePrecision)
MIXES = {"fp32/bf16/fp16": (["fp32", "bf16", "fp16"], "fp32", "fp32"),
         "fp32/bf16/fp16 g16": (["fp32", "bf16", "fp16"], "bf16", "fp32"),
         "fp32/bf16/fp16 g16 r16": (["fp32", "bf16", "fp16"], "bf16", "bf16"),
         "fp16 x3": (["fp16"] * 3, "fp32", "fp32"),
         "fp16 x3 g16": (["fp16"] * 3, "bf16", "fp32"),
         "fp16 x3 g16 r16": (["fp16"] * 3, "bf16", "bf16"),
         "bf16 x3": (["bf16"] * 3, "fp32", "fp32"),
         "bf16 x3 g16 r16": (["bf16"] * 3, "bf16", "bf16"),
         "fp32 x3": (["fp32"] * 3, "fp32", "fp32"),
         "fp32 x3 r16": (["fp32"] * 3, "fp32", "bf16")}
BATCHES, MICRO, RATIOS = [5, 2, 1], [1, 2, 1], [0.5, 0.3, 0.2]


def _train(layout: Layout, rank: int, steps: int, group: dist.ProcessGroup | None = None,
           gather: str = "fp32", reduce: str = "fp32") -> dict:
    config = preset("gpt-tiny")
    spec = TrainingSpec(steps=steps, learning_rate=3e-3, weight_decay=0.1, warmup_steps=1,
                        adam_epsilon=1e-6, gradient_clip_norm=1.0, seed=0)
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    engine = Engine(config, spec, layout, group=group, gather_precision=gather,
                    reduce_precision=reduce)
    start, end = layout.sample_range(rank)
    results = [engine.step(data.micro_batches(s, start, end, layout.micro_batch_sizes[rank]))
               for s in range(steps)]
    return {"losses": [r.loss for r in results], "skipped": sum(r.skipped for r in results),
            "scale": engine.scaler.scale if engine.loss_scaling else None,
            "bytes_per_step": {kind: n / steps
                               for kind, n in engine.comm.stats.payload_bytes.items()}}


def _worker(rank: int, world_size: int, steps: int) -> dict:
    out = {name: _train(Layout(BATCHES, MICRO, RATIOS, precisions=list(mix)), rank, steps,
                        gather=gather, reduce=reduce)
           for name, (mix, gather, reduce) in MIXES.items()}
    solo = dist.new_group([0])
    if rank == 0:
        out["reference"] = _train(Layout([8], [8], [1.0]), 0, steps, solo)
    dist.barrier()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    got = spawn_ranks(_worker, 3, args.steps, timeout_seconds=1800)[0]
    ref = got["reference"]["losses"]
    rows = {}
    for name in MIXES:
        losses = got[name]["losses"]
        rel = [abs(a - b) / b for a, b in zip(losses, ref, strict=True)]
        rows[name] = {"max_relative_loss_difference": max(rel),
                      "mean_relative_last_10": sum(rel[-10:]) / len(rel[-10:]),
                      "final_loss": losses[-1], "loss_scale": got[name]["scale"],
                      "skipped_steps": got[name]["skipped"],
                      "rank0_bytes_per_step": got[name]["bytes_per_step"]}
    summary = {"steps": args.steps, "reference_first_loss": ref[0],
               "reference_final_loss": ref[-1], "mixes": rows}
    if args.json:
        print(json.dumps(summary, indent=1))
        return
    print(f"fp32 single device: loss {ref[0]:.4f} -> {ref[-1]:.4f} over {args.steps} steps")
    print("(g16: parameters all-gathered in bf16; r16: gradients reduce-scattered in bf16; "
          "bytes: what rank 0's collectives fill per step)")
    print(f"{'ranks':<24}{'max rel diff':>13}{'mean last 10':>13}{'final loss':>11}"
          f"{'scale':>9}{'skipped':>8}{'gather MB':>10}{'r-s MB':>8}")
    for name, r in rows.items():
        moved = r["rank0_bytes_per_step"]
        print(f"{name:<24}{r['max_relative_loss_difference']:>13.2e}"
              f"{r['mean_relative_last_10']:>13.2e}{r['final_loss']:>11.4f}"
              f"{r['loss_scale'] or 'off':>9}{r['skipped_steps']:>8}"
              f"{moved['all_gather'] / 1e6:>10.2f}{moved['reduce_scatter'] / 1e6:>8.2f}")


if __name__ == "__main__":
    main()
