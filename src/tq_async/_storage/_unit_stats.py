"""What a storage unit reports of itself (`StoreStatsReply`): its cells, tiers, data paths.

Read-only: `unit_stats` copies the counters of a unit's parts (the cell index, the shared
memory arena, the NIXL agent, the device arena, the disk, the locality counts) into one reply.
"""

from __future__ import annotations

from typing import Protocol, TypedDict

from .._paths._device import DeviceArena
from .._paths._nixl import UnitNixl
from .._paths._shm import Arena
from .._wire._protocol import StoreStatsReply
from ._cell_index import CellIndex
from ._segments import SegmentStore

__all__ = ["Counted", "unit_stats"]


class Counted(Protocol):
    """What `unit_stats` reads of a unit (`tq_async._storage._cells.StorageState`)."""

    cells: CellIndex
    instance: str
    arena: Arena | None
    nixl: UnitNixl | None
    device: DeviceArena | None
    disk: SegmentStore | None
    memory_cap: int | None
    spills: int
    disk_reads: int
    host: str
    locality: dict[str, int]
    task_locality: dict[str, dict[str, int]]


def unit_stats(unit: Counted) -> StoreStatsReply:
    """``unit``'s counters, as the controller and ``tq-async stats`` read them."""
    cells, arena, nixl = unit.cells, unit.arena, unit.nixl
    task_locality = {task: dict(counts) for task, counts in sorted(unit.task_locality.items())}
    if arena is None:
        reply = StoreStatsReply(len(cells.index), cells.rows(), cells.resident_bytes, unit.instance)
        reply.host, reply.locality = unit.host, dict(unit.locality)
        reply.task_locality = task_locality
        return _tier_stats(unit, reply)
    return _tier_stats(
        unit,
        StoreStatsReply(
            len(cells.index),
            cells.rows(),
            cells.resident_bytes,
            unit.instance,
            shm_bytes=arena.live_bytes,
            shm_idle_bytes=arena.idle_bytes,
            shm_cap=arena.cap,
            shm_fallbacks=arena.fallbacks,
            shm_puts=arena.puts,
            shm_reads=arena.reads,
            nixl_puts=nixl.puts if nixl is not None else 0,
            nixl_reads=nixl.reads if nixl is not None else 0,
            nixl_registered_bytes=nixl.registered_bytes if nixl is not None else 0,
            **_device_stats(unit.device),
            host=unit.host,
            locality=dict(unit.locality),
            shm_locked_bytes=arena.locked_bytes(),
            task_locality=task_locality,
        ),
    )


def _tier_stats(unit: Counted, reply: StoreStatsReply) -> StoreStatsReply:
    reply.memory_bytes = unit.cells.memory_bytes
    reply.memory_cap = unit.memory_cap or 0
    reply.spills, reply.disk_reads = unit.spills, unit.disk_reads
    if unit.disk is not None:
        reply.disk_bytes = unit.disk.live_bytes
    return reply


class _DeviceStats(TypedDict, total=False):
    device_bytes: int
    device_cap: int
    device_puts: int
    device_reads: int
    device_fallbacks: int
    device_out_bytes: int
    device_out_us: int


def _device_stats(device: DeviceArena | None) -> _DeviceStats:
    if device is None:
        return {}
    return {
        "device_bytes": device.live_bytes,
        "device_cap": device.cap,
        "device_puts": device.puts,
        "device_reads": device.reads,
        "device_fallbacks": device.fallbacks,
        "device_out_bytes": device.out_bytes,
        "device_out_us": int(device.out_seconds * 1e6),
    }
