"""Control flow: If, Loop and Scan, whose bodies are graphs run on our own kernels.

A body travels in the QPC as the bytes of a small ModelProto (the graph with the enclosing
model's opset imports, see `nodeinfo.attribute_value`) and runs node by node through the op
registry, each node whole (one tile). Values of enclosing graphs a body reads by name arrive
as extra kernel inputs named by the `OUTER_SCOPE` attribute.

Body value shapes exist only once the body's inputs are known, so they are inferred at run
time: one ONNX shape inference of the whole body per distinct input signature, and, for values
whose shape depends on data (Range, Slice with computed starts, Reshape to a computed shape),
one inference of the node alone with its integer inputs as constants. Both caches live in the
`Body` object of one kernel call, never across calls.

Only tensor values are supported (no sequences or optionals in bodies). Loop and Scan run
their iterations one after another on one core; the whole op is one untiled kernel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from compiler_core.errors import CompileError
from compiler_core.ops.registry import (
    ALL,
    OUTER_SCOPE,
    REGISTRY,
    SMALL_CONST_ELEMENTS,
    NodeInfo,
    Shape,
    TileCtx,
    invalid_model,
    norm_domain,
    register,
)

Array = np.ndarray
ValueType = tuple[Shape | None, str | None]
"""A body value's inferred static shape (None: unknown) and numpy dtype name (None: unknown)."""


def wrap_graph(graph: onnx.GraphProto, opsets: Mapping[str, int]) -> bytes:
    """A nested graph attribute in the form `nodeinfo.attribute_value` gives the top level."""
    proto = onnx.ModelProto(ir_version=10)
    for domain, version in sorted(opsets.items()):
        proto.opset_import.add(domain=domain, version=int(version))
    proto.graph.CopyFrom(graph)
    return bytes(proto.SerializeToString(deterministic=True))


def free_names(graphs: Sequence[onnx.GraphProto]) -> list[str]:
    """Names the graphs read but do not define (outer-scope captures), in first-use order."""
    found: dict[str, None] = {}

    def walk(graph: onnx.GraphProto, outer_defined: frozenset[str]) -> None:
        defined = set(outer_defined)
        defined.update(v.name for v in graph.input)
        defined.update(t.name for t in graph.initializer)
        for node in graph.node:
            for name in node.input:
                if name and name not in defined:
                    found.setdefault(name, None)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g, frozenset(defined))
            defined.update(n for n in node.output if n)

    for graph in graphs:
        walk(graph, frozenset())
    return list(found)


def split_outer(node: NodeInfo, inputs: list[Array | None]) -> tuple[list[Array | None], dict]:
    """The node's own inputs, and its outer-scope inputs by name."""
    names = list(node.attr(OUTER_SCOPE, []) or [])
    own = len(inputs) - len(names)
    outer = {name: value for name, value in zip(names, inputs[own:], strict=True)}
    return inputs[:own], outer


def _elem_type(array: Array) -> int:
    return int(helper.np_dtype_to_tensor_dtype(array.dtype))


def _value_info(name: str, array: Array) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, _elem_type(array), list(array.shape))


def _value_type(type_proto: onnx.TypeProto) -> ValueType:
    if not type_proto.HasField("tensor_type"):
        return None, None
    tensor = type_proto.tensor_type
    dtype: str | None = None
    if tensor.elem_type:
        try:
            dtype = str(helper.tensor_dtype_to_np_dtype(tensor.elem_type))
        except (KeyError, TypeError, ValueError):
            dtype = None
    if not tensor.HasField("shape"):
        return None, dtype
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    if any(d is None for d in dims):
        return None, dtype
    return tuple(int(d) for d in dims if d is not None), dtype


def _infer(model: onnx.ModelProto) -> dict[str, ValueType]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, RuntimeError):
        return {}
    values = (*inferred.graph.value_info, *inferred.graph.output)
    return {vi.name: _value_type(vi.type) for vi in values}


def _attribute(attr: onnx.AttributeProto, opsets: Mapping[str, int]) -> Any:
    """A body node's attribute as `nodeinfo.attribute_value` gives one of the main graph."""
    kind = attr.type
    if kind == onnx.AttributeProto.GRAPH:
        return wrap_graph(attr.g, opsets)
    if kind == onnx.AttributeProto.TENSOR:
        return np.asarray(numpy_helper.to_array(attr.t))
    if kind == onnx.AttributeProto.TENSORS:
        return [np.asarray(numpy_helper.to_array(t)) for t in attr.tensors]
    if kind == onnx.AttributeProto.STRING:
        return attr.s.decode("utf-8")
    if kind == onnx.AttributeProto.STRINGS:
        return [s.decode("utf-8") for s in attr.strings]
    if kind == onnx.AttributeProto.INTS:
        return [int(v) for v in attr.ints]
    if kind == onnx.AttributeProto.FLOATS:
        return [float(v) for v in attr.floats]
    if kind == onnx.AttributeProto.INT:
        return int(attr.i)
    if kind == onnx.AttributeProto.FLOAT:
        return float(attr.f)
    raise CompileError(
        "unsupported_attribute",
        f"attribute '{attr.name}' of type {onnx.AttributeProto.AttributeType.Name(kind)} "
        "is not supported in a subgraph",
    )


@dataclass
class Body:
    """One subgraph, decoded, with the shapes inferred for it so far (per input signature)."""

    graph: onnx.GraphProto
    opsets: dict[str, int]
    owner: str
    constants: dict[str, Array]
    _body_cache: dict[tuple[Any, ...], dict[str, ValueType]] = field(default_factory=dict)
    _node_cache: dict[tuple[Any, ...], list[ValueType]] = field(default_factory=dict)

    @staticmethod
    def decode(blob: Any, owner: NodeInfo) -> Body:
        if not isinstance(blob, bytes):
            raise invalid_model(owner, "a graph attribute is missing")
        model = onnx.ModelProto()
        model.ParseFromString(blob)
        opsets = {norm_domain(o.domain): int(o.version) for o in model.opset_import}
        constants = {t.name: np.asarray(numpy_helper.to_array(t)) for t in model.graph.initializer}
        return Body(model.graph, opsets, owner.name, constants)

    @property
    def input_names(self) -> list[str]:
        return [v.name for v in self.graph.input]

    def run(self, feeds: Sequence[Array], outer: Mapping[str, Array | None]) -> list[Array]:
        """Run the body on `feeds` (one per body input) and return its outputs in order."""
        if len(feeds) != len(self.graph.input):
            raise CompileError(
                "invalid_model",
                f"the body of '{self.owner}' takes {len(self.graph.input)} inputs, "
                f"it is given {len(feeds)}",
                node=self.owner,
            )
        env: dict[str, Array | None] = dict(outer)
        env.update(self.constants)
        env.update(zip(self.input_names, (np.asarray(f) for f in feeds), strict=True))
        types = self._types(env)
        for index, proto in enumerate(self.graph.node):
            self._run_node(index, proto, env, types)
        outputs = []
        for value in self.graph.output:
            result = env.get(value.name)
            if result is None:
                raise CompileError(
                    "invalid_model",
                    f"the body of '{self.owner}' never computes its output '{value.name}'",
                    node=self.owner,
                )
            outputs.append(result)
        return outputs

    def _types(self, env: Mapping[str, Array | None]) -> dict[str, ValueType]:
        """Shapes of the body's values for these inputs: one inference per input signature."""
        known = {name: a for name, a in env.items() if a is not None}
        inputs = [*self.input_names, *(n for n in free_names([self.graph]) if n in known)]
        key = tuple((n, known[n].shape, known[n].dtype.str) for n in inputs if n in known)
        if key not in self._body_cache:
            graph = onnx.GraphProto()
            graph.CopyFrom(self.graph)
            del graph.input[:]
            graph.input.extend(_value_info(n, known[n]) for n in inputs if n in known)
            self._body_cache[key] = _infer(self._model(graph))
        return self._body_cache[key]

    def _model(self, graph: onnx.GraphProto) -> onnx.ModelProto:
        opsets = [helper.make_opsetid(d, v) for d, v in sorted(self.opsets.items())]
        model = helper.make_model(graph, opset_imports=opsets)
        model.ir_version = 10
        return model

    def _node_types(
        self, index: int, proto: onnx.NodeProto, args: list[Array | None]
    ) -> list[ValueType]:
        """Output types of one node from its actual inputs, integer ones given as constants."""
        key: list[Any] = [index]
        inputs, initializers = [], []
        for name, array in zip(proto.input, args, strict=True):
            if not name or array is None:
                continue
            if array.dtype.kind in "iu" and array.size <= SMALL_CONST_ELEMENTS:
                key.append((name, array.shape, array.dtype.str, array.tobytes()))
                initializers.append(numpy_helper.from_array(array, name))
            else:
                key.append((name, array.shape, array.dtype.str))
                inputs.append(_value_info(name, array))
        cache_key = tuple(key)
        if cache_key not in self._node_cache:
            outputs = [helper.make_empty_tensor_value_info(n) for n in proto.output if n]
            graph = helper.make_graph([proto], "node", inputs, outputs, initializer=initializers)
            inferred = _infer(self._model(graph))
            self._node_cache[cache_key] = [inferred.get(n, (None, None)) for n in proto.output]
        return self._node_cache[cache_key]

    def _run_node(
        self,
        index: int,
        proto: onnx.NodeProto,
        env: dict[str, Array | None],
        types: Mapping[str, ValueType],
    ) -> None:
        label = proto.name or proto.op_type
        domain = norm_domain(proto.domain)
        opset = self.opsets.get(domain, 1)
        opdef = REGISTRY.lookup(proto.op_type, domain, opset)
        if opdef is None:
            raise CompileError(
                "unsupported_operator",
                f"no kernel for {proto.op_type} (opset {opset}) at node '{label}' in the body "
                f"of '{self.owner}'",
                node=self.owner,
            )
        args: list[Array | None] = []
        for name in proto.input:
            if name and name not in env:
                raise CompileError(
                    "invalid_model",
                    f"node '{label}' in the body of '{self.owner}' reads '{name}', "
                    "which nothing defines before it",
                    node=self.owner,
                )
            args.append(env[name] if name else None)
        attrs = {a.name: _attribute(a, self.opsets) for a in proto.attribute}
        graphs = [a.g for a in proto.attribute if a.type == onnx.AttributeProto.GRAPH]
        captured = free_names(graphs) if graphs else []
        if captured:
            attrs[OUTER_SCOPE] = captured
        out_types = [types.get(n, (None, None)) for n in proto.output]
        if any(shape is None or dtype is None for shape, dtype in out_types):
            out_types = self._node_types(index, proto, args)
        all_args = [*args, *(env.get(name) for name in captured)]
        info = NodeInfo(
            op_type=proto.op_type,
            name=label,
            attrs=attrs,
            in_shapes=tuple(None if a is None else tuple(a.shape) for a in all_args),
            in_dtypes=tuple(None if a is None else str(a.dtype) for a in all_args),
            out_shapes=tuple(shape or () for shape, _ in out_types),
            out_dtypes=tuple(dtype or "float32" for _, dtype in out_types),
            opset=opset,
            domain=proto.domain,
            consts={
                i: a for i, a in enumerate(args) if a is not None and a.size <= SMALL_CONST_ELEMENTS
            },
        )
        results = opdef.compute(info, all_args, TileCtx.whole(info))
        for name, result in zip(proto.output, results, strict=False):
            if name:
                env[name] = np.asarray(result)


# ------------------------------------------------------------------------------------- If


def _flag(value: Array | None) -> bool:
    return value is not None and bool(np.asarray(value).reshape(-1)[0])


def if_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """Run the branch the condition selects; its outputs are the If's."""
    own, outer = split_outer(node, inputs)
    if not own or own[0] is None or np.asarray(own[0]).size != 1:
        raise invalid_model(node, "the condition must be a single boolean")
    branch = "then_branch" if _flag(own[0]) else "else_branch"
    results = Body.decode(node.attr(branch), node).run([], outer)
    if len(results) != len(node.out_shapes):
        raise invalid_model(
            node, f"{branch} has {len(results)} outputs, the If has {len(node.out_shapes)}"
        )
    return results


# ----------------------------------------------------------------------------------- Loop


def _stacked(node: NodeInfo, index: int, steps: list[Array]) -> Array:
    """Per-iteration scan outputs stacked on a new leading axis (the declared shape if none)."""
    if steps:
        return np.stack(steps)
    return np.zeros(node.out_shapes[index], dtype=np.dtype(node.out_dtypes[index]))


def loop_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """Iterate the body while the trip count and the condition allow.

    Loop-carried values are fed back each iteration; the rest of the body's outputs are
    stacked across iterations. With a runtime trip count or condition the number of
    iterations, hence the scan outputs' shapes, are the model's declared ones (checked).
    """
    own, outer = split_outer(node, inputs)
    own = own + [None] * (2 - len(own))
    trip, cond, carried = own[0], own[1], own[2:]
    if trip is None and cond is None:
        raise invalid_model(node, "neither a trip count nor a condition: the loop would never end")
    if any(value is None for value in carried):
        raise invalid_model(node, "loop-carried values must all be given")
    body = Body.decode(node.attr("body"), node)
    n_carried = len(carried)
    if len(body.graph.output) < 1 + n_carried:
        raise invalid_model(
            node, f"the body has {len(body.graph.output)} outputs, fewer than 1 + {n_carried}"
        )
    limit = None if trip is None else int(np.asarray(trip).reshape(-1)[0])
    state = [np.asarray(v) for v in carried]
    keep = True if cond is None else _flag(cond)
    scans: list[list[Array]] = [[] for _ in range(len(body.graph.output) - 1 - n_carried)]
    step = 0
    while keep and (limit is None or step < limit):
        feeds = [np.array(step, dtype=np.int64), np.array(keep), *state]
        outs = body.run(feeds, outer)
        keep = True if cond is None else _flag(outs[0])  # without cond, a for loop
        state = list(outs[1 : 1 + n_carried])
        for collected, value in zip(scans, outs[1 + n_carried :], strict=True):
            collected.append(value)
        step += 1
    return [*state, *(_stacked(node, n_carried + j, s) for j, s in enumerate(scans))]


# ----------------------------------------------------------------------------------- Scan


def _axes(node: NodeInfo, name: str, count: int, ranks: Sequence[int]) -> list[int]:
    values = list(node.attr(name) or [0] * count)
    if len(values) != count:
        raise invalid_model(node, f"{name} has {len(values)} entries for {count} tensors")
    out = []
    for value, rank in zip(values, ranks, strict=True):
        if not -rank <= value < rank:
            raise invalid_model(node, f"{name} value {value} is out of range for rank {rank}")
        out.append(value % rank)
    return out


def _directions(node: NodeInfo, name: str, count: int) -> list[int]:
    values = [int(v) for v in (node.attr(name) or [0] * count)]
    if len(values) != count or any(v not in (0, 1) for v in values):
        raise invalid_model(
            node, f"{name} must hold {count} values, each 0 (forward) or 1 (reverse)"
        )
    return values


def _scan_steps(
    node: NodeInfo,
    body: Body,
    states: list[Array],
    xs: list[Array],
    outer: Mapping[str, Array | None],
    *,
    in_axes: list[int],
    in_dirs: list[int],
    length: int | None = None,
) -> tuple[list[Array], list[list[Array]]]:
    """Run the body once per slice of the scan inputs; the final states and each step's
    scan outputs."""
    moved = [np.moveaxis(x, axis, 0) for x, axis in zip(xs, in_axes, strict=True)]
    lengths = {m.shape[0] for m in moved}
    if len(lengths) > 1:
        raise invalid_model(node, f"scan inputs have different lengths {sorted(lengths)}")
    total = lengths.pop() if lengths else 0
    steps = total if length is None else min(length, total)
    n_states = len(states)
    scans: list[list[Array]] = [[] for _ in range(len(body.graph.output) - n_states)]
    for t in range(steps):
        slices = [m[steps - 1 - t] if d else m[t] for m, d in zip(moved, in_dirs, strict=True)]
        outs = body.run([*states, *slices], outer)
        states = list(outs[:n_states])
        for collected, value in zip(scans, outs[n_states:], strict=True):
            collected.append(value)
    return states, scans


def _scan_outputs(node: NodeInfo, n_states: int, scans: list[list[Array]]) -> list[Array]:
    count = len(scans)
    out_dirs = _directions(node, "scan_output_directions", count)
    ranks = [len(node.out_shapes[n_states + j]) for j in range(count)]
    out_axes = _axes(node, "scan_output_axes", count, ranks)
    results = []
    for j, collected in enumerate(scans):
        stacked = _stacked(node, n_states + j, collected if not out_dirs[j] else collected[::-1])
        results.append(np.moveaxis(stacked, 0, out_axes[j]) if collected else stacked)
    return results


def scan_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """Scan (opset 9+): states carried across the slices of the scan inputs."""
    own, outer = split_outer(node, inputs)
    m = int(node.attr("num_scan_inputs", 0))
    if not 0 < m <= len(own) or any(v is None for v in own):
        raise invalid_model(node, f"num_scan_inputs {m} does not fit its {len(own)} inputs")
    arrays = [np.asarray(v) for v in own]
    states, xs = arrays[: len(own) - m], arrays[len(own) - m :]
    body = Body.decode(node.attr("body"), node)
    in_axes = _axes(node, "scan_input_axes", m, [x.ndim for x in xs])
    in_dirs = _directions(node, "scan_input_directions", m)
    states, scans = _scan_steps(node, body, states, xs, outer, in_axes=in_axes, in_dirs=in_dirs)
    return [*states, *_scan_outputs(node, len(states), scans)]


def scan8_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """Scan (opset 8): every input has a leading batch axis; the scan axis is axis 1 and
    `sequence_lens` may shorten each batch entry's sequence (later scan outputs stay zero)."""
    own, outer = split_outer(node, inputs)
    m = int(node.attr("num_scan_inputs", 0))
    lens, rest = own[0], own[1:]
    if not 0 < m <= len(rest) or any(v is None for v in rest):
        raise invalid_model(node, f"num_scan_inputs {m} does not fit its {len(rest)} inputs")
    arrays = [np.asarray(v) for v in rest]
    n_states = len(arrays) - m
    body = Body.decode(node.attr("body"), node)
    in_dirs = _directions(node, "directions", m)
    batch = arrays[0].shape[0]
    finals: list[list[Array]] = [[] for _ in range(n_states)]
    scan_outs: list[list[Array]] = [[] for _ in range(len(node.out_shapes) - n_states)]
    for b in range(batch):
        length = None if lens is None else int(np.asarray(lens).reshape(-1)[b])
        states, scans = _scan_steps(
            node,
            body,
            [a[b] for a in arrays[:n_states]],
            [a[b] for a in arrays[n_states:]],
            outer,
            in_axes=[0] * m,
            in_dirs=in_dirs,
            length=length,
        )
        for collected, value in zip(finals, states, strict=True):
            collected.append(value)
        for j, collected in enumerate(scans):
            full = np.zeros(
                node.out_shapes[n_states + j][1:], np.dtype(node.out_dtypes[n_states + j])
            )
            if collected:
                stacked = np.stack(collected)
                full[: stacked.shape[0]] = stacked
            scan_outs[j].append(full)
    return [*(np.stack(v) for v in finals), *(np.stack(v) for v in scan_outs)]


register(
    "If",
    if_compute,
    since=1,
    dtypes=ALL,
    kernel="if",
    doc="Runs the selected branch's nodes on our kernels; branches may read outer values.",
)
register(
    "Loop",
    loop_compute,
    since=1,
    dtypes=ALL,
    kernel="loop",
    doc="Tensor loop-carried values and scan outputs; a runtime trip count or condition "
    "takes the declared output shapes.",
)
register(
    "Scan",
    scan8_compute,
    since=8,
    until=8,
    dtypes=ALL,
    kernel="scan",
    doc="Batched Scan-8 with optional sequence_lens.",
)
register(
    "Scan",
    scan_compute,
    since=9,
    dtypes=ALL,
    kernel="scan",
    doc="States carried over slices of the scan inputs, any axes and directions.",
)
