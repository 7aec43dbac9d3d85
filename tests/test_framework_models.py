"""TensorFlow and PyTorch models compile like ONNX: recognised from their bytes, converted by
the frameworks' converters in a limited child process, and the QPC computes what the
framework computes.

Each model is built here in code (a small CNN). The PyTorch cases skip without torch and
onnxscript (`pip install 'qpcfarm[torch]'`), the TensorFlow ones without tensorflow and
tf2onnx (`pip install 'qpcfarm[tensorflow]'`). Bad and hostile files need no framework in the
test process: they are refused with a coded error, and the compile writes no QPC.
"""

from __future__ import annotations

import importlib.util
import io
import os
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from compiler_core import CompileError, compile_model, run_qpc
from compiler_core.cli import main
from compiler_core.convert import recognise, wire
from compiler_core.convert.child import MISSING, Failed, _need

HAVE_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "onnxscript"))
HAVE_TF = all(importlib.util.find_spec(m) for m in ("tensorflow", "tf2onnx"))
needs_torch = pytest.mark.skipif(
    not HAVE_TORCH, reason="torch and onnxscript not installed: pip install 'qpcfarm[torch]'"
)
needs_tf = pytest.mark.skipif(
    not HAVE_TF, reason="tensorflow and tf2onnx not installed: pip install 'qpcfarm[tensorflow]'"
)
RNG = np.random.default_rng(24)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # pragma: no cover - main returns its code
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _only_output(qpc: Path | str, x: np.ndarray) -> np.ndarray:
    """The QPC's one output for `x`, fed by the input name the converter chose (read from
    the converted ONNX kept beside the QPC)."""
    import onnx

    graph = onnx.load(Path(qpc).parent / "converted.onnx").graph
    initializers = {t.name for t in graph.initializer}
    (name,) = [i.name for i in graph.input if i.name not in initializers]
    (only,) = run_qpc(qpc, {name: x}).values()
    return only


# --- PyTorch -------------------------------------------------------------------------------


def _torch_net() -> tuple[Any, Any]:
    import torch

    torch.manual_seed(24)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 5),
    ).eval()
    return net, torch.from_numpy(RNG.standard_normal((1, 3, 8, 8), dtype=np.float32))


@needs_torch
def test_torch_export_program_compiles_through_the_cli_and_matches_torch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    net, x = _torch_net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.save(torch.export.export(net, (x,)), tmp_path / "model.bin")  # any name
    code, out, err = _cli(
        capsys, "compile", f"-m={tmp_path / 'model.bin'}", f"-aic-binary-dir={tmp_path / 'out'}"
    )
    assert code == 0, err
    assert (tmp_path / "out" / "converted.onnx").is_file()  # kept beside the QPC
    only = _only_output(out.strip(), x.numpy())
    np.testing.assert_allclose(only, net(x).detach().numpy(), rtol=1e-5, atol=1e-5)


@needs_torch
def test_torchscript_module_compiles_through_the_cli_with_its_input_shapes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    net, x = _torch_net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(net), tmp_path / "net.bin")  # any name
    code, out, err = _cli(
        capsys,
        "compile",
        f"-m={tmp_path / 'net.bin'}",
        "-input-shapes=x:1x3x8x8",
        f"-aic-binary-dir={tmp_path / 'out'}",
    )
    assert code == 0, err
    assert (tmp_path / "out" / "converted.onnx").is_file()
    only = _only_output(out.strip(), x.numpy())
    np.testing.assert_allclose(only, net(x).detach().numpy(), rtol=1e-5, atol=1e-5)


@needs_torch
def test_torchscript_module_compiles_through_the_api_with_its_input_shapes(
    tmp_path: Path,
) -> None:
    import torch

    net, x = _torch_net()
    torch.jit.save(torch.jit.script(net), tmp_path / "net.pt")
    result = compile_model(
        tmp_path / "net.pt", ["-input-shapes=x:1x3x8x8", f"-aic-binary-dir={tmp_path / 'o'}"]
    )
    assert result.conversion is not None
    assert result.conversion["format"] == "torchscript"
    assert result.conversion["converter_version"] == torch.__version__
    assert result.metrics["conversion"] == result.conversion
    only = _only_output(result.qpc_path, x.numpy())
    np.testing.assert_allclose(only, net(x).detach().numpy(), rtol=1e-5, atol=1e-5)


@needs_torch
def test_torchscript_without_input_shapes_asks_for_them(tmp_path: Path) -> None:
    import torch

    net, _x = _torch_net()
    torch.jit.save(torch.jit.script(net), tmp_path / "net.pt")
    with pytest.raises(CompileError) as info:
        compile_model(tmp_path / "net.pt", [f"-aic-binary-dir={tmp_path / 'o'}"])
    assert info.value.code == "input_shape_required"
    assert "-input-shapes=" in info.value.message
    assert not (tmp_path / "o" / "programqpc.bin").exists()


# --- TensorFlow ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keras_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Keras CNN as a SavedModel directory, a .tar.gz of it, a TFLite file and a frozen
    graph, with an input and the Keras model's own output for it."""
    if not HAVE_TF:
        pytest.skip("tensorflow and tf2onnx not installed: pip install 'qpcfarm[tensorflow]'")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tarfile

    import tensorflow as tf
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2,
    )

    tf.keras.utils.set_random_seed(24)
    inp = tf.keras.Input((8, 8, 3), batch_size=1, name="x")
    y = tf.keras.layers.Conv2D(4, 3, activation="relu")(inp)
    y = tf.keras.layers.GlobalAveragePooling2D()(y)
    model = tf.keras.Model(inp, tf.keras.layers.Dense(5)(y))
    root = tmp_path_factory.mktemp("keras")
    model.export(str(root / "saved"), verbose=False)
    with tarfile.open(root / "saved.tgz", "w:gz") as archive:
        archive.add(root / "saved", arcname="my_model")
    (root / "m.tflite").write_bytes(tf.lite.TFLiteConverter.from_keras_model(model).convert())
    fn = tf.function(model).get_concrete_function(tf.TensorSpec((1, 8, 8, 3), tf.float32, "x"))
    frozen = convert_variables_to_constants_v2(fn).graph.as_graph_def()
    (root / "frozen.pb").write_bytes(frozen.SerializeToString())
    x = RNG.standard_normal((1, 8, 8, 3), dtype=np.float32)
    return {"root": root, "x": x, "want": model(x).numpy()}


@needs_tf
@pytest.mark.parametrize(
    ("file", "fmt"),
    [
        ("m.tflite", "tflite"),
        pytest.param("frozen.pb", "frozen_graph", marks=pytest.mark.slow),
        pytest.param("saved.tgz", "saved_model", marks=pytest.mark.slow),
    ],
)
def test_tensorflow_file_compiles_through_the_api_and_matches_keras(
    keras_files: dict[str, Any], tmp_path: Path, file: str, fmt: str
) -> None:
    flags = [f"-aic-binary-dir={tmp_path}", "-input-shapes=x:1x8x8x3"]
    result = compile_model(keras_files["root"] / file, flags)
    assert result.conversion is not None and result.conversion["format"] == fmt
    assert result.conversion["converter"] == "tf2onnx"
    got = _only_output(result.qpc_path, keras_files["x"])
    np.testing.assert_allclose(got, keras_files["want"], rtol=1e-4, atol=1e-5)


@needs_tf
@pytest.mark.parametrize("file", ["m.tflite", pytest.param("frozen.pb", marks=pytest.mark.slow)])
def test_tensorflow_file_compiles_through_the_cli_and_matches_keras(
    keras_files: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], file: str
) -> None:
    model = keras_files["root"] / file
    code, out, err = _cli(capsys, "compile", f"-m={model}", f"-aic-binary-dir={tmp_path}")
    assert code == 0, err
    got = _only_output(out.strip(), keras_files["x"])
    np.testing.assert_allclose(got, keras_files["want"], rtol=1e-4, atol=1e-5)


@needs_tf
@pytest.mark.slow
def test_saved_model_directory_compiles_through_the_cli(
    keras_files: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = keras_files["root"] / "saved"
    code, out, err = _cli(
        capsys, "compile", f"-m={saved}", f"-aic-binary-dir={tmp_path}", "-input-shapes=x:1x8x8x3"
    )
    assert code == 0, err
    got = _only_output(out.strip(), keras_files["x"])
    np.testing.assert_allclose(got, keras_files["want"], rtol=1e-4, atol=1e-5)


@needs_tf
@pytest.mark.slow
def test_an_open_dimension_left_by_the_converter_is_bound_by_the_compiles_flags(
    tmp_path: Path,
) -> None:
    """A Keras SavedModel whose batch is open converts to an ONNX input with a symbolic dim:
    the compile without a binding names the symbol and the flags that bind it, and
    -onnx-define-symbol (or -batchsize) binds it; the QPC computes what Keras computes."""
    import re

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    tf.keras.utils.set_random_seed(6)
    inp = tf.keras.Input((6, 6, 3), name="x")  # batch left open
    model = tf.keras.Model(inp, tf.keras.layers.Dense(4)(tf.keras.layers.Flatten()(inp)))
    model.export(str(tmp_path / "saved"), verbose=False)
    with pytest.raises(CompileError) as info:
        compile_model(tmp_path / "saved", [f"-aic-binary-dir={tmp_path / 'a'}"])
    assert info.value.code == "dynamic_shape"
    found = re.search(r"-onnx-define-symbol=(\w+),<value> \(or -batchsize\)", str(info.value))
    assert found is not None, str(info.value)
    x = RNG.standard_normal((2, 6, 6, 3), dtype=np.float32)
    for flag in (f"-onnx-define-symbol={found.group(1)},2", "-batchsize=2"):
        out = tmp_path / flag.split("=")[0].strip("-")
        result = compile_model(tmp_path / "saved", [f"-aic-binary-dir={out}", flag])
        np.testing.assert_allclose(
            _only_output(result.qpc_path, x), model(x).numpy(), rtol=1e-4, atol=1e-5
        )


# --- what each file is, and bad files --------------------------------------------------------


def _zip(path: Path, names: list[str]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name in names:
            archive.writestr(name, b"\x80\x02}q\x00.")  # a tiny pickle, never loaded
    return path


def test_formats_are_recognised_from_the_bytes_not_the_name(tmp_path: Path) -> None:
    script = _zip(tmp_path / "a.onnx", ["m/data.pkl", "m/constants.pkl", "m/code/m.py"])
    program = _zip(tmp_path / "b.npz", ["m/archive_format", "m/models/model.json"])
    tflite = tmp_path / "c.pt"
    tflite.write_bytes(b"\x1c\x00\x00\x00TFL3" + bytes(32))
    graph = tmp_path / "d.tflite"
    graph.write_bytes(b"\x0a\x05\x0a\x01x\x12\x00")  # GraphDef { node { name: "x" } }
    onnx_file = tmp_path / "e.pb"
    onnx_file.write_bytes(b"\x08\x08\x12\x00")  # ModelProto { ir_version: 8 }
    kinds = {p.name: recognise(p) for p in (script, program, tflite, graph, onnx_file)}
    assert {n: r.format.key if r and r.format else r for n, r in kinds.items()} == {
        "a.onnx": "torchscript",
        "b.npz": "torch_export",
        "c.pt": "tflite",
        "d.tflite": "frozen_graph",
        "e.pb": None,
    }


def _pb(number: int, value: int | bytes) -> bytes:
    """One protobuf field, encoded by hand (the messages' field numbers: compiler_core/convert/
    wire.py): a varint for an int, length-delimited for bytes."""

    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)

    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    return varint(number << 3 | 2) + varint(len(value)) + value


NODE_DEF = _pb(1, b"dense/MatMul") + _pb(2, b"MatMul") + _pb(3, b"x") + _pb(3, b"dense/w")
GRAPH_DEF = _pb(1, NODE_DEF) + _pb(1, _pb(1, b"x") + _pb(2, b"Placeholder")) + _pb(4, _pb(1, 8))
META_INFO = _pb(1, b"") + _pb(4, b"serve") + _pb(5, b"2.21.0")
SAVED_MODEL_PB = _pb(1, 1) + _pb(2, _pb(1, META_INFO) + _pb(2, GRAPH_DEF) + _pb(5, b"sig"))


def _onnx_bytes() -> bytes:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    model = helper.make_model(
        graph, producer_name="tf2onnx", opset_imports=[helper.make_opsetid("", 18)]
    )
    return bytes(model.SerializeToString())


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        pytest.param(SAVED_MODEL_PB, wire.SAVED_MODEL, id="saved-model"),
        pytest.param(GRAPH_DEF, wire.GRAPH_DEF, id="graph-def"),
        pytest.param(b"\x0a\x05\x0a\x01x\x12\x00\xff\xff", wire.GRAPH_DEF, id="damaged-graph-def"),
        pytest.param(_onnx_bytes(), wire.ONNX, id="onnx"),
        pytest.param(_pb(1, 1) + _pb(2, b"pytorch"), None, id="onnx-without-graph"),
        pytest.param(b"\x08\x01\x12\xff\xff\xff\x0f", None, id="length-past-the-end"),
        pytest.param(b"not a protobuf at all", None, id="text"),
    ],
)
def test_protobufs_are_told_apart_by_their_fields(data: bytes, kind: str | None) -> None:
    """A SavedModel's saved_model.pb and an ONNX model both start with a small varint in
    field 1: the set of fields and their wire types tells them (and a GraphDef) apart."""
    assert wire.message_kind(io.BytesIO(data), len(data)) == kind


def test_a_bare_saved_model_pb_is_refused_with_what_to_send_instead(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """saved_model.pb alone (no variables/ beside it) is not taken for ONNX: the CLI says it
    needs its folder. In its folder, beside variables/, the folder is the model."""
    bare = tmp_path / "saved_model.pb"
    bare.write_bytes(SAVED_MODEL_PB)
    code, _out, err = _cli(capsys, "compile", f"-m={bare}", f"-aic-binary-dir={tmp_path / 'o'}")
    assert code == 1
    assert "without its folder" in err and "zip the SavedModel directory" in err
    assert "ONNX" not in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()

    (tmp_path / "variables").mkdir()
    found = recognise(bare)
    assert found is not None and found.format is not None
    assert (found.format.key, found.root) == ("saved_model", tmp_path)


@pytest.mark.parametrize(
    ("names", "says"),
    [
        (["sd/data.pkl", "sd/version"], "torch.save"),
        (["config.json", "model.weights.h5", "metadata.json"], "Keras .keras archive"),
    ],
)
def test_files_that_are_no_model_say_what_they_look_like(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], names: list[str], says: str
) -> None:
    path = _zip(tmp_path / "model.pt", names)
    code, _out, err = _cli(capsys, "compile", f"-m={path}", f"-aic-binary-dir={tmp_path / 'o'}")
    assert code == 1
    assert says in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("family", "content"),
    [
        ("torch", ["m/archive_format", "m/models/model.json"]),  # a .pt2 of nonsense
        pytest.param(
            "torch", ["m/data.pkl", "m/constants.pkl", "m/code/x.py"], marks=pytest.mark.slow
        ),  # TorchScript of nonsense
        ("tensorflow", b"\x1c\x00\x00\x00TFL3" + b"\xff" * 64),  # a TFLite of nonsense
        pytest.param(
            "tensorflow", b"\x0a\x08\x0a\x01x\x12\x03\xff\xff\xff", marks=pytest.mark.slow
        ),  # a GraphDef whose node's op is not UTF-8
        (None, b"\x0a\x05\x0a\x01x\x12\x00\xff\xff\xff"),  # a truncated GraphDef
        (None, ["m/saved_model.pb", "m/../../escaped"]),  # a SavedModel archive escaping
    ],
)
def test_damaged_framework_files_are_refused_with_a_code(
    tmp_path: Path, family: str | None, content: list[str] | bytes
) -> None:
    """Family None: refused before a framework is needed (a damaged protobuf in the parent,
    a SavedModel archive as the child unpacks it)."""
    if family is not None and not (HAVE_TORCH if family == "torch" else HAVE_TF):
        pytest.skip(f"the {family} extra is not installed: pip install 'qpcfarm[{family}]'")
    path = tmp_path / "model"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        _zip(path, content)
    with pytest.raises(CompileError) as info:
        compile_model(path, [f"-aic-binary-dir={tmp_path / 'o'}"])
    assert info.value.code in {
        "invalid_model",
        "conversion_failed",
        "conversion_crashed",
        "bad_archive",
    }
    assert info.value.flag == "-m"
    assert not (tmp_path / "o" / "programqpc.bin").exists()


def test_a_missing_converter_names_the_extra_to_install() -> None:
    with pytest.raises(Failed) as info:
        _need("qpcfarm_no_such_converter", "tensorflow")
    assert info.value.code == MISSING
    assert "pip install 'qpcfarm[tensorflow]'" in info.value.message


# --- -operators-supported=tensorflow|pytorch -------------------------------------------------


def _operator_rows(capsys: pytest.CaptureFixture[str], framework: str) -> dict[str, tuple]:
    code, out, err = _cli(capsys, "compile", f"-operators-supported={framework}")
    assert code == 0, err
    rows = {}
    for line in out.splitlines():
        name, rest = line.split(maxsplit=1)
        status, onnx_ops = rest.rsplit(maxsplit=1)
        rows[name] = (status, set(onnx_ops.split(",")))
    return rows


def _check_against_the_registry(rows: dict[str, tuple]) -> None:
    from compiler_core.convert import OPSET
    from compiler_core.ops import REGISTRY

    def supported(op: str) -> bool:
        return REGISTRY.lookup(op, "", OPSET) is not None

    for name, (status, onnx_ops) in rows.items():
        assert any(supported(op) for op in onnx_ops), name
        missing = sorted(op for op in onnx_ops if not supported(op))
        assert status == ("yes" if not missing else f"partly (no {', '.join(missing)})"), name


@needs_torch
def test_operators_supported_pytorch_lists_aten_ops_and_the_onnx_ops_they_become(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = _operator_rows(capsys, "pytorch")
    assert rows["aten::relu"] == ("yes", {"Relu"})
    assert "Conv" in rows["aten::convolution"][1]
    assert "Gemm" in rows["aten::addmm"][1]
    _check_against_the_registry(rows)


@needs_tf
@pytest.mark.slow  # ~20 s: importing TensorFlow and reading every tf2onnx handler's source
def test_operators_supported_tensorflow_lists_tf_ops_and_the_onnx_ops_they_become(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = _operator_rows(capsys, "tensorflow")
    assert rows["Relu"] == ("yes", {"Relu"})
    assert rows["AddV2"] == ("yes", {"Add"})
    assert "Conv" in rows["Conv2D"][1]
    _check_against_the_registry(rows)


# --- errors name the framework's node ---------------------------------------------------------


@needs_torch
def test_a_compile_error_at_a_converted_node_names_the_torch_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the compiler refuses at an ONNX node of a converted model, the error also
    names the PyTorch node it came from (its module path and ATen op)."""
    import torch

    import compiler_core.compile as compile_module

    net, x = _torch_net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.save(torch.export.export(net, (x,)), tmp_path / "net.pt2")

    def refuse(*_args: Any, **_kwargs: Any) -> Any:  # the compiler refusing the conv node
        raise CompileError("unsupported_operator", "Conv is refused here", node="node_conv2d")

    monkeypatch.setattr(compile_module, "_compile_onnx", refuse)
    with pytest.raises(CompileError) as info:
        compile_model(tmp_path / "net.pt2", [f"-aic-binary-dir={tmp_path / 'o'}"])
    assert info.value.node == "node_conv2d"
    assert info.value.details["framework_node"] == "0.conv2d"
    op = info.value.details["framework_op"]
    assert op == "aten.conv2d.default in torch.nn.modules.conv.Conv2d"
    assert "framework node 0.conv2d" in info.value.message


@needs_tf
def test_a_tensorflow_op_tf2onnx_cannot_map_is_named_with_its_node(tmp_path: Path) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2,
    )

    fn = tf.function(lambda x: tf.math.lgamma(x) + 1.0).get_concrete_function(
        tf.TensorSpec((2, 3), tf.float32, "x")
    )
    graph = convert_variables_to_constants_v2(fn).graph.as_graph_def()
    (tmp_path / "lgamma.pb").write_bytes(graph.SerializeToString())
    with pytest.raises(CompileError) as info:
        compile_model(tmp_path / "lgamma.pb", [f"-aic-binary-dir={tmp_path / 'o'}"])
    assert info.value.code == "unsupported_framework_op"
    assert info.value.node == "Lgamma"
    assert info.value.details == {"node_type": "Lgamma"}
    assert "TensorFlow op Lgamma at node Lgamma" in info.value.message
    assert not (tmp_path / "o" / "programqpc.bin").exists()
