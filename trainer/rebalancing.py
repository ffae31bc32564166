"""Live rebalancing in the training loop (issue 45, item 1; docs/rebalancing.md): the thin
shell around `cephalo.planner.feedback.rebalance`.

Every figure a decision reads reaches every rank in the engine's end-of-step all-reduce, so
every rank takes the same decision after the same step and no collective is added:

* every rank's compute seconds (the engine puts them there for the logs already);
* every rank's most samples its memory holds (`max_samples`, each rank's own figure in its
  own slot of the caller's votes: only that rank knows its memory limit);
* every rank's fingerprint of the split it ran the step under (its own slot too): ranks that
  ever disagreed on the split would read other samples than the global batch's, so all of
  them stop with the same error instead.

A new split takes effect at the next step on every rank (`Engine.set_batch_sizes`); each
rank's [start, end) range of the global batch moves, the global batch of every step stays
the same samples in the same order (data.py: a sample is a function of its step and index).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from cephalo.planner.feedback.rebalance import Decision, Rebalancer, micro_batch_counts
from cephalo.trainer.engine import Engine, StepResult


def max_samples(engine: Engine, limit_bytes: int | None, headroom_bytes: int | None) -> int:
    """The most samples this rank's memory holds with its microbatch size and shard fixed:
    the largest batch (≤ B) whose memory estimate (Engine.memory_estimate_bytes, the
    planner's model) stays within the budget. The budget is the emulated capacity
    `limit_bytes` where set and the plan's batch plus the plan's `headroom_bytes` (its
    memory budget minus its predicted peak) where known, the smaller of the two; with
    neither, the plan's batch's own estimate (a batch may grow only where memory does not
    grow with it, e.g. offloaded activations)."""
    layout = engine.layout
    planned = layout.batch_sizes[engine.rank]
    if layout.micro_batch_sizes[engine.rank] < 1:
        return 0
    at_plan = engine.memory_estimate_bytes(planned)
    budgets = []
    if limit_bytes is not None:
        budgets.append(limit_bytes)
    if headroom_bytes is not None:
        budgets.append(at_plan + max(0, headroom_bytes))
    budget = min(budgets) if budgets else at_plan
    low, high = planned, layout.global_batch_size  # the estimate grows with samples
    if engine.memory_estimate_bytes(high) <= budget:
        return high
    while high - low > 1:  # invariant: low fits (or is the plan's), high does not
        mid = (low + high) // 2
        if engine.memory_estimate_bytes(mid) <= budget:
            low = mid
        else:
            high = mid
    return low


def split_fingerprint(batch_sizes: Sequence[int]) -> float:
    """A number naming a split, exact in the all-reduce's float64 (a CRC-32)."""
    return float(zlib.crc32(",".join(str(b) for b in batch_sizes).encode()))


class LiveSplit:
    """One rank's part of live rebalancing: its votes for the end-of-step all-reduce,
    then `after_step` on the summed figures, which moves the engine to a new split when the
    rebalancer decides one."""

    def __init__(self, engine: Engine, rebalancer: Rebalancer, max_samples: int) -> None:
        self.engine = engine
        self.rebalancer = rebalancer
        self.max_samples = max_samples
        self.world = engine.comm.world_size
        self._first_step: int | None = None

    @property
    def vote_count(self) -> int:
        return 2 * self.world

    def votes(self) -> list[float]:
        """[most samples by rank, split fingerprint by rank], this rank's slots filled."""
        mine = [0.0] * self.vote_count
        mine[self.engine.rank] = float(self.max_samples)
        mine[self.world + self.engine.rank] = split_fingerprint(self.engine.layout.batch_sizes)
        return mine

    def adopt(self, batch_sizes: Sequence[int]) -> None:
        """Run under `batch_sizes` from the next step (a checkpoint's split on resume)."""
        self.engine.set_batch_sizes(batch_sizes)
        self.rebalancer.adopt(batch_sizes)

    def after_step(self, result: StepResult, votes: Sequence[float]) -> Decision | None:
        """`votes`: this class's share of the step's summed votes. The first step of the
        process is not measured (start-up: allocator, threads, first gathers)."""
        fingerprints = votes[self.world:self.vote_count]
        if len(set(fingerprints)) != 1:
            raise RuntimeError(f"ranks ran step {result.step} under different splits of the "
                               f"global batch (fingerprints {fingerprints}); this is a bug in "
                               f"live rebalancing: set spec.planner.rebalance.enabled: false")
        if self._first_step is None:
            self._first_step = result.step
            return None
        self.rebalancer.observe(result.rank_compute_seconds)
        caps = [int(v) for v in votes[:self.world]]
        decision = self.rebalancer.decide(result.step, caps)
        if decision is not None:
            self.engine.set_batch_sizes(decision.new_batch_sizes)
        return decision


def decision_record(decision: Decision, micro_batch_sizes: Sequence[int]) -> dict[str, Any]:
    """What the progress file keeps of a decision (`cephalo run`'s summary reads it)."""
    return {"step": decision.step, "from": list(decision.old_batch_sizes),
            "to": list(decision.new_batch_sizes),
            "micro_batches": micro_batch_counts(decision.new_batch_sizes, micro_batch_sizes),
            "predicted_gain": decision.predicted_gain,
            "seconds_per_sample": list(decision.seconds_per_sample)}
