"""Teams and their bearer API keys (only a key's sha256 is stored)."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db.models import ApiKey, Team
from app.services.errors import ServiceError

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


def create_api_key(session: Session, team: Team, name: str | None = None) -> tuple[str, ApiKey]:
    """A new key for `team`: returns the plaintext (shown once, never stored) and its row."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(
        team_id=team.id,
        key_hash=hash_key(key),
        prefix=key[: len(KEY_PREFIX) + _SHOWN_CHARS],
        name=name,
    )
    session.add(row)
    session.flush()
    return key, row


def team_for_key(session: Session, key: str) -> Team | None:
    """The team a bearer key belongs to, or None for an unknown, malformed or revoked key."""
    if not key.startswith(KEY_PREFIX) or len(key) > 200:
        return None
    return session.execute(
        select(Team)
        .join(ApiKey, ApiKey.team_id == Team.id)
        .where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None))
    ).scalar_one_or_none()
