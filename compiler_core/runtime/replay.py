"""Bookkeeping recorded in one inference and replayed by the later ones.

The deferred loads (deferred.py) and the mirrors (mirrors.py) keep records of VTCM byte
ranges, and what they do at an access (which bytes they write into a core, which view they
hand a kernel, whether a core has records left) follows from the order of the accesses and
their byte ranges alone, never from the bytes. A program's streams access VTCM in the same
order in every inference: the cores run until blocked in turn, and what blocks them is
semaphore counts, not data. So an inference that runs to its end is recorded, access by
access, and the later ones replay that list instead of looking the records up, which is
most of what the records cost on many cores. An access out of the recorded order (another
byte range, more or fewer accesses) is a `ReplayFault`.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import numpy as np

Write = tuple[np.ndarray, np.ndarray | None, tuple[np.ndarray, ...]]
"""(destination, source, kept): `source` (None: the data the access is given) written into
`destination` but for the bytes of the `kept` views, which keep what they held."""

HELD: list[int] = [-1]
"""The `pending` entry of a core with records while an inference replays (never changed:
the executor only asks whether a core has any)."""


class Access(NamedTuple):
    """One recorded access: its byte range, what it wrote, its result, the cores whose
    records it emptied (False) or started (True) and the bytes it counts as copied."""

    start: int
    end: int
    writes: tuple[Write, ...]
    result: Any
    pending: tuple[tuple[int, bool], ...]
    copied: int


class Span(NamedTuple):
    """One call site's run of accesses in a recorded inference that did nothing (wrote no
    bytes, changed no core's records, copied nothing), with what its reads were handed."""

    plan: list[Access]
    at: int
    length: int
    handed: tuple[tuple[int, Any], ...]
    """(operand position, the view the access handed for it), in the order handed."""


class ReplayFault(RuntimeError):
    """An inference accessed VTCM out of the order the recorded one did."""


class Replay:
    """The recording and replaying of one bookkeeping object's accesses (`enabled` False:
    every inference looks its records up; the answers are the same)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.plan: list[Access] | None = None
        """The accesses of the last inference recorded to its end."""
        self.replaying: list[Access] | None = None
        """`plan` while this inference replays it."""
        self.at = 0
        """The next access to replay."""
        self.trace: list[Access] | None = None
        """This inference's accesses, while it records them."""
        self.writes: list[Write] = []
        self.touched: dict[int, bool] = {}
        """Cores whose records the access changes, with whether each had any before."""
        self.copied = 0
        """Bytes the access counts as copied."""

    def start(self, *, fresh: bool) -> None:
        """An inference begins: it replays the recorded one, or is recorded (`fresh`: the
        streams were decoded anew, so nothing recorded applies)."""
        if fresh or not self.enabled:
            self.plan = None
        self.at = 0
        self.replaying = self.plan
        self.trace = [] if self.plan is None and self.enabled else None

    def stop(self) -> None:
        """Neither replay nor record (until the next `start`)."""
        self.replaying = self.trace = None

    def finish(self) -> None:
        """The inference ran to its end: a recorded one is what the next ones replay."""
        if self.replaying is not None and self.at != len(self.replaying):
            raise ReplayFault(
                f"an inference made {self.at} accesses, the recorded one {len(self.replaying)}"
            )
        if self.trace is not None:
            self.plan = self.trace
        self.stop()

    def follow(
        self, pending: list[list[int]], start: int, end: int, data: np.ndarray | None = None
    ) -> Access:
        """Replay the next recorded access, which must be of the same bytes (`pending`:
        the owner's, set as the access left it; `data`: this access's, for the writes of
        the access's data)."""
        plan, at = self.replaying, self.at
        assert plan is not None
        if at >= len(plan):
            raise ReplayFault(f"access {at} to [{start}, {end}) beyond the recorded ones")
        access = plan[at]
        if access[0] != start or access[1] != end:
            raise ReplayFault(f"access {at} to [{start}, {end}) out of the recorded order")
        self.at = at + 1
        writes = access[2]
        if writes:
            for dst, src, kept in writes:
                if kept:
                    saved = [k.copy() for k in kept]
                    dst[...] = src
                    for k, before in zip(kept, saved, strict=True):
                        k[...] = before
                else:
                    dst[...] = data if src is None else src
        changes = access[4]
        if changes:
            for core, held in changes:
                pending[core] = HELD if held else []
        return access

    def mark(self) -> int | None:
        """Where the next access goes in the inference being recorded (None: none is)."""
        return None if self.trace is None else len(self.trace)

    def span(self, at: int, handed: list[tuple[int, Any]]) -> Span | None:
        """A call site's accesses from `at` (a `mark`) to now, when none of them does
        anything a replay must redo (else None): the replays may then `skip` them."""
        trace = self.trace
        assert trace is not None
        for access in trace[at:]:
            if access.writes or access.pending or access.copied:
                return None
        return Span(trace, at, len(trace) - at, tuple(handed))

    def skip(self, span: Span | None) -> bool:
        """Replay a call site's recorded accesses that did nothing by stepping over them:
        only when this inference replays that very recording and has come to them in its
        order (else False: the site makes its accesses, which `follow` checks)."""
        if span is None or self.replaying is not span.plan or self.at != span.at:
            return False
        self.at += span.length
        return True

    def write(self, dst: np.ndarray, src: np.ndarray, kept: tuple[np.ndarray, ...] = ()) -> None:
        """Write `src` into `dst` but for the `kept` bytes, and note it for the record."""
        saved = [k.copy() for k in kept]
        dst[...] = src
        for k, before in zip(kept, saved, strict=True):
            k[...] = before
        self.writes.append((dst, src, kept))

    def write_data(self, dst: np.ndarray, data: np.ndarray) -> None:
        """Write the data the access is given into `dst` (each replay writes its own)."""
        dst[...] = data
        self.writes.append((dst, None, ()))

    def touch(self, core: int, had: bool) -> None:
        """The access is about to change `core`'s records (`had`: whether it has any)."""
        self.touched.setdefault(core, had)

    def record(self, pending: list[list[int]], start: int, end: int, result: Any = None) -> None:
        """End an access (of bytes [start, end)): recorded, when this inference is."""
        writes, touched = self.writes, self.touched
        if self.trace is not None:
            changed = tuple(
                (core, bool(pending[core]))
                for core, had in touched.items()
                if bool(pending[core]) != had
            )
            self.trace.append(Access(start, end, tuple(writes), result, changed, self.copied))
        if writes:
            writes.clear()
        if touched:
            touched.clear()
        self.copied = 0


class _Ranged(Protocol):
    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...


E = TypeVar("E", bound=_Ranged)


class CoreRanges(Generic[E]):
    """Per core, disjoint byte ranges [start, end) of its VTCM, each with an entry, whose
    accesses are recorded and replayed: what the deferred loads and the mirrors share
    (`replay` False: every inference looks the entries up)."""

    def __init__(self, num_cores: int, replay: bool = True) -> None:
        self.pending: list[list[int]] = [[] for _ in range(num_cores)]
        """Per core, the starts of its ranges, sorted (empty: none)."""
        self._entries: list[dict[int, E]] = [{} for _ in range(num_cores)]
        self.replay = Replay(replay)

    def clear(self) -> None:
        """The inference VTCM was zeroed: no range is held (and nothing recorded)."""
        self.pending = [[] for _ in self.pending]
        for entries in self._entries:
            entries.clear()
        self.replay.stop()

    def start(self, *, fresh: bool) -> None:
        """An inference begins with its VTCM zeroed: it replays the recorded one, or is
        recorded (`fresh`: the streams were decoded anew)."""
        self.clear()
        self.replay.start(fresh=fresh)

    def finish(self) -> None:
        """The inference ran to its end (a recorded one is what the next ones replay)."""
        self.replay.finish()

    def _overlapping(self, core: int, start: int, end: int) -> list[E]:
        """`core`'s entries whose ranges meet [start, end), last first."""
        starts = self.pending[core]
        if not starts:
            return []
        entries = self._entries[core]
        found = []
        i = bisect_left(starts, end) - 1
        while i >= 0 and entries[starts[i]].end > start:  # disjoint: ends rise with starts
            found.append(entries[starts[i]])
            i -= 1
        return found
