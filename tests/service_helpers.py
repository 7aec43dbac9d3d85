"""Real processes for the end-to-end service tests: `qpcfarm serve` and `qpcfarm worker`
subprocesses, a fresh PostgreSQL database, a private `redis-server`, and a small HTTP client.

Every process is started in its own session (process group) and is killed with its children
when the `Processes` context ends, whatever happened. Waits poll with a deadline only so that a
broken service fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

REPO_ROOT = Path(__file__).resolve().parents[1]

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def service_env(**overrides: str) -> dict[str, str]:
    """The environment of a service process: this one without any QPCFARM_ variable, the
    repository importable, plus `overrides` (QPCFARM_... names)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QPCFARM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(overrides)
    return env


def qpcfarm_argv(*args: str) -> list[str]:
    """`qpcfarm ARGS` as the console script runs it (the entry point is `app.console.cli:main`)."""
    return [sys.executable, "-m", "app.console.cli", *args]


def wait_until(check: Callable[[], T | None], what: str, timeout: float = 45.0) -> T:
    """Poll `check` until it returns something other than None (or False)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result is not None and result is not False:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)


# ------------------------------------------------------------------------------ processes


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self) -> None:
        """SIGKILL the process and everything it started (its process group)."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(timeout=30)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


@dataclass
class Processes:
    """Starts service processes and kills every one of them on exit."""

    log_dir: Path
    started: list[Process] = field(default_factory=list)

    def start(
        self, name: str, args: list[str], env: Mapping[str, str], *, capture_stdout: bool = False
    ) -> Process:
        log = self.log_dir / f"{name}-{len(self.started)}.log"
        with open(log, "wb") as log_file:
            popen = subprocess.Popen(
                qpcfarm_argv(*args),
                env=dict(env),
                cwd=self.log_dir,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if capture_stdout else log_file,
                stderr=log_file,
                start_new_session=True,  # its own group: kill() takes the pool children too
            )
        process = Process(name, popen, log)
        self.started.append(process)
        return process

    def kill_all(self) -> None:
        for process in reversed(self.started):
            process.kill()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ({p.log})\n{p.log_text()[-4000:]}" for p in self.started)


@contextmanager
def processes(log_dir: Path) -> Iterator[Processes]:
    group = Processes(log_dir)
    try:
        yield group
    except BaseException:
        sys.stderr.write(group.logs())  # what the services said, next to the failure
        raise
    finally:
        group.kill_all()


def read_key_line(process: Process, timeout: float = 45.0) -> str:
    """The API key `qpcfarm serve` prints on its own line on a first embedded start."""
    stream = process.popen.stdout
    assert stream is not None, "start the process with capture_stdout=True"
    deadline = time.monotonic() + timeout
    buffer = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], 0.2)
        if ready:
            chunk = os.read(stream.fileno(), 4096)
            if not chunk:
                break
            buffer += chunk
            for line in buffer.decode(errors="replace").splitlines():
                if line.startswith("qpf_"):
                    return line.strip()
        elif not process.alive():
            break
    raise AssertionError(f"{process.name} printed no API key; it said:\n{process.log_text()}")


def wait_for_http(base_url: str, process: Process, timeout: float = 45.0) -> None:
    def ready() -> bool:
        if not process.alive():
            raise AssertionError(f"{process.name} exited:\n{process.log_text()}")
        try:
            return httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, f"{base_url} to answer", timeout)


def wait_for_worker(process: Process, timeout: float = 45.0) -> None:
    """Until the Celery worker logs that it consumes (`... ready.`)."""

    def ready() -> bool:
        if not process.alive():
            raise AssertionError(f"{process.name} exited:\n{process.log_text()}")
        return "ready." in process.log_text()

    wait_until(ready, f"{process.name} to be ready", timeout)


def run_cli(args: list[str], env: Mapping[str, str], cwd: Path) -> str:
    """Run `qpcfarm ARGS` to completion; its stdout (fails with its stderr)."""
    done = subprocess.run(
        qpcfarm_argv(*args), env=dict(env), cwd=cwd, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return done.stdout.decode()


# --------------------------------------------------------------------- Postgres and Redis


@contextmanager
def fresh_postgres_database(admin_url: str) -> Iterator[str]:
    """A new, empty database on the server of `admin_url`; its URL. Dropped afterwards."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"qpcfarm_e2e_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


def redis_problem() -> str | None:
    if shutil.which("redis-server") is None:
        return "redis-server is not installed"
    return None


class RedisServer:
    """A private `redis-server` on a free port (no persistence): the machine's Redis is never
    touched, and a test can stop and restart the broker under a running farm."""

    def __init__(self, work_dir: Path) -> None:
        self.port = free_port()
        self.work_dir = work_dir
        self._popen: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import redis

        log = self.work_dir / f"redis-{self.starts}.log"
        self.starts += 1
        with open(log, "wb") as out:
            self._popen = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.work_dir)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
            )  # fmt: skip
        client = redis.Redis(port=self.port, socket_timeout=1)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        try:
            wait_until(answers, f"redis-server on port {self.port}", timeout=20)
        finally:
            client.close()

    def stop(self) -> None:
        """SIGKILL: the broker vanishes with every message it held."""
        if self._popen is not None and self._popen.poll() is None:
            os.killpg(self._popen.pid, signal.SIGKILL)
            self._popen.wait(timeout=30)
        self._popen = None


@contextmanager
def redis_server(work_dir: Path) -> Iterator[RedisServer]:
    server = RedisServer(work_dir)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def postgres_binaries() -> tuple[Path, str] | None:
    """(folder of initdb/postgres, the user to run them as), or None when a private server
    cannot be started here (PostgreSQL refuses to run as root)."""
    initdb = shutil.which("initdb")
    if initdb is None:
        return None
    user = "postgres" if os.geteuid() == 0 else ""
    if user and shutil.which("runuser") is None:
        return None
    return Path(os.path.realpath(initdb)).parent, user


class PostgresServer:
    """A private PostgreSQL cluster on a free port: created with initdb, started, and crashed
    (`kill`, recovered on the next start) by the test, never the machine's own server."""

    def __init__(self) -> None:
        found = postgres_binaries()
        assert found is not None, "initdb is not installed"
        self._bin, self._user = found
        self.port = free_port()
        # A folder of its own: the server's user must reach it (pytest's tmp is root-only).
        self.home = Path(tempfile.mkdtemp(prefix="qpcfarm-pg-"))
        self.data = self.home / "pgdata"
        self.log = self.home / "postgres.log"
        self._popen: subprocess.Popen[bytes] | None = None
        self.data.mkdir()
        self._own(self.home)
        self._run([str(self._bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                   "--auth=trust", "--no-sync", "-E", "UTF8"])  # fmt: skip

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _own(self, path: Path) -> None:
        if self._user:
            shutil.chown(path, self._user)
            for inner in path.rglob("*"):
                shutil.chown(inner, self._user)

    def _argv(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", self._user, "--", *argv] if self._user else argv

    def _run(self, argv: list[str]) -> None:
        done = subprocess.run(self._argv(argv), capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode(errors="replace")

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self._popen = subprocess.Popen(
                self._argv([str(self._bin / "postgres"), "-D", str(self.data),
                            "-p", str(self.port), "-k", str(self.data),
                            "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"]),
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
            )  # fmt: skip

        def answers() -> bool:
            import psycopg

            if self._popen is not None and self._popen.poll() is not None:
                raise AssertionError(f"postgres exited:\n{self.log.read_text()[-2000:]}")
            try:
                psycopg.connect(
                    f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres",
                    connect_timeout=1,
                ).close()
                return True
            except psycopg.OperationalError:
                return False

        wait_until(answers, f"postgres on port {self.port}", timeout=60)

    def kill(self) -> None:
        """Crash the server: an immediate shutdown ends every backend at once, without a
        checkpoint, so clients lose their connections mid-statement and the next start runs
        crash recovery. (A SIGKILL would leave the postmaster's children orphaned: it leads
        a session of its own.)"""
        if self._popen is None or self._popen.poll() is not None:
            self._popen = None
            return
        subprocess.run(
            self._argv([str(self._bin / "pg_ctl"), "-D", str(self.data), "stop", "-m",
                        "immediate", "-w"]),
            capture_output=True, timeout=60,
        )  # fmt: skip
        try:
            self._popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self._popen.pid, signal.SIGKILL)
            self._popen.wait(timeout=30)
        self._popen = None


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.kill()
        shutil.rmtree(server.home, ignore_errors=True)


# ----------------------------------------------------------------------------- HTTP client


@dataclass
class Api:
    base_url: str
    key: str

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url, headers={"Authorization": f"Bearer {self.key}"}, timeout=60
        )

    def upload(self, data: bytes, name: str = "model.onnx") -> dict[str, Any]:
        with self.client() as http:
            answer = http.post("/v1/models", files={"file": (name, data)})
        assert answer.status_code == 201, answer.text
        body: dict[str, Any] = answer.json()
        return body

    def submit(self, model_id: str, options: Mapping[str, Any]) -> dict[str, Any]:
        with self.client() as http:
            answer = http.post(
                "/v1/compile-jobs", json={"model_id": model_id, "options": dict(options)}
            )
        body: dict[str, Any] = answer.json()
        # 200 for a cache hit (the QPC exists), 202 for a queued or attached job.
        assert answer.status_code == (200 if body.get("cache_hit") else 202), answer.text
        return body

    def job(self, job_id: str) -> dict[str, Any]:
        with self.client() as http:
            answer = http.get(f"/v1/compile-jobs/{job_id}")
        assert answer.status_code == 200, answer.text
        body: dict[str, Any] = answer.json()
        return body

    def wait(self, job_id: str, statuses: tuple[str, ...], timeout: float = 45.0) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            job = self.job(job_id)
            return job if job["status"] in statuses else None

        return wait_until(reached, f"job {job_id} to be {'/'.join(statuses)}", timeout)

    def download_qpc(self, qpc_id: str) -> bytes:
        with self.client() as http:
            answer = http.get(f"/v1/qpcs/{qpc_id}/download")
        assert answer.status_code == 200, answer.text
        return answer.content


# ---------------------------------------------------------------------------------- models


def slow_model(layers: int = 1000, width: int = 8, batch: int = 2) -> onnx.ModelProto:
    """A long MatMul+Tanh chain: a few seconds of compile (the compiler's time grows with the
    node count), for killing a worker mid-compile.

    Weights stay under 1 KiB each: at the time of writing, an uploaded bare `.onnx` with a
    tensor of 1 KiB or more is refused as `external_data_missing` (the importer's lazy
    weights point at the model file itself, which the upload check resolves elsewhere)."""
    rng = np.random.default_rng(0)
    inits, nodes, prev = [], [], "x"
    for i in range(layers):
        weight = (rng.standard_normal((width, width)) * 0.3).astype(np.float32)
        inits.append(numpy_helper.from_array(weight, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [prev, f"w{i}"], [f"h{i}"]))
        nodes.append(helper.make_node("Tanh", [f"h{i}"], [f"t{i}"]))
        prev = f"t{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    graph = helper.make_graph(
        nodes,
        "slow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model
