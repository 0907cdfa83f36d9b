"""Cancellation at every point of a real round trip consumes nothing (docs/guarantees.md).

Each test cancels a real request on real sockets — embedded, and against a ``tq-async serve``
process over TCP and over its same-host Unix socket — at one chosen point: before the request
is sent, while it waits at the controller, after its reply arrived but before the caller ran
again (the reply is queued), during a busy poll, and after the client reconnected to retry.
Then it checks that the rows come back (at most once, exactly once after a drain).
"""

from __future__ import annotations

import asyncio
import math
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager
from typing import Any

import anyio
import pytest
import torch
from tensordict import TensorDict

import tq_async as tq
from _cluster_proc import serve_cluster, serve_role, sigkill, warm_python
from _requests import cancelled_at
from tq_async._transport._dealer import DealerConnection
from tq_async._wire._protocol import Cancel, StoreGet, encoder

MODES = ["embedded", "tcp", "unix"]


@asynccontextmanager
async def client_in(mode: str, **kwargs: Any) -> AsyncIterator[tq.AsyncClient]:
    """An AsyncClient of a cluster in this loop (embedded) or of a ``tq-async serve``."""
    if mode == "unix":
        # the reply comes through the loop's reader, not a poll inside the request's own
        # step (test_busy_polled_... covers the poll)
        kwargs.setdefault("busy_poll", 0)
    if mode == "embedded":
        async with (
            tq.local_cluster(num_storage_units=2) as cluster,
            tq.AsyncClient.connect(cluster.address, **kwargs) as client,
        ):
            yield client
        return
    address = _SHARED.address()
    try:
        async with tq.AsyncClient.connect(address, same_host=mode == "unix", **kwargs) as client:
            await client.list_partitions()  # connected (through the Unix socket if asked)
            yield client
    finally:
        await _SHARED.clean()


class _SharedService:
    """The ``tq-async serve`` the tcp and unix tests of `client_in` share (one per module and
    xdist worker: starting one per test was most of this module's time). Each test leaves it
    as it found it -- its partitions cleared, no row stored -- or it is stopped, and the next
    test starts another."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._address: str | None = None

    def address(self) -> str:
        if self._address is None:
            self._address = self._stack.enter_context(serve_cluster())
        return self._address

    def close(self) -> None:
        self._address = None
        self._stack.close()

    async def clean(self) -> None:
        """Clear every partition and wait until no unit stores a row (or stop the service)."""
        assert self._address is not None
        try:
            with anyio.fail_after(20):
                async with tq.AsyncClient.connect(self._address) as client:
                    for pid in await client.list_partitions():
                        await client.clear_partition(pid)
                    while any(s["rows"] for s in (await client.storage_stats()).values()):
                        pass  # (each stats request is a round trip after the clears)
                    assert await client.list_partitions() == []
        except BaseException:
            self.close()
            raise


_SHARED = _SharedService()


@pytest.fixture(autouse=True, scope="module")
def _shared_service() -> Iterator[None]:
    """Stop the shared service after the module's last test."""
    yield
    _SHARED.close()


def controller(client: tq.AsyncClient) -> DealerConnection:
    conn = client._links.controller
    assert conn is not None
    return conn


def cancel_on_reply(conn: DealerConnection, victim: asyncio.Task[Any]) -> None:
    """Cancel ``victim`` right after the connection read a reply, before the victim runs:
    the reply sits resolved in the loop's queue (what a timeout that fires in the same loop
    iteration as the reply's arrival does)."""
    read = conn._on_frames

    def hook(frames: list[Any]) -> None:
        read(frames)
        victim.cancel()
        conn._on_frames = read  # type: ignore[method-assign]

    conn._on_frames = hook  # type: ignore[method-assign]


async def fill(client: tq.AsyncClient, pid: str, n: int = 8) -> None:
    await client.put(TensorDict({"i": torch.arange(n)}, batch_size=[n]), partition_id=pid)


async def drain(client: tq.AsyncClient, pid: str, task: str = "t") -> list[int]:
    """Seal, then read every row left for ``task`` until end-of-stream."""
    await client.seal(pid)
    got: list[int] = []
    while True:
        meta = await client.get_meta(["i"], 1, pid, task, timeout=10)
        if meta.end_of_stream:
            return got
        got.extend((await client.get_data(meta))["i"].tolist())


async def cancelled(coro_fn: Callable[[], Any], arm: Callable[[asyncio.Task[Any]], None]) -> Any:
    """Run ``coro_fn()`` as a task armed by ``arm``; return its result, or None if cancelled."""
    task = asyncio.get_running_loop().create_task(coro_fn())
    arm(task)
    try:
        return await task
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # type: ignore[union-attr]
            raise
        return None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lease", [None, 30.0])
async def test_get_meta_cancelled_with_its_reply_queued_gives_rows_back(
    mode: str, lease: float | None
) -> None:
    async with client_in(mode) as client:
        await fill(client, "p")
        conn = controller(client)
        got = await cancelled(
            lambda: client.get_meta(["i"], 4, "p", "t", lease=lease),
            lambda task: cancel_on_reply(conn, task),
        )
        assert got is None
        rows = await drain(client, "p")
        # every row still there, once; the dropped lease does not hold end-of-stream back
        assert sorted(rows) == list(range(8))


@pytest.mark.parametrize("mode", MODES)
async def test_get_cancelled_with_its_reply_queued_gives_rows_back(mode: str) -> None:
    async with client_in(mode) as client:
        await fill(client, "p")
        conn = controller(client)
        got = await cancelled(
            lambda: client.get(["i"], 4, "p", "t"), lambda task: cancel_on_reply(conn, task)
        )
        assert got is None
        assert sorted(await drain(client, "p")) == list(range(8))


@pytest.mark.parametrize("mode", MODES)
async def test_get_meta_cancelled_while_waiting_or_before_sending_consumes_nothing(
    mode: str,
) -> None:
    async with client_in(mode) as client:
        await fill(client, "p", 2)
        # waits at the controller (too few rows), then is cancelled
        with anyio.move_on_after(0.2):
            await client.get_meta(["i"], 4, "p", "t")
        # cancelled at its first await (anyio lets a call whose reply is already there
        # complete: then its rows are the caller's)
        got: list[int] = []
        meta = None
        with anyio.CancelScope() as scope:
            scope.cancel()
            meta = await client.get_meta(["i"], 2, "p", "t")
        if meta is not None:
            got += (await client.get_data(meta))["i"].tolist()
        await fill(client, "p", 2)
        assert sorted(got + await drain(client, "p")) == [0, 0, 1, 1]


def cancel_on_send(conn: DealerConnection, victim: asyncio.Task[Any]) -> None:
    """Cancel ``victim`` as its request leaves: it is cancelled at its next await (the busy
    poll's first yield), while the service answers."""
    send = conn._send

    def hook(frames: Any) -> None:
        send(frames)
        victim.cancel()
        conn._send = send  # type: ignore[method-assign]

    conn._send = hook  # type: ignore[method-assign]


async def test_busy_polled_get_meta_cancelled_gives_rows_back() -> None:
    """Over the Unix socket a request polls for its reply; cancelled as it starts polling,
    its reply arrives for nobody and the rows go back."""
    async with client_in("unix", busy_poll=0.01) as client:
        await fill(client, "p")
        conn = controller(client)
        assert conn._busy_poll is not None
        for _ in range(8):
            got = await cancelled(
                lambda: client.get_meta(["i"], 1, "p", "t"),
                lambda task: cancel_on_send(conn, task),
            )
            assert got is None
        assert sorted(await drain(client, "p")) == list(range(8))


@pytest.mark.parametrize("mode", ["embedded", "tcp"])
async def test_cancelled_after_a_reconnect_retry_gives_rows_back(mode: str) -> None:
    """The request waits past ``retry_after``, reconnects, is answered from the service's
    reply cache or its pending entry, and is cancelled with that reply queued."""
    async with client_in(mode, retry_after=0.05) as client:
        await fill(client, "p", 2)
        conn = controller(client)

        async def wait_then_fill() -> None:
            while conn.reconnects == 0:
                await anyio.sleep(0.01)
            cancel_on_reply(conn, victim)
            await fill(client, "p", 2)

        victim = asyncio.get_running_loop().create_task(
            client.get_meta(["i"], 4, "p", "t", timeout=30)
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_then_fill)
            with pytest.raises(asyncio.CancelledError):
                await victim
        assert sorted(await drain(client, "p")) == [0, 0, 1, 1]


@pytest.mark.parametrize("mode", ["embedded", "tcp"])
async def test_acquire_rollout_cancelled_after_admission_reserves_nothing(mode: str) -> None:
    async with client_in(mode) as client:
        conn = controller(client)
        got = await cancelled(
            lambda: client.acquire_rollout(0, 3), lambda task: cancel_on_reply(conn, task)
        )
        assert got is None
        for _ in range(100):  # the one-way ReleaseRollout is ordered before this request
            status = await client.staleness_status()
            if status["outstanding"] == 0:
                break
        assert status["outstanding"] == 0


@pytest.mark.parametrize("mode", MODES)
async def test_random_timeouts_around_get_meta_lose_no_rows(mode: str) -> None:
    """The reproduction of the issue: tight timeouts around get_meta, then a drain."""
    import random

    rng = random.Random(7)
    async with client_in(mode) as client:
        await client.put(TensorDict({"i": torch.arange(120)}, batch_size=[120]), partition_id="r")
        got: list[int] = []
        for _ in range(150):
            meta = None
            with anyio.move_on_after(rng.choice([0.0, 0.0002, 0.0005, 0.001, 0.003])):
                meta = await client.get_meta(["i"], 4, "r", "a")
            if meta is not None:
                got.extend((await client.get_data(meta))["i"].tolist())
        got.extend(await drain(client, "r", "a"))
        assert sorted(got) == list(range(120))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["inline", "three_steps", "keyed"])
async def test_put_cancelled_with_its_placement_queued_leaves_nothing(mode: str, how: str) -> None:
    """The put was placed (its new rows under a put lease) but the caller never knew: the
    rows are reclaimed at once, so end-of-stream does not wait for the put lease (60 s)."""
    inline = 65536 if how == "inline" else 0
    async with client_in(mode, inline_put_bytes=inline) as client:
        conn = controller(client)
        data = TensorDict({"i": torch.arange(4) + 100}, batch_size=[4])

        async def put() -> Any:
            if how == "keyed":
                return await client.kv_batch_put(["a", "b", "c", "d"], "p", data)
            return await client.put(data, partition_id="p")

        assert await cancelled(put, lambda task: cancel_on_reply(conn, task)) is None
        await fill(client, "p", 2)
        assert sorted(await drain(client, "p")) == [0, 1]


@pytest.mark.parametrize("mode", MODES)
async def test_a_cancel_read_before_the_waiting_request_started_drops_it(mode: str) -> None:
    """The request and its Cancel leave back to back (cancelled at its first await): the
    controller reads both before the request's waiting task starts. The Cancel must still
    drop it; left waiting, it would take the next rows for nobody."""
    async with client_in(mode) as client:
        for _ in range(5):
            with anyio.CancelScope() as scope:
                scope.cancel()
                await client.get_meta(["i"], 2, "p", "t")
            assert scope.cancelled_caught  # no rows to answer it with: it was cancelled
        await fill(client, "p", 2)
        assert sorted(await drain(client, "p")) == [0, 1]


@pytest.mark.parametrize("mode", MODES)
async def test_record_from_cancelled_keeps_the_batches_it_decided_and_takes_nothing_else(
    mode: str,
) -> None:
    """A fetch with ``record_from`` (what DataLoader workers send) cancelled while it waits on
    its own batch: the lower batch it decided stays recorded for its readers, its own batch
    takes nothing. Cancelled with its reply queued: its batch stays recorded, as every
    recorded batch does, and the next reader of that index gets the same rows."""
    async with client_in(mode) as client:
        await fill(client, "p", 4)  # rows 0-3: enough for batch 0 only

        def config(index: int, **extra: int) -> dict[str, int]:
            return {"batch_index": index, "dp_rank": 0, **extra}

        async def rows(index: int) -> list[int]:
            meta = await client.get_meta(["i"], 4, "p", "t", config(index), timeout=10)
            return list(meta.global_indexes)

        with anyio.move_on_after(0.2) as scope:  # waits at the controller for batch 1's rows
            await client.get_meta(["i"], 4, "p", "t", config(1, record_from=0))
        assert scope.cancelled_caught
        assert await rows(0) == [0, 1, 2, 3]  # decided on the way: recorded
        await fill(client, "p", 8)  # rows 4-11
        conn = controller(client)
        got = await cancelled(
            lambda: client.get_meta(["i"], 4, "p", "t", config(2, record_from=0)),
            lambda task: cancel_on_reply(conn, task),
        )
        assert got is None
        assert await rows(1) == [4, 5, 6, 7]  # decided by the cancelled fetch on its way
        assert await rows(2) == [8, 9, 10, 11]  # its own batch: recorded, the same rows
        assert await drain(client, "p") == []  # nothing else was taken, nothing lost


@pytest.mark.parametrize("mode", MODES)
async def test_get_batches_cancelled_keeps_every_batch_it_decided_and_takes_nothing_else(
    mode: str,
) -> None:
    """``get_batches`` (what DataLoader workers send for a hand-off) cancelled while its own
    batch waits: nothing is taken. Cancelled with its reply queued: the asked batch, the
    batches it took ahead and those decided between stay recorded (each re-read as the same
    rows by its next reader); nothing else is taken, nothing is lost."""
    async with client_in(mode) as client:

        def config(index: int) -> dict[str, int]:
            return {"batch_index": index, "dp_rank": 0, "record_from": 0}

        async def rows(index: int) -> list[int]:
            meta = await client.get_meta(["i"], 2, "p", "t", config(index), timeout=0)
            return list(meta.global_indexes)

        def fetch() -> Any:
            return client.get_batches(["i"], 2, "p", "t", config(0), also=[2, 4])

        with anyio.move_on_after(0.2) as scope:  # no rows: it waits at the controller
            await fetch()
        assert scope.cancelled_caught
        await fill(client, "p", 12)  # rows 0-11: six batches of 2, all ready
        conn = controller(client)
        got = await cancelled(fetch, lambda task: cancel_on_reply(conn, task))
        assert got is None
        # 0, 2 and 4 came together, 1 and 3 were decided between: all recorded
        assert [await rows(i) for i in range(5)] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
        assert await drain(client, "p") == [10, 11]  # nothing else was taken, nothing lost


@pytest.mark.parametrize("mode", ["tcp", "unix"])
async def test_a_put_cancelled_after_its_columns_went_out_leaves_no_cells(mode: str) -> None:
    """A put over the socket (no shared memory) cancelled right after its `StorePut` went
    out: the client aborts the put at the controller, which tells the unit to clear the
    rows; that clear travelled on another connection and reached the unit before the put's
    columns (megabytes, still on their way), so the unit stored them afterwards for rows
    nobody has: its memory held them until the whole partition was cleared. The client now
    also sends the unit a clear on the put's own connection, after the columns."""
    from _requests import cancelled_at
    from tq_async._wire._protocol import StorePut

    async with client_in(mode, shared_memory=False) as client:
        await fill(client, "p")
        big = TensorDict({"x": torch.zeros(64, 1 << 16)}, batch_size=[64])  # 16 MiB
        with cancelled_at(StorePut) as (scope, sent), scope:
            await client.put(big, partition_id="q")
        assert scope.cancelled_caught
        assert len(sent) == 1
        with anyio.fail_after(10):  # (each stats request is a round trip later)
            while sum(s["rows"] for s in (await client.storage_stats()).values()) != 8:
                pass


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
async def test_a_client_closed_while_its_get_meta_waits_leaves_the_rows_to_the_task(
    transport: str,
) -> None:
    """A client closed while one of its get_metas waits at the controller (its caller gets
    `ClosedError`): before, the socket closed with nothing said, the request stayed parked,
    and the task's next rows were taken by it and delivered to nobody. The connection now
    sends the `Cancel` a cancelled call sends."""
    kw: dict[str, str] = {} if transport == "inproc" else {"transport": "tcp"}
    async with (
        tq.local_cluster(num_storage_units=1, **kw) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        doomed = await tq.AsyncClient.connect(cluster.address).__aenter__()
        failed: list[BaseException] = []

        async def wait() -> None:
            try:
                await doomed.get_meta(["i"], 2, "p", "t")
            except tq.ClosedError as exc:
                failed.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            with anyio.fail_after(10):  # (no event tells a request parked: the count does)
                while cluster.controller.waiting < 1:
                    await anyio.lowlevel.checkpoint()
            await doomed.aclose()
        assert len(failed) == 1
        with anyio.fail_after(10):  # the Cancel came on the closed client's connection
            while cluster.controller.waiting:
                await anyio.lowlevel.checkpoint()
        await fill(client, "p", 2)
        assert await drain(client, "p") == [0, 1]


#: a client process whose get_meta and watch wait at the controller until it is SIGKILLed
_WAITING_CLIENT = """
import asyncio, sys
import tq_async as tq

async def main():
    async with tq.AsyncClient.connect(sys.argv[1]) as client:
        async def watch():
            async for _ in client.watch():
                pass
        await asyncio.gather(client.get_meta(["i"], 2, "p", "t"), watch())

asyncio.run(main())
"""


async def test_a_client_killed_while_its_requests_wait_leaves_nothing_parked() -> None:
    """A same-host client SIGKILLed while its get_meta and its watch wait at the controller:
    its Unix socket ends, but the requests stayed parked for good (one more per killed
    consumer), and the get_meta, woken by the next put, took the task's rows for nobody.
    The end of its connection now ends its waiting requests as a Cancel does."""
    async with (
        tq.local_cluster(num_storage_units=1, transport="tcp") as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        ctl = cluster.controller
        with warm_python(_WAITING_CLIENT, cluster.address) as proc:
            with anyio.fail_after(60):  # (a process to start; the counts tell it parked)
                while ctl.waiting < 1 or not ctl.watch.parked:
                    await anyio.sleep(0.05)
            sigkill(proc)
        with anyio.fail_after(10):  # its Unix socket's end is read by the controller's loop
            while ctl.waiting or ctl.watch.parked:
                await anyio.sleep(0.01)
        await fill(client, "p", 2)
        assert await drain(client, "p") == [0, 1]


#: a client process whose get_meta waits at the controller over ZMQ (TCP) until SIGKILLed
_WAITING_ZMQ_CLIENT = """
import asyncio, sys
import tq_async as tq

async def main():
    async with tq.AsyncClient.connect(sys.argv[1], same_host=False, retry_after=0.2) as client:
        await client.get_meta(["i"], 2, "p", "t")

asyncio.run(main())
"""


async def test_a_zmq_client_killed_while_its_get_meta_waits_leaves_the_rows_to_the_task() -> None:
    """A client over TCP SIGKILLed while its get_meta waits: ZMQ tells the controller
    nothing, and the request stayed parked for good; the next put woke it and the task's
    rows went to nobody. A waiting request is resent every ``retry_after`` (its client said
    how often in its Hello): one not resent for a few periods now ends as a Cancel does."""
    async with (
        tq.local_cluster(num_storage_units=1, transport="tcp") as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        ctl = cluster.controller
        with warm_python(_WAITING_ZMQ_CLIENT, cluster.address) as proc:
            with anyio.fail_after(60):  # (a process to start; the count tells it parked)
                while ctl.waiting < 1:
                    await anyio.sleep(0.05)
            sigkill(proc)
        with anyio.fail_after(10):  # three missed resends of 0.2 s end it
            while ctl.waiting:
                await anyio.sleep(0.01)
        await fill(client, "p", 2)
        assert await drain(client, "p") == [0, 1]


async def test_a_live_zmq_client_whose_get_meta_waits_long_keeps_it() -> None:
    """The other side: a live client's waiting get_meta, resent every ``retry_after``,
    stays parked across many periods and gets the rows of the next put."""
    async with (
        tq.local_cluster(num_storage_units=1, transport="tcp") as cluster,
        tq.AsyncClient.connect(cluster.address) as producer,
        tq.AsyncClient.connect(cluster.address, same_host=False, retry_after=0.05) as consumer,
    ):
        ctl = cluster.controller
        waiter = asyncio.ensure_future(consumer.get_meta(["i"], 2, "p", "t"))
        try:
            with anyio.fail_after(30):
                while ctl.waiting < 1:
                    await anyio.sleep(0.01)
                heard = ctl._shell._heard  # the resends' stamps
                first = heard[next(iter(heard))]
                while heard and heard[next(iter(heard))] < first + 0.5:  # ten periods
                    await anyio.sleep(0.01)
            assert ctl.waiting == 1
            await fill(producer, "p", 2)
            with anyio.fail_after(30):
                meta = await waiter
        finally:
            waiter.cancel()
        assert sorted(meta.global_indexes) == [0, 1]


async def test_get_metas_given_up_on_a_paused_controller_over_tcp_take_no_rows() -> None:
    """The controller is paused (SIGSTOP) while a TCP client's get_metas give up: each
    reconnects every ``retry_after`` and resends, then sends its ``Cancel`` on its last
    connection. Once resumed, the controller reads those connections in any order: a
    ``Cancel`` read before its request found nothing to cancel and was dropped, then the
    request ran and its rows went to a caller long gone (2 of 8 rows never came back).

    What this pins is the client's half: the copies of a request and its ``Cancel`` queued
    on a socket a reconnect replaces are lost with it (the paused controller never finished
    their handshake), so a ``Cancel`` is sent again on each reconnect until its reply comes
    (`ConnectionShell`'s resend of ``ConnectionCore.cancelled``): without it this fails.
    The controller's half, a request whose ``Cancel`` was read first is not run
    (`Shell.is_retry`), is too timing-bound to reproduce here: a paused controller reads the
    surviving copies in order; `test_a_request_whose_cancel_came_first_is_not_run` pins it."""
    with serve_role("--storage-units", "1") as (proc, address):
        async with (
            tq.AsyncClient.connect(address) as producer,
            tq.AsyncClient.connect(
                address, same_host=False, retry_after=0.15, request_timeout=0.5
            ) as consumer,
        ):
            await fill(producer, "p", 8)
            proc.send_signal(signal.SIGSTOP)
            try:
                for timeout in (0, 0.2, 0, 0.2):
                    with pytest.raises(tq.TQTimeoutError):
                        await consumer.get_meta(["i"], 2, "p", "t", timeout=timeout)
            finally:
                proc.send_signal(signal.SIGCONT)
            assert sorted(await drain(producer, "p")) == list(range(8))


async def test_a_request_whose_cancel_came_first_is_not_run() -> None:
    """A ZMQ client that reconnected has messages on several connections, which the
    controller reads in any order: a request's ``Cancel`` may come before the request. The
    Cancel found nothing and was dropped, then the request ran for a caller long gone. Now
    the request is answered as cancelled, and nothing is consumed."""
    async with (
        tq.local_cluster(num_storage_units=1, transport="tcp") as cluster,
        tq.AsyncClient.connect(cluster.address) as producer,
        tq.AsyncClient.connect(cluster.address, same_host=False) as consumer,
    ):
        await fill(producer, "p", 4)
        conn = controller(consumer)
        core = conn._core
        own = next(core._rids)  # the Cancel's own request id; the get_meta's is the next
        conn._send([encoder.encode((own, Cancel(own + 1), core.identity))])
        with pytest.raises(tq.TQError, match="cancelled by its client"):
            await consumer.get_meta(["i"], 2, "p", "t", timeout=0)
        assert sorted(await drain(producer, "p")) == [0, 1, 2, 3]


async def test_a_waiting_get_meta_run_again_when_resent_keeps_what_was_left_of_its_timeout() -> (
    None
):
    """A waiting request not resent for three of its client's periods is ended as a dead
    client's; a live client resends it and it runs again (a controller paused or busy that
    long, or a tiny ``retry_after``, which did so again and again). Its ``timeout`` then
    started over: a get_meta with ``timeout=0.5`` waited on past it (for up to
    ``request_timeout`` more with ``retry_after=0.003``) and took rows put long after. Now
    it runs again with what was left of its timeout: here nothing."""
    async with (
        tq.local_cluster(num_storage_units=1, transport="tcp") as cluster,
        tq.AsyncClient.connect(cluster.address) as producer,
        tq.AsyncClient.connect(cluster.address, same_host=False, retry_after=1.0) as consumer,
    ):
        shell = cluster.controller._shell
        waiter = asyncio.ensure_future(consumer.get_meta(["i"], 2, "p", "t", timeout=0.5))
        try:
            with anyio.fail_after(30):
                while not shell._heard:
                    await anyio.sleep(0.01)
                (key,) = shell._heard
                shell._heard[key] = -math.inf  # not heard of for ages (the controller paused)
                shell._sweep()  # ended as a dead client's request, unanswered
                while key in shell.pending:
                    await anyio.sleep(0.01)
                while key not in shell.pending and not waiter.done():  # resent after 1 s
                    await anyio.sleep(0.01)
                if not waiter.done():  # running again
                    await fill(producer, "p", 2)
                with pytest.raises(tq.TQTimeoutError):
                    await waiter
        finally:
            waiter.cancel()


@pytest.mark.parametrize("mode", MODES)
async def test_a_recorded_get_cancelled_while_its_cells_are_read_keeps_its_rows_held(
    mode: str,
) -> None:
    """An auto-clear task's ``get`` of a recorded batch, cancelled once its rows were decided
    and their read went out to the unit: the batch keeps its rows (auto-clear does not free
    them), and the next read of the same batch_index gets them (before: the cancelled read
    acknowledged its hold, auto-clear freed the rows, and the replay got `RowsNotFound`)."""
    async with client_in(mode, inline_get_bytes=0) as client:
        await client.register_tasks(["t"], "p")
        await fill(client, "p")
        config = {"batch_index": 0, "dp_rank": 0}
        with cancelled_at(StoreGet) as (scope, sent), scope:
            await client.get(["i"], 4, "p", "t", config)
        assert scope.cancelled_caught
        assert sent
        # (each round trip on the connection comes after what the cancelled call sent)
        assert (await client.partition_info("p"))["rows"] == 8
        td, meta = await client.get(["i"], 4, "p", "t", config)
        assert td["i"].tolist() == meta.global_indexes == [0, 1, 2, 3]
        assert (await client.partition_info("p"))["rows"] == 4  # read, acknowledged, freed


@pytest.mark.parametrize("same_host", [False, True])
async def test_a_get_cancelled_while_its_cells_are_read_stays_cancelled_when_the_give_back_fails(
    same_host: bool,
) -> None:
    """A ``get`` cancelled while its cells are read gives its rows back (a best-effort
    clean-up); when that fails -- here the controller was SIGKILLed meanwhile, so the
    `Release` finds nothing listening -- the caller is still cancelled. Before, the clean-up's
    `BrokenError` replaced the cancellation: a ``move_on_after`` around the get raised
    instead of moving on (and a blocking get's Ctrl-C became a `BrokenError`)."""
    from _cluster_proc import serve_role, sigkill

    request = DealerConnection.request
    scope = anyio.CancelScope()
    with (
        serve_role("controller") as (controller_proc, address),
        serve_role("storage", "--controller", address, line="TQ_UNIT="),
    ):
        async with tq.AsyncClient.connect(
            address, inline_get_bytes=0, same_host=same_host, request_timeout=10
        ) as client:
            await fill(client, "p")
            ctl = controller(client)

            async def kill_then_cancel(
                self: DealerConnection, body: Any, *args: Any, **kwargs: Any
            ) -> Any:
                if isinstance(body, StoreGet):  # the rows were handed out: now read
                    sigkill(controller_proc)
                    with anyio.fail_after(10):
                        while ctl.connected is not False:
                            await anyio.sleep(0.01)
                    scope.cancel()
                return await request(self, body, *args, **kwargs)

            DealerConnection.request = kill_then_cancel  # type: ignore[method-assign]
            try:
                with scope:
                    await client.get(["i"], 4, "p", "t")
            finally:
                DealerConnection.request = request  # type: ignore[method-assign]
            assert scope.cancelled_caught


@pytest.mark.parametrize("mode", MODES)
async def test_a_client_closed_while_its_put_stores_leaves_no_put_open(mode: str) -> None:
    """A client closed (by another task) while one of its puts sends its columns to the
    unit: the put fails with `ClosedError`, and its placed rows are aborted as the client
    closes. Before, nothing told the controller (the put's own clean-up found the client
    closed), so the rows stayed under their put lease: a sealed partition's end-of-stream
    waited the lease out (60 s)."""
    from tq_async._wire._protocol import StorePut

    async with client_in(mode) as client:
        address = client.address
        doomed = await tq.AsyncClient.connect(
            address, inline_put_bytes=0, same_host=mode == "unix", busy_poll=0
        ).open()
        request = DealerConnection.request

        async def close_then_send(
            self: DealerConnection, body: Any, *args: Any, **kwargs: Any
        ) -> Any:
            if isinstance(body, StorePut):
                await doomed.aclose()
            return await request(self, body, *args, **kwargs)

        DealerConnection.request = close_then_send  # type: ignore[method-assign]
        try:
            with pytest.raises(tq.ClosedError):
                await doomed.put(TensorDict({"i": torch.arange(4) + 100}, [4]), partition_id="p")
        finally:
            DealerConnection.request = request  # type: ignore[method-assign]
        await fill(client, "p", 2)
        with anyio.fail_after(20):  # not the 60 s put lease
            assert sorted(await drain(client, "p")) == [0, 1]
        assert (await client.partition_info("p"))["uncommitted_puts"] == 0


@pytest.mark.parametrize("mode", MODES)
async def test_calls_cancelled_while_they_wait_leave_no_undo_behind(
    mode: str, tmp_path: Any
) -> None:
    """An ``acquire_rollout`` waiting for admission and a put waiting for room, each
    cancelled while it waits at the controller (a trainer's timeout loop): the client keeps
    an undo for each in case its reply was already on its way. The controller dropped them
    and never answered, so the client kept them as long as the connection lived (one per
    cancelled call: memory without bound). The controller now answers a request its client
    cancelled, and the client forgets its undo."""
    config = tmp_path / "tq.toml"
    config.write_text("capacity = 2\n[admission]\nmax_staleness = 0\n")
    small = TensorDict({"i": torch.arange(2)}, batch_size=[2])
    big = TensorDict({"x": torch.zeros(2, 1 << 15)}, batch_size=[2])  # three steps
    async with AsyncExitStack() as stack:
        if mode == "embedded":
            cluster = await stack.enter_async_context(
                tq.local_cluster(
                    num_storage_units=1,
                    capacity=2,
                    admission=tq.AdmissionConfig(max_staleness=0),
                )
            )
            address = cluster.address
        else:
            address = stack.enter_context(serve_cluster(1, ["--config", str(config)]))
        client = await stack.enter_async_context(
            tq.AsyncClient.connect(address, same_host=mode == "unix")
        )
        await client.put(small, partition_id="p")  # the partition is full
        conn = controller(client)
        for _ in range(10):
            for call in (
                lambda: client.acquire_rollout(5, 1),  # the learner is at -1: it waits
                lambda: client.put(small, partition_id="p"),
                lambda: client.put(big, partition_id="p"),
            ):
                with anyio.move_on_after(0.01) as scope:
                    await call()
                assert scope.cancelled_caught
        with anyio.fail_after(10):  # (each round trip comes after the Cancels it follows)
            while conn._core.orphans:
                await client.staleness_status()
        assert (await client.partition_info("p"))["rows"] == 2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lease", [None, 30.0])
async def test_a_client_closed_while_its_get_reads_gives_the_rows_back(
    mode: str, lease: float | None
) -> None:
    """A client closed (by another task) while one of its ``get``s reads the cells of the
    rows it fetched: the get fails with `ClosedError`, and its rows go back to the task as
    the client closes, as a cancelled get's do. Before, the get's give-back found the client
    closed (a warning): without a lease the rows stayed consumed, delivered to nobody; with
    one, end-of-stream waited for the lease to run out."""
    async with client_in(mode) as client:
        await fill(client, "p")
        doomed = await tq.AsyncClient.connect(
            client.address, inline_get_bytes=0, same_host=mode == "unix"
        ).open()
        request = DealerConnection.request

        async def close_then_send(
            self: DealerConnection, body: Any, *args: Any, **kwargs: Any
        ) -> Any:
            if isinstance(body, StoreGet):  # the rows were handed out: now read
                await doomed.aclose()
            return await request(self, body, *args, **kwargs)

        DealerConnection.request = close_then_send  # type: ignore[method-assign]
        try:
            with pytest.raises(tq.ClosedError):
                await doomed.get(["i"], 4, "p", "t", lease=lease)
        finally:
            DealerConnection.request = request  # type: ignore[method-assign]
        with anyio.fail_after(20):  # not the 30 s lease
            assert sorted(await drain(client, "p")) == list(range(8))


@pytest.mark.parametrize("mode", MODES)
async def test_an_acquire_rollout_given_up_as_its_client_closes_reserves_nothing(
    mode: str, tmp_path: Any
) -> None:
    """A rollout worker's ``acquire_rollout`` cancelled right after it went out, then its
    client closed (the worker stops): the controller admitted it, and its reply reached a
    closed client, whose undo (`ReleaseRollout` on the late reply) never ran. Its slots
    stayed reserved for good: a few such stops filled the capacity and every producer
    waited for ever. The controller now gives an admitted rollout's slots back on its
    ``Cancel``, as it gives a fetch's rows back."""
    config = tmp_path / "tq.toml"
    config.write_text('[admission]\ncapacity = 8\nlearner_task = "learner"\n')
    async with AsyncExitStack() as stack:
        if mode == "embedded":
            admission = tq.AdmissionConfig(capacity=8, learner_task="learner")
            cluster = await stack.enter_async_context(
                tq.local_cluster(num_storage_units=1, admission=admission)
            )
            address = cluster.address
        else:
            address = stack.enter_context(serve_cluster(1, ["--config", str(config)]))
        client = await stack.enter_async_context(tq.AsyncClient.connect(address))
        for _ in range(5):  # more than the capacity holds
            worker = await tq.AsyncClient.connect(address, same_host=mode == "unix").open()
            with anyio.CancelScope() as scope:
                scope.cancel()  # takes effect at its first wait: after it went out
                await worker.acquire_rollout(0, 2)
            await worker.aclose()
        with anyio.fail_after(10):  # (the closed clients' messages come on other connections)
            while (await client.staleness_status())["outstanding"]:
                pass
        with anyio.fail_after(10):
            await client.acquire_rollout(0, 8)  # the whole capacity is free


@pytest.mark.parametrize("mode", MODES)
async def test_a_take_recycled_given_up_as_its_client_closes_loses_no_prompt(
    mode: str, tmp_path: Any
) -> None:
    """A ``take_recycled`` cancelled right after it went out, then its client closed: the
    controller handed the stale rows out, and its reply reached a closed client, whose undo
    (queueing them again on the late reply) never ran. The prompts were lost for good. The
    controller now queues them again on the call's ``Cancel``."""
    config = tmp_path / "tq.toml"
    config.write_text(
        '[sampler]\nfactory = "tq_async:StalenessSampler"\nmax_staleness = 0\n'
        'on_stale = "recycle"\n'
    )
    async with AsyncExitStack() as stack:
        if mode == "embedded":
            sampler = tq.StalenessSampler(max_staleness=0, on_stale="recycle")
            cluster = await stack.enter_async_context(
                tq.local_cluster(num_storage_units=1, sampler=sampler)
            )
            address = cluster.address
        else:
            address = stack.enter_context(serve_cluster(1, ["--config", str(config)]))
        client = await stack.enter_async_context(tq.AsyncClient.connect(address))
        await client.put({"prompt": torch.arange(3)}, "p", policy_version=0)
        await client.set_policy_version(1)  # every row is now one version too old
        await client.put({"prompt": torch.arange(3, 5)}, "p", policy_version=1)
        await client.get_meta(["prompt"], 2, "p", "learn")  # finds the 3 stale rows
        assert (await client.staleness_status())["recycled_pending"] == 3
        worker = await tq.AsyncClient.connect(address, same_host=mode == "unix").open()
        with anyio.CancelScope() as scope:
            scope.cancel()  # takes effect at its first wait: after it went out
            await worker.take_recycled()
        await worker.aclose()
        with anyio.fail_after(10):  # (the closed client's Cancel came on another connection)
            while (await client.staleness_status())["recycled_pending"] != 3:
                pass
        (taken,) = await client.take_recycled()
        assert sorted(taken.global_indexes) == [0, 1, 2]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["inline", "three_steps"])
async def test_a_put_given_up_as_its_client_closes_leaves_nothing(mode: str, how: str) -> None:
    """A put cancelled right after its first message went out, then its client closed (a
    producer stopping): the controller stored and committed a one-message put (its rows
    visible, though its caller saw it cancelled: a retry put them twice) or placed a
    three-step one (its rows under the put lease: end-of-stream waited 60 s), and the reply
    reached a closed client, whose undo never ran. The controller now undoes a put on its
    ``Cancel``."""
    async with client_in(mode) as client:
        inline = 65536 if how == "inline" else 0
        producer = await tq.AsyncClient.connect(
            client.address, same_host=mode == "unix", inline_put_bytes=inline
        ).open()
        with anyio.CancelScope() as scope:
            scope.cancel()  # takes effect at its first wait: after it went out
            await producer.put(TensorDict({"i": torch.arange(4) + 100}, [4]), partition_id="p")
        await producer.aclose()
        await fill(client, "p", 2)
        with anyio.fail_after(20):  # not the 60 s put lease
            assert sorted(await drain(client, "p")) == [0, 1]
        assert (await client.partition_info("p"))["uncommitted_puts"] == 0


@pytest.mark.parametrize("mode", ["tcp", "unix"])
async def test_a_kv_put_cancelled_after_its_columns_went_out_leaves_no_cells(mode: str) -> None:
    """The same for a keyed put of new keys: its abort reclaims the new rows, whose clear
    overtook the columns, so the unit kept them for keys nobody has. The client asks which
    rows the abort reclaimed (not those another put or a tag binds meanwhile) and clears
    those on the put's own connection, after the columns."""
    from _requests import cancelled_at
    from tq_async._wire._protocol import StorePut

    async with client_in(mode, shared_memory=False) as client:
        await fill(client, "p")
        big = TensorDict({"x": torch.zeros(64, 1 << 16)}, batch_size=[64])  # 16 MiB
        with cancelled_at(StorePut) as (scope, sent), scope:
            await client.kv_batch_put([f"k{i}" for i in range(64)], "q", big)
        assert scope.cancelled_caught
        assert len(sent) == 1
        assert (await client.kv_list("q"))["q"] == {}
        with anyio.fail_after(10):  # (each stats request is a round trip later)
            while sum(s["rows"] for s in (await client.storage_stats()).values()) != 8:
                pass
