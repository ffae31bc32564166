"""Validation: a held-out split of the training data and its mean loss every
`training.evalIntervalSteps` steps (and at the last).

The validation set is fixed (the same samples at every evaluation) and never trained on:

* token data (`tokenFile`, `text`): the last `data.validationFraction` (default 1 %) of the
  token stream. `hold_out` cuts it off the stream the data source samples training windows
  from, before the first step; validation samples are evenly spaced windows tiling that tail
  (a stride of sequenceLength, so no token is predicted twice).
* synthetic data: samples of a reserved step index (`VALIDATION_STEP`) beyond any training
  step, so their seeds (seed, step, index) are distinct from every training sample's.

Every rank evaluates its share: the set is walked in global batches, rank i taking samples
[Σ_{k<i} b_k, Σ_{k≤i} b_k) of each, as in training (so memory stays within the plan), and
the engine sums the per-sample losses over ranks. The result is the mean over the set,
whatever the plan (up to floating-point reassociation).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from cephalo.api.job import DataSpec, TrainingSpec
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Engine, MicroBatch

# Beyond any training step (TrainingSpec.steps <= 1e8): seeds no training sample.
VALIDATION_STEP = 1 << 40
DEFAULT_VALIDATION_FRACTION = 0.01


class ValidationSet:
    """The fixed held-out samples of one job, indexed 0 .. num_samples - 1."""

    def __init__(self, data: DataSource, num_samples: int,
                 tokens: np.ndarray | None = None, start_token: int = 0) -> None:
        # tokens: the whole token stream, whose tail from start_token is held out.
        self.data = data
        self.tokens = tokens
        self.start_token = start_token
        self.seq_len = data.config.sequence_length or 0
        if tokens is not None:
            windows = (len(tokens) - start_token - 1) // self.seq_len
            if windows < 1:
                raise ValueError(
                    f"the held-out tail of the token stream has {len(tokens) - start_token} "
                    f"tokens, a validation sample needs {self.seq_len + 1} (sequenceLength + "
                    f"1); raise data.validationFraction or use more data")
            num_samples = min(num_samples, windows)
            self._windows = windows
        self.num_samples = num_samples

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tokens is None:
            return self.data.sample(VALIDATION_STEP, index)
        # Evenly spaced over the tail: the set spans it even when it holds more windows.
        window = index * self._windows // self.num_samples
        begin = self.start_token + window * self.seq_len
        chunk = torch.from_numpy(
            np.asarray(self.tokens[begin:begin + self.seq_len + 1], dtype=np.int64))
        vocab = self.data.config.vocab_size
        if vocab is not None and int(chunk.max()) >= vocab:
            raise ValueError(f"token file holds id {int(chunk.max())} >= vocabSize {vocab}; "
                             f"set model.vocabSize to the tokenizer's size")
        return chunk[:-1], chunk[1:]

    def describe(self, asked: int) -> str:
        if self.tokens is None:
            return f"{self.num_samples} held-out synthetic samples"
        fewer = f" (of {asked} asked: all the tail holds)" if self.num_samples < asked else ""
        return (f"{self.num_samples} windows{fewer} of the last "
                f"{len(self.tokens) - self.start_token:,} tokens, held out from training")

    def micro_batches(self, start: int, end: int, micro_batch_size: int) -> list[MicroBatch]:
        """Samples [start, end) cut into microbatches (none when the range is empty)."""
        if end <= start:
            return []
        pairs = [self.sample(j) for j in range(start, end)]
        inputs = torch.stack([p[0] for p in pairs])
        targets = torch.stack([p[1] for p in pairs])
        return [(inputs[i:i + micro_batch_size], targets[i:i + micro_batch_size])
                for i in range(0, end - start, micro_batch_size)]


def hold_out(data: DataSource, data_spec: DataSpec, num_samples: int) -> ValidationSet:
    """The job's validation set; for token data, also removes the held-out tail from what
    `data` samples training windows from (call before the first training step)."""
    if data.tokens is None:
        return ValidationSet(data, num_samples)
    tokens = data.tokens
    fraction = data_spec.validation_fraction or DEFAULT_VALIDATION_FRACTION
    cut = len(tokens) - math.ceil(len(tokens) * fraction)
    seq_len = data.config.sequence_length or 0
    if cut < seq_len + 1:
        raise ValueError(f"after holding out {fraction:g} of the token stream for validation, "
                         f"training keeps {cut} tokens, a sample needs {seq_len + 1}; lower "
                         f"data.validationFraction or use more data")
    validation = ValidationSet(data, num_samples, tokens, cut)
    # DataSource draws training windows from the whole of `tokens`: a view without the
    # tail (still memory-mapped, nothing is copied) keeps them out of the held-out part.
    data.tokens = tokens[:cut]
    return validation


class Evaluator:
    """Measures the validation loss of the engine's current weights (a collective)."""

    def __init__(self, engine: Engine, validation: ValidationSet, interval_steps: int) -> None:
        self.engine = engine
        self.validation = validation
        self.interval_steps = interval_steps

    def due(self, step: int, *, final: bool = False) -> bool:
        return final or step % self.interval_steps == 0

    def loss(self) -> float:
        """Mean per-sample loss over the whole validation set."""
        layout, rank = self.engine.layout, self.engine.rank
        total = self.validation.num_samples
        batch = layout.global_batch_size
        start, end = layout.sample_range(rank)
        micro = max(1, layout.micro_batch_sizes[rank])
        loss_sum, count = 0.0, 0
        for offset in range(0, total, batch):  # the same number of passes on every rank
            mine = self.validation.micro_batches(min(offset + start, total),
                                                 min(offset + end, total), micro)
            pass_sum, pass_count = self.engine.evaluate(mine)
            loss_sum += pass_sum
            count += pass_count
        assert count == total, (count, total)
        return loss_sum / count


def evaluator(engine: Engine, data: DataSource, training: TrainingSpec,
              data_spec: DataSpec, verbose: bool = False) -> Evaluator | None:
    """The job's evaluator, or None when `training.evalIntervalSteps` is not set."""
    if training.eval_interval_steps is None:
        return None
    asked = training.eval_samples or engine.layout.global_batch_size
    validation = hold_out(data, data_spec, asked)
    if verbose and engine.rank == 0:
        print(f"cephalo trainer: validation loss every {training.eval_interval_steps} steps "
              f"on {validation.describe(asked)}", flush=True)
    return Evaluator(engine, validation, training.eval_interval_steps)
