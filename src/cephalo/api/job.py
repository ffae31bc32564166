"""The CephaloJob custom resource: spec and status (Kubernetes camelCase on the wire).

These pydantic models are the single source of truth: `cephalo crd` generates the CRD's
OpenAPI schema from them, `cephalo run` and the operator parse job YAML with them.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.config import JsonValue

from cephalo.api.cel import (
    ONE_CHECKPOINT_TARGET,
    PRESET_OR_PRETRAINED,
    checkpoint_rules,
    model_rules,
)
from cephalo.api.data import (  # noqa: F401 - re-exported: spec.data lives in api/data.py
    DATA_URI_PATTERN,
    DataSpec,
    SyntheticData,
    TextData,
    TokenFileData,
)
from cephalo.api.elastic import ElasticSpec
from cephalo.api.hf_config import resolve_pretrained
from cephalo.api.models import PRESETS, ModelConfig
from cephalo.api.planner_spec import PlannerSpec
from cephalo.api.podtemplate import PodTemplate
from cephalo.api.safeyaml import YamlError, load_yaml_file
from cephalo.api.status import (  # noqa: F401 - re-exported: the status half of the resource
    CephaloJobStatus,
    Condition,
    Phase,
    PlanSummary,
    Progress,
)
from cephalo.api.tracking import (  # noqa: F401 - re-exported: spec.tracking lives there
    MLFLOW_URI_PATTERN,
    MlflowTracking,
    TrackingSpec,
)
from cephalo.api.wire import CamelModel
from cephalo.errors import CephaloError

API_GROUP = "cephalo.dev"
API_VERSION = "v1alpha1"
KIND = "CephaloJob"
PLURAL = "cephalojobs"

# "<name>-rank-<i>" names each rank pod and is its hostname: a 63-character DNS label, so the
# job name leaves room for "-rank-" and four digits; it also names the job's Service (a DNS
# label that starts with a letter) and the local run folder runs/<name>/.
MAX_JOB_NAME_CHARS = 47
MAX_GLOBAL_BATCH_SIZE = 65_536
JOB_NAME_PATTERN = r"[a-z]([-a-z0-9]*[a-z0-9])?"


class ModelSpec(CamelModel):
    """A preset by name, or a custom architecture. Fields given next to a preset override it."""

    # The cross-field checks of ModelConfig as CEL, so that the API server refuses them too.
    model_config = ConfigDict(json_schema_extra={
        "anyOf": [{"required": ["preset"]},
                  {"required": ["family", "numLayers", "hiddenSize", "numHeads"]},
                  {"required": ["pretrained"]}],
        "x-kubernetes-validations": model_rules(),
    })

    # The maxima below are far beyond any published model (the largest have ~130 blocks,
    # width ~25k, vocabularies ~256k): they only stop a typo or a hostile spec from making
    # the planner, profiler or trainer allocate without bound.
    preset: str | None = Field(default=None, json_schema_extra={"enum": list[JsonValue](
                                   sorted(PRESETS))},
                               description=(
        "Preset name: " + ", ".join(sorted(PRESETS)) + ". Or give `family` and dimensions."))
    family: Literal["gpt", "llama", "vit", "bert"] | None = Field(
        default=None, description="Architecture family of a custom model.")
    num_layers: int | None = Field(default=None, ge=1, le=1024, description=(
        "Transformer blocks (at most 1024; the deepest published models have ~130)."))
    hidden_size: int | None = Field(default=None, ge=1, le=65_536, description=(
        "Model width (at most 65536; the widest published models are ~25k)."))
    num_heads: int | None = Field(default=None, ge=1, le=1024, description=(
        "Attention heads (at most 1024)."))
    num_kv_heads: int | None = Field(default=None, ge=1, le=1024, description=(
        "Key/value heads (llama, grouped-query; at most 1024)."))
    ffn_hidden_size: int | None = Field(default=None, ge=1, le=262_144, description=(
        "MLP width (default 4 x hiddenSize; at most 262144)."))
    vocab_size: int | None = Field(default=None, ge=2, le=4_194_304, description=(
        "Vocabulary (text models; at most 4194304, 16x the largest published)."))
    sequence_length: int | None = Field(default=None, ge=1, le=1_048_576, description=(
        "Tokens per sample (text; default 512; at most 1048576)."))
    image_size: int | None = Field(default=None, ge=1, le=16_384, description=(
        "Image side in pixels (vit; at most 16384)."))
    patch_size: int | None = Field(default=None, ge=1, le=16_384, description=(
        "Patch side in pixels (vit; at most 16384)."))
    num_classes: int | None = Field(default=None, ge=2, le=4_194_304, description=(
        "Classes (vit, bert classification heads; at most 4194304)."))
    pretrained: str | None = Field(default=None, min_length=1, max_length=1024, description=(
        "A Hugging Face checkpoint (config.json + *.safetensors, sharded or not) to start "
        "from: a folder in the trainer image or on a volume mounted through podTemplate, or "
        "an fsspec URL (s3://...). The architecture comes from its config.json (llama, "
        "mistral, gpt2); sequenceLength may be set, other fields must agree with it. A "
        "checkpoint to resume from takes precedence (pretrained weights only start step 0)."))

    @model_validator(mode="after")
    def _preset_or_family(self) -> ModelSpec:
        if self.pretrained is not None and self.preset is not None:
            raise ValueError(PRESET_OR_PRETRAINED)  # also a CEL rule (model_rules)
        if self.preset is None and self.family is None and self.pretrained is None:
            raise ValueError("model needs a `preset` or a `family` with dimensions (or "
                             "`pretrained`)")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(
                f"unknown model preset {self.preset!r}; known presets: {', '.join(sorted(PRESETS))}"
            )
        return self

    def resolve(self) -> ModelConfig:
        """The full architecture: the preset's values overridden by any field given here."""
        if self.pretrained is not None:
            return resolve_pretrained(self.pretrained, self.model_dump(
                exclude_none=True, exclude={"preset", "pretrained"}))
        values: dict[str, Any] = dict(PRESETS[self.preset]) if self.preset else {}
        overrides = self.model_dump(exclude_none=True, exclude={"preset", "pretrained"})
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

    # Maxima: far beyond real runs (LLaMA 2: 500k steps); they stop typos and hostile specs.
    steps: int = Field(default=100, ge=1, le=100_000_000, description=(
        "Optimizer steps to run (at most 1e8)."))
    learning_rate: float = Field(default=3e-4, gt=0, le=10, description=(
        "Peak AdamW learning rate (at most 10)."))
    min_learning_rate_ratio: float = Field(
        default=0.1, ge=0, le=1, description="Final LR as a fraction of the peak (cosine/linear).")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        default="cosine", description="LR schedule after warm-up.")
    warmup_steps: int = Field(default=0, ge=0, le=100_000_000, description=(
        "Linear warm-up steps (at most 1e8)."))
    weight_decay: float = Field(default=0.0, ge=0, le=10, description=(
        "AdamW decoupled weight decay (at most 10)."))
    adam_beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW first-moment decay.")
    adam_beta2: float = Field(default=0.999, ge=0, lt=1,
                              description="AdamW second-moment decay.")
    adam_epsilon: float = Field(default=1e-8, gt=0, le=1,
                                description="AdamW term added to the denominator (at most 1).")
    gradient_clip_norm: float | None = Field(
        default=1.0, gt=0, le=1e9,
        description="Global gradient-norm clip across all shards; null disables.")
    seed: int = Field(default=0, ge=0, le=2**32 - 1, description=(
        "Seeds weights, synthetic data and dropout (at most 2^32-1, numpy's seed range)."))
    log_interval_steps: int = Field(default=1, ge=1, le=100_000_000, description=(
        "Log loss and throughput every N steps (at most 1e8)."))
    eval_interval_steps: int | None = Field(default=None, ge=1, le=100_000_000, description=(
        "Measure the mean loss on held-out validation data every N steps and at the last "
        "step (see data.validationFraction); null: no evaluation."))
    eval_samples: int | None = Field(default=None, ge=1, le=1_000_000, description=(
        "Validation samples per evaluation (a fixed set: the same samples every time); "
        "default: globalBatchSize."))



class GpuPoolSpec(CamelModel):
    """GPUs of one product to train on, optionally narrowed by node labels and capped."""

    product: str | None = Field(default=None, max_length=63, description=(
        "GPU product as in the node label nvidia.com/gpu.product (e.g. NVIDIA-A10G) or a "
        "catalog name (A10G); a label value, so at most 63 characters."))
    node_selector: dict[str, str] | None = Field(
        default=None, max_length=64,
        description="Extra node labels a node of this pool must carry (at most 64).")
    max_gpus: int | None = Field(default=None, ge=1, le=100_000, description=(
        "Use at most this many of the pool's free GPUs (at most 100000)."))
    memory_mi_b: int | None = Field(
        default=None, ge=1, le=16_777_216, alias="memoryMiB",
        description="Override the GPU memory (MiB) the planner assumes (at most 16 TiB).")


class SchedulingPolicy(CamelModel):
    """How the gang of rank pods is admitted (shaped like Kubeflow's schedulingPolicy).

    Kueue needs none of this: label the CephaloJob with `kueue.x-k8s.io/queue-name`.
    The gang scheduler (cephalo.operator.gang.gang_scheduler) is `gangScheduler`, else
    inferred from `schedulerName` (volcano; scheduler-plugins-scheduler)."""

    scheduler_name: str | None = Field(default=None, max_length=253, description=(
        "Scheduler of the rank and profiler pods, e.g. volcano or scheduler-plugins-scheduler; "
        "default: the gang scheduler's usual name, else the cluster's default scheduler."))
    gang_scheduler: Literal["volcano", "scheduler-plugins"] | None = Field(
        default=None, description=(
            "Which PodGroup API the operator creates for the rank pods (like Kubeflow's "
            "--gang-scheduler-name): volcano (scheduling.volcano.sh/v1beta1) or "
            "scheduler-plugins (coscheduling, scheduling.x-k8s.io/v1alpha1). Default: "
            "volcano when schedulerName is volcano, scheduler-plugins when it is "
            "scheduler-plugins-scheduler, else none."))
    queue: str | None = Field(default=None, max_length=253, description=(
        "Volcano queue of the job's PodGroup."))
    priority_class_name: str | None = Field(default=None, max_length=253, description=(
        "PriorityClass of the PodGroup and of every rank pod."))
    schedule_timeout_seconds: int | None = Field(default=None, ge=1, le=604_800, description=(
        "With scheduler-plugins: the PodGroup's scheduleTimeoutSeconds. With no gang "
        "scheduler: release the whole gang (delete pending and running ranks, re-plan on the "
        "GPUs that are free; not counted toward backoffLimit) when some rank stays "
        "unscheduled this long (at most a week). Unset: no timeout, ranks wait."))


CHECKPOINT_URI_PATTERN = DATA_URI_PATTERN  # scheme://bucket-or-host/...


class CheckpointSpec(CamelModel):
    """Sharded, atomic checkpoints: where they go (a shared PVC, object storage, or
    explicitly nowhere), how often, how many are kept."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": checkpoint_rules()})

    claim_name: str | None = Field(default=None, max_length=253, description=(
        "ReadWriteMany PersistentVolumeClaim for checkpoints, shared by all ranks (operator)."))
    uri: str | None = Field(default=None, max_length=1024, json_schema_extra={
        "pattern": CHECKPOINT_URI_PATTERN}, description=(
        "fsspec URL of the checkpoint root (s3://bucket/prefix; gs://, az:// with their "
        "fsspec packages); a job's checkpoints go to <uri>/<namespace>/<job name>. "
        "Credentials from the pod template's env/envFrom."))
    ephemeral: bool = Field(default=False, description=(
        "Explicitly keep no checkpoints: a restart starts again from step 0."))
    interval_steps: int = Field(default=100, ge=1, le=100_000_000,
                                description="Write a checkpoint every N steps.")
    keep: int = Field(default=2, ge=1, le=1000, description=(
        "Complete checkpoints to keep (at most 1000: each one is a full training state)."))

    @model_validator(mode="after")
    def _one_target(self) -> CheckpointSpec:
        if self.uri is not None and not re.fullmatch(CHECKPOINT_URI_PATTERN, self.uri):
            raise ValueError(f"checkpoint.uri {self.uri!r} is not a URL such as "
                             f"s3://bucket/prefix; for a volume use checkpoint.claimName")
        given = [name for name, set_ in (("claimName", self.claim_name is not None),
                                         ("uri", self.uri is not None),
                                         ("ephemeral: true", self.ephemeral)) if set_]
        if len(given) > 1:
            # The CRD's CEL rule (checkpoint_rules) says the same, less what was given.
            raise ValueError(f"{ONE_CHECKPOINT_TARGET} (got {' and '.join(given)})")
        return self


class CephaloJobSpec(CamelModel):
    image: str | None = Field(default=None, max_length=4096, description=(
        "Trainer image; default: the operator's configured trainer image."))
    model: ModelSpec
    global_batch_size: int = Field(ge=1, le=MAX_GLOBAL_BATCH_SIZE, description=(
        f"Samples per optimizer step (B); at most {MAX_GLOBAL_BATCH_SIZE}, twice the largest "
        "published batch (ViT-G: 32768 images): the planner's time and memory grow with B."))
    precision: Literal["fp32", "bf16", "fp16", "auto"] = Field(default="fp32", description=(
        "fp32 (the paper's setting), bf16 autocast, or fp16 autocast with dynamic loss "
        "scaling (one scale for the job), each with fp32 master weights; auto: each GPU its "
        "fastest (the plan gives each rank's precision)."))
    gather_precision: Literal["fp32", "bf16"] = Field(default="fp32", description=(
        "Format of the parameter all-gathers: bf16 moves half the bytes (every rank then "
        "computes from the bf16-rounded weights); master weights, gradients and their "
        "reduce-scatter stay fp32 (see reducePrecision)."))
    reduce_precision: Literal["fp32", "bf16"] = Field(default="fp32", description=(
        "Format of the gradient reduce-scatters: bf16 moves half the bytes, the sums "
        "themselves in bf16 (coarser); the shards are widened to fp32 for the optimizer."))
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    data: DataSpec = Field(default_factory=lambda: DataSpec(synthetic=SyntheticData()))
    gpu_pools: list[GpuPoolSpec] | None = Field(default=None, max_length=64, description=(
        "GPU pools to use (at most 64); default: every GPU product found."))
    max_gpus: int | None = Field(default=None, ge=1, le=100_000, description=(
        "Use at most this many GPUs in all, keeping the fastest by the GPU catalog (peak for "
        "the job's precision, then memory); at most 100000."))
    scheduling_policy: SchedulingPolicy | None = Field(default=None, description=(
        "Gang scheduling: scheduler, queue, priority and a pending timeout."))
    ranks_per_pod: int = Field(default=0, ge=0, le=64, description=(
        "Ranks (GPUs) per rank pod: 0 (auto, the default) one pod per node of a pool, as "
        "many ranks as the node had free GPUs at planning, so ranks on one node use "
        "NVLink/P2P; k > 1 the same with at most k ranks a pod; 1 (opt-out) one pod per "
        "GPU. A pod of k ranks requests k GPUs and runs k processes (consecutive ranks, "
        "LOCAL_RANK = GPU)."))
    planner: PlannerSpec = Field(default_factory=PlannerSpec)
    elastic: ElasticSpec | None = Field(default=None, description=(
        "Grow the running job onto GPUs that become free, when that pays for the restart "
        "(off by default)."))
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    tracking: TrackingSpec | None = Field(default=None, description=(
        "Experiment tracking: TensorBoard event files, an MLflow run (off by default)."))
    backoff_limit: int = Field(default=3, ge=0, le=10_000, description=(
        "Gang restarts before Failed (at most 10000)."))
    suspend: bool = Field(default=False, description="Stop all ranks; resume from checkpoint.")
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0, le=315_360_000,
                                                   description=(
        "Delete the job this long after it Succeeded or Failed (at most ten years)."))
    pod_template: PodTemplate | None = Field(default=None, description=(
        "Additions to every rank and profiler pod: env/envFrom (storage credentials), "
        "volumes, labels, annotations, tolerations, priority, CPU/memory."))
    termination_grace_period_seconds: int = Field(default=300, ge=0, le=86_400, description=(
        "Seconds a rank pod gets between SIGTERM (preemption, eviction, restart) and SIGKILL: "
        "long enough for every rank to reach a step boundary and write a checkpoint."))
    active_deadline_seconds: int | None = Field(default=None, ge=1, le=31_536_000, description=(
        "Fail the job (reason DeadlineExceeded) this long after it started (status.startTime); "
        "time spent suspended does not count."))

    @model_validator(mode="after")
    def _model_resolves(self) -> CephaloJobSpec:
        self.model.resolve()  # raises a ValueError naming the bad dimension
        return self


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str | None = None
    namespace: str | None = None

    @field_validator("name")
    @classmethod
    def _job_name(cls, name: str | None) -> str | None:
        # The CRD's root CEL rule says the same (cephalo.api.cel.name_rules).
        if name is not None and (len(name) > MAX_JOB_NAME_CHARS or
                                 not re.fullmatch(JOB_NAME_PATTERN, name)):
            raise ValueError(
                f"{name[:64]!r} is not a job name: at most {MAX_JOB_NAME_CHARS} characters "
                "(rank pods are <name>-rank-<i>, a 63-character hostname), starting with a "
                "letter, only lowercase letters, digits and '-'")
        return name


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


class JobFileError(CephaloError, ValueError):
    """A job file that cannot be used; the message says where and what to fix."""


# More errors than this are counted, not listed: a hostile file can hold thousands.
MAX_LISTED_ERRORS = 5


def format_validation_error(err: ValidationError) -> str:
    """pydantic's errors as one line: `field.path: message; …` (the first few)."""
    parts = []
    errors = err.errors(include_url=False, include_input=False)
    for e in errors[:MAX_LISTED_ERRORS]:
        loc = ".".join(str(p)[:64] for p in e["loc"]) or "(top level)"
        msg = " ".join(e["msg"].removeprefix("Value error, ").split())
        parts.append(f"{loc}: {msg}")
    if len(errors) > MAX_LISTED_ERRORS:
        parts.append(f"and {len(errors) - MAX_LISTED_ERRORS} more")
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
    """Read and validate a CephaloJob YAML file (size, depth and aliases bounded)."""
    try:
        data = load_yaml_file(path, what="CephaloJob YAML file")
    except YamlError as err:
        raise JobFileError(str(err)) from None
    return parse_job(data, source=path)
