"""The weights of a checkpoint folder's newest complete checkpoint, and how far apart two
such models are: what the resume tests compare runs by."""

from __future__ import annotations

from pathlib import Path

import torch

from cephalo.trainer import checkpoint


def latest_weights(root: Path) -> dict[str, torch.Tensor]:
    """The newest intact checkpoint under `root` as a plain state_dict."""
    info = checkpoint.find_latest(root)
    assert info is not None, f"no complete checkpoint under {root}"
    return checkpoint.full_state_dict(info)


def max_relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest relative difference of `a` from `b`, tensor by tensor."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in a)
