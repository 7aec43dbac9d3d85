"""Which framework node an ONNX node of a converted model came from, so that a compile error
about the node (an operator or a shape the compiler refuses) names what the user wrote.

torch.onnx's dynamo exporter records it on each node (`metadata_props`): the FX node and its
ATen target (`pkg.torch.onnx.fx_node`), the module path (`pkg.torch.onnx.name_scopes`) and
the module classes (`pkg.torch.onnx.class_hierarchy`). tf2onnx names each ONNX node after the
TensorFlow node it converted (`model/conv2d/Conv2D`), whose last part is usually its type.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import onnx

from compiler_core.errors import CompileError

_TARGET = re.compile(r"target=([\w.]+)")


def framework_node(model: onnx.ModelProto, onnx_node: str) -> tuple[str, str] | None:
    """(framework node name, its type) of the ONNX node named `onnx_node`; None if unknown."""
    node = next((n for n in model.graph.node if n.name == onnx_node), None)
    if node is None:
        return None
    props = {p.key: p.value for p in node.metadata_props}
    if "pkg.torch.onnx.fx_node" in props:
        target = _TARGET.search(props["pkg.torch.onnx.fx_node"])
        kind = target.group(1).removeprefix("torch.ops.") if target else node.op_type
        scopes = _literal_list(props.get("pkg.torch.onnx.name_scopes", ""))
        name = ".".join(s for s in scopes if s) or onnx_node
        classes = _literal_list(props.get("pkg.torch.onnx.class_hierarchy", ""))
        modules = [c for c in classes if not c.startswith(("aten.", "<"))]
        return name, f"{kind} in {modules[-1]}" if modules else kind
    if "/" in node.name:  # tf2onnx: the TensorFlow node's own name
        return node.name, node.name.rsplit("/", 1)[1]
    return None


def _literal_list(text: str) -> list[str]:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return []
    return [str(v) for v in value] if isinstance(value, list) else []


def name_framework_node(exc: CompileError, onnx_path: Path) -> None:
    """Add the framework node behind `exc.node` to the error (message and `details`)."""
    if not exc.node:
        return
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception:  # noqa: BLE001 - the error stands as it is
        return
    found = framework_node(model, exc.node)
    if found is None:
        return
    name, kind = found
    exc.details = {**exc.details, "framework_node": name, "framework_op": kind}
    exc.message = f"{exc.message} (framework node {name}: {kind})"
    exc.args = (exc.message,)
