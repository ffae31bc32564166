"""The Plan's replica groups (hybrid sharding): what the contract admits and refuses."""

from __future__ import annotations

import pytest

from cephalo.api.plan import Plan, PlanError, parse_plan


def _plan(ratios: list[float], groups: list[list[int]]) -> dict:
    return {"global_batch_size": 4 * len(ratios), "world_size": len(ratios),
            "replica_groups": groups,
            "ranks": [{"rank": i, "batch_size": 4, "micro_batch_size": 2,
                       "num_micro_batches": 2, "shard_ratio": r}
                      for i, r in enumerate(ratios)]}


def test_two_groups_with_matching_positions_are_admitted_and_round_trip() -> None:
    plan = parse_plan(_plan([0.7, 0.3, 0.7, 0.3], [[0, 1], [2, 3]]))
    assert plan.replica_groups == [[0, 1], [2, 3]]
    again = Plan.model_validate_json(plan.to_json())
    assert again.replica_groups == [[0, 1], [2, 3]]


def test_a_flat_plan_serialises_without_the_field() -> None:
    flat = parse_plan(_plan([0.5, 0.5], []))
    assert "replica_groups" not in flat.to_json()


@pytest.mark.parametrize(("ratios", "groups", "says"), [
    ([0.7, 0.3, 0.7, 0.3], [[0, 1], [2]], "every rank 0..3 exactly once"),
    ([0.7, 0.3, 0.7, 0.3], [[0, 1], [1, 2, 3]], "every rank 0..3 exactly once"),
    ([0.5, 0.3, 0.2, 1.0], [[0, 1, 2], [3]], "same number of ranks"),
    ([0.25, 0.25, 0.25, 0.25], [[0, 1], [2, 3]], "sum to"),  # flat ratios: a group holds half
    ([0.7, 0.3, 0.3, 0.7], [[0, 1], [2, 3]], "same position"),
])
def test_groups_that_break_the_contract_are_refused(ratios: list[float],
                                                   groups: list[list[int]], says: str) -> None:
    with pytest.raises(PlanError, match=says):
        parse_plan(_plan(ratios, groups))


def test_a_replicated_fraction_round_trips_reaches_the_engine_and_needs_two_groups() -> None:
    from cephalo.trainer.env import layout_from_plan

    plan = parse_plan({**_plan([0.7, 0.3, 0.7, 0.3], [[0, 1], [2, 3]]),
                       "replicated_fraction": 0.25})
    again = Plan.model_validate_json(plan.to_json())
    assert again.replicated_fraction == 0.25
    assert layout_from_plan(again).replicated_fraction == 0.25
    assert layout_from_plan(parse_plan(_plan([0.5, 0.5], []))).replicated_fraction == 0.0
    assert "replicated_fraction" not in parse_plan(_plan([0.5, 0.5], [])).to_json()
    with pytest.raises(PlanError, match="needs two or more replica_groups"):
        parse_plan({**_plan([1.0, 1.0], [[0, 1]]), "replicated_fraction": 0.5})
    with pytest.raises(PlanError, match="replicated_fraction"):
        parse_plan({**_plan([0.7, 0.3, 0.7, 0.3], [[0, 1], [2, 3]]),
                    "replicated_fraction": 1.5})
