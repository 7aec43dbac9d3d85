"""Alembic environment: runs against a connection handed in by the app, or the settings' URL.

`config.attributes["connection"]` (an open Connection) wins, then
`config.attributes["database_url"]`, then `QPCFARM_DATABASE_URL` via app.domain.settings.
"""

from __future__ import annotations

import logging.config

from alembic import context
from sqlalchemy import Connection

from app.domain.db import models  # noqa: F401  (fills Base.metadata)
from app.domain.db.base import Base
from app.domain.db.session import make_engine
from app.domain.settings import get_settings

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", False):
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    url = config.attributes.get("database_url") or get_settings().database_url
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.attributes.get("database_url") or get_settings().database_url
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
