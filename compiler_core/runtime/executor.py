"""The functional runtime: execute a program's per-core streams over modelled DDR and VTCM.

It is the oracle for lowering, tiling and memory planning, so it is strict: every DMA and
kernel operand is bounds-checked, constants are read-only, and cores run "until blocked" one
after another, so that a missing semaphore wait shows up as a wrong answer or a deadlock
instead of being hidden by a lucky interleaving.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import EllipsisType
from typing import TYPE_CHECKING, Any

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.lowering.program import (
    KIND_CONSTANT,
    KIND_INPUT,
    KIND_ONCHIP,
    DmaGather,
    DmaLoad,
    DmaScatter,
    DmaStore,
    KernelDesc,
    LinkSend,
    LinkWait,
    NocCopy,
    Operand,
    Program,
    RunKernel,
    SemPost,
    SemWait,
    TensorDesc,
    cores_in,
    gathered_bytes,
    is_encoded_state,
    scattered_bytes,
    stored_bytes,
)
from compiler_core.ops import REGISTRY
from compiler_core.ops.conv import WIDE_OPERANDS, product_accumulator
from compiler_core.ops.registry import Box, NodeInfo, OpDef, TileCtx, box_shape
from compiler_core.runtime.copies import ConstantCopies, Holding
from compiler_core.runtime.deferred import DeferredLoads
from compiler_core.runtime.joins import JoinTile, plan_joins
from compiler_core.runtime.mirrors import Key, Mirrors
from compiler_core.runtime.replay import Span
from compiler_core.runtime.shared import RunTile, SharedTile, plan

if TYPE_CHECKING:
    from compiler_core.runtime.numerics import FiniteProbe


class RuntimeFault(CompileError):
    """The program did something the modelled hardware would not allow."""

    def __init__(self, message: str) -> None:
        super().__init__("runtime_fault", message)


@dataclass
class _Kernel:
    desc: KernelDesc
    opdef: OpDef
    steps: list[tuple[OpDef, object]]


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _view(box: Box) -> tuple[slice | EllipsisType, ...]:
    """Index a tensor by a box and get a view, 0-d tensors included (`a[()]` is a copy)."""
    return (*_slices(box), Ellipsis)


@dataclass
class Traffic:
    """Bytes the DMA instructions of one core moved in one inference (or in activation)."""

    ddr_read: int = 0
    ddr_read_constant: int = 0
    ddr_write: int = 0
    multicast: int = 0
    """Bytes of loads and copies that fed more than one core (each counted once)."""
    noc: int = 0
    """Bytes moved VTCM to VTCM over the NoC (each transfer counted once)."""
    link: int = 0
    """Bytes sent to other devices (and copied to this one) by link transfers."""

    def as_row(self) -> list[int]:
        return [self.ddr_read, self.ddr_read_constant, self.ddr_write, self.multicast, self.noc]


class Machine:
    """DDR (constants read-only, backed by the QPC's bytes) plus one VTCM per core.

    `decoded`: encoded constants (MXFP6 weights) as the kernels read them, by DDR offset;
    the loader decodes them once (see compiler_core.mxfp)."""

    def __init__(
        self,
        program: Program,
        constants: memoryview | bytes,
        vtcm_bytes: int,
        decoded: Mapping[int, np.ndarray] | None = None,
    ) -> None:
        self.program = program
        self.decoded = dict(decoded or {})
        if len(constants) < program.constants_size:
            raise RuntimeFault(
                f"constants segment has {len(constants):,} bytes, program needs "
                f"{program.constants_size:,}"
            )
        if program.resident > vtcm_bytes:
            raise RuntimeFault(
                f"the program keeps {program.resident:,} bytes resident in VTCM, the device "
                f"has {vtcm_bytes:,}"
            )
        self.constants = np.frombuffer(constants, dtype=np.uint8, count=program.constants_size)
        self.dynamic = np.zeros(program.ddr_size - program.constants_size, dtype=np.uint8)
        self.vtcm = list(np.zeros((program.num_cores, vtcm_bytes), dtype=np.uint8))
        """One array's rows, so a multicast to evenly spaced cores is one strided write."""
        self.vtcm_bytes = vtcm_bytes
        self.protected = 0
        """VTCM bytes [0, protected) are read-only: the resident constants, once loaded."""
        self.bound: list[tuple[int, np.ndarray]] = []
        """Retained-state buffers (-retained-state) that live outside this program's DDR
        image: (DDR offset, bytes). They keep their contents from run to run and are shared
        by every specialization of the network (see `bind`)."""

    def bind(self, offset: int, storage: np.ndarray) -> None:
        """Back DDR [offset, offset + storage.nbytes) with `storage` (uint8, kept as is)."""
        self.bound = [(o, s) for o, s in self.bound if o != offset] + [(offset, storage)]

    def raw(self, t: TensorDesc) -> np.ndarray:
        """The DDR bytes of a retained-state tensor (uint8), however it is stored."""
        start, end = t.ddr_offset, t.ddr_offset + t.nbytes
        for offset, storage in self.bound:
            if offset <= start and end <= offset + storage.nbytes:
                return storage[start - offset : end - offset]
        base = self.program.constants_size
        if start < base or end > self.program.ddr_size:
            raise RuntimeFault(f"tensor {t.name} [{start}, {end}) is not dynamic DDR")
        return self.dynamic[start - base : end - base]

    def mx_store(self, t: TensorDesc) -> Any:
        """An MXINT8-stored retained tensor's blocks, read and written by boxes."""
        from compiler_core.mxint8 import Mxint8Store

        return Mxint8Store(self.raw(t), t.shape, t.dtype)

    def tensor(self, t: TensorDesc, *, write: bool = False) -> np.ndarray:
        if is_encoded_state(t):
            raise RuntimeFault(f"{t.name} is stored as MXINT8 blocks: no plain view of it")
        if t.nbytes == 0:  # an empty tensor owns no bytes, wherever its offset points
            return np.empty(t.shape, dtype=np.dtype(t.dtype))
        if t.kind == KIND_ONCHIP:
            raise RuntimeFault(f"DMA of {t.name} from DDR: it lives only in VTCM")
        start, end = t.ddr_offset, t.ddr_offset + t.nbytes
        if end > self.program.ddr_size or start < 0:
            raise RuntimeFault(f"tensor {t.name} [{start}, {end}) lies outside DDR")
        for offset, storage in self.bound:
            if offset <= start and end <= offset + storage.nbytes:
                raw = storage[start - offset : end - offset]
                return raw.view(np.dtype(t.dtype)).reshape(t.shape)
        base = self.program.constants_size
        if end <= base:
            if write:
                raise RuntimeFault(f"write to constant tensor {t.name}")
            if start in self.decoded:
                return self._decoded(t)
            raw = self.constants[start:end]
        elif start >= base:
            raw = self.dynamic[start - base : end - base]
        else:
            raise RuntimeFault(f"tensor {t.name} straddles the constants region")
        return raw.view(np.dtype(t.dtype)).reshape(t.shape)

    def _decoded(self, t: TensorDesc) -> np.ndarray:
        array = self.decoded[t.ddr_offset]
        if array.shape != t.shape or array.dtype != np.dtype(t.dtype):
            raise RuntimeFault(
                f"encoded constant {t.name} decodes to {array.dtype}{list(array.shape)}, the "
                f"program reads {t.dtype}{list(t.shape)}"
            )
        return array

    def buffer(
        self, core: int, offset: int, buf_box: Box, dtype: str, *, write: bool = False
    ) -> np.ndarray:
        """The VTCM buffer at `offset` of `core` that holds `buf_box` of a tensor."""
        shape = box_shape(buf_box)
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if offset < 0 or offset + size > self.vtcm_bytes:
            raise RuntimeFault(
                f"core {core}: VTCM access [{offset}, {offset + size}) beyond {self.vtcm_bytes}"
            )
        if write and offset < self.protected and size > 0:
            raise RuntimeFault(
                f"core {core}: write to VTCM [{offset}, {offset + size}) inside the resident "
                f"constants [0, {self.protected})"
            )
        return self.vtcm[core][offset : offset + size].view(np.dtype(dtype)).reshape(shape)

    def part(
        self, core: int, offset: int, buf_box: Box, box: Box, dtype: str, *, write: bool = False
    ) -> np.ndarray:
        """`box` of the buffer holding `buf_box` (a view; the box must lie inside it)."""
        if not contains(buf_box, box):
            raise RuntimeFault(f"core {core}: box {box} is not inside the buffer's {buf_box}")
        view = self.buffer(core, offset, buf_box, dtype, write=write)
        index: tuple[slice | EllipsisType, ...] = (
            *(slice(a - o, b - o) for (a, b), (o, _) in zip(box, buf_box, strict=True)),
            Ellipsis,  # a view, 0-d tensors included
        )
        return view[index]


def spread(views: list[np.ndarray]) -> np.ndarray | None:
    """One writable view over equal views evenly spaced in memory (a multicast's targets:
    one buffer at one offset in several cores' VTCM rows), or None."""
    if len(views) < 2 or views[0].size == 0:
        return None
    first = views[0]
    addresses = [v.__array_interface__["data"][0] for v in views]
    step = addresses[1] - addresses[0]
    if step < first.nbytes or any(
        b - a != step or v.shape != first.shape or v.strides != first.strides
        for a, b, v in zip(addresses, addresses[1:], views[1:], strict=False)
    ):
        return None
    return np.lib.stride_tricks.as_strided(
        first, shape=(len(views), *first.shape), strides=(step, *first.strides)
    )


def contains(outer: Box, inner: Box) -> bool:
    return len(outer) == len(inner) and all(
        o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True)
    )


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in out) else out


def _lookup(op_type: str, domain: str, opset: int) -> OpDef:
    opdef = REGISTRY.lookup(op_type, domain, opset)
    if opdef is None:
        raise RuntimeFault(f"no runtime kernel for {op_type} opset {opset}")
    return opdef


def _check_box(box: Box, shape: tuple[int, ...], what: str) -> None:
    if len(box) != len(shape) or any(
        a < 0 or b > d or a > b for (a, b), d in zip(box, shape, strict=False)
    ):
        raise RuntimeFault(f"{what}: box {box} outside tensor of shape {shape}")


def _nbytes(box: Box, dtype: str) -> int:
    return int(np.prod(box_shape(box), dtype=np.int64)) * np.dtype(dtype).itemsize


def _span(offset: int, buf_box: Box, box: Box, dtype: str) -> tuple[int, int, bool]:
    """The VTCM bytes [start, end) from the first to the last element of `box` in the
    buffer at `offset` holding `buf_box`, and whether the box writes every one of them
    (its rows follow each other: an all-gather's slab of a row-major buffer)."""
    size = np.dtype(dtype).itemsize
    count = int(np.prod(box_shape(box), dtype=np.int64))
    if count == 0:
        return offset, offset, True
    first = last = 0
    stride = size
    for (a, b), (o, e) in zip(reversed(box), reversed(buf_box), strict=True):
        first += (a - o) * stride
        last += (b - 1 - o) * stride
        stride *= e - o
    start, end = offset + first, offset + last + size
    return start, end, end - start == count * size


Step = Callable[[Traffic], None]
"""One instruction of a stream, decoded once: its views and checks are worked out when the
stream is first run, so running it again only moves data and calls kernels."""

_RUN, _WAIT, _POST, _LINK_WAIT = 0, 1, 2, 3


class Links:
    """The links of a partition: every device's executor by its index in the partition. A
    transfer lands in the receiver's DDR at once and counts as an arrival there; the receiver
    may read the bytes only after a LinkWait has seen every arrival it expects."""

    def __init__(self, executors: list[Executor]) -> None:
        self.executors = executors
        for index, executor in enumerate(executors):
            executor.links, executor.device_index = self, index

    def send(self, sender: int, instr: LinkSend, data: np.ndarray, dst_name: str) -> None:
        if instr.peer >= len(self.executors):
            raise RuntimeFault(
                f"device {sender}: link transfer to device {instr.peer}; the partition has "
                f"{len(self.executors)}"
            )
        receiver = self.executors[instr.peer]
        tid = receiver.tensor_ids.get(dst_name)
        t = None if tid is None else receiver.program.tensors[tid]
        if t is None or tid is None or t.dtype != str(data.dtype):
            raise RuntimeFault(
                f"device {sender}: link transfer into {dst_name}, which device {instr.peer}'s "
                "program does not have"
            )
        _check_box(instr.dst_box, t.shape, f"link transfer into {t.name}")
        receiver.machine.tensor(t, write=True)[_view(instr.dst_box)] = data
        receiver.arrivals[tid] = receiver.arrivals.get(tid, 0) + 1


def _fault(error: Exception) -> Step:
    """An instruction that cannot run: it raises when (and only when) the stream reaches it."""

    def step(traffic: Traffic) -> None:
        raise error

    return step


class Executor:
    def __init__(
        self,
        program: Program,
        constants: memoryview | bytes,
        vtcm_bytes: int,
        decoded: Mapping[int, np.ndarray] | None = None,
        *,
        shared_products: bool = True,
        mirrored: bool = True,
    ) -> None:
        """`shared_products` False: every tile computes its own product (runtime/shared.py);
        `mirrored` False: every multicast writes every target (runtime/mirrors.py). The
        answers are the same either way, it is slower."""
        self.program = program
        self.shared_products = shared_products
        self.mirrored = mirrored
        self.machine = Machine(program, constants, vtcm_bytes, decoded)
        self.kernels = [
            _Kernel(
                desc=k,
                opdef=_lookup(k.info.op_type, k.info.domain, k.info.opset),
                steps=[(_lookup(e.op_type, e.domain, e.opset), e) for e in k.epilogue],
            )
            for k in program.kernels
        ]
        self.on_kernel: Callable[[int, int, RunKernel], None] | None = None
        self.probe: FiniteProbe | None = None
        """Set for a diagnosis run only: sees every kernel's operands and results (see
        compiler_core.runtime.numerics); None costs nothing."""
        self.traffic = [Traffic() for _ in range(program.num_cores)]
        """What each core's DMAs moved in the last inference."""
        self.activation_traffic = [Traffic() for _ in range(program.num_cores)]
        """What each core's DMAs moved when the program was activated."""
        self.activated = False
        self.copies = ConstantCopies(
            program.num_cores, tracking=any(self._widened_inputs(k)[0] for k in self.kernels)
        )
        self.deferred = DeferredLoads(program.num_cores)
        """Whole-buffer constant loads of this inference not copied yet (see deferred.py)."""
        self.mirrors = Mirrors(self.machine.vtcm)
        """Multicast boxes written to one target only (see mirrors.py)."""
        self._mirrorable: list[tuple[list[int], list[int]]] = [
            ([], []) for _ in range(program.num_cores)
        ]
        """Per core, the VTCM a multicast of the program writes (starts, ends; disjoint,
        sorted): only there can a core's bytes be mirrored, so only accesses meeting it
        consult the mirrors."""
        self._streams: list[list[tuple[Any, ...]]] | None = None
        """The inference streams, decoded on the first run."""
        self._written_end = [0] * program.num_cores
        """Per core, the end of the highest VTCM byte an inference may write."""
        self._shared: dict[tuple[int, int], SharedTile | JoinTile] = {}
        """Tiles that take their part of one product with others (runtime/shared.py,
        runtime/joins.py), by (core, position in its stream)."""
        self.inference = 0
        """Counts inferences begun (a shared product is valid for one)."""
        self.retained = {program.tensors[i].name: (i, o) for i, o in program.retained.items()}
        """Retained input name -> (input, output) tensor ids: one device buffer that the
        host neither sends nor receives."""
        self.tensor_ids = {t.name: t.id for t in program.tensors}
        """A peer's link transfer names the tensor it writes (the devices' programs have the
        same tensors by name, not always the same ids: their constants differ)."""
        self.links: Links | None = None
        """The partition's links, for a program of a multi-device QPC (see Links)."""
        self.device_index = 0
        self.arrivals: dict[int, int] = {}
        """Link transfers landed in each tensor in this inference."""
        self.awaited: set[int] = set()
        """Tensors whose arrivals a LinkWait has seen in this inference."""
        self._linked = [
            program.tensors[i.dst if isinstance(i, LinkSend) else i.tensor]
            for stream in program.streams
            for i in stream
            if isinstance(i, LinkWait) or (isinstance(i, LinkSend) and i.kernel >= 0)
        ] + [  # a pipeline stage's inputs from the stage before
            t for t in program.tensors if t.name in program.meta.get("mdp", {}).get("receives", ())
        ]
        """Tensors other devices write (the partition's programs send into the same tensors
        of each device): reading one before a LinkWait on it is a race."""
        self._pcs: list[int] = []
        self._sems: list[int] = []

    def bind_state(self, state: dict[str, np.ndarray]) -> None:
        """Use `state`'s arrays (by retained input name) as the retained buffers: runs read
        and update them in place. Unbound ones start as zeros of this executor's own."""
        for name, (tid, _) in self.retained.items():
            t = self.program.tensors[tid]
            if is_encoded_state(t):  # its blocks, kept by the caller as bytes
                blocks = state.get(name)
                if blocks is None or blocks.dtype != np.uint8 or blocks.nbytes != t.nbytes:
                    blocks = state[name] = np.zeros(t.nbytes, np.uint8)  # type: ignore[index]
                self.machine.bind(t.ddr_offset, blocks)
                continue
            array = state[name]
            if array.shape != t.shape or array.dtype != np.dtype(t.dtype):
                raise CompileError(
                    "bad_inputs",
                    f"retained state {name!r} is {array.dtype}{list(array.shape)}, the program "
                    f"keeps {t.dtype}{list(t.shape)}",
                )
            if not array.flags.c_contiguous:
                raise CompileError("bad_inputs", f"retained state {name!r} is not contiguous")
            self.machine.bind(t.ddr_offset, array.reshape(-1).view(np.uint8))

    def activate(self) -> None:
        """Program activation: load the resident constants into every core's VTCM once;
        from then on inferences may read them but never write them."""
        if self.activated:
            return
        machine = self.machine
        machine.protected = 0
        for core_mem in machine.vtcm:
            core_mem[:] = 0
        self.copies.reset()
        self.traffic = self.activation_traffic
        for core, stream in enumerate(self.program.setup):
            for instr in stream:
                if not isinstance(instr, DmaLoad):
                    raise RuntimeFault(f"core {core}: activation runs loads only")
                if instr.vtcm + _nbytes(instr.buf_box, self._dtype(instr.tensor)) > (
                    self.program.resident
                ):
                    raise RuntimeFault(
                        f"core {core}: activation load beyond the resident region "
                        f"[0, {self.program.resident})"
                    )
                self._decode(core, instr, activation=True)(self.traffic[core])
        machine.protected = self.program.resident
        self.copies.seal_resident()
        self.activated = True

    def _dtype(self, tensor: int) -> str:
        return self.program.tensors[tensor].dtype

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.begin(inputs)
        while True:
            progressed, done = self.advance()
            if done:
                return self.finish()
            if not progressed:
                raise RuntimeFault("deadlock: " + "; ".join(self.stuck()))

    def begin(self, inputs: Mapping[str, np.ndarray]) -> None:
        """Start an inference: fresh VTCM and DDR activations, the inputs written, every
        core at the start of its stream (then `advance` until done, then `finish`)."""
        program, machine = self.program, self.machine
        self.activate()
        if self.inference == 1 and self.mirrored and not self.mirrors.judged:
            self.mirrors.judge()  # which buffers stay mirrored: decode the streams again
            self._streams = None
        fresh = self._streams is None
        self._decoded_streams()  # sets how far inferences write VTCM, zeroed next
        machine.dynamic[:] = 0
        for core, core_mem in enumerate(machine.vtcm):
            # an inference writes VTCM below _written_end only, so this restores all zeros
            core_mem[program.resident : self._written_end[core]] = 0
        self.copies.forget_scratch()
        self.deferred.start(fresh=fresh)
        self.mirrors.start(fresh=fresh)
        self.inference += 1
        self.traffic = [Traffic() for _ in range(program.num_cores)]
        host_inputs, host_outputs = program.host_ports()
        for tid, _ in self.retained.values():
            t = program.tensors[tid]
            if not any(o == t.ddr_offset for o, _ in machine.bound):
                machine.bind(t.ddr_offset, np.zeros(t.nbytes, np.uint8))
        expected = {program.tensors[t].name: program.tensors[t] for t in host_inputs}
        missing = sorted(set(expected) - set(inputs))
        unknown = sorted(set(inputs) - set(expected))
        if missing or unknown:
            raise CompileError(
                "bad_inputs",
                f"inputs missing: {missing or 'none'}; unknown inputs: {unknown or 'none'}; "
                f"the network takes {sorted(expected)}",
            )
        for name, t in expected.items():
            array = np.asarray(inputs[name])
            if tuple(array.shape) != t.shape:
                raise CompileError(
                    "bad_inputs",
                    f"input '{name}' has shape {tuple(array.shape)}, the QPC expects {t.shape}",
                )
            if array.dtype != np.dtype(t.dtype):
                if not np.can_cast(array.dtype, t.dtype, casting="same_kind"):
                    raise CompileError(
                        "bad_inputs",
                        f"input '{name}' has dtype {array.dtype}, the QPC expects {t.dtype}",
                    )
            assert t.kind == KIND_INPUT
            machine.tensor(t, write=True)[...] = array
        self._pcs = [0] * program.num_cores
        self._sems = [0] * program.num_semaphores
        self.arrivals.clear()
        self.awaited.clear()  # in place: decoded steps hold this set

    def finish(self) -> dict[str, np.ndarray]:
        """The finished inference's host outputs by name."""
        program = self.program
        self.deferred.finish()
        self.mirrors.finish()
        _, host_outputs = program.host_ports()
        return {
            program.tensors[t].name: self.machine.tensor(program.tensors[t]).copy()
            for t in host_outputs
        }

    def _decoded_streams(self) -> list[list[tuple[Any, ...]]]:
        if self._streams is None:
            self._written_end = [self.program.resident] * self.program.num_cores
            if self.shared_products and not self._shared:
                kernels = [(k.opdef, k.desc.info) for k in self.kernels]
                shared = plan(self.program, kernels, self._constant_view, self.machine.part)
                joins = plan_joins(
                    self.program, kernels, self._constant_view, self.machine.part, shared
                )
                self._shared = {**shared, **joins}
                # joined tiles copy each other's inputs from VTCM directly (joins.py)
                self.mirrors.off |= _joined_buffers(self.program, list(joins))
            if self.mirrored:
                self._mirrorable = _multicast_ranges(self.program, self.mirrors.off)
            streams: list[list[tuple[Any, ...]]] = []
            for core, stream in enumerate(self.program.streams):
                steps: list[tuple[Any, ...]] = []
                for index, instr in enumerate(stream):
                    if isinstance(instr, SemWait):
                        steps.append((_WAIT, instr.sem, instr.count))
                    elif isinstance(instr, LinkWait):
                        steps.append((_LINK_WAIT, instr.tensor, instr.count))
                    elif isinstance(instr, SemPost):
                        steps.append((_POST, instr.sem))
                    else:
                        steps.append((_RUN, self._decode(core, instr, at=index)))
                streams.append(steps)
            self._streams = streams
        return self._streams

    def advance(self) -> tuple[bool, bool]:
        """Run every core until it is blocked (a semaphore or link wait) or done:
        (whether any instruction ran, whether every core is done)."""
        streams = self._decoded_streams()
        sems, pcs, traffic = self._sems, self._pcs, self.traffic
        arrivals = self.arrivals
        progressed = False
        # floating-point errors are values here (inf, nan), never warnings: once per call,
        # not per ufunc (the fused epilogue steps below rely on it)
        with np.errstate(all="ignore"):
            for core, steps in enumerate(streams):
                pc, end, moved = pcs[core], len(steps), traffic[core]
                start = pc
                while pc < end:
                    step = steps[pc]
                    kind = step[0]
                    if kind == _RUN:
                        step[1](moved)
                    elif kind == _WAIT:
                        if sems[step[1]] < step[2]:
                            break
                    elif kind == _LINK_WAIT:
                        if arrivals.get(step[1], 0) < step[2]:
                            break
                        self.awaited.add(step[1])
                    else:
                        sems[step[1]] += 1
                    pc += 1
                pcs[core] = pc
                progressed = progressed or pc != start
        done = all(pc == len(s) for pc, s in zip(pcs, streams, strict=True))
        return progressed, done

    def stuck(self) -> list[str]:
        """What each unfinished core waits for."""
        out = []
        for c, stream in enumerate(self.program.streams):
            if self._pcs[c] >= len(stream):
                continue
            instr = stream[self._pcs[c]]
            if isinstance(instr, LinkWait):
                name = self.program.tensors[instr.tensor].name
                out.append(
                    f"core {c} waits for {instr.count} link transfers into {name} "
                    f"({self.arrivals.get(instr.tensor, 0)} landed)"
                )
            else:
                out.append(f"core {c} waits on semaphore {instr.sem}")  # type: ignore[union-attr]
        return out

    def _may_mirror(self, core: int, start: int, end: int) -> bool:
        """Whether VTCM bytes [start, end) of `core` can be mirrored (see `_mirrorable`)."""
        starts, ends = self._mirrorable[core]
        i = bisect_left(starts, end) - 1
        return i >= 0 and ends[i] > start

    def _targets(self, core: int, mask: int) -> list[int]:
        cores = cores_in(mask)
        if not cores or cores[-1] >= self.program.num_cores:
            raise RuntimeFault(f"core {core}: transfer to cores {mask:#x}")
        return cores

    def _will_write(self, core: int, offset: int, buf_box: Box, dtype: str) -> tuple[int, int]:
        """The VTCM bytes of a buffer an instruction writes (kept for the next zeroing)."""
        end = offset + _nbytes(buf_box, dtype)
        if end > self._written_end[core]:
            self._written_end[core] = end
        return offset, end

    def _destinations(
        self, targets: list[int], instr: DmaLoad | NocCopy, dtype: str
    ) -> list[tuple[int, np.ndarray, tuple[int, int]]]:
        """Each target core of a load or NoC copy: its view of the destination buffer and the
        VTCM bytes written there."""
        machine = self.machine
        return [
            (
                target,
                machine.part(target, instr.vtcm, instr.buf_box, instr.box, dtype, write=True),
                self._will_write(target, instr.vtcm, instr.buf_box, dtype),
            )
            for target in targets
        ]

    def _constant_view(self, tensor: int, box: Box) -> np.ndarray:
        """`box` of a constant tensor, read in place (as a deferred load hands it)."""
        view = self.machine.tensor(self.program.tensors[tensor])[_view(box)]
        view.flags.writeable = False
        return view

    def _decode(self, core: int, instr: object, *, activation: bool = False, at: int = -1) -> Step:
        """The instruction as a step, with every static check done now; a fault it would
        raise is raised when the stream reaches it, as if it ran undecoded. Activation's
        loads copy at once (what they load stays for the program's life)."""
        try:
            if isinstance(instr, DmaLoad):
                return self._load(core, instr, defer=not activation)
            if isinstance(instr, DmaStore):
                return self._store(core, instr)
            if isinstance(instr, NocCopy):
                return self._noc_copy(core, instr)
            if isinstance(instr, DmaGather):
                return self._gather(core, instr)
            if isinstance(instr, DmaScatter):
                return self._scatter(core, instr)
            if isinstance(instr, RunKernel):
                return self._kernel(core, instr, self._shared.get((core, at)))
            if isinstance(instr, LinkSend):
                return self._link_send(core, instr)
            raise RuntimeFault(f"core {core}: unknown instruction {instr!r}")
        except Exception as error:  # noqa: BLE001 - raised when the instruction is reached
            return _fault(error)

    def _load(self, core: int, instr: DmaLoad, *, defer: bool) -> Step:
        machine, copies, deferred, mirrors = self.machine, self.copies, self.deferred, self.mirrors
        t = self.program.tensors[instr.tensor]
        _check_box(instr.box, t.shape, f"DMA load of {t.name}")
        if is_encoded_state(t):
            return self._load_blocks(core, instr, t)
        src = machine.tensor(t)[_view(instr.box)]
        dsts = self._destinations(self._targets(core, instr.cores), instr, t.dtype)
        nbytes = stored_bytes(t, instr.box)
        constant = nbytes if t.kind == KIND_CONSTANT else 0
        if self._linked and t.kind != KIND_CONSTANT:
            guard = self._link_guard(core, t)
            plain = self._plain_load(core, instr, t, src, dsts, nbytes, constant)

            def guarded(traffic: Traffic) -> None:
                guard()
                plain(traffic)

            return guarded
        multicast = nbytes if len(dsts) > 1 else 0
        whole = instr.box == instr.buf_box
        holding = (instr.tensor, instr.box) if t.kind == KIND_CONSTANT and whole else None
        if defer and holding is not None and nbytes > 0:
            src = src.view()
            src.flags.writeable = False  # kernels may be handed it in place of the buffer

            skips: list[Span | None] = [None, None]
            """As a kernel's (`_kernel`): this load's accesses to the deferred loads and to
            the mirrors in the recorded inference, when they did nothing."""

            def deferred_step(traffic: Traffic) -> None:
                d_replay, m_replay = deferred.replay, mirrors.replay
                d_mark, m_mark = d_replay.mark(), m_replay.mark()
                d_skip, m_skip = d_replay.skip(skips[0]), m_replay.skip(skips[1])
                if not (d_skip and m_skip and not copies.tracking):
                    for target, dst, (start, end) in dsts:
                        if not m_skip and mirrors.pending[target]:
                            mirrors.overwrite(target, start, end, whole=True)
                        if not d_skip:
                            deferred.defer(target, start, end, dst, src)
                        copies.wrote(target, start, end, holding)
                if d_mark is not None:
                    skips[0] = d_replay.span(d_mark, [])
                if m_mark is not None:
                    skips[1] = m_replay.span(m_mark, [])
                traffic.ddr_read += nbytes
                traffic.ddr_read_constant += constant
                traffic.multicast += multicast

            return deferred_step

        return self._plain_load(core, instr, t, src, dsts, nbytes, constant)

    def _plain_load(
        self,
        core: int,
        instr: DmaLoad,
        t: TensorDesc,
        src: np.ndarray,
        dsts: list[tuple[int, np.ndarray, tuple[int, int]]],
        nbytes: int,
        constant: int,
    ) -> Step:
        """A load that copies at once."""
        copies, deferred, mirrors = self.copies, self.deferred, self.mirrors
        multicast = nbytes if len(dsts) > 1 else 0
        whole = instr.box == instr.buf_box
        holding = (instr.tensor, instr.box) if t.kind == KIND_CONSTANT and whole else None

        def step(traffic: Traffic) -> None:
            for target, dst, (start, end) in dsts:
                deferred.overwrite(target, start, end, whole=whole)
                if mirrors.pending[target]:
                    mirrors.overwrite(target, start, end, whole=whole)
                dst[...] = src
                copies.wrote(target, start, end, holding)
            traffic.ddr_read += nbytes
            traffic.ddr_read_constant += constant
            traffic.multicast += multicast

        return step

    def _link_send(self, core: int, instr: LinkSend) -> Step:
        t = self.program.tensors[instr.tensor]
        _check_box(instr.box, t.shape, f"link transfer of {t.name}")
        src = self.machine.tensor(t)[_view(instr.box)]
        guard = self._link_guard(core, t)
        dst_name = self.program.tensors[instr.dst].name
        nbytes = _nbytes(instr.box, t.dtype)

        def step(traffic: Traffic) -> None:
            guard()
            if self.links is None:
                raise RuntimeFault(
                    f"core {core}: a link transfer to device {instr.peer}: this program is one "
                    "device's of a multi-device QPC; run the QPC, not the program alone"
                )
            self.links.send(self.device_index, instr, np.array(src), dst_name)
            traffic.link += nbytes

        return step

    def _link_guard(self, core: int, t: TensorDesc) -> Callable[[], None]:
        """A check that a DMA reading `t` does not read bytes other devices write before
        they were awaited (a missing or misplaced LinkWait)."""
        lo, hi = t.ddr_offset, t.ddr_offset + t.nbytes
        targets = [
            (i, x.name)
            for i, x in enumerate(self.program.tensors)
            if x in self._linked and x.ddr_offset < hi and lo < x.ddr_offset + x.nbytes
        ]
        if not targets or t.kind == KIND_ONCHIP:
            return lambda: None
        awaited = self.awaited

        def guard() -> None:
            for tid, name in targets:
                if tid not in awaited:
                    raise RuntimeFault(
                        f"device {self.device_index} core {core}: DMA of {t.name} reads "
                        f"{name}, which other devices write, before a link wait saw their "
                        "transfers land"
                    )

        return guard

    def _load_blocks(self, core: int, instr: DmaLoad, t: TensorDesc) -> Step:
        """A load of MXINT8-stored state: the blocks cross DDR, VTCM gets the values."""
        machine, copies, deferred, mirrors = self.machine, self.copies, self.deferred, self.mirrors
        store = machine.mx_store(t)
        dsts = self._destinations(self._targets(core, instr.cores), instr, t.dtype)
        nbytes = stored_bytes(t, instr.box)
        multicast = nbytes if len(dsts) > 1 else 0
        whole = instr.box == instr.buf_box

        def step(traffic: Traffic) -> None:
            values = store.read(instr.box)
            for target, dst, (start, end) in dsts:
                deferred.overwrite(target, start, end, whole=whole)
                mirrors.overwrite(target, start, end, whole=whole)
                dst[...] = values
                copies.wrote(target, start, end, None)
            traffic.ddr_read += nbytes
            traffic.multicast += multicast

        return step

    def _store(self, core: int, instr: DmaStore) -> Step:
        t = self.program.tensors[instr.tensor]
        _check_box(instr.box, t.shape, f"DMA store of {t.name}")
        dst = self.machine.tensor(t, write=True)[_view(instr.box)]
        src = self.machine.part(core, instr.vtcm, instr.buf_box, instr.box, t.dtype)
        nbytes = _nbytes(instr.box, t.dtype)
        deferred, mirrors, start = self.deferred, self.mirrors, instr.vtcm
        end = start + _nbytes(instr.buf_box, t.dtype)

        def step(traffic: Traffic) -> None:
            deferred.settle(core, start, end)
            mirrors.settle(core, start, end)
            dst[...] = src
            traffic.ddr_write += nbytes

        return step

    def _noc_copy(self, core: int, instr: NocCopy) -> Step:
        machine, copies, deferred, mirrors = self.machine, self.copies, self.deferred, self.mirrors
        t = self.program.tensors[instr.tensor]
        _check_box(instr.box, t.shape, f"NoC copy of {t.name}")
        src = machine.part(core, instr.src_vtcm, instr.src_box, instr.box, t.dtype)
        targets = self._targets(core, instr.cores)
        dsts = self._destinations(targets, instr, t.dtype)
        src_end = instr.src_vtcm + _nbytes(instr.src_box, t.dtype)
        buf_end = instr.vtcm + _nbytes(instr.buf_box, t.dtype)
        # the source may be overwritten by its own multicast: only if the buffers meet
        snapshot = core in targets and instr.src_vtcm < buf_end and instr.vtcm < src_end
        read_start, read_end, _ = _span(instr.src_vtcm, instr.src_box, instr.box, t.dtype)
        nbytes = _nbytes(instr.box, t.dtype)
        multicast = nbytes if len(targets) > 1 else 0
        whole = (
            (instr.tensor, instr.box)
            if t.kind == KIND_CONSTANT and instr.box == instr.src_box == instr.buf_box
            else None
        )
        every = spread([dst for _, dst, _ in dsts])
        # what the copy writes: a slab of the buffer drops the deferred constant rows it
        # covers, a scattered box settles those its span meets
        dst_start, dst_end, covers = _span(instr.vtcm, instr.buf_box, instr.box, t.dtype)
        # a multicast writes its first target only, the others mirror it (mirrors.py)
        key = _buffer_key(self.program, instr)
        mirrored = (
            self.mirrored
            and len(targets) > 1
            and not snapshot
            and nbytes > 0
            and key not in self.mirrors.off
        )
        views = {target: dst for target, dst, _ in dsts}
        aimed = frozenset(targets)

        reads_mirror = self._may_mirror(core, read_start, read_end)
        meets = [t for t in targets if self._may_mirror(t, dst_start, dst_end)]

        skips: list[Span | None] = [None, None]
        """As a kernel's (`_kernel`): this copy's accesses to the deferred loads and to the
        mirrors in the recorded inference, when they did nothing, for the replays to step
        over."""

        def step(traffic: Traffic) -> None:
            d_replay, m_replay = deferred.replay, mirrors.replay
            d_mark, m_mark = d_replay.mark(), m_replay.mark()
            d_skip, m_skip = d_replay.skip(skips[0]), m_replay.skip(skips[1])
            if not d_skip:
                deferred.settle(core, read_start, read_end)
            if reads_mirror and not m_skip and mirrors.pending[core]:
                mirrors.settle(core, read_start, read_end)
            data = src.copy() if snapshot else src
            holding = whole if whole and copies.holds(core, instr.src_vtcm, whole) else None
            if mirrored:
                if not d_skip:
                    deferred.overwrite_many(targets, dst_start, dst_end, whole=covers)
                if not m_skip:
                    mirrors.multicast(
                        targets, aimed, key, instr.box, (dst_start, dst_end), covers, views, data
                    )
                if copies.tracking:
                    for target, _, (start, end) in dsts:
                        copies.wrote(target, start, end, holding)
            elif every is not None:
                if not d_skip:
                    deferred.overwrite_many(targets, dst_start, dst_end, whole=covers)
                if meets and not m_skip:
                    mirrors.overwrite_many(meets, dst_start, dst_end, whole=covers)
                every[...] = data
                if copies.tracking:
                    for target, _, (start, end) in dsts:
                        copies.wrote(target, start, end, holding)
            else:
                for target, dst, (start, end) in dsts:
                    if not d_skip:
                        deferred.overwrite(target, dst_start, dst_end, whole=covers)
                    if meets and not m_skip and mirrors.pending[target]:
                        mirrors.overwrite(target, dst_start, dst_end, whole=covers)
                    dst[...] = data
                    copies.wrote(target, start, end, holding)
            if d_mark is not None:
                skips[0] = d_replay.span(d_mark, [])
            if m_mark is not None:
                skips[1] = m_replay.span(m_mark, [])
            traffic.noc += nbytes
            traffic.multicast += multicast

        return step

    def _gather(self, core: int, instr: DmaGather) -> Step:
        machine, copies, deferred, mirrors = self.machine, self.copies, self.deferred, self.mirrors
        tensors = self.program.tensors
        t, out = tensors[instr.tensor], tensors[instr.out]
        index_t = tensors[instr.indices]
        _check_box(instr.box, t.shape, f"gather of {t.name}")
        if not 0 <= instr.axis < len(t.shape):
            raise RuntimeFault(f"core {core}: gather of {t.name} along axis {instr.axis}")
        index_view = machine.part(
            core, instr.index_vtcm, instr.index_box, instr.index_box, index_t.dtype
        )
        size = t.shape[instr.axis]
        window = tuple(
            slice(None) if a == instr.axis else slice(lo, hi)
            for a, (lo, hi) in enumerate(instr.box)
        )
        blocks = machine.mx_store(t) if is_encoded_state(t) else None  # an MXINT8 cache
        table = None if blocks is not None else machine.tensor(t)[window]
        dst = machine.part(core, instr.vtcm, instr.buf_box, instr.out_box, out.dtype, write=True)
        start, end = self._will_write(core, instr.vtcm, instr.buf_box, out.dtype)
        covers = instr.out_box == instr.buf_box
        index_start = instr.index_vtcm
        index_end = index_start + _nbytes(instr.index_box, index_t.dtype)
        nbytes = gathered_bytes(t, instr)
        constant = nbytes if t.kind == KIND_CONSTANT else 0

        def step(traffic: Traffic) -> None:
            deferred.settle(core, index_start, index_end)
            mirrors.settle(core, index_start, index_end)
            index = index_view.astype(np.int64)
            rows = np.where(index < 0, index + size, index)
            if rows.size and (rows.min() < 0 or rows.max() >= size):
                bad = int(index.flat[int(np.argmax((rows < 0) | (rows >= size)))])
                raise RuntimeFault(
                    f"core {core}: index {bad} is out of range for {t.name} axis "
                    f"{instr.axis} of size {size}"
                )
            if blocks is not None:  # decode only the slices the indices name
                axis = instr.axis
                picked = [
                    blocks.read(
                        tuple((r, r + 1) if a == axis else span for a, span in enumerate(instr.box))
                    )
                    for r in rows.reshape(-1).tolist()
                ]
                lead, rest = picked[0].shape[:axis], picked[0].shape[axis + 1 :]
                gathered = np.concatenate(picked, axis=axis).reshape((*lead, *rows.shape, *rest))
            else:
                assert table is not None
                gathered = np.take(table, rows, axis=instr.axis)
            if gathered.shape != dst.shape:
                raise RuntimeFault(
                    f"core {core}: gather of {t.name} gives {gathered.shape} for a box of "
                    f"{dst.shape}"
                )
            deferred.overwrite(core, start, end, whole=covers)
            mirrors.overwrite(core, start, end, whole=covers)
            dst[...] = gathered
            copies.wrote(core, start, end, None)
            traffic.ddr_read += nbytes
            traffic.ddr_read_constant += constant

        return step

    def _scatter(self, core: int, instr: DmaScatter) -> Step:
        """Write the update's rows into DDR at the positions the write indices name."""
        from compiler_core.ops.kv_cache import positions

        tensors = self.program.tensors
        t = tensors[instr.tensor]
        _check_box(instr.box, t.shape, f"scatter into {t.name}")
        info = (
            self.kernels[instr.kernel].desc.info if 0 <= instr.kernel < len(self.kernels) else None
        )
        if info is not None and info.op_type in ("ScatterND", "ScatterElements"):
            return self._scatter_coordinates(core, instr, info)
        axis, size = instr.axis, t.shape[instr.axis] if 0 <= instr.axis < len(t.shape) else 0
        if instr.axis == 0 or size == 0 or instr.box[axis] != (0, size):
            raise RuntimeFault(
                f"core {core}: scatter into {t.name} along axis {axis} needs the whole axis"
            )
        off_axis = [a for a in range(len(t.shape)) if a != axis]
        if [instr.update.box[a] for a in off_axis] != [instr.box[a] for a in off_axis]:
            raise RuntimeFault(
                f"core {core}: scatter update {instr.update.box} does not match {instr.box}"
            )
        if instr.indices.box != (instr.box[0],):
            raise RuntimeFault(f"core {core}: scatter indices {instr.indices.box} for {instr.box}")
        if info is None or info.op_type != "TensorScatter":
            raise RuntimeFault(f"core {core}: scatter names kernel {instr.kernel}")
        update = self._operand(core, instr.source, instr.update)
        indices = self._operand(core, instr.index, instr.indices)
        reads = [
            (piece.vtcm, piece.vtcm + _nbytes(piece.box, tensors[tid].dtype))
            for tid, operand in ((instr.source, instr.update), (instr.index, instr.indices))
            for piece in operand.pieces
        ]
        blocks = self.machine.mx_store(t) if is_encoded_state(t) else None
        if blocks is not None and (axis == len(t.shape) - 1 or instr.box[-1] != (0, t.shape[-1])):
            raise RuntimeFault(f"core {core}: a scatter into {t.name} must write whole MX rows")
        target = (
            None
            if blocks is not None
            else np.moveaxis(self.machine.tensor(t, write=True)[_view(instr.box)], axis, 1)
        )
        length = instr.update.box[axis][1] - instr.update.box[axis][0]
        # leading-axis coordinates of the tile's rows with the sequence axis second (MX rows)
        lead = [a for a in range(len(t.shape) - 1) if a != axis]
        grids = np.meshgrid(*(np.arange(*instr.box[a]) for a in lead), indexing="ij")
        first = instr.box[0][0]
        nbytes = scattered_bytes(self.program, instr)
        deferred, mirrors = self.deferred, self.mirrors

        def step(traffic: Traffic) -> None:
            for start, end in reads:
                deferred.settle(core, start, end)
                mirrors.settle(core, start, end)
            values = update() if callable(update) else update
            written = indices() if callable(indices) else indices
            assert values is not None and written is not None
            rows = np.moveaxis(values, axis, 1)
            starts = np.asarray(written).astype(np.int64)
            for b in range(rows.shape[0]):
                at = positions(info, int(starts[b]), length, size, first + b)
                if target is not None:
                    target[b, at] = rows[b]
                    continue
                assert blocks is not None
                coords = list(zip(lead, (g[b] for g in grids), strict=True))
                for j, pos in enumerate(at):  # quantize the rows written, whole MX rows
                    outer = _outer_index(len(t.shape) - 1, axis, int(pos), coords)
                    blocks.write_rows(outer, rows[b, j])
            traffic.ddr_write += nbytes

        return step

    def _scatter_coordinates(self, core: int, instr: DmaScatter, info: NodeInfo) -> Step:
        """A ScatterND's slices or a ScatterElements' elements written into DDR at the
        coordinates the indices operand holds (read whole: any index may name any row)."""
        from compiler_core.ops.in_place_scatter import element_positions, nd_positions

        tensors = self.program.tensors
        t = tensors[instr.tensor]
        shape = t.shape
        update_t, index_t = tensors[instr.source], tensors[instr.index]
        nd = info.op_type == "ScatterND"
        if instr.box != tuple((0, d) for d in shape):
            raise RuntimeFault(f"core {core}: a {info.op_type} into {t.name} spans the tensor")
        if instr.update.box != tuple((0, d) for d in update_t.shape) or instr.indices.box != tuple(
            (0, d) for d in index_t.shape
        ):
            raise RuntimeFault(f"core {core}: a {info.op_type} reads its update and indices whole")
        depth = int(index_t.shape[-1]) if nd and index_t.shape else -1
        if nd and (instr.axis != depth or update_t.shape != (*index_t.shape[:-1], *shape[depth:])):
            raise RuntimeFault(
                f"core {core}: ScatterND updates {update_t.shape} / indices {index_t.shape} "
                f"do not fit {t.name} {shape}"
            )
        if not nd and (not 0 <= instr.axis < len(shape) or update_t.shape != index_t.shape):
            raise RuntimeFault(f"core {core}: ScatterElements axis {instr.axis} into {t.name}")
        update = self._operand(core, instr.source, instr.update)
        indices = self._operand(core, instr.index, instr.indices)
        reads = [
            (piece.vtcm, piece.vtcm + _nbytes(piece.box, tensors[tid].dtype))
            for tid, operand in ((instr.source, instr.update), (instr.index, instr.indices))
            for piece in operand.pieces
        ]
        blocks = self.machine.mx_store(t) if is_encoded_state(t) else None
        if blocks is not None and not (nd and depth < len(shape)):
            raise RuntimeFault(f"core {core}: a scatter into {t.name} must write whole MX rows")
        target = None if blocks is not None else self.machine.tensor(t, write=True)
        nbytes = scattered_bytes(self.program, instr)
        deferred, mirrors = self.deferred, self.mirrors
        axis = instr.axis

        def step(traffic: Traffic) -> None:
            for start, end in reads:
                deferred.settle(core, start, end)
                mirrors.settle(core, start, end)
            values = update() if callable(update) else update
            written = indices() if callable(indices) else indices
            assert values is not None and written is not None
            if nd:
                at = nd_positions(info, np.asarray(written), shape)
                rows = np.asarray(values).reshape((at.shape[0], *shape[depth:]))
                if target is not None:
                    target[tuple(at.T)] = rows
                else:  # whole MX rows: the slices' rows over the axes before the last
                    assert blocks is not None
                    lead = (at.shape[0], *shape[depth:-1])
                    grids = np.indices(shape[depth:-1], sparse=True)
                    outer = np.broadcast_arrays(
                        *(at[:, a].reshape((-1,) + (1,) * len(grids)) for a in range(depth)),
                        *(g[None] for g in grids),
                    )
                    blocks.write_rows(tuple(o.reshape(lead) for o in outer), rows)
            else:
                assert target is not None
                where: list[np.ndarray] = list(np.indices(np.shape(written), sparse=True))
                where[axis] = element_positions(info, np.asarray(written), shape[axis], axis)
                target[tuple(where)] = values
            traffic.ddr_write += nbytes

        return step

    def _operand(
        self, core: int, tensor_id: int, operand: Operand | None
    ) -> np.ndarray | Callable[[], np.ndarray] | None:
        """An input operand: a view of the one buffer that holds it, or a function that joins
        its pieces (run at every inference: the pieces' contents change) into one array of
        its own, the same at every run."""
        if operand is None or tensor_id < 0:
            return None
        dtype = self.program.tensors[tensor_id].dtype
        pieces = operand.pieces
        if len(pieces) == 1:
            return self.machine.part(core, pieces[0].vtcm, pieces[0].box, operand.box, dtype)
        shape = box_shape(operand.box)
        parts = []
        covered = 0
        for piece in pieces:
            common = _intersect(piece.box, operand.box)
            if common is None:
                raise RuntimeFault(
                    f"core {core}: operand piece {piece.box} misses the operand {operand.box}"
                )
            src = self.machine.part(core, piece.vtcm, piece.box, common, dtype)
            where = tuple(
                slice(a - o, b - o) for (a, b), (o, _) in zip(common, operand.box, strict=True)
            )
            parts.append((where, src))
            covered += int(np.prod(box_shape(common), dtype=np.int64))
        size = int(np.prod(shape, dtype=np.int64))
        if covered != size:
            raise RuntimeFault(
                f"core {core}: the pieces of operand {operand.box} cover {covered} of its "
                f"{size} elements (gaps or overlaps)"
            )

        out = np.empty(shape, dtype=np.dtype(dtype))

        def join() -> np.ndarray:
            # one array for every run of the step: the operand lives until the step returns
            # (what kernels keep of an input, a shared product's or a join's, is a copy), and
            # a fresh one of a few hundred KB costs its page clearing at every inference
            for where, src in parts:
                out[where] = src
            return out

        return join

    def _widened_inputs(self, kernel: _Kernel) -> tuple[list[int], type]:
        """The base op's constant inputs it widens before use (positions), and to what."""
        desc = kernel.desc
        out_dtype = np.dtype(desc.info.out_dtypes[0]) if desc.info.out_dtypes else None
        if WIDE_OPERANDS not in kernel.opdef.tags or out_dtype is None or out_dtype.kind != "f":
            return [], np.float32
        acc = product_accumulator(out_dtype)
        positions = []
        for position, tid in enumerate(desc.inputs[: len(desc.info.in_shapes)]):
            t = self.program.tensors[tid] if tid >= 0 else None
            if t is not None and t.kind == KIND_CONSTANT and np.dtype(t.dtype).kind == "f":
                if np.dtype(t.dtype) != np.dtype(acc):
                    positions.append(position)
        return positions, acc

    def _wide_operands(
        self, core: int, kernel: _Kernel, instr: RunKernel
    ) -> list[tuple[int, Holding, Box, type]]:
        """The base op's inputs that are whole-buffer constants it would widen: (position,
        what the buffer must hold, the operand's box, the accumulator type)."""
        positions, acc = self._widened_inputs(kernel)
        wide = []
        for position in positions:
            operand = instr.inputs[position]
            if operand is None or len(operand.pieces) != 1:
                continue
            piece = operand.pieces[0]
            wide.append((position, (kernel.desc.inputs[position], piece.box), operand.box, acc))
        return wide

    def _reads(
        self, kernel: _Kernel, instr: RunKernel
    ) -> list[tuple[int, int, int, tuple[slice | EllipsisType, ...]]]:
        """The VTCM a kernel reads, per operand piece: (the operand's position if it is the
        piece's buffer seen through a box, else -1; the buffer's bytes [start, end); the box
        inside the buffer). A deferred constant load may stand in for a whole buffer."""
        reads = []
        for position, (tid, operand) in enumerate(
            zip(kernel.desc.inputs, instr.inputs, strict=True)
        ):
            if operand is None or tid < 0:
                continue
            dtype = self.program.tensors[tid].dtype
            for piece in operand.pieces:
                start = piece.vtcm
                index: tuple[slice | EllipsisType, ...] = (
                    *(
                        slice(a - o, b - o)
                        for (a, b), (o, _) in zip(operand.box, piece.box, strict=True)
                    ),
                    Ellipsis,
                )
                single = len(operand.pieces) == 1
                reads.append(
                    (position if single else -1, start, start + _nbytes(piece.box, dtype), index)
                )
        return reads

    def _kernel(
        self, core: int, instr: RunKernel, shared: SharedTile | JoinTile | None = None
    ) -> Step:
        kernel = self.kernels[instr.kernel]
        desc = kernel.desc
        info = desc.info
        n_base = len(info.in_shapes)
        fetched = [
            self._operand(core, tid, op) for tid, op in zip(desc.inputs, instr.inputs, strict=True)
        ]
        static: list[np.ndarray | None] = [None if callable(f) else f for f in fetched]
        joins = [(i, f) for i, f in enumerate(fetched) if callable(f)]
        reads = self._reads(kernel, instr)
        pieces = [  # each read's buffer, as a mirrored one is seen (mirrors.py)
            (box_shape(piece.box), np.dtype(self.program.tensors[tid].dtype))
            for tid, operand in zip(desc.inputs, instr.inputs, strict=True)
            if operand is not None and tid >= 0
            for piece in operand.pieces
        ]
        mirror_reads = [
            (*read, *piece)
            for read, piece in zip(reads, pieces, strict=True)
            if self._may_mirror(core, read[1], read[2])
        ]
        wide = [
            (position, holding, box, acc, instr.inputs[position].pieces[0].vtcm)  # type: ignore[union-attr]
            for position, holding, box, acc in self._wide_operands(core, kernel, instr)
        ]
        base_boxes = tuple(op.box if op is not None else None for op in instr.inputs[:n_base])
        tile = RunTile(out_box=instr.out_box, in_boxes=base_boxes)  # kept: ops may plan once
        outs = []
        for position, (tid, operand) in enumerate(zip(desc.outputs, instr.outputs, strict=True)):
            if operand is None:
                continue  # an unnamed optional output
            t = self.program.tensors[tid]
            piece = operand.pieces[0]
            dst = self.machine.part(core, piece.vtcm, piece.box, operand.box, t.dtype, write=True)
            start, end = self._will_write(core, piece.vtcm, piece.box, t.dtype)
            outs.append(
                (
                    position,
                    dst,
                    start,
                    end,
                    operand.box == piece.box,
                    self._may_mirror(core, start, end),
                )
            )
        compute, steps, copies = kernel.opdef.compute, kernel.steps, self.copies
        deferred, mirrors = self.deferred, self.mirrors
        step_infos: dict[tuple[Any, ...], tuple[NodeInfo, TileCtx]] = {}
        mirrored: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        """Per operand position, the mirror last handed for it and its view of the operand."""
        views: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        """Per operand position, the deferred constant last handed for it and its view of the
        operand's box: the same view object while the same load stands for the buffer, so a
        shared tile recognises its constant in place by identity (runtime/shared.py)."""
        fusable = bool(outs) and outs[0][0] == 0 and bool(steps) and _fusable(steps[-1][1])
        chain: list[tuple[OpDef, Any, np.dtype | None]] = [
            (opdef, e, _direct(e)) for opdef, e in (steps[:-1] if fusable else steps)
        ]
        last: Any = steps[-1][1] if fusable else None
        last_dtype = np.dtype(last.out_dtype) if fusable else None
        indices = {position: index for position, _, _, index in reads}
        layouts = {position: (shape, dtype) for position, _, _, _, shape, dtype in mirror_reads}
        skips: list[Span | None] = [None, None, None, None]
        """This step's accesses in the recorded inference, when they did nothing
        (replay.Span): the operands' reads (deferred loads, mirrors), then the outputs'
        writes (the same). The replays step over them and hand the operands the same
        constants and mirrors the accesses would."""

        def constant(position: int, src: np.ndarray) -> np.ndarray:
            held = views.get(position)
            if held is None or held[0] is not src:
                held = views[position] = (src, src[indices[position]])
            return held[1]

        def mirror(position: int, raw: np.ndarray) -> np.ndarray:
            seen = mirrored.get(position)
            if seen is None or seen[0] is not raw:
                shape, dtype = layouts[position]
                view = raw.view(dtype).reshape(shape)[indices[position]]
                seen = mirrored[position] = (raw, view)
            return seen[1]

        def step(traffic: Traffic) -> None:
            operands = list(static)
            d_replay, m_replay = deferred.replay, mirrors.replay
            d_mark, m_mark = d_replay.mark(), m_replay.mark()
            d_handed: list[tuple[int, np.ndarray]] = []
            m_handed: list[tuple[int, np.ndarray]] = []
            d_skip = d_replay.skip(skips[0])
            if d_skip:
                for position, src in skips[0].handed:  # type: ignore[union-attr]
                    operands[position] = constant(position, src)
            elif deferred.pending[core]:
                for position, start, end, _ in reads:
                    if position < 0:
                        deferred.settle(core, start, end)
                    else:
                        src = deferred.source(core, start, end)
                        if src is not None:
                            operands[position] = constant(position, src)
                            d_handed.append((position, src))
            m_skip = m_replay.skip(skips[1])
            if m_skip:
                for position, raw in skips[1].handed:  # type: ignore[union-attr]
                    operands[position] = mirror(position, raw)
            elif mirror_reads and mirrors.pending[core]:
                for position, start, end, _, _, _ in mirror_reads:
                    if position < 0:
                        mirrors.settle(core, start, end)
                    else:
                        raw = mirrors.source(core, start, end)
                        if raw is not None:
                            operands[position] = mirror(position, raw)
                            m_handed.append((position, raw))
            if d_mark is not None:
                skips[0] = d_replay.span(d_mark, d_handed)
            if m_mark is not None:
                skips[1] = m_replay.span(m_mark, m_handed)
            for i, join in joins:
                operands[i] = join()
            base = operands[:n_base]
            for position, holding, box, acc, start in wide:
                if copies.holds(core, start, holding):
                    base[position] = copies.widened(holding, box, base[position], acc)  # type: ignore[arg-type]
            results = None if shared is None else shared.results(base, self.inference)
            if results is None:
                results = compute(info, base, tile)
            d_mark, m_mark = d_replay.mark(), m_replay.mark()  # the outputs' writes
            d_skip, m_skip = d_replay.skip(skips[2]), m_replay.skip(skips[3])
            written = False
            if steps:
                value = results[0]
                for opdef, epilogue, direct in chain:
                    step_inputs = _step_operands(epilogue, value, operands)
                    if direct is not None:
                        found = _direct_step(epilogue.op_type, direct, step_inputs)
                        if found is not None:
                            value = found
                            continue
                    step_info, whole = _epilogue_info(epilogue, step_inputs, value, step_infos)
                    value = opdef.compute(step_info, step_inputs, whole)[0]
                if last is not None:
                    step_inputs = _step_operands(last, value, operands)
                    _, dst, start, end, covers, mirrorable = outs[0]
                    if self.probe is None and _fits(last, last_dtype, step_inputs, dst):
                        if not d_skip:
                            deferred.overwrite(core, start, end, whole=covers)
                        if mirrorable and not m_skip and mirrors.pending[core]:
                            mirrors.overwrite(core, start, end, whole=covers)
                        _write_fused(last.op_type, step_inputs, dst)
                        copies.wrote(core, start, end, None)
                        written = True
                    else:
                        opdef = steps[-1][0]
                        step_info, whole = _epilogue_info(last, step_inputs, value, step_infos)
                        value = opdef.compute(step_info, step_inputs, whole)[0]
                results = [value, *results[1:]]
            for position, dst, start, end, covers, mirrorable in outs:
                if written and position == 0:
                    continue
                result = np.asarray(results[position])
                if result.shape != dst.shape:
                    raise RuntimeFault(
                        f"kernel {desc.name} ({info.op_type}) produced shape {result.shape} "
                        f"for a tile of shape {dst.shape}"
                    )
                if not d_skip:
                    deferred.overwrite(core, start, end, whole=covers)
                if mirrorable and not m_skip and mirrors.pending[core]:
                    mirrors.overwrite(core, start, end, whole=covers)
                dst[...] = result
                copies.wrote(core, start, end, None)
            if d_mark is not None:
                skips[2] = d_replay.span(d_mark, [])
            if m_mark is not None:
                skips[3] = m_replay.span(m_mark, [])
            if self.probe is not None:
                self.probe.kernel(instr.kernel, operands, results)
            if self.on_kernel is not None:
                self.on_kernel(core, instr.kernel, instr)

        return step


def _joined_buffers(program: Program, joined: list[tuple[int, int]]) -> set[Key]:
    """The multicast buffers (as mirrors.py names them) whose bytes are an input of a joined
    tile (core, position in its stream) on its core: those must be written on every target.
    A buffer that only shares VTCM with such an input (the place reused at another time)
    stays mirrorable: a join reads a tile's input before its turn only to learn or to
    compute ahead, and a tile never takes a part computed from bytes other than those it
    reads at its own turn."""
    reads: list[list[tuple[int, int]]] = [[] for _ in range(program.num_cores)]
    for core, at in joined:
        instr = program.streams[core][at]
        if not isinstance(instr, RunKernel):
            continue
        inputs = program.kernels[instr.kernel].inputs
        for tid, operand in zip(inputs, instr.inputs, strict=True):
            if operand is None or tid < 0:
                continue
            for piece in operand.pieces:
                end = piece.vtcm + _nbytes(piece.box, program.tensors[tid].dtype)
                reads[core].append((piece.vtcm, end))
    found: set[Any] = set()
    for stream in program.streams:
        for instr in stream:
            if not isinstance(instr, NocCopy):
                continue
            key = _buffer_key(program, instr)
            end = key[1]
            if any(
                start == instr.vtcm and stop == end
                for core in cores_in(instr.cores)
                if core < program.num_cores
                for start, stop in reads[core]
            ):
                found.add(key)
    return found


def _buffer_key(program: Program, instr: NocCopy) -> Key:
    """The buffer a NoC copy writes, as mirrors.py names it (`mirrors.Key`)."""
    dtype = program.tensors[instr.tensor].dtype
    return (instr.vtcm, instr.vtcm + _nbytes(instr.buf_box, dtype), instr.buf_box, dtype)


def _multicast_ranges(program: Program, off: set[Key]) -> list[tuple[list[int], list[int]]]:
    """Per core, the VTCM bytes some multicast NoC copy of the program writes there, into
    a buffer not in `off` (merged ranges: starts, ends)."""
    found: list[list[tuple[int, int]]] = [[] for _ in range(program.num_cores)]
    for stream in program.streams:
        for instr in stream:
            if not isinstance(instr, NocCopy):
                continue
            targets = [c for c in cores_in(instr.cores) if c < program.num_cores]
            if len(targets) < 2:
                continue
            key = _buffer_key(program, instr)
            if key in off:
                continue
            for core in targets:
                found[core].append((instr.vtcm, key[1]))
    merged: list[tuple[list[int], list[int]]] = []
    for ranges in found:
        starts: list[int] = []
        ends: list[int] = []
        for start, end in sorted(ranges):
            if ends and start <= ends[-1]:
                ends[-1] = max(ends[-1], end)
            else:
                starts.append(start)
                ends.append(end)
        merged.append((starts, ends))
    return merged


def _step_operands(
    epilogue: Any, value: np.ndarray, operands: list[np.ndarray | None]
) -> list[np.ndarray | None]:
    """An epilogue step's inputs: the value so far (ref None), none (ref < 0) or the
    kernel's operand at ref."""
    return [
        value if ref is None else (None if ref < 0 else operands[ref]) for ref in epilogue.inputs
    ]


_FUSED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_ZEROS = {dtype: np.zeros((), dtype) for dtype in _FUSED_DTYPES}
"""Relu's other operand, per dtype (read-only: shared by every tile)."""
for _zero in _ZEROS.values():
    _zero.flags.writeable = False

_UFUNCS: dict[str, np.ufunc] = {
    "Relu": np.maximum,
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": np.divide,
}
"""The ufunc each such step's own compute calls on float operands (activation.py `_relu`,
elementwise.py's Add, Sub, Mul and Div: `int_div` divides floats with `np.divide`)."""


def _fusable(epilogue: Any) -> bool:
    """Whether a kernel's last epilogue step may write its output tile itself (`_fits`)."""
    return epilogue.domain == "" and epilogue.op_type in _UFUNCS


def _direct(epilogue: Any) -> np.dtype | None:
    """The dtype in which an epilogue step is its ufunc on its operands as they are (float32
    or float64 in and out: nothing widened or rounded), or None (it runs its own compute)."""
    dtype = np.dtype(epilogue.out_dtype)
    if not _fusable(epilogue) or epilogue.op_type == "Relu" or dtype not in _FUSED_DTYPES:
        return None
    return dtype


def _fits(
    epilogue: Any, out_dtype: np.dtype | None, inputs: list[np.ndarray | None], dst: np.ndarray
) -> bool:
    """Whether `_write_fused` gives `dst` the bytes the step's own compute would: float32 or
    float64 operands, result (`out_dtype`, the step's) and tile of one dtype, the operands
    broadcasting to the tile's shape (no widening or rounding; anything else runs the step's
    compute, which also reports a wrong shape)."""
    dtype = dst.dtype
    if dtype not in _FUSED_DTYPES or out_dtype != dtype:
        return False
    if len(inputs) != (1 if epilogue.op_type == "Relu" else 2):
        return False
    a, b = inputs[0], inputs[-1]  # one or two operands (checked above)
    if a is None or b is None or a.dtype != dtype or b.dtype != dtype:
        return False
    if a.shape == b.shape:
        return a.shape == dst.shape
    try:
        return np.broadcast_shapes(a.shape, b.shape) == dst.shape
    except ValueError:
        return False


def _write_fused(op_type: str, inputs: list[np.ndarray | None], dst: np.ndarray) -> None:
    """A kernel's last epilogue step (Relu, Add, Sub, Mul, Div) computed into its output tile:
    the same ufunc on the same operands as the step's compute (`_UFUNCS`), without the array
    it would return and the copy of it into VTCM (run inside `advance`, where floating-point
    errors are ignored)."""
    a, b = inputs[0], inputs[-1]
    assert a is not None and b is not None
    if op_type == "Relu":
        np.maximum(a, _ZEROS[dst.dtype], out=dst)
    else:
        _UFUNCS[op_type](a, b, out=dst)


def _direct_step(
    op_type: str, dtype: np.dtype, inputs: list[np.ndarray | None]
) -> np.ndarray | None:
    """An epilogue step's value as its ufunc gives it (`_direct`), when its two operands are
    of its dtype; None: it runs its own compute (inside `advance`, as `_write_fused`)."""
    a, b = inputs[0], inputs[-1]
    if len(inputs) != 2 or a is None or b is None or a.dtype != dtype or b.dtype != dtype:
        return None
    return _UFUNCS[op_type](a, b)  # type: ignore[no-any-return]


def _outer_index(
    rank: int, axis: int, pos: int, others: list[tuple[int, np.ndarray]]
) -> tuple[np.ndarray, ...]:
    """Index arrays over a tensor's leading `rank` axes: `pos` on the sequence axis, the given
    coordinate grids on the others."""
    shape = others[0][1].shape if others else ()
    out: list[np.ndarray] = []
    for a in range(rank):
        if a == axis:
            out.append(np.full(shape, pos, np.int64))
        else:
            out.append(next(g for b, g in others if b == a))
    return tuple(out)


def _epilogue_info(
    step: Any,
    inputs: list[np.ndarray | None],
    value: np.ndarray,
    cache: dict[tuple[Any, ...], tuple[NodeInfo, TileCtx]],
) -> tuple[NodeInfo, TileCtx]:
    """The NodeInfo of an epilogue step for these operand shapes and dtypes, and its whole
    tile (made once per shape)."""
    in_shapes = tuple(None if a is None else a.shape for a in inputs)
    key = (id(step), in_shapes, tuple(None if a is None else a.dtype for a in inputs), value.shape)
    found = cache.get(key)
    if found is None:
        in_dtypes = tuple(None if a is None else str(a.dtype) for a in inputs)
        info = NodeInfo(
            op_type=step.op_type,
            name=step.node_name,
            attrs=step.attrs,
            in_shapes=in_shapes,
            in_dtypes=in_dtypes,
            out_shapes=(value.shape,),
            out_dtypes=(step.out_dtype,),
            opset=step.opset,
        )
        found = cache[key] = (info, TileCtx.whole(info))
    return found
