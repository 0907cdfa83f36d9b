"""``get_batches`` (``GetMeta.also``): a batch under its index and the later ones that can be
decided at once, in one request; ``AsyncStreamingDataset.next_batch(ahead=)`` on top of it.

What must hold: the batches that come are recorded like any fetch under a ``batch_index``
(re-read as the same rows); the indexes between are decided first (gap-free, as
``record_from``); a batch that cannot be decided at once is neither waited for nor taken;
the end of the stream, a failure, or an ``async`` sampler's answer stops the list without
failing the asked batch; nothing is lost.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from prometheus_client import CollectorRegistry
from tensordict import TensorDict

import tq_async as tq
from _samplers import Later
from tq_async._client._async._get import GetPath
from tq_async._wire._checks import MAX_ALSO, validate
from tq_async._wire._protocol import GetMeta


def rows(n: int, start: int = 0) -> TensorDict:
    return TensorDict({"x": torch.arange(start, start + n)}, batch_size=[n])


def cfg(index: int, **extra: Any) -> dict[str, Any]:
    return {"batch_index": index, "dp_rank": 0, **extra}


def as_rows(got: list[tuple[TensorDict, tq.BatchMeta]]) -> list[tuple[int | None, list[int]]]:
    """(batch_index, rows) of each batch, checking the data names the same rows."""
    for td, meta in got:
        assert td["x"].tolist() == list(meta.global_indexes)
    return [(meta.batch_index, list(meta.global_indexes)) for _, meta in got]


async def recorded(client: tq.AsyncClient, index: int, pid: str = "p") -> list[int]:
    """The rows recorded under ``index`` (a re-read: never waits for a decided batch)."""
    meta = await client.get_meta(["x"], 4, pid, "t", cfg(index), timeout=0)
    return list(meta.global_indexes)


async def consumed(client: tq.AsyncClient, pid: str = "p") -> int:
    return int((await client.partition_info(pid))["consumed"].get("t", 0))


async def test_the_ready_batches_come_in_one_request_each_recorded_and_the_gaps_decided() -> None:
    registry = CollectorRegistry()
    async with (
        tq.local_cluster(num_storage_units=2, metrics_registry=registry) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(rows(40), partition_id="p")
        got = await client.get_batches(["x"], 4, "p", "t", cfg(0), also=[2, 4, 6])
        assert as_rows(got) == [
            (0, [0, 1, 2, 3]),
            (2, [8, 9, 10, 11]),
            (4, [16, 17, 18, 19]),
            (6, [24, 25, 26, 27]),
        ]
        labels = {"op": "GetMeta", "outcome": "ok", "service": "controller"}
        assert registry.get_sample_value("tq_requests_total", labels) == 1
        # the indexes between were decided on the way, lowest first (another reader's)
        assert await recorded(client, 1) == [4, 5, 6, 7]
        assert await recorded(client, 3) == [12, 13, 14, 15]
        assert await recorded(client, 5) == [20, 21, 22, 23]
        # each batch is recorded: a re-read is the same rows, and so is get_batches again
        assert await recorded(client, 4) == [16, 17, 18, 19]
        again = await client.get_batches(["x"], 4, "p", "t", cfg(2), also=[4])
        assert as_rows(again) == [(2, [8, 9, 10, 11]), (4, [16, 17, 18, 19])]
        assert await consumed(client) == 28  # batches 0-6: nothing else was taken


async def test_a_batch_not_ready_at_once_is_neither_waited_for_nor_taken() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(rows(10), partition_id="p")  # batches 0 and 1; 2 lacks rows
        with anyio.fail_after(5):
            got = await client.get_batches(["x"], 4, "p", "t", cfg(0), also=[1, 2, 3])
        assert as_rows(got) == [(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7])]
        assert await consumed(client) == 8
        await client.put(rows(6, 10), partition_id="p")
        got = await client.get_batches(["x"], 4, "p", "t", cfg(2), also=[3])
        assert as_rows(got) == [(2, [8, 9, 10, 11]), (3, [12, 13, 14, 15])]


async def test_the_asked_batch_waits_and_the_later_ones_are_decided_when_it_is_answered() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        got: list[tuple[TensorDict, tq.BatchMeta]] = []

        async def reader() -> None:
            got.extend(await client.get_batches(["x"], 4, "p", "t", cfg(0), also=[1]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            with anyio.fail_after(5):
                while cluster.controller.waiting < 1:
                    await anyio.lowlevel.checkpoint()
            await client.put(rows(6), partition_id="p")  # wakes it: batch 1 lacks 2 rows
        assert as_rows(got) == [(0, [0, 1, 2, 3])]
        await client.put(rows(2, 6), partition_id="p")
        assert await recorded(client, 1) == [4, 5, 6, 7]


async def test_the_end_of_the_stream_is_never_sent_ahead() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(rows(8), partition_id="p")
        await client.seal("p")
        got = await client.get_batches(["x"], 4, "p", "t", cfg(0), also=[1, 2, 3])
        assert as_rows(got) == [(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7])]
        td, meta = (await client.get_batches(["x"], 4, "p", "t", cfg(2), also=[3]))[0]
        assert meta.end_of_stream
        assert len(td) == 0


async def test_a_batch_that_fails_ahead_leaves_the_asked_one_and_fails_on_its_own() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(rows(21), partition_id="p")
        await client.seal("p")
        dp = {"dp_size": 2, "tail": "error"}  # global batches of 2 x 4: 8, 8, then 5 rows
        got = await client.get_batches(["x"], 4, "p", "t", cfg(0, **dp), also=[1, 2])
        assert [m.batch_index for _, m in got] == [0, 1]
        with pytest.raises(tq.InvalidRequestError, match="do not split evenly"):
            await client.get_batches(["x"], 4, "p", "t", cfg(2, **dp), also=[3])


async def test_an_async_sampler_answers_the_asked_batch_and_nothing_is_taken_ahead() -> None:
    async with (
        tq.local_cluster(num_storage_units=1, sampler=Later()) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(rows(12), partition_id="p")
        got = await client.get_batches(["x"], 4, "p", "t", cfg(0), also=[1, 2])
        assert as_rows(got) == [(0, [0, 1, 2, 3])]
        assert await consumed(client) == 4
        got = await client.get_batches(["x"], 4, "p", "t", cfg(1), also=[2])
        assert as_rows(got) == [(1, [4, 5, 6, 7])]


async def test_cells_past_the_inline_budget_are_read_from_the_units(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The inline budget is shared by the batches of one reply; those past it are read from
    the storage units by the client, and the result is the same."""
    read: list[int | None] = []
    get_data = GetPath.get_data

    async def spy(self: GetPath, meta: tq.BatchMeta, *args: Any, **kwargs: Any) -> TensorDict:
        read.append(meta.batch_index)
        return await get_data(self, meta, *args, **kwargs)

    monkeypatch.setattr(GetPath, "get_data", spy)
    async with tq.local_cluster(num_storage_units=2) as cluster:
        async with tq.AsyncClient.connect(cluster.address) as client:
            await client.put(rows(40), partition_id="p")
            got = await client.get_batches(["x"], 4, "p", "t", cfg(0), also=[1, 2, 3])
            assert as_rows(got) == [(i, list(range(4 * i, 4 * i + 4))) for i in range(4)]
            assert read == []  # all four came inline
        # 4 int64 rows a batch: 32 bytes of cells; 80 bytes fit two batches, not three
        async with tq.AsyncClient.connect(cluster.address, inline_get_bytes=80) as small:
            got = await small.get_batches(["x"], 4, "p", "t", cfg(4), also=[5, 6, 7])
        assert as_rows(got) == [(i, list(range(4 * i, 4 * i + 4))) for i in range(4, 8)]
        assert read == [6, 7]


def test_the_blocking_client_gets_batches_too() -> None:
    with (
        tq.background_cluster(num_storage_units=1) as cluster,
        tq.Client.connect(cluster.address) as client,
    ):
        client.put(rows(12), partition_id="blocking")
        got = client.get_batches(["x"], 4, "blocking", "t", cfg(0), also=[1, 2, 3])
        assert as_rows(got) == [(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7]), (2, [8, 9, 10, 11])]


@pytest.mark.parametrize(
    ("config", "also", "match"),
    [
        ({"dp_rank": 0}, [1], "needs a fetch whose sampling_config names a batch_index"),
        (cfg(2), [2], "increasing batch indexes above batch_index 2"),
        (cfg(2), [4, 3], "increasing"),
        (cfg(2), [-1], "increasing|also"),
        (cfg(0), list(range(1, MAX_ALSO + 2)), f"at most {MAX_ALSO}"),
        (cfg(0), [1 << 20], "at most"),
        (cfg(0), ["1"], "also"),
    ],
)
async def test_bad_also_is_refused_by_the_client_and_by_the_controller(
    config: dict[str, Any], also: list[Any], match: str
) -> None:
    with pytest.raises(tq.InvalidRequestError, match=match):
        validate(GetMeta("p", ["x"], 4, "t", config, also=also))
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        with pytest.raises(tq.InvalidRequestError, match=match):
            await client.get_batches(["x"], 4, "p", "t", config, also=also)


def test_a_peek_cannot_ask_for_more_batches() -> None:
    with pytest.raises(tq.InvalidRequestError, match="needs a fetch"):
        validate(GetMeta("p", ["x"], 4, "t", cfg(0), mode="peek", also=[1]))


# ---- AsyncStreamingDataset.next_batch(ahead=) ------------------------------------------------


async def test_next_batch_ahead_delivers_the_batches_taken_without_asking_again() -> None:
    registry = CollectorRegistry()
    labels = {"op": "GetMeta", "outcome": "ok", "service": "controller"}
    async with (
        tq.local_cluster(num_storage_units=1, metrics_registry=registry) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(rows(20), partition_id="p")
        await client.seal("p")
        ds = tq.AsyncStreamingDataset(client, ["x"], 4, 2, "p", "t", prefetch=0)
        async with ds:
            first = await ds.next_batch(ahead=2)
            assert first is not None
            assert first.batch_index == 0
            assert registry.get_sample_value("tq_requests_total", labels) == 1
            assert await consumed(client) == 12  # batches 0-2
            for index in (1, 2):
                got = await ds.next_batch(ahead=2)
                assert got is not None
                assert got.batch_index == index
                assert got.micro_batches[0][0]["x"].tolist() == [4 * index, 4 * index + 1]
            assert registry.get_sample_value("tq_requests_total", labels) == 1
            ds.reset()  # the batches taken are recorded: a replay reads the same rows
            replay = [m.global_indexes for _, m in [mb async for mb in ds]]
        assert replay == [[i, i + 1] for i in range(0, 20, 2)]


async def test_next_batch_ahead_is_for_the_default_fetch_without_prefetch() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        async with tq.AsyncStreamingDataset(client, ["x"], 4, 2, "p", "t") as ds:
            with pytest.raises(tq.InvalidRequestError, match="prefetch=0"):
                await ds.next_batch(ahead=1)
        async with tq.AsyncStreamingDataset(client, ["x"], 4, 2, "p", "t", prefetch=0) as ds:
            with pytest.raises(tq.InvalidRequestError, match="ahead"):
                await ds.next_batch(ahead=MAX_ALSO + 1)
            with pytest.raises(tq.InvalidRequestError, match="ahead"):
                await ds.next_batch(ahead=-1)
