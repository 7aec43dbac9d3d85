"""The HTTP side of the farm's security (docs/security.md), over real HTTP: what a request
without a valid key may cost, the bounds on bodies, uploads in flight, archives, profile
inputs and sweeps, the CSRF token's binding to the session, refused uploads leaving no blob,
the embedded mode's file modes, and that no answer names a server path.

Each hostile case answers a coded 4xx; the core cases run on both deployment modes (SQLite +
filesystem blobs, PostgreSQL + database blobs).
"""

from __future__ import annotations

import functools
import io
import os
import random
import re
import socket
import stat
import struct
import tarfile
import tempfile
import threading
import time
import tracemalloc
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from app.domain.services.archives import ArchiveLimits, extract_archive
from tests.api_helpers import LiveServer, Servers, live_server, tar_with_symlink, zip_bytes
from tests.conftest import external_data_model_dir, tiny_model, tiny_model_bytes

UPLOAD_LIMIT = 8 << 20
JSON_LIMIT = 64 << 10
OVERRIDES: dict[str, Any] = {
    "max_upload_bytes": UPLOAD_LIMIT,
    "max_json_body_bytes": JSON_LIMIT,
    "max_uploads_per_key": 2,
    "max_sweep_combinations": 8,
    "max_team_sweep_compiles": 2,
    "max_profile_inputs_bytes": 64 << 20,
}
WAIT_S = 60.0


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    running = Servers(tmp_path_factory, **OVERRIDES)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture
def local(servers: Servers) -> LiveServer:
    return servers.get("sqlite")


@pytest.fixture
def api(server: LiveServer) -> Iterator[httpx.Client]:
    with server.client(server.new_key()) as client:
        yield client


def refused(answer: httpx.Response | RawAnswer, status: int, code: str) -> None:
    body = answer.json()
    assert (answer.status_code, body.get("code")) == (status, code), answer.text


# ------------------------------------------------------------------------ raw HTTP helpers


class RawAnswer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status_code = status
        self.headers = headers
        self.content = body

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        import json

        return json.loads(self.content)


def open_request(
    server: LiveServer, method: str, path: str, headers: dict[str, str], body: bytes = b""
) -> socket.socket:
    """A connection that has sent the request line, `headers` and `body` (which may be
    only the start of what Content-Length declares) and then sends nothing more."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    return sock


def read_answer(sock: socket.socket) -> RawAnswer:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed without answering: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return RawAnswer(status, headers, rest[:length])


def partial_request(
    server: LiveServer, method: str, path: str, headers: dict[str, str], sent: bytes = b""
) -> RawAnswer:
    """The answer to a request that declares its body and sends only `sent` of it."""
    with open_request(server, method, path, headers, sent) as sock:
        return read_answer(sock)


MiB = 1 << 20
HUGE = 200 * MiB


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Temp files of this process (the server runs in it) go to a folder of the test's."""
    folder = tmp_path / "process-tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


# ----------------------------------------------- 1. bodies: authenticated and bounded first


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/v1/compile-jobs", "application/json"),
        ("/v1/models", "application/octet-stream"),
        ("/v1/models", "multipart/form-data; boundary=x"),
        ("/v1/validations", "application/octet-stream"),
        ("/v1/sweeps", "application/json"),
        ("/v1/keys", "application/json"),
    ],
)
def test_a_body_without_a_valid_key_is_answered_401_before_a_byte_of_it_is_read(
    server: LiveServer, path: str, content_type: str
) -> None:
    """200 MiB declared, 16 KiB sent: the answer comes at once, so the rest was never
    waited for, read, parsed or spooled."""
    for auth in ({}, {"Authorization": "Bearer qpf_unknown_key_unknown_key"}):
        headers = {"Content-Type": content_type, "Content-Length": str(HUGE), **auth}
        answer = partial_request(server, "POST", path, headers, b"{" * (16 << 10))
        refused(answer, 401, "unauthorized")
        assert answer.headers["www-authenticate"] == "Bearer"


def test_without_required_keys_another_authorization_scheme_is_no_key(tmp_path: Path) -> None:
    """A proxy's `Authorization: Basic` reaches a farm that requires no key: it is not a
    bearer key, so the request goes on as the local team's (as before the guard)."""
    with live_server("sqlite", tmp_path / "data", require_auth=False) as server:
        answer = httpx.post(
            f"{server.url}/v1/compile-jobs",
            json={"model_id": str(uuid.uuid4())},
            headers={"Authorization": "Basic dXNlcjpwYXNz"},
        )
        refused(answer, 404, "not_found")


def test_a_web_form_without_a_session_is_refused_before_its_file_is_spooled(
    local: LiveServer, private_tmp: Path
) -> None:
    headers = {"Content-Type": "multipart/form-data; boundary=b", "Content-Length": str(HUGE)}
    part = b'--b\r\nContent-Disposition: form-data; name="model"; filename="m.onnx"\r\n\r\n'
    answer = partial_request(local, "POST", "/", headers, part + b"\0" * (64 << 10))
    refused(answer, 401, "unauthorized")
    browser = partial_request(local, "POST", "/", {**headers, "Accept": "text/html"}, part)
    assert browser.status_code == 303 and browser.headers["location"] == "/sign-in?next=/"
    assert list(private_tmp.iterdir()) == []


def test_an_unauthenticated_stream_costs_the_api_no_more_than_a_few_kb(
    local: LiveServer, private_tmp: Path
) -> None:
    """A chunked body without a key that keeps coming: the answer is sent at once and the
    connection closed; the process's traced allocations stay small meanwhile."""
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        sock = open_request(
            local,
            "POST",
            "/v1/models",
            {"Content-Type": "application/octet-stream", "Transfer-Encoding": "chunked"},
        )
        answer: list[RawAnswer] = []
        reader = threading.Thread(target=lambda: answer.append(read_answer(sock)))
        reader.start()
        chunk = b"%x\r\n" % (1 << 16) + b"\0" * (1 << 16) + b"\r\n"
        sent = 0
        try:
            while reader.is_alive() and sent < 64 * MiB:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # the server closed the connection after answering
        reader.join(WAIT_S)
        sock.close()
        peak = tracemalloc.get_traced_memory()[1] - baseline
    finally:
        tracemalloc.stop()
    refused(answer[0], 401, "unauthorized")
    assert peak < 4 * MiB, f"{peak:,} bytes allocated for an unauthenticated body"
    assert list(private_tmp.iterdir()) == []


def test_the_guard_knows_every_route_whose_body_is_a_file(local: LiveServer) -> None:
    from app.api.request_guard import upload_patterns

    found = {
        (method, path)
        for methods, pattern in upload_patterns(local.app)
        for method in methods
        for path in ("/v1/models", "/v1/validations", f"/v1/qpcs/{uuid.uuid4()}/profile", "/")
        if pattern.match(path)
    }
    assert {m for m, _ in found} == {"POST"}
    assert len(found) == 4


def test_web_forms_are_bounded_before_they_are_read(local: LiveServer, private_tmp: Path) -> None:
    """Signing in needs no session, so its form has the small form bound; a signed-in
    upload form has the upload bound (a larger one is refused from its headers)."""
    form = {"Content-Type": "application/x-www-form-urlencoded", "Content-Length": str(HUGE)}
    refused(partial_request(local, "POST", "/sign-in", form, b"api_key="), 413, "body_too_large")
    with httpx.Client(base_url=local.url) as browser:
        page = browser.get("/sign-in").text
        token = re.search(r'name="csrf" value="([^"]+)"', page)
        assert token is not None
        data = {"api_key": local.new_key(), "csrf": token.group(1)}
        assert browser.post("/sign-in", data=data).status_code == 303
        session = browser.cookies["qpcfarm_session"]
    upload = {
        "Content-Type": "multipart/form-data; boundary=b",
        "Content-Length": str(UPLOAD_LIMIT + (1 << 20)),
        "Cookie": f"qpcfarm_session={session}",
    }
    refused(partial_request(local, "POST", "/", upload, b"--b\r\n"), 413, "upload_too_large")
    assert list(private_tmp.iterdir()) == []


def test_a_json_body_over_the_limit_is_413_body_too_large_from_its_headers(
    api: httpx.Client, server: LiveServer
) -> None:
    key = api.headers["Authorization"].removeprefix("Bearer ")
    headers = {
        "Authorization": f"Bearer {key}",
        "Content-Type": "application/json",
        "Content-Length": str(HUGE),
    }
    answer = partial_request(server, "POST", "/v1/compile-jobs", headers, b"{")
    refused(answer, 413, "body_too_large")
    assert answer.json()["max_bytes"] == JSON_LIMIT

    def endless() -> Iterator[bytes]:  # no Content-Length: counted as it streams
        yield b'{"model_id": "' + b"0" * (JSON_LIMIT + 1)
        yield b'"}'

    streamed = api.post(
        "/v1/compile-jobs", content=endless(), headers={"Content-Type": "application/json"}
    )
    refused(streamed, 413, "body_too_large")
    refused(api.post("/v1/sweeps", content=endless()), 413, "body_too_large")


def test_a_body_that_stalls_is_dropped_with_408_and_leaves_no_temp_file(
    tmp_path: Path,
) -> None:
    with live_server("sqlite", tmp_path / "data", body_read_timeout_s=0.5) as server:
        key = server.new_key()
        headers = {
            "Authorization": f"Bearer {key}",
            "Content-Type": "application/octet-stream",
            "Content-Length": str(1 * MiB),
        }
        answer = partial_request(server, "POST", "/v1/models?filename=m.onnx", headers, b"x" * 1000)
        refused(answer, 408, "body_timeout")
        json_headers = {**headers, "Content-Type": "application/json"}
        refused(
            partial_request(server, "POST", "/v1/sweeps", json_headers, b"{"), 408, "body_timeout"
        )
        assert list((tmp_path / "data" / "blobs" / "tmp").iterdir()) == []
        assert list(server.state.store.list_blobs()) == []


def test_uploads_in_flight_per_key_are_bounded_with_429_and_retry_after(
    server: LiveServer,
) -> None:
    key, other = server.new_key(), server.new_key()
    headers = {
        "Authorization": f"Bearer {key}",
        "Content-Type": "application/octet-stream",
        "Content-Length": str(4 * MiB),
    }
    slow = [
        open_request(server, "POST", "/v1/models?filename=slow.onnx", headers, b"\0" * 1000)
        for _ in range(2)
    ]
    try:
        with server.client(key) as client:
            deadline = time.monotonic() + WAIT_S
            while True:  # the two slow uploads reach the server
                answer = client.post("/v1/models", files={"file": ("m.onnx", tiny_model_bytes())})
                if answer.status_code == 429 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            refused(answer, 429, "too_many_uploads")
            assert answer.headers["retry-after"].isdigit()
        with server.client(other) as client:  # another key is not held up
            assert (
                client.post(
                    "/v1/models", files={"file": ("m.onnx", tiny_model_bytes(0.42))}
                ).status_code
                == 201
            )
    finally:
        for sock in slow:
            sock.close()
    with server.client(key) as client:  # the slots come back when the uploads end
        deadline = time.monotonic() + WAIT_S
        while (
            client.post("/v1/models", files={"file": ("m.onnx", tiny_model_bytes(0.43))})
        ).status_code != 201:
            assert time.monotonic() < deadline, "the cut uploads kept their slots"
            time.sleep(0.05)


# ------------------------------------------------------------------------------ 2. archives


def zeros_zip(unpacked: int, name: str = "weights.bin") -> bytes:
    """A zip holding tiny.onnx and `unpacked` bytes of zeros, deflated (written in pieces)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("model.onnx", tiny_model_bytes())
        with archive.open(name, "w", force_zip64=True) as out:
            for start in range(0, unpacked, MiB):
                out.write(bytes(min(MiB, unpacked - start)))
    return buffer.getvalue()


def half_random_zip(unpacked: int) -> bytes:
    """Deflates to about half: under any ratio bound, over a total bound."""
    rng = random.Random(7)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("model.onnx", tiny_model_bytes())
        with archive.open("weights.bin", "w") as out:
            for _ in range(unpacked // 4096):
                out.write(rng.randbytes(2048) + bytes(2048))
    return buffer.getvalue()


def encrypted_zip() -> bytes:
    """A zip whose members carry the 'encrypted' flag (zipfile cannot write real ones)."""
    data = bytearray(zip_bytes({"model.onnx": tiny_model_bytes()}))
    for signature, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        at = data.find(signature)
        flags = struct.unpack_from("<H", data, at + flag_at)[0]
        struct.pack_into("<H", data, at + flag_at, flags | 0x1)
    return bytes(data)


def corrupt_deflate_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("model.onnx", tiny_model_bytes() * 20)
    data = bytearray(buffer.getvalue())
    for offset in range(40, 200, 7):  # inside the deflate stream, after the local header
        data[offset] ^= 0x5A
    return bytes(data)


def deep_zip(levels: int = 2000) -> bytes:
    return zip_bytes({"a/" * levels + "model.onnx": tiny_model_bytes()})


def upload(client: httpx.Client, data: bytes, name: str) -> httpx.Response:
    return client.post("/v1/models", files={"file": (name, data)})


def test_a_zip_bomb_is_refused_by_the_ratio_bound_before_it_is_written(api: httpx.Client) -> None:
    bomb = zeros_zip(63 * MiB)
    assert len(bomb) < 128 << 10
    answer = upload(api, bomb, "bomb.zip")
    refused(answer, 413, "archive_ratio")
    assert "QPCFARM_ARCHIVE_MAX_RATIO" in answer.json()["message"]


def test_an_archive_unpacking_past_the_upload_limit_is_archive_too_large(
    api: httpx.Client,
) -> None:
    archive = half_random_zip(UPLOAD_LIMIT + 2 * MiB)
    assert len(archive) < UPLOAD_LIMIT
    answer = upload(api, archive, "big.zip")
    refused(answer, 413, "archive_too_large")
    assert answer.json()["max_bytes"] == UPLOAD_LIMIT


@pytest.mark.parametrize(
    ("make", "says"),
    [(encrypted_zip, "encrypted"), (corrupt_deflate_zip, "corrupt zip"), (deep_zip, "characters")],
)
def test_encrypted_corrupt_and_absurdly_deep_zips_are_422_bad_archive_in_a_short_answer(
    api: httpx.Client, make: Any, says: str
) -> None:
    answer = upload(api, make(), "m.zip")
    refused(answer, 422, "bad_archive")
    assert says in answer.json()["message"] and len(answer.text) < 600


def test_extraction_stops_before_it_writes_past_the_ratio_bound(tmp_path: Path) -> None:
    archive = tmp_path / "bomb.zip"
    archive.write_bytes(zeros_zip(40 * MiB))
    limits = ArchiveLimits(max_unpacked_bytes=1 << 40, max_ratio=10.0)
    with pytest.raises(Exception) as refused_:
        extract_archive(archive, tmp_path / "out", max_bytes=1 << 40, limits=limits)
    assert getattr(refused_.value, "code", None) == "archive_ratio"
    written = sum(p.stat().st_size for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert written <= archive.stat().st_size * 10 + MiB


def test_a_tar_bomb_is_refused_by_the_same_bounds(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, size in (("model.onnx", 0), ("weights.bin", 30 * MiB)):
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(bytes(size)))
    archive = tmp_path / "bomb.tar.gz"
    archive.write_bytes(buffer.getvalue())
    limits = ArchiveLimits(max_unpacked_bytes=1 << 40, max_ratio=100.0)
    with pytest.raises(Exception) as refused_:
        extract_archive(archive, tmp_path / "out", max_bytes=1 << 40, limits=limits)
    assert getattr(refused_.value, "code", None) == "archive_ratio"


def test_a_model_archive_within_the_bounds_still_uploads(api: httpx.Client, tmp_path: Path) -> None:
    folder = external_data_model_dir(tmp_path / "m", scale=0.77)
    data = zip_bytes({p.name: p.read_bytes() for p in sorted(folder.parent.iterdir())})
    assert upload(api, data, "m.zip").status_code == 201


# ------------------------------------------------------------------------ 3. profile inputs


def npz_declaring(declared: int, deflated: bool = True) -> bytes:
    """An .npz of one float32 array of `declared` bytes of zeros, written in pieces (the
    test never holds the array)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (declared // 4,)}
    )
    buffer = io.BytesIO()
    method = zipfile.ZIP_DEFLATED if deflated else zipfile.ZIP_STORED
    with zipfile.ZipFile(buffer, "w", method) as archive:
        with archive.open("x.npy", "w", force_zip64=True) as out:
            out.write(header.getvalue())
            for start in range(0, declared, 4 * MiB):
                out.write(bytes(min(4 * MiB, declared - start)))
    return buffer.getvalue()


@functools.cache
def npz_of_1_gib() -> bytes:
    return npz_declaring(1 << 30)


def lying_npz() -> bytes:
    """A member whose .npy header declares 1 GiB that its bytes do not hold."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (1 << 28,)}
    )
    return zip_bytes({"x.npy": header.getvalue() + bytes(64)})


def object_npz() -> bytes:
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "|O", "fortran_order": False, "shape": (1,)}
    )
    return zip_bytes({"x.npy": header.getvalue() + bytes(8)})


def test_profile_inputs_declaring_1_gib_are_refused_from_their_headers_unread(
    farm: Any,
) -> None:
    from app.domain.services import profiles
    from app.domain.services.errors import ServiceError

    data = npz_of_1_gib()
    assert len(data) < 8 * MiB
    tracemalloc.start()
    try:
        with pytest.raises(ServiceError) as refusal:
            profiles.store_inputs(farm.store, io.BytesIO(data), max_array_bytes=256 * MiB)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (refusal.value.code, refusal.value.status) == ("inputs_too_large", 413)
    assert peak < 64 * MiB, f"{peak:,} bytes: the arrays were unpacked"


@pytest.mark.parametrize("make", [lying_npz, object_npz, lambda: b"PK\x05\x06" + bytes(18)])
def test_profile_inputs_that_are_not_plain_arrays_are_422_bad_inputs(farm: Any, make: Any) -> None:
    from app.domain.services import profiles
    from app.domain.services.errors import ServiceError

    with pytest.raises(ServiceError) as refusal:
        profiles.store_inputs(farm.store, io.BytesIO(make()), max_array_bytes=256 * MiB)
    assert (refusal.value.code, refusal.value.status) == ("bad_inputs", 422)


def test_real_profile_inputs_pass_the_header_check(farm: Any) -> None:
    from app.domain.services import profiles

    buffer = io.BytesIO()
    np.savez_compressed(buffer, x=np.ones((2, 4), np.float32), ids=np.arange(3))
    ref = profiles.store_inputs(farm.store, io.BytesIO(buffer.getvalue()), max_array_bytes=1024)
    assert farm.store.exists(ref.sha256)


# ------------------------------------------------------------------ 4. sweeps bounded


def sweep_body(model_id: str, cores: list[int]) -> dict[str, Any]:
    return {"model_id": model_id, "space": {"parameters": {"cores": cores}}}


def test_a_sweep_over_the_combination_limit_is_422_sweep_too_large(api: httpx.Client) -> None:
    model = upload(api, tiny_model(batch=1).SerializeToString(), "m.onnx").json()
    answer = api.post("/v1/sweeps", json=sweep_body(model["id"], list(range(1, 10))))
    refused(answer, 422, "sweep_too_large")
    assert answer.json()["max_combinations"] == OVERRIDES["max_sweep_combinations"]


def test_a_teams_sweeps_queue_at_most_their_allowance_and_the_rest_waits(
    api: httpx.Client, server: LiveServer
) -> None:
    model = upload(api, tiny_model(0.61, batch=1).SerializeToString(), "m.onnx").json()
    first = api.post("/v1/sweeps", json=sweep_body(model["id"], [1, 2, 3, 4])).json()
    second = api.post("/v1/sweeps", json=sweep_body(model["id"], [5, 6])).json()
    limit = OVERRIDES["max_team_sweep_compiles"]
    assert first["progress"]["compiles_submitted"] == limit
    assert second["progress"]["compiles_submitted"] == 0  # the team's allowance is spent
    assert first["status"] == second["status"] == "running"
    other = server.client(server.new_key())  # another team's sweep is not held up
    with other:
        theirs = upload(other, tiny_model(0.62, batch=1).SerializeToString(), "m.onnx").json()
        sweep = other.post("/v1/sweeps", json=sweep_body(theirs["id"], [1, 2])).json()
        assert sweep["progress"]["compiles_submitted"] == 2


# ------------------------------------------------------------- 5. 500s that are now 4xx


def compiled_qpc(server: LiveServer, client: httpx.Client) -> dict[str, Any]:
    from worker import compile_jobs

    model = upload(client, tiny_model_bytes(random.uniform(0.01, 1.0)), "m.onnx").json()
    job = client.post("/v1/compile-jobs", json={"model_id": model["id"], "flags": []}).json()
    with server.state.session_factory() as session:
        claimed = compile_jobs.claim(session, uuid.UUID(job["id"]), "test-worker")
        assert claimed is not None
        compile_jobs.run_compile(session, server.state.store, claimed)
    done = client.get(f"/v1/compile-jobs/{job['id']}").json()
    assert done["status"] == "succeeded", done
    return done


def test_a_range_of_4300_digits_is_416_not_a_500(server: LiveServer, api: httpx.Client) -> None:
    qpc_id = compiled_qpc(server, api)["qpc_id"]
    for header in ("bytes=" + "9" * 4300 + "-", "bytes=0-" + "1" * 4300, "bytes=-" + "7" * 4300):
        answer = api.get(f"/v1/qpcs/{qpc_id}/download", headers={"Range": header})
        refused(answer, 416, "range_not_satisfiable")


def damaged_program_qpcs(qpc: bytes) -> list[bytes]:
    """The QPC with a key of program.bin's tables renamed (same length): the decoder once
    raised KeyError on each, answered 500."""
    out = []
    for key in (b'"num_semaphores"', b'"constants_size"', b'"inputs"'):
        at = qpc.rfind(key)
        assert at > 0, key
        out.append(qpc[:at] + key[:-2] + b'X"' + qpc[at + len(key) :])
    return out


def test_damaged_qpcs_sent_to_validation_are_answered_per_file_never_500(
    server: LiveServer, api: httpx.Client
) -> None:
    qpc_id = compiled_qpc(server, api)["qpc_id"]
    qpc = api.get(f"/v1/qpcs/{qpc_id}/download").content
    rng = random.Random(26)
    damaged = damaged_program_qpcs(qpc)
    for _ in range(20):
        mutated = bytearray(qpc)
        for _ in range(rng.randrange(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        damaged.append(bytes(mutated))
    for data in damaged:
        answer = api.post("/v1/validations", files={"file": ("programqpc.bin", data)})
        assert answer.status_code in (201, 422), answer.text
        if answer.status_code == 201:
            assert answer.json()["ok"] is False


def test_300_damaged_qpcs_are_reported_on_without_raising(tmp_path: Path) -> None:
    from compiler_core import compile_model
    from compiler_core.qpc.validate import validate_qpc

    result = compile_model(tiny_model().SerializeToString(), ["-aic-num-cores=2"])
    qpc = Path(result.qpc_path).read_bytes()
    result.cleanup()
    rng = random.Random(300)
    for data in damaged_program_qpcs(qpc):
        assert validate_qpc(data, "aic100-standard").ok is False
    for _ in range(300):
        mutated = bytearray(qpc)
        if rng.random() < 0.5:
            at = rng.randrange(len(qpc) - 8)
            mutated[at : at + 8] = rng.randbytes(8)
        else:
            mutated = mutated[: rng.randrange(len(qpc))]
        report = validate_qpc(bytes(mutated), "aic100-standard")  # a report, never a raise
        assert report.checks


# --------------------------------------------------- answers name no server path (item 5)


def hostile_answers(server: LiveServer, client: httpx.Client) -> list[httpx.Response]:
    answers = [
        upload(client, zeros_zip(20 * MiB), "bomb.zip"),
        upload(client, encrypted_zip(), "e.zip"),
        upload(client, corrupt_deflate_zip(), "c.zip"),
        upload(client, deep_zip(), "d.zip"),
        upload(client, tar_with_symlink(tiny_model_bytes()), "s.tar"),
        upload(client, zip_bytes({"/etc/model.onnx": tiny_model_bytes()}), "a.zip"),
        upload(client, zip_bytes({"../model.onnx": tiny_model_bytes()}), "p.zip"),
        upload(client, zip_bytes({"x.txt": b"x"}), "n.zip"),
        upload(client, tiny_model_bytes()[:40], "cut.onnx"),
        upload(client, b"\x08\x07garbage" * 100, "g.onnx"),
        upload(client, tiny_model_bytes(), "not-a.zip"),
        client.post("/v1/validations", files={"file": ("q.bin", b"\x7c\xcd\xa1\x00" + bytes(60))}),
        client.post("/v1/compile-jobs", json={"model_id": str(uuid.uuid4())}),
        client.post("/v1/compile-jobs", content=b"{" * (JSON_LIMIT + 1)),
    ]
    qpc_id = compiled_qpc(server, client)["qpc_id"]
    answers.append(client.get(f"/v1/qpcs/{qpc_id}/download", headers={"Range": "bytes=9" * 900}))
    for data in (lying_npz(), object_npz(), b"not an npz"):
        answers.append(client.post(f"/v1/qpcs/{qpc_id}/profile", files={"inputs": ("i.npz", data)}))
    return answers


def test_no_hostile_requests_answer_names_a_server_path(
    server: LiveServer, api: httpx.Client
) -> None:
    answers = hostile_answers(server, api)
    secrets = {str(Path(server.settings.data_dir).resolve()), tempfile.gettempdir() + "/"}
    for answer in answers:  # a refusal, or a validation's report of a damaged file
        assert answer.status_code < 500, answer.text
        assert answer.status_code == 201 or answer.json()["code"], answer.text
        for secret in secrets:
            assert secret not in answer.text, answer.text


# ------------------------------------------------------------- 6. embedded file modes


def test_embedded_mode_keeps_its_folder_database_and_blobs_private(tmp_path: Path) -> None:
    data_dir = tmp_path / "fresh" / "qpcfarm-data"
    old = os.umask(0o022)
    try:
        with live_server("sqlite", data_dir) as server:
            with server.client(server.new_key()) as client:
                model = upload(client, tiny_model_bytes(0.58), "m.onnx").json()
    finally:
        os.umask(old)
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    database = data_dir / "qpcfarm.db"
    assert stat.S_IMODE(database.stat().st_mode) == 0o600
    for sidecar in (data_dir / "qpcfarm.db-wal", data_dir / "qpcfarm.db-shm"):
        if sidecar.exists():
            assert stat.S_IMODE(sidecar.stat().st_mode) & 0o077 == 0
    blob = data_dir / "blobs" / model["sha256"][:2] / model["sha256"][2:]
    assert stat.S_IMODE(blob.stat().st_mode) == 0o600
    assert stat.S_IMODE((data_dir / "blobs").stat().st_mode) == 0o700


# --------------------------------------------------------------------------------- 7. CSRF


def test_the_csrf_token_is_bound_to_the_session_and_rotated_at_sign_in(
    local: LiveServer,
) -> None:
    def form_token(client: httpx.Client, page: str) -> str:
        found = re.search(r'name="csrf" value="([^"]+)"', client.get(page).text)
        assert found is not None
        return found.group(1)

    def sign_in(client: httpx.Client, key: str) -> str:
        before = form_token(client, "/sign-in")
        answer = client.post("/sign-in", data={"api_key": key, "csrf": before})
        assert answer.status_code == 303, answer.text
        return before

    key = local.new_key()
    with (
        httpx.Client(base_url=local.url) as alice,
        httpx.Client(base_url=local.url) as mallory,
    ):
        before = sign_in(alice, key)
        after = form_token(alice, "/")
        assert after != before
        sign_in(mallory, key)
        theirs = form_token(mallory, "/")
        assert theirs != after  # same key, another session, another token

        for token in (before, theirs):  # pre-sign-in token, and another session's
            answer = alice.post("/sign-out", data={"csrf": token})
            assert answer.status_code == 403 and "csrf_failed" in answer.text
        assert alice.post("/sign-out", data={"csrf": after}).status_code == 303


# ----------------------------------------------------------- 8. refused uploads leave no blob


def blobs_of(server: LiveServer) -> set[str]:
    return set(server.state.store.list_blobs())


def test_a_refused_upload_leaves_no_blob_in_either_store(
    server: LiveServer, api: httpx.Client
) -> None:
    qpc_id = compiled_qpc(server, api)["qpc_id"]
    cases = [
        lambda: upload(api, b"\x08\x07not a model" * 50, "bad.onnx"),
        lambda: upload(api, tiny_model_bytes(0.913), "named.zip"),
        lambda: upload(api, encrypted_zip(), "e.zip"),
        lambda: upload(api, zeros_zip(20 * MiB, "w2.bin"), "bomb.zip"),
        lambda: upload(api, b"", "empty.onnx"),
        lambda: upload(api, random.randbytes(UPLOAD_LIMIT + 1), "big.onnx"),
        lambda: httpx.post(
            f"{server.url}/v1/models", files={"file": ("m.onnx", tiny_model_bytes(0.914))}
        ),
        lambda: api.post(f"/v1/qpcs/{qpc_id}/profile", files={"inputs": ("i.npz", lying_npz())}),
    ]
    for case in cases:
        before = blobs_of(server)
        answer = case()
        assert 400 <= answer.status_code < 500, answer.text
        assert blobs_of(server) == before, answer.text


def test_a_refused_upload_keeps_content_another_row_names(
    server: LiveServer, api: httpx.Client
) -> None:
    """The same bytes, accepted as a model before, refused under an archive's name: the
    model's blob stays."""
    data = tiny_model_bytes(0.915)
    model = upload(api, data, "m.onnx").json()
    refused(upload(api, data, "m.zip"), 422, "bad_archive")
    assert server.state.store.exists(model["sha256"])
