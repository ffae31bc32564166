"""One flat parameter buffer per unit, of which each rank owns a contiguous shard.

A unit's parameters are laid out back to back (in `named_parameters` order) in one 1-D
buffer. `FlatUnit.detach_parameters` removes the `nn.Parameter`s from the module so the
engine can *bind* the module to any full buffer: every parameter attribute becomes a view
into it. Gradients of all views then accumulate in that one buffer's `.grad`, which is what
the ReduceScatter needs: no per-parameter gradient copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cephalo.api.sharding import shard_bounds


@dataclass(frozen=True)
class ParamSpec:
    """Where one parameter lives in its unit's flat buffer."""

    name: str  # dotted name inside the unit, e.g. "attn.qkv.weight"
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def param_specs(unit: nn.Module) -> list[ParamSpec]:
    specs: list[ParamSpec] = []
    offset = 0
    for name, p in unit.named_parameters():
        specs.append(ParamSpec(name, tuple(p.shape), offset))
        offset += p.numel()
    return specs


def unflatten(specs: list[ParamSpec], flat: torch.Tensor, prefix: str
              ) -> dict[str, torch.Tensor]:
    """A unit's state_dict entries (`prefix` + parameter name) from its full flat buffer."""
    return {f"{prefix}{s.name}": flat[s.offset:s.offset + s.numel].view(s.shape).clone()
            for s in specs}


def _owner(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    *path, leaf = dotted.split(".")
    module = root
    for part in path:
        module = getattr(module, part)
    return module, leaf


class FlatUnit:
    """The flat layout of one unit and its rank's shard bounds."""

    def __init__(self, index: int, module: nn.Module, ratios: list[float], rank: int) -> None:
        self.index = index
        self.module = module
        self.specs = param_specs(module)
        self.numel = sum(s.numel for s in self.specs)
        self.bounds = shard_bounds(self.numel, ratios)
        self.rank = rank
        self.start, self.end = self.bounds[rank]
        # Weight decay applies to matrices (embeddings, projections), not to norms and biases.
        mask = torch.zeros(self.numel, dtype=torch.bool)
        for s in self.specs:
            if len(s.shape) >= 2:
                mask[s.offset:s.offset + s.numel] = True
        self.decay_mask_shard = mask[self.start:self.end].clone()
        self._owners = [_owner(module, s.name) for s in self.specs]
        self._sizes = [s.numel for s in self.specs]

    @property
    def shard_numel(self) -> int:
        return self.end - self.start

    def flatten(self) -> torch.Tensor:
        """The module's current parameter values as one flat fp32 buffer."""
        params = dict(self.module.named_parameters())
        return torch.cat([params[s.name].detach().reshape(-1).float() for s in self.specs])

    def detach_parameters(self) -> None:
        """Turn the module's parameters into plain attributes (bound later to flat views)."""
        for owner, leaf in self._owners:
            del owner._parameters[leaf]
            owner.__dict__[leaf] = None

    def bind(self, flat: torch.Tensor) -> None:
        """Point every parameter attribute at its view of `flat` (a full unit buffer)."""
        # One `split` for all views: autograd then hands their gradients back to `flat` with
        # a single concatenation, instead of one full-size scatter per parameter (which is
        # what separate slices cost). Plain __dict__ writes: Module.__setattr__ is slow.
        chunks = flat.split(self._sizes)
        for s, chunk, (owner, leaf) in zip(self.specs, chunks, self._owners, strict=True):
            owner.__dict__[leaf] = chunk.view(s.shape)

    def bind_leaves(self, flat: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
        """Point every parameter attribute at its own leaf tensor on its part of `flat`'s
        memory, whose `.grad` is the same part of `grad`: autograd then adds each
        parameter's gradient into `grad` in place, one parameter at a time, where `bind`
        hands a whole new unit-sized buffer over per backward (its concatenation). For the
        fused tail, whose units accumulate over microbatches. Returns the leaves."""
        leaves = []
        for s, chunk, part, (owner, leaf) in zip(self.specs, flat.split(self._sizes),
                                                 grad.split(self._sizes), self._owners,
                                                 strict=True):
            param = chunk.detach().view(s.shape).requires_grad_(True)
            param.grad = part.view(s.shape)
            owner.__dict__[leaf] = param
            leaves.append(param)
        return leaves

    def unbind(self) -> None:
        """Drop the views so the full buffer can be freed (resharding)."""
        for owner, leaf in self._owners:
            owner.__dict__[leaf] = None
