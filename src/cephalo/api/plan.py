"""Plan: the planner's decision, the contract between planner, operator and trainer.

The trainer needs only `global_batch_size`, `world_size` and each rank's batch fields and
`shard_ratio`; everything else is optional so a hand-written plan works too.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from cephalo.api.job import format_validation_error
from cephalo.api.safeyaml import YamlError, read_text_file
from cephalo.errors import CephaloError

SHARD_RATIO_TOLERANCE = 1e-9


class PlanError(CephaloError, ValueError):
    """A plan that breaks an invariant; the message says which and by how much."""


def _omit_empty(data: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """Drop fields added after the first plans when they say nothing (None or empty), so a
    plan without idle GPUs serialises as it did before they existed (same bytes, same
    config hash of running jobs)."""
    return {k: v for k, v in data.items() if k not in keys or v not in (None, [], {})}


# Every field a plan carries is declared here (issue 17: nothing is fished back out of
# `model_extra`). Unknown keys are ignored, so a plan written by a newer or older Cephalo, or
# by hand, still loads: the trainer needs only the batch and shard fields.
OPTIONAL_PLAN_FIELDS = ("idle_gpus", "optimality_gap_seconds", "unit_shard_ratios", "cost",
                        "recompute", "pod_ranks", "model", "precision", "memory_fraction",
                        "state_bytes", "estimated_gpus", "assumptions", "search", "notes",
                        "replica_groups", "replicated_fraction")


class RankPlan(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rank: int = Field(ge=0)
    gpu: str = "cpu"
    pool: str | None = None
    node: str | None = None
    batch_size: int = Field(ge=0)
    micro_batch_size: int = Field(ge=0)
    num_micro_batches: int = Field(ge=0)
    shard_ratio: float = Field(ge=0, le=1)
    predicted_step_seconds: float | None = None
    predicted_memory_bytes: int | None = None
    memory_capacity_bytes: int | None = None
    # Position of this rank's GPU in the cluster's GPU list (groups in order, each group's
    # GPUs in turn). Ranks are numbered over the GPUs the plan uses; with idle GPUs this says
    # which device a rank runs on (`cephalo run` maps ranks to local devices with it).
    gpu_index: int | None = Field(default=None, ge=0)
    # Activation/working memory of this rank's microbatch (part of predicted_memory_bytes).
    compute_memory_bytes: int | None = Field(default=None, ge=0)
    # True: this GPU's times are catalog estimates, not a measured profile.
    estimated: bool | None = None
    # True: micro_batch_size lies above every size this GPU's profile measured, so the
    # rank's predicted time and memory are linear extrapolations (the cost model's, beyond
    # the profiled range; cephalo.planner.feedback.measured_sizes). None (omitted): within it.
    extrapolated: bool | None = None
    # Recompute mode only (the plan's `recompute` not false): this rank keeps the autograd
    # graphs of its last `kept_blocks` blocks (units L-k+1..L) from forward to backward and
    # recomputes the others. Their parameters are still gathered again for the backward, so
    # the collectives are the same on every rank whatever each one keeps
    # (cephalo.api.memory.kept_blocks_bytes). 0 (omitted): recompute every block.
    kept_blocks: int = Field(default=0, ge=0)
    # The per-sample block graph size the planner priced `kept_blocks` (or a plan's
    # `recompute: false`) with: the profile's measurement for this GPU
    # (GpuProfile.block_graph_bytes_per_sample). The trainer's memory check uses the same
    # figure. None (omitted): the estimate from the dimensions.
    block_graph_bytes_per_sample: float | None = Field(default=None, ge=0)
    # Where this rank keeps its boundary activations (each unit's output per microbatch, and
    # their gradients) between forward and backward: True offloads them to host memory over
    # PCIe on a side stream (the paper's activation offloading), False keeps them on the
    # device. None (omitted): the engine's default, offload on CUDA devices. The planner
    # offloads only where the device cannot hold them (a per-rank choice: collectives do
    # not change).
    offload_activations: bool | None = None
    # The precision this rank computes in (autocast over fp32 master weights; fp16 ranks
    # scale their loss by the job's one loss scale). None (omitted): the job's
    # spec.precision. A job's `auto` is always resolved into per-rank values by the planner.
    # Collectives are fp32 whatever the mix, so ranks may differ.
    precision: Literal["fp32", "bf16", "fp16"] | None = None

    @model_serializer(mode="wrap")
    def _omit_unset_index(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = _omit_empty(handler(self), ("gpu_index", "compute_memory_bytes", "estimated",
                                           "extrapolated", "offload_activations",
                                           "block_graph_bytes_per_sample", "precision"))
        if not data.get("kept_blocks"):
            data.pop("kept_blocks", None)
        return data


class IdleGpus(BaseModel):
    """GPUs the plan leaves unused (no rank, no pod) and why."""

    model_config = ConfigDict(extra="ignore")

    gpu: str
    pool: str | None = None
    count: int = Field(ge=1)
    reason: str


class BaselineResult(BaseModel):
    model_config = ConfigDict(extra="ignore")

    predicted_samples_per_second: float | None
    feasible: bool
    reason: str | None = None
    predicted_step_seconds: float | None = None

    @model_serializer(mode="wrap")
    def _omit_unset_step(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _omit_empty(handler(self), ("predicted_step_seconds",))


class PlanCost(BaseModel):
    """What the plan's GPUs cost while it runs (the job's planner.gpuPricesPerHour; idle GPUs
    cost nothing), in the prices' currency."""

    model_config = ConfigDict(extra="ignore")

    objective: str  # the job's planner.objective: throughput or cost
    price_per_hour: float = Field(ge=0)  # the GPUs used
    price_per_million_samples: float = Field(ge=0)
    price_per_million_tokens: float | None = Field(default=None, ge=0)  # text models
    cluster_price_per_hour: float = Field(ge=0)  # every GPU given (what the baselines use)
    # objective cost: the throughput floor the plan had to meet (None: no floor).
    min_samples_per_second: float | None = None
    prices_per_hour: dict[str, float] = Field(default_factory=dict)  # per GPU type

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _omit_empty(handler(self), ("price_per_million_tokens",
                                           "min_samples_per_second"))


class Plan(BaseModel):
    model_config = ConfigDict(extra="ignore")

    global_batch_size: int = Field(ge=1)
    world_size: int = Field(ge=1)
    predicted_step_seconds: float | None = None
    predicted_samples_per_second: float | None = None
    ranks: list[RankPlan]
    baselines: dict[str, BaselineResult] = Field(default_factory=dict)
    # GPUs of the cluster the planner chose not to use (fewer GPUs made the step faster).
    idle_gpus: list[IdleGpus] = Field(default_factory=list)
    # Prices of the plan and of every GPU given, where the job gives prices (None: omitted).
    cost: PlanCost | None = None
    # Proven distance of predicted_step_seconds to the cost model's optimum on the GPUs
    # used (0: exact). Positive only when the large-batch aggregate-memory search could not
    # close its Lagrangian bound.
    optimality_gap_seconds: float | None = Field(default=None, ge=0)
    # Per-unit sharding (the paper's §4.3): engine unit index ("0" embedding, "1".."L"
    # blocks, "L+1" head) -> one ratio per rank, for the units that do not use the ranks'
    # `shard_ratio`. Usually the units sharded evenly (1/N, no uneven-collective overhead)
    # or those skewed where memory needs it. Empty (omitted): every unit uses shard_ratio.
    # Validated against the world size where the plan is used (trainer env, `cephalo run`).
    unit_shard_ratios: dict[str, list[float]] = Field(default_factory=dict)
    # Job-wide (it changes the sequence of collectives, so every rank must agree): false
    # keeps every block's autograd graph and gathered unit from the forward to the backward
    # (no recompute, no second gather), chosen by the planner when memory allows it and it
    # is faster; None (omitted): the engine's default, recompute in the backward.
    recompute: bool | None = None
    # Ranks per pod, in rank order (the operator's grouping of a pool's ranks onto nodes,
    # spec.ranksPerPod); empty: one rank per pod. A grouping that does not add up to the
    # ranks of one pool per pod is ignored where it is used (operator/podspec.py).
    pod_ranks: list[int] = Field(default_factory=list)
    # Hybrid sharding (docs/hybrid-sharding.md): the ranks split into replica groups, each
    # holding the weights sharded unevenly among its own ranks (FSDP on the group's ranks);
    # across groups each slice's gradient is reduce-scattered and its optimizer state split
    # (the updated pieces all-gathered back before the next forward). Every group
    # has the same number of ranks, listed in position order; the ranks at one position in
    # every group hold the same slice, so a rank's `shard_ratio` (and every list of
    # `unit_shard_ratios`) is its share *within its group*: each group's ratios sum to 1 and
    # agree position by position. Batches stay per rank over the whole job. Empty
    # (omitted): flat sharding, one group of every rank.
    replica_groups: list[list[int]] = Field(default_factory=list)
    # Hybrid sharding's split of each slice across groups (docs/hybrid-sharding.md): the
    # leading `replicated_fraction` of every rank's slice of every unit keeps its whole
    # optimizer state in every group (its gradient all-reduced across groups under the
    # backward, nothing to gather after the update); the rest is sharded across groups as
    # above. 0 (omitted): all of it sharded; 1: every group keeps the whole state. Only with
    # two or more replica groups.
    replicated_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    # What the planner assumed, for humans and `cephalo plan` (the trainer ignores them).
    model: dict[str, Any] | None = None  # the resolved ModelConfig
    precision: str | None = None
    memory_fraction: float | None = None
    state_bytes: int | None = None  # training state of the whole model
    estimated_gpus: list[str] = Field(default_factory=list)  # timed from the catalog
    # What the plan took as given (cephalo.planner.outputs.report prints it): the ring's priced
    # network_bandwidth_bytes_per_second and network_latency_seconds, network_source, the
    # topology's figures; collective_backend ('nccl' or 'gloo') and, where the ring crosses a
    # described bandwidth, collective_efficiency (the share of the described rate it was
    # priced at: what that library reaches of a link, docs/network.md); absent: measured.
    assumptions: dict[str, Any] = Field(default_factory=dict)
    search: dict[str, Any] = Field(default_factory=dict)  # how the optimum was found
    notes: list[str] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _omit_empty_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _omit_empty(handler(self), OPTIONAL_PLAN_FIELDS)

    @model_validator(mode="after")
    def _invariants(self) -> Plan:
        check_invariants(self)
        return self

    def to_json(self) -> str:
        """Deterministic JSON (same plan, byte-identical text)."""
        return json.dumps(self.model_dump(mode="json"), indent=2) + "\n"

    def rank(self, rank: int) -> RankPlan:
        return self.ranks[rank]


def check_invariants(plan: Plan) -> None:
    """The Plan invariants (docs/architecture.md); a PlanError gives the numbers that are off."""
    if len(plan.ranks) != plan.world_size:
        raise PlanError(f"plan has {len(plan.ranks)} ranks but world_size {plan.world_size}")
    for i, r in enumerate(plan.ranks):
        if r.rank != i:
            raise PlanError(f"ranks must be listed in order 0..{plan.world_size - 1}; "
                            f"entry {i} says rank {r.rank}")
        if r.batch_size != r.micro_batch_size * r.num_micro_batches:
            raise PlanError(f"rank {i}: batch_size {r.batch_size} != micro_batch_size "
                            f"{r.micro_batch_size} x num_micro_batches {r.num_micro_batches}")
    total = sum(r.batch_size for r in plan.ranks)
    if total != plan.global_batch_size:
        raise PlanError(f"rank batch sizes sum to {total}, not global_batch_size "
                        f"{plan.global_batch_size}")
    if plan.replicated_fraction and len(plan.replica_groups) < 2:
        raise PlanError(f"replicated_fraction {plan.replicated_fraction} needs two or more "
                        f"replica_groups, the plan has {len(plan.replica_groups)}: omit it "
                        "(or set 0) for flat sharding")
    if plan.replica_groups:
        check_replica_groups(plan.replica_groups, [r.shard_ratio for r in plan.ranks],
                             "shard ratios")
        return
    ratio_sum = sum(r.shard_ratio for r in plan.ranks)
    if abs(ratio_sum - 1.0) > SHARD_RATIO_TOLERANCE:
        raise PlanError(f"shard ratios sum to {ratio_sum!r}, not 1")


def check_replica_groups(groups: list[list[int]], ratios: list[float], what: str) -> None:
    """Replica groups partition the ranks into groups of one size, and `ratios` (one per
    rank) sum to 1 within every group and agree position by position across groups."""
    world = len(ratios)
    members = sorted(r for g in groups for r in g)
    if members != list(range(world)):
        raise PlanError(f"replica_groups must list every rank 0..{world - 1} exactly once, "
                        f"got {groups}")
    size = len(groups[0])
    if any(len(g) != size for g in groups):
        raise PlanError(f"replica_groups must all have the same number of ranks, got sizes "
                        f"{[len(g) for g in groups]}")
    for g in groups:
        total = sum(ratios[r] for r in g)
        if abs(total - 1.0) > SHARD_RATIO_TOLERANCE:
            raise PlanError(f"{what} of replica group {g} sum to {total!r}, not 1")
    for position in range(size):
        first = ratios[groups[0][position]]
        for g in groups[1:]:
            if abs(ratios[g[position]] - first) > SHARD_RATIO_TOLERANCE:
                raise PlanError(f"{what}: rank {g[position]} holds {ratios[g[position]]!r} "
                                f"but rank {groups[0][position]} at the same position of "
                                f"replica group {groups[0]} holds {first!r}; ranks at one "
                                "position hold the same slice")


def parse_plan(data: Any, source: str = "plan") -> Plan:
    try:
        return Plan.model_validate(data)
    except ValidationError as err:
        raise PlanError(f"{source}: {format_validation_error(err)}") from None


# A plan is ~300 bytes a rank: this is tens of thousands of ranks.
MAX_PLAN_BYTES = 16 * 1024**2


def load_plan(path: str) -> Plan:
    try:
        data = json.loads(read_text_file(path, MAX_PLAN_BYTES, what="plan JSON file"))
    except YamlError as err:
        raise PlanError(str(err)) from None
    except (json.JSONDecodeError, RecursionError) as err:
        why = err.msg if isinstance(err, json.JSONDecodeError) else "nested too deeply"
        raise PlanError(f"{path}: not valid JSON: {why}") from None
    return parse_plan(data, source=path)
