"""Data is a pure function of (seed, step, global sample index): any plan sees the same
global batch, and each rank reads only its slice."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cephalo.api.job import DataSpec, SyntheticData, TokenFileData
from cephalo.api.models import preset
from cephalo.trainer.data import DataSource

SYNTHETIC = DataSpec(synthetic=SyntheticData())


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "vit-tiny", "bert-tiny"])
def test_rank_slices_tile_the_global_batch(name: str) -> None:
    source = DataSource(preset(name), SYNTHETIC, seed=5)
    inputs, targets = source.batch(3, 0, 8)
    pieces = [source.micro_batches(3, s, e, m) for s, e, m in ((0, 5, 1), (5, 7, 2), (7, 8, 1))]
    flat = [mb for piece in pieces for mb in piece]
    assert [mb[0].shape[0] for mb in flat] == [1, 1, 1, 1, 1, 2, 1]
    assert torch.equal(torch.cat([mb[0] for mb in flat]), inputs)
    assert torch.equal(torch.cat([mb[1] for mb in flat]), targets)
    assert not torch.equal(source.batch(4, 0, 8)[0], inputs)  # steps differ
    assert not torch.equal(DataSource(preset(name), SYNTHETIC, seed=6).batch(3, 0, 8)[0], inputs)


def test_token_file_windows(tmp_path: Path) -> None:
    config = preset("gpt-tiny")  # sequence length 32, vocab 256
    tokens = (np.arange(5000) % 251).astype(np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    source = DataSource(config, DataSpec(token_file=TokenFileData(path=str(path))), seed=0)
    inputs, targets = source.batch(0, 0, 4)
    assert inputs.shape == (4, 32) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # next-token targets
    assert torch.equal((inputs[:, 0] + 1) % 251, inputs[:, 1])  # real windows of the file
    assert torch.equal(source.batch(0, 2, 4)[0], inputs[2:])


def test_token_file_errors(tmp_path: Path) -> None:
    config = preset("gpt-tiny")
    with pytest.raises(ValueError, match="does not exist"):
        DataSource(config, DataSpec(token_file=TokenFileData(path=str(tmp_path / "x"))), 0)
    short = tmp_path / "short.bin"
    np.zeros(10, dtype=np.uint16).tofile(short)
    with pytest.raises(ValueError, match="has 10 tokens"):
        DataSource(config, DataSpec(token_file=TokenFileData(path=str(short))), 0)
    big = tmp_path / "big.bin"
    np.full(100, 300, dtype=np.uint16).tofile(big)
    with pytest.raises(ValueError, match="vocabSize 256"):
        DataSource(config, DataSpec(token_file=TokenFileData(path=str(big))), 0).batch(0, 0, 1)
    with pytest.raises(ValueError, match="needs a language model"):
        DataSource(preset("vit-tiny"), DataSpec(token_file=TokenFileData(path=str(big))), 0)
