"""Transformer architectures as plain data: presets, parameter counts and FLOPs.

This is the one description of a model that the planner (memory and compute estimates), the
profiler and the trainer (`cephalo.trainer.models.build_model`) share, so that the planner's
parameter counts are exactly the trainer's. Every model is a sequence of *units*: an
embedding unit, `num_layers` identical blocks, and a head unit. The engine shards, gathers
and schedules one unit at a time.

Architectures (all written out in `cephalo.trainer.models`):

* ``gpt``   token + learned position embedding; pre-LayerNorm blocks (fused QKV with bias,
  GELU MLP); final LayerNorm + untied LM head (no bias).
* ``llama`` token embedding; pre-RMSNorm blocks with RoPE, grouped-query attention and a
  SwiGLU MLP, no biases; final RMSNorm + untied LM head.
* ``vit``   patch embedding (conv), class token, learned positions; GPT-style blocks
  (bidirectional); final LayerNorm + linear classifier on the class token.
* ``bert``  token + position + token-type embedding with LayerNorm; post-LayerNorm encoder
  blocks; tanh pooler on the first token + linear classifier.
"""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

Family = Literal["gpt", "llama", "vit", "bert"]
TEXT_FAMILIES = ("gpt", "llama", "bert")


class RopeScaling(BaseModel):
    """RoPE frequency scaling of a pretrained Llama (Hugging Face `rope_scaling`), computed
    as transformers does. ``linear`` divides every inverse frequency by `factor`; ``llama3``
    (Llama 3.1+) divides only the low frequencies (wavelength > original context /
    low_freq_factor) by `factor`, keeps the high ones (wavelength < original context /
    high_freq_factor) and interpolates smoothly in between. Both leave cos/sin unscaled
    (transformers' attention_scaling is 1). `dynamic`, `yarn` and `longrope` are not
    supported (dynamic's frequencies depend on the run-time sequence length)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["linear", "llama3"]
    factor: float = Field(ge=1.0, le=1024.0)
    low_freq_factor: float | None = Field(default=None, gt=0.0, description="llama3 only")
    high_freq_factor: float | None = Field(default=None, gt=0.0, description="llama3 only")
    original_max_position_embeddings: int | None = Field(default=None, ge=1, le=1_048_576,
                                                         description="llama3 only")

    @model_validator(mode="after")
    def _check(self) -> RopeScaling:
        llama3 = (self.low_freq_factor, self.high_freq_factor,
                  self.original_max_position_embeddings)
        if self.type == "linear" and any(v is not None for v in llama3):
            raise ValueError("linear RoPE scaling takes only a factor")
        if self.type == "llama3":
            if any(v is None for v in llama3):
                raise ValueError("llama3 RoPE scaling needs low_freq_factor, high_freq_factor "
                                 "and original_max_position_embeddings")
            if self.high_freq_factor <= self.low_freq_factor:  # type: ignore[operator]
                raise ValueError(f"llama3 RoPE scaling needs high_freq_factor "
                                 f"{self.high_freq_factor} > low_freq_factor "
                                 f"{self.low_freq_factor}")
        return self


class ModelConfig(BaseModel):
    """A fully resolved architecture (snake_case; the CRD's camelCase spec resolves to this)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The same maxima as the CephaloJob's ModelSpec (a test checks): a config read back from
    # a checkpoint's meta.json is bounded like a spec, so a corrupted one cannot make the
    # planner or an export allocate without bound.
    family: Family
    num_layers: int = Field(ge=1, le=1024)
    hidden_size: int = Field(ge=1, le=65_536)
    num_heads: int = Field(ge=1, le=1024)
    num_kv_heads: int | None = Field(default=None, ge=1, le=1024, description="llama only (GQA)")
    ffn_hidden_size: int = Field(ge=1, le=262_144)
    vocab_size: int | None = Field(default=None, ge=2, le=4_194_304)
    sequence_length: int | None = Field(default=None, ge=1, le=1_048_576)
    image_size: int | None = Field(default=None, ge=1, le=16_384)
    patch_size: int | None = Field(default=None, ge=1, le=16_384)
    num_channels: int = Field(default=3, ge=1, le=64)
    num_classes: int | None = Field(default=None, ge=2, le=4_194_304)
    norm_epsilon: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = Field(default=None, description="llama only")

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict:
        # Unscaled RoPE is left out, so every config (and the manifests, profile keys and
        # checkpoint metadata made from its dump) reads exactly as before the field existed.
        data = handler(self)
        if data.get("rope_scaling", 0) is None:
            del data["rope_scaling"]
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.rope_scaling is not None and self.family != "llama":
            raise ValueError(f"ropeScaling applies to llama models only, not {self.family}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hiddenSize {self.hidden_size} is not divisible by numHeads {self.num_heads}"
            )
        kv = self.kv_heads
        if self.num_heads % kv:
            raise ValueError(f"numHeads {self.num_heads} is not divisible by numKvHeads {kv}")
        if self.family in TEXT_FAMILIES and (self.vocab_size is None
                                             or self.sequence_length is None):
            raise ValueError(f"a {self.family} model needs vocabSize and sequenceLength")
        if self.family == "vit":
            if self.image_size is None or self.patch_size is None or self.num_classes is None:
                raise ValueError("a vit model needs imageSize, patchSize and numClasses")
            if self.image_size % self.patch_size:
                raise ValueError(
                    f"imageSize {self.image_size} is not divisible by patchSize {self.patch_size}"
                )
        if self.family == "bert" and self.num_classes is None:
            raise ValueError("a bert model needs numClasses (it is a sequence classifier)")
        if self.family == "llama" and (self.hidden_size // self.num_heads) % 2:
            raise ValueError("llama head size (hiddenSize / numHeads) must be even for RoPE")
        return self

    # ---- shape facts -------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads if self.family == "llama" and self.num_kv_heads else self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_patches(self) -> int:
        assert self.image_size is not None and self.patch_size is not None
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_sample(self) -> int:
        """Sequence positions one sample runs through each block."""
        if self.family == "vit":
            return self.num_patches + 1
        assert self.sequence_length is not None
        return self.sequence_length

    @property
    def num_units(self) -> int:
        return self.num_layers + 2

    # ---- parameter counts (must equal the trainer's modules; a trainer test checks) ------
    def embedding_parameters(self) -> int:
        h = self.hidden_size
        if self.family == "gpt":
            return self.vocab_size * h + self.sequence_length * h  # type: ignore[operator]
        if self.family == "llama":
            return self.vocab_size * h  # type: ignore[operator]
        if self.family == "bert":
            return (self.vocab_size + self.sequence_length + 2) * h + 2 * h  # type: ignore[operator]
        patch = self.num_channels * self.patch_size**2 * h + h  # type: ignore[operator]
        return patch + h + (self.num_patches + 1) * h

    def block_parameters(self) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size
        if self.family == "llama":
            kv_width = self.kv_heads * self.head_dim
            attention = 2 * h * h + 2 * h * kv_width
            return attention + 3 * h * f + 2 * h
        # LayerNorms (2 x 2h), fused QKV + output projection with biases, 2-layer GELU MLP.
        return 4 * h * h + 2 * h * f + 9 * h + f

    def head_parameters(self) -> int:
        h = self.hidden_size
        if self.family == "gpt":
            return 2 * h + h * self.vocab_size  # type: ignore[operator]
        if self.family == "llama":
            return h + h * self.vocab_size  # type: ignore[operator]
        if self.family == "vit":
            return 2 * h + h * self.num_classes + self.num_classes  # type: ignore[operator]
        return h * h + h + h * self.num_classes + self.num_classes  # type: ignore[operator]

    def unit_parameters(self) -> list[int]:
        """Parameter count of each unit in execution order."""
        return [
            self.embedding_parameters(),
            *([self.block_parameters()] * self.num_layers),
            self.head_parameters(),
        ]

    def total_parameters(self) -> int:
        return sum(self.unit_parameters())

    # ---- FLOPs (forward, per sample; backward is 2x, recompute adds 1x forward) ----------
    def block_forward_flops(self) -> float:
        tokens = self.tokens_per_sample
        matmul_weights = self.block_parameters() - (2 * self.hidden_size)
        attention = 4 * tokens * tokens * self.hidden_size  # QK^T and AV
        return 2.0 * matmul_weights * tokens + attention

    def other_forward_flops(self) -> float:
        """Embedding + head per sample (lookups are free; LM heads are one big matmul)."""
        h = self.hidden_size
        if self.family in ("gpt", "llama"):
            return 2.0 * h * self.vocab_size * self.tokens_per_sample  # type: ignore[operator]
        if self.family == "vit":
            return 2.0 * self.embedding_parameters() * self.num_patches
        return 2.0 * (h * h + h * self.num_classes)  # type: ignore[operator]

    def forward_flops_per_sample(self) -> float:
        return self.num_layers * self.block_forward_flops() + self.other_forward_flops()

    def training_flops_per_sample(self) -> float:
        """Useful FLOPs of one training sample (3x forward; recompute is not counted)."""
        return 3.0 * self.forward_flops_per_sample()

    def architecture_key(self) -> str:
        """Stable identity of the shapes (for profile caching): every field, in order."""
        return ",".join(f"{k}={v}" for k, v in self.model_dump().items())


def _gpt(layers: int, hidden: int, heads: int, seq: int = 512) -> dict:
    return dict(family="gpt", num_layers=layers, hidden_size=hidden, num_heads=heads,
                ffn_hidden_size=4 * hidden, vocab_size=50257, sequence_length=seq)


# The paper's models (Table 2) with their published dimensions, plus tiny presets for tests and
# laptops. Sequence length 512 for text, as in the paper's evaluation.
PRESETS: dict[str, dict] = {
    "bert-large": dict(family="bert", num_layers=24, hidden_size=1024, num_heads=16,
                       ffn_hidden_size=4096, vocab_size=30522, sequence_length=512,
                       num_classes=2),
    # ViT-G as the paper trains it (48 layers, width 1664, 1.84B) at 384 px. The authors'
    # parameter counts (1,843,609,345 with a 1-output head) pin their patch size to 16:
    # 24 x 24 patches + the class token = 577 tokens per image.
    "vit-g": dict(family="vit", num_layers=48, hidden_size=1664, num_heads=16,
                  ffn_hidden_size=8192, image_size=384, patch_size=16, num_classes=1000),
    # ViT-g/14 (lower-case "giant", 1.0B; what "vit-g" named before it followed the paper).
    "vit-giant-1b": dict(family="vit", num_layers=40, hidden_size=1408, num_heads=16,
                         ffn_hidden_size=6144, image_size=224, patch_size=14, num_classes=1000),
    "vit-e": dict(family="vit", num_layers=56, hidden_size=1792, num_heads=16,
                  ffn_hidden_size=15360, image_size=224, patch_size=14, num_classes=1000),
    "gpt-1.3b": _gpt(24, 2048, 16),
    "gpt-2.7b": _gpt(32, 2560, 32),
    "gpt-6.7b": _gpt(32, 4096, 32),
    "llama-3b": dict(family="llama", num_layers=26, hidden_size=3200, num_heads=32,
                     num_kv_heads=32, ffn_hidden_size=8640, vocab_size=32000,
                     sequence_length=512, norm_epsilon=1e-6),
    "llama-7b": dict(family="llama", num_layers=32, hidden_size=4096, num_heads=32,
                     num_kv_heads=32, ffn_hidden_size=11008, vocab_size=32000,
                     sequence_length=512, norm_epsilon=1e-6),
    "gpt-tiny": dict(family="gpt", num_layers=2, hidden_size=64, num_heads=4,
                     ffn_hidden_size=256, vocab_size=256, sequence_length=32),
    "gpt-small": dict(family="gpt", num_layers=4, hidden_size=128, num_heads=4,
                      ffn_hidden_size=512, vocab_size=512, sequence_length=64),
    "llama-tiny": dict(family="llama", num_layers=2, hidden_size=64, num_heads=4,
                       num_kv_heads=2, ffn_hidden_size=176, vocab_size=256,
                       sequence_length=32),
    "vit-tiny": dict(family="vit", num_layers=2, hidden_size=64, num_heads=4,
                     ffn_hidden_size=256, image_size=32, patch_size=8, num_classes=10),
    "bert-tiny": dict(family="bert", num_layers=2, hidden_size=64, num_heads=4,
                      ffn_hidden_size=256, vocab_size=256, sequence_length=32, num_classes=2),
}


def preset(name: str) -> ModelConfig:
    """The named preset, or a ValueError listing the known names."""
    try:
        return ModelConfig(**PRESETS[name])
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown model preset {name!r}; known presets: {known}") from None
