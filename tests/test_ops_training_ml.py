"""Ops of the non-default domains: the ai.onnx.preview.training optimizers (Adagrad, Adam,
Momentum) and the numeric ai.onnx.ml ops, each against its oracle: ONNX Runtime for ai.onnx.ml
where it implements the op and type, `onnx.reference` otherwise and for the training ops, which
ONNX Runtime's default build lacks. Where an oracle departs from the spec, the test says so."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from compiler_core.compile import compile_model
from compiler_core.errors import CompileError
from compiler_core.ops.registry import REGISTRY, NodeInfo
from tests.op_checks import (
    assert_matches,
    one_node_model,
    rand,
    run_compiled,
    run_onnxruntime,
    run_reference,
)

TRAINING = "ai.onnx.preview.training"
ML = "ai.onnx.ml"


# --- ai.onnx.preview.training -------------------------------------------------------------


def _optimizer_model(
    op: str, shapes: list[tuple[int, ...]], groups: list[str], dtype: Any = np.float32, **attrs: Any
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """`op` updating len(shapes) tensors: inputs R, T, then one tensor per shape for each name
    in `groups` (X, G, state...); outputs X_new... then each state group's new values."""
    feeds: dict[str, np.ndarray] = {
        "R": np.array(0.1, dtype=dtype),
        "T": np.array(attrs.pop("T", 3), dtype=np.int64),
    }
    for group in groups:
        for i, shape in enumerate(shapes):
            value = rand(*shape, dtype=dtype)
            feeds[f"{group}{i}"] = np.abs(value) if group == "H" else value
    outputs = {
        f"{group}{i}_new": (dtype, shape)
        for group in [groups[0], *groups[2:]]
        for i, shape in enumerate(shapes)
    }
    node = oh.make_node(op, list(feeds), list(outputs), domain=TRAINING, **attrs)
    return one_node_model(node, feeds, outputs, opset=21, extra_opsets={TRAINING: 1}), feeds


def test_adagrad_updates_two_tensors_with_decay_and_norm_matches_reference() -> None:
    model, feeds = _optimizer_model(
        "Adagrad", [(3,), (2, 4)], ["X", "G", "H"], decay_factor=0.1, norm_coefficient=0.01
    )
    assert_matches(model, feeds, oracle="reference")


def test_adagrad_float64_default_attributes_matches_reference() -> None:
    model, feeds = _optimizer_model("Adagrad", [(5,)], ["X", "G", "H"], dtype=np.float64)
    assert_matches(model, feeds, oracle="reference", cores=(1,))


def _assert_matches_reference_in_declared_types(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray]
) -> None:
    """Like `assert_matches`, for reference kernels that promote float32 results to float64
    (single-tensor Adam): the oracle's values are rounded to each output's declared type."""
    expected = run_reference(model, feeds)
    for cores in (1, 4):
        got = run_compiled(model, feeds, cores)
        for out, want, have in zip(model.graph.output, expected, got, strict=True):
            declared = oh.tensor_dtype_to_np_dtype(out.type.tensor_type.elem_type)
            assert have.dtype == declared, f"{out.name} on {cores} cores: dtype {have.dtype}"
            np.testing.assert_allclose(have, want.astype(declared), rtol=1e-5, atol=1e-6)


def test_adam_bias_corrected_with_post_norm_matches_reference() -> None:
    model, feeds = _optimizer_model(
        "Adam",
        [(4,)],
        ["X", "G", "V", "H"],
        alpha=0.9,
        beta=0.8,
        epsilon=1e-3,
        norm_coefficient=0.01,
        norm_coefficient_post=0.02,
    )
    _assert_matches_reference_in_declared_types(model, feeds)


def test_adam_first_step_without_bias_correction_two_tensors_matches_reference() -> None:
    model, feeds = _optimizer_model("Adam", [(2,), (3, 2)], ["X", "G", "V", "H"], T=0)
    assert_matches(model, feeds, oracle="reference", cores=(1,))


@pytest.mark.parametrize("mode", ["standard", "nesterov"])
@pytest.mark.parametrize("step", [0, 5])
def test_momentum_modes_first_and_later_step_match_reference(mode: str, step: int) -> None:
    model, feeds = _optimizer_model(
        "Momentum",
        [(3,), (2, 2)],
        ["X", "G", "V"],
        T=step,
        alpha=0.9,
        beta=0.5,
        norm_coefficient=0.01,
        mode=mode,
    )
    assert_matches(model, feeds, oracle="reference", cores=(1,))


def test_momentum_rejects_an_unknown_mode() -> None:
    model, feeds = _optimizer_model(
        "Momentum", [(3,)], ["X", "G", "V"], alpha=0.9, beta=0.5, norm_coefficient=0.0, mode="adam"
    )
    with pytest.raises(CompileError, match="mode must be 'standard' or 'nesterov', got 'adam'"):
        compile_model(model.SerializeToString(), [])


def test_momentum_without_its_required_alpha_is_an_invalid_model() -> None:
    model, feeds = _optimizer_model(
        "Momentum", [(3,)], ["X", "G", "V"], beta=0.5, norm_coefficient=0.0, mode="standard"
    )
    with pytest.raises(CompileError, match="attribute 'alpha' is missing"):
        run_compiled(model, feeds)


# --- ai.onnx.ml: Binarizer, ArrayFeatureExtractor -----------------------------------------


def _ml_model(
    node: onnx.NodeProto,
    feeds: dict[str, np.ndarray],
    out: tuple[Any, tuple[int, ...]],
    ml_opset: int = 3,
) -> onnx.ModelProto:
    return one_node_model(node, feeds, {"Y": out}, opset=21, extra_opsets={ML: ml_opset})


@pytest.mark.parametrize(
    ("dtype", "oracle"),
    [
        (np.float32, "onnxruntime"),
        # ONNX Runtime implements Binarizer for float32 only
        (np.float64, "reference"),
        (np.int64, "reference"),
        (np.int32, "reference"),
    ],
)
def test_binarizer_thresholds_each_element_in_its_own_type(dtype: Any, oracle: str) -> None:
    x = (rand(3, 4, 5) * 4).astype(dtype)
    node = oh.make_node("Binarizer", ["X"], ["Y"], domain=ML, threshold=0.5)
    assert_matches(_ml_model(node, {"X": x}, (dtype, x.shape)), {"X": x}, oracle=oracle)


def test_array_feature_extractor_picks_last_axis_columns_matches_onnxruntime() -> None:
    feeds = {"X": rand(2, 3, 5), "Y": np.array([4, 0, 4], dtype=np.int64)}
    node = oh.make_node("ArrayFeatureExtractor", ["X", "Y"], ["Y_out"], domain=ML)
    model = one_node_model(
        node, feeds, {"Y_out": (np.float32, (2, 3, 3))}, opset=21, extra_opsets={ML: 1}
    )
    assert_matches(model, feeds)


def test_array_feature_extractor_of_a_vector_gives_one_row_matches_onnxruntime() -> None:
    feeds = {"X": np.arange(6, dtype=np.int64), "Y": np.array([[5, 1]], dtype=np.int64)}
    node = oh.make_node("ArrayFeatureExtractor", ["X", "Y"], ["Y_out"], domain=ML)
    model = one_node_model(
        node, feeds, {"Y_out": (np.int64, (1, 2))}, opset=21, extra_opsets={ML: 1}
    )
    assert_matches(model, feeds, cores=(1,))


def test_array_feature_extractor_rejects_an_index_past_the_last_axis() -> None:
    feeds = {"X": rand(2, 3), "Y": np.array([1, 3], dtype=np.int64)}
    node = oh.make_node("ArrayFeatureExtractor", ["X", "Y"], ["Y_out"], domain=ML)
    model = one_node_model(
        node, feeds, {"Y_out": (np.float32, (2, 2))}, opset=21, extra_opsets={ML: 1}
    )
    with pytest.raises(CompileError, match="index 3 is outside the last axis"):
        run_compiled(model, feeds)


def test_ml_opset_3_next_to_ai_onnx_21_compiles_and_runs() -> None:
    """Each node is read at its own domain's opset: ai.onnx.ml 3 is not ai.onnx 3."""
    x = rand(4, 6)
    nodes = [
        oh.make_node("Relu", ["X"], ["R"]),
        oh.make_node("Binarizer", ["R"], ["B"], domain=ML, threshold=0.25),
        oh.make_node("ArrayFeatureExtractor", ["B", "I"], ["Y"], domain=ML),
    ]
    graph = oh.make_graph(
        nodes,
        "mixed_domains",
        [oh.make_tensor_value_info("X", onnx.TensorProto.FLOAT, [4, 6])],
        [oh.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [4, 2])],
        initializer=[onnx.numpy_helper.from_array(np.array([5, 2], dtype=np.int64), "I")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21), oh.make_opsetid(ML, 3)])
    model.ir_version = 10
    result = compile_model(model.SerializeToString(), ["-aic-num-cores=1"])
    try:
        opsets = {k.info.op_type: k.info.opset for k in result.program.kernels}
    finally:
        result.cleanup()
    assert opsets == {"Relu": 21, "Binarizer": 3, "ArrayFeatureExtractor": 3}
    assert_matches(model, {"X": x})


# --- ai.onnx.ml: TreeEnsemble -------------------------------------------------------------


def _forest_attrs(dtype: Any = np.float32) -> dict[str, Any]:
    """Three trees over 3 features and 3 targets, using every comparison mode, set membership
    and NaN routing; tree 2 is a single leaf."""
    tensor_type = oh.np_dtype_to_tensor_dtype(np.dtype(dtype))
    # node: 0 LEQ f0, 1 GT f1, 2 MEMBER f2, 3 LT f0, 4 GTE f1, 5 EQ f2, 6 NEQ f0, 7 leaf-only
    modes = [0, 3, 6, 1, 2, 4, 5, 0]
    splits = [0.0, -0.5, np.nan, 0.5, 0.2, 1.0, 2.0, 0.0]
    return {
        "n_targets": 3,
        "tree_roots": [0, 3, 7],
        "nodes_featureids": [0, 1, 2, 0, 1, 2, 0, 0],
        "nodes_modes": oh.make_tensor("modes", onnx.TensorProto.UINT8, [8], modes),
        "nodes_splits": oh.make_tensor("splits", tensor_type, [8], splits),
        "nodes_truenodeids": [1, 0, 2, 4, 5, 3, 6, 9],
        "nodes_trueleafs": [0, 1, 1, 0, 0, 1, 1, 1],
        "nodes_falsenodeids": [2, 1, 3, 6, 4, 5, 7, 9],
        "nodes_falseleafs": [0, 1, 1, 0, 1, 1, 1, 1],
        "nodes_missing_value_tracks_true": [1, 0, 0, 0, 1, 0, 0, 0],
        "membership_values": oh.make_tensor("members", tensor_type, [4], [1.0, 2.0, -3.0, np.nan]),
        "leaf_targetids": [0, 1, 2, 0, 1, 2, 0, 1, 2, 1],
        "leaf_weights": oh.make_tensor(
            "weights", tensor_type, [10], [1.5, -2.0, 0.5, 3.0, 0.25, -1.0, 2.5, 4.0, -0.5, 0.75]
        ),
    }


def _forest_input(dtype: Any = np.float32) -> np.ndarray:
    x = np.round(rand(8, 3) * 2, 1)
    # ONNX Runtime tests membership on the integer part (-3.6 is in {-3}); the spec and the
    # reference test the exact value: integer members only where ONNX Runtime is the oracle
    x[:, 2] = np.round(x[:, 2])
    x[0] = [np.nan, 0.3, 2.0]
    x[1] = [0.5, np.nan, -3.0]
    x[2] = [-1.0, 0.2, 1.0]
    x[4] = [0.1, 0.2, 1.0]
    x[3] = [2.0, -0.5, np.nan]
    return x.astype(dtype)


def _tree_model(dtype: Any = np.float32, **attrs: Any) -> tuple[onnx.ModelProto, np.ndarray]:
    x = _forest_input(dtype)
    node = oh.make_node(
        "TreeEnsemble", ["X"], ["Y"], domain=ML, **{**_forest_attrs(dtype), **attrs}
    )
    return _ml_model(node, {"X": x}, (dtype, (8, 3)), ml_opset=5), x


@pytest.mark.parametrize("aggregate", [0, 1, 2, 3], ids=["average", "sum", "min", "max"])
def test_tree_ensemble_every_mode_and_aggregate_function_matches_onnxruntime(
    aggregate: int,
) -> None:
    model, x = _tree_model(aggregate_function=aggregate)
    assert_matches(model, {"X": x})


@pytest.mark.parametrize("transform", [3, 4], ids=["softmax_zero", "probit"])
def test_tree_ensemble_post_transform_matches_onnxruntime(transform: int) -> None:
    model, x = _tree_model(post_transform=transform, aggregate_function=0)
    # ONNX Runtime's probit uses an approximate inverse erf (1e-4 relative); ours is exact
    assert_matches(model, {"X": x}, cores=(1,), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize(("ours", "theirs"), [(1, 2), (2, 1)], ids=["softmax", "logistic"])
def test_tree_ensemble_softmax_and_logistic_follow_the_spec_numbering(
    ours: int, theirs: int
) -> None:
    """ONNX Runtime 1.32 reads post_transform 1 as LOGISTIC and 2 as SOFTMAX; the spec (and
    this compiler) the other way round. Its output for the swapped code is the oracle."""
    model, x = _tree_model(post_transform=ours)
    oracle_model, _ = _tree_model(post_transform=theirs)
    want = run_onnxruntime(oracle_model, {"X": x})[0]
    np.testing.assert_allclose(run_compiled(model, {"X": x})[0], want, rtol=1e-5, atol=1e-6)


def test_tree_ensemble_float64_matches_onnxruntime() -> None:
    model, x = _tree_model(np.float64, aggregate_function=1)
    assert_matches(model, {"X": x}, cores=(1,))


def test_tree_ensemble_float16_sum_matches_reference() -> None:
    # onnx.reference reads a single-leaf tree's root index as a leaf index: leave that tree out
    attrs = {**_forest_attrs(np.float16), "tree_roots": [0, 3]}
    x = _forest_input(np.float16)[4:]
    node = oh.make_node("TreeEnsemble", ["X"], ["Y"], domain=ML, **attrs)
    model = _ml_model(node, {"X": x}, (np.float16, (4, 3)), ml_opset=5)
    assert_matches(model, {"X": x}, oracle="reference", cores=(1,), rtol=1e-3, atol=1e-3)


def test_tree_ensemble_set_membership_tests_the_exact_value_matches_reference() -> None:
    x = np.array([[0.5, 0.0, -3.0], [0.5, 0.0, -3.5], [0.5, 0.0, 2.0], [0.5, 0.0, 2.25]])
    attrs = {**_forest_attrs(np.float32), "tree_roots": [0, 3]}
    node = oh.make_node("TreeEnsemble", ["X"], ["Y"], domain=ML, **attrs)
    feeds = {"X": x.astype(np.float32)}
    model = _ml_model(node, feeds, (np.float32, (4, 3)), ml_opset=5)
    assert_matches(model, feeds, oracle="reference", cores=(1,))


def test_tree_ensemble_rejects_branches_that_form_a_cycle() -> None:
    model, x = _tree_model(nodes_truenodeids=[1, 0, 2, 3, 4, 5, 6, 7], nodes_trueleafs=[0] * 8)
    with pytest.raises(CompileError, match="form a cycle"):
        compile_model(model.SerializeToString(), [])


def test_tree_ensemble_rejects_a_leaf_target_past_n_targets() -> None:
    model, x = _tree_model(leaf_targetids=[0, 1, 2, 0, 1, 2, 0, 1, 3, 1])
    with pytest.raises(CompileError, match=r"leaf_targetids holds 3, outside \[0, 3\)"):
        compile_model(model.SerializeToString(), [])


# --- ai.onnx.ml: Scaler, Normalizer, Imputer, LabelEncoder --------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int32])
def test_scaler_per_feature_offset_and_scale_matches_onnxruntime(dtype: Any) -> None:
    x = (rand(4, 3) * 5).astype(dtype)
    node = oh.make_node(
        "Scaler", ["X"], ["Y"], domain=ML, offset=[0.5, -1.0, 2.0], scale=[2.0, 0.5, -1.5]
    )
    assert_matches(_ml_model(node, {"X": x}, (np.float32, (4, 3))), {"X": x})


def test_scaler_single_offset_and_scale_apply_to_every_feature_matches_onnxruntime() -> None:
    x = rand(2, 5)
    node = oh.make_node("Scaler", ["X"], ["Y"], domain=ML, offset=[0.25], scale=[3.0])
    assert_matches(_ml_model(node, {"X": x}, (np.float32, (2, 5))), {"X": x}, cores=(1,))


def test_scaler_rejects_a_scale_of_the_wrong_length() -> None:
    x = rand(2, 5)
    node = oh.make_node("Scaler", ["X"], ["Y"], domain=ML, offset=[0.0], scale=[1.0, 2.0])
    with pytest.raises(CompileError, match="scale has 2 values for 5 features"):
        run_compiled(_ml_model(node, {"X": x}, (np.float32, (2, 5))), {"X": x})


@pytest.mark.parametrize("norm", ["MAX", "L1", "L2"])
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_normalizer_divides_rows_by_their_norm_matches_onnxruntime(norm: str, dtype: Any) -> None:
    x = (np.abs(rand(3, 4)) * 5 + 1).astype(dtype)
    x[1, 0] = -x[1, 0]
    node = oh.make_node("Normalizer", ["X"], ["Y"], domain=ML, norm=norm)
    assert_matches(_ml_model(node, {"X": x}, (np.float32, (3, 4))), {"X": x}, cores=(1,))


def test_normalizer_rejects_an_unknown_norm() -> None:
    x = rand(3, 4)
    node = oh.make_node("Normalizer", ["X"], ["Y"], domain=ML, norm="L3")
    with pytest.raises(CompileError, match="norm must be 'MAX', 'L1' or 'L2', got 'L3'"):
        run_compiled(_ml_model(node, {"X": x}, (np.float32, (3, 4))), {"X": x})


def test_imputer_fills_nan_per_feature_matches_onnxruntime() -> None:
    x = rand(4, 3)
    x[0, 1] = x[2, 0] = x[3, 2] = np.nan
    node = oh.make_node(
        "Imputer",
        ["X"],
        ["Y"],
        domain=ML,
        imputed_value_floats=[1.0, 2.0, 3.0],
        replaced_value_float=float("nan"),
    )
    assert_matches(_ml_model(node, {"X": x}, (np.float32, (4, 3))), {"X": x})


def test_imputer_replaces_one_int64_value_with_a_single_imputed_value_matches_onnxruntime() -> None:
    x = np.array([[0, 5, -1], [-1, -1, 7]], dtype=np.int64)
    node = oh.make_node(
        "Imputer", ["X"], ["Y"], domain=ML, imputed_value_int64s=[9], replaced_value_int64=-1
    )
    assert_matches(_ml_model(node, {"X": x}, (np.int64, (2, 3))), {"X": x}, cores=(1,))


def _label_encoder(
    x: np.ndarray, out_dtype: Any, ml_opset: int, **attrs: Any
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    node = oh.make_node("LabelEncoder", ["X"], ["Y"], domain=ML, **attrs)
    return _ml_model(node, {"X": x}, (out_dtype, x.shape), ml_opset=ml_opset), {"X": x}


def test_label_encoder_int64_keys_to_float_values_with_default_matches_onnxruntime() -> None:
    x = np.array([[3, -2, 7], [100, 3, 0]], dtype=np.int64)
    model, feeds = _label_encoder(
        x,
        np.float32,
        2,
        keys_int64s=[7, 3, -2, 0],
        values_floats=[0.5, 1.5, -2.5, 9.0],
        default_float=-7.0,
    )
    assert_matches(model, feeds)


def test_label_encoder_float_keys_to_int64_values_nan_key_and_last_repeat_win() -> None:
    """ml opset 4: a NaN key matches any NaN and of repeated keys the last wins (the spec;
    neither oracle implements the NaN rule, so the expected values are written out)."""
    x = np.array([1.5, np.nan, -0.25, 8.0, 1.5], dtype=np.float32)
    model, feeds = _label_encoder(
        x,
        np.int64,
        4,
        keys_floats=[1.5, -0.25, float("nan"), 1.5],
        values_int64s=[10, 20, 30, 40],
    )
    for cores in (1, 4):
        got = run_compiled(model, feeds, cores)[0]
        np.testing.assert_array_equal(got, np.array([40, 30, 20, -1, 40], dtype=np.int64))


def test_label_encoder_int32_tensor_tables_matches_reference() -> None:
    x = np.array([4, 1, 9, 4], dtype=np.int32)
    model, feeds = _label_encoder(
        x,
        np.int32,
        4,
        keys_tensor=oh.make_tensor("keys", onnx.TensorProto.INT32, [3], [1, 4, 5]),
        values_tensor=oh.make_tensor("values", onnx.TensorProto.INT32, [3], [11, 44, 55]),
        default_tensor=oh.make_tensor("default", onnx.TensorProto.INT32, [1], [-9]),
    )
    # ONNX Runtime 1.32 has no int32 LabelEncoder
    assert_matches(model, feeds, oracle="reference", cores=(1,))


def test_label_encoder_with_string_values_is_rejected_as_unsupported() -> None:
    """A numeric-to-string table passes the importer's input-type check, so the tiling rule
    refuses it at compile time."""
    info = NodeInfo(
        op_type="LabelEncoder",
        name="to_strings",
        attrs={"keys_int64s": [1, 2], "values_strings": ["a", "b"]},
        in_shapes=((2,),),
        in_dtypes=("int64",),
        out_shapes=((2,),),
        out_dtypes=("object",),
        opset=2,
        domain=ML,
    )
    opdef = REGISTRY.lookup("LabelEncoder", ML, 2)
    assert opdef is not None
    with pytest.raises(CompileError, match="only numeric values are supported") as err:
        opdef.split_axes(info)
    assert err.value.code == "unsupported_operator"


@pytest.mark.parametrize("op", ["Scaler", "Normalizer", "Binarizer"])
def test_an_ml_op_inside_the_graph_gets_its_input_shape_and_runs_unfused(op: str) -> None:
    """ONNX shape inference types these outputs but leaves their shape open; the importer
    fills it in (Add with a full-size operand could not carry the output's shape back), and
    the ml op stays a kernel of its own, never an epilogue step of Relu."""
    x = rand(3, 4)
    attrs = {"Scaler": {"offset": [0.5], "scale": [2.0]}, "Normalizer": {"norm": "L1"}}
    graph = oh.make_graph(
        [
            oh.make_node("Relu", ["X"], ["r"]),
            oh.make_node(op, ["r"], ["m"], domain=ML, **attrs.get(op, {})),
            oh.make_node("Add", ["m", "X"], ["Y"]),
        ],
        "g",
        [oh.make_tensor_value_info("X", onnx.TensorProto.FLOAT, [3, 4])],
        [oh.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [3, 4])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid(ML, 3)])
    assert_matches(model, {"X": x})
