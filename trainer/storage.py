"""Where checkpoints live: a POSIX folder that every rank sees, or an object store (fsspec).

`Store(location)` takes a local path (``/checkpoints/job``, ``file:///...``) or an fsspec URL
(``s3://bucket/prefix/ns/job``; ``gs://`` and ``az://`` work when gcsfs / adlfs are
installed). Credentials come from the usual environment of the backend (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for S3-compatible servers, GOOGLE_APPLICATION_
CREDENTIALS, AZURE_STORAGE_*), which the operator passes to the pods from the job's
pod template.

Writes are atomic per file on both kinds of storage: a local file is written to a temp
name, fsynced, renamed and its folder fsynced; an object store makes an object visible only
when its PUT (or multipart upload) completes. Nothing here relies on another rank having
created a folder: every rank creates what it writes into.

A POSIX folder must be *shared* (one ReadWriteMany volume, NFS, ...): `check_shared` makes
every rank write a probe file at start-up and fails on every rank with one line when some
rank cannot see the others' probes (an emptyDir per pod), or cannot write at all (bad
credentials, missing bucket, read-only volume), before any training time is spent.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import posixpath
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

if TYPE_CHECKING:  # torch.distributed only where a collective runs: `cephalo export` checks
    # its checkpoint location with Store before it needs torch (seconds of start-up)
    import torch.distributed as dist

PROBE_DIR = ".cephalo-probe"
CHUNK_BYTES = 1 << 22


class CheckpointError(RuntimeError):
    """Checkpoint storage that cannot work; one line naming the rank, the path and the cause."""


def describe(err: BaseException) -> str:
    """One line: the exception's type and text plus what to check for the usual causes."""
    text = " ".join(str(err).split()) or "(no message)"
    hint = ""
    lowered = text.lower()
    if isinstance(err, PermissionError) or any(
            s in lowered for s in ("accessdenied", "access denied", "invalidaccesskeyid",
                                   "signaturedoesnotmatch", "credentials", "forbidden")):
        hint = ("check the storage credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                "or the secret in the job's podTemplate) and their permissions")
    elif isinstance(err, OSError) and err.errno == errno.ENOSPC:
        hint = "the volume is full: free space, use a bigger volume or lower checkpoint.keep"
    elif isinstance(err, FileNotFoundError) or "nosuchbucket" in lowered:
        hint = "check that the bucket / volume exists"
    return f"{type(err).__name__}: {text}" + (f" ({hint})" if hint else "")


class HashingWriter:
    """A write-only file wrapper that counts and hashes what passes through (one pass)."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.size_bytes = 0
        self._sha = hashlib.sha256()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._sha.update(view)
        self.size_bytes += len(view)
        self._f.write(view)
        return len(view)

    def flush(self) -> None:
        self._f.flush()

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()


class Store:
    """A checkpoint root on local disk or object storage; paths below it are relative."""

    def __init__(self, location: str | Path) -> None:
        location = str(location)
        if not location.strip():
            raise CheckpointError("empty checkpoint location")
        # A fresh client per store: credentials are read from the environment now, not
        # reused from an earlier store of the same process (fsspec caches instances).
        self.fs, root = fsspec.core.url_to_fs(location, skip_instance_cache=True)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.root = root.rstrip("/") or "/"
        self.location = self.root if self.is_local else location.rstrip("/")

    def __repr__(self) -> str:
        return f"Store({self.location!r})"

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts) if parts else self.root

    def url(self, *parts: str) -> str:
        """What to show a human for a path below the root."""
        return posixpath.join(self.location, *parts) if parts else self.location

    def makedirs(self, *parts: str) -> None:
        if self.is_local:  # object stores have no folders: a key's prefix needs no creation
            os.makedirs(self.path(*parts), exist_ok=True)

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.write_stream(rel, lambda f: f.write(data))

    def write_stream(self, rel: str, produce: Callable[[HashingWriter], object]
                     ) -> dict[str, Any]:
        """Atomically write what `produce` writes; returns its size and sha256."""
        target = self.path(rel)
        if self.is_local:
            tmp = f"{target}.tmp-{os.getpid()}"
            try:
                with open(tmp, "wb") as f:
                    writer = HashingWriter(f)
                    produce(writer)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
            except BaseException:
                _remove_quietly(tmp)
                raise
            _fsync_dir(os.path.dirname(target))
        else:
            f = self.fs.open(target, "wb")
            try:
                writer = HashingWriter(f)
                produce(writer)
            except BaseException:
                # Closing would upload what was written so far: abort instead, so that a
                # failed write leaves no object (a multipart upload is cancelled).
                try:
                    f.discard()
                finally:
                    f.closed = True
                raise
            f.close()
        return {"size_bytes": writer.size_bytes, "sha256": writer.sha256}

    def read_bytes(self, rel: str) -> bytes:
        return bytes(self.fs.cat_file(self.path(rel)))

    def exists(self, rel: str) -> bool:
        self._forget_listings()
        return bool(self.fs.exists(self.path(rel)))

    def sizes(self, rel_dir: str = "") -> dict[str, int]:
        """Name -> size of the files directly in a folder (empty if it does not exist)."""
        self._forget_listings()
        try:
            entries = self.fs.ls(self.path(rel_dir), detail=True)
        except FileNotFoundError:
            return {}
        return {posixpath.basename(e["name"].rstrip("/")): int(e.get("size") or 0)
                for e in entries if e.get("type") == "file"}

    def folders(self, prefix: str) -> list[str]:
        """Names of the folders (key prefixes) directly below the root starting with prefix."""
        self._forget_listings()
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        names = (posixpath.basename(e["name"].rstrip("/")) for e in entries
                 if e.get("type") == "directory")
        return sorted(n for n in names if n.startswith(prefix))

    def remove(self, rel: str, recursive: bool = False) -> None:
        """Delete a file (or a folder with everything in it); absent is fine."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(rel), recursive=recursive)
        self._forget_listings()

    def local_copy(self, rel: str, cache_dir: Path) -> tuple[Path, dict[str, Any]]:
        """A local file with this object's bytes (the file itself on local storage, else a
        download into `cache_dir`), with the size and sha256 measured while reading."""
        sha = hashlib.sha256()
        size = 0
        if self.is_local:
            local = Path(self.path(rel))
            with open(local, "rb") as f:
                for chunk in iter(lambda: f.read(CHUNK_BYTES), b""):
                    sha.update(chunk)
                    size += len(chunk)
        else:
            cache_dir.mkdir(parents=True, exist_ok=True)
            local = cache_dir / rel.replace("/", "__")
            with self.fs.open(self.path(rel), "rb") as src, open(local, "wb") as dst:
                for chunk in iter(lambda: src.read(CHUNK_BYTES), b""):
                    sha.update(chunk)
                    size += len(chunk)
                    dst.write(chunk)
        return local, {"size_bytes": size, "sha256": sha.hexdigest()}

    def _forget_listings(self) -> None:
        # s3fs & co. cache listings; another rank may have written since.
        if not self.is_local:
            self.fs.invalidate_cache()


def _fsync_dir(path: str) -> None:
    """Make a rename in `path` durable (POSIX needs the folder itself synced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on folders; the rename is still atomic
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def gather(group: dist.ProcessGroup | None, world_size: int, value: Any) -> list[Any]:
    """Every rank's `value` on every rank (object all-gather on the given gloo group)."""
    if world_size == 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, value, group=group)
    return out


def raise_if_failed(errors: list[str | None], what: str) -> None:
    """The same one-line CheckpointError on every rank when any rank reported an error."""
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        raise CheckpointError(f"{what} failed: " + "; ".join(e for _, e in failed))


def check_shared(store: Store, rank: int, world_size: int,
                 group: dist.ProcessGroup | None) -> None:
    """Collective: every rank can write to `store`, and all ranks see the same storage."""
    token = gather(group, world_size, uuid.uuid4().hex if rank == 0 else None)[0]
    probe_dir = f"{PROBE_DIR}-{token}"
    mine = f"{probe_dir}/rank-{rank:05d}"
    error = None
    try:
        store.makedirs(probe_dir)
        store.write_bytes(mine, b"probe\n")
    except Exception as err:
        error = f"rank {rank} cannot write to {store.url(mine)}: {describe(err)}"
    raise_if_failed(gather(group, world_size, error), "checking the checkpoint storage")
    try:
        seen = store.sizes(probe_dir)
        missing = [r for r in range(world_size) if f"rank-{r:05d}" not in seen]
    except Exception as err:
        missing = []
        error = f"rank {rank} cannot list {store.url(probe_dir)}: {describe(err)}"
    reports = gather(group, world_size, (missing, error))
    store.remove(mine)
    gather(group, world_size, None)  # every probe is gone before rank 0 drops the folder
    if rank == 0:
        store.remove(probe_dir, recursive=True)
    raise_if_failed([e for _, e in reports], "checking the checkpoint storage")
    blind = [(r, m) for r, (m, _) in enumerate(reports) if m]
    if blind:
        r, m = blind[0]
        raise CheckpointError(
            f"checkpoint folder {store.url()} is not shared between ranks: rank {r} does "
            f"not see the probe file of rank {', '.join(map(str, m))} (each rank has its "
            f"own folder, e.g. an emptyDir per pod); mount one ReadWriteMany volume on every "
            f"rank (checkpoint.claimName) or use object storage (checkpoint.uri: "
            f"s3://bucket/prefix)")
