"""AsyncStreamingDataset: order, micro-batching, replay, resume, cancellation, end of stream."""

from __future__ import annotations

import json
import pickle
from collections.abc import Sequence
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import tq_async as tq
from tq_async._datasets._async import (
    AsyncStreamingDataset,
    BatchSlice,
    MicroBatch,
    chunk_batch_fn,
    default_fetch_batch_fn,
)

# A generous bound for things that must happen (never a synchronisation device).
DEADLINE = 20


def _rows(n: int, start: int = 0) -> dict[str, Any]:
    """``n`` rows whose ``x`` equals their global row id when put into an empty partition."""
    ids = range(start, start + n)
    return {
        "x": torch.tensor(list(ids)),
        "jag": torch.nested.nested_tensor(
            [torch.full((i % 5 + 1,), float(i)) for i in ids], layout=torch.jagged
        ),
        "s": [f"row{i}" for i in ids],
    }


def _check_aligned(td: Any, meta: tq.BatchMeta) -> None:
    """Data and metadata name the same rows, and every column survived intact."""
    assert td.batch_size[0] == len(meta)
    rows = list(meta.global_indexes)
    assert td["x"].tolist() == rows
    assert [t.tolist() for t in td["jag"].unbind()] == [[float(r)] * (r % 5 + 1) for r in rows]
    assert td.get("s").tolist() == [f"row{r}" for r in rows]


async def _drain(ds: AsyncStreamingDataset) -> list[MicroBatch]:
    with anyio.fail_after(DEADLINE):
        return [mb async for mb in ds]


def _ids(batches: Sequence[MicroBatch]) -> list[tuple[int | None, list[int]]]:
    return [(meta.batch_index, list(meta.global_indexes)) for _, meta in batches]


async def test_uneven_micro_batches_stay_aligned_with_jagged_and_strings() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(_rows(10), partition_id="p")
        await client.seal("p")
        ds = AsyncStreamingDataset(client, ["x", "jag", "s"], 10, 4, "p", "train")
        async with ds:
            got = await _drain(ds)
    # TransferQueue's bug was data [4, 4, 2] against meta [4, 3, 3].
    assert [len(meta) for _, meta in got] == [4, 4, 2]
    assert [td.batch_size[0] for td, _ in got] == [4, 4, 2]
    for td, meta in got:
        _check_aligned(td, meta)
        assert meta.batch_index == 0
    assert [r for _, m in got for r in m.global_indexes] == list(range(10))


async def test_jagged_micro_batches_pad_to_their_longest_row_and_share_lengths() -> None:
    # a micro-batch of a jagged field is what a read of its rows gives: padded to its longest
    # row (not to all its values), and fields of equal lengths on one ragged dimension
    lengths = [1, 9, 2, 2, 3, 1, 1, 4]
    rows = {
        "ids": torch.nested.nested_tensor(
            [torch.arange(n) + 10 * i for i, n in enumerate(lengths)], layout=torch.jagged
        ),
        "mask": torch.nested.nested_tensor(
            [torch.ones(n, dtype=torch.int64) for n in lengths], layout=torch.jagged
        ),
    }
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(rows, partition_id="p")
        await client.seal("p")
        ds = AsyncStreamingDataset(client, ["ids", "mask"], 8, 4, "p", "train")
        async with ds:
            got = await _drain(ds)
    assert [td["ids"].to_padded_tensor(-1).shape for td, _ in got] == [(4, 9), (4, 4)]
    for (td, _), first in zip(got, (0, 4), strict=True):
        part = lengths[first : first + 4]
        summed = (td["ids"] + td["mask"]).to_padded_tensor(-1)  # one ragged dimension
        assert [int((row >= 0).sum()) for row in summed] == part
        assert [t.tolist() for t in td["ids"].unbind()] == [
            (torch.arange(n) + 10 * i).tolist() for i, n in enumerate(part, start=first)
        ]


def test_chunk_batch_fn_checks_its_inputs() -> None:
    meta = tq.BatchMeta(partition_id="p", global_indexes=[0, 1, 2], field_names=[], units=[0] * 3)
    td = TensorDict({"x": torch.arange(3)}, batch_size=[3])
    assert [len(m) for _, m in chunk_batch_fn(td, meta, micro_batch_size=8)] == [3]
    with pytest.raises(tq.InvalidRequestError, match="2 rows of data but its BatchMeta has 3"):
        chunk_batch_fn(td[:2], meta, micro_batch_size=1)
    with pytest.raises(tq.InvalidRequestError, match="positive"):
        chunk_batch_fn(td, meta, micro_batch_size=0)


async def test_batches_in_order_exactly_once_then_sealed_and_drained_ends() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        for start in (0, 7, 15):  # three puts, on alternating units
            await client.put(_rows({0: 7, 7: 8, 15: 6}[start], start), partition_id="p")
        await client.seal("p")
        ds = AsyncStreamingDataset(cluster.address, ["x", "jag", "s"], 4, 3, "p", "train")
        async with ds:
            got = await _drain(ds)
            again = await _drain(ds)  # still sealed and drained: ends at once
            assert ds.batch_index == 6
    assert again == []
    indexes = [b for b, _ in _ids(got)]
    assert indexes == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5]
    assert sorted(r for _, rows in _ids(got) for r in rows) == list(range(21))
    assert [len(m) for _, m in got] == [3, 1] * 5 + [1]
    for td, meta in got:
        _check_aligned(td, meta)


async def test_next_batch_without_waiting_answers_now_or_raises_and_moves_nothing() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(_rows(4), partition_id="p")
        ds = AsyncStreamingDataset(client, ["x"], 4, 2, "p", "train", prefetch=0)
        async with ds:
            with anyio.fail_after(DEADLINE):
                first = await ds.next_batch(wait=False)
                assert first is not None
                assert [td["x"].tolist() for td, _ in first.micro_batches] == [[0, 1], [2, 3]]
                with pytest.raises(tq.TQTimeoutError, match="nothing was consumed"):
                    await ds.next_batch(wait=False)  # batch 1 has no rows yet
                assert ds.batch_index == 1
                await client.put(_rows(2, 4), partition_id="p")
                await client.seal("p")
                last = await ds.next_batch(wait=False)
                assert last is not None
                assert [td["x"].tolist() for td, _ in last.micro_batches] == [[4, 5]]
                assert await ds.next_batch(wait=False) is None  # sealed and drained

        async def custom(**kwargs: Any) -> Any:  # may not honour timeout=0
            return await default_fetch_batch_fn(**kwargs)

        for kwargs in ({"prefetch": 1}, {"prefetch": 0, "fetch_batch_fn": custom}):
            other = AsyncStreamingDataset(client, ["x"], 4, 2, "p", "t2", **kwargs)
            async with other:
                with pytest.raises(tq.InvalidRequestError, match="wait=False"):
                    await other.next_batch(wait=False)


async def test_empty_but_unsealed_stream_waits_then_delivers() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        ds = AsyncStreamingDataset(client, ["x"], 4, 4, "p", "train", prefetch=1)
        async with ds:
            # No partition at all, then an empty queue: the stream neither ends nor yields.
            with anyio.move_on_after(0.2) as waited:
                await anext(ds)
            assert waited.cancelled_caught
            assert ds.batch_index == 0  # the cancelled __anext__ moved nothing
            await client.put(_rows(4), partition_id="p")
            with anyio.fail_after(DEADLINE):
                td, _ = await anext(ds)
            assert td["x"].tolist() == [0, 1, 2, 3]
            # 3 rows are fewer than a batch: not delivered until the partition is final
            await client.put(_rows(3, 4), partition_id="p")
            with anyio.move_on_after(0.2) as waited:
                await anext(ds)
            assert waited.cancelled_caught
            await client.seal("p")
            with anyio.fail_after(DEADLINE):
                td, _ = await anext(ds)
                assert td["x"].tolist() == [4, 5, 6]
                with pytest.raises(StopAsyncIteration):
                    await anext(ds)


async def test_ranks_of_one_dp_group_see_identical_batches() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(_rows(24), partition_id="p")
        await client.seal("p")
        seen: dict[tuple[int, int], list[tuple[int | None, list[int]]]] = {}

        async def consume(dp_rank: int, replica: int) -> None:
            ds = AsyncStreamingDataset(cluster.address, ["x"], 4, 2, "p", "actor", dp_rank=dp_rank)
            async with ds:
                seen[(dp_rank, replica)] = _ids(await _drain(ds))

        async with anyio.create_task_group() as tg:
            for dp_rank in (0, 1):
                for replica in (0, 1):
                    tg.start_soon(consume, dp_rank, replica)
    assert seen[(0, 0)] == seen[(0, 1)]
    assert seen[(1, 0)] == seen[(1, 1)]
    rank0 = {r for _, rows in seen[(0, 0)] for r in rows}
    rank1 = {r for _, rows in seen[(1, 0)] for r in rows}
    assert not rank0 & rank1
    assert rank0 | rank1 == set(range(24))


async def test_replay_after_reset_rereads_beyond_the_window_with_bounded_memory() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(_rows(24), partition_id="p")
        await client.seal("p")
        fetched: list[int] = []

        async def counting_fetch(**kwargs: Any) -> Any:
            got = await default_fetch_batch_fn(**kwargs)
            if not got[1].end_of_stream:
                fetched.append(kwargs["batch_index"])
            return got

        ds = AsyncStreamingDataset(
            client,
            ["x", "jag", "s"],
            2,
            1,
            "p",
            "train",
            replay_window=3,
            fetch_batch_fn=counting_fetch,
        )
        async with ds:
            first: list[tuple[int | None, list[int]]] = []
            async for _, meta in ds:
                assert ds.cached_batches <= 3
                first.append((meta.batch_index, list(meta.global_indexes)))
            assert fetched == list(range(12))
            assert ds.cached_batch_indexes == [9, 10, 11]
            for _epoch in range(2):
                ds.reset()
                fetched.clear()
                replay: list[tuple[int | None, list[int]]] = []
                async for td, meta in ds:
                    assert ds.cached_batches <= 3
                    _check_aligned(td, meta)
                    replay.append((meta.batch_index, list(meta.global_indexes)))
                assert replay == first
                # the window served 9..11; everything older was re-read by batch_index
                assert fetched == list(range(9))
                assert ds.cached_batch_indexes == [9, 10, 11]
        # a replay consumed nothing new
        assert (await client.partition_info("p"))["consumed"]["train"] == 24


async def test_prefetch_stays_within_bounds() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(_rows(10), partition_id="p")
        await client.seal("p")
        prefetch = 2
        started = {i: anyio.Event() for i in range(13)}
        ahead: list[int] = []
        last_taken = -1  # the batch the consumer holds

        async def watched_fetch(**kwargs: Any) -> Any:
            index = kwargs["batch_index"]
            ahead.append(index - last_taken)
            started[index].set()
            return await default_fetch_batch_fn(**kwargs)

        ds = AsyncStreamingDataset(
            client, ["x"], 1, 1, "p", "train", prefetch=prefetch, fetch_batch_fn=watched_fetch
        )
        async with ds:
            with anyio.fail_after(DEADLINE):
                for i in range(10):
                    _, meta = await anext(ds)
                    assert meta.batch_index == i
                    last_taken = i
                    # wait until the prefetcher has reached its limit for this position
                    # (index 10 is the end-of-stream fetch, the last one) ...
                    await started[min(i + prefetch, 10)].wait()
                    # ... and it cannot go further while we hold on to batch i
                    assert not started[i + prefetch + 1].is_set()
        assert max(ahead) == prefetch


async def test_step_moves_to_the_next_partition_and_drops_the_window() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        for pid in ("train@0", "train@1"):
            await client.put(_rows(6), partition_id=pid)
            await client.seal(pid)
        ds = AsyncStreamingDataset(client, ["x"], 3, 3, "train@0", "train", replay_window=8)
        async with ds:
            assert _ids(await _drain(ds)) == [(0, [0, 1, 2]), (1, [3, 4, 5])]
            assert ds.cached_batches == 2
            ds.step("train@1")
            assert (ds.partition_id, ds.batch_index, ds.cached_batches) == ("train@1", 0, 0)
            got = await _drain(ds)
        assert _ids(got) == [(0, [0, 1, 2]), (1, [3, 4, 5])]
        assert {m.partition_id for _, m in got} == {"train@1"}


async def test_reset_during_iteration_continues_from_the_start() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(_rows(6), partition_id="p")
        await client.seal("p")
        ds = AsyncStreamingDataset(client, ["x"], 2, 2, "p", "train")
        async with ds:
            seen: list[int | None] = []
            with anyio.fail_after(DEADLINE):
                async for _, meta in ds:
                    seen.append(meta.batch_index)
                    if len(seen) == 2:
                        ds.reset()
        assert seen == [0, 1, 0, 1, 2]


async def test_state_dict_resumes_mid_batch_exactly_once() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(_rows(16), partition_id="p")
        await client.seal("p")
        args = (["x", "jag", "s"], 4, 2, "p", "train")
        first = AsyncStreamingDataset(cluster.address, *args)
        async with first:
            with anyio.fail_after(DEADLINE):
                taken = [await anext(first) for _ in range(3)]  # batch 0, half of batch 1
            state = first.state_dict()
        assert (state["batch_index"], state["micro_batch_index"]) == (1, 1)
        # the state travels as msgpack
        state = msgspec.msgpack.decode(msgspec.msgpack.encode(state))
        second = AsyncStreamingDataset(cluster.address, *args)
        second.load_state_dict(state)
        async with second:
            rest = await _drain(second)
    assert _ids(rest)[0] == (1, [6, 7])
    everything = [r for _, rows in _ids(taken + rest) for r in rows]
    assert everything == list(range(16))
    for td, meta in rest:
        _check_aligned(td, meta)


async def test_resuming_mid_batch_with_another_micro_batch_size_is_refused() -> None:
    """A state saved after 3 micro-batches of 2 rows, resumed with micro-batches of 4: the
    position's micro-batch 3 is past the batch's 2, so the rest of the batch (rows 6 and 7)
    was skipped without a word (with 1 of 4 it would have skipped rows 2 and 3). Mid-batch,
    the micro-batch size must be the one the state was saved with; at a batch boundary any."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(_rows(16), partition_id="p")
        await client.seal("p")
        first = AsyncStreamingDataset(client, ["x"], 8, 2, "p", "train")
        async with first:
            with anyio.fail_after(DEADLINE):
                taken = [await anext(first) for _ in range(3)]
            state = first.state_dict()
        assert (state["batch_index"], state["micro_batch_index"]) == (0, 3)
        second = AsyncStreamingDataset(client, ["x"], 8, 4, "p", "train")
        with pytest.raises(tq.InvalidRequestError, match="micro_batch_size"):
            second.load_state_dict(state)
        second.load_state_dict({**state, "batch_index": 1, "micro_batch_index": 0})
        first.load_state_dict(state)  # the same size resumes
        async with first:
            rest = await _drain(first)
    everything = [r for _, rows in _ids(taken + rest) for r in rows]
    assert everything == list(range(16))


async def test_leaving_mid_stream_keeps_prefetched_batches_readable() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(_rows(12), partition_id="p")
        await client.seal("p")
        prefetched = anyio.Event()
        rows_of: dict[int, list[int]] = {}

        async def noting_fetch(**kwargs: Any) -> Any:
            td, meta = await default_fetch_batch_fn(**kwargs)
            rows_of[kwargs["batch_index"]] = list(meta.global_indexes)
            if kwargs["batch_index"] == 1:
                prefetched.set()
            return td, meta

        ds = AsyncStreamingDataset(
            cluster.address, ["x"], 3, 3, "p", "train", prefetch=2, fetch_batch_fn=noting_fetch
        )
        async with ds:
            with anyio.fail_after(DEADLINE):
                _, meta = await anext(ds)
                await prefetched.wait()  # batch 1 is fetched (consumed) but not delivered
        assert (meta.batch_index, ds.batch_index) == (0, 1)
        consumed = (await client.consumption_status("p", "train")).tolist()
        assert all(consumed[r] for r in rows_of[1])
        # the undelivered batch is still there under its batch_index
        again = await client.get_meta(
            ["x"], 3, "p", "train", {"dp_rank": 0, "batch_index": 1}, timeout=5
        )
        assert list(again.global_indexes) == rows_of[1]
        # and the dataset picks up exactly where delivery stopped
        async with ds:
            rest = await _drain(ds)
        assert _ids(rest)[0] == (1, rows_of[1])
        assert sorted([*meta.global_indexes, *(r for _, rs in _ids(rest) for r in rs)]) == list(
            range(12)
        )


async def test_auto_clear_keeps_the_batches_read_ahead_until_they_are_delivered() -> None:
    # auto-clear frees a row once the task acknowledged it; the prefetcher's reads must not
    # acknowledge batches the caller never received (before: they were freed on arrival and a
    # resume from the position got RowsNotFound for rows nobody had seen)
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.register_tasks(["train"])
        await client.put(_rows(12), partition_id="p")
        await client.seal("p")
        args = (["x", "jag", "s"], 3, 3, "p", "train")
        first = AsyncStreamingDataset(cluster.address, *args, prefetch=2)
        async with first:
            with anyio.fail_after(DEADLINE):
                taken = [await anext(first)]
                # the prefetcher reads batches 1 and 2 ahead (each round trip waits for the
                # controller)
                while (await client.partition_info("p"))["ready"]["train"] > 3:
                    pass
        state = first.state_dict()
        assert (state["batch_index"], state["micro_batch_index"]) == (1, 0)
        # only the delivered batch was freed
        assert (await client.partition_info("p"))["rows"] == 9
        second = AsyncStreamingDataset(cluster.address, *args, prefetch=2)
        second.load_state_dict(state)
        async with second:
            rest = await _drain(second)
        assert [r for _, rows in _ids(taken + rest) for r in rows] == list(range(12))
        for td, meta in rest:
            _check_aligned(td, meta)
        # every row was delivered, then freed
        assert (await client.partition_info("p"))["rows"] == 0


async def test_a_fetch_marked_default_like_keeps_the_batches_read_ahead_too() -> None:
    """A ``fetch_batch_fn`` that wraps `default_fetch_batch_fn` (here: scales ``x``) and is
    marked ``default_like = True`` (documented on `default_fetch_batch_fn`) gets the
    default's arguments: an auto-clear task's batches read ahead keep their rows until they
    are delivered, as with the default fetch."""
    seen: list[dict[str, Any]] = []

    async def scaled(**kwargs: Any) -> Any:
        seen.append(kwargs)
        td, meta = await tq.default_fetch_batch_fn(**kwargs)
        if td is not None:
            td["x"] = td["x"] * 10
        return td, meta

    scaled.default_like = True  # type: ignore[attr-defined]
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.register_tasks(["train"])
        await client.put(_rows(12), partition_id="p")
        await client.seal("p")
        args = (["x", "s"], 3, 3, "p", "train")
        first = AsyncStreamingDataset(cluster.address, *args, prefetch=2, fetch_batch_fn=scaled)
        async with first:
            with anyio.fail_after(DEADLINE):
                taken = [await anext(first)]
                while (await client.partition_info("p"))["ready"]["train"] > 3:
                    pass
        assert all("keep_hold" in kwargs for kwargs in seen)
        assert (await client.partition_info("p"))["rows"] == 9  # only the delivered batch
        second = AsyncStreamingDataset(cluster.address, *args, prefetch=2, fetch_batch_fn=scaled)
        second.load_state_dict(first.state_dict())
        async with second:
            rest = await _drain(second)
        got = [x for td, _ in taken + rest for x in td["x"].tolist()]
        assert got == [10 * i for i in range(12)]
        assert (await client.partition_info("p"))["rows"] == 0


async def test_cancelled_fetch_on_demand_loses_nothing() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        ds = AsyncStreamingDataset(client, ["x"], 2, 2, "p", "train", prefetch=0)
        async with ds:
            with anyio.move_on_after(0.05):  # cancelled while get_meta waits
                await anext(ds)
            await client.put(_rows(4), partition_id="p")
            await client.seal("p")
            got = await _drain(ds)
        assert _ids(got) == [(0, [0, 1]), (1, [2, 3])]


async def test_stop_when_consumed_ends_without_a_seal() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        kwargs: dict[str, Any] = {"stop_when_consumed": True}
        ds = AsyncStreamingDataset(client, ["x"], 4, 4, "p", "train", **kwargs)
        async with ds:
            # nothing produced yet is not "everything consumed"
            with anyio.move_on_after(0.3) as waited:
                await anext(ds)
            assert waited.cancelled_caught
            await client.put(_rows(8), partition_id="p")
            assert _ids(await _drain(ds)) == [(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7])]
            # replay still works after a stop, and stops again at the same place
            ds.reset()
            assert [b for b, _ in _ids(await _drain(ds))] == [0, 1]
            # new rows: the stream continues where it stopped
            await client.put(_rows(4, 8), partition_id="p")
            assert _ids(await _drain(ds)) == [(2, [8, 9, 10, 11])]


async def test_stop_when_consumed_notices_rows_taken_by_another_consumer() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(_rows(16), partition_id="p")
        seen: dict[int, list[int]] = {}

        async def consume(dp_rank: int) -> None:
            ds = AsyncStreamingDataset(
                client,
                ["x"],
                4,
                4,
                "p",
                "train",
                dp_rank=dp_rank,
                stop_when_consumed=True,
            )
            async with ds:
                seen[dp_rank] = [r for _, rows in _ids(await _drain(ds)) for r in rows]

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, 0)
            tg.start_soon(consume, 1)
    assert sorted(seen[0] + seen[1]) == list(range(16))


async def test_errors_are_tq_errors_that_say_what_to_do() -> None:
    with pytest.raises(tq.InvalidRequestError, match=r"data_fields=\['x'\]"):
        AsyncStreamingDataset("tcp://127.0.0.1:1", "x", 4, 2, "p", "t")
    with pytest.raises(tq.InvalidRequestError, match="batch_size"):
        AsyncStreamingDataset("tcp://127.0.0.1:1", ["x"], 0, 2, "p", "t")
    with pytest.raises(tq.InvalidRequestError, match="batch_index"):
        AsyncStreamingDataset(
            "tcp://127.0.0.1:1", ["x"], 4, 2, "p", "t", sampling_config={"batch_index": 3}
        )
    ds = AsyncStreamingDataset("tcp://127.0.0.1:1", ["x"], 4, 2, "p", "t")
    with pytest.raises(tq.ClosedError, match="async with"):
        await anext(ds)
    with pytest.raises(tq.InvalidRequestError, match="same task_name"):
        ds.load_state_dict({**ds.state_dict(), "task_name": "other"})
    with pytest.raises(tq.InvalidRequestError, match="version"):
        ds.load_state_dict({})
    # every error pickles and rebuilds from its message (DataLoader workers re-raise that way)
    err = tq.InvalidRequestError("x")
    assert type(pickle.loads(pickle.dumps(err))) is tq.InvalidRequestError


async def test_fetch_errors_surface_in_order_and_iteration_can_retry() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(_rows(4), partition_id="p")
        await client.seal("p")
        failures = [1]

        async def flaky_fetch(**kwargs: Any) -> Any:
            if kwargs["batch_index"] == 1 and failures:
                failures.pop()
                raise tq.BrokenError("storage unit went away")
            return await default_fetch_batch_fn(**kwargs)

        async def empty_fetch(**kwargs: Any) -> Any:
            meta = tq.BatchMeta(partition_id="p", global_indexes=[], field_names=[], units=[])
            return None, meta

        ds = AsyncStreamingDataset(client, ["x"], 2, 2, "p", "train", fetch_batch_fn=flaky_fetch)
        async with ds:
            with anyio.fail_after(DEADLINE):
                assert (await anext(ds))[1].batch_index == 0
                with pytest.raises(tq.BrokenError, match="went away"):
                    await anext(ds)
                assert ds.batch_index == 1
                assert [b for b, _ in _ids(await _drain(ds))] == [1]
        bad = AsyncStreamingDataset(client, ["x"], 2, 2, "p", "other", fetch_batch_fn=empty_fetch)
        async with bad:
            with pytest.raises(tq.TQError, match="without end_of_stream"):
                await anext(bad)


async def test_custom_process_batch_fn_and_body_errors_pass_through() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(_rows(4), partition_id="p")
        await client.seal("p")

        def one_per_row(td: Any, meta: tq.BatchMeta, micro_batch_size: int) -> list[MicroBatch]:
            assert micro_batch_size == 2
            return [(td[i : i + 1], meta.select_rows([i])) for i in range(len(meta))][::-1]

        ds = AsyncStreamingDataset(client, ["x"], 4, 2, "p", "train", process_batch_fn=one_per_row)
        got: list[MicroBatch] = []

        async def read_then_fail() -> None:
            async with ds:
                got.extend(await _drain(ds))
                raise ValueError("from the body")

        # the body's own error comes out as itself, not wrapped in an ExceptionGroup
        with pytest.raises(ValueError, match="from the body"):
            await read_then_fail()
        assert [m.global_indexes for _, m in got] == [[3], [2], [1], [0]]
        assert [td["x"].tolist() for td, _ in got] == [[3], [2], [1], [0]]


# ---- dp_size, tail and empty batches -------------------------------------------------------


def _scripted_fetch(sizes: Sequence[int], seen: list[dict[str, Any]]) -> Any:
    """A fetch_batch_fn that needs no controller: batch ``b`` has ``sizes[b]`` rows (0: an
    empty share, not the end), then the stream ends. Rows are numbered on from batch to batch.
    """
    starts = [sum(sizes[:b]) for b in range(len(sizes))]

    async def fetch(*, batch_index: int, sampling_config: dict[str, Any], **_: Any) -> Any:
        seen.append(dict(sampling_config))
        if batch_index >= len(sizes):
            eos = tq.BatchMeta(
                partition_id="p", global_indexes=[], field_names=[], units=[], end_of_stream=True
            )
            return None, eos
        rows = list(range(starts[batch_index], starts[batch_index] + sizes[batch_index]))
        meta = tq.BatchMeta(
            partition_id="p",
            global_indexes=rows,
            field_names=["x"],
            units=[0] * len(rows),
            batch_index=batch_index,
        )
        return TensorDict({"x": torch.tensor(rows, dtype=torch.int64)}, [len(rows)]), meta

    return fetch


def test_dp_size_and_tail_are_validated() -> None:
    def build(**kwargs: Any) -> AsyncStreamingDataset:
        return AsyncStreamingDataset("tcp://127.0.0.1:1", ["x"], 4, 2, "p", "t", **kwargs)

    with pytest.raises(tq.InvalidRequestError, match=r"dp_rank 2 is out of range for dp_size=2"):
        build(dp_rank=2, dp_size=2)
    with pytest.raises(tq.InvalidRequestError, match="dp_size must be a positive integer"):
        build(dp_size=0)
    with pytest.raises(tq.InvalidRequestError, match="dp_size must be a positive integer"):
        build(dp_size=True)
    with pytest.raises(tq.InvalidRequestError, match="tail must be one of 'uneven', 'drop'"):
        build(dp_size=2, tail="pad")
    with pytest.raises(tq.InvalidRequestError, match="tail='drop' needs dp_size"):
        build(tail="drop")
    with pytest.raises(tq.InvalidRequestError, match="sampling_config sets dp_size=4"):
        build(dp_size=2, sampling_config={"dp_size": 4})
    with pytest.raises(tq.InvalidRequestError, match="sampling_config sets tail='drop'"):
        build(dp_size=2, sampling_config={"tail": "drop"})
    with pytest.raises(tq.InvalidRequestError, match="sampling_config sets dp_size=2"):
        build(sampling_config={"dp_size": 2})
    ds = build(dp_rank=1, dp_size=2, tail="drop", sampling_config={"dp_size": 2})
    assert (ds.dp_size, ds.tail) == (2, "drop")
    assert ds.state_dict()["dp_size"] == 2
    with pytest.raises(tq.InvalidRequestError, match="same dp_size"):
        ds.load_state_dict({**ds.state_dict(), "dp_size": 4})
    # a state saved before dp_size existed resumes
    ds.load_state_dict({k: v for k, v in ds.state_dict().items() if k != "dp_size"})
    assert build().dp_size is None


async def test_dp_size_and_tail_travel_in_sampling_config() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        seen: list[dict[str, Any]] = []
        fetch = _scripted_fetch([2], seen)
        ds = AsyncStreamingDataset(
            client,
            ["x"],
            2,
            2,
            "p",
            "t",
            dp_rank=1,
            dp_size=2,
            tail="drop",
            sampling_config={"k": 1},
            fetch_batch_fn=fetch,
        )
        async with ds:
            await _drain(ds)
        assert seen[0] == {"k": 1, "dp_rank": 1, "batch_index": 0, "dp_size": 2, "tail": "drop"}
        seen.clear()
        plain = AsyncStreamingDataset(client, ["x"], 2, 2, "p", "t", fetch_batch_fn=fetch)
        async with plain:
            await _drain(plain)
        assert seen[0] == {"dp_rank": 0, "batch_index": 0}
        seen.clear()
        # no tail: none is sent, so a sampler built with its own tail policy keeps it
        default_tail = AsyncStreamingDataset(
            client, ["x"], 2, 2, "p", "t", dp_size=2, fetch_batch_fn=fetch
        )
        async with default_tail:
            await _drain(default_tail)
        assert seen[0] == {"dp_rank": 0, "batch_index": 0, "dp_size": 2}
        assert default_tail.tail is None


async def test_an_empty_batch_is_one_micro_batch_of_zero_rows() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        calls: list[int] = []

        def counting_chunks(td: Any, meta: tq.BatchMeta, micro_batch_size: int) -> Any:
            calls.append(len(meta))
            return chunk_batch_fn(td, meta, micro_batch_size)

        for prefetch in (0, 2):
            seen: list[dict[str, Any]] = []
            ds = AsyncStreamingDataset(
                client,
                ["x"],
                4,
                2,
                "p",
                "t",
                dp_rank=1,
                dp_size=2,
                prefetch=prefetch,
                replay_window=2,
                fetch_batch_fn=_scripted_fetch([4, 0, 3], seen),
                process_batch_fn=counting_chunks,
            )
            async with ds:
                got = await _drain(ds)
                # an empty batch is a step: one micro-batch of 0 rows, process_batch_fn skipped
                assert _ids(got) == [(0, [0, 1]), (0, [2, 3]), (1, []), (2, [4, 5]), (2, [6])]
                assert [td.batch_size[0] for td, _ in got] == [2, 2, 0, 2, 1]
                assert not got[2][1].end_of_stream
                assert calls == [4, 3]
                assert ds.state_dict()["batch_index"] == 3
                # replay (the window holds the empty batch) and resume on it
                ds.reset()
                assert _ids(await _drain(ds)) == _ids(got)
                ds.load_state_dict({**ds.state_dict(), "batch_index": 1, "micro_batch_index": 0})
                assert _ids(await _drain(ds)) == _ids(got)[2:]
                ds.load_state_dict({**ds.state_dict(), "batch_index": 1, "micro_batch_index": 1})
                assert _ids(await _drain(ds)) == _ids(got)[3:]
            calls.clear()


async def test_an_empty_batch_not_recorded_under_its_index_is_still_an_error() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):

        async def unrecorded(**kwargs: Any) -> Any:
            meta = tq.BatchMeta(partition_id="p", global_indexes=[], field_names=[], units=[])
            return TensorDict({}, [0]), meta

        ds = AsyncStreamingDataset(client, ["x"], 4, 2, "p", "t", fetch_batch_fn=unrecorded)
        async with ds:
            with pytest.raises(tq.TQError, match="without end_of_stream"):
                await anext(ds)
        # a share recorded under the batch asked for (a sampler built for several ranks makes
        # batches global without dp_size) is delivered
        ds = AsyncStreamingDataset(
            client, ["x"], 4, 2, "p", "t", fetch_batch_fn=_scripted_fetch([0], [])
        )
        async with ds:
            assert _ids(await _drain(ds)) == [(0, [])]

        async def mismatched(**kwargs: Any) -> Any:
            meta = tq.BatchMeta(partition_id="p", global_indexes=[], field_names=[], units=[])
            return TensorDict({"x": torch.arange(2)}, [2]), meta

        ds = AsyncStreamingDataset(
            client, ["x"], 4, 2, "p", "t", dp_size=2, fetch_batch_fn=mismatched
        )
        async with ds:
            with pytest.raises(tq.InvalidRequestError, match="2 rows of data for a BatchMeta of 0"):
                await anext(ds)


async def test_default_fetch_passes_an_empty_share_through() -> None:
    empty = tq.BatchMeta(partition_id="p", global_indexes=[], field_names=["x"], units=[])

    class StubClient:
        async def get(self, *args: Any, **kwargs: Any) -> Any:
            return TensorDict({}, batch_size=[0]), empty

    td, meta = await default_fetch_batch_fn(
        client=StubClient(),  # type: ignore[arg-type]
        data_fields=["x"],
        batch_size=4,
        partition_id="p",
        task_name="t",
        sampling_config={"dp_rank": 0, "batch_index": 0, "dp_size": 2},
        batch_index=0,
    )
    assert meta is empty
    assert td is not None
    assert td.batch_size == torch.Size([0])


def test_chunk_batch_fn_gives_one_micro_batch_for_zero_rows() -> None:
    meta = tq.BatchMeta(partition_id="p", global_indexes=[], field_names=["x"], units=[])
    td = TensorDict({}, batch_size=[0])
    for size in (1, 4):
        ((piece, piece_meta),) = chunk_batch_fn(td, meta, micro_batch_size=size)
        assert piece.batch_size == torch.Size([0])
        assert len(piece_meta) == 0


async def test_get_of_zero_rows_asks_no_storage_unit() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        # a partition no unit has ever heard of: any request to a unit would fail
        nowhere = tq.BatchMeta(
            partition_id="nowhere", global_indexes=[], field_names=["x"], units=[]
        )
        td = await client.get_data(nowhere)
        assert td.batch_size == torch.Size([0])
        assert not list(td.keys())
        await client.put(_rows(2), partition_id="p")
        await client.seal("p")
        await client.get(["x"], 2, "p", "t")
        with anyio.fail_after(DEADLINE):
            td, meta = await client.get(["x"], 2, "p", "t")
        assert meta.end_of_stream
        assert td.batch_size == torch.Size([0])


async def test_the_adapter_interface_hands_out_whole_batches_per_worker() -> None:
    """next_batch / set_worker / entered: what the torch adapter drives, and BatchSlice."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(_rows(12), partition_id="p")
        await client.seal("p")
        ds = AsyncStreamingDataset(cluster.address, ["x", "jag", "s"], 4, 3, "p", "train")
        assert not ds.entered
        async with ds:
            assert ds.entered
            ds.set_worker(1, 2)  # worker 1 of 2 reads batches 1, 3, ...
            with anyio.fail_after(DEADLINE):
                first = await ds.next_batch()
                assert first is not None
                assert (first.batch_index, first.first_micro) == (1, 0)
                assert [len(m) for _, m in first.micro_batches] == [3, 1]
                assert await ds.next_batch() is None  # batch 3 does not exist: sealed
        assert not ds.entered
    assert isinstance(first, BatchSlice)
    copy = pickle.loads(pickle.dumps(first))  # DataLoader workers send it to the loader
    assert copy.batch_index == 1
    assert [m.global_indexes for _, m in copy.micro_batches] == [
        m.global_indexes for _, m in first.micro_batches
    ]
    for td, meta in first.micro_batches:
        _check_aligned(td, meta)


# ---- BatchSlice from a DataLoader worker to the loader: small batches travel as bytes -------


def _meta(n: int) -> tq.BatchMeta:
    return tq.BatchMeta(
        partition_id="p", global_indexes=list(range(n)), field_names=["a"], units=[0] * n
    )


def _through_a_worker_queue(item: BatchSlice) -> tuple[BatchSlice, list[int]]:
    """``item`` pickled as a DataLoader worker's queue does (ForkingPickler, with torch's
    reductions), and the sizes of the storages torch moved to shared memory for it."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions as reductions

    moved: list[int] = []

    class Spy(ForkingPickler):
        pass

    def reduce_storage(storage: Any) -> Any:
        moved.append(storage.nbytes())
        return reductions.reduce_storage(storage)

    Spy.register(torch.UntypedStorage, reduce_storage)
    buf = io.BytesIO()
    Spy(buf, pickle.HIGHEST_PROTOCOL).dump(item)
    return pickle.loads(buf.getbuffer()), moved


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    assert a.batch_size == b.batch_size
    keys = sorted(a.keys())
    assert keys == sorted(b.keys())
    for key in keys:
        x, y = a[key], b[key]
        assert type(x) is type(y)
        if isinstance(x, TensorDict):
            _same(x, y)
            continue
        assert x.dtype == y.dtype
        if x.is_nested:
            assert all(torch.equal(u, v) for u, v in zip(x.unbind(), y.unbind(), strict=True))
        else:
            assert x.shape == y.shape
            assert torch.equal(x, y)


def test_a_small_plain_batch_slice_travels_as_bytes_not_shared_memory() -> None:
    n = 4
    td = TensorDict(
        {
            "i64": torch.arange(n * 3).view(n, 3),
            "f32": torch.rand(n, 2, 2),
            "bf16": torch.rand(n, 5).to(torch.bfloat16),
            "flag": torch.tensor([True, False, True, True]),
            "u8": torch.arange(n, dtype=torch.uint8),
            "empty": torch.zeros(n, 0),
            "strided": torch.arange(n * 4).view(4, n).t(),  # not contiguous
        },
        batch_size=[n],
    )
    item = BatchSlice(7, 1, [(td, _meta(n)), (td[:2], _meta(2))])
    got, moved = _through_a_worker_queue(item)
    assert moved == []  # no tensor went through shared memory and fd passing
    assert (got.batch_index, got.first_micro) == (7, 1)
    for (a, ma), (b, mb) in zip(item.micro_batches, got.micro_batches, strict=True):
        _same(a, b)
        assert ma == mb
    out = got.micro_batches[0][0]["i64"]
    out += 1  # the loader's tensors are its own (writable, not the pickle's bytes)
    assert torch.equal(td["i64"] + 1, out)


_OTHER_BATCHES = {
    "jagged with holes": lambda: TensorDict(
        {
            "j": torch.nested.nested_tensor_from_jagged(
                torch.arange(6.0), torch.tensor([0, 3, 6]), lengths=torch.tensor([2, 3])
            )
        },
        [2],
    ),
    "named-dims": lambda: TensorDict({"a": torch.zeros(2, 3)}, [2], names=["rows"]),
    "nested-tensordict": lambda: TensorDict({"inner": TensorDict({"a": torch.ones(2)}, [2])}, [2]),
}


def _verl_like(n: int, longest: int) -> TensorDict:
    """A read's shape: jagged fields of equal lengths on one offsets tensor, a dense one and
    strings."""
    lengths = [(i * 7) % longest + 1 for i in range(n)]
    offsets = torch.tensor([0, *np.cumsum(lengths).tolist()])
    values = torch.arange(int(offsets[-1]))
    bounds = {"min_seqlen": 1, "max_seqlen": longest}  # as a read gives them
    ids = torch.nested.nested_tensor_from_jagged(values, offsets, **bounds)
    flags = torch.ones_like(values, dtype=torch.bool)
    mask = torch.nested.nested_tensor_from_jagged(flags, offsets, **bounds)
    other = torch.nested.nested_tensor(
        [torch.full((i % 3 + 1, 2), float(i)) for i in range(n)], layout=torch.jagged
    )
    return TensorDict(
        {
            "ids": ids,
            "mask": mask,
            "logp": other,
            "reward": torch.rand(n),
            "uid": NonTensorStack.from_list([f"u{i}" for i in range(n)]),
        },
        batch_size=[n],
    )


def _same_jagged(a: TensorDict, b: TensorDict) -> None:
    for key in ("ids", "mask", "logp"):
        x, y = a[key], b[key]
        assert x.dtype == y.dtype
        assert [t.tolist() for t in x.unbind()] == [t.tolist() for t in y.unbind()]
        assert x.to_padded_tensor(0).shape == y.to_padded_tensor(0).shape  # bounds kept
    assert torch.equal(a["reward"], b["reward"])
    assert a.get("uid").tolist() == b.get("uid").tolist()
    (a["ids"] + a["mask"].to(torch.int64)).unbind()  # one ragged dimension: they combine


@pytest.mark.parametrize(("rows", "longest", "inline"), [(8, 5, True), (512, 600, False)])
def test_jagged_batch_slices_travel_in_one_buffer(rows: int, longest: int, inline: bool) -> None:
    tds = [_verl_like(rows, longest) for _ in range(2)]
    item = BatchSlice(3, 0, [(td, _meta(rows)) for td in tds])
    got, moved = _through_a_worker_queue(item)
    # small: bytes inside the pickle; large (> 1 MiB): one shared-memory buffer for all
    # 2 micro-batches x (3 values + 2 offsets + 1 dense) tensors, not one per tensor
    assert moved == ([] if inline else [moved[0]])
    for (a, _), (b, _) in zip(item.micro_batches, got.micro_batches, strict=True):
        _same_jagged(a, b)
        _same_jagged(b, a)
    out = got.micro_batches[0][0]["reward"]
    out += 1  # the loader's tensors are its own
    assert torch.equal(tds[0]["reward"] + 1, out)


@pytest.mark.parametrize("kind", list(_OTHER_BATCHES))
def test_other_batch_slices_take_torchs_path_unchanged(kind: str) -> None:
    # (a jagged slice took this path too until issue 25's follow-up packed it: see above)
    td = _OTHER_BATCHES[kind]()
    item = BatchSlice(0, 0, [(td, _meta(2))])
    got, moved = _through_a_worker_queue(item)
    assert moved  # torch's reductions (shared memory) carried the tensors
    (b, meta), ((a, want),) = got.micro_batches[0], item.micro_batches
    _same(a, b)
    assert meta == want
    assert b.names == a.names


async def _my_fetch(**kwargs: Any) -> Any:
    return await default_fetch_batch_fn(**kwargs)


@pytest.mark.parametrize("cls", [AsyncStreamingDataset, tq.StreamingDataset])
def test_the_constructors_arguments_are_readable_as_attributes(cls: type) -> None:
    """AsyncStreamingDataset's docstring promises it (and StreamingDataset takes the same
    arguments): ``address``, ``request_timeout`` and the two functions were private."""
    given: dict[str, Any] = {
        "address": "tcp://127.0.0.1:1",
        "data_fields": ["x", "y"],
        "batch_size": 8,
        "micro_batch_size": 2,
        "partition_id": "train@3",
        "task_name": "learner",
        "dp_rank": 1,
        "prefetch": 3,
        "replay_window": 2,
        "stop_when_consumed": True,
        "sampling_config": {"temperature": 1},
        "fetch_batch_fn": _my_fetch,
        "process_batch_fn": chunk_batch_fn,
        "request_timeout": 7.0,
        "dp_size": 2,
        "tail": "drop",
        "device": None,
    }
    ds = cls(**given)
    got = {name: getattr(ds, name, "<missing>") for name in given}
    assert {k: v for k, v in got.items() if k != "sampling_config"} == {
        k: v for k, v in given.items() if k != "sampling_config"
    }
    assert got["sampling_config"]["temperature"] == 1


@pytest.mark.parametrize("cls", [AsyncStreamingDataset, tq.StreamingDataset])
@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "60"])
def test_a_bad_request_timeout_is_refused_when_the_dataset_is_built(cls: type, bad: Any) -> None:
    """ "Raises: InvalidRequestError: an argument is invalid" holds for ``request_timeout``
    too: it was only checked by the client the dataset opens, at the first batch (in a
    DataLoader worker, far from the line that built the dataset)."""
    with pytest.raises(tq.InvalidRequestError, match="request_timeout"):
        cls("tcp://127.0.0.1:1", ["x"], 4, 2, "p", "t", request_timeout=bad)


async def test_numpy_ints_and_floats_are_taken_as_arguments() -> None:
    """A training config hands out numpy scalars (``np.int64(4)`` for a batch size, a rank
    from an array, ``np.float32`` seconds); the dataset refused them ("batch_size must be a
    positive integer, got np.int64(4)"), and ``chunk_batch_fn`` too. They are taken as
    the ints and floats they are, so ``state_dict()`` stays plain (JSON-able)."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(8)}, partition_id="p")
        await client.seal("p")
        ds = AsyncStreamingDataset(
            client,
            ["x"],
            np.int64(4),
            np.int32(2),
            "p",
            "train",
            dp_rank=np.int64(0),
            prefetch=np.int64(1),
            replay_window=np.int64(2),
            dp_size=np.int64(1),
            request_timeout=np.float32(30.0),
        )
        assert (ds.batch_size, ds.micro_batch_size, ds.dp_size) == (4, 2, 1)
        assert type(ds.request_timeout) is float
        json.dumps(ds.state_dict())
        async with ds:
            got = await _drain(ds)
        assert [list(m.global_indexes) for _, m in got] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        json.dumps(ds.state_dict())
        td, meta = got[0]
        assert len(chunk_batch_fn(td, meta, np.int64(1))) == 2
    for bad in (np.float64(4.0), np.bool_(True), "4"):
        with pytest.raises(tq.InvalidRequestError, match="batch_size"):
            AsyncStreamingDataset("tcp://127.0.0.1:1", ["x"], bad, 2, "p", "t")


def test_field_names_in_a_numpy_array_are_taken_as_a_list() -> None:
    """``data_fields=np.array(["x", "y"])`` was refused, the error advising
    ``data_fields=[array(['x', 'y'], dtype='<U1')]``; a 1-D array is its list of names, and
    other non-lists get an example of a list."""
    ds = AsyncStreamingDataset("tcp://127.0.0.1:1", np.array(["x", "y"]), 4, 2, "p", "t")
    assert ds.data_fields == ["x", "y"]
    with pytest.raises(tq.InvalidRequestError) as info:
        AsyncStreamingDataset("tcp://127.0.0.1:1", {"x"}, 4, 2, "p", "t")  # type: ignore[arg-type]
    assert "write data_fields=['input_ids', ...]" in str(info.value)
