"""A worker and a database that goes away mid-compile: the job is never failed for it.

Each test crashes a private PostgreSQL server (never the machine's own) at a chosen stage of a
compile that runs in the test's process, so the outage falls where the test says, not where
a race puts it. The farm's database blob store lives on the same server, so storing the QPC
fails too while it is down.
"""

from __future__ import annotations

import io
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from sqlalchemy.orm import Session

from app.domain.blobs.database import DatabaseBlobStore
from app.domain.db.faults import DATABASE_FAULTS
from app.domain.db.models import CompileJob, JobStatus, Qpc
from app.domain.db.session import make_engine, make_session_factory, upgrade_database
from app.domain.services import jobs, models
from compiler_core import CompileOptions
from tests.conftest import make_team, tiny_model_bytes
from tests.service_helpers import PostgresServer, postgres_binaries, postgres_server
from worker.runner import process_job

pytestmark = pytest.mark.skipif(
    postgres_binaries() is None, reason="needs initdb/postgres to start a private server"
)


@dataclass
class Outage:
    server: PostgresServer
    sessions: Callable[[], Session]
    store: DatabaseBlobStore
    job_id: uuid.UUID

    def run(self, on_stage: Callable[[int, str], None], **kwargs: object) -> object:
        """`process_job` in this process; `on_stage(n, stage)` at each new stage's report."""
        seen: list[str] = []

        def progress(stage: str, _fraction: float) -> None:
            if not seen or seen[-1] != stage:
                seen.append(stage)
                on_stage(len(seen), stage)

        return process_job(
            self.job_id,
            session_factory=self.sessions,
            store=self.store,
            worker_name="w1",
            heartbeat_s=0.2,
            progress_cb=progress,
            **kwargs,  # type: ignore[arg-type]
        )

    def job(self) -> CompileJob:
        with self.sessions() as session:
            row = session.get(CompileJob, self.job_id)
            assert row is not None
            session.expunge(row)
            return row

    def qpcs(self) -> int:
        with self.sessions() as session:
            return session.query(Qpc).count()


@pytest.fixture
def outage() -> Iterator[Outage]:
    with postgres_server() as server:
        upgrade_database(server.url)
        engine = make_engine(server.url)
        sessions = make_session_factory(engine)
        store = DatabaseBlobStore(sessions)
        try:
            with sessions() as session:
                team = make_team(session)
                model = models.store_model(
                    session,
                    store,
                    team,
                    io.BytesIO(tiny_model_bytes()),
                    "m.onnx",
                    max_bytes=64 << 20,
                )
                job, _ = jobs.submit_job(
                    session, team, model, CompileOptions.from_json({"aic-num-cores": 2})
                )
                session.commit()
                job_id = job.id
            yield Outage(server, sessions, store, job_id)
        finally:
            engine.dispose()


def test_a_database_outage_between_progress_reports_neither_stops_nor_fails_the_compile(
    outage: Outage,
) -> None:
    def on_stage(n: int, _stage: str) -> None:
        if n == 1:
            outage.server.kill()  # the next reports, heartbeats and cancel polls get no answer
        elif n == 4:
            outage.server.start()

    status = outage.run(on_stage)

    assert status == JobStatus.succeeded
    job = outage.job()
    assert (job.status, job.attempts, job.error_code) == (JobStatus.succeeded, 1, None)
    assert outage.qpcs() == 1


def test_an_outage_when_the_qpc_is_stored_leaves_the_job_running_and_a_rerun_finishes_it(
    outage: Outage,
) -> None:
    def on_stage(_n: int, stage: str) -> None:
        if stage == "write-qpc":  # the last stage the compiler reports
            outage.server.kill()

    with pytest.raises(DATABASE_FAULTS):  # the Celery task retries this; the reaper is the backstop
        outage.run(on_stage)
    outage.server.start()

    left = outage.job()
    assert (left.status, left.error_code, left.qpc_id) == (JobStatus.running, None, None)

    time.sleep(0.3)  # the dead attempt's heartbeat goes stale
    status = outage.run(lambda _n, _stage: None, stale_after_s=0.2)

    assert status == JobStatus.succeeded
    job = outage.job()
    assert (job.status, job.attempts, job.error_code) == (JobStatus.succeeded, 2, None)
    assert outage.qpcs() == 1
