"""What a file is, from its first bytes, so a command handed the wrong file says what it got
("this is an ONNX model, not a QPC") rather than a format error of the file it expected."""

from __future__ import annotations

import os
from pathlib import Path

QPC = "a QPC"
ONNX = "an ONNX model"
NPZ = "a numpy .npz archive"
NPY = "a single numpy array (.npy)"
STATS = "a raw stats buffer (stats-inf-<n>.bin)"
HEAD_BYTES = 8

_QPC_MAGIC = (0x00A1CD7C).to_bytes(4, "little")
_STATS_MAGIC = (0x41545351).to_bytes(8, "little")
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_NPY_MAGIC = b"\x93NUMPY"
_MAX_IR_VERSION = 30


def sniff(head: bytes, name: str = "") -> str | None:
    """The kind of file that starts with `head` (None: none of these). An ONNX model is a
    protobuf whose first field is `ir_version` (tag 0x08, a small number)."""
    if head.startswith(_QPC_MAGIC):
        return QPC
    if head.startswith(_STATS_MAGIC):
        return STATS
    if head.startswith(_ZIP_MAGICS):
        return NPZ
    if head.startswith(_NPY_MAGIC):
        return NPY
    if len(head) >= 2 and head[0] == 0x08 and 1 <= head[1] <= _MAX_IR_VERSION:
        return ONNX
    if name.lower().endswith(".onnx"):
        return ONNX
    return None


ARCHIVE_HEAD_BYTES = 262
"""What `archive_kind` needs to see: a tar's `ustar` magic sits at offset 257."""


def archive_kind(head: bytes) -> str | None:
    """ "zip", "tar.gz" or "tar" for a model archive starting with `head`, else None: the one
    rule by which an upload is an archive (the farm's upload path and the submit-time fit
    check read stored uploads alike)."""
    if head.startswith(_ZIP_MAGICS):
        return "zip"
    if head.startswith(b"\x1f\x8b"):
        return "tar.gz"
    if len(head) >= ARCHIVE_HEAD_BYTES and head[257:ARCHIVE_HEAD_BYTES] == b"ustar":
        return "tar"
    return None


def sniff_file(path: str | os.PathLike[str]) -> str | None:
    with open(path, "rb") as handle:
        return sniff(handle.read(HEAD_BYTES), Path(path).name)


NPZ_HOWTO = "numpy.savez('in.npz', <input name>=<array>, ...)"


def inputs_problem(kind: str | None) -> str | None:
    """Why a file of `kind` cannot be a run's inputs (None: it may be)."""
    if kind == NPZ:
        return None
    what = f"is {kind}" if kind else "is not a numpy .npz archive"
    where = " (`qpcfarm qpc inspect QPC` lists the names and shapes)" if kind in (ONNX, QPC) else ""
    return f"{what}: inputs are an .npz archive of arrays by input name{where}: {NPZ_HOWTO}"


def model_problem(kind: str | None, path: str) -> str | None:
    """Why a file of `kind` cannot be a model to compile (None: it may be): a QPC is already
    compiled, and is run or inspected instead."""
    if kind == QPC:
        return (
            f"{path} is a QPC (a compiled program, magic 0x00A1CD7C), not an ONNX model: "
            f"run it with `qpcfarm run {path}` or summarise it with `qpcfarm qpc inspect {path}`; "
            "compile the .onnx it came from"
        )
    if kind in (NPZ, NPY, STATS):
        return f"{path} is {kind}, not an ONNX model"
    return None
