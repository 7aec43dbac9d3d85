"""No corrupt QPC is ever served: downloads, cache hits, validations and profiles read a blob
only through a check against its sha256, quarantine what fails, and answer a coded 5xx; a
resubmit compiles the QPC again; `qpcfarm admin verify-blobs` finds damage before a reader.

Over real HTTP on both deployment modes (SQLite + filesystem blobs, PostgreSQL + database
blobs); one byte of a stored blob is flipped in place, as a failing disk would.
"""

from __future__ import annotations

import base64
import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from app.domain.db.models import QuarantinedBlob
from tests.api_helpers import LiveServer
from tests.conftest import corrupt_blob, tiny_model_bytes
from worker import compile_jobs


@pytest.fixture
def api(server: LiveServer) -> Iterator[httpx.Client]:
    with server.client(server.new_key()) as client:
        yield client


def play_worker(server: LiveServer, job_id: str) -> None:
    with server.state.session_factory() as session:
        job = compile_jobs.claim(session, uuid.UUID(job_id), "test-worker")
        assert job is not None
        compile_jobs.run_compile(session, server.state.store, job)


def compile_new(server: LiveServer, api: httpx.Client) -> tuple[str, dict]:
    """(model id, finished job) of a model no other test uploads."""
    data = tiny_model_bytes(0.01 + uuid.uuid4().int % 10**9 / 10**9)
    model = api.post("/v1/models", files={"file": ("m.onnx", data)}).json()
    job = api.post("/v1/compile-jobs", json={"model_id": model["id"], "options": {}}).json()
    play_worker(server, job["id"])
    done = api.get(f"/v1/compile-jobs/{job['id']}").json()
    assert done["status"] == "succeeded", done
    return model["id"], done


def quarantined_by(server: LiveServer, sha256: str) -> list[str]:
    with server.state.session_factory() as session:
        query = select(QuarantinedBlob.found_by).where(QuarantinedBlob.sha256 == sha256)
        return list(session.execute(query).scalars())


def test_a_download_carries_the_sha256_as_etag_and_repr_digest(
    server: LiveServer, api: httpx.Client
) -> None:
    _, job = compile_new(server, api)
    answer = api.get(f"/v1/qpcs/{job['qpc_id']}/download")
    digest = base64.b64encode(hashlib.sha256(answer.content).digest()).decode()
    assert answer.headers["repr-digest"] == f"sha-256=:{digest}:"
    assert answer.headers["digest"] == f"sha-256={digest}"


def test_a_corrupt_qpc_is_not_downloaded_or_validated_and_a_resubmit_compiles_it_again(
    server: LiveServer, api: httpx.Client
) -> None:
    model_id, job = compile_new(server, api)
    qpc = api.get(f"/v1/qpcs/{job['qpc_id']}").json()
    good = api.get(f"/v1/qpcs/{qpc['id']}/download").content
    corrupt_blob(server.state.store, qpc["sha256"])

    for _ in range(2):  # found, quarantined; then known to be quarantined
        refused = api.get(f"/v1/qpcs/{qpc['id']}/download")
        assert (refused.status_code, refused.json()["code"]) == (500, "blob_corrupt")
        assert "/" not in refused.json()["message"]  # no server path
    refused = api.post(f"/v1/qpcs/{qpc['id']}/validate", json={"device": None})
    assert (refused.status_code, refused.json()["code"]) == (500, "blob_corrupt")
    assert quarantined_by(server, qpc["sha256"]) == ["download"]

    again = api.post("/v1/compile-jobs", json={"model_id": model_id, "options": {}})
    assert again.status_code == 202 and not again.json()["cache_hit"], again.text
    play_worker(server, again.json()["id"])
    rebuilt = api.get(f"/v1/compile-jobs/{again.json()['id']}").json()
    assert rebuilt["status"] == "succeeded" and rebuilt["qpc_id"] == qpc["id"]
    assert api.get(f"/v1/qpcs/{qpc['id']}/download").content == good


def test_a_resubmit_of_a_corrupt_qpc_is_no_cache_hit(server: LiveServer, api: httpx.Client) -> None:
    model_id, job = compile_new(server, api)
    qpc = api.get(f"/v1/qpcs/{job['qpc_id']}").json()
    corrupt_blob(server.state.store, qpc["sha256"], offset=0)

    again = api.post("/v1/compile-jobs", json={"model_id": model_id, "options": {}}).json()
    assert (again["status"], again["cache_hit"], again["qpc_id"]) == ("queued", False, None)
    assert quarantined_by(server, qpc["sha256"]) == ["cache"]


def test_a_large_corrupt_qpc_streams_but_never_completes(
    server: LiveServer, api: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.api import downloads

    monkeypatch.setattr(downloads, "CHECK_FIRST_BYTES", 0)  # every QPC is streamed
    _, job = compile_new(server, api)
    qpc = api.get(f"/v1/qpcs/{job['qpc_id']}").json()
    url = f"/v1/qpcs/{qpc['id']}/download"
    good = api.get(url)
    assert hashlib.sha256(good.content).hexdigest() == qpc["sha256"]
    part = api.get(url, headers={"Range": "bytes=3-12"})
    assert part.status_code == 206 and part.content == good.content[3:13]

    corrupt_blob(server.state.store, qpc["sha256"])
    received = b""
    with pytest.raises(httpx.HTTPError):  # the connection ends short of Content-Length
        with api.stream("GET", url) as answer:
            for piece in answer.iter_bytes():
                received += piece
    assert len(received) < qpc["size"]
    refused = api.get(url)
    assert (refused.status_code, refused.json()["code"]) == (500, "blob_corrupt")


def test_a_job_whose_model_blob_is_corrupt_fails_blob_corrupt(
    server: LiveServer, api: httpx.Client
) -> None:
    model = api.post("/v1/models", files={"file": ("m.onnx", tiny_model_bytes(0.777))}).json()
    corrupt_blob(server.state.store, model["sha256"], offset=10)
    job = api.post("/v1/compile-jobs", json={"model_id": model["id"], "options": {}}).json()
    play_worker(server, job["id"])
    failed = api.get(f"/v1/compile-jobs/{job['id']}").json()
    assert (failed["status"], failed["error"]["code"]) == ("failed", "blob_corrupt")


def test_verify_blobs_quarantines_corrupt_blobs_and_lists_the_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.console.cli import main
    from app.domain.settings import get_settings
    from tests.api_helpers import live_server

    with live_server("sqlite", tmp_path / "data") as server, server.client(server.new_key()) as api:
        _, job = compile_new(server, api)
        qpc = api.get(f"/v1/qpcs/{job['qpc_id']}").json()
    monkeypatch.setenv("QPCFARM_DATA_DIR", str(tmp_path / "data"))
    for name in ("QPCFARM_DATABASE_URL", "QPCFARM_BROKER_URL", "QPCFARM_BLOB_STORE"):
        monkeypatch.delenv(name, raising=False)
    get_settings.cache_clear()
    try:
        assert main(["admin", "verify-blobs"]) == 0
        assert "checked 2 blobs" in capsys.readouterr().out  # the model and its QPC
        corrupt_blob(server.state.store, qpc["sha256"])
        assert main(["admin", "verify-blobs"]) == 1
        out = capsys.readouterr().out
        assert f"corrupt {qpc['sha256']}: quarantined" in out
        assert f"missing {qpc['sha256']} (qpc): quarantined as corrupt" in out
        assert main(["admin", "verify-blobs"]) == 1  # still missing until rebuilt
        assert "0 corrupt, 1 missing" in capsys.readouterr().out
    finally:
        get_settings.cache_clear()
