"""The cost model: cycles for every instruction of a program on a modelled device.

Each core has six threads, as the vendor's profiles show them: four HVX vector threads, one
HMX tensor thread and one DMA issue thread. A kernel tile costs:

- compute: HMX MACs at the device's HMX rate (fp32 at 1/16 of fp16: HMX has no fp32 path;
  int8 at the int8 rate), or HVX work spread over the four threads at one 128-byte vector per
  thread and cycle; a fused epilogue runs on HVX alongside HMX (streamed, so the tile takes the
  longer of the two);
- DMA: a fixed descriptor cost plus bytes over this core's share of the SoC's DDR bandwidth,
  shared by the cores that run the same kernel (those active at the time), capped by one DMA
  engine's rate.

Within a kernel the DMA thread runs one tile ahead (double buffering): tile i+1 loads while
tile i computes, and tile i's results are stored after that load. A kernel ends on a core when
its last store lands; the core then posts the kernel's semaphore. The timeline walks every
core's stream honouring semaphores and the host's input doorbells (inputs arrive over PCIe in
port order), so waits, idle time and the inference duration come out of the schedule, not out
of a formula. Everything here is an estimate of a modelled device and is labelled so wherever
it is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from compiler_core.devices import DeviceProfile
from compiler_core.lowering.program import (
    KIND_CONSTANT,
    DmaLoad,
    DmaStore,
    Instr,
    Program,
    RunKernel,
    SemPost,
    SemWait,
)
from compiler_core.ops.registry import Box, box_shape

HVX_BYTES_PER_THREAD_CYCLE = 128
"""One 1024-bit HVX vector per thread and cycle."""
FP32_HMX_SLOWDOWN = 16
"""HMX has no fp32 path: fp32 MACs run on HVX, modelled as 1/16 of the fp16 HMX rate."""
DMA_ENGINE_BYTES_PER_CYCLE = 64
"""The most one core's DMA engine moves per cycle, however idle the rest of the SoC is."""
DMA_DESCRIPTOR_CYCLES = 24
"""Fixed cost of issuing one DMA transfer (descriptor setup), modelled."""
KERNEL_LAUNCH_CYCLES = 16
"""Fixed cost of starting one kernel tile, modelled."""
ACTIVATION_BASE_CYCLES = 4096
ACTIVATION_CYCLES_PER_INSTR = 2
"""Pre-inference activation (setup) of a core: a fixed part plus its stream length, modelled."""
HOST_LINK_BYTES_PER_S = 16e9
"""Host-to-device input transfer (PCIe Gen4 x8, modelled): input doorbells ring as inputs land."""

HVX_THREADS = ("hvx0", "hvx1", "hvx2", "hvx3")
THREADS = (*HVX_THREADS, "hmx", "dma")
"""Thread lanes of every core, in the order stats buffers and traces use."""


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
    """One kernel's tiles on one core: the core is in this kernel over [start, end)."""

    kernel: int
    core: int
    start: int
    end: int
    compute_cycles: int = 0
    dma_cycles: int = 0
    tiles: int = 0
    read_bytes: int = 0
    read_constant_bytes: int = 0
    write_bytes: int = 0
    vtcm_bytes: int = 0
    hmx_macs: int = 0
    hvx_work: int = 0
    threads: dict[str, ThreadUse] = field(default_factory=dict)

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
    """A semaphore post: the time it lands and the cycles of the kernel it completes."""

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
    port_names: list[str] = field(default_factory=list)
    port_is_input: list[bool] = field(default_factory=list)
    port_bytes: list[int] = field(default_factory=list)
    port_ring: list[int] = field(default_factory=list)
    """Input ports: when the host's doorbell rang; outputs: when the output was complete."""
    port_wait: list[int] = field(default_factory=list)
    """Input ports: core cycles stalled on the doorbell; outputs: cycles the finished output
    waited for the end of the inference."""
    complete: bool = True
    """False when a stream blocked forever (a program the runtime would report deadlocked)."""

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


def _elements(box: Box) -> int:
    return int(np.prod(box_shape(box), dtype=np.int64))


def _itemsize(dtype: str) -> int:
    return 1 if dtype == "bool" else np.dtype(dtype).itemsize


@dataclass(frozen=True)
class TileCompute:
    """Compute cycles of one tile: the main unit's and the HVX epilogue's (run alongside)."""

    unit: str
    main_cycles: int
    epilogue_cycles: int
    hmx_macs: int
    hvx_work: int

    @property
    def cycles(self) -> int:
        return max(self.main_cycles, self.epilogue_cycles)


def _hvx_rate(device: DeviceProfile, dtype: str) -> int:
    return max(1, device.hvx_threads * HVX_BYTES_PER_THREAD_CYCLE // _itemsize(dtype))


def tile_compute(program: Program, instr: RunKernel, device: DeviceProfile) -> TileCompute:
    kernel = program.kernels[instr.kernel]
    out_shape = kernel.info.out_shapes[0] if kernel.info.out_shapes else ()
    out_total = max(1, int(np.prod(out_shape, dtype=np.int64)))
    tile_elems = _elements(instr.out_box)
    share = tile_elems / out_total
    dtype = kernel.info.out_dtypes[0] if kernel.info.out_dtypes else "float32"
    epilogue_work = out_total * len(kernel.epilogue)
    base_work = max(0, kernel.macs - epilogue_work) * share
    epi_tile = tile_elems * len(kernel.epilogue)
    epi_dtype = kernel.epilogue[-1].out_dtype if kernel.epilogue else dtype
    if kernel.unit == "hmx":
        rate = device.hmx_fp16_macs_per_cycle
        if dtype in ("float32", "float64"):
            rate //= FP32_HMX_SLOWDOWN
        elif dtype in ("int8", "uint8"):
            rate = device.hmx_int8_macs_per_cycle
        return TileCompute(
            unit="hmx",
            main_cycles=int(np.ceil(base_work / max(1, rate))),
            epilogue_cycles=int(np.ceil(epi_tile / _hvx_rate(device, epi_dtype))),
            hmx_macs=int(round(base_work)),
            hvx_work=epi_tile,
        )
    work = base_work + epi_tile
    return TileCompute(
        unit="hvx",
        main_cycles=int(np.ceil(work / _hvx_rate(device, dtype))),
        epilogue_cycles=0,
        hmx_macs=0,
        hvx_work=int(round(work)),
    )


def tile_compute_cycles(program: Program, instr: RunKernel, device: DeviceProfile) -> int:
    return tile_compute(program, instr, device).cycles


@dataclass
class _Tile:
    loads: list[DmaLoad] = field(default_factory=list)
    run: RunKernel | None = None
    stores: list[DmaStore] = field(default_factory=list)


@dataclass
class _Block:
    """One kernel's part of a core's stream: waits, then tiles, then the post."""

    waits: list[SemWait] = field(default_factory=list)
    tiles: list[_Tile] = field(default_factory=list)
    post: SemPost | None = None

    @property
    def kernel(self) -> int | None:
        for tile in self.tiles:
            if tile.run is not None:
                return tile.run.kernel
        return self.post.sem if self.post is not None else None


def _blocks(stream: list[Instr]) -> list[_Block]:
    blocks: list[_Block] = []
    block = _Block()
    for instr in stream:
        if isinstance(instr, SemWait):
            if block.tiles or block.post is not None:
                blocks.append(block)
                block = _Block()
            block.waits.append(instr)
        elif isinstance(instr, DmaLoad):
            if not block.tiles or block.tiles[-1].run is not None:
                block.tiles.append(_Tile())
            block.tiles[-1].loads.append(instr)
        elif isinstance(instr, RunKernel):
            if not block.tiles or block.tiles[-1].run is not None:
                block.tiles.append(_Tile())
            block.tiles[-1].run = instr
        elif isinstance(instr, DmaStore):
            if not block.tiles:
                block.tiles.append(_Tile())
            block.tiles[-1].stores.append(instr)
        else:
            block.post = instr
            blocks.append(block)
            block = _Block()
    if block.waits or block.tiles:
        blocks.append(block)
    return blocks


class _Scheduler:
    def __init__(self, program: Program, device: DeviceProfile) -> None:
        self.program = program
        self.device = device
        self.ddr_bytes_per_cycle = device.ddr_bandwidth_bytes_per_s / device.clock_hz
        cores_of: dict[int, set[int]] = {}
        for core, stream in enumerate(program.streams):
            for instr in stream:
                if isinstance(instr, RunKernel):
                    cores_of.setdefault(instr.kernel, set()).add(core)
        self.active_cores = {k: len(v) for k, v in cores_of.items()}
        tensors = program.tensors
        self.ports = [*program.inputs, *program.outputs]
        self.port_range = [
            (tensors[t].ddr_offset, tensors[t].ddr_offset + tensors[t].nbytes) for t in self.ports
        ]
        self.ring: list[int] = []
        landed = 0.0
        for t in program.inputs:
            landed += tensors[t].nbytes
            self.ring.append(int(np.ceil(landed / HOST_LINK_BYTES_PER_S * device.clock_hz)))

    def dma_cycles(self, nbytes: int, transfers: int, kernel: int) -> int:
        active = max(1, self.active_cores.get(kernel, 1))
        rate = min(DMA_ENGINE_BYTES_PER_CYCLE, self.ddr_bytes_per_cycle / active)
        return transfers * DMA_DESCRIPTOR_CYCLES + int(np.ceil(nbytes / rate))

    def nbytes(self, instr: DmaLoad | DmaStore) -> int:
        t = self.program.tensors[instr.tensor]
        n = _elements(instr.box) * _itemsize(t.dtype)
        logical = _elements(tuple((0, d) for d in t.shape)) * _itemsize(t.dtype)
        if t.kind == KIND_CONSTANT and 0 < t.nbytes < logical:
            # An encoded constant (MXFP6 weight): the DMA moves its stored bytes.
            return -(-n * t.nbytes // logical)
        return n

    def input_ports(self, block: _Block) -> list[int]:
        """Input ports whose bytes this block's loads read."""
        ports: set[int] = set()
        n_in = len(self.program.inputs)
        for tile in block.tiles:
            for load in tile.loads:
                t = self.program.tensors[load.tensor]
                lo, hi = t.ddr_offset, t.ddr_offset + t.nbytes
                for p in range(n_in):
                    a, b = self.port_range[p]
                    if lo < b and a < hi:
                        ports.add(p)
        return sorted(ports)

    def run_block(self, core: int, block: _Block, start: int, timeline: Timeline) -> int:
        """Schedule a block's tiles from `start`; returns when its last store lands."""
        kernel = block.kernel if block.kernel is not None else -1
        run = KernelRun(kernel=kernel, core=core, start=start, end=start)
        dma_free = start
        unit_free = start
        pending: tuple[int, list[DmaStore]] | None = None
        program = self.program

        def store(ready: int, stores: list[DmaStore]) -> None:
            nonlocal dma_free
            if not stores:
                return
            size = sum(self.nbytes(s) for s in stores)
            begin = max(dma_free, ready)
            end = begin + self.dma_cycles(size, len(stores), kernel)
            run.thread("dma", begin, end)
            run.dma_cycles += end - begin
            run.write_bytes += size
            timeline.ddr_write[core] += size
            dma_free = end

        for tile in block.tiles:
            if tile.loads:
                size = sum(self.nbytes(ld) for ld in tile.loads)
                const = sum(
                    self.nbytes(ld)
                    for ld in tile.loads
                    if program.tensors[ld.tensor].kind == KIND_CONSTANT
                )
                end = dma_free + self.dma_cycles(size, len(tile.loads), kernel)
                run.thread("dma", dma_free, end)
                run.dma_cycles += end - dma_free
                run.read_bytes += size
                run.read_constant_bytes += const
                timeline.ddr_read[core] += size
                timeline.ddr_read_constant[core] += const
                dma_free = end
            if pending is not None:
                store(*pending)
                pending = None
            if tile.run is not None:
                cost = tile_compute(program, tile.run, self.device)
                begin = max(dma_free if tile.loads else start, unit_free)
                cycles = KERNEL_LAUNCH_CYCLES + cost.cycles
                end = begin + cycles
                if cost.unit == "hmx":
                    run.thread("hmx", begin, begin + KERNEL_LAUNCH_CYCLES + cost.main_cycles)
                    epi_end = begin + KERNEL_LAUNCH_CYCLES + cost.epilogue_cycles
                    for name in HVX_THREADS:
                        run.thread(name, begin + KERNEL_LAUNCH_CYCLES, epi_end)
                else:
                    for name in HVX_THREADS:
                        run.thread(name, begin, end)
                run.compute_cycles += cycles
                run.hmx_macs += cost.hmx_macs
                run.hvx_work += cost.hvx_work
                run.tiles += 1
                vtcm = max(
                    (
                        o.vtcm + _elements(o.box) * _itemsize(program.tensors[t].dtype)
                        for o, t in zip(
                            tile.run.outputs, program.kernels[tile.run.kernel].outputs, strict=True
                        )
                        if o is not None
                    ),
                    default=0,
                )
                run.vtcm_bytes = max(run.vtcm_bytes, vtcm)
                unit_free = end
                pending = (end, tile.stores)
            else:
                store(unit_free, tile.stores)
        if pending is not None:
            store(*pending)
        run.end = max(dma_free, unit_free)
        if block.tiles:
            timeline.runs.append(run)
        return run.end


def build_timeline(program: Program, device: DeviceProfile) -> Timeline:
    """Schedule one inference of `program` on `device` (estimated)."""
    cores = program.num_cores
    sched = _Scheduler(program, device)
    n_in = len(program.inputs)
    timeline = Timeline(
        clock_hz=device.clock_hz,
        num_cores=cores,
        core_end=[0] * cores,
        activation_cycles=[
            ACTIVATION_BASE_CYCLES + ACTIVATION_CYCLES_PER_INSTR * len(s) for s in program.streams
        ],
        ddr_read=[0] * cores,
        ddr_read_constant=[0] * cores,
        ddr_write=[0] * cores,
        port_names=[program.tensors[t].name for t in sched.ports],
        port_is_input=[i < n_in for i in range(len(sched.ports))],
        port_bytes=[program.tensors[t].nbytes for t in sched.ports],
        port_ring=[*sched.ring, *([0] * len(program.outputs))],
        port_wait=[0] * len(sched.ports),
    )
    blocks = [_blocks(stream) for stream in program.streams]
    posted: dict[int, list[int]] = {}
    next_block = [0] * cores
    clock = [0] * cores
    while True:
        progressed = False
        for core in range(cores):
            while next_block[core] < len(blocks[core]):
                block = blocks[core][next_block[core]]
                ready = clock[core]
                blocker = -1
                blocked = False
                for wait in block.waits:
                    times = posted.get(wait.sem, [])
                    if len(times) < wait.count:
                        blocked = True
                        break
                    t = sorted(times)[wait.count - 1]
                    if t > ready:
                        ready, blocker = t, wait.sem
                if blocked:
                    break
                if ready > clock[core]:
                    timeline.waits.append(Wait(core, clock[core], ready, "semaphore", blocker))
                    clock[core] = ready
                ports = sched.input_ports(block)
                if ports:
                    port = max(ports, key=lambda p: sched.ring[p])
                    ring = sched.ring[port]
                    if ring > clock[core]:
                        timeline.waits.append(Wait(core, clock[core], ring, "doorbell", port))
                        timeline.port_wait[port] += ring - clock[core]
                        clock[core] = ring
                start = clock[core]
                clock[core] = sched.run_block(core, block, start, timeline)
                if block.post is not None:
                    kernel = block.kernel if block.kernel is not None else block.post.sem
                    posted.setdefault(block.post.sem, []).append(clock[core])
                    timeline.increments.append(
                        SemIncrement(core, block.post.sem, kernel, clock[core], clock[core] - start)
                    )
                next_block[core] += 1
                progressed = True
        if all(n >= len(b) for n, b in zip(next_block, blocks, strict=True)):
            break
        if not progressed:
            timeline.complete = False
            break
    timeline.core_end = clock
    end = timeline.total_cycles
    for i in range(len(program.outputs)):
        lo, hi = sched.port_range[n_in + i]
        writers = [
            r.end
            for r in timeline.runs
            if r.kernel >= 0
            and any(
                lo < program.tensors[t].ddr_offset + program.tensors[t].nbytes
                and program.tensors[t].ddr_offset < hi
                for t in program.kernels[r.kernel].outputs
                if t >= 0
            )
        ]
        done = max(writers, default=0)
        timeline.port_ring[n_in + i] = done
        timeline.port_wait[n_in + i] = end - done
    return timeline
