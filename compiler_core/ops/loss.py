"""Loss ops: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.

Small graph-tail ops; each runs whole as one tile (reductions over every axis need it).
Math runs in float32 (float64 for float64 inputs) and rounds once to the output type.
"""

from __future__ import annotations

import numpy as np

from compiler_core.ops.registry import FLOATS, NodeInfo, TileCtx, register

Array = np.ndarray


def _nll(node: NodeInfo, log_prob: Array, target: Array, weight: Array | None) -> Array:
    """-log_prob[n, target[n, d...], d...] * weight[target], reduced as `reduction` says."""
    ignore = node.attr("ignore_index")
    target = target.astype(np.int64)
    keep = np.ones(target.shape, bool) if ignore is None else target != int(ignore)
    safe = np.where(keep, target, 0)
    picked = np.take_along_axis(log_prob, safe[:, None, ...], axis=1)[:, 0, ...]
    w = (
        np.ones(target.shape, log_prob.dtype)
        if weight is None
        else weight.astype(log_prob.dtype)[safe]
    )
    w = np.where(keep, w, 0).astype(log_prob.dtype)
    loss = -picked * w
    reduction = node.attr("reduction", "mean")
    if reduction == "none":
        return loss
    if reduction == "sum":
        return np.asarray(loss.sum())
    return np.asarray(loss.sum() / w.sum())


def _acc(x: Array) -> type[np.floating]:
    return np.float64 if x.dtype == np.float64 else np.float32


def nll_loss_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    x, target = inputs[0], inputs[1]
    assert x is not None and target is not None
    weight = inputs[2] if len(inputs) > 2 else None
    loss = _nll(node, x.astype(_acc(x)), target, weight)
    return [loss.astype(np.dtype(node.out_dtypes[0]))]


def softmax_cross_entropy_compute(
    node: NodeInfo, inputs: list[Array | None], tile: TileCtx
) -> list[Array]:
    scores, labels = inputs[0], inputs[1]
    assert scores is not None and labels is not None
    weight = inputs[2] if len(inputs) > 2 else None
    s = scores.astype(_acc(scores))
    shifted = s - s.max(axis=1, keepdims=True)
    log_prob = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = _nll(node, log_prob, labels, weight)
    outputs = [loss.astype(np.dtype(node.out_dtypes[0]))]
    if len(node.out_dtypes) > 1:
        outputs.append(log_prob.astype(np.dtype(node.out_dtypes[1])))
    return outputs


register(
    "NegativeLogLikelihoodLoss",
    nll_loss_compute,
    since=12,
    dtypes=FLOATS,
    kernel="nll_loss",
    doc="Whole-tensor kernel; reduction none/sum/mean, ignore_index, class weights.",
)
register(
    "SoftmaxCrossEntropyLoss",
    softmax_cross_entropy_compute,
    since=12,
    dtypes=FLOATS,
    kernel="softmax_cross_entropy",
    doc="LogSoftmax over axis 1 then NegativeLogLikelihoodLoss; optional log_prob output.",
)
