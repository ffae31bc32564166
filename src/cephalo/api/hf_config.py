"""Hugging Face `config.json` <-> `ModelConfig`, torch-free (the planner and the operator
resolve a pretrained model's architecture with it).

Which Hugging Face architectures map exactly onto a Cephalo family:

* ``llama`` (LlamaForCausalLM) -> ``llama``: GQA (`num_key_value_heads`), `rms_norm_eps`,
  `rope_theta`; SiLU, no attention/MLP bias, head_dim = hidden / heads. RoPE scaling
  ``linear`` and ``llama3`` (Llama 3.1/3.2/3.3) become `ModelConfig.rope_scaling`, computed
  as transformers does; ``dynamic`` (frequencies depend on the run-time sequence length),
  ``yarn``, ``longrope`` and the rest are refused. Tied embeddings are copied into
  Cephalo's untied LM head.
* ``mistral`` (MistralForCausalLM) -> ``llama`` with the same rules; its sliding window is
  *refused* unless the training sequence fits inside it (sequenceLength <= sliding_window),
  where sliding-window attention equals full causal attention.
* ``gpt2`` (GPT2LMHeadModel) -> ``gpt``: learned positions, pre-LayerNorm, fused QKV with
  bias (Conv1D weights, stored transposed), tanh-approximated GELU (``gelu_new`` /
  ``gelu_pytorch_tanh``), LM head tied to the token embedding (copied, then trained untied).
* GPT-NeoX is refused: rotary embeddings (usually partial), parallel residuals and a
  per-head interleaved fused QKV have no counterpart in Cephalo's gpt unit.

`resolve_pretrained` reads `config.json` from a local folder or (when fsspec is installed
and the process has the storage's credentials) from an fsspec URL. A process that cannot
read it (the operator: the folder lives in the trainer image or on a volume it does not
mount) needs the architecture written next to `pretrained` (family and dimensions); the
trainer then checks those against `config.json` before it loads a single weight.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cephalo.api.models import ModelConfig, RopeScaling
from cephalo.errors import CephaloError

CONFIG_FILE = "config.json"
DEFAULT_SEQUENCE_LENGTH = 512  # as for a custom model (ModelSpec.resolve)
LLAMA_TYPES = ("llama", "mistral")
GPT2_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # both are the tanh approximation of GELU
SCALED_ROPE_TYPES = ("linear", "llama3")
LLAMA3_FIELDS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class PretrainedError(CephaloError, ValueError):
    """A pretrained checkpoint Cephalo cannot use (ValueError too, so a pydantic validator
    turns it into a spec error)."""


def is_url(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


def join(location: str, name: str) -> str:
    if is_url(location):
        return location.rstrip("/") + "/" + name
    return str(Path(location.removeprefix("file://")) / name)


@lru_cache(maxsize=32)
def _read_text(path: str, mtime_ns: int) -> str:  # mtime in the key: a rewritten file rereads
    if not is_url(path):
        return Path(path).read_text()
    import fsspec  # not in the operator image: only processes that have it read URLs

    with fsspec.open(path, "rt") as f:
        return f.read()


def read_hf_config(location: str) -> dict[str, Any]:
    """The parsed config.json of a Hugging Face checkpoint folder or URL."""
    path = join(location, CONFIG_FILE)
    try:
        mtime = 0 if is_url(path) else os.stat(path).st_mtime_ns
        data = json.loads(_read_text(path, mtime))
    except (OSError, ImportError, ValueError) as err:
        raise PretrainedError(
            f"model.pretrained: cannot read {path} ({type(err).__name__}: {err}); a "
            f"process that cannot reach it (e.g. the operator) needs the architecture "
            f"(family and dimensions) given next to pretrained") from None
    if not isinstance(data, dict):
        raise PretrainedError(f"model.pretrained: {path} is not a JSON object")
    return data


def _rope(hf: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    """(rope_theta, rope type, its parameters) from either transformers 5's
    `rope_parameters` or the older top-level `rope_theta` + `rope_scaling`. Like
    transformers 5's config loading, a legacy `rope_scaling` replaces `rope_parameters`."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or params.get("type") or "default"
    return float(theta), str(kind), params


def _rope_scaling(hf: dict[str, Any], model_type: str, kind: str,
                  params: dict[str, Any]) -> RopeScaling | None:
    """The scaling of a `linear` or `llama3` rope type (None for `default`)."""
    if kind == "default":
        return None
    if kind not in SCALED_ROPE_TYPES:
        why = ("its frequencies depend on the sequence length at run time" if kind == "dynamic"
               else "only the default, linear and llama3 rope types are supported")
        raise _refuse(model_type, "rope scaling type", kind, why)
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _refuse(model_type, "partial_rotary_factor", params["partial_rotary_factor"],
                      "Cephalo rotates the whole head")
    values: dict[str, Any] = {"type": kind, "factor": params.get("factor")}
    if kind == "llama3":
        values.update({k: params.get(k) for k in LLAMA3_FIELDS})
        # transformers: a top-level original_max_position_embeddings wins, and a missing
        # one falls back to max_position_embeddings.
        values["original_max_position_embeddings"] = (
            hf.get("original_max_position_embeddings")
            or values["original_max_position_embeddings"] or hf.get("max_position_embeddings"))
    try:
        return RopeScaling(**values)
    except ValidationError as err:
        why = "; ".join(".".join(map(str, e["loc"])) + ": " + e["msg"] if e["loc"] else e["msg"]
                        for e in err.errors())
        raise _refuse(model_type, "rope scaling", params, why) from None


def _refuse(model_type: str, field: str, value: Any, why: str) -> PretrainedError:
    return PretrainedError(f"model.pretrained: {model_type} config.json has {field}={value!r}, "
                           f"which Cephalo cannot train exactly: {why}")


def _llama(hf: dict[str, Any], kind: str) -> dict[str, Any]:
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    checks = [("hidden_act", hf.get("hidden_act", "silu"), "silu", "the MLP is SwiGLU (SiLU)"),
              ("attention_bias", bool(hf.get("attention_bias", False)), False,
               "attention projections have no bias"),
              ("mlp_bias", bool(hf.get("mlp_bias", False)), False, "MLP has no bias")]
    for field, value, want, why in checks:
        if value != want:
            raise _refuse(kind, field, value, why)
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != hidden:
        raise _refuse(kind, "head_dim", head_dim,
                      f"Cephalo's head size is hidden_size / num_attention_heads = "
                      f"{hidden // heads}")
    theta, rope_type, rope_params = _rope(hf)
    scaling = _rope_scaling(hf, kind, rope_type, rope_params)
    values = dict(family="llama", num_layers=int(hf["num_hidden_layers"]), hidden_size=hidden,
                num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                ffn_hidden_size=int(hf["intermediate_size"]), vocab_size=int(hf["vocab_size"]),
                norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta)
    if scaling is not None:  # absent when unscaled: the config equals a hand-written one
        values["rope_scaling"] = scaling
    return values


def _gpt2(hf: dict[str, Any]) -> dict[str, Any]:
    hidden = int(hf["n_embd"])
    act = hf.get("activation_function", "gelu_new")
    if act not in GPT2_GELUS:
        raise _refuse("gpt2", "activation_function", act,
                      f"the GPT unit uses tanh-approximated GELU ({', '.join(GPT2_GELUS)})")
    for field, want, why in (("scale_attn_weights", True, "attention scores are scaled by "
                              "1/sqrt(head size)"),
                             ("scale_attn_by_inverse_layer_idx", False, "no per-layer scaling"),
                             ("add_cross_attention", False, "decoder-only")):
        if bool(hf.get(field, want)) != want:
            raise _refuse("gpt2", field, hf.get(field), why)
    return dict(family="gpt", num_layers=int(hf["n_layer"]), hidden_size=hidden,
                num_heads=int(hf["n_head"]), ffn_hidden_size=int(hf.get("n_inner") or 4 * hidden),
                vocab_size=int(hf["vocab_size"]),
                norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)))


def max_positions(hf: dict[str, Any]) -> int:
    return int(hf.get("n_positions") or hf.get("max_position_embeddings") or 0)


def architecture(hf: dict[str, Any], sequence_length: int | None) -> dict[str, Any]:
    """ModelConfig fields of a Hugging Face config (PretrainedError if it does not map)."""
    kind = str(hf.get("model_type", ""))
    try:
        if kind in LLAMA_TYPES:
            values = _llama(hf, kind)
        elif kind == "gpt2":
            values = _gpt2(hf)
        elif kind == "gpt_neox":
            raise PretrainedError(
                "model.pretrained: gpt_neox is not supported: its rotary embeddings, parallel "
                "residual and per-head fused QKV do not match Cephalo's gpt unit (supported: "
                "llama, mistral, gpt2)")
        else:
            raise PretrainedError(f"model.pretrained: model_type {kind!r} is not supported "
                                  f"(supported: llama, mistral, gpt2)")
    except (KeyError, TypeError) as err:
        raise PretrainedError(f"model.pretrained: {kind} config.json lacks or garbles a "
                              f"field ({type(err).__name__}: {err})") from None
    limit = max_positions(hf)
    seq = sequence_length or (min(limit, DEFAULT_SEQUENCE_LENGTH) if limit
                              else DEFAULT_SEQUENCE_LENGTH)
    if limit and seq > limit:
        raise PretrainedError(f"model.pretrained: sequenceLength {seq} exceeds the model's "
                              f"{limit} positions (max_position_embeddings / n_positions)")
    window = hf.get("sliding_window")
    if window is not None and kind == "mistral" and seq > int(window):
        raise _refuse(kind, "sliding_window", window,
                      f"sliding-window attention is only supported when it equals full "
                      f"attention, i.e. sequenceLength {seq} <= sliding_window")
    values["sequence_length"] = seq
    return values


def config_from_hf(hf: dict[str, Any], given: dict[str, Any]) -> ModelConfig:
    """The architecture of a Hugging Face config; `given` (snake_case fields written next to
    `pretrained`) may set sequence_length and must agree with config.json on the rest."""
    values = architecture(hf, given.get("sequence_length"))
    for field, value in given.items():
        if field in values and values[field] != value:
            raise PretrainedError(
                f"model.{_camel(field)} is {value!r} but the pretrained config.json says "
                f"{values[field]!r}; drop the field or fix it")
    unknown = sorted(set(given) - set(values))
    if unknown:
        raise PretrainedError(f"model.{_camel(unknown[0])} does not apply to a pretrained "
                              f"{values['family']} model")
    try:
        return ModelConfig(**values)
    except ValueError as err:
        raise PretrainedError(f"model.pretrained: {err}") from None


def resolve_pretrained(location: str, given: dict[str, Any]) -> ModelConfig:
    """ModelSpec.resolve() for a pretrained model: config.json when this process can read
    it, else the architecture given in the spec (checked against config.json by the trainer)."""
    try:
        hf = read_hf_config(location)
    except PretrainedError:
        complete = {"family", "num_layers", "hidden_size", "num_heads", "vocab_size"}
        if not complete <= set(given):
            raise
        values = dict(given)
        values.setdefault("ffn_hidden_size", 4 * values["hidden_size"])
        values.setdefault("sequence_length", DEFAULT_SEQUENCE_LENGTH)
        return ModelConfig(**values)
    return config_from_hf(hf, given)


def _camel(field: str) -> str:
    head, *rest = field.split("_")
    return head + "".join(p.title() for p in rest)


def to_hf_config(config: ModelConfig, base: dict[str, Any] | None = None,
                 dtype: str = "float32") -> dict[str, Any]:
    """A transformers-loadable config.json for `config` (llama -> Llama, or Mistral if the
    pretrained base was one; gpt -> GPT-2). `base`: the pretrained config.json to keep
    token ids and other non-architecture fields from."""
    base = dict(base or {})
    for stale in ("rope_scaling", "rope_parameters", "torch_dtype", "dtype",
                  "transformers_version", "_name_or_path"):
        base.pop(stale, None)
    if config.family == "llama":
        kind = base.get("model_type") if base.get("model_type") in LLAMA_TYPES else "llama"
        keep_window = kind == "mistral"
        if not keep_window:
            base.pop("sliding_window", None)
        base.update(
            model_type=kind,
            architectures=["MistralForCausalLM" if kind == "mistral" else "LlamaForCausalLM"],
            hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
            num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
            num_key_value_heads=config.kv_heads, head_dim=config.head_dim,
            vocab_size=config.vocab_size, hidden_act="silu",
            rms_norm_eps=config.norm_epsilon, rope_theta=config.rope_theta,
            attention_bias=False, mlp_bias=False,
            max_position_embeddings=max(max_positions(base), config.sequence_length or 0))
        if config.rope_scaling is not None:
            # The legacy `rope_scaling` form: transformers 5 reads it (and turns it into
            # rope_parameters), as do transformers 4 and vLLM.
            base["rope_scaling"] = {"rope_type": config.rope_scaling.type,
                                    **config.rope_scaling.model_dump(exclude={"type"},
                                                                     exclude_none=True)}
    elif config.family == "gpt":
        base.update(
            model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=config.hidden_size,
            n_layer=config.num_layers, n_head=config.num_heads,
            n_inner=config.ffn_hidden_size, vocab_size=config.vocab_size,
            n_positions=config.sequence_length, activation_function="gelu_new",
            layer_norm_epsilon=config.norm_epsilon, scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False, add_cross_attention=False)
    else:
        raise PretrainedError(f"a {config.family} model has no Hugging Face export (supported: "
                              f"llama, gpt)")
    # Cephalo trains the LM head untied from the embedding (a tied import is copied).
    base.update(tie_word_embeddings=False, torch_dtype=dtype)
    for key in SPECIAL_TOKEN_IDS:
        base[key] = _in_vocabulary(base.get(key), config.vocab_size or 0)
    return base


# Written explicitly: absent, transformers fills in its class defaults (GPT-2's 50256, outside
# a from-scratch model's vocabulary: a warning on every load, and `generate` would wait for
# an id the embedding lacks). A pretrained base's ids are kept.
SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _in_vocabulary(token_id: Any, vocab_size: int) -> Any:
    """`token_id` (an id or a list of ids, as Llama 3 lists several eos ids) if every id lies
    in the vocabulary, else None."""
    ids = token_id if isinstance(token_id, list) else [token_id]
    ok = all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size
             for i in ids) and ids
    return token_id if ok else None
