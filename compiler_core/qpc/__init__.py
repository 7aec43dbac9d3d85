"""The QPC: the container layout, our segments, validation against devices, and inspection."""

from compiler_core.qpc.container import (
    QPC_FILE_NAME,
    ConstantEntry,
    Qpc,
    QpcHeader,
    Segment,
    SegmentRecord,
    decode_constantsdesc,
    encode_constantsdesc,
    load_qpc,
    qpc_bytes,
    write_qpc,
)
from compiler_core.qpc.inspect import inspect_qpc, render_inspect
from compiler_core.qpc.networkdesc import (
    DTYPE_CODES,
    IODesc,
    NetworkDesc,
    Requirements,
    SpecializationDesc,
    dtype_code,
)
from compiler_core.qpc.validate import Check, ValidationReport, render_validation, validate_qpc

__all__ = [
    "DTYPE_CODES",
    "QPC_FILE_NAME",
    "Check",
    "ConstantEntry",
    "IODesc",
    "NetworkDesc",
    "Qpc",
    "QpcHeader",
    "Requirements",
    "Segment",
    "SegmentRecord",
    "SpecializationDesc",
    "ValidationReport",
    "decode_constantsdesc",
    "dtype_code",
    "encode_constantsdesc",
    "inspect_qpc",
    "load_qpc",
    "qpc_bytes",
    "render_inspect",
    "render_validation",
    "validate_qpc",
    "write_qpc",
]
