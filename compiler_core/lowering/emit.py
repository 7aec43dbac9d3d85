"""Turn tiled kernels into per-core instruction streams: data movement, kernels, semaphores.

Three steps, each on the whole program:

1. `build_schedule` walks the kernels in order and writes every core's operations: loads of
   weights and of DDR activations into VTCM (one multicast DMA where several cores need the
   same box), NoC copies that bring an on-chip activation from the cores that produced it to
   the cores that read it (halo rows to a neighbour, or every part to every core when a
   kernel needs the whole tensor), kernel tiles, and stores to DDR. Operands name VTCM
   buffers, not yet offsets. Tiles are software-pipelined: the loads of tile j+1 are issued
   before tile j runs, into the other half of a double buffer.
2. `allocate` (see `vtcm`) gives every buffer an offset valid on every core.
3. `materialize` resolves offsets and adds the semaphores: it walks the operations in
   program order over one address space (DDR and every core's VTCM), finds for each operation
   the earlier operations of other cores it conflicts with (read after write, write after
   read or write), and makes it wait for a post placed right after the latest of them on each
   such core. A post is a fence of everything its core did before, and vector clocks drop
   waits that an earlier wait already implies.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from compiler_core.lowering.box_log import BoxLog, intersect
from compiler_core.lowering.lowered import LoweredGraph, LTensor
from compiler_core.lowering.memory import MemoryPlan
from compiler_core.lowering.program import (
    KIND_CONSTANT,
    KIND_INPUT,
    KIND_ONCHIP,
    KIND_OUTPUT,
    LINK_KERNEL,
    SCATTER_IN_PLACE,
    DmaGather,
    DmaLoad,
    DmaScatter,
    DmaStore,
    Instr,
    KernelDesc,
    LinkSend,
    LinkWait,
    NocCopy,
    Operand,
    Piece,
    Program,
    RunKernel,
    SemPost,
    SemWait,
    TensorDesc,
    box_byte_progressions,
    box_byte_range,
    box_nbytes,
    cores_in,
    mask_of,
)
from compiler_core.lowering.splits import bounding_box
from compiler_core.lowering.tiling import TileSpec, output_boxes
from compiler_core.lowering.vtcm import Buffer, align, step_of
from compiler_core.lowering.vtcm_hazards import Progression, VtcmHazards, VtcmSpace, write_each
from compiler_core.ops.registry import Box, full_box

LOAD, STORE, NOC, RUN, GATHER, SCATTER = 1, 2, 3, 4, 5, 6
LINK_SEND, LINK_WAIT = 7, 8

BufRef = tuple[int, int]
"""(buffer id, byte offset inside the buffer)."""


class Part(NamedTuple):
    """Part of a tile's operand in VTCM: the buffer (and byte offset) and the box it holds."""

    ref: BufRef
    box: Box


class TileInput(NamedTuple):
    """What one tile reads of one input: the box, and the parts of VTCM that hold it."""

    box: Box
    parts: tuple[Part, ...]


class TileOutput(NamedTuple):
    """Where one tile writes one output: the box, its buffer and the box that buffer holds."""

    box: Box
    ref: BufRef
    held: Box


@dataclass
class Op:
    core: int
    kind: int
    kernel: int
    tensor: int = -1
    box: Box = ()
    dst: BufRef | None = None
    dst_box: Box = ()
    src: BufRef | None = None
    src_box: Box = ()
    mask: int = 0
    out_box: Box = ()
    inputs: tuple[TileInput | None, ...] = ()
    outputs: tuple[TileOutput | None, ...] = ()


@dataclass(frozen=True)
class Placement:
    """Where data lives: `chip` roots stay in their producers' VTCM (read by others over the
    NoC); `resident` (kernel, input slot) weights are loaded once at activation."""

    chip: frozenset[int] = frozenset()
    resident: frozenset[tuple[int, int]] = frozenset()
    double_buffer: bool = True
    multicast: bool = True
    """Off: a box several cores need is moved once per core."""
    prefetch: bool = True
    """A kernel's input buffers may be filled while the previous kernel still computes
    (their lifetimes overlap it); off when VTCM is too tight for that."""
    weights_ahead: int = 1
    """How many kernels ahead streamed weights are loaded (their buffers live that long)."""


@dataclass
class _Slot:
    core: int
    box: Box
    ref: BufRef


@dataclass
class Schedule:
    ops: list[Op]
    setup: list[Op]
    buffers: list[Buffer]
    placement: Placement
    num_cores: int
    chip_bytes: dict[int, int] = field(default_factory=dict)
    """Per on-chip root, the VTCM bytes its buffer takes on every core."""


def _tile_out_boxes(graph: LoweredGraph, kernel: int, tile: TileSpec) -> list[Box | None]:
    lk = graph.kernels[kernel]
    outputs = lk.desc.outputs
    if len(outputs) == 1:
        return [None if outputs[0] < 0 else tile.out_box]
    assert lk.request is not None
    boxes = output_boxes(lk.request.opdef, lk.desc.info, tile.out_box)
    return [None if t < 0 else boxes[o] for o, t in enumerate(outputs)]


def consumers_of(graph: LoweredGraph) -> dict[int, list[int]]:
    """Root tensor -> kernels that read it (through any alias), in order."""
    out: dict[int, list[int]] = defaultdict(list)
    for index, lk in enumerate(graph.kernels):
        for t in lk.desc.inputs:
            if t >= 0:
                root = graph.root(t)
                if not out[root] or out[root][-1] != index:
                    out[root].append(index)
    return out


def producer_of(graph: LoweredGraph) -> dict[int, int]:
    out: dict[int, int] = {}
    for index, lk in enumerate(graph.kernels):
        for t in lk.desc.outputs:
            if t >= 0:
                out[t] = index
    return out


@dataclass(frozen=True)
class _KernelTiles:
    """One kernel's tiles by core and the shape of its pipeline."""

    k: int
    desc: KernelDesc
    by_core: dict[int, list[TileSpec]]
    steps: int
    """Tiles of the busiest core: the pipeline's length."""
    compute: int
    """The schedule step the kernel computes in (`vtcm.step_of`)."""
    first: int
    """The first step its buffers live in (one earlier when inputs are prefetched)."""
    parities: int
    """2 when the tiles are double-buffered, else 1."""
    scatter: bool
    """An in-place scatter into retained state: a scatter DMA per update tile."""
    gather: bool
    """An embedding lookup done by a gather DMA (`_Builder.gathers`)."""


class _Outputs(NamedTuple):
    refs: dict[tuple[int, int, int], BufRef]
    """(core, step, output slot) -> the buffer the tile writes."""
    stores: list[int]
    """Output slots stored to DDR after each tile."""


class _Inputs(NamedTuple):
    operands: dict[tuple[int, int, int], TileInput]
    """(core, step, input slot) -> what the tile reads; streamed slots are added by the
    pipeline's loads."""
    streamed: list[int]
    """Input slots loaded from DDR tile by tile."""


class _Held(NamedTuple):
    """The box a core's scratch buffer of an input holds, and which of its two buffers."""

    box: Box
    parity: int


class _Loads(NamedTuple):
    held: dict[tuple[int, int], _Held]
    """(core, input slot) -> what that core last loaded for it."""
    early: list[Op]
    """The first tiles' weight loads, to be hoisted ahead of the kernel."""


class _Builder:
    def __init__(
        self,
        graph: LoweredGraph,
        placement: Placement,
        buffers_only: bool,
        memo: BuildMemo,
    ) -> None:
        self.graph = graph
        self.buffers_only = buffers_only
        self.memo = memo
        self.placement = placement
        self.cores = graph.num_cores
        self.ops: list[Op] = []
        self.setup: list[Op] = []
        self.buffers: list[Buffer] = []
        self.slots: dict[int, list[_Slot]] = {}
        self.consumers = consumers_of(graph)
        self.producer = producer_of(graph)
        """NoC copies count as their producer's work: its core runs them, even when it
        runs no tile of the kernel they feed."""
        self.chip_bytes: dict[int, int] = {}
        self.resident_refs: dict[tuple[int, int], dict[int, tuple[BufRef, Box]]] = {}
        self.ahead = placement.weights_ahead if placement.prefetch else 0
        self.weight_tail: tuple[int, int] | None = None
        """(position in `ops` just after the last hoisted weight loads, the kernel whose
        tiles they precede): the next streamed weights queue behind them."""
        self.run_start: dict[int, int] = {}
        """Where each kernel's last tiles sit in `ops`, after its last loads: the next
        kernel's weights are hoisted there, to load while those tiles compute."""

    def buffer(
        self, size: int, first: int, last: int, what: str, resident: bool = False, root: int = -1
    ) -> int:
        buf = Buffer(len(self.buffers), size, first, last, resident, what, root)
        self.buffers.append(buf)
        return buf.id

    def fan(self, cores: list[int]) -> list[list[int]]:
        """Cores that get one transfer together: all of them (multicast), or one each."""
        return [cores] if self.placement.multicast else [[c] for c in cores]

    def dtype(self, tid: int) -> str:
        return self.graph.tensors[tid].dtype

    # ------------------------------------------------------------------------- resident

    def residents(self) -> None:
        """Resident weights: each core keeps the bounding box of what its tiles read, at one
        offset on every core; cores that need the same box get it by one multicast. The key
        is (layer, slot): the image groups' clones of a layer (`depth_first`) read one copy."""
        graph = self.graph
        clones: dict[int, list[int]] = defaultdict(list)
        if any(lk.layer >= 0 for lk in graph.kernels):
            for k in range(len(graph.kernels)):
                clones[graph.layer(k)].append(k)
        for k, slot in sorted(self.placement.resident):
            lk = graph.kernels[k]
            tid = lk.desc.inputs[slot]
            boxes: dict[int, list[Box]] = defaultdict(list)
            for clone in clones.get(k, [k]):
                for tile in graph.kernels[clone].tiles:
                    box = tile.in_boxes[slot]
                    if box is not None:
                        boxes[tile.core].append(box)
            if not boxes:
                continue
            per_core = {c: bounding_box(b) for c, b in boxes.items()}
            size = max(box_nbytes(b, self.dtype(tid)) for b in per_core.values())
            name = lk.desc.name
            buf = self.buffer(size, 0, 1 << 40, f"weights of {name}", resident=True)
            self.resident_refs[(k, slot)] = {c: ((buf, 0), b) for c, b in per_core.items()}
            groups: dict[Box, list[int]] = defaultdict(list)
            for c, b in sorted(per_core.items()):
                groups[b].append(c)
            for box, all_cores in groups.items():
                for cores in self.fan(all_cores):
                    self.setup.append(
                        Op(
                            core=cores[0],
                            kind=LOAD,
                            kernel=k,
                            tensor=tid,
                            box=box,
                            dst=(buf, 0),
                            dst_box=box,
                            mask=mask_of(cores),
                        )
                    )

    # -------------------------------------------------------------------------- kernels

    def link(self, k: int) -> None:
        """An AllGather between devices: core 0 sends this device's part (its whole input, in
        DDR) to every device of the partition, itself included, at its rank's place in the
        output, then waits until every part has landed in its own copy of the output."""
        if self.buffers_only:
            return
        desc = self.graph.kernels[k].desc
        info = desc.info
        x, out = desc.inputs[0], desc.outputs[0]
        devices, rank = int(info.attr("devices", 1)), int(info.attr("rank", 0))
        axis = int(info.attr("axis", 0)) % len(self.graph.tensors[out].shape)
        box = full_box(self.graph.tensors[x].shape)
        part = box[axis][1] - box[axis][0]
        dst_box = tuple(
            (rank * part, (rank + 1) * part) if a == axis else rng for a, rng in enumerate(box)
        )
        first = int(info.attr("first", 0))  # the partition's devices among all (pipelines)
        order = [rank, *(p for p in range(devices) if p != rank)]  # own copy first
        for peer in (first + p for p in order):
            self.ops.append(
                Op(core=0, kind=LINK_SEND, kernel=k, tensor=x, box=box, dst_box=dst_box, mask=peer)
            )
        # the next kernels' weights are hoisted here: they load while the parts travel
        self.run_start[k] = len(self.ops)
        out_box = full_box(self.graph.tensors[out].shape)
        self.ops.append(Op(core=0, kind=LINK_WAIT, kernel=k, tensor=out, box=out_box, mask=devices))

    def kernel(self, k: int) -> None:
        """Kernel k's buffers and operations: where its outputs go, where each input comes
        from, the streamed inputs' scratch buffers, then its tiles' loads, runs and stores
        in pipeline order; weights a tile needs first are hoisted ahead of the kernel. An
        AllGather between devices is link transfers instead (`link`)."""
        if self.graph.kernels[k].desc.kernel == LINK_KERNEL:
            self.link(k)
            return
        block = len(self.ops)
        kt = self._tiles(k)
        outputs = self._outputs(kt)
        inputs = self._inputs(kt)
        scratch = self._scratch(kt, inputs.streamed)
        if self.buffers_only:
            self.track_weight_tail(k, inputs.streamed, kt.by_core)
            return
        early = self._pipeline(kt, outputs, inputs, scratch)
        if early:
            self._hoist(k, early, block)

    def _tiles(self, k: int) -> _KernelTiles:
        lk = self.graph.kernels[k]
        by_core: dict[int, list[TileSpec]] = defaultdict(list)
        for tile in lk.tiles:
            by_core[tile.core].append(tile)
        steps = max(len(t) for t in by_core.values())
        double = self.placement.double_buffer and steps > 1
        return _KernelTiles(
            k=k,
            desc=lk.desc,
            by_core=by_core,
            steps=steps,
            compute=step_of(k, True),
            first=step_of(k, False) - (1 if self.placement.prefetch else 0),
            parities=2 if double else 1,
            scatter=lk.desc.kernel == SCATTER_IN_PLACE,
            gather=self.gathers(k),
        )

    def _outputs(self, kt: _KernelTiles) -> _Outputs:
        """Each output's buffers: on-chip slots that its consumers read (stored to DDR too
        when it is a graph output), or double-buffered scratch stored to DDR. An in-place
        scatter has none: it writes DDR straight from its update tile."""
        graph, desc = self.graph, kt.desc
        out = _Outputs(refs={}, stores=[])
        for o, tid in enumerate(desc.outputs):
            if tid < 0 or kt.scatter:
                continue
            on_chip = tid in self.placement.chip
            layout = self.memo.outputs.get((kt.k, o, on_chip))
            if layout is None:
                layout = self.memo.outputs[(kt.k, o, on_chip)] = self._layout(kt, o, on_chip)
            size, tiles = layout
            if on_chip:
                last = max(
                    (step_of(c, True) for c in self.consumers.get(tid, [])), default=kt.compute
                )
                buf = self.buffer(size, kt.compute, last, f"output of {desc.name}", root=tid)
                self.chip_bytes[tid] = size
                slots = []
                for c, j, box, delta in tiles:
                    out.refs[(c, j, o)] = (buf, delta)
                    slots.append(_Slot(c, box, (buf, delta)))
                self.slots[tid] = slots
                if graph.tensors[tid].kind == KIND_OUTPUT:
                    out.stores.append(o)  # a graph output its consumers read on chip
            else:
                out.stores.append(o)
                bufs = [
                    self.buffer(size, kt.first, kt.compute, f"output tile of {desc.name}")
                    for _ in range(kt.parities)
                ]
                for c, j, _, _ in tiles:
                    out.refs[(c, j, o)] = (bufs[j % kt.parities], 0)
        return out

    def _layout(self, kt: _KernelTiles, o: int, on_chip: bool) -> _Layout:
        """Output `o`'s buffer bytes and its tiles (core, step, box, byte offset): on chip,
        each core's tiles one after another in one buffer; else one tile's scratch (the
        largest)."""
        dtype = self.dtype(kt.desc.outputs[o])
        tiles: list[tuple[int, int, Box, int]] = []
        if on_chip:
            size = 0
            for c, ts in sorted(kt.by_core.items()):
                delta = 0
                for j, t in enumerate(ts):
                    box = _tile_out_boxes(self.graph, kt.k, t)[o]
                    assert box is not None
                    tiles.append((c, j, box, delta))
                    delta += align(box_nbytes(box, dtype))
                size = delta if delta > size else size
            return size, tuple(tiles)
        size = max(
            box_nbytes(_tile_out_boxes(self.graph, kt.k, t)[o] or (), dtype)
            for t in self.graph.kernels[kt.k].tiles
        )
        for c, ts in kt.by_core.items():
            tiles.extend((c, j, (), 0) for j in range(len(ts)))
        return size, tuple(tiles)

    def _inputs(self, kt: _KernelTiles) -> _Inputs:
        """Where each input comes from: resident weights, on-chip activations (NoC copies
        as needed), or streamed from DDR (slots left for the pipeline's loads)."""
        graph, k = self.graph, kt.k
        inputs = _Inputs(operands={}, streamed=[])
        for i, tid in enumerate(kt.desc.inputs):
            if tid < 0 or (kt.gather and i == 0) or (kt.scatter and i == 0):
                continue  # an in-place scatter never reads the cache it writes
            root = graph.root(tid)
            if (graph.layer(k), i) in self.resident_refs:
                refs = self.resident_refs[(graph.layer(k), i)]
                for c, ts in kt.by_core.items():
                    for j, t in enumerate(ts):
                        box = t.in_boxes[i]
                        if box is not None:
                            ref, kept = refs[c]
                            inputs.operands[(c, j, i)] = TileInput(box, (Part(ref, kept),))
            elif root in self.placement.chip:
                self.chip_input(k, i, tid, root, kt.by_core, inputs.operands)
            else:
                inputs.streamed.append(i)
        return inputs

    def _scratch(self, kt: _KernelTiles, streamed: list[int]) -> dict[int, list[int]]:
        """Per streamed input slot, its load buffers (one per parity); a weight's live from
        the kernel it is hoisted to."""
        graph, desc = self.graph, kt.desc
        scratch: dict[int, list[int]] = {}
        for i in streamed:
            tid = desc.inputs[i]
            dtype = self.dtype(tid)
            # the tiles' distinct boxes (a core's tiles mostly read one box of a weight)
            boxes = {b for t in graph.kernels[kt.k].tiles if (b := t.in_boxes[i]) is not None}
            size = max(box_nbytes(b, dtype) for b in boxes)
            weight = graph.tensors[graph.root(tid)].kind == KIND_CONSTANT
            early_first = step_of(self.hoist_to(kt.k), True) - 1 if weight else kt.first
            scratch[i] = [
                self.buffer(
                    size, min(kt.first, early_first), kt.compute, f"input tile of {desc.name}"
                )
                for _ in range(kt.parities)
            ]
        return scratch

    def _pipeline(
        self, kt: _KernelTiles, outputs: _Outputs, inputs: _Inputs, scratch: dict[int, list[int]]
    ) -> list[Op]:
        """The tiles' loads, runs and stores in order; software-pipelined when double
        buffered (tile j+1 loads while tile j runs). Returns the first tiles' weight loads,
        which depend on nothing and are issued early (see `_hoist`)."""
        loads = _Loads(held={}, early=[])
        if kt.parities == 2:
            self._loads(kt, 0, inputs, scratch, loads)
            for j in range(1, kt.steps):
                self._loads(kt, j, inputs, scratch, loads)
                self._runs(kt, j - 1, outputs, inputs)
            self._runs(kt, kt.steps - 1, outputs, inputs)
        else:
            for j in range(kt.steps):
                self._loads(kt, j, inputs, scratch, loads)
                self._runs(kt, j, outputs, inputs)
        return loads.early

    def _loads(
        self,
        kt: _KernelTiles,
        j: int,
        inputs: _Inputs,
        scratch: dict[int, list[int]],
        loads: _Loads,
    ) -> None:
        """Step j's loads of streamed inputs: a box a core already holds is not loaded
        again; cores that need the same box get one multicast."""
        graph, desc = self.graph, kt.desc
        groups: dict[tuple[int, Box, int], list[int]] = defaultdict(list)
        for c in sorted(kt.by_core):
            ts = kt.by_core[c]
            if j >= len(ts):
                continue
            for i in inputs.streamed:
                box = ts[j].in_boxes[i]
                if box is None:
                    continue
                last = loads.held.get((c, i))
                if last is not None and last.box == box:
                    ref = (scratch[i][last.parity], 0)
                    inputs.operands[(c, j, i)] = TileInput(box, (Part(ref, box),))
                    continue
                if last is not None:
                    parity = (1 - last.parity) % kt.parities
                else:
                    parity = j % kt.parities
                loads.held[(c, i)] = _Held(box, parity)
                groups[(i, box, parity)].append(c)
                ref = (scratch[i][parity], 0)
                inputs.operands[(c, j, i)] = TileInput(box, (Part(ref, box),))
        for (i, box, parity), all_cores in groups.items():
            # a weight of the first tiles depends on nothing: it is issued early, while
            # the kernel before still computes (its buffer's lifetime allows it)
            weight = graph.tensors[graph.root(desc.inputs[i])].kind == KIND_CONSTANT
            target = loads.early if j == 0 and weight and self.placement.prefetch else self.ops
            for cores in self.fan(all_cores):
                target.append(
                    Op(
                        core=cores[0],
                        kind=LOAD,
                        kernel=kt.k,
                        tensor=desc.inputs[i],
                        box=box,
                        dst=(scratch[i][parity], 0),
                        dst_box=box,
                        mask=mask_of(cores),
                    )
                )

    def _runs(self, kt: _KernelTiles, j: int, outputs: _Outputs, inputs: _Inputs) -> None:
        """Step j's tile on every core that has one (a run, a gather DMA or an in-place
        scatter DMA), each followed by the stores of its outputs that go to DDR."""
        k, desc = kt.k, kt.desc
        if j == kt.steps - 1:
            self.run_start[k] = len(self.ops)
        for c in sorted(kt.by_core):
            ts = kt.by_core[c]
            if j >= len(ts):
                continue
            tile = ts[j]
            found: list[TileInput | None] = []
            for i, tid in enumerate(desc.inputs):  # loops, not generators: a frame each
                found.append(inputs.operands.get((c, j, i)) if tid >= 0 else None)
            ins = tuple(found)
            out_boxes = _tile_out_boxes(self.graph, k, tile)
            if kt.scatter:
                self.ops.append(
                    Op(
                        core=c,
                        kind=SCATTER,
                        kernel=k,
                        tensor=desc.outputs[0],
                        box=tile.out_box,
                        out_box=tile.out_box,
                        inputs=ins,
                    )
                )
                continue
            if kt.gather:
                index = ins[1]
                assert index is not None and len(index.parts) == 1
                self.ops.append(
                    Op(
                        core=c,
                        kind=GATHER,
                        kernel=k,
                        tensor=desc.inputs[0],
                        box=tile.in_boxes[0] or (),
                        src=index.parts[0].ref,
                        src_box=index.parts[0].box,
                        dst=outputs.refs[(c, j, 0)],
                        dst_box=tile.out_box,
                        out_box=tile.out_box,
                        inputs=ins,
                    )
                )
            else:
                made: list[TileOutput | None] = []
                for o, box in enumerate(out_boxes):
                    made.append(
                        None if box is None else TileOutput(box, outputs.refs[(c, j, o)], box)
                    )
                self.ops.append(
                    Op(
                        core=c,
                        kind=RUN,
                        kernel=k,
                        out_box=tile.out_box,
                        inputs=ins,
                        outputs=tuple(made),
                    )
                )
            for o in outputs.stores:
                box = out_boxes[o]
                assert box is not None
                self.ops.append(
                    Op(
                        core=c,
                        kind=STORE,
                        kernel=k,
                        tensor=desc.outputs[o],
                        box=box,
                        src=outputs.refs[(c, j, o)],
                        src_box=box,
                    )
                )

    def _hoist(self, k: int, early: list[Op], block: int) -> None:
        """Put kernel k's early weight loads where they overlap earlier compute: right
        behind the previous hoisted weights, or before the last tiles of the kernel they are
        hoisted to, or (not hoisted) at the start of k's own operations."""
        host = self.hoist_to(k)
        if host == k or not self.ahead:
            at = block
        elif self.weight_tail is not None and self.weight_tail[1] == host:
            at = self.weight_tail[0]
        else:
            at = self.run_start[host]
        self.ops[at:at] = early
        for other, position in self.run_start.items():
            if position >= at and other != host:  # their tiles moved down
                self.run_start[other] = position + len(early)
        self.weight_tail = (at + len(early), host)

    def buffers_signature(self, k: int) -> Hashable:
        """Everything a buffers-only build of kernel k reads besides the graph: which of its
        tensors are on chip or resident, whether it gathers, the placement's switches and
        where the previous streamed weights were hoisted to."""
        graph, chip = self.graph, self.placement.chip
        desc = graph.kernels[k].desc
        layer = graph.layer(k)
        return (
            tuple(t >= 0 and t in chip for t in desc.outputs),
            tuple(
                (t >= 0 and graph.root(t) in chip, (layer, i) in self.resident_refs)
                for i, t in enumerate(desc.inputs)
            ),
            self.gathers(k),
            self.placement.prefetch,
            self.placement.double_buffer,
            self.ahead,
            self.weight_tail,
        )

    def kernel_buffers(self, k: int) -> None:
        """`kernel(k)` in a buffers-only build, replayed from an earlier build that reached
        kernel k in the same state: the same buffers, on-chip outputs and weight tail."""
        key = (k, self.buffers_signature(k))
        done = self.memo.kernels.get(key)
        start = len(self.buffers)
        if done is None:
            self.kernel(k)
            ids = {buf.id: n for n, buf in enumerate(self.buffers[start:])}
            chip = self.placement.chip
            self.memo.kernels[key] = _KernelBuffers(
                buffers=tuple(
                    (b.size, b.first, b.last, b.resident, b.what, b.root)
                    for b in self.buffers[start:]
                ),
                outputs=tuple(
                    (
                        t,
                        self.chip_bytes[t],
                        tuple((s.core, s.box, ids[s.ref[0]], s.ref[1]) for s in self.slots[t]),
                    )
                    for t in self.graph.kernels[k].desc.outputs
                    if t >= 0 and t in chip and t in self.slots
                ),
                weight_tail=self.weight_tail,
            )
            return
        for size, first, last, resident, what, root in done.buffers:
            self.buffer(size, first, last, what, resident, root)
        for t, nbytes, slots in done.outputs:
            self.chip_bytes[t] = nbytes
            self.slots[t] = [_Slot(c, box, (start + n, at)) for c, box, n, at in slots]
        self.weight_tail = done.weight_tail

    def track_weight_tail(
        self, k: int, streamed: list[int], by_core: dict[int, list[TileSpec]]
    ) -> None:
        """What `kernel` records of its hoisted weight loads when no ops are written: the
        kernel they were hoisted to, which decides where later weights' buffers start."""
        if not self.placement.prefetch:
            return
        desc = self.graph.kernels[k].desc
        for i in streamed:
            if self.graph.tensors[self.graph.root(desc.inputs[i])].kind != KIND_CONSTANT:
                continue
            if any(ts[0].in_boxes[i] is not None for ts in by_core.values()):
                self.weight_tail = (0, self.hoist_to(k))
                return

    def hoist_to(self, k: int) -> int:
        """The kernel before whose last tiles kernel k's streamed weights are issued: right
        behind the previous streamed weights (so DDR streams one weight after another while
        the kernels in between compute), at most `weights_ahead` kernels back."""
        if not self.ahead or k == 0:
            return k
        host = max(0, k - self.ahead)
        if self.weight_tail is not None:
            host = max(host, self.weight_tail[1])
        return min(host, k - 1)

    def gathers(self, k: int) -> bool:
        """Whether kernel k is a lookup done by a gather DMA: its table is a weight left in DDR
        (an embedding) or a KV cache written in place (continuous batching's slot gather,
        `lower._gather_rows_by_dma`), its indices come whole from DDR, and no epilogue is
        fused into it."""
        lk = self.graph.kernels[k]
        request, desc = lk.request, lk.desc
        if request is None or 0 not in request.indexed or desc.epilogue:
            return False
        layer = self.graph.layer(k)
        if (layer, 0) in self.resident_refs or len(desc.outputs) != 1 or len(desc.inputs) < 2:
            return False
        index = desc.inputs[1]
        root = self.graph.root(index)
        held, seen = self.graph.tensors[root], self.graph.tensors[index]
        return (
            index >= 0
            and root not in self.placement.chip
            and (layer, 1) not in self.resident_refs
            and (
                seen.shape == held.shape
                # or a reshape of all of it (`batch_index` [B, 1] seen as [B]): same bytes
                or (self.graph.offset_in_root(index) == 0 and seen.nbytes == held.nbytes)
            )
        )

    def push(
        self, root: int, slot: _Slot, part: Box, dst: BufRef, dst_box: Box, cores: list[int]
    ) -> None:
        """The producing core sends `part` of its tile over the NoC to `cores`' buffer."""
        if self.buffers_only:
            return
        self.ops.append(
            Op(
                core=slot.core,
                kind=NOC,
                kernel=self.producer[root],
                tensor=root,
                box=part,
                src=slot.ref,
                src_box=slot.box,
                dst=dst,
                dst_box=dst_box,
                mask=mask_of(cores),
            )
        )

    def chip_input(
        self,
        k: int,
        i: int,
        tid: int,
        root: int,
        by_core: dict[int, list[TileSpec]],
        operand: dict[tuple[int, int, int], TileInput],
    ) -> None:
        """Operands of an on-chip activation (see `_chip_plan`): the buffer that receives
        what the tiles read from other cores, the NoC copies that fill it and each tile's
        parts. A buffers-only build only creates the buffer."""
        key = (k, i)
        plan = self.memo.chip.get(key)
        if plan is None:  # the same in every build: tiles and producers' slots are fixed
            plan = self.memo.chip[key] = self._chip_plan(k, i, tid, root, by_core)
        buf = -1
        if plan.size:
            first = step_of(k, False) - (1 if self.placement.prefetch else 0)
            buf = self.buffer(plan.size, first, step_of(k, True), plan.what)
        if self.buffers_only:
            return
        slots = self.slots[root]
        for n, part, delta, dst_box, cores, fanned in plan.pushes:
            for group in self.fan(list(cores)) if fanned else [list(cores)]:
                self.push(root, slots[n], part, (buf, delta), dst_box, group)
        for c, j, box, parts in plan.reads:
            made: list[Part] = []
            for n, delta, held in parts:  # a loop, not a generator: ~2,000 reads per build
                made.append(Part(slots[n].ref if n >= 0 else (buf, delta), held))
            operand[(c, j, i)] = TileInput(box, tuple(made))

    def _chip_plan(
        self, k: int, i: int, tid: int, root: int, by_core: dict[int, list[TileSpec]]
    ) -> _ChipPlan:
        """How kernel k's tiles read input `i`, an on-chip activation: in the producer's own
        buffers where the data is local; otherwise through NoC copies pushed by the
        producing cores, into halo slots (a few neighbours' rows) or a gather buffer (most
        of the tensor, multicast to every core)."""
        graph = self.graph
        name = graph.kernels[k].desc.name
        slots = self.slots[root]
        dtype = self.dtype(tid)
        root_t: LTensor = graph.tensors[root]
        reads: list[tuple[int, int, Box, tuple[tuple[int, int, Box], ...]]] = []
        if graph.tensors[tid].shape != root_t.shape:  # read through a reshape: all of it
            whole_root = full_box(root_t.shape)
            whole = full_box(graph.tensors[tid].shape)
            local = len(slots) == 1 and slots[0].box == whole_root
            if local and all(c == slots[0].core for c in by_core):
                held: tuple[tuple[int, int, Box], ...] = ((0, 0, whole),)
                size = 0
                pushes: list[tuple[int, Box, int, Box, tuple[int, ...], bool]] = []
            else:
                held = ((-1, 0, whole),)
                size = box_nbytes(whole_root, dtype)
                every = tuple(sorted(by_core))
                pushes = [(n, s.box, 0, whole_root, every, True) for n, s in enumerate(slots)]
            for c, ts in by_core.items():
                for j, t in enumerate(ts):
                    box = t.in_boxes[i]
                    if box is not None:
                        reads.append((c, j, box, held))
            return _ChipPlan(
                size, f"{root_t.name} gathered for {name}", tuple(pushes), tuple(reads)
            )

        needs: list[tuple[int, int, Box, list[int], list[int]]] = []
        most_remote = 0
        wanted_at: list[tuple[int, int, Box]] = [
            (c, j, box)
            for c, ts in by_core.items()
            for j, t in enumerate(ts)
            if (box := t.in_boxes[i]) is not None
        ]
        hits = _meeting(slots, [box for _, _, box in wanted_at])
        for (c, j, box), found in zip(wanted_at, hits, strict=True):
            mine: list[int] = []
            remote: list[int] = []
            for n in found:  # one loop, not two comprehensions
                (mine if slots[n].core == c else remote).append(n)
            needs.append((c, j, box, mine, remote))
            if len(remote) > most_remote:
                most_remote = len(remote)
        if most_remote == 0:
            for c, j, box, mine, _ in needs:
                reads.append((c, j, box, tuple((n, 0, slots[n].box) for n in mine)))
            return _ChipPlan(0, "", (), tuple(reads))
        if most_remote <= 2:
            # halo: each remote part that a tile reads lands in a slot of its own
            layout: dict[int, int] = defaultdict(int)
            halo: list[tuple[int, Box, int, Box, tuple[int, ...], bool]] = []
            extra: dict[tuple[int, int], list[tuple[int, int, Box]]] = defaultdict(list)
            for c, j, box, _, remote in sorted(needs, key=lambda need: need[:2]):
                for n in remote:
                    part = intersect(slots[n].box, box)
                    assert part is not None
                    halo.append((n, part, layout[c], part, (c,), False))
                    extra[(c, j)].append((-1, layout[c], part))
                    layout[c] += align(box_nbytes(part, dtype))
            for c, j, box, mine, _ in needs:
                parts = (*((n, 0, slots[n].box) for n in mine), *extra[(c, j)])
                reads.append((c, j, box, parts))
            return _ChipPlan(max(layout.values()), f"halo of {name}", tuple(halo), tuple(reads))
        # gather: each core receives the bounding box of what its tiles read
        per_core: dict[int, list[Box]] = defaultdict(list)
        for c, _, box, _, _ in needs:
            per_core[c].append(box)
        wanted = {c: bounding_box(boxes) for c, boxes in per_core.items()}
        size = max(box_nbytes(b, dtype) for b in wanted.values())
        by_box: dict[Box, list[int]] = defaultdict(list)
        for c, b in sorted(wanted.items()):
            by_box[b].append(c)
        gather: list[tuple[int, Box, int, Box, tuple[int, ...], bool]] = []
        for n, slot in enumerate(slots):
            for g_box, all_cores in by_box.items():
                part = intersect(slot.box, g_box)
                if part is not None:
                    gather.append((n, part, 0, g_box, tuple(all_cores), True))
        for c, j, box, _, _ in needs:
            reads.append((c, j, box, ((-1, 0, wanted[c]),)))
        return _ChipPlan(size, f"{root_t.name} gathered for {name}", tuple(gather), tuple(reads))


def _meeting(slots: list[_Slot], boxes: list[Box]) -> list[list[int]]:
    """For each box, the indices (ascending) of the slots whose boxes it meets: one array
    comparison instead of boxes x slots Python loops (the schedule's hottest spot)."""
    if not boxes or not slots:
        return [[] for _ in boxes]
    rank = len(slots[0].box)
    if rank == 0:
        return [list(range(len(slots))) for _ in boxes]
    s = np.array([s.box for s in slots], dtype=np.int64).reshape(len(slots), rank, 2)
    b = np.array(boxes, dtype=np.int64).reshape(len(boxes), rank, 2)
    meets = np.all(
        (s[None, :, :, 0] < b[:, None, :, 1]) & (b[:, None, :, 0] < s[None, :, :, 1]), axis=2
    )
    # one nonzero for the whole matrix (row-major: each row's slots ascending), cut by rows
    counts = np.count_nonzero(meets, axis=1).tolist()
    found = np.nonzero(meets)[1].tolist()
    out: list[list[int]] = []
    at = 0
    for n in counts:
        out.append(found[at : at + n])
        at += n
    return out


@dataclass(frozen=True)
class _KernelBuffers:
    """What a buffers-only build of one kernel did, to be replayed by later builds that
    reach the kernel in the same state (`_Builder.buffers_signature`)."""

    buffers: tuple[tuple[int, int, int, bool, str, int], ...]
    """(size, first, last, resident, what, root) of each buffer it created, in order."""
    outputs: tuple[tuple[int, int, tuple[tuple[int, Box, int, int], ...]], ...]
    """Its on-chip outputs: (tensor, VTCM bytes, slots as (core, box, buffer created, byte
    offset))."""
    weight_tail: tuple[int, int] | None


_Layout = tuple[int, tuple[tuple[int, int, Box, int], ...]]
"""An output's buffer bytes and its tiles as (core, step, box, byte offset in the buffer)."""


class _ChipPlan(NamedTuple):
    """How a kernel's tiles read one on-chip activation (`_Builder._chip_plan`), by its
    producer's slots (their index in `_Builder.slots`): the same in every build of the
    graph, where only buffer ids differ."""

    size: int
    """Bytes of the buffer that receives parts from other cores (0: none, all read in
    place)."""
    what: str
    pushes: tuple[tuple[int, Box, int, Box, tuple[int, ...], bool], ...]
    """NoC copies: (slot, part sent, byte offset in the buffer, box the destination holds,
    cores receiving, whether those cores are fanned out as `_Builder.fan` decides)."""
    reads: tuple[tuple[int, int, Box, tuple[tuple[int, int, Box], ...]], ...]
    """(core, step, box read, parts as (slot, or -1 for the buffer; byte offset in the
    buffer; box the part holds))."""


@dataclass
class BuildMemo:
    """What one build of a graph's schedule found that the next build of it can reuse:
    placement builds the schedule again after every spill decision, and most kernels come
    out the same each time."""

    outputs: dict[tuple[int, int, bool], _Layout] = field(default_factory=dict)
    """(kernel, output slot, whether on chip) -> its buffer's layout (`_Builder._layout`)."""
    chip: dict[tuple[int, int], _ChipPlan] = field(default_factory=dict)
    """(kernel, input slot) -> how its tiles read that on-chip activation."""
    kernels: dict[tuple[int, Hashable], _KernelBuffers] = field(default_factory=dict)
    """(kernel, buffers signature) -> what its buffers-only build did."""


def build_schedule(
    graph: LoweredGraph,
    placement: Placement,
    buffers_only: bool = False,
    memo: BuildMemo | None = None,
) -> Schedule:
    """The schedule of `placement`; `buffers_only`: only its VTCM buffers (what placement
    needs to see whether a placement fits), without ops. `memo` carries what one build
    found of the graph's tiles (which slots each tile reads, each kernel's buffers) to the
    next build of it."""
    builder = _Builder(graph, placement, buffers_only, BuildMemo() if memo is None else memo)
    builder.residents()
    for k in range(len(graph.kernels)):
        if buffers_only:
            builder.kernel_buffers(k)
        else:
            builder.kernel(k)
    return Schedule(
        ops=builder.ops,
        setup=builder.setup,
        buffers=builder.buffers,
        placement=placement,
        num_cores=graph.num_cores,
        chip_bytes=builder.chip_bytes,
    )


# ------------------------------------------------------------------------------- hazards

VTCM_SPAN = 1 << 34
"""Each core's VTCM gets its own window of the one address space the hazards are kept in."""


class _DdrHazards:
    """Per DDR tensor (root): the boxes written and read, and by which ops; tensors that
    reuse each other's bytes (liveness-based DDR reuse) conflict as a whole."""

    def __init__(self, graph: LoweredGraph, plan: MemoryPlan) -> None:
        self.graph = graph
        self.writes: dict[int, BoxLog] = {}
        self.reads: dict[int, BoxLog] = {}
        self.inherited: dict[int, tuple[int, ...]] = {}
        self.core_of: list[int] = []
        """The core of every op, by global index (filled as ops are walked)."""
        spans = sorted(
            (plan.offsets[r], plan.offsets[r] + graph.tensors[r].nbytes, r)
            for r in plan.offsets
            if graph.tensors[r].kind not in (KIND_CONSTANT,) and graph.tensors[r].nbytes > 0
        )
        self.overlaps: dict[int, list[int]] = defaultdict(list)
        for a in range(len(spans)):
            lo, hi, r = spans[a]
            for b in range(a + 1, len(spans)):
                lo2, _, r2 = spans[b]
                if lo2 >= hi:
                    break
                self.overlaps[r].append(r2)
                self.overlaps[r2].append(r)

    def _key(self, tid: int, box: Box) -> tuple[int, Box | None]:
        root = self.graph.root(tid)
        t, held = self.graph.tensors[tid], self.graph.tensors[root]
        if t.shape == held.shape:
            return root, box
        same_rows = len(t.shape) == len(held.shape) and t.shape[1:] == held.shape[1:]
        if t.alias_of == root and box and same_rows and held.nbytes:
            # an image group's rows of a graph input or output: the same box, shifted
            row = held.nbytes // held.shape[0]
            at = t.alias_offset // row
            return root, ((box[0][0] + at, box[0][1] + at), *box[1:])
        return root, None

    def _logs(self, root: int) -> tuple[BoxLog, BoxLog]:
        writes = self.writes.get(root)
        if writes is None:
            rank = len(self.graph.tensors[root].shape)
            writes = self.writes[root] = BoxLog(rank)
            self.reads[root] = BoxLog(rank)
        return writes, self.reads[root]

    def read(self, tid: int, box: Box, op: int, deps: set[int]) -> None:
        root, key = self._key(tid, box)
        writes, reads = self._logs(root)
        deps.update(writes.meeting(key))
        reads.add(key, op)

    def write(self, tid: int, box: Box, op: int, deps: set[int]) -> None:
        root, key = self._key(tid, box)
        writes, reads = self._logs(root)
        deps.update(writes.meeting(key))
        deps.update(reads.meeting(key))
        if root not in self.inherited:
            # The bytes were another tensor's: every writer of this one waits for all of
            # that tensor's accesses (each core's latest is enough: a post is a fence).
            latest: dict[int, int] = {}
            for other in self.overlaps.get(root, ()):
                if other not in self.writes:
                    continue
                for access in (*self.writes[other].all_ops(), *self.reads[other].all_ops()):
                    core = self.core_of[access]
                    latest[core] = max(latest.get(core, -1), access)
            self.inherited[root] = tuple(latest.values())
        deps.update(self.inherited[root])
        if key is None:
            writes.clear()
            reads.clear()
        else:
            writes.drop_covered(key)
            reads.drop_covered(key)
        writes.add(key, op)


def materialize(
    schedule: Schedule, graph: LoweredGraph, plan: MemoryPlan, resident: int
) -> tuple[list[list[Instr]], list[list[Instr]], int, list[int]]:
    """Streams (with semaphores), activation streams, the number of semaphores and the VTCM
    each core uses."""
    cores = schedule.num_cores
    buffers = schedule.buffers
    tensors = graph.tensors
    id_map = _tensor_ids(graph, plan, schedule.placement.chip)

    def at(ref: BufRef) -> int:
        return buffers[ref[0]].offset + ref[1]

    sizes: dict[tuple[Box, str], int] = {}

    def span(ref: BufRef, box: Box, tid: int) -> tuple[int, int]:
        lo = buffers[ref[0]].offset + ref[1]
        dtype = tensors[tid].dtype
        n = sizes.get((box, dtype))
        if n is None:
            n = sizes[(box, dtype)] = box_nbytes(box, dtype)
        return lo, lo + n

    runs_of: dict[tuple[Box, Box, str], tuple[list[Progression], int]] = {}

    def part(ref: BufRef, buf_box: Box, box: Box, tid: int) -> tuple[int, list[Progression], int]:
        """The bytes a transfer of `box` touches in the buffer holding `buf_box` (from the
        buffer's offset): parts that cores fill side by side (each its channels, or its
        columns of every row) are ordered only where they share bytes; and the buffer's end."""
        key = (box, buf_box, tensors[tid].dtype)
        found = runs_of.get(key)
        if found is None:
            found = runs_of[key] = (box_byte_progressions(*key), box_nbytes(buf_box, key[2]))
        offset = buffers[ref[0]].offset + ref[1]
        return offset, found[0], offset + found[1]

    ranges: dict[tuple[Box, Box, str], tuple[int, int]] = {}

    def part_span(ref: BufRef, buf_box: Box, box: Box, tid: int) -> tuple[int, int]:
        """From the first byte of `box` to its last: what a read of it is ordered by (a
        read's span orders it after the writes it needs and costs one segment)."""
        base = buffers[ref[0]].offset + ref[1]
        key = (box, buf_box, tensors[tid].dtype)
        found = ranges.get(key)
        if found is None:
            found = ranges[key] = box_byte_range(*key)
        return base + found[0], base + found[1]

    masks: dict[int, list[int]] = {}

    def targets_of(mask: int) -> list[int]:
        found = masks.get(mask)
        if found is None:
            found = masks[mask] = cores_in(mask)
        return found

    vtcm_used = [0] * cores
    ddr = _DdrHazards(graph, plan)
    top = max((b.offset + b.size for b in buffers), default=0)
    vtcm = VtcmHazards(ddr.core_of, VTCM_SPAN, top + 1)
    spaces = [vtcm.space(c) for c in range(cores)]  # each core's VTCM, from its offset 0
    mask_spaces: dict[int, list[VtcmSpace]] = {}

    def spaces_of(mask: int, targets: list[int]) -> list[VtcmSpace]:
        """The VTCM of each of a multicast's targets."""
        found = mask_spaces.get(mask)
        if found is None:
            found = mask_spaces[mask] = [spaces[t] for t in targets]
        return found

    ops = schedule.ops
    position: list[int] = []
    counts = [0] * cores
    clocks: list[list[int]] = [[-1] * cores for _ in range(cores)]
    clock_at: list[tuple[int, ...]] = []
    waits: list[list[tuple[int, int]]] = []
    post_after: dict[int, int] = {}
    core_of = ddr.core_of
    for index, op in enumerate(ops):
        c = op.core
        core_of.append(c)
        deps: set[int] = set()
        if op.kind == LOAD:
            ddr.read(op.tensor, op.box, index, deps)
            assert op.dst is not None
            offset, runs, end = part(op.dst, op.dst_box, op.box, op.tensor)
            targets = targets_of(op.mask)
            write_each(spaces_of(op.mask, targets), offset, runs, index, deps)
            for target in targets:
                if end > vtcm_used[target]:
                    vtcm_used[target] = end
        elif op.kind == STORE:
            assert op.src is not None
            lo, hi = part_span(op.src, op.src_box, op.box, op.tensor)
            spaces[c].read(lo, hi, index, deps)
            ddr.write(op.tensor, op.box, index, deps)
        elif op.kind == NOC:
            assert op.src is not None and op.dst is not None
            lo, hi = part_span(op.src, op.src_box, op.box, op.tensor)
            spaces[c].read(lo, hi, index, deps)
            offset, runs, end = part(op.dst, op.dst_box, op.box, op.tensor)
            targets = targets_of(op.mask)
            write_each(spaces_of(op.mask, targets), offset, runs, index, deps)
            for target in targets:
                if end > vtcm_used[target]:
                    vtcm_used[target] = end
        elif op.kind == SCATTER:
            desc = graph.kernels[op.kernel].desc
            for slot in (1, 2):
                operand = op.inputs[slot]
                assert operand is not None
                for ref, box in operand.parts:
                    lo, hi = span(ref, box, desc.inputs[slot])
                    spaces[c].read(lo, hi, index, deps)
            ddr.write(op.tensor, op.box, index, deps)
        elif op.kind == LINK_SEND:
            ddr.read(op.tensor, op.box, index, deps)
        elif op.kind == LINK_WAIT:
            ddr.write(op.tensor, op.box, index, deps)
        elif op.kind == GATHER:
            assert op.src is not None and op.dst is not None
            desc = graph.kernels[op.kernel].desc
            ddr.read(op.tensor, op.box, index, deps)  # a cache written earlier in the run
            lo, hi = span(op.src, op.src_box, desc.inputs[1])
            spaces[c].read(lo, hi, index, deps)
            out = desc.outputs[0]
            lo, hi = span(op.dst, op.dst_box, out)
            spaces[c].write(lo, hi, index, deps)
            vtcm_used[c] = max(vtcm_used[c], hi)
        else:
            desc = graph.kernels[op.kernel].desc
            space = spaces[c]
            for tid, operand in zip(desc.inputs, op.inputs, strict=True):
                if operand is None or tid < 0:
                    continue
                dtype = tensors[tid].dtype
                for ref, box in operand.parts:  # `span`, inlined (~2,900 reads for ResNet-50)
                    lo = buffers[ref[0]].offset + ref[1]
                    n = sizes.get((box, dtype))
                    if n is None:
                        n = sizes[(box, dtype)] = box_nbytes(box, dtype)
                    space.read(lo, lo + n, index, deps)
            for tid, result in zip(desc.outputs, op.outputs, strict=True):
                if result is None or tid < 0:
                    continue
                lo, hi = span(result.ref, result.held, tid)
                spaces[c].write(lo, hi, index, deps)
                if hi > vtcm_used[c]:
                    vtcm_used[c] = hi
        deps.discard(-1)
        mine = clocks[c]
        # core -> its latest op this one depends on (a core's ops are in program order)
        latest: dict[int, int] = {}
        for d in sorted(deps):  # a loop: a comprehension is a function call of its own
            latest[core_of[d]] = d
        latest.pop(c, None)  # this op's core, the op itself among them
        mine_waits: list[tuple[int, int]] = []
        for dc in sorted(latest):
            d = latest[dc]
            if mine[dc] >= position[d]:
                continue
            sem = post_after.setdefault(d, len(post_after))
            mine_waits.append((sem, d))
            snapshot = clock_at[d]
            for x in range(cores):
                if snapshot[x] > mine[x]:
                    mine[x] = snapshot[x]
            if position[d] > mine[dc]:
                mine[dc] = position[d]
        waits.append(mine_waits)
        position.append(counts[c])
        counts[c] += 1
        clock_at.append(tuple(mine))
        mine[c] = position[index]

    streams: list[list[Instr]] = [[] for _ in range(cores)]
    # the program repeats a few hundred distinct boxes thousands of times: one tuple each
    # (the program outlives the compile, and each tuple is one more object to collect)
    boxes: dict[Box, Box] = {}
    operands: dict[TileInput, Operand] = {}
    wait_on = [SemWait(sem, 1) for sem in range(len(post_after))]  # a post is waited on ~3x
    for index, op in enumerate(ops):
        stream = streams[op.core]
        for sem, _ in waits[index]:
            stream.append(wait_on[sem])
        stream.append(_instr(op, at, id_map, boxes, operands, graph))
        if index in post_after:
            stream.append(SemPost(post_after[index]))
    setup: list[list[Instr]] = [[] for _ in range(cores)]
    for op in schedule.setup:
        setup[op.core].append(_instr(op, at, id_map, boxes, operands))
    for c in range(cores):
        vtcm_used[c] = max(vtcm_used[c], resident if resident else 0)
    return streams, setup, len(post_after), vtcm_used


def _instr(
    op: Op,
    resolve: Callable[[BufRef], int],
    id_map: dict[int, int],
    boxes: dict[Box, Box],
    operands: dict[TileInput, Operand],
    graph: LoweredGraph | None = None,
) -> Instr:
    """The instruction of `op`, its boxes the ones of `boxes` and its inputs the ones of
    `operands` (equal boxes, equal operands: one object each)."""
    one = boxes.setdefault
    if op.kind == LOAD:
        assert op.dst is not None
        return DmaLoad(
            id_map[op.tensor],
            one(op.box, op.box),
            resolve(op.dst),
            one(op.dst_box, op.dst_box),
            op.mask,
            op.kernel,
        )
    if op.kind == STORE:
        assert op.src is not None
        return DmaStore(
            id_map[op.tensor],
            one(op.box, op.box),
            resolve(op.src),
            one(op.src_box, op.src_box),
            op.kernel,
        )
    if op.kind == NOC:
        assert op.src is not None and op.dst is not None
        return NocCopy(
            id_map[op.tensor],
            one(op.box, op.box),
            resolve(op.src),
            one(op.src_box, op.src_box),
            resolve(op.dst),
            one(op.dst_box, op.dst_box),
            op.mask,
            op.kernel,
        )
    if op.kind == LINK_SEND:
        assert graph is not None
        out = graph.kernels[op.kernel].desc.outputs[0]
        return LinkSend(id_map[op.tensor], op.box, op.mask, id_map[out], op.dst_box, op.kernel)
    if op.kind == LINK_WAIT:
        return LinkWait(id_map[op.tensor], op.mask, op.kernel)
    if op.kind == GATHER:
        assert op.src is not None and op.dst is not None and graph is not None
        desc = graph.kernels[op.kernel].desc
        axis = int(desc.info.attr("axis", 0)) % len(graph.tensors[desc.inputs[0]].shape)
        return DmaGather(
            tensor=id_map[op.tensor],
            axis=axis,
            box=op.box,
            indices=id_map[desc.inputs[1]],
            index_vtcm=resolve(op.src),
            index_box=op.src_box,
            out=id_map[desc.outputs[0]],
            out_box=op.out_box,
            vtcm=resolve(op.dst),
            buf_box=op.dst_box,
            kernel=op.kernel,
        )
    ins: list[Operand | None] = []
    for operand in op.inputs:
        if operand is None:
            ins.append(None)
            continue
        made = operands.get(operand)
        if made is None:  # tiles read the same operand (a resident weight's box) many times
            made = operands[operand] = Operand(
                one(operand.box, operand.box),
                tuple(Piece(resolve(ref), one(box, box)) for ref, box in operand.parts),
            )
        ins.append(made)
    if op.kind == SCATTER:
        assert graph is not None
        desc = graph.kernels[op.kernel].desc
        # imported here: importing the compiler loads no op module (ops load on lookup)
        from compiler_core.ops.in_place_scatter import dma_axis
        from compiler_core.ops.in_place_scatter import operands as scatter_operands

        u, i = scatter_operands(desc.info.op_type)
        update, indices = ins[u], ins[i]
        assert update is not None and indices is not None
        return DmaScatter(
            tensor=id_map[op.tensor],
            axis=dma_axis(desc.info),
            box=op.box,
            source=id_map[desc.inputs[u]],
            update=update,
            index=id_map[desc.inputs[i]],
            indices=indices,
            kernel=op.kernel,
        )
    outs: list[Operand | None] = []
    for result in op.outputs:  # a loop, not a generator (a frame of its own)
        if result is None:
            outs.append(None)
        else:
            piece = Piece(resolve(result.ref), one(result.held, result.held))
            outs.append(Operand(one(result.box, result.box), (piece,)))
    return RunKernel(op.kernel, one(op.out_box, op.out_box), tuple(ins), tuple(outs))


def _onchip(graph: LoweredGraph, tid: int, chip: frozenset[int]) -> bool:
    """Only in VTCM: kept on chip and not a graph output (outputs are stored as well)."""
    root = graph.root(tid)
    return root in chip and graph.tensors[root].kind != KIND_OUTPUT


def _tensor_ids(graph: LoweredGraph, plan: MemoryPlan, chip: frozenset[int]) -> dict[int, int]:
    kept = [
        t for t in graph.tensors if graph.root(t.id) in plan.offsets or graph.root(t.id) in chip
    ]
    return {t.id: i for i, t in enumerate(kept)}


def emit_program(
    graph: LoweredGraph, plan: MemoryPlan, schedule: Schedule, resident: int
) -> Program:
    chip = schedule.placement.chip
    id_map = _tensor_ids(graph, plan, chip)
    tensors = [
        TensorDesc(
            id=id_map[t.id],
            name=t.name,
            dtype=t.dtype,
            shape=t.shape,
            kind=KIND_ONCHIP if _onchip(graph, t.id, chip) else t.kind,
            ddr_offset=(
                0
                if _onchip(graph, t.id, chip)
                else plan.offset(graph, t.id) + graph.offset_in_root(t.id)
            ),
            nbytes=t.nbytes,
        )
        for t in graph.tensors
        if t.id in id_map
    ]
    kernels = []
    for lk in graph.kernels:
        desc = lk.desc
        kernels.append(
            type(desc)(
                id=desc.id,
                name=desc.name,
                info=desc.info,
                inputs=tuple(-1 if t < 0 else id_map[t] for t in desc.inputs),
                outputs=tuple(-1 if t < 0 else id_map[t] for t in desc.outputs),
                epilogue=desc.epilogue,
                kernel=desc.kernel,
                unit=desc.unit,
                macs=desc.macs,
                nodes=desc.nodes,
                op_types=desc.op_types,
            )
        )
    streams, setup, num_semaphores, vtcm_used = materialize(schedule, graph, plan, resident)
    meta: dict[str, object] = {}
    if graph.retained:
        meta["retained_state"] = [[id_map[i], id_map[o]] for i, o in graph.retained.items()]
    return Program(
        tensors=tensors,
        kernels=kernels,
        streams=streams,
        num_semaphores=num_semaphores,
        ddr_size=plan.ddr_size,
        constants_size=plan.constants_size,
        vtcm_used=vtcm_used,
        inputs=[id_map[t] for t in graph.inputs],
        outputs=[id_map[t] for t in graph.outputs],
        setup=setup,
        resident=resident,
        meta=meta,
    )


__all__ = [
    "KIND_INPUT",
    "KIND_OUTPUT",
    "Placement",
    "Schedule",
    "build_schedule",
    "emit_program",
]
