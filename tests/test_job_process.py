"""The embedded mode's jobs in child processes (`worker.job_process`), and the file lock that
lets SQLite writers of several processes take turns (`app.domain.db.session.WriterLock`).

The API process of the embedded mode keeps no job work: a job is claimed, compiled, stored
and finished by a child that opened the same database and blob store again; a child that dies
mid-job fails that job at once and is replaced, and the next job runs.
"""

from __future__ import annotations

import datetime as dt
import io
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy.orm import Session, sessionmaker

from app.domain.blobs import BlobStore
from app.domain.blobs.database import DatabaseBlobStore
from app.domain.blobs.filesystem import FilesystemBlobStore
from app.domain.db.base import utcnow
from app.domain.db.models import CompileJob, JobStatus
from app.domain.db.session import WriterLock, make_engine, make_session_factory
from app.domain.services import jobs, models
from app.domain.settings import Settings
from compiler_core import CompileOptions
from tests.api_helpers import postgres_schema_url
from tests.conftest import make_team, tiny_model_bytes
from tests.test_worker import wait_for
from worker import compile_jobs, fair_share
from worker.job_process import JobProcess, config_for
from worker.queues import queue_from_settings

OPTIONS = CompileOptions.from_json({"aic-num-cores": 2})
USED_OPTIONS = CompileOptions.from_json({"aic-num-cores": 16})
"""A past compile's options (another cache key than OPTIONS')."""


@dataclass
class Embedded:
    settings: Settings
    sessions: sessionmaker[Session]
    store: BlobStore

    def reload(self, job_id: uuid.UUID) -> CompileJob:
        with self.sessions() as session:
            job = session.get(CompileJob, job_id)
            assert job is not None
            return job

    def queued_job(self, scale: float) -> CompileJob:
        with self.sessions() as session:
            team = make_team(session)
            model = models.store_model(
                session, self.store, team, io.BytesIO(tiny_model_bytes(scale)), "m.onnx",
                max_bytes=1 << 26,
            )  # fmt: skip
            job, created = jobs.submit_job(session, team, model, OPTIONS)
            session.commit()
            assert created and job.status == JobStatus.queued
            return job


@contextmanager
def _url(kind: str, tmp_path: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'qpcfarm.db'}"
    else:
        with postgres_schema_url() as url:
            yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def embedded(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Embedded]:
    """A farm whose database a child can open again from its URL (the embedded mode's, or
    an embedded worker on PostgreSQL with the database blob store)."""
    from app.domain.db import models as tables  # noqa: F401 - registers the tables
    from app.domain.db.base import Base

    with _url(request.param, tmp_path) as url:
        engine = make_engine(url)
        Base.metadata.create_all(engine)
        sessions = make_session_factory(engine)
        store: BlobStore = (
            FilesystemBlobStore(tmp_path / "blobs")
            if request.param == "sqlite"
            else DatabaseBlobStore(sessions)
        )
        try:
            yield Embedded(Settings(data_dir=tmp_path, database_url=url), sessions, store)
        finally:
            engine.dispose()


def test_the_embedded_queue_runs_jobs_in_child_processes(embedded: Embedded) -> None:
    queue = queue_from_settings(embedded.settings, embedded.sessions, embedded.store)
    try:
        assert getattr(queue, "isolated", False)
        ids = [embedded.queued_job(0.1 * (i + 1)).id for i in range(2)]
        for job_id in ids:
            queue.enqueue(job_id)
        wait_for(lambda: all(embedded.reload(i).status == JobStatus.succeeded for i in ids), "jobs")
    finally:
        queue.close()
    for job_id in ids:
        job = embedded.reload(job_id)
        # The worker name is the API process's thread; the work was done by its child.
        assert job.qpc_id is not None and job.worker and f":{os.getpid()}:inproc-" in job.worker


@pytest.mark.parametrize("in_children", [True, False], ids=["job-process", "threads"])
def test_the_embedded_queue_orders_compiles_over_the_farms_fair_share_window(
    embedded: Embedded, in_children: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look-back is the setting `fair_share_window_s`: team A held a worker for a minute
    20 minutes ago, team B for 10 s just now. Over the last hour A used more, so B's compile
    runs first though A's is older (over the default 10 minutes A used nothing: A first)."""
    import worker.job_process

    if not in_children:  # as with an in-memory database: jobs run in the queue's threads
        monkeypatch.setattr(worker.job_process, "config_for", lambda *_args: None)
    settings = Settings(
        data_dir=embedded.settings.data_dir,
        database_url=embedded.settings.database_url,
        fair_share_window_s=3600.0,
        worker_concurrency=1,
    )
    now = utcnow()
    with embedded.sessions() as session:
        queued = []
        for name, used_s, ended_s_ago in (("a", 60, 1200), ("b", 10, 0)):
            team = make_team(session, f"{name}-{uuid.uuid4().hex[:6]}")
            model = models.store_model(
                session, embedded.store, team, io.BytesIO(tiny_model_bytes(0.2)), "m.onnx",
                max_bytes=1 << 26,
            )  # fmt: skip
            used, _ = jobs.submit_job(session, team, model, USED_OPTIONS)
            used.status = JobStatus.succeeded
            used.finished_at = now - dt.timedelta(seconds=ended_s_ago)
            used.started_at = used.finished_at - dt.timedelta(seconds=used_s)
            job, _ = jobs.submit_job(session, team, model, OPTIONS)
            queued.append(job.id)
            session.commit()
    assert fair_share.WINDOW_S < 1200 < settings.fair_share_window_s

    queue = queue_from_settings(settings, embedded.sessions, embedded.store)
    try:
        assert getattr(queue, "isolated", None) is in_children
        wait_for(
            lambda: all(embedded.reload(i).status == JobStatus.succeeded for i in queued),
            "both compiles",
        )
    finally:
        queue.close()
    a_job, b_job = (embedded.reload(i) for i in queued)
    assert a_job.started_at is not None and b_job.started_at is not None
    assert b_job.started_at < a_job.started_at


def test_an_in_memory_database_keeps_jobs_in_the_threads(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, database_url="sqlite:///:memory:")
    assert config_for(settings, FilesystemBlobStore(tmp_path / "blobs")) is None


def test_a_child_that_dies_mid_job_fails_that_job_and_the_next_job_runs(
    embedded: Embedded,
) -> None:
    config = config_for(embedded.settings, embedded.store)
    assert config is not None
    child = JobProcess(config, embedded.sessions).start()
    try:
        held = embedded.queued_job(0.3)
        worker = f"test:{os.getpid()}:inproc-0"
        with embedded.sessions() as session:  # the child's claim, as it would have written it
            assert compile_jobs.claim(session, held.id, worker)
        assert child.pid is not None
        os.kill(child.pid, signal.SIGSTOP)  # it will never answer: it dies holding the job
        outcome: list[str | None] = []

        def relay_job() -> None:
            outcome.append(child.run("compile", held.id, worker))

        relay = threading.Thread(target=relay_job)
        relay.start()
        os.kill(child.pid, signal.SIGKILL)
        relay.join()

        assert outcome == ["failed"]
        failed = embedded.reload(held.id)
        assert failed.status == JobStatus.failed and failed.error_code == "compiler_crashed"
        assert "died" in (failed.error_message or "")

        after = embedded.queued_job(0.4)
        assert child.run("compile", after.id, worker) == "succeeded"  # a new child ran it
        assert embedded.reload(after.id).qpc_id is not None
    finally:
        child.close()


def test_a_crash_leaves_a_job_of_another_worker_alone(embedded: Embedded) -> None:
    """The failure is conditional on the job still being the dead child's: a job another
    worker re-took meanwhile keeps running."""
    config = config_for(embedded.settings, embedded.store)
    assert config is not None
    child = JobProcess(config, embedded.sessions).start()
    try:
        job = embedded.queued_job(0.5)
        with embedded.sessions() as session:
            assert compile_jobs.claim(session, job.id, "another-host:1:inproc-0")
        assert child.pid is not None
        os.kill(child.pid, signal.SIGSTOP)
        relay = threading.Thread(target=child.run, args=("compile", job.id, "dead:2:inproc-0"))
        relay.start()
        os.kill(child.pid, signal.SIGKILL)
        relay.join()
        kept = embedded.reload(job.id)
        assert kept.status == JobStatus.running and kept.worker == "another-host:1:inproc-0"
    finally:
        child.close()


# ------------------------------------------------------------------ SQLite writers' lock

HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()
"""


def test_the_writer_lock_excludes_writers_of_another_process(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite-writer.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        lock = WriterLock(path)
        assert not lock.acquire(timeout=0.05)  # the other process holds it
        assert lock.acquire(timeout=0.0) is False
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait()
        assert lock.acquire(timeout=60)  # released with the other process's file
        lock.release()
    finally:
        holder.kill()
        holder.wait()


def test_sqlite_writes_take_the_file_lock_until_commit(tmp_path: Path) -> None:
    """A write transaction of one engine holds the file lock, so a second engine (as in
    another process) cannot begin writing until it commits."""
    from sqlalchemy import text

    url = f"sqlite:///{tmp_path / 'w.db'}"
    first, second = make_engine(url), make_engine(url)
    try:
        with first.begin() as conn:
            conn.execute(text("CREATE TABLE t (x INTEGER)"))
        other = WriterLock(tmp_path / "w.db-writer.lock")
        with first.connect() as conn:
            conn.execute(text("INSERT INTO t VALUES (1)"))
            assert not other.acquire(timeout=0.05)  # held by the open write transaction
            conn.commit()
        assert other.acquire(timeout=60)
        other.release()
        with second.begin() as conn:
            assert conn.execute(text("SELECT count(*) FROM t")).scalar_one() == 1
    finally:
        first.dispose()
        second.dispose()


# ------------------------------------------------------------ a job's writes to its row


def test_stage_changes_in_quick_succession_share_a_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each write of a job's row is a transaction on the writer lock that submits wait for: a
    stage change is written at once unless the row was written under STAGE_WRITE_GAP_S ago,
    and then with the next report due."""
    clock = [1000.0]
    written: list[tuple[str | None, float | None]] = []
    monkeypatch.setattr(compile_jobs.time, "monotonic", lambda: clock[0])

    def record(_session: object, _job: object, stage: str | None = None,
               progress: float | None = None) -> bool:  # fmt: skip
        written.append((stage, progress))
        return False

    monkeypatch.setattr(compile_jobs, "report_progress", record)
    job = SimpleNamespace(id=uuid.uuid4(), worker="w1")
    progress = compile_jobs._Progress(None, job, 1.0, None, None)  # type: ignore[arg-type]
    gap = compile_jobs.STAGE_WRITE_GAP_S

    progress("import", 0.0)  # the first report: written
    clock[0] += gap / 10
    progress("import", 0.1)  # same stage, interval not due: not written
    progress("graph-passes", 0.2)  # a new stage right after a write: not yet
    clock[0] += gap
    progress("lower", 0.5)  # a new stage, the last write is old enough: written
    clock[0] += gap / 10
    progress("lower", 0.6)
    clock[0] += 1.0
    progress("lower", 0.7)  # the interval is due: written

    assert written == [("import", 0.0), ("lower", 0.5), ("lower", 0.7)]
    assert progress.stage == "lower"


def test_a_failure_records_the_stage_it_failed_in(tmp_path: Path) -> None:
    from app.domain.db import models as tables  # noqa: F401 - registers the tables
    from app.domain.db.base import Base

    engine = make_engine(f"sqlite:///{tmp_path / 'f.db'}")
    Base.metadata.create_all(engine)
    farm = Embedded(Settings(data_dir=tmp_path), make_session_factory(engine),
                    FilesystemBlobStore(tmp_path / "blobs"))  # fmt: skip
    try:
        with farm.sessions() as session:
            team = make_team(session)
            from tests.conftest import tiny_model

            data = tiny_model(batch="N").SerializeToString()  # symbolic: refused at import
            model = models.store_model(session, farm.store, team, io.BytesIO(data), "m.onnx",
                                       max_bytes=1 << 26)  # fmt: skip
            job, _ = jobs.submit_job(session, team, model, OPTIONS)
            session.commit()
            claimed = compile_jobs.claim(session, job.id, "w")
            assert claimed is not None
            stages: list[str] = []
            done = compile_jobs.run_compile(
                session, farm.store, claimed, progress_cb=lambda s, _f: stages.append(s)
            )
        assert done.status == JobStatus.failed and done.error_code == "dynamic_shape"
        assert stages and farm.reload(job.id).stage == stages[-1]
    finally:
        engine.dispose()
