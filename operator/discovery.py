"""GPU discovery: Kubernetes Node dicts → pools → the ClusterSpec a plan is solved for (pure).

A pool is the set of schedulable, Ready nodes that carry one value of the GPU Feature
Discovery label `nvidia.com/gpu.product`. GPUs per node come from the node's allocatable
`nvidia.com/gpu` (what the scheduler can actually hand out, not the label's count);
memory from `nvidia.com/gpu.memory` (MiB) or, without it, the catalog.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cephalo.api import ClusterSpec, GpuGroup
from cephalo.api.job import CephaloJobSpec
from cephalo.planner.catalog import lookup_gpu

PRODUCT_LABEL = "nvidia.com/gpu.product"
MEMORY_LABEL = "nvidia.com/gpu.memory"
GPU_RESOURCE = "nvidia.com/gpu"
MIB = 1024 * 1024


@dataclass(frozen=True)
class Pool:
    """GPUs of one product on usable nodes. `product` is the label value (pool name)."""

    product: str
    catalog_name: str | None  # None: not in the catalog (cannot be planned for)
    num_gpus: int
    memory_bytes: int | None
    nodes: tuple[str, ...]


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


def discover_pools(nodes: list[dict[str, Any]]) -> Discovery:
    """Group usable GPU nodes by product label. Deterministic: pools sorted by product."""
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
        taints = [f"{t.get('key')}:{t.get('effect')}" for t in (node.get("spec") or {}).get(
            "taints") or [] if t.get("effect") in ("NoSchedule", "NoExecute")
            and t.get("key") != GPU_RESOURCE]  # rank pods tolerate only the GPU taint
        if taints:
            result.unusable.append(f"{name}: tainted {', '.join(taints)}")
            continue
        if gpus <= 0:
            result.unusable.append(f"{name}: allocatable {GPU_RESOURCE} is 0")
            continue
        pool = found.setdefault(product, {"gpus": 0, "nodes": [], "memory": []})
        pool["gpus"] += gpus
        pool["nodes"].append(name)
        if _int(labels.get(MEMORY_LABEL)) > 0:
            pool["memory"].append(_int(labels[MEMORY_LABEL]) * MIB)
    for product in sorted(found):
        info = found[product]
        try:
            catalog_name: str | None = lookup_gpu(product).name
        except ValueError:
            catalog_name = None
            result.unknown_products.append(product)
        # Nodes of one product can report slightly different memory (MIG, ECC): plan for the least.
        memory = min(info["memory"]) if info["memory"] else None
        result.pools.append(Pool(product, catalog_name, info["gpus"], memory, tuple(info["nodes"])))
    return result


class NoGpusError(ValueError):
    """No usable GPU matches the job; the message says what was looked for and found."""


def product_matches(label: str, wanted: str) -> bool:
    """Does a pool's product label answer to `wanted` (the same label or its catalog name)?"""
    if wanted == label:
        return True
    try:
        return lookup_gpu(label).name == lookup_gpu(wanted).name
    except ValueError:
        return False


def _matches(pool: Pool, wanted: str) -> bool:
    return product_matches(pool.product, wanted)


def select_cluster(spec: CephaloJobSpec, discovery: Discovery,
                   nodes: list[dict[str, Any]] | None = None) -> tuple[ClusterSpec, list[Pool]]:
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
    groups = [GpuGroup(product=p.catalog_name or p.product, count=count, pool=p.product,
                       memory_bytes=memory or p.memory_bytes) for p, count, memory in chosen]
    return ClusterSpec(groups=groups), [p for p, _, _ in chosen]


def _narrow(pool: Pool, selector: dict[str, str], nodes: list[dict[str, Any]]) -> Pool:
    """The part of a pool on nodes that carry every label of `selector`."""
    by_name = {n["metadata"]["name"]: n for n in nodes}
    keep = [n for n in pool.nodes if all(
        (by_name.get(n, {}).get("metadata", {}).get("labels") or {}).get(k) == v
        for k, v in selector.items())]
    gpus = sum(_int(by_name[n]["status"]["allocatable"].get(GPU_RESOURCE)) for n in keep)
    return Pool(pool.product, pool.catalog_name, gpus, pool.memory_bytes, tuple(keep))


def describe_nothing_found(discovery: Discovery, missing: list[str]) -> str:
    parts = [f"no usable GPUs: looked for nodes labelled {PRODUCT_LABEL} with allocatable "
             f"{GPU_RESOURCE} > 0, Ready and schedulable; saw {discovery.num_nodes} node(s)"]
    if discovery.pools:
        parts.append("pools found: " + ", ".join(
            f"{p.product} x{p.num_gpus}" for p in discovery.pools))
    if missing:
        parts.append("requested but not found: " + ", ".join(missing))
    if discovery.unknown_products:
        parts.append("products not in the GPU catalog: " + ", ".join(discovery.unknown_products))
    if discovery.unusable:
        parts.append("unusable: " + "; ".join(discovery.unusable[:8]))
    return "; ".join(parts)


def plan_fits(plan_pools: dict[str, int], discovery: Discovery) -> list[str]:
    """Pools whose GPUs a running plan uses but that have fewer now (a node was lost)."""
    have = {p.product: p.num_gpus for p in discovery.pools}
    return [f"{pool}: plan uses {used}, {have.get(pool, 0)} available"
            for pool, used in sorted(plan_pools.items()) if have.get(pool, 0) < used]
