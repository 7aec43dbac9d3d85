"""A GatherND that picks whole slots of a tensor becomes a Gather along axis 0.

QEfficient's continuous-batching models read each sequence's KV cache with `CtxGatherCB`: a
GatherND whose index tuples are (slot, head, position) with the slot from `batch_index` and
the head and position running over every head and every context row. That is
`Gather(cache, batch_index, axis=0)`, and only the Gather can be tiled: a GatherND reads its
data whole (any tuple may name any row), which for a real cache (8 slots x 16 heads x 1024
rows x 64) is more than a core's VTCM.

Matched, after constant folding: `GatherND(data, indices)` with batch_dims 0, indices
[B, d1 .. d(K-1), K] built by a Concat on the last axis whose first column is
`Expand(x, ...)` of an x shaped [B, 1, ..., 1] and whose other columns are constants equal
to `arange(data.shape[j])` along axis j (and d_j = data.shape[j]). Anything else is left as
it is (and still correct).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from compiler_core.passes.base import (
    GraphPass,
    NameScope,
    add_initializer,
    const_array,
    replace_value,
    static_dims,
)

log = logging.getLogger(__name__)


class GatherSlotsPass(GraphPass):
    name = "gather-slots"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        names = NameScope(graph)
        rewritten = 0
        for node in list(graph):
            if node.op_type == "GatherND" and node.domain in ("", "ai.onnx"):
                rewritten += self._rewrite(graph, node, names)
        if rewritten:
            log.info("gather_slots: %d GatherND became Gather along the slot axis", rewritten)
        return ir.passes.PassResult(model, modified=bool(rewritten))

    def _rewrite(self, graph: ir.Graph, node: ir.Node, names: NameScope) -> int:
        batch_dims = node.attributes.get("batch_dims")
        if batch_dims is not None and batch_dims.as_int() != 0:
            return 0
        data, indices = node.inputs[0], node.inputs[1]
        slot = _slot_source(data, indices)
        if slot is None or data is None:
            return 0
        out = node.outputs[0]
        if out.is_graph_output() and out.name is None:
            return 0
        batch = static_dims(indices)[0]  # type: ignore[index]
        label = node.name or "GatherND"
        shape = add_initializer(
            graph, np.array([batch], np.int64), names.fresh(f"{label}/slots_shape")
        )
        slots = ir.Value(
            name=names.fresh(f"{label}/slots"), type=slot.type, shape=ir.Shape([batch])
        )
        gathered = ir.Value(name=names.fresh(f"{label}/gather"), type=out.type, shape=out.shape)
        reshape = ir.Node("", "Reshape", [slot, shape], outputs=[slots], name=f"{label}/slots")
        gather = ir.Node(
            "",
            "Gather",
            [data, slots],
            attributes=[ir.AttrInt64("axis", 0)],
            outputs=[gathered],
            name=f"{label}/gather",
        )
        graph.insert_before(node, [reshape, gather])
        replace_value(out, gathered)
        graph.remove(node, safe=True)
        return 1


def _slot_source(data: ir.Value | None, indices: ir.Value | None) -> ir.Value | None:
    """The [B, 1, ..., 1] value the slot column is expanded from, when `indices` picks
    whole slots (see the module doc); else None."""
    data_dims, dims = static_dims(data), static_dims(indices)
    if data_dims is None or dims is None or indices is None or len(dims) < 2:
        return None
    depth = dims[-1]
    if depth < 1 or depth > len(data_dims) or len(dims) != depth + 1:
        return None
    if tuple(dims[1:depth]) != tuple(data_dims[1:depth]):
        return None
    concat = indices.producer()
    if concat is None or concat.op_type != "Concat" or concat.domain not in ("", "ai.onnx"):
        return None
    axis = concat.attributes.get("axis")
    if axis is None or axis.as_int() % len(dims) != len(dims) - 1:
        return None
    columns: list[ir.Value | np.ndarray] = []
    for part in concat.inputs:
        part_dims = static_dims(part)
        if part is None or part_dims is None or tuple(part_dims[:-1]) != tuple(dims[:-1]):
            return None
        array = const_array(part)
        if array is not None:
            columns += [array[..., j] for j in range(part_dims[-1])]
        elif part_dims[-1] == 1:
            columns.append(part)
        else:
            return None
    if len(columns) != depth or isinstance(columns[0], np.ndarray):
        return None
    for j, column in enumerate(columns[1:], start=1):
        if not isinstance(column, np.ndarray):
            return None
        along = np.arange(data_dims[j]).reshape([-1 if a == j else 1 for a in range(depth)])
        if not np.array_equal(column, np.broadcast_to(along, dims[:-1])):
            return None
    expand = columns[0].producer()
    if expand is None or expand.op_type != "Expand" or expand.domain not in ("", "ai.onnx"):
        return None
    source = expand.inputs[0]
    source_dims = static_dims(source)
    if source is None or source_dims is None or len(source_dims) != len(dims):
        return None
    if source_dims[0] != dims[0] or any(d != 1 for d in source_dims[1:]):
        return None
    return source
