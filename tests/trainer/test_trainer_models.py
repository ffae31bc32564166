"""build_model builds exactly what ModelConfig describes, as units the engine can run."""

from __future__ import annotations

import pytest
import torch

from cephalo.api.models import PRESETS, ModelConfig, preset
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import run_unit_for_profile
from cephalo.trainer.models import build_model

TINY = ["gpt-tiny", "llama-tiny", "vit-tiny", "bert-tiny"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_unit_parameter_counts_match_model_config(name: str) -> None:
    config = preset(name)
    with torch.device("meta"):  # the 7B presets cost nothing to count here
        model = build_model(config)
    counts = [sum(p.numel() for p in unit.parameters()) for unit in model.units]
    assert counts == config.unit_parameters()
    assert len(model.units) == config.num_units


def test_custom_gqa_llama_counts() -> None:
    config = ModelConfig(family="llama", num_layers=3, hidden_size=96, num_heads=6,
                         num_kv_heads=2, ffn_hidden_size=200, vocab_size=300,
                         sequence_length=16)
    model = build_model(config)
    assert [sum(p.numel() for p in u.parameters()) for u in model.units] == \
        config.unit_parameters()


@pytest.mark.parametrize("name", TINY)
def test_units_compose_to_the_model_and_state_dict_has_only_parameters(name: str) -> None:
    torch.manual_seed(0)
    config = preset(name)
    model = build_model(config, seed=3)
    assert torch.equal(next(model.parameters()), next(build_model(config, seed=3).parameters()))
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters()}
    from cephalo.api.job import DataSpec, SyntheticData

    inputs, targets = DataSource(config, DataSpec(synthetic=SyntheticData()), 0).batch(0, 0, 3)
    x = model.units[0](inputs)
    assert x.shape == (3, config.tokens_per_sample, config.hidden_size)
    for block in model.units[1:-1]:
        x = block(x)
    losses = model.units[-1](x, targets)
    assert losses.shape == (3,)
    assert torch.allclose(losses, model(inputs, targets))
    assert torch.isfinite(losses).all()


def test_causal_models_do_not_look_ahead() -> None:
    for name in ("gpt-tiny", "llama-tiny"):
        config = preset(name)
        model = build_model(config, seed=0)
        tokens = torch.randint(0, 256, (1, config.tokens_per_sample))
        changed = tokens.clone()
        changed[0, -1] = (changed[0, -1] + 1) % 256
        with torch.no_grad():
            a, b = model.logits(tokens), model.logits(changed)
        assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-6)
        assert not torch.allclose(a[:, -1], b[:, -1])


def test_run_unit_for_profile_times_one_block() -> None:
    config = preset("llama-tiny")
    block = build_model(config, seed=0).units[1]
    hidden = torch.randn(2, config.tokens_per_sample, config.hidden_size)
    timing = run_unit_for_profile(block, hidden, torch.device("cpu"), repeats=2)
    assert timing.micro_batch_size == 2
    assert timing.forward_seconds > 0 and timing.backward_seconds > 0
    assert timing.peak_memory_bytes is None  # CPU


def test_recompute_backward_of_a_flat_unit_equals_plain_autograd() -> None:
    from cephalo.trainer.flat import FlatUnit
    from cephalo.trainer.unit_ops import backward_unit, forward_unit

    config = preset("gpt-tiny")
    plain = build_model(config, seed=1).units[1]
    flat_unit = FlatUnit(1, build_model(config, seed=1).units[1], [1.0], 0)
    full = flat_unit.flatten()
    flat_unit.detach_parameters()
    x = torch.randn(2, config.tokens_per_sample, config.hidden_size)
    grad_y = torch.randn_like(x)
    cpu = torch.device("cpu")
    (y,) = forward_unit(flat_unit, full, [x], cpu, "fp32")
    grad_x = backward_unit(flat_unit, full, x, grad_y, cpu, "fp32", needs_input_grad=True)
    x_ref = x.clone().requires_grad_(True)
    y_ref = plain(x_ref)
    y_ref.backward(grad_y)
    assert torch.allclose(y, y_ref.detach(), atol=1e-6)
    assert grad_x is not None and torch.allclose(grad_x, x_ref.grad, atol=1e-6)
    ref_grad = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
    assert full.grad is not None and torch.allclose(full.grad, ref_grad, atol=1e-6)


def test_a_unit_built_alone_equals_the_same_unit_of_the_model() -> None:
    from cephalo.trainer.models import build_unit

    config = preset("llama-tiny")
    model = build_model(config, seed=11)
    for i in (0, 2, config.num_units - 1):
        alone = build_unit(config, i, seed=11)
        for (name, a), (_, b) in zip(alone.named_parameters(),
                                     model.units[i].named_parameters(), strict=True):
            assert torch.equal(a, b), name
    assert not torch.equal(model.units[1].attn.q.weight, model.units[2].attn.q.weight)
    with pytest.raises(ValueError, match="out of range"):
        build_unit(config, config.num_units)
