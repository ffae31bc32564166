"""Transformer building blocks shared by the model families (written for clarity).

Attention goes through `torch.nn.functional.scaled_dot_product_attention`, which picks the
fastest kernel available (flash / memory-efficient on GPU, a fused math kernel on CPU).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cephalo.api.models import RopeScaling


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale and no bias (Llama)."""

    def __init__(self, size: int, epsilon: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.epsilon = epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even under bf16 autocast: the mean of squares loses precision.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.epsilon)
        return (normed * self.weight.float()).to(x.dtype)


def scale_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies under a pretrained model's RoPE scaling, as transformers'
    `_compute_linear_scaling_rope_parameters` / `_compute_llama3_parameters` compute them."""
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    context = scaling.original_max_position_embeddings
    assert low is not None and high is not None and context is not None  # RopeScaling checks
    wavelength = 2 * math.pi / inv_freq
    # Long wavelengths (beyond context / low) are interpolated by `factor`, short ones (below
    # context / high) kept, and those in between blended linearly in context / wavelength.
    scaled = torch.where(wavelength > context / low, inv_freq / scaling.factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(medium, blended, scaled)


def rope_tables(sequence_length: int, head_dim: int, theta: float,
                scaling: RopeScaling | None = None) -> torch.Tensor:
    """cos/sin tables for rotary embeddings, shape [2, T, head_dim] (rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    inv_freq = scale_inv_freq(inv_freq, scaling)
    angles = torch.outer(torch.arange(sequence_length, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()]).float()


def apply_rope(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rotate query/key pairs; x is [batch, heads, T, head_dim]."""
    seq = x.shape[-2]
    cos, sin = tables[0, :seq].to(x.dtype), tables[1, :seq].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class FusedSelfAttention(nn.Module):
    """Multi-head attention with one fused QKV projection (GPT, ViT, BERT), biases on."""

    def __init__(self, hidden_size: int, num_heads: int, causal: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.causal = causal
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).split(hidden, dim=-1)
        shape = (batch, seq, self.num_heads, hidden // self.num_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, hidden))


class GroupedQueryAttention(nn.Module):
    """Llama attention: separate Q/K/V/O projections without bias, RoPE, K/V heads shared
    by groups of query heads."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int,
                 sequence_length: int, rope_theta: float,
                 rope_scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden_size // num_heads
        kv_width = num_kv_heads * self.head_dim
        self.q = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k = nn.Linear(hidden_size, kv_width, bias=False)
        self.v = nn.Linear(hidden_size, kv_width, bias=False)
        self.o = nn.Linear(hidden_size, hidden_size, bias=False)
        # Not persistent: derived from the config, so it never enters a state_dict.
        self.register_buffer("rope", rope_tables(sequence_length, self.head_dim, rope_theta,
                                                 rope_scaling), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q = self.q(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        rope: torch.Tensor = self.rope  # type: ignore[assignment]  # a buffer, not a Module
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, seq, hidden))


class GeluMLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden_size, ffn_hidden_size)
        self.out = nn.Linear(ffn_hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x), approximate="tanh"))


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.up = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.down = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class PreNormBlock(nn.Module):
    """GPT / ViT block: x + attn(LN(x)); x + mlp(LN(x))."""

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: int,
                 epsilon: float, causal: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden_size, eps=epsilon)
        self.attn = FusedSelfAttention(hidden_size, num_heads, causal)
        self.ln2 = nn.LayerNorm(hidden_size, eps=epsilon)
        self.mlp = GeluMLP(hidden_size, ffn_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class PostNormBlock(nn.Module):
    """BERT encoder block: LN(x + attn(x)); LN(x + mlp(x)), bidirectional."""

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: int,
                 epsilon: float) -> None:
        super().__init__()
        self.attn = FusedSelfAttention(hidden_size, num_heads, causal=False)
        self.ln1 = nn.LayerNorm(hidden_size, eps=epsilon)
        self.mlp = GeluMLP(hidden_size, ffn_hidden_size)
        self.ln2 = nn.LayerNorm(hidden_size, eps=epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


class LlamaBlock(nn.Module):
    """x + gqa(RMSNorm(x)); x + swiglu(RMSNorm(x))."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int,
                 ffn_hidden_size: int, sequence_length: int, epsilon: float,
                 rope_theta: float, rope_scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.norm1 = RMSNorm(hidden_size, epsilon)
        self.attn = GroupedQueryAttention(hidden_size, num_heads, num_kv_heads,
                                          sequence_length, rope_theta, rope_scaling)
        self.norm2 = RMSNorm(hidden_size, epsilon)
        self.mlp = SwiGLU(hidden_size, ffn_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))
