"""Shared products (compiler_core/runtime/shared.py): the tiles of a MatMul or Conv split
over cores along its constant weight compute one product and each take their part, only
when the tile would have read the same bytes; the answers are bit for bit the tiles' own."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_core.lowering.program import SemWait
from compiler_core.ops import REGISTRY, TileCtx
from compiler_core.ops.registry import NodeInfo
from compiler_core.runtime.executor import Executor
from compiler_core.runtime.shared import Compute, Group, SharedTile
from tests.runtime_helpers import blas_splits_exactly, compiled_program

VTCM = 8_323_072
RNG = np.random.default_rng(7)


def _projection() -> onnx.ModelProto:
    """Two weight-split MatMuls (the second reads the first's all-gathered output)."""
    w1 = RNG.standard_normal((256, 512)).astype(np.float32) * 0.1
    w2 = RNG.standard_normal((512, 192)).astype(np.float32) * 0.1
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("MatMul", ["r", "w2"], ["y"]),
        ],
        "projection",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 128, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 128, 192])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _pointwise_convs() -> onnx.ModelProto:
    """1x1 and 3x3 convolutions with many output channels over a small image."""
    w1 = RNG.standard_normal((512, 64, 1, 1)).astype(np.float32)
    w2 = RNG.standard_normal((256, 512, 3, 3)).astype(np.float32) * 0.05
    b2 = RNG.standard_normal(256).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("Conv", ["r", "w2", "b2"], ["y"], pads=[1, 1, 1, 1]),
        ],
        "pointwise",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 7, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256, 7, 7])],
        [
            numpy_helper.from_array(w1, "w1"),
            numpy_helper.from_array(w2, "w2"),
            numpy_helper.from_array(b2, "b2"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, feeds)[0])


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.mark.parametrize(
    ("model", "shape", "cores"),
    [
        (_projection, (1, 128, 256), 4),
        (_projection, (1, 128, 256), 14),
        (_pointwise_convs, (1, 64, 7, 7), 14),
    ],
)
def test_weight_split_tiles_take_their_parts_of_one_product_bit_for_bit(
    model: object, shape: tuple[int, ...], cores: int
) -> None:
    onnx_model = model()  # type: ignore[operator]
    program, constants = compiled_program(onnx_model, f"-aic-num-cores={cores}")
    shared = Executor(program, constants, VTCM)
    alone = Executor(program, constants, VTCM, shared_products=False)
    for _ in range(2):  # a second inference recomputes the product from its own inputs
        feeds = {"x": RNG.standard_normal(shape).astype(np.float32)}
        got, own = shared.run(feeds)["y"], alone.run(feeds)["y"]
        np.testing.assert_array_equal(_bits(got), _bits(own))
        np.testing.assert_allclose(got, _ort(onnx_model, feeds), rtol=1e-4, atol=1e-4)
        assert [t.as_row() for t in shared.traffic] == [t.as_row() for t in alone.traffic]
    assert shared._shared, "no tiles share a product"


def test_large_weight_split_products_are_computed_once() -> None:
    """BERT-sized thin products (each tile 128 x 256 x 128) sum as the whole product does:
    after the first inference's check every tile takes its part."""
    program, constants = compiled_program(_projection(), "-aic-num-cores=4")
    executor = Executor(program, constants, VTCM)
    for _ in range(2):
        executor.run({"x": RNG.standard_normal((1, 128, 256)).astype(np.float32)})
    # a row band's tiles may join other bands (joins.py), from the third inference on:
    # until then a joining tile that shares computes in its group
    found = [
        t if isinstance(t, SharedTile) else t.join.members[t.member].fallback
        for t in executor._shared.values()
    ]
    tiles = [t for t in found if t is not None]
    groups = {id(t.group): t.group for t in tiles}
    assert groups
    if blas_splits_exactly(128, 256, 512, bands=4, by_rows=False):
        assert not any(g.off for g in groups.values())
        assert sum(g.taken for g in groups.values()) == 2 * len(tiles)
    else:  # the first inference's check finds each group's parts differ: all compute alone
        assert all(g.off and g.taken == 0 for g in groups.values())


def test_without_its_waits_a_program_computes_what_its_tiles_would_alone() -> None:
    """A program whose semaphore waits are gone reads stale or unwritten activations: each
    tile compares what it reads with the group's, so the (wrong) answer is the one every
    tile computing alone gives."""
    onnx_model = _projection()
    program, constants = compiled_program(onnx_model, "-aic-num-cores=4")
    broken = dataclasses.replace(
        program, streams=[[i for i in s if not isinstance(i, SemWait)] for s in program.streams]
    )
    feeds = {"x": RNG.standard_normal((1, 128, 256)).astype(np.float32)}
    got = Executor(broken, constants, VTCM).run(feeds)["y"]
    own = Executor(broken, constants, VTCM, shared_products=False).run(feeds)["y"]
    np.testing.assert_array_equal(_bits(got), _bits(own))
    assert not np.allclose(got, _ort(onnx_model, feeds), rtol=1e-4, atol=1e-4)


def _matmul_group(
    w: np.ndarray, x_shape: tuple[int, ...], compute: Compute | None = None
) -> tuple[Group, list[SharedTile]]:
    """A group of two tiles, each half of `w`'s columns, as `plan` makes it."""
    opdef = REGISTRY.lookup("MatMul", "", 17)
    assert opdef is not None
    rows, cols = x_shape[-2], w.shape[1]
    info = NodeInfo(
        op_type="MatMul",
        name="mm",
        attrs={},
        in_shapes=(x_shape, w.shape),
        in_dtypes=("float32", "float32"),
        out_shapes=((*x_shape[:-1], cols),),
        out_dtypes=("float32",),
        opset=17,
    )
    x_box = tuple((0, d) for d in x_shape)
    out_box = ((0, rows), (0, cols))
    group = Group(
        op_type="MatMul",
        info=info,
        compute=compute or opdef.compute,
        constant=(1,),
        union=[None, w],
        tile=TileCtx(out_box=out_box, in_boxes=(x_box, ((0, w.shape[0]), (0, cols)))),
        out_box=out_box,
    )
    half = cols // 2
    tiles = []
    for lo, hi in ((0, half), (half, cols)):
        part = w[:, lo:hi]
        expected = ((1, part.__array_interface__["data"][0], part.shape, part.strides, part.dtype),)
        tile = TileCtx(out_box=((0, rows), (lo, hi)), in_boxes=(x_box, ((0, w.shape[0]), (lo, hi))))
        tiles.append(SharedTile(group, expected, (slice(0, rows), slice(lo, hi)), tile))
    return group, tiles


def _by_element(info: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx) -> list[np.ndarray]:
    """A MatMul that sums each output element alone (no BLAS), so a column block's product
    is the whole product's part bit for bit on every machine."""
    a, b = inputs
    assert a is not None and b is not None
    return [np.einsum("...ij,jk->...ik", a, b)]


def test_a_tile_takes_its_part_only_with_the_same_activation_and_the_weight_in_place() -> None:
    w = RNG.standard_normal((16, 8)).astype(np.float32)
    w.flags.writeable = False
    x = RNG.standard_normal((5, 16)).astype(np.float32)
    group, (first, second) = _matmul_group(w, x.shape, _by_element)
    part = first.results([x, w[:, :4]], inference=1)
    assert part is not None
    np.testing.assert_array_equal(_bits(part[0]), _bits(np.einsum("ij,jk->ik", x, w[:, :4])))
    # the same bytes: its part, bit for bit what its own product gives
    same = second.results([x.copy(), w[:, 4:]], inference=1)
    assert same is not None
    np.testing.assert_array_equal(_bits(same[0]), _bits(np.einsum("ij,jk->ik", x, w[:, 4:])))
    # one bit of the activation differs, or -0.0 for 0.0: it computes alone
    flipped = x.copy()
    flipped.view(np.uint32)[2, 3] ^= 1
    assert second.results([flipped, w[:, 4:]], inference=1) is None
    zeros = np.zeros_like(x)
    group.inference = -1
    assert first.results([zeros, w[:, :4]], inference=2) is not None
    assert second.results([-zeros, w[:, 4:]], inference=2) is None
    # the weight's values, but not the constant in place (a copy in VTCM): alone
    assert second.results([zeros, np.array(w[:, 4:])], inference=2) is None
    # the next inference does not reuse this one's product
    assert second.results([x, w[:, 4:]], inference=3) is not None
    assert group.inference == 3


def test_a_tile_of_equal_weight_columns_computes_alone() -> None:
    """MatMul computes one column of a weight whose columns are all equal and repeats it;
    such a tile keeps doing so (its outputs stay exactly equal)."""
    w = RNG.standard_normal((16, 8)).astype(np.float32)
    w[:, 4:] = 0.25
    w.flags.writeable = False
    x = RNG.standard_normal((5, 16)).astype(np.float32)
    _, (first, second) = _matmul_group(w, x.shape)
    assert first.results([x, w[:, :4]], inference=1) is not None
    assert second.results([x, w[:, 4:]], inference=1) is None


def test_a_part_that_differs_from_the_tiles_own_product_turns_the_group_off() -> None:
    """A BLAS that sums a wide product in another order than a thin one (here: a kernel
    that rounds by the product's width) gives a tile its own product, and the group is
    not used again in the session."""
    w = RNG.standard_normal((16, 8)).astype(np.float32)
    w.flags.writeable = False
    x = RNG.standard_normal((5, 16)).astype(np.float32)

    def by_width(
        info: NodeInfo, inputs: list[np.ndarray | None], tile: TileCtx
    ) -> list[np.ndarray]:
        a, b = inputs
        assert a is not None and b is not None
        return [(a @ b) * np.float32(1 + 2**-20 * b.shape[1])]

    group, (first, second) = _matmul_group(w, x.shape, by_width)
    got = first.results([x, w[:, :4]], inference=1)
    assert got is not None
    np.testing.assert_array_equal(
        _bits(got[0]), _bits(by_width(group.info, [x, w[:, :4]], first.tile)[0])
    )
    assert group.off and group.taken == 0
    assert second.results([x, w[:, 4:]], inference=1) is None
