"""Which protobuf message a `.pb` file holds, from its wire format alone: an ONNX ModelProto,
a TensorFlow SavedModel (`saved_model.pb`) or a frozen GraphDef.

All three are protobufs without a magic number, and an ONNX model and a SavedModel both
start with a small varint in field 1 (`ir_version`; `saved_model_schema_version`). What
tells them apart is the set of top-level fields and their wire types, read here by walking
tags and lengths (seeking past each length-delimited body, so a large file costs a few
reads, never its size in memory). Nothing is parsed, and no protobuf library is needed.

Field numbers (the messages' .proto files):
- onnx.ModelProto: 1 ir_version, 2 producer_name, 3 producer_version, 4 domain,
  5 model_version, 6 doc_string, 7 graph, 8 opset_import, 14 metadata_props,
  20 training_info, 25 functions, 26 configuration;
- tensorflow.SavedModel: 1 saved_model_schema_version, 2 meta_graphs (MetaGraphDef: 1
  meta_info_def, 2 graph_def, 3 saver_def, 4 collection_def, 5 signature_def, 6
  asset_file_def, 7 object_graph_def);
- tensorflow.GraphDef: 1 node (NodeDef: 1 name, 2 op, 3 input, 4 device, 5 attr, ...),
  2 library, 3 version, 4 versions, 5 debug_info.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

VARINT, I64, LEN, I32 = 0, 1, 2, 5
MAX_FIELDS = 4096
"""Top-level fields walked at most: enough to see every kind of field a model has (a
GraphDef repeats `node` once per node; the kinds seen in its first nodes decide)."""

ONNX = "onnx"
SAVED_MODEL = "saved_model"
GRAPH_DEF = "graph_def"

_ONNX_MODEL = {1: VARINT, 2: LEN, 3: LEN, 4: LEN, 5: VARINT, 6: LEN, 7: LEN, 8: LEN}
_ONNX_MODEL |= {14: LEN, 20: LEN, 25: LEN, 26: LEN}
_SAVED_MODEL = {1: VARINT, 2: LEN}
_META_GRAPH = {n: LEN for n in range(1, 8)}
_GRAPH_DEF = {1: LEN, 2: LEN, 3: VARINT, 4: LEN, 5: LEN}
_NODE_DEF = {n: LEN for n in range(1, 8)}


@dataclass(frozen=True)
class Field:
    """One top-level field: its number, wire type, and (length-delimited) where its body
    starts and how long it is."""

    number: int
    wire: int
    offset: int = 0
    length: int = 0


def _varint(handle: BinaryIO) -> int | None:
    value = 0
    for shift in range(0, 70, 7):
        byte = handle.read(1)
        if not byte:
            return None
        value |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            return value
    return None


def _walk(handle: BinaryIO, end: int) -> Iterator[Field]:
    """The fields of the message in `handle` from its position to offset `end`, each yielded
    with the handle past it, up to the first that is not well formed."""
    while handle.tell() < end:
        tag = _varint(handle)
        if tag is None or tag >> 3 == 0:
            return
        number, wire = tag >> 3, tag & 7
        if wire == VARINT:
            if _varint(handle) is None:
                return
            yield Field(number, wire)
        elif wire in (I64, I32):
            width = 8 if wire == I64 else 4
            if handle.tell() + width > end:
                return
            handle.seek(width, io.SEEK_CUR)
            yield Field(number, wire)
        elif wire == LEN:
            length = _varint(handle)
            start = handle.tell()
            if length is None or start + length > end:
                return
            handle.seek(length, io.SEEK_CUR)
            yield Field(number, wire, start, length)
        else:  # groups (3, 4) are in none of these messages; 6 and 7 are no wire type
            return


def fields(handle: BinaryIO, end: int, max_fields: int = MAX_FIELDS) -> list[Field]:
    """The fields of the message in `handle` (from its position to offset `end`), up to
    the first that is not well formed (a damaged or foreign tail ends the list; a file that
    is no protobuf gives an empty one)."""
    return list(itertools.islice(_walk(handle, end), max_fields))


def broken_at(handle: BinaryIO, size: int) -> int | None:
    """The offset where the top-level fields of the message in `handle` (`size` bytes) stop
    being well formed (a truncated or damaged file); None when they run to its end."""
    handle.seek(0)
    good = 0
    for _field in _walk(handle, size):
        good = handle.tell()
    return None if good == size else good


def _within(found: list[Field], table: dict[int, int]) -> bool:
    return bool(found) and all(table.get(f.number) == f.wire for f in found)


def _body(handle: BinaryIO, field: Field) -> list[Field]:
    """The first fields of a length-delimited field's body, read as a message."""
    handle.seek(field.offset)
    return fields(handle, field.offset + field.length, max_fields=8)


def message_kind(handle: BinaryIO, size: int) -> str | None:
    """ONNX, SAVED_MODEL or GRAPH_DEF for the message in `handle` (`size` bytes), None when
    it is none of them (or no protobuf at all)."""
    handle.seek(0)
    top = fields(handle, size)
    first = next((f for f in top if f.number == 1), None)
    if _within(top, _SAVED_MODEL) and any(f.number == 2 for f in top):
        meta_graph = next(f for f in top if f.number == 2)
        if _within(_body(handle, meta_graph), _META_GRAPH):
            return SAVED_MODEL
    if _within(top, _GRAPH_DEF) and first is not None:
        node = _body(handle, first)
        if _within(node, _NODE_DEF) and node[0].number == 1:  # a NodeDef starts with its name
            return GRAPH_DEF
    if _within(top, _ONNX_MODEL) and any(f.number == 7 for f in top):
        return ONNX
    return None
