"""What the plan says of precision: each rank's under a job's `auto`, and a warning where a
forced precision makes a GPU compute no faster than fp32 (issue 36, item 5).

A forced precision a GPU cannot run fast is warned, not refused: the job still runs
correctly, and the planner prices it at the speed it gets (`GpuType.achieved_flops`):

* bf16 below compute capability 8.0 (V100, T4, Pascal) is emulated: no bf16 tensor cores,
  fp32 speed; the only gain left is the 16-bit activations' memory;
* fp16 on Pascal (P100 6.0, P40 6.1): no fp16 tensor cores; torch's fp16 matmuls accumulate
  in fp32, so they run at fp32 speed (the authors measured 0.9-1.2x fp32 on both; the P40's
  native fp16 arithmetic is 1/64 of its fp32 rate), and the job takes fp16's narrow range and
  loss scaling for nothing.

Each warning says what `auto` would give those GPUs instead. GPUs without a compute
capability in the catalog (the CPU, products known only from a profile) get none.
"""

from __future__ import annotations

from cephalo.planner.cost.catalog import ComputePrecision, GpuType, fastest_precision
from cephalo.planner.search.problem import Problem


def rank_precisions(problem: Problem) -> list[ComputePrecision | None]:
    """Each rank's `RankPlan.precision`: under a job's "auto" the precision its GPU's profile
    was measured or estimated in (what the planner priced it at); else None, the job's
    (so plans of a forced precision keep their bytes)."""
    if problem.precision != "auto":
        return [None] * problem.world_size
    return [problem.rank_precision(r) for r in range(problem.world_size)]


def precision_summary(precisions: list[str], gpus: list[str]) -> str:
    """'bf16 on 16 A10G, fp16 on 16 V100-16GB and 32 T4' (rank order of first use)."""
    by_precision: dict[str, dict[str, int]] = {}
    for precision, gpu in zip(precisions, gpus, strict=True):
        counts = by_precision.setdefault(precision, {})
        counts[gpu] = counts.get(gpu, 0) + 1
    parts = []
    for precision, counts in by_precision.items():
        named = [f"{n} {gpu}" for gpu, n in counts.items()]
        listed = named[0] if len(named) == 1 else ", ".join(named[:-1]) + " and " + named[-1]
        parts.append(f"{precision} on {listed}")
    return ", ".join(parts)


def slow_precision_reason(gpu: GpuType, precision: str) -> str | None:
    """Why `precision` is no faster than fp32 on `gpu` (None: it is, or nothing is known)."""
    if not gpu.in_catalog or gpu.compute_capability is None or precision == "fp32" \
            or gpu.has_tensor_cores(precision):
        return None
    cc = ".".join(map(str, gpu.compute_capability))
    if precision == "bf16":
        return (f"bf16 is emulated at fp32 speed on {gpu.name} (compute capability {cc}: bf16 "
                "tensor cores need 8.0)")
    return (f"fp16 runs at fp32 speed on {gpu.name} (compute capability {cc}: no fp16 tensor "
            f"cores; native fp16 peaks at {gpu.fp16_tflops:g} TFLOPS against "
            f"{gpu.fp32_tflops:g} in fp32, and torch's fp16 matmuls accumulate in fp32), "
            "with fp16's narrow range and loss scaling for nothing")


def precision_notes(problem: Problem) -> list[str]:
    """One warning per GPU type whose forced precision computes no faster than fp32, with
    what `precision: auto` would run it in and how much faster the catalog says that is."""
    if problem.precision == "auto":
        return []
    notes = []
    for cls in problem.classes:
        precision = cls.cost.profile.precision
        reason = slow_precision_reason(cls.gpu, precision)
        if reason is None:
            continue
        best = fastest_precision(cls.gpu)
        gain = cls.gpu.achieved_flops(best) / cls.gpu.achieved_flops(precision)
        them = "it" if len(cls.slots) == 1 else "them"
        instead = (f"precision auto would compute {them} in {best}, {gain:.1f}x faster by "
                   "the catalog" if best != precision and gain > 1.0 else
                   f"precision auto would compute {them} in fp32")
        notes.append(f"warning: {reason}; {_ranks_phrase(cls.slots)} {instead}")
    return notes


def _ranks_phrase(slots: list[int]) -> str:
    first, last = min(slots), max(slots)
    if first == last:
        return f"rank {first}:"
    if last - first + 1 == len(slots):
        return f"ranks {first}-{last}:"
    return f"its {len(slots)} ranks:"
