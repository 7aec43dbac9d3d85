"""Data-dependent and miscellaneous ops (NonMaxSuppression, TfIdfVectorizer, Unique, Det,
Scatter) through the whole path, against ONNX Runtime.

NonMaxSuppression and Unique have data-dependent output shapes: each model declares the
static shape the oracle produces, as the compiler's contract requires.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from compiler_core.errors import CompileError
from tests.op_checks import assert_matches, one_node_model, rand, run_compiled, run_onnxruntime

F32 = np.float32
I64 = np.int64

# --- NonMaxSuppression ----------------------------------------------------------------------


def _nms_feeds(batch: int, classes: int, count: int, seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    corner = rng.uniform(0, 10, (batch, count, 2))
    size = rng.uniform(1, 4, (batch, count, 2))
    boxes = np.concatenate([corner, corner + size], axis=-1).astype(F32)
    return {
        "boxes": boxes,
        "scores": rng.uniform(0, 1, (batch, classes, count)).astype(F32),
        "max_out": np.array([3], dtype=I64),
        "iou": np.array([0.3], dtype=F32),
        "score_min": np.array([0.2], dtype=F32),
    }


def _nms_model(feeds: dict[str, np.ndarray], rows: int, **attrs: Any) -> onnx.ModelProto:
    names = ["boxes", "scores", "max_out", "iou", "score_min"]
    node = oh.make_node(
        "NonMaxSuppression", [n if n in feeds else "" for n in names], ["selected"], **attrs
    )
    return one_node_model(node, feeds, {"selected": (I64, (rows, 3))}, opset=11)


def _nms_declared(feeds: dict[str, np.ndarray], **attrs: Any) -> onnx.ModelProto:
    """The model declaring the row count ONNX Runtime selects for these feeds."""
    probe = _nms_model(feeds, 0, **attrs)
    probe.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "n"
    rows = run_onnxruntime(probe, feeds)[0].shape[0]
    return _nms_model(feeds, rows, **attrs)


def test_nms_batches_and_classes_with_score_and_iou_thresholds_match_onnxruntime() -> None:
    feeds = _nms_feeds(batch=2, classes=3, count=12)
    assert_matches(_nms_declared(feeds), feeds)


def test_nms_center_point_boxes_match_onnxruntime() -> None:
    feeds = _nms_feeds(batch=1, classes=2, count=10, seed=5)
    assert_matches(_nms_declared(feeds, center_point_box=1), feeds)


def test_nms_flipped_corners_and_tied_scores_keep_the_lower_index_first() -> None:
    feeds = _nms_feeds(batch=1, classes=1, count=8, seed=9)
    boxes = feeds["boxes"]
    boxes[0, ::2] = boxes[0, ::2][:, [2, 3, 0, 1]]  # (max, min) corners on every other box
    feeds["scores"][0, 0, :4] = 0.5  # ties
    feeds["max_out"] = np.array([8], dtype=I64)
    assert_matches(_nms_declared(feeds), feeds)


def test_nms_without_optional_thresholds_matches_onnxruntime() -> None:
    feeds = _nms_feeds(batch=1, classes=2, count=6)
    del feeds["iou"], feeds["score_min"]
    assert_matches(_nms_declared(feeds), feeds)


def test_nms_selection_count_differing_from_the_declared_shape_is_refused() -> None:
    feeds = _nms_feeds(batch=1, classes=1, count=6)
    model = _nms_declared(feeds)
    rows = model.graph.output[0].type.tensor_type.shape.dim[0].dim_value
    with pytest.raises(CompileError, match=f"selected {rows} boxes.*holds {rows + 1}"):
        run_compiled(_nms_model(feeds, rows + 1), feeds)


def test_nms_rejects_a_center_point_box_other_than_0_or_1() -> None:
    feeds = _nms_feeds(batch=1, classes=1, count=4)
    with pytest.raises(CompileError, match="center_point_box must be 0 or 1, got 2"):
        run_compiled(_nms_model(feeds, 1, center_point_box=2), feeds)


# --- TfIdfVectorizer ------------------------------------------------------------------------

_POOL = {
    "ngram_counts": [0, 4, 10],
    "pool_int64s": [2, 3, 5, 4, 5, 6, 7, 8, 6, 7, 2, 3, 5, 5, 6, 7],
}
_SHARED = [0, 1, 2, 3, 4, 5, 6, 7, 1]  # the last trigram shares column 1 with a unigram
_PERMUTED = [8, 1, 2, 3, 4, 0, 6, 7, 5]


def _tfidf_model(x: np.ndarray, columns: list[int] = _SHARED, **attrs: Any) -> onnx.ModelProto:
    node = oh.make_node(
        "TfIdfVectorizer", ["x"], ["y"], ngram_indexes=columns, **{**_POOL, **attrs}
    )
    width = max(columns) + 1
    out = (width,) if x.ndim == 1 else (x.shape[0], width)
    return one_node_model(node, {"x": x}, {"y": (F32, out)}, opset=9)


def _tokens(*shape: int, dtype: Any = I64) -> np.ndarray:
    return np.random.default_rng(11).integers(2, 9, shape).astype(dtype)


@pytest.mark.parametrize("skip", [0, 1, 3])
@pytest.mark.parametrize("low", [1, 2])
def test_tfidf_term_frequencies_of_uni_bi_trigrams_with_skips_match_onnxruntime(
    skip: int, low: int
) -> None:
    x = _tokens(3, 14)
    model = _tfidf_model(x, mode="TF", min_gram_length=low, max_gram_length=3, max_skip_count=skip)
    assert_matches(model, {"x": x})


@pytest.mark.parametrize(
    ("mode", "columns", "weighted"),
    [
        ("IDF", _SHARED, False),
        ("IDF", _PERMUTED, True),
        ("TFIDF", _SHARED, False),
        ("TFIDF", _SHARED, True),
    ],
)
def test_tfidf_weights_follow_pool_ngrams_and_shared_columns_add_like_onnxruntime(
    mode: str, columns: list[int], weighted: bool
) -> None:
    x = _tokens(30, dtype=np.int32)
    weights = {"weights": [0.5 + k for k in range(9)]} if weighted else {}
    model = _tfidf_model(
        x, columns, mode=mode, min_gram_length=1, max_gram_length=3, max_skip_count=2, **weights
    )
    assert_matches(model, {"x": x})


def test_tfidf_refuses_idf_weights_on_ngrams_sharing_a_column() -> None:
    x = _tokens(6)
    model = _tfidf_model(
        x, mode="IDF", min_gram_length=1, max_gram_length=3, max_skip_count=0, weights=[1.0] * 9
    )
    with pytest.raises(CompileError, match="IDF weights on n-grams that share an output column"):
        run_compiled(model, {"x": x})


def test_tfidf_rejects_an_unknown_mode() -> None:
    x = _tokens(6)
    model = _tfidf_model(x, mode="BM25", min_gram_length=1, max_gram_length=2, max_skip_count=0)
    with pytest.raises(CompileError, match="mode 'BM25' is not TF, IDF or TFIDF"):
        run_compiled(model, {"x": x})


# --- Unique ---------------------------------------------------------------------------------

_UNIQUE_OUTS = ("y", "indices", "inverse", "counts")


def _unique_model(
    x: np.ndarray,
    outputs: tuple[str, ...] = _UNIQUE_OUTS,
    distinct: int | None = None,
    **attrs: Any,
) -> onnx.ModelProto:
    """Unique declaring the output shapes ONNX Runtime produces (or `distinct` entries)."""
    node = oh.make_node("Unique", ["x"], list(outputs), **attrs)
    types = {n: x.dtype if n == "y" else np.dtype(I64) for n in outputs if n}
    probe = one_node_model(node, {"x": x}, {}, opset=11)
    probe.graph.output.extend(
        oh.make_tensor_value_info(n, oh.np_dtype_to_tensor_dtype(t), None) for n, t in types.items()
    )
    got = run_onnxruntime(probe, {"x": x})
    shapes = {n: list(v.shape) for n, v in zip(types, got, strict=True)}
    if distinct is not None:
        axis = attrs.get("axis")
        for n in ("y", "indices", "counts"):
            if n in shapes:
                shapes[n][0 if n != "y" or axis is None else axis] = distinct
    return one_node_model(node, {"x": x}, {n: (t, shapes[n]) for n, t in types.items()}, opset=11)


def _repeats(*shape: int) -> np.ndarray:
    return np.random.default_rng(4).integers(0, 3, shape).astype(F32)


@pytest.mark.parametrize("is_sorted", [0, 1])
def test_unique_elements_sorted_or_in_first_occurrence_order_match_onnxruntime(
    is_sorted: int,
) -> None:
    x = np.array([[2, 1, 1], [3, 4, 3], [7, 2, 0]], dtype=I64)
    assert_matches(_unique_model(x, sorted=is_sorted), {"x": x})


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("is_sorted", [0, 1])
def test_unique_slices_along_an_axis_match_onnxruntime(axis: int, is_sorted: int) -> None:
    x = _repeats(3, 6, 2)
    x[:, 3] = x[:, 1]  # repeated slices along axis 1
    x[2] = x[0]  # and along axis 0
    assert_matches(_unique_model(x, axis=axis, sorted=is_sorted), {"x": x})


def test_unique_with_omitted_optional_outputs_matches_onnxruntime() -> None:
    x = _repeats(10)
    assert_matches(_unique_model(x, ("y", "", "", "counts")), {"x": x})


def test_unique_distinct_count_differing_from_the_declared_shape_is_refused() -> None:
    x = np.array([1, 1, 2, 5], dtype=F32)
    with pytest.raises(CompileError, match="found 3 distinct entries but output Y is declared"):
        run_compiled(_unique_model(x, distinct=2), {"x": x})


# --- Det ------------------------------------------------------------------------------------


def _det_model(x: np.ndarray) -> onnx.ModelProto:
    node = oh.make_node("Det", ["x"], ["y"])
    return one_node_model(node, {"x": x}, {"y": (x.dtype, x.shape[:-2])}, opset=11)


@pytest.mark.parametrize("shape", [(3, 3), (2, 3, 4, 4), (5, 1, 1)])
def test_det_of_single_and_batched_matrices_matches_onnxruntime(shape: tuple[int, ...]) -> None:
    x = rand(*shape)
    assert_matches(_det_model(x), {"x": x}, rtol=1e-5, atol=1e-6)


def test_det_of_singular_and_float64_matrices_matches_reference() -> None:
    x = rand(2, 3, 3, dtype=np.float64)
    x[0, 2] = x[0, 0] + x[0, 1]  # rank 2
    assert_matches(_det_model(x), {"x": x}, oracle="reference", rtol=1e-12, atol=1e-12)


def test_det_rejects_a_non_square_input() -> None:
    x = rand(2, 3)
    with pytest.raises(CompileError, match="inner-most 2 dimensions must have the same size"):
        run_compiled(_det_model(x), {"x": x})


# --- Scatter (opset 9-10) -------------------------------------------------------------------


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_scatter_opset10_writes_updates_along_the_axis_like_onnxruntime(axis: int) -> None:
    data, updates = rand(4, 5), rand(3, 2)
    indices = np.array([[0, 3], [2, 1], [3, 0]], dtype=I64)
    node = oh.make_node("Scatter", ["data", "indices", "updates"], ["y"], axis=axis)
    feeds = {"data": data, "indices": indices, "updates": updates}
    model = one_node_model(node, feeds, {"y": (F32, data.shape)}, opset=10)
    assert_matches(model, feeds)
