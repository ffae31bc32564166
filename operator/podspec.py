"""Merge a job's `spec.podTemplate` into a rendered rank or profiler pod, and group a
plan's ranks into pods (several GPUs of a node per pod); pure.

The operator's fields win where they must: its labels and annotations, the trainer's
environment contract, its volumes and mounts, the GPU resource, the nodeSelector and the
security context. Collisions that would silently lose the team's setting (an env var named
like a contract variable, a volume named like one of the operator's) are refused when the
job is parsed (cephalo.api.podtemplate); what is left here is additive.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from itertools import groupby
from typing import Any

from cephalo.api import Plan
from cephalo.api.plan import RankPlan
from cephalo.api.podtemplate import PodTemplate


def _wire(items: list[Any] | None) -> list[dict[str, Any]]:
    return [i.model_dump(by_alias=True, exclude_none=True, mode="json")
            if hasattr(i, "model_dump") else copy.deepcopy(i) for i in items or []]


def apply_pod_template(pod: dict[str, Any], template: PodTemplate | None) -> dict[str, Any]:
    """`pod` with the template's additions (a new dict; `pod` itself is left untouched)."""
    if template is None:
        return pod
    pod = copy.deepcopy(pod)
    meta, spec = pod["metadata"], pod["spec"]
    (container,) = spec["containers"]
    if template.labels:
        meta["labels"] = {**template.labels, **meta.get("labels", {})}
    if template.annotations:
        meta["annotations"] = {**template.annotations, **meta.get("annotations", {})}
    if template.env:
        container["env"] = [*container.get("env", []), *_wire(template.env)]
    if template.env_from:
        # Explicit env entries take precedence over envFrom in Kubernetes, so a Secret key
        # that happens to be named RANK cannot override the contract.
        container["envFrom"] = _wire(template.env_from)
    if template.volumes:
        spec["volumes"] = [*spec.get("volumes", []), *_wire(template.volumes)]
    if template.volume_mounts:
        container["volumeMounts"] = [*container.get("volumeMounts", []),
                                     *_wire(template.volume_mounts)]
    if template.tolerations:
        spec["tolerations"] = [*spec.get("tolerations", []), *_wire(template.tolerations)]
    if template.image_pull_secrets:
        spec["imagePullSecrets"] = _wire(template.image_pull_secrets)
    if template.affinity:
        spec["affinity"] = copy.deepcopy(template.affinity)
    if template.priority_class_name:
        spec["priorityClassName"] = template.priority_class_name
    if template.service_account_name:
        # Opt-in identity for cloud workload identity (IRSA, GKE); the Kubernetes API token
        # stays unmounted (automountServiceAccountToken: false): trainers never call the API.
        spec["serviceAccountName"] = template.service_account_name
    if template.resources:
        resources = container.setdefault("resources", {})
        for kind in ("requests", "limits"):
            extra = getattr(template.resources, kind)
            if extra:
                # The GPU count is the plan's (one a rank, k for a pod of k ranks): the
                # operator's values win.
                resources[kind] = {**extra, **resources.get(kind, {})}
    return pod


# Several GPUs per pod (issue 12): the plan records how its ranks are grouped into pods, as
# the number of consecutive ranks each pod runs (rank order), under this key. It is part of
# the plan (hashed with it), so every pass renders the same pods; absent: one rank per pod.
POD_RANKS_KEY = "pod_ranks"


def pack_ranks(plan: Plan, node_free_gpus: Mapping[str, Sequence[int]],
               ranks_per_pod: int) -> list[int]:
    """Ranks per pod, in rank order: each run of consecutive ranks of one pool is packed into
    pods as large as the pool's nodes' free GPUs seen at planning (largest first), at most
    `ranks_per_pod` each (0: no cap). A pod of k ranks requests k GPUs and lands on a node
    that has them (the scheduler picks it, within the pool's nodeSelector)."""
    cap = ranks_per_pod if ranks_per_pod > 0 else max(1, plan.world_size)
    left = {pool: list(free) for pool, free in node_free_gpus.items()}
    sizes: list[int] = []
    for pool, run in groupby(plan.ranks, key=lambda r: r.pool or r.gpu):
        sizes += pod_sizes(left.setdefault(pool, []), len(list(run)), cap)
    return sizes


def pod_sizes(free: list[int], ranks: int, cap: int) -> list[int]:
    """The pods `ranks` consecutive ranks of one pool get: each as large as the node with the
    most free GPUs left (`free`, taken from in place), at most `cap`. Also how discovery
    describes the nodes a plan's ranks sit on (`discovery.describe_nodes`)."""
    nodes = sorted((g for g in free if g > 0), reverse=True)
    sizes: list[int] = []
    remaining = ranks
    while remaining:
        # The node with the most free GPUs takes the next pod; none left (more ranks
        # than free GPUs seen, e.g. a plan from before): one rank per pod.
        take = min(remaining, cap, nodes[0] if nodes else 1)
        if nodes:
            nodes[0] -= take
            nodes.sort(reverse=True)
            while nodes and nodes[-1] <= 0:
                nodes.pop()
        sizes.append(take)
        remaining -= take
    free[:] = nodes
    return sizes


def with_pod_ranks(plan: Plan, sizes: Sequence[int]) -> Plan:
    """`plan` recording `sizes` (nothing recorded when every pod runs one rank: the plan and
    its hash stay what they were)."""
    grouped = any(size > 1 for size in sizes)
    return plan.model_copy(update={"pod_ranks": list(sizes) if grouped else []})


def pod_groups(plan: Plan) -> list[list[RankPlan]]:
    """The plan's ranks grouped into pods (consecutive ranks of one pool each); one rank per
    pod when the plan records no grouping, or one that does not fit its ranks."""
    singles = [[r] for r in plan.ranks]
    sizes = plan.pod_ranks
    if not sizes or not all(s >= 1 for s in sizes) or sum(sizes) != len(plan.ranks):
        return singles
    groups, start = [], 0
    for size in sizes:
        group = plan.ranks[start:start + size]
        if len({r.pool or r.gpu for r in group}) != 1:
            return singles  # a pod is on one node, so of one pool
        groups.append(group)
        start += size
    return groups


def pods_fit(plan: Plan, node_gpus: Mapping[str, Sequence[int]]) -> list[str]:
    """Pools whose nodes (`node_gpus`: GPUs per node of each pool) can no longer hold the
    plan's multi-rank pods, largest first onto the roomiest node; empty when they all fit
    (or the plan runs one rank a pod: `plan_fits` counts those). A pod of k ranks needs one
    node with k GPUs, so a pool of as many GPUs on smaller nodes would leave it Pending."""
    wanted: dict[str, list[int]] = {}
    for group in pod_groups(plan):
        if len(group) > 1:
            wanted.setdefault(group[0].pool or group[0].gpu, []).append(len(group))
    lost = []
    for pool, sizes in sorted(wanted.items()):
        room = sorted(node_gpus.get(pool, ()), reverse=True)
        for size in sorted(sizes, reverse=True):
            if not room or room[0] < size:
                lost.append(f"{pool}: a pod of {size} ranks fits on no node "
                            f"(GPUs per node {sorted(node_gpus.get(pool, ()), reverse=True)})")
                break
            room[0] -= size
            room.sort(reverse=True)
    return lost


# ---- default CPU and memory (issue 12: no BestEffort rank pods) --------------------------
# A rank process on the host: the CUDA torch runtime, NCCL, the data loader and the metrics
# server (~2-3 GiB resident for a CUDA torch process), plus the host copy of its training
# state that an asynchronous checkpoint uploads from: master weights and two Adam moments,
# 12 bytes per owned parameter (trainer/checkpoint.py).
PROCESS_HOST_BYTES = 3 * 1024**3
CHECKPOINT_HOST_BYTES_PER_STATE_BYTE = 12 / 16  # of the 16 bytes/parameter of GPU state
CPUS_PER_RANK = 2  # the training loop and the loader/checkpoint threads


def host_memory_bytes(plan_state_bytes: int | None, shard_ratios: list[float]) -> int:
    """Host memory a pod of ranks with these shards needs: per rank the process, plus its
    share of the checkpoint snapshot when the plan says how big the state is."""
    snapshot = (plan_state_bytes or 0) * CHECKPOINT_HOST_BYTES_PER_STATE_BYTE
    return int(sum(PROCESS_HOST_BYTES + snapshot * ratio for ratio in shard_ratios))


def apply_default_resources(pod: dict[str, Any], memory_bytes: int, cpus: int) -> dict[str, Any]:
    """Requests for CPU and memory (Burstable QoS) where the pod template set neither a
    request nor a limit: a pod without them is BestEffort, the first the kubelet evicts
    under memory pressure. No default limits: a brief spike must not OOM-kill a rank."""
    for container in pod["spec"]["containers"]:
        resources = container.setdefault("resources", {})
        requests = resources.setdefault("requests", {})
        limits = resources.get("limits", {})
        memory_mib = -(-memory_bytes // 2**20)  # rounded up, in the unit people read
        for name, value in (("cpu", str(cpus)), ("memory", f"{memory_mib}Mi")):
            # a limit alone: Kubernetes makes it the request too; leave it so
            if name not in requests and name not in limits:
                requests[name] = value
    return pod
