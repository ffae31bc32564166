"""`cephalo tokenize INPUT [--tokenizer TOK] --output train.bin`: text into the token file
`data.tokenFile` reads, with the EOS id after every document.

INPUT is a .txt / .jsonl / .parquet / .arrow file, a folder of them, or a glob, local or an
fsspec URL (s3://bucket/corpus/; the backend's usual credentials from the environment).
TOK is a tokenizer.json or a Hugging Face tokenizer (or pretrained model) folder holding one;
without --tokenizer (or with `byte-level`), the quickstart's byte tokenizer (ids 0-255,
newline between documents), the default everywhere else too. Streams the input (bounded
memory) over --workers processes; the output and its sidecar <output>.json appear only
when complete. See `cephalo.corpus` (reading) and `cephalo.tokenfile` (writing).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from cephalo.errors import CephaloError

if TYPE_CHECKING:
    from cephalo.corpus import Corpus

MAX_WORKERS = 256


class TokenizeArgError(CephaloError):
    """A `cephalo tokenize` flag that cannot work."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="text file, folder or glob (.txt, .jsonl, .parquet, .arrow), local "
                             "or an fsspec URL such as s3://bucket/corpus/")
    parser.add_argument("--tokenizer", "-t", default="byte-level",
                        help="tokenizer.json, a Hugging Face tokenizer folder holding one, or "
                             "'byte-level' (the default, as in data.text.tokenizer)")
    parser.add_argument("--output", "-o", required=True, help="token file to write (e.g. "
                        "data/train.bin); its metadata goes to <output>.json")
    parser.add_argument("--format", choices=["txt", "jsonl", "parquet", "arrow"], default=None,
                        help="input format (default: from the file extensions)")
    parser.add_argument("--field", default="text",
                        help="JSON field / column holding the document text (default: text)")
    parser.add_argument("--eos-id", type=int, default=None,
                        help="end-of-sequence id to put between documents (default: from the "
                             "tokenizer folder's tokenizer_config.json or the vocabulary)")
    parser.add_argument("--workers", "-j", type=int, default=1,
                        help="encoding processes (default 1; the output does not depend on it)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output")


def run(args: argparse.Namespace) -> int:
    from cephalo.tokenfile import tokenize_corpus
    from cephalo.tokenizer import load_tokenizer

    if not 1 <= args.workers <= MAX_WORKERS:
        raise TokenizeArgError(f"--workers {args.workers}: give 1 to {MAX_WORKERS} "
                               f"(this machine has {os.cpu_count()} CPUs)")
    output = Path(args.output)
    if "://" in args.output:
        raise TokenizeArgError(f"--output {args.output}: write the token file locally (the "
                               "trainer memory-maps it), then copy it where the job reads it")
    if output.is_dir():
        raise TokenizeArgError(f"--output {output} is a folder; give a file name such as "
                               f"{output / 'train.bin'}")
    if output.exists() and not args.force:
        raise TokenizeArgError(f"--output {output} exists; pass --force to overwrite it")
    if "torch" not in sys.modules:
        # Hugging Face `datasets` imports torch (seconds) for a feature streaming never uses
        # here (sharing an epoch counter with torch DataLoader workers); USE_TORCH=0 stops it.
        os.environ.setdefault("USE_TORCH", "0")
    tokenizer = load_tokenizer(args.tokenizer, eos_id=args.eos_id)
    corpus = _corpus(args)
    summary = tokenize_corpus(corpus, tokenizer, output, workers=args.workers)
    rate = summary.num_tokens / max(summary.seconds, 1e-9)
    documents = "document" if summary.num_documents == 1 else "documents"
    files = "file" if len(corpus.files) == 1 else "files"
    print(f"wrote {summary.num_tokens:,} tokens ({summary.dtype}) of "
          f"{summary.num_documents:,} {documents} from {len(corpus.files)} {files} to "
          f"{summary.output} in {summary.seconds:.1f} s ({rate:,.0f} tokens/s); tokenizer "
          f"{tokenizer.name}, EOS id {tokenizer.eos_id}: use model.vocabSize >= "
          f"{tokenizer.vocab_size} and data.tokenFile.dtype: {summary.dtype}")
    return 0


def _corpus(args: argparse.Namespace) -> Corpus:
    """One corpus of every input's files, in the order the inputs were given."""
    from cephalo.corpus import open_corpus

    corpora = [open_corpus(i, format=args.format, field=args.field) for i in args.inputs]
    first = corpora[0]
    formats = sorted({c.format for c in corpora})
    if len(formats) > 1:
        raise TokenizeArgError(f"the inputs mix formats ({', '.join(formats)}); tokenize "
                               "each format separately or give --format")
    if any(type(c.fs) is not type(first.fs) for c in corpora):
        raise TokenizeArgError("the inputs mix local files and URLs of different storage; "
                               "tokenize them separately")
    return replace(first, location=", ".join(args.inputs),
                   files=tuple(f for c in corpora for f in c.files))
