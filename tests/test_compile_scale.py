"""The data structures that keep big compiles fast give the answers of the plain loops they
replace (issue 20 item 7: a 7 B decoder compiles in minutes, programs byte-identical).

Each structure is checked against a straightforward reference written here, on random cases
and on the schedules of a real (small) model.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from compiler_core.cost_timeline import BUCKET_CYCLES, Calendar
from compiler_core.lowering.box_log import BoxLog, covers, meets
from compiler_core.lowering.vtcm import Allocation, Buffer, align, allocate
from compiler_core.ops.registry import Box

# ----------------------------------------------------------------------------- VTCM offsets


def _allocate_reference(buffers: list[Buffer]) -> Allocation:
    """The first-fit allocation as a plain loop: resident buffers packed from 0, then the
    others largest first, each at the lowest offset clear of every buffer live with it."""
    cursor = 0
    for buf in sorted((b for b in buffers if b.resident), key=lambda b: b.id):
        buf.offset = cursor
        cursor = align(cursor + buf.size)
    resident = cursor
    placed: list[Buffer] = []
    peak = resident
    for buf in sorted(
        (b for b in buffers if not b.resident), key=lambda b: (-b.size, b.first, b.id)
    ):
        size = align(max(buf.size, 1))
        clashes = sorted(
            (p.offset, align(max(p.size, 1)))
            for p in placed
            if not (p.last < buf.first or buf.last < p.first)
        )
        offset = resident
        for off, sz in clashes:
            if offset + size <= off:
                break
            offset = max(offset, off + sz)
        buf.offset = offset
        placed.append(buf)
        peak = max(peak, offset + size)
    return Allocation(resident=resident, peak=peak)


def _random_buffers(rng: random.Random, n: int) -> list[Buffer]:
    buffers = []
    for i in range(n):
        first = rng.randrange(0, 60)
        resident = rng.random() < 0.1
        size = rng.choice([0, 1, 127, 128, 129, 4096, rng.randrange(1, 70_000)])
        last = 1 << 40 if resident else first + rng.randrange(0, 12)
        buffers.append(Buffer(i, size, first, last, resident))
    return buffers


@pytest.mark.parametrize("seed", range(40))
def test_allocation_places_every_buffer_where_the_first_fit_loop_does(seed: int) -> None:
    rng = random.Random(seed)
    buffers = _random_buffers(rng, rng.randrange(0, 160))
    reference = [Buffer(b.id, b.size, b.first, b.last, b.resident) for b in buffers]
    assert allocate(buffers) == _allocate_reference(reference)
    assert [b.offset for b in buffers] == [b.offset for b in reference]


def test_allocation_reuses_the_gap_between_two_live_buffers() -> None:
    # a (0..255) and c (512..) are live with b; b fits in the gap between them
    a = Buffer(0, 256, 0, 10)
    gap = Buffer(1, 256, 0, 3)  # dead before b starts: its bytes are free for b
    c = Buffer(2, 300, 0, 10)
    b = Buffer(3, 200, 5, 6)
    allocate([a, gap, c, b])
    assert (c.offset, a.offset, gap.offset) == (0, 384, 640)
    assert b.offset == 640


# --------------------------------------------------------------- buffers-only schedule builds


def test_placement_builds_replayed_from_the_memo_equal_fresh_builds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Placement rebuilds the buffers after every spill decision; kernels that reach the
    same state are replayed from the memo. Each replayed build equals one built afresh."""
    from compiler_core.devices import get_device
    from compiler_core.importer import import_model
    from compiler_core.lowering import emit, placement
    from compiler_core.lowering.lower import config_from, lower_graph
    from compiler_core.options import CompileOptions
    from tests.models import transformer_encoder

    # VTCM cut to 512 KiB: some activations spill, round after round, some stay on chip
    budget = 512 << 10
    config = config_from(CompileOptions(), get_device("aic100-standard"))
    config = dataclasses.replace(config, vtcm_budget=budget)
    imported = import_model(transformer_encoder(batch=2, seq=64, hidden=128, ffn=512))
    lowered = lower_graph(imported.model.graph, imported.opset, config)
    builds: list[tuple[emit.Placement, bool]] = []
    memos: list[emit.BuildMemo] = []

    def checked(graph, place, buffers_only=False, memo=None):  # type: ignore[no-untyped-def]
        built = emit.build_schedule(graph, place, buffers_only, memo)
        fresh = emit.build_schedule(graph, place, buffers_only)
        assert built.buffers == fresh.buffers and built.chip_bytes == fresh.chip_bytes
        assert built.ops == fresh.ops
        builds.append((place, buffers_only))
        memos.append(memo)
        return built

    monkeypatch.setattr(placement, "build_schedule", checked)
    planned = placement.plan_schedule(lowered, budget, placement.CodegenPolicy())
    assert planned.spilled and planned.schedule.placement.chip
    assert len({p.chip for p, only in builds if only}) >= 3
    memo = memos[0]
    assert all(m is memo for m in memos)
    # fewer kernel builds were recorded than kernels were built: the rest were replays
    buffers_only_builds = sum(1 for _, only in builds if only)
    assert len(memo.kernels) < buffers_only_builds * len(lowered.kernels)


# ------------------------------------------------------------------------ DDR hazard boxes


def _random_box(rng: random.Random, rank: int) -> Box | None:
    if rng.random() < 0.05:
        return None  # the whole tensor
    box = []
    for _ in range(rank):
        lo = rng.randrange(0, 12)
        box.append((lo, lo + rng.choice([0, 1, 2, 3, 5, 12])))  # some empty ranges
    return tuple(box)


@pytest.mark.parametrize("seed", range(30))
def test_a_box_log_finds_the_accesses_a_plain_list_finds(seed: int) -> None:
    """Random adds, lookups, covering writes and clears: the same ops met, the same kept,
    below and above the size where the log moves into arrays."""
    rng = random.Random(seed)
    rank = rng.choice([0, 1, 2, 3, 4])
    log = BoxLog(rank)
    plain: list[tuple[Box | None, int]] = []
    for op in range(rng.choice([10, 60, 400])):
        box = _random_box(rng, rank)
        action = rng.random()
        if action < 0.5:
            log.add(box, op)
            plain.append((box, op))
        elif action < 0.8:
            assert sorted(log.meeting(box)) == sorted(o for b, o in plain if meets(b, box))
        elif action < 0.99 and box is not None:
            log.drop_covered(box)
            plain = [(b, o) for b, o in plain if not covers(box, b)]
        elif action >= 0.99:
            log.clear()
            plain = []
        assert len(log) == len(plain)
        assert sorted(log.all_ops()) == sorted(o for _, o in plain)


def test_box_rules_of_the_hazards() -> None:
    a = ((0, 4), (0, 4))
    assert meets(a, ((3, 5), (3, 5))) and not meets(a, ((4, 6), (0, 4)))
    assert not meets(a, ((1, 1), (0, 4)))  # an empty box meets nothing...
    assert meets(None, ((1, 1), (0, 4)))  # ...but the whole tensor
    assert covers(a, ((1, 2), (0, 4))) and not covers(a, None) and not covers(a, ((1, 5), (0, 1)))
    log = BoxLog(2)
    for op in range(40):
        log.add(((op, op + 1), (0, 4)), op)
    log.add(None, 40)
    assert sorted(log.meeting(((10, 12), (3, 9)))) == [10, 11, 40]
    log.drop_covered(((0, 20), (0, 4)))
    assert sorted(log.all_ops()) == [*range(20, 41)]


# ------------------------------------------------------------------ shared-bandwidth calendar


class _WalkedCalendar:
    """The calendar as a walk over its buckets, one Python step each."""

    def __init__(self, bytes_per_cycle: float) -> None:
        self.capacity = bytes_per_cycle * BUCKET_CYCLES
        self.left: list[float] = []

    def book(self, start: int, nbytes: int, max_rate: float) -> int:
        if nbytes <= 0:
            return start
        t = float(start)
        remaining = float(nbytes)
        while True:
            b = int(t // BUCKET_CYCLES)
            while len(self.left) <= b:
                self.left.append(self.capacity)
            bucket_end = (b + 1) * BUCKET_CYCLES
            engine = max_rate * (bucket_end - t)
            take = min(remaining, self.left[b], engine)
            self.left[b] -= take
            remaining -= take
            if remaining <= 1e-9:
                return math.ceil(t + take / max_rate) if take < engine else bucket_end
            t = bucket_end


@pytest.mark.parametrize("seed", range(30))
def test_calendar_books_every_transfer_when_the_bucket_walk_does(seed: int) -> None:
    """Random transfers (a few bytes to megabytes, starting inside busy stretches or after
    them, engines slower and faster than the shared rate): the same completion times to the
    cycle and the same capacity left in every bucket."""
    rng = random.Random(seed)
    rate = rng.choice([105.4, 64.0, 1.0 / 3.0, 200.0])
    calendar, walked = Calendar(rate), _WalkedCalendar(rate)
    clock = 0
    for _ in range(300):
        start = max(0, clock + rng.randrange(-20_000, 3_000))
        nbytes = rng.choice([0, 1, 100, 4096, rng.randrange(1, 3_000_000), 26_982])
        engine = rng.choice([64.0, 32.0, 300.0, 7.5])
        end = calendar.book(start, nbytes, engine)
        assert end == walked.book(start, nbytes, engine)
        clock = max(clock, end // 2)
    n = len(walked.left)
    assert calendar.left[:n].tolist() == walked.left
    assert (calendar.left[n:] == calendar.capacity).all()


def test_calendar_ends_a_transfer_when_less_than_a_nanobyte_is_left() -> None:
    # two buckets of 999.9999999997 bytes move 2,000 bytes but for 6e-10: done in the second
    rate = 999.9999999997 / BUCKET_CYCLES
    engine = 2000.0 / BUCKET_CYCLES
    expected = _WalkedCalendar(rate).book(0, 2000, engine)
    assert Calendar(rate).book(0, 2000, engine) == expected < 2 * BUCKET_CYCLES
