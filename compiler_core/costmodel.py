"""The cost model: cycles for every instruction of a program on a modelled device.

A kernel tile costs the larger of its compute (HMX MACs, or HVX element work across the
vector threads) and its DMA (bytes over this core's share of DDR bandwidth): compute and
transfers overlap within a tile. The timeline walks every core's stream honouring
semaphores, so waits and idle time come out of the schedule, not out of a formula.
Every figure here is an estimate of a modelled device, and is labelled so where reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from compiler_core.devices import DeviceProfile
from compiler_core.lowering.program import (
    DmaLoad,
    DmaStore,
    Program,
    RunKernel,
    SemPost,
    SemWait,
)
from compiler_core.ops.registry import box_shape

HVX_BYTES_PER_THREAD_CYCLE = 128
FP32_HMX_SLOWDOWN = 16
"""HMX has no fp32 path: fp32 MACs run on HVX, modelled as 1/16 of the fp16 HMX rate."""


@dataclass
class KernelCost:
    kernel: int
    core: int
    start: int
    end: int
    compute_cycles: int
    dma_cycles: int


@dataclass
class Timeline:
    """The modelled schedule: per-core busy spans and totals, in device cycles."""

    clock_hz: int
    spans: list[KernelCost] = field(default_factory=list)
    core_end: list[int] = field(default_factory=list)
    core_busy: list[int] = field(default_factory=list)
    core_wait: list[int] = field(default_factory=list)
    ddr_read: list[int] = field(default_factory=list)
    ddr_read_constant: list[int] = field(default_factory=list)
    ddr_write: list[int] = field(default_factory=list)

    @property
    def total_cycles(self) -> int:
        return max(self.core_end, default=0)

    @property
    def latency_seconds(self) -> float:
        return self.total_cycles / self.clock_hz if self.clock_hz else 0.0


def _elements(box: tuple[tuple[int, int], ...]) -> int:
    return int(np.prod(box_shape(box), dtype=np.int64))


def tile_compute_cycles(program: Program, instr: RunKernel, device: DeviceProfile) -> int:
    kernel = program.kernels[instr.kernel]
    out_total = max(1, int(np.prod(kernel.info.out_shapes[0], dtype=np.int64))
                    if kernel.info.out_shapes else 1)
    share = _elements(instr.out_box) / out_total
    work = kernel.macs * share
    dtype = kernel.info.out_dtypes[0] if kernel.info.out_dtypes else "float32"
    if kernel.unit == "hmx":
        rate = device.hmx_fp16_macs_per_cycle
        if dtype in ("float32", "float64"):
            rate //= FP32_HMX_SLOWDOWN
        elif dtype in ("int8", "uint8"):
            rate = device.hmx_int8_macs_per_cycle
    else:
        itemsize = np.dtype(dtype).itemsize if dtype != "bool" else 1
        rate = device.hvx_threads * HVX_BYTES_PER_THREAD_CYCLE // max(1, itemsize)
    return int(np.ceil(work / max(1, rate)))


def build_timeline(program: Program, device: DeviceProfile) -> Timeline:
    cores = program.num_cores
    bytes_per_cycle = device.ddr_bandwidth_bytes_per_s / device.clock_hz / max(1, cores)
    timeline = Timeline(
        clock_hz=device.clock_hz,
        core_end=[0] * cores,
        core_busy=[0] * cores,
        core_wait=[0] * cores,
        ddr_read=[0] * cores,
        ddr_read_constant=[0] * cores,
        ddr_write=[0] * cores,
    )
    posted: dict[int, list[int]] = {}
    pcs = [0] * cores
    clock = [0] * cores
    pending_dma = [0] * cores
    while True:
        progressed = False
        for core, stream in enumerate(program.streams):
            while pcs[core] < len(stream):
                instr = stream[pcs[core]]
                if isinstance(instr, SemWait):
                    times = posted.get(instr.sem, [])
                    if len(times) < instr.count:
                        break
                    ready = sorted(times)[instr.count - 1]
                    if ready > clock[core]:
                        timeline.core_wait[core] += ready - clock[core]
                        clock[core] = ready
                elif isinstance(instr, SemPost):
                    posted.setdefault(instr.sem, []).append(clock[core])
                elif isinstance(instr, DmaLoad | DmaStore):
                    t = program.tensors[instr.tensor]
                    size = _elements(instr.box) * np.dtype(t.dtype).itemsize
                    if isinstance(instr, DmaLoad):
                        timeline.ddr_read[core] += size
                        if t.kind == "constant":
                            timeline.ddr_read_constant[core] += size
                    else:
                        timeline.ddr_write[core] += size
                    pending_dma[core] += size
                elif isinstance(instr, RunKernel):
                    compute = tile_compute_cycles(program, instr, device)
                    out_bytes = sum(
                        _elements(o.box) * np.dtype(program.tensors[t].dtype).itemsize
                        for o, t in zip(instr.outputs, program.kernels[instr.kernel].outputs,
                                        strict=True)
                    )
                    dma = int(np.ceil((pending_dma[core] + out_bytes) / bytes_per_cycle))
                    pending_dma[core] = -out_bytes  # the stores that follow are counted here
                    cycles = max(compute, dma, 1)
                    timeline.spans.append(
                        KernelCost(instr.kernel, core, clock[core], clock[core] + cycles,
                                   compute, dma)
                    )
                    clock[core] += cycles
                    timeline.core_busy[core] += cycles
                pcs[core] += 1
                progressed = True
            if pcs[core] >= len(stream):
                pending_dma[core] = 0
        if all(pc >= len(s) for pc, s in zip(pcs, program.streams, strict=True)):
            break
        if not progressed:
            break
    timeline.core_end = clock
    return timeline
