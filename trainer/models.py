"""GPT, Llama, ViT and BERT as a sequence of *units*: embedding, N identical blocks, head.

`build_model(config)` builds exactly the architecture `cephalo.api.models.ModelConfig`
describes (its per-unit parameter counts are checked against these modules by a test).

Unit interface (what the engine and the profiler rely on):

* ``model.units[0]``   embedding: ``unit(inputs) -> hidden [m, S, H]``
* ``model.units[1:-1]`` blocks:   ``unit(hidden) -> hidden``
* ``model.units[-1]``  head:      ``unit(hidden, targets) -> per-sample loss [m]`` (fp32)

The global training loss is the mean of the per-sample losses over the global batch, so
every sample weighs the same whatever microbatch or rank it runs on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cephalo.api.models import ModelConfig
from cephalo.trainer.layers import LlamaBlock, PostNormBlock, PreNormBlock, RMSNorm

INIT_STD = 0.02


class GptEmbedding(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        assert c.vocab_size is not None and c.sequence_length is not None
        self.tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.positions = nn.Embedding(c.sequence_length, c.hidden_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tokens(tokens) + self.positions(positions)


class LlamaEmbedding(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        assert c.vocab_size is not None
        self.tokens = nn.Embedding(c.vocab_size, c.hidden_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens)


class BertEmbedding(nn.Module):
    """Word + position + token-type (2 types; all samples use type 0) embeddings, LayerNorm."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        assert c.vocab_size is not None and c.sequence_length is not None
        self.tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.positions = nn.Embedding(c.sequence_length, c.hidden_size)
        self.token_types = nn.Embedding(2, c.hidden_size)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.norm_epsilon)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        hidden = self.tokens(tokens) + self.positions(positions) + self.token_types.weight[0]
        return self.norm(hidden)


class VitEmbedding(nn.Module):
    """Non-overlapping patches by a strided conv, a learned class token, learned positions."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        assert c.patch_size is not None
        self.patches = nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, c.patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, c.hidden_size))
        self.positions = nn.Parameter(torch.zeros(1, c.num_patches + 1, c.hidden_size))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = self.patches(images).flatten(2).transpose(1, 2)  # [m, P, H]
        cls = self.class_token.expand(images.shape[0], -1, -1)
        return torch.cat([cls, patches], dim=1) + self.positions


class LanguageModelHead(nn.Module):
    """Final norm + untied LM head; loss is next-token cross-entropy, mean over positions."""

    def __init__(self, c: ModelConfig, norm: nn.Module) -> None:
        super().__init__()
        assert c.vocab_size is not None
        self.norm = norm
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(hidden).float()
        per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        return per_token.view(targets.shape).mean(dim=1)


class VitHead(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        assert c.num_classes is not None
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.norm_epsilon)
        self.classifier = nn.Linear(c.hidden_size, c.num_classes)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.norm(hidden[:, 0]))

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(hidden).float(), targets, reduction="none")


class BertHead(nn.Module):
    """tanh pooler on the first token + linear classifier."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        assert c.num_classes is not None
        self.pooler = nn.Linear(c.hidden_size, c.hidden_size)
        self.classifier = nn.Linear(c.hidden_size, c.num_classes)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler(hidden[:, 0])))

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(hidden).float(), targets, reduction="none")


def _block(c: ModelConfig) -> nn.Module:
    if c.family == "gpt":
        return PreNormBlock(c.hidden_size, c.num_heads, c.ffn_hidden_size, c.norm_epsilon,
                            causal=True)
    if c.family == "vit":
        return PreNormBlock(c.hidden_size, c.num_heads, c.ffn_hidden_size, c.norm_epsilon,
                            causal=False)
    if c.family == "bert":
        return PostNormBlock(c.hidden_size, c.num_heads, c.ffn_hidden_size, c.norm_epsilon)
    assert c.sequence_length is not None
    return LlamaBlock(c.hidden_size, c.num_heads, c.kv_heads, c.ffn_hidden_size,
                      c.sequence_length, c.norm_epsilon, c.rope_theta, c.rope_scaling)


def _embedding(c: ModelConfig) -> nn.Module:
    return {"gpt": GptEmbedding, "llama": LlamaEmbedding, "bert": BertEmbedding,
            "vit": VitEmbedding}[c.family](c)


def _head(c: ModelConfig) -> nn.Module:
    if c.family == "gpt":
        return LanguageModelHead(c, nn.LayerNorm(c.hidden_size, eps=c.norm_epsilon))
    if c.family == "llama":
        return LanguageModelHead(c, RMSNorm(c.hidden_size, c.norm_epsilon))
    if c.family == "vit":
        return VitHead(c)
    return BertHead(c)


def _init_weights(module: nn.Module) -> None:
    """GPT-2 style: N(0, 0.02) weights, zero biases, unit norms (deterministic under a seed)."""
    if isinstance(module, (nn.Linear, nn.Conv2d)):
        nn.init.normal_(module.weight, std=INIT_STD)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=INIT_STD)
    elif isinstance(module, VitEmbedding):
        nn.init.normal_(module.class_token, std=INIT_STD)
        nn.init.normal_(module.positions, std=INIT_STD)


class UnitModel(nn.Module):
    """A model as `units` (embedding, blocks, head). `forward` is plain, unsharded training:
    per-sample losses of a batch (used by references, export checks and small runs)."""

    def __init__(self, config: ModelConfig, units: list[nn.Module] | None = None) -> None:
        super().__init__()
        self.config = config
        if units is None:
            units = [build_unit(config, i) for i in range(config.num_units)]
        self.units = nn.ModuleList(units)

    def hidden(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.units[0](inputs)
        for block in self.units[1:-1]:
            x = block(x)
        return x

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        head: Any = self.units[-1]  # a head unit (ModuleList erases the type)
        return head.logits(self.hidden(inputs))

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.units[-1](self.hidden(inputs), targets)


def unit_seed(seed: int, index: int) -> int:
    """Each unit draws its initial weights from its own stream, so a unit can be built
    alone (the engine builds, shards and frees one unit at a time: no rank ever holds the
    whole model) and still equal the same unit of `build_model(config, seed)`."""
    return (seed * 1_000_003 + index) % (2**63)


def build_unit(config: ModelConfig, index: int, seed: int | None = None) -> nn.Module:
    """Unit `index` (0: embedding, 1..num_layers: blocks, num_layers + 1: head)."""
    if not 0 <= index < config.num_units:
        raise ValueError(f"unit index {index} out of range 0..{config.num_units - 1}")
    if index == 0:
        make = _embedding
    elif index == config.num_units - 1:
        make = _head
    else:
        make = _block
    if seed is None:
        module = make(config)
        module.apply(_init_weights)
        return module
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(unit_seed(seed, index))
        module = make(config)
        module.apply(_init_weights)
    return module


def build_model(config: ModelConfig, seed: int | None = None) -> UnitModel:
    """The model `config` describes, initialised deterministically from `seed` (if given).

    Build under ``torch.device("meta")`` to count parameters of big presets for free.
    """
    return UnitModel(config, [build_unit(config, i, seed) for i in range(config.num_units)])
