"""Which framework format a model file (or directory) is, read from its bytes, never its name.

A PyTorch file is a zip archive; what is inside tells a TorchScript module (`code/`,
`constants.pkl`) from a `torch.export` program (`archive_format`, `models/*.json`) and from
a bare checkpoint (`torch.save` of weights: no program to convert). A TFLite file carries
the FlatBuffer identifier `TFL3` at bytes 4-8. A frozen TensorFlow graph (`GraphDef`), a
SavedModel's `saved_model.pb` and an ONNX model are protobufs told apart by their fields
(`wire`). A SavedModel is a directory (or a .zip/.tar of one) holding `saved_model.pb` with
its `variables/`: its `saved_model.pb` alone is refused with what to send instead.
"""

from __future__ import annotations

import os
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from compiler_core.convert import wire

SAVED_MODEL_FILE = "saved_model.pb"
MAX_MEMBERS = 100_000
"""An archive listing more entries than this is not looked into (a zip bomb of names)."""


@dataclass(frozen=True)
class Format:
    """A model format the farm converts to ONNX: `key` is stable (reports, cache keys), `what`
    how messages name it, `family` the extra that converts it."""

    key: str
    what: str
    family: str  # "torch" | "tensorflow"


TORCHSCRIPT = Format("torchscript", "a TorchScript module (torch.jit.save)", "torch")
TORCH_EXPORT = Format("torch_export", "a torch.export program (.pt2)", "torch")
SAVED_MODEL = Format("saved_model", "a TensorFlow SavedModel", "tensorflow")
FROZEN_GRAPH = Format("frozen_graph", "a frozen TensorFlow graph (GraphDef .pb)", "tensorflow")
TFLITE = Format("tflite", "a TFLite model (.tflite)", "tensorflow")
FORMATS = (TORCHSCRIPT, TORCH_EXPORT, SAVED_MODEL, FROZEN_GRAPH, TFLITE)

TORCH_CHECKPOINT = (
    "a PyTorch checkpoint saved with torch.save (weights, not a program): save the model "
    "with torch.export.save (.pt2) or torch.jit.save (TorchScript .pt) instead"
)
KERAS_V3 = (
    "a Keras .keras archive: export a SavedModel with model.export('<dir>') "
    "(or tf.saved_model.save) and give the directory or an archive of it"
)
BARE_SAVED_MODEL = (
    "the saved_model.pb of a TensorFlow SavedModel without its folder (its variables/ and "
    "assets/ are not in this file): zip the SavedModel directory (e.g. `cd <dir> && zip -r "
    "../model.zip .`) and send the archive, or give -m the directory"
)
HDF5 = (
    "an HDF5 file (a Keras .h5 model?): export a SavedModel with model.export('<dir>') "
    "and give the directory or an archive of it"
)


@dataclass(frozen=True)
class Recognised:
    """What a model path is: a convertible `format` (with `root`, the SavedModel directory
    or the file itself), or only `looks_like` (a sentence for a format we do not take)."""

    format: Format | None
    root: Path
    looks_like: str | None = None
    member_prefix: str = ""
    """For a SavedModel inside an archive: the folder of `saved_model.pb` in it."""


def _zip_names(path: Path) -> list[str] | None:
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
            if len(infos) > MAX_MEMBERS:
                return None
            return [info.filename for info in infos]
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return None


def _tar_names(path: Path) -> list[str] | None:
    try:
        with tarfile.open(path) as archive:
            names: list[str] = []
            for member in archive:
                names.append(member.name)
                if len(names) > MAX_MEMBERS:
                    return None
            return names
    except (tarfile.TarError, OSError, ValueError, EOFError):
        return None


def _saved_model_prefix(names: list[str]) -> str | None:
    """The folder of the shallowest `saved_model.pb` among archive `names` ("" at the top)."""
    found = [n for n in names if Path(n).name == SAVED_MODEL_FILE and not n.startswith("/")]
    if not found:
        return None
    best = min(found, key=lambda n: n.count("/"))
    return best[: -len(SAVED_MODEL_FILE)]


def _torch_kind(names: list[str]) -> Format | str | None:
    tails = {n.split("/", 1)[1] if "/" in n else n for n in names}
    if "archive_format" in tails or any(t.startswith("models/") for t in tails):
        return TORCH_EXPORT
    if "constants.pkl" in tails or any(t.startswith("code/") for t in tails):
        return TORCHSCRIPT
    if "data.pkl" in tails:
        return TORCH_CHECKPOINT
    if "config.json" in tails and "model.weights.h5" in tails:
        return KERAS_V3
    return None


def _protobuf(path: Path) -> Recognised | None:
    """A frozen GraphDef; a SavedModel's `saved_model.pb` given alone (in its folder, beside
    `variables/`, the folder is the model); None for ONNX or any other file."""
    try:
        with open(path, "rb") as handle:
            kind = wire.message_kind(handle, os.fstat(handle.fileno()).st_size)
    except OSError:
        return None
    if kind == wire.GRAPH_DEF:
        return Recognised(FROZEN_GRAPH, path)
    if kind == wire.SAVED_MODEL:
        folder = path.parent
        if path.name == SAVED_MODEL_FILE and (folder / "variables").is_dir():
            return Recognised(SAVED_MODEL, folder)
        return Recognised(None, path, BARE_SAVED_MODEL)
    return None


def recognise(path: str | os.PathLike[str]) -> Recognised | None:
    """The framework format of `path`, None when it is none of them (ONNX, a QPC, anything
    else: the caller's own checks say what it is)."""
    p = Path(path)
    if p.is_dir():
        if (p / SAVED_MODEL_FILE).is_file():
            return Recognised(SAVED_MODEL, p)
        return None
    try:
        with open(p, "rb") as handle:
            head = handle.read(64)
    except OSError:
        return None
    if head[4:8] == b"TFL3":
        return Recognised(TFLITE, p)
    if head.startswith(b"\x89HDF\r\n\x1a\n"):
        return Recognised(None, p, HDF5)
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        names = _zip_names(p)
        if names is None:
            return None
        prefix = _saved_model_prefix(names)
        if prefix is not None:
            return Recognised(SAVED_MODEL, p, member_prefix=prefix)
        kind = _torch_kind(names)
        if isinstance(kind, Format):
            return Recognised(kind, p)
        if isinstance(kind, str):
            return Recognised(None, p, kind)
        return None
    if head.startswith(b"\x1f\x8b") or head[257:262] == b"ustar" or _tar_magic(p):
        names = _tar_names(p)
        prefix = _saved_model_prefix(names) if names else None
        if prefix is not None:
            return Recognised(SAVED_MODEL, p, member_prefix=prefix)
        return None
    return _protobuf(p)


def _tar_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            handle.seek(257)
            return handle.read(5) == b"ustar"
    except OSError:
        return False
