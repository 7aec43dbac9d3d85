"""`-node-precision-info`: named nodes keep float32 inside a -convert-to-fp16 network (or run
in float16 inside a float32 one), with Casts only where the two precisions meet."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from compiler_core import compile_model, run_qpc
from compiler_core.errors import CompileError
from compiler_core.runtime.numerics import NonFiniteWarning
from tests.op_checks import run_onnxruntime

F = onnx.TensorProto.FLOAT


def _model() -> onnx.ModelProto:
    """x * 3000 -> square -> ReduceSum -> out: the square overflows float16 (> 65504)."""
    graph = oh.make_graph(
        [
            oh.make_node("Mul", ["x", "k"], ["scaled"], name="scale"),
            oh.make_node("Mul", ["scaled", "scaled"], ["squared"], name="square"),
            oh.make_node("ReduceSum", ["squared", "axes"], ["total"], name="sum", keepdims=0),
            oh.make_node("Sqrt", ["total"], ["y"], name="root"),
        ],
        "g",
        [oh.make_tensor_value_info("x", F, [2, 8])],
        [oh.make_tensor_value_info("y", F, [2])],
        initializer=[
            onnx.numpy_helper.from_array(np.array(3000.0, np.float32), "k"),
            onnx.numpy_helper.from_array(np.array([1], np.int64), "axes"),
        ],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])


X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)


def _compile(tmp_path: Path, text: str | None, *flags: str):
    args = list(flags)
    if text is not None:
        path = tmp_path / "precision.yaml"
        path.write_text(text)
        args.append(f"-node-precision-info={path}")
    return compile_model(_model().SerializeToString(), args)


def _run(result) -> tuple[np.ndarray, dict[str, str]]:
    try:
        out = run_qpc(result.qpc_path, {"x": X})["y"]
        kernels = result.program.kernels
        types = {name: k.info.out_dtypes[0] for k in kernels for name in k.nodes}
    finally:
        result.cleanup()
    return out, types


def test_fp32_nodes_keep_a_float16_network_from_overflowing(tmp_path: Path) -> None:
    want = run_onnxruntime(_model(), {"x": X})[0]
    with pytest.warns(NonFiniteWarning, match=r"FP32NodeInstanceNames: \[square\]"):
        plain, _ = _run(_compile(tmp_path, None, "-convert-to-fp16"))
    assert not np.isfinite(plain).all()  # the square overflows in float16, and the run says so
    text = "FP32NodeInstanceNames:\n  - square\n  - sum\n  - root\n"
    got, types = _run(_compile(tmp_path, text, "-convert-to-fp16"))
    np.testing.assert_allclose(got, want, rtol=2e-3)
    assert types["scale"] == "float16"
    assert types["square"] == types["sum"] == types["root"] == "float32"


def test_an_fp32_node_may_be_named_by_its_output(tmp_path: Path) -> None:
    # root (Sqrt) is fused into sum's kernel: `y` now names that kernel's output.
    text = "FP32NodeInstanceNames: [squared, y]\n"
    got, types = _run(_compile(tmp_path, text, "-convert-to-fp16"))
    assert np.isfinite(got).all() and types["square"] == "float32"


def test_fp16_nodes_run_in_float16_inside_a_float32_network(tmp_path: Path) -> None:
    text = "FP16NodeInstanceNames: [scale]\n"
    got, types = _run(_compile(tmp_path, text))
    assert types["scale"] == "float16" and types["square"] == "float32"
    want = run_onnxruntime(_model(), {"x": X})[0]
    np.testing.assert_allclose(got, want, rtol=2e-3)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("FP32NodeInstanceNames: [nope]\n", "names nope, which is neither a node"),
        ("FP32Nodes: [square]\n", "must be a mapping with the keys"),
        ("FP32NodeInstanceNames: square\n", "must be a list of node names"),
        ("FP32NodeInstanceNames: [sum]\nFP16NodeInstanceNames: [sum]\n", "both FP32 and FP16"),
    ],
)
def test_a_bad_precision_file_is_an_invalid_option(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(CompileError, match=message) as info:
        _compile(tmp_path, text, "-convert-to-fp16")
    assert info.value.code == "invalid_option" and info.value.flag == "-node-precision-info"
