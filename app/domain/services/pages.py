"""Limit/offset pagination for the listing functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from app.domain.services.errors import ServiceError

T = TypeVar("T")
MAX_LIMIT = 500
MAX_OFFSET = 1_000_000_000
"""Far past any real listing, and far from the 64-bit bound the databases' OFFSET has."""


@dataclass(frozen=True)
class Page(Generic[T]):
    items: list[T]
    total: int
    limit: int
    offset: int


def paginate(session: Session, query: Select[Any], limit: int, offset: int) -> Page[Any]:
    """Run `query` (already ordered) for one page, plus the total count of its rows."""
    if not 1 <= limit <= MAX_LIMIT or not 0 <= offset <= MAX_OFFSET:
        raise ServiceError(
            "bad_page", f"limit must be 1..{MAX_LIMIT} and offset 0..{MAX_OFFSET}", status=422
        )
    total = session.execute(
        select(func.count()).select_from(query.order_by(None).subquery())
    ).scalar_one()
    items = list(session.execute(query.limit(limit).offset(offset)).scalars())
    return Page(items, total, limit, offset)
