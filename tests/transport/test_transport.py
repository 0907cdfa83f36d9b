"""The transport's in-process shortcut: a client in the services' process talks inproc.

inproc passes message buffers by reference, so these tests pin down that the shortcut keeps
the semantics of a socket (what was put is a copy; what was read is the reader's own) and that
a closing endpoint still fails the requests waiting on it at once.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import uuid

import anyio
import anyio.lowlevel
import pytest
import torch
import zmq

import tq_async as tq
from tq_async._transport._dealer import BusyPoll, DealerConnection
from tq_async._transport._router import RouterEndpoint
from tq_async._transport._sync_dealer import BlockingConnection
from tq_async._transport._unix import abstract_name
from tq_async._wire._protocol import ListPartitions


async def test_a_client_in_the_services_process_connects_inproc() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address, inline_put_bytes=0) as client,
    ):
        meta = await client.put({"x": torch.arange(4)}, "p")
        assert (await client.get_data(meta))["x"].tolist() == [0, 1, 2, 3]
        assert client._links.controller is not None
        assert client._links.controller.inproc
        assert client._links.units
        assert all(conn.inproc for conn in client._links.units.values())
        # the controller reaches its units in the same process the same way
        assert all(conn.inproc for conn in cluster.controller._links.conns.values())


async def test_put_keeps_a_copy_not_the_callers_buffer() -> None:
    # above pyzmq's copy threshold (64 KiB), where inproc would pass the buffer itself
    n = 3 * 65536
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        for inline in (0, 1 << 24):  # three-step put (to the unit) and one-message put
            client.inline_put_bytes = inline
            dense = torch.arange(n, dtype=torch.float32).reshape(3, -1)
            jagged = torch.nested.nested_tensor(
                [torch.ones(n), torch.ones(1), torch.ones(2)], layout=torch.jagged
            )
            meta = await client.put({"d": dense, "j": jagged}, f"p{inline}")
            dense.fill_(-1)
            jagged.values().fill_(-1)
            td = await client.get_data(meta)
            assert torch.equal(td["d"].flatten(), torch.arange(n, dtype=torch.float32))
            assert float(td["j"].values().sum()) == n + 3


async def test_data_read_is_the_readers_own() -> None:
    n = 4 * 65536  # above pyzmq's copy threshold
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        jagged = torch.nested.nested_tensor([torch.ones(n), torch.ones(3)], layout=torch.jagged)
        meta = await client.put({"d": torch.arange(2 * n).reshape(2, n), "j": jagged}, "p")
        first = await client.get_data(meta)
        first["d"].add_(100)  # writable, and writing it must not reach the stored cells
        first["j"].values().zero_()
        again = await client.get_data(meta)
        assert torch.equal(again["d"].flatten(), torch.arange(2 * n))
        assert float(again["j"].values().sum()) == n + 3


async def test_a_blocking_client_on_its_own_loop_thread_uses_the_shortcut() -> None:
    async with tq.local_cluster(num_storage_units=1) as cluster:

        def blocking() -> tuple[bool, list[int]]:
            with tq.Client.connect(cluster.address) as client:
                meta = client.put({"x": torch.arange(3)}, "p")
                got = client.get_data(meta)["x"].tolist()
                # the blocking client's own connection, driven by this thread, goes inproc
                return bool(client._links.controller and client._links.controller.inproc), got

        inproc, got = await anyio.to_thread.run_sync(blocking)
        assert inproc
        assert got == [0, 1, 2]


async def test_closing_an_endpoint_fails_its_in_process_requests_at_once() -> None:
    """inproc has no disconnect events: the endpoint tells its connections itself."""
    seen = anyio.Event()

    def never_answer(peer: bytes, frames: list[zmq.Frame]) -> None:
        seen.set()

    endpoint = RouterEndpoint("tcp://127.0.0.1:0", never_answer)
    lost: list[bool] = []
    conn = DealerConnection(endpoint.address, on_disconnect=lambda: lost.append(True))
    try:
        assert conn.inproc
        assert conn.connected
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:

                async def waiting() -> None:
                    with pytest.raises(tq.BrokenError, match="broke"):
                        await conn.request(ListPartitions())  # no timeout: waits for ever

                tg.start_soon(waiting)
                await seen.wait()
                endpoint.close()
        assert lost == [True]
        assert conn.connected is False
    finally:
        conn.close()
        endpoint.close()


async def test_other_contexts_and_curve_go_through_the_socket() -> None:
    def ignore(peer: bytes, frames: list[zmq.Frame]) -> None:
        pass

    endpoint = RouterEndpoint("tcp://127.0.0.1:0", ignore)
    other = zmq.Context()
    try:
        conn = DealerConnection(endpoint.address, context=other)
        assert not conn.inproc  # inproc only works inside one context
        conn.close()
    finally:
        endpoint.close()
        other.term()
    public, secret = tq.curve_keypair()
    server = tq.CurveServer(public, secret)
    async with tq.local_cluster(num_storage_units=1, curve=server) as cluster:
        client_public, client_secret = tq.curve_keypair()
        curve = tq.CurveClient(public, client_public, client_secret)
        async with tq.AsyncClient.connect(cluster.address, curve=curve) as client:
            assert await client.list_partitions() == []
            assert client._links.controller is not None
            assert not client._links.controller.inproc


class _NeverRead:
    """A read that never brings the reply (a service waiting for data)."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> None:
        self.reads += 1


async def test_busy_poll_catches_a_reply_that_a_read_brings() -> None:
    poll = BusyPoll(0.01)
    fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    reads = 0

    def read() -> None:
        nonlocal reads
        reads += 1
        if reads == 3:
            fut.set_result(7)

    assert await poll.caught(fut, read)
    assert fut.result() == 7
    assert reads == 3
    assert (poll.caught_replies, poll.missed_replies) == (1, 0)


async def test_busy_poll_backs_off_after_misses_and_resets_on_a_catch() -> None:
    poll = BusyPoll(1e-6)
    loop = asyncio.get_running_loop()
    polled = []  # True: the request polled (and missed); False: it parked at once
    for _ in range(1 + 1 + 1 + 2 + 1 + 4 + 1):  # miss, skip 1, miss, skip 2, ...
        before = poll.missed_replies
        assert not await poll.caught(loop.create_future(), _NeverRead())
        polled.append(poll.missed_replies > before)
    assert polled == [True, False, True, False, False, True] + [False] * 4 + [True]
    for _ in range(BusyPoll.MAX_SKIP * 4):  # the skips never grow beyond MAX_SKIP
        await poll.caught(loop.create_future(), _NeverRead())
    assert poll._skip <= BusyPoll.MAX_SKIP
    while poll._skip:
        await poll.caught(loop.create_future(), _NeverRead())
    done = loop.create_future()
    done.set_result(None)
    assert await poll.caught(done, _NeverRead())  # a catch resets the back-off
    assert poll._skip == 0
    assert poll._backoff == 0


async def test_busy_poll_yields_to_other_tasks_even_when_the_reply_is_there() -> None:
    poll = BusyPoll(0.01)
    loop = asyncio.get_running_loop()
    ticks = 0

    async def other() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        for _ in range(50):
            fut = loop.create_future()
            fut.set_result(None)
            assert await poll.caught(fut, _NeverRead())
        tg.cancel_scope.cancel()
    assert ticks >= 49


async def test_in_process_connections_never_poll() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address, busy_poll=0.01) as client,
    ):
        await client.put({"x": torch.arange(4)}, "p")
        assert client._links.controller is not None
        assert client._links.controller.inproc
        assert client._links.controller._busy_poll is None  # the service runs on this very loop
        assert all(conn._busy_poll is None for conn in client._links.units.values())


@pytest.mark.parametrize("value", [-1e-6, 0.5, float("nan"), float("inf"), True, "1e-4"])
def test_busy_poll_is_checked(value: object) -> None:
    with pytest.raises(tq.InvalidRequestError, match="busy_poll"):
        tq.AsyncClient.connect("tcp://127.0.0.1:1", busy_poll=value)  # type: ignore[arg-type]


async def test_a_refusal_read_before_the_request_still_says_nothing_listens() -> None:
    # the monitor's refusal event can arrive before the first request is made (a fast
    # machine): the request must still give the precise reason, not a guess
    refused = anyio.Event()
    conn = DealerConnection("tcp://127.0.0.1:9", refused_is_broken=True, on_disconnect=refused.set)
    try:
        with anyio.fail_after(10):
            await refused.wait()
        with pytest.raises(tq.BrokenError, match=r"nothing listens at tcp://127\.0\.0\.1:9"):
            await conn.request(ListPartitions(), timeout=5)
    finally:
        conn.close()


def test_a_refusal_read_before_the_blocking_request_still_says_nothing_listens() -> None:
    conn = BlockingConnection("tcp://127.0.0.1:9", refused_is_broken=True)
    try:
        assert conn._monitor is not None
        # wait (no sleep) until the refusal event is there; the request reads it first
        assert conn._monitor.poll(10_000), "libzmq reported no connection attempt"
        with pytest.raises(tq.BrokenError, match=r"nothing listens at tcp://127\.0\.0\.1:9"):
            conn.request(ListPartitions(), timeout=5)
    finally:
        conn.close()


def _silent_listener() -> tuple[str, socket.socket]:
    """A Unix socket that accepts connections into its backlog and never answers."""
    address = f"uds://@tq-test-{uuid.uuid4().hex}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(abstract_name(address))
    listener.listen(16)
    return address, listener


@pytest.mark.parametrize("blocking", [False, True])
async def test_a_silent_unix_socket_is_waited_for_not_reconnected(blocking: bool) -> None:
    # a Unix socket loses no reply without ending: silence is a busy service, and
    # reconnecting made many waiting clients storm its listen queue; the blocking
    # connection once reconnected anyway
    address, listener = _silent_listener()
    conn: DealerConnection | BlockingConnection
    try:
        if blocking:  # on a thread of its own: a blocking call on a running loop is refused
            conn = blocking_conn = BlockingConnection(address, retry_after=0.05)

            def wait() -> None:
                with pytest.raises(tq.TQTimeoutError):
                    blocking_conn.request(ListPartitions(), timeout=0.5)

            await anyio.to_thread.run_sync(wait)
        else:
            conn = DealerConnection(address, retry_after=0.05)
            with pytest.raises(tq.TQTimeoutError):
                await conn.request(ListPartitions(), timeout=0.5)
        assert conn.reconnects == 0
        conn.close()
    finally:
        listener.close()


async def test_a_request_that_could_not_be_sent_is_not_kept_for_a_resend() -> None:
    address, listener = _silent_listener()
    conn = DealerConnection(address)
    try:
        with pytest.raises(TypeError):
            await conn.request(ListPartitions(), [object()])  # not a buffer
        assert conn._inflight == {}  # (a reconnect would have sent it)
    finally:
        conn.close()
        listener.close()


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_a_request_failed_by_a_break_never_reaches_a_service_that_comes_back() -> None:
    """ZMQ keeps what a DEALER sent while its peer was gone and delivers it once a peer is
    back at the address: a request the client already failed with `BrokenError` would run
    on the new service (seen: a put reported failed ran on a restarted `tq-async serve`).
    The connection replaces its socket when the peer goes away, so the queue goes with it."""
    address = f"tcp://127.0.0.1:{_free_tcp_port()}"
    back = asyncio.Event()
    conn = DealerConnection(address, on_connect=back.set)  # nothing listens: sends queue
    router = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        stale = asyncio.ensure_future(conn.request(ListPartitions(), [b"stale"], timeout=30))
        await anyio.lowlevel.checkpoint()  # sent (queued in the socket)
        conn._disconnected("the peer went away (test)")  # what the monitor reports
        with pytest.raises(tq.BrokenError):
            await stale
        router.setsockopt(zmq.LINGER, 0)
        # as a service's ROUTER does (`RouterEndpoint`): a client connecting again with its
        # identity takes it over (without it, an old connection of the same identity that
        # got through before its socket was gone kept the identity, and the new one's
        # requests were dropped)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        router.bind(address)  # a service comes back at the address
        seen: list[list[bytes]] = []

        def serve() -> None:  # as a service: every message read as it arrives
            while not any(b"fresh" in m for m in seen):  # (a best-effort Cancel may come first)
                assert router.poll(10_000), "nothing arrived"
                seen.append([bytes(f) for f in router.recv_multipart()])

        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, serve)
            with anyio.fail_after(10):
                await back.wait()
            fresh = asyncio.ensure_future(conn.request(ListPartitions(), [b"fresh"], timeout=30))
        assert not any(b"stale" in m for m in seen)
        fresh.cancel()
        with pytest.raises((asyncio.CancelledError, tq.TQError)):
            await fresh
    finally:
        conn.close()
        router.close(linger=0)


@pytest.mark.parametrize("busy_poll", [0.0, 0.05])
async def test_a_connection_used_from_another_event_loop_says_so(busy_poll: float) -> None:
    """A connection reads its socket from the loop that opened it: a request from another
    loop (another thread, or a later ``asyncio.run``) got asyncio's RuntimeError, or, while
    it polled for its reply, read the socket from two threads at once."""
    address, listener = _silent_listener()
    conn = DealerConnection(address, busy_poll=busy_poll)
    try:

        def elsewhere() -> None:
            with pytest.raises(tq.InvalidRequestError, match="another event loop"):
                asyncio.run(conn.request(ListPartitions(), timeout=5))

        await anyio.to_thread.run_sync(elsewhere)
        assert not conn._core.waiting  # nothing was sent
    finally:
        conn.close()
        listener.close()


def test_a_client_opened_in_an_earlier_asyncio_run_says_so() -> None:
    with tq.background_cluster(num_storage_units=1) as cluster:

        async def opened() -> tq.AsyncClient:
            return await tq.AsyncClient.connect(cluster.address).open()

        client = asyncio.run(opened())
        try:
            with pytest.raises(tq.InvalidRequestError, match="another event loop"):
                asyncio.run(client.list_partitions())
        finally:
            asyncio.run(client.aclose())


@pytest.mark.parametrize(
    "address", ["tcp://127.0.0.1", "tcp://127.0.0.1:abc", "tcp://h:9 ", "tcp://127.0.0.1:70000"]
)
async def test_an_address_zmq_cannot_parse_is_the_callers_error(address: str) -> None:
    # not BrokenError: that one says "retry once it is back", and a retry fails the same way
    with pytest.raises(tq.InvalidRequestError, match=r"tcp://HOST:PORT"):
        async with tq.AsyncClient.connect(address):
            pass

    def blocking() -> None:
        with (
            pytest.raises(tq.InvalidRequestError, match=r"tcp://HOST:PORT"),
            tq.Client.connect(address),
        ):
            pass

    await anyio.to_thread.run_sync(blocking)


async def test_a_forked_child_dials_the_given_address_when_the_twin_is_full() -> None:
    """A forked child re-dials the controller at the address its parent used, its same-host
    twin: with that twin's listen queue full the dial failed and left the child's client
    without a controller connection (ClosedError "not connected" on every call after)."""
    address, listener = _silent_listener()
    listener.listen(0)
    client = tq.AsyncClient.connect("tcp://127.0.0.1:9")
    links = client._links
    parent = links.controller = links.controller_connection(address, known_as=client.address)
    try:  # (the parent's connection fills the queue)
        links._pid = -1  # as in a child forked from the process that opened the client
        conn = links.ctl()
        assert conn.address == client.address
    finally:
        parent.close()
        links.close()
        listener.close()


def test_a_blocking_connection_to_a_full_unix_listen_queue_fails_at_once() -> None:
    """A Unix socket's blocking connect waits while the listener's queue is full (a paused
    or swamped service): the blocking client hung there, unbounded; the async one fails with
    EAGAIN at once, and a same-host switch falls back to the socket it has."""
    address, listener = _silent_listener()
    listener.listen(0)
    queued = []
    try:
        while True:  # fill the queue
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(abstract_name(address))
            except BlockingIOError:
                sock.close()
                break
            queued.append(sock)
        outcome: list[BaseException | None] = []

        def connect() -> None:
            try:
                BlockingConnection(address).close()
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=connect, daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), "the connect waited for room in the listen queue"
        assert isinstance(outcome[0], tq.BrokenError)
        assert "listen queue is full" in str(outcome[0])
    finally:
        listener.close()  # (wakes a connect that waits)
        for sock in queued:
            sock.close()
