"""Request-scoped dependencies: the database session, the caller's team, and ownership.

Ownership is checked here, once: a row of another team answers 404 exactly like a missing
one, so ids of other teams' models, jobs and QPCs cannot even be probed.

Cost: FastAPI runs every plain `def` dependency in the thread pool, one hop each. The cheap
ones here are `async def` (no I/O), and a known key's team comes from `TeamCache` without
touching the database, so a route costs one hop: its own body.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from app.api.errors import unauthorized
from app.domain.blobs import BlobStore
from app.domain.db.models import CompileJob, Model, Qpc, Team
from app.domain.queue import Enqueuer
from app.domain.services import jobs, models, qpcs, teams, web_sessions
from app.domain.settings import Settings

LOCAL_TEAM = "local"
"""The team of unauthenticated requests when `require_auth` is off (a one-person setup)."""
WEB_SESSION_COOKIE = "qpcfarm_session"
"""The HttpOnly, SameSite=Strict cookie holding a signed-in browser's session token
(app.web, app.domain.services.web_sessions); never the API key itself."""

_bearer = HTTPBearer(
    auto_error=False,
    description="A team's API key: `Authorization: Bearer qpf_...` "
    "(`qpcfarm admin create-key --team NAME`).",
)
TEAM_CACHE_TTL_S = 0.5
"""How long a key's caller is remembered: a revoked key or an ended session still works for
at most this long in a process that saw it (the target is within 1 s everywhere)."""


class TeamCache:
    """Callers of recently seen keys and sessions (by sha256), for `TEAM_CACHE_TTL_S`: most
    requests then need no authentication query. Unknown keys are not remembered.

    `pending` holds the lookup in flight per slot (event loop only): when an entry expires
    under load, the requests that arrive meanwhile wait for that one lookup instead of each
    sending its own (50 clients once meant 50 thread-pool lookups every 0.5 s)."""

    def __init__(self, ttl_s: float = TEAM_CACHE_TTL_S) -> None:
        self._ttl = ttl_s
        self._teams: dict[str, tuple[float, Any]] = {}
        self._lock = threading.Lock()
        self.pending: dict[str, asyncio.Future[Any]] = {}

    def get(self, key_hash: str) -> Any:
        entry = self._teams.get(key_hash)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put(self, key_hash: str, team: Any) -> None:
        with self._lock:
            now = time.monotonic()
            if len(self._teams) > 10_000:  # keys are few; a flood of distinct ones is not kept
                self._teams = {k: v for k, v in self._teams.items() if v[0] >= now}
            self._teams[key_hash] = (now + self._ttl, team)


def team_cache(request: Request) -> TeamCache:
    """The app's cache, made on first use."""
    return team_cache_of(request.app)


def team_cache_of(app: Any) -> TeamCache:
    cache: TeamCache | None = getattr(app.state, "team_cache", None)
    if cache is None:
        cache = app.state.team_cache = TeamCache()
    return cache


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
    its rollback must not wait for a pool thread (see `app.domain.db.session.unit_of_work`)."""
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


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: a detached snapshot of the team (read its columns, don't
    add it to a session), the key's id and whether it is a team admin's."""

    team: Team
    key_id: uuid.UUID | None
    """None: the local team of a farm that requires no key, or a web session."""
    admin: bool


async def current_caller(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Caller:
    """The caller of the bearer key that came with the request (401 otherwise). A GET or
    HEAD may carry the web pages' session cookie instead (the pages' QPC download link);
    nothing that changes state is accepted on the cookie alone.

    Callers are cached for `TEAM_CACHE_TTL_S` per key or session, so a revoked key or an
    ended session stops working in every API process within that time. A request with a
    body was authenticated before its body was read (`request_guard`): its caller is kept
    on the request."""
    known: Caller | None = getattr(request.state, "caller", None)
    if known is not None:
        return known
    cache = team_cache(request)
    if credentials is not None:
        key = credentials.credentials
        found = await _cached(cache, teams.hash_key(key), _caller_for_key, session, key)
        if found is None:
            raise unauthorized("the API key is unknown or revoked")
        return found  # type: ignore[no-any-return]
    token = request.cookies.get(WEB_SESSION_COOKIE)
    if token and request.method in ("GET", "HEAD"):
        slot = f"session:{web_sessions.token_hash(token)}"
        found = await _cached(cache, slot, _caller_for_session, session, token)
        if found is not None:
            return found  # type: ignore[no-any-return]
    if not settings.require_auth:
        return await _cached(cache, f"team:{LOCAL_TEAM}", _local_caller, session)  # type: ignore[no-any-return]
    raise unauthorized("an API key is required: send `Authorization: Bearer <key>`")


CurrentCaller = Annotated[Caller, Depends(current_caller)]


async def current_team(caller: CurrentCaller) -> Team:
    return caller.team


async def _cached(cache: TeamCache, slot: str, find: Any, *args: Any) -> Any:
    caller = cache.get(slot)
    if caller is not None:
        return caller
    pending = cache.pending.get(slot)
    if pending is not None:  # the same lookup is under way for another request: share it
        await asyncio.wait([pending])
        if not pending.cancelled():
            return pending.result()
        # it failed (its request saw the error): look up for this request as usual
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    cache.pending.setdefault(slot, future)
    try:
        caller = await run_in_threadpool(find, *args)
    except BaseException:
        future.cancel()
        raise
    finally:
        if cache.pending.get(slot) is future:
            del cache.pending[slot]
    if caller is not None:
        cache.put(slot, caller)
    future.set_result(caller)
    return caller


def _caller_for_key(session: Session, key: str) -> Caller | None:
    found = teams.key_for(session, key)
    session.commit()  # end the read transaction: an upload may hold this session for minutes
    if found is None:
        return None
    team, row = found
    session.expunge(team)
    return Caller(team, row.id, row.admin)


def _caller_for_session(session: Session, token: str) -> Caller | None:
    team = web_sessions.session_team(session, token)
    session.commit()
    if team is None:
        return None
    session.expunge(team)
    return Caller(team, None, False)


def _local_caller(session: Session) -> Caller:
    team = teams.get_team_by_name(session, LOCAL_TEAM)
    if team is None:
        team = teams.create_team(session, LOCAL_TEAM)
    session.commit()
    session.expunge(team)
    return Caller(team, None, True)


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
