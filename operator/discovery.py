"""GPU discovery: Kubernetes Node dicts → pools → the ClusterSpec a plan is solved for (pure).

A pool is the set of schedulable, Ready nodes that carry one value of the GPU Feature
Discovery label `nvidia.com/gpu.product`. GPUs per node come from the node's allocatable
`nvidia.com/gpu` (what the scheduler can actually hand out, not the label's count);
memory from `nvidia.com/gpu.memory` (MiB) or, without it, the catalog.

On a shared cluster a pool counts only *free* GPUs (`GpuUsage`, built by
`cephalo.operator.gpu_usage`): a node's allocatable minus what other pods bound to it request,
and a pool's total minus what other Cephalo jobs have planned there but not yet bound. A node
whose NoSchedule/NoExecute taints the job's pods do not tolerate is not used (Kubernetes
toleration matching, `tolerates`); PreferNoSchedule never excludes a node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cephalo.api import ClusterSpec, GpuGroup
from cephalo.api.cluster import ClusterNode
from cephalo.api.job import CephaloJobSpec
from cephalo.api.network import NIC_GBPS_LABEL
from cephalo.operator.locality import DEFAULT_LOCALITY_LABELS, by_domain, shared_domain
from cephalo.operator.podspec import pod_sizes
from cephalo.planner.cost.catalog import gpu_key, lookup_gpu, resolve_gpu, same_gpu

PRODUCT_LABEL = "nvidia.com/gpu.product"
MEMORY_LABEL = "nvidia.com/gpu.memory"
GPU_RESOURCE = "nvidia.com/gpu"
MIB = 1024 * 1024
# What every rendered GPU pod tolerates (render.gpu_pod): the taint GPU operators put on
# GPU nodes to keep CPU-only pods off them.
GPU_TOLERATION: dict[str, Any] = {"key": GPU_RESOURCE, "operator": "Exists",
                                  "effect": "NoSchedule"}
EXCLUDING_EFFECTS = ("NoSchedule", "NoExecute")  # PreferNoSchedule is only a preference


@dataclass(frozen=True)
class GpuUsage:
    """GPUs this job cannot have: requested per node by other pods bound there, and per pool
    (product label) planned by other Cephalo jobs but not yet bound to a node."""

    used_by_node: dict[str, int] = field(default_factory=dict)
    reserved_by_pool: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Pool:
    """GPUs of one product on usable nodes. `product` is the label value (pool name)."""

    product: str
    # The planner's and profiles' name: the catalog name, or for a product outside the
    # catalog its label (catalog.gpu_key), planned from its measured profile.
    catalog_name: str | None
    num_gpus: int
    memory_bytes: int | None
    nodes: tuple[str, ...]
    # Free GPUs per node (same order as `nodes`) before `reserved`; empty: all allocatable.
    node_gpus: tuple[int, ...] = ()
    reserved: int = 0  # planned here by other Cephalo jobs, not yet on a node


@dataclass
class Discovery:
    pools: list[Pool]
    # What was seen, for a condition message that lets a user fix the labels.
    num_nodes: int = 0
    unusable: list[str] = field(default_factory=list)  # "node: reason"
    unknown_products: list[str] = field(default_factory=list)


def _node_ready(node: dict[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _int(value: Any) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return 0


def tolerates(toleration: dict[str, Any], taint: dict[str, Any]) -> bool:
    """Kubernetes' toleration matching (k8s.io/api core/v1 Toleration.ToleratesTaint): an
    empty effect matches every effect, an empty key every key; `Exists` matches any value,
    `Equal` (the default) the same value."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    if key and key != taint.get("key"):
        return False
    if (toleration.get("operator") or "Equal") == "Exists":
        return True
    return (toleration.get("value") or "") == (taint.get("value") or "")


def job_tolerations(spec: CephaloJobSpec) -> list[dict[str, Any]]:
    """What the job's rank and profiler pods tolerate: the GPU taint, spec.podTemplate's."""
    extra = spec.pod_template.tolerations if spec.pod_template else None
    return [GPU_TOLERATION, *(t.model_dump(by_alias=True, exclude_none=True, mode="json")
                              for t in extra or [])]


def untolerated_taints(node: dict[str, Any], tolerations: Sequence[dict[str, Any]]) -> list[str]:
    """The node's NoSchedule/NoExecute taints no toleration matches ("key=value:effect")."""
    return [f"{t.get('key')}:{t.get('effect')}"
            for t in (node.get("spec") or {}).get("taints") or []
            if t.get("effect") in EXCLUDING_EFFECTS
            and not any(tolerates(tol, t) for tol in tolerations)]


def discover_pools(nodes: list[dict[str, Any]], usage: GpuUsage | None = None,
                   tolerations: Sequence[dict[str, Any]] = (GPU_TOLERATION,)) -> Discovery:
    """Group usable GPU nodes by product label. Deterministic: pools sorted by product.

    `tolerations`: what the job's pods tolerate (the GPU taint and spec.podTemplate's).
    `usage`: GPUs other pods and jobs hold; None counts every allocatable GPU as free."""
    found: dict[str, dict[str, Any]] = {}
    result = Discovery(pools=[], num_nodes=len(nodes))
    for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
        name = node["metadata"]["name"]
        labels = node["metadata"].get("labels") or {}
        product = labels.get(PRODUCT_LABEL)
        gpus = _int(((node.get("status") or {}).get("allocatable") or {}).get(GPU_RESOURCE))
        if product is None:
            continue  # a CPU node: not an error, nothing to say
        if (node.get("spec") or {}).get("unschedulable"):
            result.unusable.append(f"{name}: cordoned (spec.unschedulable)")
            continue
        if not _node_ready(node):
            result.unusable.append(f"{name}: not Ready")
            continue
        if taints := untolerated_taints(node, tolerations):
            result.unusable.append(f"{name}: tainted {', '.join(taints)} (not tolerated)")
            continue
        if gpus <= 0:
            result.unusable.append(f"{name}: allocatable {GPU_RESOURCE} is 0")
            continue
        used = usage.used_by_node.get(name, 0) if usage else 0
        if used >= gpus:
            result.unusable.append(f"{name}: all {gpus} {GPU_RESOURCE} requested by other pods")
            continue
        pool = found.setdefault(product, {"gpus": [], "nodes": [], "memory": []})
        pool["gpus"].append(gpus - used)
        pool["nodes"].append(name)
        if _int(labels.get(MEMORY_LABEL)) > 0:
            pool["memory"].append(_int(labels[MEMORY_LABEL]) * MIB)
    for product in sorted(found):
        info = found[product]
        # A product outside the catalog is planned too: the operator profiles every pool
        # (speed), memory comes from the label or the profile (NVML); the catalog only
        # feeds estimates.
        catalog_name: str | None = gpu_key(product)
        if not resolve_gpu(product).in_catalog:
            result.unknown_products.append(product)
        reserved = usage.reserved_by_pool.get(product, 0) if usage else 0
        free = sum(info["gpus"]) - reserved
        if free <= 0:
            result.unusable.append(f"{product}: all {sum(info['gpus'])} free GPU(s) planned by "
                                   "other Cephalo jobs")
            continue
        # Nodes of one product can report slightly different memory (MIG, ECC): plan for the least.
        memory = min(info["memory"]) if info["memory"] else None
        result.pools.append(Pool(product, catalog_name, free, memory, tuple(info["nodes"]),
                                 tuple(info["gpus"]), reserved))
    return result


class NoGpusError(ValueError):
    """No usable GPU matches the job; the message says what was looked for and found."""


def product_matches(label: str, wanted: str) -> bool:
    """Does a pool's product label answer to `wanted` (the same label or its catalog name)?"""
    if wanted == label:
        return True
    return same_gpu(label, wanted)  # one catalog SKU, or one product outside it


def _matches(pool: Pool, wanted: str) -> bool:
    return product_matches(pool.product, wanted)


def select_cluster(spec: CephaloJobSpec, discovery: Discovery,
                   nodes: list[dict[str, Any]] | None = None,
                   locality_labels: Sequence[str] = DEFAULT_LOCALITY_LABELS,
                   ) -> tuple[ClusterSpec, list[Pool]]:
    """The job's pool selection applied to the discovered pools → (ClusterSpec, pools used).

    Pools are named by their product label; groups carry the catalog name as `product`
    (profiles and the planner are keyed by it). Raises NoGpusError with what was found.
    """
    plannable = [p for p in discovery.pools if p.catalog_name is not None]
    chosen: list[tuple[Pool, int, int | None]] = []  # (pool, gpus, memory override)
    missing: list[str] = []
    if not spec.gpu_pools:
        chosen = [(p, p.num_gpus, None) for p in plannable]
    else:
        for want in spec.gpu_pools:
            pools = [p for p in plannable if want.product is None or _matches(p, want.product)]
            if want.node_selector:
                pools = [_narrow(p, want.node_selector, nodes or []) for p in pools]
                pools = [p for p in pools if p.num_gpus > 0]
            if not pools:
                missing.append(want.product or f"nodeSelector {want.node_selector}")
            budget = want.max_gpus
            for pool in pools:
                count = pool.num_gpus if budget is None else min(budget, pool.num_gpus)
                if budget is not None:
                    budget -= count
                memory = want.memory_mi_b * MIB if want.memory_mi_b else None
                if count > 0 and all(c[0].product != pool.product for c in chosen):
                    chosen.append((pool, count, memory))
    if not chosen:
        raise NoGpusError(describe_nothing_found(discovery, missing))
    if spec.max_gpus is not None:
        chosen = _cap(chosen, spec.max_gpus, spec.precision)
    # Pools that share a switch / zone next to each other in rank order (operator/locality.py).
    by_name = {n["metadata"]["name"]: n for n in nodes or []}
    domains = [shared_domain(p.nodes, by_name, locality_labels) for p, _, _ in chosen]
    order = by_domain(domains)
    chosen, domains = [chosen[i] for i in order], [domains[i] for i in order]
    groups = [GpuGroup(product=p.catalog_name or p.product, count=count, pool=p.product,
                       memory_bytes=memory or p.memory_bytes) for p, count, memory in chosen]
    placed = describe_nodes([(p, g) for (p, _, _), g in zip(chosen, groups, strict=True)],
                            nodes or [], spec.ranks_per_pod, domains)
    return ClusterSpec(groups=groups, nodes=placed, network_source=NETWORK_SOURCE), \
        [p for p, _, _ in chosen]


NETWORK_SOURCE = f"operator (GPU discovery, node label {NIC_GBPS_LABEL})"


def describe_nodes(chosen: list[tuple[Pool, GpuGroup]], nodes: list[dict[str, Any]],
                   ranks_per_pod: int, domains: Sequence[str | None] = ()) -> list[ClusterNode]:
    """Where the ranks of each pool will sit, as the planner's nodes: the pods
    `podspec.pack_ranks` will make of them (one per node of the pool, largest first; at most
    ranksPerPod ranks each), each on a node with its pool's NIC. A pod lands on any node of
    its pool that has room, so its NIC is the pool's slowest labelled one (none: unlabelled,
    the plan assumes the default); a pod cut short by ranksPerPod may share its node with
    others of the job, and so its NIC (one rank a pod: 1/8 of an 8-GPU node's). `domains`:
    each pool's switch / zone (operator/locality.py), given to its pods."""
    by_name = {n["metadata"]["name"]: n for n in nodes}
    out = []
    for index, (pool, group) in enumerate(chosen):
        domain = domains[index] if index < len(domains) else None
        free = list(pool.node_gpus) or [_int(((by_name.get(n) or {}).get("status") or {})
                                             .get("allocatable", {}).get(GPU_RESOURCE))
                                        for n in pool.nodes]
        largest = max(free, default=1)
        nic = _pool_nic_gbps(pool, by_name)
        cap = ranks_per_pod if ranks_per_pod > 0 else group.count
        for size in pod_sizes(list(free), group.count, cap):
            shared = ranks_per_pod > 0 and size == cap < largest
            out.append(ClusterNode(gpus={group.key: size}, name=pool.product,
                                   nic_bandwidth_bytes_per_second=None if nic is None
                                   else nic * 1e9 / 8,
                                   nic_share=size / largest if shared else 1.0,
                                   domain=domain))
    return out


def _pool_nic_gbps(pool: Pool, by_name: dict[str, dict[str, Any]]) -> float | None:
    """The slowest NIC the pool's nodes' labels name (Gbit/s); None when one is unlabelled
    or its label is not a positive number (that node's NIC is not known)."""
    speeds = []
    for name in pool.nodes:
        labels = (by_name.get(name) or {}).get("metadata", {}).get("labels") or {}
        try:
            speed = float(labels.get(NIC_GBPS_LABEL, ""))
        except ValueError:
            return None
        if not 0 < speed < float("inf"):
            return None
        speeds.append(speed)
    return min(speeds) if speeds else None


def _cap(chosen: list[tuple[Pool, int, int | None]], max_gpus: int,
         precision: str) -> list[tuple[Pool, int, int | None]]:
    """spec.maxGpus: keep the fastest GPUs (catalog peak for the job's precision, then
    memory), dropping from the slowest pools first; pool order is kept."""
    def speed(item: tuple[Pool, int, int | None]) -> tuple[float, int, str]:
        pool, _, memory = item
        try:
            gpu = lookup_gpu(pool.catalog_name or pool.product)
        except ValueError:  # not in the catalog: no estimate of its speed, keep it last
            return (0.0, -(memory or pool.memory_bytes or 0), pool.product)
        return (-gpu.peak_flops(precision), -(memory or pool.memory_bytes or gpu.memory_bytes),
                pool.product)

    left = max_gpus
    counts: dict[str, int] = {}
    for pool, count, _memory in sorted(chosen, key=speed):
        counts[pool.product] = min(count, left)
        left -= counts[pool.product]
    return [(p, counts[p.product], m) for p, _, m in chosen if counts[p.product] > 0]


def _narrow(pool: Pool, selector: dict[str, str], nodes: list[dict[str, Any]]) -> Pool:
    """The part of a pool on nodes that carry every label of `selector` (its free GPUs, less
    everything other jobs reserved in the pool: their pods may land on any of its nodes)."""
    by_name = {n["metadata"]["name"]: n for n in nodes}
    free = pool.node_gpus or tuple(
        _int(by_name[n]["status"]["allocatable"].get(GPU_RESOURCE)) for n in pool.nodes)
    keep = [(n, g) for n, g in zip(pool.nodes, free, strict=True) if all(
        (by_name.get(n, {}).get("metadata", {}).get("labels") or {}).get(k) == v
        for k, v in selector.items())]
    gpus = max(0, sum(g for _, g in keep) - pool.reserved)
    return Pool(pool.product, pool.catalog_name, gpus, pool.memory_bytes,
                tuple(n for n, _ in keep), tuple(g for _, g in keep), pool.reserved)


def describe_nothing_found(discovery: Discovery, missing: list[str]) -> str:
    parts = [f"no usable GPUs: looked for nodes labelled {PRODUCT_LABEL} with allocatable "
             f"{GPU_RESOURCE} > 0, Ready and schedulable; saw {discovery.num_nodes} node(s)"]
    if discovery.pools:
        parts.append("pools found: " + ", ".join(
            f"{p.product} x{p.num_gpus}" for p in discovery.pools))
    if missing:
        parts.append("requested but not found: " + ", ".join(missing))
    if discovery.unknown_products:
        parts.append("products not in the GPU catalog (planned once profiled): " +
                     ", ".join(discovery.unknown_products))
    if discovery.unusable:
        parts.append("unusable: " + "; ".join(discovery.unusable[:8]))
    return "; ".join(parts)


def plan_fits(plan_pools: dict[str, int], discovery: Discovery) -> list[str]:
    """Pools whose GPUs a running plan uses but that have fewer now (a node was lost)."""
    have = {p.product: p.num_gpus for p in discovery.pools}
    return [f"{pool}: plan uses {used}, {have.get(pool, 0)} available"
            for pool, used in sorted(plan_pools.items()) if have.get(pool, 0) < used]
