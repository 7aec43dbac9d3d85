"""Open the farm: the database engines, the session factory and the blob store, one way for
every process that needs them (the API's start-up, a Celery worker process, the embedded
mode's job process, the console's admin commands).

Blob reads and the quarantine's record use a pool of their own (`BLOB_POOL`) when the database
is a server: a request holds a connection of the main pool while it reads a blob (a download,
a cache hit's check), and a reader waiting for a second connection of the same, exhausted
pool would wait for itself. SQLite has one engine for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine
    from sqlalchemy.orm import Session, sessionmaker

    from app.domain.blobs import BlobStore
    from app.domain.settings import Settings

BLOB_POOL: dict[str, Any] = {"pool_size": 5, "max_overflow": 20}
"""The blob engine's pool (a server database only)."""


@dataclass
class Farm:
    """What a process opened of the farm; `close()` releases the engines' connections."""

    settings: Settings
    engine: Engine
    blob_engine: Engine
    sessions: sessionmaker[Session]
    store: BlobStore

    def close(self) -> None:
        self.engine.dispose()
        if self.blob_engine is not self.engine:
            self.blob_engine.dispose()


def open_farm(settings: Settings, *, blob_root: Path | None = None, migrate: bool = False) -> Farm:
    """Engines, sessions and blob store for `settings`. `blob_root` replaces the filesystem
    store's folder (`data_dir/blobs`). With `migrate` (a server's start), the embedded mode's
    home is created private, the database awaited and upgraded with Alembic first."""
    from app.domain.blobs.factory import blob_store
    from app.domain.db.session import (
        make_engine,
        make_session_factory,
        private_folder,
        upgrade_database,
        wait_for_database,
    )

    if migrate:
        if settings.blob_store == "filesystem" or settings.is_sqlite:
            private_folder(Path(settings.data_dir))  # the embedded mode's home: 0700 when made
        wait_for_database(settings.database_url)
    engine = make_engine(settings.database_url)
    if migrate:
        upgrade_database(engine)
    blob_engine = engine if settings.is_sqlite else make_engine(settings.database_url, **BLOB_POOL)
    store = blob_store(settings, make_session_factory(blob_engine), root=blob_root)
    return Farm(settings, engine, blob_engine, make_session_factory(engine), store)
