"""networkdesc.bin: what a QPC computes and what it needs from a device, as canonical JSON.

The vendor's descriptor is protobuf; ours mirrors its useful fields (name, I/O with vendor
dtype codes, cores, batch, specializations, stats settings) and adds `requirements`, the
numbers `validate_qpc` compares with a device profile.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from compiler_core.errors import CompileError

if TYPE_CHECKING:
    from compiler_core.lowering.program import Program, TensorDesc

NETWORKDESC_FORMAT = "qpcfarm-networkdesc"
NETWORKDESC_VERSION = 1

RETAINED_SUFFIX = "_RetainedState"
"""With -retained-state, output `<input>_RetainedState` stays on the device and feeds `<input>`
on the next run."""


def program_segment(index: int) -> str:
    """The program segment of specialization `index` (the first one's is plain program.bin)."""
    return "program.bin" if index == 0 else f"program.{index}.bin"


def statsdesc_segment(index: int) -> str:
    return "statsdesc.bin" if index == 0 else f"statsdesc.{index}.bin"


DTYPE_CODES: dict[str, int] = {
    # vendor codes
    "float32": 0,
    "float16": 1,
    "int8q": 2,
    "uint8q": 3,
    "int16q": 4,
    "int32q": 5,
    "int32": 6,
    "int64": 7,
    "int8": 8,
    # qpcfarm codes for types the vendor list does not name (>= 100)
    "uint8": 100,
    "int16": 101,
    "uint16": 102,
    "uint32": 103,
    "uint64": 104,
    "bool": 105,
    "float64": 106,
    "bfloat16": 107,
}
"""Element type -> dtype code. Vendor codes 0..8 as the vendor uses them; ours from 100."""


def dtype_code(dtype: str) -> int:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise CompileError(
            "unsupported_dtype", f"element type {dtype!r} has no QPC dtype code"
        ) from None


def _invalid(message: str) -> CompileError:
    return CompileError("invalid_qpc", f"networkdesc.bin: {message}")


@dataclass(frozen=True)
class IODesc:
    """One network input or output as the host sees it."""

    name: str
    dtype: str
    dtype_code: int
    dims: tuple[int, ...]
    layout: str
    tensor_id: int

    @classmethod
    def from_tensor(cls, tensor: TensorDesc) -> IODesc:
        """Describe a program tensor; rank-4 tensors are NCHW, the rest ND."""
        return cls(
            name=tensor.name,
            dtype=tensor.dtype,
            dtype_code=dtype_code(tensor.dtype),
            dims=tuple(tensor.shape),
            layout="NCHW" if len(tensor.shape) == 4 else "ND",
            tensor_id=tensor.id,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "dtype_code": self.dtype_code,
            "dims": list(self.dims),
            "layout": self.layout,
            "tensor_id": self.tensor_id,
        }

    @classmethod
    def from_dict(cls, d: Any) -> IODesc:
        row = _object(d, "I/O entry")
        io = cls(
            name=_get(row, "name", str),
            dtype=_get(row, "dtype", str),
            dtype_code=_get(row, "dtype_code", int),
            dims=tuple(_int_list(row, "dims")),
            layout=_get(row, "layout", str),
            tensor_id=_get(row, "tensor_id", int),
        )
        if io.layout not in ("NCHW", "ND"):
            raise _invalid(f"I/O {io.name!r} has layout {io.layout!r} (NCHW or ND)")
        return io


@dataclass(frozen=True)
class SpecializationDesc:
    """One shape specialization: its symbol values, its program and stats segments and the
    I/O shapes it takes. Constants are shared by all specializations of a QPC."""

    name: str
    symbols: dict[str, int]
    program: str
    statsdesc: str
    inputs: tuple[IODesc, ...]
    outputs: tuple[IODesc, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "symbols": dict(self.symbols),
            "program": self.program,
            "statsdesc": self.statsdesc,
            "inputs": [io.to_dict() for io in self.inputs],
            "outputs": [io.to_dict() for io in self.outputs],
        }

    @classmethod
    def from_dict(cls, d: Any) -> SpecializationDesc:
        row = _object(d, "specialization")
        symbols = _get(row, "symbols", dict)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in symbols.values()):
            raise _invalid("specialization symbols must be integers")
        return cls(
            name=_get(row, "name", str),
            symbols=dict(symbols),
            program=_get(row, "program", str),
            statsdesc=_get(row, "statsdesc", str),
            inputs=tuple(IODesc.from_dict(x) for x in _get(row, "inputs", list)),
            outputs=tuple(IODesc.from_dict(x) for x in _get(row, "outputs", list)),
        )


@dataclass(frozen=True)
class Requirements:
    """What the QPC needs from a device: compared with a DeviceProfile by validate_qpc."""

    num_cores: int
    vtcm_bytes_per_core: int
    ddr_bytes: int
    dtypes: tuple[str, ...]
    retained_state: tuple[str, ...] = ()

    @classmethod
    def from_program(
        cls, program: Program, retained_state: Iterable[str] = (), extra_ddr_bytes: int = 0
    ) -> Requirements:
        """Cores used, the largest VTCM footprint, DDR size (plus e.g. stats buffers) and
        every element type a kernel reads or writes."""
        dtypes: set[str] = set()
        for kernel in program.kernels:
            dtypes.update(d for d in kernel.info.in_dtypes if d is not None)
            dtypes.update(kernel.info.out_dtypes)
            dtypes.update(e.out_dtype for e in kernel.epilogue)
        return cls(
            num_cores=program.num_cores,
            vtcm_bytes_per_core=max(program.vtcm_used, default=0),
            ddr_bytes=program.ddr_size + extra_ddr_bytes,
            dtypes=tuple(sorted(dtypes)),
            retained_state=tuple(retained_state),
        )

    @classmethod
    def merge(cls, parts: Sequence[Requirements], retained_state: Iterable[str]) -> Requirements:
        """What several programs of one QPC need together (each runs on its own: the most
        any of them needs)."""
        return cls(
            num_cores=max(p.num_cores for p in parts),
            vtcm_bytes_per_core=max(p.vtcm_bytes_per_core for p in parts),
            ddr_bytes=max(p.ddr_bytes for p in parts),
            dtypes=tuple(sorted({d for p in parts for d in p.dtypes})),
            retained_state=tuple(retained_state),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_cores": self.num_cores,
            "vtcm_bytes_per_core": self.vtcm_bytes_per_core,
            "ddr_bytes": self.ddr_bytes,
            "dtypes": sorted(self.dtypes),
            "retained_state": list(self.retained_state),
        }

    @classmethod
    def from_dict(cls, d: Any) -> Requirements:
        row = _object(d, "requirements")
        return cls(
            num_cores=_get(row, "num_cores", int),
            vtcm_bytes_per_core=_get(row, "vtcm_bytes_per_core", int),
            ddr_bytes=_get(row, "ddr_bytes", int),
            dtypes=tuple(_str_list(row, "dtypes")),
            retained_state=tuple(_str_list(row, "retained_state")),
        )


@dataclass(frozen=True)
class NetworkDesc:
    """The network descriptor of a qpcfarm QPC (networkdesc.bin)."""

    network_name: str
    compiler_version: str
    options: dict[str, Any]
    hw_version: str
    num_cores: int
    batch_size: int
    inputs: tuple[IODesc, ...]
    outputs: tuple[IODesc, ...]
    requirements: Requirements
    specializations: tuple[SpecializationDesc, ...] = ()
    """Empty for a single-program QPC; otherwise every program, the first one included."""
    stats: dict[str, Any] = field(default_factory=dict)
    format: str = NETWORKDESC_FORMAT
    version: int = NETWORKDESC_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "version": self.version,
            "network_name": self.network_name,
            "compiler_version": self.compiler_version,
            "options": self.options,
            "hw_version": self.hw_version,
            "num_cores": self.num_cores,
            "batch_size": self.batch_size,
            "inputs": [io.to_dict() for io in self.inputs],
            "outputs": [io.to_dict() for io in self.outputs],
            "specializations": [s.to_dict() for s in self.specializations],
            "stats": self.stats,
            "requirements": self.requirements.to_dict(),
        }

    def to_bytes(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces): equal descriptors give equal bytes."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_dict(cls, d: Any) -> NetworkDesc:
        doc = _object(d, "descriptor")
        fmt = doc.get("format")
        if fmt != NETWORKDESC_FORMAT:
            raise _invalid(f"format is {fmt!r}, expected {NETWORKDESC_FORMAT!r}")
        version = doc.get("version")
        if version != NETWORKDESC_VERSION:
            raise _invalid(f"version {version!r} is not supported (expected 1)")
        specializations = tuple(
            SpecializationDesc.from_dict(s) for s in _get(doc, "specializations", list)
        )
        return cls(
            network_name=_get(doc, "network_name", str),
            compiler_version=_get(doc, "compiler_version", str),
            options=_get(doc, "options", dict),
            hw_version=_get(doc, "hw_version", str),
            num_cores=_get(doc, "num_cores", int),
            batch_size=_get(doc, "batch_size", int),
            inputs=tuple(IODesc.from_dict(x) for x in _get(doc, "inputs", list)),
            outputs=tuple(IODesc.from_dict(x) for x in _get(doc, "outputs", list)),
            requirements=Requirements.from_dict(doc.get("requirements")),
            specializations=specializations,
            stats=_get(doc, "stats", dict),
        )

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> NetworkDesc:
        try:
            doc = json.loads(bytes(data))
        except (ValueError, UnicodeDecodeError) as exc:
            raise _invalid(f"not JSON: {exc}") from exc
        return cls.from_dict(doc)

    def programs(self) -> list[SpecializationDesc]:
        """Every program with the I/O it takes: the specializations, or the one program."""
        if self.specializations:
            return list(self.specializations)
        return [
            SpecializationDesc(
                "default", {}, program_segment(0), statsdesc_segment(0), self.inputs, self.outputs
            )
        ]


def _object(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise _invalid(f"{what} is not a JSON object")
    return value


def _get(doc: Mapping[str, Any], key: str, kind: type) -> Any:
    if key not in doc:
        raise _invalid(f"missing field {key!r}")
    value = doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _invalid(f"field {key!r} should be {kind.__name__}, found {type(value).__name__}")
    return value


def _int_list(doc: Mapping[str, Any], key: str) -> list[int]:
    values = _get(doc, key, list)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise _invalid(f"field {key!r} should be a list of integers")
    return values


def _str_list(doc: Mapping[str, Any], key: str) -> list[str]:
    values = _get(doc, key, list)
    if not all(isinstance(v, str) for v in values):
        raise _invalid(f"field {key!r} should be a list of strings")
    return values
