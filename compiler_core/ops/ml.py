"""Numeric ops of the ai.onnx.ml domain: Binarizer, ArrayFeatureExtractor, Scaler, Normalizer,
Imputer, LabelEncoder (numeric tables) and TreeEnsemble.

Binarizer is elementwise, so it tiles like any unary op; it is not marked fusable because
epilogue steps are looked up in the default domain (fuse_epilogue, executor).
ArrayFeatureExtractor is a gather on the last axis with runtime indices and runs whole, as do
the small per-row/per-feature ops (Scaler, Normalizer, Imputer) and LabelEncoder, a sorted-key
lookup (searchsorted) rather than a per-element dictionary.
TreeEnsemble runs whole too: a tree walk is data-dependent, so there is no input box to cut
ahead of time; it walks every (tree, row) pair at once, one tree level per numpy step,
instead of one row at a time.

TreeEnsemble follows the ONNX specification where ONNX Runtime departs from it: post_transform
1 is SOFTMAX and 2 is LOGISTIC (ONNX Runtime 1.32 swaps them), set membership tests the exact
value (ONNX Runtime its integer part) and probit uses an exact inverse erf. Comparisons run in
the input's type; leaf weights are summed in float64 and rounded once to the output type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops._tiling import broadcast_boxes, elementwise_split
from compiler_core.ops.registry import FLOATS, NodeInfo, TileCtx, invalid_model, register

Array = np.ndarray

ML = "ai.onnx.ml"
_ML_NUMBERS = frozenset({"float32", "float64", "int32", "int64"})


def _input(node: NodeInfo, inputs: list[Array | None], index: int) -> Array:
    value = inputs[index] if index < len(inputs) else None
    if value is None:
        raise invalid_model(node, f"input {index} is required")
    return value


# --- Binarizer ----------------------------------------------------------------------------


def binarizer_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """1 where X > threshold, else 0, in X's type; NaN maps to 0."""
    x = _input(node, inputs, 0)
    threshold = float(node.attr("threshold", 0.0))
    above = x.astype(np.float64) > threshold if x.dtype.kind == "f" else x > threshold
    return [above.astype(np.dtype(node.out_dtypes[0]))]


# --- ArrayFeatureExtractor ----------------------------------------------------------------


def array_feature_extractor_compute(
    node: NodeInfo, inputs: list[Array | None], tile: TileCtx
) -> list[Array]:
    """X[..., Y.ravel()]; a 1-D X gives one row ([1, K]), as ONNX Runtime does."""
    x, indices = _input(node, inputs, 0), _input(node, inputs, 1)
    index = indices.astype(np.int64).ravel()
    width = x.shape[-1] if x.ndim else 0
    bad = index[(index < 0) | (index >= width)]
    if bad.size:
        raise invalid_model(node, f"index {int(bad[0])} is outside the last axis (size {width})")
    picked = x[..., index] if x.ndim > 1 else x.reshape(1, -1)[..., index]
    return [picked.reshape(node.out_shapes[0]).astype(np.dtype(node.out_dtypes[0]))]


# --- Scaler, Normalizer, Imputer ---------------------------------------------------------


def _per_feature(node: NodeInfo, name: str, values: Array, x: Array) -> Array:
    """A length-1 or length-F attribute, shaped to broadcast over X's last (feature) axis."""
    width = x.shape[-1] if x.ndim else 1
    if values.size not in (1, width):
        raise invalid_model(node, f"{name} has {values.size} values for {width} features")
    return values


def scaler_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """(X - offset) * scale in float32, offset and scale per feature or for all."""
    x = _input(node, inputs, 0).astype(np.float32)
    offset = _per_feature(node, "offset", np.asarray(node.attr("offset", [0.0]), np.float32), x)
    scale = _per_feature(node, "scale", np.asarray(node.attr("scale", [1.0]), np.float32), x)
    return [((x - offset) * scale).astype(np.float32)]


def normalizer_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """Each row divided by its MAX, L1 or L2 norm, in float32."""
    x = _input(node, inputs, 0).astype(np.float32)
    rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    norm = _normalizer_norm(node)
    if norm == "MAX":
        scale = rows.max(axis=1, keepdims=True)
    elif norm == "L1":
        scale = np.abs(rows).sum(axis=1, keepdims=True)
    else:
        scale = np.sqrt((rows * rows).sum(axis=1, keepdims=True))
    with np.errstate(all="ignore"):
        out = rows / scale
    return [out.reshape(node.out_shapes[0]).astype(np.float32)]


def _normalizer_norm(node: NodeInfo) -> str:
    norm = str(node.attr("norm", "MAX"))
    if norm not in ("MAX", "L1", "L2"):
        raise invalid_model(node, f"norm must be 'MAX', 'L1' or 'L2', got {norm!r}")
    return norm


def imputer_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """Entries equal to the replaced value (NaN matches NaN) become the imputed value of
    their feature (or the single imputed value)."""
    x = _input(node, inputs, 0)
    if x.dtype.kind == "f":
        imputed = np.asarray(node.attr("imputed_value_floats", []), np.float64)
        replaced: float = float(node.attr("replaced_value_float", 0.0))
        hit = np.isnan(x) if np.isnan(replaced) else x == replaced
    else:
        imputed = np.asarray(node.attr("imputed_value_int64s", []), np.int64)
        replaced = int(node.attr("replaced_value_int64", 0))
        hit = x == replaced
    if imputed.size == 0:
        raise invalid_model(node, f"no imputed values for a {x.dtype} input")
    fill = np.broadcast_to(_per_feature(node, "the imputed values", imputed, x), x.shape)
    return [np.where(hit, fill.astype(x.dtype), x).astype(np.dtype(node.out_dtypes[0]))]


# --- LabelEncoder ---------------------------------------------------------------------------

_DEFAULT_ATTR = {"i": "default_int64", "f": "default_float"}
_NUMERIC_KINDS = ("i", "u", "f")


def _label_table(node: NodeInfo, side: str) -> Array:
    """The keys or values, from whichever of the `{side}_*` attributes is set."""
    found = [
        np.asarray(node.attr(name)).ravel()
        for name in (f"{side}_tensor", f"{side}_int64s", f"{side}_floats", f"{side}_strings")
        if node.attr(name) is not None
    ]
    if len(found) != 1:
        raise invalid_model(node, f"exactly one {side}_* attribute must be set, found {len(found)}")
    if found[0].dtype.kind not in _NUMERIC_KINDS:
        raise CompileError(
            "unsupported_operator",
            f"LabelEncoder: only numeric {side} are supported, got {found[0].dtype}",
            node=node.name,
        )
    return found[0]


def _label_default(node: NodeInfo, values: Array) -> Array:
    tensor = node.attr("default_tensor")
    if tensor is not None:
        return np.asarray(tensor).ravel()[:1].astype(values.dtype)
    kind = "f" if values.dtype.kind == "f" else "i"
    fallback = -0.0 if kind == "f" else -1
    return np.asarray([node.attr(_DEFAULT_ATTR[kind], fallback)]).astype(values.dtype)


def _check_label_encoder(node: NodeInfo) -> list[int]:
    """Tiling rule that checks the tables at compile time; the op runs whole."""
    keys, values = _label_table(node, "keys"), _label_table(node, "values")
    if keys.size != values.size:
        raise invalid_model(node, f"{keys.size} keys for {values.size} values")
    return []


def label_encoder_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """Each element replaced by the value of its key (a NaN key matches any NaN), else the
    default; of repeated keys the last wins."""
    x = _input(node, inputs, 0)
    _check_label_encoder(node)
    keys, values = _label_table(node, "keys"), _label_table(node, "values")
    keys = keys.astype(x.dtype)
    out = np.broadcast_to(_label_default(node, values), x.shape).copy()
    if keys.size == 0:
        return [out.astype(np.dtype(node.out_dtypes[0]))]
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    at = np.clip(np.searchsorted(sorted_keys, x, side="right") - 1, 0, None)
    index, found = order[at], sorted_keys[at] == x
    if x.dtype.kind == "f":
        nan_keys = np.flatnonzero(np.isnan(keys))
        if nan_keys.size:
            nan_in = np.isnan(x)
            index, found = np.where(nan_in, nan_keys[-1], index), found | nan_in
    out[found] = values[index[found]]
    return [out.astype(np.dtype(node.out_dtypes[0]))]


# --- TreeEnsemble -------------------------------------------------------------------------

_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)
_AVERAGE, _SUM, _MIN, _MAX = range(4)
_NONE, _SOFTMAX, _LOGISTIC, _SOFTMAX_ZERO, _PROBIT = range(5)


@dataclass(frozen=True)
class _Forest:
    """The node's attributes as arrays, checked once: interior nodes (`feature`...), leaves
    (`target`, `weight`) and, for BRANCH_MEMBER nodes, a NaN-padded row of set members."""

    roots: Array
    feature: Array
    mode: Array
    split: Array
    true_id: Array
    false_id: Array
    true_leaf: Array
    false_leaf: Array
    missing_true: Array
    members: Array
    member_row: Array
    target: Array
    weight: Array
    n_targets: int


def _ints(node: NodeInfo, name: str, default: list[int] | None = None) -> Array:
    value = node.attr(name, default)
    if value is None:
        raise invalid_model(node, f"attribute '{name}' is required")
    return np.asarray(value, dtype=np.int64).ravel()


def _tensor(node: NodeInfo, name: str) -> Array:
    value = node.attr(name)
    if value is None:
        raise invalid_model(node, f"attribute '{name}' is required")
    return np.asarray(value).ravel()


def _member_sets(node: NodeInfo, mode: Array) -> tuple[Array, Array]:
    """membership_values split at its NaNs, one set per BRANCH_MEMBER node in order, as a
    NaN-padded matrix, and each node's row in it (-1 for other modes)."""
    member_nodes = np.flatnonzero(mode == _MEMBER)
    row = np.full(mode.shape, -1, dtype=np.int64)
    if member_nodes.size == 0:
        return np.full((1, 1), np.nan), row
    values = np.asarray(node.attr("membership_values", np.zeros(0)), np.float64).ravel()
    cuts = np.flatnonzero(np.isnan(values))
    if cuts.size != member_nodes.size:
        raise invalid_model(
            node,
            f"membership_values holds {cuts.size} NaN-terminated sets for "
            f"{member_nodes.size} BRANCH_MEMBER nodes",
        )
    sets = np.split(values, cuts + 1)[: cuts.size]
    members = np.full((len(sets), max(len(s) for s in sets)), np.nan)
    for i, s in enumerate(sets):
        members[i, : len(s)] = s
    row[member_nodes] = np.arange(member_nodes.size)
    return members, row


def _check_range(node: NodeInfo, name: str, values: Array, stop: int) -> None:
    bad = values[(values < 0) | (values >= stop)]
    if bad.size:
        raise invalid_model(node, f"{name} holds {int(bad[0])}, outside [0, {stop})")


def _forest(node: NodeInfo, n_features: int) -> _Forest:
    feature = _ints(node, "nodes_featureids")
    nodes = {
        "nodes_featureids": feature,
        "nodes_modes": _tensor(node, "nodes_modes").astype(np.int64),
        "nodes_splits": _tensor(node, "nodes_splits"),
        "nodes_truenodeids": _ints(node, "nodes_truenodeids"),
        "nodes_falsenodeids": _ints(node, "nodes_falsenodeids"),
        "nodes_trueleafs": _ints(node, "nodes_trueleafs").astype(bool),
        "nodes_falseleafs": _ints(node, "nodes_falseleafs").astype(bool),
        "nodes_missing_value_tracks_true": _ints(
            node, "nodes_missing_value_tracks_true", [0] * feature.size
        ).astype(bool),
    }
    leaves = {"leaf_targetids": _ints(node, "leaf_targetids")}
    leaves["leaf_weights"] = _tensor(node, "leaf_weights").astype(np.float64)
    for group in (nodes, leaves):
        sizes = {name: v.size for name, v in group.items()}
        if len(set(sizes.values())) != 1:
            raise invalid_model(node, f"attributes differ in length: {sizes}")
    n_nodes, n_leaves = feature.size, leaves["leaf_targetids"].size
    n_targets = int(node.attr("n_targets", node.out_shapes[0][-1]))
    mode = nodes["nodes_modes"]
    _check_range(node, "nodes_modes", mode, 7)
    _check_range(node, "nodes_featureids", feature, n_features)
    _check_range(node, "leaf_targetids", leaves["leaf_targetids"], n_targets)
    roots = _ints(node, "tree_roots")
    _check_range(node, "tree_roots", roots, n_nodes)
    for side in ("true", "false"):
        ids, to_leaf = nodes[f"nodes_{side}nodeids"], nodes[f"nodes_{side}leafs"]
        _check_range(node, f"nodes_{side}nodeids (leaves)", ids[to_leaf], n_leaves)
        _check_range(node, f"nodes_{side}nodeids (nodes)", ids[~to_leaf], n_nodes)
    members, member_row = _member_sets(node, mode)
    return _Forest(
        roots=roots,
        feature=feature,
        mode=mode,
        split=nodes["nodes_splits"],
        true_id=nodes["nodes_truenodeids"],
        false_id=nodes["nodes_falsenodeids"],
        true_leaf=nodes["nodes_trueleafs"],
        false_leaf=nodes["nodes_falseleafs"],
        missing_true=nodes["nodes_missing_value_tracks_true"],
        members=members,
        member_row=member_row,
        target=leaves["leaf_targetids"],
        weight=leaves["leaf_weights"],
        n_targets=n_targets,
    )


def _goes_true(forest: _Forest, ids: Array, value: Array) -> Array:
    """The branch each interior node `ids[k]` takes for feature value `value[k]`."""
    split = forest.split[ids].astype(value.dtype)
    mode = forest.mode[ids]
    member = (forest.members[forest.member_row[ids]] == value[:, None].astype(np.float64)).any(1)
    verdict = np.select(
        [mode == m for m in range(7)],
        [value <= split, value < split, value >= split, value > split]
        + [value == split, value != split, member],
    )
    return verdict.astype(bool) | (np.isnan(value) & forest.missing_true[ids])


def _walk(node: NodeInfo, forest: _Forest, x: Array) -> Array:
    """The leaf each (tree, row) reaches: all pairs advance one level per step."""
    rows = np.broadcast_to(np.arange(x.shape[0]), (forest.roots.size, x.shape[0])).ravel()
    at = np.repeat(forest.roots, x.shape[0])
    done = np.zeros(at.shape, dtype=bool)
    for _ in range(forest.feature.size + 1):
        active = np.flatnonzero(~done)
        if active.size == 0:
            return at.reshape(forest.roots.size, x.shape[0])
        ids = at[active]
        right = _goes_true(forest, ids, x[rows[active], forest.feature[ids]])
        at[active] = np.where(right, forest.true_id[ids], forest.false_id[ids])
        done[active] = np.where(right, forest.true_leaf[ids], forest.false_leaf[ids])
    raise invalid_model(node, "a tree's branches form a cycle (no leaf is reached)")


def _aggregate(node: NodeInfo, forest: _Forest, leaves: Array, n_rows: int) -> Array:
    """Per (row, target): the sum, mean over trees, min or max of the leaf weights reached;
    0 for a target no reached leaf feeds."""
    function = int(node.attr("aggregate_function", _SUM))
    rows = np.broadcast_to(np.arange(n_rows), leaves.shape).ravel()
    targets, weights = forest.target[leaves.ravel()], forest.weight[leaves.ravel()]
    if function in (_SUM, _AVERAGE):
        out = np.zeros((n_rows, forest.n_targets))
        np.add.at(out, (rows, targets), weights)
        return out / forest.roots.size if function == _AVERAGE else out
    if function not in (_MIN, _MAX):
        raise invalid_model(node, f"aggregate_function must be 0 to 3, got {function}")
    pick = np.minimum if function == _MIN else np.maximum
    out = np.full((n_rows, forest.n_targets), np.inf if function == _MIN else -np.inf)
    pick.at(out, (rows, targets), weights)
    hit = np.zeros(out.shape, dtype=bool)
    hit[rows, targets] = True
    return np.where(hit, out, 0.0)


def _erfinv(z: Array) -> Array:
    """Inverse error function: a closed-form first guess refined by Newton steps on erf."""
    erf = np.frompyfunc(math.erf, 1, 1)
    with np.errstate(all="ignore"):
        log_term = np.log1p(-z * z)
        a = 0.147
        head = 2 / (np.pi * a) + log_term / 2
        y = np.sign(z) * np.sqrt(np.sqrt(head * head - log_term / a) - head)
        inner = np.abs(z) < 1
        for _ in range(3):
            step = (erf(y[inner]).astype(np.float64) - z[inner]) / (
                2 / math.sqrt(math.pi) * np.exp(-(y[inner] ** 2))
            )
            y[inner] -= step
        y[np.abs(z) == 1] = np.sign(z[np.abs(z) == 1]) * np.inf
        y[~(np.abs(z) <= 1)] = np.nan
    return np.asarray(y, dtype=np.float64)


def _softmax(scores: Array, keep_zeros: bool) -> Array:
    """Softmax over each row; with `keep_zeros`, zero scores stay 0 and drop out of the sum."""
    live = scores != 0 if keep_zeros else np.ones(scores.shape, dtype=bool)
    top = np.max(np.where(live, scores, -np.inf), axis=1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.where(live, np.exp(scores - top), 0.0)
    total = e.sum(axis=1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def _post_transform(node: NodeInfo, scores: Array) -> Array:
    transform = int(node.attr("post_transform", _NONE))
    if transform == _NONE:
        return scores
    if transform in (_SOFTMAX, _SOFTMAX_ZERO):
        return _softmax(scores, keep_zeros=transform == _SOFTMAX_ZERO)
    if transform == _LOGISTIC:
        return np.asarray(1 / (1 + np.exp(-scores)))
    if transform == _PROBIT:
        return math.sqrt(2) * _erfinv(2 * scores - 1)
    raise invalid_model(node, f"post_transform must be 0 to 4, got {transform}")


def _check_tree_ensemble(node: NodeInfo) -> list[int]:
    """Tiling rule that checks the attributes at compile time; the op runs whole."""
    x_shape = node.in_shapes[0] if node.in_shapes else None
    if x_shape is None or len(x_shape) != 2:
        raise invalid_model(node, f"X must be [N, features], got shape {x_shape}")
    _check_acyclic(node, _forest(node, x_shape[1]))
    _check_choice(node, "aggregate_function", _SUM, 4)
    _check_choice(node, "post_transform", _NONE, 5)
    return []


def _check_acyclic(node: NodeInfo, forest: _Forest) -> None:
    """Every path from a root reaches a leaf: the set of interior nodes reachable in exactly
    k steps must empty out within as many steps as there are interior nodes."""
    level = np.zeros(forest.feature.size, dtype=bool)
    level[forest.roots] = True
    for _ in range(forest.feature.size + 1):
        if not level.any():
            return
        ids = np.flatnonzero(level)
        level = np.zeros_like(level)
        level[forest.true_id[ids][~forest.true_leaf[ids]]] = True
        level[forest.false_id[ids][~forest.false_leaf[ids]]] = True
    raise invalid_model(node, "a tree's branches form a cycle (no leaf is reached)")


def _check_choice(node: NodeInfo, name: str, default: int, count: int) -> None:
    value = int(node.attr(name, default))
    if not 0 <= value < count:
        raise invalid_model(node, f"{name} must be 0 to {count - 1}, got {value}")


def tree_ensemble_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = _input(node, inputs, 0)
    if x.ndim != 2:
        raise invalid_model(node, f"X must be [N, features], got shape {tuple(x.shape)}")
    forest = _forest(node, x.shape[1])
    leaves = _walk(node, forest, x)
    with np.errstate(all="ignore"):
        scores = _post_transform(node, _aggregate(node, forest, leaves, x.shape[0]))
    return [scores.astype(np.dtype(node.out_dtypes[0]))]


register(
    "Binarizer",
    binarizer_compute,
    since=1,
    dtypes=_ML_NUMBERS,
    domain=ML,
    kernel="binarizer",
    same_shape=True,
    split_axes=elementwise_split,
    input_boxes=broadcast_boxes,
    doc="Elementwise X > threshold as 0/1 in X's type; tiles like a unary op.",
)
register(
    "Scaler",
    scaler_compute,
    since=1,
    dtypes=_ML_NUMBERS,
    domain=ML,
    kernel="scaler",
    same_shape=True,
    doc="(X - offset) * scale per feature (or one pair for all), output float32; runs whole.",
)
register(
    "Normalizer",
    normalizer_compute,
    since=1,
    dtypes=_ML_NUMBERS,
    domain=ML,
    kernel="normalizer",
    same_shape=True,
    doc="Rows divided by their MAX, L1 or L2 norm, output float32; runs whole.",
)
register(
    "Imputer",
    imputer_compute,
    since=1,
    dtypes=_ML_NUMBERS,
    domain=ML,
    kernel="imputer",
    same_shape=True,
    doc="Replaces a value (or NaN) with one imputed value per feature or for all; runs whole.",
)
register(
    "LabelEncoder",
    label_encoder_compute,
    since=2,
    dtypes=frozenset({"float32", "float64", "int16", "int32", "int64"}),
    domain=ML,
    kernel="label_encoder",
    same_shape=True,
    split_axes=_check_label_encoder,
    doc="Numeric keys to numeric values (string tables are not supported); runs whole.",
)
register(
    "ArrayFeatureExtractor",
    array_feature_extractor_compute,
    since=1,
    dtypes=_ML_NUMBERS,
    domain=ML,
    kernel="array_feature_extractor",
    doc="Gathers runtime indices on the last axis (a 1-D X gives [1, K]); numeric X only.",
)
register(
    "TreeEnsemble",
    tree_ensemble_compute,
    since=5,
    dtypes=FLOATS,
    domain=ML,
    kernel="tree_ensemble",
    split_axes=_check_tree_ensemble,
    doc="All six comparison modes and set membership, NaN routing, SUM/AVERAGE/MIN/MAX, "
    "every post_transform (spec numbering); runs whole.",
)
