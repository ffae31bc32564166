"""Engine overhead: samples/s of the Cephalo engine on one rank vs a plain PyTorch loop on
the same model, batch, optimizer (AdamW + global-norm clipping) and thread count.

Two fair pairs (modes alternate round by round so background load hits all alike):
* engine without recompute  vs  plain loop;
* engine with unit-boundary recompute (its default)  vs  plain loop with
  `torch.utils.checkpoint` around every block (the same recompute work).

Run: `python bench/engine_overhead.py [--rounds 8 --batch 8]`. Target: within 10%.
On a GPU: `python bench/engine_overhead.py --device cuda --preset gpt-1.3b --batch 8`
(NCCL, prints achieved TFLOP/s of every mode too).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import ModelConfig, preset
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Engine, Layout
from cephalo.trainer.models import UnitModel, build_model
from cephalo.trainer.optim import learning_rate
from cephalo.trainer.spawn import free_port

CONFIG = dict(family="gpt", num_layers=4, hidden_size=256, num_heads=4, ffn_hidden_size=1024,
              vocab_size=1024, sequence_length=64)


def plain_step_fn(model: UnitModel, spec: TrainingSpec, recompute: bool
                  ) -> Callable[[int, torch.Tensor, torch.Tensor], float]:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": spec.weight_decay},
                                   {"params": others, "weight_decay": 0.0}],
                                  lr=spec.learning_rate)

    def forward(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if not recompute:
            return model(x, t)
        h = model.units[0](x)
        for block in model.units[1:-1]:
            h = checkpoint(block, h, use_reentrant=False)
        return model.units[-1](h, t)

    def step(i: int, x: torch.Tensor, t: torch.Tensor) -> float:
        for g in optimizer.param_groups:
            g["lr"] = learning_rate(spec, i)
        optimizer.zero_grad(set_to_none=True)
        loss = forward(x, t).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.gradient_clip_norm)
        optimizer.step()
        return loss.item()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--preset", default=None, help="a model preset instead of the default")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    config = preset(args.preset) if args.preset else ModelConfig(**CONFIG)
    spec = TrainingSpec(steps=10_000, learning_rate=1e-4)
    layout = Layout([args.batch], [args.batch], [1.0])
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    x, t = (v.to(device) for v in data.batch(0, 0, args.batch))
    engines = {name: Engine(config, spec, layout, recompute=rc, device=device)
               for name, rc in (("engine", False), ("engine+recompute", True))}
    modes: dict[str, Callable[[int, torch.Tensor, torch.Tensor], float]] = {
        "plain": plain_step_fn(build_model(config, seed=0).to(device), spec, False),
        "plain+checkpoint": plain_step_fn(build_model(config, seed=0).to(device), spec, True),
        "engine": lambda i, x, t: engines["engine"].step([(x, t)]).loss,
        "engine+recompute": lambda i, x, t: engines["engine+recompute"].step([(x, t)]).loss,
    }
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    losses: dict[str, float] = {}
    steps_done = dict.fromkeys(modes, 0)  # each mode's own LR-schedule position
    for r in range(args.rounds + 1):
        for name, fn in modes.items():
            # Two steps per mode and round, only the second timed: the first re-warms caches
            # and the allocator after the other modes ran (else the order of modes shows).
            for repeat in range(2):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                began = time.perf_counter()
                losses[name] = fn(steps_done[name], x, t)  # a Python float: synchronises
                if r and repeat:  # round 0 warms up
                    seconds[name].append(time.perf_counter() - began)
                steps_done[name] += 1
    print(f"model: gpt {config.total_parameters():,} parameters, batch {args.batch} x "
          f"{config.sequence_length} tokens, {args.threads} threads, best of {args.rounds} rounds")
    # Fastest round: background load only ever adds time, so the minimum is the most
    # faithful estimate of each mode's own cost on a shared machine.
    rate = {m: args.batch / min(s) for m, s in seconds.items()}
    flops = config.training_flops_per_sample()
    for m in modes:
        print(f"{m:>17}: {rate[m]:7.1f} samples/s, {rate[m] * flops / 1e12:7.3f} TFLOP/s "
              f"useful (last loss {losses[m]:.5f})")
    for engine, plain in (("engine", "plain"), ("engine+recompute", "plain+checkpoint")):
        print(f"{engine} / {plain}: {rate[engine] / rate[plain]:.3f} of plain samples/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
