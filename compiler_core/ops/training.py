"""Optimizer update ops of the ai.onnx.preview.training domain: Adagrad, Adam and Momentum.

Each takes a learning rate R and an update count T (scalars) followed by N tensors to optimize,
their N gradients and the optimizer's N-tensor state groups (H for Adagrad; V then H for Adam;
V for Momentum), and returns the N updated tensors followed by the updated state, group by
group. The update is elementwise but spread over many outputs of unrelated shapes, so each node
runs whole as one tile. Math runs in float64 and rounds once to each output's type, which is at
least as accurate as the float32 arithmetic of the reference.
"""

from __future__ import annotations

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.registry import NodeInfo, TileCtx, register

Array = np.ndarray

TRAINING = "ai.onnx.preview.training"
_TRAINING_FLOATS = frozenset({"float32", "float64"})


def _invalid(node: NodeInfo, message: str) -> CompileError:
    return CompileError("invalid_model", f"{node.op_type}: {message}", node=node.name)


def _groups(node: NodeInfo, inputs: list[Array | None], per: int) -> list[list[Array]]:
    """Split inputs[2:] into `per` lists of N same-shaped tensors (X's, G's, state...), in
    float64, after checking that the outputs are the N X's and the `per - 2` state groups."""
    rest = inputs[2:]
    if not rest or len(rest) % per or any(a is None for a in rest):
        raise _invalid(node, f"expected R, T and {per} groups of N tensors, got {len(inputs)}")
    n = len(rest) // per
    if len(node.out_dtypes) != (per - 1) * n:
        raise _invalid(node, f"{n} tensors to update need {(per - 1) * n} outputs")
    groups = [[np.asarray(a, np.float64) for a in rest[k * n : (k + 1) * n]] for k in range(per)]
    for i in range(n):
        shapes = {g[i].shape for g in groups}
        if len(shapes) != 1:
            raise _invalid(node, f"tensor {i} and its gradient/state differ in shape: {shapes}")
    return groups


def _scalars(node: NodeInfo, inputs: list[Array | None]) -> tuple[float, int]:
    r, t = inputs[0], inputs[1]
    if r is None or t is None or np.size(r) != 1 or np.size(t) != 1:
        raise _invalid(node, "R and T must be given as scalars")
    return float(np.asarray(r).reshape(())), int(np.asarray(t).reshape(()))


def _required(node: NodeInfo, name: str) -> float:
    value = node.attr(name)
    if value is None:
        raise _invalid(node, f"attribute '{name}' is required")
    return float(value)


def _cast(node: NodeInfo, arrays: list[Array]) -> list[Array]:
    return [
        np.asarray(a).astype(np.dtype(dt)) for a, dt in zip(arrays, node.out_dtypes, strict=True)
    ]


def adagrad_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """r = R / (1 + T * decay); H += g^2; X -= r * g / (sqrt(H) + eps), g = G + norm * X."""
    r, t = _scalars(node, inputs)
    xs, gs, hs = _groups(node, inputs, 3)
    norm = float(node.attr("norm_coefficient", 0.0))
    eps = float(node.attr("epsilon", 1e-6))
    decay = float(node.attr("decay_factor", 0.0))
    rate = r / (1 + t * decay)
    new_x, new_h = [], []
    for x, g, h in zip(xs, gs, hs, strict=True):
        g = norm * x + g
        h = h + g * g
        new_x.append(x - rate * g / (np.sqrt(h) + eps))
        new_h.append(h)
    return _cast(node, new_x + new_h)


def adam_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """Adam with bias correction folded into the rate (from T > 0 on) and an optional decay of
    X after the step (norm_coefficient_post)."""
    r, t = _scalars(node, inputs)
    xs, gs, vs, hs = _groups(node, inputs, 4)
    alpha = float(node.attr("alpha", 0.9))
    beta = float(node.attr("beta", 0.999))
    eps = float(node.attr("epsilon", 1e-6))
    norm = float(node.attr("norm_coefficient", 0.0))
    norm_post = float(node.attr("norm_coefficient_post", 0.0))
    rate = r * np.sqrt(1 - beta**t) / (1 - alpha**t) if t > 0 else r
    new_x, new_v, new_h = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs, strict=True):
        g = norm * x + g
        v = alpha * v + (1 - alpha) * g
        h = beta * h + (1 - beta) * (g * g)
        new_x.append((1 - norm_post) * (x - rate * (v / (np.sqrt(h) + eps))))
        new_v.append(v)
        new_h.append(h)
    return _cast(node, new_x + new_v + new_h)


def _momentum_mode(node: NodeInfo) -> str:
    mode = node.attr("mode")
    if isinstance(mode, bytes):
        mode = mode.decode()
    if mode not in ("standard", "nesterov"):
        raise _invalid(node, f"mode must be 'standard' or 'nesterov', got {mode!r}")
    return str(mode)


def _check_momentum(node: NodeInfo) -> list[int]:
    """Tiling rule that checks the mode at compile time; the op runs whole."""
    _momentum_mode(node)
    return []


def momentum_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    """V = alpha * V + beta * g (beta is 1 at T == 0); X -= R * V (standard) or
    R * (g + alpha * V) (nesterov), g = G + norm * X."""
    r, t = _scalars(node, inputs)
    xs, gs, vs = _groups(node, inputs, 3)
    alpha = _required(node, "alpha")
    beta = _required(node, "beta") if t > 0 else 1.0
    norm = _required(node, "norm_coefficient")
    nesterov = _momentum_mode(node) == "nesterov"
    new_x, new_v = [], []
    for x, g, v in zip(xs, gs, vs, strict=True):
        g = norm * x + g
        v = alpha * v + beta * g
        new_x.append(x - r * (g + alpha * v if nesterov else v))
        new_v.append(v)
    return _cast(node, new_x + new_v)


register(
    "Adagrad",
    adagrad_compute,
    since=1,
    dtypes=_TRAINING_FLOATS,
    domain=TRAINING,
    kernel="adagrad",
    doc="Whole-node elementwise update of N tensors; outputs X_new..., H_new....",
)
register(
    "Adam",
    adam_compute,
    since=1,
    dtypes=_TRAINING_FLOATS,
    domain=TRAINING,
    kernel="adam",
    doc="Whole-node elementwise update of N tensors with bias correction; X_new..., V..., H....",
)
register(
    "Momentum",
    momentum_compute,
    since=1,
    dtypes=_TRAINING_FLOATS,
    domain=TRAINING,
    kernel="momentum",
    split_axes=_check_momentum,
    doc="Whole-node SGD with momentum, standard or nesterov mode; outputs X_new..., V_new....",
)
