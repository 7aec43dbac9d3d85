"""Quantize a float model from a calibration profile: write the QDQ form that fold-qdq then
turns into int8 (or int16) kernels.

For every node this compiler has an integer kernel for (Conv, MatMul, Gemm, Add, Sub, Mul,
GlobalAveragePool, AveragePool, a spatial ReduceMean, unary elementwise ops, MaxPool and
data movement) whose op type is not kept float (`-execute-nodes-in-fp16`,
`-keep-original-precision-for-nodes`) and whose tensors the profile covers:
- each float activation it reads or writes gets a QuantizeLinear -> DequantizeLinear pair with
  the parameters its calibrated range gives under `-quantization-schema-activations` (data
  movement and max pooling keep their input's parameters: codes move unchanged);
- constant weights become integer constants under `-quantization-schema-constants`, per output
  channel with `-enable-channelwise` (Conv) or `-enable-rowwise` (MatMul/Gemm);
- a bias becomes int32 at the accumulator's scale (`-quantization-precision-bias=Int32`) or
  int8 with its own scale (Int8, rescaled into the accumulator by the kernel);
- a Relu or Clip that alone reads a Conv/MatMul/Gemm/Add output is quantized with it (its
  range is the kernel's saturation), so no pair sits between them.
Nodes left out stay float; their neighbours' pairs give them float values.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from compiler_core.ops.registry import REGISTRY
from compiler_core.passes.base import GraphPass, NameScope, add_initializer, model_opset
from compiler_core.passes.fold_qdq import MOVE_OPS, NOT_LUT, _activation_tail, _const, bias_add
from compiler_core.passes.raise_opset import raise_opset
from compiler_core.quant.profile import Profile, TensorStats
from compiler_core.quant.ranges import abs_histogram, side_histogram, threshold

log = logging.getLogger(__name__)

HMX = frozenset({"Conv", "MatMul", "Gemm"})
BINARY = frozenset({"Add", "Sub", "Mul"})
POOL = frozenset({"GlobalAveragePool", "ReduceMean", "AveragePool"})
WORST = 5
"""Nodes the quantization-loss warning names."""
QDQ_OPSET = {"Int8": 13, "Int16": 21}
"""The first opset whose QuantizeLinear/DequantizeLinear take what this pass writes: `axis`
(per-channel weights and int32 biases) from 13, 16-bit codes from 21. A model importing less
is raised to it first (`compiler_core.passes.raise_opset`)."""


@dataclass(frozen=True)
class QuantSettings:
    """The quantization options, as the pass reads them."""

    precision: str = "Int8"
    bias: str = "Int8"
    schema_activations: str = "symmetric_with_uint8"
    schema_constants: str = "symmetric_with_uint8"
    calibration: str = "None"
    percentile: float = 100.0
    channelwise: bool = False
    rowwise: bool = False
    keep: frozenset[str] = frozenset()

    @classmethod
    def from_options(cls, o: object) -> QuantSettings:
        return cls(
            precision=getattr(o, "quantization_precision", "Int8"),
            bias=getattr(o, "quantization_precision_bias", "Int8"),
            schema_activations=getattr(
                o, "quantization_schema_activations", cls.schema_activations
            ),
            schema_constants=getattr(o, "quantization_schema_constants", cls.schema_constants),
            calibration=getattr(o, "quantization_calibration", "None"),
            percentile=float(getattr(o, "percentile_calibration_value", 100.0)),
            channelwise=bool(getattr(o, "enable_channelwise", False)),
            rowwise=bool(getattr(o, "enable_rowwise", False)),
            keep=frozenset(getattr(o, "execute_nodes_in_fp16", ()))
            | frozenset(getattr(o, "keep_original_precision_for_nodes", ())),
        )


@dataclass(frozen=True)
class Params:
    scale: np.ndarray
    zero: np.ndarray
    dtype: str


def _types(precision: str) -> tuple[str, str]:
    return ("int16", "uint16") if precision == "Int16" else ("int8", "uint8")


def params_for_range(lo: float, hi: float, schema: str, precision: str) -> Params:
    """Scale, zero point and type that cover [lo, hi] under a schema."""
    signed, unsigned = _types(precision)
    top = float(np.iinfo(np.dtype(signed)).max)
    utop = float(np.iinfo(np.dtype(unsigned)).max)
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if schema == "asymmetric":
        scale = (hi - lo) / utop or 1.0
        zero = int(np.clip(round(-lo / scale), 0, utop))
        return Params(np.array(scale, np.float32), np.array(zero), unsigned)
    if schema == "symmetric_with_uint8" and lo >= 0:
        return Params(np.array(hi / utop or 1.0, np.float32), np.array(0), unsigned)
    scale = max(-lo, hi) / top or 1.0
    if schema == "symmetric_with_power2_scale":
        scale = 2.0 ** math.ceil(math.log2(scale))
    return Params(np.array(scale, np.float32), np.array(0), signed)


class QuantizePass(GraphPass):
    name = "quantize"

    def __init__(self, profile: Profile, settings: QuantSettings) -> None:
        super().__init__()
        self.profile = profile
        self.settings = settings
        self.quantized: list[str] = []
        """Names of the nodes given integer form."""
        self.uncovered: list[str] = []
        """Nodes left float because the profile lacks one of their tensors."""
        self.warnings: list[dict[str, Any]] = []
        self._bias_add: tuple[ir.Node, ir.Value] | None = None
        self.losses: list[tuple[str, str, float]] = []
        """(node, tensor, SQNR in dB) of each quantized activation, worst first: the
        signal-to-noise ratio its integer form has on the calibration histogram."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        target = QDQ_OPSET.get(self.settings.precision, QDQ_OPSET["Int8"])
        raise_opset(model, target, f"{self.settings.precision} QuantizeLinear/DequantizeLinear")
        self.graph = graph
        self.names = NameScope(graph)
        self.opset = model_opset(model)
        self.params: dict[int, Params] = {}
        self.pairs: list[ir.Value] = []
        self._paired: set[int] = set()
        self.quantized, self.uncovered = [], []
        consumed: set[int] = set()
        for node in list(graph):
            if id(node) in consumed or node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type in self.settings.keep or len(node.outputs) != 1:
                continue
            self._bias_add = None
            unit = node
            if node.op_type == "MatMul" and _const(node.inputs[1]) is not None:
                found = bias_add(node)
                if found is not None and found[0].op_type not in self.settings.keep:
                    self._bias_add = found
                    unit = found[0]
            tail = _activation_tail(unit) if node.op_type in HMX | {"Add", "Sub"} else None
            if self._quantize(node, tail[0] if tail else (unit if unit is not node else None)):
                self.quantized.append(node.name or node.op_type)
                if tail:
                    consumed.add(id(tail[0]))
                if unit is not node:
                    consumed.add(id(unit))
        self.losses = sorted(
            (loss for v in self.pairs if (loss := self._loss(v)) is not None),
            key=lambda item: item[2],
        )
        self.warnings = self._loss_warning()
        for value in self.pairs:
            self._insert_pair(value)
        log.info("quantize: %d nodes, %d left float", len(self.quantized), len(self.uncovered))
        return ir.passes.PassResult(model, modified=bool(self.pairs))

    # -- ranges and parameters ------------------------------------------------------------

    def _range(self, stats: TensorStats) -> tuple[float, float]:
        s = self.settings
        levels = 127 if s.precision == "Int8" else 32767
        signed = s.schema_activations != "asymmetric" and not (
            s.schema_activations == "symmetric_with_uint8" and stats.min >= 0
        )
        if s.calibration == "None":
            return stats.min, stats.max
        if signed:
            counts, edges = abs_histogram(stats)
            t = threshold(counts, edges, s.calibration, min(levels, 128), s.percentile)
            return max(stats.min, -t), min(stats.max, t)
        hi_counts, hi_edges = side_histogram(stats, positive=True)
        hi = (
            threshold(hi_counts, hi_edges, s.calibration, 255, s.percentile)
            if stats.max > 0
            else 0.0
        )
        lo = 0.0
        if stats.min < 0:
            lo_counts, lo_edges = side_histogram(stats, positive=False)
            lo = -threshold(lo_counts, lo_edges, s.calibration, 255, s.percentile)
        return max(stats.min, lo), min(stats.max, hi)

    def _activation(self, value: ir.Value | None) -> Params | None:
        if value is None or value.dtype != ir.DataType.FLOAT:
            return None
        found = self.params.get(id(value))
        if found is not None:
            return found
        stats = self.profile.tensors.get(value.name or "")
        if stats is None:
            producer = value.producer()
            if producer is not None and producer.op_type in MOVE_OPS - {"Concat"}:
                found = self._activation(producer.inputs[0])
            if found is None:
                return None
        else:
            lo, hi = self._range(stats)
            found = params_for_range(
                lo, hi, self.settings.schema_activations, self.settings.precision
            )
        self.params[id(value)] = found
        return found

    def _loss_warning(self) -> list[dict[str, Any]]:
        """One warning naming the quantized nodes whose outputs lose most (lowest SQNR)."""
        lossy = [i for i in self.losses if i[0] != "(input)" and math.isfinite(i[2])]
        worst = lossy[:WORST]  # an exact output (SQNR inf) loses nothing: never named
        if not worst:
            return []
        listed = ", ".join(f"{node} ({format_sqnr(sqnr)})" for node, _, sqnr in worst)
        return [
            {
                "code": "quantization_loss",
                "message": f"int8 loses most at {listed}: the SQNR of their quantized outputs "
                "on the calibration histograms",
                "nodes": [node for node, _, _ in worst],
                "suggestion": "keep such nodes in fp16 with -node-precision-info "
                "(FP16NodeInstanceNames) or their op types with -execute-nodes-in-fp16, if the "
                "accuracy report asks for it",
            }
        ]

    def _loss(self, value: ir.Value) -> tuple[str, str, float] | None:
        """The SQNR (dB) of a tensor's integer form over its profile histogram: rounding
        noise (scale**2 / 12) inside the representable range, clipping error outside."""
        stats = self.profile.tensors.get(value.name or "")
        p = self.params.get(id(value))
        if stats is None or p is None or stats.counts.sum() == 0:
            return None
        edges = stats.edges
        centres = (edges[:-1] + edges[1:]) / 2
        info = np.iinfo(np.dtype(p.dtype))
        scale, zero = float(p.scale), int(p.zero)
        lo, hi = (int(info.min) - zero) * scale, (int(info.max) - zero) * scale
        clipped = np.clip(centres, lo, hi)
        rounding = np.where(centres == 0.0, 0.0, scale**2 / 12.0)  # zero is the zero point
        error = np.where(centres == clipped, rounding, (centres - clipped) ** 2)
        noise = float(np.sum(stats.counts * error))
        signal = float(np.sum(stats.counts * centres**2))
        sqnr = sqnr_db(signal, noise)
        producer = value.producer()
        node = (producer.name or producer.op_type) if producer is not None else "(input)"
        return node, value.name or "", round(sqnr, 2)

    def _pair(self, value: ir.Value) -> None:
        if id(value) not in self._paired:
            self._paired.add(id(value))
            self.pairs.append(value)

    # -- node kinds -----------------------------------------------------------------------

    def _quantize(self, node: ir.Node, tail: ir.Node | None) -> bool:
        op = node.op_type
        out = (tail or node).outputs[0]
        if op in HMX:
            return self._hmx(node, out)
        if op in BINARY:
            return self._elementwise(node, out, list(node.inputs))
        if op in POOL:
            return self._elementwise(node, out, [node.inputs[0]])
        if op in MOVE_OPS:
            return self._move(node)
        opdef = REGISTRY.lookup(op, node.domain, self.opset)
        if opdef is not None and opdef.elementwise and op not in NOT_LUT:
            extras = node.inputs[1:]
            if all(v is None or (_const(v) is not None and _const(v).size == 1) for v in extras):  # type: ignore[union-attr]
                return self._elementwise(node, out, [node.inputs[0]])
        return False

    def _covered(self, node: ir.Node, values: Iterable[ir.Value | None]) -> bool:
        if all(self._activation(v) is not None for v in values):
            return True
        self.uncovered.append(node.name or node.op_type)
        return False

    def _elementwise(self, node: ir.Node, out: ir.Value, inputs: list[ir.Value | None]) -> bool:
        activations = [v for v in inputs if v is not None and v.const_value is None]
        constants = [v for v in inputs if v is not None and v.const_value is not None]
        if not activations or not self._covered(node, [*activations, out]):
            return False
        for value in constants:
            array = _const(value)
            if array is None or array.dtype.kind != "f":
                return False
        for index, given in enumerate(node.inputs):
            if given is not None and given.const_value is not None and given in constants:
                node.replace_input_with(index, self._constant(given, None))
        for value in (*activations, out):
            self._pair(value)
        return True

    def _move(self, node: ir.Node) -> bool:
        out = node.outputs[0]
        data = list(node.inputs) if node.op_type == "Concat" else [node.inputs[0]]
        if any(v is None or v.const_value is not None for v in data):
            return False
        if node.op_type == "Concat":
            if not self._covered(node, [*data, out]):
                return False
        else:
            source = self._activation(data[0])
            if source is None:
                self.uncovered.append(node.name or node.op_type)
                return False
            self.params[id(out)] = source
        for value in (*data, out):
            assert value is not None
            self._pair(value)
        return True

    def _hmx(self, node: ir.Node, out: ir.Value) -> bool:
        x, w = node.inputs[0], node.inputs[1]
        if x is None or w is None or x.const_value is not None:
            return False
        op = node.op_type
        if op == "Gemm":
            if "transA" in node.attributes and node.attributes["transA"].as_int():
                return False
        if w.const_value is None:
            if op != "MatMul":
                return False
            if not self._covered(node, [x, w, out]):
                return False
            for value in (x, w, out):
                self._pair(value)
            return True
        weights = _const(w)
        if weights is None or weights.dtype != np.float32:
            return False
        if not self._covered(node, [x, out]):
            return False
        if op == "Conv":
            axis: int | None = 0 if self.settings.channelwise else None
        elif op == "Gemm":
            trans_b = "transB" in node.attributes and node.attributes["transB"].as_int()
            axis = (0 if trans_b else 1) if self.settings.rowwise else None
        else:
            axis = weights.ndim - 1 if self.settings.rowwise and weights.ndim >= 2 else None
        x_params = self._activation(x)
        assert x_params is not None
        holder, index = node, 2
        if self._bias_add is not None:
            add, vector = self._bias_add
            holder, index = add, 1 - next(u.idx for u in node.outputs[0].uses())
        bias = holder.inputs[index] if len(holder.inputs) > index else None
        b = _const(bias) if bias is not None else None
        if bias is not None and (b is None or b.dtype != np.float32):
            return False
        w_dq, w_scale = self._weights(w, weights, axis)
        node.replace_input_with(1, w_dq)
        if bias is not None and b is not None:
            holder.replace_input_with(index, self._bias(bias, b, x_params, w_scale, node))
        self._pair(x)
        self._pair(out)
        return True

    # -- constants ------------------------------------------------------------------------

    def _weights(
        self, value: ir.Value, weights: np.ndarray, axis: int | None
    ) -> tuple[ir.Value, np.ndarray]:
        """A weight as DequantizeLinear of its integer form, and its scale per channel."""
        schema = self.settings.schema_constants
        if axis is None:
            p = params_for_range(
                float(weights.min()), float(weights.max()), schema, self.settings.precision
            )
            scale, zero = p.scale.reshape(()), p.zero.reshape(())
            codes = _quantize(weights, scale, zero, p.dtype)
            return self._dequantize(value, codes, scale, zero.astype(p.dtype), None), scale
        moved = np.moveaxis(weights, axis, 0).reshape(weights.shape[axis], -1)
        lo, hi = moved.min(axis=1), moved.max(axis=1)
        unsigned = schema == "asymmetric" or (
            schema == "symmetric_with_uint8" and weights.min() >= 0
        )
        found = [
            params_for_range(float(a), float(b), schema, self.settings.precision)
            for a, b in zip(lo, hi, strict=True)
        ]
        dtype = _types(self.settings.precision)[1 if unsigned else 0]
        if any(p.dtype != dtype for p in found):  # one type for every channel
            found = [
                params_for_range(float(min(a, 0)), float(b), "symmetric", self.settings.precision)
                for a, b in zip(lo, hi, strict=True)
            ]
            dtype = found[0].dtype
        scale = np.array([p.scale for p in found], np.float32)
        zero = np.array([p.zero for p in found], np.int64)
        shape = [1] * weights.ndim
        shape[axis] = -1
        codes = _quantize(weights, scale.reshape(shape), zero.reshape(shape), dtype)
        return self._dequantize(value, codes, scale, zero.astype(dtype), axis), scale

    def _bias(
        self, value: ir.Value, bias: np.ndarray, x: Params, w_scale: np.ndarray, node: ir.Node
    ) -> ir.Value:
        if self.settings.bias == "Int32":
            acc = (np.float32(x.scale) * w_scale).astype(np.float32)
            channels = bias.reshape(-1).size
            acc = np.broadcast_to(acc.reshape(-1), (channels,)).copy()
            wide = np.rint(bias.reshape(-1).astype(np.float64) / acc)
            codes = np.clip(wide, -(2**31), 2**31 - 1).astype(np.int32).reshape(bias.shape)
            axis = codes.ndim - 1 if channels > 1 else None
            scale = acc if axis is not None else acc.reshape(())
            zero = np.zeros(scale.shape, np.int32)
            return self._dequantize(value, codes, scale, zero, axis)
        top = float(np.abs(bias).max()) or 1.0
        scale = np.array(top / 127.0, np.float32)
        codes = _quantize(bias, scale, np.array(0), "int8")
        return self._dequantize(value, codes, scale, np.array(0, np.int8), None)

    def _constant(self, value: ir.Value, axis: int | None) -> ir.Value:
        array = _const(value)
        assert array is not None
        p = params_for_range(
            float(array.min()),
            float(array.max()),
            self.settings.schema_constants,
            self.settings.precision,
        )
        codes = _quantize(array, p.scale, p.zero, p.dtype)
        return self._dequantize(
            value, codes, p.scale.reshape(()), p.zero.astype(p.dtype).reshape(()), axis
        )

    def _dequantize(
        self,
        value: ir.Value,
        codes: np.ndarray,
        scale: np.ndarray,
        zero: np.ndarray,
        axis: int | None,
    ) -> ir.Value:
        base = value.name or "const"
        q = add_initializer(self.graph, codes, self.names.fresh(f"{base}_quantized"))
        s = add_initializer(
            self.graph, np.asarray(scale, np.float32), self.names.fresh(f"{base}_scale")
        )
        z = add_initializer(self.graph, np.asarray(zero), self.names.fresh(f"{base}_zero"))
        out = ir.Value(name=self.names.fresh(f"{base}_dq"), type=value.type, shape=value.shape)
        attrs = [ir.AttrInt64("axis", axis)] if axis is not None else []
        node = ir.Node("", "DequantizeLinear", [q, s, z], attrs, outputs=[out], name=f"{base}/dq")
        first = next(iter(self.graph), None)
        if first is None:
            self.graph.append(node)
        else:
            self.graph.insert_before(first, node)
        return out

    # -- pairs ----------------------------------------------------------------------------

    def _insert_pair(self, value: ir.Value) -> None:
        """value -> Q -> DQ, every reader (graph outputs included) reading the DQ."""
        p = self.params[id(value)]
        base = value.name or "t"
        dq_out = ir.Value(name=None, type=value.type, shape=value.shape)
        was_output = value.is_graph_output()
        value.replace_all_uses_with(dq_out, replace_graph_outputs=True)
        if was_output:
            dq_out.name = base
            value.name = self.names.fresh(f"{base}_float")
        else:
            dq_out.name = self.names.fresh(f"{base}_dq")
        scale = add_initializer(self.graph, p.scale.reshape(()), self.names.fresh(f"{base}_scale"))
        zero = add_initializer(
            self.graph, p.zero.astype(p.dtype).reshape(()), self.names.fresh(f"{base}_zero")
        )
        q_out = ir.Value(
            name=self.names.fresh(f"{base}_q"),
            type=ir.TensorType(ir.DataType.from_numpy(np.dtype(p.dtype))),
            shape=value.shape,
        )
        q = ir.Node("", "QuantizeLinear", [value, scale, zero], outputs=[q_out], name=f"{base}/q")
        dq = ir.Node(
            "", "DequantizeLinear", [q_out, scale, zero], outputs=[dq_out], name=f"{base}/dq"
        )
        producer = value.producer()
        if producer is None:
            first = next(iter(self.graph))
            self.graph.insert_before(first, [q, dq])
        else:
            self.graph.insert_after(producer, [q, dq])


def _quantize(x: np.ndarray, scale: np.ndarray, zero: np.ndarray, dtype: str) -> np.ndarray:
    info = np.iinfo(np.dtype(dtype))
    y = np.rint(x.astype(np.float32) / scale.astype(np.float32)).astype(np.float64) + zero
    return np.clip(y, info.min, info.max).astype(dtype)


def sqnr_db(signal: float, noise: float) -> float:
    """Signal-to-quantization-noise ratio in dB: inf when the integer form is exact (no
    noise, an all-zero tensor among them), -inf when there is noise but no signal."""
    if noise <= 0.0:
        return math.inf
    if signal <= 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def format_sqnr(sqnr: float) -> str:
    """`31.2 dB`; `exact` for no noise; `no signal` for noise on an all-zero tensor."""
    if sqnr == math.inf:
        return "exact"
    if sqnr == -math.inf:
        return "no signal (all zero), only noise"
    return f"{sqnr:g} dB"
