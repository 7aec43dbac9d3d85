"""Small models for the code generation tests (tests/test_codegen.py), built in code.

- `conv_net`: a conv chain with a strided conv, a residual and a classifier, random weights.
- `mlp`: Relu, then two MatMuls: under a row or batch split every core reads the same weights.
- `probed_light_model`: a light CNN of the ONNX test data with input-sensitive activations
  added as graph outputs (see its docstring for why the plain outputs prove little).
- `bench_models`: the benchmark's own model builders (bench/models.py and
  bench/transformer_models.py), the ones bench/codegen.py uses.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from tests.models import light_model_input, light_model_path

OPSET = 17
FP16_MAX = 65504.0


def conv_net(batch: int = 2, channels: int = 32, size: int = 32, seed: int = 0) -> onnx.ModelProto:
    """Conv + Relu, a strided conv, a residual with a max pool, global pool and Gemm."""
    rng = np.random.default_rng(seed)

    def w(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)

    node = helper.make_node
    nodes = [
        node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        node("Relu", ["c1"], ["r1"], name="relu1"),
        node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv2"),
        node("Relu", ["c2"], ["r2"], name="relu2"),
        node("Conv", ["r2", "w3"], ["c3"], pads=[1, 1, 1, 1], name="conv3"),
        node("MaxPool", ["r2"], ["p"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="pool"),
        node("Add", ["c3", "p"], ["s"], name="residual"),
        node("GlobalAveragePool", ["s"], ["g"], name="gap"),
        node("Flatten", ["g"], ["f"], name="flatten"),
        node("Gemm", ["f", "wf", "bf"], ["y"], transB=1, name="fc"),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 10])],
        [
            w("w1", (channels, 3, 3, 3)),
            w("b1", (channels,)),
            w("w2", (channels, channels, 3, 3)),
            w("w3", (channels, channels, 3, 3)),
            w("wf", (10, channels)),
            w("bf", (10,)),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def mlp(
    rows: int = 256, width: int = 256, batch: int | None = None, seed: int = 0
) -> onnx.ModelProto:
    """y = relu(relu(x) @ w1) @ w2 on x [rows, width] (or [batch, rows, width]): cut by rows or
    batch, every core needs all of w1 and w2."""
    rng = np.random.default_rng(seed)
    scale = np.float32(width**-0.5)
    w1 = (rng.standard_normal((width, width), dtype=np.float32) * scale).astype(np.float32)
    w2 = (rng.standard_normal((width, width), dtype=np.float32) * scale).astype(np.float32)
    node = helper.make_node
    nodes = [
        node("Relu", ["x"], ["r"], name="act0"),
        node("MatMul", ["r", "w1"], ["h"], name="fc1"),
        node("Relu", ["h"], ["a"], name="act1"),
        node("MatMul", ["a", "w2"], ["y"], name="fc2"),
    ]
    shape = [rows, width] if batch is None else [batch, rows, width]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


PROBE_OPS = ("Relu", "MaxPool", "Concat", "AveragePool", "LRN", "Add", "BatchNormalization")
"""Ops whose outputs may become probes: they end the fused chains, so probing them changes
the schedule little."""


@cache
def probed_light_model(name: str, probes: int = 3, *, fp16: bool = False) -> bytes:
    """The light CNN `name` with `probes` intermediate activations added as graph outputs.

    These models build every weight with ConstantOfShape: all channels are alike, and deep in
    the network the activations no longer depend on the image, so every final output is a
    constant (a softmax over 1,000 equal logits: 0.001 everywhere). A schedule that loses a
    tile or reads a weight nobody loaded still matches ONNX Runtime there. Probes are the
    activations (of `PROBE_OPS`) that do depend on the image: ONNX Runtime's values change
    by more than 0.1% of their peak when the image is mirrored or doubled. They are spread
    over the network, the deepest one included. With `fp16`, only activations inside the
    float16 range qualify. Returns the serialized model (a cache must not hand out a mutable
    proto).
    """
    model = onnx.load(light_model_path(name))
    candidates = [n.output[0] for n in model.graph.node if n.op_type in PROBE_OPS]
    weights = {i.name for i in model.graph.initializer}
    graph_input = next(i for i in model.graph.input if i.name not in weights)
    shape = tuple(d.dim_value for d in graph_input.type.tensor_type.shape.dim)
    image = light_model_input(shape)
    changed = (np.ascontiguousarray(image[..., ::-1]), image * np.float32(2))
    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    del wide.graph.output[:]
    wide.graph.output.extend(helper.make_empty_tensor_value_info(c) for c in candidates)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the models carry unused initializers ORT warns about
    session = ort.InferenceSession(wide.SerializeToString(), options)
    plain = session.run(candidates, {graph_input.name: image})
    others = [session.run(candidates, {graph_input.name: x}) for x in changed]
    sensitive: list[tuple[str, tuple[int, ...]]] = []
    for index, (value, a) in enumerate(zip(candidates, plain, strict=True)):
        peak = float(np.abs(a).max())
        if not np.isfinite(a).all() or (fp16 and peak >= FP16_MAX):
            continue
        if max(float(np.abs(a - other[index]).max()) for other in others) > 1e-3 * peak:
            sensitive.append((value, tuple(a.shape)))
    if len(sensitive) < probes:
        raise ValueError(f"{name}: only {len(sensitive)} input-sensitive activations to probe")
    picks = np.linspace(0, len(sensitive) - 1, probes).round().astype(int)
    for value, dims in (sensitive[i] for i in sorted(set(picks.tolist()))):
        model.graph.output.append(helper.make_tensor_value_info(value, TensorProto.FLOAT, dims))
    return model.SerializeToString()


BENCH = Path(__file__).resolve().parent.parent / "bench"


def _bench_module(name: str) -> ModuleType:
    """bench/<name>.py (bench/ is not a package), under a name of its own."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


@cache
def bench_models() -> tuple[ModuleType, ModuleType]:
    """bench/models.py (the ResNet) and bench/transformer_models.py (encoder, decoder)."""
    return _bench_module("models"), _bench_module("transformer_models")
