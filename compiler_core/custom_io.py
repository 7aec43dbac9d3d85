"""`-custom-IO-list-file`: the precision of named graph inputs and outputs at the boundary.

The file is the YAML list the vendor tool reads (and QEfficient writes):

    - IOName: past_key.0
      Precision: float16

A model keeps computing in its own types; only what crosses the boundary changes, so the host
sends and receives half the bytes for a float16 KV cache. Entries are checked against the
model when the compile applies them (`passes/apply_custom_io.py`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from compiler_core.errors import CompileError
from compiler_core.model_folder import LOCAL, ModelFolder

FLAG = "-custom-IO-list-file"

PRECISIONS = ("float32", "float16", "bfloat16")
"""Boundary precisions this compiler converts to and from (the model side must be a float)."""
INTEGERS = ("int8", "uint8")
"""Boundary types of a quantized network: an input read only by QuantizeLinear nodes to this
type, an output written by a DequantizeLinear from it, crosses the host link as its integer
codes (the host quantizes and dequantizes with the model's own scale and zero point)."""
MXINT8 = "mxint8"
"""Not a boundary type but a storage format: a retained-state tensor (a KV cache, listed by
its input or its `_RetainedState` output name) kept on the device as MXINT8 blocks
(compiler_core/mxint8.py); it never crosses the host link, so the boundary is unchanged."""


def mxint8_names(entries: list[CustomIO]) -> frozenset[str]:
    """The names listed with Precision mxint8."""
    return frozenset(e.name for e in entries if e.precision == MXINT8)


@dataclass(frozen=True)
class CustomIO:
    name: str
    precision: str


def load_custom_io(path: str | os.PathLike[str], folder: ModelFolder = LOCAL) -> list[CustomIO]:
    """The entries of a custom-IO list file; any malformed entry is an `invalid_option` that
    says which one and why."""
    import yaml

    text = folder.read_text(path, FLAG)
    try:
        doc = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as exc:
        raise _invalid(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(doc, list) or not doc:
        raise _invalid(f"{path} must be a non-empty YAML list of IOName/Precision entries")
    entries = [_entry(item, index) for index, item in enumerate(doc)]
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            raise _invalid(f"IOName {entry.name!r} is listed twice")
        seen.add(entry.name)
    return entries


def _entry(item: Any, index: int) -> CustomIO:
    where = f"entry {index + 1}"
    if not isinstance(item, dict) or set(item) != {"IOName", "Precision"}:
        raise _invalid(f"{where} must have exactly the keys IOName and Precision, got {item!r}")
    name, precision = item["IOName"], item["Precision"]
    if not isinstance(name, str) or not name:
        raise _invalid(f"{where}: IOName must be a non-empty string")
    if precision not in (*PRECISIONS, *INTEGERS, MXINT8):
        raise _invalid(
            f"{where} ({name}): Precision {precision!r} is not one of "
            f"{', '.join((*PRECISIONS, *INTEGERS, MXINT8))}"
        )
    return CustomIO(name, precision)


def _invalid(message: str) -> CompileError:
    return CompileError("invalid_option", f"{FLAG}: {message}", flag=FLAG)
