"""The cost model: per-GPU step time and memory as functions of microbatching, and ring
collectives. Pure numpy; every function here is vectorised over candidate (ℓ, m) pairs
because the solver scores thousands of them.

Step time of one GPU running ℓ microbatches of size m (the paper's Eqs. 2-3, extended with
the embedding+head pseudo-unit and the first, un-prefetchable AllGather):

    T(ℓ, m) = AG_emb
            + L · [u(F(ℓ, m), AG_block) + u(ℓ·b(m), AG_block + RS_block)]
            + u(F_o(ℓ, m), AG_head) + u(ℓ·b_o(m), AG_emb + RS_emb + RS_head)
            + P/N · adam + 2 all-reduces

b is one block's recompute+backward seconds and b_o that of head, loss and embedding, per
microbatch. A forward pass runs all ℓ microbatches through the unit in one go, so
F(ℓ, m) = c + ℓ·(f(m) - c), where f(m) is one microbatch's whole pass and c the part of it
paid once per pass (the profiler measures both); F_o likewise for embedding and data.

Communication for the next unit runs under the current unit's compute, so a unit costs
u(c, a) = max(c, a) + (1 - overlap) · min(c, a): whichever is longer when the overlap
is perfect (the paper's assumption, NCCL on its own stream), their sum when nothing overlaps
(gloo sharing two CPU cores with compute; the profiler measures the overlap). The optimizer
updates this GPU's state share (taken as the even share P/N, so that the time does not
depend on the partition chosen after it) and the step ends with two small all-reduces
(gradient norm + loss, and the per-rank timings the trainer logs).
A GPU with ℓ = 0 (state only) still takes part in every collective.
The step time of the job is the maximum over GPUs (collectives synchronise them).

Without recompute (`GpuCostModel.without_recompute`, a plan's `recompute: false`) the
forward keeps every block's graph and gathered unit for the backward: a block's backward
costs b - f per microbatch and gathers nothing (u(ℓ·(b - f), RS_block)), the embedding is
not gathered again, and the memory grows by `cephalo.api.memory.kept_graph_bytes`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from cephalo.api import memory

# The memory model is cephalo.api.memory's; its constants stay importable from here.
from cephalo.api.memory import COMM_BYTES_PER_PARAMETER
from cephalo.api.memory import STATE_BYTES_PER_PARAMETER as STATE_BYTES_PER_PARAMETER
from cephalo.api.models import ModelConfig
from cephalo.api.profile import GpuProfile, ProfilePoint, SingleRankStep, model_key
from cephalo.planner.catalog import GpuType, UnknownGpuError

# The paper measured uneven collectives at most 15% slower than even ones.
UNEVEN_COLLECTIVE_OVERHEAD = 0.15


@dataclass(frozen=True)
class CommModel:
    """Ring collectives: seconds = (n-1)/n · bytes / bandwidth + (n-1) · latency.

    AllGather and ReduceScatter may have their own (bandwidth, latency): a profiler measures
    both, and on gloo a ReduceScatter's fixed cost is several times an AllGather's. Without
    a measurement the step's small all-reduces cost 2(n-1) ring hops of latency each."""

    bandwidth_bytes_per_second: float
    latency_seconds: float
    uneven_overhead: float = UNEVEN_COLLECTIVE_OVERHEAD
    overlap_fraction: float = 1.0
    reduce_scatter_bandwidth_bytes_per_second: float | None = None
    reduce_scatter_latency_seconds: float | None = None
    all_reduce_seconds: float | None = None
    # Per step, what a measured real step took beyond this model's prediction of it (see
    # `calibrated`); added to every step on more than one GPU.
    step_overhead_seconds: float = 0.0

    def ring_seconds(self, num_bytes: float, world_size: int, uneven: bool,
                     kind: str = "all_gather") -> float:
        if world_size <= 1:
            return 0.0
        n = world_size
        bandwidth, latency = self.bandwidth_bytes_per_second, self.latency_seconds
        if kind == "reduce_scatter":
            bandwidth = self.reduce_scatter_bandwidth_bytes_per_second or bandwidth
            if self.reduce_scatter_latency_seconds is not None:
                latency = self.reduce_scatter_latency_seconds
        seconds = (n - 1) / n * num_bytes / bandwidth + (n - 1) * latency
        return seconds * (1.0 + self.uneven_overhead if uneven else 1.0)

    def calibrated(self, model: ModelConfig, costs: Iterable[GpuCostModel],
                   probe_step_seconds: float, world_size: int) -> CommModel:
        """This model plus the per-step overhead that makes its prediction of a measured
        probe step (one sample per rank, even shards, on `world_size` ranks of the fastest
        GPU type) come out exact. On NCCL the overhead is small; on gloo over a few shared
        CPU cores it holds what the per-collective fits cannot: ranks arriving at different
        times and the transport taking CPU from compute. It is never made negative enough to
        cancel more than the collectives' own modelled time."""
        unit = UnitComm.build(model, self, world_size, uneven=False)
        silent = replace(unit, ag_block=0.0, rs_block=0.0, ag_first=0.0, ag_head=0.0,
                         rs_other=0.0, all_reduce_seconds=0.0)
        one = np.ones(1)
        fastest = min(costs, key=lambda c: float(c.step_seconds(one, one, unit)[0]))
        predicted = float(fastest.step_seconds(one, one, unit)[0])
        collectives = predicted - float(fastest.step_seconds(one, one, silent)[0])
        overhead = max(probe_step_seconds - predicted, -collectives)
        return replace(self, step_overhead_seconds=overhead)

    def small_all_reduce_seconds(self, world_size: int) -> float:
        if world_size <= 1:
            return 0.0
        if self.all_reduce_seconds is not None:
            return self.all_reduce_seconds
        return 2 * (world_size - 1) * self.latency_seconds


@dataclass(frozen=True)
class UnitComm:
    """Seconds of each collective the step issues, for one world size and sharding.

    The engine gathers the embedding (exposed: nothing to hide it under), each block and the
    head in the forward pass; each block and the embedding again in the backward pass (the
    head's forward and backward are fused); and reduce-scatters every unit's gradient once."""

    ag_block: float
    rs_block: float
    ag_first: float  # the embedding unit, gathered in both passes
    ag_head: float
    rs_other: float  # embedding + head gradients: two collectives
    overlap_fraction: float = 1.0
    all_reduce_seconds: float = 0.0  # the step's fixed small all-reduces
    state_share_parameters: float = 0.0  # P / N: the optimizer's work per GPU
    step_overhead_seconds: float = 0.0  # measured, beyond the model (CommModel.calibrated)
    # Per-unit sharding (planner/unit_shards.py): `even_blocks` of the blocks are sharded
    # evenly and pay these even collectives; ag_block / rs_block price the other, skewed ones.
    even_blocks: int = 0
    ag_block_even: float = 0.0
    rs_block_even: float = 0.0

    @classmethod
    def build(cls, model: ModelConfig, comm: CommModel, world_size: int,
              uneven: bool) -> UnitComm:
        def ring(params: int, kind: str) -> float:
            return comm.ring_seconds(params * COMM_BYTES_PER_PARAMETER, world_size, uneven,
                                     kind)

        embedding, block, head = (model.embedding_parameters(), model.block_parameters(),
                                  model.head_parameters())
        # Two small all-reduces per step: [grad norm, loss], and the per-rank timings.
        all_reduce = 2 * comm.small_all_reduce_seconds(world_size)
        return cls(ag_block=ring(block, "all_gather"), rs_block=ring(block, "reduce_scatter"),
                   ag_first=ring(embedding, "all_gather"), ag_head=ring(head, "all_gather"),
                   rs_other=ring(embedding, "reduce_scatter") + ring(head, "reduce_scatter"),
                   overlap_fraction=comm.overlap_fraction, all_reduce_seconds=all_reduce,
                   state_share_parameters=model.total_parameters() / max(world_size, 1),
                   step_overhead_seconds=comm.step_overhead_seconds if world_size > 1 else 0.0)


class GpuCostModel:
    """Compute time and memory of one GPU type for one model, from a profile.

    Measured points are used as they are (interpolated between sizes); beyond the largest
    profiled size, time and memory grow linearly with the slope fitted on the upper half of
    the points, as the paper does (GPUs are saturated there)."""

    def __init__(self, gpu: GpuType | None, profile: GpuProfile, memory_capacity_bytes: int,
                 num_layers: int):
        self.gpu = gpu
        self.profile = profile
        self.estimated = profile.source == "estimated"
        self.memory_capacity_bytes = memory_capacity_bytes
        self.num_layers = num_layers
        pts = sorted(profile.points, key=lambda p: p.micro_batch_size)
        self._m = np.array([p.micro_batch_size for p in pts], dtype=np.float64)
        self._series = np.array([[p.block_forward_seconds, p.block_backward_seconds,
                                  p.other_forward_seconds, p.other_backward_seconds]
                                 for p in pts], dtype=np.float64).T  # shape (4, points)
        self._slopes = np.array([_upper_slope(self._m, s) for s in self._series])
        mem = np.array([p.compute_memory_bytes for p in pts], dtype=np.float64)
        self.memory_intercept_bytes, self.memory_slope_bytes = _linear_fit(self._m, mem)
        # Parts of the forward paid once per unit pass, not per microbatch (zero when the
        # profile did not separate them).
        self._forward_fixed = np.array([profile.block_forward_fixed_seconds or 0.0,
                                        profile.other_forward_fixed_seconds or 0.0])
        self.optimizer_seconds_per_parameter = profile.optimizer_seconds_per_parameter or 0.0
        self.optimizer_seconds_fixed = profile.optimizer_seconds_fixed or 0.0
        # The engine's own per-step work beyond units and optimizer: what the profiled real
        # step took beyond this model's prediction of it (none measured: none charged).
        self.step_fixed_seconds = 0.0
        # Recompute mode (the engine's default); `without_recompute` prices the other.
        self.recompute = True
        self._kept_bytes_per_sample = 0.0
        self._kept_fixed_bytes = 0.0
        probe = profile.single_rank_step
        if probe is not None:
            self.step_fixed_seconds = max(0.0, probe.seconds - self.modelled_seconds(probe))

    def modelled_seconds(self, probe: SingleRankStep) -> float:
        """This model's prediction of a single-rank step like `probe`, without the step
        overhead: one microbatch through every unit (no collectives, the fixed part of a
        forward paid once as in any one-microbatch pass) and the optimizer on all of
        `probe.parameters`."""
        f, b, fo, bo = self.compute_seconds(np.array([probe.micro_batch_size]))[:, 0]
        return float(probe.num_blocks * (f + b) + fo + bo + self.optimizer_seconds_fixed +
                     self.optimizer_seconds_per_parameter * probe.parameters)

    def without_recompute(self, model: ModelConfig) -> GpuCostModel:
        """This GPU priced in the engine's no-recompute mode: its graphs and the gathered
        embedding and blocks stay alive from forward to backward (memory.kept_graph_bytes,
        linear in the rank's samples)."""
        kept = copy.copy(self)
        kept.recompute = False
        dims = (model.tokens_per_sample, model.hidden_size, model.ffn_hidden_size)
        kept._kept_bytes_per_sample = float(memory.kept_graph_bytes(model.num_layers, 1,
                                                                    *dims, 0))
        kept._kept_fixed_bytes = float(memory.kept_graph_bytes(
            model.num_layers, 0, *dims, sum(model.unit_parameters()[:-1])))
        return kept

    def compute_seconds(self, m: np.ndarray) -> np.ndarray:
        """(4, len(m)) array: block fwd, block bwd, other fwd, other bwd seconds per microbatch."""
        m = np.asarray(m, dtype=np.float64)
        top = self._m[-1]
        out = np.empty((4, m.size))
        for k in range(4):
            inside = np.interp(m, self._m, self._series[k])
            out[k] = np.where(m > top, self._series[k, -1] + self._slopes[k] * (m - top), inside)
        return out

    def compute_memory_bytes(self, m: np.ndarray, ell: np.ndarray | int = 1) -> np.ndarray:
        """Peak memory beyond the training state; linear in m (independent of ℓ because
        boundary activations are offloaded). m = 0 (state only) keeps the fixed part.
        Without recompute it grows with the rank's ℓ·m samples (ℓ defaults to 1: the least
        any rank with work holds, a lower bound where only m is known)."""
        m = np.asarray(m, dtype=np.float64)
        base = np.maximum(self.memory_intercept_bytes + self.memory_slope_bytes * m, 0.0)
        if self.recompute:
            return base
        samples = m * np.asarray(ell, dtype=np.float64)
        return base + self._kept_fixed_bytes + self._kept_bytes_per_sample * samples

    def step_seconds(self, ell: np.ndarray, m: np.ndarray, comm: UnitComm) -> np.ndarray:
        """T(ℓ, m) of the module docstring, vectorised; ℓ = 0 means a state-only GPU."""
        ell = np.asarray(ell, dtype=np.float64)
        f, b, fo, bo = self.compute_seconds(np.maximum(m, 1)) * ell
        ag_back, ag_first_back = comm.ag_block, comm.ag_first
        if not self.recompute:
            # The backward reuses the forward's graphs: no recompute, no second gather.
            b = np.maximum(b - f, 0.0)
            ag_back, ag_first_back = 0.0, 0.0
        # A forward pass runs all ℓ microbatches through a unit at once: its fixed part is
        # paid once, not ℓ times (a profile point is one microbatch's whole pass).
        busy = ell > 0
        f = f - np.where(busy, (ell - 1) * self._forward_fixed[0], 0.0)
        fo = fo - np.where(busy, (ell - 1) * self._forward_fixed[1], 0.0)
        hidden = comm.overlap_fraction

        def unit(compute: np.ndarray, collective: float) -> np.ndarray:
            return np.maximum(compute, collective) + (1.0 - hidden) * np.minimum(compute,
                                                                                 collective)

        per_block = unit(f, comm.ag_block) + unit(b, ag_back + comm.rs_block)
        blocks = self.num_layers * per_block
        if comm.even_blocks:  # a mixed per-unit plan: some blocks skip the uneven overhead
            ag_even_back = comm.ag_block_even if self.recompute else 0.0
            per_even = unit(f, comm.ag_block_even) + \
                unit(b, ag_even_back + comm.rs_block_even)
            blocks = comm.even_blocks * per_even + (self.num_layers - comm.even_blocks) * per_block
        # The embedding's forward hides the first block's gather, the last block's forward
        # the head's: per pass, L + 1 gathers overlap compute. Charging the head's gather
        # to the embedding+head compute keeps the count exact.
        other = unit(fo, comm.ag_head) + unit(bo, ag_first_back + comm.rs_other)
        fixed = comm.ag_first + comm.all_reduce_seconds + self.optimizer_seconds(comm) + \
            comm.step_overhead_seconds + self.step_fixed_seconds
        return fixed + blocks + other

    def optimizer_seconds(self, comm: UnitComm) -> float:
        return self.optimizer_seconds_fixed + \
            self.optimizer_seconds_per_parameter * comm.state_share_parameters

    def accumulation_step_seconds(self, ell: np.ndarray, m: np.ndarray,
                                  comm: UnitComm) -> np.ndarray:
        """FSDP's own gradient accumulation: every microbatch gathers every unit again and
        reduce-scatters its gradient (the paper's FSDP-GA baseline); the optimizer and the
        step's all-reduces still run once."""
        fixed = comm.all_reduce_seconds + self.optimizer_seconds(comm) + \
            comm.step_overhead_seconds + self.step_fixed_seconds
        per_micro = self.step_seconds(np.ones_like(m), m, comm) - fixed
        return np.asarray(ell, dtype=np.float64) * per_micro + fixed


def step_overhead_seconds(profile: GpuProfile) -> float:
    """The engine's per-step work beyond units and optimizer that `profile`'s measured
    single-rank step shows (0 when it measured none): the planner's reading of it."""
    return GpuCostModel(None, profile, profile.memory_capacity_bytes, 0).step_fixed_seconds


def modelled_single_rank_step_seconds(profile: GpuProfile) -> float | None:
    """What this cost model predicts for `profile`'s measured single-rank step, without the
    step overhead (None: the profile measured no such step)."""
    if profile.single_rank_step is None:
        return None
    cost = GpuCostModel(None, profile, profile.memory_capacity_bytes, 0)
    return cost.modelled_seconds(profile.single_rank_step)


def _linear_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares (intercept, slope) with slope >= 0; one point: zero slope."""
    if x.size < 2 or np.ptp(x) == 0:
        return float(y.mean()), 0.0
    slope, intercept = np.polyfit(x, y, 1)
    if slope < 0:
        return float(y.mean()), 0.0
    return float(intercept), float(slope)


def _upper_slope(x: np.ndarray, y: np.ndarray) -> float:
    """Slope of the saturated (upper-half) part of a profile, for extrapolation."""
    half = max(2, math.ceil(x.size / 2))
    _, slope = _linear_fit(x[-half:], y[-half:])
    if slope == 0.0 and x.size >= 1 and x[-1] > 0:
        slope = float(y[-1] / x[-1])  # a flat tail would be free compute: assume proportional
    return slope


# ---- analytic estimate when no profile was measured ------------------------------------

# Rows (tokens) per microbatch at which a block reaches half its large-batch efficiency. On
# CUDA cores (fp32) a 512-token sample already fills the GPU: the authors measured per-sample
# time at m = 1 within ~5 % of m = 8 (V100, GPT-6.7B: 17.3 vs 17.4 ms). Tensor cores (bf16)
# need bigger tiles: their per-sample time at m = 1 is 1.3-1.9x that at m = 8.
_HALF_EFFICIENCY_TOKENS = {"fp32": 16.0, "bf16": 512.0}
_KERNEL_LAUNCH_SECONDS = 12 * 10e-6  # ~12 kernels per block pass at ~10 µs each
_WORKSPACE_BYTES = 256 * 1024**2
# Activations one block keeps per token for its recompute + backward, in units of
# (2 x ffn width + 4 x hidden width) elements: the MLP's wide tensors (input of the
# activation and its output) and the hidden-width ones (norms, attention output, residual).
# Attention scores are not materialised: SDPA's fused kernels keep them on chip. Calibrated
# on the authors' measured compute memory (ViT-e: 0.108 GiB per sample vs 0.11 estimated).
_BLOCK_ACTIVATION_FACTOR = 1.5
# The loss keeps three logits-sized fp32 tensors per token (logits, softmax, their gradient).
_HEAD_LOGIT_COPIES = 3


def estimate_profile(gpu: GpuType, model: ModelConfig, precision: str,
                     micro_batch_sizes: Iterable[int] = range(1, 9)) -> GpuProfile:
    """A GpuProfile from the catalog's measured efficiency and the model's FLOPs (marked
    `estimated`). A GPU outside the catalog has no figures to estimate from: it must be
    profiled (UnknownGpuError says how)."""
    if not gpu.in_catalog:
        raise UnknownGpuError(
            f"GPU {gpu.name!r} is not in the catalog, so its speed cannot be estimated: "
            "measure a profile of it (the operator profiles every GPU product; locally run "
            "`python -m cephalo.trainer.profile` on it) and pass the folder with --profiles")
    achieved = gpu.achieved_flops(precision)
    half = _HALF_EFFICIENCY_TOKENS.get(precision, _HALF_EFFICIENCY_TOKENS["fp32"])
    elem_bytes = 2 if precision == "bf16" else 4
    tokens = model.tokens_per_sample
    h, f = model.hidden_size, model.ffn_hidden_size
    block_act = _BLOCK_ACTIVATION_FACTOR * tokens * (2 * f + 4 * h) * elem_bytes
    head_act = _HEAD_LOGIT_COPIES * tokens * (model.vocab_size or 0) * 4
    # Two boundary activations in flight to / from host memory (fp32 in both precisions).
    boundary = 2 * memory.boundary_bytes(1, tokens, h)
    fixed = memory.unit_buffer_bytes(max(model.unit_parameters())) + _WORKSPACE_BYTES
    weight_read = model.block_parameters() * elem_bytes / (gpu.memory_bandwidth_gbps * 1e9)
    points = []
    for m in sorted(set(micro_batch_sizes)):
        fill = m * tokens / (m * tokens + half)
        # Roofline: a pass is bound by its FLOPs or by reading the block's weights, whichever
        # is slower (large models: FLOPs at any m, so per-sample time is flat in m).
        fwd = max(model.block_forward_flops() * m / (achieved * fill), weight_read) + \
            _KERNEL_LAUNCH_SECONDS
        other = model.other_forward_flops() * m / (achieved * fill) + 4 * _KERNEL_LAUNCH_SECONDS
        points.append(ProfilePoint(
            micro_batch_size=m, block_forward_seconds=fwd, block_backward_seconds=3 * fwd,
            other_forward_seconds=other, other_backward_seconds=2 * other,
            compute_memory_bytes=int(fixed + m * (block_act + head_act + boundary))))
    # AdamW reads and writes parameter, gradient and two moments: memory-bound.
    adam = 2 * memory.state_bytes_per_parameter(precision) / (gpu.memory_bandwidth_gbps * 1e9)
    return GpuProfile(product=gpu.name, memory_capacity_bytes=gpu.memory_bytes,
                      source="estimated", model_key=model_key(model.architecture_key(), precision),
                      precision=precision, points=points,  # type: ignore[arg-type]
                      optimizer_seconds_per_parameter=adam)
