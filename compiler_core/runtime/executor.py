"""The functional runtime: execute a program's per-core streams over modelled DDR and VTCM.

It is the oracle for lowering, tiling and memory planning, so it is strict: every DMA and
kernel operand is bounds-checked, constants are read-only, and cores run "until blocked" one
after another, so that a missing semaphore wait shows up as a wrong answer or a deadlock
instead of being hidden by a lucky interleaving.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import EllipsisType
from typing import TYPE_CHECKING

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.lowering.program import (
    KIND_CONSTANT,
    KIND_INPUT,
    KIND_ONCHIP,
    DmaGather,
    DmaLoad,
    DmaStore,
    KernelDesc,
    NocCopy,
    Operand,
    Program,
    RunKernel,
    SemPost,
    SemWait,
    TensorDesc,
    cores_in,
    gathered_bytes,
    stored_bytes,
)
from compiler_core.ops import REGISTRY
from compiler_core.ops.registry import Box, NodeInfo, OpDef, TileCtx, box_shape

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
        self.vtcm = [np.zeros(vtcm_bytes, dtype=np.uint8) for _ in range(program.num_cores)]
        self.vtcm_bytes = vtcm_bytes
        self.protected = 0
        """VTCM bytes [0, protected) are read-only: the resident constants, once loaded."""

    def tensor(self, t: TensorDesc, *, write: bool = False) -> np.ndarray:
        if t.nbytes == 0:  # an empty tensor owns no bytes, wherever its offset points
            return np.empty(t.shape, dtype=np.dtype(t.dtype))
        if t.kind == KIND_ONCHIP:
            raise RuntimeFault(f"DMA of {t.name} from DDR: it lives only in VTCM")
        start, end = t.ddr_offset, t.ddr_offset + t.nbytes
        if end > self.program.ddr_size or start < 0:
            raise RuntimeFault(f"tensor {t.name} [{start}, {end}) lies outside DDR")
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


class Executor:
    def __init__(
        self,
        program: Program,
        constants: memoryview | bytes,
        vtcm_bytes: int,
        decoded: Mapping[int, np.ndarray] | None = None,
    ) -> None:
        self.program = program
        self.machine = Machine(program, constants, vtcm_bytes, decoded)
        self.kernels = [
            _Kernel(
                desc=k,
                opdef=_lookup(k.info.op_type, k.info.domain, k.info.opset),
                steps=[(_lookup(e.op_type, "", e.opset), e) for e in k.epilogue],
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

    def activate(self) -> None:
        """Program activation: load the resident constants into every core's VTCM once;
        from then on inferences may read them but never write them."""
        if self.activated:
            return
        machine = self.machine
        machine.protected = 0
        for core_mem in machine.vtcm:
            core_mem[:] = 0
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
                self._execute(core, instr)
        machine.protected = self.program.resident
        self.activated = True

    def _dtype(self, tensor: int) -> str:
        return self.program.tensors[tensor].dtype

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        program, machine = self.program, self.machine
        self.activate()
        machine.dynamic[:] = 0
        for core_mem in machine.vtcm:
            core_mem[program.resident :] = 0
        self.traffic = [Traffic() for _ in range(program.num_cores)]
        expected = {program.tensors[t].name: program.tensors[t] for t in program.inputs}
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
        self._run_streams()
        return {
            program.tensors[t].name: machine.tensor(program.tensors[t]).copy()
            for t in program.outputs
        }

    def _run_streams(self) -> None:
        program = self.program
        sems = [0] * program.num_semaphores
        pcs = [0] * program.num_cores
        while True:
            progressed = False
            for core, stream in enumerate(program.streams):
                while pcs[core] < len(stream):
                    instr = stream[pcs[core]]
                    if isinstance(instr, SemWait):
                        if sems[instr.sem] < instr.count:
                            break
                    elif isinstance(instr, SemPost):
                        sems[instr.sem] += 1
                    else:
                        self._execute(core, instr)
                    pcs[core] += 1
                    progressed = True
            if all(pc == len(s) for pc, s in zip(pcs, program.streams, strict=True)):
                return
            if not progressed:
                stuck = [
                    f"core {c} waits on semaphore {s[pcs[c]].sem}"  # type: ignore[union-attr]
                    for c, s in enumerate(program.streams)
                    if pcs[c] < len(s)
                ]
                raise RuntimeFault("deadlock: " + "; ".join(stuck))

    def _targets(self, core: int, mask: int) -> list[int]:
        cores = cores_in(mask)
        if not cores or cores[-1] >= self.program.num_cores:
            raise RuntimeFault(f"core {core}: transfer to cores {mask:#x}")
        return cores

    def _execute(self, core: int, instr: object) -> None:
        machine = self.machine
        traffic = self.traffic[core]
        if isinstance(instr, DmaLoad):
            t = self.program.tensors[instr.tensor]
            _check_box(instr.box, t.shape, f"DMA load of {t.name}")
            src = machine.tensor(t)[_slices(instr.box)]
            targets = self._targets(core, instr.cores)
            for target in targets:
                machine.part(target, instr.vtcm, instr.buf_box, instr.box, t.dtype, write=True)[
                    ...
                ] = src
            nbytes = stored_bytes(t, instr.box)
            traffic.ddr_read += nbytes
            if t.kind == KIND_CONSTANT:
                traffic.ddr_read_constant += nbytes
            if len(targets) > 1:
                traffic.multicast += nbytes
        elif isinstance(instr, DmaStore):
            t = self.program.tensors[instr.tensor]
            _check_box(instr.box, t.shape, f"DMA store of {t.name}")
            dst = machine.tensor(t, write=True)
            dst[_slices(instr.box)] = machine.part(
                core, instr.vtcm, instr.buf_box, instr.box, t.dtype
            )
            traffic.ddr_write += _nbytes(instr.box, t.dtype)
        elif isinstance(instr, NocCopy):
            t = self.program.tensors[instr.tensor]
            _check_box(instr.box, t.shape, f"NoC copy of {t.name}")
            src = machine.part(core, instr.src_vtcm, instr.src_box, instr.box, t.dtype).copy()
            targets = self._targets(core, instr.cores)
            for target in targets:
                machine.part(target, instr.vtcm, instr.buf_box, instr.box, t.dtype, write=True)[
                    ...
                ] = src
            nbytes = _nbytes(instr.box, t.dtype)
            traffic.noc += nbytes
            if len(targets) > 1:
                traffic.multicast += nbytes
        elif isinstance(instr, DmaGather):
            self._gather(core, instr, traffic)
        elif isinstance(instr, RunKernel):
            self._run_kernel(core, instr)
        else:
            raise RuntimeFault(f"core {core}: unknown instruction {instr!r}")

    def _gather(self, core: int, instr: DmaGather, traffic: Traffic) -> None:
        tensors = self.program.tensors
        t, out = tensors[instr.tensor], tensors[instr.out]
        index_t = tensors[instr.indices]
        _check_box(instr.box, t.shape, f"gather of {t.name}")
        if not 0 <= instr.axis < len(t.shape):
            raise RuntimeFault(f"core {core}: gather of {t.name} along axis {instr.axis}")
        index = self.machine.part(
            core, instr.index_vtcm, instr.index_box, instr.index_box, index_t.dtype
        ).astype(np.int64)
        size = t.shape[instr.axis]
        rows = np.where(index < 0, index + size, index)
        if rows.size and (rows.min() < 0 or rows.max() >= size):
            bad = int(index.flat[int(np.argmax((rows < 0) | (rows >= size)))])
            raise RuntimeFault(
                f"core {core}: index {bad} is out of range for {t.name} axis {instr.axis} "
                f"of size {size}"
            )
        window = tuple(
            slice(None) if a == instr.axis else slice(lo, hi)
            for a, (lo, hi) in enumerate(instr.box)
        )
        gathered = np.take(self.machine.tensor(t)[window], rows, axis=instr.axis)
        dst = self.machine.part(
            core, instr.vtcm, instr.buf_box, instr.out_box, out.dtype, write=True
        )
        if gathered.shape != dst.shape:
            raise RuntimeFault(
                f"core {core}: gather of {t.name} gives {gathered.shape} for a box of {dst.shape}"
            )
        dst[...] = gathered
        nbytes = gathered_bytes(t, instr)
        traffic.ddr_read += nbytes
        traffic.ddr_read_constant += nbytes if t.kind == KIND_CONSTANT else 0

    def _operand(self, core: int, tensor_id: int, operand: Operand | None) -> np.ndarray | None:
        """An input operand: a view of the one buffer that holds it, or its pieces joined."""
        if operand is None or tensor_id < 0:
            return None
        dtype = self.program.tensors[tensor_id].dtype
        pieces = operand.pieces
        if len(pieces) == 1:
            return self.machine.part(core, pieces[0].vtcm, pieces[0].box, operand.box, dtype)
        out = np.empty(box_shape(operand.box), dtype=np.dtype(dtype))
        covered = 0
        for piece in pieces:
            common = _intersect(piece.box, operand.box)
            if common is None:
                raise RuntimeFault(
                    f"core {core}: operand piece {piece.box} misses the operand {operand.box}"
                )
            src = self.machine.part(core, piece.vtcm, piece.box, common, dtype)
            out[
                tuple(
                    slice(a - o, b - o) for (a, b), (o, _) in zip(common, operand.box, strict=True)
                )
            ] = src
            covered += int(np.prod(box_shape(common), dtype=np.int64))
        if covered != out.size:
            raise RuntimeFault(
                f"core {core}: the pieces of operand {operand.box} cover {covered} of its "
                f"{out.size} elements (gaps or overlaps)"
            )
        return out

    def _run_kernel(self, core: int, instr: RunKernel) -> None:
        kernel = self.kernels[instr.kernel]
        desc = kernel.desc
        info = desc.info
        n_base = len(info.in_shapes)
        operands = [
            self._operand(core, tid, op) for tid, op in zip(desc.inputs, instr.inputs, strict=True)
        ]
        base_boxes = tuple(op.box if op is not None else None for op in instr.inputs[:n_base])
        tile = TileCtx(out_box=instr.out_box, in_boxes=base_boxes)
        results = kernel.opdef.compute(info, operands[:n_base], tile)
        if kernel.steps:
            value = results[0]
            for opdef, step in kernel.steps:
                step_inputs = [
                    value if ref is None else (None if ref < 0 else operands[ref])
                    for ref in step.inputs  # type: ignore[attr-defined]
                ]
                step_info = NodeInfo(
                    op_type=step.op_type,  # type: ignore[attr-defined]
                    name=step.node_name,  # type: ignore[attr-defined]
                    attrs=step.attrs,  # type: ignore[attr-defined]
                    in_shapes=tuple(None if a is None else a.shape for a in step_inputs),
                    in_dtypes=tuple(None if a is None else str(a.dtype) for a in step_inputs),
                    out_shapes=(value.shape,),
                    out_dtypes=(step.out_dtype,),  # type: ignore[attr-defined]
                    opset=step.opset,  # type: ignore[attr-defined]
                )
                value = opdef.compute(step_info, step_inputs, TileCtx.whole(step_info))[0]
            results = [value, *results[1:]]
        for position, (tid, operand) in enumerate(zip(desc.outputs, instr.outputs, strict=True)):
            if operand is None:
                continue  # an unnamed optional output
            t = self.program.tensors[tid]
            piece = operand.pieces[0]
            dst = self.machine.part(core, piece.vtcm, piece.box, operand.box, t.dtype, write=True)
            result = np.asarray(results[position])
            if result.shape != dst.shape:
                raise RuntimeFault(
                    f"kernel {desc.name} ({info.op_type}) produced shape {result.shape} for a "
                    f"tile of shape {dst.shape}"
                )
            dst[...] = result
        if self.probe is not None:
            self.probe.kernel(instr.kernel, operands, results)
        if self.on_kernel is not None:
            self.on_kernel(core, instr.kernel, instr)
