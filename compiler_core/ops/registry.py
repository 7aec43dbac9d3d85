"""The op registry: the one place that says which ONNX ops we support and how.

Each entry answers four questions for one op type: which opsets and element types it accepts
(the importer's check and `-operators-supported`), how its output can be cut into tiles and
which part of each input a tile needs (lowering), what it costs (the cost model), and what it
computes (the runtime kernel, which is also what constant folding runs).

Entries are registered by the op modules of this package when they are imported, and they are
imported on demand: `compiler_core/ops/index.py`, generated from the entries themselves
(`python -m compiler_core.ops.index_builder`; a test fails when it is stale), says which
module registers each op type, so the registry knows every op's name without importing a
kernel, and a compile imports only the modules of the ops its graph uses.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from compiler_core.errors import CompileError

Box = tuple[tuple[int, int], ...]
"""A rectangular region of a tensor: one half-open [start, stop) range per axis."""


def box_elements(box: Box) -> int:
    if len(box) == 4:  # a feature map's box, unrolled (thousands of calls per compile)
        (a0, a1), (b0, b1), (c0, c1), (d0, d1) = box
        return (a1 - a0) * (b1 - b0) * (c1 - c0) * (d1 - d0)
    n = 1
    for start, stop in box:
        n *= stop - start
    return n


Shape = tuple[int, ...]

FLOATS = frozenset({"float16", "float32", "float64"})
SIGNED = frozenset({"int8", "int16", "int32", "int64"})
UNSIGNED = frozenset({"uint8", "uint16", "uint32", "uint64"})
INTS = SIGNED | UNSIGNED
NUMERIC = FLOATS | INTS
BOOL = frozenset({"bool"})
ALL = NUMERIC | BOOL


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(d)) for d in shape)


def box_shape(box: Box) -> Shape:
    return tuple(stop - start for start, stop in box)


@dataclass(frozen=True)
class NodeInfo:
    """A node as kernels see it: attributes as Python values and every static shape and dtype.

    Independent of the IR, so the runtime can rebuild it from a QPC alone.
    `attrs` holds ints, floats, strings, lists of those and numpy arrays (tensor attributes).
    A missing optional input has shape and dtype None.
    """

    op_type: str
    name: str
    attrs: dict[str, Any]
    in_shapes: tuple[Shape | None, ...]
    in_dtypes: tuple[str | None, ...]
    out_shapes: tuple[Shape, ...]
    out_dtypes: tuple[str, ...]
    opset: int = 17
    domain: str = ""
    consts: dict[int, np.ndarray] = field(default_factory=dict)
    """Values of the small constant inputs (axes, pads, shapes, starts, scales...), by input
    index, so that tiling rules can use them; kernels still receive them in `inputs` too."""
    derived: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """What tiling rules work out from the attributes once (a conv's windows), kept here
    because the split chooser asks for thousands of tiles of the same node."""

    def once(self, key: str, compute: Callable[[], Any]) -> Any:
        found = self.derived.get(key)
        if found is None:
            found = self.derived[key] = compute()
        return found

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    def has_input(self, index: int) -> bool:
        return index < len(self.in_shapes) and self.in_shapes[index] is not None

    def choice(self, name: str, default: str, choices: Sequence[str]) -> str:
        """A string attribute that must be one of `choices` (an `invalid_model` otherwise)."""
        value = self.attrs.get(name, default)
        value = value.decode() if isinstance(value, bytes) else str(value)
        if value not in choices:
            raise invalid_model(self, f"{name} {value!r} is not one of {', '.join(choices)}")
        return value


def invalid_model(node: NodeInfo, message: str) -> CompileError:
    """The error for a node whose attributes or shapes its op does not accept."""
    return CompileError("invalid_model", f"{node.op_type}: {message}", node=node.name)


@dataclass(frozen=True)
class TileCtx:
    """Where a tile sits: the output box it produces and the input boxes it was given.

    Kernels that need positions (padding in Conv, windows in pooling) read them from here;
    pure elementwise kernels ignore it. `in_boxes[i]` is None for an input given whole.
    """

    out_box: Box
    in_boxes: tuple[Box | None, ...]

    @staticmethod
    def whole(node: NodeInfo) -> TileCtx:
        return TileCtx(
            out_box=full_box(node.out_shapes[0]),
            in_boxes=tuple(None if s is None else full_box(s) for s in node.in_shapes),
        )


Compute = Callable[[NodeInfo, list[np.ndarray | None], TileCtx], list[np.ndarray]]
SplitAxes = Callable[[NodeInfo], list[int]]
InputBoxes = Callable[[NodeInfo, Box], list[Box | None]]
GridInputBoxes = Callable[
    [NodeInfo, Sequence[Sequence[tuple[int, int]]]], Iterator[list[Box | None]]
]
Macs = Callable[[NodeInfo], int]


@dataclass(frozen=True)
class HmxShape:
    """What one tile asks of the HMX array: `repeats` matrix products of `positions` output
    positions by `depth` reduction elements by `channels` output channels (a Conv tap per
    repeat, or a batch of independent MatMuls). The array works in fixed blocks, so a tile
    whose dimensions are not multiples of them wastes part of it (see cost_rates)."""

    positions: int
    depth: int
    channels: int
    repeats: int = 1

    @property
    def macs(self) -> int:
        return self.positions * self.depth * self.channels * self.repeats


TileHmx = Callable[[NodeInfo, Box], HmxShape]


def no_split(node: NodeInfo) -> list[int]:
    return []


def whole_inputs(node: NodeInfo, out_box: Box) -> list[Box | None]:
    return [None if s is None else full_box(s) for s in node.in_shapes]


def no_macs(node: NodeInfo) -> int:
    return 0


def output_elements(node: NodeInfo) -> int:
    return sum(int(np.prod(s, dtype=np.int64)) for s in node.out_shapes)


@dataclass(frozen=True)
class OpDef:
    """One supported op type. `until` is the last opset this definition covers (None: latest)."""

    op_type: str
    compute: Compute
    since: int = 1
    until: int | None = None
    dtypes: frozenset[str] = FLOATS
    domain: str = ""
    kernel: str = ""
    unit: str = "hvx"
    split_axes: SplitAxes = no_split
    input_boxes: InputBoxes = whole_inputs
    grid_input_boxes: GridInputBoxes | None = None
    """`input_boxes` of every tile of a grid cut (per output axis, its ranges), in
    `itertools.product` order; for ops whose input boxes are worked out axis by axis, so that
    each axis's part is computed once per range, not once per tile (the split chooser builds
    thousands of tiles). None: `input_boxes` per tile."""
    macs: Macs = output_elements
    hmx_shape: TileHmx | None = None
    """For HMX ops: the matrix-product shape of a tile (None: priced at full efficiency)."""
    indexed_inputs: frozenset[int] = frozenset()
    """Inputs read by index (Gather's data): when such an input is a weight in DDR, a tile
    needs only the slices its indices name, which a gather DMA fetches, not its whole box."""
    output_boxes: Callable[[NodeInfo, Box], list[Box]] | None = None
    """For ops with several outputs: each output's box in a tile cut from output 0's (None:
    such an op runs whole)."""
    output_in_ddr: bool = False
    """The output is written to DDR by a DMA straight from the input tiles (a scatter into
    retained state done in place, see ops/in_place_scatter.py): it takes no VTCM."""
    ddr_to_ddr: bool = False
    """The op moves its input's bytes DDR to DDR by DMA (link transfers between devices, see
    ops/collective.py): nothing passes through VTCM, so it fits at any size and is never
    cut into tiles for the VTCM budget."""
    alias: bool = False
    """The output is the input's bytes reinterpreted (Reshape, Squeeze...): no kernel runs."""
    elementwise: bool = False
    """Output element i depends only on element i of each (broadcast) input: may be fused as
    an epilogue of the op that produces its first input."""
    same_shape: bool = False
    """Output 0 has input 0's shape: the importer fills it in where ONNX shape inference
    leaves it open (it knows types but not shapes of several ai.onnx.ml ops)."""
    doc: str = ""
    tags: frozenset[str] = field(default_factory=frozenset)

    @property
    def kernel_name(self) -> str:
        return self.kernel or self.op_type.lower()


OpKey = tuple[str, str]
"""(domain, op_type), the domain as registered ("" for the default one)."""


class OpRegistry:
    """OpDefs by op type. With an `index` (op key -> the modules that register it, in
    registration order), an op's modules are imported the first time it is looked up."""

    def __init__(self, index: Mapping[OpKey, Sequence[str]] | None = None) -> None:
        self._ops: dict[OpKey, list[OpDef]] = {}
        self._index = dict(index or {})
        # Keys whose modules may not be imported yet (shrinks to empty).
        self._pending = {key: tuple(modules) for key, modules in self._index.items()}

    def add(self, opdef: OpDef) -> OpDef:
        self._ops.setdefault((opdef.domain, opdef.op_type), []).append(opdef)
        return opdef

    def lookup(self, op_type: str, domain: str = "", opset: int | None = None) -> OpDef | None:
        key = (norm_domain(domain), op_type)
        if key in self._pending:
            self._load(key)
        for opdef in self._ops.get(key, ()):
            if opset is None:
                return opdef
            if opdef.since <= opset and (opdef.until is None or opset <= opdef.until):
                return opdef
        return None

    def versions(self, op_type: str, domain: str = "") -> list[OpDef]:
        key = (norm_domain(domain), op_type)
        if key in self._pending:
            self._load(key)
        return list(self._ops.get(key, ()))

    def all(self) -> list[OpDef]:
        """Every entry, by (domain, op type); imports every op module."""
        for key in list(self._pending):
            self._load(key)
        return [d for key in sorted(self._ops) for d in self._ops[key]]

    def op_types(self) -> frozenset[str]:
        """The names of the supported op types (any domain), without importing a kernel."""
        return frozenset(op for _, op in (*self._index, *self._ops))

    def _load(self, key: OpKey) -> None:
        # Python's import lock makes a thread that asks for a module another thread is
        # importing wait until its registrations are complete; only then is the key done.
        for module in self._pending.get(key, ()):
            importlib.import_module(f"{__package__}.{module}")
        self._pending.pop(key, None)


SMALL_CONST_ELEMENTS = 4096
"""Constant inputs up to this many elements are handed to tiling rules by value."""

OUTER_SCOPE = "qpcfarm.outer_scope"
"""NodeInfo attribute of a node with subgraphs: the names of its extra, outer-scope inputs."""


QPCFARM_DOMAIN = "com.qpcfarm"
"""The domain of the compiler's own ops (the int8 kernels that QDQ groups fold into)."""


def norm_domain(domain: str) -> str:
    """ "ai.onnx" and "" name the same (default) domain."""
    return "" if domain in ("", "ai.onnx") else domain


def _index() -> Mapping[OpKey, Sequence[str]]:
    from compiler_core.ops.index import OP_MODULES

    return OP_MODULES


REGISTRY = OpRegistry(_index())
"""Filled as op modules are imported (on first lookup of one of their ops), never changed after."""


def register(op_type: str, compute: Compute, **kwargs: Any) -> OpDef:
    return REGISTRY.add(OpDef(op_type=op_type, compute=compute, **kwargs))
