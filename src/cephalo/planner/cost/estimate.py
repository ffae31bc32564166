"""The analytic estimate of a GPU's profile when none was measured: the catalog's
measured efficiency, the model's FLOPs and a roofline (used by `problem.build_problem` and
`cephalo plan` for GPUs without a profile; marked `estimated`)."""

from __future__ import annotations

from collections.abc import Iterable

from cephalo.api import memory
from cephalo.api.models import ModelConfig
from cephalo.api.profile import GpuProfile, ProfilePoint, model_key
from cephalo.planner.cost.catalog import GpuType, UnknownGpuError, resolve_precision

# ---- analytic estimate when no profile was measured ------------------------------------

# Rows (tokens) per microbatch at which a block reaches half its large-batch efficiency. On
# CUDA cores (fp32) a 512-token sample already fills the GPU: the authors measured per-sample
# time at m = 1 within ~5 % of m = 8 (V100, GPT-6.7B: 17.3 vs 17.4 ms). Tensor cores (bf16)
# need bigger tiles: their per-sample time at m = 1 is 1.3-1.9x that at m = 8 (fp16 alike).
_HALF_EFFICIENCY_TOKENS = {"fp32": 16.0, "bf16": 512.0, "fp16": 512.0}
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
    `estimated`) in `precision` ("auto": the GPU's fastest). A GPU outside the catalog has
    no figures to estimate from: it must be profiled (UnknownGpuError says how)."""
    if not gpu.in_catalog:
        raise UnknownGpuError(
            f"GPU {gpu.name!r} is not in the catalog, so its speed cannot be estimated: "
            "measure a profile of it (the operator profiles every GPU product; locally run "
            "`python -m cephalo.trainer.profile` on it) and pass the folder with --profiles")
    precision = resolve_precision(precision, gpu)
    achieved = gpu.achieved_flops(precision)
    # fp16 without tensor cores (Pascal) runs its matmuls as fp32 does: fp32's tiles.
    tiles = "fp32" if precision == "fp16" and not gpu.has_tensor_cores("fp16") else precision
    half = _HALF_EFFICIENCY_TOKENS.get(tiles, _HALF_EFFICIENCY_TOKENS["fp32"])
    # A block's activations are 16-bit under autocast (bf16 and fp16 alike).
    elem_bytes = memory.activation_bytes_per_element(precision)
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
