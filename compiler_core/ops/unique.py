"""Unique: the distinct elements (or slices along an axis) of a tensor, with where each first
occurs, which distinct entry every element maps to, and how often each occurs.

The number of distinct entries depends on the data, so a static compiler takes it from the
graph outputs' declared shapes; the kernel refuses a run whose count differs from the
declaration instead of padding or truncating. It needs the whole tensor, so it runs as one
tile. Slices are compared as rows of a [count, rest] view: sorting orders them
lexicographically, like ONNX Runtime; unsorted order is that of first occurrence.
"""

from __future__ import annotations

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.registry import ALL, NodeInfo, TileCtx, register

Array = np.ndarray


def _axis(node: NodeInfo, rank: int) -> int | None:
    axis = node.attr("axis")
    if axis is None:
        return None
    value = int(axis)
    if not -rank <= value < rank:
        raise CompileError(
            "invalid_model",
            f"Unique: axis {value} is out of range for a rank-{rank} input",
            node=node.name,
        )
    return value + rank if value < 0 else value


def _rows(x: Array, axis: int | None) -> Array:
    """The entries to deduplicate as rows of a 2-D array."""
    if axis is None:
        return x.reshape(-1, 1)
    return np.moveaxis(x, axis, 0).reshape(x.shape[axis], -1)


def _first_occurrences(rows: Array) -> tuple[Array, Array]:
    """Sorted distinct rows' first indices, and each row's position among the distinct rows."""
    count = rows.shape[0]
    if count == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    order = np.lexsort(rows.T[::-1]) if rows.shape[1] else np.arange(count)
    ordered = rows[order]
    changes = np.ones(count, dtype=bool)
    if rows.shape[1]:
        changes[1:] = np.any(ordered[1:] != ordered[:-1], axis=1)
    else:
        changes[1:] = False
    group = np.cumsum(changes) - 1
    first = order[changes]  # lexsort is stable: the first of each group is its first occurrence
    inverse = np.empty(count, dtype=np.int64)
    inverse[order] = group
    return first.astype(np.int64), inverse


def _check_count(node: NodeInfo, distinct: int, axis: int | None) -> None:
    declared = [
        (name, shape)
        for name, shape in zip(
            ("Y", "indices", "inverse_indices", "counts"), node.out_shapes, strict=False
        )
        if name != "inverse_indices" and shape  # () marks an omitted output
    ]
    for name, shape in declared:
        length = shape[0] if name != "Y" or axis is None else shape[axis]
        if length != distinct:
            raise CompileError(
                "runtime_fault",
                f"Unique found {distinct} distinct entries but output {name} is declared "
                f"with shape {shape}",
                node=node.name,
            )


def unique_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = inputs[0]
    assert x is not None
    axis = _axis(node, x.ndim)
    rows = _rows(x, axis)
    first, inverse = _first_occurrences(rows)
    if not int(node.attr("sorted", 1)):
        by_position = np.argsort(first, kind="stable")
        rank = np.empty_like(by_position)
        rank[by_position] = np.arange(by_position.size)
        first, inverse = first[by_position], rank[inverse]
    counts = np.bincount(inverse, minlength=first.size).astype(np.int64)
    _check_count(node, int(first.size), axis)
    y = x.reshape(-1)[first] if axis is None else np.take(x, first, axis=axis)
    outputs = [y, first, inverse, counts]
    return outputs[: len(node.out_shapes)]


def unique_macs(node: NodeInfo) -> int:
    """A sort of the entries: about n log2 n comparisons of a slice each."""
    shape = node.in_shapes[0]
    assert shape is not None
    size = int(np.prod(shape, dtype=np.int64))
    axis = _axis(node, len(shape))
    n = size if axis is None else int(shape[axis])
    return max(1, size * max(1, int(np.log2(max(n, 2)))))


register(
    "Unique",
    unique_compute,
    since=11,
    dtypes=ALL,
    kernel="unique",
    macs=unique_macs,
    doc="Whole-tensor distinct elements or slices (sorted or first-occurrence order) with "
    "indices, inverse indices and counts; the distinct count must equal the declared shapes.",
)
