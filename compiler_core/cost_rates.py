"""The cost model's rates: what one tile of a kernel costs on a modelled device's units.

The physical parameters (HMX block, HVX vector width, DMA and launch overheads,
MXFP6 decode work) and the cycles of one kernel tile from its shape alone: HMX time is the
tile's MACs padded to the array's blocks (32 output channels x 32 reduction elements, 64 for
int8, x 4 output positions), at the precision's rate; a fused epilogue runs on HVX alongside
(the tile takes the longer of the two): a float step one vector instruction per vector, an
integer (requantizing) step the instructions its fixed-point arithmetic takes. fp32 has no
HMX path: 1/16 of fp16.

These are what the lowering's split and tiling searches price candidates with; the timeline
(`cost_timeline.py`) schedules a whole emitted program with the same rates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from compiler_core.devices import DeviceProfile
from compiler_core.ops.registry import Box, HmxShape, NodeInfo, OpDef, box_elements

HVX_BYTES_PER_THREAD_CYCLE = 128
"""One 1024-bit HVX vector per thread and cycle."""
FP32_HMX_SLOWDOWN = 16
"""HMX has no fp32 path: fp32 MACs run on HVX, modelled as 1/16 of the fp16 HMX rate."""
HMX_CHANNELS = 32
HMX_DEPTH = {"fp16": 32, "int8": 64}
HMX_POSITIONS = 4
"""The HMX array's block: output channels x reduction depth x output positions per step
(4096 fp16 MACs = 32 x 32 x 4); a tile pays for whole blocks."""
DMA_DESCRIPTOR_CYCLES = 24
"""Fixed cost of issuing one DMA transfer (descriptor setup), modelled."""
KERNEL_LAUNCH_CYCLES = 16
"""Fixed cost of starting one kernel tile, modelled."""
ACTIVATION_BASE_CYCLES = 4096
ACTIVATION_CYCLES_PER_INSTR = 2
"""Pre-inference activation (setup) of a core: a fixed part plus its stream length, modelled;
the resident-constant loads come on top."""
MXFP6_DECODE_VECTOR_OPS = 16
"""HVX vector instructions to turn 64 MXFP6 weights into fp16 (one 1024-bit vector of output):
unpacking 48 bytes of 6-bit codes into 16-bit lanes (byte shuffles, shifts and masks: 6), the
E2M3 code -> fp16 lookup (4), the block scale's multiply and the conversion back to IEEE fp16
(6). Our count of the work (no figure is published); one instruction per HVX thread and cycle,
so a core decodes 4 x 64 / 16 = 16 weights a cycle. The decoded weight feeds HMX: a tile
decodes its streamed MXFP6 weights before its HMX work starts (resident weights stay decoded
in VTCM: no per-inference decode)."""
MXFP6_DECODE_ELEMENTS_PER_THREAD_CYCLE = 64 / MXFP6_DECODE_VECTOR_OPS

INT8_WIDEN_OPS = 3
"""int8 codes -> int32 lanes for 128 codes: vsxt b -> h (one instruction writing a vector
pair), then vsxt h -> w on each half (2)."""
INT8_SCALE_OPS = 8
"""One operand's product with its fixed-point multiplier, rounded to 15 fractional bits: a
32 x 32 multiply-high per 32-lane vector (vmpye + vmpyo:<<1:rnd:sat:shift, 2 x 4 = 8; the
programs' multipliers carry 24-bit mantissas, too wide for the one-instruction 16-bit
multiply). The operand enters shifted left so that the product keeps 15 bits below the
output's unit: the final narrowing's shift stays within the 15 that `vasr` takes."""
INT8_PRODUCT_OPS = 8
"""A QMul of two activations: the centred codes' 32-bit product (vmpyieo + vmpyie:acc per
32-lane vector, 2 x 4) before the multiplier's."""
INT8_SUM_OPS = 2
"""Adding a second scaled operand to the first: two word-vector-pair adds."""
INT8_OFFSET_OPS = 4
"""A constant term added in int32, one add per word vector: the input zero points' term
(-z x m, scaled once at load), a QAdd's constant operand (scaled once at load) and, folded
into the same constant, the output zero point."""
INT8_OUTPUT_ZERO_OPS = 2
"""The output zero point alone: a saturating int16 add on the two halfword vectors after the
first narrowing (round(v) + z = round(v + z) for an integer z)."""
INT8_NARROW_OPS = 3
"""int32 -> int8 with rounding and saturation: vasr(w, w, 15):rnd:sat to int16 (2, each
taking two word vectors), then a saturating pack to int8 (1)."""
INT8_CLAMP_OPS = 1
"""A saturation bound narrower than the output type's (a fused Relu: [0, 127] in int8): one
byte vmax or vmin per 128 codes."""
INT8_STEP_VECTOR_OPS = INT8_WIDEN_OPS + INT8_SCALE_OPS + INT8_OFFSET_OPS + INT8_NARROW_OPS
"""18: a QAdd of the running value and a constant (or with non-zero zero points), no clamp."""
INT8_STEP_OPERAND_VECTOR_OPS = INT8_WIDEN_OPS + INT8_SCALE_OPS + INT8_SUM_OPS
"""13: what a QAdd's second activation operand (a residual add) adds to a step."""
INT8_VECTOR_LANES = 128

HVX_THREADS = ("hvx0", "hvx1", "hvx2", "hvx3")
THREADS = (*HVX_THREADS, "hmx", "dma")
"""Thread lanes of every core, in the order stats buffers and traces use."""


def _itemsize(dtype: str) -> int:
    return 1 if dtype == "bool" else np.dtype(dtype).itemsize


def _hvx_rate(device: DeviceProfile, dtype: str) -> int:
    return max(1, device.hvx_threads * HVX_BYTES_PER_THREAD_CYCLE // _itemsize(dtype))


def _ceil_to(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


def padded_macs(shape: HmxShape, dtype: str) -> int:
    """MACs the HMX array spends on a tile: every dimension rounded up to its block."""
    depth = HMX_DEPTH["int8" if dtype in ("int8", "uint8") else "fp16"]
    return (
        _ceil_to(shape.positions, HMX_POSITIONS)
        * _ceil_to(shape.depth, depth)
        * _ceil_to(shape.channels, HMX_CHANNELS)
        * shape.repeats
    )


def hmx_rate(device: DeviceProfile, dtype: str) -> float:
    """HMX MACs per cycle at the precision a kernel computes in."""
    if dtype in ("float32", "float64"):
        return device.hmx_fp16_macs_per_cycle / FP32_HMX_SLOWDOWN
    return device.hmx_macs_per_cycle(dtype)


@dataclass(frozen=True)
class TileCompute:
    """Compute cycles of one tile: the main unit's and the HVX epilogue's (run alongside)."""

    unit: str
    main_cycles: int
    epilogue_cycles: int
    hmx_macs: int
    hmx_padded_macs: int
    hvx_work: int
    decode_cycles: int = 0
    """HVX cycles decoding the tile's streamed MXFP6 weights, before the main unit starts."""

    @property
    def cycles(self) -> int:
        main, epilogue = self.main_cycles, self.epilogue_cycles
        return self.decode_cycles + (epilogue if epilogue > main else main)


def compute_dtype(info_in: tuple[str | None, ...], out: tuple[str, ...]) -> str:
    """The precision an HMX kernel computes in: its first input's (int8 QLinear ops read
    int8 and write int8/int32), else its output's."""
    first = info_in[0] if info_in else None
    return first or (out[0] if out else "float32")


def integer_step(dtype: str) -> bool:
    """An epilogue step writing int8/uint8 codes requantizes (QAdd, QMul after an integer
    kernel): integer multiply, shift and saturation on HVX, not one vector instruction."""
    return dtype in ("int8", "uint8")


def int8_step_ops(
    op_type: str, attrs: Mapping[str, Any], out_dtype: str, constant: Sequence[bool]
) -> int:
    """HVX instructions per 128 output codes of an integer epilogue step, counted from the
    arithmetic the program gives it (`ops/int8.py`: QAdd and QMul, their zero points,
    multipliers and saturation bounds). `constant`: per operand (a, b), whether it is a
    constant (the running value and any other activation are not). Every activation read is
    widened and scaled by its multiplier; a QAdd adds the scaled operands, a QMul of two
    activations multiplies them first; constant terms are added in int32; then the narrowing
    to the output type and any bound the saturation narrows. See docs/compiler.md."""
    activations = max(1, sum(1 for c in constant if not c))
    ops = activations * INT8_WIDEN_OPS + INT8_NARROW_OPS
    if op_type == "QMul":
        ops += INT8_SCALE_OPS + (activations - 1) * INT8_PRODUCT_OPS
    else:
        ops += activations * INT8_SCALE_OPS + (activations - 1) * INT8_SUM_OPS
    centred = sum(
        1
        for side, c in zip("ab", constant, strict=False)
        if not c and int(attrs.get(f"{side}_zero", 0))
    )
    if op_type == "QMul" and activations > 1 and centred:
        # (a - za)(b - zb) is no constant term: each centred operand is subtracted in int32,
        # the output zero point added after the first narrowing
        ops += centred * INT8_OFFSET_OPS + INT8_OUTPUT_ZERO_OPS * bool(int(attrs.get("y_zero", 0)))
    elif centred or (op_type != "QMul" and any(constant)):
        ops += INT8_OFFSET_OPS
    elif int(attrs.get("y_zero", 0)):
        ops += INT8_OUTPUT_ZERO_OPS
    info = np.iinfo(np.dtype(out_dtype))
    narrower = (int(attrs.get("y_min", info.min)) > info.min) + (
        int(attrs.get("y_max", info.max)) < info.max
    )
    return ops + INT8_CLAMP_OPS * narrower


def epilogue_hvx_cycles(
    tile_elems: int,
    epilogue: tuple[str, ...],
    step_ops: Sequence[int],
    device: DeviceProfile,
) -> int:
    """HVX cycles of a tile's epilogue steps: a float step one vector instruction per
    vector of its output type; an integer step `step_ops` instructions per 128 codes (per
    step, `int8_step_ops`; a missing entry counts `INT8_STEP_VECTOR_OPS`); the instructions
    spread over the HVX threads."""
    if not any(integer_step(d) for d in epilogue):
        epi_dtype = epilogue[-1] if epilogue else "float32"
        return math.ceil(tile_elems * len(epilogue) / _hvx_rate(device, epi_dtype))
    instructions = 0.0
    for i, dtype in enumerate(epilogue):
        if integer_step(dtype):
            ops = step_ops[i] if i < len(step_ops) else INT8_STEP_VECTOR_OPS
            instructions += tile_elems * ops / INT8_VECTOR_LANES
        else:
            instructions += tile_elems / (HVX_BYTES_PER_THREAD_CYCLE // _itemsize(dtype))
    return math.ceil(instructions / max(1, device.hvx_threads))


def tile_cost(
    info: NodeInfo,
    unit: str,
    macs: int,
    epilogue: tuple[str, ...],
    out_box: Box,
    in_boxes: Sequence[Box | None],
    opdef: OpDef | None,
    device: DeviceProfile,
    epilogue_ops: Sequence[int] = (),
) -> TileCompute:
    """Compute cycles of one tile of a kernel (`macs`: the kernel's, epilogue steps
    included; `epilogue`: each step's output dtype; `epilogue_ops`: per integer step, its
    HVX instructions per 128 codes, `int8_step_ops`)."""
    out_shape = info.out_shapes[0] if info.out_shapes else ()
    out_total = math.prod(out_shape)
    out_total = out_total if out_total > 1 else 1
    tile_elems = box_elements(out_box)
    share = tile_elems / out_total
    dtype = info.out_dtypes[0] if info.out_dtypes else "float32"
    base_macs = macs - out_total * len(epilogue)
    base_macs = base_macs if base_macs > 0 else 0
    epi_tile = tile_elems * len(epilogue)
    if unit == "hmx":
        precision = compute_dtype(info.in_dtypes, info.out_dtypes)
        if opdef is not None and opdef.hmx_shape is not None:
            shape = opdef.hmx_shape(info, out_box)
            useful, padded = shape.macs, padded_macs(shape, precision)
        else:
            useful = padded = int(round(base_macs * share))
        return TileCompute(
            unit="hmx",
            main_cycles=math.ceil(padded / hmx_rate(device, precision)),
            epilogue_cycles=epilogue_hvx_cycles(tile_elems, epilogue, epilogue_ops, device),
            hmx_macs=useful,
            hmx_padded_macs=padded,
            hvx_work=epi_tile,
        )
    # HVX streams every operand it reads at least once (a reduction or a TopK does little
    # per output element but must still read all of its input)
    streamed = sum(box_elements(b) for b in in_boxes if b is not None)
    work = max(base_macs * share + epi_tile, streamed)
    return TileCompute(
        unit="hvx",
        main_cycles=math.ceil(work / _hvx_rate(device, dtype)),
        epilogue_cycles=0,
        hmx_macs=0,
        hmx_padded_macs=0,
        hvx_work=int(round(work)),
    )
