"""The lowered program: tensors in DDR, kernels, and one instruction stream per NSP core.

This is what `program.bin` holds. The encoding is ours and documented in docs/qpc-format.md:
a JSON table section (tensors and kernels, canonical so QPCs are byte-identical) followed by
fixed-layout little-endian binary instruction streams.
"""

from __future__ import annotations

import base64
import functools
import itertools
import json
import math
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.registry import Box, NodeInfo, box_elements

PROGRAM_MAGIC = b"QPRG"
PROGRAM_VERSION = 2

KIND_CONSTANT = "constant"
KIND_INPUT = "input"
KIND_OUTPUT = "output"
KIND_ACTIVATION = "activation"
KIND_ONCHIP = "onchip"
"""An activation that lives only in the VTCM of the cores that produce it: it has no DDR."""
LINK_KERNEL = "link_all_gather"
"""The kernel name of an AllGather between the devices of a partition: link transfers, not a
kernel (compiler_core/ops/collective.py)."""
SCATTER_IN_PLACE = "tensor_scatter_in_place"
"""The kernel name of a scatter (TensorScatter, ScatterND, ScatterElements) into retained
state done in place by `DmaScatter`."""


@dataclass(frozen=True)
class TensorDesc:
    """A tensor's place in DDR. Aliased tensors (Reshape...) share their root's bytes."""

    id: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str
    ddr_offset: int
    nbytes: int


@dataclass(frozen=True)
class EpilogueDesc:
    """An elementwise step applied to a kernel's output tile (see compiler_core.fusion)."""

    op_type: str
    node_name: str
    inputs: tuple[int | None, ...]
    """None: the running value; k >= 0: the kernel's operand k; -1: missing optional input."""
    attrs: dict[str, Any]
    opset: int
    out_dtype: str
    domain: str = ""
    """The step's op domain: "" for ONNX ops, the compiler's own for an integer step (a QAdd
    after a QConv)."""


@dataclass(frozen=True)
class KernelDesc:
    """One kernel: a base op (its NodeInfo) plus epilogue steps, reading and writing tensors.

    `inputs[:len(info.in_shapes)]` are the base op's inputs, the rest are epilogue operands.
    """

    id: int
    name: str
    info: NodeInfo
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    epilogue: tuple[EpilogueDesc, ...]
    kernel: str
    unit: str
    macs: int
    nodes: tuple[str, ...]
    op_types: tuple[str, ...]


Mask = int
"""A set of cores as a bit mask: bit c set for core c."""


def box_nbytes(box: Box, dtype: str) -> int:
    return box_elements(box) * _itemsize(dtype)


def box_byte_range(box: Box, buf_box: Box, dtype: str) -> tuple[int, int]:
    """The bytes of a row-major buffer holding `buf_box` that `box` (inside it) spans, from
    its first element to its last: every byte a transfer of `box` touches, and exactly those
    when the box is a slab of the outer axes (one core's channels of a feature map). Ordering
    transfers by these instead of the whole buffer lets the parts that cores multicast into
    one buffer land without waiting for each other."""
    if box == buf_box:
        return 0, box_nbytes(box, dtype)
    first = last = 0
    for (a, b), (o, e) in zip(box, buf_box, strict=True):
        if b <= a:
            return 0, 0
        n = e - o
        first = first * n + (a - o)
        last = last * n + (b - 1 - o)
    size = _itemsize(dtype)
    return first * size, (last + 1) * size


BYTE_RUNS = 128
"""At most this many contiguous runs are tracked apart for one box (`box_byte_progressions`):
past it, the box is ordered by its first-to-last span."""


ByteProgression = tuple[int, int, int, int]
"""Equal byte runs `(lo, length, stride, count)`: `[lo + k stride, lo + k stride + length)`."""


def box_byte_progressions(box: Box, buf_box: Box, dtype: str) -> list[ByteProgression]:
    """The contiguous byte runs of `box` in a row-major buffer holding `buf_box` (one per
    position of the axes outside the run: a block of rows and columns is a run per row), in
    order, as progressions of equal runs: the runs along the innermost axis outside them are
    one, and rows of them that go on at the same stride join it (the emitter's hazard walk
    takes a core's columns of every row as one strided write, without making the runs one by
    one). Past `BYTE_RUNS` runs, `box_byte_range`'s span as one run."""
    rel = [(a - o, b - o) for (a, b), (o, _) in zip(box, buf_box, strict=True)]
    if any(b <= a for a, b in rel):
        return []
    shape = [e - o for o, e in buf_box]
    k = len(shape)
    while k > 1 and rel[k - 1] == (0, shape[k - 1]):
        k -= 1
    outer = rel[: k - 1]
    if math.prod(b - a for a, b in outer) > BYTE_RUNS or not outer:
        lo, hi = box_byte_range(box, buf_box, dtype)
        return [(lo, hi - lo, hi - lo, 1)]
    size = _itemsize(dtype)
    inner = math.prod(shape[k:])
    lo, hi = rel[k - 1]
    length = (hi - lo) * inner * size
    strides = [math.prod(shape[i + 1 :]) for i in range(k - 1)]
    (a, b), step = outer[-1], strides[-1] * size
    n = b - a
    out: list[ByteProgression] = []
    for index in itertools.product(*(range(x, y) for x, y in outer[:-1])):
        base = (sum(i * st for i, st in zip(index, strides, strict=False)) + a * strides[-1]) * size
        base += lo * inner * size
        if out:  # the row goes on from the last progression's last run?
            first, _, stride, count = out[-1]
            gap = base - (first + (count - 1) * stride)
            if count == 1:
                stride = gap
            if gap == stride and (n == 1 or step == stride):
                out[-1] = (first, length, stride, count + n)
                continue
        out.append((base, length, step if n > 1 else length, n))
    return out


@functools.cache
def _itemsize(dtype: str) -> int:
    """Bytes per element (asked for every transfer and tile: numpy's dtype lookup is not free)."""
    return 1 if dtype == "bool" else np.dtype(dtype).itemsize


def stored_bytes(t: TensorDesc, box: Box) -> int:
    """The DDR bytes a transfer of `box` moves: an encoded tensor (an MXFP6 constant, MXINT8
    retained state) moves its stored size."""
    n = box_nbytes(box, t.dtype)
    if t.kind == KIND_CONSTANT or t.kind in (KIND_INPUT, KIND_OUTPUT):
        logical = box_nbytes(tuple((0, d) for d in t.shape), t.dtype)
        if 0 < t.nbytes < logical:
            return -(-n * t.nbytes // logical)
    return n


def is_encoded_state(t: TensorDesc) -> bool:
    """Retained state stored in blocks (MXINT8): its DDR bytes are not its values'."""
    if t.kind not in (KIND_INPUT, KIND_OUTPUT):
        return False
    return t.nbytes != box_nbytes(tuple((0, d) for d in t.shape), t.dtype)


def gathered_bytes(t: TensorDesc, instr: DmaGather) -> int:
    """DDR bytes a gather reads: one slice of `box` per index (whatever the values)."""
    slice_box = tuple((0, 1) if a == instr.axis else rng for a, rng in enumerate(instr.box))
    return box_elements(instr.index_box) * stored_bytes(t, slice_box)


def mask_of(cores: Iterable[int]) -> Mask:
    mask = 0
    for core in cores:
        mask |= 1 << core
    return mask


def cores_in(mask: Mask) -> list[int]:
    return [c for c in range(mask.bit_length()) if mask >> c & 1]


# The instructions are treated as immutable (hashed, shared between streams) but not declared
# frozen: a frozen dataclass sets each field through `object.__setattr__`, 3-4x the
# construction time of a slotted one, and a ResNet-50 program has ~16,000 of them.


@dataclass(slots=True, unsafe_hash=True)
class DmaLoad:
    """DDR -> VTCM: the `box` of a tensor into the buffer at `vtcm` (which holds `buf_box` of
    the tensor, C order) of every core in `cores`. One DDR read however many cores it feeds:
    with more than one core it is a multicast over the NoC. The issuing core is the stream's."""

    tensor: int
    box: Box
    vtcm: int
    buf_box: Box
    cores: Mask
    kernel: int = -1
    """The kernel this transfer serves (-1: program activation), for profiling."""


@dataclass(slots=True, unsafe_hash=True)
class DmaStore:
    """VTCM -> DDR: the `box` of a tensor from the issuing core's buffer at `vtcm`."""

    tensor: int
    box: Box
    vtcm: int
    buf_box: Box
    kernel: int = -1


@dataclass(slots=True, unsafe_hash=True)
class NocCopy:
    """VTCM -> VTCM over the NoC: the `box` of a tensor from the issuing core's buffer at
    `src_vtcm` (holding `src_box`) into the buffer at `vtcm` (holding `buf_box`) of every core
    in `cores` (a multicast when more than one)."""

    tensor: int
    box: Box
    src_vtcm: int
    src_box: Box
    vtcm: int
    buf_box: Box
    cores: Mask
    kernel: int = -1


@dataclass(slots=True, unsafe_hash=True)
class DmaGather:
    """DDR -> VTCM by indices known only at run time (an embedding lookup): for every element
    of the index buffer at `index_vtcm` (holding `index_box` of the integer tensor
    `indices`), the slice of `tensor` at that index along `axis`, over `box` on the other
    axes, lands at the element's place in the destination buffer at `vtcm` (holding
    `buf_box` of the gathered result `out`), which receives `out_box`. Only those slices
    cross DDR."""

    tensor: int
    axis: int
    box: Box
    indices: int
    index_vtcm: int
    index_box: Box
    out: int
    out_box: Box
    vtcm: int
    buf_box: Box
    kernel: int = -1


@dataclass(slots=True, unsafe_hash=True)
class DmaScatter:
    """VTCM -> DDR at rows known only at run time (a KV-cache write in place): the `update`
    operand (a box of tensor `source`, in VTCM) lands in `tensor` along `axis`, each batch
    entry b of `box` at the positions its write index (element b of the `indices` operand, a
    box of tensor `index`) names, over `box` on the other axes. `box` is the tile of `tensor`
    those rows lie in (the whole `axis`); only the update's bytes cross DDR. The kernel's node
    says how positions follow from an index (TensorScatter: linear or circular). For a
    ScatterND (`axis` = the index depth K) and a ScatterElements (`axis` its axis) `box` is the
    whole tensor and the `indices` operand holds the coordinates themselves
    (`ops/in_place_scatter.py`)."""

    tensor: int
    axis: int
    box: Box
    source: int
    update: Operand
    index: int
    indices: Operand
    kernel: int = -1


def scattered_bytes(program: Program, instr: DmaScatter) -> int:
    """DDR bytes a scatter writes: the update's rows in the cache's stored format, whatever
    the indices."""
    return stored_bytes(program.tensors[instr.tensor], instr.update.box)


@dataclass(slots=True, unsafe_hash=True)
class Piece:
    """A VTCM buffer at `vtcm` holding `box` of a tensor (C order)."""

    vtcm: int
    box: Box


@dataclass(slots=True, unsafe_hash=True)
class Operand:
    """What a kernel reads or writes: `box` of a tensor, found in the pieces' buffers.

    One piece that holds the box is a (possibly strided) view of that buffer; several pieces
    must cover the box exactly, without overlap (a kernel reading its halo rows from the
    buffers its neighbours filled). Outputs are always one piece."""

    box: Box
    pieces: tuple[Piece, ...]

    @staticmethod
    def at(vtcm: int, box: Box) -> Operand:
        """A buffer holding exactly the operand."""
        return Operand(box, (Piece(vtcm, box),))


@dataclass(slots=True, unsafe_hash=True)
class RunKernel:
    kernel: int
    out_box: Box
    inputs: tuple[Operand | None, ...]
    outputs: tuple[Operand | None, ...]
    """None where the node leaves an optional output unnamed: computed, never stored."""


@dataclass(slots=True, unsafe_hash=True)
class SemPost:
    """Raise a semaphore once every earlier instruction of this core has completed."""

    sem: int


@dataclass(slots=True, unsafe_hash=True)
class SemWait:
    """Issue nothing further until the semaphore has been raised `count` times."""

    sem: int
    count: int


@dataclass(slots=True, unsafe_hash=True)
class LinkSend:
    """DDR -> another device's DDR over the partition's link (multi-device partitioning): the
    `box` of `tensor` lands at `dst_box` of device `peer`'s tensor of the name this program's
    tensor `dst` has (`peer` is its index in the partition; its own index is a copy inside this
    device's DDR). The receiver counts the arrival on that tensor (see LinkWait)."""

    tensor: int
    box: Box
    peer: int
    dst: int
    dst_box: Box
    kernel: int = -1


@dataclass(slots=True, unsafe_hash=True)
class LinkWait:
    """Issue nothing further until `count` link transfers into `tensor` have landed in this
    device's DDR (this inference's)."""

    tensor: int
    count: int
    kernel: int = -1


Instr = (
    DmaLoad
    | DmaStore
    | NocCopy
    | DmaGather
    | DmaScatter
    | RunKernel
    | SemPost
    | SemWait
    | LinkSend
    | LinkWait
)


@dataclass
class Program:
    tensors: list[TensorDesc]
    kernels: list[KernelDesc]
    streams: list[list[Instr]]
    num_semaphores: int
    ddr_size: int
    constants_size: int
    vtcm_used: list[int]
    inputs: list[int]
    outputs: list[int]
    meta: dict[str, Any] = field(default_factory=dict)
    setup: list[list[Instr]] = field(default_factory=list)
    """Per core, what program activation runs once before any inference: loads of the
    constants that stay resident in VTCM across inferences."""
    resident: int = 0
    """VTCM bytes [0, resident) of every core hold resident constants: written by `setup`
    only, read-only to inferences."""

    @property
    def num_cores(self) -> int:
        return len(self.streams)

    @property
    def retained(self) -> dict[int, int]:
        """-retained-state: retained input -> the output that feeds it (tensor ids). Both are
        one device buffer that never crosses the host link."""
        return {int(i): int(o) for i, o in self.meta.get("retained_state", [])}

    @property
    def linked_ports(self) -> set[str]:
        """A pipeline stage's inputs other stages send it and outputs it sends them (by
        name): they cross a link between devices, not the host's."""
        mdp = self.meta.get("mdp", {})
        return {*mdp.get("receives", ()), *mdp.get("sends", ())}

    def host_ports(self) -> tuple[list[int], list[int]]:
        """The inputs the host sends and the outputs it receives (retained state and a
        pipeline stage's linked ports excluded)."""
        retained = self.retained
        kept = set(retained.values())
        linked = self.linked_ports
        return (
            [t for t in self.inputs if t not in retained and self.tensors[t].name not in linked],
            [t for t in self.outputs if t not in kept and self.tensors[t].name not in linked],
        )


# ----------------------------------------------------------------------------------- encoding

_OP_LOAD, _OP_STORE, _OP_KERNEL, _OP_POST, _OP_WAIT, _OP_NOC, _OP_GATHER = 1, 2, 3, 4, 5, 6, 7
_OP_SCATTER = 8
_OP_LINK_SEND, _OP_LINK_WAIT = 9, 10


def _jsonable(value: Any, blobs: list[str] | None = None) -> Any:
    """`value` as JSON values; arrays and bytes as base64 text, or with `blobs`, as a
    placeholder for the text appended there (`_with_blobs`)."""
    if isinstance(value, np.ndarray):
        arr = np.asarray(value, order="C")  # keeps 0-d arrays 0-d
        return {
            "__ndarray__": _base64(arr.tobytes(), blobs),
            "dtype": str(arr.dtype),
            "shape": list(arr.shape),
        }
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):  # a graph attribute: a serialized ModelProto
        return {"__bytes__": _base64(value, blobs)}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, blobs) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v, blobs) for k, v in value.items()}
    return value


def _base64(data: bytes, blobs: list[str] | None) -> str:
    text = base64.b64encode(data).decode("ascii")
    if blobs is None:
        return text
    blobs.append(text)
    return f"\x00{len(blobs) - 1}"


_BLOB = re.compile(r'"\\u0000(\d+)"')
"""A blob's placeholder as json.dumps writes it (ensure_ascii escapes the NUL)."""


def _with_blobs(text: str, blobs: list[str]) -> str | None:
    """The JSON `text` with each placeholder replaced by its blob's text, as json.dumps
    would have written it (base64 needs no escaping); None when some other string of the
    document could be mistaken for a placeholder. The JSON encoder then never escapes the
    blobs character by character (a program's constants: most of its tables)."""
    if text.count('"\\u0000') != len(blobs):
        return None
    return _BLOB.sub(lambda match: f'"{blobs[int(match[1])]}"', text)


def _unjson(value: Any) -> Any:
    if isinstance(value, dict):
        if "__ndarray__" in value:
            raw = base64.b64decode(value["__ndarray__"])
            return np.frombuffer(raw, dtype=np.dtype(value["dtype"])).reshape(value["shape"]).copy()
        if "__bytes__" in value:
            return base64.b64decode(value["__bytes__"])
        return {k: _unjson(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unjson(v) for v in value]
    return value


def _info_to_json(info: NodeInfo, blobs: list[str] | None = None) -> dict[str, Any]:
    return {
        "op_type": info.op_type,
        "name": info.name,
        "domain": info.domain,
        "opset": info.opset,
        "attrs": _jsonable(info.attrs, blobs),
        "in_shapes": [None if s is None else list(s) for s in info.in_shapes],
        "in_dtypes": list(info.in_dtypes),
        "out_shapes": [list(s) for s in info.out_shapes],
        "out_dtypes": list(info.out_dtypes),
        "consts": {str(k): _jsonable(v, blobs) for k, v in sorted(info.consts.items())},
    }


def _info_from_json(d: dict[str, Any]) -> NodeInfo:
    return NodeInfo(
        op_type=d["op_type"],
        name=d["name"],
        attrs=_unjson(d["attrs"]),
        in_shapes=tuple(None if s is None else tuple(s) for s in d["in_shapes"]),
        in_dtypes=tuple(d["in_dtypes"]),
        out_shapes=tuple(tuple(s) for s in d["out_shapes"]),
        out_dtypes=tuple(d["out_dtypes"]),
        opset=d["opset"],
        domain=d["domain"],
        consts={int(k): _unjson(v) for k, v in d["consts"].items()},
    )


def _tables_json(program: Program) -> bytes:
    """The tables section: canonical JSON (sorted keys, no spaces)."""
    blobs: list[str] = []
    text = _with_blobs(_tables_text(program, blobs), blobs)
    if text is None:
        text = _tables_text(program, None)
    return text.encode("utf-8")


def _tables_text(program: Program, blobs: list[str] | None) -> str:
    doc = {
        "version": PROGRAM_VERSION,
        "num_cores": program.num_cores,
        "num_semaphores": program.num_semaphores,
        "ddr_size": program.ddr_size,
        "constants_size": program.constants_size,
        "vtcm_used": program.vtcm_used,
        "resident": program.resident,
        "inputs": program.inputs,
        "outputs": program.outputs,
        "meta": _jsonable(program.meta, blobs),
        "tensors": [
            [t.id, t.name, t.dtype, list(t.shape), t.kind, t.ddr_offset, t.nbytes]
            for t in program.tensors
        ],
        "kernels": [
            {
                "id": k.id,
                "name": k.name,
                "info": _info_to_json(k.info, blobs),
                "inputs": list(k.inputs),
                "outputs": list(k.outputs),
                "epilogue": [
                    {
                        "op_type": e.op_type,
                        "node_name": e.node_name,
                        "inputs": list(e.inputs),
                        "attrs": _jsonable(e.attrs, blobs),
                        "opset": e.opset,
                        "out_dtype": e.out_dtype,
                        **({"domain": e.domain} if e.domain else {}),
                    }
                    for e in k.epilogue
                ],
                "kernel": k.kernel,
                "unit": k.unit,
                "macs": k.macs,
                "nodes": list(k.nodes),
                "op_types": list(k.op_types),
            }
            for k in program.kernels
        ],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def _pack_box(out: list[bytes], box: Box) -> None:
    out.append(_box_bytes(box))


@functools.lru_cache(maxsize=1 << 16)
def _box_bytes(box: Box) -> bytes:
    """A box's encoding (rank, then start/stop pairs); programs repeat the same few boxes."""
    return struct.pack(f"<B{2 * len(box)}q", len(box), *(x for pair in box for x in pair))


_PIECES = struct.Struct("<BI").pack
_VTCM = struct.Struct("<Q").pack


def _pack_operand(out: list[bytes], operand: Operand | None) -> None:
    if operand is None:
        out.append(b"\x00")
        return
    out.append(_PIECES(1, len(operand.pieces)))
    out.append(_box_bytes(operand.box))
    for piece in operand.pieces:
        out.append(_VTCM(piece.vtcm))
        out.append(_box_bytes(piece.box))


_WAIT = struct.Struct("<BII").pack
_POST = struct.Struct("<BI").pack
_LOAD = struct.Struct("<BIiQQ").pack
_STORE = struct.Struct("<BIiQ").pack
_NOC = struct.Struct("<BIiQQQ").pack
_KERNEL = struct.Struct("<BI").pack
_COUNT = struct.Struct("<I").pack


def _pack_stream(stream: list[Instr]) -> list[bytes]:
    """Each instruction's bytes; its type tested in order of frequency (a stream is
    mostly semaphore waits and posts, transfers and kernel runs)."""
    body: list[bytes] = []
    put = body.append
    box_bytes = _box_bytes
    for instr in stream:
        if isinstance(instr, SemWait):
            put(_WAIT(_OP_WAIT, instr.sem, instr.count))
        elif isinstance(instr, SemPost):
            put(_POST(_OP_POST, instr.sem))
        elif isinstance(instr, NocCopy):
            put(_NOC(_OP_NOC, instr.tensor, instr.kernel, instr.src_vtcm, instr.vtcm, instr.cores))
            put(box_bytes(instr.box))
            put(box_bytes(instr.src_box))
            put(box_bytes(instr.buf_box))
        elif isinstance(instr, RunKernel):
            put(_KERNEL(_OP_KERNEL, instr.kernel))
            put(box_bytes(instr.out_box))
            put(_COUNT(len(instr.inputs)))
            for operand in instr.inputs:
                _pack_operand(body, operand)
            put(_COUNT(len(instr.outputs)))
            for operand in instr.outputs:
                _pack_operand(body, operand)
        elif isinstance(instr, DmaLoad):
            put(_LOAD(_OP_LOAD, instr.tensor, instr.kernel, instr.vtcm, instr.cores))
            put(box_bytes(instr.box))
            put(box_bytes(instr.buf_box))
        elif isinstance(instr, DmaStore):
            put(_STORE(_OP_STORE, instr.tensor, instr.kernel, instr.vtcm))
            put(box_bytes(instr.box))
            put(box_bytes(instr.buf_box))
        elif isinstance(instr, DmaGather):
            body.append(
                struct.pack(
                    "<BIiIBIIQQ",
                    _OP_GATHER,
                    instr.tensor,
                    instr.kernel,
                    instr.indices,
                    instr.axis,
                    instr.out,
                    0,
                    instr.index_vtcm,
                    instr.vtcm,
                )
            )
            for box in (instr.box, instr.index_box, instr.out_box, instr.buf_box):
                _pack_box(body, box)
        elif isinstance(instr, DmaScatter):
            body.append(
                struct.pack(
                    "<BIiBII",
                    _OP_SCATTER,
                    instr.tensor,
                    instr.kernel,
                    instr.axis,
                    instr.source,
                    instr.index,
                )
            )
            _pack_box(body, instr.box)
            _pack_operand(body, instr.update)
            _pack_operand(body, instr.indices)
        elif isinstance(instr, LinkSend):
            body.append(
                struct.pack(
                    "<BIiII", _OP_LINK_SEND, instr.tensor, instr.kernel, instr.peer, instr.dst
                )
            )
            _pack_box(body, instr.box)
            _pack_box(body, instr.dst_box)
        else:
            assert isinstance(instr, LinkWait)
            body.append(
                struct.pack("<BIiI", _OP_LINK_WAIT, instr.tensor, instr.kernel, instr.count)
            )
    return body


def encode_program(program: Program) -> bytes:
    tables = _tables_json(program)
    setup = program.setup or [[] for _ in program.streams]
    parts: list[bytes] = [
        PROGRAM_MAGIC,
        struct.pack("<IQI", PROGRAM_VERSION, len(tables), len(program.streams)),
        tables,
    ]
    for stream in (*program.streams, *setup):
        blob = b"".join(_pack_stream(stream))
        parts.append(struct.pack("<IQ", len(stream), len(blob)))
        parts.append(blob)
    return b"".join(parts)


_BOX_FORMATS = [f"<{2 * rank}q" for rank in range(256)]


class _Reader:
    def __init__(self, data: bytes | memoryview) -> None:
        self.data = memoryview(data)
        self.pos = 0

    def take(self, fmt: str) -> tuple[Any, ...]:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise CompileError("invalid_program", f"program.bin truncated at byte {self.pos}")
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return values

    def box(self) -> Box:
        (rank,) = self.take("<B")
        flat = self.take(_BOX_FORMATS[rank])
        return tuple(zip(flat[0::2], flat[1::2], strict=True))

    def operand(self) -> Operand | None:
        (present,) = self.take("<B")
        if present == 0:
            return None
        if present != 1:
            raise CompileError("invalid_program", f"bad operand flag {present} at {self.pos}")
        (count,) = self.take("<I")
        box = self.box()
        pieces = []
        for _ in range(count):
            (vtcm,) = self.take("<Q")
            pieces.append(Piece(vtcm, self.box()))
        return Operand(box, tuple(pieces))

    def stream(self) -> list[Instr]:
        count, _blob_len = self.take("<IQ")
        stream: list[Instr] = []
        for _ in range(count):
            (code,) = self.take("<B")
            if code == _OP_LOAD:
                tensor, kernel, vtcm, cores = self.take("<IiQQ")
                stream.append(DmaLoad(tensor, self.box(), vtcm, self.box(), cores, kernel))
            elif code == _OP_STORE:
                tensor, kernel, vtcm = self.take("<IiQ")
                stream.append(DmaStore(tensor, self.box(), vtcm, self.box(), kernel))
            elif code == _OP_NOC:
                tensor, kernel, src_vtcm, vtcm, cores = self.take("<IiQQQ")
                box, src_box, buf_box = self.box(), self.box(), self.box()
                stream.append(NocCopy(tensor, box, src_vtcm, src_box, vtcm, buf_box, cores, kernel))
            elif code == _OP_GATHER:
                tensor, kernel, indices, axis, out, _, index_vtcm, vtcm = self.take("<IiIBIIQQ")
                box, index_box, out_box, buf_box = self.box(), self.box(), self.box(), self.box()
                stream.append(
                    DmaGather(
                        tensor,
                        axis,
                        box,
                        indices,
                        index_vtcm,
                        index_box,
                        out,
                        out_box,
                        vtcm,
                        buf_box,
                        kernel,
                    )
                )
            elif code == _OP_SCATTER:
                tensor, kernel, axis, source, index = self.take("<IiBII")
                box = self.box()
                update, indices = self.operand(), self.operand()
                if update is None or indices is None:
                    raise CompileError("invalid_program", f"scatter without operands at {self.pos}")
                stream.append(DmaScatter(tensor, axis, box, source, update, index, indices, kernel))
            elif code == _OP_KERNEL:
                (kernel,) = self.take("<I")
                out_box = self.box()
                (n_in,) = self.take("<I")
                ins = tuple(self.operand() for _ in range(n_in))
                (n_out,) = self.take("<I")
                outs = tuple(self.operand() for _ in range(n_out))
                stream.append(RunKernel(kernel, out_box, ins, outs))
            elif code == _OP_POST:
                stream.append(SemPost(*self.take("<I")))
            elif code == _OP_WAIT:
                stream.append(SemWait(*self.take("<II")))
            elif code == _OP_LINK_SEND:
                tensor, kernel, peer, dst = self.take("<IiII")
                box, dst_box = self.box(), self.box()
                stream.append(LinkSend(tensor, box, peer, dst, dst_box, kernel))
            elif code == _OP_LINK_WAIT:
                tensor, kernel, count = self.take("<IiI")
                stream.append(LinkWait(tensor, count, kernel))
            else:
                raise CompileError("invalid_program", f"unknown opcode {code} at {self.pos - 1}")
        return stream


def decode_program(data: bytes | memoryview) -> Program:
    """Decode and structurally check program.bin; raises CompileError('invalid_program')."""
    reader = _Reader(data)
    if bytes(reader.data[:4]) != PROGRAM_MAGIC:
        raise CompileError("invalid_program", "program.bin does not start with QPRG")
    reader.pos = 4
    version, tables_len, num_streams = reader.take("<IQI")
    if version != PROGRAM_VERSION:
        raise CompileError("invalid_program", f"program.bin version {version} is not supported")
    if reader.pos + tables_len > len(reader.data):
        raise CompileError("invalid_program", "program.bin table section is truncated")
    try:
        doc = json.loads(bytes(reader.data[reader.pos : reader.pos + tables_len]))
    except ValueError as exc:
        raise CompileError("invalid_program", f"program.bin tables are not JSON: {exc}") from exc
    reader.pos += tables_len
    try:
        tensors = [
            TensorDesc(int(i), str(n), str(dt), tuple(int(d) for d in s), str(k), int(o), int(b))
            for i, n, dt, s, k, o, b in doc["tensors"]
        ]
        kernels = [
            KernelDesc(
                id=k["id"],
                name=k["name"],
                info=_info_from_json(k["info"]),
                inputs=tuple(k["inputs"]),
                outputs=tuple(k["outputs"]),
                epilogue=tuple(
                    EpilogueDesc(
                        op_type=e["op_type"],
                        node_name=e["node_name"],
                        inputs=tuple(e["inputs"]),
                        attrs=_unjson(e["attrs"]),
                        opset=e["opset"],
                        out_dtype=e["out_dtype"],
                        domain=e.get("domain", ""),
                    )
                    for e in k["epilogue"]
                ),
                kernel=k["kernel"],
                unit=k["unit"],
                macs=k["macs"],
                nodes=tuple(k["nodes"]),
                op_types=tuple(k["op_types"]),
            )
            for k in doc["kernels"]
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise CompileError("invalid_program", f"program.bin tables are malformed: {exc}") from exc
    streams = [reader.stream() for _ in range(num_streams)]
    setup = [reader.stream() for _ in range(num_streams)]
    if reader.pos != len(reader.data):
        raise CompileError("invalid_program", "program.bin has trailing bytes")
    try:
        program = Program(
            tensors=tensors,
            kernels=kernels,
            streams=streams,
            num_semaphores=int(doc["num_semaphores"]),
            ddr_size=int(doc["ddr_size"]),
            constants_size=int(doc["constants_size"]),
            vtcm_used=[int(v) for v in doc["vtcm_used"]],
            inputs=[int(v) for v in doc["inputs"]],
            outputs=[int(v) for v in doc["outputs"]],
            meta=_unjson(doc.get("meta", {})),
            setup=setup,
            resident=int(doc.get("resident", 0)),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CompileError("invalid_program", f"program.bin tables are malformed: {exc}") from exc
    check_program(program)
    return program


def check_program(program: Program) -> None:
    """Every reference in range: tensors, kernels, semaphores, cores; tensors inside DDR;
    program activation only loads."""
    n_t, n_k = len(program.tensors), len(program.kernels)
    all_cores = (1 << program.num_cores) - 1
    for t in program.tensors:
        if t.kind == KIND_ONCHIP:
            continue
        if t.ddr_offset < 0 or t.ddr_offset + t.nbytes > program.ddr_size:
            raise CompileError("invalid_program", f"tensor {t.name} lies outside DDR")
    for k in program.kernels:
        for ref in (*k.inputs, *k.outputs):
            if ref >= n_t or ref < -1:
                raise CompileError("invalid_program", f"kernel {k.name} names tensor {ref}")
    if program.setup and len(program.setup) != program.num_cores:
        raise CompileError("invalid_program", "setup streams do not match the cores")
    for core, stream in enumerate(program.setup):
        for instr in stream:
            if not isinstance(instr, DmaLoad):
                raise CompileError(
                    "invalid_program", f"core {core}: program activation may only load constants"
                )
    for core, stream in enumerate((*program.streams, *program.setup)):
        core %= max(1, program.num_cores)
        for instr in stream:
            if isinstance(instr, DmaLoad | DmaStore | NocCopy | DmaGather) and instr.tensor >= n_t:
                raise CompileError("invalid_program", f"core {core}: DMA of tensor {instr.tensor}")
            if isinstance(instr, LinkSend | LinkWait) and instr.tensor >= n_t:
                raise CompileError("invalid_program", f"core {core}: link of tensor {instr.tensor}")
            if isinstance(instr, LinkSend) and instr.dst >= n_t:
                raise CompileError("invalid_program", f"core {core}: link into tensor {instr.dst}")
            if isinstance(instr, DmaGather) and (instr.indices >= n_t or instr.out >= n_t):
                raise CompileError("invalid_program", f"core {core}: gather names tensor")
            if isinstance(instr, DmaScatter) and (
                instr.tensor >= n_t or instr.source >= n_t or instr.index >= n_t
            ):
                raise CompileError("invalid_program", f"core {core}: scatter names tensor")
            if isinstance(instr, DmaLoad | NocCopy) and (
                instr.cores == 0 or instr.cores & ~all_cores
            ):
                raise CompileError(
                    "invalid_program", f"core {core}: transfer to cores {instr.cores:#x}"
                )
            if isinstance(instr, RunKernel) and instr.kernel >= n_k:
                raise CompileError("invalid_program", f"core {core}: kernel {instr.kernel}")
            if isinstance(instr, RunKernel):
                outputs = program.kernels[instr.kernel].outputs
                if len(instr.outputs) != len(outputs) or any(
                    (o is None) != (t < 0) for o, t in zip(instr.outputs, outputs, strict=True)
                ):
                    raise CompileError(
                        "invalid_program", f"core {core}: kernel {instr.kernel} output operands"
                    )
                if any(o is not None and len(o.pieces) != 1 for o in instr.outputs):
                    raise CompileError(
                        "invalid_program", f"core {core}: kernel {instr.kernel} output pieces"
                    )
            if isinstance(instr, SemPost | SemWait) and instr.sem >= program.num_semaphores:
                raise CompileError("invalid_program", f"core {core}: semaphore {instr.sem}")
