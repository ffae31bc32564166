"""The placement a plan assumes, requested from Kueue's topology-aware scheduling (issue 44
item 4; pure: the rank pods' annotations from the plan).

The planner prices every hop between nodes at the NICs it was given, as if the job's nodes
shared one switch, and a hybrid plan's replica group (docs/hybrid-sharding.md) gathers and
reduce-scatters every unit inside the group while the groups meet once a step. So, for a
job queued through Kueue when the chart names a level of the cluster's Kueue Topology
(`placement.kueueTopologyLevel`, a node label such as `network.topology.nvidia.com/leaf`
or `topology.kubernetes.io/zone`), every rank pod carries:

* `kueue.x-k8s.io/podset-preferred-topology: <level>`: the gang as close as Kueue can
  place it (one domain of that level if it fits), for flat and hybrid plans alike;
* when a replica group spans several pods: `kueue.x-k8s.io/podset-slice-required-topology:
  <level>` and `kueue.x-k8s.io/podset-slice-size: <pods per group>`, each slice of that
  many pods within one domain (a group on one node, the common case, needs no slice: a pod
  is on one node already).

The annotation names are Kueue v0.17's (the version the project's tests run). Kueue reads
them per PodSet; every rank pod of the job gets the same ones, so they agree whatever
PodSets Kueue forms from the pods.
"""

from __future__ import annotations

from cephalo.api import Plan
from cephalo.operator.podspec import pod_groups

KUEUE_PREFERRED_TOPOLOGY = "kueue.x-k8s.io/podset-preferred-topology"
KUEUE_SLICE_REQUIRED_TOPOLOGY = "kueue.x-k8s.io/podset-slice-required-topology"
KUEUE_SLICE_SIZE = "kueue.x-k8s.io/podset-slice-size"


def pods_per_replica_group(plan: Plan) -> int | None:
    """How many pods each replica group of a hybrid plan spans, when every group is made of
    whole pods and all span the same number; None for a flat plan or groups that share a
    pod (a slice of pods cannot then be one group)."""
    if not plan.replica_groups:
        return None
    group_of = {rank: i for i, group in enumerate(plan.replica_groups) for rank in group}
    pods_of_group: dict[int, int] = {}
    for pod in pod_groups(plan):
        groups = {group_of[r.rank] for r in pod}
        if len(groups) != 1:
            return None
        (group,) = groups
        pods_of_group[group] = pods_of_group.get(group, 0) + 1
    counts = set(pods_of_group.values())
    return counts.pop() if len(counts) == 1 else None


def kueue_topology_annotations(plan: Plan, level: str) -> dict[str, str]:
    """The rank pods' Kueue topology requests at `level` ("" : none)."""
    if not level:
        return {}
    annotations = {KUEUE_PREFERRED_TOPOLOGY: level}
    pods = pods_per_replica_group(plan)
    if pods is not None and pods > 1:
        annotations[KUEUE_SLICE_REQUIRED_TOPOLOGY] = level
        annotations[KUEUE_SLICE_SIZE] = str(pods)
    return annotations
