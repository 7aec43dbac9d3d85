"""Pipeline stages: several partitions of a partition config each run a contiguous run of
the graph's nodes (a decoder's layers), one after another.

The graph's nodes are cut, in their topological order, into as many stages as there are
partitions, each holding about the same bytes of weights. At a cut, the values computed before
it and read after it (a decoder's hidden state, its attention mask and write index) cross to
the next stage: the stage before sends them, the stage after receives them (compiler_core/
mdp/build.py adds the link transfers); among the cuts that balance the weights about as well,
the one that moves the fewest bytes wins. A stage's model keeps the graph inputs its nodes read
(the retained caches of its layers among them) and the graph outputs they produce.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from compiler_core.errors import CompileError


@dataclass(frozen=True)
class Stage:
    model: ir.Model
    receives: tuple[tuple[str, int], ...]
    """(value, the stage that computes it) for each value an earlier stage sends it (graph
    inputs of its model)."""
    sends: tuple[tuple[str, tuple[int, ...]], ...]
    """(value, the later stages that read it) for each value it computes for them (graph
    outputs of its model)."""


def _nbytes(value: ir.Value) -> int:
    shape = value.shape
    dtype = value.dtype
    if shape is None or dtype is None or not all(isinstance(d, int) for d in shape):
        return -1
    count = 1
    for d in shape.numpy():
        count *= int(d)
    return count * int(dtype.itemsize)


def _crossings(nodes: list[ir.Node]) -> list[list[ir.Value]]:
    """For each cut after node i: the values computed at or before i that a later node reads."""
    position = {node: i for i, node in enumerate(nodes)}
    last_use: dict[ir.Value, int] = {}
    for i, node in enumerate(nodes):
        for value in node.inputs:
            if value is not None and value.producer() is not None:
                last_use[value] = i
    out: list[list[ir.Value]] = []
    live: list[ir.Value] = []
    for i, node in enumerate(nodes):
        live = [v for v in live if last_use.get(v, -1) > i]
        live += [v for v in node.outputs if last_use.get(v, -1) > i]
        out.append(sorted(live, key=lambda v: position[v.producer()]))  # type: ignore[index]
    return out


def _weights(node: ir.Node) -> int:
    return sum(
        max(0, _nbytes(v)) for v in node.inputs if v is not None and v.const_value is not None
    )


def cut_points(nodes: list[ir.Node], stages: int) -> list[int]:
    """Indices i (the cut after node i) of `stages - 1` cuts: each near an equal share of the
    weights, among those the one moving the fewest bytes."""
    crossing = _crossings(nodes)
    cumulative, total = [], 0
    for node in nodes:
        total += _weights(node)
        cumulative.append(total)
    cuts: list[int] = []
    for j in range(1, stages):
        target = total * j / stages
        slack = total / stages / 4
        lo = cuts[-1] + 1 if cuts else 0
        near = [
            i
            for i in range(lo, len(nodes) - 1)
            if abs(cumulative[i] - target) <= slack
            and crossing[i]
            and all(_nbytes(v) >= 0 for v in crossing[i])
        ]
        if not near:
            near = [i for i in range(lo, len(nodes) - 1) if crossing[i]]
            if not near:
                raise CompileError(
                    "invalid_partition_config",
                    f"-mdp-load-partition-config: the network cannot be cut into {stages} "
                    "pipeline stages",
                )
            near = [min(near, key=lambda i: abs(cumulative[i] - target))]
        cuts.append(min(near, key=lambda i: (sum(_nbytes(v) for v in crossing[i]), i)))
    return cuts


def pipeline_stages(model: ir.Model, stages: int, cuts: list[int] | None = None) -> list[Stage]:
    """The model cut into `stages` stage models (new models; tensors shared), after the nodes
    `cuts` names (found by `cut_points` when None). A value goes from the stage that computes
    it straight to every later stage that reads it."""
    if stages == 1:
        return [Stage(model, (), ())]
    nodes = list(model.graph)
    cuts = cut_points(nodes, stages) if cuts is None else cuts
    bounds = [0, *(c + 1 for c in cuts), len(nodes)]
    stage_of = {n: s for s in range(stages) for n in nodes[bounds[s] : bounds[s + 1]]}
    readers: dict[str, set[int]] = {}
    home: dict[str, int] = {}
    for node in nodes:
        for value in node.inputs:
            producer = None if value is None else value.producer()
            if value is None or producer is None or stage_of[producer] == stage_of[node]:
                continue
            readers.setdefault(value.name or "", set()).add(stage_of[node])
            home[value.name or ""] = stage_of[producer]
    out = []
    for s in range(stages):
        receives = tuple((v, home[v]) for v in readers if s in readers[v])
        sends = tuple((v, tuple(sorted(readers[v]))) for v in readers if home[v] == s)
        out.append(_stage_model(model, bounds[s], bounds[s + 1], receives, sends))
    return out


def _stage_model(
    model: ir.Model,
    start: int,
    stop: int,
    receives: tuple[tuple[str, int], ...],
    sends: tuple[tuple[str, tuple[int, ...]], ...],
) -> Stage:
    clone = model.clone()
    graph = clone.graph
    nodes = list(graph)
    kept = nodes[start:stop]
    kept_set = set(kept)
    values = {o.name: o for n in nodes for o in n.outputs}
    new_inputs = []
    for name, _ in receives:
        old = values[name]
        fresh = ir.Value(name=name, shape=old.shape, type=old.type)
        for node, index in list(old.uses()):
            if node in kept_set:
                node.replace_input_with(index, fresh)
        new_inputs.append(fresh)
    produced = {o for n in kept for o in n.outputs}
    outputs = [o for o in graph.outputs if o in produced]
    outputs += [values[name] for name, _ in sends if values[name] not in outputs]
    graph.outputs.clear()
    graph.outputs.extend(outputs)
    dropped = [n for n in nodes if n not in kept_set]
    for node in reversed(dropped):
        graph.remove(node, safe=False)
    for node in kept:  # names of values the dropped nodes produced never clash
        node.graph = graph
    read = {v for n in kept for v in n.inputs if v is not None}
    original = list(graph.inputs)
    graph.inputs.clear()
    graph.inputs.extend([v for v in original if v in read] + new_inputs)
    for name in [n for n, v in graph.initializers.items() if v not in read]:
        graph.initializers.pop(name)
    return Stage(clone, receives, sends)
