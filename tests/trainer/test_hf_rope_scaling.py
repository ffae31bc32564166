"""RoPE scaling of pretrained Llamas (`linear`, Llama 3.1's `llama3`): Cephalo's inverse
frequencies are transformers' own, its logits equal transformers' at a sequence longer than
the original context (where the scaling matters: without it the logits differ), the export
writes the scaling back so transformers reloads the same model, and `dynamic` / `yarn` are
refused with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from test_hf_parity import _assemble, relative_error, save_random
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from cephalo.api.hf_config import PretrainedError, config_from_hf, read_hf_config
from cephalo.api.job import CephaloJobSpec
from cephalo.api.models import ModelConfig, RopeScaling
from cephalo.cli import main as cli_main
from cephalo.trainer import checkpoint, hf_weights
from cephalo.trainer.engine import Layout
from cephalo.trainer.hf_weights import HfReader
from cephalo.trainer.layers import scale_inv_freq
from cephalo.trainer.models import UnitModel, build_model
from cephalo.trainer.spawn import spawn_ranks

ORIGINAL_CONTEXT = 64
LONG = 96  # longer than the original context the scaling stretches
# head_dim 16 at theta 10000 gives wavelengths 6.3, 19.9, 62.8, 199, ...: with context 64,
# high_freq_factor 8 and low_freq_factor 1, llama3 keeps the first, blends the next two and
# divides the rest by the factor: all three of its branches are exercised.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 8.0, "original_max_position_embeddings": ORIGINAL_CONTEXT}
LINEAR = {"rope_type": "linear", "factor": 4.0}


def scaled_config(scaling: dict | None, legacy: bool = True) -> LlamaConfig:
    """A tiny GQA Llama (head_dim 16); `legacy` passes the scaling as the older
    `rope_scaling` + `rope_theta`, else as transformers 5's `rope_parameters`."""
    rope = ({"rope_scaling": scaling, "rope_theta": 10000.0} if legacy else
            {"rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": 1e4}})
    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=56,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=4 * ORIGINAL_CONTEXT, rms_norm_eps=1e-5, **rope)


def load(folder: Path) -> UnitModel:
    hf = read_hf_config(str(folder))
    config = config_from_hf(hf, {"sequence_length": LONG})
    reader = HfReader(str(folder), config, hf_weights._tied(hf))
    try:
        return _assemble(config, reader, [0.6, 0.4])
    finally:
        reader.close()


@pytest.mark.parametrize("scaling", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_inverse_frequencies_are_transformers_own(scaling: dict) -> None:
    hf = scaled_config(scaling)
    theirs, attention_scaling = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    assert attention_scaling == 1.0  # cos/sin are not rescaled for these types
    unscaled = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    ours = scale_inv_freq(unscaled, config_from_hf(hf.to_dict(),
                                                   {"sequence_length": LONG}).rope_scaling)
    assert torch.allclose(ours.float(), theirs, rtol=1e-6, atol=0)
    ratio = (unscaled / ours).tolist()
    if scaling["rope_type"] == "linear":
        assert ratio == pytest.approx([4.0] * 8)
    else:  # kept, blended (strictly between 1 and factor), divided by the factor
        assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(8.0)
        assert 1.0 < ratio[1] < ratio[2] < 8.0


@pytest.mark.parametrize("scaling, legacy", [(LLAMA3, True), (LLAMA3, False), (LINEAR, True)],
                         ids=["llama3-rope_scaling", "llama3-rope_parameters", "linear"])
def test_logits_match_transformers_beyond_the_original_context(tmp_path: Path, scaling: dict,
                                                               legacy: bool) -> None:
    reference = save_random(scaled_config(scaling, legacy), tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in saved or "rope_scaling" in saved
    ours = load(tmp_path)
    assert ours.config.rope_scaling is not None
    assert ours.config.rope_scaling.type == scaling["rope_type"]
    tokens = torch.randint(0, 96, (2, LONG), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        assert relative_error(ours.logits(tokens), expected) <= 1e-5
        # the same weights with unscaled RoPE are a different model: the test can fail
        unscaled = build_model(ours.config.model_copy(update={"rope_scaling": None}))
        unscaled.load_state_dict(ours.state_dict())
        assert relative_error(unscaled.logits(tokens), expected) > 1e-3


def _train(rank: int, world_size: int, pretrained: str, ckpt: str) -> list[float]:
    from cephalo.trainer.run import train

    job = CephaloJobSpec.model_validate({
        "model": {"pretrained": pretrained, "sequenceLength": LONG}, "globalBatchSize": 2,
        "training": {"steps": 1, "learningRate": 1e-3, "warmupSteps": 0},
        "checkpoint": {"intervalSteps": 1}})
    return train(job, Layout([2], [2], [1.0]), ckpt, verbose=False).losses


def test_export_writes_the_scaling_back(tmp_path: Path) -> None:
    source, ckpt, out = tmp_path / "hf-in", tmp_path / "ckpt", tmp_path / "hf-out"
    save_random(scaled_config(LLAMA3), source)
    spawn_ranks(_train, 1, str(source), str(ckpt))
    info = checkpoint.find_latest(ckpt)
    assert info is not None and info.config.rope_scaling == RopeScaling(
        type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=8.0,
        original_max_position_embeddings=ORIGINAL_CONTEXT)  # kept in the checkpoint
    assert cli_main(["export", str(ckpt), "--format", "hf", "--output", str(out)]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert theirs.config.rope_parameters["rope_type"] == "llama3"
    ours = build_model(info.config)
    ours.load_state_dict(checkpoint.full_state_dict(info))
    tokens = torch.randint(0, 96, (2, LONG), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert relative_error(ours.logits(tokens), theirs(tokens).logits) <= 1e-5
    # and Cephalo reads its own export back to the same architecture
    assert config_from_hf(read_hf_config(str(out)), {"sequence_length": LONG}) == info.config


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "type='dynamic'.*sequence length at run time"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64},
     "type='yarn'.*only the default, linear and llama3"),
    ({**LLAMA3, "low_freq_factor": 8.0}, "high_freq_factor 8.0 > low_freq_factor 8.0"),
])
def test_unsupported_scaling_is_refused_in_one_line(tmp_path: Path, scaling: dict,
                                                    message: str) -> None:
    scaled_config(scaling).save_pretrained(tmp_path)
    with pytest.raises(PretrainedError, match=message) as caught:
        config_from_hf(read_hf_config(str(tmp_path)), {"sequence_length": LONG})
    assert "\n" not in str(caught.value)


def test_unscaled_configs_dump_as_before() -> None:
    """No scaling leaves the dump (manifests, checkpoint meta, profile keys) unchanged, and a
    scaling is refused on families without RoPE."""
    from cephalo.api.models import preset

    assert "rope_scaling" not in preset("llama-tiny").model_dump()
    assert "rope_scaling" not in preset("llama-tiny").architecture_key()
    with pytest.raises(ValueError, match="ropeScaling applies to llama models only"):
        ModelConfig(**preset("gpt-tiny").model_dump(), rope_scaling={"type": "linear",
                                                                     "factor": 2.0})
