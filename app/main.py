"""The FastAPI application: `create_app()` wires settings, database, blob store and job queue.

Nothing is built at import. The lifespan waits for the database, upgrades it with Alembic,
builds the blob store and the job queue (`worker.queues.queue_from_settings`: an in-process worker
in the embedded mode, Celery when a broker is configured) and keeps them on `app.state`
(`settings`, `engine`, `session_factory`, `store`, `queue`); on shutdown it closes the queue
it built and disposes of the engine. A queue passed in is the caller's to close.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from app.api import (
    compile_jobs,
    keys,
    meta,
    models,
    profiles,
    qpcs,
    sweeps,
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
    from app.domain.queue import JobQueue

DESCRIPTION = """\
An ONNX -> QPC compile farm. Upload a model, submit a compile job with `qaic-compile` options
(as JSON or as flags), poll it, download the QPC, validate it against a device profile and
profile it on the runtime (opstats summary and trace).

Every `/v1` route needs `Authorization: Bearer <team API key>`. Errors are JSON
`{"code", "message", ...}` with a stable `code`.
"""


BLOB_POOL: dict[str, Any] = {"pool_size": 5, "max_overflow": 20}


def create_app(settings: Settings | None = None, *, queue: JobQueue | None = None) -> FastAPI:
    """The API app. `settings` default to the environment's (`get_settings()`, read at
    start-up); `queue` replaces the one built from settings (tests, embedding)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        resolved = settings or get_settings()
        await anyio.to_thread.run_sync(_start, app, resolved, queue)
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
        profiles.router,
        validations.router,
        sweeps.router,
        keys.router,
        meta.router,
        meta.health_router,
        web_router,
        web_docs.router,
    ):
        app.include_router(router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _start(app: FastAPI, settings: Settings, queue: JobQueue | None) -> None:
    from app.domain.blobs import blob_store_from_settings
    from app.domain.db.session import (
        make_engine,
        make_session_factory,
        private_folder,
        upgrade_database,
        wait_for_database,
    )
    from app.domain.services import describer
    from app.domain.services.limits import check_limits

    if settings.blob_store == "filesystem" or settings.is_sqlite:
        private_folder(Path(settings.data_dir))  # the embedded mode's home: 0700 when made
    describer.configure(check_limits(settings))  # the upload checkers' limits
    wait_for_database(settings.database_url)
    engine = make_engine(settings.database_url)
    upgrade_database(engine)
    session_factory = make_session_factory(engine)
    # Blob reads and the quarantine's record use a pool of their own: a request holds a
    # connection of the API's pool while it reads a blob (a download, a cache hit's check),
    # and a reader waiting for a second connection of the same, exhausted pool would wait
    # for itself.
    blob_engine = engine if settings.is_sqlite else make_engine(settings.database_url, **BLOB_POOL)
    store = blob_store_from_settings(settings, make_session_factory(blob_engine))
    if queue is None:
        from worker.queues import queue_from_settings

        queue = queue_from_settings(settings, session_factory, store)
    app.state.settings = settings
    app.state.engine = engine
    app.state.blob_engine = blob_engine
    app.state.session_factory = session_factory
    app.state.store = store
    app.state.queue = queue


def _stop(app: FastAPI, owns_queue: bool) -> None:
    from app.domain.services import describer

    try:
        if owns_queue:
            app.state.queue.close()
    finally:
        describer.shutdown()
        app.state.engine.dispose()
        app.state.blob_engine.dispose()


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
