"""Training data of a CephaloJob: `spec.data` (synthetic tokens, a token file, or text
documents to tokenize), split from job.py so that module stays readable; job.py re-exports
these names."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic.config import JsonValue

from cephalo.api.cel import PARENT_SEGMENT_PATTERN, token_file_rules
from cephalo.api.wire import CamelModel


class SyntheticData(CamelModel):
    """Seeded random tokens / images: deterministic per (seed, step, sample)."""


class TokenFileData(CamelModel):
    """Token ids from a file on a volume mounted into every trainer pod."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": token_file_rules()})

    path: str = Field(min_length=1, max_length=4096, description=(
        "nanoGPT-style flat binary of token ids (memory-mapped): a path, or an fsspec URL "
        "(s3://bucket/train.bin) that every rank downloads once into its local cache."))
    dtype: Literal["uint16", "uint32"] = Field(
        default="uint16", description="Integer type of the token ids in the file.")
    claim_name: str | None = Field(default=None, description=(
        "PersistentVolumeClaim holding the file, mounted read-only at mountPath in every "
        "trainer pod; none: the file is already there (in the image, or local for cephalo run)."),
        max_length=253)
    mount_path: str = Field(default="/data", max_length=4096,
                            description="Where claimName is mounted.")

    @model_validator(mode="after")
    def _path_on_volume(self) -> TokenFileData:
        # Literal prefixes, no normalisation: the same test as the CRD's CEL rule.
        if self.claim_name is None:
            return self
        parent = re.compile(PARENT_SEGMENT_PATTERN)
        mount = self.mount_path
        if not mount.startswith("/") or parent.search(mount) or parent.search(self.path) or \
                self.path.endswith("/") or not self.path.startswith(mount.rstrip("/") + "/"):
            raise ValueError(
                f"tokenFile.path {self.path!r} is not inside mountPath {self.mount_path!r}, where "
                f"volume {self.claim_name!r} is mounted; use an absolute mountPath and a path "
                "under it")
        return self


DATA_URI_PATTERN = r"^[a-z][a-z0-9+.-]*://[^/].*$"  # scheme://bucket-or-host/...
_ESCAPED_PARENT = PARENT_SEGMENT_PATTERN.replace("\\", "\\\\")  # inside a CEL string


def _text_rules() -> list[JsonValue]:
    """`TextData._one_source` and `_path_on_volume` as CEL (same verdicts)."""
    mount = "(self.mountPath.endsWith('/') ? self.mountPath : self.mountPath + '/')"
    return [
        {"rule": "has(self.path) != has(self.uri)",
         "message": "text data needs exactly one of path (a file, folder or glob) and uri"},
        {"rule": ("!has(self.claimName) || (has(self.path) && self.mountPath.startsWith('/') "
                  f"&& !self.mountPath.matches('{_ESCAPED_PARENT}') && "
                  f"!self.path.matches('{_ESCAPED_PARENT}') && self.path.startsWith({mount}) "
                  f"&& size(self.path) > size({mount}))"),
         "message": ("with claimName, path must lie inside mountPath (an absolute path), with "
                     "no '..' segments")},
    ]


class TextData(CamelModel):
    """Text documents that every rank tokenizes once before training (cached locally, keyed
    by the content of the inputs and the tokenizer), then samples exactly like a tokenFile."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _text_rules()})

    path: str | None = Field(default=None, min_length=1, max_length=4096, description=(
        "A local file, folder or glob of text (.txt, .jsonl, .parquet, .arrow); with "
        "claimName, inside mountPath."))
    uri: str | None = Field(default=None, max_length=4096, json_schema_extra={
        "pattern": DATA_URI_PATTERN}, description=(
        "fsspec URL of a file, folder or glob (s3://bucket/corpus/*.parquet; gs://, az:// "
        "with their fsspec packages). Credentials from the pod template's env/envFrom."))
    format: Literal["txt", "jsonl", "parquet", "arrow"] | None = Field(
        default=None, description="Input format; default: from the file extensions.")
    field: str = Field(default="text", min_length=1, max_length=256, description=(
        "JSON field / column holding each document's text."))
    tokenizer: str | None = Field(default=None, max_length=4096, description=(
        "tokenizer.json, or a Hugging Face tokenizer folder holding one (local path or URL); "
        "default: byte-level (UTF-8 bytes, ids 0-255, a newline byte between documents)."))
    eos_id: int | None = Field(default=None, ge=0, le=4_194_303, description=(
        "End-of-sequence id put after every document; default: the tokenizer's EOS token."))
    claim_name: str | None = Field(default=None, max_length=253, description=(
        "PersistentVolumeClaim holding the text, mounted read-only at mountPath in every "
        "trainer pod."))
    mount_path: str = Field(default="/data", max_length=4096,
                            description="Where claimName is mounted.")

    @model_validator(mode="after")
    def _one_source(self) -> TextData:
        if (self.path is None) == (self.uri is None):
            raise ValueError("data.text needs exactly one of path (a local file, folder or "
                             "glob) and uri (s3://bucket/corpus/...)")
        if self.uri is not None and not re.fullmatch(DATA_URI_PATTERN, self.uri):
            raise ValueError(f"data.text.uri {self.uri!r} is not a URL such as "
                             "s3://bucket/corpus/; for a local file use data.text.path")
        return self

    @model_validator(mode="after")
    def _path_on_volume(self) -> TextData:
        if self.claim_name is None:
            return self
        parent = re.compile(PARENT_SEGMENT_PATTERN)
        mount = self.mount_path if self.mount_path.endswith("/") else self.mount_path + "/"
        path = self.path
        if path is None or not mount.startswith("/") or parent.search(self.mount_path) or \
                parent.search(path) or not path.startswith(mount) or len(path) <= len(mount):
            raise ValueError(
                f"data.text.path {path!r} is not inside mountPath {self.mount_path!r}, where "
                f"volume {self.claim_name!r} is mounted; use an absolute mountPath and a path "
                "under it (a uri needs no claimName)")
        return self


class DataSpec(CamelModel):
    """Training data: exactly one of `synthetic`, `tokenFile` or `text`."""

    model_config = ConfigDict(json_schema_extra={
        "oneOf": [{"required": ["synthetic"]}, {"required": ["tokenFile"]},
                  {"required": ["text"]}],
    })

    synthetic: SyntheticData | None = None
    token_file: TokenFileData | None = None
    text: TextData | None = None
    validation_fraction: float | None = Field(default=None, gt=0, le=0.5, description=(
        "With training.evalIntervalSteps on tokenFile/text data: the fraction of the token "
        "stream held out at its end for validation, never sampled for training (default "
        "0.01). Synthetic data validates on a separately seeded set."))

    @model_validator(mode="after")
    def _exactly_one(self) -> DataSpec:
        given = [x for x in (self.synthetic, self.token_file, self.text) if x is not None]
        if len(given) != 1:
            raise ValueError("data needs exactly one of `synthetic: {}`, `tokenFile: {path: …}` "
                             "or `text: {path: …}`")
        return self
