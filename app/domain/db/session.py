"""Engines, sessions and schema upgrades, built from settings on first use (never at import)."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from app.domain.settings import get_settings

try:
    import fcntl as _fcntl
except ImportError:  # not POSIX: writers of other processes meet SQLite's busy handler
    _fcntl = None  # type: ignore[assignment]

MIGRATIONS_PACKAGE = "migrations"
"""Where `alembic.ini`, `env.py` and `versions/` live: package data of the installed wheel (or
the source tree's `migrations/`, through an editable install)."""
SQLITE_BUSY_TIMEOUT_S = 30.0
SQLITE_POOL_SIZE = 32
"""SQLite connections kept open: as many as API threads that use one at a time, so a burst
never opens (and PRAGMA-configures) connections that are thrown away on return."""
SERVER_POOL_SIZE = 10
SERVER_POOL_OVERFLOW = 30
"""PostgreSQL connections per engine: kept, and the burst on top (a request holds one while
it runs in one of the API's ~40 pool threads or 64 upload threads)."""
_WRITE_KEYWORDS = ("INSERT", "UPDATE", "DELETE", "REPLACE", "CREATE", "DROP", "ALTER")


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for `url`. SQLite gets WAL, foreign keys, a busy timeout and cross-thread use
    (API threads and the in-process worker share the file), and the engine's writers take
    turns on a lock of its own (`_serialized_writes`); its folder is created."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        kwargs.setdefault("pool_pre_ping", True)
        kwargs.setdefault("pool_size", SERVER_POOL_SIZE)
        kwargs.setdefault("max_overflow", SERVER_POOL_OVERFLOW)
        return create_engine(url, **kwargs)

    if parsed.database and parsed.database != ":memory:":
        private_folder(Path(parsed.database).parent)
        private_file(Path(parsed.database))
        kwargs.setdefault("pool_size", SQLITE_POOL_SIZE)
        kwargs.setdefault("max_overflow", SQLITE_POOL_SIZE)
    lock_file = None
    if parsed.database and parsed.database != ":memory:":
        lock_file = Path(f"{parsed.database}-writer.lock")
    connect_args: dict[str, Any] = {
        "check_same_thread": False,
        "timeout": SQLITE_BUSY_TIMEOUT_S,
        "factory": _serialized_writes(WriterLock(lock_file)),
    }
    connect_args.update(kwargs.pop("connect_args", {}))
    engine = create_engine(url, connect_args=connect_args, **kwargs)

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    return engine


PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_folder(path: Path) -> None:
    """Create `path` (and missing parents) readable by this user only; a folder that was
    already there keeps its mode (it may be the user's own, like the current folder)."""
    if path.is_dir():
        return
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path, PRIVATE_DIR_MODE)  # mkdir's mode is narrowed by the umask, never widened


def private_file(path: Path) -> None:
    """The embedded database file created 0600 before SQLite opens it (SQLite gives its
    `-wal` and `-shm` files the database's mode), or narrowed to 0600 if it exists."""
    if str(path).startswith("file:"):  # a SQLite URI: its own options decide
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE_MODE)
        try:
            os.fchmod(fd, PRIVATE_FILE_MODE)
        finally:
            os.close(fd)
        for suffix in ("-wal", "-shm"):
            sidecar = Path(f"{path}{suffix}")
            if sidecar.exists():
                os.chmod(sidecar, PRIVATE_FILE_MODE)
    except OSError:  # read-only, or another user's file: SQLite reports what it can't do
        return


class WriterLock:
    """The turn of one SQLite writer: a thread lock, and for a database file an exclusive
    `flock` on `<database>-writer.lock`, which every process opening the file takes too (the
    embedded mode's job processes, `serve --workers N`, the CLI).

    Only the thread holding the thread lock waits for the file lock, polling it every
    `POLL_S`: a handover across processes costs at most that, where SQLite's busy handler
    sleeps up to 100 ms a retry. A process that dies holding it releases it (the kernel
    drops the lock with the file). The file descriptor is opened per process (a forked child
    reopens it: an inherited descriptor would share the parent's lock, not exclude it).
    """

    POLL_S = 0.0005

    def __init__(self, path: Path | None) -> None:
        self._thread = threading.Lock()
        self._path = path if _fcntl is not None else None
        self._fd: int | None = None
        self._pid = 0

    def acquire(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        if not self._thread.acquire(timeout=timeout):
            return False
        if self._path is None:
            return True
        try:
            fd = self._file()
            while True:
                try:
                    _fcntl.flock(fd, _fcntl.LOCK_EX | _fcntl.LOCK_NB)  # type: ignore[union-attr]
                    return True
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        self._thread.release()
                        return False
                    time.sleep(self.POLL_S)
        except OSError:  # no lock file (a read-only folder): SQLite's own lock still holds
            return True

    def release(self) -> None:
        try:
            if self._fd is not None and self._pid == os.getpid():
                _fcntl.flock(self._fd, _fcntl.LOCK_UN)  # type: ignore[union-attr]
        finally:
            self._thread.release()

    def _file(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            assert self._path is not None
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._pid = os.getpid()
        return self._fd


def _serialized_writes(lock: WriterLock) -> type[sqlite3.Connection]:
    """A sqlite3 connection class whose write transactions hold `lock` (one per engine) from
    their first write statement to their commit or rollback.

    SQLite admits one writer at a time; a second one waits in SQLite's busy handler, which
    polls with sleeps of up to 100 ms, so under a burst of submits most of the latency was
    sleeping on a lock that had long been free. Taking turns on `WriterLock` hands the write
    over the moment the previous one ends, within the process and across the processes on the
    same file. A writer that waited `SQLITE_BUSY_TIMEOUT_S` for the lock goes on to SQLite's.
    """

    class SerializedWritesConnection(sqlite3.Connection):
        _holding = False

        def cursor(self, factory: Any = None) -> Any:
            return super().cursor(factory or SerializedWritesCursor)

        def before_statement(self, sql: str) -> None:
            if not self._holding and sql.lstrip()[:7].upper().startswith(_WRITE_KEYWORDS):
                self._holding = lock.acquire(timeout=SQLITE_BUSY_TIMEOUT_S)

        def after_statement(self) -> None:
            if self._holding and not self.in_transaction:  # autocommitted (DDL, PRAGMA)
                self._release()

        def _release(self) -> None:
            if self._holding:
                self._holding = False
                lock.release()

        def commit(self) -> None:
            try:
                super().commit()
            finally:
                self._release()

        def rollback(self) -> None:
            try:
                super().rollback()
            finally:
                self._release()

        def close(self) -> None:
            try:
                super().close()
            finally:
                self._release()

    class SerializedWritesCursor(sqlite3.Cursor):
        connection: SerializedWritesConnection

        def execute(self, sql: str, parameters: Any = (), /) -> Any:
            self.connection.before_statement(sql)
            try:
                return super().execute(sql, parameters)
            finally:
                self.connection.after_statement()

        def executemany(self, sql: str, parameters: Any, /) -> Any:
            self.connection.before_statement(sql)
            try:
                return super().executemany(sql, parameters)
            finally:
                self.connection.after_statement()

    return SerializedWritesConnection


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    # expire_on_commit=False: rows stay readable after the worker's commits and in responses.
    return sessionmaker(engine, expire_on_commit=False)


@lru_cache
def get_engine() -> Engine:
    """The process's engine for the configured database."""
    return make_engine(get_settings().database_url)


@lru_cache
def get_session_factory() -> sessionmaker[Session]:
    return make_session_factory(get_engine())


@contextmanager
def session_scope(factory: sessionmaker[Session] | None = None) -> Iterator[Session]:
    """A session that commits when the block ends normally and rolls back when it raises."""
    session = (factory or get_session_factory())()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


@contextmanager
def unit_of_work(session: Session) -> Iterator[Session]:
    """Commit `session` when the block ends normally, roll it back when it raises: in the
    thread that ran the block.

    The rule that keeps the embedded mode from deadlocking: a write transaction begins and
    ends in one thread call. SQLite writers take turns on a lock (`_serialized_writes`); a
    transaction left open for a later thread-pool call (an upload's INSERT in its thread, its
    commit in another) holds that lock while the pool fills with writers waiting for it, and
    the commit never gets a thread.
    """
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise


def wait_for_database(url: str, timeout: float = 30.0, interval: float = 0.5) -> None:
    """Block until the database answers `SELECT 1` (start-up in compose waits for postgres).

    Raises the last connection error once `timeout` seconds have passed.
    """
    engine = make_engine(url)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                with engine.connect() as conn:
                    conn.execute(text("SELECT 1"))
                return
            except OperationalError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(interval)
    finally:
        engine.dispose()


def migrations_dir() -> Path:
    """The folder of the migrations, found through the package (never the working directory),
    so an installed farm migrates wherever it is started."""
    from importlib.resources import files

    folder = Path(str(files(MIGRATIONS_PACKAGE)))
    if not (folder / "alembic.ini").is_file() or not (folder / "versions").is_dir():
        raise RuntimeError(
            f"the migrations are missing from {folder} (alembic.ini and versions/ should be "
            "installed with the package): reinstall qpcfarm"
        )
    return folder


def alembic_config(url: str | None = None) -> Any:
    """The Alembic config of the installed `migrations/`, aimed at `url` if given."""
    from alembic.config import Config

    folder = migrations_dir()
    config = Config(str(folder / "alembic.ini"))
    config.set_main_option("script_location", str(folder))
    if url is not None:
        config.attributes["database_url"] = url
    return config


def upgrade_database(target: str | Engine, revision: str = "head") -> None:
    """Run Alembic migrations up to `revision` on a URL or an engine (start-up and
    `qpcfarm db upgrade`)."""
    if isinstance(target, str):
        engine = make_engine(target)
        try:
            _upgrade(engine, revision)
        finally:
            engine.dispose()
    else:
        _upgrade(target, revision)


def _upgrade(engine: Engine, revision: str) -> None:
    """On SQLite, foreign keys are off while migrations run (SQLite's own procedure for
    changing a table: a batch migration copies it to a new one and drops the old, and with
    foreign keys on, that drop would cascade into the rows that point at it), then checked
    before they are switched on again."""
    from alembic import command

    config = alembic_config()
    sqlite = engine.dialect.name == "sqlite"
    with engine.connect() as connection:
        if sqlite:
            connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
            connection.commit()  # no BEGIN was sent: the pragma is in force for what follows
        try:
            with connection.begin():
                config.attributes["connection"] = connection
                command.upgrade(config, revision)
                if sqlite:
                    broken = connection.exec_driver_sql("PRAGMA foreign_key_check").all()
                    if broken:
                        raise RuntimeError(f"migration left dangling references: {broken[:5]}")
        finally:
            if sqlite:
                connection.exec_driver_sql("PRAGMA foreign_keys=ON")
                connection.commit()
