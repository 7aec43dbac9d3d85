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
other node stays float between its Q/DQ nodes, and the pass records why in `refusals` (one
`FoldRefusal` per node beside Q/DQ nodes that did not fold, logged at debug level). A
DequantizeLinear of a constant left over becomes a float constant. `keep_float` names op types
that are never folded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

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
from compiler_core.passes.qdq_epilogue import Affine, Codes, fold_into_producer, note_fused

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

QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
"""The ops every fold starts from."""

NOT_LUT = frozenset({"Cast", "CastLike", "IsNaN", "IsInf", "Not", "Sign", "Dropout"})
REFUSALS_SHOWN = 4
"""Refused nodes whose reasons the warning spells out (all are named in its `nodes`)."""


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


@dataclass(frozen=True)
class FoldRefusal:
    """Why a node beside Q/DQ nodes stays float: one reason per way it was tried."""

    node: str
    op_type: str
    reasons: tuple[str, ...]


class _NoFold(Exception):
    """A matcher's check failed; the message says which (raised before any rewrite)."""


@dataclass(frozen=True)
class _Group:
    """What one integer kernel would replace: the op, the Relu/Clip whose range becomes its
    saturation (`tail`), the bias Add it absorbs, and the integer form of the group's output
    with the QuantizeLinear nodes that produce it."""

    node: ir.Node
    out: QParams
    quantizers: list[ir.Node]
    tail: tuple[ir.Node, float, float] | None = None
    absorbed: tuple[ir.Node, ...] = ()
    bias: ir.Value | None = None
    """A MatMul's bias taken from the Add that follows it."""

    @property
    def how(self) -> str:
        steps = [f"{n.op_type} {n.name}" for n in self.absorbed]
        if self.tail is not None:
            steps.append(f"{self.tail[0].op_type} {self.tail[0].name}")
        return "with " + " and ".join(steps) if steps else "alone"


class FoldQDQPass(GraphPass):
    name = "fold-qdq"

    def __init__(self, keep_float: Iterable[str] = ()) -> None:
        super().__init__()
        self.keep_float = frozenset(keep_float)
        self.folded: dict[str, list[str]] = {}
        """Kernel op type -> names of the nodes folded into it (for reports)."""
        self.refusals: list[FoldRefusal] = []
        """Nodes beside Q/DQ nodes that stay float, with why."""

    @property
    def warnings(self) -> list[dict[str, object]]:
        """The refusals as one perf warning (shown with -aic-perf-warnings): in a quantized
        model, a node left float is a float kernel between integer ones."""
        if not self.refusals:
            return []
        shown = [f"{r.node} ({r.op_type}): {' / '.join(r.reasons)}" for r in self.refusals]
        more = len(shown) - REFUSALS_SHOWN
        listed = "; ".join(shown[:REFUSALS_SHOWN]) + (f"; and {more} more" if more > 0 else "")
        return [
            {
                "code": "qdq_not_folded",
                "kind": "perf",
                "message": f"{len(shown)} node(s) between QuantizeLinear/DequantizeLinear "
                f"pairs stay float: {listed}",
                "nodes": [r.node for r in self.refusals],
            }
        ]

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        changed = False
        folded: dict[str, list[str]] = {}
        refusals: list[FoldRefusal] = []
        # Every fold starts from a QuantizeLinear or DequantizeLinear node (a group's input
        # or output, a Q(DQ) pair, a dead or constant one): a float model has none to try.
        if any(n.op_type in QDQ_OPS for n in model.graph):
            folder = _Folder(model.graph, model_opset(model))
            for node in list(model.graph):
                if node.graph is None or node.domain not in ("", "ai.onnx"):
                    continue
                if node.op_type in self.keep_float:
                    continue
                if folder.fold(node):
                    changed = True
            changed |= folder.drop_dead()
            changed |= folder.fold_constant_dequantize()
            folded, refusals = folder.folded, folder.refusals
        if any(n.domain == DOMAIN for n in model.graph):
            model.opset_imports.setdefault(DOMAIN, 1)
        self.folded, self.refusals = folded, refusals
        log.info(
            "fold-qdq: %s, refused %d",
            {k: len(v) for k, v in self.folded.items()},
            len(self.refusals),
        )
        return ir.passes.PassResult(model, modified=changed)


@dataclass
class _Folder:
    """One run of the pass over a graph: the rewrites and what they folded or refused."""

    graph: ir.Graph
    opset: int
    folded: dict[str, list[str]] = field(default_factory=dict)
    refusals: list[FoldRefusal] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.names = NameScope(self.graph)

    # -- dispatch -------------------------------------------------------------------------

    def fold(self, node: ir.Node) -> bool:
        op = node.op_type
        if op == "QuantizeLinear":
            return self._requantize_pair(node)
        if len(node.outputs) != 1 or op == "DequantizeLinear":
            return False
        reasons: list[str] = []
        if op in STEPS:
            why = self._step_into_producer(node)
            if why is None:
                return True
            if op == "BatchNormalization":
                reasons.append(f"into its producer's epilogue: {why}")
        groups = list(self._groups(node))
        for group in groups:
            if isinstance(group, str):
                reasons.append(group)
                continue
            try:
                self._fold_to(group)
                return True
            except _NoFold as why:
                reasons.append(f"{group.how}: {why}")
        if any(not isinstance(g, str) for g in groups) or any(
            dequantized(v, int32=True) is not None for v in node.inputs
        ):
            self._refuse(node, reasons)
        return False

    def _groups(self, node: ir.Node) -> Iterator[_Group | str]:
        """The groups `node` could head, the most absorbing first (a MatMul with its bias
        Add, an op with its Relu/Clip, the op alone), or why one has no integer output."""
        op = node.op_type
        found = bias_add(node) if op == "MatMul" else None
        if found is not None:
            add, bias = found
            tail = _activation_tail(add)
            yield _group(node, tail[0] if tail else add, tail=tail, absorbed=(add,), bias=bias)
        tail = _activation_tail(node) if op in ("Conv", "MatMul", "Gemm", "Add", "Sub") else None
        if tail is not None:
            yield _group(node, tail[0], tail=tail)
        yield _group(node, node)

    def _refuse(self, node: ir.Node, reasons: list[str]) -> None:
        refusal = FoldRefusal(node.name or node.op_type, node.op_type, tuple(reasons))
        self.refusals.append(refusal)
        log.debug("fold-qdq: %s stays float: %s", refusal.node, "; ".join(refusal.reasons))

    def _fold_to(self, g: _Group) -> None:
        op = g.node.op_type
        if g.bias is not None:  # a MatMul with its bias Add
            self._matmul(g)
        elif op == "Conv":
            self._conv(g)
        elif op in ("MatMul", "Gemm"):
            self._matmul(g)
        elif op in ("Add", "Sub", "Mul"):
            self._binary(g)
        elif op in ("GlobalAveragePool", "ReduceMean"):
            self._avgpool(g)
        elif op == "AveragePool":
            self._windowed_avgpool(g)
        else:
            self._fold_other(g)

    def _fold_other(self, g: _Group) -> None:
        op = g.node.op_type
        if op in MOVE_OPS:
            self._move(g)
            return
        opdef = REGISTRY.lookup(op, g.node.domain, self.opset)
        if opdef is None or not opdef.elementwise or op in NOT_LUT:
            raise _NoFold(f"no integer kernel for {op}")
        self._lut(g)

    def _replace(
        self, g: _Group, op_type: str, inputs: list[ir.Value | None], attrs: list[ir.Attr]
    ) -> ir.Value:
        """Put the integer kernel in place of the group's nodes and its QuantizeLinear nodes."""
        node, out, quantizers, tail = g.node, g.out, g.quantizers, g.tail
        first = quantizers[0].outputs[0]
        result = ir.Value(name=None, type=first.type, shape=first.shape)
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
        chain = [*g.absorbed, *([tail[0]] if tail is not None else [])]
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
    ) -> tuple[ir.Value | None, ir.Value | None]:
        """The bias as the accumulator adds it: int32 at the accumulator's scale, or int8 with
        the (mantissa, shift) table that rescales it; (None, None) without a bias."""
        if value is None:
            return None, None
        channels = acc_scale.size
        dims = static_dims(value)
        if dims is None or int(np.prod(dims, dtype=np.int64)) not in (1, channels):
            raise _NoFold(f"the bias has neither 1 nor {channels} (one per channel) values")
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
                raise _NoFold("the bias is neither a dequantized nor a float constant")
            real = np.broadcast_to(array.astype(np.float64).reshape(-1), (channels,))
        real = real * scale_factor
        acc = np.rint(real / acc_scale.astype(np.float64))
        if np.any(np.abs(acc) >= 2**31):
            raise _NoFold("the bias overflows int32 at the accumulator's scale")
        return self._const_value(acc.astype(np.int32), f"{value.name or 'bias'}_i32"), None

    def _hmx(
        self,
        op_type: str,
        x: QParams,
        w_value: ir.Value,
        w: QParams,
        channels: int,
        bias: tuple[ir.Value | None, ir.Value | None],
        multiplier: np.ndarray,
        attrs: list[ir.Attr],
        g: _Group,
    ) -> None:
        node, out = g.node, g.out
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
        self._replace(g, op_type, inputs, attrs)

    def _conv(self, g: _Group) -> None:
        node, out = g.node, g.out
        x = _activation(node.inputs[0], "the input")
        w_shape = static_dims(node.inputs[1])
        if w_shape is None:
            raise _NoFold("the weight's shape is not static")
        channels = int(w_shape[0])
        w = self._weights(node.inputs[1], channels, 0)
        if w is None:
            raise _NoFold(_WEIGHT_FORM)
        sw = np.broadcast_to(w.scale.reshape(-1), (channels,)).astype(np.float32)
        acc_scale = (x.s * sw).astype(np.float32)
        bias = self._bias(node.inputs[2] if len(node.inputs) > 2 else None, acc_scale)
        multiplier = (acc_scale / out.s).astype(np.float32)
        attrs = [a for a in node.attributes.values()]
        self._hmx("QConv", x, w.value, w, channels, bias, multiplier, attrs, g)

    def _matmul(self, g: _Group) -> None:
        node, out = g.node, g.out
        a = _activation(node.inputs[0], "input A")
        if node.inputs[1] is None:
            raise _NoFold("input B is missing")
        b_value = node.inputs[1]
        gemm = node.op_type == "Gemm"
        alpha = beta = 1.0
        bias_value = g.bias
        if gemm:
            attrs = {k: v.value for k, v in node.attributes.items()}
            if int(attrs.get("transA", 0)):
                raise _NoFold("Gemm transposes A (transA=1)")
            alpha = float(attrs.get("alpha", 1.0))
            beta = float(attrs.get("beta", 1.0))
            bias_value = node.inputs[2] if len(node.inputs) > 2 else None
        b = dequantized(b_value)
        if b is None or b.value.shape is None or len(b.value.shape) < 1:
            raise _NoFold("input B is not a DequantizeLinear of a shaped integer tensor")
        if bias_value is not None and not gemm and b.value.const_value is None:
            raise _NoFold("a bias needs B constant (one value per output column)")
        b_int = b.value
        trans_b = gemm and int(
            node.attributes["transB"].as_int() if "transB" in node.attributes else 0
        )
        shape = tuple(int(d) for d in b.value.shape)  # type: ignore[arg-type]
        if b.value.const_value is None:
            if not b.per_tensor or trans_b or gemm:
                raise _NoFold("an activation B must be per tensor, untransposed, in a MatMul")
            channels = 1
        else:
            channels = shape[0] if trans_b else shape[-1]
            axis = 0 if trans_b else len(shape) - 1
            if self._weights(b_value, channels, axis) is None:
                raise _NoFold(_WEIGHT_FORM)
            if trans_b:
                codes = np.asarray(b.value.const_value.numpy()).T
                b_int = self._const_value(codes, f"{b.value.name}_t")
        sb = np.broadcast_to(b.scale.reshape(-1), (channels,)).astype(np.float32)
        acc_scale = (a.s * sb).astype(np.float32)
        if bias_value is not None and beta != 0.0:
            bias = self._bias(bias_value, acc_scale, beta / alpha if alpha else 1.0)
        else:
            bias = (None, None)
        multiplier = (acc_scale * np.float32(alpha) / out.s).astype(np.float32)
        self._hmx("QMatMul", a, b_int, b, channels, bias, multiplier, [], g)

    # -- elementwise and pooling ----------------------------------------------------------

    def _binary(self, g: _Group) -> None:
        node, out = g.node, g.out
        if len(node.inputs) != 2:
            raise _NoFold(f"{node.op_type} has {len(node.inputs)} inputs")
        a, b = _activation(node.inputs[0], "input A"), _activation(node.inputs[1], "input B")
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
        self._replace(g, op, [a.value, b.value], attrs)

    def _avgpool(self, g: _Group) -> None:
        node, out = g.node, g.out
        x = _activation(node.inputs[0], "the input")
        shape = static_dims(x.value)
        if shape is None:
            raise _NoFold("the input's shape is not static")
        if node.op_type == "ReduceMean" and not _spatial_mean(node, len(shape)):
            raise _NoFold("ReduceMean is not over every spatial axis (a global average pool)")
        count = int(np.prod(shape[2:], dtype=np.int64))
        mant, shift = _fixed(np.float64(x.s) / (np.float64(out.s) * count))
        attrs = _attr_ints(x_zero=x.z, y_zero=out.z, mult=mant, shift=shift)
        self._replace(g, "QAvgPool", [x.value], attrs)

    def _windowed_avgpool(self, g: _Group) -> None:
        """AveragePool -> QAveragePool: AveragePool's own attributes plus the s_x / s_y
        multiplier; the kernel divides each window by its own count (pads, ceil_mode)."""
        node, out = g.node, g.out
        x = _activation(node.inputs[0], "the input")
        if static_dims(x.value) is None:
            raise _NoFold("the input's shape is not static")
        if "kernel_shape" not in node.attributes:
            raise _NoFold("AveragePool has no kernel_shape")
        mant, shift = _fixed(x.s / out.s)
        extra = _attr_ints(x_zero=x.z, y_zero=out.z, mult=mant, shift=shift)
        attrs = [*node.attributes.values(), *extra]
        self._replace(g, "QAveragePool", [x.value], attrs)

    def _lut(self, g: _Group) -> None:
        node, out = g.node, g.out
        x = _activation(node.inputs[0], "the input")
        extras = []
        for index, value in enumerate(node.inputs[1:], start=1):
            array = _const(value) if value is not None else None
            if value is not None and (array is None or array.size != 1):
                raise _NoFold(f"input {index} is not a constant scalar")
            extras.append(array)
        table = self._table(node, x, extras, out)
        if table is None:
            raise _NoFold(f"{node.op_type} cannot be tabulated over the input's codes")
        table_value = self._const_value(table, f"{node.name}_table")
        self._replace(g, "QLut", [x.value, table_value], [])

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

    def _route(self, quantizers: list[ir.Node], value: ir.Value) -> None:
        """Every quantizer's readers read `value` instead; the quantizers go."""
        for q in quantizers:
            replace_value(q.outputs[0], value)
            self.graph.remove(q, safe=True)

    def _move(self, g: _Group) -> None:
        node, out, quantizers = g.node, g.out, g.quantizers
        data = [0] if node.op_type != "Concat" else list(range(len(node.inputs)))
        sources = [_activation(node.inputs[i], f"input {i}") for i in data]
        opdef = REGISTRY.lookup(node.op_type, node.domain, self.opset)
        if opdef is None or out.dtype not in opdef.dtypes:
            raise _NoFold(f"{node.op_type} has no {out.dtype} kernel")
        inputs = list(node.inputs)
        for index, source in zip(data, sources, strict=True):
            if source.dtype != out.dtype:
                raise _NoFold(f"input {index} is {source.dtype}, the output {out.dtype}")
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
        """Q(DQ(x)) with the same parameters is x itself; with other parameters, after an
        integer kernel, that kernel requantizes to them."""
        x = dequantized(node.inputs[0])
        out = _params(node, node.outputs[0])
        if x is None or out is None or node.outputs[0].is_graph_output():
            return False
        if not x.same(out):
            return self._step_into_producer(node) is None
        node.outputs[0].replace_all_uses_with(x.value)
        self.graph.remove(node, safe=True)
        return True

    def _step_into_producer(self, node: ir.Node) -> str | None:
        """A Relu, Clip, BatchNormalization or requantizing QuantizeLinear that alone reads
        the DequantizeLinear of an integer kernel's output becomes part of that kernel's
        epilogue (compiler_core/passes/qdq_epilogue.py); None when done, else why not."""
        x = dequantized(node.inputs[0])
        if x is None or not x.per_tensor:
            return "the input is not a per-tensor DequantizeLinear output"
        producer = x.value.producer()
        if producer is None or producer.domain != DOMAIN:
            return "the input is not an integer kernel's output"
        dq = node.inputs[0].producer() if node.inputs[0] is not None else None
        if len(x.value.uses()) != 1 or x.value.is_graph_output():
            return "the integer kernel's output has other readers"
        if dq is None or len(dq.outputs[0].uses()) != 1 or dq.outputs[0].is_graph_output():
            return "the DequantizeLinear output has other readers"
        if node.op_type == "QuantizeLinear":
            out: QParams | None = _params(node, node.outputs[0])
            quantizers = [node]
        else:
            found = quantized(node.outputs[0])
            out, quantizers = found if found is not None else (None, [])
        if out is None or not out.per_tensor:
            return "the output is not quantized to one per-tensor form"
        step = _step(node, x)
        if isinstance(step, str):
            return step
        old = Codes(float(x.s), x.z, x.dtype)
        why = fold_into_producer(
            producer, old, Codes(float(out.s), out.z, out.dtype), step, self._const_value
        )
        if why is not None:
            return why
        chain = [node] if node.op_type != "QuantizeLinear" else []
        note_fused(producer, chain)
        for extra in chain:
            self.folded.setdefault(producer.op_type, []).append(extra.name or extra.op_type)
        name = quantizers[0].outputs[0].name
        self._route(quantizers, x.value)
        if not x.value.is_graph_output() and name is not None and chain:
            x.value.name = name
        if chain:
            self.graph.remove(node, safe=True)
        if not dq.outputs[0].uses():  # the next step may fold into the same kernel
            self.graph.remove(dq, safe=True)
        return None

    # -- clean-up -------------------------------------------------------------------------

    def drop_dead(self) -> bool:
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

    def fold_constant_dequantize(self) -> bool:
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


_WEIGHT_FORM = "the weight is not a constant DequantizeLinear, per tensor or per output channel"


def _activation(value: ir.Value | None, what: str) -> QParams:
    """The per-tensor integer form behind an activation input, or why there is none."""
    found = dequantized(value)
    if found is None:
        raise _NoFold(f"{what} is not a DequantizeLinear output")
    if not found.per_tensor:
        raise _NoFold(f"{what} is dequantized per channel")
    return found


def _group(
    node: ir.Node,
    last: ir.Node,
    *,
    tail: tuple[ir.Node, float, float] | None = None,
    absorbed: tuple[ir.Node, ...] = (),
    bias: ir.Value | None = None,
) -> _Group | str:
    """The group from `node` to `last` (whose output the QuantizeLinear nodes read), or why
    that output has no single per-tensor integer form."""
    found = quantized(last.outputs[0])
    if found is not None:
        out, quantizers = found
        return _Group(node, out, quantizers, tail, absorbed, bias)
    value = last.outputs[0]
    whose = "the output" if last is node else f"the output of {last.op_type} {last.name}"
    if value.is_graph_output():
        return f"{whose} is a graph output"
    for use in value.uses():
        if use.node.op_type != "QuantizeLinear" or use.idx != 0:
            return f"{whose} is read by {use.node.op_type} {use.node.name}, not a QuantizeLinear"
    if not value.uses():
        return f"{whose} is not read"
    return f"{whose} is not quantized to one per-tensor form by its QuantizeLinear nodes"


STEPS = frozenset({"Relu", "Clip", "BatchNormalization"})
"""Float steps that fold into the epilogue of the integer kernel before them."""


def _real_const(value: ir.Value | None) -> np.ndarray | None:
    """A float constant, or the real values of a DequantizeLinear of a constant."""
    array = _const(value)
    if array is not None:
        return array.astype(np.float64) if array.dtype.kind == "f" else None
    q = dequantized(value, int32=True)
    if q is None or q.value.const_value is None:
        return None
    codes = np.asarray(q.value.const_value.numpy()).astype(np.int64)
    if q.per_tensor:
        return (codes - q.z).astype(np.float64) * float(q.s)
    if codes.ndim != 1 or codes.size != q.scale.size:
        return None
    return (codes - q.zero.reshape(-1)) * q.scale.reshape(-1).astype(np.float64)


def _step(node: ir.Node, x: QParams) -> Affine | str:
    """The affine map and clip a Relu, Clip, BatchNormalization or QuantizeLinear applies."""
    one, zero = np.ones(1), np.zeros(1)
    op = node.op_type
    if op == "QuantizeLinear":
        return Affine(one, zero)
    if op in ("Relu", "Clip"):
        tail = _activation_tail_of(node)
        if tail is None:
            return f"{op}'s bounds are not constants"
        return Affine(one, zero, tail[0], tail[1])
    mode = node.attributes.get("training_mode")
    if len(node.outputs) != 1 or (mode is not None and mode.as_int()):
        return "BatchNormalization in training mode"
    params = [_real_const(v) for v in node.inputs[1:5]]
    if len(params) != 4 or any(p is None for p in params):
        return "BatchNormalization's scale, bias, mean and variance are not constants"
    scale, bias, mean, var = (np.asarray(p).reshape(-1) for p in params)  # type: ignore[arg-type]
    eps = node.attributes["epsilon"].as_float() if "epsilon" in node.attributes else 1e-5
    gain = scale / np.sqrt(var + eps)
    return Affine(gain, bias - mean * gain)


def _activation_tail_of(node: ir.Node) -> tuple[float, float] | None:
    """A Relu's or Clip's range (Clip's bounds constant inputs or, at opset 6, attributes)."""
    if node.op_type == "Relu":
        return 0.0, float("inf")
    bounds = []
    for index in (1, 2):
        given = node.inputs[index] if len(node.inputs) > index else None
        array = _const(given) if given is not None else None
        if given is not None and array is None:
            return None
        bounds.append(None if array is None else float(array.reshape(-1)[0]))
    lo = bounds[0] if bounds[0] is not None else float("-inf")
    hi = bounds[1] if bounds[1] is not None else float("inf")
    if "min" in node.attributes:
        lo = node.attributes["min"].as_float()
    if "max" in node.attributes:
        hi = node.attributes["max"].as_float()
    return lo, hi


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
    bounds = _activation_tail_of(tail)
    return None if bounds is None else (tail, *bounds)


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
