"""A framework model's `input_shapes` given at upload are recorded with it and are the
`-input-shapes` of its compiles that give none; a compile's own `-input-shapes` wins. The
shapes a compile uses are in its options, so in its cache key, and its report says where they
came from. On both deployment modes (SQLite + filesystem, PostgreSQL + database blobs).

The TorchScript cases skip without the torch extra (`pip install 'qpcfarm[torch]'`).
"""

from __future__ import annotations

import importlib.util
import io
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from compiler_core import run_qpc
from tests.api_helpers import LiveServer, Servers
from tests.conftest import tiny_model_bytes
from worker import compile_jobs

HAVE_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "onnxscript"))
needs_torch = pytest.mark.skipif(
    not HAVE_TORCH, reason="torch and onnxscript not installed: pip install 'qpcfarm[torch]'"
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    running = Servers(tmp_path_factory, max_upload_bytes=16 << 20)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def server(request: pytest.FixtureRequest, servers: Servers) -> LiveServer:
    return servers.get(request.param)


@pytest.fixture
def api(server: LiveServer) -> Iterator[httpx.Client]:
    with server.client(server.new_key()) as client:
        yield client


def _torchscript() -> tuple[bytes, Any]:
    import torch

    torch.manual_seed(7)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit is deprecated, and still a format users have
        torch.jit.save(torch.jit.script(net), buffer)
    return buffer.getvalue(), net


def _submit(api: httpx.Client, model_id: str, **options: Any) -> dict[str, Any]:
    answer = api.post("/v1/compile-jobs", json={"model_id": model_id, "options": options})
    assert answer.status_code in (200, 201, 202), answer.text
    job: dict[str, Any] = answer.json()
    return job


def _run(server: LiveServer, api: httpx.Client, job_id: str) -> dict[str, Any]:
    with server.state.session_factory() as session:
        claimed = compile_jobs.claim(session, uuid.UUID(job_id), "test-worker")
        assert claimed is not None
        compile_jobs.run_compile(session, server.state.store, claimed)
    done: dict[str, Any] = api.get(f"/v1/compile-jobs/{job_id}").json()
    return done


def test_an_onnx_upload_records_no_input_shapes(api: httpx.Client) -> None:
    """An ONNX model's shapes are its own: `input_shapes` given with it are not recorded,
    and its compiles' options carry none."""
    answer = api.post(
        "/v1/models",
        params={"input_shapes": "x:1x4"},
        files={"file": ("m.onnx", tiny_model_bytes())},
    )
    assert answer.status_code == 201, answer.text
    assert answer.json()["input_shapes"] is None
    job = _submit(api, answer.json()["id"])
    assert job["options"]["input-shapes"] is None


@needs_torch
def test_recorded_input_shapes_are_the_default_and_a_compiles_own_win(
    server: LiveServer, api: httpx.Client
) -> None:
    """A TorchScript module uploaded with `input_shapes` records them (in one spelling):
    the model's representation shows them, a compile without `-input-shapes` uses them (its
    options and cache key carry them, its report says "upload"), the QPC computes what the
    module computes at that shape; a compile's own `-input-shapes` is another compile
    (another key, its report says "-input-shapes"); the same shapes spelled otherwise are
    the same compile."""
    data, net = _torchscript()
    answer = api.post(
        "/v1/models", params={"input_shapes": " input:2x4"}, files={"file": ("m.pt", data)}
    )
    assert answer.status_code == 201, answer.text
    model = answer.json()
    assert model["input_shapes"] == "input:2x4"
    assert api.get(f"/v1/models/{model['id']}").json()["input_shapes"] == "input:2x4"

    by_default = _submit(api, model["id"], **{"aic-num-cores": 1})
    assert by_default["options"]["input-shapes"] == "input:2x4"
    own = _submit(api, model["id"], **{"aic-num-cores": 1, "input-shapes": "input:3x4"})
    assert own["options"]["input-shapes"] == "input:3x4"
    assert own["id"] != by_default["id"]  # other shapes, another cache key
    spelled = _submit(api, model["id"], **{"aic-num-cores": 1, "input-shapes": "input:2x4 "})
    assert spelled["id"] == by_default["id"]  # the same shapes: the job in flight

    for job, shape, source in ((by_default, (2, 4), "upload"), (own, (3, 4), "-input-shapes")):
        done = _run(server, api, job["id"])
        assert done["status"] == "succeeded", done
        conversion = done["metrics"]["conversion"]
        assert (conversion["input_shapes"], conversion["input_shapes_from"]) == (
            job["options"]["input-shapes"],
            source,
        )
        x = np.random.default_rng(24).standard_normal(shape, dtype=np.float32)
        qpc = api.get(f"/v1/qpcs/{done['qpc_id']}/download").content
        (got,) = run_qpc(qpc, {"input": x}).values()
        import torch

        np.testing.assert_allclose(got, net(torch.from_numpy(x)).detach().numpy(), atol=1e-5)

    again = _submit(api, model["id"], **{"aic-num-cores": 1})
    assert again["cache_hit"] is True  # the default shapes' QPC, found by the same key


@needs_torch
def test_a_torchscript_compile_without_shapes_names_both_ways_to_give_them(
    server: LiveServer, api: httpx.Client
) -> None:
    """Uploaded without `input_shapes`, a TorchScript module is only loaded; its compile
    without `-input-shapes` fails `input_shape_required`, naming the compile's flag and
    the upload's field."""
    data, _net = _torchscript()
    answer = api.post("/v1/models", files={"file": ("m.pt", data)})
    assert answer.status_code == 201, answer.text
    assert answer.json()["input_shapes"] is None
    done = _run(server, api, _submit(api, answer.json()["id"])["id"])
    assert (done["status"], done["error"]["code"]) == ("failed", "input_shape_required"), done
    assert "-input-shapes" in done["error"]["message"]
    assert "the upload's input_shapes" in done["error"]["message"]
