"""Running the API for tests: a real uvicorn server in a thread, a recording job queue, teams
with keys, and an httpx client per team."""

from __future__ import annotations

import io
import re
import socket
import tarfile
import threading
import time
import uuid
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from app.domain.settings import Settings
from app.main import create_app
from tests.conftest import _postgres_problem, postgres_url

START_TIMEOUT_S = 60.0


@dataclass
class RecordingQueue:
    """A JobQueue double: records the ids the API enqueues; runs nothing."""

    ids: list[uuid.UUID] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    closed: bool = False
    reachable: bool = True

    def enqueue(self, job_id: uuid.UUID, kind: str = "compile") -> None:
        self.ids.append(job_id)
        self.kinds.append(kind)

    def close(self) -> None:
        self.closed = True

    def ping(self) -> bool:
        return self.reachable


class LiveServer:
    """`create_app(settings, queue=...)` served by uvicorn on a free 127.0.0.1 port."""

    def __init__(self, settings: Settings, queue: RecordingQueue) -> None:
        self.settings = settings
        self.queue = queue
        self.app: FastAPI = create_app(settings, queue=queue)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the API server did not start (see the log above)")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()

    @property
    def state(self) -> Any:
        return self.app.state

    def new_key(self, team_name: str | None = None) -> str:
        """A new team (unless `team_name` exists) and a bearer key for it."""
        from app.domain.services import teams

        with self.state.session_factory() as session:
            name = team_name or f"team-{uuid.uuid4().hex[:8]}"
            team = teams.get_team_by_name(session, name) or teams.create_team(session, name)
            key, _row = teams.create_api_key(session, team)
            session.commit()
        return key

    def client(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


@contextmanager
def postgres_schema_url() -> Iterator[str]:
    """The test PostgreSQL URL aimed at a new, empty schema (dropped afterwards)."""
    from sqlalchemy import create_engine, text

    problem = _postgres_problem()
    if problem is not None:
        pytest.skip(problem)
    schema = f"qpcfarm_api_{uuid.uuid4().hex[:12]}"
    admin = create_engine(postgres_url())
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{postgres_url()}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@contextmanager
def live_server(kind: str, data_dir: Path, **overrides: Any) -> Iterator[LiveServer]:
    """A started server on SQLite ("sqlite") or on a fresh PostgreSQL schema ("postgresql")."""
    with _database_url(kind, data_dir) as url:
        settings = Settings(data_dir=data_dir, database_url=url, **overrides)
        server = LiveServer(settings, RecordingQueue()).start()
        try:
            yield server
        finally:
            server.stop()


class Servers:
    """Live servers started on first use, one per database kind, stopped together (a
    module-scoped fixture holds one)."""

    def __init__(self, tmp: pytest.TempPathFactory, **overrides: Any) -> None:
        self._tmp = tmp
        self._overrides = overrides
        self._running: dict[str, tuple[Any, LiveServer]] = {}

    def get(self, kind: str) -> LiveServer:
        if kind not in self._running:
            context = live_server(kind, self._tmp.mktemp(kind), **self._overrides)
            self._running[kind] = (context, context.__enter__())
        return self._running[kind][1]

    def close(self) -> None:
        for context, _server in self._running.values():
            context.__exit__(None, None, None)


@contextmanager
def web_client(server: LiveServer, key: str) -> Iterator[httpx.Client]:
    """A browser's view of the web pages: a client signed in with `key` (cookies kept,
    redirects not followed)."""
    with httpx.Client(base_url=server.url, follow_redirects=False, timeout=60) as browser:
        form = {"api_key": key, "csrf": form_csrf(browser, "/sign-in")}
        signed = browser.post("/sign-in", data=form)
        assert signed.status_code == 303, signed.text
        yield browser


def form_csrf(browser: httpx.Client, page: str) -> str:
    """The CSRF token of the forms on `page` (the sign-in page's before sign-in, the
    session's after)."""
    found = re.search(r'name="csrf" value="([^"]+)"', browser.get(page).text)
    assert found is not None, f"no form on {page}"
    return found.group(1)


@contextmanager
def _database_url(kind: str, data_dir: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{data_dir / 'qpcfarm.db'}"
        return
    with postgres_schema_url() as url:
        yield url


# ------------------------------------------------------------------------- upload bodies


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def zip_of_folder(folder: Path) -> bytes:
    return zip_bytes({p.name: p.read_bytes() for p in sorted(folder.iterdir())})


def tar_with_symlink(model: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        info = tarfile.TarInfo("model.onnx")
        info.size = len(model)
        archive.addfile(info, io.BytesIO(model))
        link = tarfile.TarInfo("weights.bin")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        archive.addfile(link)
    return buffer.getvalue()


def multipart_chunks(
    data: bytes, filename: str, fields: dict[str, str] | None = None, chunk: int = 64 << 10
) -> tuple[str, Iterator[bytes]]:
    """(content type, body chunks) of a multipart form sent without a Content-Length."""
    boundary = uuid.uuid4().hex
    head = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in (fields or {}).items()
    )
    head += (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()

    def chunks() -> Iterator[bytes]:
        yield head
        for start in range(0, len(data), chunk):
            yield data[start : start + chunk]
        yield tail

    return f"multipart/form-data; boundary={boundary}", chunks()


def raw_chunks(data: bytes, chunk: int = 64 << 10) -> Iterator[bytes]:
    for start in range(0, len(data), chunk):
        yield data[start : start + chunk]
