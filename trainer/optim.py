"""AdamW on flat shards (the learning-rate schedule is `cephalo.api.schedule`).

AdamW is elementwise, so stepping each rank's shard with the full gradient's shard is the
same computation as stepping the whole model on one device: the formula below is
`torch.optim.AdamW`'s (so a plain PyTorch reference matches to rounding). Weight decay
applies to matrices only (a per-shard mask), gradient clipping uses the norm over *all*
shards (one all-reduce of the squared sums).
"""

from __future__ import annotations

import math
from typing import TypedDict

import torch

from cephalo.api.job import TrainingSpec
from cephalo.api.schedule import learning_rate as learning_rate  # re-exported


class OptimizerState(TypedDict):
    """`ShardedAdamW.state_dict()`: one fp32 tensor per unit (this rank's shard) per key."""

    param: list[torch.Tensor]  # master weights
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
    num_steps: int  # optimizer steps taken (Adam's bias correction)


class ShardedAdamW:
    """AdamW state (fp32 master weights, moments) for the shards one rank owns."""

    def __init__(self, master_shards: list[torch.Tensor], decay_masks: list[torch.Tensor],
                 spec: TrainingSpec) -> None:
        self.params = master_shards
        self.decay_masks = decay_masks
        self.spec = spec
        self.exp_avg = [torch.zeros_like(p) for p in master_shards]
        self.exp_avg_sq = [torch.zeros_like(p) for p in master_shards]
        self.num_steps = 0  # optimizer steps taken (Adam's bias-correction counter)

    @staticmethod
    def squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
        """Sum of squares of this rank's gradient shards (fp32, summed across ranks later)."""
        total = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
        for g in grads:
            if g.numel():
                total += torch.linalg.vector_norm(g, dtype=torch.float32).square()
        return total

    @staticmethod
    def clip_factor(global_norm: float, max_norm: float | None) -> float:
        """The factor torch.nn.utils.clip_grad_norm_ would scale gradients by."""
        if max_norm is None:
            return 1.0
        return min(1.0, max_norm / (global_norm + 1e-6))

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], lr: float, grad_scale: float = 1.0) -> None:
        self.num_steps += 1
        s = self.spec
        beta1, beta2 = s.adam_beta1, s.adam_beta2
        bias_correction1 = 1 - beta1 ** self.num_steps
        bias_correction2_sqrt = math.sqrt(1 - beta2 ** self.num_steps)
        step_size = lr / bias_correction1
        for p, g, m, v, mask in zip(self.params, grads, self.exp_avg, self.exp_avg_sq,
                                    self.decay_masks, strict=True):
            if not p.numel():
                continue
            g = g.float()
            if grad_scale != 1.0:
                g.mul_(grad_scale)  # the gradient shard is ours: scale in place
            if s.weight_decay:
                p.copy_(torch.where(mask, p * (1 - lr * s.weight_decay), p))
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / bias_correction2_sqrt).add_(s.adam_epsilon)
            p.addcdiv_(m, denom, value=-step_size)

    def state_dict(self) -> OptimizerState:
        """This rank's optimizer state, per unit (torch's `Stateful` protocol). The tensors
        are the live ones, not copies: a loader may fill them in place (as
        torch.distributed.checkpoint does) and a writer that must outlive the next step
        copies them."""
        return {"param": self.params, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq,
                "num_steps": self.num_steps}

    @torch.no_grad()
    def load_state_dict(self, state: OptimizerState) -> None:
        """Adopt `state` (same shard sizes; values already in place are not copied again)."""
        for key, mine, given in (("param", self.params, state["param"]),
                                 ("exp_avg", self.exp_avg, state["exp_avg"]),
                                 ("exp_avg_sq", self.exp_avg_sq, state["exp_avg_sq"])):
            if len(given) != len(mine):
                raise ValueError(f"optimizer state has {len(given)} {key} shards, this rank "
                                 f"{len(mine)}")
            for target, value in zip(mine, given, strict=True):
                if value.shape != target.shape:
                    raise ValueError(f"optimizer state {key} shard of shape "
                                     f"{tuple(value.shape)}, this rank's is "
                                     f"{tuple(target.shape)}")
                if value is not target:
                    target.copy_(value)
        self.num_steps = int(state["num_steps"])
