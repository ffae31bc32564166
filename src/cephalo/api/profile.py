"""GpuProfile: what the profiler measured (or the catalog estimated) for one GPU type.

A profile is per (GPU product, model architecture, precision) and must fit in a Kubernetes
termination message (4096 bytes), which is how a profiler pod hands it to the operator.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cephalo.api.models import ModelConfig

TERMINATION_MESSAGE_LIMIT_BYTES = 4096
# Part of every profile cache key: bump it whenever what a profile measures changes, so that
# profiles cached by an older profiler are measured again instead of silently lacking fields.
# 5: the real single-rank step is kept as measured (`single_rank_step`), no longer as an
# overhead computed with one planner version's cost model.
PROFILE_FORMAT = 5


class ProfilePoint(BaseModel):
    """Timings of one microbatch size. Backward includes the recompute of the forward."""

    model_config = ConfigDict(extra="forbid")

    micro_batch_size: int = Field(ge=1)
    block_forward_seconds: float = Field(ge=0, description="one transformer block, forward")
    block_backward_seconds: float = Field(ge=0, description="one block, recompute + backward")
    other_forward_seconds: float = Field(default=0.0, ge=0, description="embedding + head + loss")
    other_backward_seconds: float = Field(default=0.0, ge=0)
    compute_memory_bytes: int = Field(ge=0, description="peak bytes beyond the training state")


class CollectiveProfile(BaseModel):
    """Fitted ring-collective model: seconds = (n-1)/n * bytes / bandwidth + (n-1) * latency.

    `bandwidth`/`latency` are the AllGather's; ReduceScatter has its own fit when measured
    (on gloo its fixed cost is several times the AllGather's), else it shares this one."""

    model_config = ConfigDict(extra="forbid")

    bandwidth_bytes_per_second: float = Field(gt=0)
    latency_seconds: float = Field(ge=0)
    reduce_scatter_bandwidth_bytes_per_second: float | None = Field(default=None, gt=0)
    reduce_scatter_latency_seconds: float | None = Field(default=None, ge=0)
    all_reduce_seconds: float | None = Field(
        default=None, ge=0, description="one small (scalar) all-reduce, as the step ends with")
    world_size: int = Field(ge=2, description="ranks the measurement ran on")
    probe_step_seconds: float | None = Field(
        default=None, gt=0, description=(
            "one real training step with one sample per rank and even shards (slowest rank's "
            "median): the planner learns from it what its collective model misses"))
    uneven_overhead: float | None = Field(default=None, ge=0,
                                          description="measured uneven/even time ratio - 1")
    overlap_fraction: float | None = Field(
        default=None, ge=0, le=1, description=(
            "how much of a collective hides under concurrent compute (1: fully, as with NCCL "
            "on its own stream; near 0 on gloo when compute and gloo share few CPU cores)"))


class SingleRankStep(BaseModel):
    """One real training step of the engine on the profiled device alone, as measured, with
    what the planner needs to set its own prediction of that step beside it: the difference
    is the engine's per-step work beyond units and optimizer (inputs, buffers, logging)."""

    model_config = ConfigDict(extra="forbid")

    seconds: float = Field(gt=0, description="median wall time of one step")
    micro_batch_size: int = Field(default=1, ge=1, description="samples in the step's one "
                                                                "microbatch")
    num_blocks: int = Field(ge=0, description="transformer blocks the step ran")
    parameters: int = Field(ge=1, description="parameters the step's optimizer updated")


class GpuProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    product: str = Field(description="catalog name, e.g. A10G, or 'cpu'")
    device_name: str | None = Field(default=None, description="raw device name as reported")
    memory_capacity_bytes: int = Field(ge=1)
    source: Literal["measured", "estimated", "emulated"] = "measured"
    model_key: str = Field(description="short hash of the model architecture")
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    compute_capability: str | None = None
    driver_version: str | None = None
    torch_version: str | None = None
    points: list[ProfilePoint] = Field(min_length=1)
    collectives: CollectiveProfile | None = None
    block_forward_fixed_seconds: float | None = Field(
        default=None, ge=0, description=(
            "part of a block's one-microbatch forward paid once per pass however many "
            "microbatches run through it (binding the unit, cold caches)"))
    other_forward_fixed_seconds: float | None = Field(
        default=None, ge=0, description="the same for the embedding's forward and the data")
    single_rank_step: SingleRankStep | None = Field(
        default=None, description=(
            "a real step on this device alone, measured where the whole training state fits "
            "in a small share of the device (the planner derives the step overhead from it)"))
    optimizer_seconds_per_parameter: float | None = Field(
        default=None, ge=0, description="AdamW update time per owned parameter")
    optimizer_seconds_fixed: float | None = Field(
        default=None, ge=0, description="AdamW + gradient-norm time per step for all units, "
                                        "independent of their sizes (launch/Python overhead)")
    block_graph_bytes_per_sample: float | None = Field(
        default=None, ge=0, description=(
            "bytes autograd saves for one block's backward per sample (its saved tensors "
            "and its input, the block's own parameters not counted), measured at the "
            "smallest profiled microbatch, so never understated at larger ones (under bf16 "
            "each microbatch's graph also holds a bf16 copy of the weights); what keeping a "
            "block's graph instead of recomputing it costs "
            "(cephalo.api.memory.block_graph_bytes)"))
    host_link_bytes_per_second: float | None = Field(
        default=None, gt=0, description=(
            "pinned host<->device copy bandwidth, the slower direction, measured "
            "(cephalo.trainer.host_link); what offloading boundary activations costs "
            "(cephalo.planner.search.offload); absent: the catalog's figure for the board"))

    @model_validator(mode="before")
    @classmethod
    def _refuse_older_formats(cls, data: object) -> object:
        # Format <= 4 stored the step overhead as one planner version computed it; such a
        # profile is refused (not converted: the raw step time it came from is lost), so a
        # cache holding it measures the GPU again.
        if isinstance(data, dict) and "step_overhead_seconds" in data:
            raise ValueError(
                f"a profile of an older format (step_overhead_seconds; this Cephalo reads "
                f"format {PROFILE_FORMAT}): measure the GPU again with "
                "`python -m cephalo.trainer.profile`")
        return data

    def to_compact_json(self) -> str:
        """The smallest faithful JSON (what goes into a termination message)."""
        return self.model_dump_json(exclude_none=True)


def model_key(model_architecture_key: str, precision: str) -> str:
    """Short stable hash of a model architecture + precision (profiles depend on both)."""
    digest = hashlib.sha256(f"{model_architecture_key}|{precision}".encode()).hexdigest()
    return digest[:12]


def profile_cache_key(product: str, model: ModelConfig, precision: str, runtime: str,
                      micro_batch_sizes: Sequence[int] | None = None) -> str:
    """The one cache key of a measured profile, for the operator's ConfigMaps and the local
    profiler's files alike (DNS-label safe): GPU product, model architecture, precision,
    PROFILE_FORMAT and `runtime`, the software that measures.

    `runtime` pins the torch build: locally `torch=<version>` (the profiler runs in this
    environment); the operator, which must not import torch, passes the trainer image the
    profiler pod runs (an image pins its torch). `micro_batch_sizes`: the operator's
    ConfigMap is created once and never rewritten, so the sizes it holds are part of its
    key; a local file is replaced when a run needs sizes it lacks (None: not in the key)."""
    parts = [model.architecture_key(), f"format={PROFILE_FORMAT}", f"runtime={runtime}"]
    if micro_batch_sizes is not None:
        parts.append("mbs=" + ",".join(map(str, micro_batch_sizes)))
    safe = re.sub(r"[^a-z0-9-]+", "-", product.lower()).strip("-")[:40]
    return f"{safe}-{model_key('|'.join(parts), precision)}"


def profiled_sizes(profile: GpuProfile) -> list[int]:
    """The micro-batch sizes `profile` has points for, ascending."""
    return sorted({p.micro_batch_size for p in profile.points})


class ProfileMergeError(ValueError):
    """Points of two profiles that do not describe the same GPU, model and precision."""


def merge_points(profile: GpuProfile, extra: GpuProfile) -> GpuProfile:
    """`profile` with the points of `extra` (a later pass of the profiler on the same GPU
    product, model and precision, for other micro-batch sizes) added; a size both hold
    takes `extra`'s, the newer measurement. Everything else stays `profile`'s: its fixed
    costs, real step and collectives were measured with the points the planner already
    fitted, and a short extra pass measures them again only as a by-product."""
    for field in ("product", "model_key", "precision"):
        if getattr(profile, field) != getattr(extra, field):
            raise ProfileMergeError(
                f"cannot merge profile points of {field} {getattr(extra, field)!r} into a "
                f"profile of {getattr(profile, field)!r}")
    newer = {p.micro_batch_size for p in extra.points}
    points = sorted([p for p in profile.points if p.micro_batch_size not in newer]
                    + list(extra.points), key=lambda p: p.micro_batch_size)
    return profile.model_copy(update={"points": points})
