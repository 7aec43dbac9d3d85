"""A page, not JSON, for a browser that asks for a page that does not exist.

The API answers every error as JSON with a stable `code` (`app.api.errors`); a person who
types a wrong address into the browser gets the same `not_found` code and message on an HTML
page with the way back. Only a request that accepts `text/html` and lies outside the API
(`/v1`, the OpenAPI document) gets the page: API clients keep their JSON, whatever they accept.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api import errors as api_errors
from app.web import auth
from app.web.deps import PageNotFound, SignInRequired
from app.web.routes import not_found_page, problem, render

API_PREFIXES = ("/v1/", "/openapi.json", "/docs/assets/")


def wants_page(request: Request) -> bool:
    """A browser's navigation: it accepts HTML, and the path is not the API's."""
    path = request.url.path
    if path == "/v1" or path.startswith(API_PREFIXES):
        return False
    return "text/html" in request.headers.get("accept", "").lower()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404 and wants_page(request):
        error = problem("not_found", f"there is no page at {request.url.path}")
        return render(request, "error.html", {"error": error}, 404)
    return await api_errors._http_error(request, exc)


async def _sign_in_required(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SignInRequired)
    return Response(status_code=401) if exc.fragment else auth.sign_in_redirect(request)


async def _page_not_found(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, PageNotFound)
    if exc.fragment:
        return Response(status_code=404)
    return not_found_page(request, exc.team, exc.what, exc.ident)


def install_page_errors(app: FastAPI) -> None:
    """Answer a browser's 404 with a page (after `install_error_handlers`, which it wraps),
    and the pages' sign-in and ownership refusals (`app.web.deps`)."""
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(SignInRequired, _sign_in_required)
    app.add_exception_handler(PageNotFound, _page_not_found)
