"""The data structures that keep big compiles fast give the answers of the plain loops they
replace (issue 20 item 7: a 7 B decoder compiles in minutes, programs byte-identical).

Each structure is checked against a straightforward reference written here, on random cases
and on the schedules of a real (small) model.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from compiler_core.lowering.vtcm import Allocation, Buffer, align, allocate

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
