"""Reading a single-file model without copying its weights (compiler_core/onnx_wire.py): every
large `raw_data` becomes a reference to its own bytes in the file, and nothing else changes."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from compiler_core.onnx_wire import strip_inline_weights

THRESHOLD = 1024


def _model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    big = numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "big")
    small = numpy_helper.from_array(np.arange(4, dtype=np.float32), "small")
    large = rng.standard_normal((8, 32)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "big"], ["a"], name="matmul"),
        helper.make_node("Constant", [], ["c_big"], value=numpy_helper.from_array(large, "cb")),
        helper.make_node("Constant", [], ["c_small"], value=numpy_helper.from_array(np.ones(4))),
        # a node larger than the threshold whose attributes hold no tensor
        helper.make_node("Add", ["a", "a"], ["b"], name="add_" + "n" * 2 * THRESHOLD),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 32])],
        [big, small],
    )
    return helper.make_model(graph)


def _moved(tensor: onnx.TensorProto, data: bytes) -> bytes | None:
    """The bytes an external reference into the model file points to, or None if inline."""
    if tensor.data_location != TensorProto.EXTERNAL:
        return None
    entries = {e.key: e.value for e in tensor.external_data}
    assert entries["location"] == "m.onnx"
    offset, length = int(entries["offset"]), int(entries["length"])
    return data[offset : offset + length]


def test_large_raw_data_points_into_the_file_and_everything_else_is_unchanged() -> None:
    model = _model()
    data = model.SerializeToString()
    stripped = strip_inline_weights(memoryview(data), "m.onnx", THRESHOLD)
    assert stripped.moved == 2  # the large initializer and the large Constant's tensor
    got = onnx.ModelProto()
    got.ParseFromString(stripped.data)

    big, small = got.graph.initializer
    assert _moved(big, data) == model.graph.initializer[0].raw_data and not big.raw_data
    assert _moved(small, data) is None and small == model.graph.initializer[1]
    constant = got.graph.node[1].attribute[0].t
    assert _moved(constant, data) == model.graph.node[1].attribute[0].t.raw_data
    assert got.graph.node[2] == model.graph.node[2] and got.graph.node[3] == model.graph.node[3]

    # with the moved bytes put back inline, the model is the original, field for field
    for tensor in (big, constant):
        tensor.raw_data = _moved(tensor, data) or b""
        del tensor.external_data[:]
        tensor.ClearField("data_location")
    assert got == model


def test_a_model_without_large_raw_data_comes_back_byte_for_byte() -> None:
    model = _model()
    data = model.SerializeToString()
    stripped = strip_inline_weights(memoryview(data), "m.onnx", threshold=1 << 20)
    assert stripped.moved == 0 and stripped.data == data
