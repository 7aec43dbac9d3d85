"""The cost model's timeline: cycles for every instruction of a program on a modelled device.

It prices the program the compiler emitted and nothing else, instruction by instruction, as a
scoreboard over each core's units:

- six threads per core, as the vendor's profiles show them: four HVX vector threads, one HMX
  tensor thread and one DMA thread. The scalar thread issues instructions in program order
  without waiting for them (a `SemWait` stops issue until the semaphore is raised; a
  `SemPost` is a fence: it is raised when every earlier instruction of the core has
  completed);
- a DMA starts when its queue is free (each core has two, each running its transfers in
  order: loads and stores through the memory NoC to DDR, and `NocCopy` through the compute NoC
  to other cores' VTCM), when the VTCM it writes is no longer read by an earlier
  instruction of the core and, for a store or copy, when the data it reads has been written;
  it moves its bytes through a shared bandwidth calendar: DDR for loads and stores, the NoC
  for core-to-core copies. A multicast reads DDR once however many cores it feeds. Each
  engine moves at most `dma_bytes_per_cycle`;
- a kernel tile starts when its unit (HMX or HVX) is free and its operands have landed; it
  takes the cycles `cost_rates.tile_cost` gives it (plus the HVX decode of streamed MXFP6
  weights).

DDR and NoC bandwidth are shared by everything running at the same time on every core, not
only by the cores of one kernel. Waits, idle time and the inference duration come out of the
schedule, not out of a formula. Everything here is an estimate of a modelled device and is
labelled so wherever it is reported.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from compiler_core.cost_rates import (
    ACTIVATION_BASE_CYCLES,
    ACTIVATION_CYCLES_PER_INSTR,
    DMA_DESCRIPTOR_CYCLES,
    HVX_THREADS,
    KERNEL_LAUNCH_CYCLES,
    MXFP6_DECODE_ELEMENTS_PER_THREAD_CYCLE,
    THREADS,
    TileCompute,
    int8_step_ops,
    integer_step,
    tile_cost,
)
from compiler_core.devices import DeviceProfile, link_between
from compiler_core.lowering.program import (
    KIND_ACTIVATION,
    KIND_CONSTANT,
    DmaGather,
    DmaLoad,
    DmaScatter,
    DmaStore,
    EpilogueDesc,
    Instr,
    LinkSend,
    LinkWait,
    NocCopy,
    Program,
    RunKernel,
    SemPost,
    SemWait,
    box_byte_range,
    box_elements,
    box_nbytes,
    cores_in,
    gathered_bytes,
    scattered_bytes,
    stored_bytes,
)
from compiler_core.ops import REGISTRY
from compiler_core.ops.registry import Box, OpDef

BUCKET_CYCLES = 256
"""Granularity of the shared-bandwidth calendars."""


@dataclass
class ThreadUse:
    """One thread's part in one kernel on one core: first start, last end, busy cycles."""

    start: int
    end: int
    busy: int = 0

    def add(self, start: int, end: int) -> None:
        self.start = min(self.start, start)
        self.end = max(self.end, end)
        self.busy += end - start


@dataclass
class KernelRun:
    """One kernel's work on one core. [start, end) is the kernel's window of the core's time:
    windows follow each other without overlap (a kernel's prefetched loads may run inside the
    previous window; its threads' own intervals say where)."""

    kernel: int
    core: int
    start: int
    end: int
    compute_cycles: int = 0
    dma_cycles: int = 0
    tiles: int = 0
    read_bytes: int = 0
    read_constant_bytes: int = 0
    read_spill_bytes: int = 0
    """Read back from DDR: intermediate activations that did not stay on chip."""
    write_bytes: int = 0
    noc_bytes: int = 0
    multicast_bytes: int = 0
    vtcm_bytes: int = 0
    hmx_macs: int = 0
    hmx_padded_macs: int = 0
    hvx_work: int = 0
    threads: dict[str, ThreadUse] = field(default_factory=dict)
    first: int = 0
    """When the kernel's first instruction on the core started (may precede `start`)."""

    @property
    def cycles(self) -> int:
        return self.end - self.start

    def thread(self, name: str, start: int, end: int) -> None:
        if end <= start:
            return
        use = self.threads.get(name)
        if use is None:
            self.threads[name] = ThreadUse(start, end, end - start)
        else:
            use.add(start, end)


@dataclass(frozen=True)
class Wait:
    """A core stalled over [start, end): on a semaphore (ref = its id) or an input doorbell
    (ref = the port index)."""

    core: int
    start: int
    end: int
    kind: str
    ref: int

    @property
    def cycles(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SemIncrement:
    """A semaphore post: when it was raised, and the cycles of the kernel it follows."""

    core: int
    sem: int
    kernel: int
    time: int
    op_cycles: int


@dataclass
class Timeline:
    """The modelled schedule of one inference, in device cycles from the inference start."""

    clock_hz: int
    num_cores: int
    runs: list[KernelRun] = field(default_factory=list)
    waits: list[Wait] = field(default_factory=list)
    increments: list[SemIncrement] = field(default_factory=list)
    core_end: list[int] = field(default_factory=list)
    activation_cycles: list[int] = field(default_factory=list)
    ddr_read: list[int] = field(default_factory=list)
    ddr_read_constant: list[int] = field(default_factory=list)
    ddr_write: list[int] = field(default_factory=list)
    multicast: list[int] = field(default_factory=list)
    noc: list[int] = field(default_factory=list)
    activation_ddr_read: list[int] = field(default_factory=list)
    """Bytes each core's activation loads (the resident constants) read from DDR, once."""
    port_names: list[str] = field(default_factory=list)
    port_is_input: list[bool] = field(default_factory=list)
    port_bytes: list[int] = field(default_factory=list)
    port_ring: list[int] = field(default_factory=list)
    """Input ports: when the host's doorbell rang; outputs: when the output was complete."""
    port_wait: list[int] = field(default_factory=list)
    """Input ports: cycles the cores' loads of them waited for the doorbell; outputs: cycles
    the finished output waited for the end of the inference."""
    complete: bool = True
    """False when a stream blocked forever (a program the runtime would report deadlocked)."""
    issued: list[list[tuple[int, int]]] = field(default_factory=list)
    """Per core, per instruction: when it started and completed (waits and posts: when they
    let issue go on / were raised)."""
    link_bytes: int = 0
    """Bytes this device sent to the other devices of its partition (multi-device QPCs)."""
    link_cycles: int = 0
    """Cycles its cores waited for other devices' parts to land (link waits)."""

    @property
    def total_cycles(self) -> int:
        return max(self.core_end, default=0)

    @property
    def latency_seconds(self) -> float:
        return self.total_cycles / self.clock_hz if self.clock_hz else 0.0

    @property
    def core_busy(self) -> list[int]:
        busy = [0] * self.num_cores
        for run in self.runs:
            busy[run.core] += run.cycles
        return busy

    @property
    def core_wait(self) -> list[int]:
        waited = [0] * self.num_cores
        for wait in self.waits:
            waited[wait.core] += wait.cycles
        return waited

    def thread_busy(self, core: int) -> dict[str, int]:
        busy = dict.fromkeys(THREADS, 0)
        for run in self.runs:
            if run.core == core:
                for name, use in run.threads.items():
                    busy[name] += use.busy
        return busy


# ------------------------------------------------------------------------------ compute


def tile_compute(
    program: Program, instr: RunKernel, device: DeviceProfile, opdef: OpDef | None = None
) -> TileCompute:
    kernel = program.kernels[instr.kernel]
    cost = tile_cost(
        kernel.info,
        kernel.unit,
        kernel.macs,
        tuple(e.out_dtype for e in kernel.epilogue),
        instr.out_box,
        [o.box if o is not None else None for o in instr.inputs],
        opdef,
        device,
        epilogue_ops(program, kernel.inputs, kernel.epilogue),
    )
    decoded = _mxfp6_streamed_elements(program, kernel.inputs, instr)
    if not decoded:
        return cost
    rate = device.hvx_threads * MXFP6_DECODE_ELEMENTS_PER_THREAD_CYCLE
    return dataclasses.replace(
        cost,
        decode_cycles=math.ceil(decoded / rate),
        hvx_work=cost.hvx_work + decoded,
    )


def epilogue_ops(
    program: Program, inputs: Sequence[int], epilogue: Sequence[EpilogueDesc]
) -> tuple[int, ...]:
    """Per epilogue step: its HVX instructions per 128 codes (`cost_rates.int8_step_ops`;
    0 for a float step), from the step's attributes and which of its operands are
    constants (scaled once at load, not per element)."""
    if not any(integer_step(e.out_dtype) for e in epilogue):
        return ()
    return tuple(
        int8_step_ops(
            step.op_type,
            step.attrs,
            step.out_dtype,
            [
                k is not None
                and 0 <= k < len(inputs)
                and inputs[k] >= 0
                and program.tensors[inputs[k]].kind == KIND_CONSTANT
                for k in step.inputs
            ],
        )
        if integer_step(step.out_dtype)
        else 0
        for step in epilogue
    )


def _mxfp6_streamed_elements(program: Program, inputs: Sequence[int], instr: RunKernel) -> int:
    """Weights of this tile stored as MXFP6 and streamed into VTCM (not resident): the HVX
    decodes them to fp16 before HMX reads them."""
    count = 0
    for tid, operand in zip(inputs, instr.inputs, strict=False):
        if operand is None or tid < 0:
            continue
        t = program.tensors[tid]
        if t.kind != KIND_CONSTANT or stored_bytes(t, operand.box) >= box_nbytes(
            operand.box, t.dtype
        ):
            continue
        if all(piece.vtcm < program.resident for piece in operand.pieces):
            continue  # resident: decoded once when the program was activated
        count += box_elements(operand.box)
    return count


def tile_compute_cycles(program: Program, instr: RunKernel, device: DeviceProfile) -> int:
    return tile_compute(program, instr, device).cycles


# ------------------------------------------------------------------------- shared resources


class Calendar:
    """A bandwidth shared by every core: capacity per time bucket, booked first come.

    A booking walks the buckets from its start, taking what each has left up to the engine's
    rate, until its bytes have moved. Past the first bucket every bucket offers the same
    engine share, so the walk goes a window of buckets at a time over arrays: a long transfer
    behind a busy stretch of DDR costs a few array operations, not a Python step per bucket.
    The arithmetic is the walk's own (one subtraction per bucket, in order), so the times
    booked are exactly the bucket-by-bucket ones."""

    FIRST_WINDOW = 32

    def __init__(self, bytes_per_cycle: float) -> None:
        self.rate = bytes_per_cycle
        self.capacity = bytes_per_cycle * BUCKET_CYCLES
        self.left = np.full(1024, self.capacity)
        """Bytes each bucket has left (buckets never booked have the full capacity)."""

    def _reach(self, end: int) -> np.ndarray:
        """The buckets, with at least `end` of them."""
        if end > len(self.left):
            grown = np.full(max(end, 2 * len(self.left)), self.capacity)
            grown[: len(self.left)] = self.left
            self.left = grown
        return self.left

    def book(self, start: int, nbytes: int, max_rate: float) -> int:
        """Move `nbytes` from `start` at no more than `max_rate` bytes per cycle, in whatever
        capacity the buckets have left; returns when the last byte has moved."""
        if nbytes <= 0:
            return start
        t = float(start)
        remaining = float(nbytes)
        b = int(t // BUCKET_CYCLES)
        left = self._reach(b + 1)
        bucket_end = (b + 1) * BUCKET_CYCLES
        engine = max_rate * (bucket_end - t)
        take = min(remaining, float(left[b]), engine)
        left[b] -= take
        remaining -= take
        if remaining <= 1e-9:
            # finishes in this bucket: no earlier than the engine allows
            return math.ceil(t + take / max_rate) if take < engine else bucket_end
        # whole buckets from here on: each moves min(what it has left, the engine's share)
        engine = max_rate * BUCKET_CYCLES
        b += 1
        # as many buckets as the engine alone needs (more windows when others booked them)
        width = max(self.FIRST_WINDOW, int(remaining / engine) + 2)
        while True:
            window = self._reach(b + width)[b : b + width]
            takes = np.minimum(window, engine)
            # what remains before each bucket, subtracted bucket after bucket as a walk would
            after = np.subtract.accumulate(np.concatenate(([remaining], takes)))[1:]
            done = np.flatnonzero(after <= 1e-9)
            if not len(done):
                window -= takes
                remaining = float(after[-1])
                b += width
                width *= 2
                continue
            last = int(done[0])
            window[:last] -= takes[:last]
            if last:
                remaining = float(after[last - 1])
            take = min(remaining, float(window[last]), engine)
            window[last] -= take
            t_last = (b + last) * BUCKET_CYCLES
            return math.ceil(t_last + take / max_rate) if take < engine else t_last + BUCKET_CYCLES


class _TimeMap:
    """For one core's VTCM: when the last write to each byte range completes, and when the
    last read of it completes (intervals split at every buffer boundary seen)."""

    def __init__(self) -> None:
        self.bounds: list[int] = [0]
        self.written: list[int] = [0]
        self.read: list[int] = [0]

    def _split(self, at: int) -> int:
        i = bisect.bisect_right(self.bounds, at) - 1
        if self.bounds[i] == at:
            return i
        self.bounds.insert(i + 1, at)
        self.written.insert(i + 1, self.written[i])
        self.read.insert(i + 1, self.read[i])
        return i + 1

    def _range(self, lo: int, hi: int) -> range:
        first = self._split(lo)
        last = self._split(hi)
        return range(first, last)

    def ready_to_read(self, lo: int, hi: int) -> int:
        return max((self.written[i] for i in self._range(lo, hi)), default=0)

    def ready_to_write(self, lo: int, hi: int) -> int:
        return max((max(self.written[i], self.read[i]) for i in self._range(lo, hi)), default=0)

    def mark_read(self, lo: int, hi: int, end: int) -> None:
        for i in self._range(lo, hi):
            self.read[i] = max(self.read[i], end)

    def mark_written(self, lo: int, hi: int, end: int) -> None:
        for i in self._range(lo, hi):
            self.written[i] = end
            self.read[i] = end


@dataclass
class _Core:
    index: int
    stream: list[Instr]
    pc: int = 0
    now: int = 0
    """Issue time of the next instruction."""
    dma_free: int = 0
    """When the DMA queue to and from DDR (the memory NoC) can start its next transfer."""
    noc_free: int = 0
    """When the queue of core-to-core copies (the compute NoC) can start its next one."""
    units: dict[str, int] = field(default_factory=lambda: {"hmx": 0, "hvx": 0})
    done: int = 0
    """Completion of the latest-finishing instruction issued so far."""
    vtcm: _TimeMap = field(default_factory=_TimeMap)
    last_kernel: int = -1


class _Scheduler:
    def __init__(
        self,
        program: Program,
        device: DeviceProfile,
        timeline: Timeline,
        inputs_ready: bool = False,
    ) -> None:
        self.program = program
        self.device = device
        self.timeline = timeline
        self.ddr = Calendar(device.ddr_bandwidth_bytes_per_s / device.clock_hz)
        self.noc = Calendar(device.noc_bandwidth_bytes_per_s / device.clock_hz)
        self.engine = float(device.dma_bytes_per_cycle)
        self.opdefs = [
            REGISTRY.lookup(k.info.op_type, k.info.domain, k.info.opset) for k in program.kernels
        ]
        self.runs: dict[tuple[int, int], KernelRun] = {}
        tensors = program.tensors
        self.ports = [*program.inputs, *program.outputs]
        self.port_of_tensor = {t: i for i, t in enumerate(program.inputs)}
        self.ring: list[int] = []
        landed = 0.0
        retained = program.retained  # on the device already: never crosses the host link
        linked = program.linked_ports  # from another device, over a link
        for t in program.inputs:
            landed += 0 if t in retained or tensors[t].name in linked else tensors[t].nbytes
            ring = 0 if inputs_ready else landed / device.soc_link_bytes_per_s * device.clock_hz
            self.ring.append(int(np.ceil(ring)))
        self.input_ranges = [
            (tensors[t].ddr_offset, tensors[t].ddr_offset + tensors[t].nbytes)
            for t in program.inputs
        ]

        link = program.meta.get("mdp", {}).get("link") or {}
        fallback = link_between("host", same_card=True)
        self.link_rate = float(link.get("bytes_per_s", fallback.bytes_per_s)) / device.clock_hz
        """Bytes per cycle one device sends to its peers (its PCIe port's payload rate)."""
        self.link_latency = int(
            math.ceil(float(link.get("latency_s", fallback.latency_s)) * device.clock_hz)
        )
        self.rank = int(program.meta.get("mdp", {}).get("rank", 0))
        self.link_free = 0
        self.landed: dict[int, int] = {}
        """Per link kernel: when the last part for this device lands. The partition's
        devices run the same program shape, so each peer's part to this device leaves when
        this device's part to that peer does and lands a link latency later."""

    def link_send(self, core: _Core, instr: LinkSend) -> tuple[int, int]:
        """A part to a peer crosses the device's PCIe port (one transfer at a time); the
        device's own part is a copy within its DDR."""
        t = self.program.tensors[instr.tensor]
        nbytes = box_nbytes(instr.box, t.dtype)
        start = max(core.now, core.dma_free)
        if instr.peer == self.rank:
            end = self.ddr.book(start + DMA_DESCRIPTOR_CYCLES, 2 * nbytes, self.engine)
            landed = end
        else:
            start = max(start, self.link_free)
            end = start + DMA_DESCRIPTOR_CYCLES + int(math.ceil(nbytes / self.link_rate))
            self.link_free = end
            landed = end + self.link_latency
            self.timeline.link_bytes += nbytes
        self.landed[instr.kernel] = max(self.landed.get(instr.kernel, 0), landed)
        run = self.run(core, instr.kernel)
        run.thread("dma", start, end)
        run.dma_cycles += end - start
        self._touch(run, start, end)
        core.dma_free = end
        core.done = max(core.done, end)
        return start, end

    def link_wait(self, core: _Core, instr: LinkWait) -> tuple[int, int]:
        landed = self.landed.get(instr.kernel, core.now)
        if landed > core.now:
            self.timeline.waits.append(Wait(core.index, core.now, landed, "link", instr.tensor))
            self.timeline.link_cycles += landed - core.now
            core.now = landed
        return core.now, core.now

    def run(self, core: _Core, kernel: int) -> KernelRun:
        key = (kernel, core.index)
        found = self.runs.get(key)
        if found is None:
            found = KernelRun(kernel=kernel, core=core.index, start=0, end=0, first=-1)
            self.runs[key] = found
        return found

    def _touch(self, run: KernelRun, start: int, end: int) -> None:
        run.first = start if run.first < 0 else min(run.first, start)
        run.end = max(run.end, end)

    def _doorbell(self, core: _Core, tensor: int, start: int) -> int:
        """Loads of a graph input wait for its host transfer (the doorbell)."""
        t = self.program.tensors[tensor]
        lo, hi = t.ddr_offset, t.ddr_offset + t.nbytes
        ring = 0
        port = -1
        for p, (a, b) in enumerate(self.input_ranges):
            if lo < b and a < hi and self.ring[p] > ring:
                ring, port = self.ring[p], p
        if port >= 0 and ring > start:
            self.timeline.waits.append(Wait(core.index, start, ring, "doorbell", port))
            self.timeline.port_wait[port] += ring - start
            return ring
        return start

    def dma(
        self, core: _Core, instr: DmaLoad | DmaStore | NocCopy | DmaGather | DmaScatter
    ) -> tuple[int, int]:
        program = self.program
        t = program.tensors[instr.tensor]
        timeline = self.timeline
        c = core.index
        noc = isinstance(instr, NocCopy)
        start = max(core.now, core.noc_free if noc else core.dma_free)
        if isinstance(instr, DmaLoad):
            own = instr.cores >> c & 1
            lo, hi = _part(instr.vtcm, instr.box, instr.buf_box, t.dtype)
            if own:
                start = max(start, core.vtcm.ready_to_write(lo, hi))
            start = self._doorbell(core, instr.tensor, start)
            nbytes = stored_bytes(t, instr.box)
            end = self.ddr.book(start + DMA_DESCRIPTOR_CYCLES, nbytes, self.engine)
            if own:
                core.vtcm.mark_written(lo, hi, end)
            timeline.ddr_read[c] += nbytes
            fanout = len(cores_in(instr.cores))
            run = self.run(core, instr.kernel)
            run.read_bytes += nbytes
            if t.kind == KIND_CONSTANT:
                timeline.ddr_read_constant[c] += nbytes
                run.read_constant_bytes += nbytes
            elif t.kind == KIND_ACTIVATION:
                run.read_spill_bytes += nbytes
            if fanout > 1:
                timeline.multicast[c] += nbytes
                run.multicast_bytes += nbytes
        elif isinstance(instr, DmaGather):
            index_dtype = program.tensors[instr.indices].dtype
            ilo = instr.index_vtcm
            ihi = ilo + box_nbytes(instr.index_box, index_dtype)
            out_dtype = program.tensors[instr.out].dtype
            lo, hi = instr.vtcm, instr.vtcm + box_nbytes(instr.buf_box, out_dtype)
            start = max(start, core.vtcm.ready_to_read(ilo, ihi), core.vtcm.ready_to_write(lo, hi))
            nbytes = gathered_bytes(t, instr)
            slices = box_elements(instr.index_box)
            end = self.ddr.book(start + DMA_DESCRIPTOR_CYCLES * slices, nbytes, self.engine)
            core.vtcm.mark_read(ilo, ihi, end)
            core.vtcm.mark_written(lo, hi, end)
            timeline.ddr_read[c] += nbytes
            run = self.run(core, instr.kernel)
            run.read_bytes += nbytes
            if t.kind == KIND_CONSTANT:
                timeline.ddr_read_constant[c] += nbytes
                run.read_constant_bytes += nbytes
        elif isinstance(instr, DmaScatter):
            pieces = [
                (p.vtcm, p.vtcm + box_nbytes(p.box, program.tensors[tid].dtype))
                for tid, operand in ((instr.source, instr.update), (instr.index, instr.indices))
                for p in operand.pieces
            ]
            for lo, hi in pieces:
                start = max(start, core.vtcm.ready_to_read(lo, hi))
            nbytes = scattered_bytes(program, instr)
            entries = box_elements(instr.indices.box)  # one descriptor per batch entry's rows
            end = self.ddr.book(start + DMA_DESCRIPTOR_CYCLES * entries, nbytes, self.engine)
            for lo, hi in pieces:
                core.vtcm.mark_read(lo, hi, end)
            timeline.ddr_write[c] += nbytes
            run = self.run(core, instr.kernel)
            run.write_bytes += nbytes
        elif isinstance(instr, DmaStore):
            lo, hi = _part(instr.vtcm, instr.box, instr.buf_box, t.dtype)
            start = max(start, core.vtcm.ready_to_read(lo, hi))
            nbytes = box_nbytes(instr.box, t.dtype)
            end = self.ddr.book(start + DMA_DESCRIPTOR_CYCLES, nbytes, self.engine)
            core.vtcm.mark_read(lo, hi, end)
            timeline.ddr_write[c] += nbytes
            run = self.run(core, instr.kernel)
            run.write_bytes += nbytes
        else:
            lo, hi = _part(instr.src_vtcm, instr.box, instr.src_box, t.dtype)
            start = max(start, core.vtcm.ready_to_read(lo, hi))
            if instr.cores >> c & 1:
                dlo, dhi = _part(instr.vtcm, instr.box, instr.buf_box, t.dtype)
                start = max(start, core.vtcm.ready_to_write(dlo, dhi))
            nbytes = box_nbytes(instr.box, t.dtype)
            end = self.noc.book(start + DMA_DESCRIPTOR_CYCLES, nbytes, self.engine)
            core.vtcm.mark_read(lo, hi, end)
            if instr.cores >> c & 1:
                core.vtcm.mark_written(dlo, dhi, end)
            timeline.noc[c] += nbytes
            run = self.run(core, instr.kernel)
            run.noc_bytes += nbytes
            if len(cores_in(instr.cores)) > 1:
                timeline.multicast[c] += nbytes
                run.multicast_bytes += nbytes
        run.thread("dma", start, end)
        run.dma_cycles += end - start
        self._touch(run, start, end)
        if noc:
            core.noc_free = end
        else:
            core.dma_free = end
        core.done = max(core.done, end)
        return start, end

    def kernel(self, core: _Core, instr: RunKernel) -> tuple[int, int]:
        program = self.program
        desc = program.kernels[instr.kernel]
        cost = tile_compute(program, instr, self.device, self.opdefs[instr.kernel])
        start = max(core.now, core.units[cost.unit])
        for tid, operand in zip(desc.inputs, instr.inputs, strict=True):
            if operand is None or tid < 0:
                continue
            dtype = program.tensors[tid].dtype
            for piece in operand.pieces:
                lo = piece.vtcm
                start = max(start, core.vtcm.ready_to_read(lo, lo + box_nbytes(piece.box, dtype)))
        outs = []
        for tid, operand in zip(desc.outputs, instr.outputs, strict=True):
            if operand is None or tid < 0:
                continue
            piece = operand.pieces[0]
            hi = piece.vtcm + box_nbytes(piece.box, program.tensors[tid].dtype)
            outs.append((piece.vtcm, hi))
            start = max(start, core.vtcm.ready_to_write(piece.vtcm, hi))
        end = start + KERNEL_LAUNCH_CYCLES + cost.cycles
        for tid, operand in zip(desc.inputs, instr.inputs, strict=True):
            if operand is None or tid < 0:
                continue
            dtype = program.tensors[tid].dtype
            for piece in operand.pieces:
                core.vtcm.mark_read(piece.vtcm, piece.vtcm + box_nbytes(piece.box, dtype), end)
        for lo, hi in outs:
            core.vtcm.mark_written(lo, hi, end)
        core.units[cost.unit] = end
        decoded = start + KERNEL_LAUNCH_CYCLES + cost.decode_cycles  # MXFP6 weights decoded
        if cost.unit == "hmx" and (cost.epilogue_cycles or cost.decode_cycles):
            core.units["hvx"] = max(core.units["hvx"], decoded + cost.epilogue_cycles)
        run = self.run(core, instr.kernel)
        if cost.unit == "hmx":
            if cost.decode_cycles:
                run.thread("hmx", decoded, decoded + cost.main_cycles)
            else:
                run.thread("hmx", start, start + KERNEL_LAUNCH_CYCLES + cost.main_cycles)
            epi_end = decoded + cost.epilogue_cycles
            for name in HVX_THREADS:
                run.thread(name, start + KERNEL_LAUNCH_CYCLES, epi_end)
        else:
            for name in HVX_THREADS:
                run.thread(name, start, end)
        run.compute_cycles += end - start
        run.hmx_macs += cost.hmx_macs
        run.hmx_padded_macs += cost.hmx_padded_macs
        run.hvx_work += cost.hvx_work
        run.tiles += 1
        run.vtcm_bytes = max(run.vtcm_bytes, max((hi for _, hi in outs), default=0))
        self._touch(run, start, end)
        core.done = max(core.done, end)
        core.last_kernel = instr.kernel
        return start, end


def _part(vtcm: int, box: Box, buf_box: Box, dtype: str) -> tuple[int, int]:
    """The VTCM bytes a transfer of `box` touches in the buffer at `vtcm` holding `buf_box`."""
    lo, hi = box_byte_range(box, buf_box, dtype)
    return vtcm + lo, vtcm + hi


def _next_start(core: _Core) -> int:
    """The earliest its next instruction can start: cores go in this order, so the shared
    calendars are booked roughly in time order."""
    instr = core.stream[core.pc]
    if isinstance(instr, DmaLoad | DmaStore | DmaGather | DmaScatter | LinkSend):
        return max(core.now, core.dma_free)
    if isinstance(instr, NocCopy):
        return max(core.now, core.noc_free)
    return core.now


def _simulate(
    program: Program,
    device: DeviceProfile,
    streams: list[list[Instr]],
    timeline: Timeline,
    inputs_ready: bool = False,
) -> tuple[list[int], _Scheduler, bool]:
    """Run every core's stream through the scoreboard, one instruction at a time from the core
    whose DMA engine or issue point is earliest, so the shared calendars are booked roughly in
    time order."""
    sched = _Scheduler(program, device, timeline, inputs_ready)
    cores = [_Core(c, s) for c, s in enumerate(streams)]
    posted: dict[int, list[int]] = {}
    blocked: dict[int, list[_Core]] = {}
    ready = [(0, c.index) for c in cores if c.stream]
    heapq.heapify(ready)
    issued: list[list[tuple[int, int]]] = [[] for _ in cores]
    timeline.issued = issued
    while ready:
        _, index = heapq.heappop(ready)
        core = cores[index]
        instr = core.stream[core.pc]
        if isinstance(instr, SemWait):
            times = posted.get(instr.sem, [])
            if len(times) < instr.count:
                blocked.setdefault(instr.sem, []).append(core)
                continue
            t = sorted(times)[instr.count - 1]
            if t > core.now:
                timeline.waits.append(Wait(index, core.now, t, "semaphore", instr.sem))
                core.now = t
            span = (core.now, core.now)
        elif isinstance(instr, SemPost):
            t = max(core.now, core.done)
            posted.setdefault(instr.sem, []).append(t)
            run = sched.runs.get((core.last_kernel, index))
            first = run.first if run is not None and run.first >= 0 else t
            timeline.increments.append(
                SemIncrement(index, instr.sem, core.last_kernel, t, t - first)
            )
            for waiter in blocked.pop(instr.sem, []):
                heapq.heappush(ready, (waiter.now, waiter.index))
            span = (t, t)
        elif isinstance(instr, RunKernel):
            span = sched.kernel(core, instr)
        elif isinstance(instr, LinkSend):
            span = sched.link_send(core, instr)
        elif isinstance(instr, LinkWait):
            span = sched.link_wait(core, instr)
        else:
            span = sched.dma(core, instr)  # type: ignore[arg-type]
        issued[index].append(span)
        core.pc += 1
        if core.pc < len(core.stream):
            heapq.heappush(ready, (_next_start(core), index))
    complete = all(c.pc >= len(c.stream) for c in cores)
    return [max(c.done, c.now) for c in cores], sched, complete


def _windows(runs: list[KernelRun], cores: int) -> list[KernelRun]:
    """Give every kernel a window of its core's time: in order of completion, from the end of
    the previous window (or its own first start, if later) to its last completion."""
    out: list[KernelRun] = []
    for c in range(cores):
        mine = sorted((r for r in runs if r.core == c), key=lambda r: (r.end, r.first))
        previous = 0
        for run in mine:
            run.start = min(max(run.first, previous), run.end)
            previous = run.end
            out.append(run)
    return out


def _empty_timeline(device: DeviceProfile, cores: int, ports: int) -> Timeline:
    return Timeline(
        clock_hz=device.clock_hz,
        num_cores=cores,
        ddr_read=[0] * cores,
        ddr_read_constant=[0] * cores,
        ddr_write=[0] * cores,
        multicast=[0] * cores,
        noc=[0] * cores,
        port_wait=[0] * ports,
    )


def build_timeline(
    program: Program, device: DeviceProfile, *, inputs_ready: bool = False
) -> Timeline:
    """Schedule one inference of `program` on `device` (estimated). The inputs cross PCIe
    from the host first, unless `inputs_ready` (already in DDR: the inference after this
    one, when the host queues several)."""
    cores = program.num_cores
    n_in = len(program.inputs)
    ports = [*program.inputs, *program.outputs]
    timeline = _empty_timeline(device, cores, len(ports))
    timeline.port_names = [program.tensors[t].name for t in ports]
    timeline.port_is_input = [i < n_in for i in range(len(ports))]
    kept = {*program.retained, *program.retained.values()}
    timeline.port_bytes = [0 if t in kept else program.tensors[t].nbytes for t in ports]
    # Program activation: the resident constants' loads, once, on their own.
    setup = _empty_timeline(device, cores, len(ports))
    setup_streams = program.setup or [[] for _ in range(cores)]
    setup_end, _, _ = _simulate(program, device, setup_streams, setup)
    timeline.activation_cycles = [
        ACTIVATION_BASE_CYCLES + ACTIVATION_CYCLES_PER_INSTR * len(s) + setup_end[c]
        for c, s in enumerate(program.streams)
    ]
    timeline.activation_ddr_read = setup.ddr_read

    core_end, sched, complete = _simulate(program, device, program.streams, timeline, inputs_ready)
    timeline.complete = complete
    timeline.port_ring = [*sched.ring, *([0] * len(program.outputs))]
    timeline.runs = _windows(list(sched.runs.values()), cores)
    # a core's inference ends when its last kernel window does (its windows tile its time)
    last = [0] * cores
    for run in timeline.runs:
        last[run.core] = max(last[run.core], run.end)
    timeline.core_end = [last[c] if last[c] else core_end[c] for c in range(cores)]
    end = timeline.total_cycles
    # An output is complete when the last store into it lands.
    done = [0] * len(program.outputs)
    out_index = {t: i for i, t in enumerate(program.outputs)}
    for run in timeline.runs:
        if run.kernel < 0:
            continue
        for t in program.kernels[run.kernel].outputs:
            if t in out_index:
                done[out_index[t]] = max(done[out_index[t]], run.end)
    for i in range(len(program.outputs)):
        timeline.port_ring[n_in + i] = done[i]
        timeline.port_wait[n_in + i] = end - done[i]
    return timeline
