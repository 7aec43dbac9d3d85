"""Deterministic benchmark models, generated in code: a ResNet and a > 2 GiB external-data MLP.

Both are written atomically (to a temporary name, then renamed), so a model file that exists is
complete and can be reused by the next run with the same parameters.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 9
_ALIGN = 4096
"""External tensors start on page boundaries, so a reader can memory-map each one."""


@dataclass(frozen=True)
class ResNetSpec:
    """A v1.5 bottleneck ResNet (stride on the 3x3 conv); the defaults are ResNet-50."""

    blocks: tuple[int, ...] = (3, 4, 6, 3)
    width: int = 64
    image: int = 224
    classes: int = 1000
    seed: int = 0

    @property
    def name(self) -> str:
        blocks = "-".join(str(b) for b in self.blocks)
        return f"resnet-b{blocks}-w{self.width}-i{self.image}-s{self.seed}"


@dataclass(frozen=True)
class MlpSpec:
    """`layers` x (MatMul [hidden, hidden] + Add + Relu), weights in one external data file."""

    hidden: int = 8192
    layers: int = 9
    seed: int = 0

    @property
    def name(self) -> str:
        return f"mlp-h{self.hidden}-l{self.layers}-s{self.seed}"

    @property
    def weight_bytes(self) -> int:
        return self.layers * self.hidden * self.hidden * 4


RESNET50 = ResNetSpec()
RESNET_QUICK = ResNetSpec(blocks=(1, 1, 1, 1), width=16, image=112)
MLP_BIG = MlpSpec()  # 9 x 256 MiB = 2.25 GiB
MLP_QUICK = MlpSpec(hidden=4096, layers=5)  # 5 x 64 MiB = 320 MiB


def model_size(path: Path) -> int:
    """Bytes of the model file plus every external data file it names."""
    total = path.stat().st_size
    for location in _external_locations(path):
        total += (path.parent / location).stat().st_size
    return total


def _external_locations(path: Path) -> set[str]:
    proto = onnx.load(os.fspath(path), load_external_data=False)
    locations: set[str] = set()
    for tensor in proto.graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL:
            locations.update(e.value for e in tensor.external_data if e.key == "location")
    return locations


# --- ResNet -----------------------------------------------------------------------------------


class _GraphBuilder:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._count = 0

    def fresh(self, stem: str) -> str:
        self._count += 1
        return f"{stem}_{self._count}"

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(array.astype(np.float32), name))
        return name

    def node(self, op: str, inputs: list[str], stem: str, **attrs: Any) -> str:
        out = self.fresh(stem)
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def conv_bn(self, x: str, cin: int, cout: int, k: int, stride: int, relu: bool) -> str:
        stem = self.fresh("conv")
        fan_in = cin * k * k
        w = self.rng.standard_normal((cout, cin, k, k), dtype=np.float32)
        w *= np.float32(math.sqrt(2.0 / fan_in))
        y = self.node(
            "Conv",
            [x, self.weight(f"{stem}.weight", w)],
            stem,
            kernel_shape=[k, k],
            strides=[stride, stride],
            pads=[k // 2] * 4,
        )
        bn = [
            self.weight(f"{stem}.bn.scale", self.rng.uniform(0.5, 1.0, cout)),
            self.weight(f"{stem}.bn.bias", self.rng.uniform(-0.1, 0.1, cout)),
            self.weight(f"{stem}.bn.mean", self.rng.uniform(-0.1, 0.1, cout)),
            self.weight(f"{stem}.bn.var", self.rng.uniform(0.5, 1.5, cout)),
        ]
        y = self.node("BatchNormalization", [y, *bn], f"{stem}.bn", epsilon=1e-5)
        return self.node("Relu", [y], f"{stem}.relu") if relu else y

    def bottleneck(self, x: str, cin: int, width: int, stride: int) -> str:
        cout = width * 4
        y = self.conv_bn(x, cin, width, 1, 1, relu=True)
        y = self.conv_bn(y, width, width, 3, stride, relu=True)
        y = self.conv_bn(y, width, cout, 1, 1, relu=False)
        shortcut = x
        if stride != 1 or cin != cout:
            shortcut = self.conv_bn(x, cin, cout, 1, stride, relu=False)
        return self.node("Relu", [self.node("Add", [y, shortcut], "add")], "relu")


def resnet(spec: ResNetSpec) -> onnx.ModelProto:
    """A ResNet with random weights drawn from `spec.seed` (same spec, same bytes)."""
    g = _GraphBuilder(np.random.default_rng(spec.seed))
    x = g.conv_bn("input", 3, spec.width, 7, 2, relu=True)
    x = g.node("MaxPool", [x], "maxpool", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4)
    cin = spec.width
    for stage, count in enumerate(spec.blocks):
        width = spec.width * 2**stage
        for i in range(count):
            x = g.bottleneck(x, cin, width, 2 if stage > 0 and i == 0 else 1)
            cin = width * 4
    x = g.node("Flatten", [g.node("GlobalAveragePool", [x], "gap")], "flatten", axis=1)
    fc_w = g.rng.standard_normal((spec.classes, cin), dtype=np.float32) / np.float32(math.sqrt(cin))
    fc_b = np.zeros(spec.classes, np.float32)
    g.nodes.append(
        helper.make_node(
            "Gemm",
            [x, g.weight("fc.weight", fc_w), g.weight("fc.bias", fc_b)],
            ["logits"],
            name="fc",
            transB=1,
        )
    )
    graph = helper.make_graph(
        g.nodes,
        spec.name,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, spec.image, spec.image])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, spec.classes])],
        g.initializers,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION
    )


def write_resnet(spec: ResNetSpec, out_dir: Path, *, regenerate: bool = False) -> Path:
    path = out_dir / f"{spec.name}.onnx"
    if path.exists() and not regenerate:
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".onnx.tmp")
    onnx.save(resnet(spec), os.fspath(tmp))
    tmp.replace(path)
    return path


# --- > 2 GiB MLP with external data -----------------------------------------------------------


def write_mlp(spec: MlpSpec, out_dir: Path, *, regenerate: bool = False) -> Path:
    """Write the MLP's weights straight to `<model>.data`, chunk by chunk, then the model.

    The generator never holds a whole weight matrix (let alone two copies of all of them); the
    external data location is relative to the model file, as the ONNX spec requires.
    """
    path = out_dir / f"{spec.name}.onnx"
    if path.exists() and not regenerate:
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    data_name = f"{spec.name}.onnx.data"
    rng = np.random.default_rng(spec.seed)
    h = spec.hidden
    scale = np.float32(math.sqrt(2.0 / h))
    rows_per_chunk = max(1, (32 << 20) // (h * 4))
    initializers: list[TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    x = "input"
    with open(out_dir / data_name, "wb") as data:
        for layer in range(spec.layers):
            data.write(b"\0" * (-data.tell() % _ALIGN))
            offset = data.tell()
            for start in range(0, h, rows_per_chunk):
                rows = min(rows_per_chunk, h - start)
                chunk = rng.standard_normal((rows, h), dtype=np.float32)
                chunk *= scale
                data.write(chunk.astype("<f4", copy=False).tobytes())
            w_name = f"layer{layer}.weight"
            initializers.append(_external_tensor(w_name, [h, h], data_name, offset, h * h * 4))
            b_name = f"layer{layer}.bias"
            bias = rng.uniform(-0.01, 0.01, h).astype(np.float32)
            initializers.append(numpy_helper.from_array(bias, b_name))
            y = f"layer{layer}.matmul"
            nodes.append(helper.make_node("MatMul", [x, w_name], [y], name=y))
            z = f"layer{layer}.add"
            nodes.append(helper.make_node("Add", [y, b_name], [z], name=z))
            x = f"layer{layer}.relu" if layer < spec.layers - 1 else "output"
            nodes.append(helper.make_node("Relu", [z], [x], name=f"layer{layer}.relu"))
    graph = helper.make_graph(
        nodes,
        spec.name,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, h])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, h])],
        initializers,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION
    )
    tmp = path.with_suffix(".onnx.tmp")
    tmp.write_bytes(model.SerializeToString())
    tmp.replace(path)
    return path


def _external_tensor(
    name: str, dims: list[int], location: str, offset: int, length: int
) -> TensorProto:
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=dims)
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)
    return tensor
