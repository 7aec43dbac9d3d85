"""The blob store interface and its shared helpers (the backends are `filesystem` and
`database`; `factory` picks one from settings).

Blobs are named by the sha256 of their bytes, so writing the same content twice stores it
once and a reader can trust a name for its content. Every operation streams in bounded chunks:
a multi-GB model never sits whole in memory.
"""

from __future__ import annotations

import hashlib
import os
import queue
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol, runtime_checkable

if TYPE_CHECKING:
    pass

CHUNK_SIZE = 1 << 20
"""Streaming granularity, and the row size of the database store."""

Source = BinaryIO | Iterable[bytes]


@dataclass(frozen=True)
class BlobRef:
    sha256: str
    size: int
    created: bool = field(default=False, compare=False)
    """True when this `put` stored content the store did not hold (so a refused upload
    may remove it again: `orphans.discard_refused`)."""


class BlobTooLarge(Exception):
    """The stream passed `max_bytes`; the store kept nothing of it."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"blob exceeds the limit of {max_bytes:,} bytes")
        self.max_bytes = max_bytes


class BlobCorrupt(Exception):
    """A stored blob's bytes do not hash to its name. It has been quarantined (moved out of
    the store) by the time this is raised, so the next read finds it missing."""

    def __init__(self, sha256: str, actual_sha256: str, size: int) -> None:
        super().__init__(f"blob {sha256} is corrupt (its bytes hash to {actual_sha256})")
        self.sha256 = sha256
        self.actual_sha256 = actual_sha256
        self.size = size


@dataclass(frozen=True)
class Quarantined:
    """What a store reports of a blob it moved aside: where its bytes went (a path under
    the store's root, or a key of the database store) and who found it."""

    sha256: str
    actual_sha256: str
    size: int
    found_by: str
    location: str


QuarantineRecorder = Callable[[Quarantined], None]


class BlobNotFound(KeyError):
    def __init__(self, sha256: str) -> None:
        super().__init__(sha256)
        self.sha256 = sha256

    def __str__(self) -> str:
        return f"no blob {self.sha256}"


@runtime_checkable
class BlobStore(Protocol):
    def put(self, data: Source, *, max_bytes: int | None = None) -> BlobRef:
        """Store a stream while hashing it; raises BlobTooLarge as soon as `max_bytes` is
        passed, leaving nothing behind. Idempotent: known content is not stored again."""
        ...

    def put_file(
        self, path: Path, *, max_bytes: int | None = None, digest: FileDigest | None = None
    ) -> BlobRef:
        """`put` of a finished local file (a QPC the compiler wrote). A store of files may
        take the file's inode itself instead of a copy: the caller must not write to it
        again (reading it, and removing it, are fine). `digest`: the file's `file_digest`,
        taken earlier, used when the file is still that inode, unchanged (else hashed)."""
        ...

    def open(self, sha256: str) -> BinaryIO:
        """A readable, seekable binary stream of the blob (BlobNotFound if absent)."""
        ...

    def read_range(self, sha256: str, start: int, length: int) -> Iterator[bytes]:
        """Bytes [start, start + length) in chunks, clipped at the end (HTTP Range)."""
        ...

    def exists(self, sha256: str) -> bool: ...

    def size(self, sha256: str) -> int:
        """The blob's size in bytes (BlobNotFound if absent)."""
        ...

    def delete(self, sha256: str) -> bool:
        """Remove the blob; False if there was none."""
        ...

    def path_hint(self, sha256: str) -> Path | None:
        """A local file holding the blob, for readers that want a path (the compiler), or
        None when the store has no such file and the caller must spill (`local_path`)."""
        ...

    def quarantine(self, sha256: str, *, actual_sha256: str, size: int, found_by: str) -> None:
        """Move a blob whose bytes do not match its name out of the store (kept aside for
        inspection, recorded), so that it is never read again and a new `put` of the right
        bytes stores them afresh."""
        ...

    def list_blobs(self) -> Iterator[str]:
        """The sha256 of every stored blob (the scrub's work list)."""
        ...

    def check_writable(self) -> None:
        """Raise if the store cannot take a blob now (readiness)."""
        ...


def iter_chunks(data: Source, chunk_size: int = CHUNK_SIZE) -> Iterator[bytes]:
    """Chunks of a binary stream or of an iterable of bytes (empty chunks skipped)."""
    read = getattr(data, "read", None)
    if callable(read):
        while True:
            chunk = read(chunk_size)
            if not chunk:
                return
            yield bytes(chunk) if not isinstance(chunk, bytes) else chunk
    else:
        for chunk in data:  # type: ignore[union-attr]
            if chunk:
                yield bytes(chunk)


class HashingCounter:
    """sha256 and size of what passed through, enforcing an optional size limit."""

    def __init__(self, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self._hash = hashlib.sha256()

    def update(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.max_bytes is not None and self.size > self.max_bytes:
            raise BlobTooLarge(self.max_bytes)
        self._hash.update(chunk)

    def ref(self, created: bool = False) -> BlobRef:
        return BlobRef(self._hash.hexdigest(), self.size, created)


class BackgroundHashingCounter(HashingCounter):
    """A HashingCounter whose sha256 runs in a thread of its own from the second chunk on,
    so that hashing (~1.7 GB/s here) overlaps the caller's writes instead of adding to them;
    hashlib releases the GIL on large buffers. Size and limit are still checked at once, in
    the caller's thread. Use as a context manager: leaving it stops the thread."""

    QUEUED_CHUNKS = 8

    def __init__(self, max_bytes: int | None) -> None:
        super().__init__(max_bytes)
        self._chunks: queue.Queue[bytes | None] | None = None
        self._thread: threading.Thread | None = None

    def update(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.max_bytes is not None and self.size > self.max_bytes:
            raise BlobTooLarge(self.max_bytes)
        if self._chunks is None:
            if self.size == len(chunk):  # the first chunk: a small blob needs no thread
                self._hash.update(chunk)
                return
            self._chunks = queue.Queue(self.QUEUED_CHUNKS)
            self._thread = threading.Thread(target=self._run, name="blob-hash", daemon=True)
            self._thread.start()
        self._chunks.put(chunk)

    def _run(self) -> None:
        assert self._chunks is not None
        while (chunk := self._chunks.get()) is not None:
            self._hash.update(chunk)

    def _join(self) -> None:
        if self._chunks is not None and self._thread is not None:
            self._chunks.put(None)
            self._thread.join()
            self._chunks = self._thread = None

    def ref(self, created: bool = False) -> BlobRef:
        self._join()
        return super().ref(created)

    def __enter__(self) -> BackgroundHashingCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._join()


@dataclass(frozen=True)
class FileDigest:
    """A file's sha256 and size, and what identifies the file as it was when hashed (its
    inode and mtime: a link or a rename keeps both; a write changes the mtime)."""

    sha256: str
    size: int
    inode: int
    mtime_ns: int

    def matches(self, path: Path) -> bool:
        info = os.stat(path)
        return (info.st_ino, info.st_size, info.st_mtime_ns) == (
            self.inode,
            self.size,
            self.mtime_ns,
        )


def file_digest(path: Path) -> FileDigest:
    """Hash a finished file in one read while a thread fsyncs it (its bytes reach the disk
    while they are hashed)."""
    with open(path, "rb", 0) as src:
        info = os.fstat(src.fileno())
        digest = hashlib.sha256()
        size = 0
        with synced(src.fileno()):
            buffer = bytearray(CHUNK_SIZE)
            view = memoryview(buffer)
            while read := src.readinto(buffer):
                digest.update(view[:read])
                size += read
    return FileDigest(digest.hexdigest(), size, info.st_ino, info.st_mtime_ns)


@contextmanager
def synced(fd: int) -> Iterator[None]:
    """fsync `fd` in a thread while the block runs; its error, if any, raised at the end."""
    errors: list[OSError] = []

    def sync() -> None:
        try:
            os.fsync(fd)
        except OSError as exc:
            errors.append(exc)

    thread = threading.Thread(target=sync, name="blob-fsync", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()
    if errors:
        raise errors[0]


def check_sha256(sha256: str) -> str:
    """Reject anything but 64 lowercase hex digits (names become paths and keys)."""
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise BlobNotFound(sha256)
    return sha256


def check_range(start: int, length: int) -> None:
    if start < 0 or length < 0:
        raise ValueError(f"bad range: start {start}, length {length}")


def file_range(handle: BinaryIO, start: int, length: int) -> Iterator[bytes]:
    """Bytes [start, start + length) of an open file in chunks, clipped at its end; closes
    the file when done (a store's own files, a worker's cached copies)."""
    with handle:
        handle.seek(start)
        left = length
        while left > 0:
            chunk = handle.read(min(CHUNK_SIZE, left))
            if not chunk:
                return
            left -= len(chunk)
            yield chunk


def spill(store: BlobStore, sha256: str, dest: Path) -> Path:
    """Copy a blob into the file `dest`, streaming."""
    with store.open(sha256) as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out, CHUNK_SIZE)
    return dest


@contextmanager
def local_path(store: BlobStore, sha256: str, tmp_dir: Path, name: str = "blob") -> Iterator[Path]:
    """The store's own file for a blob, or a copy spilled into `tmp_dir` (removed after)."""
    hint = store.path_hint(sha256)
    if hint is not None:
        yield hint
        return
    dest = spill(store, sha256, tmp_dir / name)
    try:
        yield dest
    finally:
        dest.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    """Make a rename durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
