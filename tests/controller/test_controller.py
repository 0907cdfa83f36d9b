"""The controller service over real sockets: waiting, wake-ups, exactly-once, cancellation."""

from __future__ import annotations

import random

import anyio
import pytest
import torch
from tensordict import TensorDict

import tq_async as tq
from _samplers import Later


def batch(n: int, start: int = 0) -> TensorDict:
    return TensorDict({"x": torch.arange(start, start + n)}, batch_size=[n])


async def test_waiting_get_meta_wakes_when_a_later_put_lands() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        got: list[tq.BatchMeta] = []

        async def consumer() -> None:
            got.append(await client.get_meta(["x"], 4, "p", "t"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            await wait_until_waiting(cluster, 1)
            await client.put(batch(2), partition_id="p")
            assert not got  # 2 rows are not enough for batch_size 4
            await client.put(batch(2, 2), partition_id="p")
        assert got[0].global_indexes == [0, 1, 2, 3]


async def wait_until_waiting(cluster: tq.LocalCluster, n: int) -> None:
    """Yield to the loop until ``n`` get_meta requests are parked (a condition, not a timer)."""
    with anyio.fail_after(5):
        while cluster.controller.waiting < n:
            await anyio.lowlevel.checkpoint()


async def test_idle_waiter_is_never_woken() -> None:
    """Event-driven: while nothing changes, the sampler of a parked request is not re-run."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(batch(1), partition_id="p")
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.get_meta, ["x"], 2, "p", "t")
            await wait_until_waiting(cluster, 1)
            calls = cluster.controller.sampler_calls
            # Stay idle for a while (this is the observation window, not a synchronisation):
            # a polling implementation would call the sampler again during it.
            await anyio.sleep(0.3)
            assert cluster.controller.sampler_calls == calls
            # unrelated activity (another partition, another task) does not wake it either
            await client.put(batch(3), partition_id="other")
            await client.get_meta(["x"], 1, "p", "someone-else")
            assert cluster.controller.sampler_calls == calls + 1
            await client.put(batch(1, 1), partition_id="p")
        assert cluster.controller.waiting == 0


async def test_get_meta_timeout_consumes_nothing() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(batch(1), partition_id="p")
        with pytest.raises(tq.TQTimeoutError, match="nothing was consumed"):
            await client.get_meta(["x"], 2, "p", "t", timeout=0.05)
        assert not await client.check_consumption_status("p", "t")
        meta = await client.get_meta(["x"], 1, "p", "t")
        assert meta.global_indexes == [0]


async def test_cancelled_waiting_get_meta_leaves_nothing_consumed() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        with anyio.move_on_after(0.01):
            await client.get_meta(["x"], 2, "p", "t")
        await client.put(batch(2), partition_id="p")
        # the cancelled request was dropped by the controller: the rows are still there
        meta = await client.get_meta(["x"], 2, "p", "t")
        assert meta.global_indexes == [0, 1]
        assert cluster.controller.waiting == 0


async def test_cancel_after_reply_was_sent_releases_the_rows() -> None:
    """The reply is in flight when the caller gives up: the client gives the rows back."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(batch(4), partition_id="p")
        with anyio.CancelScope() as scope:
            scope.cancel()  # cancelled before the reply can be read
            await client.get_meta(["x"], 4, "p", "t")
        # the Release rides the same socket after the abandoned reply: a later call sees it
        meta = await client.get_meta(["x"], 4, "p", "t", timeout=5)
        assert sorted(meta.global_indexes) == [0, 1, 2, 3]


async def test_a_cancelled_fetch_goes_back_though_another_task_recorded_its_rows() -> None:
    """A DP job (task "learner") records its batches; an evaluator (task "eval") fetches the
    same rows and its caller gives up after the reply was sent: the rows are ready for
    "eval" again (before: the learner's record of them kept them, and "eval" never saw them)."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(batch(4), partition_id="p")
        cfg = {"dp_rank": 0, "batch_index": 0}
        recorded = await client.get_meta(["x"], 4, "p", "learner", cfg)
        assert recorded.global_indexes == [0, 1, 2, 3]
        with anyio.CancelScope() as scope:
            scope.cancel()  # cancelled before the reply can be read
            await client.get_meta(["x"], 4, "p", "eval")
        meta = await client.get_meta(["x"], 4, "p", "eval", timeout=5)
        assert sorted(meta.global_indexes) == [0, 1, 2, 3]


async def test_two_tasks_consume_the_same_rows_independently() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(batch(6), partition_id="p")
        a = await client.get_meta(["x"], 6, "p", "a")
        b1 = await client.get_meta(["x"], 3, "p", "b")
        b2 = await client.get_meta(["x"], 3, "p", "b")
        assert a.global_indexes == [0, 1, 2, 3, 4, 5]
        assert b1.global_indexes + b2.global_indexes == a.global_indexes
        assert await client.check_consumption_status("p", "a")
        assert (await client.consumption_status("p", "b")).all()


async def test_32_producers_and_consumers_deliver_every_row_exactly_once() -> None:
    n_producers, n_consumers, puts_each, rows_per_put = 32, 32, 4, 3
    total = n_producers * puts_each * rows_per_put
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as producer_client,
        tq.AsyncClient.connect(cluster.address) as consumer_client,
    ):
        seen: dict[str, list[int]] = {"gen": [], "ref": []}

        async def produce(p: int) -> None:
            rng = random.Random(p)
            for i in range(puts_each):
                start = (p * puts_each + i) * rows_per_put
                await producer_client.put(batch(rows_per_put, start), partition_id="p")
                if rng.random() < 0.5:
                    await anyio.lowlevel.checkpoint()

        async def consume(task: str, share: int) -> None:
            got = 0
            while got < share:
                td, meta = await consumer_client.get(["x"], 2, "p", task, timeout=10)
                seen[task].extend(td["x"].tolist())
                got += len(meta)

        async with anyio.create_task_group() as tg:
            for c in range(n_consumers):
                tg.start_soon(consume, "gen" if c % 2 else "ref", total // (n_consumers // 2))
            for p in range(n_producers):
                tg.start_soon(produce, p)
        for task, values in seen.items():
            assert sorted(values) == list(range(total)), task


async def test_seal_gives_end_of_stream_after_the_short_tail() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(batch(5), partition_id="p")
        first = await client.get_meta(["x"], 4, "p", "t")
        waiting: list[tq.BatchMeta] = []

        async def wait_tail() -> None:
            waiting.append(await client.get_meta(["x"], 4, "p", "t"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_tail)
            await wait_until_waiting(cluster, 1)
            await client.seal("p")  # wakes the waiter: the last row comes as a short batch
        assert first.global_indexes == [0, 1, 2, 3]
        assert waiting[0].global_indexes == [4]
        end = await client.get_meta(["x"], 4, "p", "t")
        assert end.end_of_stream
        assert end.is_empty


async def test_batch_index_returns_identical_rows_to_every_replica() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(batch(8), partition_id="p")
        cfg0 = {"dp_rank": 0, "batch_index": 0}
        a = await client.get_meta(["x"], 4, "p", "t", cfg0)
        b = await client.get_meta(["x"], 4, "p", "t", cfg0)  # a replica, or a replay
        c = await client.get_meta(["x"], 4, "p", "t", {"dp_rank": 1, "batch_index": 0})
        assert a.global_indexes == b.global_indexes == [0, 1, 2, 3]
        assert c.global_indexes == [4, 5, 6, 7]
        await client.reset_consumption("p", "t")
        again = await client.get_meta(["x"], 8, "p", "t")
        assert again.global_indexes == list(range(8))


async def test_clear_frees_storage_and_state() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        m1 = await client.put({"x": torch.zeros(64, 1024)}, partition_id="p")
        await client.put({"x": torch.zeros(64, 1024)}, partition_id="p")
        resident = sum(u.state.resident_bytes for u in cluster.units)
        assert resident == 2 * 64 * 1024 * 4
        await client.clear_samples(m1)
        assert sum(u.state.resident_bytes for u in cluster.units) == resident // 2
        with pytest.raises(tq.RowsNotFound):
            await client.get_data(m1)
        await client.clear_partition("p")
        assert sum(u.state.resident_bytes for u in cluster.units) == 0
        assert await client.list_partitions() == []
        with pytest.raises(tq.PartitionNotFound, match="'p'"):
            await client.partition_info("p")


async def test_production_status_and_tags() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        meta = await client.put(batch(3), partition_id="p", tags=[{"uid": i} for i in range(3)])
        assert not await client.check_production_status("p", ["x", "y"])
        await client.put({"y": torch.ones(2)}, meta=meta.select_rows([0, 1]))
        status = await client.production_status("p")
        assert status["y"].tolist() == [True, True, False]
        assert await client.check_production_status("p", ["x", "y"], [0, 1])
        await client.set_tags(meta.select_rows([2]), [{"total_lengths": 7}])
        got = await client.get_meta(["x"], 3, "p", "t")
        assert got.tags == [{"uid": 0}, {"uid": 1}, {"uid": 2, "total_lengths": 7}]
        info = await client.partition_info("p")
        assert info["rows"] == 3
        assert info["consumed"] == {"t": 3}


async def test_async_sampler_is_awaited() -> None:
    class Reversed(tq.BaseSampler):
        async def sample(self, ready_indexes, batch_size, *args, **kwargs):  # type: ignore[no-untyped-def,override]
            await anyio.lowlevel.checkpoint()
            if len(ready_indexes) < batch_size:
                return [], []
            rows = list(reversed(ready_indexes[:batch_size]))
            return rows, rows

    async with (
        tq.local_cluster(num_storage_units=1, sampler=Reversed()) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        async with anyio.create_task_group() as tg:
            results: list[list[int]] = []

            async def consume() -> None:
                results.append((await client.get_meta(["x"], 3, "p", "t")).global_indexes)

            tg.start_soon(consume)
            await client.put(batch(3), partition_id="p")
        assert results == [[2, 1, 0]]


async def test_sampler_with_positional_only_contract_ports_unchanged() -> None:
    """A TransferQueue-style sampler that takes no keyword context still works."""

    class Plain:
        def sample(self, ready_indexes, batch_size):  # type: ignore[no-untyped-def]
            rows = list(ready_indexes)[-batch_size:]
            return rows, rows

        def clear_partition(self, partition_id: str) -> None: ...

        def reset_partition(self, partition_id: str, task_name: str | None) -> None: ...

    async with (
        tq.local_cluster(num_storage_units=1, sampler=Plain()) as cluster,  # type: ignore[arg-type]
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(batch(5), partition_id="p")
        assert (await client.get_meta(["x"], 2, "p", "t")).global_indexes == [3, 4]


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
async def test_both_transports_round_trip(transport: str) -> None:
    async with (
        tq.local_cluster(num_storage_units=2, transport=transport) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        assert cluster.address.startswith(f"{transport}://")
        meta = await client.put(batch(3), partition_id="p")
        assert (await client.get_data(meta))["x"].tolist() == [0, 1, 2]


async def test_bad_transport_is_rejected() -> None:
    with pytest.raises(tq.InvalidRequestError, match="transport"):
        async with tq.local_cluster(transport="udp"):
            pass


class _Greedy(tq.BaseSampler):
    """Hands out every row of the partition, ready or not (a buggy custom sampler that asks
    to be called before ``batch_size`` rows are ready)."""

    short_ready_ok = True

    def sample(self, ready_indexes, batch_size, **ctx):  # type: ignore[no-untyped-def]
        rows = [0, 1, 2]
        return rows, rows


async def test_a_sampler_returning_rows_without_the_fields_is_refused() -> None:
    async with (
        tq.local_cluster(num_storage_units=1, sampler=_Greedy()) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        meta = await client.put(batch(3), partition_id="p")
        await client.put({"y": torch.ones(2)}, meta=meta.select_rows([0, 1]))  # row 2 has no y
        with pytest.raises(tq.InvalidRequestError, match="row 2, which lacks some of"):
            await client.get_meta(["x", "y"], 3, "p", "t")
        # nothing was consumed: a correct request still sees every row
        got = await client.get_meta(["x"], 3, "p", "t")
        assert got.global_indexes == [0, 1, 2]


async def test_a_zero_timeout_answers_now_or_times_out_at_once() -> None:
    """``timeout=0``: what can be answered now, else TQTimeoutError, nothing consumed (and
    nothing left waiting on the controller)."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(batch(3), partition_id="p")
        with anyio.fail_after(5):
            with pytest.raises(tq.TQTimeoutError, match="nothing was consumed"):
                await client.get_meta(["x"], 4, "p", "t", timeout=0)
            assert cluster.controller._shell.lot.parked(("p", "t")) == 0
            await client.put(batch(1, 3), partition_id="p")
            got = await client.get_meta(["x"], 4, "p", "t", timeout=0)
        assert got.global_indexes == [0, 1, 2, 3]
        with pytest.raises(tq.InvalidRequestError, match="timeout"):
            await client.get_meta(["x"], 4, "p", "t", timeout=-1)


async def test_a_zero_timeout_waits_for_an_async_sampler_answer_only() -> None:
    async with (
        tq.local_cluster(num_storage_units=1, sampler=Later()) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(batch(2), partition_id="p")
        with anyio.fail_after(5):
            with pytest.raises(tq.TQTimeoutError):
                await client.get_meta(["x"], 4, "p", "t", timeout=0)
        assert (await client.partition_info("p"))["consumed"].get("t", 0) == 0
        await client.put(batch(2, 2), partition_id="p")
        with anyio.fail_after(5):  # the async sampler's answer is awaited
            got = await client.get_meta(["x"], 4, "p", "t", timeout=0)
        assert got.global_indexes == [0, 1, 2, 3]


async def test_record_from_with_an_async_sampler_decides_lower_batches_in_one_call() -> None:
    async with (
        tq.local_cluster(num_storage_units=1, sampler=Later()) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(batch(4), partition_id="p")
        got: list[tq.BatchMeta] = []

        async def third() -> None:
            cfg = {"batch_index": 2, "dp_rank": 0, "record_from": 0}
            got.append(await client.get_meta(["x"], 2, "p", "t", cfg))

        async with anyio.create_task_group() as tg:
            tg.start_soon(third)
            await wait_until_waiting(cluster, 1)  # batches 0 and 1 took the 4 rows
            await client.put(batch(2, 4), partition_id="p")
        assert got[0].global_indexes == [4, 5]
        for b, rows in enumerate([[0, 1], [2, 3]]):
            meta = await client.get_meta(["x"], 2, "p", "t", {"batch_index": b, "dp_rank": 0})
            assert meta.global_indexes == rows


class _Gated(tq.BaseSampler):
    """An ``async`` sampler whose calls all answer once ``calls`` of them have started: two
    concurrent requests choose the same rows, and the second answer no longer fits."""

    def __init__(self, calls: int) -> None:
        self.calls = calls
        self.started = 0
        self.gate: anyio.Event | None = None

    async def sample(self, ready_indexes, batch_size, *args, **kwargs):  # type: ignore[no-untyped-def,override]
        rows = list(ready_indexes)[:batch_size]
        if len(rows) < batch_size:
            return [], []
        if self.gate is None:
            self.gate = anyio.Event()
        self.started += 1
        if self.started >= self.calls:
            self.gate.set()
        await self.gate.wait()
        return rows, rows


async def test_async_sampler_answer_dropped_for_a_moved_state_samples_again_at_once() -> None:
    """Two consumers' ``async`` sampler calls choose the same rows; the first answer is
    applied, the second no longer fits (its rows were consumed meanwhile) and is dropped:
    the second request samples again at once and gets the other ready rows, instead of
    waiting for a put that never comes."""
    sampler = _Gated(calls=2)
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(batch(8), partition_id="p")
        await client.seal("p")
        got: list[list[int]] = []

        async def consume() -> None:
            got.append((await client.get_meta(["x"], 4, "p", "t")).global_indexes)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                tg.start_soon(consume)
        assert sorted(got) == [[0, 1, 2, 3], [4, 5, 6, 7]]


async def test_async_sampler_answering_rows_that_do_not_exist_fails_at_once() -> None:
    """An ``async`` sampler's wrong answer (a row never put), with nothing changing while it
    ran, fails the request with a clear error naming the row, as a plain sampler's does,
    instead of waiting (for ever without a timeout) for a change that would not help."""

    class Wrong(tq.BaseSampler):
        async def sample(self, ready_indexes, batch_size, *args, **kwargs):  # type: ignore[no-untyped-def,override]
            await anyio.lowlevel.checkpoint()
            return [999], [999]

    async with (
        tq.local_cluster(num_storage_units=1, sampler=Wrong()) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(batch(4), partition_id="p")
        with anyio.fail_after(10), pytest.raises(tq.TQError, match="row 999 does not exist"):
            await client.get_meta(["x"], 1, "p", "t")
        info = await client.partition_info("p")
        assert info["consumed"].get("t", 0) == 0


async def test_async_sampler_request_sees_a_seal_that_came_before_it_started_waiting() -> None:
    """A get_meta whose ``async`` sampler call was started when the request came in, and a
    seal handled right after (before the request's task took its place in the wait): the
    request looks again once the answer ("not enough yet") is in, sees the partition final
    and gets its short last batch, instead of waiting for a wake-up that already went."""

    class FinalOnly(tq.BaseSampler):
        short_ready_ok = True

        async def sample(self, ready_indexes, batch_size, *args, final=False, **kwargs):  # type: ignore[no-untyped-def,override]
            await anyio.lowlevel.checkpoint()
            rows = list(ready_indexes)[:batch_size]
            return (rows, rows) if len(rows) == batch_size or final else ([], [])

    async with (
        tq.local_cluster(num_storage_units=1, sampler=FinalOnly()) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(batch(4), partition_id="p")
        got: list[list[int]] = []

        async def consume() -> None:
            got.append((await client.get_meta(["x"], 8, "p", "t")).global_indexes)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await anyio.lowlevel.checkpoint()  # the get_meta goes out first
                await client.seal("p")
        assert got == [[0, 1, 2, 3]]
