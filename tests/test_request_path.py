"""What a request costs the API process, pinned by counts rather than by time: the database
statements of a submit, one key lookup however many requests wait for it, and an upload's
importer check done by a describer process that may die without taking the API with it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import event

from app.api.deps import TeamCache, _cached
from app.domain.services import describer
from tests.api_helpers import LiveServer, live_server
from tests.conftest import tiny_model_bytes


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server("sqlite", tmp_path_factory.mktemp("request-path")) as running:
        yield running


@pytest.fixture
def api(server: LiveServer) -> Iterator[httpx.Client]:
    with server.client(server.new_key()) as client:
        yield client


class Statements:
    """The SQL statements the API's engine runs inside a `with` block."""

    def __init__(self, server: LiveServer) -> None:
        self._engine = server.state.engine
        self.seen: list[str] = []

    def _record(self, *args: Any) -> None:
        self.seen.append(str(args[2]).split()[0].upper())

    def __enter__(self) -> Statements:
        event.listen(self._engine, "before_cursor_execute", self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self._engine, "before_cursor_execute", self._record)


def test_a_new_job_submit_is_seven_statements_and_a_commit(
    server: LiveServer, api: httpx.Client
) -> None:
    model = api.post("/v1/models", files={"file": ("m.onnx", tiny_model_bytes(0.71))}).json()
    body = {"model_id": model["id"], "flags": ["-aic-num-cores=2"]}
    api.get(f"/v1/models/{model['id']}")  # the key's team is cached now

    with Statements(server) as statements:
        answer = api.post("/v1/compile-jobs", json=body)

    assert answer.status_code == 202 and answer.json()["status"] == "queued"
    # SQLite: the model and the cache lookup before the write hold (a cached QPC's blob is
    # hashed, and a damaged one's quarantine recorded, while no write lock is held); the hold;
    # then, under it, the model, the cache lookup, the INSERT ... RETURNING of the job and the
    # lookup again (a QPC stored between the two makes the new row a cache hit instead).
    assert statements.seen == [
        *["SELECT", "SELECT"],
        "UPDATE",
        *["SELECT", "SELECT", "INSERT", "SELECT"],
    ], statements.seen


def test_a_cache_hit_reads_the_qpc_row_once(server: LiveServer, api: httpx.Client) -> None:
    from worker import compile_jobs

    model = api.post("/v1/models", files={"file": ("m.onnx", tiny_model_bytes(0.72))}).json()
    body = {"model_id": model["id"], "flags": ["-aic-num-cores=2"]}
    job = api.post("/v1/compile-jobs", json=body).json()
    with server.state.session_factory() as session:  # a worker compiles it
        claimed = compile_jobs.claim(session, uuid.UUID(job["id"]), "w")
        assert claimed is not None
        compile_jobs.run_compile(session, server.state.store, claimed)
    assert api.get(f"/v1/compile-jobs/{job['id']}").json()["status"] == "succeeded"

    with Statements(server) as statements:
        hit = api.post("/v1/compile-jobs", json=body)

    assert hit.status_code == 200 and hit.json()["cache_hit"] is True
    # SQLite, before the write hold: the model, the cache lookup, the QPC's sha256 (its blob
    # is hashed before it is handed out); the hold; under it: the model, the cache lookup, the
    # QPC row held, its sha256 (not hashed again), the INSERT ... RETURNING of the succeeded
    # job, its report.
    assert statements.seen == [
        *["SELECT", "SELECT", "SELECT"],
        "UPDATE",
        *["SELECT", "SELECT", "SELECT", "SELECT", "INSERT", "SELECT"],
    ], statements.seen


def test_requests_waiting_for_the_same_key_share_one_lookup() -> None:
    """When a key's cached team expires under load, the requests that arrive meanwhile wait
    for the one lookup in flight instead of each sending their own."""
    cache = TeamCache()
    release = threading.Event()
    calls: list[str] = []

    def find(key: str) -> str:
        calls.append(key)
        release.wait()
        return f"team of {key}"

    async def burst() -> list[Any]:
        tasks = [asyncio.create_task(_cached(cache, "slot", find, "k")) for _ in range(20)]
        while not calls:  # the first request's lookup is under way
            await asyncio.sleep(0)
        for _ in range(5):
            await asyncio.sleep(0)  # the others reach the pending lookup
        release.set()
        return await asyncio.gather(*tasks)

    answers = asyncio.run(burst())
    assert calls == ["k"] and answers == ["team of k"] * 20
    assert cache.get("slot") == "team of k" and not cache.pending


def test_a_failed_lookup_is_not_shared_as_an_answer() -> None:
    cache = TeamCache()
    attempts: list[int] = []

    def find() -> str:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("database down")
        return "team"

    async def two() -> tuple[BaseException | str, ...]:
        first = asyncio.create_task(_cached(cache, "slot", find))
        await asyncio.sleep(0)
        second = asyncio.create_task(_cached(cache, "slot", find))
        return tuple(await asyncio.gather(first, second, return_exceptions=True))

    first, second = asyncio.run(two())
    assert isinstance(first, RuntimeError) and second == "team" and len(attempts) == 2


def test_uploads_are_checked_in_a_describer_process(api: httpx.Client) -> None:
    good = api.post("/v1/models", files={"file": ("m.onnx", tiny_model_bytes(0.73))})
    assert good.status_code == 201 and good.json()["inputs"][0]["name"] == "x"
    pids = describer.checker_pids()
    assert pids and os.getpid() not in pids
    bad = api.post("/v1/models", files={"file": ("m.onnx", b"not a model")})
    assert bad.status_code == 422 and bad.json()["code"] == "invalid_model"


def test_a_describer_that_dies_is_replaced_and_the_upload_still_answers(
    api: httpx.Client,
) -> None:
    assert api.post("/v1/models", files={"file": ("m.onnx", tiny_model_bytes(0.74))}).is_success
    children = describer.checker_pids()
    assert children
    for pid in children:
        os.kill(pid, signal.SIGKILL)

    again = api.post("/v1/models", files={"file": ("m.onnx", tiny_model_bytes(0.75))})

    assert again.status_code == 201, again.text
    assert not set(describer.checker_pids()) & set(children)


def test_the_describer_answers_a_refusal_with_the_importer_s_code(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(tiny_model_bytes(0.76)[:40])
    with pytest.raises(describer.ServiceError) as refused:
        describer.inspect_in_child(path, "m.onnx", 1 << 20, tmp_path)
    assert refused.value.code == "invalid_model" and refused.value.status == 422
    assert str(path) not in refused.value.message


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_serve_leaves_no_child_process_behind(tmp_path: Path, stop: signal.Signals) -> None:
    """The embedded serve's job process and describers end with it: after a graceful stop
    (uvicorn re-raises the signal, which skips exit handlers) and after a SIGKILL."""
    import subprocess

    from tests.service_helpers import free_port, qpcfarm_argv, service_env, wait_until

    port = free_port()
    env = service_env(QPCFARM_DATA_DIR=str(tmp_path / "data"))
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    serve = subprocess.Popen(
        qpcfarm_argv("serve", "--port", str(port), "--log-level", "warning"),
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, "the farm to start", timeout=120)
        key = (tmp_path / "data" / "api-key").read_text().strip()
        answer = httpx.post(
            f"{url}/v1/models",
            content=tiny_model_bytes(0.77),
            params={"filename": "m.onnx"},
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/octet-stream"},
            timeout=120,
        )
        assert answer.status_code == 201, answer.text
        found = subprocess.run(["pgrep", "-P", str(serve.pid)], capture_output=True, text=True)
        children = [int(pid) for pid in found.stdout.split()]
        assert len(children) >= 2  # the job process and a describer (and their tracker)

        serve.send_signal(stop)
        serve.wait(timeout=120)
        wait_until(
            lambda: not any(Path(f"/proc/{pid}").exists() for pid in children) or None,
            "the children to end",
            timeout=60,
        )
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        log.close()
