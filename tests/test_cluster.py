"""``local_cluster``: errors of the caller's block come out as themselves; blocking calls on
the loop that runs the services fail at once instead of deadlocking."""

from __future__ import annotations

import time

import anyio
import pytest

import tq_async as tq


async def test_an_exception_in_the_block_propagates_as_itself() -> None:
    with pytest.raises(ValueError, match="mine") as info:
        async with tq.local_cluster(num_storage_units=1):
            raise ValueError("mine")
    assert type(info.value) is ValueError  # not an ExceptionGroup around it

    class Custom(Exception):
        pass

    with pytest.raises(Custom) as custom:
        async with tq.local_cluster(num_storage_units=1):
            raise Custom("x")
    assert type(custom.value) is Custom


async def test_a_tq_error_in_the_block_propagates_as_itself() -> None:
    with pytest.raises(tq.TQTimeoutError):
        async with (
            tq.local_cluster(num_storage_units=1) as cluster,
            tq.AsyncClient.connect(cluster.address) as client,
        ):
            await client.get_meta(["x"], 1, "p", "t", timeout=0.05)


async def test_cancelling_the_block_still_cancels() -> None:
    with anyio.move_on_after(0.05) as scope:
        async with tq.local_cluster(num_storage_units=1):
            await anyio.sleep_forever()
    assert scope.cancelled_caught


async def test_a_blocking_client_on_the_services_loop_fails_at_once() -> None:
    async with tq.local_cluster(num_storage_units=1) as cluster:
        t0 = time.monotonic()
        with pytest.raises(tq.InvalidRequestError, match="would block the event loop") as info:
            tq.Client.connect(cluster.address).open()
        assert "tq.AsyncClient.connect(address)" in str(info.value)
        assert "anyio.to_thread.run_sync" in str(info.value)
        assert time.monotonic() - t0 < 0.1  # known before any I/O

        # from another thread the same blocking client works
        def use() -> list[str]:
            with tq.Client.connect(cluster.address) as client:
                return client.list_partitions()

        assert await anyio.to_thread.run_sync(use) == []


async def test_iterating_a_streaming_loader_on_the_services_loop_fails_at_once() -> None:
    async with tq.local_cluster(num_storage_units=1) as cluster:
        dataset = tq.StreamingDataset(cluster.address, ["x"], 2, 2, "p", "learner")
        loader = tq.StreamingDataLoader(dataset)
        with pytest.raises(tq.InvalidRequestError, match="StreamingDataLoader"):
            next(iter(loader))


async def test_a_blocking_client_elsewhere_is_untouched() -> None:
    # not this loop's services: the blocking client only blocks this loop (discouraged, but
    # it cannot deadlock), so it is allowed
    # nothing listens there (refused at once): a BrokenError, not InvalidRequestError
    with pytest.raises(tq.BrokenError, match="nothing listens at"):
        tq.Client.connect("tcp://127.0.0.1:9", request_timeout=0.2).open()
