"""The one-round-trip get: the controller sends a batch's cells along with its metadata.

When every row of a ``get`` sits in a storage unit of the controller's own process and the
cells take at most ``inline_get_bytes``, the ``get_meta`` reply carries them; otherwise the
client reads them from the units as usual. Either way the result is the same.
"""

from __future__ import annotations

import anyio
import msgspec
import torch
import zmq

import tq_async as tq
from tq_async._controller._server import ControllerServer
from tq_async._storage._server import StorageServer
from tq_async._wire._protocol import MetaReply, StoreGet, reply_decoder, storage_request_decoder


def count_unit_reads(units: list[StorageServer]) -> list[int]:
    """How many StoreGet messages the units answered (the controller's reads of units in its
    own process are calls, not messages, and are not counted)."""
    seen = [0]
    for unit in units:
        endpoint = unit._endpoint
        assert endpoint is not None
        real = endpoint._on_message

        def on_message(peer: bytes, frames: list[zmq.Frame], _real=real) -> None:  # type: ignore[no-untyped-def]
            if isinstance(storage_request_decoder.decode(frames[0].buffer).body, StoreGet):
                seen[0] += 1
            _real(peer, frames)

        endpoint._on_message = on_message
    return seen


async def put_batches(client: tq.AsyncClient) -> None:
    # two puts: round-robin puts them on two units
    await client.put(
        {
            "x": torch.arange(4),
            "j": torch.nested.nested_tensor(
                [torch.arange(i + 1) for i in range(4)], layout=torch.jagged
            ),
            "s": ["a", "b", "c", "d"],
        },
        "p",
    )
    await client.put(
        {
            "x": torch.arange(4, 8),
            "j": torch.nested.nested_tensor(
                [torch.arange(i + 5) for i in range(4)], layout=torch.jagged
            ),
            "s": ["e", "f", "g", "h"],
        },
        "p",
    )


class OddFirst(tq.BaseSampler):
    """Rows from both units, interleaved: 1, 0, 5, 4, ..."""

    def sample(self, ready_indexes, batch_size, **ctx):  # type: ignore[no-untyped-def]
        rows = sorted(ready_indexes, key=lambda r: (r % 2 == 0, -r))[:batch_size]
        return rows, rows


def check(td: object, meta: tq.BatchMeta) -> None:
    rows = meta.global_indexes
    assert td["x"].tolist() == rows  # type: ignore[index]
    assert [t.tolist() for t in td["j"].unbind()] == [list(range(r + 1)) for r in rows]  # type: ignore[index]
    assert list(td["s"]) == ["abcdefgh"[r] for r in rows]  # type: ignore[index]


async def test_get_of_local_cells_is_one_round_trip_in_meta_order() -> None:
    async with (
        tq.local_cluster(num_storage_units=2, sampler=OddFirst()) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await put_batches(client)
        reads = count_unit_reads(cluster.units)
        td, meta = await client.get(["x", "j", "s"], 6, "p", "t")
        assert len(set(meta.units)) == 2  # the batch spans both units
        assert meta.global_indexes == [7, 5, 3, 1, 6, 4]
        check(td, meta)
        assert reads[0] == 0
        assert not client._links.units  # the client never had to talk to a unit


async def test_large_or_disabled_inline_reads_from_the_units() -> None:
    async with (
        tq.local_cluster(num_storage_units=2, sampler=OddFirst()) as cluster,
        tq.AsyncClient.connect(cluster.address, inline_get_bytes=16) as client,
    ):
        await put_batches(client)
        reads = count_unit_reads(cluster.units)
        td, meta = await client.get(["x", "j", "s"], 6, "p", "t")  # more than 16 bytes
        check(td, meta)
        assert reads[0] == 2  # one StoreGet per unit
        client.inline_get_bytes = 0
        td, meta = await client.get(["x", "j", "s"], 2, "p", "t")
        check(td, meta)
        assert reads[0] == 3


async def test_waiting_get_gets_the_cells_inline_too() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        reads = count_unit_reads(cluster.units)
        got: list[object] = []

        async def consumer() -> None:
            got.append(await client.get(["x"], 2, "p", "t"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            await anyio.wait_all_tasks_blocked()
            await client.put({"x": torch.tensor([5, 6])}, "p")
        td, meta = got[0]  # type: ignore[misc]
        assert td["x"].tolist() == [5, 6]
        assert meta.global_indexes == [0, 1]
        assert reads[0] == 0


async def test_a_retried_get_gets_metadata_without_the_cells() -> None:
    """The reply cache keeps no cells alive: a retry is answered with metadata only, and the
    client then reads the cells from the units."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(3)}, "p")
        await client.get(["x"], 3, "p", "t")
        controller: ControllerServer = cluster.controller
        reply = reply_decoder.decode(list(controller._shell.replies.values())[-1])
        meta = msgspec.msgpack.decode(reply.payload, type=MetaReply)
        assert meta.rows == [0, 1, 2]
        assert meta.inline is None


async def test_blocking_client_takes_the_option() -> None:
    async with tq.local_cluster(num_storage_units=1) as cluster:
        reads = count_unit_reads(cluster.units)

        def blocking() -> list[int]:
            with tq.Client.connect(cluster.address, inline_get_bytes=0) as client:
                client.put({"x": torch.arange(3)}, "p")
                td, _ = client.get(["x"], 3, "p", "t")
                return list(td["x"].tolist())

        assert await anyio.to_thread.run_sync(blocking) == [0, 1, 2]
        assert reads[0] == 1
