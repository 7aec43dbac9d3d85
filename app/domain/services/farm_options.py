"""The one door for compile options that come over the network (the JSON API and the web
form alike): parsed by the compiler's schema, then held to what a farm accepts.

- options naming places on the server (`-m`, `-aic-binary-dir`, `-operators-supported`) are
  refused; file options must name a path inside the model's archive (`model_files`);
- every number must be finite and every integer fit in 64 bits: the canonical options are
  stored as JSON in the job row and hashed into the cache key, and a value no database or
  compiler can hold is the client's mistake, answered 422 `invalid_option` naming the flag;
- an option the compiler's parser chokes on (not with its own CompileError) is refused the
  same way instead of surfacing as a server error.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from app.domain.services.model_files import check_model_file_paths
from compiler_core import CompileError, CompileOptions
from compiler_core.options import LOCAL_ONLY_OPTIONS

log = logging.getLogger(__name__)

FARM_INSTEAD = {
    "model": "the model is the upload named by `model_id`",
    "aic_binary_dir": "the QPC is stored by the farm: download it from /v1/qpcs/{id}/download",
    "operators_supported": "see GET /v1/operators",
    "mdp_dump_partition_config": "the partition a compile used is in its QPC's mdp_meta_info "
    "(qpc inspect names its devices)",
}
"""What the farm offers in place of a local-only option (which options are local-only is the
compiler's `LOCAL_ONLY_OPTIONS`; this only words the refusal)."""
INT64 = (-(1 << 63), (1 << 63) - 1)


def farm_options(
    *, flags: list[str] | None = None, values: dict[str, Any] | None = None
) -> CompileOptions:
    """Options from `qaic-compile` flag strings or a JSON object of flag names (one of the
    two), checked for the farm (CompileError `invalid_option` otherwise)."""
    try:
        if flags is not None:
            options = CompileOptions.from_flags(flags)
        else:
            options = CompileOptions.from_json(values or {})
    except CompileError:
        raise
    except Exception as exc:  # the parser's own bug or limit: still the client's input
        log.warning("options refused by an unexpected parser error", exc_info=True)
        raise CompileError(
            "invalid_option", f"the options cannot be parsed: {_first_line(exc)}"
        ) from None
    check_farm_rules(options)
    return options


def check_farm_rules(options: CompileOptions) -> None:
    """What the farm holds any options to, however they were made (a request, a sweep's
    compile group): no local-only option, file options inside the model, storable values."""
    for spec in LOCAL_ONLY_OPTIONS:
        if getattr(options, spec.attr):
            why = FARM_INSTEAD.get(spec.attr, "it acts on the machine running the compile")
            raise CompileError(
                "invalid_option", f"{spec.flag} is not accepted by the farm: {why}", flag=spec.flag
            )
    check_model_file_paths(options)
    for name, value in options.to_json().items():
        problem = _unstorable(value)
        if problem is not None:
            raise CompileError("invalid_option", f"-{name}: {problem}", flag=f"-{name}")


def _unstorable(value: Any) -> str | None:
    """Why a canonical option value cannot be stored and compiled, or None."""
    if isinstance(value, str):
        return "contains a control character" if _has_control(value) else None
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        if not INT64[0] <= value <= INT64[1]:
            return f"{value:.3e} is out of range (integers must fit in 64 bits)"
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value} is not a finite number"
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, list | tuple):
        for item in value:
            problem = _unstorable(item)
            if problem is not None:
                return problem
    return None


def _has_control(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]
