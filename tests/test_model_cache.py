"""A worker's local cache of models by sha256 (`worker.model_cache`), in front of the farm's
blob store (the database, or a filesystem volume shared with the API): a model is read from
the store once per worker, hashed before use until a hash of the unchanged file proved it
good, evicted least recently used first."""

from __future__ import annotations

import hashlib
import io
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.domain.blobs import BlobCorrupt, BlobStore
from app.domain.blobs.database import DatabaseBlobStore
from app.domain.blobs.filesystem import FilesystemBlobStore
from app.domain.blobs.integrity import verify_blob, verify_for_use
from app.domain.db.models import JobStatus
from app.domain.services import jobs, models
from compiler_core import CompileOptions
from tests.conftest import Farm, make_team, ready_database, tiny_model_bytes
from worker import model_cache
from worker.model_cache import ModelCache
from worker.runner import process_job


class CountingStore:
    """A store that counts the bytes read from it."""

    def __init__(self, store: BlobStore) -> None:
        self._store = store
        self.read = 0

    def read_range(self, sha256: str, start: int, length: int) -> Iterator[bytes]:
        for chunk in self._store.read_range(sha256, start, length):
            self.read += len(chunk)
            yield chunk

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.fixture
def database_store(tmp_path: Path) -> Iterator[DatabaseBlobStore]:
    with ready_database("postgresql", tmp_path) as db:
        yield DatabaseBlobStore(db.sessions)


def test_a_model_is_read_from_the_store_once_and_checked_on_every_use(
    database_store: DatabaseBlobStore, tmp_path: Path
) -> None:
    data = tiny_model_bytes()
    ref = database_store.put(io.BytesIO(data))
    counting = CountingStore(database_store)
    cached = ModelCache(tmp_path / "cache", 1 << 30).over(counting)  # type: ignore[arg-type]
    first = cached.path_hint(ref.sha256)
    assert first is not None and first.read_bytes() == data
    assert counting.read == len(data)
    second = cached.path_hint(ref.sha256)
    assert second == first
    assert verify_blob(cached, ref.sha256, found_by="compile") == len(data)
    assert counting.read == len(data)  # the second use and its check read the local copy


def test_a_damaged_cached_copy_is_dropped_and_the_stores_blob_kept(
    database_store: DatabaseBlobStore, tmp_path: Path
) -> None:
    data = tiny_model_bytes()
    ref = database_store.put(io.BytesIO(data))
    cache = ModelCache(tmp_path / "cache", 1 << 30)
    cached = cache.over(database_store)
    path = cached.path_hint(ref.sha256)
    assert path is not None
    path.write_bytes(b"\0" + data[1:])
    with pytest.raises(BlobCorrupt):
        verify_blob(cached, ref.sha256, found_by="compile")
    assert not path.exists()
    assert verify_blob(database_store, ref.sha256, found_by="compile") == len(data)
    assert cached.path_hint(ref.sha256) == path and path.read_bytes() == data  # filled again


def test_the_least_recently_used_models_beyond_the_limit_go_but_not_recent_ones(
    tmp_path: Path,
) -> None:
    cache = ModelCache(tmp_path / "cache", max_bytes=250)
    names = [hashlib.sha256(bytes([i])).hexdigest() for i in range(4)]
    long_ago = time.time() - 2 * model_cache.KEEP_RECENT_S
    for age, name in enumerate(names):
        cache.file(name).write_bytes(b"x" * 100)
        os.utime(cache.file(name), (long_ago + age, long_ago + age))
    cache.cached(names[0])  # used just now: the most recent
    assert cache.evict() == [names[1], names[2]]
    assert cache.models() == sorted([names[0], names[3]])
    cache.max_bytes = 0
    assert cache.evict() == [names[3]]  # the recently used one stays however full
    assert sorted(p.name for p in cache.root.iterdir()) == [
        model_cache.USED_PREFIX + names[0],
        names[0],
    ]  # an evicted model's use marker goes with it


def test_a_use_leaves_the_cached_files_times_as_its_check_saw_them(tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "cache", 1 << 30)
    name = hashlib.sha256(b"m").hexdigest()
    cache.file(name).write_bytes(b"m")
    before = os.stat(cache.file(name))
    assert cache.cached(name) == cache.file(name)
    after = os.stat(cache.file(name))
    assert (after.st_mtime_ns, after.st_ctime_ns) == (before.st_mtime_ns, before.st_ctime_ns)


def _settled(path: Path) -> None:
    """Wait until `path` last changed more than TRUST_AFTER_S ago (set small by the test)."""
    while time.time_ns() - os.stat(path).st_ctime_ns < model_cache.TRUST_AFTER_S * 1e9:
        time.sleep(0.01)


def test_a_cached_model_is_hashed_until_a_hash_of_the_settled_file_passed_then_trusted(
    database_store: DatabaseBlobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_cache, "TRUST_AFTER_S", 0.05)
    ref = database_store.put(io.BytesIO(tiny_model_bytes()))
    cache = ModelCache(tmp_path / "cache", 1 << 30)
    cached = cache.over(database_store)
    path = cached.path_hint(ref.sha256)
    assert path is not None
    verify_for_use(cached, ref.sha256, found_by="compile")
    assert not cache.trusted(ref.sha256)  # just written: a write in the same tick would hide
    _settled(path)
    verify_for_use(cached, ref.sha256, found_by="compile")
    assert cache.trusted(ref.sha256)
    cached.path_hint(ref.sha256)  # a use
    assert cache.trusted(ref.sha256)


@pytest.mark.parametrize("damage", ["same size", "appended", "replaced"])
def test_any_write_to_a_trusted_cached_model_is_caught_by_the_next_check(
    database_store: DatabaseBlobStore,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    damage: str,
) -> None:
    monkeypatch.setattr(model_cache, "TRUST_AFTER_S", 0.05)
    data = tiny_model_bytes()
    ref = database_store.put(io.BytesIO(data))
    cache = ModelCache(tmp_path / "cache", 1 << 30)
    cached = cache.over(database_store)
    path = cached.path_hint(ref.sha256)
    assert path is not None
    _settled(path)
    verify_for_use(cached, ref.sha256, found_by="compile")
    assert cache.trusted(ref.sha256)
    times = os.stat(path)
    if damage == "same size":
        path.write_bytes(b"\0" + data[1:])
        os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))  # even with its mtime back
    elif damage == "appended":
        with open(path, "ab") as out:
            out.write(b"\0")
    else:
        other = path.with_name(".other")
        other.write_bytes(b"\0" + data[1:])
        os.replace(other, path)
    assert not cache.trusted(ref.sha256)
    with pytest.raises(BlobCorrupt):
        verify_for_use(cached, ref.sha256, found_by="compile")
    assert not path.exists()
    assert verify_blob(database_store, ref.sha256, found_by="compile") == len(data)


def test_a_farm_worker_compiles_from_its_cache_and_the_job_succeeds(
    farm: Farm, tmp_path: Path
) -> None:
    if farm.mode != "farm":
        assert (
            model_cache.for_worker(farm.store, tmp_path, 1 << 30, server_database=False)
            is farm.store
        )
        return  # the embedded mode's store is this host's own files: no cache
    with farm.session() as session:
        team = make_team(session)
        model = models.store_model(
            session, farm.store, team, io.BytesIO(tiny_model_bytes()), "m.onnx",
            max_bytes=1 << 26,
        )  # fmt: skip
        job, _ = jobs.submit_job(session, team, model, CompileOptions.from_json({}))
        session.commit()
        sha256, job_id = model.sha256, job.id
    status = process_job(
        job_id, session_factory=farm.db.sessions, store=farm.store, worker_name="w",
        kind="compile", work_root=tmp_path,
    )  # fmt: skip
    assert status == JobStatus.succeeded
    assert (tmp_path / model_cache.FOLDER / sha256).is_file()


def test_a_farm_worker_caches_models_of_a_filesystem_store_shared_with_the_api(
    tmp_path: Path,
) -> None:
    with ready_database("postgresql", tmp_path) as db:
        store = FilesystemBlobStore(tmp_path / "shared" / "blobs")
        with db.sessions() as session:
            team = make_team(session)
            model = models.store_model(
                session, store, team, io.BytesIO(tiny_model_bytes()), "m.onnx",
                max_bytes=1 << 26,
            )  # fmt: skip
            job, _ = jobs.submit_job(session, team, model, CompileOptions.from_json({}))
            session.commit()
            sha256, job_id = model.sha256, job.id
        status = process_job(
            job_id, session_factory=db.sessions, store=store, worker_name="w",
            kind="compile", work_root=tmp_path / "work",
        )  # fmt: skip
        assert status == JobStatus.succeeded
        assert (tmp_path / "work" / model_cache.FOLDER / sha256).is_file()
