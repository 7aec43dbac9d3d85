"""Joined row bands (compiler_core/runtime/joins.py): a conv's thin row bands, or a MatMul's
row bands, whose inputs are final before their own turn are computed in one product at an
earlier tile's turn, learned over a session's first inferences; each tile still compares its
input at its own turn, so the answers are bit for bit the tiles' own and a missing wait
still shows."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_core.lowering.program import SemWait
from compiler_core.runtime.executor import Executor
from compiler_core.runtime.joins import Join, JoinTile
from tests.runtime_helpers import blas_splits_exactly, compiled_program

VTCM = 8_323_072
RNG = np.random.default_rng(3)
SHAPE = (1, 64, 14, 14)


def _bottleneck() -> onnx.ModelProto:
    """3x3, 1x1 and 3x3 convs with a residual Add over a 14x14 image (ResNet's layer 3
    shape: a band of one or two rows is 14 or 28 output positions)."""
    w1 = RNG.standard_normal((64, 64, 3, 3)).astype(np.float32) * 0.05
    w2 = RNG.standard_normal((128, 64, 1, 1)).astype(np.float32) * 0.1
    w3 = RNG.standard_normal((64, 128, 3, 3)).astype(np.float32) * 0.05
    b1 = RNG.standard_normal(64).astype(np.float32)
    b2 = RNG.standard_normal(128).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c1"], ["r1"]),
            helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"]),
            helper.make_node("Relu", ["c2"], ["r2"]),
            helper.make_node("Conv", ["r2", "w3"], ["c3"], pads=[1, 1, 1, 1]),
            helper.make_node("Add", ["c3", "x"], ["y"]),
        ],
        "bottleneck",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(SHAPE))],
        [
            numpy_helper.from_array(w, name)
            for w, name in ((w1, "w1"), (w2, "w2"), (w3, "w3"), (b1, "b1"), (b2, "b2"))
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


MLP_SHAPE = (1, 128, 256)


def _mlp() -> onnx.ModelProto:
    """A transformer's feed-forward block: MatMul + bias + Relu, MatMul + residual Add (the
    second MatMul's tiles read row bands of the first's output, gathered from the cores)."""
    w1 = RNG.standard_normal((256, 1024)).astype(np.float32) * 0.05
    w2 = RNG.standard_normal((1024, 256)).astype(np.float32) * 0.05
    b = RNG.standard_normal(1024).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("Add", ["h", "b"], ["hb"]),
            helper.make_node("Relu", ["hb"], ["r"]),
            helper.make_node("MatMul", ["r", "w2"], ["o"]),
            helper.make_node("Add", ["o", "x"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(MLP_SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(MLP_SHAPE))],
        [numpy_helper.from_array(w, name) for w, name in ((w1, "w1"), (w2, "w2"), (b, "b"))],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


MODELS = {"conv": (_bottleneck, SHAPE), "matmul": (_mlp, MLP_SHAPE)}


def _joins(executor: Executor) -> list[Join]:
    found = {id(t.join): t.join for t in executor._shared.values() if isinstance(t, JoinTile)}
    return list(found.values())


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.mark.parametrize("cores", [4, 14])
@pytest.mark.parametrize("kind", ["conv", "matmul"])
def test_joined_bands_give_each_tile_its_own_product_bit_for_bit(kind: str, cores: int) -> None:
    build, shape = MODELS[kind]
    model = build()
    program, constants = compiled_program(model, f"-aic-num-cores={cores}")
    joined = Executor(program, constants, VTCM)
    alone = Executor(program, constants, VTCM, shared_products=False)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for _ in range(4):  # the second inference learns which bands join, the third uses them
        feeds = {"x": RNG.standard_normal(shape).astype(np.float32)}
        got = joined.run(feeds)["y"]
        np.testing.assert_array_equal(_bits(got), _bits(alone.run(feeds)["y"]))
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=1e-4, atol=1e-4)
        assert [t.as_row() for t in joined.traffic] == [t.as_row() for t in alone.traffic]
    joins = _joins(joined)
    assert joins and any(j.joins for j in joins), "no band joined another's product"
    assert all(j.matmul == (kind == "matmul") for j in joins)
    if kind == "conv":
        # each join took parts, or its first check found that BLAS sums the joined product
        # otherwise than a band's (OpenBLAS's Haswell kernels do; its SkylakeX ones do not)
        assert all(j.taken or j.off for j in joins)
        if blas_splits_exactly(196, 576, 64, bands=14, by_rows=True):
            assert sum(j.taken for j in joins if not j.off) > 0
            if cores == 14:  # the 1x1 conv's bands are read into the product's matrix
                assert any(j.pointwise and j.taken and not j.off for j in joins)
    else:  # every band's input is final at the first tile's turn: one product
        assert any(len(j.batches) == 1 for j in joins)
        # each join took parts, or its first check found that BLAS sums the joined product
        # otherwise than a band's (OpenBLAS's Haswell kernels do; its SkylakeX ones do not)
        assert all(j.taken or j.off for j in joins)


@pytest.mark.parametrize("kind", ["conv", "matmul"])
def test_without_its_waits_a_program_with_joins_computes_what_its_tiles_would_alone(
    kind: str,
) -> None:
    """A program whose semaphore waits are gone reads inputs other cores have not written
    yet. Even told that every band joins the first tile's product, each tile compares its
    own input with the one the product used, so the (wrong) answer is the one every tile
    computing alone gives."""
    build, shape = MODELS[kind]
    model = build()
    program, constants = compiled_program(model, "-aic-num-cores=14")
    broken = dataclasses.replace(
        program, streams=[[i for i in s if not isinstance(i, SemWait)] for s in program.streams]
    )
    joined = Executor(broken, constants, VTCM)
    alone = Executor(broken, constants, VTCM, shared_products=False)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": RNG.standard_normal(shape).astype(np.float32)}
    joined.run(feeds)  # records each kernel's order of turns
    joins = _joins(joined)
    assert joins
    for join in joins:  # as if learned: every band joins the first turn's product
        join.joins, join.done = {m: 0 for m in join.order[1:]}, True
    for _ in range(2):
        feeds = {"x": RNG.standard_normal(shape).astype(np.float32)}
        got = joined.run(feeds)["y"]
        np.testing.assert_array_equal(_bits(got), _bits(alone.run(feeds)["y"]))
    assert not np.allclose(got, session.run(None, feeds)[0], rtol=1e-4, atol=1e-4)
    assert sum(j.taken for j in joins) < sum(2 * len(j.joins) for j in joins)


@pytest.mark.parametrize("kind", ["conv", "matmul"])
def test_without_its_waits_a_tile_whose_part_was_checked_still_compares_its_input(
    kind: str,
) -> None:
    """As above, with every tile's part taken as checked already (as after a session's
    first inferences), so only each tile's compare of its input with the product's stands
    between a missing wait and a lucky answer: the answer is still the tiles' own (up to
    the rounding of products of other shapes, which the check would have caught)."""
    build, shape = MODELS[kind]
    model = build()
    program, constants = compiled_program(model, "-aic-num-cores=14")
    broken = dataclasses.replace(
        program, streams=[[i for i in s if not isinstance(i, SemWait)] for s in program.streams]
    )
    joined = Executor(broken, constants, VTCM)
    alone = Executor(broken, constants, VTCM, shared_products=False)
    feeds = {"x": RNG.standard_normal(shape).astype(np.float32)}
    joined.run(feeds)
    joins = _joins(joined)
    for join in joins:
        join.joins, join.done = {m: 0 for m in join.order[1:]}, True
        for member in join.members:
            member.checked = True
    for _ in range(2):
        feeds = {"x": RNG.standard_normal(shape).astype(np.float32)}
        want = alone.run(feeds)["y"]
        np.testing.assert_allclose(joined.run(feeds)["y"], want, rtol=1e-5, atol=1e-5)
    assert sum(j.taken for j in joins) < sum(2 * len(j.joins) for j in joins)


def test_a_tile_run_out_of_the_learned_order_turns_its_convs_joins_off() -> None:
    model = _bottleneck()
    program, constants = compiled_program(model, "-aic-num-cores=14")
    executor = Executor(program, constants, VTCM)
    feeds = {"x": RNG.standard_normal(SHAPE).astype(np.float32)}
    executor.run(feeds)
    join = next(j for j in _joins(executor) if len(j.order) > 1)
    join.order[0], join.order[1] = join.order[1], join.order[0]
    want = Executor(program, constants, VTCM, shared_products=False).run(feeds)["y"]
    np.testing.assert_array_equal(_bits(executor.run(feeds)["y"]), _bits(want))
    assert join.off
