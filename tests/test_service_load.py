"""The farm under load and faults, over real HTTP against real processes the tests start and
kill: many concurrent clients, identical submissions, a database that goes away.

Figures these tests pin down: 100 concurrent clients uploading and submitting in the
embedded mode get no 5xx and no dropped connection; identical submissions compile once.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import _postgres_problem, postgres_url, tiny_model_bytes
from tests.load_helpers import identical_submits, upload_and_submit
from tests.service_helpers import (
    Api,
    free_port,
    fresh_postgres_database,
    postgres_binaries,
    postgres_server,
    processes,
    read_key_line,
    redis_problem,
    redis_server,
    run_cli,
    service_env,
    wait_for_http,
    wait_for_worker,
    wait_until,
)


def distinct_model(n: int) -> bytes:
    return tiny_model_bytes(0.1 + n / 1024)


def test_embedded_mode_holds_100_concurrent_clients_uploading_and_submitting(
    tmp_path: Path,
) -> None:
    # The 100 clients share one key; the per-key bound on concurrent uploads (8 by default,
    # pinned in tests/test_security_http.py) would answer most of them 429, so it is lifted
    # here to measure what the farm itself holds.
    env = service_env(QPCFARM_DATA_DIR=str(tmp_path / "data"), QPCFARM_MAX_UPLOADS_PER_KEY="100")
    port = free_port()
    with processes(tmp_path) as procs:
        serve = procs.start("serve", ["serve", "--port", str(port)], env, capture_stdout=True)
        api = Api(f"http://127.0.0.1:{port}", read_key_line(serve))
        wait_for_http(api.base_url, serve)

        result = upload_and_submit(
            api.base_url,
            api.key,
            clients=100,
            rounds=2,
            model=distinct_model,
            options={"aic-num-cores": 1},
        )

        assert result.failures == [], result.failures[:5]
        assert result.statuses[201] == 200 and result.statuses[202] == 200, result.statuses
        assert serve.alive()


# ------------------------------------------------------------------------------- faults


def assert_unavailable(answer: httpx.Response, code: str) -> None:
    """503 with the code, a Retry-After, and no server path in the message."""
    assert answer.status_code == 503, answer.text
    body = answer.json()
    assert body["code"] == code and "/" not in body["message"], body
    assert int(answer.headers["retry-after"]) > 0


def test_farm_mode_answers_503_while_postgresql_is_down_and_loses_no_job(
    tmp_path: Path,
) -> None:
    if postgres_binaries() is None or redis_problem() is not None:
        pytest.skip("needs initdb/postgres and redis-server to start private servers")
    with postgres_server() as pg, redis_server(tmp_path) as redis, processes(tmp_path) as procs:
        env = service_env(
            QPCFARM_DATA_DIR=str(tmp_path / "data"),
            QPCFARM_DATABASE_URL=pg.url,
            QPCFARM_BROKER_URL=redis.url,
            QPCFARM_HEARTBEAT_S="0.5",
            QPCFARM_STALE_AFTER_S="4",
            QPCFARM_REQUEUE_AFTER_S="3",
        )
        run_cli(["admin", "create-team", "ci", "--init"], env, tmp_path)
        key = run_cli(["admin", "create-key", "--team", "ci"], env, tmp_path).strip()
        port = free_port()
        serve = procs.start("serve", ["serve", "--port", str(port)], env)
        api = Api(f"http://127.0.0.1:{port}", key)
        wait_for_http(api.base_url, serve)
        worker = procs.start("worker", ["worker"], env)
        wait_for_worker(worker)
        before = api.submit(api.upload(distinct_model(1))["id"], {})
        model_id = api.upload(distinct_model(2))["id"]

        pg.kill()
        with api.client() as http:
            assert_unavailable(http.get("/v1/models"), "database_unavailable")
            assert_unavailable(
                http.post("/v1/compile-jobs", json={"model_id": model_id, "options": {}}),
                "database_unavailable",
            )
            assert_unavailable(
                http.post("/v1/models", files={"file": ("m.onnx", distinct_model(3))}),
                "database_unavailable",
            )
            ready = http.get("/readyz")
            assert ready.status_code == 503 and ready.json()["checks"]["database"] != "ok"
        pg.start()

        def answers() -> bool:
            with api.client() as http:
                return http.get("/v1/models").status_code == 200

        wait_until(answers, "the API to reach the restarted database")
        after = api.submit(model_id, {})
        for job in (before, after):
            done = api.wait(job["id"], ("succeeded", "failed", "cancelled"), timeout=90)
            assert done["status"] == "succeeded", done["error"]
        assert serve.alive() and worker.alive()


def test_embedded_mode_answers_503_while_the_blob_store_cannot_write(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    env = service_env(QPCFARM_DATA_DIR=str(data_dir))
    port = free_port()
    with processes(tmp_path) as procs:
        serve = procs.start("serve", ["serve", "--port", str(port)], env, capture_stdout=True)
        api = Api(f"http://127.0.0.1:{port}", read_key_line(serve))
        wait_for_http(api.base_url, serve)
        spool = data_dir / "blobs" / "tmp"
        spool.rmdir()
        spool.write_text("not a folder: every write into the store fails")
        with api.client() as http:
            assert_unavailable(
                http.post("/v1/models", files={"file": ("m.onnx", distinct_model(4))}),
                "storage_unavailable",
            )
            ready = http.get("/readyz")
            assert ready.status_code == 503 and ready.json()["checks"]["blobs"] != "ok"
            spool.unlink()
            spool.mkdir()
            assert http.get("/readyz").status_code == 200
        assert api.upload(distinct_model(4))["name"] == "model.onnx"


# ------------------------------------------------------------------ identical submissions


def compiles_of(answers: list[dict[str, object]]) -> set[object]:
    """Jobs that compile: every answer that is not a cache hit names one."""
    return {a["id"] for a in answers if not a["cache_hit"]}


def test_embedded_mode_compiles_identical_concurrent_submits_once(tmp_path: Path) -> None:
    env = service_env(QPCFARM_DATA_DIR=str(tmp_path / "data"))
    port = free_port()
    with processes(tmp_path) as procs:
        serve = procs.start("serve", ["serve", "--port", str(port)], env, capture_stdout=True)
        api = Api(f"http://127.0.0.1:{port}", read_key_line(serve))
        wait_for_http(api.base_url, serve)
        body = {"model_id": api.upload(distinct_model(5))["id"], "options": {}}

        answers = identical_submits(api.base_url, api.key, body, clients=50, rounds=4)

        assert len(answers) == 200
        compiled = compiles_of(answers)
        assert len(compiled) == 1, compiled
        done = api.wait(str(compiled.pop()), ("succeeded", "failed", "cancelled"))
        assert done["status"] == "succeeded" and done["attempts"] == 1


def test_farm_mode_compiles_identical_submits_to_two_api_processes_once(
    tmp_path: Path,
) -> None:
    problem = _postgres_problem() or redis_problem()
    if problem is not None:
        pytest.skip(problem)
    with (
        fresh_postgres_database(postgres_url()) as db_url,
        redis_server(tmp_path) as redis,
        processes(tmp_path) as procs,
    ):
        env = service_env(
            QPCFARM_DATA_DIR=str(tmp_path / "data"),
            QPCFARM_DATABASE_URL=db_url,
            QPCFARM_BROKER_URL=redis.url,
        )
        run_cli(["admin", "create-team", "ci", "--init"], env, tmp_path)
        key = run_cli(["admin", "create-key", "--team", "ci"], env, tmp_path).strip()
        port = free_port()
        serve = procs.start("serve", ["serve", "--port", str(port), "--workers", "2"], env)
        api = Api(f"http://127.0.0.1:{port}", key)
        wait_for_http(api.base_url, serve)
        worker = procs.start("worker", ["worker"], env)
        wait_for_worker(worker)
        body = {"model_id": api.upload(distinct_model(6))["id"], "options": {}}

        answers = identical_submits(api.base_url, api.key, body, clients=50, rounds=4)

        compiled = compiles_of(answers)
        assert len(answers) == 200 and len(compiled) == 1, compiled
        done = api.wait(str(compiled.pop()), ("succeeded", "failed", "cancelled"))
        assert done["status"] == "succeeded"


def test_farm_mode_answers_50_concurrent_cache_hits_without_starving_its_pool(
    tmp_path: Path,
) -> None:
    """A cache hit reads the cached QPC from the database blob store while its request holds
    a connection: blob reads have a pool of their own, so a burst cannot wait for itself."""
    import uuid

    from tests.api_helpers import live_server
    from worker import compile_jobs

    with live_server("postgresql", tmp_path) as server, server.client(server.new_key()) as http:
        model = http.post("/v1/models", files={"file": ("m.onnx", distinct_model(7))}).json()
        body = {"model_id": model["id"], "options": {}}
        job = http.post("/v1/compile-jobs", json=body).json()
        with server.state.session_factory() as session:
            claimed = compile_jobs.claim(session, uuid.UUID(job["id"]), "w")
            assert claimed is not None
            compile_jobs.run_compile(session, server.state.store, claimed)
        key = http.headers["Authorization"].removeprefix("Bearer ")

        answers = identical_submits(server.url, key, body, clients=50, rounds=2)

        assert len(answers) == 100 and all(a["cache_hit"] for a in answers)
