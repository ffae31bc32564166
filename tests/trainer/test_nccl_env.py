"""NCCL ranks join their group with stashing, not record_stream (issue 43, item 4;
trainer/nccl_env.py): on a torch whose NCCL backend record_streams by default, a freed unit
buffer is not reusable until NCCL's events complete, so a host running ahead of the GPU grows
memory past the plan's model. The variable must be in the environment when the group is
created, on the NCCL path only, and a user's own value stands."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cephalo.trainer import nccl_env
from cephalo.trainer.nccl_env import AVOID_RECORD_STREAMS, init_group, nccl_environment


def _seen_at_init(monkeypatch: pytest.MonkeyPatch, backend: str, version: str) -> list:
    seen: list = []
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda b, **kw: seen.append((b, os.environ.get(AVOID_RECORD_STREAMS))))
    init_group(backend, timeout=timedelta(seconds=5))
    return seen


def test_an_old_torch_s_nccl_rank_stashes_from_its_group_s_creation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AVOID_RECORD_STREAMS, raising=False)
    assert _seen_at_init(monkeypatch, "nccl", "2.6.0+cu124") == [("nccl", "1")]


def test_gloo_and_a_stashing_torch_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AVOID_RECORD_STREAMS, raising=False)
    assert _seen_at_init(monkeypatch, "gloo", "2.6.0") == [("gloo", None)]
    # From 2.8 the variable is deprecated: setting it would only warn.
    assert _seen_at_init(monkeypatch, "nccl", "2.13.0+cu130") == [("nccl", None)]


def test_a_user_s_own_setting_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AVOID_RECORD_STREAMS, "0")
    assert _seen_at_init(monkeypatch, "nccl", "2.5.1") == [("nccl", "0")]


@pytest.mark.parametrize(("version", "wanted"), [
    ("2.4.0", {AVOID_RECORD_STREAMS: "1"}), ("2.7.1+cu126", {AVOID_RECORD_STREAMS: "1"}),
    ("2.8.0", {}), ("2.10.0a0+git1234", {}), ("2.13.0+cu130", {}),
])
def test_which_torch_needs_it(version: str, wanted: dict[str, str]) -> None:
    assert nccl_environment(version) == wanted


def test_every_group_the_trainer_creates_goes_through_init_group() -> None:
    """run.py, the probe and the collective profiler: no direct init_process_group that
    would skip NCCL's environment (spawn.py is gloo-only, for tests)."""
    trainer = Path(nccl_env.__file__).parent
    direct = [path.name for path in sorted(trainer.glob("*.py"))
              if path.name not in ("nccl_env.py", "spawn.py")
              and "dist.init_process_group(" in path.read_text()]
    assert direct == []
