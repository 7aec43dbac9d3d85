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
from compiler_core.mdp.pipeline import Stage, pipeline_stages
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


def meta_info(
    config: PartitionConfig, opts: CompileOptions, ports: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """`ports`: per device, the values it receives from and sends to other stages."""
    devices = []
    index = 0
    for stage, partition in enumerate(config.partitions):
        for d in partition.devices:
            entry = {
                "index": index,
                "deviceId": d.device_id,
                "numCores": d.num_cores,
                "prefix": device_prefix(index),
                "stage": stage,
            }
            if ports is not None:
                entry.update(ports[index])
            devices.append(entry)
            index += 1
    return {
        "version": MDP_META_VERSION,
        "partition": config.to_json(),
        "devices": devices,
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
    with the single-device compile's steps (compiler_core/build.py). Several partitions are
    pipeline stages (mdp/pipeline.py), the devices of each one slice its share
    (mdp/shard.py).

    Devices are compiled one after another; weights still in the model's file are sliced
    lazily (mdp/shard.py), so the compile holds no device's share of them: the QPC writer
    reads each device's constants when it writes them."""
    config = load_partition(opts, folder)
    n = config.num_devices
    stages = single.Stages(progress)
    specs = single.specializations(opts, folder)
    imports = [single.import_spec(source, opts, spec, stages, folder) for spec in specs]
    cuts = _stage_cuts(imports, len(config.partitions))
    link = link_meta(config, opts)
    segments: list[Segment] = []
    firsts: list[tuple[list[Any], list[str], CompileOptions]] = []
    ports: list[dict[str, Any]] = []
    out_dir, tmpdir = single.output_dir(opts)
    offsets = [sum(len(p.devices) for p in config.partitions[:s]) for s in range(len(cuts[0]))]
    for stage, partition in enumerate(config.partitions):
        members = len(partition.devices)
        for rank, device in enumerate(partition.devices):
            index = offsets[stage] + rank
            device_opts = opts.with_(
                aic_num_cores=device.num_cores,
                mdp_load_partition_config=None,
                mdp_dump_partition_config=None,
                mdp_devices=None,
            )
            builds = []
            for spec, imported, cut in zip(specs, imports, cuts, strict=True):
                piece = cut[stage]
                share = shard_model(piece.model, members, rank, offsets[stage])
                builds.append(
                    single.lower_spec(
                        source,
                        device_opts,
                        spec,
                        stages,
                        policy,
                        folder,
                        imported=dataclasses.replace(imported, model=share),
                    )
                )
            piece = cuts[0][stage]
            receives = [name for name, _ in piece.receives]
            sends = (
                [
                    [name, [d for s in readers for d in _stage_devices(config, offsets, s)]]
                    for name, readers in piece.sends
                ]
                if rank == 0  # the stage's first device sends (every one computes them)
                else []
            )
            ports.append({"receives": receives, "sends": [name for name, _ in piece.sends]})
            meta = {
                "mdp": {
                    "devices": n,
                    "rank": index,
                    "device_id": device.device_id,
                    "link": link,
                    "stage": stage,
                    "receives": receives,
                    "sends": [name for name, _ in piece.sends],
                }
            }
            retained = single.retained_state(builds, device_opts)
            shared, constant_items = single.shared_constants(builds)
            for build, region in zip(builds, shared, strict=True):
                single.plan_and_emit(build, region, device_opts, stages, meta)
                if receives or sends:
                    _add_transfers(build, receives, sends)
            prefix = device_prefix(index)
            for seg in single.qpc_segments(builds, device_opts, retained, constant_items):
                segments.append(dataclasses.replace(seg, name=prefix + seg.name))
            if rank == 0:
                firsts.append((builds, retained, device_opts))
    builds, retained, first_opts = firsts[0]
    network = _host_network(single, firsts, opts, ports, offsets)
    top = [
        Segment("networkdesc.bin", network.to_bytes()),
        Segment(MDP_META, json.dumps(meta_info(config, opts, ports), sort_keys=True).encode()),
    ]
    with stages.stage("write-qpc"):
        write_qpc(out_dir / "programqpc.bin", top + segments)
    if opts.mdp_dump_partition_config:
        _dump(opts.mdp_dump_partition_config, config)
    timelines = [single.Timelines(b, o.device) for b, _, o in firsts]

    def report() -> dict[str, Any]:
        metrics = single.build_metrics(builds, first_opts, timelines[0])
        if len(firsts) > 1:
            metrics = _pipeline_metrics(firsts, timelines, config, opts)
        metrics["mdp"] = mdp_report(config, opts, timelines[0][0])
        return metrics

    return single.CompileResult(
        qpc_path=out_dir / "programqpc.bin",
        _report=report,
        warnings=single.build_warnings(builds, first_opts, retained, timelines[0]),
        pass_times=stages.pass_times(),
        options=opts,
        program=builds[0].done()[1],
        programs={single.spec_name(b.spec): b.done()[1] for b in builds},
        _tmpdir=tmpdir,
    )


def _stage_cuts(imports: list[Any], stages: int) -> list[list[Stage]]:
    """Each specialization's model cut into the same stages (the cut found on the first one's
    nodes, applied by node name to the others: every stage keeps its layers' caches)."""
    first = pipeline_stages(imports[0].model, stages)
    if stages == 1:
        return [pipeline_stages(i.model, 1) for i in imports]
    names = [[n.name for n in s.model.graph][-1] for s in first[:-1]]
    out = [first]
    for imported in imports[1:]:
        nodes = [n.name for n in imported.model.graph]
        out.append(pipeline_stages(imported.model, stages, [nodes.index(n) for n in names]))
    return out


def _stage_devices(config: PartitionConfig, offsets: list[int], stage: int) -> list[int]:
    return [offsets[stage] + r for r in range(len(config.partitions[stage].devices))]


def _add_transfers(build: Any, receives: list[str], sends: list[list[Any]]) -> None:
    """A pipeline stage's boundary: core 0 waits for every value an earlier stage sends
    before any core starts (a semaphore after the waits); after every core has finished, core
    0 sends what later stages read to each of their devices. The program is encoded again."""
    from compiler_core.lowering.program import (
        LinkSend,
        LinkWait,
        SemPost,
        SemWait,
        encode_program,
    )
    from compiler_core.ops.registry import full_box

    program = build.program
    ids = {t.name: t.id for t in program.tensors}
    streams = program.streams
    if receives:
        sem = program.num_semaphores
        program.num_semaphores += 1
        streams[0][:0] = [*(LinkWait(ids[name], 1) for name in receives), SemPost(sem)]
        for stream in streams[1:]:
            stream[:0] = [SemWait(sem, 1)]
    if sends:
        sem = program.num_semaphores
        program.num_semaphores += 1
        for stream in streams:
            stream.append(SemPost(sem))
        streams[0].append(SemWait(sem, len(streams)))
        for name, peers in sends:
            t = program.tensors[ids[name]]
            box = full_box(t.shape)
            streams[0] += [LinkSend(t.id, box, peer, t.id, box) for peer in peers]
    build.program_bytes = encode_program(program)


def _host_network(
    single: Any,
    firsts: list[tuple[list[Any], list[str], CompileOptions]],
    opts: CompileOptions,
    ports: list[dict[str, Any]],
    offsets: list[int],
) -> Any:
    """The network as the host sees it: every stage's inputs and outputs but the values the
    stages pass each other (each stage's first device's)."""
    networks = []
    for stage, (builds, retained, _) in enumerate(firsts):
        network = single.network_desc(builds, opts, retained)
        linked = set(ports[offsets[stage]]["receives"]) | set(ports[offsets[stage]]["sends"])
        networks.append((network, linked))
    top, _ = networks[0]
    if len(networks) == 1:
        return top

    def merged(pick: Any) -> tuple[Any, ...]:
        seen: dict[str, Any] = {}
        for network, linked in networks:
            for io in pick(network):
                if io.name not in linked:
                    seen.setdefault(io.name, io)
        return tuple(seen.values())

    specs = tuple(
        dataclasses.replace(
            spec,
            inputs=merged(lambda n, i=i: n.specializations[i].inputs),
            outputs=merged(lambda n, i=i: n.specializations[i].outputs),
        )
        for i, spec in enumerate(top.specializations)
    )
    retained = [r for network, _ in networks for r in network.requirements.retained_state]
    return dataclasses.replace(
        top,
        inputs=merged(lambda n: n.inputs),
        outputs=merged(lambda n: n.outputs),
        specializations=specs,
        requirements=dataclasses.replace(top.requirements, retained_state=tuple(retained)),
    )


def _pipeline_metrics(
    firsts: list[tuple[list[Any], list[str], CompileOptions]],
    timelines: list[Any],
    config: PartitionConfig,
    opts: CompileOptions,
) -> dict[str, Any]:
    """A pipeline's step runs its stages one after another: each specialization's estimated
    latency is the sum of its stages' (each stage's first device's timeline, its sends
    included) plus a link latency per stage boundary; the LLM report is of those sums."""
    from compiler_core.llm_report import llm_report
    from compiler_core.metrics import perf_metrics

    builds0 = firsts[0][0]
    link = config.slowest_link(opts.device)
    hop_us = 0.0 if link is None else link.latency_s * 1e6
    each: dict[str, dict[str, Any]] = {}
    stage_us: dict[str, list[float]] = {}
    for i, build in enumerate(builds0):
        name = single_spec_name(build)
        metrics = perf_metrics(
            build.done()[1], build.lowered, build.done()[0], firsts[0][2], opts.device,
            timelines[0][i],
        )  # fmt: skip
        per_stage = [
            timelines[s][i].latency_seconds * 1e6 for s in range(len(firsts))
        ]  # fmt: skip
        metrics["estimated_latency_us"] = round(sum(per_stage) + hop_us * (len(firsts) - 1), 3)
        stage_us[name] = [round(x, 3) for x in per_stage]
        each[name] = metrics
    first = dict(next(iter(each.values())))
    if len(builds0) > 1:
        first["specializations"] = each
    llm = llm_report(
        [
            (single_spec_name(b), b.spec.symbols if b.spec else {}, b.done()[1], each[name])
            for b, name in zip(builds0, each, strict=True)
        ],
        opts.device,
    )
    if llm is not None:
        first["llm"] = llm
    first["pipeline_stage_latency_us"] = stage_us
    return first


def single_spec_name(build: Any) -> str:
    return build.spec.name if build.spec is not None else "default"


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
