"""Server-side sessions of signed-in browsers.

Signing in with an API key opens a session: the browser's cookie holds a random token (the
key never leaves the sign-in form), the database the token's sha256, the team, the key it was
opened with and an expiry. A session ends at its expiry, at sign-out, or when its key is
revoked: the lookup joins the key, and revoking deletes the key's sessions.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from app.domain.db.base import utcnow
from app.domain.db.models import ApiKey, Team, WebSession

SESSION_TTL_S = 12 * 3600
"""How long a sign-in lasts (a working day); the cookie's Max-Age is the same."""


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def open_session(session: Session, team: Team, key: ApiKey, ttl_s: int = SESSION_TTL_S) -> str:
    """A new session for a key's team; returns the token for the cookie. Caller commits."""
    token = secrets.token_urlsafe(32)
    now = utcnow()
    session.add(
        WebSession(
            token_hash=token_hash(token),
            team_id=team.id,
            api_key_id=key.id,
            created_at=now,
            expires_at=now + dt.timedelta(seconds=ttl_s),
        )
    )
    session.flush()
    return token


def session_team(session: Session, token: str) -> Team | None:
    """The team of a live session (None: unknown, expired, or its key revoked)."""
    if not 20 <= len(token) <= 100:
        return None
    return session.execute(
        select(Team)
        .join(WebSession, WebSession.team_id == Team.id)
        .join(ApiKey, ApiKey.id == WebSession.api_key_id)
        .where(
            WebSession.token_hash == token_hash(token),
            WebSession.expires_at > utcnow(),
            ApiKey.revoked_at.is_(None),
        )
    ).scalar_one_or_none()


def close_session(session: Session, token: str) -> None:
    """Sign out; also sweeps sessions that expired. Caller commits."""
    session.execute(delete(WebSession).where(WebSession.token_hash == token_hash(token)))
    session.execute(delete(WebSession).where(WebSession.expires_at <= utcnow()))
