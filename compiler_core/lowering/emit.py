"""Turn tiled kernels and the memory plan into per-core streams of DMA, kernel and semaphores.

Each kernel owns one semaphore; every core that runs tiles of it posts once when done. Before
its first tile of a kernel, a core waits for every earlier kernel it depends on: the writers of
what it reads (read after write), and the readers and writers of the DDR bytes it is about to
overwrite, which liveness-based reuse makes possible (write after read, write after write).
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import numpy as np

from compiler_core.lowering.lower import LoweredGraph
from compiler_core.lowering.memory import MemoryPlan
from compiler_core.lowering.program import (
    DmaLoad,
    DmaStore,
    Instr,
    Operand,
    Program,
    RunKernel,
    SemPost,
    SemWait,
    TensorDesc,
)
from compiler_core.ops.registry import box_shape, full_box

ALIGN = 64


def _bytes(box: tuple[tuple[int, int], ...], dtype: str) -> int:
    n = int(np.prod(box_shape(box), dtype=np.int64)) * np.dtype(dtype).itemsize
    return (n + ALIGN - 1) // ALIGN * ALIGN


class _Hazards:
    """Who last wrote each DDR byte range and who read it since: the kernels a new access
    must wait for. Earlier accessors need no wait: the last writer waited for them already."""

    def __init__(self) -> None:
        self.bounds: list[int] = []  # sorted segment starts; a segment runs to the next bound
        self.writer: list[int] = []  # per segment, -1 when never written
        self.readers: list[tuple[int, ...]] = []

    def _split(self, at: int) -> int:
        """Index of the segment starting at `at`, splitting the one that contains it."""
        i = bisect.bisect_left(self.bounds, at)
        if i < len(self.bounds) and self.bounds[i] == at:
            return i
        if i == 0:
            self.bounds.insert(0, at)
            self.writer.insert(0, -1)
            self.readers.insert(0, ())
            return 0
        self.bounds.insert(i, at)
        self.writer.insert(i, self.writer[i - 1])
        self.readers.insert(i, self.readers[i - 1])
        return i

    def _segments(self, start: int, stop: int) -> range:
        first = self._split(start)
        last = self._split(stop)
        return range(first, last)

    def read(self, start: int, stop: int, kernel: int, deps: set[int]) -> None:
        for i in self._segments(start, stop):
            if self.writer[i] >= 0:
                deps.add(self.writer[i])
            if kernel not in self.readers[i]:
                self.readers[i] = (*self.readers[i], kernel)

    def write(self, start: int, stop: int, kernel: int, deps: set[int]) -> None:
        for i in self._segments(start, stop):
            if self.writer[i] >= 0:
                deps.add(self.writer[i])
            deps.update(self.readers[i])
            self.writer[i] = kernel
            self.readers[i] = ()


def _dependencies(graph: LoweredGraph, plan: MemoryPlan) -> list[set[int]]:
    """For every kernel, the earlier kernels it must wait for: writers of what it reads
    (read after write), and readers and writers of the bytes it overwrites (write after read
    or write, which liveness-based reuse makes possible)."""
    ranges: dict[int, tuple[int, int]] = {}
    for t in graph.tensors:
        root = graph.root(t.id)
        if root in plan.offsets and graph.tensors[root].nbytes > 0:
            start = plan.offsets[root]
            ranges[t.id] = (start, start + graph.tensors[root].nbytes)
    hazards = _Hazards()
    deps: list[set[int]] = []
    for index, kernel in enumerate(graph.kernels):
        mine: set[int] = set()
        reads = {ranges[t] for t in kernel.desc.inputs if t >= 0 and t in ranges}
        writes = {ranges[t] for t in kernel.desc.outputs if t >= 0 and t in ranges}
        for start, stop in sorted(reads):
            hazards.read(start, stop, index, mine)
        for start, stop in sorted(writes):
            hazards.write(start, stop, index, mine)
        mine.discard(index)
        deps.append(mine)
    return deps


def emit_program(graph: LoweredGraph, plan: MemoryPlan) -> Program:
    tensors = [
        TensorDesc(
            id=t.id,
            name=t.name,
            dtype=t.dtype,
            shape=t.shape,
            kind=t.kind,
            ddr_offset=plan.offset(graph, t.id),
            nbytes=t.nbytes,
        )
        for t in graph.tensors
        if graph.root(t.id) in plan.offsets
    ]
    # Tensors never referenced are dropped from the table; keep ids dense by remapping.
    id_map = {t.id: i for i, t in enumerate(tensors)}
    tensors = [
        TensorDesc(id_map[t.id], t.name, t.dtype, t.shape, t.kind, t.ddr_offset, t.nbytes)
        for t in tensors
    ]

    deps = _dependencies(graph, plan)
    cores_of = [sorted({tile.core for tile in k.tiles}) for k in graph.kernels]
    # Everything a kernel waited for is complete once it posts: waiting for it implies them.
    # Bit sets (Python ints): kernel d's bit is set when d is known to be complete.
    implied: list[int] = []
    for index in range(len(graph.kernels)):
        closure = 0
        for dep in deps[index]:
            closure |= (1 << dep) | implied[dep]
        implied.append(closure)
    known: list[int] = [0] * graph.num_cores
    streams: list[list[Instr]] = [[] for _ in range(graph.num_cores)]
    vtcm_used = [0] * graph.num_cores
    kernels = []
    for index, kernel in enumerate(graph.kernels):
        desc = kernel.desc
        remapped = type(desc)(
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
        kernels.append(remapped)
        by_core: dict[int, list] = defaultdict(list)
        for tile in kernel.tiles:
            by_core[tile.core].append(tile)
        for core in cores_of[index]:
            stream = streams[core]
            for dep in sorted(deps[index], reverse=True):
                if known[core] >> dep & 1:
                    continue
                if cores_of[dep] != [core]:
                    stream.append(SemWait(sem=dep, count=len(cores_of[dep])))
                known[core] |= (1 << dep) | implied[dep]
            for tile in by_core[core]:
                cursor = 0
                in_ops: list[Operand | None] = []
                for tid, box in zip(remapped.inputs, tile.in_boxes, strict=True):
                    if tid < 0 or box is None:
                        in_ops.append(None)
                        continue
                    stream.append(DmaLoad(tensor=tid, box=box, vtcm=cursor))
                    in_ops.append(Operand(vtcm=cursor, box=box))
                    cursor += _bytes(box, tensors[tid].dtype)
                out_ops: list[Operand | None] = []
                for tid in remapped.outputs:
                    if tid < 0:
                        out_ops.append(None)  # an unnamed optional output: computed, dropped
                        continue
                    # Only single-output kernels are tiled; the others write whole outputs.
                    single = len(remapped.outputs) == 1
                    box = tile.out_box if single else full_box(tensors[tid].shape)
                    out_ops.append(Operand(vtcm=cursor, box=box))
                    cursor += _bytes(box, tensors[tid].dtype)
                stream.append(
                    RunKernel(
                        kernel=index,
                        out_box=tile.out_box,
                        inputs=tuple(in_ops),
                        outputs=tuple(out_ops),
                    )
                )
                for tid, operand in zip(remapped.outputs, out_ops, strict=True):
                    if operand is not None:
                        stream.append(DmaStore(tensor=tid, box=operand.box, vtcm=operand.vtcm))
                vtcm_used[core] = max(vtcm_used[core], cursor)
            stream.append(SemPost(sem=index))
            if cores_of[index] == [core]:
                known[core] |= 1 << index

    return Program(
        tensors=tensors,
        kernels=kernels,
        streams=streams,
        num_semaphores=len(graph.kernels),
        ddr_size=plan.ddr_size,
        constants_size=plan.constants_size,
        vtcm_used=vtcm_used,
        inputs=[id_map[t] for t in graph.inputs],
        outputs=[id_map[t] for t in graph.outputs],
    )
