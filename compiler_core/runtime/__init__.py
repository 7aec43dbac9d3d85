"""The functional runtime: execute a QPC and return its outputs by name."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.runtime.executor import Executor, RuntimeFault

if TYPE_CHECKING:
    from compiler_core.qpc.container import Qpc

__all__ = ["Executor", "RuntimeFault", "run_qpc"]


def run_qpc(
    qpc: str | os.PathLike[str] | bytes | bytearray | memoryview,
    inputs: Mapping[str, np.ndarray],
    *,
    profiling_out_dir: str | os.PathLike[str] | None = None,
    iterations: int = 1,
) -> dict[str, np.ndarray]:
    """Run `iterations` inferences of a qpcfarm QPC; the last one's outputs are returned by name.

    With `profiling_out_dir`, the stats buffer the QPC carries is filled for every inference
    (from the cost model's timeline, see compiler_core.profiling) and written there as
    `stats-inf-<n>.bin`, the input of `qpcfarm opstats`.
    """
    from compiler_core.qpc.container import load_qpc

    if iterations < 1:
        raise CompileError("invalid_arguments", f"iterations must be at least 1, not {iterations}")
    with load_qpc(qpc) as container:
        network = container.network
        if network is None:
            raise CompileError(
                "unsupported_qpc", "only qpcfarm QPCs can be run on the functional runtime"
            )
        from compiler_core.profiling.stats_writer import (
            StatsRecorder,
            device_for,
            write_stats_file,
        )

        program = container.program()
        device_name = network.options.get("aic-device") or network.options.get("aic_device")
        if device_name:
            vtcm = device_for(network).vtcm_bytes_per_core
        else:
            vtcm = max(max(program.vtcm_used, default=0), 8_323_072)
        constants = container.segments["constants.bin"]
        executor = Executor(program, constants, vtcm, _decoded_constants(container, constants))
        recorder = None
        if profiling_out_dir is not None:
            recorder = StatsRecorder.for_qpc(
                container.segments.get("statsdesc.bin"), network, executor
            )
        outputs: dict[str, np.ndarray] = {}
        for inference in range(iterations):
            if recorder is not None:
                recorder.start()
            outputs = executor.run(inputs)
            if recorder is not None and profiling_out_dir is not None:
                write_stats_file(Path(profiling_out_dir), inference, recorder.finish(inference))
        return outputs


def _decoded_constants(container: Qpc, constants: memoryview | bytes) -> dict[int, np.ndarray]:
    """Encoded constants (MXFP6 weights) decoded once, by offset; a bad one is refused."""
    from compiler_core.mxfp import decode_constants

    entries = container.constants()
    if not any(e.encoding is not None for e in entries):
        return {}
    try:
        return decode_constants(entries, constants)
    except ValueError as exc:
        raise RuntimeFault(f"constantsdesc.bin: {exc}") from None
