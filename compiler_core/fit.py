"""Does the model fit the device? Decided from the model's header, before any compile.

What one SoC's DDR must hold (per SoC: a program runs on one; sliced over the SoCs of a
partition, `-mdp-load-partition-config`, each keeps its share of the MatMul weights and of the
KV cache, see `_weights`):
- the weights, at the size they are stored: fp16 with `-convert-to-fp16` (float32 weights),
  MXFP6 (6.25 bits an element, scales included) for MatMul/Gemm weights with
  `-mxfp6-matmul`, their own type otherwise;
- the KV cache (with `-retained-state`, every input whose `<input>_RetainedState` output
  feeds it), with its batch of sequences, fp16 or MXINT8 as the custom-IO list or
  `-mxint8-kv-cache` says;
- the working set: every specialization's other inputs and outputs, and the two largest
  activations any of them has (a lower bound of what the memory plan places: at least a
  producer's input and output are alive at once).

Shapes come from the header only: weights are never read (an external-data model's header
is a few hundred kilobytes whatever its weights weigh), and shape inference runs on the header
with the options' symbols bound. A model that cannot fit is refused with `model_does_not_fit`,
the bytes needed and available, and the options that would make it fit.

The host memory a compile needs is reported (`host_bytes`: the stored weights, the most the
compiler maps at once) but not checked here: the compile runs on a worker, not where the job
is submitted.
"""

from __future__ import annotations

import io
import json
import math
import os
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.file_kinds import ARCHIVE_HEAD_BYTES, archive_kind
from compiler_core.model_folder import LOCAL, ModelFolder

CODE = "model_does_not_fit"
RETAINED_SUFFIX = "_RetainedState"
_FLOAT = {1: 4, 10: 2, 16: 2, 11: 8}
"""ONNX float types (FLOAT, FLOAT16, BFLOAT16, DOUBLE) -> bytes."""


@dataclass(frozen=True)
class FitReport:
    fits: bool
    needed_bytes: int
    available_bytes: int
    weights_bytes: int
    kv_cache_bytes: int
    working_set_bytes: int
    sequences: int
    kv_bytes_per_sequence: int
    host_bytes: int
    device: str
    suggestions: list[str] = field(default_factory=list)
    devices: int = 1
    """SoCs the model is sliced over (-mdp-load-partition-config): the figures are per SoC."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def message(self) -> str:
        gb = 1e9
        over = f" sliced over {self.devices} SoCs" if self.devices > 1 else ""
        text = (
            f"the model{over} needs {self.needed_bytes / gb:.2f} GB of device DDR per SoC "
            f"(weights {self.weights_bytes / gb:.2f} GB, KV cache {self.kv_cache_bytes / gb:.2f} "
            f"GB for {self.sequences} sequence(s), working set "
            f"{self.working_set_bytes / gb:.2f} GB); {self.device} has "
            f"{self.available_bytes / gb:.2f} GB"
        )
        if self.suggestions:
            text += "; it would fit with " + ", or ".join(self.suggestions)
        return text


def _itemsize(elem_type: int) -> int:
    import onnx

    return int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).itemsize)


def _mxfp6_weights(model: Any) -> set[str]:
    """Initializers read as the weight operand of a MatMul/Gemm (what -mxfp6-matmul encodes)."""
    names = set()
    for node in model.graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type in ("MatMul", "Gemm"):
            if len(node.input) > 1:
                names.add(node.input[1])
    return names


def _weights(model: Any, fp16: bool, mxfp6: bool, devices: int = 1) -> tuple[int, int]:
    """(bytes stored on one SoC, bytes in the model's files). Over several SoCs (tensor
    slicing, compiler_core/mdp/shard.py) each keeps 1/devices of every 2-D MatMul/Gemm weight
    that divides; the rest (embeddings, norms) is whole on each."""
    from compiler_core.mxfp import mxfp6_nbytes

    matmul = _mxfp6_weights(model)
    encoded = matmul if mxfp6 else set()
    stored = files = 0
    for init in model.graph.initializer:
        shape = [int(d) for d in init.dims]
        count = math.prod(shape)
        size = _itemsize(init.data_type)
        files += count * size
        if devices > 1 and init.name in matmul and len(shape) == 2 and _divides(shape, devices):
            shape = [shape[0], shape[1] // devices]
            count //= devices
        if init.name in encoded and init.data_type in _FLOAT and len(shape) == 2:
            stored += mxfp6_nbytes(shape, 0)
        elif fp16 and init.data_type == 1:
            stored += count * 2
        else:
            stored += count * size
    return stored, files


def _divides(shape: list[int], devices: int) -> bool:
    return shape[0] % devices == 0 and shape[1] % devices == 0


def sliceable(model: Any, devices: int) -> bool:
    """Whether every 2-D MatMul/Gemm weight splits evenly over `devices` SoCs."""
    names = _mxfp6_weights(model)
    return all(
        _divides([int(d) for d in init.dims], devices)
        for init in model.graph.initializer
        if init.name in names and len(init.dims) == 2
    )


def _bound(model: Any, symbols: Mapping[str, int]) -> Any:
    """A copy of the header with the symbols bound and shapes inferred."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for value in (*copy.graph.input, *copy.graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param and dim.dim_param in symbols:
                dim.dim_value = int(symbols[dim.dim_param])
    try:
        return onnx.shape_inference.infer_shapes(copy)
    except Exception:  # noqa: BLE001 - inference is a refinement; the I/O shapes still count
        return copy


def _tensor_bytes(value: Any, fp16: bool) -> int | None:
    t = value.type.tensor_type
    if not t.HasField("shape"):
        return None
    dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    if any(d is None for d in dims):
        return None
    size = 2 if fp16 and t.elem_type == 1 else _itemsize(t.elem_type)
    return math.prod(dims) * size  # type: ignore[arg-type]


def check_fit_model(
    model: Any,
    options: Any,
    specializations: list[Mapping[str, int]],
    precisions: Mapping[str, str] | None = None,
    devices: int = 1,
) -> FitReport:
    """The fit of a header-only ModelProto under `options` (CompileOptions); `precisions`:
    the custom-IO list's entries by name (None: read the list the options name, locally);
    `devices`: the SoCs of the partition it is sliced over (weights and KV cache per SoC)."""
    from compiler_core.mxint8 import mxint8_nbytes

    device = options.device
    fp16 = bool(options.convert_to_fp16)
    weights, files = _weights(model, fp16, bool(options.mxfp6_matmul), devices)
    mx_all = bool(getattr(options, "mxint8_kv_cache", False))
    if precisions is None:
        precisions = _custom_io(options, LOCAL)
    defined = dict(options.onnx_define_symbol)
    slots = getattr(options, "full_batch_size", None)
    if slots is not None:  # -full-batch-size binds the cache's slots, as the compile does
        defined.setdefault("full_batch_size", int(slots))
    bindings = [defined | dict(s) for s in specializations] or [defined]
    kv = 0
    kv_fp16 = 0
    mx_kv_bytes = 0
    sequences = 1
    working = 0
    outputs = {o.name for o in model.graph.output}
    for symbols in bindings:
        bound = _bound(model, symbols)
        retained = {
            i.name
            for i in bound.graph.input
            if options.retained_state and f"{i.name}{RETAINED_SUFFIX}" in outputs
        }
        spec_kv = spec_kv16 = spec_mx = io_bytes = 0
        for value in (*bound.graph.input, *bound.graph.output):
            name = value.name
            base = name[: -len(RETAINED_SUFFIX)] if name.endswith(RETAINED_SUFFIX) else name
            n = _tensor_bytes(value, fp16 and base not in retained)
            if n is None:
                continue
            if base in retained:
                if name == base:
                    dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
                    listed = {precisions.get(n) for n in (name, f"{name}{RETAINED_SUFFIX}")}
                    item = 2 if "float16" in listed else _itemsize(value.type.tensor_type.elem_type)
                    plain = math.prod(dims) * item
                    mx = mx_all or "mxint8" in listed
                    spec_kv += mxint8_nbytes(dims) if mx else plain
                    spec_kv16 += plain
                    spec_mx += mxint8_nbytes(dims)
                    sequences = max(sequences, dims[0] if dims else 1)
            else:
                io_bytes += n
        largest = sorted(
            (b for v in bound.graph.value_info if (b := _tensor_bytes(v, fp16)) is not None),
            reverse=True,
        )[:2]
        kv = max(kv, -(-spec_kv // devices))  # each SoC keeps its heads' share
        kv_fp16 = max(kv_fp16, -(-spec_kv16 // devices))
        mx_kv_bytes = max(mx_kv_bytes, -(-spec_mx // devices))
        working = max(working, io_bytes + sum(largest))
    needed = weights + kv + working
    available = device.ddr_bytes_per_soc
    report = FitReport(
        fits=needed <= available,
        needed_bytes=needed,
        available_bytes=available,
        weights_bytes=weights,
        kv_cache_bytes=kv,
        working_set_bytes=working,
        sequences=sequences,
        kv_bytes_per_sequence=kv // max(1, sequences),
        host_bytes=files,
        device=device.name,
        devices=devices,
    )
    if report.fits:
        return report
    suggestions = []
    if not options.mxfp6_matmul:
        mx_weights, _ = _weights(model, fp16, True, devices)
        if mx_weights + kv + working <= available:
            suggestions.append(f"-mxfp6-matmul (weights {mx_weights / 1e9:.2f} GB)")
    if kv and not mx_all and kv == kv_fp16:
        mx_kv = mx_kv_bytes
        if weights + mx_kv + working <= available:
            suggestions.append("-mxint8-kv-cache")
    if kv and weights + working < available:
        share = (available - weights - working) / kv
        suggestions.append(f"a context at most {share:.0%} of the current one")
    more = _more_devices(model, options, kv, working, devices)
    if more is not None:
        suggestions.append(more)
    return FitReport(**{**report.as_dict(), "suggestions": suggestions})


def _more_devices(model: Any, options: Any, kv: int, working: int, devices: int) -> str | None:
    """The fewest SoCs (more than now, at most a host's) the model fits sliced over, as the
    flag that does it; None when no number does (the working set does not shrink)."""
    device = options.device
    fp16 = bool(options.convert_to_fp16)
    available = device.ddr_bytes_per_soc
    kv_whole = kv * devices
    for n in range(devices + 1, device.max_socs_per_host + 1):
        if not sliceable(model, n):
            continue
        weights, _ = _weights(model, fp16, bool(options.mxfp6_matmul), n)
        per_soc = weights + -(-kv_whole // n) + working
        if per_soc <= available:
            cards = -(-n // device.socs)
            where = f"{cards} {device.display_name} cards" if cards > 1 else "one card"
            return (
                f"-mdp-load-partition-config over {n} SoCs ({where}; "
                f"{per_soc / 1e9:.2f} GB per SoC)"
            )
    return None


def _custom_io(options: Any, folder: ModelFolder) -> dict[str, str]:
    """Read through `folder`, as every file a compile reads (the farm confines it)."""
    path = getattr(options, "custom_io_list_file", None)
    if not path:
        return {}
    from compiler_core.custom_io import load_custom_io

    return {e.name: e.precision for e in load_custom_io(path, folder)}


def _specializations(options: Any, folder: ModelFolder) -> list[Mapping[str, int]]:
    path = getattr(options, "network_specialization_config", None)
    if not path:
        return []
    from compiler_core.specializations import load_specializations, with_full_batch_size

    specs = load_specializations(path, folder)
    slots = getattr(options, "full_batch_size", None)
    if slots is not None:
        specs = with_full_batch_size(specs, int(slots))
    return [s.symbols for s in specs]


def read_header(source: object) -> Any:
    """The model's ModelProto without external weights' bytes."""
    import onnx

    if isinstance(source, onnx.ModelProto):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return onnx.load_model_from_string(bytes(source))
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"no model header in {type(source).__name__}")
    return onnx.load(os.fspath(source), load_external_data=False)


def check_fit(source: object, options: Any, folder: ModelFolder = LOCAL) -> FitReport:
    """The fit of a model (path or bytes) under `options`, from its header; the files the
    options name are read through `folder`."""
    header = read_header(source)
    precisions = _custom_io(options, folder)
    specs = _specializations(options, folder)
    return check_fit_model(header, options, specs, precisions, _devices(options, folder))


def _devices(options: Any, folder: ModelFolder, text: str | bytes | None = None) -> int:
    """The SoCs of the partition config the options name (1 without one)."""
    path = getattr(options, "mdp_load_partition_config", None)
    if not path:
        return int(getattr(options, "mdp_devices", None) or 1)
    from compiler_core.mdp.config import FLAG, parse_partition_config

    if text is None:
        text = folder.read_text(path, FLAG)
    # pipeline stages hold about equal shares of the weights too (mdp/pipeline.py)
    return parse_partition_config(text, options.device).num_devices


def require_fit(report: FitReport) -> None:
    """Refuse a model that cannot fit: `model_does_not_fit` with the figures."""
    if not report.fits:
        raise CompileError(CODE, report.message(), details=report.as_dict())


def worth_checking(source: object, options: Any) -> bool:
    """Checked before a compile that could overflow: an LLM (retained state) or a model whose
    files weigh more than a quarter of the SoC's DDR. Other models skip the header read."""
    if getattr(options, "retained_state", False):
        return True
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            total = sum(f.stat().st_size for f in path.parent.iterdir() if f.is_file())
        except OSError:
            return False
        return upload_worth_checking(options, total)
    return False


def upload_worth_checking(options: Any, size: int) -> bool:
    """The same for a stored upload of `size` bytes."""
    if getattr(options, "retained_state", False):
        return True
    return bool(size > options.device.ddr_bytes_per_soc // 4)


# --------------------------------------------------------------------------- stored uploads


MAX_SUBMIT_HEADER_BYTES = 64 << 20
"""The most of a stored upload the API reads for the submit-time check: a model proto whose
weights are external (an LLM's, as exported) is far smaller. A larger header (inline weights)
or a tar archive (no index: its members are found only by decompressing what comes before
them) is left to the same check at the start of the compile, in the worker's limited child."""
MAX_OPTION_FILE_BYTES = 1 << 20


def header_from_upload(
    stream: IO[bytes], member_files: Mapping[str, str] | None = None
) -> tuple[Any, dict[str, bytes]] | None:
    """From a stored upload (a bare .onnx, or a .zip holding one with its data): the model's
    header and the bytes of the named small files beside it (option files such as the
    specializations JSON), reading neither the weights nor any other member, and never more
    than the sizes above (the zip's directory gives each member's size before it is read).
    None when the header cannot be had within them."""
    import onnx

    head = stream.read(ARCHIVE_HEAD_BYTES)
    stream.seek(0)
    kind = archive_kind(head)
    wanted = dict(member_files or {})
    files: dict[str, bytes] = {}
    try:
        if kind == "zip":
            with zipfile.ZipFile(stream) as archive:
                infos = {info.filename: info for info in archive.infolist()}
                onnx_name = _single_onnx(list(infos))
                if infos[onnx_name].file_size > MAX_SUBMIT_HEADER_BYTES:
                    return None
                header = onnx.load_model_from_string(archive.read(onnx_name))
                root = os.path.dirname(onnx_name)
                for key, rel in wanted.items():
                    member = os.path.normpath(os.path.join(root, rel))
                    if member in infos and infos[member].file_size <= MAX_OPTION_FILE_BYTES:
                        files[key] = archive.read(member)
                return header, files
        if kind is not None:  # a tar: no index
            return None
        data = stream.read(MAX_SUBMIT_HEADER_BYTES + 1)
        if len(data) > MAX_SUBMIT_HEADER_BYTES:
            return None
        return onnx.load_model_from_string(data), files
    except (zipfile.BadZipFile, RuntimeError, ValueError, EOFError, OSError, zlib.error):
        return None  # the upload check accepted it; the compile will name what is wrong


def _single_onnx(names: list[str]) -> str:
    found = [n for n in names if n.endswith(".onnx")]
    if len(found) != 1:
        raise CompileError("invalid_model", f"the archive holds {len(found)} .onnx models")
    return found[0]


def check_upload_fit(stream: IO[bytes], options: Any) -> FitReport | None:
    """`check_fit` of a stored upload, for the farm's submit: the specializations file (named
    relative to the model inside the archive) is read from the archive too. None when the
    header is not to be had cheaply (`header_from_upload`): the compile checks it then."""
    wanted = {}
    if options.network_specialization_config:
        wanted["specializations"] = options.network_specialization_config
    if options.custom_io_list_file:
        wanted["custom_io"] = options.custom_io_list_file
    if options.mdp_load_partition_config:
        wanted["partition"] = options.mdp_load_partition_config
    found = header_from_upload(stream, wanted)
    if found is None:
        return None
    header, files = found
    import yaml

    specs: list[Mapping[str, int]] = []
    precisions: dict[str, str] = {}
    try:
        if "specializations" in files:
            from compiler_core.specializations import parse_specializations

            doc = json.loads(io.BytesIO(files["specializations"]).read())
            specs = [s.symbols for s in parse_specializations(doc)]
        if "custom_io" in files:
            entries = yaml.safe_load(files["custom_io"]) or []
            if isinstance(entries, list):
                precisions = {
                    str(e.get("IOName")): str(e.get("Precision"))
                    for e in entries
                    if isinstance(e, dict)
                }
        devices = _devices(options, LOCAL, files["partition"]) if "partition" in files else 1
    except (ValueError, RecursionError, yaml.YAMLError, CompileError):
        return None  # a malformed option file: the compile names what is wrong with it
    return check_fit_model(header, options, specs, precisions, devices)
