"""Token files from corpora: the flat file `data.tokenFile` reads (nanoGPT-style ids, uint16
when the vocabulary fits, else uint32) with the EOS id after every document, and a sidecar
``<output>.json`` saying dtype, vocabulary and counts (torch-free; `cephalo tokenize` and the
trainer's `data.text` write them).

Both files appear only when complete (temp name, then rename: the sidecar first, the token
file last); a failure leaves nothing. With `workers` > 1, batches of documents are encoded in
worker processes and written in input order, so the file is byte-identical to a
single-process run; at most 2 x workers batches are in flight (bounded memory). One process
already encodes each batch on all cores (the `tokenizers` thread pool): workers add
parallel reading and parsing, which pays off on many-core machines.
"""

from __future__ import annotations

import collections
import concurrent.futures
import concurrent.futures.process
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cephalo.corpus import Corpus, CorpusError, Piece, batches, pieces
from cephalo.tokenizer import TextTokenizer

SIDECAR_SUFFIX = ".json"
SIDECAR_FORMAT = "cephalo-token-file/1"
MAX_LISTED_INPUTS = 100


@dataclass(frozen=True)
class TokenizeSummary:
    output: Path
    dtype: str
    num_tokens: int
    num_documents: int
    seconds: float


def encode_batch(encode: Callable[[list[str]], list[np.ndarray]], batch: list[Piece],
                 eos_id: int, dtype: np.dtype) -> tuple[np.ndarray, int]:
    """(the batch's ids, EOS after each document end, in `dtype`; documents ended)."""
    eos = np.array([eos_id], dtype=np.uint32)
    parts: list[np.ndarray] = []
    for ids, (_, ends) in zip(encode([text for text, _ in batch]), batch, strict=True):
        parts.append(ids)
        if ends:
            parts.append(eos)
    return np.concatenate(parts).astype(dtype, copy=False), sum(ends for _, ends in batch)


_worker_state: dict[str, Any] = {}


def _init_worker(tokenizer: TextTokenizer) -> None:
    # One process per worker already: the tokenizer's own thread pool would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_state.update(encode=tokenizer.encoder(), eos=tokenizer.eos_id,
                         dtype=tokenizer.dtype)


def _work(batch: list[Piece]) -> tuple[np.ndarray, int]:
    s = _worker_state
    return encode_batch(s["encode"], batch, s["eos"], s["dtype"])


def encoded(corpus: Corpus, tokenizer: TextTokenizer, workers: int = 1
            ) -> Iterator[tuple[np.ndarray, int]]:
    """The corpus's token ids batch by batch, in input order, and documents per batch."""
    work = batches(pieces(corpus))
    if workers <= 1:
        encode = tokenizer.encoder()
        for batch in work:
            yield encode_batch(encode, batch, tokenizer.eos_id, tokenizer.dtype)
        return
    # spawn, not fork: the parent may hold a tokenizer thread pool (or torch) that a forked
    # child would inherit in a broken state.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context,
                                                initializer=_init_worker,
                                                initargs=(tokenizer,)) as pool:
        pending: collections.deque[concurrent.futures.Future] = collections.deque()
        try:
            for batch in work:
                pending.append(pool.submit(_work, batch))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except concurrent.futures.process.BrokenProcessPool:
            raise CorpusError(f"a tokenize worker process died (killed, or out of memory) "
                              f"while encoding {corpus.location}; retry with fewer --workers"
                              ) from None
        finally:
            for future in pending:
                future.cancel()


def sidecar_path(output: Path) -> Path:
    return output.with_name(output.name + SIDECAR_SUFFIX)


def read_sidecar(token_file: str | Path) -> dict[str, Any] | None:
    """The metadata `cephalo tokenize` wrote next to a token file, if any."""
    try:
        data = json.loads(sidecar_path(Path(token_file)).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == SIDECAR_FORMAT else None


def sidecar_mismatch(token_file: str | Path, dtype: str, vocab_size: int | None,
                     shown: str | None = None) -> str | None:
    """Why a token file's sidecar disagrees with the job (None: it agrees, or there is no
    sidecar): reading uint32 ids as uint16 (or the reverse) trains on garbage silently.
    `shown`: the name to use in the message (a URL the local file was downloaded from)."""
    meta = read_sidecar(token_file)
    if meta is None:
        return None
    name = shown or str(token_file)
    if meta.get("dtype") != dtype:
        return (f"token file {name} holds {meta.get('dtype')} ids (says its sidecar "
                f"{name}{SIDECAR_SUFFIX}) but data.tokenFile.dtype is {dtype}")
    vocab = meta.get("vocab_size")
    if isinstance(vocab, int) and vocab_size is not None and vocab > vocab_size:
        return (f"token file {name} comes from a tokenizer of {vocab:,} ids, more than "
                f"model.vocabSize {vocab_size:,}; set model.vocabSize >= {vocab}")
    return None


def tokenize_corpus(corpus: Corpus, tokenizer: TextTokenizer, output: Path,
                    workers: int = 1) -> TokenizeSummary:
    """Write the corpus's token file and its sidecar atomically (see the module doc)."""
    started = time.monotonic()
    output = Path(output)
    created = [p for p in [output.parent, *output.parent.parents] if not p.exists()]
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    side_tmp = sidecar_path(tmp)
    num_tokens = num_documents = 0
    try:
        with open(tmp, "wb") as f:
            for ids, documents in encoded(corpus, tokenizer, workers):
                f.write(ids.tobytes())
                num_tokens += ids.size
                num_documents += documents
            f.flush()
            os.fsync(f.fileno())
        if num_tokens == 0:
            raise CorpusError(f"text data {corpus.location} holds no text (every document is "
                              "empty)")
        inputs = [corpus.url(p) for p in corpus.files[:MAX_LISTED_INPUTS]]
        side_tmp.write_text(json.dumps({
            "format": SIDECAR_FORMAT, "dtype": tokenizer.dtype.name, "num_tokens": num_tokens,
            "num_documents": num_documents, "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id, "tokenizer": tokenizer.name,
            "tokenizer_sha256": tokenizer.fingerprint, "text_format": corpus.format,
            "field": corpus.field, "inputs": inputs, "num_inputs": len(corpus.files)},
            indent=1) + "\n")
        os.replace(side_tmp, sidecar_path(output))
        os.replace(tmp, output)  # the token file last: present means complete
    except BaseException:
        for path in (tmp, side_tmp):
            path.unlink(missing_ok=True)
        for folder in created:  # deepest first
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    return TokenizeSummary(output, tokenizer.dtype.name, num_tokens, num_documents,
                           time.monotonic() - started)
