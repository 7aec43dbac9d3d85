"""Who a browser is: a server-side session in an HttpOnly cookie, and a CSRF token bound to
that session (before sign-in, a double-submit cookie's).

Signing in with an API key opens a session (app.domain.services.web_sessions); the cookie holds the
session's random token, never the key. It is HttpOnly, SameSite=Strict, and Secure when the
page came over HTTPS (or the farm runs in production), so other sites can neither read it nor
send it with their forms; the CSRF token echoed in every form (an HMAC of the session's
token, new at each sign-in) also stops a forged post from a same-site page, and the
pre-sign-in cookie's token stops login CSRF on the sign-in form itself.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from urllib.parse import quote

from fastapi import Request, Response
from fastapi.responses import RedirectResponse
from sqlalchemy.orm import Session

from app.api.deps import LOCAL_TEAM, WEB_SESSION_COOKIE
from app.domain.db.models import Team
from app.domain.services import teams, web_sessions
from app.domain.settings import Settings

SESSION_COOKIE = WEB_SESSION_COOKIE
"""The signed-in browser's session token; the API accepts it on GET, so the QPC download
link works from the pages."""
CSRF_COOKIE = "qpcfarm_csrf"
CSRF_FIELD = "csrf"


def web_team(request: Request, session: Session, settings: Settings) -> Team | None:
    """The team of the session cookie; with auth off, the local team; else None (sign in)."""
    token = request.cookies.get(SESSION_COOKIE)
    if token:
        team = web_sessions.session_team(session, token)
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
    if request.cookies.get(SESSION_COOKIE):  # an ended session: forget it
        response.delete_cookie(SESSION_COOKIE, path="/")
    return response


def safe_next(target: str | None) -> str:
    """A local path to go to after sign-in (never another site: no scheme, no `//host`)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def secure_cookies(request: Request, settings: Settings) -> bool:
    """Cookies are `Secure` when the page came over HTTPS (directly, or by a trusted TLS
    proxy's X-Forwarded-Proto), and always in production."""
    return request.url.scheme == "https" or settings.environment == "production"


def set_session_cookie(
    request: Request, response: Response, token: str, settings: Settings
) -> None:
    response.set_cookie(
        SESSION_COOKIE,
        token,
        max_age=web_sessions.SESSION_TTL_S,
        path="/",
        httponly=True,
        samesite="strict",
        secure=secure_cookies(request, settings),
    )


def csrf_token(request: Request) -> str:
    """The CSRF token of this browser's forms. Signed in: derived from the session's token
    (`session_csrf`), so it is bound to that session and changes at every sign-in. Before
    sign-in (the sign-in form itself, or a farm without auth): the double-submit cookie's
    token, or a new one (see `remember_csrf`)."""
    session_token = _session_token(request)
    if session_token is not None:
        return session_csrf(session_token)
    token = request.cookies.get(CSRF_COOKIE)
    if token and 20 <= len(token) <= 100:
        return token
    cached: str | None = getattr(request.state, "new_csrf", None)
    if cached is None:
        cached = secrets.token_urlsafe(32)
        request.state.new_csrf = cached
    return cached


def session_csrf(session_token: str) -> str:
    """A session's CSRF token: an HMAC of its (secret, HttpOnly) token. Another page cannot
    compute it, one session's token is refused in another, and knowing it reveals nothing
    of the session token."""
    digest = hmac.new(session_token.encode(), b"qpcfarm-csrf-v1", hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def _session_token(request: Request) -> str | None:
    token = request.cookies.get(SESSION_COOKIE)
    return token if token and 20 <= len(token) <= 100 else None


def remember_csrf(request: Request, response: Response) -> None:
    """Set the CSRF cookie when this request made a new token."""
    token: str | None = getattr(request.state, "new_csrf", None)
    if token is not None:
        response.set_cookie(
            CSRF_COOKIE,
            token,
            path="/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )


def rotate_csrf(response: Response) -> None:
    """At sign-in and sign-out: the pre-sign-in token is dropped (the signed-in forms carry
    the session's own, and the next sign-in form gets a new one)."""
    response.delete_cookie(CSRF_COOKIE, path="/")


def csrf_ok(request: Request, submitted: str | None) -> bool:
    """The form's token is this browser's: the session's while signed in, else the
    double-submit cookie's."""
    session_token = _session_token(request)
    expected = session_csrf(session_token) if session_token else request.cookies.get(CSRF_COOKIE)
    return bool(expected and submitted) and secrets.compare_digest(
        str(expected).encode(), str(submitted).encode()
    )
