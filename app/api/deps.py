"""Request-scoped dependencies: the database session, the caller's team, and ownership.

Ownership is checked here, once: a row of another team answers 404 exactly like a missing
one, so ids of other teams' models, jobs and QPCs cannot even be probed.

Cost: FastAPI runs every plain `def` dependency in the thread pool, one hop each. The cheap
ones here are `async def` (no I/O), and a known key's team comes from `TeamCache` without
touching the database, so a route costs one hop: its own body.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Protocol

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
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
TEAM_CACHE_TTL_S = 5.0
"""How long a key's team is remembered: a revoked key still works for at most this long."""


class TeamCache:
    """Teams of recently seen keys (by the key's sha256), for `TEAM_CACHE_TTL_S`: most
    requests then need no authentication query. Unknown keys are not remembered."""

    def __init__(self, ttl_s: float = TEAM_CACHE_TTL_S) -> None:
        self._ttl = ttl_s
        self._teams: dict[str, tuple[float, Team]] = {}
        self._lock = threading.Lock()

    def get(self, key_hash: str) -> Team | None:
        entry = self._teams.get(key_hash)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put(self, key_hash: str, team: Team) -> None:
        with self._lock:
            now = time.monotonic()
            if len(self._teams) > 10_000:  # keys are few; a flood of distinct ones is not kept
                self._teams = {k: v for k, v in self._teams.items() if v[0] >= now}
            self._teams[key_hash] = (now + self._ttl, team)


def team_cache(request: Request) -> TeamCache:
    """The app's cache, made on first use."""
    cache: TeamCache | None = getattr(request.app.state, "team_cache", None)
    if cache is None:
        cache = request.app.state.team_cache = TeamCache()
    return cache


class Enqueuer(Protocol):
    """What the API needs of `app.queue.JobQueue`: hand a committed job id to the workers."""

    def enqueue(self, job_id: uuid.UUID) -> None: ...


async def get_queue(request: Request) -> Enqueuer:
    queue: Enqueuer = request.app.state.queue
    return queue


async def get_settings_dep(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_store(request: Request) -> BlobStore:
    store: BlobStore = request.app.state.store
    return store


async def get_session(request: Request) -> AsyncIterator[Session]:
    """A session for this request; routes commit what they change, the rest rolls back.

    Making one does no I/O, and closing one whose route committed only drops it. A session
    left inside a transaction (a route that raised) is rolled back: on PostgreSQL in the
    thread pool (a round trip), on SQLite at once, here. A SQLite write transaction holds
    the engine's writer lock, and the pool may be full of writers waiting for that lock:
    its rollback must not wait for a pool thread (see `app.db.session.unit_of_work`)."""
    session: Session = request.app.state.session_factory()
    try:
        yield session
    finally:
        if session.in_transaction() and not request.app.state.settings.is_sqlite:
            await run_in_threadpool(session.close)
        else:
            session.close()


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
StoreDep = Annotated[BlobStore, Depends(get_store)]
SessionDep = Annotated[Session, Depends(get_session)]
QueueDep = Annotated[Enqueuer, Depends(get_queue)]


async def current_team(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Team:
    """The team whose bearer key came with the request (401 otherwise). A GET or HEAD may
    carry the key in the web pages' sign-in cookie instead (the pages' QPC download link);
    nothing that changes state is accepted on the cookie alone.

    The Team is a detached snapshot (read its columns, e.g. `team.id`; don't add it to a
    session): a cached one for a key seen in the last `TEAM_CACHE_TTL_S`."""
    key = credentials.credentials if credentials is not None else None
    if key is None and request.method in ("GET", "HEAD"):
        key = request.cookies.get(WEB_KEY_COOKIE)
    cache = team_cache(request)
    if key is None:
        if not settings.require_auth:
            return await _cached(cache, f"team:{LOCAL_TEAM}", _local_team, session)
        raise unauthorized("an API key is required: send `Authorization: Bearer <key>`")
    team = await _cached(cache, teams.hash_key(key), _team_for_key, session, key)
    if team is None:
        raise unauthorized("the API key is unknown or revoked")
    return team


async def _cached(cache: TeamCache, slot: str, find: Any, *args: Any) -> Any:
    team = cache.get(slot)
    if team is None:
        team = await run_in_threadpool(find, *args)
        if team is not None:
            cache.put(slot, team)
    return team


def _team_for_key(session: Session, key: str) -> Team | None:
    team = teams.team_for_key(session, key)
    session.commit()  # end the read transaction: an upload may hold this session for minutes
    if team is not None:
        session.expunge(team)
    return team


def _local_team(session: Session) -> Team:
    team = teams.get_team_by_name(session, LOCAL_TEAM)
    if team is None:
        team = teams.create_team(session, LOCAL_TEAM)
    session.commit()
    session.expunge(team)
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
