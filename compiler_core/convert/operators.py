"""`-operators-supported=tensorflow` and `=pytorch`: the framework operators the farm takes
through conversion, each with the ONNX operators its converter may emit for it.

The tables are the converters' own: tf2onnx's handler registry (`tf_op.create_mapping` at the
opset conversions target), and torch.onnx's registry of torchlib functions (one per ATen
operator). What a handler emits is read from its source: tf2onnx handler classes name ONNX ops in
`make_node("Op", ...)` calls, `node.type = "Op"` or a table's `onnx_op` (with the module's
own helper functions they call), torchlib functions call `op.Op(...)`
(directly or in one private helper). Each operator is then matched against the compiler's
op registry at that opset: "yes" when every ONNX op its handler may emit is supported,
"partly" (naming the ones that are not) when some branches convert to unsupported ops.
Operators none of whose ONNX ops are supported are left out.

Listing imports the converter (seconds for TensorFlow): it runs only for this command.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

import onnx

from compiler_core.convert.run import OPSET
from compiler_core.errors import CompileError

_MAKE_NODE = re.compile(
    r"""(?:make_node\(\s*|\bnode\.type\s*=\s*|op_type\s*=\s*)["']([A-Z]\w*)["']"""
)
_RETYPES = re.compile(r"\bnode\.type\s*=(?!=)")
_FUNCTION_CALL = re.compile(r"\b([a-z_]\w*)\(")
_OP_CALL = re.compile(r"\bop\.([A-Z]\w*)\(")
_HELPER_CALL = re.compile(r"\b(_\w+)\(")
_NOT_ENOUGH = {"Constant", "Identity"}
"""A handler read as emitting only these makes its real ops some other way: not listed."""


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _tensorflow_table() -> dict[str, set[str]]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        import tf2onnx.onnx_opset  # noqa: F401 - registers the TensorFlow handlers
        import tf2onnx.tflite_handlers  # noqa: F401 - and the TFLite ones
        from tf2onnx.handler import tf_op
    except ImportError as exc:
        raise _missing("tf2onnx", "tensorflow", exc) from None
    table: dict[str, set[str]] = {}
    for name, (func, kwargs) in tf_op.create_mapping(OPSET, None).items():
        handler = getattr(func, "__self__", func)  # the handler class: all its versions
        classes = inspect.getmro(handler)[:-1] if inspect.isclass(handler) else (handler,)
        source = "\n".join(_source(c) for c in classes)  # with the bases it inherits
        ops = set(_MAKE_NODE.findall(source))
        module = inspect.getmodule(handler)
        for helper_name in set(_FUNCTION_CALL.findall(source)):
            helper = getattr(module, helper_name, None)
            if inspect.isfunction(helper) and helper.__module__ == getattr(module, "__name__", ""):
                ops |= set(_MAKE_NODE.findall(_source(helper)))
        if kwargs.get("onnx_op"):
            ops.add(kwargs["onnx_op"])
        elif not _RETYPES.search(source) and onnx.defs.has(name):
            ops.add(name)  # kept as it is: the TensorFlow op is the ONNX op of that name
        table[name] = ops
    return table


def _pytorch_table() -> dict[str, set[str]]:
    try:
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        from torch.onnx._internal.exporter import _registration
    except ImportError as exc:
        raise _missing("torch", "torch", exc) from None
    try:
        registry = _registration.ONNXRegistry.from_torchlib()
    except ImportError as exc:  # onnxscript
        raise _missing("onnxscript", "torch", exc) from None
    table: dict[str, set[str]] = {}
    for target, decompositions in registry.functions.items():
        name = str(target)
        if not name.startswith("aten::"):
            continue
        ops: set[str] = set()
        for decomposition in decompositions:
            ops |= _torchlib_ops(decomposition.onnx_function)
        table[name] = ops
    return table


def _torchlib_ops(function: Any) -> set[str]:
    body = getattr(function, "func", None) or getattr(function, "function", None)
    source = _source(body)
    ops = set(_OP_CALL.findall(source))
    module = inspect.getmodule(body)
    for helper_name in set(_HELPER_CALL.findall(source)):
        helper = getattr(module, helper_name, None)
        helper = getattr(helper, "func", None) or getattr(helper, "function", None) or helper
        if callable(helper):
            ops |= set(_OP_CALL.findall(_source(helper)))
    return ops


def _missing(module: str, extra: str, exc: ImportError) -> CompileError:
    return CompileError(
        "missing_converter",
        f"listing the operators needs {module}, which is not installed: "
        f"pip install 'qpcfarm[{extra}]' ({exc})",
        flag="-operators-supported",
    )


TABLES: dict[str, Callable[[], dict[str, set[str]]]] = {
    "tensorflow": _tensorflow_table,
    "pytorch": _pytorch_table,
}


def supported_rows(framework: str) -> list[tuple[str, str, str]]:
    """(framework op, "yes" or "partly (no X, Y)", the ONNX ops it becomes), sorted."""
    from compiler_core.ops import REGISTRY

    supported = {o.op_type for o in REGISTRY.all() if not o.domain and _covers(o, OPSET)}
    rows = []
    for name, onnx_ops in sorted(TABLES[framework]().items()):
        usable = onnx_ops & supported
        if not usable or onnx_ops <= _NOT_ENOUGH:
            continue  # nothing supported, or the handler's ops could not be read
        missing = sorted(onnx_ops - supported)
        status = "yes" if not missing else f"partly (no {', '.join(missing)})"
        rows.append((name, status, ",".join(sorted(onnx_ops))))
    return rows


def _covers(opdef: Any, opset: int) -> bool:
    return bool(opdef.since <= opset and (opdef.until is None or opset <= opdef.until))


def render(rows: Iterable[tuple[str, str, str]]) -> str:
    rows = list(rows)
    if not rows:
        return ""
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "".join(
        f"{name:<{widths[0]}}  {status:<{widths[1]}}  {onnx}\n" for name, status, onnx in rows
    )
