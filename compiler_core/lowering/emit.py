"""Turn tiled kernels and the memory plan into per-core streams of DMA, kernel and semaphores.

Each kernel owns one semaphore; every core that runs tiles of it posts once when done. Before
its first tile of a kernel, a core waits for every earlier kernel it depends on: the writers of
what it reads (read after write), and the readers and writers of the DDR bytes it is about to
overwrite, which liveness-based reuse makes possible (write after read, write after write).
"""

from __future__ import annotations

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


def _dependencies(graph: LoweredGraph, plan: MemoryPlan) -> list[set[int]]:
    ranges: dict[int, tuple[int, int]] = {}
    for t in graph.tensors:
        root = graph.root(t.id)
        if root in plan.offsets:
            start = plan.offsets[root]
            ranges[t.id] = (start, start + graph.tensors[root].nbytes)
    deps: list[set[int]] = []
    writes: list[list[tuple[int, int]]] = []
    reads: list[list[tuple[int, int]]] = []
    for index, kernel in enumerate(graph.kernels):
        r = [ranges[t] for t in kernel.desc.inputs if t >= 0 and t in ranges]
        w = [ranges[t] for t in kernel.desc.outputs if t in ranges]
        mine: set[int] = set()
        for prev in range(index):
            if any(_overlap(a, b) for a in r for b in writes[prev]) or any(
                _overlap(a, b) for a in w for b in (*writes[prev], *reads[prev])
            ):
                mine.add(prev)
        deps.append(mine)
        reads.append(r)
        writes.append(w)
    return deps


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def emit_program(graph: LoweredGraph, plan: MemoryPlan, *, extra_meta: dict | None = None
                 ) -> Program:
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
    implied: list[set[int]] = []
    for index in range(len(graph.kernels)):
        closure: set[int] = set()
        for dep in deps[index]:
            closure.add(dep)
            closure |= implied[dep]
        implied.append(closure)
    known: list[set[int]] = [set() for _ in range(graph.num_cores)]
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
            outputs=tuple(id_map[t] for t in desc.outputs),
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
                if dep in known[core]:
                    continue
                if cores_of[dep] != [core]:
                    stream.append(SemWait(sem=dep, count=len(cores_of[dep])))
                known[core].add(dep)
                known[core] |= implied[dep]
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
                out_ops: list[Operand] = []
                for position, tid in enumerate(remapped.outputs):
                    box = tile.out_box if position == 0 else full_box(tensors[tid].shape)
                    if len(remapped.outputs) > 1:
                        box = full_box(tensors[tid].shape)
                    out_ops.append(Operand(vtcm=cursor, box=box))
                    cursor += _bytes(box, tensors[tid].dtype)
                stream.append(
                    RunKernel(kernel=index, out_box=tile.out_box, inputs=tuple(in_ops),
                              outputs=tuple(out_ops))
                )
                for tid, operand in zip(remapped.outputs, out_ops, strict=True):
                    stream.append(DmaStore(tensor=tid, box=operand.box, vtcm=operand.vtcm))
                vtcm_used[core] = max(vtcm_used[core], cursor)
            stream.append(SemPost(sem=index))
            if cores_of[index] == [core]:
                known[core].add(index)

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
        meta=dict(extra_meta or {}),
    )
