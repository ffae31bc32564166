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
A GPU with ℓ = 0 (state only) still takes part in every collective. Under hybrid sharding
(planner/search/hybrid.py) a unit's forward gather waits its cross-group all-gather too: each
block's forward collective is AG_block + X_block (`UnitComm.cross_ag_block`) and the first
unit's X (`cross_ag_first`) is exposed next to AG_emb; each unit's backward collective is
its group's gather and reduce-scatter with the cross-group collective of its slice gradient
Y (`cross_rs_block`, `cross_rs_other`): max(AG_block + RS_block, Y_block) where Y rides a
link of its own (every group one node), AG_block + RS_block + Y_block where it shares the
NICs with the group's ring (`UnitComm.backward_collectives`). The embedding's Y
(`cross_rs_last`) is exposed: its gradient is the backward's last, and nothing is left to
hide it under. (The engine starts each unit's Y when the next unit's reduce-scatter is
issued, so the first block's is exposed too; the model hosts it under a block's backward,
where the head's runs: one block's Y at most under-charged where the windows have room.)
The step time of the job is the maximum over GPUs (collectives synchronise them).

Without recompute (`GpuCostModel.without_recompute`, a plan's `recompute: false`) the
forward keeps every block's graph and gathered unit for the backward: a block's backward
costs b - f per microbatch and gathers nothing (u(ℓ·(b - f), RS_block)), the embedding is
not gathered again, and the memory grows by `cephalo.api.memory.kept_graph_bytes`.

In recompute mode a rank may keep the graphs of its last k blocks (a rank plan's
`kept_blocks`): such a block's backward costs b - f per microbatch but still gathers
(u(ℓ·(b - f), AG_block + RS_block)), and the rank's memory grows by
`cephalo.api.memory.kept_blocks_bytes` for its ℓ·m samples. The first e blocks of a
per-unit plan are sharded evenly, so max(0, e + k - L) blocks are both kept and even: the
step prices the four kinds (even or skewed, kept or recomputed) by their counts. These are
upper bounds: the engine runs the last blocks that every rank keeps per microbatch with the
head instead, gathered once, wherever that holds no more memory
(`cephalo.api.memory.fused_tail_blocks`); pricing that tail would need every rank's choice at
once, which the per-rank search does not have. Its whole-model case is a job-wide mode of its
own (`GpuCostModel.fused_everything`): every working rank keeps all L blocks and the engine
runs them all per microbatch, so a block's backward costs b - f and gathers nothing
(u(ℓ·(b - f), RS_block)) while the embedding is still recomputed, and the memory grows by
`cephalo.api.memory.fused_tail_bytes` for one microbatch — where the engine would fuse.
"""

from __future__ import annotations

import copy
import functools
import math

import numpy as np

from cephalo.api import memory
from cephalo.api.models import ModelConfig
from cephalo.api.profile import GpuProfile, SingleRankStep
from cephalo.planner.cost.catalog import GpuType

# The collectives' model (comm_model) sits below this one: it prices a step through the
# `StepPricer` protocol it declares, so it never imports this module back.
from cephalo.planner.cost.comm_model import UnitComm

# How many distinct size arrays one cost model remembers compute_seconds for, and the
# largest it remembers (a search asks for a few dozen small ones again and again; the
# bounds keep a plan's memory, limited in the operator's planning process, within ~8 MiB).
_COMPUTE_MEMO_ENTRIES = 256
_COMPUTE_MEMO_SIZES = 1024


class GpuCostModel:
    """Compute time and memory of one GPU type for one model, from a profile.

    Measured points are used as they are (interpolated between sizes); beyond the largest
    profiled size, time and memory grow linearly with the slope fitted on the upper half of
    the points, as the paper does (GPUs are saturated there)."""

    def __init__(self, gpu: GpuType | None, profile: GpuProfile, memory_capacity_bytes: int,
                 num_layers: int, model: ModelConfig | None = None):
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
        # Recompute mode (the engine's default); `without_recompute` prices the other, and
        # `fused_everything` recompute mode with every block in the engine's fused tail.
        self.recompute = True
        self.fused_all = False
        self._fused_fixed_bytes = 0.0
        self._kept_bytes_per_sample = 0.0
        self._kept_fixed_bytes = 0.0
        # One kept block's graph per sample (recompute mode's `kept_blocks`): the profile's
        # measurement, else the estimate from the model's dimensions (None: no model given,
        # no block can be kept). Measured figures are rounded per rank as the API does.
        self._graph_measured = profile.block_graph_bytes_per_sample
        self._graph_bytes_per_sample: float | None = None
        if self._graph_measured is not None:
            self._graph_bytes_per_sample = float(self._graph_measured)
        elif model is not None:
            self._graph_bytes_per_sample = float(memory.block_graph_bytes(
                1, model.tokens_per_sample, model.hidden_size, model.ffn_hidden_size))
        # compute_seconds' answers by sizes; shared with the mode copies (without_recompute,
        # fused_everything), whose compute time is the same function of m.
        self._compute_memo: dict[bytes, np.ndarray] = {}
        probe = profile.single_rank_step
        if probe is not None:
            self.step_fixed_seconds = max(0.0, probe.seconds - self.modelled_seconds(probe))

    @property
    def largest_profiled_size(self) -> int:
        """The largest micro-batch size the profile has a point for (beyond: extrapolated)."""
        return int(self._m[-1])

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
        linear in the rank's samples; the profile's measured block graph when it has one)."""
        kept = copy.copy(self)
        kept.recompute = False
        dims = (model.tokens_per_sample, model.hidden_size, model.ffn_hidden_size)
        # Per sample; the measured graph size unrounded (the API rounds per rank's samples).
        kept._kept_bytes_per_sample = float(memory.kept_graph_bytes(
            model.num_layers, 1, *dims, 0)) if self._graph_measured is None else (
            model.num_layers * float(self._graph_measured)
            + (model.num_layers + 2) * memory.boundary_bytes(1, *dims[:2]))
        kept._kept_fixed_bytes = float(memory.kept_graph_bytes(
            model.num_layers, 0, *dims, sum(model.unit_parameters()[:-1])))
        return kept

    def fused_everything(self, model: ModelConfig) -> GpuCostModel | None:
        """This GPU priced with every block in the engine's fused tail (a plan keeping all L
        blocks on every working rank, where memory.fused_tail_blocks then runs them all per
        microbatch with the head): no recompute and no second gather of a block (the
        embedding is still recomputed and gathered again), one microbatch's block graphs
        and every block's parameters and gradient held (memory.fused_tail_bytes). Only where
        that holds no more than layered graphs would, which is when the engine runs it;
        elsewhere a candidate does not fit. None where no graph size is known."""
        if self._graph_bytes_per_sample is None or self.num_layers == 0:
            return None
        fused = copy.copy(self)
        fused.recompute = False  # priced as keep-everything's blocks, see step_seconds
        fused.fused_all = True
        fused._fused_fixed_bytes = float(memory.fused_tail_bytes(
            self.num_layers, 0, model.tokens_per_sample, model.hidden_size,
            model.ffn_hidden_size, model.block_parameters()))
        return fused

    def _fused_memory_bytes(self, base: np.ndarray, m: np.ndarray,
                            ell: np.ndarray | None) -> np.ndarray:
        """compute_memory_bytes of the fused-everything mode: `ell` None is the lower bound
        for m alone (no check that the engine would fuse)."""
        layers = self.num_layers
        tail = self._fused_fixed_bytes + layers * self.block_graph_bytes(m)
        out = np.where(m > 0, base + tail, base)
        if ell is None:
            return out
        # The engine fuses only where that costs no more than the layered graphs (with the
        # same rounding: memory.fused_tail_blocks); elsewhere the plan could not be run.
        layered = layers * self.block_graph_bytes(m * np.asarray(ell, dtype=np.float64))
        return np.where((m > 0) & (tail > layered), np.inf, out)

    def compute_seconds(self, m: np.ndarray) -> np.ndarray:
        """(4, len(m)) array: block fwd, block bwd, other fwd, other bwd seconds per microbatch.
        Read-only: the searches ask for the same few sizes again and again (every candidate's
        step_seconds), so each answer is kept, keyed by the sizes' float64 bytes."""
        m = np.asarray(m, dtype=np.float64)
        key = m.tobytes()
        out = self._compute_memo.get(key)
        if out is not None:
            return out
        top = self._m[-1]
        out = np.empty((4, m.size))
        for k in range(4):
            inside = np.interp(m, self._m, self._series[k])
            out[k] = np.where(m > top, self._series[k, -1] + self._slopes[k] * (m - top), inside)
        out.flags.writeable = False  # shared by every caller that asks for these sizes
        if m.size <= _COMPUTE_MEMO_SIZES:
            if len(self._compute_memo) >= _COMPUTE_MEMO_ENTRIES:
                self._compute_memo.clear()  # bounded: keeps only the recent sizes
            self._compute_memo[key] = out
        return out

    def compute_memory_bytes(self, m: np.ndarray, ell: np.ndarray | int | None = None,
                             kept: np.ndarray | None = None) -> np.ndarray:
        """Peak memory beyond the training state; linear in m (independent of ℓ because
        boundary activations are offloaded). m = 0 (state only) keeps the fixed part.
        Without recompute it grows with the rank's ℓ·m samples (ℓ None counts 1: the least
        any rank with work holds, a lower bound where only m is known). `kept` (recompute
        mode): the blocks whose graphs each candidate keeps, for all its ℓ·m samples. The
        fused-everything mode holds one microbatch's graphs; a candidate the engine would
        not fuse costs infinite memory."""
        m = np.asarray(m, dtype=np.float64)
        base = np.maximum(self.memory_intercept_bytes + self.memory_slope_bytes * m, 0.0)
        if self.fused_all:
            return self._fused_memory_bytes(base, m, None if ell is None else np.asarray(ell))
        ell = 1 if ell is None else ell
        if self.recompute:
            if kept is None:
                return base
            return base + self.kept_blocks_bytes(kept, m * np.asarray(ell, dtype=np.float64))
        samples = m * np.asarray(ell, dtype=np.float64)
        return base + self._kept_fixed_bytes + self._kept_bytes_per_sample * samples

    @property
    def can_keep_blocks(self) -> bool:
        """Whether this model prices kept blocks (recompute mode, graph bytes known)."""
        return self.recompute and self._graph_bytes_per_sample is not None \
            and self.num_layers > 0

    def block_graph_bytes(self, samples: np.ndarray) -> np.ndarray:
        """One block's kept graph for `samples` samples (memory.block_graph_bytes)."""
        samples = np.asarray(samples, dtype=np.float64)
        if self._graph_bytes_per_sample is None:
            return np.full(samples.shape, np.inf)
        per = samples * self._graph_bytes_per_sample
        return np.round(per) if self._graph_measured is not None else per

    def kept_blocks_bytes(self, kept: np.ndarray, samples: np.ndarray) -> np.ndarray:
        """memory.kept_blocks_bytes, vectorised: `kept` block graphs for `samples` samples."""
        kept = np.asarray(kept, dtype=np.float64)
        return np.where(kept > 0, kept * self.block_graph_bytes(samples), 0.0)

    def max_kept_blocks(self, m: np.ndarray, ell: np.ndarray, room_bytes: float,
                        base_bytes: np.ndarray | None = None) -> np.ndarray:
        """Per candidate, the most blocks (≤ L) whose graphs fit in `room_bytes` next to its
        compute memory (`base_bytes`, compute_memory_bytes(m), when the caller has it; 0
        where none fits, for a state-only rank, or outside recompute)."""
        m = np.asarray(m, dtype=np.float64)
        if not self.can_keep_blocks:
            return np.zeros(m.shape, dtype=np.int64)
        per = self.block_graph_bytes(m * np.asarray(ell, dtype=np.float64))
        base = self.compute_memory_bytes(m) if base_bytes is None else base_bytes
        with np.errstate(divide="ignore", invalid="ignore"):
            most = np.floor((room_bytes - base) / per)  # no samples: 0/0 or x/0, cleared
        most = np.clip(np.where(per > 0, most, 0.0), 0, self.num_layers)
        # Floating point: the count must fit by the same sum compute_memory_bytes makes.
        most -= (base + most * per > room_bytes) & (most > 0)
        return most.astype(np.int64)

    def step_seconds(self, ell: np.ndarray, m: np.ndarray, comm: UnitComm,
                     kept: np.ndarray | None = None,
                     per_micro: np.ndarray | None = None) -> np.ndarray:
        """T(ℓ, m) of the module docstring, vectorised; ℓ = 0 means a state-only GPU.
        `kept` (recompute mode): per candidate, how many of the last blocks keep their
        graphs (their backward skips the recompute, not the gather). `per_micro`:
        compute_seconds(max(m, 1)) when the caller has it (a bisection over ℓ)."""
        if per_micro is None:
            per_micro = self.compute_seconds(np.maximum(m, 1))
        seconds = self._step_seconds(ell, comm, kept, per_micro)
        if comm.step_overhead_seconds >= 0.0:
            return seconds
        # A negative overhead (the model over-predicted the measured probe step) takes back at
        # most this step's own exposed collectives. The probe, one sample per rank, hides
        # almost none of them under compute; a larger step hides most, and the probe's whole
        # share priced it below its compute alone, negative on a slow link
        # (tests/unit/test_costmodel.py).
        return np.maximum(seconds, self._step_seconds(ell, comm.silent(), kept, per_micro))

    def _step_seconds(self, ell: np.ndarray, comm: UnitComm, kept: np.ndarray | None,
                      per_micro: np.ndarray) -> np.ndarray:
        ell = np.asarray(ell, dtype=np.float64)
        f, b, fo, bo = per_micro * ell
        ag_back, ag_first_back = comm.ag_block, comm.ag_first
        if kept is not None and not np.any(kept):
            kept = None  # k = 0 everywhere: the same sums without the kept terms
        # A kept block's backward: no recompute (only where some block is kept).
        b_kept = np.maximum(b - f, 0.0) if kept is not None or not self.recompute else b
        if not self.recompute:
            kept = None
            # The backward reuses the forward's graphs: no recompute, no second gather (the
            # fused tail's embedding is still recomputed: gathered again).
            b = b_kept
            ag_back, ag_first_back = 0.0, (comm.ag_first if self.fused_all else 0.0)
        # A forward pass runs all ℓ microbatches through a unit at once: its fixed part is
        # paid once, not ℓ times (a profile point is one microbatch's whole pass). Skipped
        # where the profile separated none: subtracting zeros leaves the same numbers.
        busy = ell > 0
        if self._forward_fixed[0]:
            f = f - np.where(busy, (ell - 1) * self._forward_fixed[0], 0.0)
        if self._forward_fixed[1]:
            fo = fo - np.where(busy, (ell - 1) * self._forward_fixed[1], 0.0)
        hidden = comm.overlap_fraction

        def unit(compute: np.ndarray, collective: float) -> np.ndarray:
            if hidden == 1.0:  # perfect overlap (NCCL): the longer of the two, half the work
                return np.maximum(compute, collective)
            return np.maximum(compute, collective) + (1.0 - hidden) * np.minimum(compute,
                                                                                 collective)

        layers, even = self.num_layers, comm.even_blocks
        # Kept blocks are the last k, even ones the first e: `both` are kept and even.
        k = 0.0 if kept is None else np.asarray(kept, dtype=np.float64)
        both = np.maximum(0.0, even + k - layers) if even else 0.0
        # A block's forward gather waits its cross-group all-gather first (hybrid; else 0).
        ag_forward = comm.ag_block + comm.cross_ag_block
        # A block's backward: its group's gather and reduce-scatter, and (hybrid) the
        # cross-group collective of its slice, beside them or after them (UnitComm).
        backward = comm.backward_collectives
        cross = comm.cross_rs_block
        per_block = unit(f, ag_forward) + unit(b, backward(ag_back, comm.rs_block, cross))
        blocks = (layers - k) * per_block
        if even:  # a mixed per-unit plan: some blocks skip the uneven overhead
            ag_even_back = comm.ag_block_even if self.recompute else 0.0
            per_even = unit(f, comm.ag_block_even + comm.cross_ag_block) + \
                unit(b, backward(ag_even_back, comm.rs_block_even, cross))
            blocks = (even - both) * per_even + (layers - even - (k - both)) * per_block
        if kept is not None:  # (k = 0 adds exact zeros: the same sums as without `kept`)
            blocks = blocks + (k - both) * (
                unit(f, ag_forward) + unit(b_kept, backward(comm.ag_block, comm.rs_block, cross)))
            if even:
                blocks = blocks + both * (
                    unit(f, comm.ag_block_even + comm.cross_ag_block) +
                    unit(b_kept, backward(comm.ag_block_even, comm.rs_block_even, cross)))
        # The embedding's forward hides the first block's gather, the last block's forward
        # the head's: per pass, L + 1 gathers overlap compute. Charging the head's gather
        # to the embedding+head compute keeps the count exact.
        other = unit(fo, comm.ag_head) + \
            unit(bo, backward(ag_first_back, comm.rs_other, comm.cross_rs_other))
        # The first unit's forward gathers are exposed (hybrid: its cross all-gather too).
        # (Hybrid: the embedding's cross-group collective, after the whole backward, too.)
        fixed = comm.ag_first + comm.cross_ag_first + comm.cross_rs_last + \
            comm.all_reduce_seconds + \
            self.optimizer_seconds(comm) + \
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
    return _linear_fit_of(np.asarray(x, dtype=np.float64).tobytes(),
                          np.asarray(y, dtype=np.float64).tobytes())


@functools.lru_cache(maxsize=4096)
def _linear_fit_of(x_bytes: bytes, y_bytes: bytes) -> tuple[float, float]:
    """_linear_fit by the points' float64 bytes: every plan builds the same profiles' cost
    models again (each subset and mode of the GPUs), and a fit is a least-squares solve."""
    x, y = np.frombuffer(x_bytes), np.frombuffer(y_bytes)
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
