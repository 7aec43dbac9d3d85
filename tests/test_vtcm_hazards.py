"""The emitter's VTCM hazards (`lowering/vtcm_hazards.py`) find, for every access, exactly the
ops that byte-by-byte bookkeeping finds: the last writer of each byte read, and the last writer
and readers since of each byte written (each core's latest reader standing for its earlier
ones), when every core reads only its own window of the address space, as the emitter's cores
read only their own VTCM. Periodic blocks and one reader per byte are a representation only;
these tests compare every access's ops with a plain sorted segment list that keeps each
core's readers, on random strided traffic and on a 14-core compile's own."""

from __future__ import annotations

import bisect
import itertools
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from compiler_core import compile_model
from compiler_core.lowering import emit
from compiler_core.lowering.emit import VTCM_SPAN
from compiler_core.lowering.program import BYTE_RUNS, box_byte_progressions, box_byte_range
from compiler_core.lowering.vtcm_hazards import Progression, VtcmHazards, VtcmSpace, write_each
from tests.codegen_models import conv_net


class _Reference:
    """One sorted list of segments over the whole address space, split at every access."""

    def __init__(self, core_of: list[int]) -> None:
        self.bounds = [0]
        self.writer = [-1]
        self.readers: list[tuple[int, ...]] = [()]
        self.core_of = core_of

    def _split(self, at: int) -> int:
        i = bisect.bisect_right(self.bounds, at) - 1
        if self.bounds[i] != at:
            i += 1
            self.bounds.insert(i, at)
            self.writer.insert(i, self.writer[i - 1])
            self.readers.insert(i, self.readers[i - 1])
        return i

    def read(self, lo: int, hi: int, op: int, deps: set[int]) -> None:
        core = self.core_of[op]
        for i in range(self._split(lo), self._split(hi)):
            if self.writer[i] >= 0:
                deps.add(self.writer[i])
            kept = (r for r in self.readers[i] if self.core_of[r] != core)
            self.readers[i] = (*kept, op)

    def write(self, lo: int, hi: int, op: int, deps: set[int]) -> None:
        first, last = self._split(lo), self._split(hi)
        for i in range(first, last):
            if self.writer[i] >= 0:
                deps.add(self.writer[i])
            deps.update(self.readers[i])
        del self.bounds[first + 1 : last], self.writer[first + 1 : last]
        del self.readers[first + 1 : last]
        self.writer[first] = op
        self.readers[first] = ()

    def write_runs(self, base: int, runs: Sequence[Progression], op: int, deps: set[int]) -> None:
        for lo, length, stride, count in runs:
            for k in range(count):
                at = base + lo + k * stride
                if length > 0:
                    self.write(at, at + length, op, deps)


Call = tuple[str, int, int | list[Progression], int]
"""("r", lo, hi, op) or ("w", base, progressions, op)."""


def _replay(calls: list[Call], core_of: list[int], window: int) -> list[tuple[set[int], set[int]]]:
    """Each call's ops from the hazards and from the reference (the hazards' "no op", -1,
    left out)."""
    hazards, reference = VtcmHazards(core_of, window), _Reference(core_of)
    found = []
    for kind, a, b, op in calls:
        got: set[int] = set()
        want: set[int] = set()
        if kind == "r":
            assert not isinstance(b, list)
            hazards.read(a, b, op, got)
            reference.read(a, b, op, want)
        else:
            assert isinstance(b, list)
            hazards.write_runs(a, b, op, got)
            reference.write_runs(a, b, op, want)
        got.discard(-1)
        found.append((got, want))
    return found


def _runs(progressions: Sequence[Progression]) -> list[tuple[int, int]]:
    return [
        (lo + k * stride, lo + k * stride + length)
        for lo, length, stride, count in progressions
        for k in range(count)
    ]


def _plain_runs(box: Any, buf_box: Any, dtype: str) -> list[tuple[int, int]]:
    """A box's contiguous byte runs, one by one: each element's bytes in row-major order,
    adjacent ones joined (the span past `BYTE_RUNS` runs)."""
    size = {"int8": 1, "float16": 2, "float32": 4}[dtype]
    shape = [e - o for o, e in buf_box]
    runs: list[tuple[int, int]] = []
    axes = [range(a - o, b - o) for (a, b), (o, _) in zip(box, buf_box, strict=True)]
    for index in itertools.product(*axes):
        flat = 0
        for i, n in zip(index, shape, strict=True):
            flat = flat * n + i
        lo = flat * size
        if runs and runs[-1][1] == lo:
            runs[-1] = (runs[-1][0], lo + size)
        else:
            runs.append((lo, lo + size))
    return runs if len(runs) <= BYTE_RUNS else [box_byte_range(box, buf_box, dtype)]


def test_a_box_s_byte_runs_come_as_progressions_of_equal_runs() -> None:
    # a core's columns of every row of every channel: one strided write
    buffer = ((0, 1), (0, 128), (0, 1), (0, 56))
    columns = ((0, 1), (0, 128), (0, 1), (8, 16))
    assert box_byte_progressions(columns, buffer, "int8") == [(8, 8, 56, 128)]
    # two rows of each of 8 channels: a run per channel, a channel apart
    rows = ((0, 1), (0, 8), (2, 4), (0, 56))
    assert box_byte_progressions(rows, ((0, 1), (0, 8), (0, 7), (0, 56)), "int8") == [
        (112, 112, 392, 8)
    ]
    rng = random.Random(21)
    for _ in range(500):
        sides = [rng.randint(1, 9) for _ in range(4)]
        held = tuple((o, o + side) for o, side in zip((0, 2, 0, 5), sides, strict=True))
        box = []
        for o, e in held:
            a = rng.randint(o, e - 1)
            box.append((a, rng.randint(a + 1, e)))
        dtype = rng.choice(["int8", "float16", "float32"])
        found = box_byte_progressions(tuple(box), held, dtype)
        assert _runs(found) == _plain_runs(tuple(box), held, dtype)
        assert all(stride >= length for _, length, stride, _ in found)


def _count_paths(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often the hazards made, took apart and expanded periodic blocks."""
    taken: Counter[str] = Counter()
    for name in ("_carve", "_expand", "_periods", "_regrid"):
        method = getattr(VtcmSpace, name)

        def counted(self: VtcmSpace, *args: int, _name: str = name, _method: Any = method) -> Any:
            taken[_name] += 1
            return _method(self, *args)

        monkeypatch.setattr(VtcmSpace, name, counted)
    return taken


def test_random_strided_traffic_finds_the_ops_bytes_would(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = _count_paths(monkeypatch)
    rng = random.Random(25)
    cores = 4
    core_of: list[int] = []
    calls: list[Call] = []
    for op in range(3000):
        core = rng.randrange(cores)
        core_of.append(core)
        window = rng.randrange(cores) << 20  # any core's, for a write
        roll = rng.random()
        if roll < 0.3:  # a read of a span in its own core's: a kernel's operand, a store's part
            lo = (core << 20) + rng.randrange(0, 60_000)
            calls.append(("r", lo, lo + rng.choice([1, 56, 300, 5_000, 40_000]), op))
        elif roll < 0.45:  # a write of a span: a kernel's output, a whole box
            lo = window + rng.randrange(0, 60_000)
            length = rng.choice([8, 112, 2_000, 30_000])
            calls.append(("w", 0, [(lo, length, length, 1)], op))
        else:  # a part of a shared buffer: its columns of every row
            stride = rng.choice([168, 224, 392, 560])
            length = rng.choice([56, 112, stride // 2, stride])
            phase = rng.randrange(0, stride - length + 1, 56)
            at = window + rng.choice([0, 4_096, 50_000]) + phase
            calls.append(("w", at, [(0, length, stride, rng.choice([2, 5, 64, 128]))], op))
    found = _replay(calls, core_of, 1 << 20)
    assert all(got == want for got, want in found)
    assert sum(len(want) for _, want in found) > 3000  # the traffic does conflict
    assert all(taken[name] for name in ("_carve", "_expand", "_periods", "_regrid"))


def test_a_14_core_compile_s_accesses_find_the_ops_bytes_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Small maps cut by columns on 14 cores: each core multicasts its columns of every row.
    Every walk of the compile (one per program it emits) is replayed on its own."""
    taken = _count_paths(monkeypatch)
    # by walk (its ops' cores): the calls, each core's window placed in one address space
    walks: dict[int, tuple[list[int], list[Call]]] = {}
    read, write_runs = VtcmSpace.read, VtcmSpace.write_runs

    def recorded(self: VtcmSpace, call: Call) -> None:
        walks.setdefault(id(self.core_of), (self.core_of, []))[1].append(call)

    def recorded_read(self: VtcmSpace, lo: int, hi: int, op: int, deps: set[int]) -> None:
        at = self.core * VTCM_SPAN
        recorded(self, ("r", at + lo, at + hi, op))
        read(self, lo, hi, op, deps)

    def recorded_write_runs(
        self: VtcmSpace, base: int, runs: Sequence[Progression], op: int, deps: set[int]
    ) -> None:
        recorded(self, ("w", self.core * VTCM_SPAN + base, list(runs), op))
        write_runs(self, base, runs, op, deps)

    def recorded_write(self: VtcmSpace, lo: int, hi: int, op: int, deps: set[int]) -> None:
        recorded_write_runs(self, 0, [(lo, hi - lo, hi - lo, 1)], op, deps)

    def recorded_write_each(
        spaces: Sequence[VtcmSpace],
        base: int,
        runs: Sequence[Progression],
        op: int,
        deps: set[int],
    ) -> None:
        for space in spaces:
            recorded(space, ("w", space.core * VTCM_SPAN + base, list(runs), op))
        write_each(spaces, base, runs, op, deps)

    monkeypatch.setattr(VtcmSpace, "read", recorded_read)
    monkeypatch.setattr(emit, "write_each", recorded_write_each)
    monkeypatch.setattr(VtcmSpace, "write_runs", recorded_write_runs)
    monkeypatch.setattr(VtcmSpace, "write", recorded_write)
    compile_model(conv_net(batch=1, channels=32, size=28), ["-aic-num-cores=14"])
    monkeypatch.undo()
    calls = [call for _, walk in walks.values() for call in walk]
    strided = [runs for _, _, runs, _ in calls if isinstance(runs, list) and runs[0][3] > 1]
    assert len(strided) > 100 and taken["_carve"]
    for core_of, walk in walks.values():
        found = _replay(walk, core_of, VTCM_SPAN)
        assert all(got == want for got, want in found)


def test_a_strided_write_makes_periods_of_a_long_segment_past_a_short_one() -> None:
    # the first run falls in a short segment; the ones past it, in one long segment
    hazards = VtcmHazards([1, 1, 0], 1 << 20)
    deps: set[int] = set()
    hazards.write(0, 100, 0, deps)
    hazards.write_runs(0, [(0, 8, 56, 64)], 1, deps)
    assert any(block.period == 56 for block in hazards.space(0).blocks)
    read: set[int] = set()
    hazards.read(0, 64 * 56, 2, read)
    assert read - {-1} == {0, 1}


def test_a_multicast_s_writes_find_what_each_target_s_own_write_would() -> None:
    """`write_each` sorts each progression out once for all a multicast's targets: every
    target's VTCM ends as its own `write_runs` leaves it, and the ops found are their union."""
    rng = random.Random(7)
    cores = 5
    core_of = [rng.randrange(cores) for _ in range(1500)]
    each = VtcmHazards(core_of, 1 << 20)
    alone = VtcmHazards(core_of, 1 << 20)
    found = 0
    for op, core in enumerate(core_of):
        if rng.random() < 0.3:  # a read of its own core's
            lo = rng.randrange(0, 60_000)
            hi = lo + rng.choice([1, 300, 5_000])
            got: set[int] = set()
            want: set[int] = set()
            each.space(core).read(lo, hi, op, got)
            alone.space(core).read(lo, hi, op, want)
            assert got == want
            continue
        stride = rng.choice([168, 224, 560])
        length = rng.choice([56, stride, stride + 56])  # strided, whole, overlapping runs
        runs = [(rng.randrange(0, 300), length, stride, rng.choice([1, 3, 64]))]
        if rng.random() < 0.3:  # two progressions, one empty
            runs.append((70_000, rng.choice([0, 100]), 100, 2))
        targets = rng.sample(range(cores), rng.randrange(1, cores + 1))
        base = rng.randrange(0, 50_000)
        got, want = set(), set()
        write_each([each.space(t) for t in targets], base, runs, op, got)
        for t in targets:
            alone.space(t).write_runs(base, runs, op, want)
        assert got == want
        found += len(want)
    for c in range(cores):
        a, b = each.space(c), alone.space(c)
        assert a.starts == b.starts
        assert [(x.period, x.count, x.offs, x.writer, x.readers) for x in a.blocks] == [
            (x.period, x.count, x.offs, x.writer, x.readers) for x in b.blocks
        ]
    assert found > 1500  # the writes do conflict
