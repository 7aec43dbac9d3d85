"""TensorFlow and PyTorch models in: recognised from their bytes (`kinds`), converted to ONNX
by the frameworks' own converters in a limited child process (`run`, `child`)."""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

from compiler_core.convert.kinds import FORMATS, Format, Recognised, recognise
from compiler_core.convert.run import (
    OPSET,
    Converted,
    convert,
    format_input_shapes,
    parse_input_shapes,
)
from compiler_core.errors import CompileError

__all__ = [
    "FORMATS",
    "FORMAT_KEYS",
    "CONVERTED_FILE",
    "OPSET",
    "Converted",
    "Format",
    "Recognised",
    "convert",
    "convert_if_framework",
    "converter_of",
    "converter_versions",
    "format_input_shapes",
    "parse_input_shapes",
    "recognise",
]

CONVERTED_FILE = "converted.onnx"
FORMAT_KEYS = frozenset(f.key for f in FORMATS)
"""The stored kinds of uploads that are converted (a model's `kind` is its format's key)."""


def convert_if_framework(
    path: str | os.PathLike[str], out_dir: Path, input_shapes: str | None
) -> Converted | None:
    """The ONNX conversion of a TensorFlow or PyTorch model at `path`, written to
    `out_dir/converted.onnx`; None for a file that is none of them (ONNX...)."""
    recognised = recognise(path)
    if recognised is None:
        return None
    if recognised.format is None:
        raise CompileError("invalid_model", f"{path} is {recognised.looks_like}", flag="-m")
    out_dir.mkdir(parents=True, exist_ok=True)
    return convert(recognised, out_dir / CONVERTED_FILE, parse_input_shapes(input_shapes))


CONVERTER_PACKAGES = {
    "torch": ("torch", "onnxscript"),
    "tensorflow": ("tensorflow-cpu", "tensorflow", "tf2onnx"),
}


def converter_versions(family: str) -> str:
    """The installed versions of a family's converter packages ("tf2onnx 1.17.0, ..."), read
    from package metadata (nothing is imported): part of the farm's cache key for a model
    that is converted, so a new converter makes a new compile."""
    found = []
    for name in CONVERTER_PACKAGES.get(family, ()):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(found)


def converter_of(kind: str) -> str:
    """`converter_versions` of the family that converts a stored model of `kind` (a format's
    key); "" for ONNX (kind "onnx" or "archive")."""
    family = next((f.family for f in FORMATS if f.key == kind), None)
    return converter_versions(family) if family else ""
