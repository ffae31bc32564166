"""`--emulate`: CPU ranks that behave like catalog GPUs, so heterogeneous planning can be seen
and measured on any machine. Clearly labelled as emulation wherever it shows.

* speed: GPU g's compute is slowed by time dilation d_g = peak_fastest / peak_g, the ratio
  of the catalog's peak FLOP/s in the precision g computes in (the job's; under auto each
  GPU's own, GpuType.peak_flops), so the fastest emulated GPU runs at the CPU's real speed
  and a GPU with a third of its peak takes 3x as long. Peak ratios,
  not the estimated profile, because a tiny model's estimate is all kernel-launch overhead
  and would hide the very differences emulation is meant to show;
* memory: capacity_g = catalog memory_g x scale, with the scale chosen so that the emulated
  cluster holds the training state plus every rank's largest profiled microbatch with 50%
  to spare (memory then shapes the plan as it does on the real cards). The engine enforces it.
"""

from __future__ import annotations

from dataclasses import dataclass

from cephalo.api.memory import state_bytes
from cephalo.api.models import ModelConfig
from cephalo.api.plan import Plan
from cephalo.api.profile import GpuProfile, ProfilePoint, SingleRankStep
from cephalo.planner.cost.catalog import lookup_gpu
from cephalo.planner.cost.costmodel import modelled_single_rank_step_seconds, step_overhead_seconds

HEADROOM = 1.5


@dataclass(frozen=True)
class Emulation:
    dilation: dict[str, float]  # per emulated product, >= 1
    capacity_bytes: dict[str, int]
    memory_scale: float

    def describe(self, product: str) -> str:
        gpu = lookup_gpu(product)
        d = self.dilation[product]
        speed = "at this CPU's speed (the fastest emulated GPU)" if d == 1.0 else \
            f"{d:.2f}x slower than this CPU"
        return (f"emulated {product}: compute {speed}, memory "
                f"{gpu.memory_bytes / 2**30:.0f} GiB -> "
                f"{self.capacity_bytes[product] / 2**20:.1f} MiB")


def _dilation(products: list[str], precision: str) -> dict[str, float]:
    peak = {p: lookup_gpu(p).peak_flops(precision) for p in sorted(set(products))}
    fastest = max(peak.values())
    return {p: fastest / peak[p] for p in peak}


def _scaled_capacity(products: list[str], memory_scale: float) -> dict[str, int]:
    """Each emulated GPU's memory: its catalog memory x `memory_scale`."""
    return {p: int(lookup_gpu(p).memory_bytes * memory_scale) for p in set(products)}


def plan_emulation(cpu_profile: GpuProfile, products: list[str], model: ModelConfig,
                   precision: str, memory_fraction: float,
                   memory_scale: float | None = None) -> Emulation:
    dilation = _dilation(products, precision)
    if memory_scale is None:
        largest = max(cpu_profile.points, key=lambda q: q.micro_batch_size)
        need = state_bytes(model.total_parameters(), precision) + \
            len(products) * largest.compute_memory_bytes
        offered = sum(lookup_gpu(p).memory_bytes for p in products) * memory_fraction
        memory_scale = HEADROOM * need / offered
    return Emulation(dilation, _scaled_capacity(products, memory_scale), memory_scale)


def emulated_profile(cpu_profile: GpuProfile, product: str, emu: Emulation,
                     contention: float = 1.0) -> GpuProfile:
    """The CPU's measured profile as the emulated GPU will run it, marked `emulated`, with
    its emulated memory capacity. The engine sleeps (d - 1) x the CPU time of each unit's
    work, and the work itself runs `contention` times slower when ranks share cores:
    t_emulated = t_cpu x (contention + d - 1)."""
    d = contention + emu.dilation[product] - 1.0
    points = [ProfilePoint(
        micro_batch_size=p.micro_batch_size, block_forward_seconds=p.block_forward_seconds * d,
        block_backward_seconds=p.block_backward_seconds * d,
        other_forward_seconds=p.other_forward_seconds * d,
        other_backward_seconds=p.other_backward_seconds * d,
        compute_memory_bytes=p.compute_memory_bytes) for p in cpu_profile.points]
    # The once-per-pass part of a forward is unit work (dilated); the step's own work and
    # the optimizer run outside the units (only contention slows them).
    scaled = {k: getattr(cpu_profile, k) * factor
              for k, factor in (("block_forward_fixed_seconds", d),
                                ("other_forward_fixed_seconds", d),
                                ("optimizer_seconds_fixed", contention),
                                ("optimizer_seconds_per_parameter", contention))
              if getattr(cpu_profile, k) is not None}
    emulated = cpu_profile.model_copy(update={
        **scaled, "product": product, "source": "emulated", "points": points,
        "memory_capacity_bytes": emu.capacity_bytes[product],
        "device_name": f"emulated {product} on {cpu_profile.device_name}"})
    return emulated.model_copy(update={"single_rank_step": _emulated_step(cpu_profile,
                                                                          emulated, contention)})


def _emulated_step(cpu_profile: GpuProfile, emulated: GpuProfile,
                   contention: float) -> SingleRankStep | None:
    """The measured single-rank step as the emulated GPU takes it: its units and optimizer
    as the emulated profile models them, plus the CPU step's own overhead slowed only by
    contention (the engine's per-step work runs outside the units, undilated). The planner
    then derives exactly contention x the CPU's overhead from it."""
    probe = cpu_profile.single_rank_step
    modelled = modelled_single_rank_step_seconds(emulated)
    if probe is None or modelled is None:
        return None
    seconds = modelled + contention * step_overhead_seconds(cpu_profile)
    return probe.model_copy(update={"seconds": seconds})


def given_plan_emulation(plan: Plan, products: list[str], precision: str, source: str,
                         memory_scale: float | None = None,
                         cluster_products: list[str] | None = None) -> Emulation:
    """The emulation a given plan (`cephalo run --plan`) runs under: the same time dilation
    as when it was planned (catalog peaks), and each emulated GPU's memory as the plan
    recorded it (`memory_capacity_bytes`, the capacity it was planned against), or catalog
    memory x `memory_scale` when given. Without either there is nothing to cap the rank's
    memory at: an error, not a silently uncapped rank. `products`: each rank's emulated GPU
    (the plan's ranks run on the devices in order, `check_plan`).

    A plan timed from the catalog's estimates of the real GPUs (`cephalo plan` without
    profiles) is refused: its step times and memory are a real card's, which CPU ranks do not
    emulate (its prediction would be off by orders of magnitude, its cap a real card's).

    `cluster_products`: every emulated device's GPU, idle ones included (default
    `products`): the dilation is relative to the fastest of them, as when it was planned."""
    for r, product in zip(plan.ranks, products, strict=True):
        if r.estimated:
            raise ValueError(
                f"{source}: rank {r.rank}'s times are catalog estimates for a real {product}, "
                f"not for a CPU rank emulating one; drop --plan to profile and plan here, or "
                f"plan with `cephalo plan --profiles RUN_DIR/profiles` from an emulated run")
    if memory_scale is not None:
        capacity = _scaled_capacity(products, memory_scale)
    else:
        capacity = {}
        for r, product in zip(plan.ranks, products, strict=True):
            if r.memory_capacity_bytes is None:
                raise ValueError(
                    f"{source}: rank {r.rank} (emulated {product}) records no "
                    "memory_capacity_bytes to cap its memory at; pass --emulate-memory-scale "
                    "X (emulated memory = catalog memory x X) or use a plan cephalo planned")
            capacity[product] = min(capacity.get(product, r.memory_capacity_bytes),
                                    r.memory_capacity_bytes)
    first = products[0]
    dilation = _dilation(cluster_products or products, precision)
    return Emulation({p: dilation[p] for p in set(products)}, capacity,
                     capacity[first] / lookup_gpu(first).memory_bytes)

