"""A checkpoint reader leaves no files behind: local shards are read where they are (no
temporary folder, no copy), and the downloads of an object store's shards are deleted when
the reader is closed or its `with` block ends. Regression: every reader made a
`cephalo-read-*` folder in the temp dir, even over local storage, and readers that were
never closed left hundreds of them behind."""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch

from cephalo.trainer.checkpoint import CheckpointInfo, ShardReader, rank_file_name
from cephalo.trainer.storage import Store

NAME = "step-00000001"
VALUES = torch.arange(6, dtype=torch.float32)


def _write_shards(store: Store) -> CheckpointInfo:
    """Two ranks' shard files of one 6-element unit (rank 0 holds [0, 4), rank 1 [4, 6)),
    in the layout the trainer writes, and the meta.json fields the reader uses."""
    bounds = [(0, 4), (4, 6)]
    for rank, (start, end) in enumerate(bounds):
        entry = {"start": start, "end": end, "param": VALUES[start:end].clone(),
                 "exp_avg": torch.zeros(end - start), "exp_avg_sq": torch.ones(end - start)}
        with store.fs.open(store.path(NAME, rank_file_name(rank)), "wb") as f:
            torch.save({"units": [entry], "rng": torch.get_rng_state()}, f)
    return CheckpointInfo(store, NAME, {"bounds": [bounds], "step": 1})


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The process's temp dir, empty at the start, where a reader makes its own folders."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.fixture
def memory_store() -> Iterator[Store]:
    """An object store (fsspec's in-memory filesystem: not local, so shards are downloaded)."""
    root = f"memory://checkpoints-{uuid.uuid4().hex}"
    yield Store(root)
    fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)


def test_a_reader_over_local_storage_makes_no_temporary_folder(tmp_path: Path,
                                                                temp_dir: Path) -> None:
    (tmp_path / "ckpt" / NAME).mkdir(parents=True)
    info = _write_shards(Store(tmp_path / "ckpt"))
    reader = ShardReader(info)  # not closed: nothing of its own to delete
    assert torch.equal(reader.read(0, 0, 6), VALUES)
    assert list(temp_dir.iterdir()) == []


def test_an_object_store_reader_deletes_its_downloads_when_closed(memory_store: Store,
                                                                   temp_dir: Path) -> None:
    info = _write_shards(memory_store)
    assert not memory_store.is_local
    with ShardReader(info) as reader:
        assert torch.equal(reader.read(0, 2, 5), VALUES[2:5])
        (downloads,) = temp_dir.iterdir()
        assert downloads.name.startswith("cephalo-read-")
        assert sorted(p.name for p in downloads.iterdir()) == [
            f"{NAME}__{rank_file_name(0)}", f"{NAME}__{rank_file_name(1)}"]
    assert list(temp_dir.iterdir()) == []


def test_a_reader_given_a_cache_dir_keeps_the_callers_downloads(memory_store: Store,
                                                                 tmp_path: Path,
                                                                 temp_dir: Path) -> None:
    info = _write_shards(memory_store)
    cache = tmp_path / "cache"
    with ShardReader(info, cache_dir=cache) as reader:
        assert torch.equal(reader.read(0, 0, 6, "param"), VALUES)
    assert len(list(cache.iterdir())) == 2  # the caller's folder: the caller cleans it up
    assert list(temp_dir.iterdir()) == []
