"""A kernel's last epilogue step (Relu, Add, Sub, Mul, Div) written straight into its output
tile by the runtime (compiler_core/runtime/executor.py `_write_fused`), and an earlier
arithmetic step computed by its ufunc (`_direct_step`), give the bytes the step's own
compute (followed by the copy into VTCM) gives, special values and broadcasts included."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_core.lowering.program import EpilogueDesc
from compiler_core.ops import REGISTRY, TileCtx
from compiler_core.ops.registry import NodeInfo
from compiler_core.runtime.executor import Executor, _direct, _direct_step, _fits, _write_fused
from tests.runtime_helpers import compiled_program

RNG = np.random.default_rng(11)


def _specials(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """Random values with NaNs (two payloads, both signs), infinities, zeros of both signs
    and subnormals scattered in (as many as fit)."""
    a: np.ndarray = RNG.standard_normal(shape).astype(dtype)
    flat = a.reshape(-1)
    tiny = np.finfo(dtype).smallest_subnormal
    special = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, tiny, -tiny][: flat.size - 1]
    flat[: len(special)] = np.array(special, dtype=dtype)
    bits = flat.view(np.uint32 if dtype == np.float32 else np.uint64)
    bits[len(special)] = bits[0] | 1  # a NaN with another payload
    RNG.shuffle(flat)
    return a


def _step(op_type: str, dtype: str, refs: tuple[int | None, ...]) -> EpilogueDesc:
    return EpilogueDesc(
        op_type=op_type, node_name=op_type.lower(), inputs=refs, attrs={}, opset=17,
        out_dtype=dtype,
    )  # fmt: skip


def _own(op_type: str, inputs: list[np.ndarray]) -> np.ndarray:
    opdef = REGISTRY.lookup(op_type, "", 17)
    assert opdef is not None
    info = NodeInfo(
        op_type=op_type,
        name=op_type.lower(),
        attrs={},
        in_shapes=tuple(a.shape for a in inputs),
        in_dtypes=tuple(str(a.dtype) for a in inputs),
        out_shapes=(np.broadcast_shapes(*(a.shape for a in inputs)),),
        out_dtypes=(str(inputs[0].dtype),),
        opset=17,
    )
    return np.asarray(opdef.compute(info, list(inputs), TileCtx.whole(info))[0])


STEPS = [("Relu", 1), ("Add", 2), ("Sub", 2), ("Mul", 2), ("Div", 2)]
SHAPES = [(1, 8, 5, 7), (7,), (5, 1), (1, 8, 1, 1)]
"""The tile's shape, then operand shapes that broadcast to it (a bias, a column, a channel)."""


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    ("op_type", "arity", "other"),
    [(op, arity, other) for op, arity in STEPS for other in SHAPES[: 1 if arity == 1 else None]],
)
def test_a_fused_last_step_writes_the_bytes_its_own_compute_gives(
    op_type: str, arity: int, other: tuple[int, ...], dtype: type
) -> None:
    shape = SHAPES[0]
    inputs = [_specials(shape, dtype), _specials(other, dtype)][:arity]
    step = _step(op_type, np.dtype(dtype).name, (None, 0)[:arity])
    vtcm = np.zeros(2 * inputs[0].nbytes, np.uint8)
    dst: np.ndarray = vtcm[8 : 8 + inputs[0].nbytes].view(dtype).reshape(shape)
    assert _fits(step, np.dtype(dtype), list(inputs), dst)
    with np.errstate(all="ignore"):  # as the executor's `advance` runs it
        _write_fused(op_type, list(inputs), dst)
    own = _own(op_type, inputs)
    view = np.uint32 if dtype == np.float32 else np.uint64
    np.testing.assert_array_equal(dst.view(view), own.view(view))
    assert not vtcm[:8].any() and not vtcm[8 + inputs[0].nbytes :].any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op_type", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("other", SHAPES)
def test_an_arithmetic_step_by_its_ufunc_gives_the_bytes_its_own_compute_gives(
    op_type: str, dtype: type, other: tuple[int, ...]
) -> None:
    inputs = [_specials(SHAPES[0], dtype), _specials(other, dtype)]
    direct = _direct(_step(op_type, np.dtype(dtype).name, (None, 0)))
    assert direct == np.dtype(dtype)
    with np.errstate(all="ignore"):  # as the executor's `advance` runs it
        got = _direct_step(op_type, direct, list(inputs))
    assert got is not None
    own = _own(op_type, inputs)
    view = np.uint32 if dtype == np.float32 else np.uint64
    np.testing.assert_array_equal(got.view(view), own.view(view))


def test_steps_that_widen_or_round_run_their_own_compute() -> None:
    x32 = np.ones((2, 3), np.float32)
    assert _direct(_step("Relu", "float32", (None,))) is None  # fused only as a last step
    assert _direct(_step("Add", "float16", (None, 0))) is None  # rounds to float16
    assert _direct(_step("Pow", "float32", (None, 0))) is None
    add = _direct(_step("Add", "float32", (None, 0)))
    assert add is not None
    assert _direct_step("Add", add, [x32, x32.astype(np.float64)]) is None
    assert _direct_step("Add", add, [x32, None]) is None


def test_an_add_into_its_own_operand_sees_the_operand_before_the_write() -> None:
    """A residual Add whose output tile is the buffer of its other operand."""
    a = _specials((4, 6), np.float32)
    b = _specials((4, 6), np.float32)
    want = _own("Add", [a, b])
    with np.errstate(all="ignore"):
        _write_fused("Add", [a, b], b)
    np.testing.assert_array_equal(b.view(np.uint32), want.view(np.uint32))


def _fit(op_type: str, out_dtype: str, inputs: list[np.ndarray | None], dst: np.ndarray) -> bool:
    refs = (None, 0, -1)[: len(inputs)] if inputs[-1] is None else (None, 0)[: len(inputs)]
    return _fits(_step(op_type, out_dtype, refs), np.dtype(out_dtype), inputs, dst)


def test_last_steps_that_would_widen_round_or_grow_the_tile_run_their_own_compute() -> None:
    x32 = np.ones((2, 3), np.float32)
    dst = np.empty((2, 3), np.float32)
    assert _fit("Add", "float32", [x32, x32], dst)
    assert _fit("Add", "float32", [x32, np.ones(3, np.float32)], dst)  # a bias
    assert not _fit("Relu", "float16", [x32.astype(np.float16)], dst.astype(np.float16))
    assert not _fit("Relu", "float16", [x32], dst)  # the step rounds to float16
    assert not _fit("Add", "float32", [x32[:1], np.ones(3, np.float32)], dst)  # a smaller result
    assert not _fit("Mul", "float32", [x32, np.ones((4, 1, 3), np.float32)], dst)  # a larger one
    assert not _fit("Sub", "float32", [x32, np.ones(2, np.float32)], dst)  # no broadcast
    assert not _fit("Add", "float32", [x32, x32.astype(np.float64)], dst)
    assert not _fit("Relu", "float32", [np.ones((3, 2), np.float32)], dst)  # a wrong shape
    assert not _fit("Add", "float32", [x32, None], dst)


def _residual_block() -> onnx.ModelProto:
    """Conv + Relu, then Conv + Add(residual) + Relu: the epilogues ResNet's kernels carry."""
    w1 = RNG.standard_normal((32, 32, 3, 3)).astype(np.float32) * 0.1
    w2 = RNG.standard_normal((32, 32, 1, 1)).astype(np.float32) * 0.1
    b = RNG.standard_normal(32).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1", "b"], ["c1"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c1"], ["r1"]),
            helper.make_node("Conv", ["r1", "w2", "b"], ["c2"]),
            helper.make_node("Add", ["c2", "x"], ["s"]),
            helper.make_node("Relu", ["s"], ["y"]),
        ],
        "residual",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 14, 14])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 14, 14])],
        [numpy_helper.from_array(w, n) for w, n in ((w1, "w1"), (w2, "w2"), (b, "b"))],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("cores", [1, 4])
def test_fused_epilogues_compute_what_onnx_runtime_does(cores: int) -> None:
    model = _residual_block()
    program, constants = compiled_program(model, f"-aic-num-cores={cores}")
    assert any(k.epilogue and k.epilogue[-1].op_type == "Relu" for k in program.kernels)
    executor = Executor(program, constants, 8_323_072)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for _ in range(2):
        feeds = {"x": RNG.standard_normal((1, 32, 14, 14)).astype(np.float32)}
        got = executor.run(feeds)["y"]
        want = session.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
