"""Depth-first schedule by image group (`-aic-enable-depth-first`, `-aic-depth-first-mem`).

The batch-major schedule runs every layer over the whole batch before the next layer starts,
so at a large batch the activations of a layer outgrow VTCM (and spill to DDR) or crowd out
the resident weights. The depth-first schedule splits the batch into groups of images and
clones the network's kernels once per group, group after group (or interleaved, see
`split_into_groups`): one group's activations flow through the whole chain while they fit
on chip, and are dead before the next group needs the room. A layer's clones read one
resident copy of its weights (`LKernel.layer`: residents are keyed by layer and slot), so
groups do not load them again; weights that are not resident stream once per group.

Every clone is an ordinary kernel of the program the runtime executes: its NodeInfo and
tensors have the group's batch, graph inputs and outputs are read and written through views
(`LTensor.alias_offset`) of the group's rows. It applies only when every kernel keeps images
apart along axis 0 (checked with each op's own tiling rule), so the result cannot change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.lowering.lowered import LKernel, LoweredGraph, LTensor
from compiler_core.lowering.placement import Planned
from compiler_core.lowering.program import KIND_ACTIVATION, KIND_CONSTANT
from compiler_core.lowering.tiling import output_boxes, tiles_of
from compiler_core.ops.registry import NodeInfo

MIB = 1 << 20


def batch_of(graph: LoweredGraph) -> int | None:
    """The batch every graph input and output shares on axis 0 (None when they disagree)."""
    dims = {graph.tensors[t].shape[0] if graph.tensors[t].shape else 1 for t in graph.inputs}
    dims |= {graph.tensors[t].shape[0] if graph.tensors[t].shape else 1 for t in graph.outputs}
    return dims.pop() if len(dims) == 1 else None


def why_not(graph: LoweredGraph, batch: int | None) -> str | None:
    """Why the network cannot run image group by image group (None: it can). Every kernel
    must map images [j, j+1) of its output to images [j, j+1) of each activation operand and
    to the same box of each weight, by its op's own tiling rule."""
    if batch is None:
        return "the graph inputs and outputs do not share one batch dimension on axis 0"
    if batch <= 1:
        return "the batch is 1: there is nothing to split into image groups"
    for lk in graph.kernels:
        desc, req = lk.desc, lk.request
        name = f"'{desc.name}' ({desc.info.op_type})"
        if req is None:
            return f"kernel {name} has no tiling rule"
        for tid in desc.outputs:
            if tid >= 0 and graph.tensors[tid].shape[:1] != (batch,):
                return f"kernel {name} writes a tensor without the batch on axis 0"
        for value in desc.info.consts.values():
            if value.dtype.kind in "iu" and batch in np.asarray(value).reshape(-1).tolist():
                return f"kernel {name} has a constant operand that may encode the batch size"
        constant = [
            tid >= 0 and graph.tensors[graph.root(tid)].kind == KIND_CONSTANT for tid in desc.inputs
        ]
        for i, tid in enumerate(desc.inputs):
            if tid >= 0 and not constant[i] and graph.tensors[tid].shape[:1] != (batch,):
                return f"kernel {name} reads a tensor without the batch on axis 0"
            if tid >= 0 and not constant[i]:
                root = graph.tensors[graph.root(tid)]
                if root.shape[:1] != (batch,):
                    return f"kernel {name} reads a reshape that moves the batch axis"
        try:
            tiles = tiles_of(req, {0: batch})[:2]
        except CompileError:
            return f"kernel {name} cannot be tiled one image at a time"
        for j, tile in enumerate(tiles):
            if tile.out_box[0] != (j, j + 1):
                return f"kernel {name} is not cut by image"
            for written in output_boxes(req.opdef, req.info, tile.out_box):
                if written[:1] != ((j, j + 1),):
                    return f"kernel {name} writes several images from one"
            for i, box in enumerate(tile.in_boxes):
                if box is None or desc.inputs[i] < 0:
                    continue
                other = tiles[1 - j].in_boxes[i]
                if constant[i]:
                    if box != other:
                        return f"kernel {name} reads a different part of a weight per image"
                elif box[:1] != ((j, j + 1),) or other is None or box[1:] != other[1:]:
                    return f"kernel {name} mixes images (an operand is not read image by image)"
    return None


def activation_bytes_per_image(graph: LoweredGraph, batch: int) -> int:
    """The most activation bytes live at once in the batch-major order, per image: what one
    image of a group adds to the on-chip working set."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for k, lk in enumerate(graph.kernels):
        for tid in (*lk.desc.inputs, *lk.desc.outputs):
            if tid < 0:
                continue
            root = graph.root(tid)
            if graph.tensors[root].kind == KIND_CONSTANT:
                continue
            first.setdefault(root, k)
            last[root] = k
    deltas = [0] * (len(graph.kernels) + 1)
    for root, start in first.items():
        size = graph.tensors[root].nbytes
        deltas[start] += size
        deltas[last[root] + 1] -= size
    peak = live = 0
    for d in deltas:
        live += d
        peak = max(peak, live)
    return -(-peak // batch)


def split_into_groups(graph: LoweredGraph, groups: int, lag: int | None = None) -> LoweredGraph:
    """The network cloned once per image group; tiles not yet chosen. Weights stay shared
    tensors; activations are new tensors with the group's batch; graph inputs and outputs are
    read and written through views of the group's rows.

    `lag`: group g+1 starts layer k after group g's layer k + lag (None: after group g's last
    layer, group after group). A lag shorter than the network interleaves the groups, so one
    group's weight-heavy last layers run beside the next group's compute-heavy first ones."""
    batch = batch_of(graph)
    assert batch is not None
    size = batch // groups
    tensors = list(graph.tensors)
    kernels: list[LKernel] = []
    infos: dict[int, NodeInfo] = {}
    for g in range(groups):
        clone: dict[int, int] = {}

        def tensor(tid: int, g: int = g, clone: dict[int, int] = clone) -> int:
            return _clone_tensor(graph, tensors, clone, tid, g, groups)

        for k, lk in enumerate(graph.kernels):
            req = lk.request
            assert req is not None
            desc = lk.desc
            inputs = tuple(tensor(t) for t in desc.inputs)
            outputs = tuple(tensor(t) for t in desc.outputs)
            info = infos.get(k)
            if info is None:
                info = infos[k] = _group_info(desc.info, inputs, outputs, tensors, size)
            extra = inputs[len(info.in_shapes) :]
            request = dataclasses.replace(
                req,
                info=info,
                extra_shapes=tuple(tensors[t].shape for t in extra),
            )
            out_elems = int(np.prod(info.out_shapes[0], dtype=np.int64)) if info.out_shapes else 0
            macs = int(req.opdef.macs(info)) + out_elems * len(desc.epilogue)
            kid = len(kernels)
            kernels.append(
                LKernel(
                    desc=dataclasses.replace(
                        desc,
                        id=kid,
                        name=f"{desc.name}.group{g}",
                        info=info,
                        inputs=inputs,
                        outputs=outputs,
                        macs=macs,
                    ),
                    tiles=[],
                    request=request,
                    layer=k,  # group 0's clone of kernel k has index k
                )
            )
    if lag is not None and lag < len(graph.kernels):
        kernels = _interleaved(kernels, len(graph.kernels), lag)
    return LoweredGraph(
        tensors=tensors,
        kernels=kernels,
        inputs=list(graph.inputs),
        outputs=list(graph.outputs),
        num_cores=graph.num_cores,
        network_name=graph.network_name,
        warnings=list(graph.warnings),
    )


def _interleaved(kernels: list[LKernel], layers: int, lag: int) -> list[LKernel]:
    """Group-major clones reordered so that group g's layer k runs at step k + g x lag, and
    renumbered (each clone's `layer` is then group 0's clone's new index)."""
    order = sorted(range(len(kernels)), key=lambda i: (i % layers + (i // layers) * lag, i))
    index = {old: new for new, old in enumerate(order)}
    return [
        dataclasses.replace(
            kernels[old],
            desc=dataclasses.replace(kernels[old].desc, id=new),
            layer=index[kernels[old].layer],
        )
        for new, old in enumerate(order)
    ]


def _clone_tensor(
    graph: LoweredGraph,
    tensors: list[LTensor],
    clone: dict[int, int],
    tid: int,
    group: int,
    groups: int,
) -> int:
    """Group `group`'s tensor for `tid` (made on first use): weights are shared, activations
    get the group's batch, graph inputs and outputs a view of the group's rows."""
    if tid < 0:
        return tid
    found = clone.get(tid)
    if found is not None:
        return found
    t = graph.tensors[tid]
    if graph.tensors[graph.root(tid)].kind == KIND_CONSTANT:
        clone[tid] = tid
        return tid
    shape = (t.shape[0] // groups, *t.shape[1:])
    name = f"{t.name}.group{group}"
    made = LTensor(len(tensors), name, t.dtype, shape, t.kind)
    if t.alias_of is not None:
        made.alias_of = _clone_tensor(graph, tensors, clone, t.alias_of, group, groups)
        made.id = len(tensors)  # the source may have been made just now
    elif t.kind != KIND_ACTIVATION:  # a graph input or output: this group's rows of it
        made.alias_of = tid
        made.alias_offset = group * t.nbytes // groups
    tensors.append(made)
    clone[tid] = made.id
    return made.id


def _group_info(
    info: NodeInfo,
    inputs: tuple[int, ...],
    outputs: tuple[int, ...],
    tensors: list[LTensor],
    size: int,
) -> NodeInfo:
    """The node as one group's clone sees it: the group's batch on every activation."""
    in_shapes = tuple(
        None if shape is None or inputs[i] < 0 else tensors[inputs[i]].shape
        for i, shape in enumerate(info.in_shapes)
    )
    out_shapes = tuple(
        tensors[outputs[o]].shape if o < len(outputs) and outputs[o] >= 0 else (size, *s[1:])
        for o, s in enumerate(info.out_shapes)
    )
    return dataclasses.replace(info, in_shapes=in_shapes, out_shapes=out_shapes, derived={})


Latency = Callable[[LoweredGraph], tuple[float, Planned]]
"""Schedules a grouped graph (splits, placement) and returns its modelled latency, seconds."""


@dataclass(frozen=True)
class Choice:
    """What the depth-first planner decided: the grouped graph and its schedule (None: keep
    the batch-major one) and warnings that say why not."""

    lowered: LoweredGraph | None
    planned: Planned | None
    groups: int
    notes: list[str]


def group_sizes(batch: int) -> list[int]:
    """Images per group to try, largest first: the proper divisors of the batch."""
    return [d for d in range(batch // 2, 0, -1) if batch % d == 0]


INTERLEAVE = (4, 8)
"""Lags tried for the chosen group size, as fractions of the network (1/4, 1/8 of its
kernels): measured on ResNet-50 at batch 16 on 14 cores, 2 groups of 8 interleaved with a lag
of 8 kernels are 3% faster than group after group; shorter lags were slower again."""


def _lags(layers: int) -> list[int | None]:
    """The orders tried for a group size: group after group (None), then the lags."""
    return [None, *sorted({max(1, layers // d) for d in INTERLEAVE}, reverse=True)]


def plan_depth_first(
    graph: LoweredGraph, mem_mib: int | None, baseline: Callable[[], float], latency: Latency
) -> Choice:
    """Group size by `-aic-depth-first-mem` (the largest group whose live activations fit it,
    summed over the cores), or else by the cost model: group sizes are tried from the
    largest down while each is faster than the last, and the fastest is kept if it beats
    the batch-major schedule (`baseline()`, seconds; asked only then). For the size chosen,
    the cost model then picks the order: group after group, or interleaved (see
    `split_into_groups`)."""
    batch = batch_of(graph)
    reason = why_not(graph, batch)
    if reason is not None or batch is None:
        return Choice(None, None, 1, [f"depth-first scheduling cannot apply: {reason}"])
    sizes = group_sizes(batch)
    notes: list[str] = []
    best: tuple[float, int, LoweredGraph, Planned] | None = None
    if mem_mib is not None:
        per_image = activation_bytes_per_image(graph, batch)
        fits = [s for s in sizes if s * per_image <= mem_mib * MIB]
        if not fits:
            notes.append(
                f"-aic-depth-first-mem={mem_mib}: one image's activations take "
                f"{per_image / MIB:.1f} MiB at their peak; groups of 1 image are used"
            )
        sizes = fits[:1] or [1]
    for size in sizes:
        grouped = split_into_groups(graph, batch // size)
        seconds, planned = latency(grouped)
        if best is not None and seconds >= best[0]:
            break  # smaller groups: less work per core, weights streamed more often
        best = (seconds, size, grouped, planned)
    assert best is not None
    size = best[1]
    for lag in _lags(len(graph.kernels))[1:]:
        grouped = split_into_groups(graph, batch // size, lag)
        seconds, planned = latency(grouped)
        if seconds < best[0]:
            best = (seconds, size, grouped, planned)
    seconds, size, grouped, planned = best
    if mem_mib is None and seconds >= (batch_major := baseline()):
        return Choice(
            None,
            None,
            1,
            [
                f"depth-first scheduling not applied: its fastest form ({batch // size} groups "
                f"of {size} images) is estimated at {seconds * 1e6:,.0f} us, the batch-major "
                f"schedule at {batch_major * 1e6:,.0f} us (give -aic-depth-first-mem to force a "
                f"group size)"
            ],
        )
    return Choice(grouped, planned, batch // size, notes)
