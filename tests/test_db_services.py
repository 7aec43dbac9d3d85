"""The data layer as a specification: schema and migrations, settings, and every service.

Service tests run in both deployment modes (the `farm` fixture): embedded (SQLite +
filesystem blobs) and farm (PostgreSQL + database blobs).
"""

from __future__ import annotations

import datetime as dt
import io
import stat
import tarfile
import threading
import uuid
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Table, func, inspect, select
from sqlalchemy.orm import Session

from app.domain.blobs import BlobRef
from app.domain.db.base import Base, utcnow
from app.domain.db.models import ApiKey, CompileJob, CompileReport, JobStatus, Model, Qpc, Team
from app.domain.db.session import (
    alembic_config,
    session_scope,
    upgrade_database,
    wait_for_database,
)
from app.domain.services import jobs, models, qpcs, teams, validations
from app.domain.services.errors import ServiceError
from app.domain.settings import Settings, get_settings
from compiler_core import CompileOptions
from tests.conftest import (
    Farm,
    empty_database,
    external_data_model_dir,
    make_team,
    tiny_model,
    tiny_model_bytes,
)
from worker import claims, compile_jobs
from worker.heartbeat import JobHeartbeat

LIMIT = 64 << 20
OPTIONS = CompileOptions.from_json({"aic-num-cores": 2})


# ------------------------------------------------------------------------------ helpers


def add_model(farm: Farm, session: Session, team: Team, data: bytes | None = None) -> Model:
    model = models.store_model(
        session,
        farm.store,
        team,
        io.BytesIO(data or tiny_model_bytes()),
        "tiny.onnx",
        max_bytes=LIMIT,
    )
    session.commit()
    return model


def queued_job(
    farm: Farm, session: Session, team: Team, options: CompileOptions = OPTIONS
) -> CompileJob:
    job, created = jobs.submit_job(session, team, add_model(farm, session, team), options)
    session.commit()
    assert created and job.status == JobStatus.queued
    return job


def compiled_job(farm: Farm, session: Session, team: Team) -> CompileJob:
    job = queued_job(farm, session, team)
    claimed = compile_jobs.claim(session, job.id, "worker-1")
    assert claimed is not None
    done = compile_jobs.run_compile(session, farm.store, claimed)
    assert done.status == JobStatus.succeeded, (done.error_code, done.error_message)
    return done


def qpc_id_of(job: CompileJob) -> uuid.UUID:
    assert job.qpc_id is not None, "the job has no QPC"
    return job.qpc_id


def old_schema_team(session: Session, name: str | None = None) -> Any:
    """A team row written with the columns every revision has (a migration test's database
    is at an older revision than the models)."""
    from sqlalchemy import insert

    team_id = uuid.uuid4()
    session.execute(
        insert(table_of(Team)).values(
            id=team_id, name=name or f"team-{team_id.hex[:8]}", created_at=utcnow()
        )
    )
    return SimpleNamespace(id=team_id)


def table_of(entity: type[Base]) -> Table:
    """The entity's Core table (typed: the declarative base declares `__table__` a
    FromClause), for writes to a database at an older revision than the models."""
    table = entity.__table__
    assert isinstance(table, Table)
    return table


def old_schema_model(session: Session, team_id: uuid.UUID) -> Any:
    """A model row written with the columns every revision has (as `old_schema_team`)."""
    from sqlalchemy import insert

    model_id = uuid.uuid4()
    values = {"sha256": "a" * 64, "size": 1, "name": "m", "kind": "onnx", "opset": 17}
    session.execute(
        insert(table_of(Model)).values(
            id=model_id, team_id=team_id, inputs=[], outputs=[], created_at=utcnow(), **values
        )
    )
    return SimpleNamespace(id=model_id)


def count(session: Session, entity: type[Base]) -> int:
    return int(session.execute(select(func.count()).select_from(entity)).scalar_one())


def raises_service_error(code: str, status: int) -> Callable[[Callable[[], object]], ServiceError]:
    def check(call: Callable[[], object]) -> ServiceError:
        with pytest.raises(ServiceError) as raised:
            call()
        assert (raised.value.code, raised.value.status) == (code, status), raised.value
        return raised.value

    return check


# -------------------------------------------------------------------- schema, settings


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_migrating_an_empty_database_to_head_gives_exactly_the_models_tables(
    kind: str, tmp_path: Path
) -> None:
    with empty_database(kind, tmp_path) as db:
        upgrade_database(db.engine)
        upgrade_database(db.engine)  # a second run is a no-op
        with db.engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
            head = ScriptDirectory.from_config(alembic_config()).get_current_head()
            assert context.get_current_revision() == head
        tables = set(inspect(db.engine).get_table_names()) - {"alembic_version"}
        assert tables == set(Base.metadata.tables)


def test_upgrade_database_accepts_a_url(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'nested' / 'farm.db'}"
    upgrade_database(url)
    wait_for_database(url, timeout=1)
    assert (tmp_path / "nested" / "farm.db").exists()


def test_wait_for_database_gives_up_with_the_connection_error() -> None:
    from sqlalchemy.exc import OperationalError

    with pytest.raises(OperationalError):
        wait_for_database("postgresql+psycopg://postgres@127.0.0.1:1/none", timeout=0.2)


def test_the_embedded_default_needs_no_configuration(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("DATABASE_URL", "BROKER_URL", "BLOB_STORE", "DATA_DIR"):
        monkeypatch.delenv(f"QPCFARM_{name}", raising=False)
    settings = Settings()
    assert settings.database_url == "sqlite:///qpcfarm-data/qpcfarm.db"
    assert settings.broker_url is None and settings.embedded_worker
    assert settings.blob_store == "filesystem"
    assert settings.max_upload_bytes == 8 << 30
    assert settings.require_auth and settings.environment == "development"


def test_settings_come_from_qpcfarm_environment_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("QPCFARM_DATABASE_URL", "postgresql+psycopg://db/farm")
    monkeypatch.setenv("QPCFARM_BROKER_URL", "redis://redis:6379/0")
    monkeypatch.setenv("QPCFARM_MAX_UPLOAD_BYTES", "1000")
    get_settings.cache_clear()
    try:
        settings = get_settings()
        assert get_settings() is settings  # cached
        assert settings.blob_store == "database" and not settings.embedded_worker
        assert settings.max_upload_bytes == 1000
    finally:
        get_settings.cache_clear()


def test_session_scope_commits_on_success_and_rolls_back_on_error(farm: Farm) -> None:
    with session_scope(farm.db.sessions) as session:
        make_team(session, "kept")
    with pytest.raises(RuntimeError), session_scope(farm.db.sessions) as session:
        make_team(session, "dropped")
        raise RuntimeError("boom")
    with farm.session() as session:
        names = session.execute(select(Team.name)).scalars().all()
    assert names == ["kept"]


def test_timestamps_come_back_as_aware_utc(session: Session, team: Team) -> None:
    session.expire_all()
    created = session.get(Team, team.id)
    assert created is not None and created.created_at.tzinfo is not None
    assert abs(created.created_at - utcnow()) < dt.timedelta(minutes=5)


# ------------------------------------------------------------------------------- teams


def test_a_team_name_is_unique(session: Session, team: Team) -> None:
    raises_service_error("team_exists", 409)(lambda: teams.create_team(session, team.name))


def test_an_api_key_is_shown_once_and_stored_only_as_a_hash(session: Session, team: Team) -> None:
    key, row = teams.create_api_key(session, team, "ci")
    session.commit()
    assert key.startswith("qpf_") and len(key) > 40
    assert row.prefix == key[:12] and row.key_hash == teams.hash_key(key)
    stored = session.execute(select(ApiKey)).scalars().all()
    assert all(key not in (r.key_hash, r.prefix, r.name) for r in stored)
    found = teams.team_for_key(session, key)
    assert found is not None and found.id == team.id


def test_an_unknown_malformed_or_revoked_key_finds_no_team(session: Session, team: Team) -> None:
    key, row = teams.create_api_key(session, team)
    assert teams.team_for_key(session, key + "x") is None
    assert teams.team_for_key(session, "Bearer " + key) is None
    row.revoked_at = utcnow()
    session.commit()
    assert teams.team_for_key(session, key) is None


# ------------------------------------------------------------------------------ models


def test_an_onnx_upload_is_stored_with_its_inputs_and_outputs(
    farm: Farm, session: Session, team: Team
) -> None:
    data = tiny_model_bytes()
    model = add_model(farm, session, team, data)
    assert model.kind == "onnx" and model.size == len(data) and model.opset == 17
    assert model.name == "tiny.onnx"
    assert model.inputs == [{"name": "x", "dtype": "float", "shape": [2, 4]}]
    assert model.outputs == [{"name": "y", "dtype": "float", "shape": [2, 3]}]
    assert farm.store.exists(model.sha256)


def test_a_model_with_a_symbolic_batch_is_accepted_and_keeps_the_symbol(
    farm: Farm, session: Session, team: Team
) -> None:
    data = tiny_model(batch="N").SerializeToString()
    model = add_model(farm, session, team, data)
    assert model.inputs == [{"name": "x", "dtype": "float", "shape": ["N", 4]}]


@pytest.mark.parametrize(
    "data", [b"this is not a model", tiny_model_bytes()[:-40]], ids=["not-onnx", "truncated"]
)
def test_a_file_that_is_not_a_whole_onnx_model_is_refused_with_the_importers_code(
    farm: Farm, session: Session, team: Team, data: bytes
) -> None:
    raises_service_error("invalid_model", 422)(lambda: add_model(farm, session, team, data))
    assert count(session, Model) == 0


def test_a_bare_onnx_may_not_reach_for_files_beside_it(
    farm: Farm, session: Session, team: Team, tmp_path: Path
) -> None:
    # Its external data would otherwise resolve next to the stored blob (other blobs).
    path = external_data_model_dir(tmp_path / "m")
    error = raises_service_error("external_data_not_allowed", 422)(
        lambda: add_model(farm, session, team, path.read_bytes())
    )
    assert "archive" in error.message


def test_an_oversize_upload_is_refused_and_leaves_no_blob(
    farm: Farm, session: Session, team: Team
) -> None:
    data = tiny_model_bytes()
    raises_service_error("too_large", 413)(
        lambda: models.store_model(
            session, farm.store, team, io.BytesIO(data), "m.onnx", max_bytes=len(data) - 1
        )
    )
    from hashlib import sha256

    assert not farm.store.exists(sha256(data).hexdigest())


def _zip(members: Mapping[str, bytes | Path]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, content in members.items():
            data = content.read_bytes() if isinstance(content, Path) else content
            archive.writestr(zipfile.ZipInfo(name), data, zipfile.ZIP_DEFLATED)
    return out.getvalue()


def _tar(members: list[tarfile.TarInfo | tuple[str, bytes]], mode: str = "w") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode=mode) as archive:  # type: ignore[call-overload]
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                archive.addfile(member)
            else:
                info = tarfile.TarInfo(member[0])
                info.size = len(member[1])
                archive.addfile(info, io.BytesIO(member[1]))
    return out.getvalue()


@pytest.mark.parametrize(
    ("fmt", "filename"), [("zip", "m.zip"), ("tar", "m.tar"), ("w:gz", "m.tar.gz")]
)
def test_an_archive_with_external_data_is_stored_as_uploaded(
    farm: Farm, session: Session, team: Team, tmp_path: Path, fmt: str, filename: str
) -> None:
    folder = tmp_path / "m"
    model_path = external_data_model_dir(folder)
    files = {"net/model.onnx": model_path, "net/weights.bin": folder / "weights.bin"}
    if fmt == "zip":
        data = _zip(files)
    else:
        data = _tar([(n, p.read_bytes()) for n, p in files.items()], "w" if fmt == "tar" else fmt)
    model = models.store_model(
        session, farm.store, team, io.BytesIO(data), filename, max_bytes=LIMIT
    )
    assert model.kind == "archive" and model.size == len(data)
    assert model.inputs == [{"name": "x", "dtype": "float", "shape": [2, 4]}]
    with farm.store.open(model.sha256) as handle:
        assert handle.read() == data


def _symlink_zip() -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        info = zipfile.ZipInfo("weights.bin")
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        archive.writestr(info, "/etc/passwd")
        archive.writestr("model.onnx", tiny_model_bytes())
    return out.getvalue()


def _special_tar(kind: bytes, name: str = "weights.bin") -> bytes:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = "/etc/passwd"
    return _tar([("model.onnx", tiny_model_bytes()), info])


ONNX = tiny_model_bytes()
PAD = bytes(2 << 20)  # 2 MiB of zeros: compresses to almost nothing, over the 1 MiB limit

# name -> (archive bytes, what the refusal says)
HOSTILE_ARCHIVES: dict[str, tuple[Callable[[], bytes], str]] = {
    "zip-absolute-path": (lambda: _zip({"/tmp/evil.onnx": ONNX}), "absolute path"),
    "zip-dot-dot": (lambda: _zip({"../evil.onnx": ONNX}), "'..'"),
    "zip-backslash-dot-dot": (lambda: _zip({"a\\..\\..\\evil.onnx": ONNX}), "'..'"),
    "zip-symlink": (_symlink_zip, "symbolic link"),
    "zip-too-many-members": (lambda: _zip({f"f{i}": b"" for i in range(1001)}), "1000 members"),
    "zip-bomb": (lambda: _zip({"model.onnx": ONNX, "pad.bin": PAD}), "ARCHIVE_MAX_RATIO"),
    "zip-no-model": (lambda: _zip({"readme.txt": b"hello"}), "no .onnx"),
    "zip-two-models": (lambda: _zip({"a.onnx": ONNX, "b.onnx": ONNX}), "expected one"),
    "tar-absolute-path": (lambda: _tar([("/tmp/evil.onnx", ONNX)]), "absolute path"),
    "tar-dot-dot": (lambda: _tar([("x/../../evil.onnx", ONNX)]), "'..'"),
    "tar-symlink": (lambda: _special_tar(tarfile.SYMTYPE), "is a link"),
    "tar-hardlink": (lambda: _special_tar(tarfile.LNKTYPE), "is a link"),
    "tar-device": (lambda: _special_tar(tarfile.CHRTYPE), "not a regular file"),
    "tar-fifo": (lambda: _special_tar(tarfile.FIFOTYPE), "not a regular file"),
    "tar-gz-bomb": (
        lambda: _tar([("model.onnx", ONNX), ("pad", PAD)], "w:gz"),
        "ARCHIVE_MAX_RATIO",
    ),
    "tar-too-many-members": (lambda: _tar([(f"f{i}", b"") for i in range(1001)]), "1000 members"),
    "named-zip-but-onnx": (lambda: ONNX, "not a .zip"),
}
BOMBS = {"zip-bomb", "tar-gz-bomb"}
"""Refused by the extraction's ratio bound (413 `archive_ratio`), not as malformed."""


@pytest.mark.parametrize("name", sorted(HOSTILE_ARCHIVES))
def test_a_hostile_archive_is_refused_as_bad_archive(
    farm: Farm, session: Session, team: Team, name: str
) -> None:
    build, reason = HOSTILE_ARCHIVES[name]
    data = build()
    filename = "upload.tar.gz" if name.startswith("tar") else "upload.zip"
    code, status = ("archive_ratio", 413) if name in BOMBS else ("bad_archive", 422)
    error = raises_service_error(code, status)(
        lambda: models.store_model(
            session, farm.store, team, io.BytesIO(data), filename, max_bytes=1 << 20
        )
    )
    assert reason in error.message
    assert count(session, Model) == 0


def test_a_team_sees_only_its_own_models_a_page_at_a_time(
    farm: Farm, session: Session, team: Team
) -> None:
    other = make_team(session)
    mine = [add_model(farm, session, team, tiny_model_bytes(scale=s)) for s in (0.1, 0.2, 0.3)]
    theirs = add_model(farm, session, other)
    page = models.list_models(session, team, limit=2, offset=0)
    assert page.total == 3 and len(page.items) == 2
    rest = models.list_models(session, team, limit=2, offset=2)
    assert {m.id for m in page.items + rest.items} == {m.id for m in mine}
    assert models.get_model(session, team, mine[0].id).id == mine[0].id
    raises_service_error("not_found", 404)(lambda: models.get_model(session, team, theirs.id))
    raises_service_error("not_found", 404)(lambda: models.get_model(session, team, uuid.uuid4()))
    raises_service_error("bad_page", 422)(lambda: models.list_models(session, team, limit=0))


# -------------------------------------------------------------------------------- jobs


def test_submitting_queues_a_job_keyed_by_model_options_and_compiler_version(
    farm: Farm, session: Session, team: Team
) -> None:
    job = queued_job(farm, session, team)
    model = session.get(Model, job.model_id)
    assert model is not None
    assert job.options_key == jobs.options_key(model.sha256, OPTIONS)
    assert CompileOptions.from_json(job.options).to_json_str() == OPTIONS.to_json_str()
    assert job.device == OPTIONS.device.name and job.attempts == 0 and not job.cache_hit
    other = CompileOptions.from_json({"aic-num-cores": 4})
    assert jobs.options_key(model.sha256, other) != job.options_key


def test_submitting_the_same_compile_again_attaches_to_the_active_job(
    farm: Farm, session: Session, team: Team
) -> None:
    job = queued_job(farm, session, team)
    model = session.get(Model, job.model_id)
    assert model is not None
    again, created = jobs.submit_job(
        session, team, model, CompileOptions.from_flags(["-aic-num-cores=2"])
    )
    assert (again.id, created) == (job.id, False)
    compile_jobs.claim(session, job.id, "w")
    running, created = jobs.submit_job(session, team, model, OPTIONS)
    assert (running.id, created) == (job.id, False)


def test_another_team_does_not_attach_to_a_teams_job(
    farm: Farm, session: Session, team: Team
) -> None:
    job = queued_job(farm, session, team)
    other = make_team(session)
    their_model = add_model(farm, session, other)
    theirs, created = jobs.submit_job(session, other, their_model, OPTIONS)
    assert created and theirs.id != job.id
    mine = session.get(Model, job.model_id)
    assert mine is not None
    raises_service_error("not_found", 404)(lambda: jobs.submit_job(session, other, mine, OPTIONS))


def test_an_identical_compile_after_success_is_a_cache_hit(
    farm: Farm, session: Session, team: Team
) -> None:
    done = compiled_job(farm, session, team)
    model = session.get(Model, done.model_id)
    assert model is not None
    hit, created = jobs.submit_job(session, team, model, OPTIONS)
    session.commit()
    assert created and hit.id != done.id
    assert hit.status == JobStatus.succeeded and hit.cache_hit and hit.qpc_id == done.qpc_id
    assert hit.progress == 1.0 and hit.finished_at is not None


def test_by_default_another_team_compiles_its_own_and_sees_no_other_teams_qpc(
    farm: Farm, session: Session, team: Team
) -> None:
    done = compiled_job(farm, session, team)
    other = make_team(session)
    model = add_model(farm, session, other)  # same bytes, another team
    theirs, created = jobs.submit_job(session, other, model, OPTIONS)
    session.commit()
    assert created and (theirs.status, theirs.cache_hit) == (JobStatus.queued, False)
    raises_service_error("not_found", 404)(lambda: qpcs.get_qpc(session, other, qpc_id_of(done)))


def test_with_the_farm_scope_another_teams_hit_gets_a_copy_of_its_own(
    farm: Farm, session: Session, team: Team
) -> None:
    done = compiled_job(farm, session, team)
    other = make_team(session)
    model = add_model(farm, session, other)
    hit, _ = jobs.submit_job(session, other, model, OPTIONS, cache_scope="farm")
    session.commit()
    assert hit.status == JobStatus.succeeded and hit.cache_hit and hit.qpc_id is not None
    assert hit.qpc_id != done.qpc_id  # their own row: nothing names the first team's QPC
    mine, theirs = qpcs.get_qpc(session, team, qpc_id_of(done)), session.get(Qpc, hit.qpc_id)
    assert theirs is not None and theirs.team_id == other.id and theirs.sha256 == mine.sha256
    report, own = qpcs.get_report(session, theirs), qpcs.get_report(session, mine)
    assert report is not None and own is not None and report.metrics == own.metrics
    again, _ = jobs.submit_job(session, other, model, OPTIONS, cache_scope="farm")
    assert again.qpc_id == hit.qpc_id  # one copy, not one per hit


def test_claim_makes_a_queued_job_running_once(farm: Farm, session: Session, team: Team) -> None:
    job = queued_job(farm, session, team)
    claimed = compile_jobs.claim(session, job.id, "worker-a")
    assert claimed is not None
    assert (claimed.status, claimed.worker, claimed.attempts) == (JobStatus.running, "worker-a", 1)
    assert claimed.started_at is not None and claimed.heartbeat_at is not None
    assert compile_jobs.claim(session, job.id, "worker-b") is None
    assert compile_jobs.claim(session, uuid.uuid4(), "worker-b") is None


def race_to_claim(farm: Farm, job_id: uuid.UUID, workers: tuple[str, ...]) -> list[str]:
    """Claim one job from several threads at once, each with its own session; the winners."""
    barrier = threading.Barrier(len(workers))
    winners: list[str] = []
    errors: list[BaseException] = []

    def contend(name: str) -> None:
        with farm.session() as own:
            try:
                barrier.wait()
                if compile_jobs.claim(own, job_id, name) is not None:
                    winners.append(name)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

    threads = [threading.Thread(target=contend, args=(name,)) for name in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    return winners


def test_of_concurrent_claims_exactly_one_wins(farm: Farm, session: Session, team: Team) -> None:
    for cores in (1, 2, 3):
        job = queued_job(farm, session, team, CompileOptions.from_json({"aic-num-cores": cores}))
        winners = race_to_claim(farm, job.id, ("a", "b", "c"))
        assert len(winners) == 1
        session.expire_all()
        row = session.get(CompileJob, job.id)
        assert row is not None and (row.worker, row.attempts) == (winners[0], 1)


def test_a_job_whose_worker_stopped_heartbeating_is_reclaimed_with_one_more_attempt(
    farm: Farm, session: Session, team: Team
) -> None:
    job = queued_job(farm, session, team)
    t0 = utcnow()
    first = compile_jobs.claim(session, job.id, "worker-a", now=t0, stale_after_s=60)
    assert first is not None
    assert (
        compile_jobs.claim(
            session, job.id, "worker-b", now=t0 + dt.timedelta(seconds=59), stale_after_s=60
        )
        is None
    )
    with farm.session() as other_session:
        second = compile_jobs.claim(
            other_session, job.id, "worker-b", now=t0 + dt.timedelta(seconds=61), stale_after_s=60
        )
        assert second is not None and (second.worker, second.attempts) == ("worker-b", 2)
    # The first worker learns at its next report that the job is no longer its own.
    assert compile_jobs.report_progress(session, first, "lower", 0.6) is True


def test_report_progress_records_stage_and_progress_and_says_when_to_stop(
    farm: Farm, session: Session, team: Team
) -> None:
    job = queued_job(farm, session, team)
    claimed = compile_jobs.claim(session, job.id, "w")
    assert claimed is not None
    assert compile_jobs.report_progress(session, claimed, "graph-passes", 0.3) is False
    with farm.session() as api:
        row = api.get(CompileJob, job.id)
        assert row is not None and (row.stage, row.progress) == ("graph-passes", 0.3)
        owner = api.get(Team, team.id)
        assert owner is not None
        jobs.cancel(api, owner, row)
        api.commit()
        assert row.status == JobStatus.running and row.cancel_requested
    assert compile_jobs.report_progress(session, claimed, "lower", 0.6) is True


def test_a_heartbeat_thread_keeps_a_job_fresh_and_notices_a_cancel(
    farm: Farm, session: Session, team: Team
) -> None:
    job = queued_job(farm, session, team)
    claimed = compile_jobs.claim(session, job.id, "w")
    assert claimed is not None and claimed.heartbeat_at is not None
    first_beat = claimed.heartbeat_at
    with JobHeartbeat(farm.db.sessions, CompileJob, job.id, "w", interval_s=0.02) as heartbeat:
        while heartbeat.beats < 2:
            threading.Event().wait(0.01)
        assert not heartbeat.stop_requested()
        jobs.cancel(session, team, claimed)
        session.commit()
        while not heartbeat.stop_requested():
            threading.Event().wait(0.01)
    session.refresh(claimed)
    assert claimed.heartbeat_at is not None and claimed.heartbeat_at > first_beat


def test_cancelling_a_queued_job_ends_it_at_once(farm: Farm, session: Session, team: Team) -> None:
    job = queued_job(farm, session, team)
    cancelled = jobs.cancel(session, team, job)
    session.commit()
    assert cancelled.status == JobStatus.cancelled and cancelled.finished_at is not None
    assert compile_jobs.claim(session, job.id, "w") is None
    raises_service_error("not_cancellable", 409)(lambda: jobs.cancel(session, team, job))


def test_cancelling_a_running_job_stops_its_compile(
    farm: Farm, session: Session, team: Team
) -> None:
    job = queued_job(farm, session, team)
    claimed = compile_jobs.claim(session, job.id, "w")
    assert claimed is not None
    with farm.session() as api:
        row = api.get(CompileJob, job.id)
        owner = api.get(Team, team.id)
        assert row is not None and owner is not None
        jobs.cancel(api, owner, row)
        api.commit()
    stages: list[str] = []
    done = compile_jobs.run_compile(
        session, farm.store, claimed, progress_cb=lambda s, f: stages.append(s)
    )
    assert done.status == JobStatus.cancelled and done.qpc_id is None
    assert stages == ["import"]  # stopped at the first progress report
    assert count(session, Qpc) == 0


def test_should_cancel_stops_a_compile_too(farm: Farm, session: Session, team: Team) -> None:
    job = queued_job(farm, session, team)
    claimed = compile_jobs.claim(session, job.id, "w")
    assert claimed is not None
    done = compile_jobs.run_compile(session, farm.store, claimed, should_cancel=lambda: True)
    assert done.status == JobStatus.cancelled


def test_a_team_cannot_cancel_another_teams_job(farm: Farm, session: Session, team: Team) -> None:
    job = queued_job(farm, session, team)
    other = make_team(session)
    raises_service_error("not_found", 404)(lambda: jobs.cancel(session, other, job))
    raises_service_error("not_found", 404)(lambda: jobs.get_job(session, other, job.id))


def test_a_dead_workers_job_with_a_cancel_request_ends_cancelled_not_rerun(
    farm: Farm, session: Session, team: Team
) -> None:
    job = queued_job(farm, session, team)
    t0 = utcnow()
    claimed = compile_jobs.claim(session, job.id, "dead", now=t0)
    assert claimed is not None
    jobs.cancel(session, team, claimed)
    session.commit()
    assert compile_jobs.claim(session, job.id, "w2", now=t0 + dt.timedelta(hours=1)) is None
    session.refresh(claimed)
    assert claimed.status == JobStatus.cancelled


def test_the_sweep_finds_lost_queued_jobs_and_dead_workers_jobs_once(
    farm: Farm, session: Session, team: Team
) -> None:
    lost = queued_job(farm, session, team)
    dead = queued_job(farm, session, team, CompileOptions.from_json({"aic-num-cores": 3}))
    alive = queued_job(farm, session, team, CompileOptions.from_json({"aic-num-cores": 4}))
    t0 = utcnow()
    compile_jobs.claim(session, dead.id, "dead", now=t0)
    compile_jobs.claim(session, alive.id, "alive", now=t0)
    later = t0 + dt.timedelta(seconds=120)
    compile_jobs.report_progress(session, alive, "lower", 0.5, now=later)
    found = claims.stale_ids(session, CompileJob, later, stale_after_s=60, requeue_after_s=100)
    session.commit()
    assert set(found) == {lost.id, dead.id}
    assert (
        claims.stale_ids(
            session,
            CompileJob,
            later + dt.timedelta(seconds=1),
            stale_after_s=60,
            requeue_after_s=100,
        )
        == []
    )
    again = claims.stale_ids(
        session,
        CompileJob,
        later + dt.timedelta(seconds=200),
        stale_after_s=60,
        requeue_after_s=100,
    )
    assert lost.id in again


def test_run_compile_stores_a_qpc_that_validates_and_its_report(
    farm: Farm, session: Session, team: Team
) -> None:
    job = queued_job(farm, session, team)
    claimed = compile_jobs.claim(session, job.id, "worker-1")
    assert claimed is not None
    seen: list[tuple[str, float]] = []
    done = compile_jobs.run_compile(
        session, farm.store, claimed, progress_cb=lambda s, f: seen.append((s, f))
    )
    assert done.status == JobStatus.succeeded, done.error_message
    assert (done.stage, done.progress, done.cache_hit) == ("done", 1.0, False)
    assert done.finished_at is not None and done.error_code is None
    assert [s for s, _ in seen][0] == "import" and seen[-1] == ("write-qpc", 1.0)

    qpc = qpcs.get_qpc(session, team, qpc_id_of(done))
    assert farm.store.size(qpc.sha256) == qpc.size
    assert qpc.requirements["num_cores"] >= 1 and qpc.options_key == job.options_key
    report = qpcs.get_report(session, qpc)
    assert report is not None and report.metrics["estimated"] is True
    assert "lower" in report.pass_times and "stage write-qpc" in report.log

    validation = validations.validate_stored_qpc(
        session, farm.store, team, qpc, OPTIONS.device.name
    )
    session.commit()
    assert validation.ok and all(c["ok"] for c in validation.checks)
    assert validation.qpc_id == qpc.id and validation.qpc_sha256 == qpc.sha256


def test_run_compile_extracts_an_archive_model(
    farm: Farm, session: Session, team: Team, tmp_path: Path
) -> None:
    folder = tmp_path / "m"
    path = external_data_model_dir(folder, scale=0.5)
    data = _zip({"model.onnx": path, "weights.bin": folder / "weights.bin"})
    model = models.store_model(
        session, farm.store, team, io.BytesIO(data), "m.zip", max_bytes=LIMIT
    )
    job, _ = jobs.submit_job(session, team, model, OPTIONS)
    session.commit()
    claimed = compile_jobs.claim(session, job.id, "w")
    assert claimed is not None
    assert compile_jobs.run_compile(session, farm.store, claimed).status == JobStatus.succeeded


def test_two_runs_of_the_same_compile_store_one_qpc_and_one_report_per_team(
    farm: Farm, session: Session, team: Team
) -> None:
    # Two teams submit the same bytes and options before either finishes: two compiles,
    # a QPC row for each team (its own id), one blob.
    first = queued_job(farm, session, team)
    other = make_team(session)
    second, _ = jobs.submit_job(session, other, add_model(farm, session, other), OPTIONS)
    session.commit()
    for job in (first, second):
        claimed = compile_jobs.claim(session, job.id, "w")
        assert claimed is not None
        assert compile_jobs.run_compile(session, farm.store, claimed).status == JobStatus.succeeded
    assert first.qpc_id != second.qpc_id
    assert (count(session, Qpc), count(session, CompileReport)) == (2, 2)
    # A late duplicate `succeed` of a finished job (a redelivered message) changes nothing.
    qpc = session.get(Qpc, first.qpc_id)
    assert qpc is not None
    outcome = compile_jobs.CompileOutcome(metrics={}, warnings=[], pass_times={}, requirements={})
    compile_jobs.succeed(session, first, BlobRef(qpc.sha256, qpc.size), outcome)
    assert (count(session, Qpc), count(session, CompileReport)) == (2, 2)
    assert len(list(farm.store.list_blobs())) == 2  # the model and the QPC, once each


def test_a_compile_error_fails_the_job_with_the_compilers_structured_error(
    farm: Farm, session: Session, team: Team
) -> None:
    model = add_model(farm, session, team, tiny_model(batch="N").SerializeToString())
    job, _ = jobs.submit_job(session, team, model, OPTIONS)  # no -batchsize: N stays unbound
    session.commit()
    claimed = compile_jobs.claim(session, job.id, "w")
    assert claimed is not None
    done = compile_jobs.run_compile(session, farm.store, claimed)
    assert done.status == JobStatus.failed and done.error_code == "dynamic_shape"
    assert done.error_detail is not None and done.error_detail["code"] == "dynamic_shape"
    assert "-onnx-define-symbol=N" in (done.error_message or "")

    fixed, _ = jobs.submit_job(session, team, model, OPTIONS.with_(batchsize=3))
    session.commit()
    claimed = compile_jobs.claim(session, fixed.id, "w")
    assert claimed is not None
    assert compile_jobs.run_compile(session, farm.store, claimed).status == JobStatus.succeeded


def test_an_unexpected_exception_fails_the_job_as_internal_error(
    farm: Farm, session: Session, team: Team
) -> None:
    job = queued_job(farm, session, team)
    claimed = compile_jobs.claim(session, job.id, "w")
    assert claimed is not None

    def broken(stage: str, fraction: float) -> None:
        raise RuntimeError("disk on fire at /srv/qpcfarm/tmp/qpcfarm-job-x/model.onnx")

    done = compile_jobs.run_compile(session, farm.store, claimed, progress_cb=broken)
    assert done.status == JobStatus.failed and done.error_code == "internal_error"
    assert "RuntimeError" in (done.error_message or "")
    assert "/srv" not in (done.error_message or "")  # no server path reaches the client


def test_a_job_whose_model_blob_vanished_fails_as_model_missing(
    farm: Farm, session: Session, team: Team
) -> None:
    job = queued_job(farm, session, team)
    model = session.get(Model, job.model_id)
    assert model is not None
    farm.store.delete(model.sha256)
    claimed = compile_jobs.claim(session, job.id, "w")
    assert claimed is not None
    assert compile_jobs.run_compile(session, farm.store, claimed).error_code == "model_missing"


def test_jobs_are_listed_per_team_newest_first_and_filtered_by_status(
    farm: Farm, session: Session, team: Team
) -> None:
    a = queued_job(farm, session, team)
    b = queued_job(farm, session, team, CompileOptions.from_json({"aic-num-cores": 3}))
    jobs.cancel(session, team, a)
    other = make_team(session)
    session.commit()
    page = jobs.list_jobs(session, team)
    assert [j.id for j in page.items] == [b.id, a.id] and page.total == 2
    assert [j.id for j in jobs.list_jobs(session, team, status=JobStatus.cancelled).items] == [a.id]
    assert jobs.list_jobs(session, other).total == 0


# ------------------------------------------------------------------- qpcs, validations


def test_a_team_cannot_see_another_teams_qpc(farm: Farm, session: Session, team: Team) -> None:
    done = compiled_job(farm, session, team)
    other = make_team(session)
    qpc_id = qpc_id_of(done)
    raises_service_error("not_found", 404)(lambda: qpcs.get_qpc(session, other, qpc_id))
    qpc = session.get(Qpc, done.qpc_id)
    assert qpc is not None
    raises_service_error("not_found", 404)(
        lambda: validations.validate_stored_qpc(session, farm.store, other, qpc, None)
    )


def test_validating_against_an_unknown_device_is_refused(
    farm: Farm, session: Session, team: Team
) -> None:
    done = compiled_job(farm, session, team)
    qpc = session.get(Qpc, done.qpc_id)
    assert qpc is not None
    raises_service_error("unknown_device", 422)(
        lambda: validations.validate_stored_qpc(session, farm.store, team, qpc, "no-such-card")
    )
    raises_service_error("unknown_device", 422)(
        lambda: validations.validate_uploaded(session, farm.store, team, io.BytesIO(b"x"), "nope")
    )


def test_an_uploaded_qpc_is_validated_and_recorded(
    farm: Farm, session: Session, team: Team
) -> None:
    done = compiled_job(farm, session, team)
    qpc = session.get(Qpc, done.qpc_id)
    assert qpc is not None
    with farm.store.open(qpc.sha256) as handle:
        good = handle.read()
    valid = validations.validate_uploaded(session, farm.store, team, io.BytesIO(good), None)
    bad = validations.validate_uploaded(session, farm.store, team, io.BytesIO(b"junk" * 20), None)
    session.commit()
    assert valid.ok and valid.qpc_id == qpc.id
    assert not bad.ok and bad.qpc_id is None and not bad.checks[0]["ok"]
    raises_service_error("too_large", 413)(
        lambda: validations.validate_uploaded(
            session, farm.store, team, io.BytesIO(good), None, max_bytes=10
        )
    )
    page = validations.list_validations(session, team, limit=1)
    assert page.total == 2 and len(page.items) == 1
    assert validations.get_validation(session, team, bad.id).id == bad.id
    other = make_team(session)
    assert validations.list_validations(session, other).total == 0
    raises_service_error("not_found", 404)(
        lambda: validations.get_validation(session, other, bad.id)
    )


def test_a_bare_onnx_with_large_inline_weights_is_accepted(
    farm: Farm, session: Session, team: Team
) -> None:
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    weights = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        [weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    stored = add_model(farm, session, team, model.SerializeToString())
    assert stored.inputs[0]["name"] == "x"


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_the_one_active_job_migration_keeps_the_oldest_of_duplicates_in_flight(
    kind: str, tmp_path: Path
) -> None:
    from sqlalchemy import insert

    from app.domain.db.models import ACTIVE_JOB_PREDICATE

    with empty_database(kind, tmp_path) as db:
        upgrade_database(db.engine, "0003")
        with db.sessions() as session:
            team = old_schema_team(session)
            model = old_schema_model(session, team.id)
            start = utcnow()
            rows = [
                (JobStatus.running, 0),
                (JobStatus.queued, 1),
                (JobStatus.running, 2),
                (JobStatus.succeeded, 3),
            ]
            ids = [uuid.uuid4() for _ in rows]
            for job_id, (status, age) in zip(ids, rows, strict=True):
                session.execute(
                    insert(CompileJob).values(
                        id=job_id,
                        team_id=team.id,
                        model_id=model.id,
                        options={},
                        options_key="k" * 64,
                        device="aic100-standard",
                        status=status,
                        created_at=start + dt.timedelta(seconds=age),
                    )  # fmt: skip
                )
            session.commit()

        upgrade_database(db.engine)

        with db.sessions() as session:
            active = (
                session.execute(select(CompileJob.id).where(ACTIVE_JOB_PREDICATE)).scalars().all()
            )
            assert active == [ids[0]]
            states = {j.id: (j.status, j.cancel_requested) for j in session.scalars(
                select(CompileJob))}  # fmt: skip
            assert states[ids[1]] == (JobStatus.cancelled, False)
            assert states[ids[2]] == (JobStatus.running, True)
            assert states[ids[3]] == (JobStatus.succeeded, False)


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_the_per_team_qpc_migration_gives_each_team_its_own_row_and_loses_nothing(
    kind: str, tmp_path: Path
) -> None:
    from sqlalchemy import insert

    from app.domain.db.models import ProfileJob, Validation

    with empty_database(kind, tmp_path) as db:
        upgrade_database(db.engine, "0005")
        with db.sessions() as session:
            a, b = old_schema_team(session, "a"), old_schema_team(session, "b")
            model = old_schema_model(session, a.id)
            qpc_id, orphan_id = uuid.uuid4(), uuid.uuid4()
            for ident, sha in ((qpc_id, "b" * 64), (orphan_id, "c" * 64)):
                session.execute(
                    insert(table_of(Qpc)).values(
                        id=ident,
                        sha256=sha,
                        size=9,
                        compiler_version="v",
                        options_key="k" * 64,
                        device="aic100-standard",
                        requirements={},
                        created_at=utcnow(),
                    )  # fmt: skip
                )
            session.execute(insert(table_of(CompileReport)).values(
                id=uuid.uuid4(), qpc_id=qpc_id, metrics={"x": 1}, warnings=[], pass_times={},
                log="", created_at=utcnow()))  # fmt: skip
            start = utcnow()
            for team, age in ((a, 0), (b, 5)):
                session.execute(insert(table_of(CompileJob)).values(
                    id=uuid.uuid4(), team_id=team.id, model_id=model.id, options={},
                    options_key="k" * 64, device="aic100-standard", status="succeeded",
                    qpc_id=qpc_id, cache_hit=team is b, cancel_requested=False, attempts=1,
                    progress=1.0, created_at=start + dt.timedelta(seconds=age)))  # fmt: skip
            session.execute(insert(table_of(Validation)).values(
                id=uuid.uuid4(), team_id=b.id, qpc_id=qpc_id, qpc_sha256="b" * 64, ok=True,
                checks=[], created_at=utcnow()))  # fmt: skip
            session.execute(insert(table_of(ProfileJob)).values(
                id=uuid.uuid4(), team_id=a.id, qpc_id=qpc_id, status="queued", iterations=1,
                attempts=0, created_at=utcnow()))  # fmt: skip
            session.commit()
            a_id, b_id = a.id, b.id

        upgrade_database(db.engine)

        with db.sessions() as session:
            rows = {q.team_id: q for q in session.scalars(select(Qpc))}
            assert set(rows) == {a_id, b_id}  # the orphan is gone, the shared one split
            assert rows[a_id].id == qpc_id and rows[b_id].sha256 == "b" * 64
            by_team = {j.team_id: j.qpc_id for j in session.scalars(select(CompileJob))}
            assert by_team == {a_id: qpc_id, b_id: rows[b_id].id}
            assert session.scalars(select(Validation.qpc_id)).one() == rows[b_id].id
            assert session.scalars(select(ProfileJob.qpc_id)).one() == qpc_id  # not cascaded
            assert count(session, CompileReport) == 2
