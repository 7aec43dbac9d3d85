"""Hazards between VTCM accesses: per byte, the op that last wrote it and the latest op that
read it since, kept so that a transfer's strided byte runs cost about as much as one run.

Each byte is read by the ops of one core only (a core reads only its own VTCM; other cores
write into it, by DMA or NoC), so its latest reader stands for all the earlier ones: a post
is a fence of everything its core did before.

`materialize` (emit.py) orders each transfer by the bytes it touches: up to 128 equal runs a
fixed stride apart when cores fill a shared buffer side by side (each its columns of every
row). Each core's window is a `VtcmSpace` of its own, walked in offsets from 0 (one-digit
ints, on CPython's fast paths), and cut into blocks, sorted by start and tiling it:

- a *plain* block holds segments (absolute starts, each with its writer and readers), as
  many as `PLAIN_MAX`, and is halved past that so an insert shifts few of them;
- a *periodic* block repeats one period's segments (starts within the period) `count` times.

A strided write into a plain block's uniform segment makes a periodic block whose period is
the stride, and a later strided write with the same stride at a phase that fits in a period
changes that one period's segments for all the periods it covers. An access that meets a
periodic block otherwise takes the periods it touches apart (a single period or a run of
whole ones), and a strided write with another stride turns the block into plain segments.
Only the representation differs from byte-by-byte bookkeeping: every byte has the same
writer and readers, so every access finds the same ops.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence

COMPACT = (1 << 30) - 1
"""Offsets below this are one-digit ints, which CPython adds and compares on its fast paths
(a core's VTCM is a few MiB): a core's window is walked in its own offsets, from 0."""

PLAIN_MAX = 64
"""Segments a plain block holds before it is halved."""

STRIDED_MIN = 4
"""Runs of one strided write, falling in one uniform segment, that make a periodic block."""

REGRID_MAX = 8
"""A periodic block is seen with a period up to this many of its own to suit a stride."""

Progression = tuple[int, int, int, int]
"""Equal runs `(lo, length, stride, count)`: `[lo + k stride, lo + k stride + length)`."""


class _Block:
    """Segments: `offs` (absolute when plain, `period` 0; else within one period, from 0),
    each one's last writer and latest reader since (-1: none); a periodic block has `count`
    periods. `own`: no other block holds its lists (periodic blocks split off one another
    share theirs until one is written)."""

    __slots__ = ("count", "offs", "own", "period", "readers", "writer")

    def __init__(
        self,
        period: int,
        count: int,
        offs: list[int],
        writer: list[int],
        readers: list[int],
        own: bool = True,
    ) -> None:
        self.period = period
        self.count = count
        self.offs = offs
        self.writer = writer
        self.readers = readers
        self.own = own


def _read(b: _Block, lo: int, hi: int, lim: int, op: int, deps: set[int]) -> None:
    """A read of `[lo, hi)` (not empty) in `b`'s segments (which end at `lim`): the segments
    split at `lo` and `hi`."""
    offs, writer, readers = b.offs, b.writer, b.readers
    first = bisect_right(offs, lo) - 1
    if offs[first] != lo:
        first += 1
        offs.insert(first, lo)
        writer.insert(first, writer[first - 1])
        readers.insert(first, readers[first - 1])
    if hi < lim:
        last = bisect_left(offs, hi, first + 1)
        if last == len(offs) or offs[last] != hi:
            offs.insert(last, hi)
            writer.insert(last, writer[last - 1])
            readers.insert(last, readers[last - 1])
    else:
        last = len(offs)
    if last == first + 1:  # one segment, mostly
        deps.add(writer[first])
        readers[first] = op
    else:
        deps.update(writer[first:last])
        readers[first:last] = [op] * (last - first)


def _write_one(b: _Block, lo: int, hi: int, lim: int, op: int, deps: set[int]) -> None:
    """A write of `[lo, hi)` (not empty, before `lim`) in `b`'s segments: those it meets are
    found by bisection and replaced by slice (a run meets one or two segments, mostly)."""
    offs, writer, readers = b.offs, b.writer, b.readers
    i = bisect_right(offs, lo) - 1
    j = bisect_left(offs, hi, i + 1)  # segments i .. j - 1 meet the run
    if j == i + 1:  # one segment, mostly
        deps.add(writer[i])
        deps.add(readers[i])
    else:
        deps.update(writer[i:j])
        deps.update(readers[i:j])
    if (offs[j] if j < len(offs) else lim) > hi:  # the rest of segment j - 1, after the run
        offs.insert(j, hi)
        writer.insert(j, writer[j - 1])
        readers.insert(j, readers[j - 1])
    if offs[i] < lo:  # the part of segment i before the run
        i += 1
    if j == i + 1:  # the run replaces one segment
        offs[i] = lo
        writer[i] = op
        readers[i] = -1
    elif j == i:  # the run splits one segment
        offs.insert(i, lo)
        writer.insert(i, op)
        readers.insert(i, -1)
    else:
        offs[i:j] = (lo,)
        writer[i:j] = (op,)
        readers[i:j] = (-1,)


def _write(b: _Block, runs: Sequence[tuple[int, int]], lim: int, op: int, deps: set[int]) -> None:
    """A write of each run (ascending, disjoint, not empty, before `lim`) in one pass over
    `b`'s segments: those the runs cover are rebuilt at once."""
    offs, writer, readers = b.offs, b.writer, b.readers
    count = len(offs)
    first = i = bisect_right(offs, runs[0][0]) - 1
    pos = offs[i]
    end = offs[i + 1] if i + 1 < count else lim
    new_offs: list[int] = []
    new_writer: list[int] = []
    new_readers: list[int] = []
    for lo, hi in runs:
        while end <= lo:  # segments wholly before the run, as they are
            new_offs.append(pos)
            new_writer.append(writer[i])
            new_readers.append(readers[i])
            i += 1
            pos = end
            end = offs[i + 1] if i + 1 < count else lim
        if pos < lo:  # the part of segment i before the run
            new_offs.append(pos)
            new_writer.append(writer[i])
            new_readers.append(readers[i])
        while True:  # the segments the run meets
            deps.add(writer[i])
            deps.add(readers[i])
            if end >= hi:
                break
            i += 1
            end = offs[i + 1] if i + 1 < count else lim
        new_offs.append(lo)
        new_writer.append(op)
        new_readers.append(-1)
        pos = hi
        if end == hi:  # segment i ends with the run: the next one is current
            i += 1
            if i == count:
                break
            end = offs[i + 1] if i + 1 < count else lim
    if i < count:  # the rest of the current segment
        new_offs.append(pos)
        new_writer.append(writer[i])
        new_readers.append(readers[i])
    offs[first : i + 1] = new_offs
    writer[first : i + 1] = new_writer
    readers[first : i + 1] = new_readers


class VtcmHazards:
    """Every core's VTCM as one address space, a `window` of it per core (each access within
    one window): the last writer and the latest reader since of every byte (ops by global
    index); each access adds the ops it must wait for to `deps`, and -1 (no op) when a byte
    it meets has none. Each window is a `VtcmSpace` of its own, in its own offsets."""

    def __init__(self, core_of: list[int], window: int, end: int = 0) -> None:
        self.core_of = core_of
        """The core of every op, by global index."""
        self.window = window
        end = end if end else window
        self.end = end if end > COMPACT else COMPACT
        """Past every offset accessed in a window (the window's size, unless told less)."""
        self.spaces: dict[int, VtcmSpace] = {}

    def space(self, core: int) -> VtcmSpace:
        """Core `core`'s window, in offsets from its start."""
        found = self.spaces.get(core)
        if found is None:
            found = self.spaces[core] = VtcmSpace(core, self.core_of, self.end)
        return found

    def read(self, lo: int, hi: int, op: int, deps: set[int]) -> None:
        """A read by `op` of bytes in its own core's window."""
        core, lo = divmod(lo, self.window)
        self.space(core).read(lo, hi - core * self.window, op, deps)

    def write(self, lo: int, hi: int, op: int, deps: set[int]) -> None:
        core, lo = divmod(lo, self.window)
        self.space(core).write(lo, hi - core * self.window, op, deps)

    def write_runs(self, base: int, runs: Sequence[Progression], op: int, deps: set[int]) -> None:
        """A write of each progression's runs, offset by `base` (a transfer's bytes)."""
        for lo, length, stride, count in runs:
            core, at = divmod(base + lo, self.window)
            self.space(core).write_runs(at, ((0, length, stride, count),), op, deps)


def write_each(
    spaces: Sequence[VtcmSpace], base: int, runs: Sequence[Progression], op: int, deps: set[int]
) -> None:
    """`VtcmSpace.write_runs` in each of `spaces` (a multicast's targets): each progression
    is sorted out once for all of them. Exact: a space's accesses keep their order, and
    `deps` is a union whatever the order of the spaces."""
    for lo, length, stride, count in runs:
        if length <= 0:
            continue
        lo += base
        if count == 1 or stride == length:
            hi = lo + length * count
            for space in spaces:
                space._put(lo, hi, op, deps)
        elif stride > length:
            for space in spaces:
                space._strided(lo, length, stride, count, op, deps)
        else:  # overlapping runs: one by one
            for space in spaces:
                for k in range(count):
                    at = lo + k * stride
                    space._span(at, at + length, op, deps, False)


class VtcmSpace:
    """One core's window of VTCM, from offset 0 to `end` (past every byte accessed): per byte,
    the last writer and the latest reader since (ops by global index; only `core` reads)."""

    def __init__(self, core: int, core_of: list[int], end: int) -> None:
        self.starts: list[int] = [0]
        self.blocks: list[_Block] = [_Block(0, 1, [0], [-1], [-1])]
        self.core = core
        self.core_of = core_of
        self.end = end

    def read(self, lo: int, hi: int, op: int, deps: set[int]) -> None:
        """A read by `op`, of this core."""
        assert self.core_of[op] == self.core, "a core reads only its own VTCM"
        if hi <= lo:
            return
        starts = self.starts
        i = bisect_right(starts, lo) - 1
        b = self.blocks[i]
        end = starts[i + 1] if i + 1 < len(starts) else self.end
        if b.period or hi > end:  # a periodic block, or more than one block
            self._span(lo, hi, op, deps, True)
            return
        _read(b, lo, hi, end, op, deps)  # in one plain block, mostly
        if len(b.offs) > PLAIN_MAX:
            self._halve(i)

    def write(self, lo: int, hi: int, op: int, deps: set[int]) -> None:
        if hi > lo:
            self._put(lo, hi, op, deps)

    def write_runs(self, base: int, runs: Sequence[Progression], op: int, deps: set[int]) -> None:
        """A write of each progression's runs, offset by `base` (a transfer's bytes)."""
        write_each((self,), base, runs, op, deps)

    # ------------------------------------------------------------------ accesses
    def _put(self, lo: int, hi: int, op: int, deps: set[int]) -> None:
        """A write of `[lo, hi)` (not empty)."""
        starts = self.starts
        i = bisect_right(starts, lo) - 1
        b = self.blocks[i]
        end = starts[i + 1] if i + 1 < len(starts) else self.end
        if b.period or hi > end:  # a periodic block, or more than one block
            self._span(lo, hi, op, deps, False)
            return
        _write_one(b, lo, hi, end, op, deps)  # in one plain block, mostly
        if len(b.offs) > PLAIN_MAX:
            self._halve(i)
        elif len(b.offs) == 1:  # the block is one segment now: it may join a neighbour
            self._join(i - 1, i + 1)

    def _span(self, lo: int, hi: int, op: int, deps: set[int], read: bool) -> None:
        starts, blocks = self.starts, self.blocks
        i = first = bisect_right(starts, lo) - 1
        pos = lo
        while pos < hi:
            b = blocks[i]
            start = starts[i]
            end = starts[i + 1] if i + 1 < len(starts) else self.end
            period = b.period
            if not period:
                stop = hi if hi < end else end
                if read:
                    _read(b, pos, stop, end, op, deps)
                else:
                    _write_one(b, pos, stop, end, op, deps)
                if len(b.offs) > PLAIN_MAX:
                    self._halve(i)
                    i += 1
                i += 1
                pos = end
                continue
            q, phase = divmod(pos - start, period)
            stop = (hi if hi < end else end) - start
            if phase or stop < (q + 1) * period:  # within period q
                i = self._periods(i, q, q + 1)
                stop -= q * period
                stop = stop if stop < period else period
                if read:
                    _read(blocks[i], phase, stop, period, op, deps)
                else:
                    _write_one(blocks[i], phase, stop, period, op, deps)
            else:  # whole periods
                i = self._periods(i, q, stop // period)
                if read:
                    _read(blocks[i], 0, period, period, op, deps)
                else:
                    _write_one(blocks[i], 0, period, period, op, deps)
                    blocks[i] = _Block(0, 1, [starts[i]], [op], [-1])
            i += 1
            pos = starts[i] if i < len(starts) else self.end
        if not read:
            self._join(first - 1, i)

    def _strided(
        self, lo0: int, length: int, stride: int, count: int, op: int, deps: set[int]
    ) -> None:
        """A write of `[lo0 + k stride, lo0 + k stride + length)` for k < count."""
        starts, blocks = self.starts, self.blocks
        k = 0
        while k < count:
            lo = lo0 + k * stride
            i = bisect_right(starts, lo) - 1
            b = blocks[i]
            start = starts[i]
            end = starts[i + 1] if i + 1 < len(starts) else self.end
            period = b.period
            if not period:
                last = (end - length - lo0) // stride  # the last run inside
                last = last if last < count else count - 1
                if last < k:  # run k crosses the block's end
                    self._span(lo, lo + length, op, deps, False)
                    k += 1
                    continue
                if last - k + 1 >= STRIDED_MIN:
                    offs = b.offs
                    j = bisect_right(offs, lo) - 1
                    seg_end = offs[j + 1] if j + 1 < len(offs) else end
                    n = (seg_end - lo) // stride
                    n = n if n <= last - k else last - k + 1
                    if n >= STRIDED_MIN:  # periods of one segment: the next turn writes them
                        self._carve(i, j, lo, n, stride)
                        continue
                    # a later segment holding that many periods: the runs before it, then it
                    need = (STRIDED_MIN + 1) * stride
                    top = lo0 + (last + 1) * stride
                    segs = len(offs)
                    for x in range(j + 1, bisect_left(offs, top, j + 1)):
                        if (offs[x + 1] if x + 1 < segs else end) - offs[x] >= need:
                            break
                    else:
                        x = 0
                    if x:
                        stop = -(-(offs[x] - lo0) // stride)  # the first run from there
                        runs = [
                            (lo0 + y * stride, lo0 + y * stride + length) for y in range(k, stop)
                        ]
                        _write(b, runs, end, op, deps)
                        if len(b.offs) > PLAIN_MAX:
                            self._halve(i)
                        k = stop
                        continue
                if last == k:  # one run in this block (small blocks, one period each)
                    _write_one(b, lo, lo + length, end, op, deps)
                else:
                    runs = [
                        (lo0 + x * stride, lo0 + x * stride + length) for x in range(k, last + 1)
                    ]
                    _write(b, runs, end, op, deps)
                if len(b.offs) > PLAIN_MAX:
                    self._halve(i)
                k = last + 1
                continue
            q, phase = divmod(lo - start, period)
            first = phase % stride  # the phase of the period's first run
            if period % stride or first + length > stride:  # runs cross periods
                if not self._regrid(i, lo, length, stride, count - k):
                    self._expand(i)
                continue
            per = period // stride  # runs in a period
            if phase != first or count - k < per:  # the runs in period q
                n = (period - phase + stride - 1) // stride
                n = n if n < count - k else count - k
                i = self._periods(i, q, q + 1)
                runs = [(phase + x * stride, phase + x * stride + length) for x in range(n)]
                _write(blocks[i], runs, period, op, deps)
                k += n
                continue
            n = (count - k) // per  # whole periods: one's segments for all
            n = n if n < b.count - q else b.count - q
            i = self._periods(i, q, q + n)
            if per == 1:  # the stride is the period, mostly
                _write_one(blocks[i], first, first + length, period, op, deps)
            else:
                runs = [(first + x * stride, first + x * stride + length) for x in range(per)]
                _write(blocks[i], runs, period, op, deps)
            k += n * per

    # ------------------------------------------------------------------ block surgery
    def _periods(self, i: int, q0: int, q1: int) -> int:
        """Periods `[q0, q1)` of periodic block i as a block of their own, with lists of its
        own (blocks split off one another share theirs); its index."""
        b = self.blocks[i]
        if b.own and q0 == 0 and q1 == b.count:  # all of a block that shares nothing: itself
            return i
        start = self.starts[i]
        period = b.period
        new_starts: list[int] = []
        new_blocks: list[_Block] = []
        own = b.own and (q0 == 0 or q1 == b.count)  # the rest of b in one block
        if q0 > 0:
            new_starts.append(start)
            new_blocks.append(_Block(period, q0, b.offs, b.writer, b.readers, own))
        at = i + len(new_blocks)
        new_starts.append(start + q0 * period)
        new_blocks.append(_Block(period, q1 - q0, b.offs[:], b.writer[:], b.readers[:]))
        if q1 < b.count:
            new_starts.append(start + q1 * period)
            new_blocks.append(_Block(period, b.count - q1, b.offs, b.writer, b.readers, own))
        self.starts[i : i + 1] = new_starts
        self.blocks[i : i + 1] = new_blocks
        return at

    def _carve(self, i: int, j: int, lo: int, n: int, stride: int) -> None:
        """`n` periods of `stride` bytes from `lo`, inside segment j of plain block i, as a
        periodic block."""
        b = self.blocks[i]
        hi = lo + n * stride
        end = self.starts[i + 1] if i + 1 < len(self.starts) else self.end
        offs, writer, readers = b.offs, b.writer, b.readers
        new_starts: list[int] = []
        new_blocks: list[_Block] = []
        keep = j + 1 if offs[j] < lo else j  # the segments before `lo`
        if keep:
            new_starts.append(offs[0])
            new_blocks.append(_Block(0, 1, offs[:keep], writer[:keep], readers[:keep]))
        new_starts.append(lo)
        new_blocks.append(_Block(stride, n, [0], [writer[j]], [readers[j]]))
        if hi < end:
            new_starts.append(hi)
            if j + 1 < len(offs) and offs[j + 1] == hi:
                rest = _Block(0, 1, offs[j + 1 :], writer[j + 1 :], readers[j + 1 :])
            else:
                rest = _Block(0, 1, [hi, *offs[j + 1 :]], writer[j:], readers[j:])
            new_blocks.append(rest)
        self.starts[i : i + 1] = new_starts
        self.blocks[i : i + 1] = new_blocks

    def _regrid(self, i: int, lo: int, length: int, stride: int, left: int) -> bool:
        """Periodic block i seen from `lo` with a period both its own and `stride` divide,
        for as many whole such periods as the `left` runs from `lo` fill; whether it was."""
        b = self.blocks[i]
        start, period = self.starts[i], b.period
        grid = math.lcm(period, stride)
        if grid > REGRID_MAX * period:
            return False
        end = start + period * b.count
        fit = min(left, (end - length - lo) // stride + 1)  # runs inside the block
        n = min((end - lo) // grid, fit // (grid // stride))
        if n < 1:
            return False
        q, phase = divmod(lo - start, period)
        offs, writer, readers = b.offs, b.writer, b.readers
        j = bisect_right(offs, phase) - 1  # the segment at `phase`
        keep = j + 1 if offs[j] < phase else j  # the segments that start before it
        order = list(range(j, len(offs)))
        rel = [0, *(offs[x] - phase for x in range(j + 1, len(offs)))]
        order += range(keep)  # the period's start, after its end
        rel += (offs[x] + period - phase for x in range(keep))
        reps = range(0, grid, period)
        inner = _Block(
            grid,
            n,
            [x + r for r in reps for x in rel],
            [writer[x] for _ in reps for x in order],
            [readers[x] for _ in reps for x in order],
        )
        new_starts: list[int] = []
        new_blocks: list[_Block] = []
        if q:
            new_starts.append(start)
            new_blocks.append(_Block(period, q, offs, writer, readers, False))
        at = start + q * period
        if phase:  # the start of period q, before `lo`
            new_starts.append(at)
            new_blocks.append(
                _Block(0, 1, [at + x for x in offs[:keep]], writer[:keep], readers[:keep])
            )
        new_starts.append(lo)
        new_blocks.append(inner)
        q += n * (grid // period)  # the period holding the end of the new block
        at = start + q * period
        if phase:  # the rest of period q
            new_starts.append(at + phase)
            rest = [at + phase, *(at + x for x in offs[j + 1 :])]
            new_blocks.append(_Block(0, 1, rest, writer[j:], readers[j:]))
            q += 1
        if q < b.count:
            new_starts.append(start + q * period)
            new_blocks.append(_Block(period, b.count - q, offs, writer, readers, False))
        self.starts[i : i + 1] = new_starts
        self.blocks[i : i + 1] = new_blocks
        return True

    def _expand(self, i: int) -> None:
        """Periodic block i as plain blocks of its segments."""
        b = self.blocks[i]
        start, period = self.starts[i], b.period
        offs: list[int] = []
        for q in range(b.count):
            at = start + q * period
            offs += [at + o for o in b.offs]
        writer = b.writer * b.count
        readers = b.readers * b.count
        step = PLAIN_MAX // 2
        self.starts[i : i + 1] = offs[::step]
        self.blocks[i : i + 1] = [
            _Block(0, 1, offs[x : x + step], writer[x : x + step], readers[x : x + step])
            for x in range(0, len(offs), step)
        ]

    def _halve(self, i: int) -> None:
        b = self.blocks[i]
        h = len(b.offs) // 2
        rest = _Block(0, 1, b.offs[h:], b.writer[h:], b.readers[h:])
        del b.offs[h:], b.writer[h:], b.readers[h:]
        self.starts.insert(i + 1, rest.offs[0])
        self.blocks.insert(i + 1, rest)

    def _join(self, i: int, last: int) -> None:
        """Neighbouring plain blocks among `[i, last]` as one, while it stays small (a large
        write leaves one block per block it covered)."""
        blocks, starts = self.blocks, self.starts
        i = i if i > 0 else 0
        last = last if last < len(blocks) else len(blocks) - 1
        while i < last:
            a, b = blocks[i], blocks[i + 1]
            if a.period or b.period or len(a.offs) + len(b.offs) > PLAIN_MAX:
                i += 1
                continue
            skip = 1 if a.writer[-1] == b.writer[0] and a.readers[-1] == b.readers[0] else 0
            a.offs += b.offs[skip:]
            a.writer += b.writer[skip:]
            a.readers += b.readers[skip:]
            del blocks[i + 1], starts[i + 1]
            last -= 1
