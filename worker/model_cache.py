"""Models kept on the worker's local disk by sha256, so a worker that compiles the same model
again (a sweep, a recompile, another option) does not read it from the blob store again.

The farm's store is the database (`blob_chunks`): reading a 98 MiB ResNet-50 back chunk by
chunk costs seconds per job. `ModelCache.over(store)` is a store whose reads of a cached
model come from a local file: `path_hint` fills the cache on a miss (the blob is spilled
while hashed, then renamed into place, so a reader never sees a partial file) and answers the
cached file, which the compile then maps in place; reads (`read_range`, `open`, `size`) of a
cached sha256 are served from it, so the check before every compile hashes the local copy.
Everything else goes to the store.

The cache lives in `<work root>/model-cache` (the work-folder reaper leaves it alone) and
holds at most `QPCFARM_MODEL_CACHE_BYTES` (0: no cache): after a fill, the least recently
used files beyond it are removed, never one used in the last `KEEP_RECENT_S` (a compile opens
its model within seconds of asking; an open file outlives its removal). A cached copy that
fails its hash check is removed (and the job fails `blob_corrupt`); the store's blob is not
touched, and the next job reads it afresh.
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
from app.domain.blobs.base import BlobRef, Source, check_range, check_sha256
from app.domain.blobs.integrity import spill_verified

log = logging.getLogger(__name__)

FOLDER = "model-cache"
KEEP_RECENT_S = 600.0
READ_CHUNK = 1 << 20


class ModelCache:
    """Files named by sha256 under `root`, at most `max_bytes` in total."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def file(self, sha256: str) -> Path:
        return self.root / check_sha256(sha256)

    def cached(self, sha256: str) -> Path | None:
        path = self.file(sha256)
        try:
            os.utime(path)  # recently used: the eviction order
        except FileNotFoundError:
            return None
        return path

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
        self.file(sha256).unlink(missing_ok=True)

    def evict(self) -> list[str]:
        """Remove the least recently used files beyond `max_bytes`; their names."""
        with self._lock:
            entries: list[tuple[float, int, Path]] = []
            for path in self.root.iterdir():
                if path.name.startswith("."):
                    continue
                try:
                    info = path.stat()
                except FileNotFoundError:
                    continue
                entries.append((info.st_mtime, info.st_size, path))
            total = sum(size for _, size, _ in entries)
            removed: list[str] = []
            now = time.time()
            for mtime, size, path in sorted(entries):
                if total <= self.max_bytes:
                    break
                if now - mtime < KEEP_RECENT_S:
                    continue
                path.unlink(missing_ok=True)
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

    def size(self, sha256: str) -> int:
        path = self._cache.cached(sha256)
        return path.stat().st_size if path is not None else self._store.size(sha256)

    def read_range(self, sha256: str, start: int, length: int) -> Iterator[bytes]:
        path = self._cache.cached(sha256)
        if path is None:
            yield from self._store.read_range(sha256, start, length)
            return
        check_range(start, length)
        with open(path, "rb") as handle:
            handle.seek(start)
            left = length
            while left > 0:
                chunk = handle.read(min(READ_CHUNK, left))
                if not chunk:
                    return
                left -= len(chunk)
                yield chunk

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

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


_CACHES: dict[Path, ModelCache] = {}
_CACHES_LOCK = threading.Lock()


def for_worker(store: BlobStore, work_root: Path | None, max_bytes: int | None = None) -> BlobStore:
    """`store` behind this process's model cache under `work_root` (`workdirs.work_root`);
    `store` itself when it has local files already or the cache is off."""
    from app.domain.blobs.database import DatabaseBlobStore
    from app.domain.settings import get_settings
    from worker.workdirs import work_root as resolve

    if max_bytes is None:
        max_bytes = get_settings().model_cache_bytes
    if max_bytes <= 0 or not isinstance(store, DatabaseBlobStore):
        return store  # off, or a store of local files already (or cached already)
    root = resolve(work_root) / FOLDER
    with _CACHES_LOCK:
        cache = _CACHES.get(root)
        if cache is None or cache.max_bytes != max_bytes:
            cache = _CACHES[root] = ModelCache(root, max_bytes)
    return cache.over(store)
