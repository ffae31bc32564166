"""Text corpora: finding and reading the documents behind `cephalo tokenize` and the
trainer's `data.text` (torch-free).

A corpus is one file, a folder (every file of the format below it), or a glob, on local disk
or behind an fsspec URL (``s3://bucket/corpus/*.parquet``; credentials from the backend's
usual environment, as for checkpoints). Formats, inferred from the extension unless given:

* ``txt``: each file is one document (what scripts/text_to_tokens.py does with its inputs);
  it is read in pieces of about `PIECE_CHARS` characters cut at line ends, so a huge file
  never sits in memory whole (a token may split differently at a piece boundary than in one
  call; the pieces depend only on the text, so the result is still deterministic);
* ``jsonl``: one JSON object per line, the document in `field` (default ``text``);
* ``parquet`` / ``arrow``: rows through Hugging Face `datasets` in streaming mode (bounded
  memory), the document in column `field`.
``.gz``/``.bz2``/``.xz``/``.zst`` after txt/jsonl extensions are decompressed on the fly.
Files are read in sorted path order; empty and null documents are skipped.
The token files they become: `cephalo.tokenfile`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cephalo.errors import CephaloError

FORMATS = ("txt", "jsonl", "parquet", "arrow")
EXTENSIONS = {".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl",
              ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma", ".zst": "zstd"}
PIECE_CHARS = 1 << 16  # a txt piece; long enough that boundaries are rare among tokens
BATCH_CHARS = 1 << 20  # text per unit of work (one encode_batch call, one worker task)
BATCH_PIECES = 1024
# What Dataset.save_to_disk writes next to its .arrow files: metadata, not documents.
BOOKKEEPING_FILES = ("state.json", "dataset_info.json")


class CorpusError(CephaloError, ValueError):
    """Text input that cannot be tokenized: one line naming the file (and line or row)."""


@dataclass(frozen=True)
class Corpus:
    """Resolved inputs: the files (fsspec paths of `fs`), in reading order, and their format."""

    location: str
    fs: Any
    files: tuple[str, ...]
    format: str
    field: str
    storage_options: dict[str, Any]

    def url(self, path: str) -> str:
        return path if _is_local(self.fs) else self.fs.unstrip_protocol(path)


def _is_local(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def _format_of(path: str) -> str | None:
    name = posixpath.basename(path).lower()
    for suffix in COMPRESSIONS:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return EXTENSIONS.get(posixpath.splitext(name)[1])


def _listed(path: str, format: str | None) -> bool:
    """A folder's file that holds documents: not hidden or "_" bookkeeping (.cache,
    _SUCCESS), not save_to_disk's metadata, and of the format asked for (or a known one)."""
    name = posixpath.basename(path)
    found = _format_of(path)
    return not name.startswith((".", "_")) and name not in BOOKKEEPING_FILES and \
        found is not None and (format is None or found == format)


def open_corpus(location: str, format: str | None = None, field: str = "text",
                storage_options: dict[str, Any] | None = None) -> Corpus:
    """Resolve a file, folder or glob (local or fsspec URL) into the files to read."""
    import fsspec

    if format is not None and format not in FORMATS:
        raise CorpusError(f"unknown text format {format!r}; use one of {', '.join(FORMATS)}")
    options = dict(storage_options or {})
    try:
        fs, path = fsspec.core.url_to_fs(location, **options)
        if any(c in path for c in "*?["):
            files = [f for f in fs.glob(path) if fs.isfile(f)]
        elif fs.isdir(path):
            # Hidden and "_" files are bookkeeping (.cache, _SUCCESS, state.json's kin).
            files = [f for f in fs.find(path) if _listed(f, format)]
        elif fs.isfile(path):
            files = [path]
        else:
            raise CorpusError(f"text data {location}: no such file or folder")
    except CorpusError:
        raise
    except (OSError, ValueError, ImportError) as err:
        raise CorpusError(f"cannot list text data {location}: {' '.join(str(err).split())}"
                          ) from None
    if not files:
        raise CorpusError(f"text data {location}: no {format or 'txt/jsonl/parquet/arrow'} "
                          "files there")
    files = sorted(files)
    if format is None:
        found = {_format_of(f) for f in files}
        if None in found:
            bad = next(f for f in files if _format_of(f) is None)
            raise CorpusError(f"cannot tell the format of {bad} from its extension; give it "
                              f"(--format / data.text.format: {', '.join(FORMATS)})")
        if len(found) > 1:
            names = sorted(str(f) for f in found)
            raise CorpusError(f"text data {location} mixes formats ({', '.join(names)});"
                              " give one (--format / data.text.format)")
        (only,) = found
        assert only is not None  # None was refused above
        format = only
    return Corpus(location, fs, tuple(files), format, field, options)


# --- reading: (text, ends a document) pieces --------------------------------------------

Piece = tuple[str, bool]


def _read_txt(corpus: Corpus, path: str) -> Iterator[Piece]:
    compression = COMPRESSIONS.get(posixpath.splitext(path)[1].lower())
    with corpus.fs.open(path, "rb", compression=compression) as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8", newline="")
        buffer: list[str] = []
        size = started = 0
        try:
            for line in text:
                buffer.append(line)
                size += len(line)
                if size >= PIECE_CHARS:
                    yield "".join(buffer), False
                    buffer, size, started = [], 0, 1
        except UnicodeDecodeError as err:
            raise CorpusError(f"{corpus.url(path)} is not UTF-8 text: {err.reason} at "
                              f"byte {err.start} of a block") from None
        if buffer or started:
            yield "".join(buffer), True


def _read_jsonl(corpus: Corpus, path: str) -> Iterator[Piece]:
    compression = COMPRESSIONS.get(posixpath.splitext(path)[1].lower())
    with corpus.fs.open(path, "rb", compression=compression) as raw:
        for number, line in enumerate(raw, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise CorpusError(f"{corpus.url(path)} line {number} is not JSON: "
                                  f"{getattr(err, 'msg', err)}") from None
            text = _field(record, corpus, f"{corpus.url(path)} line {number}")
            if text:
                yield text, True


def _field(record: Any, corpus: Corpus, where: str) -> str | None:
    if not isinstance(record, dict) or corpus.field not in record:
        raise CorpusError(f"{where} has no field {corpus.field!r} (the document text; choose "
                          "another with --field / data.text.field)")
    value = record[corpus.field]
    if value is not None and not isinstance(value, str):
        raise CorpusError(f"{where}: field {corpus.field!r} holds {type(value).__name__}, "
                          "not text")
    return value


def _read_rows(corpus: Corpus, path: str) -> Iterator[Piece]:
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    url = corpus.url(path)
    try:
        rows = datasets.load_dataset(corpus.format, data_files=[url], split="train",
                                     streaming=True, storage_options=corpus.storage_options)
        for number, row in enumerate(rows):
            text = _field(row, corpus, f"{url} row {number}")
            if text:
                yield text, True
    except CorpusError:
        raise
    except Exception as err:  # pyarrow and datasets raise many types for a bad file
        raise CorpusError(f"cannot read {url} as {corpus.format}: "
                          f"{type(err).__name__}: {' '.join(str(err).split())[:300]}") from None


_READERS: dict[str, Callable[[Corpus, str], Iterator[Piece]]] = {
    "txt": _read_txt, "jsonl": _read_jsonl, "parquet": _read_rows, "arrow": _read_rows}


def pieces(corpus: Corpus) -> Iterator[Piece]:
    for path in corpus.files:
        try:
            yield from _READERS[corpus.format](corpus, path)
        except CorpusError:
            raise
        except OSError as err:
            raise CorpusError(f"cannot read {corpus.url(path)}: "
                              f"{' '.join(str(err).split())}") from None


def batches(stream: Iterator[Piece]) -> Iterator[list[Piece]]:
    """Pieces grouped into units of work; the grouping never changes the output."""
    batch: list[Piece] = []
    size = 0
    for piece in stream:
        batch.append(piece)
        size += len(piece[0])
        if size >= BATCH_CHARS or len(batch) >= BATCH_PIECES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def fingerprint(corpus: Corpus, memo: Path | None = None) -> str:
    """sha256 over what decides the token stream's input: format, field and, per file, its
    name and content (local files are hashed; object-store files by their ETag/checksum and
    size, which change whenever the content does). `memo`: a folder remembering each local
    file's hash under its (path, size, mtime, inode), so a restart does not re-read a large
    corpus (the same trust in mtime as make or rsync)."""
    sha = hashlib.sha256(f"{corpus.format}|{corpus.field}".encode())
    for path in corpus.files:
        sha.update(b"|" + posixpath.basename(path).encode())
        if _is_local(corpus.fs):
            sha.update(_file_sha256(path, memo).encode())
        else:
            info = corpus.fs.info(path)
            key = info.get("ETag") or info.get("etag") or info.get("md5Hash") or \
                corpus.fs.ukey(path)
            sha.update(f"{key}|{info.get('size')}".encode())
    return sha.hexdigest()


def _file_sha256(path: str, memo: Path | None) -> str:
    st = os.stat(path)
    stamp = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    note = memo / (hashlib.sha256(stamp.encode()).hexdigest()[:32] + ".sha256") \
        if memo is not None else None
    if note is not None and note.is_file():
        return note.read_text().strip()
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            sha.update(chunk)
    digest = sha.hexdigest()
    if note is not None:
        try:
            note.parent.mkdir(parents=True, exist_ok=True)
            tmp = note.with_name(f".{note.name}.{os.getpid()}")
            tmp.write_text(digest + "\n")
            os.replace(tmp, note)
        except OSError:
            pass  # a read-only cache only costs the re-read
    return digest


def check_text(location: str, format: str | None, field: str, tokenizer: str | None,
               eos_id: int | None, vocab_size: int | None) -> None:
    """Before any rank starts: the inputs exist (and list), the tokenizer loads, and its
    vocabulary fits the model. Raises CorpusError / TokenizerError with one line."""
    from cephalo.tokenizer import load_tokenizer

    open_corpus(location, format=format, field=field)
    loaded = load_tokenizer(tokenizer, eos_id=eos_id)
    if vocab_size is not None and loaded.vocab_size > vocab_size:
        raise CorpusError(f"tokenizer {loaded.name} has {loaded.vocab_size:,} ids, more than "
                          f"model.vocabSize {vocab_size:,}; set model.vocabSize >= "
                          f"{loaded.vocab_size}")


def check_remote_file(url: str, what: str) -> None:
    """An object-storage file exists and is readable with the current credentials."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
        found = fs.isfile(path)
    except (OSError, ValueError, ImportError) as err:
        raise CorpusError(f"{what} {url}: cannot open it: {' '.join(str(err).split())}"
                          ) from None
    if not found:
        raise CorpusError(f"{what} {url} does not exist")
