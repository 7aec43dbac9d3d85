"""The order between writing a row that names a blob and collecting the blob.

A writer stores the blob, then (in the transaction that inserts the row naming it) takes
`lock_for_write` and checks the blob is still there; the collector takes `lock_for_delete`,
checks that no row names the blob and deletes it. On PostgreSQL the locks are transaction
advisory locks on the sha256 (shared for writers, exclusive for the collector), held to the
commit: the collector either sees the writer's committed row, or deleted the blob before the
writer's check, which then stores it again (or refuses with a retry). SQLite has one writer
at a time: the collector's transaction takes the write lock first.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.orm import Session


def lock_key(sha256: str) -> int:
    """The advisory lock's signed 64-bit key: the sha256's first 16 hex digits."""
    value = int(sha256[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def _postgres(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def lock_for_write(session: Session, sha256: str) -> None:
    """Before inserting a row that names `sha256` (then check the blob exists)."""
    if _postgres(session):
        session.execute(text("SELECT pg_advisory_xact_lock_shared(:k)"), {"k": lock_key(sha256)})


def lock_for_delete(session: Session, sha256: str) -> None:
    """Before checking that no row names `sha256` and deleting its blob."""
    if _postgres(session):
        session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": lock_key(sha256)})
    else:  # SQLite: hold the database's write lock until the commit
        hold_writes(session)


def hold_writes(session: Session) -> None:
    """SQLite: begin the session's write transaction now, so that what it reads next (a
    model, a cached QPC) cannot be deleted before it writes the row naming it (SQLite reads
    outside a write transaction see no lock). PostgreSQL: nothing (rows are locked instead)."""
    if not _postgres(session):
        session.execute(text("UPDATE teams SET name = name WHERE id IS NULL"))
