"""Which VTCM buffers hold an untouched copy of a constant, and those constants widened.

Matrix kernels (conv, matmul: the `WIDE_OPERANDS` ops) compute fp16 data in fp32 (see
`product_accumulator`), so every tile used to widen its weights again on every inference.
The runtime widens each constant box once per session instead, and hands the widened copy
to a kernel only when the buffer the program points the kernel at provably holds that
constant: a DMA (or a NoC copy of such a buffer) wrote the whole buffer from the constant,
and nothing has written any byte of it since. Any other buffer is read as it is, so a
program that forgot a load, or overwrote its weights, still computes with what its VTCM
holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Holding = tuple[int, Any]
"""(tensor id, box): the constant box a buffer holds in full."""


class ConstantCopies:
    """`tracking` False (no kernel of the program widens a constant): nothing is recorded
    and no buffer is taken to hold a constant."""

    def __init__(self, num_cores: int, tracking: bool = True) -> None:
        self.tracking = tracking
        self._scratch: list[dict[int, tuple[int, Holding]]] = [{} for _ in range(num_cores)]
        """Per core, by buffer start: (buffer end, what it holds), for buffers an inference
        wrote (forgotten when the next inference zeroes that VTCM)."""
        self._resident: list[dict[int, tuple[int, Holding]]] = [{} for _ in range(num_cores)]
        """The same for buffers program activation loaded: inferences cannot write those."""
        self._wide: dict[tuple[Holding, Any], np.ndarray] = {}

    def wrote(self, core: int, start: int, end: int, holding: Holding | None) -> None:
        """Bytes [start, end) of `core`'s VTCM were written, with a whole constant box
        (`holding`) or with anything else (None)."""
        if not self.tracking:
            return
        scratch = self._scratch[core]
        if scratch:
            for stale in [s for s, (e, _) in scratch.items() if s < end and start < e]:
                del scratch[stale]
        if holding is not None:
            scratch[start] = (end, holding)

    def holds(self, core: int, start: int, holding: Holding) -> bool:
        found = self._scratch[core].get(start) or self._resident[core].get(start)
        return found is not None and found[1] == holding

    def seal_resident(self) -> None:
        """Activation is over: what it loaded stays for the program's life."""
        for scratch, resident in zip(self._scratch, self._resident, strict=True):
            resident.update(scratch)
            scratch.clear()

    def forget_scratch(self) -> None:
        """The inference VTCM was zeroed: no scratch buffer holds a constant any more."""
        for scratch in self._scratch:
            scratch.clear()

    def reset(self) -> None:
        for scratch, resident in zip(self._scratch, self._resident, strict=True):
            scratch.clear()
            resident.clear()

    def widened(self, holding: Holding, box: Any, view: np.ndarray, dtype: type) -> np.ndarray:
        """`box` of the constant, as `dtype` (read-only; computed from `view` the first time)."""
        key = (holding[0], box), np.dtype(dtype).str
        found = self._wide.get(key)
        if found is None:
            found = view.astype(dtype)
            found.flags.writeable = False
            self._wide[key] = found
        return found
