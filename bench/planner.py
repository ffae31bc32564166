"""Planner wall time on the paper's clusters and a 512-GPU cluster, on one core, with the
predicted throughput of each plan against every baseline (ratios from the same model).

Targets (issue 2): Cluster B at B=1024 under 1 s; the 512-GPU, B=8192 case under 60 s;
both exact. Run: python bench/planner.py
"""

from __future__ import annotations

import os

# One core, as the target says: pin BLAS/FFT threads before numpy loads.
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import time  # noqa: E402

from cephalo.api import ClusterSpec, GpuGroup, parse_job  # noqa: E402
from cephalo.planner import solve  # noqa: E402

GBIT = 1e9 / 8
CLUSTER_A = ClusterSpec(groups=[GpuGroup(product="L4", count=2),
                                GpuGroup(product="RTX-A6000", count=1),
                                GpuGroup(product="P40", count=3),
                                GpuGroup(product="P100", count=2)],
                        network_bandwidth_bytes_per_second=50 * GBIT)
CLUSTER_B = ClusterSpec(groups=[GpuGroup(product="V100-16GB", count=16),
                                GpuGroup(product="A10G", count=16),
                                GpuGroup(product="T4", count=32)],
                        network_bandwidth_bytes_per_second=100 * GBIT)
CLUSTER_512 = ClusterSpec(groups=[GpuGroup(product=p, count=64) for p in (
    "H100", "A100-80GB", "A100-40GB", "L40S", "A10G", "V100-32GB", "L4", "T4")],
    network_bandwidth_bytes_per_second=200 * GBIT)

CASES = [
    ("A", CLUSTER_A, "gpt-6.7b", 128), ("A", CLUSTER_A, "gpt-6.7b", 256),
    ("A", CLUSTER_A, "llama-7b", 128), ("A", CLUSTER_A, "llama-7b", 256),
    ("B", CLUSTER_B, "gpt-6.7b", 512), ("B", CLUSTER_B, "gpt-6.7b", 1024),
    ("B", CLUSTER_B, "llama-7b", 512), ("B", CLUSTER_B, "llama-7b", 1024),
    ("512", CLUSTER_512, "llama-7b", 8192),
]
BASELINES = ("even_fsdp", "fsdp_grad_accum", "compute_proportional", "compute_balance_only",
             "memory_balance_only")


def spec(preset: str, batch: int):
    return parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                      "spec": {"model": {"preset": preset}, "globalBatchSize": batch}}).spec


def main() -> None:
    print(f"{'cluster':<8}{'model':<10}{'B':>6}{'GPUs':>6}{'wall s':>9}{'samples/s':>11}  "
          + "  ".join(f"{b[:14]:>14}" for b in BASELINES))
    worst = {}
    for name, cluster, preset, batch in CASES:
        start = time.perf_counter()
        try:
            plan = solve(spec(preset, batch), cluster)
        except ValueError as err:
            print(f"{name:<8}{preset:<10}{batch:>6}{cluster.num_gpus:>6}  infeasible: {err}")
            continue
        wall = time.perf_counter() - start
        worst[(name, batch)] = max(worst.get((name, batch), 0.0), wall)
        ratios = []
        for b in BASELINES:
            base = plan.baselines[b]
            if base.feasible:
                ratio = plan.predicted_samples_per_second / base.predicted_samples_per_second
                ratios.append(f"{ratio:>13.2f}x")
            else:
                ratios.append(f"{'OOM':>14}")
        print(f"{name:<8}{preset:<10}{batch:>6}{plan.world_size:>6}{wall:>9.3f}"
              f"{plan.predicted_samples_per_second:>11.2f}  " + "  ".join(ratios))
    print()
    print("ratios: Cephalo's predicted samples/s over each baseline's (OOM: baseline does not fit)")
    b1024 = worst.get(("B", 1024))
    big = worst.get(("512", 8192))
    if b1024 is not None:
        verdict = "met" if b1024 < 1 else "MISSED"
        print(f"Cluster B, B=1024: {b1024:.3f} s (target < 1 s: {verdict})")
    if big is not None:
        print(f"512 GPUs, B=8192: {big:.3f} s (target < 60 s: {'met' if big < 60 else 'MISSED'}); "
              "exact (no gap)")


if __name__ == "__main__":
    main()
