"""Does the data loader keep up (issue 13)? Tokens/s that `DataSource` delivers from a token
file and from a text dataset (after its one-time tokenization, which is timed separately),
against the tokens/s the quickstart model consumes in training. Target: loader >= 10x.

* Consumption is MEASURED with the actual trainer: `cephalo.trainer.run.train` on the
  quickstart job (gpt-small, global batch 24 x 64 tokens) on 2 gloo CPU ranks of 12 samples
  each, as `bench/checkpoint.py` runs it, no checkpoints; step time = mean gap between step
  boundaries after `--warmup` steps. (`cephalo run examples/quickstart.yaml` also emulates
  two GPUs by slowing the ranks down, so it consumes no more than this.)
* The loader is timed in ONE process building the WHOLE global batch of each step (every
  rank's slice, cut into microbatches of 4), i.e. one rank doing all ranks' loading:
  conservative, since on a cluster each rank loads only its own slice in parallel.
* Token file: 32 M random uint16 ids (64 MiB, memory-mapped). Text dataset: a jsonl corpus
  generated here, tokenized by a byte-level BPE trained here (`tokenizers`, no download),
  loaded through `data.text` from the warm cache. The one-time tokenization is timed too:
  `cephalo tokenize` as a user runs it (its own process, start-up included) with 1 and
  `--workers` processes, and the trainer's first use of `data.text`.

Each measurement is repeated `--repeats` times, interleaved; the median and the spread
(min-max) are printed. Run: python bench/data_loader.py [--repeats 5] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cephalo.api.job import CephaloJobSpec, DataSpec, TextData, TokenFileData
from cephalo.trainer import text_data
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Layout
from cephalo.trainer.spawn import spawn_ranks

LAYOUT = Layout([12, 12], [4, 4], [0.5, 0.5])  # the quickstart's two ranks
GLOBAL_BATCH = 24
MICRO = 4
WORDS = [  # common English words: a corpus that BPE compresses like real text
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by",
    "at", "from", "his", "an", "were", "are", "which", "this", "be", "has", "or", "had",
    "first", "one", "their", "its", "new", "after", "who", "they", "two", "her", "she",
    "been", "other", "when", "there", "all", "during", "into", "school", "time", "may",
    "years", "more", "most", "only", "over", "city", "some", "world", "would", "where",
    "later", "up", "such", "used", "many", "can", "state", "about", "national", "out",
    "known", "university", "united", "then", "made"
]


def quickstart() -> CephaloJobSpec:
    return CephaloJobSpec.model_validate({
        "model": {"preset": "gpt-small"}, "globalBatchSize": GLOBAL_BATCH,
        "training": {"steps": 1, "learningRate": 3e-3, "warmupSteps": 3},
        "checkpoint": {"ephemeral": True}})


def _train_worker(rank: int, world_size: int, steps: int) -> list[float]:
    from cephalo.trainer import run

    boundaries: list[float] = []

    def at_boundary() -> bool:
        boundaries.append(time.perf_counter())
        return False

    spec = quickstart()
    spec.training.steps = steps
    run.train(spec, LAYOUT, None, verbose=False, stop_requested=at_boundary)
    return boundaries


def consumed_tokens_per_second(steps: int, warmup: int) -> float:
    boundaries = spawn_ranks(_train_worker, 2, steps, timeout_seconds=1800)[0]
    step = (boundaries[-1] - boundaries[warmup]) / (len(boundaries) - 1 - warmup)
    config = quickstart().model.resolve()
    return GLOBAL_BATCH * config.tokens_per_sample / step


def loader_tokens_per_second(source: DataSource, steps: int, first_step: int) -> float:
    tokens = 0
    started = time.perf_counter()
    for step in range(first_step, first_step + steps):
        for inputs, _ in source.micro_batches(step, 0, GLOBAL_BATCH, MICRO):
            tokens += inputs.numel()
    return tokens / (time.perf_counter() - started)


def write_corpus(folder: Path, num_documents: int) -> Path:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "corpus.jsonl", "w") as f:
        for _ in range(num_documents):
            words = rng.choice(WORDS, size=int(rng.integers(50, 400)))
            f.write(json.dumps({"text": " ".join(words).capitalize() + "."}) + "\n")
    return folder


def train_tokenizer(folder: Path, vocab_size: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([" ".join(WORDS)] * 50, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def spread(values: list[float]) -> str:
    return (f"{statistics.median(values):,.0f} (min {min(values):,.0f}, max "
            f"{max(values):,.0f}, n={len(values)})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200, help="loader steps per repeat")
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--documents", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=2, help="tokenize workers to compare")
    args = parser.parse_args()
    config = quickstart().model.resolve()
    assert config.vocab_size is not None
    with tempfile.TemporaryDirectory(prefix="cephalo-bench-data-") as tmp:
        work = Path(tmp)
        os.environ[text_data.CACHE_ENV] = str(work / "cache")
        token_file = work / "tokens.bin"
        rng = np.random.default_rng(0)
        rng.integers(0, config.vocab_size, 32 << 20, dtype=np.uint16).tofile(token_file)
        corpus = write_corpus(work / "corpus", args.documents)
        tok = train_tokenizer(work / "tok", config.vocab_size)
        text = TextData(path=str(corpus), tokenizer=str(tok))

        for workers in sorted({1, args.workers}):
            # The command itself (its own process, as a user runs it): a worker spawned from
            # this script would re-import it, torch included.
            output = work / f"tok-{workers}.bin"
            started = time.perf_counter()
            subprocess.run([sys.executable, "-I", "-m", "cephalo.cli", "tokenize", str(corpus),
                            "-t", str(tok), "-o", str(output), "-j", str(workers)],
                           check=True, capture_output=True)
            seconds = time.perf_counter() - started
            meta = json.loads(output.with_name(output.name + ".json").read_text())
            print(f"cephalo tokenize -j {workers}: {meta['num_tokens'] / seconds:,.0f} tokens/s "
                  f"wall, start-up included ({meta['num_tokens']:,} tokens, "
                  f"{meta['num_documents']:,} documents, {seconds:.1f} s)")
        started = time.perf_counter()
        text_source = DataSource(config, DataSpec(text=text), seed=0, verbose=False)
        print(f"data.text first use (tokenize into the cache): "
              f"{time.perf_counter() - started:.1f} s; later uses: ", end="")
        started = time.perf_counter()
        text_source = DataSource(config, DataSpec(text=text), seed=0, verbose=False)
        print(f"{time.perf_counter() - started:.2f} s (cache hit: hashing the inputs)")
        file_source = DataSource(config, DataSpec(token_file=TokenFileData(
            path=str(token_file))), seed=0, verbose=False)

        rates: dict[str, list[float]] = {"token file": [], "text dataset": []}
        for repeat in range(args.repeats):
            first = repeat * args.steps
            rates["token file"].append(loader_tokens_per_second(file_source, args.steps, first))
            rates["text dataset"].append(loader_tokens_per_second(text_source, args.steps,
                                                                  first))
        consumed = [consumed_tokens_per_second(args.train_steps, args.warmup)
                    for _ in range(max(1, min(args.repeats, 3)))]
    need = statistics.median(consumed)
    print(f"quickstart model consumes (MEASURED, trainer on 2 gloo CPU ranks, gpt-small, "
          f"batch {GLOBAL_BATCH} x {config.tokens_per_sample} tokens): {spread(consumed)} "
          "tokens/s")
    for name, values in rates.items():
        ratio = statistics.median(values) / need
        print(f"loader, {name} (1 process, whole global batch): {spread(values)} tokens/s = "
              f"{ratio:,.1f}x consumption (min {min(values) / need:,.1f}x) "
              f"{'OK' if min(values) / need >= 10 else 'BELOW'} target 10x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
