"""Request-scoped dependencies: the database session, the caller's team, and ownership.

Ownership is checked here, once: a row of another team answers 404 exactly like a missing
one, so ids of other teams' models, jobs and QPCs cannot even be probed.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Annotated, Protocol

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from app.api.errors import unauthorized
from app.blobs import BlobStore
from app.db.models import CompileJob, Model, Qpc, Team
from app.services import jobs, models, qpcs, teams
from app.settings import Settings

LOCAL_TEAM = "local"
"""The team of unauthenticated requests when `require_auth` is off (a one-person setup)."""
WEB_KEY_COOKIE = "qpcfarm_key"
"""The HttpOnly, SameSite=Strict cookie holding a signed-in browser's API key (app.web)."""

_bearer = HTTPBearer(
    auto_error=False,
    description="A team's API key: `Authorization: Bearer qpf_...` "
    "(`qpcfarm admin create-key --team NAME`).",
)


class Enqueuer(Protocol):
    """What the API needs of `app.queue.JobQueue`: hand a committed job id to the workers."""

    def enqueue(self, job_id: uuid.UUID) -> None: ...


def get_queue(request: Request) -> Enqueuer:
    queue: Enqueuer = request.app.state.queue
    return queue


def get_settings_dep(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_store(request: Request) -> BlobStore:
    store: BlobStore = request.app.state.store
    return store


def get_session(request: Request) -> Iterator[Session]:
    """A session for this request; routes commit what they change, the rest rolls back."""
    session: Session = request.app.state.session_factory()
    try:
        yield session
    finally:
        session.close()


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
StoreDep = Annotated[BlobStore, Depends(get_store)]
SessionDep = Annotated[Session, Depends(get_session)]
QueueDep = Annotated[Enqueuer, Depends(get_queue)]


def current_team(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Team:
    """The team whose bearer key came with the request (401 otherwise). A GET or HEAD may
    carry the key in the web pages' sign-in cookie instead (the pages' QPC download link);
    nothing that changes state is accepted on the cookie alone."""
    key = credentials.credentials if credentials is not None else None
    if key is None and request.method in ("GET", "HEAD"):
        key = request.cookies.get(WEB_KEY_COOKIE)
    if key is None:
        if not settings.require_auth:
            return _local_team(session)
        raise unauthorized("an API key is required: send `Authorization: Bearer <key>`")
    team = teams.team_for_key(session, key)
    if team is None:
        raise unauthorized("the API key is unknown or revoked")
    session.commit()  # end the read transaction: an upload may hold this session for minutes
    return team


def _local_team(session: Session) -> Team:
    team = teams.get_team_by_name(session, LOCAL_TEAM)
    if team is None:
        team = teams.create_team(session, LOCAL_TEAM)
    session.commit()
    return team


CurrentTeam = Annotated[Team, Depends(current_team)]


def team_model(model_id: uuid.UUID, session: SessionDep, team: CurrentTeam) -> Model:
    return models.get_model(session, team, model_id)


def team_job(job_id: uuid.UUID, session: SessionDep, team: CurrentTeam) -> CompileJob:
    return jobs.get_job(session, team, job_id)


def team_qpc(qpc_id: uuid.UUID, session: SessionDep, team: CurrentTeam) -> Qpc:
    return qpcs.get_qpc(session, team, qpc_id)


TeamModel = Annotated[Model, Depends(team_model)]
TeamJob = Annotated[CompileJob, Depends(team_job)]
TeamQpc = Annotated[Qpc, Depends(team_qpc)]
