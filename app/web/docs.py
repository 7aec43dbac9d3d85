"""The API's browsable documentation, `/docs` (Swagger UI) and `/redoc` (ReDoc), served
entirely by the farm: a farm on a closed network has its API docs in the browser too.

The assets come from the pinned `fastapi-offline` package (Swagger UI 5 and ReDoc 2 as
released, nothing else of it is used) and are served under `/docs/assets/`. Each page starts its
viewer from a static script (`app/web/static/swagger-init.js`) or a tag, never an inline
script, so the pages' Content-Security-Policy needs no CDN and no `'unsafe-inline'` script.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.templating import Jinja2Templates

ASSETS_PACKAGE = "fastapi_offline"
ASSET_NAMES = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")
ASSET_CACHE = "public, max-age=86400"
"""The assets change only with the pinned package's version."""
OPENAPI_URL = "/openapi.json"

templates = Jinja2Templates(directory=str(Path(__file__).resolve().parent / "templates"))
router = APIRouter(include_in_schema=False)


def assets_dir() -> Path:
    return Path(str(files(ASSETS_PACKAGE))) / "static"


@router.get("/docs", response_class=HTMLResponse)
def swagger_ui(request: Request) -> HTMLResponse:
    context = {"title": f"{request.app.title} API", "openapi_url": OPENAPI_URL}
    return templates.TemplateResponse(request, "docs_swagger.html", context)


@router.get("/redoc", response_class=HTMLResponse)
def redoc(request: Request) -> HTMLResponse:
    context = {"title": f"{request.app.title} API", "openapi_url": OPENAPI_URL}
    return templates.TemplateResponse(request, "docs_redoc.html", context)


@router.get("/docs/assets/{name}", response_model=None)
def asset(name: str) -> Response:
    if name not in ASSET_NAMES:
        return Response(status_code=404)
    return FileResponse(assets_dir() / name, headers={"Cache-Control": ASSET_CACHE})
