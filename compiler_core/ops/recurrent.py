"""Recurrent ops: RNN, GRU and LSTM (opsets 7, 14 and 22: one definition, `layout` read
when present).

Each runs whole: every time step depends on the previous one, so no output axis can be
cut into independent tiles. The three share one driver that normalises the layout to
time-major, walks each direction over the time steps and assembles Y / Y_h (/ Y_c); they
differ only in the cell (one step of the recurrence for the whole batch).

Numerics follow the equations of the specification literally (gate order LSTM i o f c,
GRU z r h), in float32 (float64 for float64 inputs; float16 is computed in float32 and
rounded once at the end). `clip` bounds every activation's input, as ONNX Runtime does
(the cell state fed to LSTM's h is not clipped).

`sequence_lens`: a batch entry of length L runs steps 0..L-1 only (the reverse direction
starts at L-1); its state is frozen past L, its Y rows there are zero, and its Y_h / Y_c
are the state after its last valid step. For L = 0 they are zeros, as in ONNX Runtime
(the specification does not say; the initial state would be the other reading).

`activation_alpha` / `activation_beta` are consumed in order by the activations that take
that parameter (as ONNX Runtime reads them); an activation that finds the list exhausted
uses ONNX Runtime's default (the specification gives none for recurrent ops).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.ops.registry import FLOATS, NodeInfo, TileCtx, invalid_model, register

Array = np.ndarray
Activation = Callable[[Array], Array]


def _sigmoid(x: Array) -> Array:
    # Split by sign so that exp never overflows.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _softplus(x: Array) -> Array:
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def _make(name: str, a: float, b: float, dt: type[np.floating]) -> Activation:
    alpha, beta = dt(a), dt(b)
    table: dict[str, Activation] = {
        "relu": lambda x: np.maximum(x, dt(0)),
        "tanh": np.tanh,
        "sigmoid": _sigmoid,
        "affine": lambda x: alpha * x + beta,
        "leakyrelu": lambda x: np.where(x >= 0, x, alpha * x),
        "thresholdedrelu": lambda x: np.where(x > alpha, x, dt(0)),
        "scaledtanh": lambda x: alpha * np.tanh(beta * x),
        "hardsigmoid": lambda x: np.clip(alpha * x + beta, dt(0), dt(1)),
        "elu": lambda x: np.where(x >= 0, x, alpha * (np.exp(np.minimum(x, 0)) - 1)),
        "softsign": lambda x: x / (1 + np.abs(x)),
        "softplus": _softplus,
    }
    return table[name]


_PARAMS: dict[str, tuple[float | None, float | None]] = {
    "relu": (None, None),
    "tanh": (None, None),
    "sigmoid": (None, None),
    "softsign": (None, None),
    "softplus": (None, None),
    "affine": (0.0, 0.0),
    "leakyrelu": (0.01, None),
    "thresholdedrelu": (0.0, None),
    "elu": (1.0, None),
    "scaledtanh": (0.0, 0.0),
    "hardsigmoid": (0.2, 0.5),
}
"""Per activation: default alpha and beta, None where it takes no such parameter. The
recurrent ops' specification gives no defaults; these are ONNX Runtime's (note
ThresholdedRelu's 0, where the standalone op's default is 1)."""

_DEFAULT_ACTS = {
    "RNN": ("Tanh",),
    "GRU": ("Sigmoid", "Tanh"),
    "LSTM": ("Sigmoid", "Tanh", "Tanh"),
}

_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def _activations(node: NodeInfo, directions: int, dt: type[np.floating]) -> list[Activation]:
    """The activations of every direction, flat: (f, g, h) forward then (f, g, h) reverse."""
    per_dir = len(_DEFAULT_ACTS[node.op_type])
    names = [str(n) for n in node.attr("activations", [])]
    if not names:
        names = list(_DEFAULT_ACTS[node.op_type]) * directions
    if len(names) != per_dir * directions:
        raise CompileError(
            "invalid_model",
            f"{node.op_type} needs {per_dir * directions} activations "
            f"({per_dir} per direction), got {len(names)}",
            node=node.name,
        )
    alphas = [float(v) for v in node.attr("activation_alpha", [])]
    betas = [float(v) for v in node.attr("activation_beta", [])]
    result = []
    for name in names:
        key = name.lower()
        if key not in _PARAMS:
            raise CompileError(
                "invalid_model", f"{node.op_type}: unknown activation '{name}'", node=node.name
            )
        alpha, beta = _PARAMS[key]
        if alpha is not None and alphas:
            alpha = alphas.pop(0)
        if beta is not None and betas:
            beta = betas.pop(0)
        result.append(_make(key, alpha or 0.0, beta or 0.0, dt))
    return result


@dataclass
class _Weights:
    """One direction's parameters, gate blocks as in the ONNX layout (rows of W / R)."""

    w: Array  # (gates*H, input)
    r: Array  # (gates*H, H)
    wb: Array  # (gates*H,)
    rb: Array  # (gates*H,)
    p: Array | None  # (3*H,) LSTM peepholes i, o, f
    acts: list[Activation]
    clip: float | None


State = tuple[Array, ...]
Cell = Callable[[NodeInfo, _Weights, Array, State], State]
"""One step of one direction for the whole batch: (x_t, state) -> new state; state[0] is H."""


def _clip(x: Array, wts: _Weights) -> Array:
    return x if wts.clip is None else np.clip(x, -wts.clip, wts.clip)


def _rnn_cell(node: NodeInfo, wts: _Weights, x: Array, state: State) -> State:
    (h,) = state
    f = wts.acts[0]
    return (f(_clip(x @ wts.w.T + h @ wts.r.T + wts.wb + wts.rb, wts)),)


def _gru_cell(node: NodeInfo, wts: _Weights, x: Array, state: State) -> State:
    (h,) = state
    f, g = wts.acts[0], wts.acts[1]
    size = h.shape[-1]
    xw = x @ wts.w.T + wts.wb
    w_z, w_r, w_h = xw[:, :size], xw[:, size : 2 * size], xw[:, 2 * size :]
    r_z, r_r, r_h = (wts.r[k * size : (k + 1) * size] for k in range(3))
    rb_z, rb_r, rb_h = (wts.rb[k * size : (k + 1) * size] for k in range(3))
    z = f(_clip(w_z + h @ r_z.T + rb_z, wts))
    r = f(_clip(w_r + h @ r_r.T + rb_r, wts))
    if int(node.attr("linear_before_reset", 0)):
        candidate = g(_clip(w_h + r * (h @ r_h.T + rb_h), wts))
    else:
        candidate = g(_clip(w_h + (r * h) @ r_h.T + rb_h, wts))
    return ((1 - z) * candidate + z * h,)


def _lstm_cell(node: NodeInfo, wts: _Weights, x: Array, state: State) -> State:
    h, c = state
    f, g, act_h = wts.acts[0], wts.acts[1], wts.acts[2]
    size = h.shape[-1]
    pre = x @ wts.w.T + h @ wts.r.T + wts.wb + wts.rb
    pre_i, pre_o, pre_f, pre_c = (pre[:, k * size : (k + 1) * size] for k in range(4))
    p_i, p_o, p_f = (
        (None, None, None)
        if wts.p is None
        else (wts.p[k * size : (k + 1) * size] for k in range(3))
    )
    i = f(_clip(pre_i if p_i is None else pre_i + p_i * c, wts))
    if int(node.attr("input_forget", 0)):
        forget = 1 - i
    else:
        forget = f(_clip(pre_f if p_f is None else pre_f + p_f * c, wts))
    c_new = forget * c + i * g(_clip(pre_c, wts))
    o = f(_clip(pre_o if p_o is None else pre_o + p_o * c_new, wts))
    return (o * act_h(c_new), c_new)


_CELLS: dict[str, Cell] = {"RNN": _rnn_cell, "GRU": _gru_cell, "LSTM": _lstm_cell}


def _input(inputs: list[Array | None], index: int) -> Array | None:
    return inputs[index] if index < len(inputs) else None


def _directions(node: NodeInfo) -> tuple[bool, ...]:
    """One flag per direction: True where it runs backwards in time."""
    direction = node.attr("direction", "forward")
    direction = direction.decode() if isinstance(direction, bytes) else str(direction)
    options = {"forward": (False,), "reverse": (True,), "bidirectional": (False, True)}
    if direction not in options:
        raise invalid_model(
            node, f"direction must be forward, reverse or bidirectional, not '{direction}'"
        )
    return options[direction]


def _state_input(value: Array | None, shape: tuple[int, int, int], batchwise: bool) -> Array:
    """initial_h / initial_c as (directions, batch, H), zeros when absent."""
    if value is None:
        return np.zeros(shape)
    return value.transpose(1, 0, 2) if batchwise else value


def _run_direction(
    node: NodeInfo, wts: _Weights, x: Array, lens: Array, state: State, backwards: bool
) -> tuple[Array, State]:
    """Walk one direction over time-major x (T, batch, input): its Y (T, batch, H) and the
    final state, honouring each batch entry's length."""
    steps, batch = x.shape[0], x.shape[1]
    cell = _CELLS[node.op_type]
    rows = np.arange(batch)
    y = np.zeros((steps, batch, state[0].shape[-1]), dtype=x.dtype)
    for s in range(steps):
        active = s < lens
        if not active.any():
            break
        t = np.where(active, lens - 1 - s, 0) if backwards else np.full(batch, s)
        new = cell(node, wts, x[t, rows], state)
        state = tuple(np.where(active[:, None], n, o) for n, o in zip(new, state, strict=True))
        y[t[active], rows[active]] = new[0][active]
    # An empty sequence produced no state: zeros, as ONNX Runtime gives (not the initial one).
    state = tuple(np.where((lens > 0)[:, None], v, 0).astype(x.dtype) for v in state)
    return y, state


def _check_node(node: NodeInfo) -> None:
    """The static checks: attributes and input shapes against each other."""
    x_shape, w_shape, r_shape = node.in_shapes[0], node.in_shapes[1], node.in_shapes[2]
    assert x_shape is not None and w_shape is not None and r_shape is not None
    layout = int(node.attr("layout", 0))
    if layout not in (0, 1):
        raise invalid_model(node, f"layout must be 0 or 1, not {layout}")
    if len(x_shape) != 3:
        raise invalid_model(node, f"X must have rank 3, has shape {tuple(x_shape)}")
    batch, features = (x_shape[0], x_shape[2]) if layout else (x_shape[1], x_shape[2])
    dirs, gates = len(_directions(node)), _GATES[node.op_type]
    size = int(node.attr("hidden_size", r_shape[-1]))
    shapes = {
        "W": (dirs, gates * size, features),
        "R": (dirs, gates * size, size),
        "B": (dirs, 2 * gates * size),
        "sequence_lens": (batch,),
        "initial_h": (batch, dirs, size) if layout else (dirs, batch, size),
        "initial_c": (batch, dirs, size) if layout else (dirs, batch, size),
        "P": (dirs, 3 * size),
    }
    for index, (name, want) in enumerate(shapes.items(), start=1):
        have = node.in_shapes[index] if index < len(node.in_shapes) else None
        if have is not None and tuple(have) != want:
            raise invalid_model(
                node, f"{name} has shape {tuple(have)}, expected {want} (hidden_size {size})"
            )
    _activations(node, dirs, np.float32)


def recurrent_split_axes(node: NodeInfo) -> list[int]:
    """No split (time steps are sequential); checks the node once, at compile time."""
    _check_node(node)
    return []


def recurrent_compute(node: NodeInfo, inputs: list[Array | None], tile: TileCtx) -> list[Array]:
    _check_node(node)
    x, w, r = inputs[0], inputs[1], inputs[2]
    assert x is not None and w is not None and r is not None
    dt: type[np.floating] = np.float64 if x.dtype == np.float64 else np.float32
    batchwise = bool(int(node.attr("layout", 0)))
    if batchwise:
        x = x.transpose(1, 0, 2)
    x = x.astype(dt)
    steps, batch, _ = x.shape
    backwards = _directions(node)
    dirs, gates = len(backwards), _GATES[node.op_type]
    size = int(node.attr("hidden_size", r.shape[-1]))
    b = _input(inputs, 3)
    if b is None:
        b = np.zeros((dirs, 2 * gates * size), dt)
    lens_in = _input(inputs, 4)
    lens = np.full(batch, steps) if lens_in is None else lens_in.astype(np.int64).reshape(-1)
    if ((lens < 0) | (lens > steps)).any():
        raise invalid_model(node, f"sequence_lens {lens.tolist()} must lie in [0, {steps}]")
    state_shape = (dirs, batch, size)
    h0 = _state_input(_input(inputs, 5), state_shape, batchwise).astype(dt)
    c0 = _state_input(_input(inputs, 6), state_shape, batchwise).astype(dt)
    p = _input(inputs, 7)
    clip = node.attr("clip")
    acts = _activations(node, dirs, dt)
    per_dir = len(acts) // dirs

    y = np.zeros((steps, dirs, batch, size), dt)
    finals: list[list[Array]] = [[], []]
    for d, back in enumerate(backwards):
        wts = _Weights(
            w=w[d].astype(dt),
            r=r[d].astype(dt),
            wb=b[d, : gates * size].astype(dt),
            rb=b[d, gates * size :].astype(dt),
            p=None if p is None else p[d].astype(dt),
            acts=acts[d * per_dir : (d + 1) * per_dir],
            clip=None if clip is None else float(clip),
        )
        state: State = (h0[d], c0[d]) if node.op_type == "LSTM" else (h0[d],)
        y[:, d], final = _run_direction(node, wts, x, lens, state, back)
        for k, value in enumerate(final):
            finals[k].append(value)
    outs = [y] + [np.stack(f) for f in finals if f]
    if batchwise:
        outs = [outs[0].transpose(2, 0, 1, 3)] + [o.transpose(1, 0, 2) for o in outs[1:]]
    count = len(node.out_shapes)
    return [
        np.ascontiguousarray(o).astype(np.dtype(dtype))
        for o, dtype in zip(outs[:count], node.out_dtypes, strict=True)
    ]


def recurrent_macs(node: NodeInfo) -> int:
    """Every step of every direction multiplies x by W and H by R for all gates."""
    x_shape, w_shape, r_shape = node.in_shapes[0], node.in_shapes[1], node.in_shapes[2]
    assert x_shape is not None and w_shape is not None and r_shape is not None
    steps_batch = int(x_shape[0]) * int(x_shape[1])
    dirs, rows = int(w_shape[0]), int(w_shape[1])
    return steps_batch * dirs * rows * (int(w_shape[2]) + int(r_shape[2]))


_DOCS = {
    "RNN": "Simple RNN",
    "GRU": "GRU (linear_before_reset 0 or 1)",
    "LSTM": "LSTM (peepholes, input_forget)",
}

for _op, _what in _DOCS.items():
    register(
        _op,
        recurrent_compute,
        since=7,
        dtypes=FLOATS,
        kernel=_op.lower(),
        split_axes=recurrent_split_axes,
        macs=recurrent_macs,
        doc=f"{_what}: forward, reverse or bidirectional; sequence_lens, initial states, "
        "layout 0/1, clip and the spec's activations with alpha/beta.",
    )
