"""Small test models built in code, shared by the end-to-end tests."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

LIGHT_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
LIGHT_MODELS = sorted(f[: -len(".onnx")] for f in os.listdir(LIGHT_DIR) if f.endswith(".onnx"))


def light_model_path(name: str) -> str:
    return os.path.join(LIGHT_DIR, name + ".onnx")


def light_model_input(shape: tuple[int, ...]) -> np.ndarray:
    """The input the ONNX backend tests feed these models: arange(n) / n."""
    n = int(np.prod(shape))
    return (np.arange(n).reshape(shape) / n).astype(np.float32)


def transformer_encoder(
    batch: int = 2, seq: int = 16, hidden: int = 64, heads: int = 4, ffn: int = 128, seed: int = 0
) -> onnx.ModelProto:
    """One pre-norm transformer encoder layer: attention + GELU feed-forward, opset 17."""
    rng = np.random.default_rng(seed)
    head = hidden // heads
    inits: list[onnx.TensorProto] = []

    def weight(name: str, shape: tuple[int, ...], scale: float = 0.1) -> str:
        inits.append(
            numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)
        )
        return name

    def const(name: str, values: list[int] | list[float], dtype: type = np.int64) -> str:
        inits.append(numpy_helper.from_array(np.array(values, dtype=dtype), name))
        return name

    n = helper.make_node
    nodes = [
        n(
            "LayerNormalization",
            ["x", weight("ln1_g", (hidden,)), weight("ln1_b", (hidden,))],
            ["h"],
            axis=-1,
            epsilon=1e-5,
            name="ln1",
        ),
        n("MatMul", ["h", weight("wq", (hidden, hidden))], ["q0"], name="q_proj"),
        n("Add", ["q0", weight("bq", (hidden,))], ["q1"], name="q_bias"),
        n("MatMul", ["h", weight("wk", (hidden, hidden))], ["k0"], name="k_proj"),
        n("MatMul", ["h", weight("wv", (hidden, hidden))], ["v0"], name="v_proj"),
        n(
            "Reshape",
            ["q1", const("heads_shape", [batch, seq, heads, head])],
            ["q2"],
            name="q_split",
        ),
        n("Transpose", ["q2"], ["q"], perm=[0, 2, 1, 3], name="q_t"),
        n("Reshape", ["k0", "heads_shape"], ["k2"], name="k_split"),
        n("Transpose", ["k2"], ["kt"], perm=[0, 2, 3, 1], name="k_t"),
        n("Reshape", ["v0", "heads_shape"], ["v2"], name="v_split"),
        n("Transpose", ["v2"], ["v"], perm=[0, 2, 1, 3], name="v_t"),
        n("MatMul", ["q", "kt"], ["s0"], name="scores"),
        n("Div", ["s0", const("scale", [float(np.sqrt(head))], np.float32)], ["s1"], name="scale"),
        n("Softmax", ["s1"], ["p"], axis=-1, name="softmax"),
        n("MatMul", ["p", "v"], ["a0"], name="attend"),
        n("Transpose", ["a0"], ["a1"], perm=[0, 2, 1, 3], name="merge_t"),
        n("Reshape", ["a1", const("merge_shape", [batch, seq, hidden])], ["a2"], name="merge"),
        n("MatMul", ["a2", weight("wo", (hidden, hidden))], ["o0"], name="o_proj"),
        n("Add", ["o0", weight("bo", (hidden,))], ["o1"], name="o_bias"),
        n("Add", ["x", "o1"], ["r1"], name="residual1"),
        n(
            "LayerNormalization",
            ["r1", weight("ln2_g", (hidden,)), weight("ln2_b", (hidden,))],
            ["h2"],
            axis=-1,
            epsilon=1e-5,
            name="ln2",
        ),
        n("MatMul", ["h2", weight("w1", (hidden, ffn))], ["f0"], name="ffn_up"),
        n("Add", ["f0", weight("b1", (ffn,))], ["f1"], name="ffn_bias"),
        n(
            "Div",
            ["f1", const("sqrt2", [float(np.sqrt(2.0))], np.float32)],
            ["g0"],
            name="gelu_div",
        ),
        n("Erf", ["g0"], ["g1"], name="gelu_erf"),
        n("Add", ["g1", const("one", [1.0], np.float32)], ["g2"], name="gelu_add"),
        n("Mul", ["f1", "g2"], ["g3"], name="gelu_mul"),
        n("Mul", ["g3", const("half", [0.5], np.float32)], ["g4"], name="gelu_half"),
        n("MatMul", ["g4", weight("w2", (ffn, hidden))], ["f2"], name="ffn_down"),
        n("Add", ["r1", "f2"], ["y"], name="residual2"),
    ]
    graph = helper.make_graph(
        nodes,
        "encoder",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, hidden])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


OVERFLOW_WIDTH = 16
OVERFLOW_INPUTS = {"x": np.ones((1, OVERFLOW_WIDTH), np.float32)}


def overflowing_model(with_mask_branch: bool = False) -> onnx.ModelProto:
    """x @ W (W = 5000): 80,000 with x = 1, past float16's 65,504; scaled by 1e-4 into a
    Softmax, whose +inf inputs make NaN. The scale is a per-column vector: a scalar one the
    compile folds into W (compiler_core/passes/fold_matmul_scale.py) and nothing overflows.
    With the mask branch, an earlier kernel turns finite inputs into -inf (Log of 0, as an
    attention mask does) that its Softmax turns back into zeros: not the cause, and not
    blamed."""
    nodes = []
    inits = [
        numpy_helper.from_array(np.full((OVERFLOW_WIDTH, OVERFLOW_WIDTH), 5000.0, np.float32), "W"),
        numpy_helper.from_array(np.full((OVERFLOW_WIDTH,), 1e-4, np.float32), "s"),
    ]
    if with_mask_branch:
        z = np.zeros((OVERFLOW_WIDTH, OVERFLOW_WIDTH), np.float32)
        z[:, OVERFLOW_WIDTH // 2 :] = 0.1
        inits.append(numpy_helper.from_array(z, "Z"))
        nodes += [
            helper.make_node("MatMul", ["x", "Z"], ["zx"], name="/mask/MatMul"),
            helper.make_node("Log", ["zx"], ["logits"], name="/mask/Log"),
            helper.make_node("Softmax", ["logits"], ["masked"], name="/mask/Softmax", axis=-1),
        ]
    nodes += [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="/proj/MatMul"),
        helper.make_node("Mul", ["h", "s"], ["hs"], name="/proj/Mul"),
        helper.make_node("Softmax", ["hs"], ["p"], name="/head/Softmax", axis=-1),
    ]
    if with_mask_branch:
        nodes.append(helper.make_node("Add", ["masked", "p"], ["y"], name="/out/Add"))
    else:
        nodes.append(helper.make_node("Identity", ["p"], ["y"], name="/out/Identity"))
    graph = helper.make_graph(
        nodes,
        "overflow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, OVERFLOW_WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, OVERFLOW_WIDTH])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def sparse_matmul_header(folder: Path, k: int, n: int) -> Path:
    """y = x @ w with w [k, n] fp16 as external data in a sparse file (its bytes were never
    written: a check that reads only headers can size a model of any size)."""
    w = TensorProto(name="w", data_type=TensorProto.FLOAT16, dims=[k, n])
    w.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "weights.data"), ("offset", "0"), ("length", str(k * n * 2))):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, n])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = folder / "big.onnx"
    path.write_bytes(model.SerializeToString())
    with open(folder / "weights.data", "wb") as data:
        data.truncate(k * n * 2)
    return path
