"""Portable statements the ORM lacks: INSERT ... ON CONFLICT DO NOTHING on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import ColumnElement, CursorResult, Result, TextClause
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from app.domain.db.base import Base


def insert_or_ignore(
    session: Session,
    entity: type[Base],
    values: dict[str, Any],
    conflict: list[str],
    where: ColumnElement[bool] | TextClause | None = None,
) -> bool:
    """Insert one row unless one with the same `conflict` columns exists (also one being
    inserted concurrently: PostgreSQL waits for it). True if this call inserted it. With
    `where`, the conflict is with the partial unique index of that predicate.

    Get-or-create without savepoints: two workers storing the same QPC both succeed.
    """
    stmt = insert_statement(session, entity, values)
    # RETURNING, not rowcount: the ORM-level execute does not report rowcount reliably here.
    key = entity.__table__.c[conflict[0]]
    returned = session.execute(
        stmt.on_conflict_do_nothing(index_elements=conflict, index_where=where).returning(key)
    ).first()
    return returned is not None


def insert_statement(
    session: Session, entity: type[Base], values: dict[str, Any]
) -> postgresql.Insert | sqlite.Insert:
    """The dialect's INSERT of one row (it has `on_conflict_do_nothing`)."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        return postgresql.insert(entity).values(**values)
    if dialect == "sqlite":
        return sqlite.insert(entity).values(**values)
    raise NotImplementedError(f"insert_or_ignore: unsupported database {dialect!r}")


def rowcount(result: Result[Any]) -> int:
    """Rows matched by an INSERT/UPDATE/DELETE (the conditional updates' "did I win")."""
    return cast(CursorResult[Any], result).rowcount
