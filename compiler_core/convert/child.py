"""The conversion itself, run as a script in a process of its own (`convert/run.py` starts it
under limits): `python -I child.py <request.json> <result.json>`.

It imports nothing of qpcfarm (only the standard library and the converter), so what a
hostile model does to this process ends with it. The request names the format, the model,
where to write the ONNX, the opset and the input shapes; the result is the converter's name
and version, or an error (code, message, and the framework's node name and type when one
node is at fault).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any


class Failed(Exception):
    def __init__(
        self, code: str, message: str, node: str | None = None, node_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.node, self.node_type = code, message, node, node_type


MISSING = "missing_converter"


def _need(module: str, extra: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise Failed(
            MISSING,
            f"converting this model needs {module}, which is not installed: "
            f"pip install 'qpcfarm[{extra}]' ({exc})",
        ) from None


def _shapes(request: dict[str, Any]) -> list[tuple[str, list[int]]]:
    return [(name, list(dims)) for name, dims in request.get("input_shapes", [])]


# --- PyTorch --------------------------------------------------------------------------------


def _torch(request: dict[str, Any]) -> dict[str, Any]:
    torch = _need("torch", "torch")
    _need("onnxscript", "torch")
    src, dst, opset = request["model"], request["output"], request["opset"]
    if request["format"] == "torch_export":
        try:
            program = torch.export.load(src)
        except Exception as exc:  # noqa: BLE001 - any load failure is the file's fault
            raise Failed(
                "invalid_model", f"torch.export.load cannot read it: {_one_line(exc)}"
            ) from None
        try:
            onnx_program = torch.onnx.export(
                program, opset_version=opset, dynamo=True, optimize=True, verbose=False
            )
            onnx_program.save(dst)
        except Exception as exc:  # noqa: BLE001
            raise _torch_failure(exc, program) from None
        return {"converter": "torch.onnx.export (dynamo)", "version": torch.__version__}
    try:
        module = torch.jit.load(src, map_location="cpu")
    except Exception as exc:  # noqa: BLE001
        raise Failed("invalid_model", f"torch.jit.load cannot read it: {_one_line(exc)}") from None
    shapes = _shapes(request)
    arg_names = [i.debugName().split(".")[0] for i in list(module.graph.inputs())[1:]]
    if not shapes and request.get("check_only"):
        return {"converter": "", "version": torch.__version__, "inputs": arg_names}
    if not shapes:
        raise Failed(
            "input_shape_required",
            "a TorchScript module does not record its input shapes: pass "
            f"-input-shapes=<name>:<d0>x<d1>... for its inputs ({', '.join(arg_names)}), "
            "e.g. -input-shapes=x:1x3x224x224",
        )
    if len(shapes) != len(arg_names):
        raise Failed(
            "input_shape_required",
            f"the module's forward takes {len(arg_names)} input(s) ({', '.join(arg_names)}); "
            f"-input-shapes gives {len(shapes)}",
        )
    example = tuple(torch.zeros(dims) for _name, dims in shapes)
    module.eval()
    try:
        torch.onnx.export(
            module,
            example,
            dst,
            opset_version=opset,
            dynamo=False,
            input_names=[name for name, _dims in shapes],
            do_constant_folding=True,
        )
    except Exception as exc:  # noqa: BLE001
        raise _torch_failure(exc, None) from None
    return {"converter": "torch.onnx.export (TorchScript)", "version": torch.__version__}


def _torch_failure(exc: Exception, program: Any) -> Failed:
    text = _one_line(exc)
    match = re.search(r"(aten::\w+|aten\.\w+(?:\.\w+)?|[\w.]+::\w+)", text)
    node_type = match.group(1) if match else None
    node = None
    if program is not None and node_type is not None:
        short = (
            node_type.replace("::", ".").split(".")[1]
            if "." in node_type.replace("::", ".")
            else node_type
        )
        for fx_node in program.graph.nodes:
            if fx_node.op == "call_function" and short in str(fx_node.target):
                node = fx_node.name
                break
    where = f" at node {node} ({node_type})" if node else (f" ({node_type})" if node_type else "")
    return Failed(
        "conversion_failed",
        f"torch.onnx.export cannot convert the model{where}: {text}",
        node=node,
        node_type=node_type,
    )


# --- TensorFlow -----------------------------------------------------------------------------


class _Unsupported(logging.Handler):
    """Collects tf2onnx's 'Tensorflow op [name: type] is not supported' reports."""

    PATTERN = re.compile(r"Tensorflow op \[(.+): (\w+)\] is not supported")

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.found: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = self.PATTERN.search(record.getMessage())
        if match:
            self.found.append((match.group(1), match.group(2)))


def _extract(archive: str, prefix: str, into: Path, max_bytes: int, max_ratio: float) -> Path:
    """A SavedModel's folder out of its archive: members outside `into` are refused, and so
    is an archive whose members unpack to more than `max_bytes` or `max_ratio` times its own
    size (plus 1 MiB): a compression bomb stops before a byte is written. The sizes summed
    are the members' own (a zip member is read only up to its recorded size, a tar member is
    that size)."""
    into.mkdir()
    limit = min(max_bytes, int(Path(archive).stat().st_size * max_ratio) + (1 << 20))
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as z:
                infos = z.infolist()
                for info in infos:
                    target = (into / info.filename).resolve()
                    if not target.is_relative_to(into.resolve()):
                        raise Failed(
                            "bad_archive",
                            f"archive member {info.filename!r} leads outside the archive",
                        )
                _check_unpacked(sum(i.file_size for i in infos), limit)
                z.extractall(into)
        else:
            with tarfile.open(archive) as t:
                members = t.getmembers()
                _check_unpacked(sum(m.size for m in members), limit)
                t.extractall(into, members=members, filter="data")
    except (zipfile.BadZipFile, tarfile.TarError, OSError, EOFError) as exc:
        raise Failed("bad_archive", f"cannot unpack the SavedModel archive: {exc}") from None
    return into / prefix


def _check_unpacked(total: int, limit: int) -> None:
    if total > limit:
        raise Failed(
            "archive_too_large",
            f"the SavedModel archive unpacks to {total:,} bytes, more than its limit of "
            f"{limit:,} (100 times its size, at most 16 GiB): a compression bomb is not a model",
        )


def _tensorflow(request: dict[str, Any]) -> dict[str, Any]:
    src = request["model"]
    if request["format"] == "saved_model" and Path(src).is_file():  # before TensorFlow loads
        into = Path(request["work"]) / "saved_model"
        limits = request["archive_max_bytes"], request["archive_max_ratio"]
        src = str(_extract(src, request.get("member_prefix", ""), into, *limits))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    tf = _need("tensorflow", "tensorflow")
    tf2onnx = _need("tf2onnx", "tensorflow")
    from tf2onnx import convert, tf_loader

    dst, opset, kind = request["output"], request["opset"], request["format"]
    shapes = {f"{name}:0" if ":" not in name else name: dims for name, dims in _shapes(request)}
    collector = _Unsupported()
    logging.getLogger("tf2onnx").addHandler(collector)
    try:
        if kind == "tflite":
            model, _ = convert.from_tflite(
                src, opset=opset, output_path=dst, shape_override=shapes or None
            )
        elif kind == "frozen_graph":
            inputs, outputs = _graph_ends(tf, src)
            graph_def, inputs, outputs = tf_loader.from_graphdef(src, inputs, outputs)
            model, _ = convert.from_graph_def(
                graph_def,
                input_names=inputs,
                output_names=outputs,
                opset=opset,
                output_path=dst,
                shape_override=shapes or None,
            )
        else:
            try:
                graph_def, inputs, outputs = tf_loader.from_saved_model(src, None, None)
            except Exception as exc:  # noqa: BLE001
                raise Failed(
                    "invalid_model", f"TensorFlow cannot load the SavedModel: {_one_line(exc)}"
                ) from None
            model, _ = convert.from_graph_def(
                graph_def,
                input_names=inputs,
                output_names=outputs,
                opset=opset,
                output_path=dst,
                shape_override=shapes or None,
            )
    except Failed:
        raise
    except Exception as exc:  # noqa: BLE001
        if collector.found:
            raise _unsupported(collector.found) from None
        raise Failed(
            "conversion_failed", f"tf2onnx cannot convert the model: {_one_line(exc)}"
        ) from None
    unmapped = [(n.name, n.op_type[4:]) for n in model.graph.node if n.op_type.startswith("TFL_")]
    if collector.found or unmapped:
        Path(dst).unlink(missing_ok=True)
        raise _unsupported(collector.found or unmapped)
    return {
        "converter": "tf2onnx",
        "version": f"{tf2onnx.__version__} (TensorFlow {tf.__version__})",
    }


def _unsupported(found: list[tuple[str, str]]) -> Failed:
    node, node_type = found[0]
    more = f" (and {len(found) - 1} more node(s))" if len(found) > 1 else ""
    return Failed(
        "unsupported_framework_op",
        f"tf2onnx has no ONNX mapping for TensorFlow op {node_type} at node {node}{more}",
        node=node,
        node_type=node_type,
    )


def _graph_ends(tf: Any, path: str) -> tuple[list[str], list[str]]:
    """A frozen graph's inputs (its Placeholders) and outputs (nodes nothing reads)."""
    graph_def = tf.compat.v1.GraphDef()
    try:
        graph_def.ParseFromString(Path(path).read_bytes())
    except Exception as exc:  # noqa: BLE001
        raise Failed(
            "invalid_model", f"not a readable TensorFlow GraphDef: {_one_line(exc)}"
        ) from None
    read: set[str] = set()
    for node in graph_def.node:
        for name in node.input:
            read.add(name.lstrip("^").split(":")[0])
    inputs = [f"{n.name}:0" for n in graph_def.node if n.op == "Placeholder"]
    outputs = [
        f"{n.name}:0"
        for n in graph_def.node
        if n.name not in read and n.op not in ("Placeholder", "Const", "NoOp")
    ]
    if not outputs:
        raise Failed("invalid_model", "the GraphDef has no output node")
    return inputs, outputs


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return (text[:400] + "...") if len(text) > 400 else (text or type(exc).__name__)


def main(request_path: str, result_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    try:
        if request["family"] == "torch":
            result = _torch(request)
        else:
            result = _tensorflow(request)
        out = {"ok": True, **result}
    except Failed as exc:
        out = {
            "ok": False,
            "code": exc.code,
            "message": exc.message,
            "node": exc.node,
            "node_type": exc.node_type,
        }
    except MemoryError:
        out = {
            "ok": False,
            "code": "conversion_memory_limit",
            "message": "the conversion ran out of its memory limit",
        }
    Path(result_path).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
