"""The placement a plan assumes, requested from Kueue's topology-aware scheduling (issue 44
item 4, pure): the rank pods' annotations (names as Kueue v0.17 reads them), validated pods,
and the setting's checks."""

from __future__ import annotations

import pytest
from kube_fixtures import job_body
from test_operator_render import UID, _validate

from cephalo.api import Plan, parse_job
from cephalo.operator.config import OperatorConfig
from cephalo.operator.placement import (
    KUEUE_PREFERRED_TOPOLOGY,
    KUEUE_SLICE_REQUIRED_TOPOLOGY,
    KUEUE_SLICE_SIZE,
    pods_per_replica_group,
)
from cephalo.operator.render import render

LEAF = "network.topology.nvidia.com/leaf"
TAS = OperatorConfig(kueue_topology_level=LEAF)


def _plan(groups: list[list[int]], pod_ranks: list[int]) -> Plan:
    """Four A10G ranks of two GPUs a node, in pods of `pod_ranks`."""
    ratio = 1 / len(groups[0]) if groups else 0.25
    return Plan.model_validate({
        "global_batch_size": 16, "world_size": 4, "replica_groups": groups,
        "pod_ranks": pod_ranks,
        "ranks": [{"rank": i, "gpu": "A10G", "pool": "NVIDIA-A10G", "batch_size": 4,
                   "micro_batch_size": 4, "num_micro_batches": 1, "shard_ratio": ratio}
                  for i in range(4)]})


def _rank_pods(plan: Plan, queued: bool = True, config: OperatorConfig = TAS) -> list[dict]:
    body = job_body("gpt", uid=UID)
    if queued:
        body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    pods = render(parse_job(body), plan, config)[2:]
    _validate(pods)
    return pods


def _topology(pod: dict) -> dict[str, str]:
    return {k: v for k, v in pod["metadata"].get("annotations", {}).items()
            if "topology" in k or k == KUEUE_SLICE_SIZE}


def test_a_group_a_node_asks_kueue_for_the_gang_close_and_nothing_per_group() -> None:
    """Hybrid, a replica group per two-GPU pod (one node): a pod is on one node already."""
    pods = _rank_pods(_plan([[0, 1], [2, 3]], [2, 2]))
    assert [_topology(p) for p in pods] == [{KUEUE_PREFERRED_TOPOLOGY: LEAF}] * 2


def test_a_group_of_several_pods_asks_for_each_group_in_one_domain() -> None:
    """Hybrid, a replica group of two one-rank pods: a slice of 2 pods per leaf switch."""
    plan = _plan([[0, 1], [2, 3]], [])
    assert pods_per_replica_group(plan) == 2
    assert [_topology(p) for p in _rank_pods(plan)] == [{
        KUEUE_PREFERRED_TOPOLOGY: LEAF, KUEUE_SLICE_REQUIRED_TOPOLOGY: LEAF,
        KUEUE_SLICE_SIZE: "2"}] * 4


def test_flat_plans_unqueued_jobs_and_no_level_ask_for_no_slices() -> None:
    flat = _plan([], [2, 2])
    assert pods_per_replica_group(flat) is None
    assert [_topology(p) for p in _rank_pods(flat)] == [{KUEUE_PREFERRED_TOPOLOGY: LEAF}] * 2
    assert [_topology(p) for p in _rank_pods(flat, queued=False)] == [{}, {}]
    assert [_topology(p) for p in _rank_pods(_plan([[0, 1], [2, 3]], []),
                                              config=OperatorConfig())] == [{}] * 4


def test_groups_that_share_a_pod_are_not_sliced() -> None:
    """Groups of one rank in pods of two: a slice of pods cannot be one group."""
    plan = _plan([[0], [1], [2], [3]], [2, 2])
    assert pods_per_replica_group(plan) is None
    assert [_topology(p) for p in _rank_pods(plan)] == [{KUEUE_PREFERRED_TOPOLOGY: LEAF}] * 2


@pytest.mark.parametrize("level", ["topology.kubernetes.io/zone", LEAF, "kubernetes.io/hostname"])
def test_the_level_is_a_label_key(level: str) -> None:
    assert OperatorConfig.from_env({"CEPHALO_KUEUE_TOPOLOGY_LEVEL": level}) \
        .kueue_topology_level == level


@pytest.mark.parametrize("level", ["zone=a", "/leaf", "network.topology.nvidia.com/", "a b"])
def test_a_level_that_is_no_label_key_is_refused_at_startup(level: str) -> None:
    with pytest.raises(ValueError, match=r"CEPHALO_KUEUE_TOPOLOGY_LEVEL=.*node label key"):
        OperatorConfig.from_env({"CEPHALO_KUEUE_TOPOLOGY_LEVEL": level})
