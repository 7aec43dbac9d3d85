"""A loaded QPC that runs many inferences, as an application holds a device program.

Two things outlive a single inference and so live here rather than in the executor:
- the specialization: a QPC may hold several programs (prefill and decode shapes of one
  network); each run takes the one whose input shapes match what the caller gives;
- retained state (`-retained-state`): outputs `<input>_RetainedState` stay in device memory and
  are that input on the next run, in whichever specialization runs next. The host neither
  sends those inputs nor receives those outputs; the state starts as zeros and `reset()`
  zeroes it again.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from compiler_core.errors import CompileError
from compiler_core.runtime.executor import Executor, Links, RuntimeFault
from compiler_core.runtime.numerics import (
    FiniteProbe,
    NumericsReport,
    diagnose,
    nonfinite_outputs,
    warn,
)

if TYPE_CHECKING:
    from compiler_core.qpc.container import Qpc
    from compiler_core.qpc.networkdesc import IODesc, NetworkDesc, SpecializationDesc

QpcSource = str | os.PathLike[str] | bytes | bytearray | memoryview


class QpcSession:
    """Open a qpcfarm QPC for running; use as a context manager or call `close()`."""

    def __init__(self, qpc: QpcSource | Qpc) -> None:
        from compiler_core.qpc.container import Qpc, load_qpc
        from compiler_core.qpc.networkdesc import RETAINED_SUFFIX

        self._container: Qpc = qpc if isinstance(qpc, Qpc) else load_qpc(qpc)
        self.devices: list[QpcSession] = []
        """A multi-device QPC's sessions, one per device of its partition (see run)."""
        self.linked: set[str] = set()
        """A pipeline stage's ports other stages feed or read (not the host's)."""
        meta = self._container.mdp
        if meta is not None:
            self.devices = [
                QpcSession(self._container.device(i)) for i in range(len(meta["devices"]))
            ]
            for device, entry in zip(self.devices, meta["devices"], strict=True):
                device.linked = {*entry.get("receives", ()), *entry.get("sends", ())}
        network = self._container.network
        if network is None:
            self._container.close()
            raise CompileError(
                "unsupported_qpc", "only qpcfarm QPCs can be run on the functional runtime"
            )
        self.network: NetworkDesc = network
        self.specializations: list[SpecializationDesc] = network.programs()
        self.retained: dict[str, str] = {
            name: name + RETAINED_SUFFIX for name in network.requirements.retained_state
        }
        """Retained input -> the output that feeds it."""
        self._executors: dict[str, Executor] = {}
        self._decoded: dict[int, np.ndarray] | None = None
        self.state: dict[str, np.ndarray] = {}
        """The retained buffers as the device holds them, by input name."""
        self.numerics: NumericsReport | None = None
        """The first run whose outputs held NaN or infinities: where they began (also issued
        as a `NonFiniteWarning`). Later runs are checked too, but not traced again."""
        self.reset()

    def reset(self) -> None:
        """Zero the retained state (a new sequence for a KV cache)."""
        for device in self.devices:
            device.reset()
        if self.devices:
            return
        if self.state:
            for array in self.state.values():
                array[...] = 0  # in place: the executors hold these buffers
            return
        first = self.specializations[0]
        self.state = {
            io.name: np.zeros(io.dims, dtype=np.dtype(io.dtype))
            for io in first.inputs
            if io.name in self.retained
        }

    def select(self, inputs: Mapping[str, np.ndarray]) -> SpecializationDesc:
        """The specialization whose host inputs have exactly these names and shapes."""
        given = {name: tuple(np.shape(value)) for name, value in inputs.items()}
        retained_given = sorted(set(given) & set(self.retained))
        if retained_given:
            raise CompileError(
                "bad_inputs",
                f"{', '.join(retained_given)} is retained state kept on the device between "
                "runs (-retained-state); the host does not send it (reset() zeroes it)",
            )
        for spec in self.specializations:
            wanted = {io.name: io.dims for io in self._host_inputs(spec)}
            if wanted == given:
                return spec
        if len(self.specializations) == 1:
            return self.specializations[0]  # the executor names what is wrong
        offered = "; ".join(
            f"{s.name}: " + ", ".join(f"{io.name}{list(io.dims)}" for io in self._host_inputs(s))
            for s in self.specializations
        )
        shapes = ", ".join(f"{n}{list(d)}" for n, d in sorted(given.items()))
        raise CompileError(
            "bad_inputs",
            f"no specialization takes inputs {shapes or '(none)'}; the QPC has {offered}",
        )

    def run(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        profiling_out_dir: str | os.PathLike[str] | None = None,
        iterations: int = 1,
    ) -> dict[str, np.ndarray]:
        """Run `iterations` inferences; the last one's outputs by name (retained ones stay).

        With `profiling_out_dir`, the stats buffer the QPC carries is filled for every
        inference (from the cost model's timeline, see compiler_core.profiling) and written
        there as `stats-inf-<n>.bin`, the input of `qpcfarm opstats`.
        """
        if iterations < 1:
            raise CompileError(
                "invalid_arguments", f"iterations must be at least 1, not {iterations}"
            )
        if self.devices:
            if profiling_out_dir is not None:
                raise CompileError(
                    "invalid_arguments", "profiling a multi-device QPC is not supported yet"
                )
            for _ in range(iterations - 1):
                self._run_devices(inputs)
            return self._run_devices(inputs)
        spec = self.select(inputs)
        executor = self._executor(spec)
        recorder = None
        if profiling_out_dir is not None:
            from compiler_core.profiling.stats_writer import StatsRecorder

            recorder = StatsRecorder.for_qpc(
                self._container.segments.get(spec.statsdesc), self.network, executor
            )
        outputs: dict[str, np.ndarray] = {}
        for inference in range(iterations):
            if recorder is not None:
                recorder.start()
            on_device = bool(executor.retained)  # else an older QPC: the host moves the state
            feeds = dict(inputs) if on_device else {**inputs, **self.state}
            with np.errstate(all="ignore"):  # non-finite results are reported below, once
                outputs = executor.run(feeds)
            if self.numerics is None:
                self._check_numerics(executor, feeds, outputs)
            if not on_device:
                for name, output in self.retained.items():
                    self.state[name][...] = outputs.pop(output)
            if recorder is not None and profiling_out_dir is not None:
                from compiler_core.profiling.stats_writer import write_stats_file

                write_stats_file(Path(profiling_out_dir), inference, recorder.finish(inference))
        return outputs

    def _run_devices(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One inference of a multi-device QPC: every device gets the host's inputs and runs
        its program until it waits for a link or a semaphore, device after device, until all
        are done (a device that never gets what it waits for is a deadlock); the outputs are
        device 0's (the partition's programs make them whole on every device)."""
        spec = self.specializations.index(self.select(inputs))  # the same on every device
        feeds = [self._device_inputs(d, inputs) for d in self.devices]
        executors = [d._executor(d.specializations[spec]) for d in self.devices]
        Links(executors)
        with np.errstate(all="ignore"):
            for executor, feed in zip(executors, feeds, strict=True):
                executor.begin(feed)
            finished = [False] * len(executors)
            while not all(finished):
                moved = False
                for index, executor in enumerate(executors):
                    if finished[index]:
                        continue
                    progressed, finished[index] = executor.advance()
                    moved = moved or progressed
                if not moved and not all(finished):
                    stuck = [
                        f"device {i}: {s}"
                        for i, e in enumerate(executors)
                        if not finished[i]
                        for s in e.stuck()
                    ]
                    raise RuntimeFault("deadlock: " + "; ".join(stuck))
            outputs: dict[str, np.ndarray] = {}
            for executor in executors:  # pipeline stages: each its own outputs
                for name, value in executor.finish().items():
                    outputs.setdefault(name, value)
            return outputs

    def _device_inputs(
        self, device: QpcSession, inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The host inputs a device's program takes (a pipeline stage takes its own)."""
        wanted = {io.name for s in device.specializations for io in device._host_inputs(s)}
        unknown = sorted(set(inputs) - {io.name for io in self.network.inputs})
        if unknown:
            raise CompileError(
                "bad_inputs",
                f"unknown inputs {unknown}; the network takes "
                f"{sorted(io.name for io in self.network.inputs if io.name not in self.retained)}",
            )
        return {name: value for name, value in inputs.items() if name in wanted}

    def _check_numerics(
        self, executor: Executor, feeds: Mapping[str, np.ndarray], outputs: dict[str, np.ndarray]
    ) -> None:
        """Outputs with NaN or infinities: run the inference again with every kernel watched,
        trace them to where they began, keep the report and warn with it."""
        bad = nonfinite_outputs(outputs)
        if not bad:
            return
        probe = FiniteProbe()
        executor.probe, on_kernel, executor.on_kernel = probe, executor.on_kernel, None
        traffic = executor.traffic
        try:
            with np.errstate(all="ignore"):
                executor.run(feeds)
        finally:
            executor.probe, executor.on_kernel, executor.traffic = None, on_kernel, traffic
        self.numerics = diagnose(executor.program, bad, probe)
        warn(self.numerics)

    def executor(self, inputs: Mapping[str, np.ndarray]) -> Executor:
        """The executor of the specialization these inputs select (to watch its kernels, as
        calibration does with the executor's probe)."""
        return self._executor(self.select(inputs))

    def close(self) -> None:
        for device in self.devices:
            device.close()
        self._executors.clear()
        self._container.close()

    def __enter__(self) -> QpcSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _host_inputs(self, spec: SpecializationDesc) -> list[IODesc]:
        return [
            io for io in spec.inputs if io.name not in self.retained and io.name not in self.linked
        ]

    def _executor(self, spec: SpecializationDesc) -> Executor:
        if spec.program not in self._executors:
            from compiler_core.profiling.stats_writer import device_for

            program = self._container.program(spec.program)
            if self.network.options.get("aic-device") or self.network.options.get("aic_device"):
                vtcm = device_for(self.network).vtcm_bytes_per_core
            else:
                vtcm = max(max(program.vtcm_used, default=0), 8_323_072)
            constants = self._container.segments["constants.bin"]
            executor = Executor(program, constants, vtcm, self._decoded_constants(constants))
            if executor.retained:
                executor.bind_state(self.state)  # one device buffer for every specialization
            self._executors[spec.program] = executor
        return self._executors[spec.program]

    def _decoded_constants(self, constants: memoryview | bytes) -> dict[int, np.ndarray]:
        """Encoded constants (MXFP6 weights) decoded once for every program, by offset; a bad
        one is refused."""
        if self._decoded is None:
            from compiler_core.mxfp import decode_constants

            entries = self._container.constants()
            self._decoded = {}
            if any(e.encoding is not None for e in entries):
                try:
                    self._decoded = decode_constants(entries, constants)
                except ValueError as exc:
                    raise RuntimeFault(f"constantsdesc.bin: {exc}") from None
        return self._decoded
