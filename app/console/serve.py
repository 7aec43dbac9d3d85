"""The composition root of `qpcfarm serve`: the one place that knows both the web face
(`app.main`) and the worker. It gives the web face the worker's queue (an in-process worker
in the embedded mode, Celery in the farm) and, in the farm, starts this process's reaper.

uvicorn builds the app from `create_farm_app` (its factory), in every API process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

    from app.domain.settings import Settings

APP_FACTORY = "app.console.serve:create_farm_app"
"""What uvicorn imports in each API process."""


def create_farm_app(settings: Settings | None = None) -> FastAPI:
    """The API app with the worker's queue (`worker.queues.queue_from_settings`)."""
    from app.main import create_app
    from worker.queues import queue_from_settings

    return create_app(settings, queue_factory=queue_from_settings)


def start_farm_reaper(settings: Settings) -> None:
    """Farm mode: hand out again the jobs of dead workers and lost messages from this API
    process too (workers reap as well; more reapers are harmless). In the embedded mode the
    in-process queue reaps for itself."""
    from app.domain.db.session import make_engine, make_session_factory
    from worker.queues import CeleryQueue
    from worker.reaper import start_reaper

    sessions = make_session_factory(make_engine(settings.database_url))
    start_reaper(sessions, CeleryQueue(settings, sessions), settings)
