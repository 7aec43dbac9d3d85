"""Small float models for the quantization tests and their QDQ forms from ONNX Runtime's own
quantizer (`quantize_static` with a synthetic calibration reader)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
from onnx import TensorProto
from onnx import numpy_helper as nh

Feeds = dict[str, np.ndarray]


def _model(
    nodes: list[onnx.NodeProto], inputs, outputs, inits: Mapping[str, np.ndarray], name: str
):
    graph = oh.make_graph(
        nodes,
        name,
        [oh.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [oh.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
        [nh.from_array(v, k) for k, v in inits.items()],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def cnn(seed: int = 0, classes: int = 10) -> onnx.ModelProto:
    """Conv-Relu, Conv + residual Add-Relu, MaxPool, GlobalAveragePool, Flatten, Gemm."""
    rng = np.random.default_rng(seed)
    inits = {
        "w1": rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32),
        "b1": rng.normal(0, 0.1, (8,)).astype(np.float32),
        "w2": rng.normal(0, 0.2, (8, 8, 3, 3)).astype(np.float32),
        "b2": rng.normal(0, 0.1, (8,)).astype(np.float32),
        "w3": rng.normal(0, 0.3, (8, 1, 3, 3)).astype(np.float32),
        "fw": rng.normal(0, 0.3, (classes, 8)).astype(np.float32),
        "fb": rng.normal(0, 0.1, (classes,)).astype(np.float32),
    }
    nodes = [
        oh.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        oh.make_node("Relu", ["c1"], ["r1"]),
        oh.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        oh.make_node("Add", ["c2", "r1"], ["a"]),
        oh.make_node("Relu", ["a"], ["r2"]),
        oh.make_node("Conv", ["r2", "w3"], ["dw"], pads=[1, 1, 1, 1], group=8),
        oh.make_node("Sigmoid", ["dw"], ["sg"]),
        oh.make_node("MaxPool", ["sg"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        oh.make_node("GlobalAveragePool", ["p"], ["g"]),
        oh.make_node("Flatten", ["g"], ["f"]),
        oh.make_node("Gemm", ["f", "fw", "fb"], ["y"], transB=1),
    ]
    return _model(nodes, [("x", [1, 3, 16, 16])], [("y", [1, classes])], inits, "cnn")


def cnn_bn(seed: int = 4, classes: int = 10) -> onnx.ModelProto:
    """A ResNet-style block as exported before any pre-processing: Conv-BatchNormalization-
    Relu, Conv-BatchNormalization, the residual Add, Relu, a Clip (Relu6) after a 1x1 Conv,
    MaxPool, GlobalAveragePool, Flatten, Gemm."""
    rng = np.random.default_rng(seed)
    inits: dict[str, np.ndarray] = {
        "w1": rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32),
        "w2": rng.normal(0, 0.2, (8, 8, 3, 3)).astype(np.float32),
        "w3": rng.normal(0, 0.3, (16, 8, 1, 1)).astype(np.float32),
        "b3": rng.normal(0, 0.1, (16,)).astype(np.float32),
        "lo": np.array(0.0, np.float32),
        "hi": np.array(6.0, np.float32),
        "fw": rng.normal(0, 0.3, (classes, 16)).astype(np.float32),
        "fb": rng.normal(0, 0.1, (classes,)).astype(np.float32),
    }
    for norm in ("bn1", "bn2"):
        inits[f"{norm}.s"] = rng.uniform(0.5, 1.5, 8).astype(np.float32)
        inits[f"{norm}.b"] = rng.uniform(-0.2, 0.2, 8).astype(np.float32)
        inits[f"{norm}.m"] = rng.uniform(-0.2, 0.2, 8).astype(np.float32)
        inits[f"{norm}.v"] = rng.uniform(0.5, 1.5, 8).astype(np.float32)

    def bn(name: str, x: str, y: str) -> onnx.NodeProto:
        operands = [x, f"{name}.s", f"{name}.b", f"{name}.m", f"{name}.v"]
        return oh.make_node("BatchNormalization", operands, [y], name=name)

    nodes = [
        oh.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        bn("bn1", "c1", "n1"),
        oh.make_node("Relu", ["n1"], ["r1"]),
        oh.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        bn("bn2", "c2", "n2"),
        oh.make_node("Add", ["n2", "r1"], ["a"]),
        oh.make_node("Relu", ["a"], ["r2"]),
        oh.make_node("Conv", ["r2", "w3", "b3"], ["c3"]),
        oh.make_node("Clip", ["c3", "lo", "hi"], ["r3"]),
        oh.make_node("MaxPool", ["r3"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        oh.make_node("GlobalAveragePool", ["p"], ["g"]),
        oh.make_node("Flatten", ["g"], ["f"]),
        oh.make_node("Gemm", ["f", "fw", "fb"], ["y"], transB=1),
    ]
    return _model(nodes, [("x", [1, 3, 16, 16])], [("y", [1, classes])], inits, "cnn_bn")


def pooled(seed: int = 2, **pool: Any) -> onnx.ModelProto:
    """Conv-Relu then a windowed AveragePool (attributes `pool`) as the output, so its own
    quantization step is the tolerance."""
    rng = np.random.default_rng(seed)
    inits = {
        "w1": rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32),
        "b1": rng.normal(0, 0.1, (8,)).astype(np.float32),
    }
    nodes = [
        oh.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        oh.make_node("Relu", ["c1"], ["r1"]),
        oh.make_node("AveragePool", ["r1"], ["y"], **pool),
    ]
    model = _model(nodes, [("x", [1, 3, 13, 13])], [("y", None)], inits, "pooled")
    return onnx.shape_inference.infer_shapes(model)


def mlp(seed: int = 1) -> onnx.ModelProto:
    """MatMul + bias, SiLU (x * Sigmoid(x)), MatMul, Tanh, Sub, Concat, Transpose, and an
    activation-by-activation MatMul."""
    rng = np.random.default_rng(seed)
    inits = {
        "w1": rng.normal(0, 0.25, (16, 32)).astype(np.float32),
        "b1": rng.normal(0, 0.1, (32,)).astype(np.float32),
        "w2": rng.normal(0, 0.2, (32, 16)).astype(np.float32),
    }
    nodes = [
        oh.make_node("MatMul", ["x", "w1"], ["m1"]),
        oh.make_node("Add", ["m1", "b1"], ["h1"]),
        oh.make_node("Sigmoid", ["h1"], ["s1"]),
        oh.make_node("Mul", ["h1", "s1"], ["silu"]),
        oh.make_node("MatMul", ["silu", "w2"], ["m2"]),
        oh.make_node("Tanh", ["m2"], ["t"]),
        oh.make_node("Sub", ["t", "x"], ["d"]),
        oh.make_node("Concat", ["d", "t"], ["cat"], axis=1),
        oh.make_node("Transpose", ["cat"], ["tr"], perm=[1, 0]),
        oh.make_node("MatMul", ["cat", "tr"], ["y"]),
    ]
    return _model(nodes, [("x", [4, 16])], [("y", [4, 4])], inits, "mlp")


def calibration(model: onnx.ModelProto, count: int = 8, seed: int = 3) -> list[Feeds]:
    """Random normal samples for every graph input."""
    rng = np.random.default_rng(seed)
    shapes = {
        i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input
    }
    return [
        {n: rng.normal(0, 1, s).astype(np.float32) for n, s in shapes.items()} for _ in range(count)
    ]


class _Reader:
    """onnxruntime.quantization's CalibrationDataReader over a list of feeds."""

    def __init__(self, samples: list[Feeds]) -> None:
        self._it: Iterator[Feeds] = iter(samples)

    def get_next(self) -> Feeds | None:
        return next(self._it, None)


def ort_qdq(model: onnx.ModelProto, samples: list[Feeds], **kwargs: Any) -> onnx.ModelProto:
    """ONNX Runtime's static QDQ quantization of `model` calibrated on `samples`."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    reader = type("Reader", (_Reader, CalibrationDataReader), {})(samples)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "float.onnx", Path(tmp) / "qdq.onnx"
        onnx.save(model, src)
        quantize_static(str(src), str(dst), reader, quant_format=QuantFormat.QDQ, **kwargs)
        return onnx.load(dst)


def run_ort(model: onnx.ModelProto, feeds: Feeds, *, optimize: bool = True) -> list[np.ndarray]:
    """ONNX Runtime on CPU; `optimize` (the default) lets it fuse QDQ groups into its own int8
    kernels, which is ORT's int8 execution of the model."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return [np.asarray(v) for v in session.run(None, feeds)]


def output_scales(model: onnx.ModelProto) -> dict[str, float]:
    """Each graph output's quantization step: the scale of the DequantizeLinear producing it."""
    inits = {i.name: nh.to_array(i) for i in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.output[0] in {
            o.name for o in model.graph.output
        }:
            found[node.output[0]] = float(inits[node.input[1]].reshape(-1)[0])
    return found
