"""The accesses of one DDR tensor that later accesses may conflict with: (box, op) pairs.

Emit asks, for every load and store, which earlier accesses of the tensor its box meets, and
drops those a store covers. A big decoder's tensors collect a thousand tile accesses each, and
a Python loop over all of them per access made hazard tracking quadratic; past a few entries
the boxes live in arrays and one comparison answers for all of them. A `None` box is the
whole tensor: it meets every box and no box covers it.
"""

from __future__ import annotations

import numpy as np

from compiler_core.ops.registry import Box

SMALL = 16
"""Up to this many entries a plain loop is faster than the array comparison."""


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of one rank, or None when they do not overlap."""
    if len(a) == 4:  # a feature map's box, unrolled (thousands of calls per schedule)
        (a0, a1), (b0, b1), (c0, c1), (d0, d1) = a
        (e0, e1), (f0, f1), (g0, g1), (h0, h1) = b
        lo0, hi0 = (a0 if a0 > e0 else e0), (a1 if a1 < e1 else e1)
        lo1, hi1 = (b0 if b0 > f0 else f0), (b1 if b1 < f1 else f1)
        lo2, hi2 = (c0 if c0 > g0 else g0), (c1 if c1 < g1 else g1)
        lo3, hi3 = (d0 if d0 > h0 else h0), (d1 if d1 < h1 else h1)
        if lo0 >= hi0 or lo1 >= hi1 or lo2 >= hi2 or lo3 >= hi3:
            return None
        return ((lo0, hi0), (lo1, hi1), (lo2, hi2), (lo3, hi3))
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo = a0 if a0 > b0 else b0
        hi = a1 if a1 < b1 else b1
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def meets(a: Box | None, b: Box | None) -> bool:
    return a is None or b is None or intersect(a, b) is not None


def covers(outer: Box, inner: Box | None) -> bool:
    return inner is not None and all(
        o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True)
    )


class BoxLog:
    """(box, op) entries of one tensor of rank `rank`."""

    __slots__ = ("rank", "entries", "lo", "hi", "whole", "ops", "n")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.entries: list[tuple[Box | None, int]] | None = []
        """The entries while there are few; None once they moved into the arrays."""
        self.lo = np.empty((0, rank), dtype=np.int64)
        self.hi = np.empty((0, rank), dtype=np.int64)
        self.whole = np.empty(0, dtype=bool)
        self.ops = np.empty(0, dtype=np.int64)
        self.n = 0

    def __len__(self) -> int:
        return len(self.entries) if self.entries is not None else self.n

    def add(self, box: Box | None, op: int) -> None:
        if self.entries is not None:
            self.entries.append((box, op))
            if len(self.entries) > SMALL:
                self._to_arrays()
            return
        if self.n == len(self.ops):
            self._grow(2 * self.n)
        n = self.n
        if box is None:
            self.whole[n] = True
        else:
            self.whole[n] = False
            self.lo[n] = [d[0] for d in box]
            self.hi[n] = [d[1] for d in box]
        self.ops[n] = op
        self.n = n + 1

    def meeting(self, box: Box | None) -> list[int]:
        """The ops of the entries that `box` meets."""
        if self.entries is not None:
            return [op for b, op in self.entries if meets(b, box)]
        n = self.n
        if box is None:
            return self.ops[:n].tolist()
        lo, hi = self._bounds(box)
        if any(a >= b for a, b in box):  # an empty box meets only whole-tensor entries
            return self.ops[:n][self.whole[:n]].tolist()
        elo, ehi = self.lo[:n], self.hi[:n]
        hit = np.all((elo < hi) & (lo < ehi) & (elo < ehi), axis=1) | self.whole[:n]
        return self.ops[:n][hit].tolist()

    def drop_covered(self, box: Box) -> None:
        """Forget the entries `box` covers (a later write of all their bytes)."""
        if self.entries is not None:
            self.entries = [(b, op) for b, op in self.entries if not covers(box, b)]
            return
        n = self.n
        lo, hi = self._bounds(box)
        gone = np.all((lo <= self.lo[:n]) & (self.hi[:n] <= hi), axis=1) & ~self.whole[:n]
        if not gone.any():
            return
        keep = np.flatnonzero(~gone)
        m = len(keep)
        self.lo[:m] = self.lo[keep]
        self.hi[:m] = self.hi[keep]
        self.whole[:m] = self.whole[keep]
        self.ops[:m] = self.ops[keep]
        self.n = m

    def clear(self) -> None:
        self.entries = []
        self.n = 0

    def all_ops(self) -> list[int]:
        if self.entries is not None:
            return [op for _, op in self.entries]
        return self.ops[: self.n].tolist()

    def _bounds(self, box: Box) -> tuple[np.ndarray, np.ndarray]:
        return (
            np.array([d[0] for d in box], dtype=np.int64),
            np.array([d[1] for d in box], dtype=np.int64),
        )

    def _to_arrays(self) -> None:
        entries = self.entries
        assert entries is not None
        self.entries = None
        self.n = 0
        self._grow(4 * len(entries))
        for box, op in entries:
            self.add(box, op)

    def _grow(self, capacity: int) -> None:
        capacity = max(capacity, 4 * SMALL)
        n = self.n
        lo = np.empty((capacity, self.rank), dtype=np.int64)
        hi = np.empty((capacity, self.rank), dtype=np.int64)
        whole = np.empty(capacity, dtype=bool)
        ops = np.empty(capacity, dtype=np.int64)
        lo[:n], hi[:n], whole[:n], ops[:n] = self.lo[:n], self.hi[:n], self.whole[:n], self.ops[:n]
        self.lo, self.hi, self.whole, self.ops = lo, hi, whole, ops
