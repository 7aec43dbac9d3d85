"""Place every tensor in DDR: constants, then graph I/O, then activations with reuse.

Activations share space when their lifetimes (first writing kernel to last reading kernel,
aliases included, extended by `-allocator-dealloc-delay`) do not overlap: a greedy best-offset
placement, largest first. Exceeding the device's DDR is an error that says by how much.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from compiler_core.errors import CompileError
from compiler_core.lowering.lowered import LoweredGraph
from compiler_core.lowering.program import (
    KIND_ACTIVATION,
    KIND_CONSTANT,
    KIND_INPUT,
    KIND_OUTPUT,
    LINK_KERNEL,
)

ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class MemoryPlan:
    offsets: dict[int, int]
    """DDR offset of every root tensor (aliases resolve through LoweredGraph.root)."""
    constants_size: int
    io_size: int
    activations_size: int
    ddr_size: int
    constant_order: list[int]
    lifetimes: dict[int, tuple[int, int]]

    def offset(self, graph: LoweredGraph, tensor_id: int) -> int:
        return self.offsets[graph.root(tensor_id)]


def used_constants(graph: LoweredGraph) -> list[int]:
    """The constants kernels read (aliases resolved), in the order they are first read."""
    order: list[int] = []
    seen: set[int] = set()
    for kernel in graph.kernels:
        for tid in kernel.desc.inputs:
            if tid < 0:
                continue
            root = graph.root(tid)
            if root not in seen and graph.tensors[root].kind == KIND_CONSTANT:
                seen.add(root)
                order.append(root)
    for tid in graph.outputs:
        root = graph.root(tid)
        if root not in seen and graph.tensors[root].kind == KIND_CONSTANT:
            seen.add(root)
            order.append(root)
    return order


@dataclass(frozen=True)
class SharedConstants:
    """A constants region laid out for several graphs: one graph's constant ids -> offsets."""

    offsets: dict[int, int]
    size: int


def shared_constant_offsets(
    keys: list[dict[int, Hashable]], sizes: dict[Hashable, int]
) -> tuple[list[SharedConstants], list[tuple[Hashable, int]]]:
    """Lay out the union of several graphs' constants once: equal keys (same name, type,
    shape, encoding and bytes) share one place. `keys[g]` maps graph g's constant ids to keys,
    in the order the graph first uses them; the second result lists (key, offset) in DDR
    order, the layout of the constants segment."""
    placed: dict[Hashable, int] = {}
    cursor = 0
    for graph_keys in keys:
        for key in graph_keys.values():
            if key not in placed:
                placed[key] = cursor
                cursor = _align(cursor + sizes[key])
    shared = [
        SharedConstants({tid: placed[key] for tid, key in graph_keys.items()}, cursor)
        for graph_keys in keys
    ]
    return shared, list(placed.items())


def plan_memory(
    graph: LoweredGraph,
    *,
    dealloc_delay: int = 0,
    ddr_capacity: int | None = None,
    extra_bytes: int = 0,
    shared_constants: SharedConstants | None = None,
    on_chip: frozenset[int] = frozenset(),
) -> MemoryPlan:
    """`shared_constants`: where every constant already lies (the region several
    specializations of one network share); otherwise constants are laid out here.
    `on_chip`: activations that live only in VTCM and take no DDR."""
    offsets: dict[int, int] = {}
    used_roots: list[int] = []
    seen: set[int] = set()
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for index, kernel in enumerate(graph.kernels):
        for tid in (*kernel.desc.inputs, *kernel.desc.outputs):
            if tid < 0:
                continue
            root = graph.root(tid)
            first.setdefault(root, index)
            last[root] = index
            if root not in seen:
                seen.add(root)
                used_roots.append(root)
    for tid in (*graph.inputs, *graph.outputs):
        root = graph.root(tid)
        if root not in seen:
            seen.add(root)
            used_roots.append(root)

    cursor = 0
    constant_order = used_constants(graph)
    if shared_constants is not None:
        for tid in constant_order:
            offsets[tid] = shared_constants.offsets[tid]
        cursor = shared_constants.size
    else:
        for tid in constant_order:
            offsets[tid] = cursor
            cursor = _align(cursor + graph.tensors[tid].nbytes)
    constants_size = cursor

    io_start = cursor
    for tid in used_roots:
        if graph.tensors[tid].kind in (KIND_INPUT, KIND_OUTPUT):
            offsets[tid] = cursor
            cursor = _align(cursor + graph.tensors[tid].nbytes)
    io_size = cursor - io_start

    act_start = cursor
    acts = [t for t in used_roots if graph.tensors[t].kind == KIND_ACTIVATION and t not in on_chip]
    lifetimes = {t: (first.get(t, 0), last.get(t, 0) + dealloc_delay) for t in acts}
    for kernel in graph.kernels:  # other devices write them when they get there: never reused
        if kernel.desc.kernel == LINK_KERNEL:
            for t in kernel.desc.outputs:
                if t >= 0 and graph.root(t) in lifetimes:
                    lifetimes[graph.root(t)] = (0, len(graph.kernels) + dealloc_delay)
    placed: list[tuple[int, int, int, int]] = []  # (offset, size, start, end)
    peak = 0
    for tid in sorted(acts, key=lambda t: (-graph.tensors[t].nbytes, lifetimes[t][0], t)):
        size = _align(max(graph.tensors[tid].nbytes, 1))
        start, end = lifetimes[tid]
        clashes = sorted((off, sz) for off, sz, s, e in placed if not (e < start or end < s))
        offset = 0
        for off, sz in clashes:
            if offset + size <= off:
                break
            offset = max(offset, off + sz)
        placed.append((offset, size, start, end))
        offsets[tid] = act_start + offset
        peak = max(peak, offset + size)
    activations_size = peak
    ddr_size = act_start + activations_size + extra_bytes
    if ddr_capacity is not None and ddr_size > ddr_capacity:
        raise CompileError(
            "ddr_overflow",
            f"the network needs {ddr_size:,} bytes of device DDR (constants {constants_size:,}, "
            f"I/O {io_size:,}, activations {activations_size:,}), {ddr_size - ddr_capacity:,} "
            f"bytes more than the device's {ddr_capacity:,}",
            details={"needed": ddr_size, "capacity": ddr_capacity},
        )
    return MemoryPlan(
        offsets=offsets,
        constants_size=constants_size,
        io_size=io_size,
        activations_size=activations_size,
        ddr_size=ddr_size,
        constant_order=constant_order,
        lifetimes=lifetimes,
    )
