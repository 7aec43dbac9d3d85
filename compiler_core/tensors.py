"""Small helpers for the IR's tensors that several stages share."""

from __future__ import annotations

import os
from typing import Any, BinaryIO

import onnx_ir as ir

from compiler_core.errors import CompileError


def release_mapping(tensor: object) -> None:
    """Unmap a memory-mapped external tensor's pages once they have been read.

    A view still alive elsewhere keeps the mapping (Python refuses to close it); the pages
    are then freed with the last view, so this never fails.
    """
    if isinstance(tensor, ir.ExternalTensor):
        try:
            tensor.release()
        except BufferError:
            pass


SMALL_TENSOR_BYTES = 64 * 1024
"""External tensors up to this size are read into memory at import instead of mapped:
touching a mapped file can bring in a whole 2 MiB huge page for a few bytes."""


def read_external(tensor: ir.ExternalTensor, files: dict[str, BinaryIO] | None = None) -> ir.Tensor:
    """The tensor's bytes read with a plain file read (no mapping), as an in-memory tensor.
    `files`: open files by path, shared by the reads of one graph (a model's 160 small
    weights in its own file: one open instead of 160)."""
    import numpy as np

    path = str(tensor.path)
    if files is None:
        with open(path, "rb") as own:
            raw = _read_at(own, tensor)
    else:
        shared = files.get(path)
        if shared is None:
            shared = files[path] = open(path, "rb")  # noqa: SIM115 - closed by the caller
        raw = _read_at(shared, tensor)
    dtype = np.dtype(tensor.dtype.numpy()).newbyteorder("<")
    array = np.frombuffer(raw, dtype=dtype, count=tensor.size).reshape(tensor.shape.numpy())
    return ir.Tensor(array.astype(array.dtype.newbyteorder("=")), name=tensor.name)


def read_into(
    tensor: ir.ExternalTensor, out: Any, files: dict[str, BinaryIO], skip: int = 0
) -> None:
    """The tensor's bytes as stored in its file, from byte `skip` on, read into `out` (a
    writable buffer, filled): a caller that reuses one buffer touches no new pages per
    tensor. `files`: open files by path (see `read_external`), closed by the caller."""
    path = str(tensor.path)
    source = files.get(path)
    if source is None:
        source = files[path] = open(path, "rb", buffering=0)  # noqa: SIM115 - see above
    view = memoryview(out).cast("B")
    done, offset = 0, (tensor.offset or 0) + skip
    while done < len(view):
        got = os.preadv(source.fileno(), [view[done:]], offset + done)
        if not got:
            raise CompileError(
                "external_data_missing",
                f"external data file '{tensor.location}' ends before tensor {tensor.name!r} does",
            )
        done += got


def _read_at(source: BinaryIO, tensor: ir.ExternalTensor) -> bytes:
    """The tensor's bytes; a file that ends before them (the import checks lengths first,
    but a file can change after) is the same clear error as `read_into`'s."""
    source.seek(tensor.offset or 0)
    raw = source.read(tensor.nbytes)
    if len(raw) < tensor.nbytes:
        raise CompileError(
            "external_data_missing",
            f"external data file '{tensor.location}' ends before tensor {tensor.name!r} does",
        )
    return raw


def load_small_external(graph: ir.Graph, limit: int = SMALL_TENSOR_BYTES) -> int:
    """Replace external tensors by in-memory copies; returns how many were read.

    Read: every initializer of the main graph up to `limit` bytes, and every tensor attribute
    except the `value` of a main-graph Constant larger than `limit` (a weight: it stays
    mapped, like a large initializer). Subgraph tensors are read whatever their size: a body
    travels in the QPC serialized, and must not refer to a file.
    """
    files: dict[str, BinaryIO] = {}
    try:
        return _load_small(graph, limit, files)
    finally:
        for source in files.values():
            source.close()


def _load_small(graph: ir.Graph, limit: int, files: dict[str, BinaryIO]) -> int:
    count = 0
    for value in graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor) and tensor.nbytes <= limit:
            value.const_value = read_external(tensor, files)
            count += 1
    for node in ir.traversal.RecursiveGraphIterator(graph):
        in_main = node.graph is graph
        for name, attr in list(node.attributes.items()):
            if attr.type == ir.AttributeType.GRAPH and attr.value is not None:
                count += _load_initializers(attr.as_graph(), files)
            elif attr.type == ir.AttributeType.GRAPHS:
                count += sum(_load_initializers(body, files) for body in attr.as_graphs())
            if attr.type != ir.AttributeType.TENSOR:
                continue
            tensor = attr.as_tensor()
            if not isinstance(tensor, ir.ExternalTensor):
                continue
            if in_main and node.op_type == "Constant" and tensor.nbytes > limit:
                continue
            node.attributes[name] = ir.AttrTensor(name, read_external(tensor, files))
            count += 1
    return count


def _load_initializers(body: ir.Graph, files: dict[str, BinaryIO]) -> int:
    count = 0
    for value in body.initializers.values():
        if isinstance(value.const_value, ir.ExternalTensor):
            value.const_value = read_external(value.const_value, files)
            count += 1
    return count
