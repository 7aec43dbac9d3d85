"""Fair share as a specification, in both deployment modes (the `farm` fixture): a message
is a doorbell, the worker runs the fairest queued compile (`worker.fair_share`)."""

from __future__ import annotations

import datetime as dt
import io
import uuid

from sqlalchemy import update
from sqlalchemy.orm import Session

from app.domain.db.base import utcnow
from app.domain.db.models import CompileJob, JobStatus, Model, Team
from app.domain.services import jobs, models
from compiler_core import CompileOptions
from tests.conftest import Farm, make_team, tiny_model_bytes
from worker import fair_share
from worker.runner import process_job


def add_model(farm: Farm, session: Session, team: Team) -> Model:
    model = models.store_model(
        session, farm.store, team, io.BytesIO(tiny_model_bytes()), "tiny.onnx", max_bytes=1 << 26
    )
    session.commit()
    return model


def queue(
    session: Session, team: Team, model: Model, cores: int, *, batch: bool = False
) -> uuid.UUID:
    job, created = jobs.submit_job(
        session, team, model, CompileOptions.from_json({"aic-num-cores": cores}), batch=batch
    )
    session.commit()
    assert created and job.status == JobStatus.queued
    return job.id


def used_workers(session: Session, team: Team, model: Model, seconds: float) -> None:
    """A finished compile of the team that held a worker for `seconds` just now."""
    job_id = queue(session, team, model, 16)
    now = utcnow()
    session.execute(
        update(CompileJob)
        .where(CompileJob.id == job_id)
        .values(
            status=JobStatus.succeeded,
            started_at=now - dt.timedelta(seconds=seconds),
            finished_at=now,
        )
    )
    session.commit()


def two_teams(farm: Farm, session: Session) -> tuple[Team, Model, Team, Model]:
    a, b = make_team(session, "sweeping"), make_team(session, "interactive")
    session.commit()
    return a, add_model(farm, session, a), b, add_model(farm, session, b)


def test_the_team_with_less_recent_worker_time_goes_first_whatever_the_message_names(
    farm: Farm, session: Session
) -> None:
    a, model_a, b, model_b = two_teams(farm, session)
    a_jobs = [queue(session, a, model_a, cores) for cores in (1, 2, 3)]
    used_workers(session, a, model_a, 30)
    b_job = queue(session, b, model_b, 1)  # submitted last
    claimed = fair_share.claim_next(session, a_jobs[0], "w1")
    assert claimed is not None and claimed.id == b_job
    # Then A's, oldest first, as A's messages (or B's) arrive.
    order = [fair_share.claim_next(session, b_job, f"w{i}") for i in range(3)]
    assert [job.id for job in order if job is not None] == a_jobs
    assert fair_share.claim_next(session, b_job, "w9") is None  # nothing left to run


def test_within_the_window_only_recent_time_counts(farm: Farm, session: Session) -> None:
    a, model_a, b, model_b = two_teams(farm, session)
    b_job = queue(session, b, model_b, 1)  # the older job
    a_job = queue(session, a, model_a, 1)
    used_workers(session, b, model_b, 5)
    now = utcnow()
    used = fair_share.recent_worker_seconds(session, [a.id, b.id], now, 600)
    assert set(used) == {b.id} and 4.5 < used[b.id] < 6
    later = now + dt.timedelta(seconds=700)  # B's compile is out of the window then
    assert fair_share.recent_worker_seconds(session, [a.id, b.id], later, 600) == {}
    claimed = fair_share.claim_next(session, b_job, "w1", window_s=600, now=later)
    assert claimed is not None and claimed.id == b_job  # no recent time: the oldest
    session.execute(update(CompileJob).where(CompileJob.id == b_job).values(status="queued"))
    session.commit()
    claimed = fair_share.claim_next(session, b_job, "w2", window_s=600, now=now)
    assert claimed is not None and claimed.id == a_job  # B used 5 s just now, A none


def test_a_sweeps_compiles_yield_to_interactive_ones(farm: Farm, session: Session) -> None:
    a, model_a, b, model_b = two_teams(farm, session)
    sweep_jobs = [queue(session, a, model_a, cores, batch=True) for cores in (1, 2)]
    used_workers(session, b, model_b, 60)  # B used the workers more, yet its person goes first
    own = queue(session, b, model_b, 1)
    mine = queue(session, a, model_a, 8)
    first = fair_share.claim_next(session, sweep_jobs[0], "w1")
    second = fair_share.claim_next(session, sweep_jobs[0], "w2")
    assert first is not None and second is not None
    assert [first.id, second.id] == [mine, own]  # A used no time: its interactive first
    third = fair_share.claim_next(session, sweep_jobs[0], "w3")
    assert third is not None and third.id == sweep_jobs[0]


def test_an_interactive_submit_of_a_queued_sweep_compile_makes_it_interactive(
    farm: Farm, session: Session
) -> None:
    a, model_a, _b, _model_b = two_teams(farm, session)
    swept = queue(session, a, model_a, 1, batch=True)
    job, created = jobs.submit_job(
        session, a, model_a, CompileOptions.from_json({"aic-num-cores": 1})
    )
    assert (job.id, created, job.batch) == (swept, False, False)


def test_a_team_at_its_running_quota_waits_and_others_run(farm: Farm, session: Session) -> None:
    a, model_a, b, model_b = two_teams(farm, session)
    a.max_running_jobs = 1
    session.commit()
    a_jobs = [queue(session, a, model_a, cores) for cores in (1, 2)]
    first = fair_share.claim_next(session, a_jobs[0], "w1")
    assert first is not None and first.id == a_jobs[0]
    assert fair_share.claim_next(session, a_jobs[1], "w2") is None  # A is at its quota
    b_job = queue(session, b, model_b, 1)
    other = fair_share.claim_next(session, a_jobs[1], "w2")
    assert other is not None and other.id == b_job
    session.execute(update(CompileJob).where(CompileJob.id == a_jobs[0]).values(status="succeeded"))
    session.commit()
    last = fair_share.claim_next(session, a_jobs[1], "w3")
    assert last is not None and last.id == a_jobs[1]


def test_a_dead_workers_job_is_retaken_by_its_own_message(farm: Farm, session: Session) -> None:
    a, model_a, b, model_b = two_teams(farm, session)
    stale = queue(session, a, model_a, 1)
    queue(session, b, model_b, 1)
    long_ago = utcnow() - dt.timedelta(seconds=600)
    session.execute(
        update(CompileJob)
        .where(CompileJob.id == stale)
        .values(status="running", attempts=1, started_at=long_ago, heartbeat_at=long_ago)
    )
    session.commit()
    claimed = fair_share.claim_next(session, stale, "w2", stale_after_s=60)
    assert claimed is not None and (claimed.id, claimed.attempts) == (stale, 2)


def test_the_workers_run_path_runs_the_fairest_compile(farm: Farm, session: Session) -> None:
    """`process_job`, which Celery's task and the embedded queue both call."""
    a, model_a, b, model_b = two_teams(farm, session)
    a_job = queue(session, a, model_a, 1)
    used_workers(session, a, model_a, 30)
    b_job = queue(session, b, model_b, 1)
    status = process_job(
        a_job, session_factory=farm.db.sessions, store=farm.store, worker_name="w1",
        kind="compile",
    )  # fmt: skip
    assert status == JobStatus.succeeded
    session.expire_all()
    done, waiting = session.get(CompileJob, b_job), session.get(CompileJob, a_job)
    assert done is not None and done.status == JobStatus.succeeded
    assert waiting is not None and waiting.status == JobStatus.queued


def test_the_reaper_sends_again_what_a_running_quota_held_back_once_there_is_room(
    farm: Farm, session: Session
) -> None:
    a, model_a, _b, _model_b = two_teams(farm, session)
    a.max_running_jobs = 1
    session.commit()
    a_jobs = [queue(session, a, model_a, cores) for cores in (1, 2, 3)]
    running = fair_share.claim_next(session, a_jobs[0], "w1")
    assert running is not None
    assert fair_share.claim_next(session, a_jobs[1], "w2") is None  # that message ran nothing
    assert fair_share.held_back_ids(session) == []  # no room: nothing to send
    session.execute(update(CompileJob).where(CompileJob.id == a_jobs[0]).values(status="succeeded"))
    session.commit()
    assert fair_share.held_back_ids(session, quiet_s=0) == [a_jobs[1]]  # room for one
    session.commit()
    assert fair_share.held_back_ids(session, quiet_s=30) == []  # just sent: left alone
