"""Compile a network for a partition: every device's program in one QPC.

Each device's share of the model (compiler_core/mdp/shard.py) goes through the whole
single-device compile (passes, lowering, memory, emit) with that device's cores. The QPC holds:

- `networkdesc.bin`: the network as the host sees it (device 0's I/O: the host sends every
  device the same inputs and reads the outputs, made whole on every device, from device 0);
- `mdp_meta_info`: the partition (the config file's JSON), each device's id, cores and
  segment prefix, and the link the devices exchange data over;
- `device<N>/...`: device N's own networkdesc, programs, stats layouts and constants.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import compiler_core.build as single
from compiler_core.cost_timeline import Timeline
from compiler_core.errors import CompileError
from compiler_core.importer import ModelSource
from compiler_core.lowering.placement import CodegenPolicy
from compiler_core.mdp.config import (
    FLAG,
    Partition,
    PartitionConfig,
    PartitionDevice,
    parse_partition_config,
    tensor_slicing,
)
from compiler_core.mdp.shard import shard_model
from compiler_core.model_folder import ModelFolder
from compiler_core.options import CompileOptions
from compiler_core.qpc.container import MDP_META, Segment, write_qpc

MDP_META_VERSION = 1


def device_prefix(index: int) -> str:
    return f"device{index}/"


def load_partition(opts: CompileOptions, folder: ModelFolder) -> PartitionConfig:
    """The partition file the options name, or the one `-mdp-devices=N` stands for."""
    if opts.mdp_load_partition_config is None:
        config = tensor_slicing(opts.mdp_devices or 1, opts.aic_num_cores)
        return parse_partition_config(config.dumps(), opts.device)
    text = folder.read_text(opts.mdp_load_partition_config, FLAG)
    return parse_partition_config(text, opts.device)


def link_meta(config: PartitionConfig, opts: CompileOptions) -> dict[str, Any]:
    link = config.slowest_link(opts.device)
    if link is None:
        return {}
    return {"kind": link.kind, "bytes_per_s": link.bytes_per_s, "latency_s": link.latency_s}


def meta_info(config: PartitionConfig, opts: CompileOptions) -> dict[str, Any]:
    return {
        "version": MDP_META_VERSION,
        "partition": config.to_json(),
        "devices": [
            {
                "index": index,
                "deviceId": d.device_id,
                "numCores": d.num_cores,
                "prefix": device_prefix(index),
            }
            for index, d in enumerate(config.partitions[0].devices)
        ],
        "link": link_meta(config, opts),
    }


def compile_partitioned(
    source: ModelSource,
    opts: CompileOptions,
    progress: Any,
    policy: CodegenPolicy,
    folder: ModelFolder,
) -> Any:
    """`compile_model` for `-mdp-load-partition-config`: one program per device, each built
    with the single-device compile's steps (compiler_core/build.py).

    Devices are compiled one after another; weights still in the model's file are sliced
    lazily (mdp/shard.py), so the compile holds no device's share of them: the QPC writer
    reads each device's constants when it writes them."""
    config = load_partition(opts, folder)
    devices = config.partitions[0].devices
    n = len(devices)
    stages = single.Stages(progress)
    specs = single.specializations(opts, folder)
    imports = [single.import_spec(source, opts, spec, stages, folder) for spec in specs]
    link = link_meta(config, opts)
    segments: list[Segment] = []
    first: tuple[list[Any], list[str], CompileOptions] | None = None
    out_dir, tmpdir = single.output_dir(opts)
    for rank, device in enumerate(devices):
        device_opts = opts.with_(
            aic_num_cores=device.num_cores,
            mdp_load_partition_config=None,
            mdp_dump_partition_config=None,
            mdp_devices=None,
        )
        builds = []
        for spec, imported in zip(specs, imports, strict=True):
            share = dataclasses.replace(imported, model=shard_model(imported.model, n, rank))
            builds.append(
                single.lower_spec(source, device_opts, spec, stages, policy, folder, imported=share)
            )
        meta = {"mdp": {"devices": n, "rank": rank, "device_id": device.device_id, "link": link}}
        retained = single.retained_state(builds, device_opts)
        shared, constant_items = single.shared_constants(builds)
        for build, region in zip(builds, shared, strict=True):
            single.plan_and_emit(build, region, device_opts, stages, meta)
        prefix = device_prefix(rank)
        for seg in single.qpc_segments(builds, device_opts, retained, constant_items):
            segments.append(dataclasses.replace(seg, name=prefix + seg.name))
        if first is None:
            first = (builds, retained, device_opts)
    assert first is not None
    builds, retained, first_opts = first
    network = single.network_desc(builds, opts, retained)
    top = [
        Segment("networkdesc.bin", network.to_bytes()),
        Segment(MDP_META, json.dumps(meta_info(config, opts), sort_keys=True).encode()),
    ]
    with stages.stage("write-qpc"):
        write_qpc(out_dir / "programqpc.bin", top + segments)
    if opts.mdp_dump_partition_config:
        _dump(opts.mdp_dump_partition_config, config)
    timelines = single.Timelines(builds, first_opts.device)

    def report() -> dict[str, Any]:
        metrics = single.build_metrics(builds, first_opts, timelines)
        metrics["mdp"] = mdp_report(config, opts, timelines[0])
        return metrics

    return single.CompileResult(
        qpc_path=out_dir / "programqpc.bin",
        _report=report,
        warnings=single.build_warnings(builds, first_opts, retained, timelines),
        pass_times=stages.pass_times(),
        options=opts,
        program=builds[0].done()[1],
        programs={single.spec_name(b.spec): b.done()[1] for b in builds},
        _tmpdir=tmpdir,
    )


def mdp_report(config: PartitionConfig, opts: CompileOptions, timeline: Timeline) -> dict[str, Any]:
    """The partition in the metrics: devices, cores, the link and what the exchanges cost."""
    devices = config.partitions[0].devices
    return {
        "devices": [{"deviceId": d.device_id, "numCores": d.num_cores} for d in devices],
        "link": link_meta(config, opts),
        "link_bytes_per_device": timeline.link_bytes,
        "link_wait_us": round(timeline.link_cycles / timeline.clock_hz * 1e6, 3),
    }


def _dump(path: str, config: PartitionConfig) -> None:
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(config.dumps())
    except OSError as exc:
        raise CompileError(
            "output_dir",
            f"-mdp-dump-partition-config: cannot write {path}: {exc.strerror}",
            flag="-mdp-dump-partition-config",
        ) from None


def dump_from_qpc(qpc: Path, path: str) -> None:
    """`-mdp-dump-partition-config` for a QPC compiled elsewhere (`qpcfarm submit`): the
    partition its `mdp_meta_info` names (one device for a single-device QPC)."""
    from compiler_core.mdp.config import single_device
    from compiler_core.qpc.container import load_qpc

    with load_qpc(qpc) as container:
        meta = container.mdp
        network = container.network
        cores = network.num_cores if network is not None else 1
    if meta is None:
        _dump(path, single_device(cores))
        return
    doc = meta["partition"]
    config = PartitionConfig(
        tuple(
            Partition(
                str(p["name"]),
                tuple(PartitionDevice(d["deviceId"], d["numCores"]) for d in p["devices"]),
            )
            for p in doc["partitions"]
        ),
        tuple((c["type"], frozenset(c["devices"])) for c in doc.get("connections", [])),
    )
    _dump(path, config)
