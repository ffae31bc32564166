"""Text tokenizers for training data: a Hugging Face `tokenizers` tokenizer (a
`tokenizer.json` file, or a tokenizer / pretrained-model directory holding one), or the
byte-level tokenizer of the offline quickstart (UTF-8 bytes, ids 0-255).

`load_tokenizer(location)` is the one place that finds a tokenizer and its end-of-sequence
id; `cephalo tokenize`, the trainer's text data and the pre-run checks all use it. It is
torch-free. `location` is a local path or an fsspec URL (``s3://bucket/llama/``): only the
small JSON files are read, so a URL costs a few requests.

The EOS id, in order: the explicit `eos_id`; `eos_token` of tokenizer_config.json or
special_tokens_map.json (a string or ``{"content": ...}``); `eos_token_id` of
generation_config.json or config.json; the first well-known EOS token the vocabulary holds
(``</s>``, ``<|endoftext|>``, ``<|end_of_text|>``, ``<eos>``). None of these: an error that
says to pass the id.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from cephalo.errors import CephaloError

BYTE_LEVEL = "byte-level"
BYTE_VOCAB_SIZE = 256
BYTE_EOS_ID = 10  # "\n", what scripts/text_to_tokens.py puts between files
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
WELL_KNOWN_EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
MAX_JSON_BYTES = 64 << 20  # the largest tokenizer.json files (256k vocabularies) are ~20 MB


class TokenizerError(CephaloError, ValueError):
    """A tokenizer that cannot be used: one line saying which file and why."""


@dataclass(frozen=True)
class TextTokenizer:
    """What tokenizing needs, picklable (worker processes rebuild the encoder from it)."""

    name: str  # for humans: the location, or "byte-level"
    vocab_size: int  # ids are < vocab_size
    eos_id: int
    definition: str | None  # tokenizer.json text; None: byte-level

    @property
    def fingerprint(self) -> str:
        """sha256 of what decides the ids: the tokenizer definition and the EOS id."""
        sha = hashlib.sha256((self.definition or BYTE_LEVEL).encode())
        sha.update(f"|eos={self.eos_id}".encode())
        return sha.hexdigest()

    @property
    def dtype(self) -> np.dtype:
        """The narrowest token-file dtype that holds every id."""
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    def encoder(self) -> Callable[[list[str]], list[np.ndarray]]:
        """texts -> one uint32 id array per text (no special tokens added)."""
        if self.definition is None:
            return _encode_bytes
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(self.definition)

        def encode(texts: list[str]) -> list[np.ndarray]:
            # encode_batch_fast skips the character offsets, which token ids do not need.
            encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
            return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

        return encode


def _encode_bytes(texts: list[str]) -> list[np.ndarray]:
    return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for t in texts]


def byte_tokenizer() -> TextTokenizer:
    return TextTokenizer(BYTE_LEVEL, BYTE_VOCAB_SIZE, BYTE_EOS_ID, None)


def _read_text(fs: Any, path: str) -> str | None:
    """A small JSON file's text, None if absent."""
    try:
        if not fs.isfile(path):
            return None
        size = fs.size(path) or 0
        if size > MAX_JSON_BYTES:
            raise TokenizerError(f"{path} is {size:,} bytes, more than a tokenizer file can be "
                                 f"({MAX_JSON_BYTES:,})")
        with fs.open(path, "rb") as f:
            return f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise TokenizerError(f"cannot read {path}: {err}") from None


def _read_json(fs: Any, path: str) -> dict[str, Any] | None:
    text = _read_text(fs, path)
    if text is None:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise TokenizerError(f"{path} is not valid JSON: {err}") from None
    return data if isinstance(data, dict) else None


def _token_name(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def special_token_ids(files: Mapping[str, bytes], vocab_size: int) -> dict[str, int]:
    """bos/eos/pad token ids as tokenizer files define them (their `*_token` names in
    tokenizer_config.json, looked up in tokenizer.json), where they lie in the vocabulary:
    what `cephalo export --format hf` writes into a from-scratch model's config so that
    `generate` stops at the tokenizer's eos. Empty without both files or with a malformed
    one; a name the vocabulary lacks is left out."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(files[TOKENIZER_FILE].decode())
        settings = json.loads(files[TOKENIZER_CONFIG_FILE])
    except Exception:  # missing, malformed (tokenizers raises a bare Exception), not UTF-8
        return {}
    found = {}
    for role in ("bos", "eos", "pad"):
        name = _token_name(settings.get(f"{role}_token")) if isinstance(settings, dict) \
            else None
        token_id = tokenizer.token_to_id(name) if name is not None else None
        if token_id is not None and 0 <= token_id < vocab_size:
            found[f"{role}_token_id"] = token_id
    return found


def _find_eos(fs: Any, folder: str | None, token_to_id: Callable[[str], int | None]
              ) -> tuple[int | None, str]:
    """(eos id, where it came from) from the files next to tokenizer.json."""
    if folder is not None:
        for name in (TOKENIZER_CONFIG_FILE, "special_tokens_map.json"):
            data = _read_json(fs, posixpath.join(folder, name)) or {}
            token = _token_name(data.get("eos_token"))
            if token is not None:
                found = token_to_id(token)
                if found is None:
                    raise TokenizerError(f"{posixpath.join(folder, name)} names eos_token "
                                         f"{token!r}, which the vocabulary does not hold")
                return found, f"{name} eos_token {token!r}"
        for name in ("generation_config.json", "config.json"):
            value = (_read_json(fs, posixpath.join(folder, name)) or {}).get("eos_token_id")
            if isinstance(value, list) and value:
                value = value[0]
            if isinstance(value, int) and not isinstance(value, bool):
                return value, f"{name} eos_token_id"
    for token in WELL_KNOWN_EOS:
        found = token_to_id(token)
        if found is not None:
            return found, f"the vocabulary's {token!r}"
    return None, ""


def load_tokenizer(location: str | None, eos_id: int | None = None,
                   storage_options: dict[str, Any] | None = None) -> TextTokenizer:
    """The tokenizer at `location` (tokenizer.json, or a folder holding it; a local path or
    an fsspec URL), or the byte-level one when `location` is None or "byte-level"."""
    if location is None or location == BYTE_LEVEL:
        tok = byte_tokenizer()
        if eos_id is not None and eos_id != tok.eos_id:
            _check_eos(eos_id, tok.vocab_size, BYTE_LEVEL)
            tok = TextTokenizer(BYTE_LEVEL, BYTE_VOCAB_SIZE, eos_id, None)
        return tok
    import fsspec
    from tokenizers import Tokenizer

    try:
        fs, path = fsspec.core.url_to_fs(location, **(storage_options or {}))
        is_dir = fs.isdir(path)
    except (OSError, ValueError, ImportError) as err:
        raise TokenizerError(f"cannot open tokenizer {location}: {err}") from None
    folder = path.rstrip("/") if is_dir else None
    file = posixpath.join(folder, TOKENIZER_FILE) if folder is not None else path
    definition = _read_text(fs, file)
    if definition is None:
        hint = (f"the folder has no {TOKENIZER_FILE} (slow tokenizers such as *.model "
                "files are not supported: save a fast one)") if is_dir else "no such file"
        raise TokenizerError(f"tokenizer {location}: {hint}")
    try:
        tokenizer = Tokenizer.from_str(definition)
    except Exception as err:  # tokenizers raises a bare Exception on a bad definition
        raise TokenizerError(f"{file} is not a tokenizers tokenizer.json: "
                             f"{str(err)[:200]}") from None
    # The largest id + 1, not the count: a vocabulary may have holes (added tokens placed
    # at the end of a padded embedding), and the model's vocabSize must cover every id.
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    vocab_size = max(vocab.values(), default=-1) + 1
    if vocab_size < 1:
        raise TokenizerError(f"{file} has an empty vocabulary")
    source = "eos id given"
    if eos_id is None:
        eos_id, source = _find_eos(fs, folder, tokenizer.token_to_id)
        if eos_id is None:
            raise TokenizerError(f"tokenizer {location}: no end-of-sequence token found (no "
                                 "eos_token in tokenizer_config.json, none of "
                                 f"{', '.join(WELL_KNOWN_EOS)}); give its id (--eos-id, "
                                 "data.text.eosId)")
    _check_eos(eos_id, vocab_size, f"{location} ({source})")
    return TextTokenizer(location, vocab_size, eos_id, definition)


def _check_eos(eos_id: int, vocab_size: int, where: str) -> None:
    if not 0 <= eos_id < vocab_size:
        raise TokenizerError(f"EOS id {eos_id} from {where} is outside the vocabulary "
                             f"(0..{vocab_size - 1})")
