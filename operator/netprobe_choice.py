"""Which network probes a job needs, and which of them the cluster-wide cache already answers
(issue 35 item 1, issue 46 items 5 and 8; docs/network.md). Pure: no I/O, no clock.

A probe is named by what it measures: its kind, its pools (GPU product labels) and each
pool's **NIC identity**, the nodes' `node.kubernetes.io/instance-type` and
`cephalo.dev/nic-gbps` labels. Two jobs on the same pools of the same machine types share
one measurement whatever their namespaces; a node replaced by one of the same type measures
nothing again, a pool that gains a machine type with another NIC is measured again. Node
names are left out on purpose: an autoscaler renames nodes, it does not change their NICs.

A probe is answered by the cache when
* the same probe was measured (kind, pools and NIC identities), or
* for an inter-node probe, each of its pools' NIC was measured in *any* pair (the fastest
  such pair: `with_measured_network` takes a pool's NIC from the fastest pair it was measured
  in, so the A10G pool measured against a T4 answers an A10G <-> A10G probe too).
Only a probe with a pool whose NIC was never measured (or an intra-node link never measured)
is left to run.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from cephalo.api.cluster import ClusterSpec
from cephalo.api.job import CephaloJobSpec
from cephalo.api.network import NIC_GBPS_LABEL
from cephalo.api.network_profile import INTER, INTRA, NETWORK_PROFILE_KEY, NetworkProfile
from cephalo.operator.discovery import Pool

INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"  # a cloud machine type: its NIC
LABEL_NETWORK_PROFILE = "cephalo.dev/network-profile"  # "true" on the cache's ConfigMaps


@dataclass(frozen=True)
class Probe:
    kind: str  # INTER or INTRA
    pools: tuple[str, ...]  # product labels: two for inter-node (maybe equal), one intra
    nics: tuple[str, ...] = ()  # each pool's NIC identity (empty: none known)

    @property
    def key(self) -> str:
        """What the probe measures: the cache's name for it (no node, job or namespace)."""
        nics = self.nics or ("",) * len(self.pools)
        return f"{self.kind}:" + "|".join(f"{p}@{n}" if n else p
                                          for p, n in zip(self.pools, nics, strict=True))

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.key.encode()).hexdigest()[:10]

    @property
    def config_map_name(self) -> str:
        return f"cephalo-network-{self.kind.split('-')[0]}-{self.digest}"

    def describe(self) -> str:
        return f"{self.kind} {' <-> '.join(self.pools)}" if self.kind == INTER else \
            f"{self.kind} {self.pools[0]} x2"


def nic_identity(pool: Pool, nodes: Sequence[Mapping[str, Any]]) -> str:
    """The pool's NIC identity: the distinct instance-type / nic-gbps labels of its nodes
    ('' where its nodes carry neither: the pool is its product alone)."""
    names = set(pool.nodes)
    seen = set()
    for node in nodes:
        meta = node.get("metadata") or {}
        if meta.get("name") in names:
            labels = meta.get("labels") or {}
            kind, gbps = labels.get(INSTANCE_TYPE_LABEL, ""), labels.get(NIC_GBPS_LABEL, "")
            if kind or gbps:
                seen.add(f"{kind}/{gbps}" if gbps else kind)
    return ",".join(sorted(seen))


def nic_identities(pools: Sequence[Pool], nodes: Sequence[Mapping[str, Any]]
                   ) -> dict[str, str]:
    return {p.product: nic_identity(p, nodes) for p in pools}


def read_cache(config_maps: Sequence[Mapping[str, Any]]) -> list[NetworkProfile]:
    """The measurements in the cache's ConfigMaps (an unreadable one is left out: the next
    measurement of its link replaces it)."""
    found = []
    for cm in config_maps:
        try:
            found.append(NetworkProfile.model_validate_json(
                (cm.get("data") or {}).get(NETWORK_PROFILE_KEY, "")))
        except ValidationError:
            continue
    return found


def pinned(spec: CephaloJobSpec) -> tuple[bool, bool]:
    """(inter-node, intra-node) links the job gives by hand: not probed."""
    planner = spec.planner
    flat = planner.network_bandwidth_gbps is not None
    network = planner.network
    return (flat or (network is not None and network.inter_node_gbps is not None),
            flat or (network is not None and network.intra_node_gbps is not None))


def probes_needed(spec: CephaloJobSpec, cluster: ClusterSpec, pools: list[Pool],
                  nics: Mapping[str, str] | None = None) -> list[Probe]:
    """The probes that would describe the links a plan on `cluster` may cross (`nics`: each
    pool's NIC identity, by product label)."""
    if cluster.num_gpus < 2:
        return []  # one GPU: no collective crosses anything
    counts = {g.pool or g.product: g.count for g in cluster.groups}
    used = sorted((p for p in pools if counts.get(p.product, 0) > 0), key=lambda p: p.product)
    inter_pinned, intra_pinned = pinned(spec)

    def probe(kind: str, *names: str) -> Probe:
        return Probe(kind, names, tuple(nics.get(n, "") for n in names) if nics else ())

    probes: list[Probe] = []
    if not inter_pinned:
        names = [p.product for p in used]
        probes += [probe(INTER, a, b) for a, b in itertools.pairwise(names)]
        if len(used) == 1 and len(_free_nodes(used[0])) >= 2:
            probes.append(probe(INTER, used[0].product, used[0].product))
    if not intra_pinned:
        probes += [probe(INTRA, p.product) for p in used
                   if counts[p.product] >= 2 and max(_free_nodes(p), default=0) >= 2]
    return probes


def _free_nodes(pool: Pool) -> list[int]:
    """Free GPUs on each of the pool's nodes (all allocatable where not counted)."""
    return [g for g in pool.node_gpus if g > 0] if pool.node_gpus else [1] * len(pool.nodes)


def _sides(kind: str, pools: Sequence[str], nics: Sequence[str]) -> list[tuple[str, str]]:
    return sorted(zip(pools, list(nics) or [""] * len(pools), strict=True)) if kind == INTER \
        else list(zip(pools, list(nics) or [""] * len(pools), strict=True))


@dataclass(frozen=True)
class Answer:
    measured: list[NetworkProfile]  # the cached measurements to plan with
    to_probe: list[Probe]  # the probes nothing cached answers, in the order needed


def answer(needed: Sequence[Probe], cached: Sequence[NetworkProfile], *, now: float,
           max_age_seconds: float) -> Answer:
    """What the cache (measurements no older than `max_age_seconds` at `now`) answers of
    `needed`, and what only a probe would."""
    fresh = [c for c in cached if c.age_seconds(now) <= max_age_seconds]
    measured: list[NetworkProfile] = []
    to_probe: list[Probe] = []
    for probe in needed:
        wanted = _sides(probe.kind, probe.pools, probe.nics)
        same = [c for c in fresh if c.kind == probe.kind
                and _sides(c.kind, c.pools, c.nics) == wanted]
        found = [_latest(same)] if same else []
        if not found and probe.kind == INTER:
            nic = [_fastest_pair(side, fresh) for side in dict.fromkeys(wanted)]
            found = [m for m in nic if m is not None] if all(nic) else []
        if not found:
            to_probe.append(probe)
        measured += [m for m in found if m not in measured]
    return Answer(measured, to_probe)


def _latest(profiles: Sequence[NetworkProfile]) -> NetworkProfile:
    return max(profiles, key=lambda p: p.measured_at)


def _fastest_pair(side: tuple[str, str], fresh: Sequence[NetworkProfile]
                  ) -> NetworkProfile | None:
    """The fastest inter-node measurement the pool (with that NIC identity) took part in."""
    pairs = [c for c in fresh if c.kind == INTER and side in _sides(c.kind, c.pools, c.nics)]
    return max(pairs, key=lambda p: (p.bandwidth_bytes_per_second, p.measured_at),
               default=None)


@dataclass(frozen=True)
class Background:
    """What a Running job probes beside its gang (issue 46 item 8): at most one probe, and
    why each other never-measured link is left alone for now."""

    probe: Probe | None  # to start, or to keep watching (it runs already)
    left: dict[str, str]  # Probe.describe() -> why it is not measured now


def background_probe(to_probe: Sequence[Probe], failed: Mapping[str, str],
                     free: Sequence[Pool], running: frozenset[str] = frozenset()
                     ) -> Background:
    """The probe a Running job should run now, of the links nothing cached answers
    (`to_probe`, from `answer`). `failed`: probe key -> why, never tried again for the job;
    `free`: the pools as free of *every* pod, the job's own ranks included (a probe must
    never take a GPU its gang holds, nor one another workload holds); `running`: digests of
    the job's probe pods that exist. A running probe that still answers a link is kept (its
    pods hold their GPUs: they are no longer free); else the first that fits in `free`."""
    left: dict[str, str] = {}
    wanted = [p for p in to_probe if p.key not in failed]
    for probe in to_probe:
        if probe.key in failed:
            left[probe.describe()] = f"probe failed: {failed[probe.key]}"
    chosen = next((p for p in wanted if p.digest in running), None)
    if chosen is None:
        chosen = next((p for p in wanted if _room(p, free)), None)
    for probe in wanted:
        if probe is not chosen:
            left[probe.describe()] = (
                "not measured yet: one probe at a time" if chosen is not None and
                _room(probe, free) else f"not measured: no free GPUs to probe "
                f"{probe.describe()} without the job's own")
    return Background(chosen, left)


def _room(probe: Probe, free: Sequence[Pool]) -> bool:
    """The probe's pods fit on free GPUs: one GPU on each of two nodes (inter-node), or two
    GPUs of one node (intra-node), with the GPUs other jobs planned in a pool and have not
    placed yet (`Pool.reserved`) left to them."""
    by_product = {p.product: p for p in free}
    pools = [by_product.get(name) for name in probe.pools]
    if any(p is None for p in pools):
        return False
    wanted: dict[str, int] = {}
    for name in probe.pools:
        wanted[name] = wanted.get(name, 0) + (2 if probe.kind == INTRA else 1)
    for name, gpus in wanted.items():
        pool = by_product[name]
        if sum(_free_nodes(pool)) - pool.reserved < gpus:
            return False
    if probe.kind == INTRA:
        return max(_free_nodes(by_product[probe.pools[0]]), default=0) >= 2
    first, second = (by_product[n] for n in probe.pools)
    # two distinct nodes, one free GPU on each (a node belongs to one pool: two pools are
    # two nodes; one pool needs two of its nodes with a free GPU)
    return len(_free_nodes(first)) >= 2 if first is second else bool(
        _free_nodes(first) and _free_nodes(second))


__all__ = ["INSTANCE_TYPE_LABEL", "LABEL_NETWORK_PROFILE", "Answer", "Background", "Probe",
           "answer", "background_probe", "nic_identities", "nic_identity", "pinned",
           "probes_needed", "read_cache"]
