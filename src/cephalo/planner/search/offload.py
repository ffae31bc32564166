"""Where each rank keeps its boundary activations between forward and backward: on its
device, or offloaded to host memory (the paper's activation offloading).

A boundary is one unit's output for one microbatch, fp32 (`cephalo.api.memory`). Kept on
the device, a recompute-mode rank holds L + 2 of them for all its ℓ·m samples
(`memory.kept_boundary_bytes`), L + 2 - j with a fused tail of j blocks (their outputs live
in one microbatch's graphs). Offloaded, the engine (`trainer/passes.py`,
`ActivationStore`) copies them over PCIe on a side stream, per microbatch:

* forward: each recomputed block's input goes to host (1 transfer, under a block's forward;
  a kept block's graph holds its input, so it sends none);
* backward: each recomputed block brings its input and its output's gradient back and sends
  its input's gradient out (3 transfers, under its recompute + backward); a kept block only
  the two gradients (under its backward without recompute), a block in the fused tail none;
  the head (or the fused tail) sends its input's gradient out and the embedding brings it
  back (2, under their backward).

A transfer hides under the compute it runs beside; what it takes beyond that compute is
added to the rank's step. Offloading also pins host memory, so the planner offloads only
where the boundaries do not fit the device: the memory-saving trick where memory needs it.
Without recompute (a plan's `recompute: false`) the kept graphs hold the boundaries on the
device already (their bytes are in `memory.kept_graph_bytes`): nothing to offload. A CPU
rank never offloads: its host memory is its memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from pydantic import ValidationError

from cephalo.api import memory
from cephalo.api.models import ModelConfig
from cephalo.api.plan import Plan, RankPlan
from cephalo.api.profile import GpuProfile
from cephalo.planner.cost.catalog import GpuType, gpu_key
from cephalo.planner.search.problem import Problem, gib

# PCIe 3.0 x16's usable rate: the slowest link a catalog GPU has, assumed where neither a
# profile nor the catalog says.
DEFAULT_HOST_LINK_BYTES_PER_SECOND = 12e9


@dataclass(frozen=True)
class OffloadDecision:
    offload: bool
    # What keeping the boundaries on the device takes (memory.kept_boundary_bytes, offload
    # False); 0 without recompute (counted already) or without samples.
    boundary_bytes: int
    # Whether the rank's memory plus those bytes fits its budget.
    fits: bool
    # Transfer seconds per step the compute does not hide (0 when kept).
    forward_extra_seconds: float = 0.0
    backward_extra_seconds: float = 0.0

    @property
    def extra_seconds(self) -> float:
        return self.forward_extra_seconds + self.backward_extra_seconds

    @property
    def device_bytes(self) -> int:
        """What the decision adds to the rank's device memory."""
        return 0 if self.offload else self.boundary_bytes


def host_link_bytes_per_second(profile: GpuProfile | None, gpu: GpuType | None) -> float:
    """The rank's host link: the profile's measurement, else the catalog's figure for the
    board, else PCIe 3.0 x16 (conservative: every catalog GPU has at least that)."""
    if profile is not None and profile.host_link_bytes_per_second:
        return float(profile.host_link_bytes_per_second)
    if gpu is not None and gpu.host_link_gbps:
        return gpu.host_link_gbps * 1e9
    return DEFAULT_HOST_LINK_BYTES_PER_SECOND


def transfers_per_microbatch(num_layers: int, kept_blocks: int = 0,
                             fused_blocks: int = 0) -> tuple[int, int]:
    """(to host, back to the device): the boundary copies of one microbatch's step, from the
    module docstring's list; the same number each way, all of one boundary's size.
    `fused_blocks` of the kept ones run per microbatch with the head (the engine's fused
    tail, `plan_fused_tail_blocks`): their gradients stay inside the graph."""
    recomputed = num_layers - kept_blocks
    # Forward: the recomputed blocks' inputs. Backward: every block's and the head's input
    # gradient out (one for a fused tail as a whole); the recomputed blocks' inputs, every
    # block's output gradient and the embedding's back in.
    to_host = recomputed + num_layers - fused_blocks + 1
    to_device = recomputed + num_layers - fused_blocks + 1
    return to_host, to_device


def transfer_extra_seconds(num_layers: int, micro_batch_size: int, num_micro_batches: int,
                           tokens_per_sample: int, hidden_size: int,
                           compute_seconds: Sequence[float], bandwidth_bytes_per_second: float,
                           kept_blocks: int = 0, fused_blocks: int = 0
                           ) -> tuple[float, float]:
    """(forward, backward) seconds per step that offloading adds beyond the compute hiding
    it, summed over units: per unit and microbatch max(0, transfers - compute).
    `compute_seconds`: one microbatch's block forward, block backward (recompute included),
    embedding+head forward and backward (GpuCostModel.compute_seconds at m). The last
    `fused_blocks` of the kept ones (the fused tail) transfer nothing of their own: the
    tail's input gradient goes out and comes back as the head's did."""
    if micro_batch_size == 0 or num_micro_batches == 0:
        return 0.0, 0.0
    if bandwidth_bytes_per_second <= 0:
        raise ValueError(f"host link bandwidth must be positive, got "
                         f"{bandwidth_bytes_per_second}")
    f, b, _, bo = (float(s) for s in compute_seconds)
    one = memory.boundary_bytes(micro_batch_size, tokens_per_sample,
                                hidden_size) / bandwidth_bytes_per_second
    recomputed = num_layers - kept_blocks
    forward = recomputed * max(0.0, one - f)
    backward = (recomputed * max(0.0, 3 * one - b)
                + (kept_blocks - fused_blocks) * max(0.0, 2 * one - max(b - f, 0.0))
                + max(0.0, 2 * one - bo))
    return num_micro_batches * forward, num_micro_batches * backward


def decide_offload(*, budget_bytes: float, memory_bytes: float, model: ModelConfig,
                   micro_batch_size: int, num_micro_batches: int,
                   compute_seconds: Sequence[float], bandwidth_bytes_per_second: float,
                   product: str, recompute: bool = True, kept_blocks: int = 0,
                   fused_blocks: int = 0) -> OffloadDecision:
    """Keep the boundaries on the device when `memory_bytes` (the rank's predicted memory
    with them offloaded) plus memory.kept_boundary_bytes for its ℓ·m samples fits
    `budget_bytes`; else offload them and price the transfers the compute does not hide.
    `fused_blocks`: the job's fused tail (plan_fused_tail_blocks)."""
    samples = micro_batch_size * num_micro_batches
    if not recompute or samples == 0:
        return OffloadDecision(False, 0, True)
    need = memory.kept_boundary_bytes(model.num_layers, samples, model.tokens_per_sample,
                                      model.hidden_size, offload=False,
                                      fused_blocks=fused_blocks)
    fits = memory_bytes + need <= budget_bytes
    if fits or gpu_key(product) == "cpu":
        return OffloadDecision(False, need, fits)
    forward, backward = transfer_extra_seconds(
        model.num_layers, micro_batch_size, num_micro_batches, model.tokens_per_sample,
        model.hidden_size, compute_seconds, bandwidth_bytes_per_second, kept_blocks,
        fused_blocks)
    return OffloadDecision(True, need, False, forward, backward)


def offload_plan(plan: Plan, problem: Problem) -> Plan:
    """`plan` with each rank's offload decision (the solver's last step): rank r of the plan
    is rank r of `problem` (the GPUs the plan uses: the solver's `choice.problem`)."""
    assert problem.world_size == plan.world_size, (problem.world_size, plan.world_size)
    fused = plan_fused_tail_blocks(plan)
    decisions = []
    links = []
    for r in plan.ranks:
        cost = problem.rank_cost(r.rank)
        m = max(r.micro_batch_size, 1)
        link = host_link_bytes_per_second(cost.profile, cost.gpu)
        links.append(link)
        decisions.append(decide_offload(
            budget_bytes=problem.rank_budget(r.rank),
            memory_bytes=float(r.predicted_memory_bytes or 0), model=problem.model,
            micro_batch_size=r.micro_batch_size, num_micro_batches=r.num_micro_batches,
            compute_seconds=cost.compute_seconds(np.array([m]))[:, 0].tolist(),
            bandwidth_bytes_per_second=link, product=r.gpu,
            recompute=plan.recompute is not False, kept_blocks=r.kept_blocks,
            fused_blocks=fused))
    return apply_offload(plan, decisions, links)


def plan_fused_tail_blocks(plan: Plan) -> int:
    """How many kept blocks the engine will run per microbatch with the head on every rank
    (cephalo.api.memory.fused_tail_blocks, from the same plan fields the trainer's layout
    carries); 0 for a plan without its model."""
    if plan.model is None or plan.recompute is False:
        return 0
    try:
        model = ModelConfig.model_validate(plan.model)
    except ValidationError:
        return 0
    return memory.fused_tail_blocks(
        [r.kept_blocks for r in plan.ranks], [r.batch_size for r in plan.ranks],
        [r.micro_batch_size for r in plan.ranks], model.tokens_per_sample, model.hidden_size,
        model.ffn_hidden_size, model.block_parameters(),
        [r.block_graph_bytes_per_sample for r in plan.ranks])


def apply_offload(plan: Plan, decisions: Sequence[OffloadDecision],
                  links_bytes_per_second: Sequence[float]) -> Plan:
    """`plan` with the decisions written in: each rank's `offload_activations`, its memory
    with the boundaries it keeps, its step with the transfers not hidden (and the plan's
    step and throughput when the slowest rank changes), notes for people."""
    ranks: list[RankPlan] = []
    notes = list(plan.notes)
    offloaded: dict[str, dict[str, float]] = {}
    for r, d, link in zip(plan.ranks, decisions, links_bytes_per_second, strict=True):
        update: dict[str, object] = {"offload_activations": d.offload}
        if r.predicted_memory_bytes is not None:
            update["predicted_memory_bytes"] = r.predicted_memory_bytes + d.device_bytes
        if r.compute_memory_bytes is not None:  # boundaries are compute memory, not state
            update["compute_memory_bytes"] = r.compute_memory_bytes + d.device_bytes
        if d.extra_seconds > 0 and r.predicted_step_seconds is not None:
            update["predicted_step_seconds"] = r.predicted_step_seconds + d.extra_seconds
            notes.append(
                f"rank {r.rank} ({r.gpu}) offloads its boundary activations "
                f"({gib(d.boundary_bytes)} would not fit): the host transfers at "
                f"{link / 1e9:.0f} GB/s add {d.extra_seconds:.4g} s per step beyond the "
                "compute that hides them")
        if not d.offload and not d.fits:
            notes.append(
                f"rank {r.rank} ({r.gpu}) keeps its boundary activations "
                f"({gib(d.boundary_bytes)}) in host memory, beyond its planned budget")
        if d.offload:
            offloaded[str(r.rank)] = {"boundary_bytes": d.boundary_bytes,
                                      "host_link_bytes_per_second": link,
                                      "unhidden_seconds": d.extra_seconds}
        ranks.append(r.model_copy(update=update))
    update_plan: dict[str, object] = {"ranks": ranks, "notes": notes}
    slowest = max((r.predicted_step_seconds or 0.0 for r in ranks), default=0.0)
    if plan.predicted_step_seconds is not None and slowest > plan.predicted_step_seconds:
        update_plan["predicted_step_seconds"] = slowest
        update_plan["predicted_samples_per_second"] = plan.global_batch_size / slowest
    if offloaded:
        update_plan["assumptions"] = {**plan.assumptions, "activation_offload": offloaded}
    return plan.model_copy(update=update_plan)


def _ranges(ranks: Sequence[int]) -> str:
    """'rank 3', 'ranks 0-5', 'ranks 0-2, 5'."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {text}"


def boundary_activations_line(plan: Plan) -> str:
    """Where the plan keeps each rank's boundary activations, for `cephalo plan`."""
    if plan.recompute is False:
        return "boundary activations: kept on the device (the kept graphs hold them)"
    kept = [r.rank for r in plan.ranks if r.offload_activations is False]
    off = [r.rank for r in plan.ranks if r.offload_activations]
    default = [r.rank for r in plan.ranks if r.offload_activations is None]
    parts = []
    if kept:
        parts.append(f"kept on the device ({_ranges(kept)})")
    if off:
        info = plan.assumptions.get("activation_offload")
        info = info if isinstance(info, dict) else {}
        sizes = [float(info.get(str(r), {}).get("boundary_bytes", 0)) for r in off]
        unhidden = {r: float(info.get(str(r), {}).get("unhidden_seconds", 0)) for r in off}
        why = ""
        if any(sizes):
            most = max(sizes)
            why = f": {'' if min(sizes) == most else 'up to '}{gib(most)} would not fit"
        text = f"offloaded to host ({_ranges(off)}{why})"
        worst = max(off, key=lambda r: unhidden[r])
        if unhidden[worst] > 0:
            text += (f", transfers add up to {unhidden[worst]:.4g} s per step beyond compute "
                     f"(rank {worst})")
        elif all(str(r) in info for r in off):  # priced by the planner, not set by hand
            text += ", transfers hidden under compute"
        parts.append(text)
    if default:
        # A hand-written plan's 'cpu' rank may run on any device: say what each kind does.
        parts.append(f"the engine's default: offloaded on a GPU, kept on a CPU "
                     f"({_ranges(default)})")
    return "boundary activations: " + "; ".join(parts)
