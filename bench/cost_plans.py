"""Throughput-optimal against cost-optimal plans (`planner.objective`) on the paper's
Clusters A and B, priced with a cloud-like price list, side by side: GPUs used, samples/s,
price per hour and per million samples. Planned from the calibrated catalog (no GPU needed).

    python bench/cost_plans.py [--floor-fraction 0.5]

`--floor-fraction F`: the cost plan must keep at least F of the throughput plan's samples/s
(0: no floor). The prices are illustrative on-demand list prices per GPU-hour, rounded (a
single-GPU instance's price where a cloud rents one): they differ by provider, region and
date, so read the table as what the objective does, not as a quote.
"""

from __future__ import annotations

import argparse
from typing import Any

from cephalo.api import ClusterSpec, GpuGroup, Plan, parse_job
from cephalo.planner import solve

PRICES_PER_HOUR = {  # USD per GPU-hour, illustrative (see the module docstring)
    "NVIDIA-L4": 0.80, "NVIDIA-RTX-A6000": 0.80, "Tesla-P40": 0.60,
    "Tesla-P100-PCIE-16GB": 1.46, "Tesla-V100-SXM2-16GB": 3.06, "NVIDIA-A10G": 1.01,
    "Tesla-T4": 0.53,
}
CLUSTER_A = ({"NVIDIA-L4": 2, "NVIDIA-RTX-A6000": 1, "Tesla-P40": 3,
              "Tesla-P100-PCIE-16GB": 2}, 50.0)
CLUSTER_B = ({"Tesla-V100-SXM2-16GB": 16, "NVIDIA-A10G": 16, "Tesla-T4": 32}, 100.0)
CASES = [("A", CLUSTER_A, "gpt-2.7b", 256), ("A", CLUSTER_A, "llama-3b", 128),
         ("A", CLUSTER_A, "gpt-1.3b", 128), ("B", CLUSTER_B, "llama-7b", 256),
         ("B", CLUSTER_B, "gpt-1.3b", 256), ("B", CLUSTER_B, "vit-e", 256)]


def spec(preset: str, batch: int, gbit: float, **planner: Any):
    return parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                      "metadata": {"name": "cost"},
                      "spec": {"model": {"preset": preset}, "globalBatchSize": batch,
                               "planner": {"networkBandwidthGbps": gbit,
                                           "gpuPricesPerHour": PRICES_PER_HOUR,
                                           **planner}}}).spec


def used(plan: Plan) -> str:
    counts: dict[str, int] = {}
    for r in plan.ranks:
        counts[r.gpu] = counts.get(r.gpu, 0) + 1
    return " + ".join(f"{n}x{g}" for g, n in counts.items())


def row(cluster: str, preset: str, batch: int, label: str, plan: Plan) -> str:
    cost = plan.cost
    assert cost is not None and plan.predicted_samples_per_second is not None
    return (f"| {cluster} | {preset} | {batch} | {label} | {used(plan)} | "
            f"{plan.predicted_samples_per_second:.2f} | {cost.price_per_hour:.2f} | "
            f"{cost.price_per_million_samples:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floor-fraction", type=float, default=0.5)
    args = parser.parse_args()
    print("| cluster | model | B | objective | GPUs used | samples/s | $/hour | "
          "$/M samples |\n|---|---|---|---|---|---|---|---|")
    for name, (gpus, gbit), preset, batch in CASES:
        cluster = ClusterSpec(groups=[GpuGroup(product=p, count=n) for p, n in gpus.items()])
        fast = solve(spec(preset, batch, gbit), cluster, choose_gpus=True)
        print(row(name, preset, batch, "throughput", fast))
        floor = {} if args.floor_fraction <= 0 else {
            "minSamplesPerSecond": fast.predicted_samples_per_second * args.floor_fraction}
        cheap = solve(spec(preset, batch, gbit, objective="cost", **floor), cluster,
                      choose_gpus=True)
        label = "cost" + (f" (>= {args.floor_fraction:.0%} of it)" if floor else "")
        print(row(name, preset, batch, label, cheap))


if __name__ == "__main__":
    main()
