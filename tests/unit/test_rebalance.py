"""Live rebalancing's pure core (cephalo.planner.feedback.rebalance): the exact split against a
brute force, the damping (interval, minimum gain, smoothing) and the bounds it keeps."""

from __future__ import annotations

import heapq
import itertools
import random

import pytest

from cephalo.planner.feedback.rebalance import (
    Rebalancer,
    best_split,
    micro_batch_counts,
    predicted_compute_seconds,
)


def _brute_force(times: list[float | None], total: int, caps: list[int], low: list[int]
                 ) -> float:
    """The least max_i t_i·b_i over every integer split within the bounds."""
    ranges = [range(lo, (0 if t is None else hi) + 1)
              for t, lo, hi in zip(times, low, caps, strict=True)]
    best = float("inf")
    for split in itertools.product(*ranges):
        if sum(split) == total:
            best = min(best, predicted_compute_seconds(times, list(split)))
    return best


def _one_by_one(times: list[float], total: int, caps: list[int], low: list[int]) -> list[int]:
    """Water-filling without the jump: every sample placed by the heap."""
    split = list(low)
    heap = [((split[i] + 1) * t, i) for i, t in enumerate(times) if split[i] < caps[i]]
    heapq.heapify(heap)
    for _ in range(total - sum(low)):
        _, i = heapq.heappop(heap)
        split[i] += 1
        if split[i] < caps[i]:
            heapq.heappush(heap, ((split[i] + 1) * times[i], i))
    return split


def test_best_split_matches_brute_force_on_small_instances() -> None:
    rng = random.Random(45)
    checked = 0
    for _ in range(400):
        n = rng.randint(1, 4)
        times: list[float | None] = [rng.choice([0.5, 1.0, 1.5, 3.0, rng.uniform(0.1, 5)])
                                     for _ in range(n)]
        if n > 1 and rng.random() < 0.2:
            times[rng.randrange(n)] = None  # a state-only rank
        low = [0 if t is None else rng.randint(0, 1) for t in times]
        caps = [lo + rng.randint(0, 6) for lo in low]
        total = rng.randint(1, 12)
        room = sum(c for t, c in zip(times, caps, strict=True) if t is not None)
        feasible = sum(low) <= total <= room
        if not feasible:
            with pytest.raises(ValueError, match="no split of"):
                best_split(times, total, caps, low)
            continue
        split = best_split(times, total, caps, low)
        assert sum(split) == total
        assert all(lo <= b <= (0 if t is None else hi)
                   for b, t, lo, hi in zip(split, times, low, caps, strict=True))
        assert predicted_compute_seconds(times, split) == pytest.approx(
            _brute_force(times, total, caps, low), rel=1e-12)
        checked += 1
    assert checked > 200  # most instances were feasible and compared


def test_best_split_jump_gives_the_same_maximum_as_water_filling_one_by_one() -> None:
    rng = random.Random(7)
    for _ in range(50):
        n = rng.randint(2, 8)
        times = [rng.uniform(0.01, 1.0) for _ in range(n)]
        caps = [rng.randint(100, 5000) for _ in range(n)]
        low = [1] * n
        total = rng.randint(n, sum(caps))
        fast = best_split(times, total, caps, low)
        slow = _one_by_one(times, total, caps, low)
        assert sum(fast) == total
        assert predicted_compute_seconds(times, fast) == pytest.approx(
            predicted_compute_seconds(times, slow), rel=1e-12)


def test_best_split_moves_samples_to_the_faster_rank_within_memory() -> None:
    # Rank 1 is 3x slower per sample: it should hold a quarter of the batch...
    assert best_split([1.0, 3.0], 40, [40, 40]) == [30, 10]
    # ...unless rank 0's memory holds no more than 25 samples.
    assert best_split([1.0, 3.0], 40, [25, 40]) == [25, 15]


def test_best_split_refuses_bad_bounds() -> None:
    with pytest.raises(ValueError, match="no measured time but a minimum"):
        best_split([1.0, None], 4, [4, 4], [0, 1])
    with pytest.raises(ValueError, match="must be > 0"):
        best_split([0.0, 1.0], 4, [4, 4])
    with pytest.raises(ValueError, match="not a range"):
        best_split([1.0, 1.0], 4, [4, 4], [5, 0])


def test_micro_batch_counts_round_up_for_a_smaller_last_microbatch() -> None:
    assert micro_batch_counts([30, 10, 0], [8, 4, 0]) == [4, 3, 0]


def _rebalancer(**kwargs: float) -> Rebalancer:
    settings = {"interval_steps": 4, "min_gain": 0.05, **kwargs}
    return Rebalancer([32, 32], [4, 4], **settings)  # type: ignore[arg-type]


def test_a_slowed_rank_loses_samples_at_the_next_interval() -> None:
    bal = _rebalancer()
    for step in range(1, 4):
        bal.observe([3.2, 3.2])  # 0.1 s per sample on both
        assert bal.decide(step, [64, 64]) is None
    bal.observe([3.2, 9.6])  # rank 1 now takes 3x as long
    decision = bal.decide(4, [64, 64])
    assert decision is not None and decision.step == 4
    assert decision.old_batch_sizes == (32, 32)
    new = decision.new_batch_sizes
    assert sum(new) == 64 and new[1] < 32
    assert bal.batch_sizes == list(new) and bal.history == [decision]
    assert decision.predicted_gain >= 0.05
    assert "split [32, 32] -> " in decision.describe()


def test_decisions_only_every_interval_and_after_a_measured_step() -> None:
    bal = _rebalancer()
    assert bal.decide(4, [64, 64]) is None  # nothing measured yet
    bal.observe([3.2, 9.6])
    for step in (1, 2, 3, 5, 6, 7):
        assert bal.decide(step, [64, 64]) is None
    assert bal.decide(8, [64, 64]) is not None
    # A new split starts its measurements afresh: the next interval needs its own step.
    assert bal.decide(12, [64, 64]) is None


def test_noise_within_the_minimum_gain_keeps_the_split() -> None:
    """Per-sample times that wander ±2 % around a balanced split never predict a 5 % gain:
    at most (1.02 / 0.98) - 1 ≈ 4.1 % over the optimum for the true times."""
    rng = random.Random(3)
    true = [0.1, 0.3]
    split = best_split(true, 64, [64, 64], [1, 1])
    bal = Rebalancer(split, [4, 4], interval_steps=1, min_gain=0.05, smoothing=1.0)
    for step in range(1, 500):
        noisy = [t * b * rng.uniform(0.98, 1.02) for t, b in zip(true, split, strict=True)]
        bal.observe(noisy)
        assert bal.decide(step, [64, 64]) is None
    assert bal.batch_sizes == split
    # The same noise with no minimum gain does move it (the check above is not vacuous).
    eager = Rebalancer(split, [4, 4], interval_steps=1, min_gain=0.0, smoothing=1.0)
    moved = False
    for step in range(1, 200):
        eager.observe([t * b * rng.uniform(0.98, 1.02)
                       for t, b in zip(true, eager.batch_sizes, strict=True)])
        moved = moved or eager.decide(step, [64, 64]) is not None
    assert moved


def test_smoothing_damps_a_single_slow_step() -> None:
    bal = _rebalancer(min_gain=0.2, smoothing=1 / 3)
    for _ in range(3):
        bal.observe([3.2, 3.2])
    bal.observe([3.2, 4.8])  # one step 1.5x slower: smoothed to ~1.17x, gain < 20 %
    assert bal.decide(4, [64, 64]) is None


def test_every_working_rank_keeps_a_sample_and_a_state_only_rank_none() -> None:
    bal = Rebalancer([6, 2, 0], [2, 1, 0], interval_steps=1, min_gain=0.0)
    bal.observe([0.6, 200.0, 0.05])  # rank 1 is 1000x slower per sample; rank 2 holds state
    decision = bal.decide(1, [8, 8, 8])
    assert decision is not None and decision.new_batch_sizes == (7, 1, 0)
    assert decision.seconds_per_sample[2] is None


def test_the_memory_bound_caps_a_fast_rank_but_never_its_current_batch() -> None:
    bal = _rebalancer(interval_steps=1)
    bal.observe([3.2, 9.6])
    decision = bal.decide(1, [40, 64])
    assert decision is not None and decision.new_batch_sizes == (40, 24)
    # A bound below the split in force (e.g. figures that moved) does not force samples off.
    bal2 = _rebalancer(interval_steps=1)
    bal2.observe([3.2, 9.6])
    decision2 = bal2.decide(1, [10, 64])
    assert decision2 is None


def test_a_split_memory_forbids_stays_and_says_why() -> None:
    bal = _rebalancer(interval_steps=1)
    bal.observe([3.2, 9.6])  # 0.1 and 0.3 s per sample: the balance is [48, 16]
    assert bal.decide(1, [32, 64]) is None  # rank 0's memory holds no more than it has
    assert bal.held is not None and bal.held.step == 1
    assert bal.held.wanted_batch_sizes == (48, 16)
    assert bal.held.reason == ("split [32, 32] kept short of [48, 16] after step 1: rank 0 "
                               "would need 48 samples, its memory holds 32 at microbatch 4")
    # Memory binds part of the way: the move goes as far as it can and says where it stopped.
    bal.observe([3.2, 9.6])
    decision = bal.decide(2, [40, 64])
    assert decision is not None and decision.new_batch_sizes == (40, 24)
    assert decision.held == bal.held and bal.held is not None
    assert "rank 0 would need 48 samples, its memory holds 40 at microbatch 4" in \
        decision.describe()
    # Once nothing binds, nothing is held.
    bal.observe([4.0, 7.2])
    bal.decide(3, [64, 64])
    assert bal.held is None


def test_memory_that_costs_less_than_the_minimum_gain_is_not_a_hold() -> None:
    bal = _rebalancer(interval_steps=1)
    bal.observe([3.2, 3.36])  # [32, 32] is within 5 % of the balance
    assert bal.decide(1, [32, 64]) is None and bal.held is None


def test_adopt_refuses_another_global_batch() -> None:
    with pytest.raises(ValueError, match="is not one of 64 samples"):
        _rebalancer().adopt([30, 30])


def test_a_move_back_to_a_split_measured_slower_is_not_made() -> None:
    """Found on the emulator (test_operator_prometheus, a tiny CPU job whose steps are mostly
    fixed work): [1, 7] -> [2, 6] -> [1, 7] -> ... every interval. Each rank's compute, as
    measured there (seconds, by batch), is not linear in its samples, so the per-sample model
    of the split in force keeps predicting the other split >5 % faster. [2, 6] measured 9.1
    ms at its slowest rank against 12.5 at [1, 7]: going back is a loss that was measured,
    and the split stays."""
    compute = [{1: 5.14e-3, 2: 9.1e-3}, {6: 7.0e-3, 7: 12.5e-3}]  # rank -> batch -> seconds
    bal = Rebalancer([1, 7], [1, 1], interval_steps=2, min_gain=0.05, smoothing=1.0)
    splits = []
    for step in range(1, 41):
        bal.observe([compute[r][b] for r, b in enumerate(bal.batch_sizes)])
        bal.decide(step, [8, 8])
        splits.append(tuple(bal.batch_sizes))
    assert splits[1] == (2, 6)  # the first move, which the measurements then confirm
    assert set(splits[1:]) == {(2, 6)}, splits
    assert len(bal.history) == 1


def test_a_split_left_long_ago_may_be_taken_again_when_the_ranks_changed() -> None:
    """The memory blocks only a move back to the split just left, and only while the split
    in force measures better than that one did: once a rank slows, the move is made."""
    bal = Rebalancer([1, 7], [1, 1], interval_steps=2, min_gain=0.05, smoothing=1.0)
    compute = [{1: 5.14e-3, 2: 9.1e-3}, {6: 7.0e-3, 7: 12.5e-3}]
    for step in range(1, 5):
        bal.observe([compute[r][b] for r, b in enumerate(bal.batch_sizes)])
        bal.decide(step, [8, 8])
    assert bal.batch_sizes == [2, 6]
    # Rank 0 now computes 3x slower: [2, 6] measures 27.3 ms, worse than [1, 7]'s 12.5.
    bal.observe([3 * 9.1e-3, 7.0e-3])
    decision = bal.decide(6, [8, 8])
    assert decision is not None and decision.new_batch_sizes == (1, 7)
