"""Text featurisation: TfIdfVectorizer over integer token ids.

The attributes describe a pool of n-grams, grouped by length (`ngram_counts[i]` is where the
(i+1)-grams start in the pool); n-gram k maps to output column `ngram_indexes[k]` and has
weight `weights[k]` (default 1). The kernel counts, per row, every n-gram of each length in
[min_gram_length, max_gram_length] at each skip distance up to max_skip_count, weights each
n-gram's count (TF: the count; IDF: the weight if the count is non-zero; TFIDF: count x
weight) and sums the n-grams sharing a column (IDF without weights marks it 1), as ONNX
Runtime does. Unigrams are counted once, not once per skip distance, also like ONNX Runtime.
IDF weights on n-grams that share a column are refused: ONNX Runtime then keeps whichever
weight it meets last in its scan, an artefact of its traversal rather than a defined result.
Matching is a broadcast comparison of every window against every pool n-gram of its length:
small pools and rows are the norm, and it needs no hashing of tuples.

Rows are independent but the whole input is small, so the node runs whole as one tile.
String tokens (pool_strings) are not supported: strings never reach the accelerator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.registry import NodeInfo, TileCtx, invalid_model, register

Array = np.ndarray

_MODES = ("TF", "IDF", "TFIDF")


@dataclass(frozen=True)
class _Pool:
    """The n-gram pool cut into levels: grams[n] is a [count, n] array of the n-grams, ids[n]
    their positions in pool order (which index `columns` and `weights`)."""

    grams: dict[int, Array]
    ids: dict[int, Array]
    columns: Array
    width: int
    weights: Array | None


def _as_str(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _mode(node: NodeInfo) -> str:
    mode = _as_str(node.attr("mode", ""))
    if mode not in _MODES:
        raise invalid_model(node, f"mode {mode!r} is not TF, IDF or TFIDF")
    return mode


def _gram_lengths(node: NodeInfo) -> tuple[int, int, int]:
    low = int(node.attr("min_gram_length", 0))
    high = int(node.attr("max_gram_length", 0))
    skip = int(node.attr("max_skip_count", 0))
    if not 1 <= low <= high:
        raise invalid_model(node, f"gram lengths [{low}, {high}] are not 1 <= min <= max")
    if skip < 0:
        raise invalid_model(node, f"max_skip_count {skip} is negative")
    return low, high, skip


def _pool(node: NodeInfo, low: int, high: int) -> _Pool:
    """The pool's levels; n-grams of a counted length ([low, high]) must be distinct."""
    if node.attr("pool_strings") is not None:
        raise invalid_model(node, "pool_strings (string tokens) is not supported, only pool_int64s")
    pool = np.asarray(node.attr("pool_int64s", []), dtype=np.int64)
    starts = [int(v) for v in node.attr("ngram_counts", [])]
    columns = np.asarray(node.attr("ngram_indexes", []), dtype=np.int64)
    bounds = [*starts, pool.size]
    if any(a > b for a, b in zip(bounds, bounds[1:], strict=False)) or (starts and starts[0]):
        raise invalid_model(node, f"ngram_counts {starts} are not increasing offsets into the pool")
    grams: dict[int, Array] = {}
    ids: dict[int, Array] = {}
    used = 0
    for level, (begin, end) in enumerate(zip(bounds, bounds[1:], strict=False)):
        n = level + 1
        if (end - begin) % n:
            raise invalid_model(
                node, f"{end - begin} pool entries for {n}-grams is not a multiple of {n}"
            )
        count = (end - begin) // n
        grams[n] = pool[begin:end].reshape(count, n)
        if low <= n <= high and np.unique(grams[n], axis=0).shape[0] != count:
            raise invalid_model(node, f"the pool lists a {n}-gram twice")
        ids[n] = np.arange(used, used + count)
        used += count
    if used != columns.size or (columns.size and columns.min() < 0):
        raise invalid_model(node, f"{columns.size} ngram_indexes for {used} pool n-grams")
    width = int(columns.max()) + 1 if columns.size else 0
    weights_attr = node.attr("weights")
    weights = None if weights_attr is None else np.asarray(weights_attr, dtype=np.float32)
    if weights is not None and weights.size != used:
        raise invalid_model(node, f"{weights.size} weights for {used} pool n-grams")
    return _Pool(grams, ids, columns, width, weights)


def _check_idf_weights(node: NodeInfo, mode: str, pool: _Pool) -> None:
    shared = np.unique(pool.columns).size != pool.columns.size
    if mode == "IDF" and pool.weights is not None and shared:
        raise CompileError(
            "unsupported_attribute",
            "TfIdfVectorizer: IDF weights on n-grams that share an output column are not supported",
            node=node.name,
        )


def _count_level(tokens: Array, grams: Array, step: int) -> Array:
    """[rows, count] occurrences of each gram (its tokens taken `step` apart) in each row."""
    n = grams.shape[1]
    positions = tokens.shape[1] - (n - 1) * step
    if positions <= 0 or grams.shape[0] == 0:
        return np.zeros((tokens.shape[0], grams.shape[0]), dtype=np.int64)
    windows = np.stack([tokens[:, k * step : k * step + positions] for k in range(n)], axis=-1)
    hits: Array = (windows[:, :, None, :] == grams[None, None, :, :]).all(axis=-1).sum(axis=1)
    return hits


def _gram_counts(tokens: Array, pool: _Pool, low: int, high: int, skip: int) -> Array:
    """[rows, pool n-grams] occurrence counts, in pool order."""
    counts = np.zeros((tokens.shape[0], pool.columns.size), dtype=np.int64)
    for n in range(low, min(high, max(pool.grams, default=0)) + 1):
        for step in range(1, (skip + 2) if n > 1 else 2):  # unigrams do not skip
            counts[:, pool.ids[n]] += _count_level(tokens, pool.grams[n], step)
    return counts


def tfidf_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x = inputs[0]
    assert x is not None
    if x.ndim not in (1, 2):
        raise invalid_model(node, f"input rank {x.ndim} is not 1 or 2")
    mode = _mode(node)
    low, high, skip = _gram_lengths(node)
    pool = _pool(node, low, high)
    _check_idf_weights(node, mode, pool)
    tokens = (x.reshape(1, -1) if x.ndim == 1 else x).astype(np.int64)
    counts = _gram_counts(tokens, pool, low, high, skip).astype(np.float32)
    if mode == "IDF":
        counts = (counts > 0).astype(np.float32)
    if mode != "TF" and pool.weights is not None:
        counts = counts * pool.weights
    out = np.zeros((tokens.shape[0], pool.width), dtype=np.float32)
    # IDF without weights marks a column present once, however many of its n-grams occur
    # (with weights its columns are distinct, see _check_idf_weights).
    gather = np.maximum.at if mode == "IDF" and pool.weights is None else np.add.at
    gather(out.T, pool.columns, counts.T)  # columns of `out`, through a transposed view
    return [out.reshape(node.out_shapes[0]).astype(np.dtype(node.out_dtypes[0]))]


def tfidf_macs(node: NodeInfo) -> int:
    """Every window against every pool n-gram; also the compile-time attribute check."""
    mode = _mode(node)
    low, high, skip = _gram_lengths(node)
    pool = _pool(node, low, high)
    _check_idf_weights(node, mode, pool)
    shape = node.in_shapes[0]
    assert shape is not None
    tokens = int(np.prod(shape, dtype=np.int64))
    grams = sum(g.size for g in pool.grams.values())
    return max(1, tokens * grams * (skip + 1))


register(
    "TfIdfVectorizer",
    tfidf_compute,
    since=9,
    dtypes=frozenset({"int32", "int64"}),
    kernel="tfidf_vectorizer",
    macs=tfidf_macs,
    doc="Whole-tensor n-gram counting over int token ids (rank 1 or 2) with skips; TF, IDF "
    "or TFIDF weighting. String pools are not supported.",
)
