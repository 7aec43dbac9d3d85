"""Constant loads whose bytes are moved only when something needs them as VTCM bytes.

A DMA load of a whole buffer from a constant tensor is most of the bytes an inference
moves when weights stream (BERT-base: 0.54 GB per inference on 14 cores), and the kernel
that reads the buffer next could read the constant itself. So such a load records "this
buffer holds that constant box" instead of copying, and every later access to the core's
VTCM goes through this record, which keeps the runtime exactly as strict as if it had
copied:

- a kernel operand that is exactly a deferred buffer reads the constant (a read-only view);
- any other read of bytes a deferred buffer covers (a store, a NoC copy, a joined operand,
  a gather's indices) first writes the constant into VTCM (`settle`);
- a write over the whole of a deferred buffer drops the record (the copy would have been
  overwritten); a write over part of it first writes the constant (`overwrite`);
- an inference starts with no record (its VTCM is zeroed).

The source is a constant, which nothing can change, so settling late gives the bytes an
early copy would have: what a core reads, and so every race a missing semaphore wait
exposes, is unchanged. Byte counts are the instruction's, as before.

The records follow from the order of the accesses alone (their byte ranges, not the bytes),
and a program's streams access VTCM in the same order in every inference (the cores run
until blocked in turn, and what blocks them is semaphore counts, not data). So an inference
that runs to its end is recorded: per access, the constant rows it wrote into VTCM, the view
it handed a kernel and which cores' records it emptied or started. The later inferences
replay that list (`start`, `finish`) instead of looking the records up, which is most of
what the records cost on many cores; an access out of the recorded order is a fault.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import NamedTuple

import numpy as np


class _Access(NamedTuple):
    """One recorded access: its byte range, the constant bytes it wrote (VTCM view,
    constant view), its result (`source`) and the cores whose records it emptied (False)
    or started (True)."""

    start: int
    end: int
    writes: tuple[tuple[np.ndarray, np.ndarray], ...]
    result: np.ndarray | None
    pending: tuple[tuple[int, bool], ...]


_HELD: list[int] = [-1]
"""`pending` of a core with records while replaying (never changed)."""


class ReplayFault(RuntimeError):
    """An inference accessed VTCM out of the order the recorded one did."""


class DeferredLoads:
    """Per core, the deferred buffers: disjoint byte ranges [start, end) of its VTCM, each
    with the VTCM view it stands for and the constant view that fills it. `replay` False:
    every inference looks the records up (the answers are the same)."""

    def __init__(self, num_cores: int, replay: bool = True) -> None:
        self.replay = replay
        self.pending: list[list[int]] = [[] for _ in range(num_cores)]
        """Per core, the starts of its deferred buffers, sorted (empty: nothing deferred)."""
        self._entries: list[dict[int, tuple[int, np.ndarray, np.ndarray]]] = [
            {} for _ in range(num_cores)
        ]
        """Per core, by start: (end, VTCM view, constant view)."""
        self._plan: list[_Access] | None = None
        """The accesses of the last inference recorded to its end."""
        self._replaying: list[_Access] | None = None
        """`_plan` while this inference replays it."""
        self._at = 0
        """The next access to replay."""
        self._trace: list[_Access] | None = None
        """This inference's accesses, while it records them."""
        self._writes: list[tuple[np.ndarray, np.ndarray]] = []
        self._touched: dict[int, bool] = {}
        """Cores whose records the access changes: whether each had any before."""

    def clear(self) -> None:
        """The inference VTCM was zeroed: nothing is deferred (and nothing recorded)."""
        self.pending = [[] for _ in self.pending]
        for entries in self._entries:
            entries.clear()
        self._replaying = self._trace = None

    def start(self, *, fresh: bool) -> None:
        """An inference begins with its VTCM zeroed: it replays the recorded one, or is
        recorded (`fresh`: the streams were decoded anew, so nothing recorded applies)."""
        self.clear()
        if fresh or not self.replay:
            self._plan = None
        self._at = 0
        if self._plan is not None:
            self._replaying = self._plan
        else:
            self._trace = []

    def finish(self) -> None:
        """The inference ran to its end: a recorded one is what the next ones replay."""
        if self._replaying is not None and self._at != len(self._replaying):
            raise ReplayFault(
                f"an inference made {self._at} deferred-load accesses, the recorded one "
                f"{len(self._replaying)}"
            )
        if self._trace is not None:
            self._plan = self._trace
        self._replaying = self._trace = None

    def defer(self, core: int, start: int, end: int, dst: np.ndarray, src: np.ndarray) -> None:
        """The whole buffer `dst` ([start, end) of `core`'s VTCM) now holds `src`."""
        if self._replaying is not None:
            self._follow(start, end)
            return
        if self._meets(core, start, end):
            self._cut(core, start, end, whole=True)
        self._add(core, start, end, dst, src)
        self._record(start, end)

    def source(self, core: int, start: int, end: int) -> np.ndarray | None:
        """The constant a buffer that is exactly [start, end) stands for, or None (then any
        deferred bytes inside it are settled, and the buffer itself is read)."""
        if self._replaying is not None:
            return self._follow(start, end)
        found = self._entries[core].get(start)
        if found is not None and found[0] == end:
            self._record(start, end, found[2])
            return found[2]
        if self._meets(core, start, end):
            self._cut(core, start, end, whole=False)
        self._record(start, end)
        return None

    def settle(self, core: int, start: int, end: int) -> None:
        """Bytes [start, end) of `core`'s VTCM are about to be read: write the deferred
        bytes there (whole rows of the first axis of each buffer they touch; the buffers'
        other rows stay deferred)."""
        if self._replaying is not None:
            self._follow(start, end)
            return
        if self._meets(core, start, end):
            self._cut(core, start, end, whole=False)
        self._record(start, end)

    def overwrite(self, core: int, start: int, end: int, *, whole: bool) -> None:
        """Bytes [start, end) of `core`'s VTCM are about to be written: every byte of that
        range (`whole`: the deferred bytes there are dropped) or only some of them (a box
        inside a buffer: they are written first, as a read would)."""
        if self._replaying is not None:
            self._follow(start, end)
            return
        if self._meets(core, start, end):
            self._cut(core, start, end, whole=whole)
        self._record(start, end)

    def overwrite_many(self, cores: list[int], start: int, end: int, *, whole: bool) -> None:
        """`overwrite` on each of `cores` (a multicast's targets: one range on each)."""
        if self._replaying is not None:
            self._follow(start, end)
            return
        for core in cores:
            if self._meets(core, start, end):
                self._cut(core, start, end, whole=whole)
        self._record(start, end)

    def _follow(self, start: int, end: int) -> np.ndarray | None:
        """Replay the next recorded access, which must be of the same bytes."""
        plan, at = self._replaying, self._at
        assert plan is not None
        if at >= len(plan) or plan[at].start != start or plan[at].end != end:
            raise ReplayFault(f"deferred-load access {at} to [{start}, {end}) out of order")
        access = plan[at]
        self._at = at + 1
        for dst, src in access.writes:
            dst[...] = src
        if access.pending:
            for core, held in access.pending:
                self.pending[core] = _HELD if held else []
        return access.result

    def _record(self, start: int, end: int, result: np.ndarray | None = None) -> None:
        """End an access: recorded, when this inference is."""
        writes, touched = self._writes, self._touched
        if self._trace is not None:
            changed = tuple(
                (core, bool(self.pending[core]))
                for core, had in touched.items()
                if bool(self.pending[core]) != had
            )
            self._trace.append(_Access(start, end, tuple(writes), result, changed))
        if writes:
            writes.clear()
        if touched:
            touched.clear()

    def _write(self, dst: np.ndarray, src: np.ndarray) -> None:
        dst[...] = src
        self._writes.append((dst, src))

    def _meets(self, core: int, start: int, end: int) -> bool:
        """Whether a deferred buffer of `core` overlaps [start, end): the last one starting
        before `end` is the only candidate, as they are disjoint."""
        starts = self.pending[core]
        if not starts:
            return False
        i = bisect_left(starts, end)
        return i > 0 and self._entries[core][starts[i - 1]][0] > start

    def _cut(self, core: int, start: int, end: int, *, whole: bool) -> None:
        """Take every deferred buffer meeting [start, end) apart by rows of its first axis:
        rows wholly outside stay deferred; rows inside are written, except those `whole`
        says the caller overwrites entirely."""
        self._touched.setdefault(core, True)
        for key in self._overlapping(core, start, end):
            found_end, dst, src = self._entries[core].pop(key)
            self.pending[core].remove(key)
            if dst.ndim == 0 or dst.shape[0] == 0 or dst.nbytes == 0:
                if not (whole and start <= key and found_end <= end):
                    self._write(dst, src)
                continue
            rows = dst.shape[0]
            row = dst.nbytes // rows
            head = max(0, (start - key) // row)  # rows [0, head) end at or before start
            tail = min(rows, -(-(end - key) // row))  # rows [tail, rows) begin at or after end
            if head > 0:
                self._add(core, key, key + head * row, dst[:head], src[:head])
            if tail < rows:
                self._add(core, key + tail * row, found_end, dst[tail:], src[tail:])
            if not whole:
                self._write(dst[head:tail], src[head:tail])
                continue
            first = key + head * row < start  # the first row inside straddles start
            if first:
                self._write(dst[head : head + 1], src[head : head + 1])
            if key + tail * row > end and not (first and tail - 1 == head):  # the last, end
                self._write(dst[tail - 1 : tail], src[tail - 1 : tail])

    def _add(self, core: int, start: int, end: int, dst: np.ndarray, src: np.ndarray) -> None:
        self._touched.setdefault(core, bool(self.pending[core]))
        insort(self.pending[core], start)
        self._entries[core][start] = (end, dst, src)

    def _overlapping(self, core: int, start: int, end: int) -> list[int]:
        starts = self.pending[core]
        if not starts:
            return []
        entries = self._entries[core]
        found = []
        i = bisect_left(starts, end) - 1
        while i >= 0 and entries[starts[i]][0] > start:  # disjoint: ends rise with starts
            found.append(starts[i])
            i -= 1
        return found
