"""`inspect_qpc`: a summary of a QPC as a JSON-ready dict, and its human rendering.

Vendor QPCs are summarised at container level (segments only); for ours the summary adds the
network descriptor and counts from the decoded program.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from compiler_core.errors import CompileError
from compiler_core.lowering.program import DmaLoad, DmaStore, Program, RunKernel, SemPost, SemWait
from compiler_core.qpc.container import Qpc, QpcSource, load_qpc

_INSTR_NAMES: tuple[tuple[type, str], ...] = (
    (DmaLoad, "dma_load"),
    (DmaStore, "dma_store"),
    (RunKernel, "kernel"),
    (SemPost, "sem_post"),
    (SemWait, "sem_wait"),
)


def _program_summary(program: Program) -> dict[str, Any]:
    op_types: Counter[str] = Counter()
    kernels: Counter[str] = Counter()
    for kernel in program.kernels:
        op_types.update(kernel.op_types or (kernel.info.op_type,))
        kernels[kernel.kernel] += 1
    per_core = []
    for stream in program.streams:
        counts = {name: sum(isinstance(i, cls) for i in stream) for cls, name in _INSTR_NAMES}
        per_core.append({"total": len(stream), **counts})
    return {
        "kernel_count": len(program.kernels),
        "op_type_counts": dict(sorted(op_types.items())),
        "kernel_counts": dict(sorted(kernels.items())),
        "instructions_per_core": per_core,
        "num_semaphores": program.num_semaphores,
        "tensor_count": len(program.tensors),
        "ddr_size": program.ddr_size,
        "vtcm_used": list(program.vtcm_used),
    }


def _summarise(qpc: Qpc) -> dict[str, Any]:
    out: dict[str, Any] = {
        "format": "qpcfarm" if qpc.is_qpcfarm else "vendor",
        "size": qpc.total_size,
        "version": qpc.header.version,
        "compression": qpc.header.compression,
        "segments": [
            {
                "name": r.name,
                "size": r.size,
                "offset": r.offset_field,
                "data_offset": r.data_offset,
            }
            for r in qpc.records
        ],
        "constants_size": len(qpc.segments.get("constants.bin", b"")),
    }
    if not qpc.is_qpcfarm:
        return out
    try:
        net = qpc.network
    except CompileError as exc:
        out["network_error"] = exc.message
        net = None
    if net is not None:
        out.update(
            network_name=net.network_name,
            compiler_version=net.compiler_version,
            hw_version=net.hw_version,
            num_cores=net.num_cores,
            batch_size=net.batch_size,
            inputs=[io.to_dict() for io in net.inputs],
            outputs=[io.to_dict() for io in net.outputs],
            options=net.options,
            specializations=[spec.to_dict() for spec in net.specializations],
            stats=net.stats,
            requirements=net.requirements.to_dict(),
        )
    try:
        mdp = qpc.mdp
    except CompileError as exc:
        out["mdp_error"] = exc.message
        return out
    if mdp is not None:
        out["mdp"] = _partition_summary(qpc, mdp)
        qpc = qpc.device(0)  # the constants and program below are device 0's
        out["constants_size"] = len(qpc.segments.get("constants.bin", b""))
    if "constantsdesc.bin" in qpc.segments:
        out["constants_count"] = len(qpc.constants())
    try:
        out["program"] = _program_summary(qpc.program())
    except CompileError as exc:
        out["program_error"] = exc.message
    return out


def _partition_summary(qpc: Qpc, mdp: dict[str, Any]) -> dict[str, Any]:
    """A multi-device QPC: each device's SoC id, cores and program size, and the link."""
    devices = []
    for index, d in enumerate(mdp["devices"]):
        entry: dict[str, Any] = {
            "device_id": d["deviceId"],
            "num_cores": d["numCores"],
            "stage": d.get("stage", 0),
        }
        try:
            device = qpc.device(index)
            program = device.program()
            entry.update(
                ddr_size=program.ddr_size,
                constants_size=len(device.segments.get("constants.bin", b"")),
                kernel_count=len(program.kernels),
            )
        except CompileError as exc:
            entry["error"] = exc.message
        devices.append(entry)
    return {"devices": devices, "link": mdp.get("link", {}), "partition": mdp.get("partition")}


def inspect_qpc(source: QpcSource | Qpc) -> dict[str, Any]:
    """Summarise a QPC; raises CompileError('invalid_qpc') if the container is unreadable.

    A program that does not decode is reported under `program_error` rather than raised.
    """
    if isinstance(source, Qpc):
        return _summarise(source)
    with load_qpc(source) as qpc:
        return _summarise(qpc)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _flags(options: dict[str, Any]) -> str:
    """The compile's options as the flags that set them (defaults left out); options this
    compiler version no longer parses are shown as stored."""
    from compiler_core.options import CompileOptions

    try:
        flags = CompileOptions.from_json(options).to_flags()
    except CompileError:
        flags = [f"-{k}={v}" for k, v in sorted(options.items()) if v not in (None, [], {})]
    return " ".join(flags) or "(defaults)"


def _io_line(io: dict[str, Any]) -> str:
    dims = "x".join(str(d) for d in io["dims"]) or "scalar"
    return f"    {io['name']}: {io['dtype']} [{dims}] {io['layout']}"


def render_inspect(d: dict[str, Any]) -> str:
    """Human-readable text of an `inspect_qpc` dict."""
    lines = [
        f"QPC ({d['format']}), container version {d['version']}, {d['size']:,} bytes "
        f"({_size(d['size'])})",
        "Segments:",
    ]
    width = max((len(s["name"]) for s in d["segments"]), default=0)
    for seg in d["segments"]:
        lines.append(
            f"  {seg['name']:<{width}}  {seg['size']:>14,} B  at {seg['data_offset']:,}"
            + (f"  (offset field {seg['offset']:,})" if seg["offset"] else "")
        )
    if "network_name" in d:
        req = d["requirements"]
        lines += [
            f"Network: {d['network_name']}",
            f"  compiler {d['compiler_version']}, hardware {d['hw_version']}, "
            f"{d['num_cores']} cores, batch {d['batch_size']}",
            "  inputs:",
            *(_io_line(io) for io in d["inputs"]),
            "  outputs:",
            *(_io_line(io) for io in d["outputs"]),
            f"  requirements: {req['num_cores']} cores, "
            f"{_size(req['vtcm_bytes_per_core'])} VTCM per core, {_size(req['ddr_bytes'])} DDR, "
            f"types {', '.join(req['dtypes']) or '-'}",
        ]
        if d["options"]:
            lines.append(f"  options: {_flags(d['options'])}")
        for spec in d["specializations"]:
            symbols = ", ".join(f"{k}={v}" for k, v in spec["symbols"].items())
            shapes = ", ".join(
                f"{io['name']}[{'x'.join(str(n) for n in io['dims'])}]" for io in spec["inputs"]
            )
            lines.append(
                f"  specialization {spec['name']} ({symbols}): {spec['program']}, {shapes}"
            )
        if req.get("retained_state"):
            lines.append(f"  retained state: {', '.join(req['retained_state'])}")
    if "mdp" in d:
        mdp = d["mdp"]
        link = mdp["link"]
        lines.append(
            f"Partition: {_count(len(mdp['devices']), 'device')}"
            + (
                f", {link['kind']} link {link['bytes_per_s'] / 1e9:.1f} GB/s, "
                f"{link['latency_s'] * 1e6:.0f} us"
                if link
                else ""
            )
        )
        for index, dev in enumerate(mdp["devices"]):
            detail = (
                f"DDR {_size(dev['ddr_size'])}, constants {_size(dev['constants_size'])}"
                if "ddr_size" in dev
                else f"does not decode: {dev.get('error')}"
            )
            stage = f"stage {dev['stage']}, " if any(x["stage"] for x in mdp["devices"]) else ""
            lines.append(
                f"  device {index}: {stage}SoC {dev['device_id']}, "
                f"{_count(dev['num_cores'], 'core')}, " + detail
            )
        lines.append("Device 0:")
    count = d.get("constants_count")
    lines.append(
        f"Constants: {_size(d['constants_size'])}"
        + ("" if count is None else f" in {_count(count, 'tensor')}")
    )
    if "program" in d:
        prog = d["program"]
        lines.append(
            f"Program: {_count(prog['kernel_count'], 'kernel')}, "
            f"{_count(prog['tensor_count'], 'tensor')}, "
            f"{_count(prog['num_semaphores'], 'semaphore')}, DDR {_size(prog['ddr_size'])}"
        )
        ops = ", ".join(f"{k} {v}" for k, v in prog["op_type_counts"].items())
        lines.append(f"  ops: {ops or '-'}")
        for core, counts in enumerate(prog["instructions_per_core"]):
            detail = ", ".join(f"{k} {v}" for k, v in counts.items() if k != "total" and v)
            lines.append(f"  core {core:2d}: {counts['total']} instructions ({detail or 'none'})")
    elif "program_error" in d:
        lines.append(f"Program: does not decode: {d['program_error']}")
    return "\n".join(lines)
