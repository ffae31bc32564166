"""Every GPU at its fastest precision (issue 36): the planner's predicted throughput of the
paper's Clusters A and B under fp32, bf16 and auto, and which GPUs each plan uses in which
precision.

Cluster A (2 L4, 1 RTX A6000, 3 P40, 2 P100) at 50 Gbit/s and Cluster B (16 V100, 16 A10G,
32 T4) at 100 Gbit/s are the networks `bench/paper_figures.py` reproduces the paper's
figures at; the models are the authors' (ViT-e at 384 px). Times are the calibrated
catalog's estimates (`cephalo.planner.cost.catalog`: the authors measured fp32 everywhere but fp16
only on some GPUs and models, so one source for all three columns). Under bf16 the GPUs
without bf16 tensor cores (V100, T4, Pascal) compute at fp32 speed; under auto each GPU type
computes in `fastest_precision`: bf16 on A10G, L4, A6000, fp16 on V100 and T4, fp32 on P40
and P100 (Pascal's fp16 is no faster in torch). The issue's target: on Cluster B, auto at
least 1.5x bf16 (`tests/unit/test_precision_auto.py` holds it for GPT-2.7B and Llama-7B).
Run: python bench/precision_plans.py   (about a minute on one core)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paper_figures import CLUSTER_A, CLUSTER_B, MODEL_NAMES, cluster_spec, job

from cephalo.api import Plan
from cephalo.planner import solve
from cephalo.planner.cost.authors_profiles import AUTHORS_MODELS
from cephalo.planner.search.precision import precision_summary
from cephalo.planner.search.problem import InfeasibleError

PRECISIONS = ("fp32", "bf16", "auto")
# (cluster, GPUs, Gbit/s, global batch): the paper's batch sizes on each cluster.
CLUSTERS = (("A", CLUSTER_A, 50.0, 256), ("B", CLUSTER_B, 100.0, 512))
MODELS = ("deepspeedgpt_2.7b", "deepspeedllama_7b", "deepspeedvit_e")


def plan(model: str, gpus: dict[str, int], gbit: float, batch: int,
         precision: str) -> Plan | str:
    """The catalog plan of `model` on `gpus` in `precision`, or why there is none."""
    spec = job(AUTHORS_MODELS[model], batch).model_copy(update={"precision": precision})
    try:
        return solve(spec, cluster_spec(gpus, gbit))
    except InfeasibleError as err:
        return f"does not fit: {str(err)[:70]}"


def used(result: Plan) -> str:
    """'fp16 on 16 V100-16GB and 32 T4, bf16 on 16 A10G': the GPUs the plan uses."""
    precision = result.precision or "fp32"
    return precision_summary([r.precision or precision for r in result.ranks],
                             [r.gpu for r in result.ranks])


def rows() -> list[str]:
    header = (f"{'cluster':<8} {'model':<9} {'B':>4}  {'precision':<9} {'samples/s':>9}  "
              f"{'x bf16':>6}  GPUs used (precision)")
    lines = [header, "-" * len(header)]
    for name, gpus, gbit, batch in CLUSTERS:
        for model in MODELS:
            results = {p: plan(model, gpus, gbit, batch, p) for p in PRECISIONS}
            bf16 = results["bf16"]
            for precision, result in results.items():
                label = f"{name} ({gbit:g}G)"
                if isinstance(result, str):
                    lines.append(f"{label:<8} {MODEL_NAMES[model]:<9} {batch:>4}  "
                                 f"{precision:<9} {result}")
                    continue
                sps = result.predicted_samples_per_second or 0.0
                ratio = f"{sps / bf16.predicted_samples_per_second:.2f}x" if not isinstance(
                    bf16, str) and bf16.predicted_samples_per_second else "-"
                lines.append(f"{label:<8} {MODEL_NAMES[model]:<9} {batch:>4}  {precision:<9} "
                             f"{sps:>9.2f}  {ratio:>6}  {used(result)}")
    return lines


def main() -> None:
    print("Predicted samples/s per precision (catalog estimates; the paper's networks)")
    print("\n".join(rows()))


if __name__ == "__main__":
    main()
