"""TensorFlow and PyTorch models in: recognised from their bytes (`kinds`), converted to ONNX
by the frameworks' own converters in a limited child process (`run`, `child`)."""

from __future__ import annotations

import os
from pathlib import Path

from compiler_core.convert.kinds import FORMATS, Format, Recognised, recognise
from compiler_core.convert.run import OPSET, Converted, convert, parse_input_shapes
from compiler_core.errors import CompileError

__all__ = [
    "FORMATS",
    "OPSET",
    "Converted",
    "Format",
    "Recognised",
    "convert",
    "convert_if_framework",
    "parse_input_shapes",
    "recognise",
]

CONVERTED_FILE = "converted.onnx"


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
