"""Blobs as 1 MiB rows of `blob_chunks` (the farm default): no shared disk between hosts.

An upload writes its chunks under a temporary key while hashing, then, in the same
transaction, either renames them to the sha256 and adds the `blobs` row, or drops them when
that content is already stored. A failed or oversize upload rolls back and leaves nothing.
Reads fetch one chunk per query, so memory stays at a chunk whatever the blob's size.
"""

from __future__ import annotations

import io
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, cast

from sqlalchemy import delete, insert, select, update
from sqlalchemy.orm import Session

from app.domain.blobs.base import (
    CHUNK_SIZE,
    BlobNotFound,
    BlobRef,
    BlobTooLarge,
    FileDigest,
    HashingCounter,
    Quarantined,
    QuarantineRecorder,
    Source,
    check_range,
    check_sha256,
    iter_chunks,
)
from app.domain.db.base import utcnow
from app.domain.db.models import Blob, BlobChunk
from app.domain.db.ops import insert_or_ignore, rowcount

BATCH_CHUNKS = 8
"""Chunk rows sent per statement (one round trip, pipelined by the driver): a 98 MiB QPC is
13 statements instead of 98; at most 8 MiB wait in memory."""


class DatabaseBlobStore:
    def __init__(
        self,
        session_factory: Callable[[], Session],
        on_quarantine: QuarantineRecorder | None = None,
    ) -> None:
        self._sessions = session_factory
        self._on_quarantine = on_quarantine

    def put(self, data: Source, *, max_bytes: int | None = None) -> BlobRef:
        with self._sessions() as probe:
            sqlite = probe.get_bind().dialect.name == "sqlite"
        if sqlite:
            with _spooled(data, max_bytes) as spooled:
                return self._put(spooled, max_bytes)
        return self._put(data, max_bytes)

    def put_file(
        self, path: Path, *, max_bytes: int | None = None, digest: FileDigest | None = None
    ) -> BlobRef:
        """`put` of the file's bytes (a `digest` saves nothing: the rows are written anyway)."""
        with open(path, "rb") as data:
            return self.put(data, max_bytes=max_bytes)

    def _put(self, data: Source, max_bytes: int | None) -> BlobRef:
        counter = HashingCounter(max_bytes)
        upload_key = f"tmp-{uuid.uuid4().hex}"
        with self._sessions() as session, session.begin():
            rows: list[dict[str, object]] = []
            for seq, chunk in enumerate(_exact_chunks(iter_chunks(data), CHUNK_SIZE)):
                counter.update(chunk)
                rows.append({"sha256": upload_key, "seq": seq, "data": chunk})
                if len(rows) == BATCH_CHUNKS:
                    session.execute(insert(BlobChunk), rows)
                    rows = []
            if rows:
                session.execute(insert(BlobChunk), rows)
            ref = counter.ref()
            row = {"sha256": ref.sha256, "size": ref.size, "created_at": utcnow()}
            chunks = BlobChunk.sha256 == upload_key
            created = insert_or_ignore(session, Blob, row, ["sha256"])
            if created:
                session.execute(update(BlobChunk).where(chunks).values(sha256=ref.sha256))
            else:
                session.execute(delete(BlobChunk).where(chunks))
        return BlobRef(ref.sha256, ref.size, bool(created))

    def open(self, sha256: str) -> BinaryIO:
        raw = _ChunkReader(self._sessions, sha256, self.size(sha256))
        return cast(BinaryIO, io.BufferedReader(raw, buffer_size=CHUNK_SIZE))

    def read_range(self, sha256: str, start: int, length: int) -> Iterator[bytes]:
        check_range(start, length)
        end = min(start + length, self.size(sha256))
        return self._range(sha256, start, end)

    def _range(self, sha256: str, start: int, end: int) -> Iterator[bytes]:
        pos = start
        while pos < end:
            seq, offset = divmod(pos, CHUNK_SIZE)
            chunk = self._chunk(sha256, seq)
            piece = chunk[offset : offset + (end - pos)]
            pos += len(piece)
            yield piece

    def _chunk(self, sha256: str, seq: int) -> bytes:
        with self._sessions() as session:
            data = session.execute(
                select(BlobChunk.data).where(BlobChunk.sha256 == sha256, BlobChunk.seq == seq)
            ).scalar_one_or_none()
        if data is None:
            raise BlobNotFound(sha256)
        return data

    def exists(self, sha256: str) -> bool:
        try:
            self.size(sha256)
        except BlobNotFound:
            return False
        return True

    def size(self, sha256: str) -> int:
        check_sha256(sha256)
        with self._sessions() as session:
            size = session.execute(
                select(Blob.size).where(Blob.sha256 == sha256)
            ).scalar_one_or_none()
        if size is None:
            raise BlobNotFound(sha256)
        return size

    def delete(self, sha256: str) -> bool:
        with self._sessions() as session, session.begin():
            found = rowcount(session.execute(delete(Blob).where(Blob.sha256 == sha256)))
            session.execute(delete(BlobChunk).where(BlobChunk.sha256 == sha256))
        return bool(found)

    def path_hint(self, sha256: str) -> Path | None:
        return None

    def quarantine(self, sha256: str, *, actual_sha256: str, size: int, found_by: str) -> None:
        """The chunks move under a key of their own (`q-<hex>`), the `blobs` row goes."""
        location = f"q-{uuid.uuid4().hex}"
        with self._sessions() as session, session.begin():
            gone = rowcount(session.execute(delete(Blob).where(Blob.sha256 == sha256)))
            if not gone:
                return  # another reader moved it first
            session.execute(
                update(BlobChunk).where(BlobChunk.sha256 == sha256).values(sha256=location)
            )
        if self._on_quarantine is not None:
            self._on_quarantine(Quarantined(sha256, actual_sha256, size, found_by, location))

    def list_blobs(self) -> Iterator[str]:
        with self._sessions() as session:
            names = list(session.execute(select(Blob.sha256).order_by(Blob.sha256)).scalars())
        yield from names

    def check_writable(self) -> None:
        with self._sessions() as session:
            session.execute(select(Blob.sha256).limit(1)).all()


@contextmanager
def _spooled(data: Source, max_bytes: int | None) -> Iterator[BinaryIO]:
    """The stream copied to a temporary file first (refused as soon as it passes
    `max_bytes`). On SQLite a write transaction holds the one writer slot of the database,
    so it must not stay open while an upload trickles in from the network."""
    with tempfile.TemporaryFile(prefix="qpcfarm-blob-") as spool:
        size = 0
        for chunk in iter_chunks(data):
            size += len(chunk)
            if max_bytes is not None and size > max_bytes:
                raise BlobTooLarge(max_bytes)
            spool.write(chunk)
        spool.seek(0)
        yield cast(BinaryIO, spool)


def _exact_chunks(chunks: Iterable[bytes], size: int) -> Iterator[bytes]:
    """Re-cut a stream into pieces of exactly `size` bytes (the last may be shorter), so the
    chunk holding byte N is always row N // size."""
    buffer = bytearray()
    for chunk in chunks:
        if not buffer and len(chunk) == size:
            yield chunk
            continue
        buffer += chunk
        while len(buffer) >= size:
            yield bytes(buffer[:size])
            del buffer[:size]
    if buffer:
        yield bytes(buffer)


class _ChunkReader(io.RawIOBase):
    """A seekable raw stream over a blob's chunk rows, holding one chunk at a time."""

    def __init__(self, sessions: Callable[[], Session], sha256: str, size: int) -> None:
        self._sessions = sessions
        self._sha256 = sha256
        self._size = size
        self._pos = 0
        self._seq = -1
        self._chunk = b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        if self._pos >= self._size:
            return 0
        seq, offset = divmod(self._pos, CHUNK_SIZE)
        if seq != self._seq:
            with self._sessions() as session:
                data = session.execute(
                    select(BlobChunk.data).where(
                        BlobChunk.sha256 == self._sha256, BlobChunk.seq == seq
                    )
                ).scalar_one_or_none()
            if data is None:
                raise BlobNotFound(self._sha256)
            self._seq, self._chunk = seq, data
        n = min(len(buffer), len(self._chunk) - offset)
        buffer[:n] = self._chunk[offset : offset + n]
        self._pos += n
        return n
