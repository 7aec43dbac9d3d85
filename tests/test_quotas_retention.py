"""Per-team quotas and retention, as specifications, in both deployment modes (the `farm`
fixture: SQLite + filesystem blobs, PostgreSQL + database blobs), and over HTTP.

Quotas: queued jobs (429 `queue_quota` + `Retry-After`), stored bytes (413 `storage_quota`
with the numbers), a sweep never exceeding the queue's room. Retention: what is old and
unreferenced goes, what a job, sweep or pin references stays, also while submits race it.
"""

from __future__ import annotations

import datetime as dt
import io
import threading
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app.domain.db.base import utcnow
from app.domain.db.models import CompileJob, JobStatus, Model, Qpc, Team
from app.domain.services import jobs, models, qpcs, quotas, retention, sweeps
from app.domain.services.errors import ServiceError
from compiler_core import CompileOptions
from tests.api_helpers import Servers
from tests.conftest import Farm, make_team, tiny_model_bytes
from worker import compile_jobs

LIMIT = 64 << 20
LATER = dt.timedelta(days=40)
"""Collections run "40 days from now" with a 30-day period: what the test made is old."""


def options(cores: int) -> CompileOptions:
    return CompileOptions.from_json({"aic-num-cores": cores})


def add_model(farm: Farm, session: Session, team: Team, scale: float = 0.1) -> Model:
    model = models.store_model(
        session, farm.store, team, io.BytesIO(tiny_model_bytes(scale)), "tiny.onnx",
        max_bytes=LIMIT,
    )  # fmt: skip
    session.commit()
    return model


def compile_now(farm: Farm, session: Session, job: CompileJob) -> CompileJob:
    claimed = compile_jobs.claim(session, job.id, "worker-1")
    assert claimed is not None
    done = compile_jobs.run_compile(session, farm.store, claimed)
    assert done.status == JobStatus.succeeded, (done.error_code, done.error_message)
    return done


def submit(session: Session, team: Team, model: Model, cores: int) -> CompileJob:
    job, _created = jobs.submit_job(session, team, model, options(cores))
    session.commit()
    return job


def collect(farm: Farm, session: Session, **kwargs: object) -> retention.Collected:
    return retention.collect(
        session,
        farm.store,
        default_days=None,
        now=utcnow() + LATER,
        **kwargs,  # type: ignore[arg-type]
    )


# --------------------------------------------------------------------------------- quotas


def test_a_submit_beyond_the_queue_quota_is_429_with_retry_after_and_the_numbers(
    farm: Farm, session: Session, team: Team
) -> None:
    team.max_queued_jobs = 2
    session.commit()
    model = add_model(farm, session, team)
    first = submit(session, team, model, 1)
    submit(session, team, model, 2)
    with pytest.raises(ServiceError) as raised:
        jobs.submit_job(session, team, model, options(3), retry_after_s=7)
    error = raised.value
    assert (error.code, error.status) == ("queue_quota", 429)
    assert error.headers == {"Retry-After": "7"}
    assert error.to_dict()["queued_jobs"] == 2 and error.to_dict()["max_queued_jobs"] == 2
    session.rollback()
    # An identical submit queues nothing: it attaches to the job in flight.
    attached, created = jobs.submit_job(session, team, model, options(1))
    assert (attached.id, created) == (first.id, False)
    # Once one has started, there is room again.
    assert compile_jobs.claim(session, first.id, "worker-1") is not None
    assert submit(session, team, model, 3).status == JobStatus.queued


def test_stored_bytes_beyond_the_quota_are_413_with_the_numbers(
    farm: Farm, session: Session, team: Team
) -> None:
    model = add_model(farm, session, team)
    team.max_stored_bytes = model.size + 10
    session.commit()
    with pytest.raises(ServiceError) as raised:
        add_model(farm, session, team, scale=0.2)
    error = raised.value
    assert (error.code, error.status) == ("storage_quota", 413)
    assert error.to_dict()["stored_bytes"] == model.size
    assert error.to_dict()["max_stored_bytes"] == model.size + 10
    assert error.to_dict()["adding_bytes"] == model.size  # same-sized model, other bytes
    session.rollback()
    assert session.execute(select(func.count()).select_from(Model)).scalar_one() == 1
    # At its limit, a compile (whose QPC adds bytes) is refused too.
    team.max_stored_bytes = model.size
    session.commit()
    with pytest.raises(ServiceError) as raised:
        jobs.submit_job(session, team, model, options(1))
    assert (raised.value.code, raised.value.status) == ("storage_quota", 413)
    session.rollback()
    team.max_stored_bytes = None
    session.commit()
    assert submit(session, team, model, 1).status == JobStatus.queued


def test_sweeps_submit_no_more_than_the_queue_quota_leaves_room_for(
    farm: Farm, session: Session, team: Team
) -> None:
    model = add_model(farm, session, team)
    assert sweeps.sweep_compile_allowance(session, team.id, 64) == 64
    team.max_queued_jobs = 5
    submit(session, team, model, 1)
    assert sweeps.sweep_compile_allowance(session, team.id, 64) == 4
    assert sweeps.sweep_compile_allowance(session, team.id, 3) == 3


def test_usage_is_counted_against_the_limits(farm: Farm, session: Session, team: Team) -> None:
    model = add_model(farm, session, team)
    job = compile_now(farm, session, submit(session, team, model, 1))
    submit(session, team, model, 2)
    qpc = session.get(Qpc, job.qpc_id)
    assert qpc is not None
    team.max_running_jobs = 3
    session.commit()
    described = quotas.describe(session, team)
    assert described["usage"] == {
        "queued_jobs": 1,
        "running_jobs": 0,
        "stored_bytes": model.size + qpc.size,
    }
    assert described["limits"]["max_running_jobs"] == 3
    assert described["limits"]["max_queued_jobs"] is None


# ------------------------------------------------------------------------------ retention


def test_old_unreferenced_models_and_qpcs_go_and_referenced_ones_stay(
    farm: Farm, session: Session
) -> None:
    team = make_team(session, "keeps-30-days")
    team.retention_days = 30
    forever = make_team(session, "keeps-forever")
    session.commit()
    old_model = add_model(farm, session, team, 0.1)
    old_job = compile_now(farm, session, submit(session, team, old_model, 1))
    pinned_model = add_model(farm, session, team, 0.2)
    pinned_job = compile_now(farm, session, submit(session, team, pinned_model, 1))
    pinned_qpc = session.get(Qpc, pinned_job.qpc_id)
    assert pinned_qpc is not None
    qpcs.set_pinned(session, pinned_qpc, True)
    busy_model = add_model(farm, session, team, 0.3)
    busy_job = submit(session, team, busy_model, 1)  # still queued
    kept_elsewhere = add_model(farm, session, forever, 0.1)  # same bytes, another team
    session.commit()
    old_qpc = session.get(Qpc, old_job.qpc_id)
    assert old_qpc is not None
    old_ids = (old_model.id, old_qpc.id, old_job.id)
    old_qpc_sha = old_qpc.sha256

    dry = collect(farm, session, dry_run=True)
    assert [t.team for t in dry.teams] == ["keeps-30-days"]
    assert dry.teams[0].models == [str(old_model.id)]
    assert dry.teams[0].qpcs == [str(old_qpc.id)]
    session.expire_all()
    assert session.get(Model, old_model.id) is not None  # a dry run deletes nothing
    assert farm.store.exists(old_qpc_sha)

    done = collect(farm, session)
    session.expire_all()
    assert session.get(Model, old_ids[0]) is None
    assert session.get(Qpc, old_ids[1]) is None
    assert session.get(CompileJob, old_ids[2]) is None
    assert done.blobs == [old_qpc_sha]  # the model's bytes are another team's model too
    assert not farm.store.exists(old_qpc_sha)
    assert farm.store.exists(kept_elsewhere.sha256)
    for kept in (pinned_model.id, busy_model.id, kept_elsewhere.id):
        assert session.get(Model, kept) is not None
    assert session.get(Qpc, pinned_qpc.id) is not None
    assert session.get(CompileJob, pinned_job.id) is not None
    assert session.get(CompileJob, busy_job.id) is not None
    assert farm.store.exists(pinned_qpc.sha256)
    # Within the period nothing goes.
    assert retention.collect(session, farm.store, default_days=None).teams[0].models == []


def test_a_farm_default_period_applies_to_teams_without_their_own(
    farm: Farm, session: Session, team: Team
) -> None:
    model = add_model(farm, session, team)
    assert collect(farm, session).teams == []  # no period anywhere: nothing collected
    found = retention.collect(session, farm.store, default_days=30, now=utcnow() + LATER)
    assert found.teams[0].models == [str(model.id)]


def test_submits_racing_the_collector_never_lose_what_they_reference(
    farm: Farm, session: Session
) -> None:
    """Cache-hit submits of an old QPC and compiles of an old model run while the collector
    runs again and again "40 days later": every job ends naming rows that exist and a QPC
    whose bytes are there."""
    team = make_team(session, "racing")
    team.retention_days = 30
    session.commit()
    models_ = [add_model(farm, session, team, 0.1 + i / 10) for i in range(3)]
    for model in models_:
        compile_now(farm, session, submit(session, team, model, 1))
    team_id, model_ids = team.id, [m.id for m in models_]
    stop = threading.Event()
    errors: list[BaseException] = []
    made: list[uuid.UUID] = []

    def submitter() -> None:
        with farm.session() as s:
            t = s.get(Team, team_id)
            assert t is not None
            for round_ in range(6):
                for model_id in model_ids:
                    try:
                        row, _ = jobs.submit(s, t, model_id, options(1 + round_ % 2))
                        s.commit()
                        made.append(row.id)
                    except ServiceError as exc:  # the model was collected: an honest 404
                        s.rollback()
                        if exc.code != "not_found":
                            errors.append(exc)
                    except BaseException as exc:  # noqa: BLE001 - reported below
                        s.rollback()
                        errors.append(exc)

    def collector() -> None:
        with farm.session() as s:
            while not stop.is_set():
                try:
                    retention.collect(s, farm.store, default_days=None, now=utcnow() + LATER)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    s.rollback()
                    errors.append(exc)

    threads = [threading.Thread(target=submitter), threading.Thread(target=collector)]
    for thread in threads:
        thread.start()
    threads[0].join()
    stop.set()
    threads[1].join()
    assert errors == []
    session.expire_all()
    for job_id in made:
        job = session.get(CompileJob, job_id)
        if job is None:  # a finished job, collected in turn with what only it named
            continue
        assert session.get(Model, job.model_id) is not None
        if job.qpc_id is not None:
            qpc = session.get(Qpc, job.qpc_id)
            assert qpc is not None and farm.store.exists(qpc.sha256)


# ---------------------------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    running = Servers(tmp_path_factory, max_upload_bytes=1 << 20, quota_retry_after_s=11)
    try:
        yield running
    finally:
        running.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_over_http_a_full_queue_is_429_the_team_page_shows_usage_and_a_qpc_can_be_pinned(
    servers: Servers, kind: str
) -> None:
    server = servers.get(kind)
    key = server.new_key()
    with server.state.session_factory() as s:
        team_id = s.execute(select(Team.id).order_by(Team.created_at.desc())).scalars().first()
        s.execute(update(Team).where(Team.id == team_id).values(max_queued_jobs=1))
        s.commit()
    with server.client(key) as client:
        model = client.post("/v1/models", files={"file": ("m.onnx", tiny_model_bytes(0.7))})
        assert model.status_code == 201, model.text
        body = {"model_id": model.json()["id"], "options": {"aic-num-cores": 1}}
        first = client.post("/v1/compile-jobs", json=body)
        assert first.status_code == 202
        full = client.post("/v1/compile-jobs", json={**body, "options": {"aic-num-cores": 2}})
        assert full.status_code == 429
        assert full.headers["Retry-After"] == "11"
        assert full.json()["code"] == "queue_quota"
        assert full.json()["max_queued_jobs"] == 1
        page = client.get("/v1/team").json()
        assert page["usage"]["queued_jobs"] == 1
        assert page["limits"]["max_queued_jobs"] == 1
        with server.state.session_factory() as s:
            job = compile_jobs.claim(s, uuid.UUID(first.json()["id"]), "w")
            assert job is not None
            compile_jobs.run_compile(s, server.state.store, job)
        qpc_id = client.get(f"/v1/compile-jobs/{first.json()['id']}").json()["qpc_id"]
        pinned = client.put(f"/v1/qpcs/{qpc_id}/pin")
        assert pinned.status_code == 200 and pinned.json()["pinned"] is True
        assert client.delete(f"/v1/qpcs/{qpc_id}/pin").json()["pinned"] is False
