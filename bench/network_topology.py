"""The paper's clusters planned under each network model (issue 35, docs/network.md).

For Cluster A (examples/gpt-2.7b-cluster-a.yaml: two machines, 50 Gbit/s between them,
PCIe inside) and Cluster B (examples/llama-7b-cluster-b.yaml: 8 VMs of 8 GPUs, 100 Gbit/s
NICs, NVLink on the V100 VMs, PCIe on the others), GPT-2.7B, Llama-7B and ViT-e at B = 256
and 512 (fp32, catalog estimates), it prints the GPUs each plan uses and its predicted
samples/s:

* default: what the planner assumed before the topology model and without a word from the
  job: a flat ring at 10 Gbit/s per GPU (the job's networkBandwidthGbps: 10);
* per GPU: that flat ring at the cluster's link speed per GPU (networkBandwidthGbps: 50 or
  100), the figure the issue's target is measured against;
* topology: the example's planner.network (nodes, NICs, intra-node links);
* 10G NIC: the same nodes with a 10 Gbit/s NIC each.

and, per row, topology / per GPU (the target: at least 0.9 with all three GPU types on
Cluster B, tests/unit/test_network_topology.py) and the ratio all GPUs / the A10Gs alone
on Cluster B under the topology (the paper's Fig. 6 measured about 2x at B = 512). Run:
python bench/network_topology.py   (about a minute on one core)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cephalo.api import Plan, load_job, parse_job
from cephalo.api.job import CephaloJobSpec
from cephalo.commands.plan import pools_as_cluster
from cephalo.planner import solve

ROOT = Path(__file__).resolve().parent.parent
CLUSTERS = {"A": ("examples/gpt-2.7b-cluster-a.yaml", 50.0),
            "B": ("examples/llama-7b-cluster-b.yaml", 100.0)}
MODELS = ("gpt-2.7b", "llama-7b", "vit-e")
BATCHES = (256, 512)
SETTINGS = ("default", "per GPU", "topology", "10G NIC")


def job(cluster: str, preset: str, batch: int, setting: str) -> CephaloJobSpec:
    """The example's job with this model, batch and network setting."""
    path, link_gbps = CLUSTERS[cluster]
    spec = load_job(str(ROOT / path)).spec.to_wire()
    spec["model"] = {"preset": preset}
    spec["globalBatchSize"] = batch
    planner: dict[str, Any] = spec.setdefault("planner", {})
    network = planner.pop("network")
    if setting == "default":
        planner["networkBandwidthGbps"] = 10.0
    elif setting == "per GPU":
        planner["networkBandwidthGbps"] = link_gbps
    else:
        if setting == "10G NIC":
            network["interNodeGbps"] = 10.0
            for node in network["nodes"]:
                node.pop("interNodeGbps", None)
        planner["network"] = network
    return parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                      "metadata": {"name": "bench"}, "spec": spec}).spec


def plan_for(cluster: str, preset: str, batch: int, setting: str,
             only: dict[str, int] | None = None) -> Plan:
    spec = job(cluster, preset, batch, setting)
    if only is not None:  # a sub-cluster (the A10Gs alone): its pools and nodes only
        pools = [p.model_copy(update={"max_gpus": only[p.product]})
                 for p in spec.gpu_pools or [] if p.product in only]
        network = spec.planner.network
        if network is not None and network.nodes is not None:
            nodes = [n for n in network.nodes if set(n.gpus) <= set(only)]
            network = network.model_copy(update={"nodes": nodes})
        planner = spec.planner.model_copy(update={"network": network})
        spec = spec.model_copy(update={"gpu_pools": pools, "planner": planner})
    return solve(spec, pools_as_cluster(spec))


def used(plan: Plan) -> str:
    counts: dict[str, int] = {}
    for rank in plan.ranks:
        counts[rank.gpu] = counts.get(rank.gpu, 0) + 1
    return "+".join(f"{n} {gpu}" for gpu, n in counts.items())


def rows() -> list[list[str]]:
    out = []
    for cluster in CLUSTERS:
        for preset in MODELS:
            for batch in BATCHES:
                plans = {s: plan_for(cluster, preset, batch, s) for s in SETTINGS}
                sps = {s: p.predicted_samples_per_second or 0.0 for s, p in plans.items()}
                row = [cluster, preset, str(batch)]
                row += [f"{used(plans[s])}: {sps[s]:.1f}" for s in SETTINGS]
                row.append(f"{sps['topology'] / sps['per GPU']:.2f}")
                if cluster == "B":
                    alone = plan_for(cluster, preset, batch, "topology",
                                     only={"NVIDIA-A10G": 16})
                    row.append(f"{sps['topology'] / (alone.predicted_samples_per_second or 1):.2f}")
                else:
                    row.append("-")
                out.append(row)
    return out


def main() -> None:
    header = ["cluster", "model", "B", "default (flat 10 Gbit/s per GPU)",
              "per GPU (flat, link speed)", "topology (paper's links)", "10 Gbit/s NIC per node",
              "topology / per GPU", "all / A10G alone (paper Fig. 6: ~2x)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows():
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
