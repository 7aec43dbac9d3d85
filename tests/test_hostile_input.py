"""Hostile and absurd input over real HTTP: each is a 4xx with a stable `code`, never a 500
or a dropped connection, on both deployment modes (SQLite + filesystem, PostgreSQL +
database blobs)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from tests.api_helpers import LiveServer, multipart_chunks
from tests.conftest import tiny_model, tiny_model_bytes


@pytest.fixture
def api(server: LiveServer) -> Iterator[httpx.Client]:
    with server.client(server.new_key()) as client:
        yield client


@pytest.fixture
def model_id(api: httpx.Client) -> str:
    data = tiny_model(batch="N").SerializeToString()
    answer = api.post("/v1/models", files={"file": ("m.onnx", data)})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


def refused(answer: httpx.Response, status: int, code: str) -> None:
    assert (answer.status_code, answer.json().get("code")) == (status, code), answer.text


@pytest.mark.parametrize("route", ["/v1/models", "/v1/compile-jobs", "/v1/validations"])
@pytest.mark.parametrize("offset", ["9223372036854775808", "9223372036854775807", "-1"])
def test_an_offset_beyond_any_listing_is_422(api: httpx.Client, route: str, offset: str) -> None:
    refused(api.get(route, params={"offset": offset}), 422, "invalid_request")


@pytest.mark.parametrize(
    "options",
    [
        '{"vtcm-working-set-limit-ratio": NaN}',
        '{"vtcm-working-set-limit-ratio": Infinity}',
        '{"vtcm-working-set-limit-ratio": -Infinity}',
        '{"batchsize": 9223372036854775808}',
        '{"batchsize": 1e400}',
        '{"onnx-define-symbol": "N,' + "9" * 5000 + '"}',
        '{"onnx-define-symbol": "N\\u0000,2"}',
    ],
)
def test_options_no_database_or_compiler_can_hold_are_422_invalid_option(
    api: httpx.Client, model_id: str, options: str
) -> None:
    body = f'{{"model_id": "{model_id}", "options": {options}}}'
    answer = api.post(
        "/v1/compile-jobs", content=body, headers={"Content-Type": "application/json"}
    )
    assert answer.status_code == 422, answer.text
    assert answer.json()["code"] in ("invalid_option", "invalid_request"), answer.text


@pytest.mark.parametrize(
    "flag",
    [
        "-onnx-define-symbol=N," + "9" * 5000,
        "-batchsize=9223372036854775808",
        "-vtcm-working-set-limit-ratio=nan",
    ],
)
def test_flags_no_database_or_compiler_can_hold_are_422_invalid_option(
    api: httpx.Client, model_id: str, flag: str
) -> None:
    answer = api.post("/v1/compile-jobs", json={"model_id": model_id, "flags": [flag]})
    refused(answer, 422, "invalid_option")


def test_a_file_name_with_a_nul_is_422_and_stores_no_model(api: httpx.Client) -> None:
    raw = api.post(
        "/v1/models?filename=nul%00.onnx",
        content=tiny_model_bytes(0.31),
        headers={"Content-Type": "application/octet-stream"},
    )
    refused(raw, 422, "invalid_filename")
    content_type, body = multipart_chunks(tiny_model_bytes(0.32), "nul\x00.onnx")
    form = api.post("/v1/models", content=b"".join(body), headers={"Content-Type": content_type})
    refused(form, 422, "invalid_filename")
    assert api.get("/v1/models").json()["count"] == 0


def test_byte_mutated_models_are_422_never_500(api: httpx.Client) -> None:
    """Single-byte mutations of a valid model: the ones that once broke the importer's
    checker step (onnx_ir SerdeError, an undefined tensor type) among them."""
    data = tiny_model_bytes(0.5)
    rng = random.Random(11)
    mutants = [(23, 204), (125, 56)]  # known to have raised inside the checker step
    mutants += [(rng.randrange(len(data)), rng.randrange(256)) for _ in range(30)]
    for position, value in mutants:
        mutated = bytearray(data)
        mutated[position] = value
        answer = api.post("/v1/models", files={"file": ("m.onnx", bytes(mutated))})
        assert answer.status_code in (201, 422), (position, value, answer.text)
        if answer.status_code == 422:
            assert answer.json()["code"], answer.text
