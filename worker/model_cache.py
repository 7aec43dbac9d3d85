"""Models kept on the worker's local disk by sha256, so a worker that compiles the same model
again (a sweep, a recompile, another option) neither reads it from the blob store again nor
hashes it again.

In farm mode the store is the database (`blob_chunks`) or a volume shared by the API and the
workers: reading a 98 MiB ResNet-50 back costs seconds per job from the first, a read across
the network from the second. `ModelCache.over(store)` is a store whose reads of a cached
model come from a local file: `path_hint` fills the cache on a miss (the blob is spilled
while hashed, then renamed into place, so a reader never sees a partial file) and answers the
cached file, which the compile then maps in place; reads (`read_range`, `open`, `size`) of a
cached sha256 are served from it.

The check before a compile (`check_local`) hashes the cached file once and then trusts it
while its inode, size, mtime and ctime are the ones it had when that hash began: the folder
is the worker's own (0700, under its work root), nothing of the farm writes a cached file
after its fill, and any write to it changes its ctime (which no one can set back). Trust is
only recorded when the hash began `TRUST_AFTER_S` after the file's last change, so a write in
the same timestamp tick as that change, which would leave ctime as it was, cannot go unseen.
So the first use after a fill hashes the file, as does the first use in each process; a
damaged disk that keeps a file's times is not caught between (`qpcfarm admin verify-blobs`
scrubs the store, and each download and cache hit checks the bytes it serves).

The cache lives in `<work root>/model-cache` (the work-folder reaper leaves it alone) and
holds at most `QPCFARM_MODEL_CACHE_BYTES` (0: no cache): after a fill, the least recently
used files beyond it are removed, never one used in the last `KEEP_RECENT_S` (a compile opens
its model within seconds of asking; an open file outlives its removal). A use is recorded on
a marker file beside the model (`.used-<sha256>`), not on the model, whose times are its
check's. A cached copy that fails its hash check is removed (and the job fails
`blob_corrupt`); the store's blob is not touched, and the next job reads it afresh.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from app.domain.blobs import BlobStore
from app.domain.blobs.base import (
    BlobRef,
    FileDigest,
    Source,
    check_range,
    check_sha256,
    file_range,
)
from app.domain.blobs.integrity import spill_verified, verify_blob

log = logging.getLogger(__name__)

FOLDER = "model-cache"
KEEP_RECENT_S = 600.0
USED_PREFIX = ".used-"
TRUST_AFTER_S = 2.0
"""How long after a file's last change a hash must begin for its result to be trusted
until the next change: above the coarsest timestamp granularity of the file systems a
work root lives on (1-2 s; Linux's local file systems tick every few ms)."""

StatKey = tuple[int, int, int, int]
"""A file's inode, size, mtime and ctime (ns): what a write to it changes."""


def _stat_key(path: Path) -> tuple[StatKey, int]:
    info = os.stat(path)
    return (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns), info.st_ctime_ns


class ModelCache:
    """Files named by sha256 under `root`, at most `max_bytes` in total."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._trusted: dict[str, StatKey] = {}
        """Cached files that hashed right, as they were when their hash began."""
        root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def file(self, sha256: str) -> Path:
        return self.root / check_sha256(sha256)

    def _used(self, sha256: str) -> Path:
        return self.root / f"{USED_PREFIX}{sha256}"

    def cached(self, sha256: str) -> Path | None:
        path = self.file(sha256)
        if not path.is_file():
            return None
        self._used(sha256).touch()  # recently used: the eviction order
        return path

    def check(self, store: BlobStore, sha256: str, *, found_by: str) -> None:
        """Hash the cached file of `sha256` (read through `store`, a `CachedStore` over this
        cache) unless it hashed right before and is unchanged since (see the module)."""
        key, ctime_ns = _stat_key(self.file(sha256))
        if self._trusted.get(sha256) == key:
            return
        began = time.time_ns()
        verify_blob(store, sha256, found_by=found_by)  # BlobCorrupt: dropped (`quarantine`)
        try:
            after, _ = _stat_key(self.file(sha256))
        except FileNotFoundError:
            return
        if after == key and began - ctime_ns >= TRUST_AFTER_S * 1e9:
            self._trusted[sha256] = key

    def trusted(self, sha256: str) -> bool:
        """Whether the next `check` of `sha256` reads nothing (the file is as it was)."""
        try:
            return self._trusted.get(sha256) == _stat_key(self.file(sha256))[0]
        except FileNotFoundError:
            return False

    def fill(self, store: BlobStore, sha256: str) -> Path:
        """The cached file of `sha256`, read from `store` (and checked) if not there yet."""
        found = self.cached(sha256)
        if found is not None:
            return found
        tmp = self.root / f".fill-{uuid.uuid4().hex}"
        try:
            spill_verified(store, sha256, tmp, found_by="compile")
            os.replace(tmp, self.file(sha256))
        finally:
            tmp.unlink(missing_ok=True)
        self.evict()
        return self.file(sha256)

    def drop(self, sha256: str) -> None:
        self._trusted.pop(sha256, None)
        self.file(sha256).unlink(missing_ok=True)
        self._used(sha256).unlink(missing_ok=True)

    def models(self) -> list[str]:
        """The sha256 of every cached model."""
        return sorted(p.name for p in self.root.iterdir() if len(p.name) == 64)

    def _last_use(self, path: Path) -> tuple[float, int]:
        """(last use, size) of a cached model: its marker's mtime, or its own if unused."""
        info = path.stat()
        try:
            used = self._used(path.name).stat().st_mtime
        except FileNotFoundError:
            used = info.st_mtime
        return max(used, info.st_mtime), info.st_size

    def evict(self) -> list[str]:
        """Remove the least recently used files beyond `max_bytes`; their names."""
        with self._lock:
            entries: list[tuple[float, int, Path]] = []
            for name in self.models():
                try:
                    used, size = self._last_use(self.root / name)
                except FileNotFoundError:
                    continue
                entries.append((used, size, self.root / name))
            total = sum(size for _, size, _ in entries)
            removed: list[str] = []
            now = time.time()
            for mtime, size, path in sorted(entries):
                if total <= self.max_bytes:
                    break
                if now - mtime < KEEP_RECENT_S:
                    continue
                self.drop(path.name)
                total -= size
                removed.append(path.name)
            return removed

    def over(self, store: BlobStore) -> BlobStore:
        """`store` with this cache in front of its model reads (stores that already have
        local files, `path_hint` not None, are returned as they are)."""
        return CachedStore(store, self)


class CachedStore:
    """A `BlobStore` that serves cached blobs from local files (see the module)."""

    def __init__(self, store: BlobStore, cache: ModelCache) -> None:
        self._store = store
        self._cache = cache

    def path_hint(self, sha256: str) -> Path | None:
        return self._cache.fill(self._store, sha256)

    def check_local(self, sha256: str, *, found_by: str) -> None:
        """The check before a use of `path_hint`'s file (`integrity.verify_for_use`)."""
        if self._cache.cached(sha256) is None:
            verify_blob(self, sha256, found_by=found_by)  # evicted meanwhile: the store's
            return
        self._cache.check(self, sha256, found_by=found_by)

    def size(self, sha256: str) -> int:
        path = self._cache.cached(sha256)
        return path.stat().st_size if path is not None else self._store.size(sha256)

    def read_range(self, sha256: str, start: int, length: int) -> Iterator[bytes]:
        path = self._cache.cached(sha256)
        if path is None:
            yield from self._store.read_range(sha256, start, length)
            return
        check_range(start, length)
        yield from file_range(open(path, "rb"), start, length)

    def open(self, sha256: str) -> BinaryIO:
        path = self._cache.cached(sha256)
        return open(path, "rb") if path is not None else self._store.open(sha256)

    def quarantine(self, sha256: str, *, actual_sha256: str, size: int, found_by: str) -> None:
        if self._cache.cached(sha256) is not None:
            log.warning("cached model %s failed its hash check; removed from the cache", sha256)
            self._cache.drop(sha256)
            return
        self._store.quarantine(sha256, actual_sha256=actual_sha256, size=size, found_by=found_by)

    def put(self, data: Source, *, max_bytes: int | None = None) -> BlobRef:
        return self._store.put(data, max_bytes=max_bytes)

    def put_file(
        self, path: Path, *, max_bytes: int | None = None, digest: FileDigest | None = None
    ) -> BlobRef:
        return self._store.put_file(path, max_bytes=max_bytes, digest=digest)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


_CACHES: dict[Path, ModelCache] = {}
_CACHES_LOCK = threading.Lock()


def for_worker(
    store: BlobStore,
    work_root: Path | None,
    max_bytes: int | None = None,
    *,
    server_database: bool,
) -> BlobStore:
    """`store` behind this process's model cache under `work_root` (`workdirs.work_root`):
    the database store, and the filesystem store of a farm whose database is a server (a
    volume the API and the workers share, perhaps over a network). `store` itself when the
    cache is off or the store is the embedded mode's folder (SQLite: this host's own disk,
    whose files the compile uses in place)."""
    from app.domain.blobs.database import DatabaseBlobStore
    from app.domain.blobs.filesystem import FilesystemBlobStore
    from app.domain.settings import get_settings
    from worker.workdirs import work_root as resolve

    if max_bytes is None:
        max_bytes = get_settings().model_cache_bytes
    shared = isinstance(store, DatabaseBlobStore) or (
        isinstance(store, FilesystemBlobStore) and server_database
    )
    if max_bytes <= 0 or not shared:
        return store  # off, a store of this host's files, or cached already
    root = resolve(work_root) / FOLDER
    with _CACHES_LOCK:
        cache = _CACHES.get(root)
        if cache is None or cache.max_bytes != max_bytes:
            cache = _CACHES[root] = ModelCache(root, max_bytes)
    return cache.over(store)
