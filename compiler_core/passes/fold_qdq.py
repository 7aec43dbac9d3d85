"""Fold QDQ groups into int8 kernels: DequantizeLinear -> float op -> QuantizeLinear becomes
one integer kernel (compiler_core/ops/int8.py) reading and writing the integer tensors.

A QDQ model (ONNX Runtime's `quantize_static`, a torch export, or our own profile-driven
quantization) says each tensor's integer form with a Q/DQ pair; run as written, every op would
still compute in float between a dequantize and a quantize. This pass keeps the integers:

- Conv, MatMul, Gemm -> QConv / QMatMul (weights int8 per tensor or per channel, bias int32,
  or int8 with its own scale, alpha folded into the requantization);
- Add, Sub, Mul -> QAdd / QMul; GlobalAveragePool -> QAvgPool; AveragePool -> QAveragePool;
- unary elementwise ops (Relu, Clip, Sigmoid, LeakyRelu, HardSwish, ...) -> QLut, or, for a
  Relu/Clip on a tensor with its producer's scale, a narrower saturation of that producer;
- data movement and max pooling (Reshape, Transpose, Concat, MaxPool, ...) run on the
  integers themselves (a QLut requantizes where input and output scales differ);
- Q(DQ(x)) with equal parameters is x.

A group folds only when every float input is a DequantizeLinear (per-tensor for activations)
and every use of the output is a QuantizeLinear with one set of per-tensor parameters; any
other node stays float between its Q/DQ nodes. A DequantizeLinear of a constant left over
becomes a float constant. `keep_float` names op types that are never folded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from compiler_core.fusion import FUSED_NODES_KEY, fused_node_names
from compiler_core.nodeinfo import node_info
from compiler_core.ops.registry import QPCFARM_DOMAIN as DOMAIN
from compiler_core.ops.registry import REGISTRY, NodeInfo, TileCtx
from compiler_core.passes.base import (
    GraphPass,
    NameScope,
    add_initializer,
    model_opset,
    replace_value,
    static_dims,
)

log = logging.getLogger(__name__)

MOVE_OPS = frozenset(
    {
        "Reshape",
        "Flatten",
        "Squeeze",
        "Unsqueeze",
        "Transpose",
        "Identity",
        "Slice",
        "Gather",
        "Concat",
        "MaxPool",
        "GlobalMaxPool",
        "SpaceToDepth",
        "DepthToSpace",
        "Expand",
        "Tile",
    }
)
"""Ops whose output codes are input codes (moved, not computed): they run on the integers."""

NOT_LUT = frozenset({"Cast", "CastLike", "IsNaN", "IsInf", "Not", "Sign", "Dropout"})


@dataclass(frozen=True)
class QParams:
    """One tensor's integer form: its integer value and how its codes map to reals."""

    value: ir.Value
    scale: np.ndarray
    zero: np.ndarray
    axis: int
    dtype: str

    @property
    def per_tensor(self) -> bool:
        return self.scale.size == 1

    @property
    def s(self) -> np.float32:
        return np.float32(self.scale.reshape(-1)[0])

    @property
    def z(self) -> int:
        return int(self.zero.reshape(-1)[0])

    def same(self, other: QParams) -> bool:
        return (
            self.per_tensor
            and other.per_tensor
            and self.dtype == other.dtype
            and self.s == other.s
            and self.z == other.z
        )


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None:
        return None
    return np.asarray(value.const_value.numpy())


def _params(node: ir.Node, value: ir.Value) -> QParams | None:
    """The parameters of a Q or DQ node; `value` is its integer side."""
    scale = _const(node.inputs[1] if len(node.inputs) > 1 else None)
    if scale is None or value.dtype is None or scale.dtype.kind != "f":
        return None
    if "block_size" in node.attributes and node.attributes["block_size"].as_int() > 0:
        return None
    zp = node.inputs[2] if len(node.inputs) > 2 else None
    zero = _const(zp) if zp is not None else np.zeros(scale.shape, np.int64)
    if zero is None:
        return None
    dtype = value.dtype.numpy().name
    if dtype not in ("int8", "uint8", "int16", "uint16", "int32"):
        return None
    axis_attr = node.attributes.get("axis")
    axis = axis_attr.as_int() if axis_attr is not None else 1
    return QParams(value, scale.astype(np.float32), zero.astype(np.int64), axis, dtype)


def dequantized(value: ir.Value | None, *, int32: bool = False) -> QParams | None:
    """The integer form behind a float value produced by a DequantizeLinear (int32 only
    where asked: a bias)."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
        return None
    source = node.inputs[0]
    if source is None:
        return None
    found = _params(node, source)
    if found is None or (found.dtype == "int32" and not int32):
        return None
    return found


def _quantizers(value: ir.Value) -> list[ir.Node] | None:
    """Every use of `value`, if all are QuantizeLinear nodes reading it as their input 0."""
    if value.is_graph_output():
        return None
    uses = list(value.uses())
    nodes = []
    for use in uses:
        node = use.node
        if node.op_type != "QuantizeLinear" or use.idx != 0 or node.domain not in ("", "ai.onnx"):
            return None
        nodes.append(node)
    return nodes or None


def quantized(value: ir.Value) -> tuple[QParams, list[ir.Node]] | None:
    """The one per-tensor integer form every use of `value` quantizes it to."""
    nodes = _quantizers(value)
    if nodes is None:
        return None
    found = [_params(n, n.outputs[0]) for n in nodes]
    first = found[0]
    if first is None or not first.per_tensor:
        return None
    if not all(p is not None and p.same(first) for p in found):
        return None
    return first, nodes


def _quantize(x: np.ndarray, scale: np.float32, zero: int, dtype: str) -> np.ndarray:
    info = np.iinfo(np.dtype(dtype))
    y = np.rint(x.astype(np.float32) / scale).astype(np.float64) + zero
    return np.clip(y, info.min, info.max).astype(dtype)


def _attr_ints(**values: int) -> list[ir.Attr]:
    return [ir.AttrInt64(name, int(v)) for name, v in values.items()]


class FoldQDQPass(GraphPass):
    name = "fold-qdq"

    def __init__(self, keep_float: Iterable[str] = ()) -> None:
        super().__init__()
        self.keep_float = frozenset(keep_float)
        self.folded: dict[str, list[str]] = {}
        """Kernel op type -> names of the nodes folded into it (for reports)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self.graph = graph
        self.names = NameScope(graph)
        self.opset = model_opset(model)
        self.folded = {}
        self._tail: tuple[ir.Node, float, float] | None = None
        self._absorbed: list[ir.Node] = []
        self._bias_value: ir.Value | None = None
        changed = False
        for node in list(graph):
            if node.graph is None or node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type in self.keep_float:
                continue
            if self._fold(node):
                changed = True
        changed |= self._drop_dead()
        changed |= self._fold_constant_dequantize()
        if any(n.domain == DOMAIN for n in graph):
            model.opset_imports.setdefault(DOMAIN, 1)
        log.info("fold-qdq: %s", {k: len(v) for k, v in self.folded.items()})
        return ir.passes.PassResult(model, modified=changed)

    # -- dispatch -------------------------------------------------------------------------

    def _fold(self, node: ir.Node) -> bool:
        op = node.op_type
        if op == "QuantizeLinear":
            return self._requantize_pair(node)
        if len(node.outputs) != 1 or op == "DequantizeLinear":
            return False
        if op == "MatMul":
            found = bias_add(node)
            if found is not None and self._fold_with_bias(node, *found):
                return True
        if op in ("Conv", "MatMul", "Gemm", "Add", "Sub"):
            tail = _activation_tail(node)
            if tail is not None and self._fold_with_tail(node, *tail):
                return True
        out = quantized(node.outputs[0])
        if out is None:
            return False
        return self._fold_to(node, *out)

    def _fold_to(self, node: ir.Node, out: QParams, quantizers: list[ir.Node]) -> bool:
        op = node.op_type
        if op == "Conv":
            return self._conv(node, out, quantizers)
        if op in ("MatMul", "Gemm"):
            return self._matmul(node, out, quantizers)
        if op in ("Add", "Sub", "Mul"):
            return self._binary(node, out, quantizers)
        if op in ("GlobalAveragePool", "ReduceMean"):
            return self._avgpool(node, out, quantizers)
        if op == "AveragePool":
            return self._windowed_avgpool(node, out, quantizers)
        return self._fold_other(node, out, quantizers)

    def _fold_with_tail(self, node: ir.Node, tail: ir.Node, lo: float, hi: float) -> bool:
        """Conv -> Relu/Clip -> Q (a float activation between the op and its quantizer, as
        torch exports it): the activation becomes the kernel's saturation range."""
        out = quantized(tail.outputs[0])
        if out is None:
            return False
        params, quantizers = out
        self._tail = (tail, lo, hi)
        try:
            return self._fold_to(node, params, quantizers)
        finally:
            self._tail = None

    def _fold_with_bias(self, node: ir.Node, add: ir.Node, bias: ir.Value) -> bool:
        """MatMul -> Add(constant [N]) [-> Relu/Clip] -> Q: the constant is the kernel's
        bias, added in the accumulator (one rounding instead of two, no extra pass)."""
        tail = _activation_tail(add)
        last = tail[0] if tail is not None else add
        out = quantized(last.outputs[0])
        if out is None:
            return False
        params, quantizers = out
        self._tail = tail
        self._absorbed = [add]
        self._bias_value = bias
        try:
            return self._matmul(node, params, quantizers)
        finally:
            self._tail, self._absorbed, self._bias_value = None, [], None

    def _fold_other(self, node: ir.Node, out: QParams, quantizers: list[ir.Node]) -> bool:
        op = node.op_type
        if op in MOVE_OPS:
            return self._move(node, out, quantizers)
        opdef = REGISTRY.lookup(op, node.domain, self.opset)
        if opdef is not None and opdef.elementwise and op not in NOT_LUT:
            return self._lut(node, out, quantizers)
        return False

    def _replace(
        self,
        node: ir.Node,
        op_type: str,
        inputs: list[ir.Value | None],
        attrs: list[ir.Attr],
        out: QParams,
        quantizers: list[ir.Node],
    ) -> ir.Value:
        """Put the integer kernel in place of `node` and its QuantizeLinear nodes."""
        first = quantizers[0].outputs[0]
        result = ir.Value(name=None, type=first.type, shape=first.shape)
        tail = self._tail
        if tail is not None:
            codes = _quantize(np.array([tail[1], tail[2]]), out.s, out.z, out.dtype)
            attrs = [*attrs, *_attr_ints(y_min=int(codes[0]), y_max=int(codes[1]))]
        new = ir.Node(
            DOMAIN, op_type, inputs, attrs, outputs=[result], name=node.name or node.op_type
        )
        self.graph.insert_before(node, new)
        name = first.name
        for q in quantizers:
            q_out = q.outputs[0]
            was_output = q_out.is_graph_output()
            q_out.replace_all_uses_with(result, replace_graph_outputs=True)
            if was_output:
                name = q_out.name
            q_out.name = None
        result.name = name
        for q in quantizers:
            self.graph.remove(q, safe=True)
        chain = [*self._absorbed, *([tail[0]] if tail is not None else [])]
        if chain:
            names = [*fused_node_names(node)]
            for extra in chain:
                names += fused_node_names(extra)
                self.folded.setdefault(op_type, []).append(extra.name or extra.op_type)
            new.meta[FUSED_NODES_KEY] = names
        for extra in reversed(chain):
            self.graph.remove(extra, safe=True)
        self.graph.remove(node, safe=True)
        self.folded.setdefault(op_type, []).append(node.name or node.op_type)
        return result

    def _const_value(self, array: np.ndarray, hint: str) -> ir.Value:
        return add_initializer(self.graph, np.ascontiguousarray(array), self.names.fresh(hint))

    # -- HMX ops --------------------------------------------------------------------------

    def _weights(self, value: ir.Value | None, channels: int, axis: int) -> QParams | None:
        """A constant weight's integer form, per tensor or per channel along `axis`."""
        w = dequantized(value)
        if w is None or w.value.const_value is None:
            return None
        if not w.per_tensor:
            rank = len(w.value.shape) if w.value.shape is not None else 0
            if (w.axis + rank if w.axis < 0 else w.axis) != axis or w.scale.size != channels:
                return None
        return w

    def _bias(
        self,
        value: ir.Value | None,
        acc_scale: np.ndarray,
        scale_factor: float = 1.0,
    ) -> tuple[ir.Value | None, ir.Value | None] | None:
        """The bias as the accumulator adds it: int32 at the accumulator's scale, or int8 with
        the (mantissa, shift) table that rescales it; (None, None) without a bias."""
        if value is None:
            return None, None
        channels = acc_scale.size
        dims = static_dims(value)
        if dims is None or int(np.prod(dims, dtype=np.int64)) not in (1, channels):
            return None
        q = dequantized(value, int32=True)
        if q is not None and q.value.const_value is not None:
            codes = np.asarray(q.value.const_value.numpy()).astype(np.int64).reshape(-1)
            codes = np.broadcast_to(codes, (channels,))
            scale = np.broadcast_to(q.scale.reshape(-1), (channels,)).astype(np.float32)
            zero = np.broadcast_to(q.zero.reshape(-1), (channels,))
            if q.dtype in ("int8", "uint8", "int16", "uint16") and scale_factor == 1.0:
                # an int8 (int16) bias keeps its bytes; the kernel rescales it exactly
                centred = (codes - zero).astype(np.dtype(q.dtype.replace("uint", "int")))
                from compiler_core.ops.int8 import requant_table  # only when QDQ folds

                table = requant_table(scale / acc_scale)
                return (
                    self._const_value(centred, f"{value.name or 'bias'}_q"),
                    self._const_value(table, f"{value.name or 'bias'}_rq"),
                )
            real = (codes - zero).astype(np.float64) * scale.astype(np.float64)
            if (
                q.value.dtype is not None
                and q.value.dtype.numpy() == np.int32
                and scale_factor == 1.0
                and np.all(zero == 0)
                and np.allclose(scale, acc_scale, rtol=1e-6, atol=0)
            ):
                return self._const_value(codes.astype(np.int32), f"{value.name}_i32"), None
        else:
            array = _const(value)
            if array is None or array.dtype.kind != "f":
                return None
            real = np.broadcast_to(array.astype(np.float64).reshape(-1), (channels,))
        real = real * scale_factor
        acc = np.rint(real / acc_scale.astype(np.float64))
        if np.any(np.abs(acc) >= 2**31):
            return None
        return self._const_value(acc.astype(np.int32), f"{value.name or 'bias'}_i32"), None

    def _hmx(
        self,
        node: ir.Node,
        op_type: str,
        x: QParams,
        w_value: ir.Value,
        w: QParams,
        channels: int,
        bias: tuple[ir.Value | None, ir.Value | None],
        multiplier: np.ndarray,
        attrs: list[ir.Attr],
        out: QParams,
        quantizers: list[ir.Node],
    ) -> bool:
        zeros = np.broadcast_to(w.zero.reshape(-1), (channels,))
        w_zero = None
        if np.any(zeros != 0):
            dtype = w.dtype if w.per_tensor else w.dtype
            w_zero = self._const_value(zeros.astype(dtype), f"{node.name}_wzero")
        from compiler_core.ops.int8 import requant_table  # only when QDQ folds

        rq = self._const_value(requant_table(multiplier), f"{node.name}_rq")
        inputs = [x.value, w_value, bias[0], w_zero, rq, bias[1]]
        while inputs and inputs[-1] is None:
            inputs.pop()
        attrs = [*attrs, *_attr_ints(x_zero=x.z, y_zero=out.z)]
        self._replace(node, op_type, inputs, attrs, out, quantizers)
        return True

    def _conv(self, node: ir.Node, out: QParams, quantizers: list[ir.Node]) -> bool:
        x = dequantized(node.inputs[0])
        w_shape = static_dims(node.inputs[1])
        if x is None or not x.per_tensor or w_shape is None:
            return False
        channels = int(w_shape[0])
        w = self._weights(node.inputs[1], channels, 0)
        if w is None:
            return False
        sw = np.broadcast_to(w.scale.reshape(-1), (channels,)).astype(np.float32)
        acc_scale = (x.s * sw).astype(np.float32)
        bias = self._bias(node.inputs[2] if len(node.inputs) > 2 else None, acc_scale)
        if bias is None:
            return False
        multiplier = (acc_scale / out.s).astype(np.float32)
        attrs = [a for a in node.attributes.values()]
        return self._hmx(
            node, "QConv", x, w.value, w, channels, bias, multiplier, attrs, out, quantizers
        )

    def _matmul(self, node: ir.Node, out: QParams, quantizers: list[ir.Node]) -> bool:
        a = dequantized(node.inputs[0])
        if a is None or not a.per_tensor or node.inputs[1] is None:
            return False
        b_value = node.inputs[1]
        gemm = node.op_type == "Gemm"
        alpha = beta = 1.0
        bias_value = self._bias_value
        if gemm:
            attrs = {k: v.value for k, v in node.attributes.items()}
            if int(attrs.get("transA", 0)):
                return False
            alpha = float(attrs.get("alpha", 1.0))
            beta = float(attrs.get("beta", 1.0))
            bias_value = node.inputs[2] if len(node.inputs) > 2 else None
        b = dequantized(b_value)
        if b is None or b.value.shape is None or len(b.value.shape) < 1:
            return False
        if bias_value is not None and not gemm and b.value.const_value is None:
            return False
        b_int = b.value
        trans_b = gemm and int(
            node.attributes["transB"].as_int() if "transB" in node.attributes else 0
        )
        shape = tuple(int(d) for d in b.value.shape)  # type: ignore[arg-type]
        if b.value.const_value is None:
            if not b.per_tensor or trans_b or gemm:
                return False
            channels = 1
        else:
            channels = shape[0] if trans_b else shape[-1]
            axis = 0 if trans_b else len(shape) - 1
            if self._weights(b_value, channels, axis) is None:
                return False
            if trans_b:
                codes = np.asarray(b.value.const_value.numpy()).T
                b_int = self._const_value(codes, f"{b.value.name}_t")
        sb = np.broadcast_to(b.scale.reshape(-1), (channels,)).astype(np.float32)
        acc_scale = (a.s * sb).astype(np.float32)
        if bias_value is not None and beta != 0.0:
            bias = self._bias(bias_value, acc_scale, beta / alpha if alpha else 1.0)
            if bias is None:
                return False
        else:
            bias = (None, None)
        multiplier = (acc_scale * np.float32(alpha) / out.s).astype(np.float32)
        return self._hmx(
            node, "QMatMul", a, b_int, b, channels, bias, multiplier, [], out, quantizers
        )

    # -- elementwise and pooling ----------------------------------------------------------

    def _binary(self, node: ir.Node, out: QParams, quantizers: list[ir.Node]) -> bool:
        if len(node.inputs) != 2:
            return False
        a, b = dequantized(node.inputs[0]), dequantized(node.inputs[1])
        if a is None or b is None or not (a.per_tensor and b.per_tensor):
            return False
        attrs = _attr_ints(a_zero=a.z, b_zero=b.z, y_zero=out.z)
        if node.op_type == "Mul":
            mant, shift = _fixed(np.float32(a.s * b.s) / out.s)
            attrs += _attr_ints(mult=mant, shift=shift)
            op = "QMul"
        else:
            ma, sa = _fixed(a.s / out.s)
            mb, sb = _fixed(b.s / out.s)
            ma, mb, shift = _common_shift(ma, sa, mb, sb)
            if node.op_type == "Sub":
                mb = -mb
            attrs += _attr_ints(a_mult=ma, b_mult=mb, shift=shift)
            op = "QAdd"
        self._replace(node, op, [a.value, b.value], attrs, out, quantizers)
        return True

    def _avgpool(self, node: ir.Node, out: QParams, quantizers: list[ir.Node]) -> bool:
        x = dequantized(node.inputs[0])
        shape = static_dims(x.value) if x is not None else None
        if x is None or not x.per_tensor or shape is None:
            return False
        if node.op_type == "ReduceMean" and not _spatial_mean(node, len(shape)):
            return False
        count = int(np.prod(shape[2:], dtype=np.int64))
        mant, shift = _fixed(np.float64(x.s) / (np.float64(out.s) * count))
        attrs = _attr_ints(x_zero=x.z, y_zero=out.z, mult=mant, shift=shift)
        self._replace(node, "QAvgPool", [x.value], attrs, out, quantizers)
        return True

    def _windowed_avgpool(self, node: ir.Node, out: QParams, quantizers: list[ir.Node]) -> bool:
        """AveragePool -> QAveragePool: AveragePool's own attributes plus the s_x / s_y
        multiplier; the kernel divides each window by its own count (pads, ceil_mode)."""
        x = dequantized(node.inputs[0])
        if x is None or not x.per_tensor or static_dims(x.value) is None:
            return False
        if "kernel_shape" not in node.attributes:
            return False
        mant, shift = _fixed(x.s / out.s)
        extra = _attr_ints(x_zero=x.z, y_zero=out.z, mult=mant, shift=shift)
        attrs = [*node.attributes.values(), *extra]
        self._replace(node, "QAveragePool", [x.value], attrs, out, quantizers)
        return True

    def _lut(self, node: ir.Node, out: QParams, quantizers: list[ir.Node]) -> bool:
        x = dequantized(node.inputs[0])
        if x is None or not x.per_tensor:
            return False
        extras = []
        for value in node.inputs[1:]:
            array = _const(value) if value is not None else None
            if value is not None and (array is None or array.size != 1):
                return False
            extras.append(array)
        if node.op_type in ("Relu", "Clip") and self._narrow_producer(node, x, extras, out):
            self._route(quantizers, x.value)
            self.graph.remove(node, safe=True)
            return True
        table = self._table(node, x, extras, out)
        if table is None:
            return False
        table_value = self._const_value(table, f"{node.name}_table")
        self._replace(node, "QLut", [x.value, table_value], [], out, quantizers)
        return True

    def _table(
        self, node: ir.Node, x: QParams, extras: list[np.ndarray | None], out: QParams
    ) -> np.ndarray | None:
        """The op over every code of x, quantized to the output's parameters."""
        info = np.iinfo(np.dtype(x.dtype))
        codes = np.arange(int(info.min), int(info.max) + 1, dtype=np.int64)
        real = ((codes - x.z).astype(np.float32) * x.s).astype(np.float32)
        opdef = REGISTRY.lookup(node.op_type, node.domain, self.opset)
        if opdef is None:
            return None
        base = node_info(node, self.opset, with_consts=False)
        n = (len(codes),)
        float_info = NodeInfo(
            op_type=base.op_type,
            name=base.name,
            attrs=base.attrs,
            in_shapes=(n, *(None if e is None else e.shape for e in extras)),
            in_dtypes=("float32", *(None if e is None else "float32" for e in extras)),
            out_shapes=(n,),
            out_dtypes=("float32",),
            opset=base.opset,
            domain=base.domain,
        )
        args: list[np.ndarray | None] = [real]
        args += [None if e is None else e.astype(np.float32) for e in extras]
        try:
            (y,) = opdef.compute(float_info, args, TileCtx.whole(float_info))[:1]
        except Exception:  # an op whose kernel needs more than a vector: left float
            log.debug("fold-qdq: no table for %s", node.name, exc_info=True)
            return None
        return _quantize(np.asarray(y), out.s, out.z, out.dtype)

    def _narrow_producer(
        self, node: ir.Node, x: QParams, extras: list[np.ndarray | None], out: QParams
    ) -> bool:
        """A Relu/Clip on the output of our own kernel, at that kernel's scale: the kernel
        saturates to the narrower range instead (no extra pass over the tensor)."""
        producer = x.value.producer()
        if producer is None or producer.domain != DOMAIN or producer.op_type == "QLut":
            return False
        if not x.same(out) or len(x.value.uses()) != 1:
            return False
        dq = node.inputs[0].producer() if node.inputs[0] is not None else None
        if dq is None or len(dq.outputs[0].uses()) != 1:
            return False
        info = np.iinfo(np.dtype(out.dtype))
        lo, hi = 0.0, float("inf")
        if node.op_type == "Clip":
            lo = float(extras[0]) if len(extras) > 0 and extras[0] is not None else -np.inf
            hi = float(extras[1]) if len(extras) > 1 and extras[1] is not None else np.inf
        code_lo = (
            int(info.min)
            if lo == -np.inf
            else int(_quantize(np.array([lo]), out.s, out.z, out.dtype)[0])
        )
        code_hi = (
            int(info.max)
            if hi == np.inf
            else int(_quantize(np.array([hi]), out.s, out.z, out.dtype)[0])
        )
        attrs = producer.attributes
        old_lo = attrs["y_min"].as_int() if "y_min" in attrs else int(info.min)
        old_hi = attrs["y_max"].as_int() if "y_max" in attrs else int(info.max)
        producer.meta[FUSED_NODES_KEY] = [*fused_node_names(producer), *fused_node_names(node)]
        attrs["y_min"] = ir.AttrInt64("y_min", max(old_lo, code_lo))
        attrs["y_max"] = ir.AttrInt64("y_max", min(old_hi, code_hi))
        self.folded.setdefault(producer.op_type, []).append(node.name or node.op_type)
        return True

    def _route(self, quantizers: list[ir.Node], value: ir.Value) -> None:
        """Every quantizer's readers read `value` instead; the quantizers go."""
        for q in quantizers:
            replace_value(q.outputs[0], value)
            self.graph.remove(q, safe=True)

    def _move(self, node: ir.Node, out: QParams, quantizers: list[ir.Node]) -> bool:
        data = [0] if node.op_type != "Concat" else list(range(len(node.inputs)))
        sources = [dequantized(node.inputs[i]) for i in data]
        if any(s is None or not s.per_tensor for s in sources):
            return False
        opdef = REGISTRY.lookup(node.op_type, node.domain, self.opset)
        if opdef is None or out.dtype not in opdef.dtypes:
            return False
        inputs = list(node.inputs)
        for index, source in zip(data, sources, strict=True):
            assert source is not None
            if source.dtype != out.dtype:
                return False
            value = source.value
            if not source.same(out):
                value = self._requant_lut(node, source, out)
            inputs[index] = value
        attrs = list(node.attributes.values())
        first = quantizers[0].outputs[0]
        result = ir.Value(name=None, type=first.type, shape=first.shape)
        new = ir.Node(node.domain, node.op_type, inputs, attrs, outputs=[result], name=node.name)
        self.graph.insert_before(node, new)
        name = first.name
        for q in quantizers:
            q_out = q.outputs[0]
            if q_out.is_graph_output():
                name = q_out.name
            q_out.replace_all_uses_with(result, replace_graph_outputs=True)
            q_out.name = None
        result.name = name
        for q in quantizers:
            self.graph.remove(q, safe=True)
        self.graph.remove(node, safe=True)
        self.folded.setdefault(node.op_type, []).append(node.name or node.op_type)
        return True

    def _requant_lut(self, node: ir.Node, source: QParams, out: QParams) -> ir.Value:
        info = np.iinfo(np.dtype(source.dtype))
        codes = np.arange(int(info.min), int(info.max) + 1, dtype=np.int64)
        real = (codes - source.z).astype(np.float32) * source.s
        table = self._const_value(_quantize(real, out.s, out.z, out.dtype), f"{node.name}_rq")
        result = ir.Value(
            name=self.names.fresh(f"{source.value.name}_requant"),
            type=ir.TensorType(ir.DataType.from_numpy(np.dtype(out.dtype))),
            shape=source.value.shape,
        )
        lut = ir.Node(
            DOMAIN, "QLut", [source.value, table], outputs=[result], name=f"{node.name}/requant"
        )
        self.graph.insert_before(node, lut)
        return result

    def _requantize_pair(self, node: ir.Node) -> bool:
        """Q(DQ(x)) with the same parameters is x itself."""
        x = dequantized(node.inputs[0])
        out = _params(node, node.outputs[0])
        if x is None or out is None or not x.same(out) or node.outputs[0].is_graph_output():
            return False
        node.outputs[0].replace_all_uses_with(x.value)
        self.graph.remove(node, safe=True)
        return True

    # -- clean-up -------------------------------------------------------------------------

    def _drop_dead(self) -> bool:
        """Q/DQ nodes nothing reads any more."""
        removed = True
        changed = False
        while removed:
            removed = False
            for node in list(self.graph):
                if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
                    continue
                if any(v.uses() or v.is_graph_output() for v in node.outputs):
                    continue
                self.graph.remove(node, safe=True)
                removed = changed = True
        return changed

    def _fold_constant_dequantize(self) -> bool:
        """A DequantizeLinear of a constant that no integer kernel took becomes a float
        constant (computed by the registry's own kernel)."""
        changed = False
        for node in list(self.graph):
            if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx"):
                continue
            if any(v is not None and v.const_value is None for v in node.inputs):
                continue
            out = node.outputs[0]
            if out.is_graph_output():
                continue
            opdef = REGISTRY.lookup(node.op_type, node.domain, self.opset)
            assert opdef is not None
            info = node_info(node, self.opset)
            args = [None if v is None else _const(v) for v in node.inputs]
            (array,) = opdef.compute(info, args, TileCtx.whole(info))[:1]
            name = out.name or f"{node.name}_value"
            out.name = None
            const = add_initializer(self.graph, np.asarray(array), self.names.fresh(name))
            out.replace_all_uses_with(const)
            self.graph.remove(node, safe=True)
            changed = True
        return changed


def _spatial_mean(node: ir.Node, rank: int) -> bool:
    """A ReduceMean over every axis after the channels (a global average pool)."""
    if "axes" in node.attributes:
        axes = list(node.attributes["axes"].as_ints())
    else:
        given = node.inputs[1] if len(node.inputs) > 1 else None
        array = _const(given) if given is not None else None
        if array is None:
            return False
        axes = [int(a) for a in array.reshape(-1)]
    axes = sorted(a + rank if a < 0 else a for a in axes)
    return rank > 2 and axes == list(range(2, rank))


def bias_add(node: ir.Node) -> tuple[ir.Node, ir.Value] | None:
    """The Add that alone reads a MatMul's output with a constant (or dequantized constant)
    vector of one value per output column: (the Add, the vector)."""
    value = node.outputs[0]
    uses = list(value.uses())
    dims = static_dims(value)
    if value.is_graph_output() or len(uses) != 1 or dims is None or not dims:
        return None
    add = uses[0].node
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.inputs) != 2:
        return None
    other = add.inputs[1 - uses[0].idx]
    if other is None or static_dims(add.outputs[0]) != dims:
        return None
    source = dequantized(other, int32=True)
    constant = source.value.const_value if source is not None else other.const_value
    other_dims = static_dims(source.value if source is not None else other)
    if constant is None or other_dims is None:
        return None
    if int(np.prod(other_dims, dtype=np.int64)) != dims[-1] or (
        other_dims and other_dims[-1] != dims[-1]
    ):
        return None
    return add, other


def _activation_tail(node: ir.Node) -> tuple[ir.Node, float, float] | None:
    """The Relu or Clip (constant bounds) that alone reads `node`'s output, with its range."""
    value = node.outputs[0]
    uses = list(value.uses())
    if value.is_graph_output() or len(uses) != 1 or uses[0].idx != 0:
        return None
    tail = uses[0].node
    if tail.domain not in ("", "ai.onnx") or tail.op_type not in ("Relu", "Clip"):
        return None
    if tail.op_type == "Relu":
        return tail, 0.0, float("inf")
    bounds = []
    for index in (1, 2):
        given = tail.inputs[index] if len(tail.inputs) > index else None
        array = _const(given) if given is not None else None
        if given is not None and array is None:
            return None
        bounds.append(None if array is None else float(array.reshape(-1)[0]))
    lo = bounds[0] if bounds[0] is not None else float("-inf")
    hi = bounds[1] if bounds[1] is not None else float("inf")
    if "min" in tail.attributes:  # Clip-6
        lo = tail.attributes["min"].as_float()
    if "max" in tail.attributes:
        hi = tail.attributes["max"].as_float()
    return tail, lo, hi


def _fixed(multiplier: float | np.floating) -> tuple[int, int]:
    """One float32 multiplier as (mantissa, shift) ints."""
    from compiler_core.ops.int8 import fixed_point  # only when QDQ folds

    mant, shift = fixed_point(np.array(multiplier, dtype=np.float32))
    return int(mant), int(shift)


def _common_shift(ma: int, sa: int, mb: int, sb: int) -> tuple[int, int, int]:
    """Two fixed-point multipliers over one shift, within 22 bits of headroom."""
    shift = max(sa, sb)
    low = min(sa, sb)
    if shift - low > 22:
        shift = low + 22
    return _at(ma, sa, shift), _at(mb, sb, shift), shift


def _at(mant: int, shift: int, target: int) -> int:
    if target >= shift:
        return mant << (target - shift)
    drop = shift - target
    return (mant + (1 << (drop - 1))) >> drop
