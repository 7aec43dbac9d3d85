"""The runtime side of stats: fill a QPC's stats buffer for one inference.

The functional runtime plays the device. It executes the program for real (outputs, tile
counts) and takes the cycles from the cost model's timeline of the same program, which is what
a device's counters would have measured on the modelled hardware. PMU events are computed per
core and thread from the same timeline (see `pmu.py`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from compiler_core.cost_rates import HVX_THREADS, THREADS
from compiler_core.cost_timeline import KernelRun, Timeline, Wait, build_timeline
from compiler_core.devices import DeviceProfile, default_device_for, get_device
from compiler_core.errors import CompileError
from compiler_core.lowering.program import RunKernel
from compiler_core.profiling.stats_layout import (
    HEADER_FIELDS,
    OP_FIELDS,
    STATS_MAGIC,
    STATSDESC_VERSION,
    StatsLayout,
)

if TYPE_CHECKING:
    from compiler_core.qpc.networkdesc import NetworkDesc
    from compiler_core.runtime.executor import Executor, Traffic

_BURST = 64


def _busy(run: KernelRun, thread: str) -> int:
    use = run.threads.get(thread)
    return use.busy if use is not None else 0


def pmu_count(
    event: int, runs: list[KernelRun], waits: list[Wait], thread: str | None, pcycles: int
) -> int:
    """One event over some kernel runs of one core: on one thread, or the whole core (None)."""
    threads = THREADS if thread is None else (thread,)
    hvx = [t for t in threads if t in HVX_THREADS]
    on_hmx = "hmx" in threads
    on_dma = "dma" in threads
    if event == 0x01:
        return pcycles
    if event == 0x02:
        return sum(_busy(r, t) for r in runs for t in threads)
    if event == 0x03:
        return sum(w.cycles for w in waits if w.kind == "semaphore")
    if event == 0x04:
        return sum(w.cycles for w in waits if w.kind == "doorbell")
    if event == 0x05:
        return sum(max(0, r.cycles - max(_busy(r, "hmx"), _busy(r, "hvx0"))) for r in runs)
    if event == 0x10:
        return sum(_busy(r, "hmx") for r in runs) if on_hmx else 0
    if event == 0x11:
        return sum(r.hmx_macs for r in runs) if on_hmx else 0
    if event == 0x12:
        return sum(r.tiles for r in runs if r.hmx_macs) if on_hmx else 0
    if event == 0x20:
        return sum(_busy(r, t) for r in runs for t in hvx)
    if event == 0x21:
        return sum(r.hvx_work * len(hvx) // len(HVX_THREADS) for r in runs)
    if event == 0x22:
        return sum(r.tiles for r in runs if r.hvx_work) if hvx else 0
    if not on_dma:
        return 0 if event in (0x30, 0x31, 0x32, 0x33, 0x34, 0x40) else _core_wide(event, runs)
    if event == 0x30:
        return sum(r.read_bytes for r in runs)
    if event == 0x31:
        return sum(r.write_bytes for r in runs)
    if event == 0x32:
        return sum(-(-r.read_bytes // _BURST) for r in runs)
    if event == 0x33:
        return sum(-(-r.write_bytes // _BURST) for r in runs)
    if event == 0x34:
        return sum(r.read_constant_bytes for r in runs)
    if event == 0x40:
        return sum(_busy(r, "dma") for r in runs)
    return _core_wide(event, runs)


def _core_wide(event: int, runs: list[KernelRun]) -> int:
    if event == 0x41:
        return len(runs)
    return 0  # not in the catalogue: accepted, counts zero (compile warned)


def fill_stats(
    layout: StatsLayout,
    timeline: Timeline,
    inference: int,
    executed_tiles: Mapping[tuple[int, int], int] | None = None,
    traffic: Sequence[Traffic] | None = None,
) -> bytes:
    """The raw stats buffer of one inference (`layout.size` bytes).

    `executed_tiles[(kernel, core)]` are the tiles the runtime really ran, and `traffic` the
    bytes its DMA instructions moved per core; without them the timeline's figures are used.
    """
    buf = bytearray(layout.size)
    cores = layout.num_cores
    runs_of: dict[int, list[KernelRun]] = {c: [] for c in range(cores)}
    waits_of: dict[int, list[Wait]] = {c: [] for c in range(cores)}
    by_row: dict[tuple[int, int], KernelRun] = {}
    for run in timeline.runs:
        runs_of[run.core].append(run)
        by_row[(run.kernel, run.core)] = run
    for wait in timeline.waits:
        waits_of[wait.core].append(wait)

    def put(name: str, table: np.ndarray) -> None:
        section = layout.section(name)
        assert section is not None and table.shape == (section.rows, len(section.fields))
        data = np.ascontiguousarray(table, dtype="<u8").tobytes()
        buf[section.offset : section.offset + len(data)] = data

    header = dict.fromkeys(HEADER_FIELDS, 0)
    header.update(
        magic=STATS_MAGIC,
        version=STATSDESC_VERSION,
        level=layout.level,
        num_cores=cores,
        threads=len(layout.threads),
        inference=inference,
        batchsize=layout.batchsize,
        clock_hz=timeline.clock_hz,
    )
    put("header", np.array([[header[f] for f in HEADER_FIELDS]], dtype=np.uint64))

    if layout.section("core_thread") is not None:
        rows = []
        for c in range(cores):
            busy = timeline.thread_busy(c)
            act = timeline.activation_cycles[c]
            rows += [[busy[t], timeline.core_end[c], act, act] for t in layout.threads]
        put("core_thread", np.array(rows, dtype=np.uint64))
    if layout.section("pmu") is not None:
        rows = [
            [
                pmu_count(e, runs_of[c], waits_of[c], t, timeline.core_end[c])
                for e in layout.pmu_events
            ]
            for c in range(cores)
            for t in layout.threads
        ]
        put("pmu", np.array(rows, dtype=np.uint64))
    if layout.section("ddr") is not None:
        rows = (
            [t.as_row() for t in traffic]
            if traffic is not None
            else [
                [
                    timeline.ddr_read[c],
                    timeline.ddr_read_constant[c],
                    timeline.ddr_write[c],
                    timeline.multicast[c],
                    timeline.noc[c],
                ]
                for c in range(cores)
            ]
        )
        put("ddr", np.array(rows, dtype=np.uint64).reshape(cores, 5))
    if layout.section("ports") is not None:
        put(
            "ports",
            np.array(
                [
                    [timeline.port_wait[p], timeline.port_ring[p], timeline.port_bytes[p]]
                    for p in range(len(layout.ports))
                ],
                dtype=np.uint64,
            ).reshape(len(layout.ports), 3),
        )
    if layout.section("sem_increments") is not None:
        rows = []
        for key in layout.op_rows:
            done = by_row.get(key)
            rows.append([done.end, done.cycles] if done is not None else [0, 0])
        put("sem_increments", np.array(rows, dtype=np.uint64).reshape(len(layout.op_rows), 2))
    if layout.section("ops") is not None:
        put("ops", _op_rows(layout, timeline, by_row, executed_tiles))
    if layout.section("ops_pmu") is not None:
        rows = []
        for key in layout.op_rows:
            found = by_row.get(key)
            rows.append(
                [
                    pmu_count(e, [found], [], None, found.cycles) if found is not None else 0
                    for e in layout.extended_events
                ]
            )
        put(
            "ops_pmu",
            np.array(rows, dtype=np.uint64).reshape(
                len(layout.op_rows), len(layout.extended_events)
            ),
        )
    return bytes(buf)


def _op_rows(
    layout: StatsLayout,
    timeline: Timeline,
    by_row: dict[tuple[int, int], KernelRun],
    executed: Mapping[tuple[int, int], int] | None,
) -> np.ndarray:
    waits_before: dict[tuple[int, int], int] = {}
    ends: dict[int, int] = {}
    for run in sorted(timeline.runs, key=lambda r: (r.core, r.end, r.start)):
        waits_before[(run.kernel, run.core)] = run.start - ends.get(run.core, 0)
        ends[run.core] = run.end
    table = np.zeros((len(layout.op_rows), len(OP_FIELDS)), dtype=np.uint64)
    for i, key in enumerate(layout.op_rows):
        found = by_row.get(key)
        if found is None:
            continue
        run = found
        tiles = executed.get(key, 0) if executed is not None else run.tiles
        values = [
            run.start,
            run.end,
            run.cycles,
            waits_before[key],
            run.compute_cycles,
            run.dma_cycles,
            tiles,
            run.read_bytes,
            run.read_constant_bytes,
            run.write_bytes,
            run.vtcm_bytes,
        ]
        for t in THREADS:
            use = run.threads.get(t)
            values += [use.start, use.end, use.busy] if use is not None else [0, 0, 0]
        table[i] = values
    return table


STATS_FILE_PATTERN = "stats-inf-{index:05d}.bin"
"""One raw stats buffer per inference in the profiling directory (index from 0)."""


def device_for(network: NetworkDesc) -> DeviceProfile:
    """The device profile a QPC was compiled for (its -aic-device, else its hardware's default)."""
    name = network.options.get("aic-device") or network.options.get("aic_device")
    return get_device(name) if name else default_device_for(network.hw_version)


class StatsRecorder:
    """Hooks an Executor: counts the tiles each core really runs, then writes the stats
    buffer into the machine's DDR (where the QPC placed it) and returns its bytes."""

    def __init__(self, layout: StatsLayout, timeline: Timeline, executor: Executor) -> None:
        self.layout = layout
        self.timeline = timeline
        self.executor = executor
        self.tiles: Counter[tuple[int, int]] = Counter()
        executor.on_kernel = self._on_kernel

    @classmethod
    def for_qpc(
        cls, statsdesc: bytes | memoryview | None, network: NetworkDesc, executor: Executor
    ) -> StatsRecorder:
        if statsdesc is None:
            raise CompileError(
                "no_stats",
                "this QPC has no statsdesc.bin (compiled by an older qpcfarm?): recompile it to "
                "collect stats",
            )
        layout = StatsLayout.from_bytes(statsdesc)
        timeline = build_timeline(executor.program, device_for(network))
        return cls(layout, timeline, executor)

    def _on_kernel(self, core: int, kernel: int, _instr: RunKernel) -> None:
        self.tiles[(kernel, core)] += 1

    def start(self) -> None:
        self.tiles.clear()

    def finish(self, inference: int) -> bytes:
        raw = fill_stats(self.layout, self.timeline, inference, self.tiles, self.executor.traffic)
        machine = self.executor.machine
        base = self.layout.ddr_offset - self.executor.program.constants_size
        region = machine.dynamic[base : base + self.layout.size]
        if base < 0 or len(region) != self.layout.size:
            raise CompileError("invalid_qpc", "the stats buffer lies outside the program's DDR")
        region[:] = np.frombuffer(raw, dtype=np.uint8)
        return region.tobytes()


def write_stats_file(out_dir: Path, inference: int, raw: bytes) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / STATS_FILE_PATTERN.format(index=inference)
    path.write_bytes(raw)
    return path
