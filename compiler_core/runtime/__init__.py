"""The functional runtime: execute a QPC and return its outputs by name."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from compiler_core.runtime.executor import Executor, RuntimeFault
from compiler_core.runtime.session import QpcSession

__all__ = ["Executor", "QpcSession", "RuntimeFault", "run_qpc"]


def run_qpc(
    qpc: str | os.PathLike[str] | bytes | bytearray | memoryview,
    inputs: Mapping[str, np.ndarray],
    *,
    profiling_out_dir: str | os.PathLike[str] | None = None,
    iterations: int = 1,
) -> dict[str, np.ndarray]:
    """Run `iterations` inferences of a qpcfarm QPC; the last one's outputs are returned by name.

    The specialization is picked from the input shapes; retained state starts at zero (use a
    `QpcSession` to keep it across runs). With `profiling_out_dir`, the stats buffer the QPC
    carries is filled for every inference and written there as `stats-inf-<n>.bin`, the
    input of `qpcfarm opstats`.
    """
    with QpcSession(qpc) as session:
        return session.run(inputs, profiling_out_dir=profiling_out_dir, iterations=iterations)
