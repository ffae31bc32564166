"""`python -m cephalo.trainer` ranks for tests that signal, kill and resume them: each rank a
real process of its own, forked from the tests' fork server (`cephalo.trainer.forked`,
torch imported once) rather than a fresh interpreter that spends ~2.5 s of CPU on its
imports before its first step. The interpreter's own start (`python -m`, the console
script) stays tested where it is what is checked: test_bad_environment_fails_fast_on_every_rank,
the image tests and tests/local."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from cephalo.trainer.forked import ForkedModule, start_module, wait_for_all


def start_ranks(envs: Sequence[Mapping[str, str]], folder: Path, tag: str
                ) -> list[ForkedModule]:
    """One trainer rank per environment (exactly that environment), rank i's stdout and
    stderr in `folder`/`tag`-i.log (`output`)."""
    return [start_module("cephalo.trainer", [], env, cwd=folder, log=log_of(folder, tag, i))
            for i, env in enumerate(envs)]


def log_of(folder: Path, tag: str, rank: int) -> Path:
    return folder / f"{tag}-{rank}.log"


def finish(procs: Sequence[ForkedModule], folder: Path, tag: str,
           timeout_seconds: float = 600) -> list[str]:
    """Wait for every rank (none left running, also on failure); each rank's output."""
    wait_for_all(procs, timeout_seconds)
    return [log_of(folder, tag, i).read_text(errors="replace") for i in range(len(procs))]
