"""Replayed bookkeeping (compiler_core/runtime/replay.py): from the inference after a
recorded one, the deferred loads and the mirrors replay the recorded accesses instead of
looking their records up, and leave every byte, view and count the look-up leaves."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from compiler_core.lowering.placement import CodegenPolicy
from compiler_core.lowering.program import Program, SemWait
from compiler_core.runtime import Executor, mirrors
from compiler_core.runtime.deferred import DeferredLoads
from compiler_core.runtime.executor import _multicast_ranges
from compiler_core.runtime.replay import Replay
from tests.models import transformer_encoder
from tests.runtime_helpers import compiled_program

VTCM = 8_323_072


def _without_waits(program: Program) -> Program:
    return dataclasses.replace(
        program, streams=[[i for i in s if not isinstance(i, SemWait)] for s in program.streams]
    )


@pytest.mark.parametrize("tampered", [False, True])
def test_replayed_inferences_compute_and_leave_what_looked_up_ones_do(
    tampered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test transformer on 4 cores with its weights streamed (deferred loads, NoC
    copies and multicasts over their buffers, mirrored however few bytes they spare), and
    the same program without its semaphore waits (a wrong answer; its multicasts' bytes
    are copied out, so none stays mirrored): from the third inference on neither the
    deferred loads nor the mirrors look their records up, and every inference's outputs,
    VTCM, byte counts and mirror bytes copied out equal those of an executor that always
    looks them up."""
    monkeypatch.setattr(mirrors, "SPARED", 0)  # keep the small multicasts mirrored
    program, constants = compiled_program(
        transformer_encoder(), "-aic-num-cores=4", policy=CodegenPolicy(residency=False)
    )
    if tampered:
        program = _without_waits(program)
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 16, 64)).astype(np.float32)}
    replayed, looked_up = Executor(program, constants, VTCM), Executor(program, constants, VTCM)
    looked_up.deferred.replay.enabled = looked_up.mirrors.replay.enabled = False
    for inference in range(4):
        if inference == 2:

            def looks_up(*args: object) -> bool:
                raise AssertionError("a replayed access looked the records up")

            monkeypatch.setattr(replayed.deferred, "_meets", looks_up)
            monkeypatch.setattr(replayed.mirrors, "_overlapping", looks_up)
        got, want = replayed.run(feeds), looked_up.run(feeds)
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value)
        for mine, theirs in zip(replayed.machine.vtcm, looked_up.machine.vtcm, strict=True):
            np.testing.assert_array_equal(mine, theirs)
        assert [t.as_row() for t in replayed.traffic] == [t.as_row() for t in looked_up.traffic]
        assert replayed.mirrors.copied == looked_up.mirrors.copied
    plan = replayed.mirrors.replay.plan
    assert plan is not None
    if not tampered:  # some multicasts stay mirrored, and the replay writes their boxes
        assert any(starts for starts, _ in _multicast_ranges(program, replayed.mirrors.off))
        assert any(access.writes for access in plan)


def _recorded(deferred: DeferredLoads, accesses: list[tuple[int, int]]) -> Replay:
    """`deferred` records one inference: a buffer deferred over bytes [0, 16), then
    `accesses` (settles), then its end; the replay of the next inference has begun."""
    memory = np.zeros(16, np.uint8)
    deferred.start(fresh=True)
    deferred.defer(0, 0, 16, memory.reshape(4, 4), np.ones((4, 4), np.uint8))
    for start, end in accesses:
        deferred.settle(0, start, end)
    deferred.finish()
    deferred.start(fresh=False)
    deferred.defer(0, 0, 16, memory.reshape(4, 4), np.ones((4, 4), np.uint8))
    return deferred.replay


def test_a_call_sites_accesses_that_did_nothing_are_stepped_over_in_the_replays() -> None:
    """Settles of bytes no deferred buffer covers write nothing and change no record: the
    span of them is stepped over in the replay that comes to it in its order, and that
    replay still ends where the recorded inference did."""
    deferred = DeferredLoads(1)
    memory = np.zeros(16, np.uint8)
    deferred.start(fresh=True)
    deferred.defer(0, 0, 16, memory.reshape(4, 4), np.ones((4, 4), np.uint8))
    at = deferred.replay.mark()
    assert at == 1
    deferred.settle(0, 16, 32)
    deferred.settle(0, 32, 48)
    span = deferred.replay.span(at, [(0, "handed")])
    deferred.finish()
    assert span is not None and (span.at, span.length, span.handed) == (1, 2, ((0, "handed"),))
    deferred.start(fresh=False)
    assert not deferred.replay.skip(span)  # not yet come to: the defer comes first
    deferred.defer(0, 0, 16, memory.reshape(4, 4), np.ones((4, 4), np.uint8))
    assert deferred.replay.skip(span)
    deferred.finish()  # every access replayed
    deferred.start(fresh=True)  # a new recording: the old span applies no more
    deferred.defer(0, 0, 16, memory.reshape(4, 4), np.ones((4, 4), np.uint8))
    assert not deferred.replay.skip(span)


def test_a_call_sites_accesses_that_wrote_bytes_are_never_stepped_over() -> None:
    """A settle that writes deferred bytes into VTCM (each replay must write them again)
    makes no span; nor does an inference that is not recorded."""
    deferred = DeferredLoads(1)
    memory = np.zeros(16, np.uint8)
    deferred.start(fresh=True)
    deferred.defer(0, 0, 16, memory.reshape(4, 4), np.ones((4, 4), np.uint8))
    at = deferred.replay.mark()
    assert at is not None
    deferred.settle(0, 16, 32)
    deferred.settle(0, 0, 4)  # writes row 0
    assert deferred.replay.span(at, []) is None
    deferred.finish()
    deferred.start(fresh=False)
    assert deferred.replay.mark() is None


def test_replayed_kernels_step_over_their_accesses_that_did_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The test transformer on 4 cores with its weights streamed: from the third inference
    on, kernels step over their recorded deferred-load accesses that did nothing (fewer
    accesses followed one by one than recorded), and the outputs equal those of an
    executor that replays nothing."""
    program, constants = compiled_program(
        transformer_encoder(), "-aic-num-cores=4", policy=CodegenPolicy(residency=False)
    )
    feeds = {"x": np.random.default_rng(2).standard_normal((2, 16, 64)).astype(np.float32)}
    replayed, looked_up = Executor(program, constants, VTCM), Executor(program, constants, VTCM)
    looked_up.deferred.replay.enabled = looked_up.mirrors.replay.enabled = False
    followed = 0
    follow = Replay.follow

    def counted(self: Replay, *args: object) -> object:
        nonlocal followed
        followed += self is replayed.deferred.replay
        return follow(self, *args)  # type: ignore[arg-type]

    for inference in range(3):
        if inference == 2:
            monkeypatch.setattr(Replay, "follow", counted)
        got, want = replayed.run(feeds), looked_up.run(feeds)
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value)
    plan = replayed.deferred.replay.plan
    assert plan is not None and 0 < followed < len(plan)
