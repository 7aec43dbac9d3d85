"""Fold the float step after an integer kernel into that kernel's requantizing epilogue.

In ONNX Runtime's QDQ models an integer kernel's output is often read by one more float step
between a DequantizeLinear and a QuantizeLinear: a Relu or Clip quantized to a scale of its
own (symmetric activations give a Relu output half the range of its input), a
BatchNormalization left unfolded (`quantize_static` without pre-processing), or a plain
requantization Q(DQ(x)) to other parameters. Each is an affine map per channel followed by a
clip, `y = clip(x * gain + offset, lo, hi)`, so the producing kernel can compute it directly:
its output multiplier takes the gain and the new scale, its int32 bias the offset, its
saturation the clip, its zero point and output type the QuantizeLinear's. The step, its
DequantizeLinear and its QuantizeLinear leave the program: the activation stays integer from
one kernel to the next.

The result differs from running the QDQ graph as written in one place: the producer's own
rounding to its old scale (and saturation to its old range) no longer happens, so an output
code can differ by one where that intermediate rounding crossed a half (at most
`gain * s_old / s_new / 2 + 1/2` codes, under one code whenever the new scale is not finer
than `gain * s_old`), the error a compiler that fuses the pair makes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from compiler_core.fusion import FUSED_NODES_KEY, fused_node_names

RESCALABLE = frozenset({"QConv", "QMatMul", "QAdd", "QMul", "QAvgPool", "QAveragePool", "QLut"})
"""Integer kernels whose output parameters the fold can change."""

PER_CHANNEL = frozenset({"QConv", "QMatMul"})
"""Kernels with a per-channel multiplier and bias (a BatchNormalization's gain and offset)."""

MAX_GAIN = 2.0**20
"""A multiplier past this (a huge gain, a tiny new scale) is refused: fixed point needs < 2**24."""


@dataclass(frozen=True)
class Affine:
    """`y = clip(x * gain + offset, lo, hi)` in reals; gain and offset have one value or one
    per channel (axis 1 of the kernel's output)."""

    gain: np.ndarray
    offset: np.ndarray
    lo: float = float("-inf")
    hi: float = float("inf")

    @property
    def per_tensor(self) -> bool:
        return self.gain.size == 1 and self.offset.size == 1


@dataclass(frozen=True)
class Codes:
    """One tensor's integer form as the epilogue needs it."""

    scale: float
    zero: int
    dtype: str


ConstFn = Callable[[np.ndarray, str], ir.Value]
"""Adds a constant to the graph under a fresh name made from the hint."""


def quantize(x: np.ndarray, c: Codes) -> np.ndarray:
    """ONNX QuantizeLinear of float values (float32 division, round half to even, saturate)."""
    info = np.iinfo(np.dtype(c.dtype))
    y = np.rint(np.asarray(x, np.float32) / np.float32(c.scale)).astype(np.float64) + c.zero
    return np.clip(y, info.min, info.max).astype(c.dtype)


def fold_into_producer(
    producer: ir.Node, old: Codes, new: Codes, step: Affine, const: ConstFn
) -> str | None:
    """Rewrite `producer` (an integer kernel whose output has `old` parameters) to produce
    `step` of its output with `new` parameters. None when done, else why not (nothing was
    changed)."""
    op = producer.op_type
    if op not in RESCALABLE:
        return f"its producer {op} has no requantizing epilogue"
    if not step.per_tensor and op not in PER_CHANNEL:
        return f"a per-channel step cannot fold into {op}"
    if np.any(step.gain <= 0) or not np.all(np.isfinite(step.gain)):
        return "the step's gain is not positive (a fixed-point multiplier is >= 0)"
    info = np.iinfo(np.dtype(old.dtype))
    attrs = producer.attributes
    old_lo = attrs["y_min"].as_int() if "y_min" in attrs else int(info.min)
    old_hi = attrs["y_max"].as_int() if "y_max" in attrs else int(info.max)
    narrowed = old_lo > int(info.min) or old_hi < int(info.max)
    lo, hi = step.lo, step.hi
    if narrowed:
        if not step.per_tensor:
            return "the producer saturates to a narrower range (a fused Relu) before the step"
        gain, offset = float(step.gain.reshape(-1)[0]), float(step.offset.reshape(-1)[0])
        if old_lo > int(info.min):
            lo = max(lo, (old_lo - old.zero) * old.scale * gain + offset)
        if old_hi < int(info.max):
            hi = min(hi, (old_hi - old.zero) * old.scale * gain + offset)
    ratio = step.gain.astype(np.float64) * old.scale / new.scale
    if np.any(ratio > MAX_GAIN):
        return "the new scale is too fine for a fixed-point multiplier"
    if op not in PER_CHANNEL and op != "QLut" and np.any(step.offset != 0):
        return f"{op} has no bias to take an offset"
    try:
        if op == "QLut":
            why = _compose_table(producer, old, new, step, const)
        elif op in PER_CHANNEL:
            why = _rescale_hmx(producer, old, new, step, ratio, const)
        else:
            why = _rescale_scalar(producer, float(ratio.reshape(-1)[0]))
    except ValueError as exc:  # a multiplier fixed point cannot hold (checked before writing)
        return str(exc)
    if why is not None:
        return why
    out_info = np.iinfo(np.dtype(new.dtype))
    code_lo = int(out_info.min) if lo == float("-inf") else int(quantize(np.array([lo]), new)[0])
    code_hi = int(out_info.max) if hi == float("inf") else int(quantize(np.array([hi]), new)[0])
    if op != "QLut":  # a table's entries are already the new codes
        for name, code in (("y_zero", new.zero), ("y_min", code_lo), ("y_max", code_hi)):
            attrs[name] = ir.AttrInt64(name, int(code))
    producer.outputs[0].type = ir.TensorType(ir.DataType.from_numpy(np.dtype(new.dtype)))
    return None


def note_fused(producer: ir.Node, nodes: list[ir.Node]) -> None:
    """The producer's kernel now also runs `nodes` (for reports)."""
    names = list(fused_node_names(producer))
    for node in nodes:
        names += fused_node_names(node)
    producer.meta[FUSED_NODES_KEY] = names


def _rescale_hmx(
    producer: ir.Node, old: Codes, new: Codes, step: Affine, ratio: np.ndarray, const: ConstFn
) -> str | None:
    """QConv / QMatMul: the per-channel (mantissa, shift) table times the ratio of scales and
    the gain; the offset added to the int32 bias in accumulator units."""
    from compiler_core.ops.int8 import requant_table  # only when QDQ folds

    inputs = list(producer.inputs)
    rq_value = inputs[4] if len(inputs) > 4 else None
    if rq_value is None or rq_value.const_value is None:
        return "the producer's requantization table is not a constant"
    table = np.asarray(rq_value.const_value.numpy()).astype(np.int64)
    mult = table[:, 0].astype(np.float64) * np.exp2(-table[:, 1].astype(np.float64))
    channels = max(mult.size, step.gain.size, step.offset.size)
    if mult.size not in (1, channels):
        return "the step's channels do not match the producer's"
    if producer.op_type == "QMatMul" and not step.per_tensor:
        shape = producer.outputs[0].shape
        if shape is None or len(shape) != 2:
            return "a per-channel step on a MatMul output of rank other than 2"
    mult = np.broadcast_to(mult, (channels,))
    gain = np.broadcast_to(ratio, (channels,))
    new_table = requant_table((mult * gain).astype(np.float32))
    offset = np.broadcast_to(step.offset.astype(np.float64), (channels,))
    bias_value = inputs[2] if len(inputs) > 2 else None
    bias: np.ndarray | None = None
    if np.any(offset != 0):
        if len(inputs) > 5 and inputs[5] is not None:
            return "the producer's bias is int8 with its own scale"
        # one accumulator unit is mult * s_old in reals
        unit = mult * old.scale * step.gain.astype(np.float64).reshape(-1)
        if np.any(unit == 0):
            return "a channel's multiplier is zero"
        if bias_value is None:
            bias = np.zeros(channels, np.int64)
        elif bias_value.const_value is None:
            return "the producer's bias is not a constant"
        else:
            bias = np.broadcast_to(
                np.asarray(bias_value.const_value.numpy()).astype(np.int64).reshape(-1),
                (channels,),
            )
        total = bias + np.rint(offset / np.broadcast_to(unit, (channels,)))
        if np.any(np.abs(total) >= 2**31):
            return "the offset overflows the int32 bias"
        bias = total.astype(np.int32)
    producer.replace_input_with(4, const(new_table, f"{producer.name}_rq"))
    if bias is not None:
        producer.replace_input_with(2, const(bias, f"{producer.name}_bias"))
    return None


def _rescale_scalar(producer: ir.Node, ratio: float) -> str | None:
    """QAdd (two multipliers on one shift), QMul, QAvgPool, QAveragePool (one multiplier)."""
    from compiler_core.ops.int8 import fixed_point  # only when QDQ folds

    attrs = producer.attributes
    shift = attrs["shift"].as_int()
    names = ("a_mult", "b_mult") if producer.op_type == "QAdd" else ("mult",)
    fixed = []
    for name in names:
        m = attrs[name].as_int() * 2.0**-shift * ratio
        mant, sh = fixed_point(np.array(abs(m), np.float32))
        fixed.append((int(np.sign(m)) * int(mant), int(sh)))
    top = max(s for _, s in fixed)
    low = min(s for m, s in fixed if m != 0) if any(m for m, _ in fixed) else top
    top = min(top, low + 22)  # the common shift keeps 22 bits of headroom (fold_qdq's rule)
    for name, (m_int, m_shift) in zip(names, fixed, strict=True):
        at_top = m_int << (top - m_shift) if top >= m_shift else _round_shift(m_int, m_shift - top)
        attrs[name] = ir.AttrInt64(name, at_top)
    attrs["shift"] = ir.AttrInt64("shift", top)
    return None


def _round_shift(value: int, drop: int) -> int:
    sign = -1 if value < 0 else 1
    return sign * ((abs(value) + (1 << (drop - 1))) >> drop)


def _compose_table(
    producer: ir.Node, old: Codes, new: Codes, step: Affine, const: ConstFn
) -> str | None:
    """QLut: the step applied to every entry of the table (exactly the QDQ graph's result:
    the table's codes are dequantized, stepped and quantized as ONNX does)."""
    table_value = producer.inputs[1]
    if table_value is None or table_value.const_value is None:
        return "the producer's table is not a constant"
    codes = np.asarray(table_value.const_value.numpy()).astype(np.int64)
    real = ((codes - old.zero).astype(np.float32) * np.float32(old.scale)).astype(np.float32)
    stepped = real * np.float32(step.gain.reshape(-1)[0]) + np.float32(step.offset.reshape(-1)[0])
    stepped = np.clip(stepped, step.lo, step.hi).astype(np.float32)
    producer.replace_input_with(1, const(quantize(stepped, new), f"{producer.name}_table"))
    return None
