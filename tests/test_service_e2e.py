"""The whole service over real HTTP with real processes, in both deployment modes.

- embedded: `qpcfarm serve` alone (SQLite, blob directory, in-process worker);
- farm: `qpcfarm serve` + `qpcfarm worker` processes on a fresh PostgreSQL database and a
  private redis-server;
- a worker SIGKILLed mid-compile: its job still completes, once;
- the broker killed and restarted under a running farm: no job is lost.

Compiled QPCs are run on the functional runtime and compared with ONNX Runtime.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from sqlalchemy import create_engine, func, select

from app.domain.db.models import Blob, BlobChunk, CompileJob, Qpc, QuarantinedBlob
from tests.conftest import _postgres_problem, postgres_url, tiny_model_bytes
from tests.service_helpers import (
    Api,
    Processes,
    RedisServer,
    free_port,
    fresh_postgres_database,
    processes,
    read_key_line,
    redis_problem,
    redis_server,
    run_cli,
    service_env,
    slow_model,
    wait_for_http,
    wait_for_worker,
)

OPTIONS = {"aic-num-cores": 2}


def assert_runs_like_onnxruntime(qpc: bytes, model: bytes, tmp_path: Path, batch: int) -> None:
    from compiler_core.runtime import run_qpc

    path = tmp_path / f"{uuid.uuid4().hex}.qpc"
    path.write_bytes(qpc)
    session = ort.InferenceSession(model)
    feed = session.get_inputs()[0]
    x = np.linspace(-1, 1, batch * int(feed.shape[1]), dtype=np.float32).reshape(batch, -1)
    expected = session.run(None, {feed.name: x})[0]
    got = np.asarray(run_qpc(str(path), {feed.name: x})[session.get_outputs()[0].name])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


# -------------------------------------------------------------------------------- embedded


def test_embedded_serve_compiles_an_upload_and_answers_a_repeat_from_its_cache(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "data"
    env = service_env(QPCFARM_DATA_DIR=str(data_dir))
    port = free_port()
    with processes(tmp_path) as procs:
        serve = procs.start("serve", ["serve", "--port", str(port)], env, capture_stdout=True)
        key = read_key_line(serve)
        assert (data_dir / "api-key").read_text().strip() == key
        api = Api(f"http://127.0.0.1:{port}", key)
        wait_for_http(api.base_url, serve)

        model = tiny_model_bytes()
        model_id = api.upload(model, "tiny.onnx")["id"]
        job = api.submit(model_id, OPTIONS)
        assert job["status"] in ("queued", "running", "succeeded") and not job["cache_hit"]
        done = api.wait(job["id"], ("succeeded", "failed", "cancelled"))
        assert done["status"] == "succeeded", done["error"]
        assert done["attempts"] == 1 and done["metrics"] and done["pass_times"]
        assert_runs_like_onnxruntime(api.download_qpc(done["qpc_id"]), model, tmp_path, 2)

        again = api.submit(model_id, OPTIONS)
        assert again["id"] != done["id"]
        assert (again["status"], again["cache_hit"], again["qpc_id"]) == (
            "succeeded",
            True,
            done["qpc_id"],
        )


def test_embedded_serve_restarted_keeps_its_key_and_runs_jobs_left_queued(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "data"
    env = service_env(QPCFARM_DATA_DIR=str(data_dir))
    with processes(tmp_path) as procs:
        port = free_port()
        first = procs.start("serve", ["serve", "--port", str(port)], env, capture_stdout=True)
        api = Api(f"http://127.0.0.1:{port}", read_key_line(first))
        wait_for_http(api.base_url, first)
        model_id = api.upload(tiny_model_bytes())["id"]
        first.kill()

        # A job committed while no server runs (as if the process died before its worker
        # took it): the next start finds it in the database.
        job_id = queue_job_directly(data_dir, model_id)
        port = free_port()
        second = procs.start("serve", ["serve", "--port", str(port)], env, capture_stdout=True)
        api = Api(f"http://127.0.0.1:{port}", api.key)
        wait_for_http(api.base_url, second)
        done = api.wait(str(job_id), ("succeeded", "failed", "cancelled"))
        assert done["status"] == "succeeded", done["error"]
        assert "the local API key is in" in second.log_text()  # no second team, no new key


def queue_job_directly(data_dir: Path, model_id: str) -> uuid.UUID:
    from app.domain.db.models import Model, Team
    from app.domain.db.session import make_engine, make_session_factory
    from app.domain.services import jobs
    from compiler_core import CompileOptions

    engine = make_engine(f"sqlite:///{data_dir / 'qpcfarm.db'}")
    try:
        with make_session_factory(engine)() as session:
            model = session.get(Model, uuid.UUID(model_id))
            assert model is not None
            team = session.get(Team, model.team_id)
            assert team is not None
            job, created = jobs.submit_job(
                session, team, model, CompileOptions.from_json({"aic-num-cores": 3})
            )
            session.commit()
            assert created
            return job.id
    finally:
        engine.dispose()


# ------------------------------------------------------------------------------------ farm


@dataclass
class FarmServices:
    env: dict[str, str]
    redis: RedisServer


@pytest.fixture
def farm(tmp_path: Path) -> Iterator[FarmServices]:
    """A fresh PostgreSQL database and a private redis-server, and the environment that
    points `qpcfarm serve`/`worker` at them (short heartbeat and sweep thresholds)."""
    problem = _postgres_problem() or redis_problem()
    if problem is not None:
        pytest.skip(problem)
    with fresh_postgres_database(postgres_url()) as db_url, redis_server(tmp_path) as redis:
        env = service_env(
            QPCFARM_DATA_DIR=str(tmp_path / "data"),
            QPCFARM_DATABASE_URL=db_url,
            QPCFARM_BROKER_URL=redis.url,
            QPCFARM_HEARTBEAT_S="0.5",
            QPCFARM_STALE_AFTER_S="4",
            QPCFARM_REQUEUE_AFTER_S="3",
        )
        yield FarmServices(env, redis)


def start_farm_api(procs: Processes, env: dict[str, str], tmp_path: Path) -> Api:
    run_cli(["admin", "create-team", "ci", "--init"], env, tmp_path)
    key = run_cli(["admin", "create-key", "--team", "ci"], env, tmp_path).strip()
    port = free_port()
    serve = procs.start("serve", ["serve", "--port", str(port)], env)
    api = Api(f"http://127.0.0.1:{port}", key)
    wait_for_http(api.base_url, serve)
    return api


def farm_rows(env: dict[str, str]) -> tuple[int, dict[str, str]]:
    """(QPC rows, worker of each job by id) straight from the farm's database."""
    engine = create_engine(env["QPCFARM_DATABASE_URL"])
    try:
        with engine.connect() as conn:
            qpcs = conn.execute(select(func.count()).select_from(Qpc)).scalar_one()
            workers = conn.execute(select(CompileJob.id, CompileJob.worker)).all()
        return int(qpcs), {str(job_id): str(worker) for job_id, worker in workers}
    finally:
        engine.dispose()


def test_farm_mode_two_worker_processes_share_the_jobs_and_all_succeed(
    farm: FarmServices, tmp_path: Path
) -> None:
    with processes(tmp_path) as procs:
        api = start_farm_api(procs, farm.env, tmp_path)
        workers = [procs.start(f"worker{i}", ["worker"], farm.env) for i in range(2)]
        for worker in workers:
            wait_for_worker(worker)
        run_cli(["worker", "--ping"], farm.env, tmp_path)  # the compose health check

        models = [slow_model(layers=150, width=8 + i) for i in range(6)]
        blobs = [model.SerializeToString() for model in models]
        ids = [api.submit(api.upload(blob)["id"], OPTIONS)["id"] for blob in blobs]
        done = [api.wait(job_id, ("succeeded", "failed", "cancelled")) for job_id in ids]

        assert [job["status"] for job in done] == ["succeeded"] * 6, [j["error"] for j in done]
        for job, blob in zip(done, blobs, strict=True):
            assert_runs_like_onnxruntime(api.download_qpc(job["qpc_id"]), blob, tmp_path, 2)
        qpc_rows, worker_of = farm_rows(farm.env)
        assert qpc_rows == 6
        processes_used = {worker_of[job_id].rsplit(":", 1)[0] for job_id in ids}
        assert len(processes_used) == 2, worker_of  # both workers took jobs


def _count(env: dict[str, str], table: Any) -> int:
    engine = create_engine(env["QPCFARM_DATABASE_URL"])
    try:
        with engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(table)).scalar_one())
    finally:
        engine.dispose()


def test_farm_mode_with_a_filesystem_store_shared_by_api_and_worker_serves_every_blob(
    farm: FarmServices, tmp_path: Path
) -> None:
    """The recommended farm (docker-compose.yml): blob bytes on a volume every process
    mounts, none in PostgreSQL; the job folders on it too, so a QPC is linked in."""
    data = tmp_path / "data"
    env = {**farm.env, "QPCFARM_BLOB_STORE": "filesystem", "QPCFARM_WORK_DIR": str(data / "work")}
    with processes(tmp_path) as procs:
        api = start_farm_api(procs, env, tmp_path)
        wait_for_worker(procs.start("worker", ["worker"], env))
        assert httpx.get(f"{api.base_url}/readyz").status_code == 200

        blob = slow_model(layers=20).SerializeToString()
        model = api.upload(blob)
        done = api.wait(api.submit(model["id"], OPTIONS)["id"], ("succeeded", "failed"))
        assert done["status"] == "succeeded", done["error"]
        qpc = api.download_qpc(done["qpc_id"])
        assert_runs_like_onnxruntime(qpc, blob, tmp_path, 2)
        sha256 = hashlib.sha256(qpc).hexdigest()
        stored = data / "blobs" / sha256[:2] / sha256[2:]
        assert stored.read_bytes() == qpc and stored.stat().st_nlink == 1  # job folder gone
        assert (data / "work" / "model-cache" / model["sha256"]).is_file()
        assert (_count(env, Blob), _count(env, BlobChunk)) == (0, 0)
        assert api.submit(model["id"], OPTIONS)["cache_hit"] is True

        damaged = bytearray(qpc)
        damaged[-1] ^= 0xFF
        stored.write_bytes(bytes(damaged))  # the disk goes bad under the farm
        with api.client() as http:
            refused = http.get(f"/v1/qpcs/{done['qpc_id']}/download")
        assert (refused.status_code, refused.json()["code"]) == (500, "blob_corrupt")
        assert not stored.exists() and _count(env, QuarantinedBlob) == 1
        assert [p.name.split(".")[0] for p in (data / "blobs" / "quarantine").iterdir()] == [sha256]

        again = api.submit(model["id"], OPTIONS)
        assert again.get("cache_hit") is not True  # compiled afresh, stored again
        redone = api.wait(again["id"], ("succeeded", "failed"))
        assert redone["status"] == "succeeded", redone["error"]
        assert api.download_qpc(redone["qpc_id"]) == qpc
        assert "0 corrupt, 0 missing" in run_cli(["admin", "verify-blobs"], env, tmp_path)

        unused = api.upload(slow_model(layers=3).SerializeToString(), "unused.onnx")
        files = [data / "blobs" / s[:2] / s[2:] for s in (model["sha256"], unused["sha256"])]
        assert all(f.exists() for f in [*files, stored])
        run_cli(["admin", "set-limits", "--team", "ci", "--retention-days", "0"], env, tmp_path)
        assert "collected 3 blob(s)" in run_cli(["admin", "gc"], env, tmp_path)
        assert not any(f.exists() for f in [*files, stored])  # jobs, models and QPC all old


def test_farm_mode_a_job_whose_worker_is_killed_mid_compile_still_completes_once(
    farm: FarmServices, tmp_path: Path
) -> None:
    with processes(tmp_path) as procs:
        api = start_farm_api(procs, farm.env, tmp_path)
        first = procs.start("worker-doomed", ["worker"], farm.env)
        wait_for_worker(first)
        blob = slow_model().SerializeToString()
        job = api.submit(api.upload(blob)["id"], OPTIONS)

        running = api.wait(job["id"], ("running", "succeeded", "failed"))
        assert running["status"] == "running", "the compile ended before the worker was killed"
        first.kill()  # SIGKILL to the worker and its pool: no goodbye, no ack
        replacement = procs.start("worker-new", ["worker"], farm.env)
        wait_for_worker(replacement)

        done = api.wait(job["id"], ("succeeded", "failed", "cancelled"), timeout=90)
        assert done["status"] == "succeeded", done["error"]
        assert done["attempts"] >= 2
        qpc_rows, _ = farm_rows(farm.env)
        assert qpc_rows == 1
        assert_runs_like_onnxruntime(api.download_qpc(done["qpc_id"]), blob, tmp_path, 2)


def test_farm_mode_loses_no_job_when_the_broker_dies_and_comes_back(
    farm: FarmServices, tmp_path: Path
) -> None:
    with processes(tmp_path) as procs:
        api = start_farm_api(procs, farm.env, tmp_path)
        worker = procs.start("worker", ["worker"], farm.env)
        wait_for_worker(worker)
        slow = slow_model(layers=600).SerializeToString()
        running = api.submit(api.upload(slow)["id"], OPTIONS)
        api.wait(running["id"], ("running", "succeeded"))
        small = [tiny_model_bytes(0.1 * (i + 2)) for i in range(2)]
        model_ids = [api.upload(blob)["id"] for blob in small]

        farm.redis.stop()  # every message in the broker is gone with it
        during = api.submit(model_ids[0], OPTIONS)  # committed; its enqueue fails
        farm.redis.start()
        after = api.submit(model_ids[1], OPTIONS)

        for job, blob in ((running, slow), (during, small[0]), (after, small[1])):
            done = api.wait(job["id"], ("succeeded", "failed", "cancelled"), timeout=60)
            assert done["status"] == "succeeded", done["error"]
            assert_runs_like_onnxruntime(api.download_qpc(done["qpc_id"]), blob, tmp_path, 2)
        assert worker.alive()  # the same worker reconnected
