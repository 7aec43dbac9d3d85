"""Detection post-processing: NonMaxSuppression.

NMS is greedy and sequential per (batch, class): a box is kept only if no box kept before it
overlaps it too much, so the node runs whole as one tile. Its row count depends on the data;
a static compiler takes it from the graph output's declared shape (the importer's
data-dependent-shape contract), and the kernel refuses a run whose selection has a different
count rather than pad or truncate silently.

Overlap is computed in float32 with the same comparisons ONNX Runtime uses (a box is
suppressed when IoU > iou_threshold; a candidate needs score > score_threshold; degenerate
boxes never suppress), so results on threshold boundaries agree with it.
"""

from __future__ import annotations

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.registry import NodeInfo, TileCtx, register

Array = np.ndarray


def _corners(boxes: Array, center_point_box: int) -> Array:
    """[..., 4] boxes as (y_min, x_min, y_max, x_max) in float32."""
    b = boxes.astype(np.float32)
    if center_point_box:
        xc, yc, w, h = b[..., 0], b[..., 1], b[..., 2], b[..., 3]
        half_w, half_h = w / np.float32(2), h / np.float32(2)
        return np.stack([yc - half_h, xc - half_w, yc + half_h, xc + half_w], axis=-1)
    y_min = np.minimum(b[..., 0], b[..., 2])
    y_max = np.maximum(b[..., 0], b[..., 2])
    x_min = np.minimum(b[..., 1], b[..., 3])
    x_max = np.maximum(b[..., 1], b[..., 3])
    return np.stack([y_min, x_min, y_max, x_max], axis=-1)


def _overlaps(box: Array, kept: Array, iou_threshold: np.float32) -> bool:
    """Whether `box` overlaps any of `kept` (both in corner form) by more than the threshold."""
    if kept.shape[0] == 0:
        return False
    inter_h = np.minimum(box[2], kept[:, 2]) - np.maximum(box[0], kept[:, 0])
    inter_w = np.minimum(box[3], kept[:, 3]) - np.maximum(box[1], kept[:, 1])
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (kept[:, 2] - kept[:, 0]) * (kept[:, 3] - kept[:, 1])
    inter = np.maximum(inter_h, np.float32(0)) * np.maximum(inter_w, np.float32(0))
    union = area + areas - inter
    valid = (inter_h > 0) & (inter_w > 0) & (area > 0) & (areas > 0) & (union > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = inter / np.where(valid, union, np.float32(1))
    return bool(np.any(valid & (iou > iou_threshold)))


def _select(
    corners: Array, scores: Array, limit: int, iou_threshold: np.float32, score_min: float | None
) -> list[int]:
    """Greedy NMS over one class: indices of the kept boxes, best score first."""
    order = np.argsort(-scores.astype(np.float64), kind="stable")  # ties: lower index first
    if score_min is not None:
        order = order[scores[order] > score_min]
    kept: list[int] = []
    for index in order:
        if len(kept) >= limit:
            break
        if not _overlaps(corners[index], corners[kept], iou_threshold):
            kept.append(int(index))
    return kept


def _scalar(inputs: list[Array | None], index: int) -> Array | None:
    value = inputs[index] if index < len(inputs) else None
    if value is None or value.size == 0:
        return None
    return value.reshape(-1)[0]


def _check_shapes(node: NodeInfo, boxes: Array, scores: Array) -> None:
    if boxes.ndim != 3 or boxes.shape[2] != 4:
        raise CompileError(
            "invalid_model",
            f"NonMaxSuppression: boxes shape {tuple(boxes.shape)} is not [batch, boxes, 4]",
            node=node.name,
        )
    if scores.ndim != 3 or scores.shape[0] != boxes.shape[0] or scores.shape[2] != boxes.shape[1]:
        raise CompileError(
            "invalid_model",
            f"NonMaxSuppression: scores shape {tuple(scores.shape)} does not match boxes "
            f"{tuple(boxes.shape)} (expected [batch, classes, boxes])",
            node=node.name,
        )


def _center_point_box(node: NodeInfo) -> int:
    value = int(node.attr("center_point_box", 0))
    if value not in (0, 1):
        raise CompileError(
            "invalid_model",
            f"NonMaxSuppression: center_point_box must be 0 or 1, got {value}",
            node=node.name,
        )
    return value


def nms_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    boxes, scores = inputs[0], inputs[1]
    assert boxes is not None and scores is not None
    center_point_box = _center_point_box(node)
    _check_shapes(node, boxes, scores)
    limit_value = _scalar(inputs, 2)
    limit = 0 if limit_value is None else max(0, int(limit_value))
    iou_value = _scalar(inputs, 3)
    iou_threshold = np.float32(0 if iou_value is None else iou_value)
    score_value = _scalar(inputs, 4)
    score_min = None if score_value is None else float(np.float32(score_value))

    corners = _corners(boxes, center_point_box)
    rows: list[tuple[int, int, int]] = []
    for b in range(scores.shape[0]):
        for c in range(scores.shape[1]):
            kept = _select(corners[b], scores[b, c], limit, iou_threshold, score_min)
            rows.extend((b, c, k) for k in kept)

    expected = int(node.out_shapes[0][0])
    if len(rows) != expected:
        raise CompileError(
            "runtime_fault",
            f"NonMaxSuppression selected {len(rows)} boxes but the declared output "
            f"{node.out_shapes[0]} holds {expected}",
            node=node.name,
        )
    out = np.array(rows, dtype=np.int64).reshape(len(rows), 3)
    return [out.astype(np.dtype(node.out_dtypes[0]))]


def nms_macs(node: NodeInfo) -> int:
    """Pairwise IoU within each class: about classes * boxes^2 / 2 per batch, times ~10 ops.

    Also the compile-time check of the attribute (the cost model sees every node)."""
    _center_point_box(node)
    shape = node.in_shapes[1]
    assert shape is not None
    batch, classes, count = (int(d) for d in shape)
    return max(1, batch * classes * count * count * 5)


register(
    "NonMaxSuppression",
    nms_compute,
    since=10,
    dtypes=frozenset({"float32"}),
    kernel="non_max_suppression",
    macs=nms_macs,
    doc="Whole-tensor greedy NMS (corner or center boxes); the selected count must equal the "
    "graph output's declared row count.",
)
