"""The CephaloJob custom resource: spec and status (Kubernetes camelCase on the wire).

These pydantic models are the single source of truth: `cephalo crd` generates the CRD's
OpenAPI schema from them, `cephalo run` and the operator parse job YAML with them.
"""

from __future__ import annotations

import posixpath
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from cephalo.api.models import PRESETS, ModelConfig

API_GROUP = "cephalo.dev"
API_VERSION = "v1alpha1"
KIND = "CephaloJob"
PLURAL = "cephalojobs"


class CamelModel(BaseModel):
    """Base for every wire type: camelCase aliases, snake_case attributes, no unknown keys."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=False
    )

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class ModelSpec(CamelModel):
    """A preset by name, or a custom architecture. Fields given next to a preset override it."""

    model_config = ConfigDict(json_schema_extra={
        "anyOf": [{"required": ["preset"]},
                  {"required": ["family", "numLayers", "hiddenSize", "numHeads"]}],
    })

    preset: str | None = Field(default=None, description=(
        "Preset name: " + ", ".join(sorted(PRESETS)) + ". Or give `family` and dimensions."))
    family: Literal["gpt", "llama", "vit", "bert"] | None = Field(
        default=None, description="Architecture family of a custom model.")
    num_layers: int | None = Field(default=None, ge=1, description="Transformer blocks.")
    hidden_size: int | None = Field(default=None, ge=1, description="Model width.")
    num_heads: int | None = Field(default=None, ge=1, description="Attention heads.")
    num_kv_heads: int | None = Field(default=None, ge=1,
                                     description="Key/value heads (llama, grouped-query).")
    ffn_hidden_size: int | None = Field(default=None, ge=1,
                                        description="MLP width (default 4 x hiddenSize).")
    vocab_size: int | None = Field(default=None, ge=2, description="Vocabulary (text models).")
    sequence_length: int | None = Field(default=None, ge=1,
                                        description="Tokens per sample (text; default 512).")
    image_size: int | None = Field(default=None, ge=1, description="Image side in pixels (vit).")
    patch_size: int | None = Field(default=None, ge=1, description="Patch side in pixels (vit).")
    num_classes: int | None = Field(default=None, ge=2,
                                    description="Classes (vit, bert classification heads).")

    @model_validator(mode="after")
    def _preset_or_family(self) -> ModelSpec:
        if self.preset is None and self.family is None:
            raise ValueError("model needs a `preset` or a `family` with dimensions")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(
                f"unknown model preset {self.preset!r}; known presets: {', '.join(sorted(PRESETS))}"
            )
        return self

    def resolve(self) -> ModelConfig:
        """The full architecture: the preset's values overridden by any field given here."""
        values: dict[str, Any] = dict(PRESETS[self.preset]) if self.preset else {}
        overrides = self.model_dump(exclude_none=True, exclude={"preset"})
        values.update(overrides)
        if self.preset is None:
            missing = [k for k in ("num_layers", "hidden_size", "num_heads") if k not in values]
            if missing:
                names = ", ".join(to_camel(m) for m in missing)
                raise ValueError(f"custom model is missing {names}")
            values.setdefault("ffn_hidden_size", 4 * values["hidden_size"])
            if values["family"] in ("gpt", "llama", "bert"):
                values.setdefault("sequence_length", 512)
            if values["family"] == "bert":
                values.setdefault("num_classes", 2)
        return ModelConfig(**values)


class TrainingSpec(CamelModel):
    """Optimizer (AdamW), learning-rate schedule and seed; a step uses globalBatchSize samples."""

    steps: int = Field(default=100, ge=1, description="Optimizer steps to run.")
    learning_rate: float = Field(default=3e-4, gt=0, description="Peak AdamW learning rate.")
    min_learning_rate_ratio: float = Field(
        default=0.1, ge=0, le=1, description="Final LR as a fraction of the peak (cosine/linear).")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        default="cosine", description="LR schedule after warm-up.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW decoupled weight decay.")
    adam_beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW first-moment decay.")
    adam_beta2: float = Field(default=0.999, ge=0, lt=1,
                              description="AdamW second-moment decay.")
    adam_epsilon: float = Field(default=1e-8, gt=0,
                                description="AdamW term added to the denominator.")
    gradient_clip_norm: float | None = Field(
        default=1.0, gt=0,
        description="Global gradient-norm clip across all shards; null disables.")
    seed: int = Field(default=0, ge=0, description="Seeds weights, synthetic data and dropout.")
    log_interval_steps: int = Field(default=1, ge=1,
                                    description="Log loss and throughput every N steps.")


class SyntheticData(CamelModel):
    """Seeded random tokens / images: deterministic per (seed, step, sample)."""


class TokenFileData(CamelModel):
    """Token ids from a file on a volume mounted into every trainer pod."""

    path: str = Field(description="nanoGPT-style flat binary of token ids (memory-mapped).")
    dtype: Literal["uint16", "uint32"] = Field(
        default="uint16", description="Integer type of the token ids in the file.")
    claim_name: str | None = Field(default=None, description=(
        "PersistentVolumeClaim holding the file, mounted read-only at mountPath in every "
        "trainer pod; none: the file is already there (in the image, or local for cephalo run)."))
    mount_path: str = Field(default="/data", description="Where claimName is mounted.")

    @model_validator(mode="after")
    def _path_on_volume(self) -> TokenFileData:
        if self.claim_name is None:
            return self
        mount = posixpath.normpath(self.mount_path)
        if not posixpath.isabs(mount) or not posixpath.normpath(self.path).startswith(
                mount.rstrip("/") + "/"):
            raise ValueError(
                f"tokenFile.path {self.path!r} is not inside mountPath {self.mount_path!r}, where "
                f"volume {self.claim_name!r} is mounted; use an absolute mountPath and a path "
                "under it")
        return self


class DataSpec(CamelModel):
    """Training data: exactly one of `synthetic` or `tokenFile`."""

    model_config = ConfigDict(json_schema_extra={
        "oneOf": [{"required": ["synthetic"]}, {"required": ["tokenFile"]}],
    })

    synthetic: SyntheticData | None = None
    token_file: TokenFileData | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> DataSpec:
        if (self.synthetic is None) == (self.token_file is None):
            raise ValueError("data needs exactly one of `synthetic: {}` or `tokenFile: {path: …}`")
        return self


class GpuPoolSpec(CamelModel):
    """GPUs of one product to train on, optionally narrowed by node labels and capped."""

    product: str | None = Field(default=None, description=(
        "GPU product as in the node label nvidia.com/gpu.product (e.g. NVIDIA-A10G) or a "
        "catalog name (A10G)."))
    node_selector: dict[str, str] | None = Field(
        default=None, description="Extra node labels a node of this pool must carry.")
    max_gpus: int | None = Field(default=None, ge=1, description="Use at most this many GPUs.")
    memory_mi_b: int | None = Field(
        default=None, ge=1, alias="memoryMiB",
        description="Override the GPU memory (MiB) the planner assumes.")


class PlannerSpec(CamelModel):
    """What the planner may use and assume: memory headroom, profiling sizes, network."""

    memory_fraction: float = Field(default=0.8, gt=0, le=1, description=(
        "Fraction of each GPU's memory the plan may use (the paper caps at 80%)."))
    profile_micro_batch_sizes: list[int] = Field(
        default_factory=lambda: list(range(1, 9)), min_length=1,
        description="Microbatch sizes the profiler measures (linear extrapolation beyond).")
    network_bandwidth_gbps: float = Field(default=10.0, gt=0, description=(
        "Bandwidth per GPU for collectives (Gbit/s) when no collective profile exists."))
    network_latency_microseconds: float = Field(default=50.0, ge=0, description=(
        "Per-hop latency of collectives when no collective profile exists."))
    allow_state_only_ranks: bool = Field(default=True, description=(
        "Let a slow GPU take no batch and only hold training state when that is faster."))


class CheckpointSpec(CamelModel):
    """Sharded, atomic checkpoints: where they go, how often, how many are kept."""

    claim_name: str | None = Field(default=None, description=(
        "PersistentVolumeClaim for checkpoints (operator); none = emptyDir (lost with the pods)."))
    interval_steps: int = Field(default=100, ge=1, description="Write a checkpoint every N steps.")
    keep: int = Field(default=2, ge=1, description="Complete checkpoints to keep.")


class CephaloJobSpec(CamelModel):
    image: str | None = Field(default=None, description=(
        "Trainer image; default: the operator's configured trainer image."))
    model: ModelSpec
    global_batch_size: int = Field(ge=1, description="Samples per optimizer step (B).")
    precision: Literal["fp32", "bf16"] = Field(default="fp32", description=(
        "fp32 (the paper's setting) or bf16 autocast with fp32 master weights."))
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    data: DataSpec = Field(default_factory=lambda: DataSpec(synthetic=SyntheticData()))
    gpu_pools: list[GpuPoolSpec] | None = Field(default=None, description=(
        "GPU pools to use; default: every GPU product found."))
    planner: PlannerSpec = Field(default_factory=PlannerSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    backoff_limit: int = Field(default=3, ge=0, description="Gang restarts before Failed.")
    suspend: bool = Field(default=False, description="Stop all ranks; resume from checkpoint.")
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0, description=(
        "Delete the job this long after it Succeeded or Failed."))

    @model_validator(mode="after")
    def _model_resolves(self) -> CephaloJobSpec:
        self.model.resolve()  # raises a ValueError naming the bad dimension
        return self


Phase = Literal["Pending", "Profiling", "Planning", "Running", "Restarting", "Suspended",
                "Succeeded", "Failed"]


class Condition(CamelModel):
    """One observed aspect of the job (Kubernetes API conventions), keyed by `type`."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str | None = None
    message: str | None = None
    last_transition_time: str | None = None


class PlanSummary(CamelModel):
    """The current plan in brief; the full plan JSON is in `configMap`."""

    world_size: int | None = Field(default=None, description="Ranks (GPUs) in the plan.")
    predicted_samples_per_second: float | None = Field(
        default=None, description="Throughput the planner predicts.")
    speedup_over_even_fsdp: float | None = Field(
        default=None, alias="speedupOverEvenFSDP",
        description="Predicted throughput over even FSDP on the same GPUs.")
    config_map: str | None = Field(default=None,
                                   description="ConfigMap holding the full plan JSON.")
    pools: dict[str, int] | None = Field(default=None, description="GPUs used per pool.")


class Progress(CamelModel):
    """Training progress as last reported by rank 0."""

    step: int | None = Field(default=None, description="Last completed optimizer step.")
    total_steps: int | None = None
    loss: float | None = Field(default=None, description="Mean loss of the last step.")
    samples_per_second: float | None = Field(default=None,
                                             description="Measured training throughput.")
    last_update_time: str | None = None


class CephaloJobStatus(CamelModel):
    model_config = ConfigDict(extra="allow")  # kopf keeps its own bookkeeping in status

    phase: Phase | None = None
    message: str | None = None
    conditions: list[Condition] | None = None
    observed_generation: int | None = None
    plan: PlanSummary | None = None
    progress: Progress | None = None
    restarts: int | None = None
    start_time: str | None = None
    completion_time: str | None = None


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str | None = None
    namespace: str | None = None


class CephaloJob(CamelModel):
    model_config = ConfigDict(extra="ignore")

    api_version: str = Field(default=f"{API_GROUP}/{API_VERSION}")
    kind: str = Field(default=KIND)
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: CephaloJobSpec
    status: CephaloJobStatus | None = None

    @model_validator(mode="after")
    def _kind(self) -> CephaloJob:
        if self.kind != KIND or self.api_version != f"{API_GROUP}/{API_VERSION}":
            raise ValueError(
                f"expected apiVersion {API_GROUP}/{API_VERSION} kind {KIND}, got "
                f"{self.api_version} {self.kind}")
        return self


class JobFileError(ValueError):
    """A job file that cannot be used; the message says where and what to fix."""


def format_validation_error(err: ValidationError) -> str:
    """pydantic's errors as one line: `field.path: message; …`."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def parse_job(data: Any, source: str = "job") -> CephaloJob:
    """Validate a CephaloJob given as a dict; a JobFileError names each bad field."""
    if not isinstance(data, dict):
        raise JobFileError(f"{source}: expected a CephaloJob mapping, got {type(data).__name__}")
    try:
        return CephaloJob.model_validate(data)
    except ValidationError as err:
        raise JobFileError(f"{source}: {format_validation_error(err)}") from None


def load_job(path: str) -> CephaloJob:
    """Read and validate a CephaloJob YAML file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise JobFileError(f"{path}: no such file") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise JobFileError(f"{path}: not valid YAML{where}: {problem}") from None
    return parse_job(data, source=path)
