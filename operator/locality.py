"""Which nodes share a switch or zone, from the labels the cluster already publishes (issue 44
item 4; pure).

Kubernetes' well-known `topology.kubernetes.io/zone` and NVIDIA Topograph's
`network.topology.nvidia.com/{accelerator,leaf,spine,core}` (its documented default keys,
configurable in its chart as in ours: `placement.localityLabels`) name, per node, the
domain it sits in at each level. A rank pod lands on any node of its pool, so the operator
knows the domain of a pool's pods only as far as every node of the pool agrees: a pool's
domain is the path of levels, outermost first, down to the first level where its nodes
differ ("topology.kubernetes.io/zone=a/network.topology.nvidia.com/leaf=s1"). A level no
node of the pool is labelled with is skipped (the cluster does not publish it).

The planner gets it as `ClusterNode.domain`, and the pools are ordered by it, so the ranks
(in pool order) and with them every ring and each hybrid replica group of consecutive nodes
follow the switches; the planner keeps a group of several nodes inside one domain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# Innermost first: an NVLink domain inside a leaf switch, inside a spine, a core, a zone.
DEFAULT_LOCALITY_LABELS = (
    "network.topology.nvidia.com/accelerator", "network.topology.nvidia.com/leaf",
    "network.topology.nvidia.com/spine", "network.topology.nvidia.com/core",
    "topology.kubernetes.io/zone")


def shared_domain(node_names: Sequence[str], by_name: Mapping[str, dict[str, Any]],
                  locality_labels: Sequence[str]) -> str | None:
    """The domain every node of `node_names` shares (module docstring); None: none known."""
    if not node_names:
        return None
    path = []
    for key in reversed(locality_labels):  # outermost first
        values = {((by_name.get(n) or {}).get("metadata", {}).get("labels") or {}).get(key)
                  for n in node_names}
        if values == {None}:
            continue  # the cluster does not publish this level
        if len(values) != 1:
            break  # the pool spans several domains here, so every level inside too
        path.append(f"{key}={values.pop()}")
    return "/".join(path) or None


def by_domain(domains: Sequence[str | None]) -> list[int]:
    """Indices of `domains` in an order that keeps each domain's entries together and
    domains that share outer levels next to each other (the paths sorted level by level);
    unknown ones last; ties keep their order (pools stay sorted by product)."""
    return sorted(range(len(domains)), key=lambda i: (
        domains[i] is None, tuple((domains[i] or "").split("/"))))
