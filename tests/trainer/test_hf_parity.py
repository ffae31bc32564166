"""Hugging Face import: tiny random models made here with `transformers` (no download) give
the same logits in Cephalo, each rank reads only its shard ranges, and configs that do not
map are refused with one line naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from transformers import GPT2Config, LlamaConfig, MistralConfig

from cephalo.api.hf_config import PretrainedError, config_from_hf, read_hf_config
from cephalo.api.job import CephaloJobSpec
from cephalo.api.models import ModelConfig
from cephalo.trainer import hf_weights
from cephalo.trainer.flat import FlatUnit
from cephalo.trainer.hf_weights import HfReader
from cephalo.trainer.models import UnitModel, build_unit

SEQ = 16
RATIOS = [0.45, 0.2, 0.35]  # uneven, and not aligned with any tensor boundary


def llama_config(**extra) -> LlamaConfig:
    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=56,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, rms_norm_eps=1e-5, **extra)


def mistral_config() -> MistralConfig:
    return MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=56,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                         max_position_embeddings=64, sliding_window=SEQ, head_dim=8)


def gpt2_config() -> GPT2Config:
    return GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=40)


def save_random(hf_config, folder: Path, shard_size: str | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
    with torch.no_grad():  # non-trivial norms (they start at exactly 1 and 0)
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return model


def load_cephalo(folder: Path | str, ratios: list[float] | None = None) -> UnitModel:
    """A Cephalo model whose every unit is assembled from each rank's reads of its range."""
    hf = read_hf_config(str(folder))
    config = config_from_hf(hf, {"sequence_length": SEQ})
    reader = HfReader(str(folder), config, hf_weights._tied(hf))
    try:
        return _assemble(config, reader, ratios)
    finally:
        reader.close()


def _assemble(config: ModelConfig, reader: HfReader, ratios: list[float] | None) -> UnitModel:
    units = []
    for i in range(config.num_units):
        module = build_unit(config, i, seed=1)
        unit = FlatUnit(i, module, ratios or [1.0], 0)
        pieces = [reader.read(i, unit.specs, s, e) for s, e in unit.bounds]
        flat = torch.cat(pieces)
        for spec in unit.specs:
            owner = module.get_parameter(spec.name)
            with torch.no_grad():
                owner.copy_(flat[spec.offset:spec.offset + spec.numel].view(spec.shape))
        units.append(module)
    return UnitModel(config, units).eval()


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


@pytest.mark.parametrize("make", [
    llama_config, mistral_config, gpt2_config, lambda: llama_config(tie_word_embeddings=True),
    lambda: llama_config(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})],
    ids=["llama-gqa", "mistral", "gpt2", "llama-tied", "llama-theta"])
def test_logits_match_transformers(tmp_path: Path, make) -> None:
    reference = save_random(make(), tmp_path)
    ours = load_cephalo(tmp_path, RATIOS)
    tokens = torch.randint(0, 96, (3, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        got = ours.logits(tokens)
    assert got.shape == expected.shape
    assert relative_error(got, expected) <= 1e-5


def test_sharded_checkpoint_and_only_own_ranges_are_read(tmp_path: Path, monkeypatch) -> None:
    save_random(llama_config(), tmp_path, shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    hf = read_hf_config(str(tmp_path))
    config = config_from_hf(hf, {"sequence_length": SEQ})
    reader = HfReader(str(tmp_path), config, tied=False)
    read_elements: list[int] = []
    original = hf_weights.read_rows

    def counting(handle, name, rows, transpose):
        values = original(handle, name, rows, transpose)
        read_elements.append(values.numel())
        return values

    monkeypatch.setattr(hf_weights, "read_rows", counting)
    for rank in range(len(RATIOS)):
        read_elements.clear()
        own = 0
        slack = 0
        for i in range(config.num_units):
            with torch.device("meta"):
                unit = FlatUnit(i, build_unit(config, i), RATIOS, rank)
            reader.read(i, unit.specs, unit.start, unit.end)
            own += unit.shard_numel
            # at most one partial row on each side of each parameter the range touches
            slack += sum(2 * (s.shape[-1] if len(s.shape) > 1 else 0) for s in unit.specs)
        total = sum(u for u in config.unit_parameters())
        assert own <= sum(read_elements) <= own + slack
        assert sum(read_elements) < 0.6 * total  # far from the whole model


def test_spec_with_pretrained_resolves_and_checks_contradictions(tmp_path: Path) -> None:
    save_random(llama_config(), tmp_path)
    spec = CephaloJobSpec.model_validate({
        "model": {"pretrained": str(tmp_path), "sequenceLength": SEQ}, "globalBatchSize": 4})
    assert spec.model.resolve() == ModelConfig(
        family="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2,
        ffn_hidden_size=56, vocab_size=96, sequence_length=SEQ, norm_epsilon=1e-5)
    with pytest.raises(ValueError, match=r"model.hiddenSize is 64 but the pretrained "
                                         r"config.json says 32"):
        CephaloJobSpec.model_validate({"model": {"pretrained": str(tmp_path), "hiddenSize": 64},
                                       "globalBatchSize": 4})
    with pytest.raises(ValueError, match="sequenceLength 128 exceeds the model's 64 positions"):
        CephaloJobSpec.model_validate({"model": {"pretrained": str(tmp_path),
                                                 "sequenceLength": 128}, "globalBatchSize": 4})
    with pytest.raises(ValueError, match="either `preset` or `pretrained`"):
        CephaloJobSpec.model_validate({"model": {"pretrained": str(tmp_path),
                                                 "preset": "llama-tiny"}, "globalBatchSize": 4})
    # a process that cannot read config.json (the operator) plans with the architecture
    # given next to pretrained; the trainer checks it against config.json before loading
    given = {"family": "llama", "numLayers": 2, "hiddenSize": 32, "numHeads": 4,
             "numKvHeads": 2, "ffnHiddenSize": 56, "vocabSize": 96, "sequenceLength": SEQ}
    elsewhere = CephaloJobSpec.model_validate({
        "model": {"pretrained": "/in/the/trainer/image", **given}, "globalBatchSize": 4})
    assert elsewhere.model.resolve() == spec.model.resolve()
    with pytest.raises(ValueError, match=r"cannot read .*config\.json"):
        CephaloJobSpec.model_validate({"model": {"pretrained": str(tmp_path / "nope")},
                                       "globalBatchSize": 4})


@pytest.mark.parametrize("hf_config, message", [
    (llama_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "rope scaling type='dynamic'.*sequence length at run time"),
    (llama_config(hidden_act="gelu"), "hidden_act='gelu'"),
    (llama_config(attention_bias=True), "attention_bias=True"),
    (MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                   num_attention_heads=4, max_position_embeddings=64, sliding_window=8),
     "sliding_window=8"),
    (GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, activation_function="gelu"),
     "activation_function='gelu'"),
    (transformers.GPTNeoXConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, intermediate_size=64),
     "gpt_neox is not supported"),
])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path: Path, hf_config,
                                                          message: str) -> None:
    hf_config.save_pretrained(tmp_path)
    with pytest.raises(PretrainedError, match=message) as caught:
        config_from_hf(read_hf_config(str(tmp_path)), {"sequence_length": SEQ})
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("name", ["llama-tiny", "gpt-tiny"])
def test_export_names_and_shapes_are_transformers_own(name: str) -> None:
    """A model trained from scratch (no pretrained base) exports under exactly the tensor
    names and shapes that transformers builds from the exported config.json."""
    from cephalo.api.hf_config import to_hf_config
    from cephalo.api.models import preset
    from cephalo.trainer.hf_export import tensor_plan

    config = preset(name)
    hf_config = transformers.AutoConfig.for_model(**to_hf_config(config))
    theirs = transformers.AutoModelForCausalLM.from_config(hf_config).state_dict()
    ours = {hf: tuple(reversed(spec.shape)) if transpose else spec.shape
            for _, spec, hf, transpose in tensor_plan(config)}
    assert ours == {k: tuple(v.shape) for k, v in theirs.items()}


@pytest.mark.parametrize("name", ["llama-tiny", "gpt-tiny", "gpt-small"])
def test_exported_special_token_ids_lie_in_the_vocabulary(name: str) -> None:
    """A model trained from scratch has no special tokens of its own: its config.json must
    not inherit GPT-2's 50256 (transformers then warns on every load and `generate` would
    stop on an id the embedding does not have). A pretrained base's ids are kept."""
    from cephalo.api.hf_config import to_hf_config
    from cephalo.api.models import preset

    config = preset(name)
    hf_config = transformers.AutoConfig.for_model(**to_hf_config(config))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(hf_config, key)
        assert value is None or 0 <= value < config.vocab_size, (key, value)
    kept = to_hf_config(config, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    assert (kept["bos_token_id"], kept["eos_token_id"], kept["pad_token_id"]) == (1, 2, 0)
    # Llama 3 lists several eos ids; an id outside this vocabulary is dropped, not kept.
    assert to_hf_config(config, {"eos_token_id": [1, 2]})["eos_token_id"] == [1, 2]
    assert to_hf_config(config, {"eos_token_id": [1, 10**6]})["eos_token_id"] is None


def test_bf16_checkpoint_loads_as_fp32_masters(tmp_path: Path) -> None:
    reference = save_random(llama_config(), tmp_path / "fp32")
    reference.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    ours = load_cephalo(tmp_path / "bf16", RATIOS)
    tokens = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():  # the bf16 values, upcast: transformers' model in fp32 again
        assert relative_error(ours.logits(tokens), reference.float()(tokens).logits) <= 1e-5
