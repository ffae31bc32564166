"""Plain PyTorch training of a whole model on the whole global batch: `torch.optim.AdamW`
(decay on matrices only, as the engine's optimizer), global-norm clipping and the engine's
learning-rate schedule. The fidelity tests hold the engine's uneven, sharded and hybrid
steps against it: code the engine does not share."""

from __future__ import annotations

import torch

from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
from cephalo.api.models import ModelConfig
from cephalo.trainer.data import DataSource
from cephalo.trainer.models import build_model
from cephalo.trainer.optim import learning_rate


def pytorch_training(config: ModelConfig, spec: TrainingSpec, steps: int, global_batch: int
                     ) -> tuple[list[float], list[torch.Tensor]]:
    """(mean loss of every step, every unit's final weights as one flat fp32 tensor), on
    the synthetic data the engine tests read (seed 0)."""
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    model = build_model(config, seed=spec.seed)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": spec.weight_decay},
         {"params": others, "weight_decay": 0.0}],
        lr=spec.learning_rate, betas=(spec.adam_beta1, spec.adam_beta2), eps=spec.adam_epsilon)
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(spec, step)
        inputs, targets = data.batch(step, 0, global_batch)
        optimizer.zero_grad()
        loss = model(inputs, targets).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.gradient_clip_norm)
        optimizer.step()
        losses.append(loss.item())
    return losses, [torch.cat([p.detach().reshape(-1) for p in unit.parameters()])
                    for unit in model.units]
