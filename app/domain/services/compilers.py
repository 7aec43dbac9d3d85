"""Which compilers the farm has now: workers advertise theirs, a submit that names one is
checked against them.

A worker writes one `worker_compilers` row per compiler it has when it starts and again at
every reap (`advertise`); rows not refreshed within `fresh_s` are workers gone and are not
counted (`available`), and are deleted by the next advertise of any worker.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from app.domain import timing
from app.domain.compilers import Compiler, CompilerSpecError, parse, version_key
from app.domain.db.base import utcnow
from app.domain.db.models import WorkerCompiler
from app.domain.db.ops import insert_statement
from app.domain.services.errors import ServiceError

FRESH_FACTOR = 3.0
"""A worker's advertisement counts for this many reap intervals (it refreshes at each)."""
UNAVAILABLE = "compiler_unavailable"


def advertise_interval(stale_after_s: float) -> float:
    """How often a worker says again what it has: as often as it reaps."""
    return timing.reap_interval(stale_after_s)


def fresh_s(stale_after_s: float) -> float:
    """How long an advertisement counts: `FRESH_FACTOR` advertise intervals."""
    return FRESH_FACTOR * advertise_interval(stale_after_s)


def advertise(
    session: Session, worker: str, compilers: Iterable[Compiler], *, fresh_s: float,
    now: dt.datetime | None = None,
) -> None:  # fmt: skip
    """Record that `worker` has `compilers` now, and forget workers silent for 10x `fresh_s`.
    Commits."""
    now = now or utcnow()
    for c in compilers:
        values = {"worker": worker[:255], "backend": c.backend, "version": c.version}
        stmt = insert_statement(session, WorkerCompiler, {**values, "seen_at": now})
        session.execute(
            stmt.on_conflict_do_update(
                index_elements=["worker", "backend", "version"], set_={"seen_at": now}
            )
        )
    gone = now - dt.timedelta(seconds=10 * fresh_s)
    session.execute(delete(WorkerCompiler).where(WorkerCompiler.seen_at < gone))
    session.commit()


def withdraw(session: Session, worker: str) -> None:
    """A worker stopping: its compilers are no longer offered. Commits."""
    session.execute(delete(WorkerCompiler).where(WorkerCompiler.worker == worker[:255]))
    session.commit()


def available(
    session: Session, *, fresh_s: float, now: dt.datetime | None = None
) -> list[dict[str, Any]]:
    """`[{compiler, backend, version, workers}]` of the compilers live workers have, by
    backend then newest version first."""
    now = now or utcnow()
    rows = session.execute(
        select(WorkerCompiler.backend, WorkerCompiler.version, func.count())
        .where(WorkerCompiler.seen_at >= now - dt.timedelta(seconds=fresh_s))
        .group_by(WorkerCompiler.backend, WorkerCompiler.version)
    ).all()
    by_backend: dict[str, list[Any]] = {}
    for backend, version, count in rows:
        by_backend.setdefault(backend, []).append((version, count))
    out = []
    for backend in sorted(by_backend):
        versions = sorted(by_backend[backend], key=lambda v: version_key(v[0]), reverse=True)
        for version, count in versions:
            out.append({
                "compiler": str(Compiler(backend, version)), "backend": backend,
                "version": version, "workers": int(count),
            })  # fmt: skip
    return out


def resolve(
    session: Session, requested: str | None, *, fresh_s: float, now: dt.datetime | None = None
) -> Compiler | None:
    """The compiler a submit asked for, checked: None for none asked (the default); `backend`
    alone is its newest version a live worker has. 422 `invalid_compiler` for a malformed
    one; 409 `compiler_unavailable` naming what is available when no live worker has it."""
    if requested is None:
        return None
    try:
        backend, version = parse(requested)
    except CompilerSpecError as exc:
        raise ServiceError("invalid_compiler", str(exc), 422) from None
    offered = available(session, fresh_s=fresh_s, now=now)
    for row in offered:  # newest first within a backend
        if row["backend"] == backend and version in (None, row["version"]):
            return Compiler(backend, row["version"])
    names = [row["compiler"] for row in offered]
    raise ServiceError(
        UNAVAILABLE,
        f"no worker has compiler {requested}; available: {', '.join(names) or 'none'}",
        409,
        {"requested": requested, "available": names},
    )
