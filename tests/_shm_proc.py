"""Test helpers for the shared-memory path that run in other processes."""

from __future__ import annotations

import asyncio
import os
import signal

import msgspec

from tq_async._paths._shm import ArenaMap
from tq_async._transport._dealer import DealerConnection
from tq_async._wire._protocol import ShmAlloc, ShmGrant, ShmHello, ShmHelloReply


def alloc_then_die(unit_address: str, nbytes: int) -> None:
    """Take a shared-memory grant, write half of it, then SIGKILL ourselves mid-put."""

    async def run() -> None:
        conn = DealerConnection(unit_address)
        payload, _ = await conn.request(ShmHello(os.getpid()), timeout=30)
        hello = msgspec.msgpack.decode(payload, type=ShmHelloReply)
        arena = ArenaMap(hello.pid, hello.fd, hello.size, hello.token)
        payload, _ = await conn.request(ShmAlloc(nbytes), timeout=30)
        grant = msgspec.msgpack.decode(payload, type=ShmGrant)
        arena.view[grant.offset : grant.offset + nbytes // 2] = 7
        os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(run())


def device_alloc_then_die(unit_address: str, nbytes: int) -> None:
    """Take a device arena grant (after both handshakes), then SIGKILL ourselves mid-put."""
    from tq_async._wire._protocol import DeviceHello

    async def run() -> None:
        conn = DealerConnection(unit_address)
        await conn.request(ShmHello(os.getpid()), timeout=30)
        payload, _ = await conn.request(DeviceHello(os.getpid()), timeout=30)
        assert payload != msgspec.msgpack.encode(None)
        payload, _ = await conn.request(ShmAlloc(nbytes, device=True), timeout=30)
        msgspec.msgpack.decode(payload, type=ShmGrant)
        os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(run())


def device_read_then_stop(unit_address: str, partition_id: str, rows: list[int]) -> None:
    """Read ``rows`` of field "x" through the unit's device arena (pinned by the reply), then
    stop (SIGSTOP) without giving the pin back: the test kills us."""
    from tq_async._wire._protocol import DeviceHello, StoredColumns, StoreGet

    async def run() -> None:
        conn = DealerConnection(unit_address)
        await conn.request(ShmHello(os.getpid()), timeout=30)
        await conn.request(DeviceHello(os.getpid()), timeout=30)
        get = StoreGet(partition_id, rows, ["x"], shm=True, device=True)
        payload, _ = await conn.request(get, timeout=30)
        stored = msgspec.msgpack.decode(payload, type=StoredColumns)
        assert stored.device_spans is not None
        assert stored.device_spans[0]
        os.kill(os.getpid(), signal.SIGSTOP)

    asyncio.run(run())


def pinned_alloc_then_die(unit_address: str, nbytes: int) -> None:
    """Take a shared-memory grant a GPU will copy into (``pinned``: the unit keeps its chunks
    resident for this process), then SIGKILL ourselves before the put."""

    async def run() -> None:
        conn = DealerConnection(unit_address)
        await conn.request(ShmHello(os.getpid()), timeout=30)
        payload, _ = await conn.request(ShmAlloc(nbytes, pinned=True), timeout=30)
        msgspec.msgpack.decode(payload, type=ShmGrant)
        os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(run())
