"""The planner: per-GPU batch, microbatching and uneven training-state shards (torch-free).

`solve(spec, cluster, profiles) -> Plan` is exact for the cost model in `cost.costmodel`;
`evaluate(...)` scores any given assignment under the same model. Four layers, each importing
only those before it (docs/architecture.md, "The planner's layout"): `cost` <- `search` <-
`outputs`, `feedback`. Above them: this public API and `worker`, `solve` in a child process."""

from __future__ import annotations

from collections.abc import Iterable

from cephalo.api.models import ModelConfig
from cephalo.api.profile import GpuProfile
from cephalo.planner.cost.catalog import GPU_CATALOG, GpuType, lookup_gpu
from cephalo.planner.cost.estimate import estimate_profile as _estimate
from cephalo.planner.search.evaluate import Evaluation, evaluate, water_fill
from cephalo.planner.search.problem import InfeasibleError
from cephalo.planner.search.solver import solve


def estimate_profile(gpu: str | GpuType, model: ModelConfig, precision: str = "fp32",
                     micro_batch_sizes: Iterable[int] = range(1, 9)) -> GpuProfile:
    """A catalog-based GpuProfile (source 'estimated') for a GPU name or label."""
    gpu_type = gpu if isinstance(gpu, GpuType) else lookup_gpu(gpu)
    return _estimate(gpu_type, model, precision, micro_batch_sizes)


__all__ = ["GPU_CATALOG", "Evaluation", "GpuType", "InfeasibleError", "estimate_profile",
           "evaluate", "lookup_gpu", "solve", "water_fill"]
