"""Workers as a specification: running a job, idempotency, cancel, failure, the sweep, the
in-process queue, the Celery task and configuration, and the service CLI commands.

Job tests run in both deployment modes (the `farm` fixture: SQLite + filesystem blobs, and
PostgreSQL + database blobs). Compiled QPCs are checked against ONNX Runtime.
"""

from __future__ import annotations

import datetime as dt
import io
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.domain.db.base import Base, utcnow
from app.domain.db.models import CompileJob, CompileReport, JobStatus, Model, Qpc, Team
from app.domain.db.session import make_engine, make_session_factory, upgrade_database
from app.domain.services import jobs, models, teams
from app.domain.settings import Settings, get_settings
from compiler_core import CompileOptions
from tests.conftest import Farm, make_team, tiny_model, tiny_model_bytes
from worker import compile_jobs
from worker.inprocess import InProcessQueue
from worker.reaper import reap_once
from worker.runner import process_job

OPTIONS = CompileOptions.from_json({"aic-num-cores": 2})
LIMIT = 64 << 20


# ------------------------------------------------------------------------------ helpers


def add_model(farm: Farm, session: Session, team: Team, data: bytes | None = None) -> Model:
    model = models.store_model(
        session, farm.store, team, io.BytesIO(data or tiny_model_bytes()), "m.onnx", max_bytes=LIMIT
    )
    session.commit()
    return model


def queued_job(farm: Farm, session: Session, team: Team, data: bytes | None = None) -> CompileJob:
    job, created = jobs.submit_job(session, team, add_model(farm, session, team, data), OPTIONS)
    session.commit()
    assert created and job.status == JobStatus.queued
    return job


def run(farm: Farm, job_id: uuid.UUID, worker: str = "w1", **kwargs: object) -> JobStatus | None:
    return process_job(
        job_id,
        session_factory=farm.db.sessions,
        store=farm.store,
        worker_name=worker,
        **kwargs,  # type: ignore[arg-type]
    )


def reload(farm: Farm, job_id: uuid.UUID) -> CompileJob:
    with farm.session() as session:
        job = session.get(CompileJob, job_id)
        assert job is not None
        return job


def count(farm: Farm, entity: type[Base]) -> int:
    with farm.session() as session:
        return int(session.execute(select(func.count()).select_from(entity)).scalar_one())


def assert_qpc_matches_onnxruntime(farm: Farm, qpc_id: uuid.UUID, tmp_path: Path) -> None:
    from compiler_core.runtime import run_qpc

    with farm.session() as session:
        qpc = session.get(Qpc, qpc_id)
        assert qpc is not None
        sha = qpc.sha256
    path = tmp_path / "programqpc.bin"
    with farm.store.open(sha) as src:
        path.write_bytes(src.read())
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    expected = ort.InferenceSession(tiny_model_bytes()).run(None, {"x": x})[0]
    got = np.asarray(run_qpc(str(path), {"x": x})["y"])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll until `predicate()`; the timeout only keeps a broken worker from hanging the run."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.05)


class RecordingQueue:
    """A JobQueue that remembers what it was given (the sweep's output, inspected)."""

    def __init__(self) -> None:
        self.ids: list[uuid.UUID] = []
        self.kinds: list[str] = []

    def enqueue(self, job_id: uuid.UUID, kind: str = "compile") -> None:
        self.ids.append(job_id)
        self.kinds.append(kind)

    def close(self) -> None:
        pass

    def ping(self) -> bool:
        return True


# --------------------------------------------------------------------------- process_job


def test_a_queued_job_is_compiled_and_its_qpc_and_report_are_stored(
    farm: Farm, session: Session, team: Team, tmp_path: Path
) -> None:
    job = queued_job(farm, session, team)
    stages: list[str] = []

    status = run(farm, job.id, progress_cb=lambda stage, _f: stages.append(stage))

    assert status == JobStatus.succeeded
    done = reload(farm, job.id)
    assert (done.status, done.stage, done.progress, done.attempts) == (
        JobStatus.succeeded,
        "done",
        1.0,
        1,
    )
    assert done.worker == "w1" and done.finished_at is not None and done.qpc_id is not None
    assert "import" in stages and stages.index("import") < len(stages) - 1
    with farm.session() as s:
        qpc = s.get(Qpc, done.qpc_id)
        assert qpc is not None and farm.store.exists(qpc.sha256)
        report = s.execute(select(CompileReport).where(CompileReport.qpc_id == qpc.id)).scalar_one()
        assert report.metrics and report.pass_times and "stage import" in report.log
    assert_qpc_matches_onnxruntime(farm, done.qpc_id, tmp_path)


def test_running_a_job_twice_compiles_it_once_and_stores_one_qpc(
    farm: Farm, session: Session, team: Team
) -> None:
    job = queued_job(farm, session, team)

    assert run(farm, job.id, "w1") == JobStatus.succeeded
    assert run(farm, job.id, "w2") is None  # a duplicate message: the claim refuses it

    done = reload(farm, job.id)
    assert (done.status, done.worker, done.attempts) == (JobStatus.succeeded, "w1", 1)
    assert count(farm, Qpc) == 1 and count(farm, CompileReport) == 1


def test_two_teams_compiling_the_same_thing_store_one_blob_and_a_qpc_row_each(
    farm: Farm, session: Session, team: Team
) -> None:
    # Two teams submit the same bytes and options before either compiles: two real compiles
    # (no attaching across teams), one blob by content, a QPC row in each team's records.
    first = queued_job(farm, session, team)
    second = queued_job(farm, session, make_team(session))

    assert run(farm, first.id) == JobStatus.succeeded
    assert run(farm, second.id) == JobStatus.succeeded

    mine, theirs = reload(farm, first.id).qpc_id, reload(farm, second.id).qpc_id
    assert None not in (mine, theirs) and mine != theirs
    assert count(farm, Qpc) == 2 and count(farm, CompileReport) == 2
    with farm.session() as s:
        assert len({q.sha256 for q in s.scalars(select(Qpc))}) == 1


def test_a_cancel_requested_while_compiling_stops_the_compile(
    farm: Farm, session: Session, team: Team
) -> None:
    job = queued_job(farm, session, team)
    stages: list[str] = []

    def cancel_from_another_thread() -> None:
        with farm.session() as other:
            row = other.get(CompileJob, job.id)
            assert row is not None and row.status == JobStatus.running
            jobs.cancel(other, team, row)
            other.commit()

    def on_progress(stage: str, _fraction: float) -> None:
        stages.append(stage)
        if len(stages) == 1:
            canceller = threading.Thread(target=cancel_from_another_thread)
            canceller.start()
            canceller.join()

    status = run(farm, job.id, progress_cb=on_progress)

    assert status == JobStatus.cancelled
    done = reload(farm, job.id)
    assert (done.status, done.stage, done.qpc_id) == (JobStatus.cancelled, "cancelled", None)
    assert stages == stages[:1]  # the compile went no further than the cancelling report
    assert count(farm, Qpc) == 0


def test_a_failing_compile_stores_the_structured_error(
    farm: Farm, session: Session, team: Team
) -> None:
    dynamic = tiny_model(batch="N").SerializeToString()  # no -onnx-define-symbol given
    job = queued_job(farm, session, team, dynamic)

    assert run(farm, job.id) == JobStatus.failed

    done = reload(farm, job.id)
    assert done.status == JobStatus.failed and done.qpc_id is None
    assert done.error_code == "dynamic_shape"
    assert done.error_message is not None and "'x'" in done.error_message
    assert done.error_detail is not None and done.error_detail["flag"] == "-onnx-define-symbol"
    assert count(farm, Qpc) == 0


def test_a_job_whose_workers_keep_dying_is_failed_as_worker_lost(
    farm: Farm, session: Session, team: Team
) -> None:
    job = queued_job(farm, session, team)
    long_ago = utcnow() - dt.timedelta(hours=1)
    for attempt in range(3):  # three claims whose workers died without a word
        then = long_ago + dt.timedelta(minutes=10 * attempt)
        claimed = compile_jobs.claim(session, job.id, f"dead-{attempt}", now=then)
        assert claimed is not None

    assert run(farm, job.id, max_attempts=3) == JobStatus.failed

    done = reload(farm, job.id)
    assert (done.status, done.error_code, done.attempts) == (JobStatus.failed, "worker_lost", 4)


# ----------------------------------------------------------------------------------- sweep


def test_the_sweep_reenqueues_a_dead_workers_job_and_the_reclaim_counts_an_attempt(
    farm: Farm, session: Session, team: Team
) -> None:
    job = queued_job(farm, session, team)
    now = utcnow()
    dead = compile_jobs.claim(session, job.id, "dead-worker", now=now - dt.timedelta(seconds=120))
    assert dead is not None and dead.attempts == 1
    live = queued_job(farm, session, make_team(session), tiny_model_bytes(0.2))
    assert compile_jobs.claim(session, live.id, "live-worker") is not None
    queue = RecordingQueue()

    assert reap_once(farm.db.sessions, queue, now, stale_after_s=60) == [job.id]
    assert queue.ids == [job.id]  # the live worker's job is left alone
    assert reap_once(farm.db.sessions, queue, now, stale_after_s=60) == []  # stamped

    assert run(farm, job.id, "rescuer", stale_after_s=60) == JobStatus.succeeded
    done = reload(farm, job.id)
    assert (done.status, done.worker, done.attempts) == (JobStatus.succeeded, "rescuer", 2)
    assert count(farm, Qpc) == 1


def test_the_sweep_reenqueues_a_job_whose_message_was_lost(
    farm: Farm, session: Session, team: Team
) -> None:
    job = queued_job(farm, session, team)
    queue = RecordingQueue()
    soon = utcnow() + dt.timedelta(seconds=10)
    later = utcnow() + dt.timedelta(seconds=400)

    assert reap_once(farm.db.sessions, queue, soon, requeue_after_s=300) == []
    assert reap_once(farm.db.sessions, queue, later, requeue_after_s=300) == [job.id]


def test_concurrent_sweeps_hand_out_a_dead_job_and_only_one_worker_runs_it(
    farm: Farm, session: Session, team: Team
) -> None:
    job = queued_job(farm, session, team)
    assert compile_jobs.claim(session, job.id, "dead", now=utcnow() - dt.timedelta(minutes=5))
    queues = [RecordingQueue(), RecordingQueue()]
    for queue in queues:
        reap_once(farm.db.sessions, queue, stale_after_s=60)
    handed_out = [job_id for queue in queues for job_id in queue.ids]
    assert set(handed_out) == {job.id}

    results = [run(farm, job_id, f"w{i}", stale_after_s=60) for i, job_id in enumerate(handed_out)]

    assert results.count(JobStatus.succeeded) == 1
    assert reload(farm, job.id).attempts == 2 and count(farm, Qpc) == 1


# ------------------------------------------------------------------------ in-process queue


@pytest.fixture
def in_process(farm: Farm) -> Iterator[Callable[..., InProcessQueue]]:
    started: list[InProcessQueue] = []

    def start(**kwargs: object) -> InProcessQueue:
        queue = InProcessQueue(farm.db.sessions, farm.store, **kwargs)  # type: ignore[arg-type]
        started.append(queue.start())
        return queue

    yield start
    for queue in started:
        queue.close()


def test_the_in_process_queue_runs_enqueued_jobs(
    farm: Farm, session: Session, team: Team, in_process: Callable[..., InProcessQueue]
) -> None:
    queue = in_process(concurrency=2)
    assert queue.ping()
    ids = [queued_job(farm, session, team, tiny_model_bytes(0.1 * (i + 1))).id for i in range(3)]
    for job_id in ids:
        queue.enqueue(job_id)

    wait_for(lambda: all(reload(farm, i).status == JobStatus.succeeded for i in ids), "3 jobs")
    assert count(farm, Qpc) == 3


def test_the_in_process_queue_picks_up_queued_and_dead_jobs_when_it_starts(
    farm: Farm, session: Session, team: Team, in_process: Callable[..., InProcessQueue]
) -> None:
    # Left behind by a previous process: two jobs never run, one whose worker died.
    waiting = [queued_job(farm, session, team, tiny_model_bytes(s)).id for s in (0.3, 0.4)]
    orphan = queued_job(farm, session, team, tiny_model_bytes(0.5)).id
    assert compile_jobs.claim(
        session, orphan, "old-process", now=utcnow() - dt.timedelta(minutes=5)
    )

    in_process(stale_after_s=60)

    every = [*waiting, orphan]
    wait_for(lambda: all(reload(farm, i).status == JobStatus.succeeded for i in every), "jobs")
    assert [reload(farm, i).attempts for i in every] == [1, 1, 2]


def test_the_in_process_queue_sweeps_for_itself_while_it_runs(
    farm: Farm, session: Session, team: Team, in_process: Callable[..., InProcessQueue]
) -> None:
    in_process(stale_after_s=60, reap_interval_s=0.05)
    # After the start: a job whose worker died and whose id no thread was ever given.
    orphan = queued_job(farm, session, team).id
    assert compile_jobs.claim(
        session, orphan, "lost-thread", now=utcnow() - dt.timedelta(minutes=5)
    )

    wait_for(lambda: reload(farm, orphan).status == JobStatus.succeeded, "the swept job")
    assert reload(farm, orphan).attempts == 2


def test_a_closed_in_process_queue_refuses_work_and_reports_not_ready(
    farm: Farm, in_process: Callable[..., InProcessQueue]
) -> None:
    queue = in_process()
    queue.close()
    assert not queue.ping()
    with pytest.raises(RuntimeError):
        queue.enqueue(uuid.uuid4())


# --------------------------------------------------------------------- queue choice, Celery


def test_without_a_broker_the_queue_is_in_process_and_with_one_it_is_celery(
    farm: Farm, tmp_path: Path
) -> None:
    from app.domain.queue import JobQueue
    from worker.queues import CeleryQueue, queue_from_settings

    embedded = queue_from_settings(Settings(data_dir=tmp_path), farm.db.sessions, farm.store)
    try:
        assert isinstance(embedded, InProcessQueue) and isinstance(embedded, JobQueue)
        assert embedded.ping()
    finally:
        embedded.close()
    farm_queue = queue_from_settings(
        Settings(data_dir=tmp_path, broker_url="redis://127.0.0.1:1/0"),
        farm.db.sessions,
        farm.store,
    )
    try:
        assert isinstance(farm_queue, CeleryQueue) and isinstance(farm_queue, JobQueue)
        assert not farm_queue.ping()  # nothing listens on port 1
        farm_queue.enqueue(uuid.uuid4())  # a broker outage is logged, not raised: the sweep
    finally:
        farm_queue.close()


def test_the_celery_app_redelivers_rather_than_loses_and_outlives_the_longest_compile() -> None:
    from worker.celery_app import celery_config, make_celery_app

    settings = Settings(broker_url="redis://127.0.0.1:6379/0", job_time_limit_s=1200)
    config = celery_config(settings)

    assert config["task_acks_late"] and config["task_reject_on_worker_lost"]
    assert config["worker_prefetch_multiplier"] == 1
    assert config["task_time_limit"] == 1200
    assert 0 < config["task_soft_time_limit"] < 1200
    assert config["broker_transport_options"]["visibility_timeout"] > 1200
    assert config["broker_connection_retry_on_startup"]
    assert (config["task_serializer"], config["accept_content"]) == ("json", ["json"])
    assert config["task_ignore_result"]
    app = make_celery_app(settings)
    assert app.conf.task_acks_late and app.conf.broker_url == settings.broker_url
    with pytest.raises(ValueError, match="QPCFARM_BROKER_URL"):
        make_celery_app(Settings())


def test_the_compile_task_runs_the_job_named_in_its_message_and_retries_database_outages(
    tmp_path: Path,
) -> None:
    from sqlalchemy.exc import OperationalError

    from app.domain.blobs import blob_store_from_settings
    from worker.celery_app import TASK_NAME, make_celery_app
    from worker.tasks import register_tasks

    settings = Settings(data_dir=tmp_path, broker_url="memory://")
    upgrade_database(settings.database_url)
    engine = make_engine(settings.database_url)
    sessions = make_session_factory(engine)
    try:
        with sessions() as session:
            team = make_team(session)
            model = models.store_model(
                session,
                blob_store_from_settings(settings, sessions),
                team,
                io.BytesIO(tiny_model_bytes()),
                "m.onnx",
                max_bytes=LIMIT,
            )
            job, _ = jobs.submit_job(session, team, model, OPTIONS)
            session.commit()
            job_id = job.id

        tasks = register_tasks(make_celery_app(settings), settings)
        task = tasks["compile"]
        assert task.name == TASK_NAME and OperationalError in task.autoretry_for
        assert tasks["profile"].name == "qpcfarm.profile"
        assert task.apply(args=[str(job_id)]).get() == "succeeded"
        assert task.apply(args=[str(job_id)]).get() is None  # redelivered: nothing to do
        assert task.apply(args=["not-a-uuid"]).get() is None

        with sessions() as session:
            done = session.get(CompileJob, job_id)
            assert done is not None and (done.status, done.attempts) == (JobStatus.succeeded, 1)
    finally:
        engine.dispose()


# ------------------------------------------------------------------------------ service CLI


@pytest.fixture
def embedded_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The CLI's settings: an embedded data dir in tmp (settings are cached per process)."""
    for name in ("QPCFARM_DATABASE_URL", "QPCFARM_BROKER_URL", "QPCFARM_BLOB_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("QPCFARM_DATA_DIR", str(tmp_path / "data"))
    get_settings.cache_clear()
    yield tmp_path / "data"
    get_settings.cache_clear()


def team_of(data_dir: Path, key: str) -> str | None:
    engine = make_engine(f"sqlite:///{data_dir / 'qpcfarm.db'}")
    try:
        with make_session_factory(engine)() as session:
            team = teams.team_for_key(session, key)
            return None if team is None else team.name
    finally:
        engine.dispose()


def test_admin_creates_a_team_and_prints_a_working_key_on_its_own_line(
    embedded_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.console.cli import main

    assert main(["admin", "create-team", "vision", "--init"]) == 0
    assert main(["admin", "create-key", "--team", "vision"]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("qpf_")
    assert team_of(embedded_env, lines[0]) == "vision"


def test_admin_errors_are_one_line_and_exit_non_zero(
    embedded_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.console.cli import main

    assert main(["db", "upgrade", "--init"]) == 0
    assert main(["admin", "create-key", "--team", "nobody"]) == 1
    assert main(["admin", "create-team", "twice"]) == 0
    assert main(["admin", "create-team", "twice"]) == 1
    assert main(["admin", "frobnicate"]) == 1
    errors = capsys.readouterr().err.splitlines()
    failures = [line for line in errors if line.startswith("qpcfarm: error:")]
    assert len(failures) == 3 and "nobody" in failures[0] and "twice" in failures[1]


def test_the_first_embedded_start_creates_team_local_and_saves_its_key_privately(
    embedded_env: Path,
) -> None:
    from app.console.cli import API_KEY_FILE, ensure_local_key

    upgrade_database(get_settings().database_url)  # as `serve` does first
    key = ensure_local_key(get_settings())

    assert key is not None and team_of(embedded_env, key) == "local"
    key_file = embedded_env / API_KEY_FILE
    assert key_file.read_text().strip() == key
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert ensure_local_key(get_settings()) is None  # later starts keep the key


def test_worker_needs_a_broker(embedded_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.console.cli import main

    assert main(["worker"]) == 1
    assert "QPCFARM_BROKER_URL" in capsys.readouterr().err


def test_db_upgrade_creates_the_schema_when_asked_and_upgrades_it_again(
    embedded_env: Path,
) -> None:
    from app.console.cli import main

    assert main(["db", "upgrade", "--init"]) == 0
    assert main(["db", "upgrade"]) == 0  # idempotent
    assert (embedded_env / "qpcfarm.db").is_file()


@pytest.mark.parametrize(
    "argv",
    [
        ["admin", "create-team", "vision"],
        ["admin", "list-keys"],
        ["admin", "verify-blobs"],
        ["admin", "revoke-key", "qpf_x"],
        ["db", "upgrade"],
    ],
)
def test_outside_the_farms_folder_admin_and_db_refuse_and_create_nothing(
    embedded_env: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    from app.console.cli import main

    assert main(argv) == 1
    error = capsys.readouterr().err
    assert error.startswith("qpcfarm: error: no farm database:")
    assert str(embedded_env / "qpcfarm.db") in error and "--init" in error
    assert not embedded_env.exists()


def test_a_server_database_without_the_farms_schema_is_refused_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.console.cli import main
    from tests.api_helpers import postgres_schema_url

    with postgres_schema_url() as url:
        monkeypatch.setenv("QPCFARM_DATABASE_URL", url)
        get_settings.cache_clear()
        try:
            assert main(["admin", "list-keys"]) == 1
            assert "holds no farm schema" in capsys.readouterr().err
            assert main(["admin", "list-keys", "--init"]) == 0
            assert main(["admin", "list-keys"]) == 0
        finally:
            get_settings.cache_clear()


def test_compiler_commands_and_help_go_to_the_compiler_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import onnx

    from app.console.cli import main

    model = tmp_path / "m.onnx"
    onnx.save_model(tiny_model(), str(model))
    out = tmp_path / "out"

    assert main(["compile", f"-m={model}", f"-aic-binary-dir={out}"]) == 0
    assert (out / "programqpc.bin").is_file()
    assert main(["-h"]) == 0
    help_text = capsys.readouterr().out
    for command in ("compile", "run", "qpc", "serve", "worker", "admin", "db"):
        assert command in help_text
    assert main(["compile", "-m=missing.onnx", f"-aic-binary-dir={out}"]) == 1
    assert capsys.readouterr().err.startswith("qpcfarm: error: model file not found")


def test_admin_sets_a_teams_limits_shows_its_usage_and_runs_the_collector(
    embedded_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from app.console.cli import main

    assert main(["admin", "create-team", "vision", "--init"]) == 0
    argv = ["admin", "set-limits", "--team", "vision", "--max-queued", "20"]
    assert main([*argv, "--max-stored", "2G", "--retention-days", "30"]) == 0
    assert "queued jobs   0 of 20" in capsys.readouterr().out
    assert main(["admin", "show-team", "--team", "vision", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["limits"] == {
        "max_queued_jobs": 20,
        "max_running_jobs": None,
        "max_stored_bytes": 2 << 30,
        "retention_days": 30.0,
    }
    assert shown["usage"] == {"queued_jobs": 0, "running_jobs": 0, "stored_bytes": 0}
    assert main(["admin", "set-limits", "--team", "vision", "--max-stored", "none"]) == 0
    capsys.readouterr()
    assert main(["admin", "gc", "--dry-run", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [t["team"] for t in report["teams"]] == ["vision"]
    assert report["teams"][0]["models"] == [] and report["blobs"] == []
    assert main(["admin", "set-limits", "--team", "vision", "--max-queued", "-3"]) == 1
