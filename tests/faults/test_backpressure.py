"""Backpressure: a full partition makes put wait (or put_nowait raise); nothing is evicted."""

from __future__ import annotations

import anyio
import pytest
import torch

import tq_async as tq


def rows(n: int) -> dict[str, torch.Tensor]:
    return {"x": torch.zeros(n)}


@pytest.fixture(params=[65536, 0], ids=["one-message put", "three-step put"])
def inline(request: pytest.FixtureRequest) -> int:
    """Both put paths wait for room the same way (``inline_put_bytes`` of the client)."""
    value: int = request.param
    return value


async def test_put_waits_for_room_and_put_nowait_raises(inline: int) -> None:
    async with (
        tq.local_cluster(num_storage_units=1, capacity=4) as cluster,
        tq.AsyncClient.connect(cluster.address, inline_put_bytes=inline) as client,
    ):
        first = await client.put(rows(3), "p")
        with pytest.raises(tq.WouldBlock, match="capacity of 4"):
            await client.put_nowait(rows(2), "p")
        await client.put_nowait(rows(1), "p")  # exactly fits
        done: list[tq.BatchMeta] = []

        async def producer() -> None:
            done.append(await client.put(rows(2), "p"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(producer)
            with anyio.fail_after(5):
                while cluster.controller.waiting < 1:
                    await anyio.lowlevel.checkpoint()
            # consuming does not free anything: unconsumed data is never evicted, and
            # consumed data stays until cleared
            await client.get_meta(["x"], 4, "p", "t")
            assert not done
            await client.clear_samples(first.select_rows([0, 1]))
        assert len(done[0]) == 2
        assert (await client.partition_info("p"))["rows"] == 4
        with pytest.raises(tq.TQTimeoutError, match="nothing was written"):
            await client.put(rows(1), "p", timeout=0.05)
        with pytest.raises(tq.InvalidRequestError, match="never fit"):
            await client.put(rows(5), "q")
        # adding fields to existing rows needs no room
        await client.put({"y": torch.ones(2)}, meta=done[0])


async def test_auto_clear_frees_rows_once_every_registered_task_consumed(inline: int) -> None:
    async with (
        tq.local_cluster(num_storage_units=1, capacity=4) as cluster,
        tq.AsyncClient.connect(cluster.address, inline_put_bytes=inline) as client,
    ):
        await client.register_tasks(["reward", "learner"])
        await client.put(rows(4), "p")
        reward = await client.get_meta(["x"], 4, "p", "reward")
        await client.ack(reward)
        assert (await client.partition_info("p"))["rows"] == 4  # learner has not consumed
        learner = await client.get_meta(["x"], 2, "p", "learner")
        # fetched but not yet read: held, never freed under the consumer's feet
        assert (await client.partition_info("p"))["rows"] == 4
        assert (await client.get_data(learner))["x"].tolist() == [0.0, 0.0]
        await client.ack(learner)
        assert (await client.partition_info("p"))["rows"] == 2
        assert cluster.units[0].state.resident_bytes == 16  # the chunk lives while rows do
        await client.put_nowait(rows(2), "p")  # room again
        # get() acknowledges by itself once it has read the data
        td, _ = await client.get(["x"], 2, "p", "learner")
        assert len(td) == 2
        assert (await client.partition_info("p"))["rows"] == 2
        await client.register_tasks([])  # off
        await client.get_meta(["x"], 2, "p", "learner")
        assert (await client.partition_info("p"))["rows"] == 2


async def test_global_capacity_spans_partitions(inline: int) -> None:
    async with (
        tq.local_cluster(num_storage_units=1, capacity=3, capacity_scope="global") as cluster,
        tq.AsyncClient.connect(cluster.address, inline_put_bytes=inline) as client,
    ):
        await client.put(rows(2), "a")
        with pytest.raises(tq.WouldBlock):
            await client.put_nowait(rows(2), "b")
        await client.clear_partition("a")
        await client.put_nowait(rows(3), "b")


async def test_cancelled_waiting_put_writes_nothing(inline: int) -> None:
    async with (
        tq.local_cluster(num_storage_units=1, capacity=1) as cluster,
        tq.AsyncClient.connect(cluster.address, inline_put_bytes=inline) as client,
    ):
        await client.put(rows(1), "p")
        with anyio.move_on_after(0.05):
            await client.put(rows(1), "p")
        # the Cancel travels ahead of this request on the same socket
        assert (await client.partition_info("p"))["allocated"] == 1
        assert cluster.controller.waiting == 0


async def test_auto_clear_with_the_streaming_dataset() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.register_tasks(["learner"])
        await client.put(rows(6), "p")
        await client.seal("p")
        ds = tq.AsyncStreamingDataset(client, ["x"], 2, 2, "p", "learner")
        async with ds:
            got = [len(td) async for td, _ in ds]
        assert got == [2, 2, 2]
        assert (await client.partition_info("p"))["rows"] == 0  # every row read, then freed


async def test_a_keyed_put_waiting_for_room_counts_its_new_keys_again_when_woken() -> None:
    """A keyed put waits for room for its one new key; meanwhile its other key is cleared,
    so it now makes two rows. Woken by that clear (room for one), it must wait on for room
    for two: before, it counted the one row it needed when it arrived and went past the
    capacity."""
    async with (
        tq.local_cluster(num_storage_units=1, capacity=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.kv_batch_put(["a", "b"], "p", rows(2))
        done: list[tq.BatchMeta] = []

        async def producer() -> None:
            done.append(await client.kv_batch_put(["a", "c"], "p", rows(2)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(producer)
            with anyio.fail_after(5):
                while cluster.controller.waiting < 1:
                    await anyio.lowlevel.checkpoint()
            await client.kv_clear(["a"], "p")  # room for one row; the put needs two now
            assert (await client.partition_info("p"))["rows"] == 1
            assert cluster.controller.waiting == 1
            assert not done
            await client.kv_clear(["b"], "p")
        assert done[0].keys == ["a", "c"]
        assert (await client.partition_info("p"))["rows"] == 2


async def test_a_full_global_capacity_is_reported_as_all_partitions_not_the_empty_one(
    inline: int,
) -> None:
    """With ``capacity_scope="global"`` the rows that fill the capacity may all be in other
    partitions: the errors say so instead of calling the (empty) partition put to full."""
    async with (
        tq.local_cluster(num_storage_units=1, capacity=4, capacity_scope="global") as cluster,
        tq.AsyncClient.connect(cluster.address, inline_put_bytes=inline) as client,
    ):
        await client.put(rows(4), "p")
        with pytest.raises(tq.WouldBlock) as nowait:
            await client.put_nowait(rows(1), "q")
        with pytest.raises(tq.TQTimeoutError) as waited:
            await client.put(rows(1), "q", timeout=0.05)
    for exc in (nowait.value, waited.value):
        assert "all partitions together" in str(exc)
        assert "capacity of 4 rows" in str(exc)
        assert "partition 'q'" not in str(exc)
