"""Tensor slicing: one device's share of a network spread over the `n` devices of a partition.

Megatron-style, found by propagating a placement through the graph (no pattern names):
every value is replicated (R: whole on each device), split (S(a): device r holds the r-th
of n equal chunks of axis a) or partial (P: each device holds a summand of it).

- a MatMul by a constant 2-D weight with a replicated input keeps its weight's r-th column
  block (S on the last axis: Q/K/V, the MLP's up projection, the LM head by vocabulary); with
  an input split on its last axis, its r-th row block (P: the attention output projection,
  the MLP's down projection);
- reshapes, transposes and elementwise ops carry S along (heads become the split axis of the
  attention; constants that meet a split value are sliced with it); softmax, layer norm and
  batched MatMuls do where the split axis is not the one they work across;
- a retained-state cache written by a split update (TensorScatter) is split too: each device
  keeps the cache of its heads, in its own DDR;
- anything else needs its inputs whole: a P value becomes R by an all-reduce (AllGather along
  a new axis, then ReduceSum in device order: every device gets the same bits), an S value by
  an AllGather along its axis; graph outputs (the logits) are made whole the same way.

So a decoder block costs two all-reduces (after the attention and after the MLP) and the
model one all-gather of the logits. Sliced weights are new tensors of 1/n the size; the
others are shared with the original model (not copied).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from compiler_core.errors import CompileError
from compiler_core.ops import REGISTRY
from compiler_core.ops.registry import QPCFARM_DOMAIN as DOMAIN
from compiler_core.tensors import release_mapping

RETAINED_SUFFIX = "_RetainedState"


@dataclass(frozen=True)
class Placement:
    kind: str
    """"R", "S" or "P"."""
    axis: int = -1


R = Placement("R")
P = Placement("P")


def S(axis: int) -> Placement:  # noqa: N802 - reads as the notation of the module doc
    return Placement("S", axis)


def _dims(value: ir.Value) -> list[int]:
    shape = value.shape
    if shape is None:
        raise CompileError("mdp_unsupported", f"value {value.name} has no known shape")
    dims = []
    for d in shape:
        if not isinstance(d, int):
            raise CompileError("mdp_unsupported", f"value {value.name} has a symbolic shape")
        dims.append(d)
    return dims


class _Sharder:
    def __init__(self, model: ir.Model, devices: int, rank: int, first: int = 0) -> None:
        self.model = model
        self.graph = model.graph
        self.n = devices
        self.rank = rank
        self.first = first
        """The partition's first device among all of the config's (pipeline stages)."""
        self.opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 13))
        self.state: dict[ir.Value, Placement] = {}
        self.whole: dict[ir.Value, ir.Value] = {}
        self.count = 0
        self.retained_inputs = {
            v.name
            for v in self.graph.inputs
            if any(o.name == f"{v.name}{RETAINED_SUFFIX}" for o in self.graph.outputs)
        }

    # ------------------------------------------------------------------ helpers

    def of(self, value: ir.Value | None) -> Placement:
        if value is None:
            return R
        return self.state.get(value, R)

    def fresh(self, hint: str) -> str:
        self.count += 1
        return f"mdp_{hint}_{self.count}"

    def constant(self, array: np.ndarray, hint: str, *, named: bool = False) -> ir.Value:
        """A new initializer; `named`: `hint` is already its (fresh) name."""
        name = hint if named else self.fresh(hint)
        tensor = ir.tensor(np.ascontiguousarray(array), name=name)
        value = ir.Value(
            name=name,
            shape=ir.Shape(list(array.shape)),
            type=ir.TensorType(tensor.dtype),
            const_value=tensor,
        )
        self.graph.register_initializer(value)
        return value

    def chunk(self, size: int, what: str) -> tuple[int, int]:
        if size % self.n:
            raise CompileError("mdp_unsupported", f"{what}: {size} is not divisible by {self.n}")
        step = size // self.n
        return self.rank * step, (self.rank + 1) * step

    def sliced_constant(self, value: ir.Value, axis: int) -> ir.Value:
        """The device's block of a constant along `axis`. A weight still in the model's file
        is sliced lazily, when its bytes are wanted (lowering, the QPC writer), and its pages
        let go after: a compile holds no device's share of the weights in memory."""
        tensor = value.const_value
        assert tensor is not None
        shape = [int(d) for d in tensor.shape.numpy()]
        lo, hi = self.chunk(shape[axis], f"constant {value.name} axis {axis}")
        index = tuple(slice(lo, hi) if a == axis else slice(None) for a in range(len(shape)))
        name = self.fresh(value.name or "weight")
        if not isinstance(tensor, ir.ExternalTensor):
            return self.constant(tensor.numpy()[index], name, named=True)
        shape[axis] = hi - lo

        def block() -> ir.TensorProtocol:
            part = np.ascontiguousarray(tensor.numpy()[index])
            release_mapping(tensor)
            return ir.tensor(part, name=name)

        lazy = ir.LazyTensor(block, dtype=tensor.dtype, shape=ir.Shape(shape), name=name)
        sliced = ir.Value(
            name=name, shape=ir.Shape(shape), type=ir.TensorType(tensor.dtype), const_value=lazy
        )
        self.graph.register_initializer(sliced)
        return sliced

    def split_shape(self, value: ir.Value, axis: int) -> None:
        dims = _dims(value)
        dims[axis] //= self.n
        value.shape = ir.Shape(dims)

    def node(
        self, op: str, inputs: list[ir.Value], before: ir.Node, domain: str = "", **attrs: object
    ) -> ir.Value:
        attributes = [
            ir.AttrInt64s(k, list(v)) if isinstance(v, list | tuple) else ir.AttrInt64(k, int(v))  # type: ignore[call-overload]
            for k, v in attrs.items()
        ]
        node = ir.Node(domain, op, inputs, attributes, num_outputs=1, name=self.fresh(op))
        node.outputs[0].name = node.name
        self.graph.insert_before(before, node)
        return node.outputs[0]

    # --------------------------------------------------------------- collectives

    def make_whole(self, value: ir.Value, before: ir.Node) -> ir.Value:
        """The replicated form of a split or partial value (one collective per value)."""
        place = self.of(value)
        if place.kind == "R":
            return value
        found = self.whole.get(value)
        if found is not None:
            return found
        dims = _dims(value)
        dtype = value.dtype
        if place.kind == "S":
            out = self.node(
                "AllGather",
                [value],
                before,
                DOMAIN,
                axis=place.axis,
                devices=self.n,
                rank=self.rank,
                first=self.first,
            )
            full = list(dims)
            full[place.axis] *= self.n
            out.shape, out.type = ir.Shape(full), ir.TensorType(dtype)  # type: ignore[arg-type]
        else:
            shape = self.constant(np.array([1, *dims], np.int64), "stack_shape")
            stacked = self.node("Reshape", [value, shape], before)
            stacked.shape, stacked.type = ir.Shape([1, *dims]), ir.TensorType(dtype)  # type: ignore[arg-type]
            parts = self.node(
                "AllGather",
                [stacked],
                before,
                DOMAIN,
                axis=0,
                devices=self.n,
                rank=self.rank,
                first=self.first,
            )
            parts.shape, parts.type = ir.Shape([self.n, *dims]), ir.TensorType(dtype)  # type: ignore[arg-type]
            if self.opset >= 13:
                axes = self.constant(np.array([0], np.int64), "sum_axes")
                out = self.node("ReduceSum", [parts, axes], before, keepdims=0)
            else:
                out = self.node("ReduceSum", [parts], before, axes=[0], keepdims=0)
            out.shape, out.type = ir.Shape(dims), ir.TensorType(dtype)  # type: ignore[arg-type]
        self.whole[value] = out
        return out

    def all_whole(self, node: ir.Node) -> None:
        for i, value in enumerate(node.inputs):
            if value is not None and self.of(value).kind != "R":
                node.replace_input_with(i, self.make_whole(value, node))
        for out in node.outputs:
            self.state[out] = R

    # --------------------------------------------------------------------- rules

    def visit(self, node: ir.Node) -> None:
        places = [self.of(v) for v in node.inputs]
        if node.op_type == "TensorScatter" and node.domain in ("", "ai.onnx"):
            self.scatter(node)
            return
        if all(p.kind == "R" for p in places):
            for out in node.outputs:
                self.state[out] = R
            return
        if node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
            self.all_whole(node)
            return
        rule = getattr(self, f"rule_{node.op_type}", None)
        if rule is not None and rule(node):
            return
        opdef = REGISTRY.lookup(node.op_type, "", self.opset)
        if opdef is not None and opdef.elementwise and self.elementwise(node):
            return
        self.all_whole(node)

    def settle(self, node: ir.Node, place: Placement) -> bool:
        out = node.outputs[0]
        self.state[out] = place
        if place.kind == "S":
            self.split_shape(out, place.axis)
        return True

    def rule_MatMul(self, node: ir.Node) -> bool:  # noqa: N802
        x, w = node.inputs[0], node.inputs[1]
        assert x is not None and w is not None
        px, pw = self.of(x), self.of(w)
        out_rank = len(_dims(node.outputs[0]))
        if w.const_value is not None and len(_dims(w)) == 2 and px.kind != "P":
            rank_x = len(_dims(x))
            if px.kind == "S" and px.axis == rank_x - 1:  # row block: a partial sum
                if _dims(w)[0] % self.n:
                    return False
                node.replace_input_with(1, self.sliced_constant(w, 0))
                self.state[node.outputs[0]] = P
                return True
            if px.kind == "S" and px.axis < rank_x - 2 + (1 if rank_x >= 2 else 0):
                return self.settle(node, S(px.axis + out_rank - rank_x))
            return False
        if px.kind == "P" or pw.kind == "P" or len(_dims(x)) != len(_dims(w)):
            return False
        batch = out_rank - 2
        if px == pw and px.kind == "S" and px.axis < batch:
            return self.settle(node, px)
        if px.kind == "S" and px.axis == out_rank - 2 and pw.kind == "R":
            return self.settle(node, px)
        if pw.kind == "S" and pw.axis == out_rank - 1 and px.kind == "R":
            return self.settle(node, pw)
        return False

    def column_split(self, node: ir.Node) -> bool:
        """A replicated input times a constant 2-D weight: keep the weight's column block."""
        w = node.inputs[1]
        if w is None or w.const_value is None or len(_dims(w)) != 2:
            return False
        if _dims(w)[1] % self.n or _dims(w)[1] < self.n:
            return False
        node.replace_input_with(1, self.sliced_constant(w, 1))
        return self.settle(node, S(len(_dims(node.outputs[0])) - 1))

    def elementwise(self, node: ir.Node) -> bool:
        out_dims = _dims(node.outputs[0])
        r = len(out_dims)
        axis = None
        for v in node.inputs:
            p = self.of(v)
            if p.kind == "P":
                return False
            if p.kind == "S":
                aligned = p.axis + r - len(_dims(v))  # type: ignore[arg-type]
                if axis is not None and aligned != axis:
                    return False
                axis = aligned
        assert axis is not None
        for i, v in enumerate(node.inputs):
            if v is None or self.of(v).kind == "S":
                continue
            dims = _dims(v)
            local = axis - (r - len(dims))
            if local < 0 or dims[local] == 1:
                continue
            if v.const_value is not None:
                node.replace_input_with(i, self.sliced_constant(v, local))
                continue
            lo, hi = self.chunk(dims[local], f"{node.name} input {v.name}")
            starts = self.constant(np.array([lo], np.int64), "starts")
            ends = self.constant(np.array([hi], np.int64), "ends")
            axes = self.constant(np.array([local], np.int64), "axes")
            part = self.node("Slice", [v, starts, ends, axes], node)
            sliced = list(dims)
            sliced[local] = hi - lo
            part.shape, part.type = ir.Shape(sliced), v.type
            node.replace_input_with(i, part)
        return self.settle(node, S(axis))

    def reshaped_axis(self, in_dims: list[int], out_dims: list[int], axis: int) -> int | None:
        """Where a split of `axis` lands after a reshape: the output axis after the same
        leading elements whose length the devices still divide (see the module doc)."""
        before = math.prod(in_dims[:axis])
        for b in range(len(out_dims)):
            if math.prod(out_dims[:b]) == before and out_dims[b] % self.n == 0 and out_dims[b]:
                return b
            if math.prod(out_dims[:b]) > before:
                break
        return None

    def rule_Reshape(self, node: ir.Node) -> bool:  # noqa: N802
        x = node.inputs[0]
        p = self.of(x)
        if p.kind != "S" or self.of(node.inputs[1]).kind != "R":
            return False
        full_in = _dims(x)  # type: ignore[arg-type]
        full_in[p.axis] *= self.n
        out_dims = _dims(node.outputs[0])
        b = self.reshaped_axis(full_in, out_dims, p.axis)
        if b is None:
            return False
        local = list(out_dims)
        local[b] //= self.n
        node.replace_input_with(1, self.constant(np.array(local, np.int64), "shape"))
        return self.settle(node, S(b))

    def _shape_op(self, node: ir.Node) -> bool:
        x = node.inputs[0]
        p = self.of(x)
        if p.kind != "S" or any(self.of(v).kind != "R" for v in node.inputs[1:]):
            return False
        full_in = _dims(x)  # type: ignore[arg-type]
        full_in[p.axis] *= self.n
        b = self.reshaped_axis(full_in, _dims(node.outputs[0]), p.axis)
        return False if b is None else self.settle(node, S(b))

    rule_Unsqueeze = rule_Squeeze = rule_Flatten = _shape_op  # noqa: N815

    def rule_Transpose(self, node: ir.Node) -> bool:  # noqa: N802
        p = self.of(node.inputs[0])
        if p.kind != "S":
            return False
        perm = node.attributes.get("perm")
        rank = len(_dims(node.outputs[0]))
        order = list(perm.as_ints()) if perm is not None else list(range(rank))[::-1]
        return self.settle(node, S(order.index(p.axis)))

    def rule_Softmax(self, node: ir.Node) -> bool:  # noqa: N802
        p = self.of(node.inputs[0])
        rank = len(_dims(node.outputs[0]))
        attr = node.attributes.get("axis")
        axis = (attr.as_int() if attr is not None else (-1 if self.opset >= 13 else 1)) % rank
        if p.kind != "S" or (p.axis == axis if self.opset >= 13 else p.axis >= axis):
            return False
        return self.settle(node, p)

    rule_LogSoftmax = rule_Softmax  # noqa: N815

    def rule_LayerNormalization(self, node: ir.Node) -> bool:  # noqa: N802
        p = self.of(node.inputs[0])
        rank = len(_dims(node.outputs[0]))
        attr = node.attributes.get("axis")
        axis = (attr.as_int() if attr is not None else -1) % rank
        if p.kind != "S" or p.axis >= axis or any(self.of(v).kind != "R" for v in node.inputs[1:]):
            return False
        return self.settle(node, p)

    def scatter(self, node: ir.Node) -> None:
        """A cache written by a split update is split the same way (each device keeps its
        heads' rows); a cache that is a retained graph input takes the split shape."""
        cache, update = node.inputs[0], node.inputs[1]
        assert cache is not None and update is not None
        pu, pc = self.of(update), self.of(cache)
        if pu.kind == "S" and pc.kind == "R" and cache.is_graph_input():
            if cache.name not in self.retained_inputs or len(cache.uses()) != 1:
                self.all_whole(node)
                return
            self.split_shape(cache, pu.axis)
            self.state[cache] = pu
            pc = pu
        if pu.kind == "S" and pc == pu and all(self.of(v).kind == "R" for v in node.inputs[2:]):
            self.settle(node, pu)
            return
        if pu.kind == "R" and pc.kind == "R" and all(self.of(v).kind == "R" for v in node.inputs):
            self.state[node.outputs[0]] = R
            return
        self.all_whole(node)

    # ------------------------------------------------------------------- driver

    def run(self) -> None:
        for node in list(self.graph):
            if (
                node.op_type == "MatMul"
                and node.domain in ("", "ai.onnx")
                and all(self.of(v).kind == "R" for v in node.inputs)
                and self.column_split(node)
            ):
                continue
            self.visit(node)
        outputs = self.graph.outputs
        last = self.graph.node(len(self.graph) - 1) if len(self.graph) else None
        for i, out in enumerate(list(outputs)):
            place = self.of(out)
            if place.kind == "R":
                continue
            name = out.name or ""
            if name.endswith(RETAINED_SUFFIX):
                source = name[: -len(RETAINED_SUFFIX)]
                inputs = {v.name: v for v in self.graph.inputs}
                if source in inputs and self.of(inputs[source]) == place:
                    continue
                raise CompileError(
                    "mdp_unsupported",
                    f"retained state {out.name} is split across devices but its input "
                    f"{source} is not split the same way",
                )
            assert last is not None
            whole = self.make_whole(out, last)  # put in order by the sort below
            out.name = self.fresh("part")
            whole.name = name
            outputs[i] = whole
        self.graph.sort()


def shard_model(model: ir.Model, devices: int, rank: int, first: int = 0) -> ir.Model:
    """Device `rank`'s graph of `model` sliced over `devices` devices (a new model; the
    original's tensors are shared, not copied); `first`: the index of the partition's first
    device among the config's, which link transfers name."""
    if devices == 1:
        return model
    clone = model.clone()
    if DOMAIN not in clone.opset_imports:
        clone.opset_imports[DOMAIN] = 1
    _Sharder(clone, devices, rank, first).run()
    return clone
