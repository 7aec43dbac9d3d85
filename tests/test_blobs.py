"""The blob stores: content-addressed, idempotent, streamed both ways, nothing left on failure.

Every test runs on the filesystem store and on the database store (SQLite and PostgreSQL).
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import sessionmaker

from app.domain.blobs import BlobNotFound, BlobRef, BlobStore, BlobTooLarge, local_path
from app.domain.blobs.base import CHUNK_SIZE
from app.domain.blobs.database import DatabaseBlobStore
from app.domain.blobs.factory import blob_store_from_settings
from app.domain.blobs.filesystem import FilesystemBlobStore
from app.domain.db.models import Blob, BlobChunk
from app.domain.settings import Settings

MiB = 1 << 20


def stored_bytes(store: BlobStore) -> int:
    """Everything the store holds, temporary leftovers included."""
    if isinstance(store, FilesystemBlobStore):
        return sum(p.stat().st_size for p in store.root.rglob("*") if p.is_file())
    assert isinstance(store, DatabaseBlobStore)
    with store._sessions() as session:
        chunks = session.execute(select(func.coalesce(func.sum(func.length(BlobChunk.data)), 0)))
        return int(chunks.scalar_one())


def blob_rows(store: BlobStore) -> int:
    if isinstance(store, FilesystemBlobStore):
        return sum(1 for p in store.root.rglob("*") if p.is_file())
    assert isinstance(store, DatabaseBlobStore)
    with store._sessions() as session:
        return int(session.execute(select(func.count()).select_from(Blob)).scalar_one())


def read_all(store: BlobStore, sha256: str) -> bytes:
    with store.open(sha256) as handle:
        return handle.read()


def pieces(data: bytes, size: int) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


SAMPLE = os.urandom(2 * CHUNK_SIZE + 12345)


def test_put_names_the_blob_by_sha256_and_reads_it_back(blob_store: BlobStore) -> None:
    ref = blob_store.put(io.BytesIO(SAMPLE))
    assert ref == BlobRef(hashlib.sha256(SAMPLE).hexdigest(), len(SAMPLE))
    assert blob_store.exists(ref.sha256)
    assert blob_store.size(ref.sha256) == len(SAMPLE)
    assert read_all(blob_store, ref.sha256) == SAMPLE


def test_put_accepts_an_iterable_of_odd_sized_chunks(blob_store: BlobStore) -> None:
    ref = blob_store.put(pieces(SAMPLE, 77_777))
    assert ref.sha256 == hashlib.sha256(SAMPLE).hexdigest()
    assert read_all(blob_store, ref.sha256) == SAMPLE


def test_the_same_content_twice_is_stored_once(blob_store: BlobStore) -> None:
    first = blob_store.put(io.BytesIO(SAMPLE))
    second = blob_store.put(pieces(SAMPLE, 4096))
    assert first == second
    assert blob_rows(blob_store) == 1
    assert stored_bytes(blob_store) == len(SAMPLE)


def test_an_empty_blob_is_a_blob(blob_store: BlobStore) -> None:
    ref = blob_store.put(io.BytesIO(b""))
    assert ref == BlobRef(hashlib.sha256(b"").hexdigest(), 0)
    assert blob_store.exists(ref.sha256)
    assert read_all(blob_store, ref.sha256) == b""


def test_an_oversize_upload_raises_and_leaves_nothing_behind(blob_store: BlobStore) -> None:
    with pytest.raises(BlobTooLarge) as raised:
        blob_store.put(pieces(SAMPLE, 100_000), max_bytes=len(SAMPLE) - 1)
    assert raised.value.max_bytes == len(SAMPLE) - 1
    assert not blob_store.exists(hashlib.sha256(SAMPLE).hexdigest())
    assert stored_bytes(blob_store) == 0


def test_an_oversize_upload_stops_reading_once_past_the_limit(blob_store: BlobStore) -> None:
    consumed = []

    def endless() -> Iterator[bytes]:
        while True:
            consumed.append(MiB)
            yield b"x" * MiB

    with pytest.raises(BlobTooLarge):
        blob_store.put(endless(), max_bytes=3 * MiB)
    assert len(consumed) == 4
    assert stored_bytes(blob_store) == 0


def test_an_upload_of_exactly_the_limit_is_accepted(blob_store: BlobStore) -> None:
    ref = blob_store.put(io.BytesIO(SAMPLE), max_bytes=len(SAMPLE))
    assert ref.size == len(SAMPLE)


def test_a_failing_source_leaves_nothing_behind(blob_store: BlobStore) -> None:
    def broken() -> Iterator[bytes]:
        yield SAMPLE[:CHUNK_SIZE]
        yield SAMPLE[CHUNK_SIZE : CHUNK_SIZE + 10]
        raise ConnectionError("client went away")

    with pytest.raises(ConnectionError):
        blob_store.put(broken())
    assert stored_bytes(blob_store) == 0


def test_put_file_stores_a_files_bytes_and_leaves_the_file_as_it_was(
    blob_store: BlobStore, tmp_path: Path
) -> None:
    source = tmp_path / "work" / "programqpc.bin"
    source.parent.mkdir()
    source.write_bytes(SAMPLE)
    ref = blob_store.put_file(source)
    assert (ref.sha256, ref.size, ref.created) == (
        hashlib.sha256(SAMPLE).hexdigest(),
        len(SAMPLE),
        True,
    )
    assert source.read_bytes() == SAMPLE
    assert blob_store.put_file(source).created is False
    source.unlink()  # the job folder goes
    assert read_all(blob_store, ref.sha256) == SAMPLE
    assert blob_rows(blob_store) == 1


def test_put_file_of_an_oversize_file_raises_and_leaves_nothing_behind(
    blob_store: BlobStore, tmp_path: Path
) -> None:
    source = tmp_path / "big.bin"
    source.write_bytes(SAMPLE)
    with pytest.raises(BlobTooLarge):
        blob_store.put_file(source, max_bytes=len(SAMPLE) - 1)
    assert stored_bytes(blob_store) == 0
    assert source.read_bytes() == SAMPLE


def test_a_file_on_the_stores_file_system_is_linked_in_not_copied(tmp_path: Path) -> None:
    store = FilesystemBlobStore(tmp_path / "blobs")
    source = tmp_path / "programqpc.bin"
    source.write_bytes(SAMPLE)
    os.chmod(source, 0o644)
    ref = store.put_file(source)
    stored = store.root / ref.sha256[:2] / ref.sha256[2:]
    assert stored.stat().st_ino == source.stat().st_ino
    assert stored.stat().st_mode & 0o777 == 0o600  # the store's own mode, whoever wrote it
    source.unlink()
    assert stored.stat().st_nlink == 1 and stored.read_bytes() == SAMPLE
    assert sorted(p.name for p in (store.root / "tmp").iterdir()) == []


def test_put_file_trusts_a_digest_only_of_the_same_unchanged_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.domain.blobs import filesystem
    from app.domain.blobs.base import file_digest

    store = FilesystemBlobStore(tmp_path / "blobs")
    source = tmp_path / "programqpc.bin"
    source.write_bytes(SAMPLE)
    early = file_digest(source)
    assert (early.sha256, early.size) == (hashlib.sha256(SAMPLE).hexdigest(), len(SAMPLE))
    hashed: list[Path] = []
    monkeypatch.setattr(filesystem, "file_digest", lambda p: hashed.append(p) or file_digest(p))
    assert store.put_file(source, digest=early).sha256 == early.sha256
    assert hashed == []  # the digest taken while the compiler went on: no second read

    changed = b"\0" + SAMPLE[1:]
    with open(source, "r+b") as out:  # the same inode and size, written again
        out.write(changed[:1])
    os.utime(source, ns=(early.mtime_ns + 1, early.mtime_ns + 1))
    ref = store.put_file(source, digest=early)
    assert len(hashed) == 1 and ref.sha256 == hashlib.sha256(changed).hexdigest()
    other = tmp_path / "other.bin"
    other.write_bytes(SAMPLE)
    assert not early.matches(other)  # another inode with the same bytes is hashed anew


def test_a_file_on_another_file_system_is_copied_while_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FilesystemBlobStore(tmp_path / "blobs")
    source = tmp_path / "programqpc.bin"
    source.write_bytes(SAMPLE)

    def cross_device(src: object, dst: object) -> None:
        raise OSError(18, "Invalid cross-device link")  # EXDEV

    monkeypatch.setattr(os, "link", cross_device)
    ref = store.put_file(source)
    stored = store.root / ref.sha256[:2] / ref.sha256[2:]
    assert stored.stat().st_ino != source.stat().st_ino
    assert stored.read_bytes() == SAMPLE and ref.sha256 == hashlib.sha256(SAMPLE).hexdigest()


@pytest.mark.parametrize(
    ("start", "length"),
    [
        (0, 10),
        (CHUNK_SIZE - 5, 10),  # across a chunk boundary
        (CHUNK_SIZE, CHUNK_SIZE),  # exactly one chunk
        (100, 2 * CHUNK_SIZE),  # three chunks
        (len(SAMPLE) - 3, 100),  # clipped at the end
        (len(SAMPLE), 10),  # past the end: nothing
        (5, 0),
    ],
)
def test_read_range_returns_exactly_the_requested_bytes(
    blob_store: BlobStore, start: int, length: int
) -> None:
    ref = blob_store.put(io.BytesIO(SAMPLE))
    got = b"".join(blob_store.read_range(ref.sha256, start, length))
    assert got == SAMPLE[start : start + length]


def test_an_open_blob_is_seekable(blob_store: BlobStore) -> None:
    ref = blob_store.put(io.BytesIO(SAMPLE))
    with blob_store.open(ref.sha256) as handle:
        assert handle.seekable()
        handle.seek(CHUNK_SIZE + 7)
        assert handle.read(20) == SAMPLE[CHUNK_SIZE + 7 : CHUNK_SIZE + 27]
        handle.seek(-5, io.SEEK_END)
        assert handle.read() == SAMPLE[-5:]
        assert handle.tell() == len(SAMPLE)


def test_a_missing_blob_is_reported_as_such(blob_store: BlobStore) -> None:
    missing = hashlib.sha256(b"never stored").hexdigest()
    assert not blob_store.exists(missing)
    assert not blob_store.delete(missing)
    with pytest.raises(BlobNotFound):
        blob_store.open(missing)
    with pytest.raises(BlobNotFound):
        blob_store.size(missing)
    with pytest.raises(BlobNotFound):
        list(blob_store.read_range(missing, 0, 10))


def test_a_name_that_is_not_a_sha256_is_never_found(blob_store: BlobStore) -> None:
    assert not blob_store.exists("../../etc/passwd")
    with pytest.raises(BlobNotFound):
        blob_store.open("../" + "a" * 61)


def test_delete_removes_the_blob(blob_store: BlobStore) -> None:
    ref = blob_store.put(io.BytesIO(SAMPLE))
    assert blob_store.delete(ref.sha256)
    assert not blob_store.exists(ref.sha256)
    assert stored_bytes(blob_store) == 0


def test_local_path_gives_a_file_with_the_blobs_bytes(
    blob_store: BlobStore, tmp_path: Path
) -> None:
    ref = blob_store.put(io.BytesIO(SAMPLE))
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    with local_path(blob_store, ref.sha256, spill_dir) as path:
        assert path.read_bytes() == SAMPLE
    assert list(spill_dir.iterdir()) == []  # a spilled copy is removed afterwards


def test_only_the_filesystem_store_has_a_path_hint(blob_store: BlobStore) -> None:
    ref = blob_store.put(io.BytesIO(SAMPLE))
    hint = blob_store.path_hint(ref.sha256)
    if isinstance(blob_store, FilesystemBlobStore):
        assert hint is not None and hint.read_bytes() == SAMPLE
        assert hint.parent.name == ref.sha256[:2]
    else:
        assert hint is None


def test_a_200_mb_blob_streams_in_and_out_in_bounded_memory(blob_store: BlobStore) -> None:
    total = 200 * MiB
    block = os.urandom(MiB)
    process = psutil.Process()
    baseline = process.memory_info().rss
    peak = baseline
    digest = hashlib.sha256()

    def source() -> Iterator[bytes]:
        nonlocal peak
        for i in range(total // MiB):
            chunk = i.to_bytes(8, "little") + block[8:]  # every chunk differs
            digest.update(chunk)
            peak = max(peak, process.memory_info().rss)
            yield chunk

    ref = blob_store.put(source())
    assert ref == BlobRef(digest.hexdigest(), total)

    readback = hashlib.sha256()
    with blob_store.open(ref.sha256) as handle:
        while chunk := handle.read(MiB):
            readback.update(chunk)
            peak = max(peak, process.memory_info().rss)
    assert readback.hexdigest() == ref.sha256
    assert peak - baseline < 40 * MiB


def test_settings_pick_the_filesystem_store_for_sqlite_and_the_database_store_otherwise(
    tmp_path: Path,
) -> None:
    sessions = sessionmaker()  # unbound: the factory only hands it to the database store
    embedded = Settings(data_dir=tmp_path)
    assert embedded.blob_store == "filesystem"
    store = blob_store_from_settings(embedded, sessions)
    assert isinstance(store, FilesystemBlobStore) and store.root == tmp_path / "blobs"

    farm = Settings(data_dir=tmp_path, database_url="postgresql+psycopg://db/qpcfarm")
    assert farm.blob_store == "database"
    assert isinstance(blob_store_from_settings(farm, sessions), DatabaseBlobStore)


# ------------------------------------------------------------------------------ integrity


def test_a_corrupt_blob_is_never_read_whole_and_is_quarantined_by_its_first_reader(
    blob_store: BlobStore,
) -> None:
    from app.domain.blobs import BlobCorrupt
    from app.domain.blobs.integrity import verified_range
    from tests.conftest import corrupt_blob

    data = os.urandom(3 * CHUNK_SIZE + 5)
    ref = blob_store.put(io.BytesIO(data))
    corrupt_blob(blob_store, ref.sha256, offset=-2)

    pieces: list[bytes] = []
    with pytest.raises(BlobCorrupt):
        for piece in verified_range(blob_store, ref.sha256, 0, ref.size, found_by="test"):
            pieces.append(piece)
    assert 0 < len(b"".join(pieces)) < ref.size  # the last piece was held back
    assert not blob_store.exists(ref.sha256)
    assert ref.sha256 not in list(blob_store.list_blobs())

    assert blob_store.put(io.BytesIO(data)) == ref  # good bytes again: stored afresh
    whole = b"".join(verified_range(blob_store, ref.sha256, 0, ref.size, found_by="test"))
    assert whole == data


def test_a_checked_range_is_exactly_the_bytes_asked_for(blob_store: BlobStore) -> None:
    from app.domain.blobs.integrity import verified_range

    data = os.urandom(2 * CHUNK_SIZE + 100)
    ref = blob_store.put(io.BytesIO(data))
    for start, length in ((0, 10), (CHUNK_SIZE - 3, 7), (5, 2 * CHUNK_SIZE), (len(data) - 4, 99)):
        got = b"".join(verified_range(blob_store, ref.sha256, start, length, found_by="test"))
        assert got == data[start : start + length]


def test_storing_known_content_again_repairs_an_undetected_damaged_file(tmp_path: Path) -> None:
    from app.domain.blobs.integrity import verify_blob
    from tests.conftest import corrupt_blob

    store = FilesystemBlobStore(tmp_path / "blobs")
    ref = store.put(io.BytesIO(b"qpc bytes" * 1000))
    corrupt_blob(store, ref.sha256)
    store.put(io.BytesIO(b"qpc bytes" * 1000))
    assert verify_blob(store, ref.sha256, found_by="test") == ref.size


def test_the_store_reports_each_quarantined_blob_once_with_where_it_went(
    tmp_path: Path,
) -> None:
    from app.domain.blobs import BlobCorrupt
    from app.domain.blobs.base import Quarantined
    from app.domain.blobs.integrity import verify_blob
    from tests.conftest import corrupt_blob

    events: list[Quarantined] = []
    store = FilesystemBlobStore(tmp_path / "blobs", on_quarantine=events.append)
    ref = store.put(io.BytesIO(b"x" * 100))
    corrupt_blob(store, ref.sha256, offset=0)
    with pytest.raises(BlobCorrupt):
        verify_blob(store, ref.sha256, found_by="scrub")
    store.quarantine(ref.sha256, actual_sha256="0" * 64, size=100, found_by="again")  # gone
    assert [(e.sha256, e.found_by, e.size) for e in events] == [(ref.sha256, "scrub", 100)]
    assert (store.root / events[0].location).read_bytes() == bytes([ord("x") ^ 0xFF]) + b"x" * 99
