"""TensorFlow and PyTorch models through the farm's API: an upload is recognised from its
bytes and checked by converting it (in a limited process), a compile job converts it in the
worker, the report names the converter and its version, the ONNX it made is downloadable,
and the QPC computes what the framework computes. Bad and hostile files of each format are
refused 4xx with a code, and no model is recorded.

Skips without the extra of the format (`pip install 'qpcfarm[torch]'`, `[tensorflow]`).
"""

from __future__ import annotations

import importlib.util
import io
import os
import sys
import uuid
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest

from compiler_core import run_qpc
from tests.api_helpers import LiveServer, Servers
from worker import compile_jobs

HAVE_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "onnxscript"))
HAVE_TF = all(importlib.util.find_spec(m) for m in ("tensorflow", "tf2onnx"))
RNG = np.random.default_rng(2424)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    running = Servers(tmp_path_factory, max_upload_bytes=16 << 20)
    try:
        yield running.get("sqlite")
    finally:
        running.close()


@pytest.fixture
def api(server: LiveServer) -> Iterator[httpx.Client]:
    with server.client(server.new_key()) as client:
        yield client


def _compile(server: LiveServer, api: httpx.Client, model_id: str, **options: Any) -> dict:
    job = api.post("/v1/compile-jobs", json={"model_id": model_id, "options": options}).json()
    with server.state.session_factory() as session:
        claimed = compile_jobs.claim(session, uuid.UUID(job["id"]), "test-worker")
        assert claimed is not None
        compile_jobs.run_compile(session, server.state.store, claimed)
    done = api.get(f"/v1/compile-jobs/{job['id']}").json()
    assert done["status"] == "succeeded", done
    return done


def _run(api: httpx.Client, done: dict, x: np.ndarray) -> np.ndarray:
    """Run the job's QPC on `x`, fed by the input name of the converted ONNX (downloaded)."""
    qpc_id = done["qpc_id"]
    converted = api.get(f"/v1/qpcs/{qpc_id}/converted.onnx")
    assert converted.status_code == 200, converted.text
    graph = onnx.load_from_string(converted.content).graph
    initializers = {t.name for t in graph.initializer}
    (name,) = [i.name for i in graph.input if i.name not in initializers]
    qpc = api.get(f"/v1/qpcs/{qpc_id}/download")
    assert qpc.status_code == 200, qpc.text
    (only,) = run_qpc(qpc.content, {name: x}).values()
    return only


def _report(api: httpx.Client, done: dict) -> dict:
    """The job's perf metrics (the report the job carries)."""
    metrics: dict = done["metrics"]
    return {"metrics": metrics}


@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed: pip install 'qpcfarm[torch]'")
def test_a_torch_export_upload_compiles_and_matches_torch(
    server: LiveServer, api: httpx.Client
) -> None:
    import torch

    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten())
    x = torch.from_numpy(RNG.standard_normal((1, 3, 6, 6), dtype=np.float32))
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.save(torch.export.export(net.eval(), (x,)), buffer)
    response = api.post("/v1/models", files={"file": ("net.bin", buffer.getvalue())})
    assert response.status_code == 201, response.text
    model = response.json()
    assert model["kind"] == "torch_export"
    assert [i["shape"] for i in model["inputs"]] == [[1, 3, 6, 6]]

    done = _compile(server, api, model["id"], **{"aic-num-cores": 1})
    conversion = _report(api, done)["metrics"]["conversion"]
    assert conversion["format"] == "torch_export"
    assert conversion["converter_version"] == torch.__version__
    got = _run(api, done, x.numpy())
    np.testing.assert_allclose(got, net(x).detach().numpy(), rtol=1e-5, atol=1e-5)

    again = api.post(
        "/v1/compile-jobs", json={"model_id": model["id"], "options": {"aic-num-cores": 1}}
    ).json()
    assert again["cache_hit"] is True  # the same program twice is one compile


@pytest.mark.skipif(
    not HAVE_TF, reason="tensorflow not installed: pip install 'qpcfarm[tensorflow]'"
)
def test_a_tflite_upload_compiles_and_matches_keras(server: LiveServer, api: httpx.Client) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    tf.keras.utils.set_random_seed(2)
    inp = tf.keras.Input((6, 6, 2), batch_size=1)
    out = tf.keras.layers.Dense(3)(tf.keras.layers.Conv2D(4, 3, activation="relu")(inp))
    model = tf.keras.Model(inp, out)
    data = tf.lite.TFLiteConverter.from_keras_model(model).convert()
    response = api.post("/v1/models", files={"file": ("model.onnx", data)})  # the name lies
    assert response.status_code == 201, response.text
    assert response.json()["kind"] == "tflite"
    done = _compile(server, api, response.json()["id"])
    assert _report(api, done)["metrics"]["conversion"]["converter"] == "tf2onnx"
    x = RNG.standard_normal((1, 6, 6, 2), dtype=np.float32)
    np.testing.assert_allclose(_run(api, done, x), model(x).numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(
    not HAVE_TF, reason="tensorflow not installed: pip install 'qpcfarm[tensorflow]'"
)
def test_a_frozen_graph_upload_compiles_and_matches_keras(
    server: LiveServer, api: httpx.Client
) -> None:
    """A frozen GraphDef (`.pb`, its variables folded into constants) through the API: its
    Placeholder's shape is fixed, so no `input_shapes` are needed."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2,
    )

    tf.keras.utils.set_random_seed(4)
    inp = tf.keras.Input((6, 6, 2), batch_size=1)
    model = tf.keras.Model(inp, tf.keras.layers.Conv2D(3, 3, activation="relu")(inp))
    fn = tf.function(model).get_concrete_function(tf.TensorSpec((1, 6, 6, 2), tf.float32, "x"))
    frozen = convert_variables_to_constants_v2(fn).graph.as_graph_def().SerializeToString()
    response = api.post("/v1/models", files={"file": ("frozen.pb", frozen)})
    assert response.status_code == 201, response.text
    assert (response.json()["kind"], response.json()["input_shapes"]) == ("frozen_graph", None)
    done = _compile(server, api, response.json()["id"])
    assert _report(api, done)["metrics"]["conversion"]["format"] == "frozen_graph"
    x = RNG.standard_normal((1, 6, 6, 2), dtype=np.float32)
    np.testing.assert_allclose(_run(api, done, x), model(x).numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # TensorFlow's import and the SavedModel's conversion: ~15 s
@pytest.mark.skipif(
    not HAVE_TF, reason="tensorflow not installed: pip install 'qpcfarm[tensorflow]'"
)
def test_a_saved_model_archive_upload_compiles_and_matches_keras(
    server: LiveServer, api: httpx.Client, tmp_path: Path
) -> None:
    """A Keras CNN exported as a SavedModel, zipped, through the API: the upload converts it
    to check it (Keras leaves the batch open; `input_shapes` fixes it, as `-input-shapes`
    does for the compile), the job converts it in the worker, the QPC computes what Keras
    computes, and the same SavedModel uploaded again is one compile."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    tf.keras.utils.set_random_seed(5)
    inp = tf.keras.Input((6, 6, 3), batch_size=1, name="x")
    y = tf.keras.layers.Conv2D(4, 3, activation="relu")(inp)
    y = tf.keras.layers.GlobalAveragePooling2D()(y)
    model = tf.keras.Model(inp, tf.keras.layers.Dense(5)(y))
    model.export(str(tmp_path / "saved"), verbose=False)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path in sorted((tmp_path / "saved").rglob("*")):
            if path.is_file():
                archive.write(path, f"my_model/{path.relative_to(tmp_path / 'saved')}")
    data = buffer.getvalue()

    shapes = {"input_shapes": "x:1x6x6x3"}
    response = api.post("/v1/models", params=shapes, files={"file": ("keras.zip", data)})
    assert response.status_code == 201, response.text
    uploaded = response.json()
    assert uploaded["kind"] == "saved_model"
    assert [i["shape"] for i in uploaded["inputs"]] == [[1, 6, 6, 3]]
    options = {"aic-num-cores": 1, "input-shapes": "x:1x6x6x3"}
    done = _compile(server, api, uploaded["id"], **options)
    conversion = _report(api, done)["metrics"]["conversion"]
    assert (conversion["format"], conversion["converter"]) == ("saved_model", "tf2onnx")
    x = RNG.standard_normal((1, 6, 6, 3), dtype=np.float32)
    np.testing.assert_allclose(_run(api, done, x), model(x).numpy(), rtol=1e-4, atol=1e-5)

    again = api.post("/v1/models", files={"file": ("again.zip", data)}).json()
    job = api.post("/v1/compile-jobs", json={"model_id": again["id"], "options": options})
    assert job.json()["cache_hit"] is True, job.text


def _torchscript(in_features: int) -> bytes:
    import torch

    torch.manual_seed(3)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit is deprecated, and still a format users have
        torch.jit.save(torch.jit.script(torch.nn.Linear(in_features, 3).eval()), buffer)
    return buffer.getvalue()


@pytest.mark.skipif(not HAVE_TORCH, reason="torch not installed: pip install 'qpcfarm[torch]'")
def test_a_torchscript_upload_with_input_shapes_is_converted_at_upload(
    api: httpx.Client,
) -> None:
    """A TorchScript module records no input shapes. Given them (`input_shapes`, as the
    compile's `-input-shapes`), the upload converts it: its inputs are described with them,
    and a module that loads but does not convert with them is refused 422 and not stored.
    Without them it is only loaded (its inputs named, shapes unknown), as before."""
    data = _torchscript(4)
    bad = api.post(
        "/v1/models", params={"input_shapes": "input:1x5"}, files={"file": ("m.pt", data)}
    )  # the Linear takes 4 features: loads, but does not convert with these shapes
    assert bad.status_code == 422, bad.text
    assert bad.json()["code"] == "conversion_failed"
    assert "/tmp" not in bad.json()["message"]
    assert sys.prefix not in bad.json()["message"]  # nor the converter's installation
    assert api.get("/v1/models").json()["count"] == 0

    syntax = api.post(
        "/v1/models", params={"input_shapes": "input:1xfour"}, files={"file": ("m.pt", data)}
    )
    assert syntax.status_code == 422, syntax.text
    assert syntax.json()["code"] == "invalid_option"
    assert api.get("/v1/models").json()["count"] == 0

    good = api.post(  # a multipart field before the file, like the query parameter
        "/v1/models", data={"input_shapes": "input:2x4"}, files={"file": ("m.pt", data)}
    )
    assert good.status_code == 201, good.text
    assert good.json()["kind"] == "torchscript"
    assert [i["shape"] for i in good.json()["inputs"]] == [[2, 4]]

    loaded_only = api.post("/v1/models", files={"file": ("m.pt", _torchscript(5))})
    assert loaded_only.status_code == 201, loaded_only.text
    assert [i["shape"] for i in loaded_only.json()["inputs"]] == [None]


def _zip(names: list[str], data: bytes = b"\x80\x02}q\x00.") -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in names:
            archive.writestr(name, data)
    return buffer.getvalue()


SAVED_MODEL_PB = b"\x08\x01\x12\x04\x0a\x02\x0a\x00"
"""SavedModel { schema_version: 1, meta_graphs { meta_info_def { meta_graph_version: "" } } }"""


HOSTILE = [
    pytest.param("torch", _zip(["m/archive_format", "m/models/model.json"]), id="pt2"),
    pytest.param("torch", _zip(["m/data.pkl", "m/constants.pkl", "m/code/x.py"]), id="torchscript"),
    pytest.param("tensorflow", b"\x1c\x00\x00\x00TFL3" + b"\xff" * 64, id="tflite"),
    # a GraphDef whose tail is no protobuf: refused before TensorFlow starts
    pytest.param(None, b"\x0a\x05\x0a\x01x\x12\x00\xff\xff", id="frozen-graph-truncated"),
    pytest.param(
        "tensorflow",
        b"\x0a\x08\x0a\x01x\x12\x03\xff\xff\xff",  # well formed; its node's op is not UTF-8
        id="frozen-graph",
        marks=pytest.mark.slow,
    ),
    # SavedModel archives refused as they are unpacked, before TensorFlow loads
    pytest.param(None, _zip(["m/saved_model.pb", "m/../../escaped"]), id="saved-model-escapes"),
    pytest.param(
        None, _zip(["m/saved_model.pb", "m/variables/v"], bytes(16 << 20)), id="saved-model-bomb"
    ),
    pytest.param(
        "tensorflow",
        _zip(["m/saved_model.pb", "m/variables/x"]),
        id="saved-model",
        marks=pytest.mark.slow,
    ),
    pytest.param(None, _zip(["sd/data.pkl", "sd/version"]), id="torch-checkpoint"),
    # SavedModel { schema_version: 1, meta_graphs { meta_info_def { meta_graph_version: "" } } }
    pytest.param(None, SAVED_MODEL_PB, id="bare-saved-model-pb"),
]


@pytest.mark.parametrize(("family", "data"), HOSTILE)
def test_bad_framework_files_are_refused_4xx_and_no_model_is_recorded(
    server: LiveServer, api: httpx.Client, family: str | None, data: bytes
) -> None:
    """Family None: refused without the framework (the bytes, the archive's unpacking)."""
    if family == "torch" and not HAVE_TORCH or family == "tensorflow" and not HAVE_TF:
        pytest.skip(f"the {family} extra is not installed: pip install 'qpcfarm[{family}]'")
    blobs = set(server.state.store.list_blobs())
    response = api.post("/v1/models", files={"file": ("model", data)})
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["code"] in {
        "invalid_model",
        "conversion_failed",
        "conversion_crashed",
        "bad_archive",
        "archive_too_large",
    }
    assert "/tmp" not in response.json()["message"]  # no server path
    assert api.get("/v1/models").json()["count"] == 0
    assert set(server.state.store.list_blobs()) == blobs  # the upload's bytes are not kept


def test_the_cache_key_of_a_converted_model_names_its_converters_versions() -> None:
    """A new converter version makes a new compile of the same bytes; ONNX has no converter
    and keeps its key; the input shapes a compile uses are part of its key too."""
    from importlib import metadata

    from app.domain.services.jobs import options_key
    from compiler_core import CompileOptions
    from compiler_core.convert import converter_of

    assert converter_of("onnx") == converter_of("archive") == ""
    if HAVE_TORCH:
        assert f"torch {metadata.version('torch')}" in converter_of("torchscript")
    if HAVE_TF:
        assert f"tf2onnx {metadata.version('tf2onnx')}" in converter_of("saved_model")
    options, sha = CompileOptions(), "a" * 64
    keys = {
        options_key(sha, options),
        options_key(sha, options, converter="torch 2.13.0, onnxscript 0.7.2"),
        options_key(sha, options, converter="torch 2.14.0, onnxscript 0.7.2"),
        options_key(sha, options.with_(input_shapes="x:1x4")),
    }
    assert len(keys) == 4
