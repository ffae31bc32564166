"""`data.text`: text documents tokenized once into a local token file, then sampled exactly
like `data.tokenFile` (the same (seed, step, index) windows, see `data.py`); and a
`data.tokenFile` on object storage, downloaded once into the same cache.

The token stream depends only on the inputs' content, the tokenizer and the EOS id (files in
sorted path order, documents in file order, EOS after each; `cephalo.corpus`), so every rank
derives the identical stream on its own and no rank waits on another's download. The file is
cached under `cache_root()` with that content hash in its name: ranks of one machine and
restarts reuse it (a file lock lets one process tokenize while the others wait), a changed
input or tokenizer makes a new one.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from cephalo.api import trainer_env
from cephalo.api.job import TextData
from cephalo.corpus import Corpus, open_corpus
from cephalo.corpus import fingerprint as corpus_fingerprint
from cephalo.tokenfile import SIDECAR_SUFFIX, read_sidecar, sidecar_path, tokenize_corpus
from cephalo.tokenizer import TextTokenizer, load_tokenizer

CACHE_ENV = trainer_env.DATA_CACHE
WORKERS_ENV = trainer_env.TOKENIZE_WORKERS


def cache_root() -> Path:
    """$CEPHALO_DATA_CACHE, else $XDG_CACHE_HOME/cephalo/tokens (~/.cache/...), else a
    folder under the system temp dir when the home cache is not writable (read-only pods)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = base / "cephalo" / "tokens"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / "cephalo-tokens"


def location(text: TextData) -> str:
    """The inputs as `cephalo.corpus` takes them: a local path or an fsspec URL."""
    found = text.uri if text.uri is not None else text.path
    assert found is not None  # TextData validates exactly one
    return found


def tokenizer_of(text: TextData) -> TextTokenizer:
    return load_tokenizer(text.tokenizer, eos_id=text.eos_id)


def stream_key(corpus: Corpus, tokenizer: TextTokenizer, root: Path) -> str:
    """Content hash of inputs + tokenizer + EOS: equal keys, equal token streams."""
    sha = hashlib.sha256(corpus_fingerprint(corpus, memo=root / "hashes").encode())
    sha.update(tokenizer.fingerprint.encode())
    return sha.hexdigest()


def token_stream(text: TextData, cache: Path | None = None, verbose: bool = False
                 ) -> tuple[Path, np.dtype]:
    """The local token file of `text` (tokenized now unless cached) and its dtype."""
    tokenizer = tokenizer_of(text)
    corpus = open_corpus(location(text), format=text.format, field=text.field)
    root = cache or cache_root()
    root.mkdir(parents=True, exist_ok=True)
    key = stream_key(corpus, tokenizer, root)
    path = root / f"{key[:32]}.bin"
    if _complete(path):
        return path, tokenizer.dtype
    with open(root / f"{key[:32]}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one tokenizer per machine; the others wait here
        if not _complete(path):
            started = time.monotonic()
            workers = max(1, int(os.environ.get(WORKERS_ENV, "1") or 1))
            summary = tokenize_corpus(corpus, tokenizer, path, workers=workers)
            if verbose:
                print(f"cephalo trainer: tokenized {corpus.location} ({len(corpus.files)} "
                      f"file(s), {summary.num_documents:,} documents) into "
                      f"{summary.num_tokens:,} tokens with {tokenizer.name} in "
                      f"{time.monotonic() - started:.1f} s; cached at {path}", flush=True)
    return path, tokenizer.dtype


def local_token_file(url: str, cache: Path | None = None) -> Path:
    """A token file on object storage (`data.tokenFile.path: s3://...`), downloaded once per
    machine into the cache (keyed by URL, ETag and size, so a replaced object is fetched
    again) with its sidecar when there is one; memory-mapping needs a local file."""
    import fsspec

    try:
        fs, remote = fsspec.core.url_to_fs(url)
        info = fs.info(remote)
    except FileNotFoundError:
        raise ValueError(f"token file {url} does not exist (data.tokenFile.path)") from None
    except (OSError, ValueError, ImportError) as err:
        raise ValueError(f"cannot open token file {url}: {' '.join(str(err).split())}"
                         ) from None
    etag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or fs.ukey(remote)
    key = hashlib.sha256(f"{url}|{etag}|{info.get('size')}".encode()).hexdigest()[:32]
    root = cache or cache_root()
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{key}.bin"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file() or path.stat().st_size != info.get("size"):
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            try:
                if fs.exists(remote + SIDECAR_SUFFIX):  # before the data: present = complete
                    fs.get_file(remote + SIDECAR_SUFFIX, str(sidecar_path(tmp)))
                    os.replace(sidecar_path(tmp), sidecar_path(path))
                fs.get_file(remote, str(tmp))
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
                sidecar_path(tmp).unlink(missing_ok=True)
    return path


def _complete(path: Path) -> bool:
    # tokenize_corpus renames the sidecar first and the token file last.
    meta = read_sidecar(path)
    return path.is_file() and meta is not None and sidecar_path(path).is_file() and \
        meta.get("num_tokens", -1) * np.dtype(meta.get("dtype", "uint16")).itemsize == \
        path.stat().st_size
