"""Who a browser is: the API key in an HttpOnly cookie, and a double-submit CSRF token.

The key cookie is SameSite=Strict and HttpOnly, so other sites can neither read it nor send it
with their forms; the CSRF token (a second cookie echoed in every form) also stops a forged
post from a same-site page, and login CSRF on the sign-in form itself.
"""

from __future__ import annotations

import secrets
from urllib.parse import quote

from fastapi import Request, Response
from fastapi.responses import RedirectResponse
from sqlalchemy.orm import Session

from app.api.deps import LOCAL_TEAM, WEB_KEY_COOKIE
from app.db.models import Team
from app.services import teams
from app.settings import Settings

KEY_COOKIE = WEB_KEY_COOKIE
"""The signed-in browser's API key (the same key `Authorization: Bearer` carries); the API
accepts it on GET, so the QPC download link works from the pages."""
CSRF_COOKIE = "qpcfarm_csrf"
CSRF_FIELD = "csrf"
KEY_COOKIE_MAX_AGE_S = 30 * 24 * 3600


def web_team(request: Request, session: Session, settings: Settings) -> Team | None:
    """The team of the key cookie; with auth off, the local team; else None (sign in)."""
    key = request.cookies.get(KEY_COOKIE)
    if key:
        team = teams.team_for_key(session, key)
        session.commit()  # end the read transaction before long work
        if team is not None:
            return team
    if not settings.require_auth:
        team = teams.get_team_by_name(session, LOCAL_TEAM)
        if team is None:
            team = teams.create_team(session, LOCAL_TEAM)
        session.commit()
        return team
    return None


def sign_in_redirect(request: Request) -> RedirectResponse:
    """303 to the sign-in page, remembering where the browser wanted to go."""
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    response = RedirectResponse(f"/sign-in?next={quote(target, safe='/')}", status_code=303)
    if request.cookies.get(KEY_COOKIE):  # a revoked or unknown key: forget it
        response.delete_cookie(KEY_COOKIE, path="/")
    return response


def safe_next(target: str | None) -> str:
    """A local path to go to after sign-in (never another site: no scheme, no `//host`)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def set_key_cookie(response: Response, key: str) -> None:
    response.set_cookie(
        KEY_COOKIE,
        key,
        max_age=KEY_COOKIE_MAX_AGE_S,
        path="/",
        httponly=True,
        samesite="strict",
    )


def csrf_token(request: Request) -> str:
    """This browser's CSRF token: the cookie's, or a new one (see `remember_csrf`)."""
    token = request.cookies.get(CSRF_COOKIE)
    if token and 20 <= len(token) <= 100:
        return token
    cached: str | None = getattr(request.state, "new_csrf", None)
    if cached is None:
        cached = secrets.token_urlsafe(32)
        request.state.new_csrf = cached
    return cached


def remember_csrf(request: Request, response: Response) -> None:
    """Set the CSRF cookie when this request made a new token."""
    token: str | None = getattr(request.state, "new_csrf", None)
    if token is not None:
        response.set_cookie(CSRF_COOKIE, token, path="/", httponly=True, samesite="strict")


def csrf_ok(request: Request, submitted: str | None) -> bool:
    """Double-submit check: the form's token equals the cookie's."""
    cookie = request.cookies.get(CSRF_COOKIE)
    return bool(cookie and submitted) and secrets.compare_digest(
        str(cookie).encode(), str(submitted).encode()
    )
