"""The conformance runner (bench/conformance.py) on a representative selection of ONNX node
cases, and its isolation: a crash, a hang, a wrong answer or a non-"unsupported" compile error
is a failure; only the importer's unsupported-operator error is "unsupported"."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import conformance  # noqa: E402

REPRESENTATIVE = (
    "test_abs",
    "test_bitshift_right_int8",
    "test_cast_FLOAT_to_DOUBLE",
    "test_cumprod_1d_exclusive",
    "test_mod_mixed_sign_float32",
    "test_nllloss_NCd1d2",
    "test_rms_normalization_4d_axis0",
    "test_sce_none_log_prob",
    "test_selu_expanded_ver18",
    "test_shrink_hard_expanded_ver18",
    "test_spacetodepth_example",
    "test_add_bcast",
    "test_argmax_keepdims_example",
    "test_averagepool_2d_pads",
    "test_batchnorm_example",
    "test_clip_default_min",
    "test_concat_3d_axis_1",
    "test_conv_with_strides_padding",
    "test_convtranspose",
    "test_cumsum_1d",
    "test_div_int8",
    "test_einsum_batch_matmul",
    "test_gather_1",
    "test_gemm_all_attributes",
    "test_gelu_tanh_2",
    "test_instancenorm_example",
    "test_layer_normalization_4d_axis1_expanded",
    "test_leakyrelu_default",
    "test_lrn",
    "test_matmul_4d",
    "test_maxpool_2d_same_upper",
    "test_mod_mixed_sign_int32",
    "test_pow_types_int64_float32",
    "test_relu",
    "test_softmax_axis_0_expanded",
    "test_split_equal_parts_1d_opset18",
    "test_transpose_all_permutations_3",
    "test_where_long_example",
    # shapes that hang on runtime inputs: declared outputs, also carried back through
    # Cast/Sqrt/CastLike and Log
    "test_reshape_reordered_all_dims",
    "test_reduce_l2_keep_dims_example_expanded",
    "test_reduce_log_sum_asc_axes_expanded",
    # reductions over an empty set give their identity
    "test_reduce_max_empty_set",
    "test_reduce_min_empty_set",
    "test_reduce_log_sum_exp_empty_set",
    # declared shapes carried back through binary ops whose other operand is one element
    "test_hannwindow_expanded",
    # a zero vector stays zero under LpNormalization
    "test_l2normalization_axis_0",
    # unnamed optional outputs before a named one (present_key/value, then qk_matmul_output)
    "test_attention_4d_with_qk_matmul",
    "test_resize_downsample_scales_cubic_antialias",
    "test_resize_downsample_sizes_nearest_not_smaller",
    "test_resize_downsample_scales_linear_align_corners",
    "test_training_dropout_mask",
    "test_optional_has_element_empty_no_input_tensor_input",
    # op families added for the conformance work, one or two cases each
    "test_linear_attention_gated_delta_gqa",
    "test_linear_attention_gated_delta_expanded",
    "test_causal_conv_with_state_silu_with_past_state",
    "test_tensorscatter_circular",
    "test_swiglu_alpha",
    "test_gridsample_bicubic_align_corners_0_additional_1",
    "test_affine_grid_3d_align_corners",
    "test_col2im_pads",
    "test_roialign_mode_max",
    "test_deform_conv_with_multiple_offset_groups",
    "test_maxunpool_export_with_output_shape",
    "test_qlinearmatmul_3D_int8_float16",
    "test_convinteger_with_padding",
    "test_qlinearconv",
    "test_bitcast_scalar_float32_to_int32",
    "test_rotary_embedding_with_interleaved_rotary_dim",
    "test_nonmaxsuppression_two_batches",
    "test_tfidfvectorizer_tf_batch_uniandbigrams_skip5",
    "test_det_nd",
    "test_scatter_with_axis",
    "test_stft_with_window",
    "test_melweightmatrix",
    "test_adam_multiple",
    "test_nesterov_momentum",
    "test_ai_onnx_ml_tree_ensemble_set_membership",
    "test_ai_onnx_ml_array_feature_extractor",
    "test_gru_seq_length",
    "test_lstm_with_peepholes",
    "test_simple_rnn_bidirectional",
    # subgraphs: If, Loop (also inside Range's body), Scan, FlexAttention's score_mod
    "test_if",
    "test_loop11",
    "test_range_int32_type_negative_delta_expanded",
    "test_scan9_multi_state",
    "test_flexattention_score_mod",
)

ENGINES: dict[str, conformance.Engine] = {
    "qpc-1": conformance.qpcfarm_engine(1),
    "qpc-4": conformance.qpcfarm_engine(4),
    "ort": conformance.ort_engine,
}


@pytest.fixture(scope="module")
def outcomes() -> dict[tuple[str, str], conformance.Outcome]:
    pattern = "^(" + "|".join(REPRESENTATIVE) + ")$"
    cases = conformance.load_cases(pattern)
    assert sorted(c.name for c in cases) == sorted(REPRESENTATIVE)
    results = conformance.run_tasks(cases, ENGINES, jobs=2, timeout=120)
    return {(o.case, o.engine): o for o in results}


@pytest.mark.parametrize("cores", [1, 4])
@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_node_case_matches_the_expected_outputs(
    outcomes: dict[tuple[str, str], conformance.Outcome], name: str, cores: int
) -> None:
    outcome = outcomes[(name, f"qpc-{cores}")]
    assert outcome.status == conformance.PASS, outcome.detail


def test_onnx_runtime_runs_in_the_same_run(
    outcomes: dict[tuple[str, str], conformance.Outcome],
) -> None:
    ort = [o for (_, engine), o in outcomes.items() if engine == "ort"]
    assert len(ort) == len(REPRESENTATIVE)
    # ONNX Runtime really ran: it passes most of these (not all: some ops it lacks or gets
    # wrong, e.g. training-mode Dropout, FlexAttention, align_corners downsampling).
    assert sum(o.status == conformance.PASS for o in ort) >= 0.8 * len(REPRESENTATIVE)


# --- isolation and classification, on tiny fake cases ---------------------------------------


def _abs_case(name: str, expected: np.ndarray) -> conformance.Case:
    graph = oh.make_graph(
        [oh.make_node("Abs", ["x"], ["y"])],
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    x = np.array([-1.0, 2.0, -3.0], np.float32)
    return conformance.Case(
        name, "Abs", model.SerializeToString(), (((x,), (expected,)),), 1e-3, 1e-7, True
    )


def _custom_op_case() -> conformance.Case:
    graph = oh.make_graph(
        [oh.make_node("Frobnicate", ["x"], ["y"], domain="com.example")],
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3])],
    )
    model = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("com.example", 1)]
    )
    x = np.ones(3, np.float32)
    return conformance.Case(
        "custom", "Frobnicate", model.SerializeToString(), (((x,), (x,)),), 1e-3, 1e-7, True
    )


def _crash(case: conformance.Case) -> tuple[str, str]:
    os._exit(3)


def _hang(case: conformance.Case) -> tuple[str, str]:
    time.sleep(600)
    return conformance.PASS, ""


def _raise(case: conformance.Case) -> tuple[str, str]:
    raise RuntimeError("kernel blew up")


def test_a_crash_a_hang_or_an_exception_is_a_failure_and_the_run_goes_on() -> None:
    good = _abs_case("good", np.array([1.0, 2.0, 3.0], np.float32))
    engines: dict[str, conformance.Engine] = {
        "crash": _crash,
        "hang": _hang,
        "raise": _raise,
        "qpc": conformance.qpcfarm_engine(1),
    }
    results = conformance.run_tasks([good], engines, jobs=2, timeout=2)
    by_engine = {o.engine: o for o in results}
    assert by_engine["crash"].status == conformance.FAIL
    assert by_engine["crash"].detail.startswith("crash")
    assert by_engine["hang"].status == conformance.FAIL
    assert by_engine["hang"].detail.startswith("timeout")
    assert by_engine["raise"].status == conformance.FAIL
    assert "kernel blew up" in by_engine["raise"].detail
    assert by_engine["qpc"].status == conformance.PASS, by_engine["qpc"].detail


def test_a_wrong_answer_is_a_failure_and_only_unsupported_ops_are_unsupported() -> None:
    wrong = _abs_case("wrong", np.array([1.0, 2.0, 3.5], np.float32))
    cases = [wrong, _custom_op_case()]
    results = conformance.run_tasks(cases, {"qpc": conformance.qpcfarm_engine(1)}, jobs=1)
    by_case = {o.case: o for o in results}
    assert by_case["wrong"].status == conformance.FAIL
    assert by_case["wrong"].detail.startswith("wrong answer")
    assert by_case["custom"].status == conformance.UNSUPPORTED
    assert "Frobnicate" in by_case["custom"].detail


def test_the_report_counts_numeric_and_all_cases_per_engine() -> None:
    cases = [_abs_case("a", np.zeros(3, np.float32)), _custom_op_case()]
    cases[1] = conformance.Case(**{**cases[1].__dict__, "numeric": False})
    outcomes = [
        conformance.Outcome("a", "qpc", conformance.PASS),
        conformance.Outcome("custom", "qpc", conformance.FAIL, "x"),
    ]
    report = conformance.summarize(cases, outcomes, ["qpc"])
    assert report.totals["numeric"]["qpc"] == {"pass": 1, "fail": 0, "unsupported": 0}
    assert report.totals["all"]["qpc"] == {"pass": 1, "fail": 1, "unsupported": 0}
    assert report.by_op["Frobnicate"]["qpc"] == {"fail": 1}
    assert "numeric cases:" in conformance.format_report(report)
