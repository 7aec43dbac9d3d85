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
from compiler_core.runtime.executor import _multicast_ranges
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
