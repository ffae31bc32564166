"""Hugging Face safetensors weights <-> Cephalo units, read one rank's shard at a time.

Every Cephalo parameter has one Hugging Face tensor (`unit_sources`), stored either in the
same layout or transposed (GPT-2's Conv1D keeps [in, out]). A rank's master shard of a unit
is a global element range [start, end) of the unit's flat buffer (flat.py); `HfReader.read`
serves exactly that range the way `checkpoint.ShardReader.read` serves a resume: for each
parameter the range overlaps it slices the rows it needs with safetensors' `get_slice`
(at most one partial row more on each side), so a rank never materialises the whole model.
Reads go in chunks of whole rows (CHUNK_BYTES), each under its own `safe_open`, written
straight into the master shard: safetensors memory-maps the file and the pages a read
touched count towards the process's RSS until the mapping goes, so the transient stays one
chunk (a GPT-2 Conv1D chunk is a column block and maps at most its whole tensor).
bench/hf_loading.py measures it: peak = the rank's shard + ~20 MiB.

Object-storage checkpoints (fsspec URLs) are downloaded file by file to local disk (only
the files holding this rank's ranges) and then read the same way: disk, not memory.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from cephalo.api.hf_config import PretrainedError, config_from_hf, is_url, join, read_hf_config
from cephalo.api.models import ModelConfig
from cephalo.trainer.flat import ParamSpec
from cephalo.trainer.storage import CheckpointError, Store

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SOURCE_FOLDER = "pretrained"  # below a checkpoint root: the files export needs again
SOURCE_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "merges.txt")
CHUNK_BYTES = 16 * 2**20  # at most this much of a tensor is read (and mapped) at once
TIED_BY_DEFAULT = {"gpt2": True, "llama": False, "mistral": False}


@dataclass(frozen=True)
class Source:
    """Where one Cephalo parameter lives in a Hugging Face checkpoint."""

    names: tuple[str, ...]  # candidates, first found wins; names[0] is what export writes
    transpose: bool = False  # stored [in, out] (GPT-2 Conv1D) instead of [out, in]


def _llama_block(layer: int) -> dict[str, Source]:
    p = f"model.layers.{layer}."
    pairs = {"norm1.weight": "input_layernorm.weight", "attn.q.weight": "self_attn.q_proj.weight",
             "attn.k.weight": "self_attn.k_proj.weight", "attn.v.weight": "self_attn.v_proj.weight",
             "attn.o.weight": "self_attn.o_proj.weight",
             "norm2.weight": "post_attention_layernorm.weight",
             "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
             "mlp.down.weight": "mlp.down_proj.weight"}
    return {ours: Source((p + theirs,)) for ours, theirs in pairs.items()}


def _gpt2(name: str, transpose: bool = False) -> Source:
    # GPT2LMHeadModel saves "transformer.*"; the original Hub files (GPT2Model) have no prefix.
    return Source((f"transformer.{name}", name), transpose)


def _gpt2_block(layer: int) -> dict[str, Source]:
    p = f"h.{layer}."
    out = {f"{ln}.{k}": _gpt2(f"{p}{hf}.{k}") for ln, hf in (("ln1", "ln_1"), ("ln2", "ln_2"))
           for k in ("weight", "bias")}
    for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                         ("mlp.fc", "mlp.c_fc"), ("mlp.out", "mlp.c_proj")):
        out[f"{ours}.weight"] = _gpt2(f"{p}{theirs}.weight", transpose=True)
        out[f"{ours}.bias"] = _gpt2(f"{p}{theirs}.bias")
    return out


def unit_sources(config: ModelConfig, index: int, tied: bool = False) -> dict[str, Source]:
    """Cephalo parameter name (inside unit `index`) -> its Hugging Face tensor. `tied`: the
    checkpoint may omit the LM head, which then is the token embedding."""
    last = config.num_units - 1
    if config.family == "llama":
        embedding = "model.embed_tokens.weight"
        if index == 0:
            return {"tokens.weight": Source((embedding,))}
        if index == last:
            head: tuple[str, ...] = (("lm_head.weight", embedding) if tied
                                     else ("lm_head.weight",))
            return {"norm.weight": Source(("model.norm.weight",)), "lm_head.weight": Source(head)}
        return _llama_block(index - 1)
    if config.family == "gpt":
        if index == 0:
            return {"tokens.weight": _gpt2("wte.weight"), "positions.weight": _gpt2("wpe.weight")}
        if index == last:
            wte = _gpt2("wte.weight").names
            head = ("lm_head.weight", *wte) if tied else ("lm_head.weight",)
            return {"norm.weight": _gpt2("ln_f.weight"), "norm.bias": _gpt2("ln_f.bias"),
                    "lm_head.weight": Source(head)}
        return _gpt2_block(index - 1)
    raise PretrainedError(f"a {config.family} model has no Hugging Face mapping (supported: "
                          f"llama, mistral, gpt2)")


def read_rows(handle: Any, name: str, rows: tuple[int, int] | None, transpose: bool
              ) -> torch.Tensor:
    """Rows [r0, r1) of a tensor in Cephalo's [out, in] layout (all of a 1-D range when
    `rows` indexes elements); the one place bytes are read (tests count them here)."""
    sl = handle.get_slice(name)
    if rows is None:
        return sl[:]
    r0, r1 = rows
    return sl[:, r0:r1].T if transpose else sl[r0:r1]


class HfReader:
    """Global element ranges of Cephalo units, read from a Hugging Face checkpoint."""

    def __init__(self, location: str, config: ModelConfig, tied: bool,
                 cache_dir: Path | None = None) -> None:
        self.location = location
        self.config = config
        self.tied = tied
        self._cache_dir = cache_dir
        self._own_cache: Path | None = None
        self._local: dict[str, Path] = {}
        self._store = Store(location) if is_url(location) else None
        self.weight_map = self._weight_map()

    def _file(self, file_name: str) -> Path:
        if file_name not in self._local:
            if not is_url(self.location):
                self._local[file_name] = Path(join(self.location, file_name))
            else:
                if self._cache_dir is None:
                    self._own_cache = self._cache_dir = Path(tempfile.mkdtemp(prefix="cephalo-hf-"))
                assert self._store is not None
                self._local[file_name], _ = self._store.local_copy(file_name, self._cache_dir)
        return self._local[file_name]

    def _weight_map(self) -> dict[str, str]:
        """Tensor name -> file name (from the index of a sharded checkpoint, else the one
        file's header)."""
        try:
            text = _read_optional(join(self.location, INDEX_FILE))
            if text is not None:
                return dict(json.loads(text)["weight_map"])
            with safe_open(str(self._file(SINGLE_FILE)), framework="pt") as f:
                return dict.fromkeys(f.keys(), SINGLE_FILE)
        except (OSError, ValueError, KeyError) as err:
            raise PretrainedError(f"model.pretrained {self.location}: no readable "
                                  f"{INDEX_FILE} or {SINGLE_FILE} ({type(err).__name__}: "
                                  f"{err})") from None

    def close(self) -> None:
        if self._own_cache is not None:
            shutil.rmtree(self._own_cache, ignore_errors=True)
            self._own_cache = None

    def _name(self, source: Source) -> str:
        for name in source.names:
            if name in self.weight_map:
                return name
        raise PretrainedError(f"model.pretrained {self.location}: tensor {source.names[0]} is "
                              f"missing from the checkpoint")

    def read(self, unit: int, specs: list[ParamSpec], start: int, end: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [start, end) of unit `unit`'s flat buffer (fp32), written into `out`
        (a CPU fp32 tensor of that size, e.g. the master shard itself) when given."""
        if out is None:
            out = torch.empty(end - start, dtype=torch.float32)
        sources = unit_sources(self.config, unit, self.tied)
        for spec in specs:
            lo, hi = max(start, spec.offset), min(end, spec.offset + spec.numel)
            if hi <= lo:
                continue
            source = sources[spec.name]
            name = self._name(source)
            path = str(self._file(self.weight_map[name]))
            # Chunks of whole rows, each under its own mapping of the file: the pages a read
            # touches count as RSS until unmapped, so this bounds the transient to a chunk.
            row = spec.shape[-1] if len(spec.shape) > 1 else 1
            step = max(1, CHUNK_BYTES // (4 * row)) * row
            a = lo
            while a < hi:
                b = min(hi, (a - spec.offset) // row * row + spec.offset + step)
                with safe_open(path, framework="pt") as handle:
                    values = self._range(handle, name, source, spec, a - spec.offset,
                                         b - spec.offset)
                    out[a - start:b - start].copy_(values)
                    del values
                a = b
        return out

    def _range(self, handle: Any, name: str, source: Source, spec: ParamSpec, a: int, b: int
               ) -> torch.Tensor:
        """Elements [a, b) of one parameter (flattened in Cephalo's layout)."""
        stored = tuple(handle.get_slice(name).get_shape())
        want = tuple(reversed(spec.shape)) if source.transpose else spec.shape
        # GPT-2's position table may be longer than the training sequence: its first rows.
        longer_ok = spec.name == "positions.weight" and stored[1:] == want[1:] \
            and stored[0] >= want[0]
        if stored != want and not longer_ok:
            raise PretrainedError(f"model.pretrained {self.location}: tensor {name} has shape "
                                  f"{list(stored)}, the model needs {list(want)}")
        if len(spec.shape) == 1:
            return read_rows(handle, name, (a, b), False).float()
        width = spec.shape[1]
        r0, r1 = a // width, -(-b // width)
        rows = read_rows(handle, name, (r0, r1), source.transpose)
        return rows.reshape(-1)[a - r0 * width:b - r0 * width].float()


def _read_optional(path: str) -> bytes | None:
    if not is_url(path):
        p = Path(path)
        return p.read_bytes() if p.is_file() else None
    import fsspec

    fs, rel = fsspec.core.url_to_fs(path)
    return bytes(fs.cat_file(rel)) if fs.exists(rel) else None


def _tied(hf: dict[str, Any]) -> bool:
    model_type = str(hf.get("model_type", ""))
    return bool(hf.get("tie_word_embeddings", TIED_BY_DEFAULT.get(model_type, False)))


def init_from_pretrained(engine: Any, spec: Any, store: Store | None, verbose: bool) -> None:
    """Step 0 of a job with `model.pretrained`: every rank fills its own master shards from
    the Hugging Face checkpoint (Adam moments stay zero). A resumed run (step > 0) keeps its
    checkpoint. Rank 0 keeps config.json and tokenizer files under the checkpoint root's
    `pretrained/`, for `cephalo export --format hf`."""
    if spec.pretrained is None or engine.step_count != 0:
        return
    try:
        hf = read_hf_config(spec.pretrained)
        config = config_from_hf(hf, spec.model_dump(exclude_none=True,
                                                    exclude={"preset", "pretrained"}))
        if config != engine.config:
            raise PretrainedError(f"model.pretrained {spec.pretrained}: its config.json "
                                  f"describes {config}, the job resolved {engine.config}")
        reader = HfReader(spec.pretrained, config, _tied(hf))
        try:
            engine.load_parameters(
                lambda i, start, end: reader.read(i, engine.units[i].specs, start, end))
        finally:
            reader.close()
        if store is not None and engine.rank == 0:
            keep_source_files(spec.pretrained, store)
    except PretrainedError as err:  # the same one line on every rank (main() prints it)
        raise CheckpointError(str(err)) from None
    if verbose and engine.rank == 0:
        print(f"cephalo trainer: initialised from pretrained {spec.pretrained}", flush=True)


def keep_source_files(location: str, store: Store) -> None:
    store.makedirs(SOURCE_FOLDER)
    for name in SOURCE_FILES:
        data = _read_optional(join(location, name))
        if data is not None:
            store.write_bytes(f"{SOURCE_FOLDER}/{name}", data)
