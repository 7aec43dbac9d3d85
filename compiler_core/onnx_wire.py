"""Read a single-file ONNX model without copying its weights into memory.

Protobuf parsing copies every `raw_data` field into the parsed message, so a 100 MB model
costs 100 MB more than the file. Instead we walk the protobuf wire format of the memory-mapped
file and re-encode the model with each large `raw_data` turned into an external-data reference
to its own bytes *inside the model file* (location = the file, offset = where the bytes are).
The IR then memory-maps them like any external data: the weights are read from the file once,
when the QPC's constants are written, and never held twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# Field numbers from onnx.proto.
_MODEL_GRAPH = 7
_GRAPH_NODE, _GRAPH_INITIALIZER = 1, 5
_NODE_ATTRIBUTE = 5
_ATTRIBUTE_TENSOR = 5
_TENSOR_RAW_DATA, _TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION = 9, 13, 14
_EXTERNAL = 1

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class WireError(ValueError):
    """The bytes are not a protobuf message we can walk; the caller parses them normally."""


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    if pos < len(buf) and buf[pos] < 0x80:  # one byte: field keys, small lengths
        return buf[pos], pos + 1
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


_ONE_BYTE = [bytes((value,)) for value in range(0x80)]


def _encode_varint(value: int) -> bytes:
    if value < 0x80:
        return _ONE_BYTE[value]
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _encode_varint(field << 3 | wire)


def _len_field(field: int, payload: bytes) -> bytes:
    return _key(field, _LEN) + _encode_varint(len(payload)) + payload


def _fields(buf: memoryview, start: int, end: int):  # type: ignore[no-untyped-def]
    """Yield (field, wire, field_start, value_start, value_end) for a message's fields."""
    pos = start
    size = len(buf)
    while pos < end:
        field_start = pos
        key = buf[pos]  # pos < end <= len(buf)
        if key < 0x80:
            pos += 1
        else:
            key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise WireError("field number 0")
        if wire == _VARINT:
            if pos < size and buf[pos] < 0x80:
                value_end = pos + 1
            else:
                _, value_end = _varint(buf, pos)
            yield field, wire, field_start, pos, value_end
            pos = value_end
        elif wire == _I64:
            yield field, wire, field_start, pos, pos + 8
            pos += 8
        elif wire == _I32:
            yield field, wire, field_start, pos, pos + 4
            pos += 4
        elif wire == _LEN:
            length, value_start = _varint(buf, pos)
            value_end = value_start + length
            if value_end > end:
                raise WireError("length-delimited field runs past its message")
            yield field, wire, field_start, value_start, value_end
            pos = value_end
        else:
            raise WireError(f"unsupported wire type {wire}")
    if pos != end:
        raise WireError("message overruns its length")


Rewriter = Callable[[memoryview, int, int], bytes | None]


def _rewrite(buf: memoryview, start: int, end: int, children: dict[int, Rewriter]) -> bytes | None:
    """Re-encode a message, rewriting the sub-messages of `children`; None if nothing changed.
    The fields between two rewritten ones are copied as one run."""
    out: list[bytes] = []
    kept = start  # where the run of unchanged fields not yet copied starts
    for field, wire, field_start, value_start, value_end in _fields(buf, start, end):
        rewrite = children.get(field) if wire == _LEN else None
        new = rewrite(buf, value_start, value_end) if rewrite else None
        if new is not None:
            out.append(bytes(buf[kept:field_start]))
            out.append(_len_field(field, new))
            kept = value_end
    if not out:
        return None
    out.append(bytes(buf[kept:end]))
    return b"".join(out)


def _external_entry(key: bytes, value: bytes) -> bytes:
    """An `external_data` field of a TensorProto: a StringStringEntryProto (key 1, value 2)."""
    return _len_field(_TENSOR_EXTERNAL_DATA, _len_field(1, key) + _len_field(2, value))


@dataclass
class Stripped:
    data: bytes
    moved: int
    """How many raw_data fields now point into the model file."""


def strip_inline_weights(data: memoryview, location: str, threshold: int = 1024) -> Stripped:
    """The model's bytes with every `raw_data` of at least `threshold` bytes (initializers
    and Constant-node tensors) replaced by an external reference into `location`.

    Raises WireError when the bytes are not a well-formed message (those it walks: a message
    shorter than `threshold` cannot hold such a field and is skipped); nothing is copied until
    the whole walk succeeded.
    """

    counts = {"moved": 0}
    # The parts of each reference that are the same for every tensor, encoded once.
    at_location = _external_entry(b"location", location.encode())
    external = _key(_TENSOR_DATA_LOCATION, _VARINT) + _encode_varint(_EXTERNAL)

    def tensor(buf: memoryview, start: int, end: int) -> bytes | None:
        if end - start < threshold:
            return None
        cuts: list[tuple[int, int]] = []  # the raw_data fields left out: every one that large
        moved: tuple[int, int] | None = None
        for field, wire, field_start, value_start, value_end in _fields(buf, start, end):
            if field == _TENSOR_RAW_DATA and wire == _LEN and value_end - value_start >= threshold:
                moved = (value_start, value_end - value_start)
                cuts.append((field_start, value_end))
            elif field in (_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION):
                return None  # already external: leave it as it is
        if moved is None:
            return None
        offset, length = moved
        counts["moved"] += 1
        keep: list[bytes] = []
        kept = start
        for cut_start, cut_end in cuts:  # the other fields, in order, as runs
            keep.append(bytes(buf[kept:cut_start]))
            kept = cut_end
        keep.append(bytes(buf[kept:end]))
        keep.append(at_location)
        keep.append(_external_entry(b"offset", str(offset).encode()))
        keep.append(_external_entry(b"length", str(length).encode()))
        keep.append(external)
        return b"".join(keep)

    def attribute(buf: memoryview, start: int, end: int) -> bytes | None:
        if end - start < threshold:
            return None
        return _rewrite(buf, start, end, {_ATTRIBUTE_TENSOR: tensor})

    def node(buf: memoryview, start: int, end: int) -> bytes | None:
        if end - start < threshold:
            return None
        return _rewrite(buf, start, end, {_NODE_ATTRIBUTE: attribute})

    def graph(buf: memoryview, start: int, end: int) -> bytes | None:
        return _rewrite(buf, start, end, {_GRAPH_INITIALIZER: tensor, _GRAPH_NODE: node})

    result = _rewrite(data, 0, len(data), {_MODEL_GRAPH: graph})
    return Stripped(data=bytes(data) if result is None else result, moved=counts["moved"])
