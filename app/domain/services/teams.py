"""Teams and their bearer API keys (only a key's sha256 is stored)."""

from __future__ import annotations

import hashlib
import secrets
import uuid

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from app.domain.db.base import utcnow
from app.domain.db.models import ApiKey, Team, WebSession
from app.domain.services.errors import ServiceError, not_found

KEY_PREFIX = "qpf_"
_SHOWN_CHARS = 8
"""Characters after `qpf_` kept in clear, so people can tell their keys apart."""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_team(session: Session, name: str) -> Team:
    name = name.strip()
    if not name:
        raise ServiceError("invalid_team_name", "a team needs a name", 422)
    if get_team_by_name(session, name) is not None:
        raise ServiceError("team_exists", f"team {name!r} already exists", 409)
    team = Team(name=name)
    session.add(team)
    session.flush()
    return team


def get_team_by_name(session: Session, name: str) -> Team | None:
    return session.execute(select(Team).where(Team.name == name)).scalar_one_or_none()


def create_api_key(
    session: Session, team: Team, name: str | None = None, *, admin: bool = False
) -> tuple[str, ApiKey]:
    """A new key for `team`: returns the plaintext (shown once, never stored) and its row.
    An `admin` key may also manage the team's keys."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(
        team_id=team.id,
        key_hash=hash_key(key),
        prefix=key[: len(KEY_PREFIX) + _SHOWN_CHARS],
        name=name,
        admin=admin,
    )
    session.add(row)
    session.flush()
    return key, row


def team_for_key(session: Session, key: str) -> Team | None:
    """The team a bearer key belongs to, or None for an unknown, malformed or revoked key."""
    found = key_for(session, key)
    return None if found is None else found[0]


def key_for(session: Session, key: str) -> tuple[Team, ApiKey] | None:
    """The team and row of a live bearer key (None: unknown, malformed or revoked)."""
    if not key.startswith(KEY_PREFIX) or len(key) > 200:
        return None
    row = session.execute(
        select(Team, ApiKey)
        .join(ApiKey, ApiKey.team_id == Team.id)
        .where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None))
    ).one_or_none()
    return None if row is None else (row[0], row[1])


def list_keys(session: Session, team: Team | None = None) -> list[tuple[Team, ApiKey]]:
    """Keys (revoked ones too) of one team or of every team, oldest first."""
    query = select(Team, ApiKey).join(ApiKey, ApiKey.team_id == Team.id)
    if team is not None:
        query = query.where(ApiKey.team_id == team.id)
    rows = session.execute(query.order_by(Team.name, ApiKey.created_at, ApiKey.id)).all()
    return [(r[0], r[1]) for r in rows]


def find_key(session: Session, ident: str, team: Team | None = None) -> ApiKey:
    """A key by its id or by its shown prefix (`qpf_abcd1234`), within `team` if given:
    404 `not_found` when none matches (another team's key too), 409 `ambiguous_key` when a
    prefix matches several."""
    query = select(ApiKey)
    if team is not None:
        query = query.where(ApiKey.team_id == team.id)
    try:
        query = query.where(ApiKey.id == uuid.UUID(ident))
    except ValueError:
        query = query.where(ApiKey.prefix == ident.strip())
    found = list(session.execute(query.limit(2)).scalars())
    if not found:
        raise not_found("key", ident)
    if len(found) > 1:
        raise ServiceError("ambiguous_key", f"several keys start {ident!r}: use the key id", 409)
    return found[0]


def revoke_key(session: Session, key: ApiKey) -> ApiKey:
    """Revoke a key (again is a no-op) and end its web sessions. The caller commits; API
    processes stop accepting it within `deps.TEAM_CACHE_TTL_S`."""
    if key.revoked_at is None:
        key.revoked_at = utcnow()
    session.execute(delete(WebSession).where(WebSession.api_key_id == key.id))
    session.flush()
    return key
