"""Which kept blocks the engine runs per microbatch with the head (the fused tail,
cephalo.api.memory.fused_tail_blocks): the most blocks every working rank keeps such that no
working rank holds more than its layered graphs of the same blocks, the planner's price.
Checked against the definition by brute force over every j, on real model dimensions."""

from __future__ import annotations

import itertools

import pytest

from cephalo.api import memory, preset
from cephalo.api.models import ModelConfig

GPT = preset("gpt-tiny").model_copy(update={"num_layers": 6})
# Llama-7B-like widths with short sequences: a block's parameters outweigh one microbatch's
# graph, so holding them costs more than layered graphs of few microbatches.
WIDE = ModelConfig(family="llama", num_layers=4, hidden_size=4096, num_heads=32,
                   ffn_hidden_size=11008, vocab_size=32000, sequence_length=512)


def _dims(config: ModelConfig) -> tuple[int, int, int]:
    return config.tokens_per_sample, config.hidden_size, config.ffn_hidden_size


def _fits(j: int, config: ModelConfig, batch: int, micro: int,
          measured: float | None) -> bool:
    return memory.fused_tail_bytes(j, micro, *_dims(config), config.block_parameters(),
                                   measured) <= \
        memory.kept_blocks_bytes(j, batch, *_dims(config), measured)


def _brute(config: ModelConfig, kept: list[int], batches: list[int], micros: list[int],
           measured: list[float | None]) -> int:
    working = [r for r, b in enumerate(batches) if b > 0]
    best = 0
    for j in range(0, config.num_layers + 1):
        if all(j <= kept[r] and _fits(j, config, batches[r], micros[r], measured[r])
               for r in working):
            best = j
    return best


def _rule(config: ModelConfig, kept: list[int], batches: list[int], micros: list[int],
          measured: list[float | None]) -> int:
    return memory.fused_tail_blocks(kept, batches, micros, *_dims(config),
                                    config.block_parameters(), measured)


@pytest.mark.parametrize("config", [GPT, WIDE], ids=["gpt-tiny", "llama-7b-wide"])
def test_the_rule_is_the_most_blocks_that_cost_no_rank_more(config: ModelConfig) -> None:
    cases = 0
    graphs: list[float | None] = [None, 1000.0, 5e6]
    for kept, (b0, m0), (b1, m1), g in itertools.product(
            itertools.product(range(config.num_layers + 1), repeat=2),
            [(0, 1), (2, 2), (4, 1), (8, 2), (8, 8)], [(1, 1), (6, 2), (16, 4)], graphs):
        batches, micros, measured = [b0, b1], [m0, m1], [g, None]
        got = _rule(config, list(kept), batches, micros, measured)
        assert got == _brute(config, list(kept), batches, micros, measured), (
            kept, batches, micros, measured)
        cases += got > 0
    assert cases > 50  # the rule does run blocks per microbatch, not only refuse


def test_one_microbatch_per_rank_never_fuses() -> None:
    # One microbatch: the layered graph is the same one graph, and the tail would hold the
    # blocks' parameters and gradients on top.
    assert _rule(GPT, [6, 6], [4, 4], [4, 4], [None, None]) == 0


def test_a_rank_without_samples_does_not_hold_the_others_back() -> None:
    assert _rule(GPT, [0, 3], [0, 8], [1, 2], [None, None]) == 3
    assert _rule(GPT, [0, 3], [2, 8], [1, 2], [None, None]) == 0


def test_wide_blocks_fuse_only_with_enough_microbatches() -> None:
    # Two microbatches of one 512-token sample: a block's parameters and gradient (2 x 810 MB
    # fp32) outweigh the graph saved; with 32 microbatches they do not.
    assert _rule(WIDE, [4], [2], [1], [None]) == 0
    assert _rule(WIDE, [4], [32], [1], [None]) == 4
