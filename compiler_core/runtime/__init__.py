"""The functional runtime: execute a QPC and return its outputs by name."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.runtime.executor import Executor, RuntimeFault

__all__ = ["Executor", "RuntimeFault", "run_qpc"]


def run_qpc(
    qpc: str | os.PathLike[str] | bytes | bytearray | memoryview,
    inputs: Mapping[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """Run one inference of a qpcfarm QPC; every graph output is returned by name."""
    from compiler_core.devices import get_device
    from compiler_core.qpc.container import load_qpc

    with load_qpc(qpc) as container:
        network = container.network
        if network is None:
            raise CompileError(
                "unsupported_qpc", "only qpcfarm QPCs can be run on the functional runtime"
            )
        device_name = network.options.get("aic-device") or network.options.get("aic_device")
        vtcm = get_device(device_name).vtcm_bytes_per_core if device_name else None
        program = container.program()
        vtcm = vtcm or max(max(program.vtcm_used, default=0), 8_323_072)
        executor = Executor(program, container.segments["constants.bin"], vtcm)
        return executor.run(inputs)
