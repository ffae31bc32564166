"""The memory model: what one rank's device holds during a training step, stated once.

The engine's own accounting (`cephalo.trainer.engine.Engine.memory_estimate_bytes`), the
profiler (`cephalo.trainer.profile_units`, whose compute memory includes the unit buffers)
and the planner (`cephalo.planner.cost.costmodel`, `problem`, `solver`) all read these figures;
torch-free so the operator side can. tests/unit/test_memory_model.py holds the engine's
measured peak against them.

What a rank holds, from the engine's allocations (trainer/engine.py, optim.py,
collectives.py):

* training state, per parameter of its shards: the fp32 master weight, AdamW's two fp32
  moments (`ShardedAdamW`) and the fp32 gradient shard a reduce-scatter hands it, kept
  until the optimizer step. bf16 runs autocast over the same fp32 masters, so the state is
  16 bytes per parameter in both precisions;
* gathered unit buffers, fp32 in both precisions (a gather has the shards' dtype): during
  a unit's backward the current unit, its full gradient, the gradient of the microbatch
  being added to it (autograd hands a parameter's gradient over as one new full buffer,
  then adds it in place), the next unit's prefetched gather and the previous unit's
  gradient, whose reduce-scatter the engine lets run under this unit's backward (one at a
  time) — five buffers of at most the largest unit (with one microbatch, four);
* boundary activations, one per unit output per microbatch, fp32 in both precisions (the
  residual stream stays fp32 under autocast). Offloaded to host on GPUs; otherwise the
  forward keeps every unit's output until its backward, plus a gradient in flight;
* on top, the working set of one unit's compute for one microbatch (measured by the
  profiler per microbatch size).
"""

from __future__ import annotations

FP32_BYTES = 4
# Master weight + AdamW exp_avg + exp_avg_sq + reduce-scattered gradient shard, all fp32.
_STATE_BYTES = {"fp32": 4 * FP32_BYTES, "bf16": 4 * FP32_BYTES, "fp16": 4 * FP32_BYTES}
# A job's "auto" (each rank in its GPU's fastest precision) keeps the same fp32 state.
_STATE_BYTES["auto"] = _STATE_BYTES["fp32"]
STATE_BYTES_PER_PARAMETER = _STATE_BYTES["fp32"]
# Parameters are gathered and gradients reduce-scattered in fp32 in every precision.
COMM_BYTES_PER_PARAMETER = FP32_BYTES
# Current unit, its gradient, a microbatch's gradient being added to it, the prefetched next
# unit, the previous unit's gradient under its reduce-scatter.
UNIT_BUFFERS_AT_PEAK = 5
BOUNDARY_BYTES_PER_ELEMENT = FP32_BYTES


def state_bytes_per_parameter(precision: str) -> int:
    """Bytes of training state per parameter a rank owns."""
    return _STATE_BYTES[precision]


def activation_bytes_per_element(precision: str) -> int:
    """Bytes of one element of a block's own activations (its compute working set): 2 under
    16-bit autocast (bf16, fp16), else 4. Boundary activations stay fp32 in every precision
    (the residual stream is not autocast): BOUNDARY_BYTES_PER_ELEMENT."""
    return 2 if precision in ("bf16", "fp16") else FP32_BYTES


def state_bytes(owned_parameters: float, precision: str = "fp32") -> float:
    return state_bytes_per_parameter(precision) * owned_parameters


# Hybrid sharding (docs/hybrid-sharding.md): the fp32 slice a rank's group gathers from.
HYBRID_SLICE_BYTES_PER_PARAMETER = FP32_BYTES


def hybrid_state_bytes(owned_parameters_in_group: float, groups: int, precision: str,
                       replicated_fraction: float = 0.0) -> float:
    """Training state of a rank under hybrid sharding across `groups` replica groups, where
    it holds `owned_parameters_in_group` (n_j) of its group's shard: the whole fp32 slice
    (what its group's all-gathers read, 4 n_j) and the master, Adam moments and gradient
    (16 bytes a parameter: `state_bytes`) of its piece of the sharded part of the slice,
    (1 - a) n_j / G, and of all of the replicated part, a n_j (a: the plan's
    `replicated_fraction`). In every precision (the state is fp32 in all). With one group
    the slice is the master: `state_bytes(n_j)` exactly."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    if not 0.0 <= replicated_fraction <= 1.0:
        raise ValueError(f"replicated_fraction must be in [0, 1], got {replicated_fraction}")
    if groups == 1:
        return state_bytes(owned_parameters_in_group, precision)
    # Summed in this order so that a = 0 is n_j / G to the last bit (the plans of the
    # planner before the fraction, byte for byte).
    owned = owned_parameters_in_group * replicated_fraction + \
        owned_parameters_in_group * (1.0 - replicated_fraction) / groups
    return (HYBRID_SLICE_BYTES_PER_PARAMETER * owned_parameters_in_group
            + state_bytes(owned, precision))


def unit_buffer_bytes(largest_unit_parameters: int) -> int:
    """Peak bytes of gathered unit buffers (parameters and full gradients) on a rank."""
    return UNIT_BUFFERS_AT_PEAK * COMM_BYTES_PER_PARAMETER * largest_unit_parameters


def boundary_bytes(samples: int, tokens_per_sample: int, hidden_size: int) -> int:
    """One unit boundary (a unit's output or its gradient) for `samples` samples."""
    return samples * tokens_per_sample * hidden_size * BOUNDARY_BYTES_PER_ELEMENT


def kept_boundary_bytes(num_layers: int, samples: int, tokens_per_sample: int,
                        hidden_size: int, offload: bool, fused_blocks: int = 0) -> int:
    """Boundary activations a rank keeps on its device at the peak: none when offloaded;
    else the output of the embedding and of every block for all its samples (the head's
    input is the last block's output), plus the gradient of one in flight. Blocks in the
    fused tail (`fused_tail_blocks`) keep none: their outputs live in one microbatch's
    graphs."""
    if offload:
        return 0
    return (num_layers - fused_blocks + 2) * boundary_bytes(samples, tokens_per_sample,
                                                            hidden_size)


# ---- without recompute (a plan's `recompute: false`) -------------------------------------
# Autograd's saved tensors of one block, per token, in elements: the wide MLP tensors (the
# input of the activation and its output; a gated MLP has one more) and the hidden-width ones
# (the norms' inputs and outputs, q/k/v, the attention output, the projections' inputs, the
# residual stream). Attention scores are not kept: SDPA's fused kernels save only their
# output and log-sum-exp. An estimate from the model's dimensions (the profiler measures a
# block's whole working set, not its saved tensors), counted at 4 bytes an element in both
# precisions so that the fp32 residual stream under bf16 autocast is not understated;
# tests/trainer/test_recompute_plan.py holds the engine's measured peak under it.
_GRAPH_WIDE_TENSORS = 3
_GRAPH_HIDDEN_TENSORS = 14


def block_graph_bytes(samples: int, tokens_per_sample: int, hidden_size: int,
                      ffn_hidden_size: int, measured_bytes_per_sample: float | None = None
                      ) -> int:
    """What one block's forward keeps for its backward, for `samples` samples: the
    profiler's measurement (`GpuProfile.block_graph_bytes_per_sample`) when there is one,
    else the estimate from the dimensions."""
    if measured_bytes_per_sample is not None:
        return round(samples * measured_bytes_per_sample)
    per_token = _GRAPH_WIDE_TENSORS * ffn_hidden_size + _GRAPH_HIDDEN_TENSORS * hidden_size
    return samples * tokens_per_sample * per_token * FP32_BYTES


# ---- kept blocks in recompute mode (a rank plan's `kept_blocks`) --------------------------
# A rank may keep the autograd graphs of its last k blocks from their forward to their
# backward instead of recomputing them. Their gathered parameters are freed after the
# forward and gathered again for the backward, as for a recomputed block, so the sequence
# of collectives does not change and each rank chooses its own k. Beyond the recompute
# mode's figure the rank holds k block graphs for all its samples (layered accumulation runs
# every microbatch through a unit before the next unit, so all ℓ·m samples' graphs are alive
# at the start of the backward). The boundary activations are counted already.
def kept_blocks_bytes(kept_blocks: int, samples: int, tokens_per_sample: int,
                      hidden_size: int, ffn_hidden_size: int,
                      measured_bytes_per_sample: float | None = None) -> int:
    """What keeping `kept_blocks` block graphs adds to a recompute-mode rank's memory."""
    return kept_blocks * block_graph_bytes(samples, tokens_per_sample, hidden_size,
                                           ffn_hidden_size, measured_bytes_per_sample)


def kept_graph_bytes(num_layers: int, samples: int, tokens_per_sample: int, hidden_size: int,
                     ffn_hidden_size: int, kept_unit_parameters: int,
                     measured_bytes_per_sample: float | None = None) -> int:
    """What a rank holds without recompute beyond the recompute mode's figure (state, the
    unit buffers and one unit's working set): every block's graph for all its samples (the
    profile's measured size when given, as for kept blocks), every unit output and one layer
    of output gradients (kept on the device: the graphs hold them), and the gathered
    embedding and blocks (`kept_unit_parameters`, fp32), which stay alive from their forward
    to their backward."""
    return (num_layers * block_graph_bytes(samples, tokens_per_sample, hidden_size,
                                           ffn_hidden_size, measured_bytes_per_sample)
            + (num_layers + 2) * boundary_bytes(samples, tokens_per_sample, hidden_size)
            + COMM_BYTES_PER_PARAMETER * kept_unit_parameters)


# ---- the kept tail run per microbatch ------------------------------------------------------
# Layered accumulation keeps a kept block's graph for every microbatch (all ℓ·m samples).
# The last j blocks that *every* rank keeps can instead run per microbatch, like the head:
# each microbatch goes forward through them and the head and straight back, so one
# microbatch's graphs are alive at a time, and their gathered parameters stay from the forward
# to the end of the tail (no second gather: every rank skips it, so the collectives agree).
# That holds the head's and the j blocks' parameters and full gradients together, plus up to
# two microbatch gradients being added (autograd may finish two units' close together): 2j + 4
# unit buffers where recompute mode counts five, so 2j - 1 more block buffers (the next
# unit's gather is issued only as the tail's last backward ends, in place of such a
# gradient). The engine runs a block this way only where it costs no rank more than its
# layered graphs (`fused_tail_blocks`), so the planner's per-rank price of kept blocks
# (`kept_blocks_bytes`) stays an upper bound; its fused-everything mode prices this figure.
def fused_tail_bytes(blocks: int, micro_batch_size: int, tokens_per_sample: int,
                     hidden_size: int, ffn_hidden_size: int, block_parameters: int,
                     measured_bytes_per_sample: float | None = None) -> int:
    """What running the last `blocks` blocks per microbatch adds to a recompute-mode rank's
    memory: their graphs for one microbatch and their held parameters and gradients."""
    if blocks <= 0:
        return 0
    graphs = blocks * block_graph_bytes(micro_batch_size, tokens_per_sample, hidden_size,
                                        ffn_hidden_size, measured_bytes_per_sample)
    return graphs + (2 * blocks - 1) * COMM_BYTES_PER_PARAMETER * block_parameters


def fused_tail_blocks(kept_blocks: list[int], batch_sizes: list[int],
                      micro_batch_sizes: list[int], tokens_per_sample: int, hidden_size: int,
                      ffn_hidden_size: int, block_parameters: int,
                      measured_bytes_per_sample: list[float | None] | None = None) -> int:
    """How many of the last blocks every rank runs per microbatch: the most j no larger than
    any working rank's kept blocks for which no working rank's tail costs more than the
    layered graphs of the same j blocks (a rank without samples computes nothing and takes
    part in the tail's collectives one unit buffer at a time: any j).
    The same on every rank: it reads only the layout (and the plan's graph sizes)."""
    measured = measured_bytes_per_sample or [None] * len(kept_blocks)
    working = [r for r, samples in enumerate(batch_sizes) if samples > 0]
    if not working:
        return 0
    dims = (tokens_per_sample, hidden_size, ffn_hidden_size)
    for j in range(min(kept_blocks[r] for r in working), 0, -1):
        if all(fused_tail_bytes(j, micro_batch_sizes[r], *dims, block_parameters, measured[r])
               <= kept_blocks_bytes(j, batch_sizes[r], *dims, measured[r]) for r in working):
            return j
    return 0
