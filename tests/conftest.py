"""Shared fixtures: the two deployment modes' databases and blob stores, and small factories.

Every test that asks for `farm` (or `session`, `team`) runs twice: "embedded" (SQLite in
tmp_path + filesystem blob store) and "farm" (PostgreSQL + database blob store). Each test
gets its own database: a new SQLite file, or a uniquely named schema of the `test` database
at QPCFARM_TEST_POSTGRES_URL, dropped afterwards. So tests are isolated and may commit freely,
as workers do.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

if TYPE_CHECKING:  # app modules are imported lazily: other test files need no database
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session, sessionmaker

    from app.domain.blobs import BlobStore
    from app.domain.db.models import Team
    from tests.api_helpers import LiveServer, Servers
    from tests.service_helpers import RedisServer

POSTGRES_URL_ENV = "QPCFARM_TEST_POSTGRES_URL"
DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def postgres_url() -> str:
    return os.environ.get(POSTGRES_URL_ENV, DEFAULT_POSTGRES_URL)


@cache
def _postgres_problem() -> str | None:
    """Why PostgreSQL cannot be used (None when it answers)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(postgres_url(), connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001 - any failure means: no server to test on
        return f"PostgreSQL at {postgres_url()} unavailable: {exc}"
    finally:
        engine.dispose()
    return None


# ------------------------------------------------------------------------------ databases


@dataclass
class TestDatabase:
    kind: str  # "sqlite" | "postgresql"
    url: str
    engine: Engine
    sessions: sessionmaker[Session]


@contextmanager
def empty_database(kind: str, tmp_path: Path) -> Iterator[TestDatabase]:
    """A database with no tables: a new SQLite file, or a new PostgreSQL schema."""
    from sqlalchemy import text

    from app.domain.db.session import make_engine, make_session_factory

    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'qpcfarm-test.db'}"
        engine = make_engine(url)
        try:
            yield TestDatabase(kind, url, engine, make_session_factory(engine))
        finally:
            engine.dispose()
        return

    problem = _postgres_problem()
    if problem is not None:
        pytest.skip(problem)
    url = postgres_url()
    schema = f"qpcfarm_test_{uuid.uuid4().hex[:12]}"
    admin = make_engine(url)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine = make_engine(url, connect_args={"options": f"-csearch_path={schema}"})
    try:
        yield TestDatabase(kind, url, engine, make_session_factory(engine))
    finally:
        engine.dispose()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@contextmanager
def ready_database(kind: str, tmp_path: Path) -> Iterator[TestDatabase]:
    """An empty database with the models' tables created."""
    from app.domain.db import models  # noqa: F401 - registers the tables
    from app.domain.db.base import Base

    with empty_database(kind, tmp_path) as db:
        Base.metadata.create_all(db.engine)
        yield db


# ----------------------------------------------------------------------------- blob stores


@dataclass
class Farm:
    """A database and the blob store its deployment mode uses: "embedded" is SQLite with
    the filesystem store, "farm" is PostgreSQL with the database store."""

    mode: str
    db: TestDatabase
    store: BlobStore

    def session(self) -> Session:
        return self.db.sessions()


@pytest.fixture(params=["embedded", "farm"])
def farm(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Farm]:
    from app.domain.blobs.database import DatabaseBlobStore
    from app.domain.blobs.filesystem import FilesystemBlobStore

    kind = "sqlite" if request.param == "embedded" else "postgresql"
    with ready_database(kind, tmp_path) as db:
        if request.param == "embedded":
            store: BlobStore = FilesystemBlobStore(tmp_path / "blobs")
        else:
            store = DatabaseBlobStore(db.sessions)
        yield Farm(request.param, db, store)


@pytest.fixture
def session(farm: Farm) -> Iterator[Session]:
    """A session on the farm's database (tests may commit: the database is theirs)."""
    s = farm.session()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(params=["filesystem", "database-sqlite", "database-postgresql"])
def blob_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlobStore]:
    """Each blob store; the database store on both databases."""
    from app.domain.blobs.database import DatabaseBlobStore
    from app.domain.blobs.filesystem import FilesystemBlobStore

    if request.param == "filesystem":
        yield FilesystemBlobStore(tmp_path / "blobs")
        return
    with ready_database(request.param.split("-")[1], tmp_path) as db:
        yield DatabaseBlobStore(db.sessions)


def corrupt_blob(store: BlobStore, sha256: str, offset: int = -1) -> None:
    """Flip one byte of a stored blob in place (a disk or a database going bad), at `offset`
    (negative: from the end)."""
    from sqlalchemy import select, update

    from app.domain.blobs.database import DatabaseBlobStore
    from app.domain.blobs.filesystem import FilesystemBlobStore
    from app.domain.db.models import BlobChunk

    if isinstance(store, FilesystemBlobStore):
        path = store.root / sha256[:2] / sha256[2:]
        data = bytearray(path.read_bytes())
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))
        return
    assert isinstance(store, DatabaseBlobStore)
    size = store.size(sha256)
    seq, at = divmod(offset % size, 1 << 20)
    with store._sessions() as session:
        where = (BlobChunk.sha256 == sha256, BlobChunk.seq == seq)
        chunk = bytearray(session.execute(select(BlobChunk.data).where(*where)).scalar_one())
        chunk[at] ^= 0xFF
        session.execute(update(BlobChunk).where(*where).values(data=bytes(chunk)))
        session.commit()


# ---------------------------------------------------------------------------- live servers


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """One live server per database kind for a module's tests (a module that needs other
    settings overrides this fixture with its own `Servers(tmp_path_factory, **overrides)`)."""
    from tests.api_helpers import Servers

    running = Servers(tmp_path_factory)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def server(request: pytest.FixtureRequest, servers: Servers) -> LiveServer:
    """A live server: each test runs on SQLite + filesystem and on PostgreSQL + database
    blobs."""
    return servers.get(request.param)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own (the machine's Redis is never restarted or flushed)."""
    from tests.service_helpers import redis_problem, redis_server

    problem = redis_problem()
    if problem is not None:
        pytest.skip(problem)
    with redis_server(tmp_path) as running:
        yield running


# ------------------------------------------------------------------------------- factories


def make_team(session: Session, name: str | None = None) -> Team:
    from app.domain.services import teams

    return teams.create_team(session, name or f"team-{uuid.uuid4().hex[:8]}")


def tiny_model(scale: float = 0.1, batch: int | str = 2) -> onnx.ModelProto:
    """y = Relu(x @ W + b), x: float[batch, 4]; `scale` changes the weights (and the bytes)."""
    weights = numpy_helper.from_array(
        (np.arange(12, dtype=np.float32).reshape(4, 3) * scale).astype(np.float32), "W"
    )
    bias = numpy_helper.from_array(np.ones(3, dtype=np.float32), "b")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"]),
            helper.make_node("Add", ["h", "b"], ["z"]),
            helper.make_node("Relu", ["z"], ["y"]),
        ],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3])],
        [weights, bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def tiny_model_bytes(scale: float = 0.1) -> bytes:
    return tiny_model(scale).SerializeToString()


def external_data_model_dir(folder: Path, scale: float = 0.1) -> Path:
    """`folder/model.onnx` with its weights in `folder/weights.bin`."""
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save_model(
        tiny_model(scale),
        str(folder / "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights.bin",
        size_threshold=0,
    )
    return folder / "model.onnx"


@pytest.fixture
def team(session: Session) -> Team:
    made = make_team(session)
    session.commit()
    return made
