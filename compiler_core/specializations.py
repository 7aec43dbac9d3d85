"""`-network-specialization-config`: several shape specializations of one network in one QPC.

An LLM is compiled once for prefill (`seq_len=128`) and once for decode (`seq_len=1`); both
programs live in one QPC and share one copy of the weights. The file takes either of the two
JSON forms the vendor tool reads:

    {"specializations": [{"batch_size": "1", "seq_len": "128"}, {"seq_len": "1", ...}]}
    {"specializations": [{"name": "Prefill", "symbols": {"seq_len": "128"}}, ...]}

Each specialization binds symbolic dimensions like `-onnx-define-symbol` does (and on top of
it); the first form's specializations are named after their bindings.

The keys QEfficient writes for an LLM (`VENDOR_KEYS`) are accepted as they are, whether or
not the model's inputs use them as dimensions (a model exported with a static context still
gets `ctx_len`; `full_batch_exec_size` and `num_logits_to_keep` describe the run), and they
must agree with each other: `batch_size` <= `full_batch_size` (continuous batching: a decode
of a subset of the cache slots), `full_batch_exec_size` <= `full_batch_size`, `seq_len` <=
`ctx_len`, `num_logits_to_keep` <= `seq_len`. `num_speculative_tokens` = k (our key, after
QEfficient's compile argument of that name) makes a speculative decode specialization of
k + 1 tokens: it sets `seq_len` to k + 1 (or checks it). Any other key must be a symbol of
the model's inputs (the compile says so otherwise: a typo is not a no-op).
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

VENDOR_KEYS = frozenset(
    {
        "batch_size",
        "seq_len",
        "ctx_len",
        "full_batch_size",
        "full_batch_exec_size",
        "num_logits_to_keep",
        "num_speculative_tokens",
    }
)
"""Keys of an LLM's specializations (QEfficient's, plus `num_speculative_tokens`) accepted
whether or not a dimension of the model uses them."""

SPECULATIVE = "num_speculative_tokens"

_AT_MOST = (
    ("batch_size", "full_batch_size", "a decode batch takes at most every cache slot"),
    ("full_batch_exec_size", "full_batch_size", "the executed batch takes at most every slot"),
    ("seq_len", "ctx_len", "a run writes at most the context's rows"),
    ("num_logits_to_keep", "seq_len", "a run keeps at most one logit row per token"),
)


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
        return Specialization(name, _vendor_keys(symbols, f"{where} ({name})"))
    symbols = {key: _value(key, value, where) for key, value in item.items()}
    name = ",".join(f"{k}={v}" for k, v in symbols.items())
    return Specialization(name, _vendor_keys(symbols, where))


def with_full_batch_size(specs: list[Specialization], slots: int) -> list[Specialization]:
    """`-full-batch-size=N`: every specialization's `full_batch_size` is N (a file that says
    otherwise is refused: one value, one place), and a decode (seq_len 1) without a
    `batch_size` decodes every slot."""
    out = []
    for index, spec in enumerate(specs):
        symbols = dict(spec.symbols)
        given = symbols.setdefault("full_batch_size", slots)
        if given != slots:
            raise CompileError(
                "invalid_option",
                f"-full-batch-size={slots} but specialization {spec.name!r} sets "
                f"full_batch_size={given}: give it in one place",
                flag="-full-batch-size",
            )
        if symbols.get("seq_len") == 1:
            symbols.setdefault("batch_size", slots)
        out.append(Specialization(spec.name, _vendor_keys(symbols, f"specialization {index + 1}")))
    return out


def _vendor_keys(symbols: dict[str, int], where: str) -> dict[str, int]:
    """The LLM keys checked against each other; `num_speculative_tokens` = k sets seq_len."""
    if SPECULATIVE in symbols:
        tokens = symbols[SPECULATIVE] + 1
        if symbols.setdefault("seq_len", tokens) != tokens:
            raise _invalid(
                f"{where}: {SPECULATIVE}={tokens - 1} is a decode of {tokens} tokens "
                f"(the last accepted one and {tokens - 1} drafts), but seq_len is "
                f"{symbols['seq_len']}"
            )
    for small, large, why in _AT_MOST:
        if small in symbols and large in symbols and symbols[small] > symbols[large]:
            raise _invalid(
                f"{where}: {small}={symbols[small]} exceeds {large}={symbols[large]} ({why})"
            )
    return symbols


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
