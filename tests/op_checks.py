"""One-node models through the whole path (compile_model -> QPC -> run_qpc), checked against an
oracle: ONNX Runtime where it implements the op, `onnx.reference` where it does not.

Shared by the op-family test files so that each states only the node, its inputs and the
oracle; the model is built here with declared input and output types and shapes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
from onnx.reference import ReferenceEvaluator

from compiler_core.compile import compile_model
from compiler_core.runtime import run_qpc

RNG = np.random.default_rng(2026)


def rand(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def one_node_model(
    node: onnx.NodeProto,
    inputs: Mapping[str, np.ndarray],
    outputs: Mapping[str, tuple[np.dtype | type, Sequence[int]]],
    *,
    opset: int,
    extra_opsets: Mapping[str, int] | None = None,
    initializers: Mapping[str, np.ndarray] | None = None,
) -> onnx.ModelProto:
    """A model of `node` alone: graph inputs typed from the feeds, outputs as declared."""
    consts = dict(initializers or {})
    graph_inputs = [
        oh.make_tensor_value_info(name, oh.np_dtype_to_tensor_dtype(value.dtype), list(value.shape))
        for name, value in inputs.items()
        if name not in consts
    ]
    graph_outputs = [
        oh.make_tensor_value_info(name, oh.np_dtype_to_tensor_dtype(np.dtype(dtype)), list(dims))
        for name, (dtype, dims) in outputs.items()
    ]
    graph = oh.make_graph(
        [node],
        "one_node",
        graph_inputs,
        graph_outputs,
        initializer=[onnx.numpy_helper.from_array(v, name) for name, v in consts.items()],
    )
    opsets = [oh.make_opsetid("", opset)]
    opsets += [oh.make_opsetid(d, v) for d, v in (extra_opsets or {}).items()]
    model = oh.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model


def run_compiled(
    model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], cores: int = 1
) -> list[np.ndarray]:
    """Compile for `cores` NSP cores, run on the functional runtime, outputs in graph order."""
    result = compile_model(model.SerializeToString(), [f"-aic-num-cores={cores}"])
    try:
        got = run_qpc(result.qpc_path, dict(feeds))
    finally:
        result.cleanup()
    return [got[out.name] for out in model.graph.output]


def run_onnxruntime(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return list(session.run(None, dict(feeds)))


def run_reference(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(v) for v in ReferenceEvaluator(model).run(None, dict(feeds))]


def assert_matches(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    *,
    oracle: str = "onnxruntime",
    cores: Sequence[int] = (1, 4),
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Every output of the compiled model, on each core count, equals the oracle's."""
    expected = (run_onnxruntime if oracle == "onnxruntime" else run_reference)(model, feeds)
    inputs = {k: v for k, v in feeds.items()}
    for count in cores:
        got = run_compiled(model, inputs, count)
        for out, want, have in zip(model.graph.output, expected, got, strict=True):
            assert have.dtype == want.dtype, f"{out.name} on {count} cores: dtype {have.dtype}"
            np.testing.assert_allclose(
                have, want, rtol=rtol, atol=atol, err_msg=f"{out.name} on {count} cores"
            )
