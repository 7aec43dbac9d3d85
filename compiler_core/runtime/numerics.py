"""Non-finite outputs (NaN, +-inf): where they came from and what to do about it.

A run checks its float outputs only (`nonfinite_outputs`, one pass over each output). When one
holds a NaN or an infinity, the session runs the same inference again with a `FiniteProbe`
on the executor, which looks at every kernel's operands and results, and `diagnose` follows
the non-finite values back from the outputs to where they began: the first kernel (in program
order) whose inputs were all finite and whose results were not, or a graph input that carried
them in. Infinities that never reach an output (an attention mask's -inf) are not blamed.

The usual cause is float16's range (+-65504) under `-convert-to-fp16`: an activation that
float32 holds overflows. The fix is to keep the nodes of that kernel in float32 with
`-node-precision-info` (FP32NodeInstanceNames), which the report spells out.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from compiler_core.lowering.program import KIND_CONSTANT, Program, TensorDesc

FP16_MAX = 65504.0
_INSERTED_CAST = re.compile(r"/to_fp(16|32)(_\d+)?$")
"""The Casts -convert-to-fp16 adds at precision borders: not nodes of the user's model."""


@dataclass(frozen=True)
class Counts:
    """Non-finite values of one array (or of a kernel's results), and its finite range."""

    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    size: int = 0
    low: float | None = None
    """The smallest finite value (None: none was finite)."""
    high: float | None = None

    @property
    def bad(self) -> int:
        return self.nan + self.posinf + self.neginf

    def plus(self, other: Counts) -> Counts:
        return Counts(
            self.nan + other.nan,
            self.posinf + other.posinf,
            self.neginf + other.neginf,
            self.size + other.size,
            _min(self.low, other.low),
            _max(self.high, other.high),
        )

    def describe(self) -> str:
        parts = [
            f"{n:,} {what}"
            for n, what in ((self.nan, "NaN"), (self.posinf, "+inf"), (self.neginf, "-inf"))
            if n
        ]
        return ", ".join(parts) + f" of {self.size:,} values"


def count(array: np.ndarray) -> Counts:
    """The non-finite values of a float array and the range of its finite ones."""
    values = np.asarray(array)
    finite = np.isfinite(values)
    size = int(values.size)
    if finite.all():
        if size == 0:
            return Counts()
        return Counts(size=size, low=float(values.min()), high=float(values.max()))
    kept = values[finite]
    return Counts(
        nan=int(np.isnan(values).sum()),
        posinf=int(np.isposinf(values).sum()),
        neginf=int(np.isneginf(values).sum()),
        size=size,
        low=float(kept.min()) if kept.size else None,
        high=float(kept.max()) if kept.size else None,
    )


def is_float(array: Any) -> bool:
    return isinstance(array, np.ndarray) and array.dtype.kind == "f"


def nonfinite_outputs(outputs: Mapping[str, np.ndarray]) -> dict[str, Counts]:
    """The float outputs that hold a NaN or an infinity (cheap: one pass when all is well)."""
    found = {}
    for name, value in outputs.items():
        if is_float(value) and not np.isfinite(value).all():
            found[name] = count(value)
    return found


@dataclass
class KernelSeen:
    """What the probe saw of one kernel over all its tiles."""

    inputs: Counts = field(default_factory=Counts)
    results: Counts = field(default_factory=Counts)
    bad_inputs: dict[int, Counts] = field(default_factory=dict)
    """Operands that held non-finite values, by position in the kernel's `inputs`."""

    def suspects(self) -> list[int]:
        """The operands that explain the results: a NaN that came in stays NaN (so NaN
        results follow NaN operands only; an attention mask's -inf beside them is no
        cause); NaN made here, or infinities, follow the operands with infinities."""
        if self.results.nan:
            carried = [p for p, c in self.bad_inputs.items() if c.nan]
            if carried:
                return carried
        return [p for p, c in self.bad_inputs.items() if c.posinf or c.neginf or c.nan]


class FiniteProbe:
    """Called by the executor after each kernel's results are written (diagnosis runs only)."""

    def __init__(self) -> None:
        self.kernels: dict[int, KernelSeen] = {}

    def kernel(
        self, kernel: int, operands: Sequence[np.ndarray | None], results: Sequence[Any]
    ) -> None:
        seen = self.kernels.setdefault(kernel, KernelSeen())
        for position, operand in enumerate(operands):
            if is_float(operand):
                counted = count(operand)  # type: ignore[arg-type]
                seen.inputs = seen.inputs.plus(counted)
                if counted.bad:
                    before = seen.bad_inputs.get(position, Counts())
                    seen.bad_inputs[position] = before.plus(counted)
        for result in results:
            array = np.asarray(result)
            if array.dtype.kind == "f":
                seen.results = seen.results.plus(count(array))


@dataclass(frozen=True)
class Origin:
    """Where the non-finite values began."""

    kind: str
    """`kernel`, or `input` (a graph input carried them in), or `constant`."""
    name: str
    dtype: str
    kernel: int | None = None
    op_types: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()
    """The ONNX nodes of the kernel, as `-node-precision-info` names them."""
    inputs: Counts | None = None
    results: Counts | None = None


@dataclass(frozen=True)
class NumericsReport:
    outputs: dict[str, Counts]
    origin: Origin | None

    @property
    def fix(self) -> str:
        origin = self.origin
        if origin is None:
            return ""
        if origin.kind != "kernel":
            return f"check the values given for {origin.kind} {origin.name!r}"
        if origin.dtype == "float16" and origin.nodes:
            names = ", ".join(origin.nodes)
            return (
                "keep these nodes in float32: compile with -node-precision-info=<file.yaml>, "
                f"the file holding `FP32NodeInstanceNames: [{names}]`"
            )
        return (
            "the model computes this in float32 as well: check the inputs and the model "
            "(an overflow, or 0/0, log or sqrt of a negative)"
        )

    def message(self) -> str:
        shown = "; ".join(f"output {n!r} holds {c.describe()}" for n, c in self.outputs.items())
        origin = self.origin
        if origin is None:
            return f"{shown}; where they began could not be traced"
        if origin.kind != "kernel":
            return f"{shown}; they came in with {origin.kind} {origin.name!r}"
        assert origin.inputs is not None and origin.results is not None
        inputs = (
            f"finite, within [{_num(origin.inputs.low)}, {_num(origin.inputs.high)}]"
            if origin.inputs.size
            else "not float"
        )
        limit = f"; float16 holds at most +-{FP16_MAX:,.0f}" if origin.dtype == "float16" else ""
        return (
            f"{shown}. The first non-finite values came from kernel {origin.kernel} "
            f"{origin.name!r} ({'+'.join(origin.op_types)}), computed in "
            f"{origin.dtype}: its inputs were {inputs}, it produced "
            f"{origin.results.describe()}{_finite_part(origin.results)}{limit}"
        )

    def to_dict(self) -> dict[str, Any]:
        """A warning as compile reports them (`code`, `message`, `nodes`, `suggestion`) plus
        the counts per output and the origin."""
        origin = self.origin
        return {
            "code": "non_finite",
            "message": self.message(),
            "nodes": list(origin.nodes) if origin is not None else [],
            "suggestion": self.fix,
            "outputs": {name: asdict(c) for name, c in self.outputs.items()},
            "origin": asdict(origin) if origin is not None else None,
        }


class NonFiniteWarning(RuntimeWarning):
    """Issued by a run whose outputs hold NaN or infinities; `.report` says where from."""

    def __init__(self, report: NumericsReport) -> None:
        origin = report.origin
        nodes = f" (ONNX nodes: {', '.join(origin.nodes)})" if origin and origin.nodes else ""
        fix = f"; fix: {report.fix}" if report.fix else ""
        super().__init__(report.message() + nodes + fix)
        self.report = report


def warn(report: NumericsReport) -> None:
    warnings.warn(NonFiniteWarning(report), stacklevel=3)


def diagnose(program: Program, outputs: Mapping[str, Counts], probe: FiniteProbe) -> NumericsReport:
    """Follow the non-finite outputs back through the kernels the probe saw."""
    tensors = program.tensors
    producers: dict[int, list[int]] = {}
    for desc in program.kernels:
        for t in desc.outputs:
            producers.setdefault(t, []).append(desc.id)
    by_name = {tensors[t].name: t for t in program.outputs}
    origins: list[Origin] = []
    seen: set[int] = set()
    # (tensor, the kernel that read it: None for a graph output)
    stack: list[tuple[int, int | None]] = [
        (by_name[name], None) for name in outputs if name in by_name
    ]
    while stack:
        tensor, reader = stack.pop()
        if tensor in seen:
            continue
        seen.add(tensor)
        makers = [k for k in producers.get(tensor, []) if k in probe.kernels]
        held = tensors[tensor]
        if not makers and tensor not in program.inputs and held.kind != KIND_CONSTANT:
            makers = _alias_root(program, probe, held, reader)
        if not makers:
            kind = "input" if tensor in program.inputs else held.kind
            origins.append(Origin(kind=str(kind), name=held.name, dtype=held.dtype))
            continue
        for k in makers:
            found = probe.kernels[k]
            if not found.results.bad:
                continue
            if found.bad_inputs:
                inputs = program.kernels[k].inputs
                stack.extend((inputs[p], k) for p in found.suspects() if inputs[p] >= 0)
            else:
                origins.append(_kernel_origin(program, k, found))
    kernels = sorted((o for o in origins if o.kernel is not None), key=lambda o: o.kernel or 0)
    first = kernels[0] if kernels else (origins[0] if origins else None)
    return NumericsReport(dict(outputs), first)


def _alias_root(
    program: Program, probe: FiniteProbe, tensor: TensorDesc, reader: int | None
) -> list[int]:
    """A tensor no kernel writes is another's bytes under a new shape (Reshape, Flatten: the
    program keeps no link). Its writer is taken to be the last kernel before the reader that
    wrote non-finite values into a tensor of the same dtype and size."""
    last = len(program.kernels) - 1 if reader is None else reader - 1
    for k in range(last, -1, -1):
        found = probe.kernels.get(k)
        if found is None or not found.results.bad:
            continue
        outs = (program.tensors[t] for t in program.kernels[k].outputs)
        if any(t.dtype == tensor.dtype and t.nbytes == tensor.nbytes for t in outs):
            return [k]
    return []


def _kernel_origin(program: Program, kernel: int, seen: KernelSeen) -> Origin:
    desc = program.kernels[kernel]
    nodes = tuple(
        name
        for name, op in zip(desc.nodes, desc.op_types, strict=False)
        if not (op == "Cast" and _INSERTED_CAST.search(name))
    )
    dtype = desc.info.out_dtypes[0] if desc.info.out_dtypes else ""
    return Origin(
        kind="kernel",
        name=desc.name,
        dtype=str(dtype),
        kernel=kernel,
        op_types=tuple(desc.op_types),
        nodes=nodes,
        inputs=seen.inputs,
        results=seen.results,
    )


def _finite_part(counts: Counts) -> str:
    if counts.low is None or counts.high is None:
        return " (no finite result)"
    return f" (its finite results within [{_num(counts.low)}, {_num(counts.high)}])"


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.6g}"


def _min(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _max(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)
