"""Promises at the client's edge: errors of a broken unit, empty shares, samplers called
directly. (The blocking client on the services' loop: ``tests/deploy/test_cluster.py``;
cancellation: ``tests/faults/test_cancellation.py``.)"""

from __future__ import annotations

import logging
import signal
from typing import Any

import anyio
import pytest
import torch
from tensordict import TensorDict

import tq_async as tq
import tq_async._client._async._get as client_get
from _cluster_proc import serve_role
from _requests import paused_at
from tq_async._transport._dealer import DealerConnection
from tq_async._wire._protocol import PutCommit, ShmFree, StoreGet, StorePut


async def until(predicate: Any, seconds: float = 10) -> None:
    """Let the loop run until ``predicate()`` holds (bounded)."""
    with anyio.fail_after(seconds):
        while not predicate():
            await anyio.sleep(0.005)


async def test_unit_killed_after_a_same_host_read_still_returns_the_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The unit dies between its shared-memory reply and the client's unpin: the data was
    copied, so the read returns it; the failed best-effort unpin replaces nothing (it used
    to surface as a raw ``zmq.error.ZMQError``)."""
    with serve_role("--storage-units", "1") as (proc, address):
        async with tq.AsyncClient.connect(address, request_timeout=10) as client:
            x = torch.arange(64 * 4096, dtype=torch.float32).reshape(64, 4096)  # 1 MiB
            meta = await client.put(TensorDict({"x": x}, batch_size=[64]), partition_id="p")
            await client.get_data(meta)  # links to the unit: Unix socket + shared memory
            assert any(a is not None for a in client._links.arenas.values())
            copy = client_get._copy_spans
            units: list[DealerConnection] = list(client._links.units.values())

            async def copy_then_kill(arena: Any, spans: Any) -> list[Any]:
                frames = await copy(arena, spans)
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                await until(lambda: all(c.connected is False for c in units))
                return frames

            monkeypatch.setattr(client_get, "_copy_spans", copy_then_kill)
            td = await client.get_data(meta)
            assert torch.equal(td["x"], x)
            # every later call on that connection is a TQError, one-way sends included
            with pytest.raises(tq.BrokenError):
                units[0].send_oneway(ShmFree([], []))
            assert units[0].send_best_effort(ShmFree([], [])) is False
            with pytest.raises(tq.BrokenError):
                await client.get_data(meta)


async def test_unit_killed_before_a_same_host_read_copies_is_broken_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The unit dies after its shared-memory reply, before the client copied: its arena is
    unmapped with the connection, so the read fails with BrokenError (not AttributeError)."""
    with serve_role("--storage-units", "1") as (proc, address):
        async with tq.AsyncClient.connect(address, request_timeout=10) as client:
            x = torch.ones(64, 4096)
            meta = await client.put(TensorDict({"x": x}, batch_size=[64]), partition_id="p")
            await client.get_data(meta)
            copy = client_get._copy_spans
            units: list[DealerConnection] = list(client._links.units.values())

            async def kill_then_copy(arena: Any, spans: Any) -> list[Any]:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                await until(lambda: all(c.connected is False for c in units))
                return await copy(arena, spans)

            monkeypatch.setattr(client_get, "_copy_spans", kill_then_copy)
            with pytest.raises(tq.BrokenError):
                await client.get_data(meta)


async def test_a_killed_unit_fails_a_read_in_flight_with_broken_error() -> None:
    with serve_role("--storage-units", "1") as (proc, address):
        async with tq.AsyncClient.connect(address, request_timeout=10) as client:
            meta = await client.put({"x": torch.ones(4, 3)}, partition_id="p")
            await client.get_data(meta)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            with pytest.raises(tq.BrokenError):
                await client.get_data(meta)


def _dtypes(td: TensorDict) -> dict[str, Any]:
    out = {}
    for k in td.keys():  # noqa: SIM118 (a TensorDict iterates its keys only so)
        v = td[k]
        out[k] = (v.dtype, v.is_nested, tuple(v.shape[2:] if v.is_nested else v.shape[1:]))
    return out


@pytest.mark.parametrize("how", ["get_data", "get"])
async def test_an_empty_share_carries_every_field_with_zero_rows(how: str) -> None:
    sampler = tq.SeqlenBalancedSampler(n_samples_per_prompt=2, dp_size=2)
    async with (
        tq.local_cluster(num_storage_units=1, task_samplers={"t": sampler}) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        jag = torch.nested.nested_tensor(
            [torch.ones(3, 2), torch.ones(5, 2)], layout=torch.jagged, dtype=torch.bfloat16
        )
        data = TensorDict(
            {"ids": torch.arange(2), "x": torch.ones(2, 3, 4, dtype=torch.float16), "j": jag},
            batch_size=[2],
        )
        # one group of 2 rows for 2 ranks: rank 0 gets it, rank 1 an empty share
        await client.put(data, partition_id="p", tags=[{"uid": 0, "total_lengths": 5}] * 2)
        await client.seal("p")
        fields = ["ids", "x", "j"]
        shares: dict[int, TensorDict] = {}
        for rank in (0, 1):
            cfg = {"dp_rank": rank, "batch_index": 0, "dp_size": 2}
            if how == "get":
                td, meta = await client.get(fields, 2, "p", "t", cfg)
            else:
                meta = await client.get_meta(fields, 2, "p", "t", cfg)
                td = await client.get_data(meta)
            assert not meta.end_of_stream
            shares[rank] = td
        full, empty = shares[0], shares[1]
        assert full.batch_size == torch.Size([2])
        assert empty.batch_size == torch.Size([0])
        assert sorted(empty.keys()) == sorted(fields)
        assert _dtypes(empty) == _dtypes(full)
        assert empty["x"].shape == (0, 3, 4)
        assert empty["ids"].shape == (0,)
        assert empty["j"].is_nested
        assert empty["j"].size(0) == 0
        # end of stream still carries no columns
        end = await client.get_meta(fields, 2, "p", "t", {"dp_rank": 1, "batch_index": 1})
        assert end.end_of_stream
        assert list((await client.get_data(end)).keys()) == []


SAMPLERS = [
    tq.SequentialSampler(),
    tq.GRPOGroupNSampler(2),
    tq.RankAwareSampler(),
    tq.SeqlenBalancedSampler(dp_size=2),
    tq.StalenessSampler(max_staleness=1),
]


@pytest.mark.parametrize("sampler", SAMPLERS, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize(
    ("ctx", "word"),
    [
        ({"dp_rank": -1, "batch_index": 0}, "dp_rank"),
        ({"dp_rank": 0, "batch_index": -2}, "batch_index"),
        ({"dp_rank": 0.5, "batch_index": 0}, "dp_rank"),
        ({"dp_rank": 2, "batch_index": 0, "sampling_config": {"dp_size": 2}}, "dp_rank"),
    ],
)
def test_a_sampler_called_directly_refuses_a_bad_context(
    sampler: tq.BaseSampler, ctx: dict[str, Any], word: str
) -> None:
    tags = {r: {"uid": r // 2, "total_lengths": 3} for r in range(8)}
    with pytest.raises(tq.InvalidRequestError, match=word):
        sampler(list(range(8)), 2, partition_id="p", task_name="t", tags=tags, **ctx)


def test_a_sampler_called_directly_refuses_a_bad_dp_size() -> None:
    with pytest.raises(tq.InvalidRequestError, match="dp_size"):
        tq.RankAwareSampler().sample_shares(list(range(8)), 2, 0)


async def test_a_paused_same_host_unit_is_reported_as_not_answering() -> None:
    """A unit stopped with SIGSTOP still exists: a request that times out, and a connection
    that breaks, say so (it is not "stopped or vanished")."""
    with serve_role("--storage-units", "1") as (proc, address):
        async with tq.AsyncClient.connect(address, request_timeout=0.5, retry_after=None) as client:
            meta = await client.put({"x": torch.ones(4, 3)}, partition_id="p")
            await client.get_data(meta)  # links to the unit: its process is known
            (conn,) = client._links.units.values()
            assert conn.peer_pid == proc.pid
            proc.send_signal(signal.SIGSTOP)
            try:
                with pytest.raises(tq.TQTimeoutError, match=r"not answering.*paused"):
                    await client.get_data(meta)
                conn._disconnected()  # what a heartbeat timeout does
                with pytest.raises(tq.BrokenError, match=f"process {proc.pid} still exists"):
                    conn._check_usable()
            finally:
                proc.send_signal(signal.SIGCONT)


async def test_a_read_from_several_units_raises_one_tq_error_not_a_group() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        a = await client.put({"v": torch.arange(2)}, partition_id="p")
        b = await client.put({"v": torch.arange(2)}, partition_id="p")
        meta = tq.BatchMeta.concat([a, b])
        assert len(set(meta.units)) == 2
        await client.clear_samples(b)
        with pytest.raises(tq.RowsNotFound):
            await client.get_data(meta)


def test_a_client_used_on_another_event_loop_says_so() -> None:
    """An `AsyncClient` belongs to the event loop that opened it (its sockets are that
    loop's). Used on another one -- ``asyncio.run`` once to open it and once per call, as
    a notebook does -- its calls failed with ``RuntimeError: Event loop is closed`` (or,
    with the first loop still running in another thread, with a future "attached to a
    different loop"); some even worked. Each call now says what the rule is."""
    with tq.background_cluster(num_storage_units=1) as cluster:
        client = tq.AsyncClient.connect(cluster.address)

        async def first() -> tq.BatchMeta:
            await client.open()
            return await client.put(TensorDict({"x": torch.ones(2)}, [2]), partition_id="p")

        meta = anyio.run(first)
        calls = [
            lambda: client.put(TensorDict({"x": torch.ones(2)}, [2]), partition_id="p"),
            lambda: client.get_data(meta),
            lambda: client.get_meta(["x"], 1, "p", "t", timeout=0),
            lambda: client.list_partitions(),
        ]
        for call in calls:

            async def again(call: Any = call) -> None:
                await call()

            with pytest.raises(tq.InvalidRequestError, match="event loop that opened it"):
                anyio.run(again)
        anyio.run(client.aclose)  # closing is fine anywhere
        anyio.run(first)  # and a closed client opens on the loop it is opened on
        anyio.run(client.aclose)


@pytest.mark.parametrize("at", [StorePut, PutCommit], ids=["store", "commit"])
@pytest.mark.parametrize("again", [False, True], ids=["cleared", "cleared-and-re-created"])
async def test_a_put_whose_partition_is_cleared_under_it_says_to_put_again(
    at: type, again: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A put of new rows (no BatchMeta) whose partition another task cleared between its
    placement and its commit: it failed with "... since this BatchMeta was made ... fetch a
    new BatchMeta with get_meta" (it has none) or "does not exist (never put to ...)", and
    its clean-up warned "could not clear rows of a failed put". The error says the partition
    was cleared while the put wrote: put again; nothing is kept, nothing warns."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"i": torch.arange(2)}, partition_id="p")
        big = {"x": torch.zeros(2, 1 << 15)}  # (placed, stored, then committed)
        with paused_at(at) as paused, caplog.at_level(logging.WARNING, logger="tq_async"):
            async with anyio.create_task_group() as tg:
                outcome: list[BaseException] = []

                async def put() -> None:
                    try:
                        await client.put(big, partition_id="p")
                    except tq.TQError as exc:
                        outcome.append(exc)

                tg.start_soon(put)
                await paused.reached(1)
                await client.clear_partition("p")
                if again:
                    await client.put({"i": torch.arange(1)}, partition_id="p")
                paused.go()
        (error,) = outcome
        assert isinstance(error, (tq.RowsNotFound, tq.PartitionNotFound))
        message = str(error)
        assert "cleared (clear_partition) while this put wrote" in message
        assert "put again" in message
        assert "BatchMeta" not in message
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        held = {u: s["rows"] for u, s in (await client.storage_stats()).items()}
        assert held == {0: 1 if again else 0}


@pytest.mark.parametrize("again", [False, True], ids=["cleared", "cleared-and-re-created"])
async def test_a_get_whose_partition_is_cleared_while_it_reads_fails_without_a_warning(
    again: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``get`` whose partition another task cleared after its rows were fetched, before
    their cells were read: it fails with `RowsNotFound`, and its give-back of the rows (gone
    with their partition) warned "could not give back the rows of a failed get" each time,
    though nothing was left to give back. It warns nothing now."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address, inline_get_bytes=0) as client,
    ):
        await client.put({"i": torch.arange(2)}, partition_id="p")
        with paused_at(StoreGet) as paused, caplog.at_level(logging.WARNING, logger="tq_async"):
            async with anyio.create_task_group() as tg:
                outcome: list[BaseException] = []

                async def get() -> None:
                    try:
                        await client.get(["i"], 2, "p", "t")
                    except tq.TQError as exc:
                        outcome.append(exc)

                tg.start_soon(get)
                await paused.reached(1)
                await client.clear_partition("p")
                if again:
                    await client.put({"i": torch.arange(1)}, partition_id="p")
                paused.go()
        assert [type(e) for e in outcome] == [tq.RowsNotFound]
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        if again:  # the new partition's row is the task's, untouched
            assert len(await client.get_meta(["i"], 1, "p", "t", timeout=5)) == 1


@pytest.mark.parametrize("call", ["get", "get_batches", "kv_batch_get"])
@pytest.mark.parametrize("clear", ["clear_partition", "kv_clear", "re-created"])
async def test_a_read_whose_rows_are_cleared_while_it_reads_says_what_to_do(
    call: str, clear: str
) -> None:
    """A ``get`` (``get_batches``, ``kv_batch_get``: no BatchMeta in the caller's hands)
    whose rows another task cleared after the controller named them, before their cells were
    read: it said "... since this BatchMeta was made ...; fetch a new BatchMeta" (or named a
    row number the caller never saw, with no advice). It says the rows were removed while
    this call read them, and to call it again."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address, inline_get_bytes=0) as client,
    ):
        await client.kv_batch_put(["a", "b"], "p", {"i": torch.arange(2)})
        reads = {
            "get": lambda: client.get(["i"], 2, "p", "t"),
            "get_batches": lambda: client.get_batches(
                ["i"], 2, "p", "t", {"batch_index": 0}, also=[]
            ),
            "kv_batch_get": lambda: client.kv_batch_get(["a", "b"], "p"),
        }
        with paused_at(StoreGet) as paused:
            async with anyio.create_task_group() as tg:
                outcome: list[BaseException] = []

                async def read() -> None:
                    try:
                        await reads[call]()
                    except tq.TQError as exc:
                        outcome.append(exc)

                tg.start_soon(read)
                await paused.reached(1)
                if clear == "kv_clear":
                    await client.kv_clear(["a"], "p")
                else:
                    await client.clear_partition("p")
                if clear == "re-created":
                    await client.kv_batch_put(["a", "b"], "p", {"i": torch.arange(2)})
                paused.go()
        (error,) = outcome
        assert isinstance(error, tq.RowsNotFound)
        message = str(error)
        assert f"while this {call} read" in message
        assert f"call {call} again" in message
        assert "BatchMeta" not in message
