"""spec.planner of a CephaloJob: what the planner may use, assume and optimise."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic.config import JsonValue

from cephalo.api.network import NetworkSpec
from cephalo.api.rebalance import RebalanceSpec
from cephalo.api.replan import ReplanSpec
from cephalo.api.wire import CamelModel

# The rule of PlannerSpec that pydantic checks in `_floor_needs_cost`, as CEL for the API
# server. (objective cost without prices is refused at planning, not here: the operator's
# price list may supply them.)
_FLOOR_NEEDS_COST = ("planner.minSamplesPerSecond and planner.deadlineSeconds bound the cost "
                     "objective: set planner.objective: cost, or leave them out")
_FLAT_OR_TOPOLOGY = ("planner.networkBandwidthGbps/networkLatencyMicroseconds price a flat "
                     "ring, planner.network the nodes' links: give one of them")
_PLANNER_RULES: list[JsonValue] = [
    {"rule": "(has(self.objective) && self.objective == 'cost') || "
             "(!has(self.minSamplesPerSecond) && !has(self.deadlineSeconds))",
     "message": _FLOOR_NEEDS_COST},
    {"rule": "!has(self.network) || "
             "(!has(self.networkBandwidthGbps) && !has(self.networkLatencyMicroseconds))",
     "message": _FLAT_OR_TOPOLOGY},
]


class PlannerSpec(CamelModel):
    """What the planner may use, assume and optimise (throughput, or price per sample)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _PLANNER_RULES})

    memory_fraction: float = Field(default=0.8, gt=0, le=1, description=(
        "Fraction of each GPU's memory the plan may use (the paper caps at 80%)."))
    # Every size is run by the profiler on every GPU product: a few small sizes suffice.
    profile_micro_batch_sizes: list[Annotated[int, Field(ge=1, le=4096)]] = Field(
        default_factory=lambda: list(range(1, 9)), min_length=1, max_length=64,
        description=("Microbatch sizes the profiler measures (linear extrapolation beyond); "
                     "1 to 64 sizes, each 1 to 4096."))
    # Before planner.network (issue 35) these were the only network figures, defaulted to 10
    # Gbit/s and 50 µs; a job stored with them keeps exactly the plans it had.
    network_bandwidth_gbps: float | None = Field(default=None, gt=0, le=100_000, description=(
        "A flat ring: every hop of every collective at this bandwidth per GPU (Gbit/s), as "
        "if each GPU were a node of its own with a NIC this fast; used when no collective "
        "profile exists. Unset: planner.network (the nodes' links). At most 100000."))
    network_latency_microseconds: float | None = Field(
        default=None, ge=0, le=10_000_000, description=(
            "With networkBandwidthGbps: the flat ring's latency per hop (default 50; at "
            "most 10 s)."))
    network: NetworkSpec | None = Field(default=None, description=(
        "The nodes' links (NIC, NVLink/PCIe) the collectives cross; unset figures come from "
        "the operator's node labels or the documented defaults (docs/network.md)."))
    allow_state_only_ranks: bool = Field(default=True, description=(
        "Let a slow GPU take no batch and only hold training state when that is faster."))
    choose_gpus: bool = Field(default=True, description=(
        "Let the planner leave GPUs idle (no rank, no pod) when fewer are faster, e.g. a "
        "small model whose collectives cost more than the extra GPUs save; the plan names "
        "them in idle_gpus with the reason. false: every selected GPU gets a rank."))
    # 5 %: about the cost model's measured error (bench/cost_model.py: median |error| 3.4 to
    # 3.9 %), so a user who owns 8 GPUs does not see one idle for a gain the model cannot
    # resolve (issue 25: 8xA100, 7 GPUs predicted 2.1 % faster).
    min_gain_to_idle_gpus: float = Field(default=0.05, ge=0, le=10, description=(
        "With chooseGpus: leave GPUs idle only when fewer are predicted to give more than "
        "this fraction more throughput than every GPU (0.05: 5 %, about the cost model's "
        "error); 0: the fastest choice, however small its gain (at most 10)."))
    objective: Literal["throughput", "cost"] = Field(default="throughput", description=(
        "throughput: the fastest plan. cost: the least price per sample (gpuPricesPerHour of "
        "the GPUs used, idle GPUs cost nothing), at least minSamplesPerSecond or fast enough "
        "to finish the training steps within deadlineSeconds."))
    gpu_prices_per_hour: dict[str, Annotated[float, Field(gt=0, le=100_000)]] | None = Field(
        default=None, max_length=64, description=(
        "Price of one GPU for an hour, per GPU type (catalog name or GPU Feature Discovery "
        "product label, e.g. NVIDIA-L4: 0.8); any currency, USD in the examples. Default: "
        "the operator's price list (chart value gpuPricesPerHour). At most 64 types."))
    min_samples_per_second: float | None = Field(default=None, gt=0, le=1e12, description=(
        "objective cost: the plan must predict at least this many samples per second."))
    deadline_seconds: float | None = Field(default=None, gt=0, le=1e9, description=(
        "objective cost: the plan must predict finishing the training steps (those left, "
        "on a resume) within this many seconds."))

    # Issue 44: flat FSDP sends every parameter across every node's NIC three times a step;
    # hybrid shards the state inside groups of ranks on fast links and crosses the NICs
    # with one gradient all-reduce a step (docs/hybrid-sharding.md).
    sharding: Literal["auto", "flat", "hybrid"] = Field(default="auto", description=(
        "How the training state is sharded. flat: over every rank (one group). hybrid: "
        "inside replica groups of whole nodes (one node, or several where one cannot hold "
        "the state), replicated across groups, the gradient shards all-reduced across "
        "them once a step. auto: whichever the planner predicts faster "
        "(docs/hybrid-sharding.md)."))

    replan: ReplanSpec = Field(default_factory=ReplanSpec, description=(
        "Re-plan a running job on the GPUs it holds once its measured steps show the cost "
        "model was off (docs/replanning.md); enabled: false opts out."))
    rebalance: RebalanceSpec = Field(default_factory=RebalanceSpec, description=(
        "Move samples between the running job's ranks from their measured compute, at a "
        "step boundary and without a restart (docs/rebalancing.md); off by default for now, "
        "enabled: true opts in."))

    @model_validator(mode="after")
    def _floor_needs_cost(self) -> PlannerSpec:
        # The same rule as _PLANNER_RULES (the API server's), in the same words.
        if self.objective != "cost" and (self.min_samples_per_second is not None or
                                         self.deadline_seconds is not None):
            raise ValueError(_FLOOR_NEEDS_COST)
        if self.network is not None and (self.network_bandwidth_gbps is not None or
                                         self.network_latency_microseconds is not None):
            raise ValueError(_FLAT_OR_TOPOLOGY)
        return self
