"""Who a request is from and what its body may cost, decided from its headers before the
body is read (an ASGI middleware in front of every route).

For a request that carries a body (POST, PUT, PATCH, DELETE):

1. **Authentication first.** A `/v1` request needs a known bearer key (unless the farm
   requires none); a web form needs a live session cookie (except `/sign-in`). Without one
   the answer (401 `unauthorized`; a browser's form gets the sign-in redirect) goes out at
   once: not a byte of the body is read, parsed or spooled, so an unauthenticated request
   costs what its headers cost. The caller found here is kept on the request
   (`request.state.caller`) for `deps.current_caller`.
2. **A bound on the body.** Upload routes (a multipart or octet-stream body on a route whose
   documented request body is a file) may send the upload limit plus the multipart framing;
   web forms without a file `max_form_body_bytes`; everything else (JSON)
   `max_json_body_bytes`. A Content-Length over the bound is refused before reading; a body
   without one is counted as it streams and refused when it passes the bound (413
   `body_too_large`, or `upload_too_large` for uploads).
3. **Uploads in flight per key** are bounded (`max_uploads_per_key`): one key holding many
   slow uploads open cannot take every upload thread (429 `too_many_uploads`, `Retry-After`).
4. **A body that stalls** (nothing for `body_read_timeout_s`) is dropped with 408
   `body_timeout`; the route sees its stream fail, so a half-stored upload is removed.

When the bound or the timeout strikes mid-body, the route's own answer (whatever its body
parser made of the failure) is replaced by the coded error.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import anyio
from fastapi.concurrency import run_in_threadpool
from starlette.responses import RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api import deps
from app.api.errors import (
    DATABASE_FAULTS,
    ApiError,
    error_response,
    unauthorized,
    unavailable,
    upload_too_large,
)
from app.api.uploads import MULTIPART_OVERHEAD
from app.domain.settings import Settings

log = logging.getLogger(__name__)

BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
UPLOAD_MEDIA = frozenset({"multipart/form-data", "application/octet-stream", ""})
"""Media types an upload route reads as a file (an empty type is a raw body)."""
OPEN_WEB_FORMS = frozenset({"/sign-in"})
"""Web forms that need no session (signing in is how one gets one)."""
UPLOAD_RETRY_AFTER_S = 5


def body_too_large(max_bytes: int) -> ApiError:
    return ApiError(
        "body_too_large",
        f"the request body exceeds the limit of {max_bytes:,} bytes",
        413,
        {"max_bytes": max_bytes},
    )


def body_timeout(seconds: float) -> ApiError:
    return ApiError(
        "body_timeout", f"the request body sent nothing for {seconds:g} s; it was dropped", 408
    )


def too_many_uploads(limit: int) -> ApiError:
    return ApiError(
        "too_many_uploads",
        f"this key already has {limit} uploads in flight (the limit); retry when one ends",
        429,
        {"max_uploads": limit},
        headers={"Retry-After": str(UPLOAD_RETRY_AFTER_S)},
    )


@dataclass
class UploadSlots:
    """Uploads in flight per caller (event loop only, so no lock)."""

    in_flight: Counter[str] = field(default_factory=Counter)

    def take(self, who: str, limit: int) -> bool:
        if self.in_flight[who] >= limit:
            return False
        self.in_flight[who] += 1
        return True

    def give_back(self, who: str) -> None:
        self.in_flight[who] -= 1
        if self.in_flight[who] <= 0:
            del self.in_flight[who]


def upload_slots(app: Any) -> UploadSlots:
    slots: UploadSlots | None = getattr(app.state, "upload_slots", None)
    if slots is None:
        slots = app.state.upload_slots = UploadSlots()
    return slots


def is_upload_route(route: Any) -> bool:
    """A route whose request body is a file: its (documented) body is multipart or raw."""
    extra = getattr(route, "openapi_extra", None) or {}
    content = (extra.get("requestBody") or {}).get("content") or {}
    return "multipart/form-data" in content or "application/octet-stream" in content


Patterns = list[tuple[frozenset[str], re.Pattern[str]]]


def upload_patterns(app: Any) -> Patterns:
    """(methods, path regex) of the app's upload routes, found once."""
    return _patterns(app)[1]


def body_patterns(app: Any) -> Patterns:
    """(methods, path regex) of every route that takes a body method, found once."""
    return _patterns(app)[0]


def _patterns(app: Any) -> tuple[Patterns, Patterns]:
    found: tuple[Patterns, Patterns] | None = getattr(app.state, "route_patterns", None)
    if found is None:
        routes = [
            (route, frozenset(route.methods or ()) & BODY_METHODS)
            for route in _all_routes(app.routes)
            if hasattr(route, "path_regex")
        ]
        found = (
            [(methods, route.path_regex) for route, methods in routes if methods],
            [(methods, route.path_regex) for route, methods in routes if is_upload_route(route)],
        )
        app.state.route_patterns = found
    return found


def _matches(patterns: Patterns, scope: Scope) -> bool:
    return any(
        scope["method"] in methods and pattern.match(scope["path"]) for methods, pattern in patterns
    )


def _all_routes(routes: Any) -> Iterator[Any]:
    """Every endpoint route, inside included routers too (FastAPI keeps an included router
    as one entry whose `original_router` holds its routes, their paths already prefixed)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _all_routes(inner.routes)
        else:
            yield route


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _cookie(scope: Scope, name: str) -> str | None:
    raw = _header(scope, b"cookie")
    if not raw:
        return None
    for part in raw.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value.strip().strip('"') or None
    return None


class RequestGuard:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        app = scope["app"]
        settings: Settings | None = getattr(app.state, "settings", None)
        if settings is None or not _matches(body_patterns(app), scope):
            # Not started (no lifespan), or no route takes this method here: the router's
            # 404 or 405 reads no body.
            await self.app(scope, receive, send)
            return
        try:
            who = await self._authenticate(scope, app, settings)
        except ApiError as exc:
            await error_response(exc)(scope, receive, send)
            return
        except DATABASE_FAULTS as exc:
            # The key lookup runs before any route, outside the app's exception handlers:
            # answer the same 503 a route would (a database restart is transient).
            log.error("database unavailable: %s", type(exc).__name__, exc_info=exc)
            await error_response(unavailable("database_unavailable", "database"))(
                scope, receive, send
            )
            return
        if isinstance(who, Response):
            await who(scope, receive, send)
            return
        media = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
        upload = media in UPLOAD_MEDIA and _matches(upload_patterns(app), scope)
        limit, too_large = self._bound(scope, settings, upload, media)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            await error_response(too_large)(scope, receive, send)
            return
        if not upload:
            await _Guarded(self.app, limit, too_large, settings.body_read_timeout_s)(
                scope, receive, send
            )
            return
        slots = upload_slots(app)
        if not slots.take(who, settings.max_uploads_per_key):
            await error_response(too_many_uploads(settings.max_uploads_per_key))(
                scope, receive, send
            )
            return
        try:
            await _Guarded(self.app, limit, too_large, settings.body_read_timeout_s)(
                scope, receive, send
            )
        finally:
            slots.give_back(who)

    @staticmethod
    def _bound(scope: Scope, settings: Settings, upload: bool, media: str) -> tuple[int, ApiError]:
        if upload:
            limit = settings.max_upload_bytes + MULTIPART_OVERHEAD
            return limit, upload_too_large(settings.max_upload_bytes)
        if not scope["path"].startswith("/v1/") and media in (
            "application/x-www-form-urlencoded",
            "multipart/form-data",
        ):
            return settings.max_form_body_bytes, body_too_large(settings.max_form_body_bytes)
        return settings.max_json_body_bytes, body_too_large(settings.max_json_body_bytes)

    async def _authenticate(self, scope: Scope, app: Any, settings: Settings) -> str | Response:
        """Who the request is from (a key for the per-key bounds), from its headers alone;
        ApiError 401, or the sign-in redirect of a web form, when it is nobody."""
        path: str = scope["path"]
        authorization = _header(scope, b"authorization")
        cache = deps.team_cache_of(app)
        if path.startswith("/v1/") or path == "/v1":
            scheme, _, key = (authorization or "").partition(" ")
            key = key.strip()
            if scheme.lower() == "bearer" and key:  # another scheme is no key (as HTTPBearer)
                caller = await _lookup(
                    app, cache, deps.teams.hash_key(key), deps._caller_for_key, key
                )
                if caller is None:
                    raise unauthorized("the API key is unknown or revoked")
                scope.setdefault("state", {})["caller"] = caller
                return f"key:{caller.key_id}"
            if settings.require_auth:
                raise unauthorized("an API key is required: send `Authorization: Bearer <key>`")
            return "local"
        if path in OPEN_WEB_FORMS:
            return "sign-in"
        token = _cookie(scope, deps.WEB_SESSION_COOKIE)
        if token:
            slot = f"session:{deps.web_sessions.token_hash(token)}"
            caller = await _lookup(app, cache, slot, deps._caller_for_session, token)
            if caller is not None:
                return slot
        if not settings.require_auth:
            return "local"
        if "text/html" in (_header(scope, b"accept") or ""):
            response = RedirectResponse(f"/sign-in?next={quote(path, safe='/')}", 303)
            if token:
                response.delete_cookie(deps.WEB_SESSION_COOKIE, path="/")
            return response
        raise unauthorized("sign in first: this form needs a signed-in session")


async def _lookup(app: Any, cache: deps.TeamCache, slot: str, find: Any, secret: str) -> Any:
    """The caller of a key or session: from the cache (no session, no thread hop: the
    common case), else looked up on a session of its own."""
    known = cache.get(slot)
    if known is not None:
        return known
    session = app.state.session_factory()
    try:
        return await deps._cached(cache, slot, find, session, secret)
    finally:
        await run_in_threadpool(session.close)


class _Guarded:
    """One request's body, counted and timed on its way to the app; a violation replaces
    the app's answer with its coded error."""

    def __init__(self, app: ASGIApp, limit: int, too_large: ApiError, timeout_s: float) -> None:
        self.app = app
        self.limit = limit
        self.too_large = too_large
        self.timeout_s = timeout_s
        self.received = 0
        self.body_done = False
        self.violation: ApiError | None = None
        self.started = False
        self.replaced = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def guarded_receive() -> Message:
            if self.body_done:
                return await receive()
            try:
                with anyio.fail_after(self.timeout_s):
                    message = await receive()
            except TimeoutError:
                self.violation = body_timeout(self.timeout_s)
                raise self.violation from None
            if message["type"] == "http.request":
                self.received += len(message.get("body", b""))
                if self.received > self.limit:
                    self.violation = self.too_large
                    raise self.violation
                if not message.get("more_body", False):
                    self.body_done = True
            return message

        async def guarded_send(message: Message) -> None:
            if message["type"] == "http.response.start" and self.violation is not None:
                self.replaced = True
                await error_response(self.violation)(scope, receive, send)
                return
            if self.replaced:
                return
            if message["type"] == "http.response.start":
                self.started = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if self.violation is None or self.started or self.replaced:
                raise
            self.replaced = True
            await error_response(self.violation)(scope, receive, send)
