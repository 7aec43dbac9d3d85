"""Blobs as files `<root>/ab/cdef...` (the embedded default): the compiler reads them in place.

A blob found corrupt is moved to `<root>/quarantine/<sha256>.<utc time>` (never read again,
kept for inspection); a `put` of content already stored replaces the file with the bytes it
just wrote and hashed, so storing good bytes again also repairs a damaged copy no reader has
caught yet.
"""

from __future__ import annotations

import datetime as dt
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from app.domain.blobs.base import (
    BackgroundHashingCounter,
    BlobNotFound,
    BlobRef,
    BlobTooLarge,
    FileDigest,
    Quarantined,
    QuarantineRecorder,
    Source,
    check_range,
    check_sha256,
    file_digest,
    file_range,
    fsync_dir,
    iter_chunks,
)

FILE_MODE = 0o600
DIR_MODE = 0o700
"""Blobs are a team's models and QPCs: readable by the farm's own user only (the umask can
only narrow these)."""


class FilesystemBlobStore:
    """Writes go to `<root>/tmp/` while hashing, then are renamed into place atomically, so a
    reader never sees a partial blob and a crash leaves only a temp file."""

    def __init__(
        self, root: str | os.PathLike[str], on_quarantine: QuarantineRecorder | None = None
    ) -> None:
        self.root = Path(root)
        self._tmp = self.root / "tmp"
        self.root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        self._tmp.mkdir(mode=DIR_MODE, exist_ok=True)
        self._quarantine_dir = self.root / "quarantine"
        self._on_quarantine = on_quarantine

    def _path(self, sha256: str) -> Path:
        check_sha256(sha256)
        return self.root / sha256[:2] / sha256[2:]

    def put(self, data: Source, *, max_bytes: int | None = None) -> BlobRef:
        tmp = self._tmp / f"{uuid.uuid4().hex}.part"
        try:
            # Unbuffered: chunks are large, so a buffer would only add a copy.
            with (
                BackgroundHashingCounter(max_bytes) as counter,
                open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "wb", 0) as out,
            ):
                for chunk in iter_chunks(data):
                    counter.update(chunk)
                    _write_all(out, chunk)
                os.fsync(out.fileno())  # once, at the end
                ref = counter.ref()
            final = self._path(ref.sha256)
            final.parent.mkdir(mode=DIR_MODE, exist_ok=True)
            created = not final.exists()
            os.replace(tmp, final)  # over a stored copy too: these bytes are known good
            fsync_dir(final.parent)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return BlobRef(ref.sha256, ref.size, created)

    def put_file(
        self, path: Path, *, max_bytes: int | None = None, digest: FileDigest | None = None
    ) -> BlobRef:
        """A file on the store's file system is linked in, not copied: hashed in one read
        while the disk takes its bytes (`file_digest`; or its `digest` taken earlier, when the
        link is still that file unchanged), then the link is renamed into place. A file
        elsewhere is `put` (copied while hashed, one pass)."""
        tmp = self._tmp / f"{uuid.uuid4().hex}.part"
        try:
            os.link(path, tmp)
        except OSError:  # another file system (EXDEV), or one without hard links
            with open(path, "rb") as data:
                return self.put(data, max_bytes=max_bytes)
        try:
            if digest is None or not digest.matches(tmp):
                digest = file_digest(tmp)
            if max_bytes is not None and digest.size > max_bytes:
                raise BlobTooLarge(max_bytes)
            os.chmod(tmp, FILE_MODE)
            final = self._path(digest.sha256)
            final.parent.mkdir(mode=DIR_MODE, exist_ok=True)
            created = not final.exists()
            os.replace(tmp, final)  # a no-op when both name this inode already (put twice)
            fsync_dir(final.parent)
        finally:
            tmp.unlink(missing_ok=True)
        return BlobRef(digest.sha256, digest.size, created)

    def open(self, sha256: str) -> BinaryIO:
        try:
            return open(self._path(sha256), "rb")
        except FileNotFoundError:
            raise BlobNotFound(sha256) from None

    def read_range(self, sha256: str, start: int, length: int) -> Iterator[bytes]:
        check_range(start, length)
        handle = self.open(sha256)  # opened now, so a missing blob raises before iteration
        return file_range(handle, start, length)

    def exists(self, sha256: str) -> bool:
        try:
            return self._path(sha256).is_file()
        except BlobNotFound:
            return False

    def size(self, sha256: str) -> int:
        try:
            return self._path(sha256).stat().st_size
        except FileNotFoundError:
            raise BlobNotFound(sha256) from None

    def delete(self, sha256: str) -> bool:
        try:
            self._path(sha256).unlink()
        except (FileNotFoundError, BlobNotFound):
            return False
        return True

    def path_hint(self, sha256: str) -> Path | None:
        path = self._path(sha256)
        if not path.is_file():
            raise BlobNotFound(sha256)
        return path

    def quarantine(self, sha256: str, *, actual_sha256: str, size: int, found_by: str) -> None:
        self._quarantine_dir.mkdir(mode=DIR_MODE, exist_ok=True)
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
        target = self._quarantine_dir / f"{sha256}.{stamp}"
        try:
            os.replace(self._path(sha256), target)
        except FileNotFoundError:
            return  # another reader moved it first
        event = Quarantined(
            sha256, actual_sha256, size, found_by, str(target.relative_to(self.root))
        )
        if self._on_quarantine is not None:
            self._on_quarantine(event)

    def list_blobs(self) -> Iterator[str]:
        for folder in sorted(self.root.iterdir()):
            if len(folder.name) != 2 or not folder.is_dir():
                continue
            for path in sorted(folder.iterdir()):
                name = folder.name + path.name
                if len(name) == 64 and path.is_file():
                    yield name

    def check_writable(self) -> None:
        probe = self._tmp / f"ready-{uuid.uuid4().hex}"
        try:
            with open(probe, "wb", 0) as out:
                out.write(b"ok")
                os.fsync(out.fileno())
        finally:
            probe.unlink(missing_ok=True)


def _write_all(out: BinaryIO, chunk: bytes) -> None:
    """An unbuffered file may write less than asked; write the rest."""
    view = memoryview(chunk)
    while view:
        written = out.write(view)
        view = view[written or 0 :]
