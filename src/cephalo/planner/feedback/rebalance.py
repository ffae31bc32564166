"""Live rebalancing: a new split of the same global batch over the same ranks, from what the
running ranks measured (issue 45, item 1). Pure: the trainer feeds it the timings every rank
already receives from the end-of-step all-reduce, so every rank computes the same split from
the same numbers, with no collective of its own.

What moves is only each rank's batch b_i, i.e. its number of microbatches ℓ_i = ⌈b_i / m_i⌉:
its microbatch size m_i stays, so its per-microbatch memory stays, and its shard stays. A rank
whose batch is not a multiple of m_i runs a smaller last microbatch (the engine cuts a rank's
samples into microbatches of m_i and takes the rest as one more: data.micro_batches), so
every B is reachable and Σ b_i = B holds exactly.

The model of a rank's compute is linear in its samples: t_i · b_i, with t_i its measured
compute seconds per sample, smoothed (an exponentially weighted mean over the steps run under
the split in force). A rank's fixed per-step work makes t_i over-state what moving a sample
changes, so a move under-shoots the balance rather than over-shooting it: repeated moves
approach it from one side and the minimum gain stops them close to it, instead of
oscillating. The optimisation is exact: `best_split` minimises max_i t_i · b_i over integer
splits (water-filling, checked against a brute force in the tests).

Damping, so noise does not move samples back and forth: a decision every `interval_steps`
steps at most, on the smoothed times, and only when the predicted compute of the slowest rank
drops by at least `min_gain` (its fraction). Hysteresis, because a rank's compute need not be
linear in its samples (fixed per-step work, caches, a tiny model's overheads): the split just
left, and the slowest rank's compute measured under it, are remembered, and a move back to
it is made only when the split in force measures at least `min_gain` slower than it did. Seen
on the operator's emulator without it: [1, 7] -> [2, 6] -> [1, 7] -> ... every interval, each
split's per-sample figures predicting the other >5 % faster, while [2, 6] measured faster.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

# Weight of the newest step in the smoothed seconds per sample: a slowdown shows after a step
# or two, a single noisy step moves the estimate by a third of its deviation.
SMOOTHING = 1 / 3


@dataclass(frozen=True)
class Hold:
    """Memory keeps the split short of the one the figures want (issue 45, item 2): the
    ranks that would need more samples than their memory holds at their microbatch size.
    Growing them needs a smaller microbatch or a smaller shard, i.e. a restart
    (re-planning); moving shards in place is not done."""

    step: int  # the decision (1-based step) that found it
    kept_batch_sizes: tuple[int, ...]  # the split in force after that decision
    wanted_batch_sizes: tuple[int, ...]  # the split without the memory bounds
    reason: str


@dataclass(frozen=True)
class Decision:
    """A new split, effective from the step after `step`."""

    step: int  # the step (1-based, as logged) after which the split changes
    old_batch_sizes: tuple[int, ...]
    new_batch_sizes: tuple[int, ...]
    seconds_per_sample: tuple[float | None, ...]  # the smoothed figures it was taken on
    predicted_gain: float  # old predicted compute / new - 1
    held: Hold | None = None  # memory stopped the move short of the split wanted

    def describe(self) -> str:
        times = ", ".join("-" if t is None else f"{t * 1e3:.2f}" for t in self.seconds_per_sample)
        held = "" if self.held is None else f"; {self.held.reason}"
        return (f"split {list(self.old_batch_sizes)} -> {list(self.new_batch_sizes)} after step "
                f"{self.step}: the slowest rank's compute predicted "
                f"{1 + self.predicted_gain:.2f}x faster (ms per sample: {times}){held}")


def micro_batch_counts(batch_sizes: Sequence[int], micro_batch_sizes: Sequence[int]
                       ) -> list[int]:
    """ℓ_i = ⌈b_i / m_i⌉ (the last microbatch may be smaller); 0 for a rank without samples."""
    return [0 if b == 0 else -(-b // m) for b, m in zip(batch_sizes, micro_batch_sizes,
                                                         strict=True)]


def predicted_compute_seconds(seconds_per_sample: Sequence[float | None],
                              batch_sizes: Sequence[int]) -> float:
    """The slowest rank's predicted compute, max_i t_i · b_i (ranks without a figure hold no
    samples and count 0)."""
    return max((t * b for t, b in zip(seconds_per_sample, batch_sizes, strict=True)
                if t is not None and b > 0), default=0.0)


def best_split(seconds_per_sample: Sequence[float | None], global_batch_size: int,
               max_samples: Sequence[int], min_samples: Sequence[int] | None = None
               ) -> list[int]:
    """The integer split b (Σ b_i = B, min_i ≤ b_i ≤ max_i) minimising max_i t_i · b_i.

    Ranks whose t_i is None take no samples (their min must be 0). Water-filling: every rank
    starts at its minimum, then each remaining sample goes to the rank whose compute would
    be the smallest with it (ties to the lower rank, so the split is the same on every rank).
    The k-th sample placed this way costs the k-th smallest of all "next sample" costs, and
    those costs grow along each rank, so the largest placed one is the least possible
    maximum. Raises ValueError when the bounds cannot hold B."""
    n = len(seconds_per_sample)
    low = list(min_samples) if min_samples is not None else [0] * n
    if len(max_samples) != n or len(low) != n:
        raise ValueError(f"need one bound per rank ({n}), got {len(max_samples)} maxima and "
                         f"{len(low)} minima")
    for i, (t, lo, hi) in enumerate(zip(seconds_per_sample, low, max_samples, strict=True)):
        if t is None and lo > 0:
            raise ValueError(f"rank {i} has no measured time but a minimum of {lo} samples")
        if t is not None and not (t > 0 and math.isfinite(t)):
            raise ValueError(f"rank {i}: seconds per sample must be > 0 and finite, got {t}")
        if lo < 0 or hi < lo:
            raise ValueError(f"rank {i}: bounds [{lo}, {hi}] are not a range of sample counts")
    caps = [0 if t is None else hi for t, hi in zip(seconds_per_sample, max_samples,
                                                    strict=True)]
    if sum(low) > global_batch_size or sum(caps) < global_batch_size:
        raise ValueError(f"no split of {global_batch_size} samples fits the bounds "
                         f"(minima sum to {sum(low)}, maxima to {sum(caps)})")
    split = list(low)
    left = global_batch_size - sum(low)
    # Jump close to the end first (a global batch of thousands need not go one by one): the
    # continuous optimum's level, rounded down per rank, never exceeds the integer optimum's
    # per-rank counts, so water-filling from there gives the same maximum.
    rates = [(i, t) for i, t in enumerate(seconds_per_sample) if t is not None and caps[i] > 0]
    level = left / sum(1.0 / t for _, t in rates) if rates else 0.0
    for i, t in rates:
        take = min(caps[i], max(split[i], math.floor(level / t))) - split[i]
        take = max(0, min(take, left))
        split[i] += take
        left -= take
    heap = [((split[i] + 1) * t, i) for i, t in rates if split[i] < caps[i]]
    heapq.heapify(heap)
    while left > 0:
        _, i = heapq.heappop(heap)
        split[i] += 1
        left -= 1
        t = seconds_per_sample[i]
        assert t is not None
        if split[i] < caps[i]:
            heapq.heappush(heap, ((split[i] + 1) * t, i))
    return split


class Rebalancer:
    """One job's live split: `observe` every step's per-rank compute seconds, `decide` at a
    step boundary. Deterministic: the same calls give the same decisions on every rank."""

    def __init__(self, batch_sizes: Sequence[int], micro_batch_sizes: Sequence[int], *,
                 interval_steps: int, min_gain: float, smoothing: float = SMOOTHING) -> None:
        if len(batch_sizes) != len(micro_batch_sizes):
            raise ValueError("need one batch size and one microbatch size per rank")
        if interval_steps < 1 or min_gain < 0 or not 0 < smoothing <= 1:
            raise ValueError(f"interval_steps >= 1, min_gain >= 0, 0 < smoothing <= 1; got "
                             f"{interval_steps}, {min_gain}, {smoothing}")
        for i, (b, m) in enumerate(zip(batch_sizes, micro_batch_sizes, strict=True)):
            if b > 0 and m < 1:
                raise ValueError(f"rank {i} has {b} samples but microbatch size {m}")
        self.batch_sizes = list(batch_sizes)
        self.micro_batch_sizes = list(micro_batch_sizes)
        self.interval_steps = interval_steps
        self.min_gain = min_gain
        self.smoothing = smoothing
        # Smoothed compute seconds per sample (None: never measured with samples).
        self.seconds_per_sample: list[float | None] = [None] * len(batch_sizes)
        self._observed = 0  # steps observed under the split in force
        # The slowest working rank's compute seconds under the split in force, smoothed as
        # the per-sample figures are; and the split last left with its own (hysteresis).
        self.slowest_seconds: float | None = None
        self._left: tuple[tuple[int, ...], float] | None = None
        self.history: list[Decision] = []
        # Set by each decision that memory kept short of the split wanted; None otherwise.
        self.held: Hold | None = None

    @property
    def global_batch_size(self) -> int:
        return sum(self.batch_sizes)

    def observe(self, rank_compute_seconds: Sequence[float]) -> None:
        """One step's compute seconds per rank, run under the split in force. A rank without
        samples keeps its last figure (it measured nothing per sample)."""
        if len(rank_compute_seconds) != len(self.batch_sizes):
            raise ValueError(f"need {len(self.batch_sizes)} ranks' seconds, got "
                             f"{len(rank_compute_seconds)}")
        slowest = max((s for s, b in zip(rank_compute_seconds, self.batch_sizes, strict=True)
                       if b > 0 and s > 0 and math.isfinite(s)), default=None)
        if slowest is not None:
            before_slowest = self.slowest_seconds
            self.slowest_seconds = slowest if before_slowest is None or self._observed == 0 \
                else self.smoothing * slowest + (1 - self.smoothing) * before_slowest
        for i, (seconds, samples) in enumerate(zip(rank_compute_seconds, self.batch_sizes,
                                                   strict=True)):
            if samples == 0 or not (seconds > 0 and math.isfinite(seconds)):
                continue
            now = seconds / samples
            before = self.seconds_per_sample[i]
            # The first step under a split sets the figure: a previous split's steps would
            # carry its fixed costs spread over other batch sizes.
            self.seconds_per_sample[i] = now if before is None or self._observed == 0 else \
                self.smoothing * now + (1 - self.smoothing) * before
        self._observed += 1

    def decide(self, step: int, max_samples: Sequence[int]) -> Decision | None:
        """At the end of step `step` (1-based): a new split when it is due (a multiple of
        the interval, with a step measured under the split in force) and its predicted gain
        reaches the minimum; None otherwise. `max_samples`: per rank, the most samples its
        memory holds (the split in force is assumed to fit). Ranks keep at least one sample
        so that they stay measured; a rank without samples or a measurement keeps none."""
        if step % self.interval_steps or self._observed == 0:
            return None
        # A state-only rank of the plan (microbatch size 0) never takes samples.
        times = [t if m > 0 else None
                 for t, m in zip(self.seconds_per_sample, self.micro_batch_sizes, strict=True)]
        if any(t is None for t, b in zip(times, self.batch_sizes, strict=True) if b > 0):
            return None  # a working rank without a figure: nothing to decide on
        low = [1 if b > 0 else 0 for b in self.batch_sizes]
        caps = [max(b, hi) if t is not None else 0
                for t, b, hi in zip(times, self.batch_sizes, max_samples, strict=True)]
        new = best_split(times, self.global_batch_size, caps, low)
        before = predicted_compute_seconds(times, self.batch_sizes)
        after = predicted_compute_seconds(times, new)
        gain = before / after - 1 if after > 0 else 0.0
        moves = new != self.batch_sizes and gain >= self.min_gain and \
            not self._measured_worse(new)
        self.held = self._hold(step, times, low, caps, new if moves else self.batch_sizes)
        if not moves:
            return None
        decision = Decision(step=step, old_batch_sizes=tuple(self.batch_sizes),
                            new_batch_sizes=tuple(new), seconds_per_sample=tuple(times),
                            predicted_gain=gain, held=self.held)
        left = self.slowest_seconds
        self.adopt(new)
        if left is not None:
            self._left = (decision.old_batch_sizes, left)
        self.history.append(decision)
        return decision

    def _hold(self, step: int, times: Sequence[float | None], low: Sequence[int],
              caps: Sequence[int], kept: Sequence[int]) -> Hold | None:
        """Why the split `kept` (in force after this decision) stays short of the one the
        figures want without memory bounds, when the difference is worth a move (at least
        `min_gain`); None when memory costs less than that."""
        unbounded = [0 if t is None else self.global_batch_size for t in times]
        wanted = best_split(times, self.global_batch_size, unbounded, low)
        short = predicted_compute_seconds(times, kept) / \
            max(predicted_compute_seconds(times, wanted), 1e-300) - 1
        if short < self.min_gain:
            return None
        bound = [f"rank {i} would need {w} samples, its memory holds {max(c, k)} at "
                 f"microbatch {m}"
                 for i, (w, c, k, m) in enumerate(zip(wanted, caps, kept,
                                                      self.micro_batch_sizes, strict=True))
                 if w > max(c, k)]
        if not bound:  # short for another reason (hysteresis), not memory
            return None
        return Hold(step=step, kept_batch_sizes=tuple(kept), wanted_batch_sizes=tuple(wanted),
                    reason=f"split {list(kept)} kept short of {wanted} after step {step}: "
                           + "; ".join(bound))

    def _measured_worse(self, new: Sequence[int]) -> bool:
        """`new` is the split just left, and the split in force measures no `min_gain`
        slower than it did: going back would undo a move its measurements confirmed."""
        if self._left is None or tuple(new) != self._left[0] or self.slowest_seconds is None:
            return False
        return self.slowest_seconds < self._left[1] * (1 + self.min_gain)

    def adopt(self, batch_sizes: Sequence[int]) -> None:
        """Run under `batch_sizes` from now (a decision, or a checkpoint's split on resume):
        the smoothing starts afresh on its steps."""
        if len(batch_sizes) != len(self.batch_sizes) or \
                sum(batch_sizes) != self.global_batch_size:
            raise ValueError(f"split {list(batch_sizes)} is not one of {self.global_batch_size} "
                             f"samples over {len(self.batch_sizes)} ranks")
        self.batch_sizes = list(batch_sizes)
        self._observed = 0
        self._left = None  # a resumed split has no move to undo (decide sets it after a move)
