"""Every kind of bad input ends in one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_core.cli import main


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, path)
    return path


def _relu(shape: list[int | str]) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def truncated(tmp: Path) -> tuple[Path, str]:
    data = _relu([1, 4]).SerializeToString()
    (tmp / "m.onnx").write_bytes(data[: len(data) // 2])
    return tmp / "m.onnx", "is not an ONNX model"


def not_onnx(tmp: Path) -> tuple[Path, str]:
    (tmp / "m.onnx").write_text("this is a text file, not a model\n")
    return tmp / "m.onnx", "is not an ONNX model"


def unsupported_op(tmp: Path) -> tuple[Path, str]:
    model = _relu([1, 4])
    model.graph.node.append(helper.make_node("Frobnicate", ["y"], ["z"], domain="com.acme"))
    model.graph.output[0].name = "z"
    model.opset_import.append(helper.make_opsetid("com.acme", 1))
    return _save(model, tmp / "m.onnx"), "Frobnicate"


def unbound_symbol(tmp: Path) -> tuple[Path, str]:
    return _save(_relu(["N", 4]), tmp / "m.onnx"), "-onnx-define-symbol=N"


def escaping_external_data(tmp: Path) -> tuple[Path, str]:
    weights = numpy_helper.from_array(np.ones((4,), np.float32), "w")
    weights.data_location = TensorProto.EXTERNAL
    weights.ClearField("raw_data")
    for key, value in (("location", "../secret.bin"), ("offset", "0"), ("length", "16")):
        entry = weights.external_data.add()
        entry.key, entry.value = key, value
    (tmp.parent / "secret.bin").write_bytes(bytes(16))
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"], name="add")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    (tmp / "m.onnx").write_bytes(model.SerializeToString())
    return tmp / "m.onnx", "../secret.bin"


def cannot_fit(tmp: Path) -> tuple[Path, str]:
    graph = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["y"], axis=1, name="wide")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3_000_000])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3_000_000])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return _save(model, tmp / "m.onnx"), "bytes more than"


CASES: dict[str, Callable[[Path], tuple[Path, str]]] = {
    "truncated": truncated,
    "not-onnx": not_onnx,
    "unsupported-op": unsupported_op,
    "unbound-symbol": unbound_symbol,
    "external-data-outside-folder": escaping_external_data,
    "cannot-fit-vtcm": cannot_fit,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_model_gives_one_clear_line_and_exit_1(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    path, expected = CASES[case](folder)
    code = main(["compile", f"-m={path}", f"-aic-binary-dir={tmp_path / 'out'}"])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 1
    assert "Traceback" not in captured.err + captured.out
    errors = [line for line in lines if line.startswith("qpcfarm: error:")]
    assert len(errors) == 1 and expected.lower() in errors[0].lower(), captured.err
    assert not (tmp_path / "out" / "programqpc.bin").exists()


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("-aic-num-cores=17", "-aic-num-cores"),
        ("-aic-num-cores=-1", "-aic-num-cores"),
        ("-vtcm-working-set-limit-ratio=1.5", "-vtcm-working-set-limit-ratio"),
        ("-aic-pmu-events=XYZ", "-aic-pmu-events"),
        ("-stats-level=abc", "-stats-level"),
        ("-no-such-flag", "-no-such-flag"),
    ],
)
def test_bad_option_gives_one_clear_line_and_exit_1(
    flag: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _save(_relu([1, 4]), tmp_path / "m.onnx")
    code = main(["compile", f"-m={path}", f"-aic-binary-dir={tmp_path / 'out'}", flag])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert expected in err.strip().splitlines()[-1]
