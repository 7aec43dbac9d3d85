"""Each rule of the service lives in one place and everyone reads it there (issue 22): the job
kinds' table, the worker's timing defaults, the stage names, the farm's option rules, the
pages' sign-in and ownership dependencies, commit-then-enqueue, and the reaper's name."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, get_args

import pytest
from sqlalchemy import select

from app.domain import stages, timing
from app.domain.db.models import Base, CompileJob, JobStatus, Model, Team
from app.domain.db.session import make_engine, make_session_factory
from app.domain.job_kinds import JOB_KINDS, KINDS
from app.domain.queue import JobKind, commit_then_enqueue
from app.domain.settings import Settings


def _database(tmp_path: Path) -> Any:
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    Base.metadata.create_all(engine)
    return make_session_factory(engine)


def _queued_compile(session: Any) -> CompileJob:
    """A queued compile job of a new team's model, flushed."""
    team = Team(name=f"t-{uuid.uuid4().hex[:8]}")
    session.add(team)
    session.flush()
    model = Model(
        team_id=team.id, sha256="0" * 64, size=1, name="m", kind="onnx", opset=13,
        inputs=[], outputs=[],
    )  # fmt: skip
    session.add(model)
    session.flush()
    job = CompileJob(
        team_id=team.id, model_id=model.id, options={}, options_key="k", device="aic100"
    )
    session.add(job)
    session.flush()
    return job


# ------------------------------------------------------------------------- job kinds


def test_every_job_kind_has_one_row_with_its_table_task_and_claim() -> None:
    assert set(JOB_KINDS) == set(get_args(JobKind)) == set(KINDS)
    for kind, spec in JOB_KINDS.items():
        assert spec.kind == kind
        assert spec.task_name == f"qpcfarm.{kind}"
        assert spec.doing and spec.crash_code
        assert set(spec.claim_values) <= set(spec.table.__table__.columns.keys())
    tables = [spec.table for spec in JOB_KINDS.values()]
    assert len(set(tables)) == len(tables)
    assert JOB_KINDS["compile"].cancellable and not JOB_KINDS["profile"].cancellable
    assert JOB_KINDS["compile"].claim_values["stage"] == stages.CLAIMED


def test_the_worker_runs_every_kind_and_its_tasks_and_queue_read_the_table() -> None:
    from worker.celery_app import TASK_NAMES
    from worker.runner import RUNS

    assert set(RUNS) == set(JOB_KINDS)
    assert TASK_NAMES == {kind: spec.task_name for kind, spec in JOB_KINDS.items()}


def test_the_runner_claims_every_kind_through_the_table(tmp_path: Path) -> None:
    """A claim sets what the kind's row says (a compile starts at stage `claimed`), and
    `kind_of` finds a job's kind from its table."""
    from worker import claims
    from worker.runner import kind_of

    sessions = _database(tmp_path)
    with sessions() as session:
        job = _queued_compile(session)
        session.commit()
        assert kind_of(session, job.id) == "compile"
        claimed = claims.claim_job(session, "compile", job.id, "w")
        assert isinstance(claimed, CompileJob) and claimed.status == JobStatus.running
        assert (claimed.stage, claimed.progress) == (stages.CLAIMED, 0.0)
        assert claims.claim_job(session, "compile", job.id, "other") is None


# ------------------------------------------------------------------ timing and stages


def test_the_settings_defaults_are_the_timing_constants() -> None:
    settings = Settings(data_dir=Path("unused"))
    assert settings.heartbeat_s == timing.HEARTBEAT_S
    assert settings.stale_after_s == timing.STALE_AFTER_S
    assert settings.requeue_after_s == timing.REQUEUE_AFTER_S
    assert settings.job_time_limit_s == timing.JOB_TIME_LIMIT_S


@pytest.mark.parametrize(("stale", "interval"), [(60.0, 20.0), (1.0, 1.0), (600.0, 30.0)])
def test_the_reaper_runs_a_third_of_the_stale_threshold_within_1_to_30_s(
    stale: float, interval: float
) -> None:
    from worker.reaper import reap_interval

    assert timing.reap_interval(stale) == interval
    assert reap_interval(Settings(data_dir=Path("unused"), stale_after_s=stale)) == interval


def test_the_service_stages_have_words_and_end_states_are_named_once() -> None:
    for stage in (stages.CLAIMED, stages.DONE, stages.CANCELLED):
        assert stages.STAGE_WORDS[stage]
    assert stages.describe_stage("cancelled", stages.CANCELLED) == "cancelled"
    assert stages.describe_stage("failed", stages.DONE) == "failed"


def test_every_stage_a_compile_reports_has_words_on_the_pages(tmp_path: Path) -> None:
    """The pages and `qpcfarm submit` show `STAGE_WORDS`; a stage the compiler reports that
    is missing there would show as its raw name."""
    from compiler_core import compile_model
    from tests.conftest import tiny_model

    reported: list[str] = []
    result = compile_model(
        tiny_model().SerializeToString(),
        [f"-aic-binary-dir={tmp_path / 'out'}"],
        progress=lambda stage, _fraction: reported.append(stage),
    )
    assert result.qpc_path
    assert reported and set(reported) <= set(stages.STAGE_WORDS), set(reported)


# ----------------------------------------------------------------------- option rules


def test_the_farm_reads_its_option_rules_from_the_compilers_option_spec() -> None:
    """Which options the farm refuses and which name a file in the model's upload are flags
    on the compiler's option declarations; the service keeps no list of its own."""
    from app.domain.services import farm_options
    from compiler_core.options import LOCAL_ONLY_OPTIONS, MODEL_FILE_OPTIONS

    local_only = {spec.attr for spec in LOCAL_ONLY_OPTIONS}
    assert {"model", "aic_binary_dir", "operators_supported"} <= local_only
    assert set(farm_options.FARM_INSTEAD) <= local_only  # only words the refusals
    assert not local_only & {spec.attr for spec in MODEL_FILE_OPTIONS}


@pytest.mark.parametrize(
    "flag", ["-m=/etc/passwd", "-aic-binary-dir=/tmp/x", "-operators-supported=onnx"]
)
def test_options_made_any_way_are_held_to_the_farm_rules(flag: str) -> None:
    """A request's flags and a sweep's compile group go through the same check."""
    from app.domain.services.farm_options import check_farm_rules, farm_options
    from compiler_core import CompileError, CompileOptions

    with pytest.raises(CompileError) as refused:
        farm_options(flags=[flag])
    assert refused.value.code == "invalid_option"
    with pytest.raises(CompileError):
        check_farm_rules(CompileOptions.from_flags([flag]))


# --------------------------------------------------------------- commit then enqueue


class _SeeingQueue:
    """Records, at each enqueue, whether another session can already read the job."""

    def __init__(self, sessions: Any) -> None:
        self.sessions = sessions
        self.seen: list[tuple[uuid.UUID, str, bool]] = []

    def enqueue(self, job_id: uuid.UUID, kind: JobKind = "compile") -> None:
        with self.sessions() as other:
            visible = other.execute(
                select(CompileJob.id).where(CompileJob.id == job_id)
            ).scalar_one_or_none()
        self.seen.append((job_id, kind, visible is not None))


def test_commit_then_enqueue_hands_over_only_committed_rows(tmp_path: Path) -> None:
    sessions = _database(tmp_path)
    queue = _SeeingQueue(sessions)
    with sessions() as session:
        job = _queued_compile(session)
        commit_then_enqueue(session, queue, [job.id, None])
    assert queue.seen == [(job.id, "compile", True)]


# ------------------------------------------------------------------ the pages' checks


def _routes(router: Any) -> list[Any]:
    """The router's routes, those of the routers it includes too."""
    from fastapi.routing import APIRoute

    found = []
    for route in router.routes:
        if isinstance(route, APIRoute):
            found.append(route)
        elif hasattr(route, "original_router"):
            found += _routes(route.original_router)
    return found


def test_every_page_of_a_team_object_gets_it_through_the_ownership_dependency() -> None:
    """No page reads a job, profile or sweep id itself: the dependency that signs in and
    checks ownership is the one place (`app.web.deps`)."""
    from app.web import deps
    from app.web import router as web_router

    owners: dict[str, set[Any]] = {
        "job_id": {deps.page_job, deps.fragment_job},
        "profile_id": {deps.page_profile, deps.fragment_profile},
        "sweep_id": {deps.page_sweep, deps.fragment_sweep},
    }
    signed_in: set[Any] = {deps.page_team, deps.fragment_team}
    public = {"/sign-in", "/sign-out", "/web/static/{name}"}
    checked = 0
    for route in _routes(web_router):
        if route.path in public:
            continue
        calls: set[Any] = {d.call for d in route.dependant.dependencies}
        assert calls & signed_in or any(
            sub.call in signed_in for d in route.dependant.dependencies for sub in d.dependencies
        ), route.path
        for param, dependencies in owners.items():
            if "{" + param + "}" in route.path:
                assert calls & dependencies, route.path
                assert param not in {p.name for p in route.dependant.path_params}, route.path
                checked += 1
    assert checked == 11  # seven job pages and forms, two profile and two sweep pages


# --------------------------------------------------------------------------- the reaper


def test_the_worker_command_keeps_the_old_no_sweep_spelling(capsys: Any) -> None:
    """`--no-reap` is the flag now; `--no-sweep` still parses (it then needs a broker, like
    the new spelling)."""
    import os

    from app.console.cli import main
    from app.domain.settings import get_settings

    saved = os.environ.pop("QPCFARM_BROKER_URL", None)
    get_settings.cache_clear()
    try:
        for flag in ("--no-reap", "--no-sweep"):
            assert main(["worker", flag]) != 0
            err = capsys.readouterr().err
            assert "no broker configured" in err and "unrecognized" not in err
    finally:
        if saved is not None:
            os.environ["QPCFARM_BROKER_URL"] = saved
        get_settings.cache_clear()
