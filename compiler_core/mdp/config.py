"""The partition config file, as the vendor's `-mdp-load-partition-config` reads it.

    {"connections": [{"devices": [0, 1, 2, 3], "type": "p2p"}],
     "partitions": [{"name": "Partition0",
                     "devices": [{"deviceId": 0, "numCores": 16}, {"deviceId": 1, ...}]}]}

A partition over several devices is tensor slicing (every device holds a slice of every
layer); several partitions are pipeline stages (each runs its share of the layers); devices
listed in a `connections` entry of type `p2p` exchange data peer to peer
through their card's PCIe switch, any other pair through the host. Device ids number the SoCs
of the host card after card (compiler_core.devices). Every mistake is a CompileError
`invalid_partition_config` naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from compiler_core.devices import DeviceProfile, Link, link_between
from compiler_core.errors import CompileError

FLAG = "-mdp-load-partition-config"
CONNECTION_TYPES = ("p2p",)


@dataclass(frozen=True)
class PartitionDevice:
    device_id: int
    num_cores: int


@dataclass(frozen=True)
class Partition:
    name: str
    devices: tuple[PartitionDevice, ...]


@dataclass(frozen=True)
class PartitionConfig:
    partitions: tuple[Partition, ...]
    connections: tuple[tuple[str, frozenset[int]], ...] = ()
    """(type, device ids) of each connection entry."""

    @property
    def devices(self) -> tuple[PartitionDevice, ...]:
        return tuple(d for p in self.partitions for d in p.devices)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def connected(self, a: int, b: int) -> str | None:
        """The connection type joining device ids a and b, or None (through the host)."""
        for kind, ids in self.connections:
            if a in ids and b in ids:
                return kind
        return None

    def link(self, device: DeviceProfile, a: int, b: int) -> Link:
        kind = self.connected(a, b) or "host"
        return link_between(kind, device.card_of(a) == device.card_of(b))

    def slowest_link(self, device: DeviceProfile) -> Link | None:
        """The link an exchange among the devices waits for (the slowest pair: an all-gather
        ends when its last part lands), or None for one device."""
        ids = [d.device_id for d in self.devices]
        links = [self.link(device, a, b) for i, a in enumerate(ids) for b in ids[i + 1 :]]
        return max(links, key=lambda k: k.seconds(1 << 16), default=None)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        if self.connections:
            doc["connections"] = [
                {"devices": sorted(ids), "type": kind} for kind, ids in self.connections
            ]
        doc["partitions"] = [
            {
                "name": p.name,
                "devices": [{"deviceId": d.device_id, "numCores": d.num_cores} for d in p.devices],
            }
            for p in self.partitions
        ]
        return doc

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"


def _bad(message: str, **details: Any) -> CompileError:
    return CompileError(
        "invalid_partition_config", f"{FLAG}: {message}", flag=FLAG, details=details
    )


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{where} must be an integer, not {json.dumps(value)}")
    return value


def parse_partition_config(text: str | bytes, device: DeviceProfile) -> PartitionConfig:
    """Parse and check a partition config against `device` (cores per SoC, SoCs a host
    holds)."""
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise _bad("the file must hold a JSON object with a 'partitions' list")
    unknown = sorted(set(doc) - {"connections", "partitions"})
    if unknown:
        raise _bad(f"unknown key(s) {', '.join(unknown)}; known: connections, partitions")
    raw_parts = doc.get("partitions")
    if not isinstance(raw_parts, list) or not raw_parts:
        raise _bad("'partitions' must be a non-empty list")
    partitions: list[Partition] = []
    seen_ids: dict[int, str] = {}
    names: set[str] = set()
    for i, raw in enumerate(raw_parts):
        where = f"partitions[{i}]"
        if not isinstance(raw, dict):
            raise _bad(f"{where} must be an object with 'name' and 'devices'")
        name = raw.get("name", f"Partition{i}")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}.name must be a non-empty string")
        if name in names:
            raise _bad(f"partition name {name!r} is given twice")
        names.add(name)
        raw_devices = raw.get("devices")
        if not isinstance(raw_devices, list) or not raw_devices:
            raise _bad(f"{where}.devices must be a non-empty list")
        devices = []
        for j, entry in enumerate(raw_devices):
            at = f"{where}.devices[{j}]"
            if not isinstance(entry, dict) or "deviceId" not in entry:
                raise _bad(f"{at} must be an object with deviceId and numCores")
            device_id = _int(entry["deviceId"], f"{at}.deviceId")
            cores = _int(entry.get("numCores", device.cores_per_soc), f"{at}.numCores")
            if not 0 <= device_id < device.max_socs_per_host:
                raise _bad(
                    f"{at}.deviceId {device_id} is not a SoC of the host: {device.display_name} "
                    f"hosts have SoCs 0-{device.max_socs_per_host - 1}",
                    device_id=device_id,
                )
            if not 1 <= cores <= device.cores_per_soc:
                raise _bad(
                    f"{at}.numCores {cores} is out of range: a {device.display_name} SoC has "
                    f"{device.cores_per_soc} cores",
                    num_cores=cores,
                )
            if device_id in seen_ids:
                raise _bad(
                    f"deviceId {device_id} appears twice (in {seen_ids[device_id]} and {at})",
                    device_id=device_id,
                )
            seen_ids[device_id] = at
            devices.append(PartitionDevice(device_id, cores))
        partitions.append(Partition(name, tuple(devices)))
    connections = []
    raw_connections = doc.get("connections", [])
    if not isinstance(raw_connections, list):
        raise _bad("'connections' must be a list")
    for i, raw in enumerate(raw_connections):
        where = f"connections[{i}]"
        if not isinstance(raw, dict):
            raise _bad(f"{where} must be an object with 'devices' and 'type'")
        kind = raw.get("type")
        if kind not in CONNECTION_TYPES:
            raise _bad(
                f"{where}.type {json.dumps(kind)} is not known; "
                f"known: {', '.join(CONNECTION_TYPES)}"
            )
        ids = raw.get("devices")
        if not isinstance(ids, list) or len(ids) < 2:
            raise _bad(f"{where}.devices must list at least two device ids")
        members = {_int(d, f"{where}.devices") for d in ids}
        strangers = sorted(members - set(seen_ids))
        if strangers:
            raise _bad(
                f"{where} names device(s) {strangers} that no partition uses",
                devices=strangers,
            )
        connections.append((str(kind), frozenset(members)))
    return PartitionConfig(tuple(partitions), tuple(connections))


def single_device(cores: int) -> PartitionConfig:
    """What a compile without a partition config runs on: one SoC."""
    return PartitionConfig((Partition("Partition0", (PartitionDevice(0, cores),)),))


def tensor_slicing(devices: int, cores: int) -> PartitionConfig:
    """One partition over SoCs 0..devices-1, connected p2p (what the configurator and the fit
    check suggest)."""
    ids = tuple(PartitionDevice(d, cores) for d in range(devices))
    connections = (("p2p", frozenset(range(devices))),) if devices > 1 else ()
    return PartitionConfig((Partition("Partition0", ids),), connections)
