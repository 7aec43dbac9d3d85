"""`-custom-IO-list-file`: give named graph inputs and outputs the listed precision.

Runs after precision conversion, so that a float16 input of a `-convert-to-fp16` network loses
the boundary Cast that conversion added instead of gaining a second one: the listed input then
feeds the network directly, and a listed output is the float16 value the network computed.
Elsewhere one Cast at the boundary converts between the listed and the model's type.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from compiler_core.custom_io import FLAG, MXINT8, CustomIO
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
