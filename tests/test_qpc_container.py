"""The QPC container, its network descriptor, validate_qpc and inspect_qpc."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from compiler_core.errors import CompileError
from compiler_core.lowering.program import (
    DmaLoad,
    DmaStore,
    Instr,
    KernelDesc,
    Operand,
    Program,
    RunKernel,
    SemPost,
    SemWait,
    TensorDesc,
    encode_program,
)
from compiler_core.ops.registry import NodeInfo
from compiler_core.qpc import (
    ConstantEntry,
    IODesc,
    NetworkDesc,
    Requirements,
    Segment,
    SpecializationDesc,
    decode_constantsdesc,
    dtype_code,
    encode_constantsdesc,
    inspect_qpc,
    load_qpc,
    qpc_bytes,
    render_inspect,
    render_validation,
    validate_qpc,
    write_qpc,
)
from compiler_core.qpc.validate import SKIPPED_VENDOR

HEADER = struct.Struct("<IBBHQQQQ")
RECORD = struct.Struct("<QQQQ")


# ----------------------------------------------------------------------------------- builders


def relu_program(num_cores: int = 1, dtype: str = "float32") -> Program:
    """x -> Relu -> y, split by rows over `num_cores` cores; core 0 signals the others."""
    rows = 2 * num_cores
    shape = (rows, 4)
    nbytes = rows * 4 * np.dtype("float16" if dtype == "bfloat16" else dtype).itemsize
    tensors = [
        TensorDesc(0, "w", dtype, shape, "constant", 0, nbytes),
        TensorDesc(1, "x", dtype, shape, "input", nbytes, nbytes),
        TensorDesc(2, "y", dtype, shape, "output", 2 * nbytes, nbytes),
    ]
    info = NodeInfo("Relu", "relu0", {}, (shape,), (dtype,), (shape,), (dtype,))
    kernel = KernelDesc(
        id=0,
        name="relu0",
        info=info,
        inputs=(1,),
        outputs=(2,),
        epilogue=(),
        kernel="relu",
        unit="hvx",
        macs=rows * 4,
        nodes=("relu0",),
        op_types=("Relu",),
    )
    streams: list[list[Instr]] = []
    for core in range(num_cores):
        box = ((2 * core, 2 * core + 2), (0, 4))
        stream: list[Instr] = [
            DmaLoad(1, box, 0, box, 1 << core, 0),
            RunKernel(0, box, (Operand.at(0, box),), (Operand.at(64, box),)),
            DmaStore(2, box, 64, box, 0),
        ]
        if num_cores > 1:
            stream.append(SemPost(0) if core else SemWait(0, num_cores - 1))
        streams.append(stream)
    return Program(
        tensors=tensors,
        kernels=[kernel],
        streams=streams,
        num_semaphores=1,
        ddr_size=3 * nbytes,
        constants_size=nbytes,
        vtcm_used=[128] * num_cores,
        inputs=[1],
        outputs=[2],
    )


def network_for(program: Program, **changes: object) -> NetworkDesc:
    fields: dict[str, object] = dict(
        network_name="relu-net",
        compiler_version="0.1.0",
        options={"aic-num-cores": program.num_cores, "convert-to-fp16": False},
        hw_version="ai100",
        num_cores=program.num_cores,
        batch_size=1,
        inputs=(IODesc.from_tensor(program.tensors[1]),),
        outputs=(IODesc.from_tensor(program.tensors[2]),),
        requirements=Requirements.from_program(program),
        stats={"level": 0},
    )
    fields.update(changes)
    return NetworkDesc(**fields)  # type: ignore[arg-type]


def our_segments(
    program: Program | None = None, net: NetworkDesc | None = None, program_bin: bytes | None = None
) -> list[Segment]:
    program = program or relu_program()
    net = net or network_for(program)
    weights = np.arange(8, dtype=np.float32)
    return [
        Segment("networkdesc.bin", net.to_bytes()),
        Segment("program.bin", encode_program(program) if program_bin is None else program_bin),
        Segment("constants.bin", [weights], offset_field=None),
        Segment(
            "constantsdesc.bin",
            encode_constantsdesc([ConstantEntry("w", "float32", (8,), 0, weights.nbytes)]),
        ),
    ]


def hand_built_container(segments: list[tuple[str, bytes]]) -> bytes:
    """A container packed by hand the way a vendor tool might: no alignment, no CRCs."""
    names = b"".join(n.encode() + b"\0" for n, _ in segments)
    table_end = 40 + 32 * len(segments)
    pos = table_end + len(names)
    records, blobs, name_pos = [], [], table_end
    for name, data in segments:
        records.append(RECORD.pack(len(data), 0, name_pos, pos))
        blobs.append(data)
        name_pos += len(name) + 1
        pos += len(data)
    header = HEADER.pack(0x00A1CD7C, 0, 1, 1, pos, 0, len(segments), 40)
    return header + b"".join(records) + names + b"".join(blobs)


VENDOR_SEGMENTS = [
    ("network.elf", b"\x7fELF\x01\x01\x01" + bytes(range(40))),
    ("networkdesc.bin", b"\x08\x09\x12\x08resnet50\x18\x0e\x20\x01"),
    ("constants.bin", bytes(range(256)) * 3),
    ("constantsdesc.bin", b"\x0a\x04\x08\x00\x10\x01"),
]


def record_field(index: int, field: int) -> int:
    """Byte offset of field (0 size, 1 offset, 2 name offset, 3 data offset) of a record."""
    return 40 + 32 * index + 8 * field


def patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


# -------------------------------------------------------------------------- container layout


def test_round_trip_keeps_every_segment_its_bytes_and_its_offset_field() -> None:
    arrays: list[np.ndarray] = [np.arange(10, dtype=np.float32), np.ones((3, 5), dtype=np.int64)]
    segments = [
        Segment("a.bin", b"hello"),
        Segment("b.bin", memoryview(b"0123456789abcdef")[4:12], offset_field=7),
        Segment("constants.bin", arrays, offset_field=None),
        Segment("empty.bin", b""),
        Segment("gen.bin", (bytes([i]) * 100 for i in range(5))),
    ]
    with load_qpc(qpc_bytes(segments), verify=True) as qpc:
        assert bytes(qpc.segments["a.bin"]) == b"hello"
        assert bytes(qpc.segments["b.bin"]) == b"456789ab"
        assert bytes(qpc.segments["constants.bin"]) == b"".join(a.tobytes() for a in arrays)
        assert bytes(qpc.segments["empty.bin"]) == b""
        assert bytes(qpc.segments["gen.bin"]) == b"".join(bytes([i]) * 100 for i in range(5))
        assert qpc.segment_offsets["b.bin"] == 7
        assert qpc.segment_offsets["constants.bin"] == len(qpc.segments["constants.bin"])
        assert qpc.network is None


def test_every_segment_gets_a_crc_segment_holding_zlib_crc32() -> None:
    with load_qpc(qpc_bytes([Segment("a.bin", b"abc"), Segment("b.bin", b"")])) as qpc:
        assert sorted(qpc.segments) == ["a.bin", "a.bin.crc", "b.bin", "b.bin.crc"]
        assert bytes(qpc.segments["a.bin.crc"]) == struct.pack("<I", zlib.crc32(b"abc"))
        assert bytes(qpc.segments["b.bin.crc"]) == struct.pack("<I", 0)


def test_header_table_names_and_aligned_data_follow_the_public_layout() -> None:
    data = qpc_bytes([Segment("one", b"x" * 3), Segment("two", b"y" * 70)])
    magic, major, minor, compression, total, base, count, table = HEADER.unpack_from(data)
    assert (magic, major, minor, compression, base, table) == (0x00A1CD7C, 0, 1, 1, 0, 40)
    assert total == len(data) and count == 4
    records = [RECORD.unpack_from(data, 40 + 32 * i) for i in range(count)]
    names_start = 40 + 32 * count
    assert data[names_start:].startswith(b"one\0two\0one.crc\0two.crc\0")
    assert [r[2] for r in records] == [
        names_start,
        names_start + 4,
        names_start + 8,
        names_start + 16,
    ]
    for _size, _, _, data_offset in records:
        assert data_offset % 64 == 0
    assert data[records[1][3] : records[1][3] + 70] == b"y" * 70
    padding = data[records[0][3] + 3 : records[1][3]]
    assert padding == bytes(len(padding))


def test_writing_the_same_segments_twice_gives_byte_identical_files(tmp_path: Path) -> None:
    first, second = tmp_path / "a.qpc", tmp_path / "b.qpc"
    size = write_qpc(first, our_segments())
    write_qpc(second, our_segments())
    assert first.read_bytes() == second.read_bytes() == qpc_bytes(our_segments())
    assert size == first.stat().st_size


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "programqpc.bin"
    write_qpc(target, [Segment("a", b"old")])
    before = target.read_bytes()

    def failing() -> Iterator[bytes]:
        yield b"partial"
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        write_qpc(target, [Segment("a", failing())])
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["programqpc.bin"]


@pytest.mark.parametrize("names", [["a", "a"], ["a", "a.crc"], ["x.crc"], [""], ["bad\0name"]])
def test_write_rejects_names_that_would_collide_or_cannot_be_stored(names: list[str]) -> None:
    with pytest.raises(ValueError):
        qpc_bytes([Segment(n, b"1") for n in names])


def test_loaded_files_are_memory_mapped_not_copied(tmp_path: Path) -> None:
    path = tmp_path / "programqpc.bin"
    write_qpc(path, [Segment("constants.bin", np.zeros(1 << 16, np.float32))])
    qpc = load_qpc(path)
    import mmap

    assert isinstance(qpc.segments["constants.bin"].obj, mmap.mmap)
    qpc.close()
    assert qpc.segments == {}


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def test_a_chunked_multi_hundred_megabyte_segment_streams_to_disk(tmp_path: Path) -> None:
    chunk, count = 4 << 20, 64  # 256 MiB, never in memory at once
    samples: list[int] = []

    def chunks() -> Iterator[bytes]:
        for i in range(count):
            samples.append(_rss())
            yield bytes([i % 251]) * chunk

    baseline = _rss()
    path = tmp_path / "big.qpc"
    total = write_qpc(path, [Segment("constants.bin", chunks(), offset_field=None)])
    samples.append(_rss())
    assert total > chunk * count
    assert max(samples) - baseline < 64 << 20
    expected_crc = 0
    for i in range(count):
        expected_crc = zlib.crc32(bytes([i % 251]) * chunk, expected_crc)
    with load_qpc(path) as qpc:
        assert len(qpc.segments["constants.bin"]) == chunk * count
        assert bytes(qpc.segments["constants.bin.crc"]) == struct.pack("<I", expected_crc)


# ------------------------------------------------------------------------ structural damage


def _good() -> bytes:
    return qpc_bytes([Segment("a.bin", b"alpha" * 20), Segment("b.bin", b"beta" * 20)])


def _truncated_name() -> bytes:
    data = bytearray(patched(_good(), record_field(0, 2), "<Q", len(_good()) - 1))
    data[-1] = 0xFF
    return bytes(data)


CORRUPTIONS = {
    "bad magic": (lambda: patched(_good(), 0, "<I", 0xDEADBEEF), "bad magic 0xDEADBEEF"),
    "truncated header": (lambda: _good()[:20], "truncated header"),
    "truncated file": (lambda: _good()[:-10], "total size mismatch"),
    "version": (lambda: patched(_good(), 4, "<B", 3), "unsupported container version 3.1"),
    "table beyond file": (lambda: patched(_good(), 24, "<Q", 1000), "segment table"),
    "name out of range": (
        lambda: patched(_good(), record_field(1, 2), "<Q", 1 << 40),
        "name offset 1099511627776 is beyond the file",
    ),
    "unterminated name": (_truncated_name, "not NUL-terminated"),
    "data out of bounds": (
        lambda: patched(_good(), record_field(0, 0), "<Q", 1 << 20),
        "'a.bin': data [",
    ),
    "overlap": (
        lambda: patched(
            _good(),
            record_field(1, 3),
            "<Q",
            struct.unpack_from("<Q", _good(), record_field(0, 3))[0] + 8,
        ),
        "overlapping segments: data of 'a.bin' overlaps data of 'b.bin'",
    ),
    "duplicate names": (
        lambda: patched(
            _good(),
            record_field(1, 2),
            "<Q",
            struct.unpack_from("<Q", _good(), record_field(0, 2))[0],
        ),
        "duplicate segment name 'a.bin'",
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_structural_damage_is_an_invalid_qpc_error_naming_the_problem(case: str) -> None:
    make, fragment = CORRUPTIONS[case]
    with pytest.raises(CompileError) as info:
        load_qpc(make())
    assert info.value.code == "invalid_qpc"
    assert fragment in info.value.message


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_structural_damage_fails_the_container_check_without_raising(case: str) -> None:
    make, fragment = CORRUPTIONS[case]
    report = validate_qpc(make())
    assert not report.ok
    assert [(c.name, c.ok) for c in report.checks] == [("container", False)]
    assert fragment in report.checks[0].message
    assert render_validation(report).startswith("FAIL container: ")


def test_a_damaged_file_on_disk_fails_the_container_check(tmp_path: Path) -> None:
    path = tmp_path / "programqpc.bin"
    path.write_bytes(b"")
    assert "truncated header" in validate_qpc(path).check("container").message
    missing = validate_qpc(tmp_path / "nope.bin")
    assert not missing.ok and "cannot read" in missing.check("container").message


def test_a_flipped_data_byte_fails_the_checksum_naming_the_segment() -> None:
    data = bytearray(_good())
    offset = struct.unpack_from("<Q", data, record_field(1, 3))[0]
    data[offset] ^= 0x01
    with pytest.raises(CompileError, match="b.bin: CRC32"):
        load_qpc(bytes(data), verify=True)
    load_qpc(bytes(data)).close()  # without verify the layout alone is checked
    report = validate_qpc(bytes(data))
    assert report.check("container").ok
    check = report.check("checksums")
    assert not check.ok and check.message.startswith("b.bin: CRC32")


# ---------------------------------------------------------------------------- vendor QPCs


def test_a_vendor_qpc_loads_at_container_level() -> None:
    data = hand_built_container(VENDOR_SEGMENTS)
    with load_qpc(data, verify=True) as qpc:
        assert not qpc.is_qpcfarm
        assert qpc.network is None
        assert {n: bytes(v) for n, v in qpc.segments.items()} == dict(VENDOR_SEGMENTS)


def test_a_vendor_qpc_passes_container_checks_and_skips_ours() -> None:
    report = validate_qpc(hand_built_container(VENDOR_SEGMENTS), device="aic100-standard")
    assert report.ok
    by_name = {c.name: c for c in report.checks}
    for name in ("container", "checksums", "required-segments"):
        assert by_name[name].ok and by_name[name].message != SKIPPED_VENDOR
    skipped = [c.name for c in report.checks if c.message == SKIPPED_VENDOR]
    assert "program-decodes" in skipped and "device-cores" in skipped
    assert "not a qpcfarm QPC: skipped" in render_validation(report)


def test_a_vendor_qpc_without_network_elf_fails_required_segments() -> None:
    report = validate_qpc(hand_built_container(VENDOR_SEGMENTS[1:]))
    check = report.check("required-segments")
    assert not report.ok and not check.ok and "network.elf" in check.message


def test_constants_without_constantsdesc_fails_required_segments() -> None:
    report = validate_qpc(hand_built_container(VENDOR_SEGMENTS[:3]))
    assert "come together" in report.check("required-segments").message


def test_a_container_with_one_segment_is_invalid() -> None:
    with pytest.raises(CompileError, match="at least 2"):
        load_qpc(hand_built_container(VENDOR_SEGMENTS[:1]))


def test_vendor_crc_segments_are_checked_when_present() -> None:
    elf = VENDOR_SEGMENTS[0][1]
    good = hand_built_container(
        [*VENDOR_SEGMENTS, ("network.elf.crc", struct.pack("<I", zlib.crc32(elf)))]
    )
    assert validate_qpc(good).check("checksums").message == "1 checksum match"
    bad = hand_built_container([*VENDOR_SEGMENTS, ("network.elf.crc", b"\0\0\0\0")])
    assert "network.elf: CRC32" in validate_qpc(bad).check("checksums").message


# ------------------------------------------------------------------------- our QPCs: checks


def test_a_well_formed_qpc_passes_every_check() -> None:
    report = validate_qpc(qpc_bytes(our_segments()), device="aic100-standard")
    assert report.ok, render_validation(report)
    assert [c.name for c in report.checks] == [
        "container",
        "checksums",
        "required-segments",
        "container-fields",
        "network-descriptor",
        "program-decodes",
        "constants-descriptor",
        "device-hw-version",
        "device-cores",
        "device-vtcm",
        "device-ddr",
        "device-dtypes",
        "device-instances",
    ]
    assert report.device == "aic100-standard"
    assert json.loads(json.dumps(report.to_dict()))["ok"] is True


def test_every_byte_of_our_qpc_no_checksum_covers_is_checked_by_validation() -> None:
    """The header's base, each record's per-segment value and the zero padding are outside
    every CRC: a change to any of them is a failing check, not a valid QPC."""
    good = qpc_bytes(our_segments())
    assert validate_qpc(good).ok
    accepted = []
    for offset in range(len(good)):
        damaged = bytearray(good)
        damaged[offset] ^= 0x5A
        if validate_qpc(bytes(damaged)).ok:
            accepted.append(offset)
    assert accepted == []
    base = bytearray(good)
    struct.pack_into("<Q", base, 16, 7)
    check = validate_qpc(bytes(base)).check("container-fields")
    assert not check.ok and "header base is 7" in check.message


def test_validate_reads_a_path_and_loaded_qpcs(tmp_path: Path) -> None:
    path = tmp_path / "programqpc.bin"
    write_qpc(path, our_segments(relu_program(num_cores=4)))
    assert validate_qpc(path).ok
    assert validate_qpc(str(path)).ok
    with load_qpc(path) as qpc:
        assert validate_qpc(qpc).ok
        assert qpc.segments  # validating a loaded QPC does not close it


def test_missing_program_segment_fails_required_segments() -> None:
    segments = [s for s in our_segments() if s.name != "program.bin"]
    report = validate_qpc(qpc_bytes(segments))
    assert "missing program.bin" in report.check("required-segments").message
    assert not report.check("program-decodes").ok


def test_a_program_that_does_not_decode_fails_program_decodes() -> None:
    bad = encode_program(relu_program())[:-3]
    report = validate_qpc(qpc_bytes(our_segments(program_bin=bad)))
    check = report.check("program-decodes")
    assert report.check("checksums").ok and not check.ok
    assert "truncated" in check.message


def test_a_kernel_run_that_drops_a_stored_output_fails_program_decodes() -> None:
    """Only an output the kernel table marks unnamed (-1) may have no operand."""
    program = relu_program()
    stream = list(program.streams[0])
    at = next(i for i, instr in enumerate(stream) if isinstance(instr, RunKernel))
    stream[at] = dataclasses.replace(stream[at], outputs=(None,))
    tampered = dataclasses.replace(program, streams=[stream, *program.streams[1:]])
    check = validate_qpc(qpc_bytes(our_segments(program_bin=encode_program(tampered))))
    assert not check.check("program-decodes").ok
    assert "output operands" in check.check("program-decodes").message


def test_cores_in_program_must_match_the_network_descriptor() -> None:
    program = relu_program(num_cores=2)
    net = network_for(program, num_cores=3)
    check = validate_qpc(qpc_bytes(our_segments(program, net))).check("program-decodes")
    assert not check.ok and "program has 2 cores, networkdesc says 3" in check.message


def test_requirements_may_not_understate_what_the_program_uses() -> None:
    program = relu_program()
    req = Requirements.from_program(program)
    low = Requirements(req.num_cores, 64, req.ddr_bytes - 1, req.dtypes)
    check = validate_qpc(qpc_bytes(our_segments(program, network_for(program, requirements=low))))
    message = check.check("program-decodes").message
    assert "128 B of VTCM" in message and "of DDR" in message


def test_a_bad_network_descriptor_fails_its_check_and_the_device_checks() -> None:
    segments = our_segments()
    segments[0] = Segment("networkdesc.bin", b'{"format": "qpcfarm-networkdesc", "version": 1}')
    report = validate_qpc(qpc_bytes(segments), device="aic100-pro")
    assert "missing field" in report.check("network-descriptor").message
    assert report.check("program-decodes").ok  # decodes on its own
    assert not report.check("device-cores").ok


def test_a_network_without_inputs_fails_the_descriptor_check() -> None:
    program = relu_program()
    report = validate_qpc(qpc_bytes(our_segments(program, network_for(program, inputs=()))))
    assert "no inputs" in report.check("network-descriptor").message


def test_a_missing_crc_segment_fails_checksums_for_our_qpcs() -> None:
    with load_qpc(qpc_bytes(our_segments())) as qpc:
        segments = {n: bytes(v) for n, v in qpc.segments.items() if n != "program.bin.crc"}
    report = validate_qpc(hand_built_container(list(segments.items())))
    assert "program.bin has no program.bin.crc" in report.check("checksums").message


def test_a_constant_beyond_constants_bin_fails_the_constants_check() -> None:
    segments = our_segments()
    segments[3] = Segment(
        "constantsdesc.bin", encode_constantsdesc([ConstantEntry("w", "float32", (9,), 0, 36)])
    )
    check = validate_qpc(qpc_bytes(segments)).check("constants-descriptor")
    assert not check.ok and "beyond constants.bin (32 B)" in check.message


# ---------------------------------------------------------------------------- device checks


def test_bfloat16_needs_ai200_class_hardware() -> None:
    program = relu_program(dtype="bfloat16")
    qpc = qpc_bytes(our_segments(program))
    on_ai100 = validate_qpc(qpc, device="aic100-pro")
    assert "does not support bfloat16" in on_ai100.check("device-dtypes").message
    net = network_for(program, hw_version="ai200")
    assert validate_qpc(qpc_bytes(our_segments(program, net)), device="aic200").ok


def test_a_qpc_for_more_cores_than_the_device_has_fails_device_cores() -> None:
    qpc = qpc_bytes(our_segments(relu_program(num_cores=16)))
    assert validate_qpc(qpc, device="aic100-pro").ok
    check = validate_qpc(qpc, device="aic100-standard").check("device-cores")
    assert not check.ok and "needs 16 NSP cores" in check.message and "has 14" in check.message


def test_vtcm_ddr_and_hardware_version_are_compared_with_the_device() -> None:
    program = relu_program()
    req = Requirements.from_program(program)
    huge = Requirements(req.num_cores, 9 << 20, 40 << 30, req.dtypes)
    net = network_for(program, requirements=huge, hw_version="ai200")
    report = validate_qpc(qpc_bytes(our_segments(program, net)), device="aic100-pro")
    failed = {c.name for c in report.checks if not c.ok}
    assert failed == {"device-hw-version", "device-vtcm", "device-ddr", "device-instances"}


def test_an_unknown_device_is_an_error_not_a_failed_check() -> None:
    with pytest.raises(CompileError) as info:
        validate_qpc(qpc_bytes(our_segments()), device="nonexistent-card")
    assert info.value.code == "unknown_device"


# ------------------------------------------------------------------------ network descriptor


def test_network_descriptor_round_trips_through_canonical_json() -> None:
    program = relu_program(num_cores=2)
    io = (IODesc.from_tensor(program.tensors[1]),), (IODesc.from_tensor(program.tensors[2]),)
    spec = SpecializationDesc("bs4", {"batch_size": 4}, "program.1.bin", "statsdesc.1.bin", *io)
    net = network_for(program, specializations=(spec,))
    data = net.to_bytes()
    assert NetworkDesc.from_bytes(data) == net
    doc = json.loads(data)
    assert data == json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    assert doc["format"] == "qpcfarm-networkdesc" and doc["version"] == 1
    assert doc["requirements"]["dtypes"] == ["float32"]


def test_a_loaded_qpc_exposes_its_network_and_program() -> None:
    program = relu_program(num_cores=2)
    with load_qpc(qpc_bytes(our_segments(program))) as qpc:
        assert qpc.is_qpcfarm
        assert qpc.network == network_for(program)
        assert qpc.program().streams == program.streams
        assert qpc.program() is qpc.program()
        assert qpc.constants() == [ConstantEntry("w", "float32", (8,), 0, 32)]


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"\x08\x01", "not JSON"),
        (b"[]", "not a JSON object"),
        (b'{"format": "other", "version": 1}', "format is 'other'"),
        (b'{"format": "qpcfarm-networkdesc", "version": 2}', "version 2"),
    ],
)
def test_a_malformed_network_descriptor_is_invalid_qpc(data: bytes, fragment: str) -> None:
    with pytest.raises(CompileError) as info:
        NetworkDesc.from_bytes(data)
    assert info.value.code == "invalid_qpc" and fragment in info.value.message


def test_a_wrongly_typed_field_is_named() -> None:
    doc = network_for(relu_program()).to_dict()
    doc["num_cores"] = "4"
    with pytest.raises(CompileError, match="'num_cores' should be int, found str"):
        NetworkDesc.from_dict(doc)


def test_dtype_codes_follow_the_vendor_numbering_and_ours_start_at_100() -> None:
    vendor = ["float32", "float16", "int8q", "uint8q", "int16q", "int32q", "int32", "int64", "int8"]
    assert [dtype_code(d) for d in vendor] == list(range(9))
    assert dtype_code("bfloat16") >= 100 and dtype_code("bool") >= 100
    with pytest.raises(CompileError) as info:
        dtype_code("complex64")
    assert info.value.code == "unsupported_dtype"


def test_io_layout_is_nchw_for_rank_4_and_nd_otherwise() -> None:
    image = TensorDesc(5, "img", "float16", (1, 3, 8, 8), "input", 0, 384)
    assert IODesc.from_tensor(image).layout == "NCHW"
    assert IODesc.from_tensor(image).dtype_code == 1
    assert IODesc.from_tensor(relu_program().tensors[1]).layout == "ND"


def test_requirements_come_from_the_program() -> None:
    req = Requirements.from_program(relu_program(num_cores=3), retained_state=("kv",))
    assert req == Requirements(3, 128, 3 * 6 * 4 * 4, ("float32",), ("kv",))


# ------------------------------------------------------------------------- constantsdesc.bin


def test_constantsdesc_round_trips_and_accepts_plain_dicts() -> None:
    entries = [ConstantEntry("w", "float16", (2, 3), 0, 12), ConstantEntry("b", "int64", (), 64, 8)]
    data = encode_constantsdesc(entries)
    assert decode_constantsdesc(data) == entries
    assert encode_constantsdesc([e.to_dict() for e in entries]) == data


@pytest.mark.parametrize(
    "data",
    [
        b"nope",
        b"{}",
        b'[{"name": "w"}]',
        b'[{"name":"w","dtype":"f","shape":[],"offset":-1,"nbytes":0}]',
    ],
)
def test_a_malformed_constantsdesc_is_invalid_qpc(data: bytes) -> None:
    with pytest.raises(CompileError) as info:
        decode_constantsdesc(data)
    assert info.value.code == "invalid_qpc"


# -------------------------------------------------------------------------------- inspect


def test_inspect_summarises_network_program_and_segments() -> None:
    summary = inspect_qpc(qpc_bytes(our_segments(relu_program(num_cores=2))))
    assert summary["format"] == "qpcfarm" and summary["version"] == "0.1"
    assert summary["network_name"] == "relu-net" and summary["num_cores"] == 2
    assert [io["name"] for io in summary["inputs"]] == ["x"]
    assert summary["constants_size"] == 32 and summary["constants_count"] == 1
    program = summary["program"]
    assert program["kernel_count"] == 1 and program["op_type_counts"] == {"Relu": 1}
    assert [c["total"] for c in program["instructions_per_core"]] == [4, 4]
    assert program["instructions_per_core"][1]["sem_post"] == 1
    constants = next(s for s in summary["segments"] if s["name"] == "constants.bin")
    assert constants["offset"] == constants["size"] == 32
    json.dumps(summary)
    text = render_inspect(summary)
    assert "Network: relu-net" in text and "Relu 1" in text and "core  1: 4 instructions" in text


def test_inspect_of_a_vendor_qpc_lists_segments_only() -> None:
    summary = inspect_qpc(hand_built_container(VENDOR_SEGMENTS))
    assert summary["format"] == "vendor" and "network_name" not in summary
    assert [s["name"] for s in summary["segments"]] == [n for n, _ in VENDOR_SEGMENTS]
    assert "network.elf" in render_inspect(summary)


def test_inspect_reports_a_program_that_does_not_decode() -> None:
    summary = inspect_qpc(qpc_bytes(our_segments(program_bin=b"QPRG")))
    assert "truncated" in summary["program_error"]
    assert "does not decode" in render_inspect(summary)


def test_inspect_raises_for_a_broken_container(tmp_path: Path) -> None:
    path = tmp_path / "bad.qpc"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(CompileError) as info:
        inspect_qpc(os.fspath(path))
    assert info.value.code == "invalid_qpc"
