"""`validate_qpc`: container integrity, our segments, and fit on a device; one check per line.

A bad file never raises: each problem is a failing check that says what is wrong. Vendor QPCs
are checked at container level (layout, checksums, required segments); the checks that read
our own segment encodings are reported as skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from compiler_core.errors import CompileError
from compiler_core.qpc.container import (
    CRC_SUFFIX,
    HEADER_SIZE,
    MDP_META,
    RECORD_SIZE,
    ConstantEntry,
    Qpc,
    QpcSource,
    load_qpc,
)

if TYPE_CHECKING:
    from compiler_core.devices import DeviceProfile
    from compiler_core.lowering.program import Program
    from compiler_core.qpc.networkdesc import NetworkDesc, SpecializationDesc

SKIPPED_VENDOR = "not a qpcfarm QPC: skipped"


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "message": self.message}


@dataclass
class ValidationReport:
    ok: bool
    checks: list[Check] = field(default_factory=list)
    device: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "device": self.device,
            "checks": [c.to_dict() for c in self.checks],
        }

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)


class _Checks:
    """Collects checks; a check function returns its message or raises _Fail."""

    def __init__(self) -> None:
        self.checks: list[Check] = []

    def run(self, name: str, body: Callable[[], str]) -> bool:
        try:
            message = body()
        except _Fail as fail:
            self.checks.append(Check(name, False, str(fail)))
            return False
        except CompileError as exc:
            self.checks.append(Check(name, False, exc.message))
            return False
        self.checks.append(Check(name, True, message))
        return True

    def skip(self, name: str, message: str) -> None:
        self.checks.append(Check(name, True, message))


class _Fail(Exception):
    pass


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


# --------------------------------------------------------------------------- container checks


def _checksums(qpc: Qpc) -> str:
    problems = qpc.checksum_problems()
    crcs = [n for n in qpc.segments if n.endswith(CRC_SUFFIX)]
    if qpc.is_qpcfarm:
        missing = [
            n
            for n in qpc.segments
            if not n.endswith(CRC_SUFFIX) and n + CRC_SUFFIX not in qpc.segments
        ]
        problems += [f"{n} has no {n}{CRC_SUFFIX} segment" for n in missing]
    if problems:
        raise _Fail("; ".join(problems))
    if not crcs:
        return "no checksum segments (optional in vendor QPCs)"
    return f"{_plural(len(crcs), 'checksum')} match"


def _container_fields(qpc: Qpc) -> str:
    """The header and record fields no checksum covers hold what qpcfarm writes (a QPC whose
    `base` or a record's per-segment value was changed is tampered, not valid)."""
    problems = []
    if qpc.header.base != 0:
        problems.append(f"header base is {qpc.header.base}, qpcfarm writes 0")
    for record in qpc.records:
        constants = record.name.rsplit("/", 1)[-1] == "constants.bin"
        expected = record.size if constants else 0
        if record.offset_field != expected:
            problems.append(
                f"segment {record.name!r}: per-segment value {record.offset_field}, qpcfarm "
                f"writes {expected}"
                + (" (its size: all constants are static)" if constants else "")
            )
    problems += _nonzero_padding(qpc)
    if problems:
        raise _Fail("; ".join(problems[:4]) + ("; ..." if len(problems) > 4 else ""))
    return (
        f"header, {_plural(len(qpc.records), 'segment record')} and padding as qpcfarm writes them"
    )


def _nonzero_padding(qpc: Qpc) -> list[str]:
    """Bytes outside the header, table, names and data are padding, written as zeros."""
    view = qpc.file_view
    regions = [
        (0, HEADER_SIZE),
        (qpc.header.table_offset, qpc.header.table_offset + RECORD_SIZE * len(qpc.records)),
    ]
    for record in qpc.records:
        regions.append((record.name_offset, record.name_offset + len(record.name.encode()) + 1))
        regions.append((record.data_offset, record.data_offset + record.size))
    regions.sort()
    problems = []
    position = 0
    for start, end in [*regions, (len(view), len(view))]:
        if start > position and any(view[position:start]):
            problems.append(f"non-zero padding in bytes [{position}, {start})")
        position = max(position, end)
    return problems


def _required_segments(qpc: Qpc) -> str:
    names = set(qpc.segments)
    mdp = qpc.mdp if qpc.is_qpcfarm else None
    if mdp is not None:
        required = ["networkdesc.bin", MDP_META] + [
            d["prefix"] + name
            for d in mdp["devices"]
            for name in ("networkdesc.bin", "program.bin", "constants.bin", "constantsdesc.bin")
        ]
        missing = [n for n in required if n not in names]
        if missing:
            raise _Fail(f"missing {', '.join(missing)}")
        return (
            f"networkdesc.bin, {MDP_META} and every device's networkdesc, program and "
            f"constants present ({_plural(len(mdp['devices']), 'device')})"
        )
    required = (
        ["networkdesc.bin", "program.bin"]
        if qpc.is_qpcfarm
        else [
            "network.elf",
            "networkdesc.bin",
        ]
    )
    missing = [n for n in required if n not in names]
    if missing:
        raise _Fail(f"missing {', '.join(missing)}")
    if ("constants.bin" in names) != ("constantsdesc.bin" in names):
        present = "constants.bin" if "constants.bin" in names else "constantsdesc.bin"
        raise _Fail(
            f"{present} present without its partner (constants.bin and "
            "constantsdesc.bin come together)"
        )
    return f"{', '.join(required)} present" + (
        "; constants.bin with constantsdesc.bin" if "constants.bin" in names else ""
    )


# --------------------------------------------------------------------------------- our checks


def _network_descriptor(qpc: Qpc) -> str:
    net = qpc.network
    if net is None:
        raise _Fail("no networkdesc.bin segment")
    if not net.inputs or not net.outputs:
        raise _Fail(f"network {net.network_name!r} declares no inputs or no outputs")
    if net.num_cores < 1 or net.batch_size < 1:
        raise _Fail(f"num_cores {net.num_cores} and batch_size {net.batch_size} must be >= 1")
    return (
        f"network {net.network_name!r}: {_plural(len(net.inputs), 'input')}, "
        f"{_plural(len(net.outputs), 'output')}, {_plural(net.num_cores, 'core')}, "
        f"batch {net.batch_size}, compiler {net.compiler_version}"
    )


def _program_decodes(qpc: Qpc, net: NetworkDesc | None) -> str:
    """Every program decodes (each specialization's) and fits what the descriptor says."""
    if net is None:
        return _program_summary(qpc.program())
    programs = net.programs()
    problems: list[str] = []
    summaries: list[str] = []
    for spec in programs:
        program = qpc.program(spec.program)
        label = f"{spec.program}: " if len(programs) > 1 else ""
        summaries.append(label + _program_summary(program))
        problems += [label + p for p in _program_problems(program, spec, net)]
    if problems:
        raise _Fail("; ".join(problems))
    if len(programs) > 1:
        names = ", ".join(s.name for s in programs)
        return f"{_plural(len(programs), 'specialization')} ({names}): " + "; ".join(summaries)
    return summaries[0]


def _program_summary(program: Program) -> str:
    instructions = sum(len(s) for s in program.streams)
    return (
        f"{_plural(len(program.kernels), 'kernel')}, {_plural(instructions, 'instruction')} "
        f"on {_plural(program.num_cores, 'core')}"
    )


def _program_problems(program: Program, spec: SpecializationDesc, net: NetworkDesc) -> list[str]:
    problems = []
    if program.num_cores != net.num_cores:
        problems.append(f"program has {program.num_cores} cores, networkdesc says {net.num_cores}")
    if len(program.inputs) != len(spec.inputs) or len(program.outputs) != len(spec.outputs):
        problems.append(
            f"program has {len(program.inputs)} inputs / {len(program.outputs)} outputs, "
            f"networkdesc {len(spec.inputs)} / {len(spec.outputs)}"
        )
    else:
        ports = (*program.inputs, *program.outputs)
        for tid, io in zip(ports, (*spec.inputs, *spec.outputs), strict=True):
            t = program.tensors[tid] if 0 <= tid < len(program.tensors) else None
            if t is None or (t.name, t.dtype, tuple(t.shape)) != (io.name, io.dtype, io.dims):
                problems.append(f"program I/O does not match networkdesc entry {io.name!r}")
                break
    req = net.requirements
    if max(program.vtcm_used, default=0) > req.vtcm_bytes_per_core:
        problems.append(
            f"program uses {max(program.vtcm_used)} B of VTCM, networkdesc requires only "
            f"{req.vtcm_bytes_per_core}"
        )
    if program.ddr_size > req.ddr_bytes:
        problems.append(
            f"program uses {program.ddr_size} B of DDR, networkdesc requires only {req.ddr_bytes}"
        )
    return problems


def _constants_descriptor(qpc: Qpc) -> str:
    if "constantsdesc.bin" not in qpc.segments:
        return "no constants"
    entries = qpc.constants()
    size = len(qpc.segments.get("constants.bin", b""))
    for entry in entries:
        if entry.offset + entry.nbytes > size:
            raise _Fail(
                f"constant {entry.name!r} [{entry.offset}, {entry.offset + entry.nbytes}) lies "
                f"beyond constants.bin ({size} B)"
            )
        if entry.encoding is not None:
            _encoded_constant(entry)
    split = qpc.segment_offsets.get("constants.bin", 0)
    if split > size:
        raise _Fail(f"constants.bin static/dynamic split {split} is beyond its size {size}")
    return f"{_plural(len(entries), 'constant')} in {size} B"


def _encoded_constant(entry: ConstantEntry) -> None:
    from compiler_core.mxfp import FLOAT_DTYPES, MXFP6, mxfp6_nbytes

    if entry.encoding != MXFP6:
        raise _Fail(f"constant {entry.name!r} has unknown encoding {entry.encoding!r}")
    rank = len(entry.shape)
    axis = entry.block_axis
    if axis is None or not 0 <= axis < rank or entry.dtype not in FLOAT_DTYPES:
        raise _Fail(
            f"MXFP6 constant {entry.name!r} needs a float16/float32 dtype and a block axis "
            f"within its rank {rank} (dtype {entry.dtype}, block_axis {axis})"
        )
    expected = mxfp6_nbytes(entry.shape, axis)
    if entry.nbytes != expected:
        raise _Fail(
            f"MXFP6 constant {entry.name!r} of shape {list(entry.shape)} blocked along axis "
            f"{axis} takes {expected} B (25 B per 32-element block), constantsdesc says "
            f"{entry.nbytes} B"
        )


# ------------------------------------------------------------------------------ device checks


def _device_checks(
    checks: _Checks, net: NetworkDesc, device: DeviceProfile, mdp: dict[str, Any] | None = None
) -> None:
    from compiler_core.devices import canonical_hw_version

    req = net.requirements
    cores = getattr(device, "cores_per_soc", device.num_cores)
    ddr = getattr(device, "ddr_bytes_per_soc", device.ddr_bytes)

    def hw_version() -> str:
        wanted = canonical_hw_version(net.hw_version)
        if wanted != device.hw_version:
            raise _Fail(f"compiled for {wanted}, {device.display_name} is {device.hw_version}")
        return f"{wanted} matches {device.display_name}"

    def within(need: int, have: int, unit: str) -> Callable[[], str]:
        def body() -> str:
            text = f"needs {need:,} {unit}, {device.display_name} has {have:,}"
            if need > have:
                raise _Fail(f"{text} ({need - have:,} too many)")
            return text

        return body

    def dtypes() -> str:
        missing = sorted(set(req.dtypes) - set(device.dtypes))
        if missing:
            hint = " (bfloat16 needs ai200-class hardware)" if "bfloat16" in missing else ""
            raise _Fail(f"{device.display_name} does not support {', '.join(missing)}{hint}")
        return f"{', '.join(req.dtypes) or 'no types'} supported"

    checks.run("device-hw-version", hw_version)
    checks.run("device-cores", within(req.num_cores, cores, "NSP cores"))
    checks.run(
        "device-vtcm",
        within(req.vtcm_bytes_per_core, device.vtcm_bytes_per_core, "bytes of VTCM per core"),
    )
    checks.run("device-ddr", within(req.ddr_bytes, ddr, "bytes of DDR"))
    checks.run("device-dtypes", dtypes)
    checks.run("device-instances", lambda: _instances(req.num_cores, req.ddr_bytes, device, mdp))


def _instances(
    num_cores: int, ddr_bytes: int, device: DeviceProfile, mdp: dict[str, Any] | None
) -> str:
    """How many copies of the QPC one card runs at once: on each SoC as many as its cores
    and its DDR both hold (a partitioned QPC: one per group of its SoCs)."""
    if mdp is not None:
        width = len(mdp["devices"])
        copies = device.socs // width
        noun = "copy" if copies == 1 else "copies"
        text = f"an {device.display_name} card holds {copies} {noun} over {width} SoCs"
        if copies < 1:
            raise _Fail(text)
        return text
    by_cores = device.cores_per_soc // max(1, num_cores)
    by_ddr = device.ddr_bytes_per_soc // max(1, ddr_bytes)
    per_soc = min(by_cores, by_ddr)
    text = (
        f"an {device.display_name} card holds {_plural(per_soc * device.socs, 'instance')}: "
        f"{per_soc} per SoC (by cores {by_cores}, by DDR {by_ddr}) x {_plural(device.socs, 'SoC')}"
    )
    if per_soc < 1:
        raise _Fail(text)
    return text


DEVICE_CHECKS = (
    "device-hw-version", "device-cores", "device-vtcm", "device-ddr", "device-dtypes",
    "device-instances",
)  # fmt: skip
OUR_CHECKS = ("network-descriptor", "program-decodes", "constants-descriptor")


# -------------------------------------------------------------------------------------- entry


def validate_qpc(source: QpcSource | Qpc, device: str | None = None) -> ValidationReport:
    """Check a QPC (path, bytes or loaded Qpc), optionally against a device profile.

    An unknown device name raises CompileError('unknown_device'); a bad file does not raise.
    """
    profile = None
    if device is not None:
        from compiler_core.devices import get_device

        profile = get_device(device)
    checks = _Checks()
    report = ValidationReport(
        ok=False, checks=checks.checks, device=profile.name if profile else None
    )

    loaded: list[Qpc] = []

    def container() -> str:
        qpc = source if isinstance(source, Qpc) else load_qpc(source)
        loaded.append(qpc)
        kind = "qpcfarm" if qpc.is_qpcfarm else "vendor"
        return (
            f"{kind} QPC, version {qpc.header.version}, {_plural(len(qpc.segments), 'segment')}, "
            f"{qpc.total_size:,} bytes"
        )

    def container_or_unreadable() -> str:
        try:
            return container()
        except OSError as exc:
            raise _Fail(f"cannot read the QPC: {exc}") from exc

    if not checks.run("container", container_or_unreadable):
        return report
    qpc = loaded[0]
    try:
        _validate_loaded(checks, qpc, profile)
    finally:
        if not isinstance(source, Qpc):
            qpc.close()
    report.ok = all(c.ok for c in checks.checks)
    return report


def _validate_loaded(checks: _Checks, qpc: Qpc, profile: DeviceProfile | None) -> None:
    checks.run("checksums", lambda: _checksums(qpc))
    checks.run("required-segments", lambda: _required_segments(qpc))
    if not qpc.is_qpcfarm:
        checks.skip("container-fields", SKIPPED_VENDOR)
        for name in OUR_CHECKS + (DEVICE_CHECKS if profile else ()):
            checks.skip(name, SKIPPED_VENDOR)
        return
    checks.run("container-fields", lambda: _container_fields(qpc))
    net_ok = checks.run("network-descriptor", lambda: _network_descriptor(qpc))
    net = qpc.network if net_ok else None
    if MDP_META in qpc.segments and not checks.run("partition", lambda: _partition(qpc)):
        return
    mdp = qpc.mdp
    if mdp is None:
        checks.run("program-decodes", lambda: _program_decodes(qpc, net))
        checks.run("constants-descriptor", lambda: _constants_descriptor(qpc))
    else:
        for index in range(len(mdp["devices"])):
            device = qpc.device(index)
            checks.run(
                f"device{index}-program-decodes",
                lambda d=device: _program_decodes(d, d.network),  # type: ignore[misc]
            )
            checks.run(
                f"device{index}-constants-descriptor",
                lambda d=device: _constants_descriptor(d),  # type: ignore[misc]
            )
    if profile is None:
        return
    if mdp is not None:
        checks.run("device-socs", lambda: _socs(mdp, profile))
    if net is None:
        for name in DEVICE_CHECKS:
            checks.checks.append(Check(name, False, "not checked: the network descriptor is bad"))
        return
    _device_checks(checks, net, profile, mdp)


def _partition(qpc: Qpc) -> str:
    """A multi-device QPC's partition: the devices it needs and their cores."""
    mdp = qpc.mdp
    if mdp is None:
        return "one device"
    devices = mdp["devices"]
    for index in range(len(devices)):
        meta = qpc.device(index).program().meta.get("mdp", {})
        if meta.get("rank") != index or meta.get("devices") != len(devices):
            raise _Fail(
                f"device {index}'s program is not device {index} of {len(devices)} "
                f"(it says {meta.get('rank')} of {meta.get('devices')})"
            )
    listed = ", ".join(f"SoC {d['deviceId']} ({_plural(d['numCores'], 'core')})" for d in devices)
    return f"{_plural(len(devices), 'device')}: {listed}"


def _socs(mdp: dict[str, Any], device: DeviceProfile) -> str:
    """A partition runs on the SoCs of one card: as many as it has devices, ids below the
    card's SoC count, each with the cores its program needs."""
    ids = [int(d["deviceId"]) for d in mdp["devices"]]
    need = max(ids) + 1
    text = (
        f"needs {_plural(len(ids), 'SoC')} (device ids {', '.join(map(str, ids))}), "
        f"an {device.display_name} card has {device.socs}"
    )
    if need > device.socs:
        raise _Fail(text)
    short = [d for d in mdp["devices"] if d["numCores"] > device.cores_per_soc]
    if short:
        raise _Fail(
            f"device {short[0]['deviceId']} needs {short[0]['numCores']} cores, a "
            f"{device.display_name} SoC has {device.cores_per_soc}"
        )
    return text


def render_validation(report: ValidationReport) -> str:
    """One line per check: `PASS name: message` or `FAIL name: message`."""
    return "\n".join(f"{'PASS' if c.ok else 'FAIL'} {c.name}: {c.message}" for c in report.checks)
