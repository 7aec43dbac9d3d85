"""`conv_compute` (compiler_core/ops/conv.py) builds its im2col columns in per-thread scratch
memory and adds the bias into the product's own array: results must not share that memory,
and must stay what ONNX Runtime computes."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_core.ops import REGISTRY, TileCtx
from compiler_core.ops.registry import NodeInfo

RNG = np.random.default_rng(5)


def _conv(
    w: np.ndarray, b: np.ndarray, x_shape: tuple[int, ...]
) -> tuple[NodeInfo, ort.InferenceSession]:
    out_shape = (x_shape[0], w.shape[0], *x_shape[2:])
    info = NodeInfo(
        op_type="Conv",
        name="conv",
        attrs={"pads": [1, 1, 1, 1]},
        in_shapes=(x_shape, w.shape, b.shape),
        in_dtypes=("float32", "float32", "float32"),
        out_shapes=(out_shape,),
        out_dtypes=("float32",),
        opset=17,
    )
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1])],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(out_shape))],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return info, session


@pytest.mark.parametrize("uniform", [False, True])
def test_a_product_keeps_its_result_when_the_next_reuses_the_scratch_columns(
    uniform: bool,
) -> None:
    """Two 3x3 convs with bias in a row; with `uniform`, every weight row is equal (the
    product is one row repeated, a read-only array the bias cannot be added into)."""
    w = RNG.standard_normal((16, 8, 3, 3)).astype(np.float32) * 0.2
    if uniform:
        w[:] = w[:1]
    b = RNG.standard_normal(16).astype(np.float32)
    x_shape = (1, 8, 9, 11)
    info, session = _conv(w, b, x_shape)
    opdef = REGISTRY.lookup("Conv", "", 17)
    assert opdef is not None
    tile = TileCtx.whole(info)
    x1, x2 = (RNG.standard_normal(x_shape).astype(np.float32) for _ in range(2))
    y1 = np.asarray(opdef.compute(info, [x1, w, b], tile)[0])
    kept = y1.copy()
    y2 = np.asarray(opdef.compute(info, [x2, w, b], tile)[0])
    assert not np.shares_memory(y1, y2)
    np.testing.assert_array_equal(y1, kept)
    for x, y in ((x1, y1), (x2, y2)):
        want = session.run(None, {"x": x})[0]
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)
