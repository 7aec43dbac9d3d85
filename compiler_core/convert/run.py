"""Convert a TensorFlow or PyTorch model to ONNX in a child process under limits.

Loading a SavedModel, a TorchScript module or a torch.export program runs the framework on
data the user wrote (graphs, pickled metadata): the conversion is done by `child.py`, a
separate Python process (`-I`: no user site, no environment paths) that imports nothing of
qpcfarm, in a scratch folder of its own, with its address space, CPU time and file sizes
capped and a wall-clock deadline after which its whole process group is killed. A crash, a
hang or an allocation without bound ends there, as a coded `CompileError`; the caller's
process never loads the framework (docs/security.md).
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from compiler_core.convert import wire
from compiler_core.convert.kinds import FROZEN_GRAPH, Format, Recognised
from compiler_core.errors import CompileError

OPSET = 18
"""The ONNX opset conversions target: the newest the compiler's registry covers for the ops
converters emit (Resize 18, the Reduce ops with axes as inputs) and the oldest the
torch.onnx dynamo exporter writes."""
MEMORY_BYTES = 8 << 30
"""The child's address-space cap. TensorFlow reserves several GiB of address space at import;
a model is converted in a fraction of it."""
TIME_S = 600.0
CPU_S = 1200
FILE_BYTES = 8 << 30
CHILD = Path(__file__).with_name("child.py")
ARCHIVE_MAX_BYTES = 16 << 30
ARCHIVE_MAX_RATIO = 100.0
"""What a SavedModel archive may unpack to: in total, and as a multiple of its own size (plus
1 MiB); the same defaults as the farm's ONNX archives (QPCFARM_ARCHIVE_MAX_*)."""


@dataclass(frozen=True)
class Converted:
    """An ONNX model made from a framework model: where it is and what made it."""

    onnx_path: Path
    format: str
    converter: str
    converter_version: str
    checked_inputs: tuple[str, ...] = ()
    """`check_only` of a TorchScript module: its forward's argument names (no ONNX written)."""
    input_shapes: str = ""
    """The `-input-shapes` it was converted with ("": the model's own)."""

    def describe(self) -> dict[str, str]:
        described = {
            "format": self.format,
            "converter": self.converter,
            "converter_version": self.converter_version,
            "opset": str(OPSET),
        }
        if self.input_shapes:
            described["input_shapes"] = self.input_shapes
        return described


def _limits(memory_bytes: int) -> None:  # runs in the child before exec
    """Cap the child; never above a cap the caller has (a farm compile process's own)."""
    os.setsid()
    for limit, value in (
        (resource.RLIMIT_AS, memory_bytes),
        (resource.RLIMIT_CPU, CPU_S),
        (resource.RLIMIT_FSIZE, FILE_BYTES),
        (resource.RLIMIT_CORE, 0),
    ):
        soft, hard = resource.getrlimit(limit)
        capped = value if hard == resource.RLIM_INFINITY else min(value, hard)
        if soft != resource.RLIM_INFINITY:
            capped = min(capped, soft)
        resource.setrlimit(limit, (capped, capped))


def convert(
    recognised: Recognised,
    output: Path,
    input_shapes: list[tuple[str, list[int]]],
    *,
    check_only: bool = False,
    memory_bytes: int = MEMORY_BYTES,
    time_s: float = TIME_S,
) -> Converted:
    """Write the ONNX conversion of `recognised` to `output`, or raise a coded CompileError.
    `check_only`: a TorchScript module, whose input shapes come with the compile, is only
    loaded (no ONNX is written when no shapes are given)."""
    fmt = recognised.format
    assert fmt is not None
    if fmt is FROZEN_GRAPH:  # a damaged protobuf is refused here, without a framework
        _check_intact(recognised.root, fmt)
    with tempfile.TemporaryDirectory(prefix="qpcfarm-convert-") as work:
        request = {
            "family": fmt.family,
            "format": fmt.key,
            "model": str(Path(recognised.root).resolve()),
            "member_prefix": recognised.member_prefix,
            "output": str(output.resolve()),
            "opset": OPSET,
            "input_shapes": input_shapes,
            "work": work,
            "check_only": check_only,
            "archive_max_bytes": ARCHIVE_MAX_BYTES,
            "archive_max_ratio": ARCHIVE_MAX_RATIO,
        }
        request_path, result_path = Path(work, "request.json"), Path(work, "result.json")
        request_path.write_text(json.dumps(request))
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": work,
            "TMPDIR": work,
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
        }
        proc = subprocess.Popen(
            [sys.executable, "-I", str(CHILD), str(request_path), str(result_path)],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=lambda: _limits(memory_bytes),  # noqa: PLW1509 - no threads forked
        )
        try:
            _out, err = proc.communicate(timeout=time_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise CompileError(
                "conversion_time_limit",
                f"converting {fmt.what} to ONNX did not finish in {time_s:.0f} s",
                flag="-m",
            ) from None
        try:
            result = json.loads(result_path.read_text())
            if not result["ok"]:  # no path of this machine in what the user reads
                result["message"] = _scrub(result["message"], work, recognised.root)
        except (OSError, ValueError):
            tail = err.decode(errors="replace").strip().splitlines()[-1:] if err else []
            how = (
                f"killed by signal {-proc.returncode}"
                if proc.returncode < 0
                else f"exit status {proc.returncode}"
            )
            raise CompileError(
                "conversion_crashed",
                f"the converter of {fmt.what} stopped ({how}) before it finished: the file is "
                f"damaged or hostile, or it needs more than the conversion's limits"
                + (f" ({tail[0][:300]})" if tail else ""),
                flag="-m",
            ) from None
    if not result["ok"]:
        details = {k: result[k] for k in ("node_type",) if result.get(k)}
        raise CompileError(
            result["code"],
            f"{fmt.what}: {result['message']}",
            flag="-m",
            node=result.get("node"),
            details=details or None,
        )
    return Converted(
        output,
        fmt.key,
        result["converter"],
        result["version"],
        tuple(result.get("inputs", ())),
        format_input_shapes(input_shapes),
    )


def parse_input_shapes(text: str | None) -> list[tuple[str, list[int]]]:
    """`x:1x3x224x224,y:1x8` -> [("x", [1, 3, 224, 224]), ("y", [1, 8])]."""
    if not text:
        return []
    shapes = []
    for entry in text.split(","):
        name, sep, dims = entry.strip().rpartition(":")
        try:
            values = [int(d) for d in dims.split("x")]
        except ValueError:
            values = []
        if not sep or not name or not values or min(values) < 1:
            raise CompileError(
                "invalid_option",
                f"-input-shapes: '{entry}' is not <name>:<d0>x<d1>... (e.g. x:1x3x224x224)",
                flag="-input-shapes",
            )
        shapes.append((name, values))
    return shapes


def _check_intact(path: Path, fmt: Format) -> None:
    """A protobuf whose top-level fields stop before its end (truncated, or damaged) is
    refused before a framework is started for it."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        broken = wire.broken_at(handle, size)
    if broken is not None:
        raise CompileError(
            "invalid_model",
            f"{fmt.what}: the protobuf is damaged: its fields stop being well formed at byte "
            f"{broken:,} of {size:,} (a truncated or corrupted file)",
            flag="-m",
        )


def format_input_shapes(shapes: list[tuple[str, list[int]]]) -> str:
    """The `-input-shapes` text of parsed `shapes`, in one spelling (no spaces)."""
    return ",".join(f"{name}:{'x'.join(str(d) for d in dims)}" for name, dims in shapes)


def _scrub(text: str, work: str, model: Path) -> str:
    """`text` without the scratch folder's path (its files named relative to it), with the
    model's path as its file name only, the Python installation's path (the converter's
    files, in a framework's traceback) as `<python>`, the project's as `<qpcfarm>`, and any
    other absolute path as its last part."""
    for folder in {work, os.path.realpath(work)}:
        text = text.replace(folder.rstrip("/") + "/", "").replace(folder, ".")
    for path in {str(model), str(Path(model).resolve())}:
        text = text.replace(path, Path(model).name)
    for prefix in {sys.prefix, sys.base_prefix, os.path.realpath(sys.prefix)}:
        text = text.replace(prefix.rstrip("/") + "/", "<python>/")
    text = text.replace(str(_SOURCE_ROOT) + "/", "<qpcfarm>/")
    return _ABSOLUTE_PATH.sub(r"\1", text)


_SOURCE_ROOT = Path(__file__).resolve().parents[2]
"""The folder holding `compiler_core` (the conversion child's own file is in a traceback)."""
_ABSOLUTE_PATH = re.compile(r"(?<![\w.<>])/(?:[^\s\"'/:]+/)+([^\s\"'/:]+)")
"""Any other absolute path (a scripted module's source file, a cache folder): its last part."""
