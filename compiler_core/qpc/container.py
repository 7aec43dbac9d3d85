"""The QPC container: the public segment layout, written in one streaming pass and read by mmap.

Layout (little-endian, documented in docs/qpc-format.md): a 40-byte header, a table of 32-byte
segment records, the NUL-terminated names back to back, then each segment's data aligned to 64
bytes. Constants can be gigabytes, so writing streams chunks straight to disk and reading maps
the file instead of copying it.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeAlias

from compiler_core.errors import CompileError

try:  # ISA-L's CRC-32: the same checksum as zlib's, 3-4x faster (CLMUL), ~1 ms to import
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - an environment installed before the dependency
    from zlib import crc32 as _crc32

if TYPE_CHECKING:
    from compiler_core.lowering.program import Program
    from compiler_core.qpc.networkdesc import NetworkDesc

QPC_MAGIC = 0x00A1CD7C
QPC_MAJOR = 0
QPC_MINOR = 1
COMPRESSION_ON_DISK = 1
HEADER_SIZE = 40
RECORD_SIZE = 32
DATA_ALIGNMENT = 64
CRC_SUFFIX = ".crc"
MAX_NAME_BYTES = 4096
QPC_FILE_NAME = "programqpc.bin"

_HEADER = struct.Struct("<IBBHQQQQ")
_RECORD = struct.Struct("<QQQQ")
_CRC = struct.Struct("<I")
_CRC_CHUNK = 64 << 20

Buffer: TypeAlias = bytes | bytearray | memoryview
SegmentData: TypeAlias = Buffer | Iterable[Any]
"""A buffer (bytes, memoryview, a contiguous numpy array...) or an iterable of buffers."""

QpcSource: TypeAlias = str | os.PathLike[str] | bytes | bytearray | memoryview


@dataclass(frozen=True)
class Segment:
    """One named segment to write. `offset_field` is the record's per-segment value; None
    means "the segment's size" (what constants.bin carries: everything is static)."""

    name: str
    data: SegmentData
    offset_field: int | None = 0


@dataclass(frozen=True)
class QpcHeader:
    magic: int
    major: int
    minor: int
    compression: int
    total_size: int
    base: int
    num_segments: int
    table_offset: int

    @property
    def version(self) -> str:
        return f"{self.major}.{self.minor}"


@dataclass(frozen=True)
class SegmentRecord:
    name: str
    size: int
    offset_field: int
    name_offset: int
    data_offset: int


def _invalid(message: str) -> CompileError:
    return CompileError("invalid_qpc", message)


# ------------------------------------------------------------------------------------ writing


def _chunks(data: SegmentData) -> Iterator[memoryview]:
    """Yield the segment's bytes as flat, contiguous byte views, never joining them."""
    if isinstance(data, str):
        raise TypeError("segment data must be bytes-like or an iterable of buffers, not str")
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        chunks: Iterable[Any] = data  # not a buffer, so an iterable of them
        for chunk in chunks:
            yield from _chunks(chunk)
        return
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    yield view.cast("B") if view.ndim != 1 or view.format != "B" else view


def _align(value: int) -> int:
    return -(-value // DATA_ALIGNMENT) * DATA_ALIGNMENT


def _check_names(segments: Sequence[Segment]) -> list[str]:
    names = [s.name for s in segments]
    all_names = names + [n + CRC_SUFFIX for n in names]
    for name in names:
        if not name or "\x00" in name:
            raise ValueError(f"segment name {name!r} is empty or contains NUL")
        if name.endswith(CRC_SUFFIX):
            raise ValueError(f"segment {name!r}: .crc segments are added by write_qpc")
    seen: set[str] = set()
    for name in all_names:
        if name in seen:
            raise ValueError(f"duplicate segment name {name!r}")
        seen.add(name)
    return all_names


def _write_stream(out: IO[bytes], segments: Sequence[Segment]) -> int:
    """Write the container to a seekable binary stream; returns the total size.

    The table is written last (sizes of streamed segments are only known once written), at
    a position reserved up front, so the whole file is one forward pass plus one seek.
    """
    all_names = _check_names(segments)
    count = len(all_names)
    encoded = [n.encode("utf-8") + b"\x00" for n in all_names]
    table_end = HEADER_SIZE + RECORD_SIZE * count
    name_offsets: list[int] = []
    pos = table_end
    for raw in encoded:
        name_offsets.append(pos)
        pos += len(raw)
    out.write(b"\x00" * table_end)
    out.write(b"".join(encoded))

    records: list[tuple[int, int, int, int]] = []
    crcs: list[int] = []
    for index, segment in enumerate(segments):
        start = _align(pos)
        out.write(b"\x00" * (start - pos))
        size, crc = 0, 0
        for chunk in _chunks(segment.data):
            out.write(chunk)
            crc = _crc32(chunk, crc)
            size += chunk.nbytes
        offset_field = size if segment.offset_field is None else segment.offset_field
        records.append((size, offset_field, name_offsets[index], start))
        crcs.append(crc)
        pos = start + size
    for index, crc in enumerate(crcs):
        start = _align(pos)
        out.write(b"\x00" * (start - pos) + _CRC.pack(crc))
        records.append((_CRC.size, 0, name_offsets[len(segments) + index], start))
        pos = start + _CRC.size

    out.seek(0)
    out.write(
        _HEADER.pack(
            QPC_MAGIC, QPC_MAJOR, QPC_MINOR, COMPRESSION_ON_DISK, pos, 0, count, HEADER_SIZE
        )
    )
    out.write(b"".join(_RECORD.pack(*r) for r in records))
    out.seek(pos)
    return pos


def write_qpc(path: str | os.PathLike[str], segments: Sequence[Segment]) -> int:
    """Write a QPC atomically (temp file in the same directory, then rename).

    Adds `<name>.crc` (zlib CRC32 of the data, u32 LE) for every segment. Deterministic: the
    same segments give a byte-identical file. Returns the total size in bytes. Readers never
    see a partial file; durability across a power cut is the blob store's job (it fsyncs what
    it keeps), so the compile itself does not wait for the disk, as the vendor tool does not.
    """
    target = Path(path)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            total = _write_stream(out, segments)
            out.flush()
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return total


def qpc_bytes(segments: Sequence[Segment]) -> bytes:
    """The container in memory: for small QPCs and tests."""
    import io

    buffer = io.BytesIO()
    _write_stream(buffer, segments)
    return buffer.getvalue()


# ------------------------------------------------------------------------------------ reading


def _read_name(view: memoryview, offset: int, index: int) -> str:
    if offset >= len(view):
        raise _invalid(f"segment {index}: name offset {offset} is beyond the file ({len(view)} B)")
    window = bytes(view[offset : offset + MAX_NAME_BYTES])
    end = window.find(b"\x00")
    if end < 0:
        raise _invalid(f"segment {index}: name at offset {offset} is not NUL-terminated")
    try:
        return window[:end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _invalid(f"segment {index}: name at offset {offset} is not UTF-8") from exc


def parse_header(view: memoryview) -> QpcHeader:
    if len(view) < HEADER_SIZE:
        raise _invalid(f"truncated header: {len(view)} bytes, a QPC header has {HEADER_SIZE}")
    header = QpcHeader(*_HEADER.unpack_from(view, 0))
    if header.magic != QPC_MAGIC:
        raise _invalid(f"bad magic 0x{header.magic:08X} (expected 0x{QPC_MAGIC:08X})")
    if (header.major, header.minor) != (QPC_MAJOR, QPC_MINOR):
        raise _invalid(f"unsupported container version {header.version} (expected 0.1)")
    if header.compression != COMPRESSION_ON_DISK:
        raise _invalid(f"unsupported compression type {header.compression} (expected 1)")
    if header.total_size != len(view):
        raise _invalid(
            f"total size mismatch: header says {header.total_size} bytes, file has {len(view)}"
        )
    return header


def parse_table(view: memoryview, header: QpcHeader) -> list[SegmentRecord]:
    """Read the segment table and check bounds, overlaps and duplicate names."""
    if header.num_segments < 2:
        raise _invalid(f"{header.num_segments} segments: a QPC has at least 2")
    table_end = header.table_offset + RECORD_SIZE * header.num_segments
    if header.table_offset < HEADER_SIZE or table_end > len(view):
        raise _invalid(
            f"segment table [{header.table_offset}, {table_end}) lies outside the file "
            f"({len(view)} B) or overlaps the header"
        )
    records: list[SegmentRecord] = []
    regions: list[tuple[int, int, str]] = [(0, HEADER_SIZE, "header")]
    regions.append((header.table_offset, table_end, "segment table"))
    seen: set[str] = set()
    for index in range(header.num_segments):
        size, offset_field, name_offset, data_offset = _RECORD.unpack_from(
            view, header.table_offset + RECORD_SIZE * index
        )
        name = _read_name(view, name_offset, index)
        if name in seen:
            raise _invalid(f"duplicate segment name {name!r}")
        seen.add(name)
        if data_offset + size > len(view):
            raise _invalid(
                f"segment {name!r}: data [{data_offset}, {data_offset + size}) is beyond the "
                f"file ({len(view)} B)"
            )
        regions.append((name_offset, name_offset + len(name.encode()) + 1, f"name of {name!r}"))
        if size:
            regions.append((data_offset, data_offset + size, f"data of {name!r}"))
        records.append(SegmentRecord(name, size, offset_field, name_offset, data_offset))
    regions.sort()
    for (_, end_a, what_a), (start_b, _, what_b) in zip(regions, regions[1:], strict=False):
        if start_b < end_a:
            raise _invalid(f"overlapping segments: {what_a} overlaps {what_b}")
    return records


MDP_META = "mdp_meta_info"
"""The segment naming a multi-device QPC's devices (compiler_core/mdp/build.py)."""


class Qpc:
    """A loaded QPC: header, records and zero-copy views of each segment's data.

    Views point into a read-only mmap of the file; `close()` (or the context manager) unmaps
    it. Views taken from `segments` must not be used after closing.
    """

    def __init__(self, view: memoryview, mapping: mmap.mmap | None, path: Path | None) -> None:
        self._view = view
        self._mmap = mapping
        self.path = path
        self.header = parse_header(view)
        self.records = parse_table(view, self.header)
        self.segments: dict[str, memoryview] = {
            r.name: view[r.data_offset : r.data_offset + r.size] for r in self.records
        }
        self.segment_offsets: dict[str, int] = {r.name: r.offset_field for r in self.records}
        self._programs: dict[str, Program] = {}
        self._network: NetworkDesc | None = None

    @property
    def total_size(self) -> int:
        return self.header.total_size

    @property
    def is_qpcfarm(self) -> bool:
        """Ours: has program.bin or a JSON network descriptor. Vendor QPCs have neither."""
        desc = self.segments.get("networkdesc.bin")
        return "program.bin" in self.segments or (desc is not None and desc[:1] == b"{")

    @property
    def network(self) -> NetworkDesc | None:
        """The parsed network descriptor; None for vendor (protobuf) QPCs or when absent.
        Raises CompileError('invalid_qpc') if ours and malformed."""
        from compiler_core.qpc.networkdesc import NetworkDesc

        desc = self.segments.get("networkdesc.bin")
        if desc is None or not self.is_qpcfarm:
            return None
        if self._network is None:
            self._network = NetworkDesc.from_bytes(desc)
        return self._network

    def program(self, segment: str = "program.bin") -> Program:
        """Decode a program segment (once): program.bin, or a specialization's
        program.<n>.bin; raises CompileError('invalid_program') if it is bad."""
        from compiler_core.lowering.program import decode_program

        if segment not in self._programs:
            if segment not in self.segments:
                raise _invalid(f"the QPC has no {segment} segment")
            self._programs[segment] = decode_program(self.segments[segment])
        return self._programs[segment]

    @property
    def mdp(self) -> dict[str, Any] | None:
        """A multi-device QPC's `mdp_meta_info` (the partition and each device's segment
        prefix), or None for a single-device one."""
        raw = self.segments.get(MDP_META)
        if raw is None:
            return None
        try:
            doc = json.loads(bytes(raw))
            devices = doc["devices"]
            assert isinstance(devices, list) and devices
            for d in devices:
                assert isinstance(d["prefix"], str) and isinstance(d["numCores"], int)
                assert isinstance(d["deviceId"], int)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise _invalid(f"{MDP_META} is malformed") from None
        return dict(doc)

    def device(self, index: int) -> Qpc:
        """Device `index`'s own QPC inside a multi-device one: its segments, prefix removed
        (a view: valid while this QPC is open)."""
        meta = self.mdp
        if meta is None or not 0 <= index < len(meta["devices"]):
            raise _invalid(f"the QPC has no device {index}")
        prefix = meta["devices"][index]["prefix"]
        sub = object.__new__(Qpc)
        sub._view, sub._mmap, sub.path, sub.header = memoryview(b""), None, self.path, self.header
        sub.records = [r for r in self.records if r.name.startswith(prefix)]
        sub.segments = {
            n[len(prefix) :]: v for n, v in self.segments.items() if n.startswith(prefix)
        }
        sub.segment_offsets = {
            n[len(prefix) :]: o for n, o in self.segment_offsets.items() if n.startswith(prefix)
        }
        sub._programs, sub._network = {}, None
        if "networkdesc.bin" not in sub.segments:
            raise _invalid(f"device {index} has no {prefix}networkdesc.bin")
        return sub

    def constants(self) -> list[ConstantEntry]:
        desc = self.segments.get("constantsdesc.bin")
        return [] if desc is None else decode_constantsdesc(desc)

    def checksum_problems(self) -> list[str]:
        """What is wrong with the `.crc` segments present (empty: all match)."""
        problems = []
        for name, view in self.segments.items():
            if not name.endswith(CRC_SUFFIX):
                continue
            target = name[: -len(CRC_SUFFIX)]
            if target not in self.segments:
                problems.append(f"{name} has no segment {target!r} to check")
            elif len(view) != _CRC.size:
                problems.append(f"{name} is {len(view)} bytes, a CRC32 has 4")
            else:
                (expected,) = _CRC.unpack(view)
                actual = crc32(self.segments[target])
                if actual != expected:
                    problems.append(
                        f"{target}: CRC32 0x{actual:08X} does not match {name} 0x{expected:08X}"
                    )
        return problems

    @property
    def file_view(self) -> memoryview:
        """The whole file's bytes (valid until `close()`)."""
        return self._view

    def close(self) -> None:
        for view in (*self.segments.values(), self._view):
            try:
                view.release()
            except BufferError:
                pass  # exported further (e.g. numpy); released when that is dropped
        self.segments = {}
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes when it is dropped
            self._mmap = None

    def __enter__(self) -> Qpc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def crc32(view: memoryview | bytes) -> int:
    """CRC32 of a (possibly huge, mmap-backed) buffer, in bounded steps."""
    view = memoryview(view)
    crc = 0
    for start in range(0, len(view), _CRC_CHUNK):
        crc = _crc32(view[start : start + _CRC_CHUNK], crc)
    return crc


def load_qpc(source: QpcSource, *, verify: bool = False) -> Qpc:
    """Open a QPC from a path or from bytes; structural errors raise CompileError('invalid_qpc').

    Files are memory-mapped read-only, so gigabytes of constants are never copied. With
    `verify`, every `.crc` segment present is checked too.
    """
    if isinstance(source, bytes | bytearray | memoryview):
        qpc = Qpc(memoryview(source).cast("B"), None, None)
    else:
        path = Path(source)
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size == 0:
                raise _invalid(f"truncated header: 0 bytes, a QPC header has {HEADER_SIZE}")
            mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        view = memoryview(mapping)
        try:
            qpc = Qpc(view, mapping, path)
        except BaseException:
            view.release()
            mapping.close()
            raise
    if verify:
        problems = qpc.checksum_problems()
        if problems:
            qpc.close()
            raise _invalid("checksum mismatch: " + "; ".join(problems))
    return qpc


# -------------------------------------------------------------------------- constantsdesc.bin


@dataclass(frozen=True)
class ConstantEntry:
    """Where one constant lives inside constants.bin."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    encoding: str | None = None
    """None: raw little-endian values; "mxfp6": see compiler_core/mxfp.py (dtype and shape
    are then the logical ones, nbytes the stored size)."""
    block_axis: int | None = None
    """The axis an encoded constant's blocks run along (MXFP6: the matmul's K axis)."""

    def to_dict(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }
        if self.encoding is not None:
            row["encoding"] = self.encoding
            row["block_axis"] = self.block_axis
        return row


def encode_constantsdesc(entries: Sequence[ConstantEntry | Mapping[str, Any]]) -> bytes:
    """constantsdesc.bin: a canonical JSON list of {name, dtype, shape, offset, nbytes}, plus
    {encoding, block_axis} for encoded constants."""
    rows = []
    for entry in entries:
        if isinstance(entry, ConstantEntry):
            rows.append(entry.to_dict())
        else:
            rows.append(_constant_from_json(dict(entry)).to_dict())
    return json.dumps(rows, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _constant_from_json(row: Any) -> ConstantEntry:
    if not isinstance(row, dict):
        raise _invalid(f"constantsdesc.bin entry is not an object: {row!r}")
    try:
        entry = ConstantEntry(
            name=str(row["name"]),
            dtype=str(row["dtype"]),
            shape=tuple(int(d) for d in row["shape"]),
            offset=int(row["offset"]),
            nbytes=int(row["nbytes"]),
            encoding=None if row.get("encoding") is None else str(row["encoding"]),
            block_axis=None if row.get("block_axis") is None else int(row["block_axis"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise _invalid(f"constantsdesc.bin entry is malformed: {exc!r}") from exc
    if entry.offset < 0 or entry.nbytes < 0 or any(d < 0 for d in entry.shape):
        raise _invalid(f"constantsdesc.bin entry {entry.name!r} has a negative field")
    return entry


def decode_constantsdesc(data: bytes | memoryview) -> list[ConstantEntry]:
    try:
        rows = json.loads(bytes(data))
    except ValueError as exc:
        raise _invalid(f"constantsdesc.bin is not JSON: {exc}") from exc
    if not isinstance(rows, list):
        raise _invalid("constantsdesc.bin is not a JSON list")
    return [_constant_from_json(row) for row in rows]
