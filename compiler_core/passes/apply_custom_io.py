"""`-custom-IO-list-file`: give named graph inputs and outputs the listed precision.

Runs after precision conversion, so that a float16 input of a `-convert-to-fp16` network loses
the boundary Cast that conversion added instead of gaining a second one: the listed input then
feeds the network directly, and a listed output is the float16 value the network computed.
Elsewhere one Cast at the boundary converts between the listed and the model's type.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from compiler_core.custom_io import FLAG, INTEGERS, MXINT8, CustomIO
from compiler_core.errors import CompileError
from compiler_core.passes.base import GraphPass, NameScope, cast_node, is_cast_to, prepend
from compiler_core.qpc.networkdesc import RETAINED_SUFFIX

log = logging.getLogger(__name__)

_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
BFLOAT16_CAST_OPSET = 13
"""Cast converts to and from bfloat16 from opset 13: the pipeline raises an older model to it
before epilogue fusion (`compiler_core.passes.raise_opset.RaiseOpsetPass`)."""


class ApplyCustomIOPass(GraphPass):
    name = "apply-custom-io"

    def __init__(self, entries: list[CustomIO], mxint8_kv_cache: bool = False) -> None:
        super().__init__()
        self.entries = entries
        self.mxint8_kv_cache = mxint8_kv_cache
        """-mxint8-kv-cache: every retained pair not listed is treated as listed mxint8."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        names = NameScope(graph)
        inputs = {v.name or "": v for v in graph.inputs}
        outputs = {v.name or "": i for i, v in enumerate(graph.outputs)}
        changed = 0
        entries = list(self.entries)
        if self.mxint8_kv_cache:
            listed = {e.name for e in entries}
            for name in inputs:
                pair = (name, f"{name}{RETAINED_SUFFIX}")
                if pair[1] in outputs and not listed & set(pair):
                    entries += [CustomIO(n, MXINT8) for n in pair]
        for entry in entries:
            if entry.precision == MXINT8:  # a storage format of retained state (lowering)
                changed += _mxint8_boundary(graph, entry.name, inputs, outputs, names)
                continue
            if entry.precision in INTEGERS:  # the boundary QuantizeLinear moves to the host
                changed += _integer_boundary(graph, entry, inputs, outputs)
                continue
            target = (
                ir.DataType[entry.precision.upper()]
                if entry.precision != "float32"
                else (ir.DataType.FLOAT)
            )
            if entry.name in inputs:
                changed += _retype_input(graph, inputs[entry.name], target, names)
            elif entry.name in outputs:
                changed += _retype_output(graph, outputs[entry.name], target, names)
            else:
                raise CompileError(
                    "invalid_option",
                    f"{FLAG}: {entry.name!r} is neither a graph input nor a graph output "
                    f"(inputs: {', '.join(inputs) or 'none'}; outputs: "
                    f"{', '.join(outputs) or 'none'})",
                    flag=FLAG,
                )
        log.info("apply-custom-io: %d boundary values retyped", changed)
        return ir.passes.PassResult(model, modified=changed > 0)


def _mxint8_boundary(
    graph: ir.Graph,
    name: str,
    inputs: dict[str, ir.Value],
    outputs: dict[str, int],
    names: NameScope,
) -> int:
    """An MXINT8 tensor is stored in blocks and read back in the network's compute type: the
    boundary Cast precision conversion added (to or from float16) goes; otherwise the
    boundary stays as the model has it."""
    if name in inputs:
        value = inputs[name]
        uses = list(value.uses())
        if uses and all(is_cast_to(u.node, ir.DataType.FLOAT16) for u in uses):
            return _retype_input(graph, value, ir.DataType.FLOAT16, names)
        return 0
    if name in outputs:
        producer = graph.outputs[outputs[name]].producer()
        source = producer.inputs[0] if producer is not None and producer.inputs else None
        if (
            producer is not None
            and producer.op_type == "Cast"
            and source is not None
            and (source.dtype == ir.DataType.FLOAT16)
        ):
            return _retype_output(graph, outputs[name], ir.DataType.FLOAT16, names)
        return 0
    raise CompileError(
        "invalid_option",
        f"{FLAG}: {name!r} (mxint8) is neither a graph input nor a graph output",
        flag=FLAG,
    )


def _integer_boundary(
    graph: ir.Graph, entry: CustomIO, inputs: dict[str, ir.Value], outputs: dict[str, int]
) -> int:
    """An input read only by QuantizeLinear nodes to `entry.precision` with one per-tensor
    scale and zero point becomes their integer output (the host sends the codes); an output
    written by a per-tensor DequantizeLinear from that type becomes its integer input (the
    host receives the codes). Anything else is an error naming the entry and why."""
    want = ir.DataType[entry.precision.upper()]
    where = f"{FLAG}: {entry.name!r} ({entry.precision})"
    if entry.name in inputs:
        value = inputs[entry.name]
        uses = list(value.uses())
        casts = _boundary_casts(value)  # -convert-to-fp16's Cast in front of the quantizers
        if casts:
            uses = [u for c in casts for u in c.outputs[0].uses()]
        quantizers = [u.node for u in uses if u.node.op_type == "QuantizeLinear" and u.idx == 0]
        if not uses or len(quantizers) != len(uses):
            raise _invalid(f"{where} must be read only by QuantizeLinear nodes")
        params = {_per_tensor(q) for q in quantizers}
        if len(params) != 1 or None in params or quantizers[0].outputs[0].dtype != want:
            raise _invalid(
                f"{where}: its QuantizeLinear nodes must quantize it to {entry.precision} "
                "with one per-tensor scale and zero point"
            )
        value.type = ir.TensorType(want)
        for q in quantizers:
            ir.convenience.replace_all_uses_with(q.outputs[0], value)
            graph.remove(q, safe=True)
        for boundary in casts:
            graph.remove(boundary, safe=True)
        return 1
    if entry.name in outputs:
        position = outputs[entry.name]
        value = graph.outputs[position]
        dq = value.producer()
        cast = None
        if dq is not None and dq.op_type == "Cast" and dq.inputs and dq.inputs[0] is not None:
            # -convert-to-fp16's Cast back to the model's float type after the dequantize
            inner = dq.inputs[0]
            if inner.producer() is not None and len(list(inner.uses())) == 1:
                cast, dq = dq, inner.producer()
        source = dq.inputs[0] if dq is not None and dq.inputs else None
        if dq is None or dq.op_type != "DequantizeLinear" or source is None:
            raise _invalid(f"{where} must be written by a DequantizeLinear")
        if source.dtype != want or _per_tensor(dq) is None:
            raise _invalid(
                f"{where}: its DequantizeLinear must read {entry.precision} codes with one "
                "per-tensor scale and zero point"
            )
        if source.is_graph_input() or source.is_graph_output() or value.uses():
            raise _invalid(f"{where}: the codes are also another boundary value or read inside")
        graph.outputs[position] = source
        if cast is not None:
            graph.remove(cast, safe=True)
        graph.remove(dq, safe=True)
        source.name = entry.name
        return 1
    raise _invalid(f"{where} is neither a graph input nor a graph output")


def _boundary_casts(value: ir.Value) -> list[ir.Node]:
    """The Casts to float16 that read a float32 input, when they are all its uses (the
    boundary `-convert-to-fp16` adds; an integer entry looks through them)."""
    uses = list(value.uses())
    if value.dtype != ir.DataType.FLOAT or not uses:
        return []
    if all(is_cast_to(u.node, ir.DataType.FLOAT16) for u in uses):
        return [u.node for u in uses]
    return []


def _per_tensor(node: ir.Node) -> tuple[float, int] | None:
    """A Q/DQ node's (scale, zero point) when both are per-tensor constants."""
    scale = node.inputs[1] if len(node.inputs) > 1 else None
    zero = node.inputs[2] if len(node.inputs) > 2 else None
    if scale is None or scale.const_value is None:
        return None
    if zero is not None and zero.const_value is None:
        return None
    s = scale.const_value.numpy().reshape(-1)
    z = zero.const_value.numpy().reshape(-1) if zero is not None else [0]  # type: ignore[union-attr]
    if s.size != 1 or len(z) != 1:
        return None
    return float(s[0]), int(z[0])


def _invalid(message: str) -> CompileError:
    return CompileError("invalid_option", message, flag=FLAG)


def _check_float(value: ir.Value, target: ir.DataType) -> None:
    if value.dtype not in _FLOATS:
        raise CompileError(
            "invalid_option",
            f"{FLAG}: {value.name!r} is {value.dtype.name.lower() if value.dtype else 'untyped'}"
            f" in the model; only float inputs and outputs can change precision "
            f"(to {target.name.lower()})",
            flag=FLAG,
        )


def _retype_input(graph: ir.Graph, value: ir.Value, target: ir.DataType, names: NameScope) -> int:
    _check_float(value, target)
    if value.dtype == target:
        return 0
    uses = list(value.uses())
    casts = [u.node for u in uses if is_cast_to(u.node, target)]
    model_type = value.dtype
    assert model_type is not None
    value.type = ir.TensorType(target)
    if casts and len(casts) == len(uses):
        # The network already reads it in the listed type (a -convert-to-fp16 boundary Cast).
        for cast in casts:
            ir.convenience.replace_all_uses_with(cast.outputs[0], value)
            graph.remove(cast, safe=True)
        return 1
    back = cast_node(
        value,
        model_type,
        names.fresh(f"{value.name}_{model_type.name.lower()}"),
        f"{value.name}/from_{target.name.lower()}",
    )
    for use in uses:
        use.node.replace_input_with(use.idx, back.outputs[0])
    prepend(graph, back)
    return 1


def _retype_output(graph: ir.Graph, position: int, target: ir.DataType, names: NameScope) -> int:
    value = graph.outputs[position]
    _check_float(value, target)
    if value.dtype == target:
        return 0
    producer = value.producer()
    name = value.name
    if (
        producer is not None
        and producer.op_type == "Cast"
        and producer.inputs[0] is not None
        and producer.inputs[0].dtype == target
        and not producer.inputs[0].is_graph_input()
        and not producer.inputs[0].is_graph_output()
        and len(value.uses()) == 0
    ):
        # The network computed it in the listed type and cast it back: drop that Cast.
        source = producer.inputs[0]
        graph.outputs[position] = source
        graph.remove(producer, safe=True)
        source.name = name
        return 1
    value.name = names.fresh(f"{name}_{(value.dtype or target).name.lower()}")
    cast = cast_node(value, target, name, f"{name}/to_{target.name.lower()}")
    graph.append(cast)
    graph.outputs[position] = cast.outputs[0]
    return 1
