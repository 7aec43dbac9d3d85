"""The FastAPI application, the web face of the farm: `create_app()` wires settings, the
opened farm (database, blob store) and a job queue.

Nothing is built at import. The lifespan opens the farm (`app.domain.farm.open_farm`: waits
for the database, upgrades it with Alembic, builds the blob store), builds the job queue with
the factory it was given (the composition root `app.console.serve` passes the worker's: an
in-process worker in the embedded mode, Celery when a broker is configured) and keeps them on
`app.state` (`farm`, `settings`, `engine`, `blob_engine`, `session_factory`, `store`, `queue`);
on shutdown it closes the queue it built and the farm. A queue passed in is the caller's to
close. The web face never imports the worker.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio.to_thread
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from app.api import (
    compare,
    compile_jobs,
    keys,
    meta,
    models,
    profiles,
    qpcs,
    sweeps,
    team,
    validations,
)
from app.api.errors import install_error_handlers
from app.api.openapi import complete
from app.api.request_guard import RequestGuard
from app.api.schemas import OPTIONS_SCHEMA_NAME
from app.domain.settings import Settings, get_settings
from app.security_headers import SecurityHeaders
from app.web import docs as web_docs
from app.web import router as web_router
from app.web.errors import install_page_errors
from compiler_core.version import COMPILER_VERSION

if TYPE_CHECKING:
    from app.domain.queue import JobQueue, QueueFactory

DESCRIPTION = """\
An ONNX -> QPC compile farm. Upload a model, submit a compile job with `qaic-compile` options
(as JSON or as flags), poll it, download the QPC, validate it against a device profile and
profile it on the runtime (opstats summary and trace).

Every `/v1` route needs `Authorization: Bearer <team API key>`. Errors are JSON
`{"code", "message", ...}` with a stable `code`.
"""


def create_app(
    settings: Settings | None = None,
    *,
    queue: JobQueue | None = None,
    queue_factory: QueueFactory | None = None,
) -> FastAPI:
    """The API app. `settings` default to the environment's (`get_settings()`, read at
    start-up). The jobs go to `queue` (the caller's: tests, embedding), or to the queue
    `queue_factory` builds at start-up for the opened farm (and closes at shutdown)."""
    if queue is None and queue_factory is None:
        raise ValueError(
            "create_app needs a job queue: pass queue= or queue_factory= "
            "(app.console.serve.create_farm_app passes the worker's)"
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        resolved = settings or get_settings()
        await anyio.to_thread.run_sync(_start, app, resolved, queue, queue_factory)
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(_stop, app, queue is None)

    app = FastAPI(
        title="qpcfarm",
        version=COMPILER_VERSION,
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,  # served by app.web.docs from local assets (no CDN)
        redoc_url=None,
    )
    install_error_handlers(app)
    install_page_errors(app)  # a browser's 404 is a page; the API's stay JSON
    app.add_middleware(RequestGuard)  # inside SecurityHeaders: its answers get them too
    app.add_middleware(SecurityHeaders)
    for router in (
        models.router,
        compile_jobs.router,
        qpcs.router,
        compare.router,
        profiles.router,
        validations.router,
        sweeps.router,
        keys.router,
        team.router,
        meta.router,
        meta.health_router,
        web_router,
        web_docs.router,
    ):
        app.include_router(router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _start(
    app: FastAPI, settings: Settings, queue: JobQueue | None, factory: QueueFactory | None
) -> None:
    from app.domain.farm import open_farm
    from app.domain.services import describer
    from app.domain.services.limits import check_limits

    describer.configure(check_limits(settings))  # the upload checkers' limits
    farm = open_farm(settings, migrate=True)
    if queue is None:
        assert factory is not None
        queue = factory(settings, farm.sessions, farm.store)
    app.state.farm = farm
    app.state.settings = settings
    app.state.engine = farm.engine
    app.state.blob_engine = farm.blob_engine
    app.state.session_factory = farm.sessions
    app.state.store = farm.store
    app.state.queue = queue


def _stop(app: FastAPI, owns_queue: bool) -> None:
    from app.domain.services import describer

    try:
        if owns_queue:
            app.state.queue.close()
    finally:
        describer.shutdown()
        app.state.farm.close()


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The generated schema plus the compiler's options schema, which `JobCreate.options`
    references as `#/components/schemas/CompileOptions`."""
    if app.openapi_schema is None:
        from compiler_core.options import options_json_schema

        schema = get_openapi(
            title=app.title,
            version=app.version,
            description=app.description,
            routes=app.routes,
        )
        schema.setdefault("components", {}).setdefault("schemas", {})[OPTIONS_SCHEMA_NAME] = (
            options_json_schema()
        )
        app.openapi_schema = complete(schema)
    return app.openapi_schema
