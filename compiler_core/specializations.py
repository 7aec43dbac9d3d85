"""`-network-specialization-config`: several shape specializations of one network in one QPC.

An LLM is compiled once for prefill (`seq_len=128`) and once for decode (`seq_len=1`); both
programs live in one QPC and share one copy of the weights. The file takes either of the two
JSON forms the vendor tool reads:

    {"specializations": [{"batch_size": "1", "seq_len": "128"}, {"seq_len": "1", ...}]}
    {"specializations": [{"name": "Prefill", "symbols": {"seq_len": "128"}}, ...]}

Each specialization binds symbolic dimensions like `-onnx-define-symbol` does (and on top of
it); the first form's specializations are named after their bindings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from compiler_core.errors import CompileError
from compiler_core.model_folder import LOCAL, ModelFolder
from compiler_core.options import MAX_DIMENSION

FLAG = "-network-specialization-config"


@dataclass(frozen=True)
class Specialization:
    name: str
    symbols: Mapping[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "symbols": dict(self.symbols)}


def load_specializations(
    path: str | os.PathLike[str], folder: ModelFolder = LOCAL
) -> list[Specialization]:
    text = folder.read_text(path, FLAG)
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _invalid(f"{path} is not JSON: {exc}") from None
    return parse_specializations(doc)


def parse_specializations(doc: Any) -> list[Specialization]:
    """Both JSON forms; every problem is an `invalid_option` naming the entry at fault."""
    if not isinstance(doc, dict) or set(doc) != {"specializations"}:
        raise _invalid('the file must be an object with one key, "specializations"')
    entries = doc["specializations"]
    if not isinstance(entries, list) or not entries:
        raise _invalid('"specializations" must be a non-empty list')
    specs = [_entry(item, index) for index, item in enumerate(entries)]
    names: set[str] = set()
    bindings: set[tuple[tuple[str, int], ...]] = set()
    for spec in specs:
        binding = tuple(sorted(spec.symbols.items()))
        if binding in bindings:
            raise _invalid(f"specialization {spec.name!r} repeats another's symbol values")
        if spec.name in names:
            raise _invalid(f"two specializations are named {spec.name!r}")
        names.add(spec.name)
        bindings.add(binding)
    return specs


def _entry(item: Any, index: int) -> Specialization:
    where = f"specialization {index + 1}"
    if not isinstance(item, dict) or not item:
        raise _invalid(f"{where} must be a non-empty object")
    if "symbols" in item:
        if set(item) - {"name", "symbols"}:
            raise _invalid(f'{where}: the named form takes only "name" and "symbols"')
        name = item.get("name", f"specialization{index}")
        if not isinstance(name, str) or not name:
            raise _invalid(f"{where}: name must be a non-empty string")
        raw = item["symbols"]
        if not isinstance(raw, dict) or not raw:
            raise _invalid(f"{where}: symbols must be a non-empty object")
        symbols = {key: _value(key, value, where) for key, value in raw.items()}
        return Specialization(name, symbols)
    symbols = {key: _value(key, value, where) for key, value in item.items()}
    return Specialization(",".join(f"{k}={v}" for k, v in symbols.items()), symbols)


def _value(key: Any, value: Any, where: str) -> int:
    if not isinstance(key, str) or not key:
        raise _invalid(f"{where}: symbol names must be non-empty strings")
    plain = isinstance(value, str | int) and not isinstance(value, bool)
    text = str(value).strip() if plain else ""
    if not (text.isascii() and text.isdigit() and len(text) <= 24) or not (
        1 <= int(text) <= MAX_DIMENSION
    ):
        shown = value if len(text) <= 24 else f"{text[:24]}..."
        raise _invalid(
            f"{where}: {key} must be a positive integer up to {MAX_DIMENSION}, got {shown!r}"
        )
    return int(text)


def _invalid(message: str) -> CompileError:
    return CompileError("invalid_option", f"{FLAG}: {message}", flag=FLAG)
