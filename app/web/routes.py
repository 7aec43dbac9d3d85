"""The server-rendered pages at `/`: sign in, upload and compile, watch jobs, read a job's
report, download its QPC, validate it against a device and profile it (per-operator chart and
timeline).

Routes stay thin: the work is done by the same service functions the JSON API calls, and a
refusal is shown on the page as its stable code and message.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.api.deps import QueueDep, SessionDep, SettingsDep, StoreDep
from app.domain.blobs import BlobStore
from app.domain.blobs.orphans import discarded_on_refusal
from app.domain.db.models import CompileJob, ProfileJob, Team
from app.domain.db.session import unit_of_work
from app.domain.queue import Enqueuer, commit_then_enqueue
from app.domain.services import (
    compare,
    compilers,
    job_origins,
    jobs,
    models,
    profiles,
    qpcs,
    quotas,
    teams,
    validations,
    web_sessions,
)
from app.domain.services.errors import ServiceError
from app.domain.services.farm_options import farm_options
from app.domain.settings import Settings
from app.web import auth, profile_views, views
from app.web.deps import (
    FragmentJob,
    FragmentProfile,
    FragmentTeam,
    PageJob,
    PageProfile,
    PageTeam,
    find_job,
    parse_uuid,
)
from compiler_core import CompileError, CompileOptions
from compiler_core.devices import list_devices
from compiler_core.profiling.opstats import OPSTATS_LEVEL

HERE = Path(__file__).resolve().parent
STATIC_DIR = HERE / "static"
JOB_LIST_LIMIT = 50
POLL_DONE_HEADER = "X-Poll-Done"
STATS_LEVEL_DEFAULT = CompileOptions().stats_level

templates = Jinja2Templates(directory=str(HERE / "templates"))
templates.env.filters.update(views.FILTERS)
templates.env.globals.update(views.GLOBALS)

router = APIRouter(include_in_schema=False)

FormStr = Annotated[str, Form()]


# ------------------------------------------------------------------------------ helpers


def render(
    request: Request, name: str, context: dict[str, Any], status_code: int = 200
) -> HTMLResponse:
    full = {"csrf": auth.csrf_token(request), "team": None, **context}
    response = templates.TemplateResponse(request, name, full, status_code=status_code)
    auth.remember_csrf(request, response)
    return response


def problem(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"code": code, "message": message, **extra}


def csrf_refused() -> dict[str, Any]:
    return problem(
        "csrf_failed", "the form's security token did not match; reload the page and try again"
    )


def not_found_page(request: Request, team: Team, what: str, ident: str) -> HTMLResponse:
    error = problem("not_found", f"{what} {ident} not found")
    return render(request, "error.html", {"team": team, "error": error}, 404)


def team_jobs(session: Session, team: Team, show: str | None = None) -> dict[str, Any]:
    """The job list's context: the jobs of the origin `show` asks for (own by default),
    the sweep that made each sweep job, and the count of each origin."""
    listed = job_origins.list_jobs(session, team, job_origins.origin_of(show), limit=JOB_LIST_LIMIT)
    return {
        "jobs": listed.jobs,
        "sweep_of": listed.sweep_of,
        "origin": listed.origin,
        "counts": listed.counts,
    }


def compile_flags(flags: str, cores: str, fp16: bool, device: str) -> list[str]:
    """The form as qaic-compile flags: the free text first, then the common fields."""
    try:
        argv = shlex.split(flags)
    except ValueError as exc:
        raise CompileError("invalid_option", f"cannot split the flags: {exc}") from None
    if cores.strip():
        argv.append(f"-aic-num-cores={cores.strip()}")
    if fp16:
        argv.append("-convert-to-fp16")
    if device.strip():
        argv.append(f"-aic-device={device.strip()}")
    return argv


def dashboard_context(
    session: Session, team: Team, settings: Settings, show: str | None = None, **extra: Any
) -> dict[str, Any]:
    return {
        "team": team,
        **team_jobs(session, team, show),
        "devices": list_devices(),
        "compilers": offered_compilers(session, settings),
        "form": {"flags": "", "cores": "", "fp16": False, "device": "", "compiler": ""},
        **extra,
    }


def offered_compilers(session: Session, settings: Settings) -> list[dict[str, Any]]:
    """The compilers live workers have (the forms' choices besides the default), by the
    farm's own staleness window, as `GET /v1/compilers` answers."""
    return compilers.available(session, fresh_s=compilers.fresh_s(settings.stale_after_s))


# -------------------------------------------------------------------------- sign in/out


@router.get("/sign-in", response_class=HTMLResponse)
def sign_in_page(request: Request, settings: SettingsDep, next: str = "/") -> HTMLResponse:
    context = {"next": auth.safe_next(next), "key_hint": views.key_hint(settings)}
    return render(request, "sign_in.html", context)


@router.post("/sign-in", response_model=None)
def sign_in(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    api_key: FormStr = "",
    csrf: FormStr = "",
    next: FormStr = "/",
) -> Response:
    target = auth.safe_next(next)
    if not auth.csrf_ok(request, csrf):
        context = {"next": target, "error": csrf_refused(), "key_hint": views.key_hint(settings)}
        return render(request, "sign_in.html", context, 403)
    found = teams.key_for(session, api_key.strip())
    if found is None:
        session.commit()
        error = problem("unauthorized", "the API key is unknown or revoked")
        context = {"next": target, "error": error, "key_hint": views.key_hint(settings)}
        return render(request, "sign_in.html", context, 401)
    token = web_sessions.open_session(session, *found)
    session.commit()
    response = RedirectResponse(target, status_code=303)
    auth.set_session_cookie(request, response, token, settings)
    auth.rotate_csrf(response)
    return response


@router.post("/sign-out", response_model=None)
def sign_out(request: Request, session: SessionDep, csrf: FormStr = "") -> Response:
    if not auth.csrf_ok(request, csrf):
        return render(request, "error.html", {"error": csrf_refused()}, 403)
    token = request.cookies.get(auth.SESSION_COOKIE)
    if token:
        web_sessions.close_session(session, token)
        session.commit()
    response = RedirectResponse("/sign-in", status_code=303)
    response.delete_cookie(auth.SESSION_COOKIE, path="/")
    auth.rotate_csrf(response)
    return response


# ---------------------------------------------------------------------------- dashboard


@router.get("/", response_model=None)
def dashboard(
    request: Request,
    session: SessionDep,
    team: PageTeam,
    settings: SettingsDep,
    submitted: str | None = None,
    attached: str | None = None,
    show: str | None = None,
) -> Response:
    submitted_job = find_job(session, team, submitted) if submitted else None
    context = dashboard_context(
        session, team, settings, show, submitted_job=submitted_job, attached=bool(attached)
    )
    return render(request, "dashboard.html", context)


@router.get("/jobs/rows", response_model=None)
def job_rows(
    request: Request, session: SessionDep, team: FragmentTeam, show: str | None = None
) -> Response:
    """The job list's rows alone, polled by the dashboard for live status."""
    context = {"team": team, **team_jobs(session, team, show)}
    return render(request, "_job_rows.html", context)


UPLOAD_FORM: dict[str, Any] = {"requestBody": {"content": {"multipart/form-data": {}}}}
"""Marks the upload form for `request_guard` (its body may be as large as an upload)."""


@router.post("/", response_model=None, openapi_extra=UPLOAD_FORM)
def submit(
    request: Request,
    session: SessionDep,
    team: PageTeam,
    settings: SettingsDep,
    store: StoreDep,
    queue: QueueDep,
    model: Annotated[UploadFile | None, File()] = None,
    flags: FormStr = "",
    cores: FormStr = "",
    fp16: FormStr = "",
    device: FormStr = "",
    compiler: FormStr = "",
    csrf: FormStr = "",
) -> Response:
    """Upload a model and submit its compile, as `POST /v1/models` + `/v1/compile-jobs`."""
    form = {
        "flags": flags,
        "cores": cores,
        "fp16": bool(fp16),
        "device": device,
        "compiler": compiler,
    }
    if not auth.csrf_ok(request, csrf):
        context = dashboard_context(session, team, settings, form=form, error=csrf_refused())
        return render(request, "dashboard.html", context, 403)
    try:
        options = farm_options(flags=compile_flags(flags, cores, bool(fp16), device))
        if model is None or not model.filename:
            raise ServiceError("no_file", "choose an .onnx model (or a .zip/.tar of one)", 422)
        fresh = compilers.fresh_s(settings.stale_after_s)
        chosen = compilers.resolve(session, compiler or None, fresh_s=fresh)
        sessions = request.app.state.session_factory
        with discarded_on_refusal(store, sessions) as kept, unit_of_work(session):
            row = models.store_model(
                session, kept, team, model.file, model.filename,
                max_bytes=settings.max_upload_bytes, input_shapes=options.input_shapes,
            )  # fmt: skip
            job, created = jobs.submit_job(
                session, team, row, options, store=store, cache_scope=settings.cache_scope,
                compiler=chosen,
                retry_after_s=settings.quota_retry_after_s,
            )  # fmt: skip
    except (CompileError, ServiceError) as exc:
        session.rollback()
        status = exc.status if isinstance(exc, ServiceError) else 422
        context = dashboard_context(session, team, settings, form=form, error=exc.to_dict())
        page = render(request, "dashboard.html", context, status)
        if isinstance(exc, ServiceError):
            page.headers.update(exc.headers)  # a quota's Retry-After, as the API says it
        return page
    commit_then_enqueue(session, queue, jobs.to_enqueue(job, created))  # committed above
    attached = "" if created else "&attached=1"  # joined an identical job in flight
    return RedirectResponse(f"/?submitted={job.id}{attached}", status_code=303)


@router.get("/team", response_model=None)
def team_page(request: Request, session: SessionDep, team: PageTeam) -> Response:
    """The team's usage against its quotas (what `GET /v1/team` answers)."""
    described = quotas.describe(session, team)
    context = {"team": team, "usage": described["usage"], "limits": described["limits"]}
    return render(request, "team.html", context)


# ------------------------------------------------------------------------------ a job


def stats_level_of(job: CompileJob) -> int:
    """The -stats-level the job's QPC is compiled with (profiling needs OPSTATS_LEVEL)."""
    return int((job.options or {}).get("stats-level", STATS_LEVEL_DEFAULT))


def job_context(
    session: Session, team: Team, job: CompileJob, settings: Settings
) -> dict[str, Any]:
    qpc = report = None
    if job.qpc_id is not None:
        qpc = qpcs.get_qpc(session, team, job.qpc_id)
        report = qpcs.get_report(session, qpc)
    return {
        "team": team,
        "job": job,
        "qpc": qpc,
        "report": report,
        "profiles": profiles.profiles_of_qpc(session, team, qpc.id) if qpc else [],
        "metrics": views.split_metrics(report.metrics) if report else views.Metrics(),
        "pass_times": views.pass_times(report.pass_times) if report else None,
        "warning_sections": views.warning_sections(report.warnings) if report else [],
        "specialized": (report.metrics or {}).get("specializations", {}) if report else {},
        "programs": (qpc.requirements or {}).get("programs", []) if qpc else [],
        "flags": views.flags_of(job.options),
        "devices": list_devices(),
        "compilers": offered_compilers(session, settings),
        "stats_level": stats_level_of(job),
        "profile_level": OPSTATS_LEVEL,
    }


@router.get("/jobs/{job_id}", response_model=None)
def job_page(
    request: Request,
    session: SessionDep,
    team: PageTeam,
    job: PageJob,
    settings: SettingsDep,
    validation: str | None = None,
    recompiled_from: str | None = None,
    compare_with: str | None = None,
) -> Response:
    context = job_context(session, team, job, settings)
    context["recompiled_from"] = find_job(session, team, recompiled_from or "")
    context["compare_with"] = find_job(session, team, compare_with or "")
    shown = parse_uuid(validation or "")
    if shown is not None:
        try:
            context["validation"] = validations.get_validation(session, team, shown)
        except ServiceError:
            pass
    return render(request, "job.html", context)


@router.get("/jobs/{job_id}/live", response_model=None)
def job_live(
    request: Request,
    session: SessionDep,
    team: FragmentTeam,
    job: FragmentJob,
    settings: SettingsDep,
) -> Response:
    """The job page's changing part, polled while the job is queued or running."""
    response = render(request, "_job_body.html", job_context(session, team, job, settings))
    if not job.status.is_active:
        response.headers[POLL_DONE_HEADER] = "1"
    return response


def job_action(
    request: Request,
    session: Session,
    team: Team,
    job: CompileJob,
    settings: Settings,
    csrf: str,
    act: Callable[[Team, CompileJob], str],
) -> Response:
    """The common shape of a form on the job page (signed in and the team's job: the route's
    dependencies): a valid CSRF token, then `act` (which returns where to go next); a
    ServiceError it raises is shown on the job page with its status."""
    if not auth.csrf_ok(request, csrf):
        context = {**job_context(session, team, job, settings), "error": csrf_refused()}
        return render(request, "job.html", context, 403)
    try:
        target = act(team, job)
    except ServiceError as exc:
        session.rollback()
        context = {**job_context(session, team, job, settings), "error": exc.to_dict()}
        page = render(request, "job.html", context, exc.status)
        page.headers.update(exc.headers)  # a quota's Retry-After, as the API says it
        return page
    return RedirectResponse(target, status_code=303)


def _job_qpc(session: Session, team: Team, job: CompileJob, purpose: str) -> Any:
    if job.qpc_id is None:
        raise ServiceError("no_qpc", f"job {job.id} has no QPC to {purpose} yet", 409)
    return qpcs.get_qpc(session, team, job.qpc_id)


@router.post("/jobs/{job_id}/validate", response_model=None)
def validate(
    request: Request,
    session: SessionDep,
    team: PageTeam,
    job: PageJob,
    settings: SettingsDep,
    store: StoreDep,
    device: FormStr = "",
    csrf: FormStr = "",
) -> Response:
    """Validate the job's QPC against a device; the result is shown on the job page."""

    def act(team: Team, job: CompileJob) -> str:
        qpc = _job_qpc(session, team, job, "validate")
        row = validations.validate_stored_qpc(session, store, team, qpc, device.strip() or None)
        session.commit()
        return f"/jobs/{job.id}?validation={row.id}#validation"

    return job_action(request, session, team, job, settings, csrf, act)


@router.post("/jobs/{job_id}/cancel", response_model=None)
def cancel(
    request: Request,
    session: SessionDep,
    team: PageTeam,
    job: PageJob,
    settings: SettingsDep,
    csrf: FormStr = "",
) -> Response:
    def act(team: Team, job: CompileJob) -> str:
        jobs.cancel(session, team, job)
        session.commit()
        return f"/jobs/{job.id}"

    return job_action(request, session, team, job, settings, csrf, act)


def _recompile(
    session: Session,
    settings: Settings,
    store: BlobStore,
    queue: Enqueuer,
    team: Team,
    job: CompileJob,
    options: CompileOptions,
    compiler: str = "",
) -> CompileJob:
    """A new job of `job`'s model with `options` and `compiler` ("": the default), committed
    and enqueued: what the job page's recompile buttons do."""
    chosen = compilers.resolve(
        session, compiler or None, fresh_s=compilers.fresh_s(settings.stale_after_s)
    )
    new, created = jobs.submit_job(
        session, team, job.model, options, store=store, cache_scope=settings.cache_scope,
        compiler=chosen, retry_after_s=settings.quota_retry_after_s,
    )  # fmt: skip
    commit_then_enqueue(session, queue, jobs.to_enqueue(new, created))
    return new


@router.post("/jobs/{job_id}/recompile-for-profile", response_model=None)
def recompile_for_profile(
    request: Request,
    session: SessionDep,
    team: PageTeam,
    job: PageJob,
    settings: SettingsDep,
    store: StoreDep,
    queue: QueueDep,
    csrf: FormStr = "",
) -> Response:
    """The job's model and options again, at the stats level profiling needs (a QPC below it
    holds no per-operator cycles): a new job, shown on its page."""

    def act(team: Team, job: CompileJob) -> str:
        options = CompileOptions.from_json(job.options).with_(stats_level=OPSTATS_LEVEL)
        new = _recompile(session, settings, store, queue, team, job, options)
        return f"/jobs/{new.id}?recompiled_from={job.id}"

    return job_action(request, session, team, job, settings, csrf, act)


@router.post("/jobs/{job_id}/recompile", response_model=None)
def recompile_with(
    request: Request,
    session: SessionDep,
    team: PageTeam,
    job: PageJob,
    settings: SettingsDep,
    store: StoreDep,
    queue: QueueDep,
    compiler: FormStr = "",
    csrf: FormStr = "",
) -> Response:
    """The job's model and options again with another compiler (what a new version does to
    an old model): a new job, whose page links the comparison with this one."""

    def act(team: Team, job: CompileJob) -> str:
        options = CompileOptions.from_json(job.options)
        new = _recompile(session, settings, store, queue, team, job, options, compiler)
        return f"/jobs/{new.id}?compare_with={job.id}"

    return job_action(request, session, team, job, settings, csrf, act)


# ---------------------------------------------------------------------------- profiles


@router.post("/jobs/{job_id}/profile", response_model=None)
def start_profile(
    request: Request,
    session: SessionDep,
    team: PageTeam,
    job: PageJob,
    settings: SettingsDep,
    queue: QueueDep,
    iterations: FormStr = "1",
    csrf: FormStr = "",
) -> Response:
    """Profile the job's QPC on the runtime (random inputs), as `POST /v1/qpcs/{id}/profile`."""

    def act(team: Team, job: CompileJob) -> str:
        qpc = _job_qpc(session, team, job, "profile")
        profiles.check_profilable(session, qpc)  # before the iterations: the likelier refusal
        try:
            count = int(iterations.strip() or "1")
        except ValueError:
            raise ServiceError(
                "invalid_iterations", f"iterations must be a number, not {iterations!r}", 422
            ) from None
        row = profiles.submit(session, team, qpc, iterations=count)
        commit_then_enqueue(session, queue, [row.id], "profile")
        return f"/profiles/{row.id}"

    return job_action(request, session, team, job, settings, csrf, act)


def profile_context(
    session: Session, store: BlobStore, team: Team, profile: ProfileJob
) -> dict[str, Any]:
    trace = None
    if profile.trace_sha256 is not None:
        trace = json.loads(profiles.trace_bytes(store, profile))
    compile_job = session.execute(
        select(CompileJob.id)
        .where(CompileJob.team_id == team.id, CompileJob.qpc_id == profile.qpc_id)
        .order_by(CompileJob.created_at)
        .limit(1)
    ).scalar_one_or_none()
    return {
        "team": team,
        "profile": profile,
        "compile_job_id": compile_job,
        "summary": profile.summary or {},
        "chart": profile_views.operator_chart(profile.summary),
        "timeline": profile_views.timeline(trace),
    }


@router.get("/compare", response_model=None)
def compare_page(
    request: Request, session: SessionDep, team: PageTeam, a: str = "", b: str = ""
) -> Response:
    """Two compiles side by side (`a` before, `b` after: QPC or compile job ids)."""
    context: dict[str, Any] = {"team": team, "a": a, "b": b, "result": None}
    if not (a or b):
        return render(request, "compare.html", context)
    ids = [parse_uuid(a), parse_uuid(b)]
    if ids[0] is None or ids[1] is None:
        error = problem("invalid_request", "give two ids: a QPC id or a compile job id each")
        return render(request, "compare.html", {**context, "error": error}, 422)
    try:
        context["result"] = compare.compare(session, team, ids[0], ids[1])
    except ServiceError as exc:
        return render(request, "compare.html", {**context, "error": exc.to_dict()}, exc.status)
    return render(request, "compare.html", context)


@router.get("/profiles/{profile_id}", response_model=None)
def profile_page(
    request: Request, session: SessionDep, team: PageTeam, profile: PageProfile, store: StoreDep
) -> Response:
    return render(request, "profile.html", profile_context(session, store, team, profile))


@router.get("/profiles/{profile_id}/live", response_model=None)
def profile_live(
    request: Request,
    session: SessionDep,
    team: FragmentTeam,
    profile: FragmentProfile,
    store: StoreDep,
) -> Response:
    """The profile page's body, polled while the profile is queued or running."""
    context = profile_context(session, store, team, profile)
    response = render(request, "_profile_body.html", context)
    if not profile.status.is_active:
        response.headers[POLL_DONE_HEADER] = "1"
    return response


# ------------------------------------------------------------------------------ static


@router.get("/web/static/{name}", response_model=None)
def static(name: str) -> Response:
    """The pages' stylesheet (served by a route, so including the router is all it takes)."""
    files = {p.name: p for p in STATIC_DIR.iterdir() if p.is_file()}
    if name not in files:
        return Response(status_code=404)
    return FileResponse(files[name], headers={"Cache-Control": "public, max-age=300"})
