"""RNN, GRU and LSTM through the whole path, against ONNX Runtime.

ONNX Runtime implements all three in float32 and time-major layout only: batchwise models
(layout=1) are checked against it on the equivalent time-major model, and float64 / float16
against the ONNX reference (which ignores activations, clip and sequence_lens, so those
cases keep the defaults).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from compiler_core.errors import CompileError
from tests.op_checks import (
    assert_matches,
    one_node_model,
    rand,
    run_compiled,
    run_onnxruntime,
)

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
OPS = list(GATES)
Feeds = dict[str, np.ndarray]


def recurrent(
    op: str,
    *,
    steps: int = 4,
    batch: int = 3,
    features: int = 2,
    hidden: int = 3,
    bidirectional: bool = False,
    layout: int = 0,
    bias: bool = True,
    lens: list[int] | None = None,
    initial_h: bool = False,
    initial_c: bool = False,
    peepholes: bool = False,
    outputs: tuple[str, ...] | None = None,
    dtype: Any = np.float32,
    opset: int = 22,
    **attrs: Any,
) -> tuple[onnx.ModelProto, Feeds]:
    """A one-node recurrent model and random feeds; inputs left out are '' or trailing."""
    dirs, gates = (2 if bidirectional else 1), GATES[op]
    state = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    feeds: Feeds = {
        "X": rand(*((batch, steps, features) if layout else (steps, batch, features)), dtype=dtype),
        "W": rand(dirs, gates * hidden, features, dtype=dtype),
        "R": rand(dirs, gates * hidden, hidden, dtype=dtype),
    }
    optional = {
        "B": rand(dirs, 2 * gates * hidden, dtype=dtype) if bias else None,
        "sequence_lens": None if lens is None else np.array(lens, np.int32),
        "initial_h": rand(*state, dtype=dtype) if initial_h else None,
        "initial_c": rand(*state, dtype=dtype) if initial_c else None,
        "P": rand(dirs, 3 * hidden, dtype=dtype) if peepholes else None,
    }
    names = ["X", "W", "R"] + [n if v is not None else "" for n, v in optional.items()]
    while names[-1] == "":
        names.pop()
    feeds.update({n: v for n, v in optional.items() if v is not None})
    if outputs is None:
        outputs = ("Y", "Y_h", "Y_c") if op == "LSTM" else ("Y", "Y_h")
    y_dims = [batch, steps, dirs, hidden] if layout else [steps, dirs, batch, hidden]
    dims = {"Y": y_dims, "Y_h": list(state), "Y_c": list(state)}
    declared = {n: (np.dtype(dtype), dims[n]) for n in outputs if n}
    if bidirectional:
        attrs["direction"] = "bidirectional"
    if layout:
        attrs["layout"] = layout
    attrs = {k: v for k, v in attrs.items() if not (isinstance(v, list) and not v)}
    node = oh.make_node(op, names, list(outputs), hidden_size=hidden, **attrs)
    return one_node_model(node, feeds, declared, opset=opset), feeds


def check(op: str, **kwargs: Any) -> None:
    model, feeds = recurrent(op, **kwargs)
    assert_matches(model, feeds, rtol=1e-5, atol=1e-5)


# --- all three ops: directions, opsets, states, sequence_lens, clip, layout ------------------


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("opset", [7, 14, 22])
def test_forward_defaults_match_onnxruntime_at_each_opset(op, opset):
    check(op, opset=opset, bias=False)


@pytest.mark.parametrize("op", OPS)
def test_reverse_with_bias_and_initial_state_matches_onnxruntime(op):
    check(op, direction="reverse", initial_h=True, initial_c=op == "LSTM", opset=14)


@pytest.mark.parametrize("op", OPS)
def test_bidirectional_sequence_lens_freeze_state_and_zero_padded_steps(op):
    # Lengths full, partial, one and zero: the reverse direction starts at each entry's end;
    # an empty entry's Y_h / Y_c are zeros (as ONNX Runtime gives).
    check(
        op,
        steps=5,
        batch=4,
        bidirectional=True,
        lens=[5, 3, 1, 0],
        initial_h=True,
        initial_c=op == "LSTM",
    )


@pytest.mark.parametrize("op", OPS)
def test_clip_bounds_every_activation_input(op):
    check(op, bidirectional=True, clip=0.4, initial_h=True, peepholes=op == "LSTM")


@pytest.mark.parametrize("op", OPS)
def test_batchwise_layout_matches_onnxruntime_on_the_time_major_model(op):
    """ONNX Runtime rejects layout=1: the oracle runs the same data time-major."""
    lstm = op == "LSTM"
    options = dict(bidirectional=True, lens=[4, 2, 1], initial_h=True, initial_c=lstm)
    model, feeds = recurrent(op, layout=1, peepholes=lstm, **options)
    time_major = {
        k: v.transpose(1, 0, 2) if k in ("X", "initial_h", "initial_c") else v
        for k, v in feeds.items()
    }
    reference, _ = recurrent(op, peepholes=lstm, **options)
    want = run_onnxruntime(reference, time_major)
    want = [want[0].transpose(2, 0, 1, 3)] + [s.transpose(1, 0, 2) for s in want[1:]]
    for cores in (1, 4):
        got = run_compiled(model, feeds, cores)
        for name, have, expected in zip(("Y", "Y_h", "Y_c"), got, want, strict=False):
            np.testing.assert_allclose(have, expected, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_float64_and_float16_match_reference(op, dtype):
    model, feeds = recurrent(op, dtype=dtype, bidirectional=True, initial_h=True)
    tol = 1e-9 if dtype == np.float64 else 1e-2
    assert_matches(model, feeds, oracle="reference", rtol=tol, atol=tol)


# --- activations ---------------------------------------------------------------------------

PARAMETRISED = {
    "Relu": ([], []),
    "Tanh": ([], []),
    "Sigmoid": ([], []),
    "Affine": ([0.7], [0.2]),
    "LeakyRelu": ([0.3], []),
    "ThresholdedRelu": ([0.4], []),
    "ScaledTanh": ([1.5], [0.6]),
    "HardSigmoid": ([0.3], [0.4]),
    "Elu": ([0.8], []),
    "Softsign": ([], []),
    "Softplus": ([], []),
}


@pytest.mark.parametrize("activation", list(PARAMETRISED))
def test_rnn_each_activation_with_its_alpha_beta_matches_onnxruntime(activation):
    alpha, beta = PARAMETRISED[activation]
    check(
        "RNN",
        bidirectional=True,
        activations=[activation, activation],
        activation_alpha=alpha * 2,
        activation_beta=beta * 2,
        initial_h=True,
    )


@pytest.mark.parametrize(
    "activation", ["Affine", "LeakyRelu", "ThresholdedRelu", "ScaledTanh", "HardSigmoid", "Elu"]
)
def test_rnn_activation_defaults_apply_without_alpha_beta(activation):
    # The specification gives no defaults here: ONNX Runtime's are LeakyRelu 0.01,
    # HardSigmoid 0.2 / 0.5, Elu 1, and 0 for Affine, ScaledTanh and ThresholdedRelu.
    check("RNN", activations=[activation])


def test_gru_alpha_beta_are_consumed_only_by_activations_that_take_them():
    check(
        "GRU",
        bidirectional=True,
        activations=["HardSigmoid", "Tanh", "Sigmoid", "LeakyRelu"],
        activation_alpha=[0.25, 0.2],
        activation_beta=[0.45],
    )


def test_lstm_custom_activations_per_direction_match_onnxruntime():
    check(
        "LSTM",
        bidirectional=True,
        activations=["HardSigmoid", "Softsign", "ScaledTanh", "Sigmoid", "Elu", "Tanh"],
        activation_alpha=[0.25, 0.9, 0.7],
        activation_beta=[0.45, 1.1],
        peepholes=True,
    )


# --- GRU and LSTM specifics ------------------------------------------------------------------


@pytest.mark.parametrize("linear_before_reset", [0, 1])
def test_gru_linear_before_reset_places_the_reset_gate_as_specified(linear_before_reset):
    check(
        "GRU",
        bidirectional=True,
        initial_h=True,
        lens=[4, 2, 3],
        linear_before_reset=linear_before_reset,
    )


def test_lstm_peepholes_with_initial_states_and_sequence_lens_match_onnxruntime():
    check("LSTM", peepholes=True, initial_h=True, initial_c=True, lens=[2, 4, 3])


def test_lstm_input_forget_couples_forget_gate_to_input_gate():
    check("LSTM", input_forget=1, peepholes=True, initial_c=True)


def test_lstm_clip_bounds_gate_inputs_but_not_the_cell_state():
    model, feeds = recurrent("LSTM", clip=0.1, initial_h=True, initial_c=True)
    feeds["initial_c"] = feeds["initial_c"] * 5  # |C| stays well above the clip
    assert_matches(model, feeds, rtol=1e-5, atol=1e-5)


def test_lstm_unnamed_y_before_named_y_h_and_y_c():
    check("LSTM", outputs=("", "Y_h", "Y_c"), direction="reverse", initial_h=True)


def test_gru_with_only_y_h_output_listed_after_unnamed_y():
    check("GRU", outputs=("", "Y_h"), bidirectional=True)


def test_lstm_with_y_only_omits_state_outputs():
    check("LSTM", outputs=("Y",), initial_c=True)


# --- bad inputs --------------------------------------------------------------------------------


def _compile_error(model: onnx.ModelProto, feeds: Feeds, match: str) -> None:
    with pytest.raises(CompileError, match=match) as err:
        run_compiled(model, feeds)
    assert err.value.code == "invalid_model"


def test_unknown_activation_is_a_compile_error():
    model, feeds = recurrent("RNN", activations=["Swish"])
    _compile_error(model, feeds, "unknown activation 'Swish'")


def test_wrong_number_of_activations_is_a_compile_error():
    model, feeds = recurrent("LSTM", bidirectional=True, activations=["Sigmoid", "Tanh", "Tanh"])
    _compile_error(model, feeds, "needs 6 activations .3 per direction., got 3")


def test_unknown_direction_is_a_compile_error():
    model, feeds = recurrent("GRU", direction="sideways")
    _compile_error(model, feeds, "direction must be forward, reverse or bidirectional")


def test_hidden_size_disagreeing_with_weights_is_a_compile_error():
    model, feeds = recurrent("GRU", hidden=3)
    model.graph.node[0].attribute[0].i = 4  # hidden_size
    _compile_error(model, feeds, r"W has shape \(1, 9, 2\), expected \(1, 12, 2\)")


def test_sequence_length_beyond_the_input_is_an_error_at_run_time():
    model, feeds = recurrent("RNN", lens=[4, 5, 1])
    _compile_error(model, feeds, r"sequence_lens \[4, 5, 1\] must lie in \[0, 4\]")
