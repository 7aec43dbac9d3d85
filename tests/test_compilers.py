"""Compiler backends and versions: a worker advertises what it has (`qpcfarm` at its version,
`qaic` at the SDK's when `exec/qaic-compile` is installed); a job may name one and goes only
to workers that have it (a Celery queue per compiler); none available is 409 naming what is;
the cache key holds backend and version."""

from __future__ import annotations

import datetime as dt
import json
import random
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session

from app.console.submit import parse_args
from app.domain.compilers import (
    DEFAULT,
    Compiler,
    CompilerSpecError,
    local_compilers,
    parse,
    queue_name,
    version_key,
)
from app.domain.db.base import utcnow
from app.domain.db.models import CompileJob, JobStatus, Team
from app.domain.services import compilers, jobs
from app.domain.services.errors import ServiceError
from app.domain.settings import Settings
from compiler_core import CompileOptions
from compiler_core.version import COMPILER_VERSION
from tests.api_helpers import LiveServer, live_server, web_client
from tests.conftest import Farm, tiny_model_bytes
from worker import compile_jobs

FRESH_S = 60.0
QAIC = Compiler("qaic", "1.18.2.0")
OLD = Compiler("qpcfarm", "0.0.9")


APPS_XML = "<apps><version>1.18.2.0</version></apps>"


def fake_sdk(root: Path, version_text: str | None = APPS_XML) -> Path:
    exe = root / "exec" / "qaic-compile"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    if version_text is not None:
        (root / "versions").mkdir()
        (root / "versions" / "apps.xml").write_text(version_text)
    return root


# ------------------------------------------------------------------------ names and hosts


def test_a_compiler_is_backend_at_version_and_a_bare_backend_leaves_the_version_open() -> None:
    assert parse("qpcfarm@0.1.0") == ("qpcfarm", "0.1.0")
    assert parse("qaic") == ("qaic", None)
    for bad in ("gcc@1", "qaic@", "qaic@1 2", "qaic@../x"):
        with pytest.raises(CompilerSpecError):
            parse(bad)
    assert str(QAIC) == "qaic@1.18.2.0" and queue_name(QAIC) == "qpcfarm.qaic-1.18.2.0"
    assert version_key("0.10.0") > version_key("0.9.1")


def test_a_host_has_qpcfarm_and_qaic_only_when_the_sdk_compiler_is_installed(
    tmp_path: Path,
) -> None:
    bare = Settings(data_dir=tmp_path, qaic_sdk=tmp_path / "none")
    assert local_compilers(bare) == [DEFAULT]
    assert DEFAULT == Compiler("qpcfarm", COMPILER_VERSION)

    sdk = fake_sdk(tmp_path / "sdk")
    assert local_compilers(Settings(data_dir=tmp_path, qaic_sdk=sdk)) == [DEFAULT, QAIC]
    pinned = Settings(data_dir=tmp_path, qaic_sdk=sdk, qaic_version="1.19.0.1")
    assert local_compilers(pinned)[1] == Compiler("qaic", "1.19.0.1")
    unversioned = fake_sdk(tmp_path / "sdk2", None)
    assert local_compilers(Settings(data_dir=tmp_path, qaic_sdk=unversioned))[1].version == (
        "unknown"
    )


# --------------------------------------------------------------------------- the service


def test_what_live_workers_advertise_is_available_newest_first_and_silence_expires_it(
    farm: Farm, session: Session
) -> None:
    now = utcnow()
    compilers.advertise(session, "w1", [DEFAULT, QAIC], fresh_s=FRESH_S, now=now)
    compilers.advertise(session, "w2", [DEFAULT, OLD], fresh_s=FRESH_S, now=now)

    listed = compilers.available(session, fresh_s=FRESH_S, now=now)

    assert [(r["compiler"], r["workers"]) for r in listed] == [
        ("qaic@1.18.2.0", 1),
        (str(DEFAULT), 2),
        ("qpcfarm@0.0.9", 1),
    ]
    assert compilers.resolve(session, "qaic", fresh_s=FRESH_S, now=now) == QAIC
    assert compilers.resolve(session, "qpcfarm", fresh_s=FRESH_S, now=now) == DEFAULT
    assert compilers.resolve(session, None, fresh_s=FRESH_S, now=now) is None

    later = now + dt.timedelta(seconds=FRESH_S + 1)
    compilers.advertise(session, "w2", [DEFAULT], fresh_s=FRESH_S, now=later)
    with pytest.raises(ServiceError) as gone:
        compilers.resolve(session, "qaic", fresh_s=FRESH_S, now=later)
    assert gone.value.status == 409 and gone.value.code == "compiler_unavailable"
    assert gone.value.detail["available"] == [str(DEFAULT)]

    compilers.withdraw(session, "w2")
    assert compilers.available(session, fresh_s=FRESH_S, now=later) == []


def test_the_cache_key_holds_backend_and_version(farm: Farm) -> None:
    options = CompileOptions()
    sha = "ab" * 32
    default = jobs.options_key(sha, options)
    assert jobs.options_key(sha, options, compiler=DEFAULT) == default  # the same compiler
    assert jobs.options_key(sha, options, compiler=OLD) != default
    assert jobs.options_key(sha, options, compiler=QAIC) not in (default, jobs.options_key(
        sha, options, compiler=Compiler("qaic", "1.19.0.0")))  # fmt: skip


def test_a_worker_refuses_a_job_for_a_compiler_it_does_not_run(
    farm: Farm, session: Session, team: Team
) -> None:
    from app.domain.services import models

    model = models.store_model(
        session, farm.store, team, _bytes_io(tiny_model_bytes(0.3)), "m.onnx", max_bytes=1 << 30
    )
    job, _ = jobs.submit_job(session, team, model, CompileOptions(), compiler=OLD)
    session.commit()
    claimed = compile_jobs.claim(session, job.id, "w")
    assert claimed is not None

    compile_jobs.run_compile(session, farm.store, claimed)

    assert claimed.status is JobStatus.failed and claimed.error_code == "compiler_unavailable"
    assert "0.0.9" in (claimed.error_message or "")


def _bytes_io(data: bytes) -> Any:
    import io

    return io.BytesIO(data)


def _queued(
    farm: Farm, session: Session, team: Team, scale: float, compiler: Compiler | None
) -> CompileJob:
    """A queued compile of a distinct tiny model (`scale`) naming `compiler`."""
    from app.domain.services import models

    data = _bytes_io(tiny_model_bytes(scale))
    model = models.store_model(session, farm.store, team, data, "m.onnx", max_bytes=1 << 30)
    job, _ = jobs.submit_job(session, team, model, CompileOptions(), compiler=compiler)
    session.commit()
    return job


# ------------------------------------------------------------------------------ the API


def _advertise(server: LiveServer, worker: str, have: list[Compiler]) -> None:
    with server.state.session_factory() as session:
        compilers.advertise(session, worker, have, fresh_s=FRESH_S)


def test_a_job_naming_a_compiler_no_worker_has_is_409_naming_what_is_available(
    server: LiveServer,
) -> None:
    worker = f"w-{uuid.uuid4().hex[:6]}"
    _advertise(server, worker, [DEFAULT])
    try:
        with server.client(server.new_key()) as api:
            model = _upload(api)
            listed = api.get("/v1/compilers").json()
            refused = api.post(
                "/v1/compile-jobs", json={"model_id": model, "compiler": "qaic@9.9.9"}
            )
            malformed = api.post("/v1/compile-jobs", json={"model_id": model, "compiler": "gcc@12"})
            jobs_after = api.get("/v1/compile-jobs").json()["count"]
    finally:
        with server.state.session_factory() as session:
            compilers.withdraw(session, worker)

    row = next(r for r in listed if r["compiler"] == str(DEFAULT))
    assert (row["backend"], row["version"]) == ("qpcfarm", COMPILER_VERSION)
    assert row["workers"] >= 1
    assert refused.status_code == 409 and refused.json()["code"] == "compiler_unavailable"
    assert str(DEFAULT) in refused.json()["available"]
    assert str(DEFAULT) in refused.json()["message"]
    assert malformed.status_code == 422 and malformed.json()["code"] == "invalid_compiler"
    assert jobs_after == 0


def test_a_job_naming_an_available_compiler_records_it_and_keys_the_cache_by_it(
    server: LiveServer,
) -> None:
    worker = f"w-{uuid.uuid4().hex[:6]}"
    _advertise(server, worker, [DEFAULT, QAIC])
    try:
        with server.client(server.new_key()) as api:
            model = _upload(api)
            plain = api.post("/v1/compile-jobs", json={"model_id": model}).json()
            _play(server, plain["id"])
            pinned = api.post(
                "/v1/compile-jobs", json={"model_id": model, "compiler": str(DEFAULT)}
            )
            vendor = api.post("/v1/compile-jobs", json={"model_id": model, "compiler": "qaic"})
    finally:
        with server.state.session_factory() as session:
            compilers.withdraw(session, worker)

    assert plain["compiler"] is None
    # The default and qpcfarm at the same version are one compiler: a cache hit.
    assert pinned.status_code == 200 and pinned.json()["cache_hit"] is True
    assert pinned.json()["compiler"] == str(DEFAULT)
    # Another backend is another key: queued, with the version resolved.
    assert vendor.status_code == 202 and vendor.json()["compiler"] == "qaic@1.18.2.0"
    assert vendor.json()["status"] == "queued"


def test_the_web_forms_offer_the_compilers_live_by_the_farms_staleness_window(
    tmp_path: Path,
) -> None:
    """The upload form's and the recompile form's choices count a worker's advertisement as
    `GET /v1/compilers` does: fresh for `compilers.fresh_s` of the farm's `stale_after_s`
    (the app's settings: 30 s, so fresh for 30 s), not of the environment's (60 s by
    default, fresh for 60 s). An advertisement 45 s old is stale to the farm."""
    assert compilers.fresh_s(30.0) < 45 < compilers.fresh_s(Settings().stale_after_s)
    with live_server("sqlite", tmp_path, stale_after_s=30.0) as server:
        now = utcnow()
        with server.state.session_factory() as session:
            compilers.advertise(session, "quiet", [QAIC], fresh_s=FRESH_S,
                                now=now - dt.timedelta(seconds=45))  # fmt: skip
            compilers.advertise(session, "live", [OLD], fresh_s=FRESH_S, now=now)
        key = server.new_key()
        with server.client(key) as api:
            listed = [r["compiler"] for r in api.get("/v1/compilers").json()]
            job = api.post("/v1/compile-jobs", json={"model_id": _upload(api)}).json()
            _play(server, job["id"])  # a finished job's page offers the recompile
        with web_client(server, key) as browser:
            pages = {page: browser.get(page).text for page in ("/", f"/jobs/{job['id']}")}

    assert listed == [str(OLD)]
    for page, html in pages.items():
        offered = re.findall(r'<option value="((?:qaic|qpcfarm)@[^"]+)"', html)
        assert offered == listed, page


def _upload(api: httpx.Client) -> str:
    data = tiny_model_bytes(scale=random.uniform(0.01, 1.0))
    answer = api.post("/v1/models", files={"file": ("m.onnx", data)})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


def _play(server: LiveServer, job_id: str) -> None:
    with server.state.session_factory() as session:
        job = compile_jobs.claim(session, uuid.UUID(job_id), "test-worker")
        assert job is not None
        compile_jobs.run_compile(session, server.state.store, job)


# ---------------------------------------------------------------------- the Celery queues


def _waiting(url: str, queue: str) -> list[str]:
    import redis

    client = redis.Redis.from_url(url)
    try:
        raw = client.lrange(queue, 0, -1)
    finally:
        client.close()
    return [json.loads(m)["headers"]["argsrepr"].strip("[]()',\" ") for m in raw]


def test_a_job_naming_a_compiler_is_sent_to_that_compilers_queue_only(
    farm: Farm, session: Session, team: Team, private_redis: Any, tmp_path: Path
) -> None:
    from worker.celery_app import QUEUE_NAME
    from worker.queues import CeleryQueue

    plain = _queued(farm, session, team, 0.1, None)
    vendor = _queued(farm, session, team, 0.2, QAIC)
    old = _queued(farm, session, team, 0.3, OLD)
    queue = CeleryQueue(Settings(data_dir=tmp_path, broker_url=private_redis.url), farm.db.sessions)
    try:
        for job in (plain, vendor, old):
            queue.enqueue(job.id)
    finally:
        queue.close()

    assert _waiting(private_redis.url, QUEUE_NAME) == [str(plain.id)]
    assert _waiting(private_redis.url, queue_name(QAIC)) == [str(vendor.id)]
    assert _waiting(private_redis.url, queue_name(OLD)) == [str(old.id)]


# ------------------------------------------------------------------ the embedded worker


def test_the_embedded_worker_advertises_its_compilers_and_runs_a_job_naming_one(
    tmp_path: Path,
) -> None:
    from fastapi.testclient import TestClient

    from app.console.serve import create_farm_app
    from tests.test_web_pages import new_key

    settings = Settings(
        data_dir=tmp_path,
        database_url=f"sqlite:///{tmp_path / 'qpcfarm.db'}",
        broker_url=None,
        blob_store="filesystem",
        qaic_sdk=tmp_path / "no-sdk",
    )
    app = create_farm_app(settings)
    with TestClient(app, base_url="http://localhost") as client:
        key = new_key(app, "alpha")
        headers = {"Authorization": f"Bearer {key}"}
        listed = client.get("/v1/compilers", headers=headers).json()
        upload = client.post(
            "/v1/models", headers=headers, files={"file": ("m.onnx", tiny_model_bytes(0.4))}
        ).json()
        job = client.post(
            "/v1/compile-jobs",
            headers=headers,
            json={"model_id": upload["id"], "compiler": f"qpcfarm@{COMPILER_VERSION}"},
        ).json()
        done = _wait(client, headers, job["id"])
        refused = client.post(
            "/v1/compile-jobs", headers=headers, json={"model_id": upload["id"], "compiler": "qaic"}
        )

    assert [r["compiler"] for r in listed] == [str(DEFAULT)]
    assert done["status"] == "succeeded" and done["compiler"] == str(DEFAULT)
    assert refused.status_code == 409 and refused.json()["available"] == [str(DEFAULT)]


def _wait(client: Any, headers: dict[str, str], job_id: str) -> dict[str, Any]:
    import time

    deadline = time.monotonic() + 120
    while True:
        body: dict[str, Any] = client.get(f"/v1/compile-jobs/{job_id}", headers=headers).json()
        if body["status"] not in ("queued", "running") or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


def test_submit_takes_compiler_as_a_client_option() -> None:
    args = parse_args(["-m=x.onnx", "--compiler", "qaic@1.18.2.0", "-aic-num-cores=2"], env={})
    assert args.compiler == "qaic@1.18.2.0" and args.flags == ["-m=x.onnx", "-aic-num-cores=2"]
    assert parse_args(["-m=x.onnx"], env={}).compiler is None


def test_a_message_claims_only_a_queued_compile_of_its_own_jobs_compiler(
    farm: Farm, session: Session, team: Team
) -> None:
    from worker import fair_share

    vendor = _queued(farm, session, team, 0.11, QAIC)  # the oldest: fair share would pick it
    plain = _queued(farm, session, team, 0.12, None)
    old = _queued(farm, session, team, 0.13, OLD)

    by_plain = fair_share.claim_next(session, plain.id, "w-default")
    by_old = fair_share.claim_next(session, old.id, "w-old")
    again = fair_share.claim_next(session, plain.id, "w-default")
    by_vendor = fair_share.claim_next(session, vendor.id, "w-qaic")

    assert by_plain is not None and by_plain.id == plain.id
    assert by_old is not None and by_old.id == old.id
    assert again is None  # the vendor job waits for a worker with the SDK
    assert by_vendor is not None and by_vendor.id == vendor.id
