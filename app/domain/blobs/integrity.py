"""Reads that check a blob against its name: every byte the farm serves or feeds to the
compiler, the validator or the runtime has first hashed to the sha256 it is stored under.

A blob is read once, hashed as it goes: no second read. Whoever finds a mismatch quarantines
the blob (`BlobStore.quarantine`: moved out of the store, recorded) and raises `BlobCorrupt`,
so a damaged blob is never handed out again, a cache lookup no longer finds it and the next
compile stores good bytes afresh.

A streamed range holds back its last piece until the whole blob has been hashed: a reader
never receives all the bytes it asked for unless they were good (an HTTP download of a
corrupt blob ends short of its Content-Length, which every client reports as an error).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from app.domain.blobs.base import BlobCorrupt, BlobStore, check_range


def verified_range(
    store: BlobStore, sha256: str, start: int, length: int, *, found_by: str
) -> Iterator[bytes]:
    """Bytes [start, start + length) of a blob (clipped at its end), released only as far as
    the blob has proven good: the last piece comes after the whole blob hashed right.

    The size is read (and a missing blob raises BlobNotFound) when this is called, not on
    the first `next`."""
    check_range(start, length)
    size = store.size(sha256)
    end = min(start + length, size)
    return _verified_range(store, sha256, size, start, end, found_by)


def _verified_range(
    store: BlobStore, sha256: str, size: int, start: int, end: int, found_by: str
) -> Iterator[bytes]:
    digest = hashlib.sha256()
    held: bytes | None = None
    pos = 0
    for chunk in store.read_range(sha256, 0, size):
        digest.update(chunk)
        lo, hi = max(start, pos), min(end, pos + len(chunk))
        pos += len(chunk)
        if lo < hi:
            if held is not None:
                yield held
            held = chunk[lo - (pos - len(chunk)) : hi - (pos - len(chunk))]
    _check(store, sha256, digest.hexdigest(), pos, found_by)
    if held is not None:
        yield held


def verified_bytes(store: BlobStore, sha256: str, *, found_by: str) -> bytes:
    """A (small) blob's bytes, checked."""
    return b"".join(verified_range(store, sha256, 0, store.size(sha256), found_by=found_by))


def verify_blob(store: BlobStore, sha256: str, *, found_by: str) -> int:
    """Read a whole blob and check it (quarantined and BlobCorrupt if bad); its size."""
    digest = hashlib.sha256()
    size = 0
    for chunk in store.read_range(sha256, 0, store.size(sha256)):
        digest.update(chunk)
        size += len(chunk)
    _check(store, sha256, digest.hexdigest(), size, found_by)
    return size


def verify_for_use(store: BlobStore, sha256: str, *, found_by: str) -> None:
    """Check a blob before it is used from its `path_hint`: `verify_blob`, unless the store
    vouches for that local file itself (`check_local`: the worker's model cache, which hashed
    the file before and trusts it while it is unchanged: `worker.model_cache`)."""
    check_local = getattr(store, "check_local", None)
    if callable(check_local):
        check_local(sha256, found_by=found_by)
    else:
        verify_blob(store, sha256, found_by=found_by)


@contextmanager
def verified_path(
    store: BlobStore, sha256: str, tmp_dir: Path, name: str = "blob", *, found_by: str
) -> Iterator[Path]:
    """A local file of a checked blob: the store's own file once it hashed right, or a copy
    spilled into `tmp_dir` while hashing (removed after)."""
    hint = store.path_hint(sha256)
    if hint is not None:
        verify_for_use(store, sha256, found_by=found_by)
        yield hint
        return
    dest = spill_verified(store, sha256, tmp_dir / name, found_by=found_by)
    try:
        yield dest
    finally:
        dest.unlink(missing_ok=True)


def spill_verified(store: BlobStore, sha256: str, dest: Path, *, found_by: str) -> Path:
    """Copy a blob into the file `dest` while hashing it; a corrupt blob leaves no file."""
    digest = hashlib.sha256()
    size = 0
    try:
        with open(dest, "wb") as out:
            for chunk in store.read_range(sha256, 0, store.size(sha256)):
                digest.update(chunk)
                size += len(chunk)
                out.write(chunk)
        _check(store, sha256, digest.hexdigest(), size, found_by)
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    return dest


def _check(store: BlobStore, sha256: str, actual: str, size: int, found_by: str) -> None:
    if actual != sha256:
        store.quarantine(sha256, actual_sha256=actual, size=size, found_by=found_by)
        raise BlobCorrupt(sha256, actual, size)
