"""The HTTP API as a specification, over real HTTP (uvicorn in a thread, httpx).

Core flows run against both databases: SQLite with the filesystem blob store (embedded) and
PostgreSQL with the database blob store (farm). The job queue is a recording double; where a
test needs a compiled QPC it plays the worker itself (`worker.compile_jobs`: claim, then
run_compile).
Each test works in its own team, so tests sharing a server do not see each other's rows.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import socket
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest
from sqlalchemy import func, select

from app.api.uploads import UploadInterrupted
from app.domain.db.models import BlobChunk, CompileJob
from compiler_core.devices import device_names
from compiler_core.options import options_json_schema
from tests.api_helpers import (
    LiveServer,
    Servers,
    live_server,
    multipart_chunks,
    raw_chunks,
    tar_with_symlink,
    zip_bytes,
    zip_of_folder,
)
from tests.conftest import external_data_model_dir, tiny_model, tiny_model_bytes
from worker import compile_jobs

LIMIT = 1 << 20
ZERO_ID = "00000000-0000-0000-0000-000000000000"


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    running = Servers(tmp_path_factory, max_upload_bytes=LIMIT)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture
def local(servers: Servers) -> LiveServer:
    """The SQLite server, for behaviour that does not depend on the database."""
    return servers.get("sqlite")


@pytest.fixture
def api(server: LiveServer) -> Iterator[httpx.Client]:
    with server.client(server.new_key()) as client:
        yield client


@pytest.fixture
def local_api(local: LiveServer) -> Iterator[httpx.Client]:
    with local.client(local.new_key()) as client:
        yield client


# ------------------------------------------------------------------------------- helpers


def unique_model() -> bytes:
    """A tiny model whose bytes no other test uploads (the QPC cache is keyed by them)."""
    return tiny_model_bytes(scale=random.uniform(0.01, 1.0))


def upload(client: httpx.Client, data: bytes | None = None, name: str = "tiny.onnx") -> dict:
    response = client.post("/v1/models", files={"file": (name, data or unique_model())})
    assert response.status_code == 201, response.text
    return response.json()


def submit(client: httpx.Client, model_id: str, **body: Any) -> httpx.Response:
    return client.post("/v1/compile-jobs", json={"model_id": model_id, **body})


def play_worker(server: LiveServer, job_id: str) -> None:
    """Do what a worker does with an enqueued id: claim the job and compile it."""
    with server.state.session_factory() as session:
        job = compile_jobs.claim(session, uuid.UUID(job_id), "test-worker")
        assert job is not None
        compile_jobs.run_compile(session, server.state.store, job)


def compiled(server: LiveServer, client: httpx.Client, cores: int = 2) -> dict:
    """A finished job of a fresh model (its JSON)."""
    model = upload(client)
    job = submit(client, model["id"], options={"aic-num-cores": cores}).json()
    play_worker(server, job["id"])
    done = client.get(f"/v1/compile-jobs/{job['id']}").json()
    assert done["status"] == "succeeded", done
    return done


def error_code(response: httpx.Response) -> str:
    code: str = response.json()["code"]
    return code


def leftover_upload_parts(server: LiveServer) -> int:
    """Pieces of unfinished uploads in the blob store (temp files or temp chunk rows)."""
    if server.settings.blob_store == "filesystem":
        return len(list((Path(server.settings.data_dir) / "blobs" / "tmp").iterdir()))
    with server.state.session_factory() as session:
        query = select(func.count()).where(BlobChunk.sha256.like("tmp-%"))
        return int(session.execute(query).scalar_one())


# ------------------------------------------------------------------------------- uploads


def test_an_uploaded_onnx_file_answers_201_with_its_id_sha256_and_io(
    api: httpx.Client,
) -> None:
    data = unique_model()
    response = api.post("/v1/models", files={"file": ("tiny.onnx", data)})

    assert response.status_code == 201
    model = response.json()
    assert model["sha256"] == hashlib.sha256(data).hexdigest()
    assert model["size"] == len(data) and model["name"] == "tiny.onnx"
    assert model["opset"] == 17
    assert model["inputs"] == [{"name": "x", "dtype": "float", "shape": [2, 4]}]
    assert model["outputs"] == [{"name": "y", "dtype": "float", "shape": [2, 3]}]
    assert response.headers["location"] == f"/v1/models/{model['id']}"
    assert api.get(f"/v1/models/{model['id']}").json() == model
    listing = api.get("/v1/models").json()
    assert listing["count"] == 1 and listing["items"] == [model]


def test_a_raw_octet_stream_body_named_by_query_is_an_upload_too(local_api: httpx.Client) -> None:
    data = unique_model()
    response = local_api.post(
        "/v1/models?filename=raw.onnx",
        content=raw_chunks(data, chunk=50),  # chunked: no Content-Length
        headers={"Content-Type": "application/octet-stream"},
    )
    assert response.status_code == 201, response.text
    assert response.json()["name"] == "raw.onnx"
    assert response.json()["sha256"] == hashlib.sha256(data).hexdigest()


def test_a_zip_of_a_model_with_external_data_is_accepted(api: httpx.Client, tmp_path: Path) -> None:
    external_data_model_dir(tmp_path / "m", scale=random.uniform(0.01, 1.0))
    archive = zip_of_folder(tmp_path / "m")

    response = api.post("/v1/models", files={"file": ("model.zip", archive)})

    assert response.status_code == 201, response.text
    assert response.json()["kind"] == "archive"
    assert response.json()["inputs"][0]["name"] == "x"


@pytest.mark.parametrize(
    ("name", "body", "code"),
    [
        ("notes.onnx", b"this is not a model", "invalid_model"),
        ("half.onnx", tiny_model_bytes()[: len(tiny_model_bytes()) // 2], "invalid_model"),
        ("up.zip", zip_bytes({"../evil.onnx": tiny_model_bytes()}), "bad_archive"),
        ("abs.zip", zip_bytes({"/etc/evil.onnx": tiny_model_bytes()}), "bad_archive"),
        ("link.tar", tar_with_symlink(tiny_model_bytes()), "bad_archive"),
        ("two.zip", zip_bytes({"a.onnx": b"1", "b.onnx": b"2"}), "bad_archive"),
    ],
    ids=["not-onnx", "truncated", "zip-dotdot", "zip-absolute", "tar-symlink", "two-models"],
)
def test_a_bad_upload_is_422_with_a_stable_code_and_no_model(
    local: LiveServer, local_api: httpx.Client, name: str, body: bytes, code: str
) -> None:
    response = local_api.post("/v1/models", files={"file": (name, body)})

    assert response.status_code == 422, response.text
    assert error_code(response) == code
    message = response.json()["message"]  # names no file of the server
    assert str(local.settings.data_dir) not in message and "qpcfarm-upload" not in message
    assert local_api.get("/v1/models").json()["count"] == 0


@pytest.mark.parametrize("form", ["raw", "multipart"])
@pytest.mark.parametrize("length", ["content-length", "chunked"])
def test_an_upload_over_the_limit_is_413_and_leaves_nothing_stored(
    server: LiveServer, api: httpx.Client, form: str, length: str
) -> None:
    data = random.randbytes(LIMIT + 1)
    if form == "raw":
        content_type = "application/octet-stream"
        body: Any = raw_chunks(data)
        if length == "content-length":
            body = data
    else:
        content_type, chunks = multipart_chunks(data, "big.onnx")
        body = b"".join(chunks) if length == "content-length" else chunks

    response = api.post("/v1/models", content=body, headers={"Content-Type": content_type})

    assert response.status_code == 413
    assert error_code(response) == "upload_too_large"
    assert response.json()["max_bytes"] == LIMIT
    assert not server.state.store.exists(hashlib.sha256(data).hexdigest())
    assert leftover_upload_parts(server) == 0
    assert api.get("/v1/models").json()["count"] == 0


def test_a_file_of_exactly_the_limit_is_accepted_by_the_store(local_api: httpx.Client) -> None:
    # Not a model, so the importer refuses it: the point is that the size check let it in.
    response = local_api.post("/v1/models", files={"file": ("big.onnx", b"\0" * LIMIT)})
    assert response.status_code == 422 and error_code(response) == "invalid_model"


def test_a_form_without_a_file_part_is_422_invalid_request(local_api: httpx.Client) -> None:
    response = local_api.post("/v1/models", files={"name": (None, "x")})
    assert response.status_code == 422
    assert error_code(response) == "invalid_request"


def test_form_fields_after_the_file_are_refused(local_api: httpx.Client) -> None:
    boundary = "b0undary"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="m.onnx"\r\n\r\n'
    ).encode() + tiny_model_bytes()
    body += f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="x"\r\n\r\n1\r\n'.encode()
    body += f"--{boundary}--\r\n".encode()
    response = local_api.post(
        "/v1/models",
        content=body,
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    assert response.status_code == 422 and error_code(response) == "invalid_request"
    assert local_api.get("/v1/models").json()["count"] == 0


def test_a_body_of_another_media_type_is_415(local_api: httpx.Client) -> None:
    response = local_api.post("/v1/models", json={"model": "m.onnx"})
    assert response.status_code == 415 and error_code(response) == "unsupported_media_type"


# ---------------------------------------------------------------------------------- auth


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer qpf_not-a-key", "Bearer something", "Basic dXNlcjpwYXNz", "Bearer"],
    ids=["missing", "unknown-key", "malformed-key", "basic", "empty-bearer"],
)
@pytest.mark.parametrize(
    "path", ["/v1/models", "/v1/compile-jobs", f"/v1/qpcs/{ZERO_ID}", "/v1/devices"]
)
def test_requests_without_a_valid_key_get_401_asking_for_a_bearer_token(
    local: LiveServer, authorization: str | None, path: str
) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    with local.client() as client:
        response = client.get(path, headers=headers)

    assert response.status_code == 401
    assert error_code(response) == "unauthorized"
    assert response.headers["www-authenticate"] == "Bearer"


def test_health_probes_and_the_api_docs_need_no_key(local: LiveServer) -> None:
    with local.client() as client:
        assert client.get("/healthz").json() == {"status": "ok", "checks": {}}
        assert client.get("/readyz").status_code == 200
        assert client.get("/docs").status_code == 200
        assert client.get("/openapi.json").status_code == 200


# --------------------------------------------------------------------- unknown and others'


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", f"/v1/models/{ZERO_ID}"),
        ("GET", f"/v1/compile-jobs/{ZERO_ID}"),
        ("POST", f"/v1/compile-jobs/{ZERO_ID}/cancel"),
        ("GET", f"/v1/qpcs/{ZERO_ID}"),
        ("GET", f"/v1/qpcs/{ZERO_ID}/download"),
        ("GET", f"/v1/validations/{ZERO_ID}"),
        ("GET", "/v1/nothing-here"),
    ],
)
def test_unknown_ids_and_routes_answer_404_not_found(
    local_api: httpx.Client, method: str, path: str
) -> None:
    response = local_api.request(method, path)
    assert response.status_code == 404 and error_code(response) == "not_found"


def test_a_malformed_id_is_422_invalid_request(local_api: httpx.Client) -> None:
    response = local_api.get("/v1/models/not-a-uuid")
    assert response.status_code == 422 and error_code(response) == "invalid_request"


def test_another_teams_models_jobs_qpcs_and_validations_answer_404(
    server: LiveServer, api: httpx.Client
) -> None:
    job = compiled(server, api)
    qpc_id = job["qpc_id"]
    validation = api.post(f"/v1/qpcs/{qpc_id}/validate", json={"device": None}).json()

    with server.client(server.new_key()) as other:
        for path in (
            f"/v1/models/{job['model_id']}",
            f"/v1/compile-jobs/{job['id']}",
            f"/v1/qpcs/{qpc_id}",
            f"/v1/qpcs/{qpc_id}/download",
            f"/v1/validations/{validation['id']}",
        ):
            response = other.get(path)
            assert response.status_code == 404, path
            assert error_code(response) == "not_found"
        assert other.post(f"/v1/compile-jobs/{job['id']}/cancel").status_code == 404
        assert other.post(f"/v1/qpcs/{qpc_id}/validate", json={}).status_code == 404
        assert submit(other, job["model_id"]).status_code == 404
        assert other.get("/v1/compile-jobs").json()["count"] == 0
        assert other.get("/v1/models").json()["count"] == 0


# ------------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("body", "code", "flag"),
    [
        ({"options": {"aic-num-cores": 99}}, "invalid_option", "-aic-num-cores"),
        ({"flags": ["-aic-num-cores=0"]}, "invalid_option", "-aic-num-cores"),
        ({"options": {"no-such-option": 1}}, "unknown_option", "-no-such-option"),
        ({"flags": ["-no-such-flag"]}, "unknown_option", "-no-such-flag"),
        ({"options": {"stats-level": 41}}, "invalid_option", "-stats-level"),
        ({"options": {"model": "/etc/passwd"}}, "invalid_option", "-model"),
        ({"flags": ["-aic-binary-dir=/srv"]}, "invalid_option", "-aic-binary-dir"),
        ({"flags": ["-operators-supported=onnx"]}, "invalid_option", "-operators-supported"),
    ],
    ids=[
        "range",
        "flag-range",
        "unknown",
        "unknown-flag",
        "choice",
        "model-path",
        "out-dir",
        "local-action",
    ],
)
def test_bad_options_are_422_naming_the_flag_and_nothing_is_queued(
    local: LiveServer, local_api: httpx.Client, body: dict, code: str, flag: str
) -> None:
    model = upload(local_api)
    enqueued = len(local.queue.ids)

    response = submit(local_api, model["id"], **body)

    assert response.status_code == 422, response.text
    assert error_code(response) == code
    assert response.json()["flag"] == flag
    assert len(local.queue.ids) == enqueued
    assert local_api.get("/v1/compile-jobs").json()["count"] == 0


def test_options_and_flags_together_are_422_invalid_request(local_api: httpx.Client) -> None:
    model = upload(local_api)
    response = submit(local_api, model["id"], options={}, flags=[])
    assert response.status_code == 422 and error_code(response) == "invalid_request"


def test_a_job_for_an_unknown_model_is_404(local_api: httpx.Client) -> None:
    response = submit(local_api, ZERO_ID, options={})
    assert response.status_code == 404 and error_code(response) == "not_found"


# ---------------------------------------------------------------------------------- jobs


def test_a_submitted_job_is_committed_then_enqueued_and_answers_202(
    server: LiveServer, api: httpx.Client
) -> None:
    model = upload(api)
    seen_committed: list[bool] = []

    def enqueue(job_id: uuid.UUID, kind: str = "compile") -> None:  # as a worker would read
        with server.state.session_factory() as session:
            seen_committed.append(session.get(CompileJob, job_id) is not None)
        server.queue.ids.append(job_id)

    server.queue.enqueue = enqueue  # type: ignore[method-assign]
    try:
        response = submit(api, model["id"], flags=["-aic-num-cores=2", "-convert-to-fp16"])
    finally:
        del server.queue.enqueue

    assert response.status_code == 202, response.text
    job = response.json()
    assert job["status"] == "queued" and job["cache_hit"] is False and job["attached"] is False
    assert job["options"]["aic-num-cores"] == 2 and job["options"]["convert-to-fp16"] is True
    assert job["model_id"] == model["id"] and job["error"] is None and job["qpc_id"] is None
    assert seen_committed == [True] and server.queue.ids[-1] == uuid.UUID(job["id"])
    assert api.get(f"/v1/compile-jobs/{job['id']}").json() == job


def test_an_identical_submit_attaches_to_the_queued_job(
    server: LiveServer, api: httpx.Client
) -> None:
    model = upload(api)
    first = submit(api, model["id"], options={"aic-num-cores": 2}).json()
    enqueued = len(server.queue.ids)

    again = submit(api, model["id"], flags=["-aic-num-cores=2"])

    assert again.status_code == 202
    assert again.json()["id"] == first["id"] and again.json()["attached"] is True
    assert len(server.queue.ids) == enqueued


def test_jobs_are_listed_newest_first_by_page_and_status(local_api: httpx.Client) -> None:
    model = upload(local_api)
    ids = [
        submit(local_api, model["id"], options={"aic-num-cores": cores}).json()["id"]
        for cores in (1, 2, 3)
    ]
    local_api.post(f"/v1/compile-jobs/{ids[0]}/cancel")

    page = local_api.get("/v1/compile-jobs", params={"limit": 2}).json()
    assert page["count"] == 3 and [j["id"] for j in page["items"]] == ids[::-1][:2]
    rest = local_api.get("/v1/compile-jobs", params={"limit": 2, "offset": 2}).json()
    assert [j["id"] for j in rest["items"]] == [ids[0]]
    cancelled = local_api.get("/v1/compile-jobs", params={"status": "cancelled"}).json()
    assert [j["id"] for j in cancelled["items"]] == [ids[0]]
    bad = local_api.get("/v1/compile-jobs", params={"status": "sleeping"})
    assert bad.status_code == 422 and error_code(bad) == "invalid_request"


def test_a_queued_job_cancels_at_once_and_a_finished_one_is_409(
    server: LiveServer, api: httpx.Client
) -> None:
    model = upload(api)
    job = submit(api, model["id"]).json()

    response = api.post(f"/v1/compile-jobs/{job['id']}/cancel")

    assert response.status_code == 200
    assert response.json()["status"] == "cancelled" and response.json()["finished_at"]
    again = api.post(f"/v1/compile-jobs/{job['id']}/cancel")
    assert again.status_code == 409 and error_code(again) == "not_cancellable"
    with server.state.session_factory() as session:  # a worker given the id runs nothing
        assert compile_jobs.claim(session, uuid.UUID(job["id"]), "test-worker") is None


def test_a_finished_compile_is_reported_and_an_identical_submit_is_a_cache_hit(
    server: LiveServer, api: httpx.Client
) -> None:
    model = upload(api)
    job = submit(api, model["id"], options={"aic-num-cores": 2, "aic-perf-metrics": True})
    play_worker(server, job.json()["id"])

    done = api.get(f"/v1/compile-jobs/{job.json()['id']}").json()
    assert done["status"] == "succeeded" and done["stage"] == "done" and done["progress"] == 1
    assert done["qpc_id"] and done["metrics"] and done["pass_times"]
    assert isinstance(done["warnings"], list) and done["attempts"] == 1
    enqueued = len(server.queue.ids)

    hit = submit(api, model["id"], flags=["-aic-num-cores=2"])

    assert hit.status_code == 200, hit.text
    body = hit.json()
    assert body["cache_hit"] is True and body["status"] == "succeeded"
    assert body["qpc_id"] == done["qpc_id"] and body["id"] != done["id"]
    assert body["metrics"] == done["metrics"]
    assert len(server.queue.ids) == enqueued


def test_a_failed_compile_carries_a_structured_error(server: LiveServer, api: httpx.Client) -> None:
    dynamic = tiny_model(scale=random.uniform(0.01, 1.0), batch="N").SerializeToString()
    model = upload(api, dynamic)
    job = submit(api, model["id"]).json()
    play_worker(server, job["id"])

    failed = api.get(f"/v1/compile-jobs/{job['id']}").json()

    assert failed["status"] == "failed" and failed["qpc_id"] is None
    assert failed["error"]["code"] == "dynamic_shape"
    assert failed["error"]["message"]


# ---------------------------------------------------------------------------------- qpcs


def test_a_qpc_is_read_with_its_report(server: LiveServer, api: httpx.Client) -> None:
    job = compiled(server, api)

    qpc = api.get(f"/v1/qpcs/{job['qpc_id']}").json()

    assert qpc["id"] == job["qpc_id"] and len(qpc["sha256"]) == 64 and qpc["size"] > 0
    assert qpc["report"]["metrics"] == job["metrics"]
    assert qpc["report"]["pass_times"] == job["pass_times"]
    assert qpc["requirements"]["num_cores"] == 2
    assert qpc["download_url"] == f"/v1/qpcs/{qpc['id']}/download"


def test_a_qpc_downloads_streamed_with_its_sha256_as_etag_and_ranges(
    server: LiveServer, api: httpx.Client
) -> None:
    qpc = api.get(f"/v1/qpcs/{compiled(server, api)['qpc_id']}").json()
    url = f"/v1/qpcs/{qpc['id']}/download"

    full = api.get(url)
    assert full.status_code == 200
    assert hashlib.sha256(full.content).hexdigest() == qpc["sha256"]
    assert full.headers["etag"] == f'"{qpc["sha256"]}"'
    assert full.headers["content-disposition"] == "attachment; filename=programqpc.bin"
    assert full.headers["accept-ranges"] == "bytes"
    data, size = full.content, qpc["size"]

    assert api.get(url, headers={"If-None-Match": full.headers["etag"]}).status_code == 304
    assert api.get(url, headers={"If-None-Match": '"other"'}).status_code == 200

    part = api.get(url, headers={"Range": "bytes=10-19"})
    assert part.status_code == 206 and part.content == data[10:20]
    assert part.headers["content-range"] == f"bytes 10-19/{size}"
    tail = api.get(url, headers={"Range": "bytes=-7"})
    assert tail.status_code == 206 and tail.content == data[-7:]
    rest = api.get(url, headers={"Range": f"bytes={size - 3}-"})
    assert rest.content == data[-3:]
    clipped = api.get(url, headers={"Range": f"bytes=0-{size + 100}"})
    assert clipped.status_code == 206 and clipped.content == data

    for bad in (f"bytes={size}-", "bytes=5-2", "items=0-1", "bytes=0-1,4-5"):
        refused = api.get(url, headers={"Range": bad})
        assert refused.status_code == 416, bad
        assert refused.headers["content-range"] == f"bytes */{size}"
        assert error_code(refused) == "range_not_satisfiable"

    stale = api.get(url, headers={"Range": "bytes=0-1", "If-Range": '"older"'})
    assert stale.status_code == 200 and stale.content == data


def test_a_stored_qpc_validated_against_a_too_small_device_fails_its_device_checks(
    server: LiveServer, api: httpx.Client
) -> None:
    qpc_id = compiled(server, api, cores=12)["qpc_id"]

    small = api.post(f"/v1/qpcs/{qpc_id}/validate", json={"device": "aic080"})
    big = api.post(f"/v1/qpcs/{qpc_id}/validate", json={"device": "aic100-pro"})

    assert small.status_code == 201, small.text
    result = small.json()
    assert result["ok"] is False and result["device"] == "aic080"
    failing = [c["name"] for c in result["checks"] if not c["ok"]]
    # too few cores, so the card holds no instance of it either
    assert failing == ["device-cores", "device-instances"]
    assert result["qpc_id"] == qpc_id
    assert api.get(f"/v1/validations/{result['id']}").json() == result
    assert big.json()["ok"] is True and all(c["ok"] for c in big.json()["checks"])


def test_validating_against_an_unknown_device_is_422_unknown_device(
    server: LiveServer, api: httpx.Client
) -> None:
    qpc_id = compiled(server, api)["qpc_id"]
    response = api.post(f"/v1/qpcs/{qpc_id}/validate", json={"device": "gpu-9000"})
    assert response.status_code == 422 and error_code(response) == "unknown_device"


def test_an_uploaded_tampered_qpc_validates_as_not_ok_with_the_failing_checks(
    server: LiveServer, api: httpx.Client
) -> None:
    qpc_id = compiled(server, api)["qpc_id"]
    good = api.get(f"/v1/qpcs/{qpc_id}/download").content
    tampered = bytearray(good)
    tampered[len(good) // 2] ^= 0xFF

    response = api.post(
        "/v1/validations",
        data={"device": "aic100-standard"},
        files={"file": ("programqpc.bin", bytes(tampered))},
    )

    assert response.status_code == 201, response.text
    result = response.json()
    assert result["ok"] is False and result["device"] == "aic100-standard"
    assert "checksums" in [c["name"] for c in result["checks"] if not c["ok"]]
    assert result["qpc_id"] is None

    intact = api.post(
        "/v1/validations?device=aic100-standard",
        content=good,
        headers={"Content-Type": "application/octet-stream"},
    ).json()
    assert intact["ok"] is True and intact["qpc_id"] == qpc_id  # linked: same content
    listed = api.get("/v1/validations").json()
    assert {v["id"] for v in listed["items"]} == {result["id"], intact["id"]}


def test_an_uploaded_qpc_for_an_unknown_device_is_422_and_not_validated(
    local_api: httpx.Client,
) -> None:
    response = local_api.post(
        "/v1/validations", data={"device": "gpu-9000"}, files={"file": ("q.bin", b"junk")}
    )
    assert response.status_code == 422 and error_code(response) == "unknown_device"
    assert local_api.get("/v1/validations").json()["count"] == 0


# ---------------------------------------------------------------------------------- meta


def test_devices_lists_the_compilers_device_profiles(local_api: httpx.Client) -> None:
    devices = local_api.get("/v1/devices").json()

    assert [d["name"] for d in devices] == device_names()
    standard = next(d for d in devices if d["name"] == "aic100-standard")
    assert standard["num_cores"] == 14 and standard["vtcm_bytes"] == 8_323_072
    assert standard["ddr_bytes"] == 16 << 30 and "float16" in standard["dtypes"]


def test_operators_lists_the_op_registry_for_onnx_only(local_api: httpx.Client) -> None:
    from compiler_core.ops import REGISTRY

    operators = local_api.get("/v1/operators", params={"framework": "onnx"}).json()

    assert len(operators) == len(REGISTRY.all())
    relu = next(o for o in operators if o["op"] == "Relu")
    assert relu["domain"] == "ai.onnx" and relu["since"] >= 1 and "float32" in relu["dtypes"]
    other = local_api.get("/v1/operators", params={"framework": "tflite"})
    assert other.status_code == 422 and error_code(other) == "unknown_framework"


def test_readyz_answers_503_while_the_queue_is_unreachable(server: LiveServer) -> None:
    with server.client() as client:
        assert client.get("/readyz").json() == {
            "status": "ok",
            "checks": {"database": "ok", "queue": "ok", "blobs": "ok"},
        }
        server.queue.reachable = False
        try:
            response = client.get("/readyz")
        finally:
            server.queue.reachable = True
    assert response.status_code == 503
    assert response.json()["checks"]["queue"] == "unavailable"


def test_openapi_lists_every_route_and_the_compilers_options_schema(local: LiveServer) -> None:
    with local.client() as client:
        schema = client.get("/openapi.json").json()

    assert set(schema["paths"]) >= {
        "/v1/models",
        "/v1/models/{model_id}",
        "/v1/compile-jobs",
        "/v1/compile-jobs/{job_id}",
        "/v1/compile-jobs/{job_id}/cancel",
        "/v1/qpcs/{qpc_id}",
        "/v1/qpcs/{qpc_id}/download",
        "/v1/qpcs/{qpc_id}/validate",
        "/v1/validations",
        "/v1/validations/{validation_id}",
        "/v1/devices",
        "/v1/operators",
        "/healthz",
        "/readyz",
    }
    components = schema["components"]["schemas"]
    assert components["CompileOptions"] == options_json_schema()
    options_field = components["JobCreate"]["properties"]["options"]
    assert {"$ref": "#/components/schemas/CompileOptions"} in options_field["anyOf"]
    upload_body = schema["paths"]["/v1/models"]["post"]["requestBody"]["content"]
    assert set(upload_body) == {"multipart/form-data", "application/octet-stream"}


class PutSpy:
    """Wraps the server's blob store to record how each `put` ended."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.outcomes: list[BaseException | None] = []

    def put(self, data: Any, **kwargs: Any) -> Any:
        try:
            ref = self._store.put(data, **kwargs)
        except BaseException as exc:
            self.outcomes.append(exc)
            raise
        self.outcomes.append(None)
        return ref

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_an_upload_cut_off_mid_body_stores_nothing(local: LiveServer) -> None:
    data = random.randbytes(200_000)
    key = local.new_key()
    host, port = local.url.removeprefix("http://").split(":")
    spy = PutSpy(local.state.store)
    local.state.store = spy
    try:
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                (
                    "POST /v1/models?filename=cut.onnx HTTP/1.1\r\n"
                    f"Host: {host}\r\nAuthorization: Bearer {key}\r\n"
                    "Content-Type: application/octet-stream\r\n"
                    f"Content-Length: {len(data)}\r\n\r\n"
                ).encode()
                + data[:150_000]
            )
        deadline = time.monotonic() + 60
        while not spy.outcomes:  # the server notices the cut and the store gives up
            assert time.monotonic() < deadline, "the cut upload never reached the store"
            time.sleep(0.01)
    finally:
        local.state.store = spy._store

    assert isinstance(spy.outcomes[0], UploadInterrupted)
    assert leftover_upload_parts(local) == 0
    assert not local.state.store.exists(hashlib.sha256(data[:150_000]).hexdigest())
    with local.client(key) as client:
        assert client.get("/v1/models").json()["count"] == 0


def test_without_required_auth_a_request_without_key_acts_as_the_local_team(
    tmp_path: Path,
) -> None:
    with live_server("sqlite", tmp_path, require_auth=False) as server:
        with server.client() as anonymous:
            model = upload(anonymous)
            assert anonymous.get("/v1/models").json()["items"] == [model]
            wrong = anonymous.get("/v1/models", headers={"Authorization": "Bearer qpf_x"})
            assert wrong.status_code == 401
        with server.client(server.new_key("local")) as keyed:
            assert keyed.get(f"/v1/models/{model['id']}").json() == model
    assert server.queue.closed is False  # a queue passed to create_app is its owner's


# ------------------------------------------------------------- options that name input files


def _decoder_archive(*, with_files: bool = True) -> bytes:
    from tests.decoder_model import kv_decoder, past_names, retained_name

    model = kv_decoder(seed=random.randrange(1 << 30)).SerializeToString()
    specs = {
        "specializations": [
            {"name": "prefill", "symbols": {"batch_size": "1", "seq_len": "8"}},
            {"name": "decode", "symbols": {"batch_size": "1", "seq_len": "1"}},
        ]
    }
    io_list = "".join(
        f"- IOName: {n}\n  Precision: float16\n"
        for p in past_names(2)
        for n in (p, retained_name(p))
    )
    members = {"decoder.onnx": model}
    if with_files:
        members |= {"specs.json": json.dumps(specs).encode(), "io.yaml": io_list.encode()}
    return zip_bytes(members)


LLM_FLAGS = [
    "-network-specialization-config=specs.json",
    "-custom-IO-list-file=io.yaml",
    "-retained-state",
    "-aic-num-cores=2",
]


def test_specialization_and_custom_io_files_travel_in_the_model_archive(
    local: LiveServer, local_api: httpx.Client, tmp_path: Path
) -> None:
    from compiler_core import QpcSession
    from tests.decoder_model import generate_reference, generate_with

    archive = _decoder_archive()
    model = upload(local_api, archive, "decoder.zip")
    job = submit(local_api, model["id"], flags=LLM_FLAGS).json()
    play_worker(local, job["id"])
    done = local_api.get(f"/v1/compile-jobs/{job['id']}").json()
    assert done["status"] == "succeeded", done
    qpc = local_api.get(f"/v1/qpcs/{done['qpc_id']}/download")
    assert qpc.status_code == 200
    path = tmp_path / "programqpc.bin"
    path.write_bytes(qpc.content)
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        decoder = onnx.load_from_string(zf.read("decoder.onnx"))
    prompt = np.array([[3, 17, 5, 40, 22, 9, 11, 30]], np.int64)
    with QpcSession(path) as session:
        assert [s.name for s in session.specializations] == ["prefill", "decode"]
        tokens = generate_with(session.run, prompt, 4, feed_back=False)
    assert tokens == generate_reference(decoder, prompt, 4)


@pytest.mark.parametrize("value", ["/etc/specs.json", "../specs.json", "C:\\specs.json"])
def test_a_file_option_outside_the_upload_is_refused_at_submit(
    local_api: httpx.Client, value: str
) -> None:
    model = upload(local_api)
    response = submit(local_api, model["id"], flags=[f"-network-specialization-config={value}"])
    assert response.status_code == 422, response.text
    assert error_code(response) == "invalid_option"
    assert "relative to the model" in response.json()["message"]


def test_a_file_option_on_a_bare_model_is_refused_at_submit(local_api: httpx.Client) -> None:
    model = upload(local_api)
    response = submit(local_api, model["id"], flags=LLM_FLAGS)
    assert response.status_code == 422, response.text
    assert error_code(response) == "invalid_option"
    assert "uploaded as a bare .onnx" in response.json()["message"]


def test_a_file_option_the_archive_does_not_carry_fails_the_job_naming_it(
    local: LiveServer, local_api: httpx.Client
) -> None:
    model = upload(local_api, _decoder_archive(with_files=False), "decoder.zip")
    job = submit(local_api, model["id"], flags=LLM_FLAGS).json()
    play_worker(local, job["id"])
    done = local_api.get(f"/v1/compile-jobs/{job['id']}").json()
    assert done["status"] == "failed"
    assert done["error"]["code"] == "invalid_option"
    assert "has no file specs.json beside the model" in done["error"]["message"]
