"""Deterministic global batches: sample j of step s is a pure function of (seed, s, j).

So the data never depends on the plan: rank i materialises only samples
[Σ_{k<i} b_k, Σ_{k≤i} b_k) of each step, and resuming at step s reads exactly what an
uninterrupted run would have read (the data position *is* the step).

* synthetic text (gpt, llama): arithmetic token sequences ``a + b·t mod V`` with random
  (a, b) per sample — learnable, so losses fall in demos.
* synthetic classification: bert — random tokens labelled by their first token; vit — noisy
  images whose mean brightness encodes the label.
* token file (gpt, llama): a nanoGPT-style flat binary of uint16/uint32 token ids,
  memory-mapped; each sample is a window at a seeded random offset.
* text (gpt, llama): documents tokenized once into such a file (`text_data`, cached by
  content, identical on every rank), then sampled exactly like a token file.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from cephalo.api.job import DataSpec
from cephalo.api.models import ModelConfig
from cephalo.tokenfile import sidecar_mismatch
from cephalo.trainer import text_data

_MASK64 = (1 << 64) - 1


def sample_seed(seed: int, step: int, index: int) -> int:
    """A well-mixed 63-bit seed for one sample (splitmix64 over the three integers)."""
    x = 0
    for value in (seed, step, index):
        x = (x ^ value) + 0x9E3779B97F4A7C15 & _MASK64
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
        x ^= x >> 31
    return x & ((1 << 63) - 1)


def _check_sidecar(path: str | os.PathLike[str], dtype: np.dtype, config: ModelConfig,
                   shown: str) -> None:
    problem = sidecar_mismatch(os.fspath(path), dtype.name, config.vocab_size, shown)
    if problem is not None:
        raise ValueError(problem)


class DataSource:
    """Produces any slice of any step's global batch."""

    def __init__(self, config: ModelConfig, data: DataSpec, seed: int,
                 verbose: bool = True) -> None:
        self.config = config
        self.seed = seed
        self.tokens: np.ndarray | None = None
        if data.token_file is not None or data.text is not None:
            kind = "tokenFile" if data.token_file is not None else "text"
            if config.family not in ("gpt", "llama"):
                raise ValueError(f"{kind} data needs a language model (gpt or llama), the "
                                 f"job's model is {config.family}; use `synthetic: {{}}`")
            if data.text is not None:
                # Tokenized once per machine (cached by content); then the very same
                # windows as a token file.
                path, dtype = text_data.token_stream(data.text, verbose=verbose)
                shown = str(path)
            else:
                assert data.token_file is not None
                path, dtype = data.token_file.path, np.dtype(data.token_file.dtype)
                shown = path
                if "://" in path:  # object storage: a local copy to memory-map
                    path = text_data.local_token_file(path)
            if not os.path.exists(path):
                raise ValueError(f"token file {path} does not exist (data.tokenFile.path)")
            _check_sidecar(path, dtype, config, shown)
            self.tokens = np.memmap(path, dtype=dtype, mode="r")
            needed = self._seq_len + 1
            if len(self.tokens) < needed:
                raise ValueError(f"token file {path} has {len(self.tokens)} tokens, a sample "
                                 f"needs {needed} (sequenceLength + 1)")

    @property
    def _seq_len(self) -> int:
        assert self.config.sequence_length is not None
        return self.config.sequence_length

    def sample(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, target) of global sample `index` of step `step`."""
        g = torch.Generator().manual_seed(sample_seed(self.seed, step, index))
        c = self.config
        if self.tokens is not None:
            start = int(torch.randint(0, len(self.tokens) - self._seq_len, (1,), generator=g))
            window = torch.from_numpy(
                np.asarray(self.tokens[start:start + self._seq_len + 1], dtype=np.int64))
            assert c.vocab_size is not None
            if int(window.max()) >= c.vocab_size:
                raise ValueError(f"token file holds id {int(window.max())} >= vocabSize "
                                 f"{c.vocab_size}; set model.vocabSize to the tokenizer's size")
            return window[:-1], window[1:]
        if c.family in ("gpt", "llama"):
            assert c.vocab_size is not None
            a, b = torch.randint(0, c.vocab_size, (2,), generator=g)
            positions = torch.arange(self._seq_len + 1)
            tokens = (a + (b % 7 + 1) * positions) % c.vocab_size
            return tokens[:-1], tokens[1:]
        if c.family == "bert":
            assert c.vocab_size is not None and c.num_classes is not None
            tokens = torch.randint(0, c.vocab_size, (self._seq_len,), generator=g)
            return tokens, tokens[0] % c.num_classes
        assert c.image_size is not None and c.num_classes is not None
        label = torch.randint(0, c.num_classes, (), generator=g)
        image = torch.randn(c.num_channels, c.image_size, c.image_size, generator=g) * 0.5
        return image + (label.float() / c.num_classes - 0.5), label

    def batch(self, step: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples [start, end) of step `step`, stacked."""
        pairs = [self.sample(step, j) for j in range(start, end)]
        if not pairs:
            raise ValueError("empty sample range")
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def micro_batches(self, step: int, start: int, end: int, micro_batch_size: int
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's slice [start, end) of step `step`, cut into microbatches."""
        if end <= start:
            return []
        inputs, targets = self.batch(step, start, end)
        return [(inputs[i:i + micro_batch_size], targets[i:i + micro_batch_size])
                for i in range(0, end - start, micro_batch_size)]
