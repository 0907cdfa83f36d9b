"""Same-host control plane: a client of a ``tq-async serve`` on its host talks to the
controller over the controller's Unix-socket twin (``tq_async._transport._unix``) once it has
proven it
is the same controller, and to the units over their ipc twins; ``same_host=False`` keeps the
addresses as given."""

from __future__ import annotations

import re
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

import tq_async as tq
from _cluster_proc import _read_address, serve_cluster, serve_role
from tq_async._errors import BrokenError
from tq_async._transport._endpoints import same_host_ipc
from tq_async._transport._unix import abstract_name

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="abstract sockets: Linux only")


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    with serve_cluster(storage_units=2) as addr:
        yield addr


async def test_a_same_host_client_uses_the_unix_twins(address: str) -> None:
    async with tq.AsyncClient.connect(address) as client:
        assert client._links.controller is not None
        assert client._links.controller.address.startswith("uds://@tq-")
        meta = await client.put({"x": torch.arange(40_000)}, partition_id="twin")
        td, got = await client.get(["x"], 40_000, "twin", "t")
        assert torch.equal(td["x"], torch.arange(40_000))
        assert got.global_indexes == meta.global_indexes
        assert all(c.address.startswith("uds://@tq-") for c in client._links.units.values())
        await client.clear_partition("twin")


async def test_same_host_false_keeps_the_given_addresses(address: str) -> None:
    async with tq.AsyncClient.connect(address, same_host=False) as client:
        assert client._links.controller is not None
        assert client._links.controller.address == address
        await client.put({"x": torch.arange(40_000)}, partition_id="far")
        td, _ = await client.get(["x"], 40_000, "far", "t")
        assert torch.equal(td["x"], torch.arange(40_000))
        assert all(c.address.startswith("tcp://") for c in client._links.units.values())
        await client.clear_partition("far")


async def test_a_put_arriving_while_the_client_moves_to_a_unit_twin_is_not_caught(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new client's first put links the unit's arena and moves to its Unix twin (closing
    the TCP connection); a put that arrives meanwhile must wait for the move, not send on
    the connection about to close (ClosedError, seen in the ingest benchmark)."""
    batch = {"x": torch.arange(32_768)}  # 128 KiB a unit: through shared memory
    async with tq.AsyncClient.connect(address) as client:
        links = client._links
        at_gate, gate = anyio.Event(), anyio.Event()
        connection = links.connection

        def gated(target: str, **kw: Any) -> Any:
            conn = connection(target, **kw)
            if target.startswith("uds://") and kw.get("known_as"):  # a unit's twin
                request = conn.request

                async def hold_hello(body: Any, *a: Any, **k: Any) -> Any:
                    if type(body).__name__ == "ShmHello" and not gate.is_set():
                        at_gate.set()
                        await gate.wait()
                    return await request(body, *a, **k)

                conn.request = hold_hello  # type: ignore[method-assign]
            return conn

        monkeypatch.setattr(links, "connection", gated)
        got: list[Any] = []

        async def second() -> None:
            got.append(await links.data_link(0))

        async with anyio.create_task_group() as tg:
            tg.start_soon(client.put, batch, "moving")  # links, then waits at the gate
            await at_gate.wait()
            tg.start_soon(second)  # arrives during the move
            await anyio.wait_all_tasks_blocked()
            assert got == []  # it waits for the move: the TCP connection is about to close
            tg.start_soon(client.put, batch, "moving")
            await anyio.wait_all_tasks_blocked()
            gate.set()
        conn, arena = got[0]
        assert conn.address.startswith("uds://@tq-")
        assert arena is not None
        assert all(c.address.startswith("uds://@tq-") for c in links.units.values())
        assert (await client.partition_info("moving"))["rows"] == 2 * 32_768
        await client.clear_partition("moving")


def test_only_listed_abstract_sockets_count() -> None:
    assert not same_host_ipc("uds://@tq-does-not-exist")
    assert not same_host_ipc("tcp://127.0.0.1:5555")
    assert not same_host_ipc(None)


async def test_garbage_on_the_unix_socket_is_dropped(address: str) -> None:
    async with tq.AsyncClient.connect(address) as client:
        assert client._links.controller is not None
        name = abstract_name(client._links.controller.address)
        for garbage in (
            b"\xff\xff\xff\xff",  # oversized length
            struct.pack("<II", 8, 9) + b"xxxx",  # frame count beyond the message
            struct.pack("<I", 12) + struct.pack("<II", 1, 4) + b"nope",  # no hello first
        ):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(name)
                s.sendall(garbage)
                s.settimeout(10)
                assert s.recv(10) == b""  # the service hangs up on it
        # and still serves
        assert await client.list_partitions() is not None


async def test_a_dead_controller_breaks_a_unix_connection_at_once() -> None:
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, read with a deadline
        [sys.executable, "-m", "tq_async._deploy._cli", "serve", "--storage-units", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        address = _read_address(proc)
        async with tq.AsyncClient.connect(address, retry_after=None) as client:
            assert client._links.controller is not None
            assert client._links.controller.address.startswith("uds://")
            await client.put({"x": torch.arange(4)}, partition_id="p")
            waiting = client.get_meta(["x"], 100, "p", "t")  # parks in the controller
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:

                    async def kill() -> None:  # runs once the get_meta has gone out
                        proc.send_signal(signal.SIGKILL)

                    tg.start_soon(kill)
                    # named by the address the program connected to, the socket after it
                    with pytest.raises(BrokenError, match=rf"{re.escape(address)} \(uds://@tq-"):
                        await waiting
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


def test_a_blocking_client_names_the_address_it_connected_to_when_broken() -> None:
    with serve_role("--storage-units", "1") as (proc, address):
        client = tq.Client.connect(address, retry_after=None)
        with client:
            assert client._links.controller is not None
            assert client._links.controller.address.startswith("uds://")
            client.put({"x": torch.arange(4)}, partition_id="p")
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            # the next call sees the socket's end before it uses it (as the AsyncClient, which
            # reads in the background) and dials the address again: what it says names the
            # address the program connected to (a break during a call names the socket after
            # it: the AsyncClient's test above)
            with pytest.raises(BrokenError, match=rf"nothing listens at {re.escape(address)} "):
                client.get_meta(["x"], 100, "p", "t", timeout=10)


def _raw(frames: list[bytes]) -> bytes:
    from tq_async._transport._unix import encode

    return b"".join(bytes(part) for part in encode(frames))


def test_the_stream_reads_messages_whole_however_they_arrive() -> None:
    """Many messages in one read, messages across a full read chunk, and a large message in
    pieces: each comes out whole, in order, once all of its bytes are in."""
    from tq_async._transport._unix import _CHUNK, MessageStream

    ours, theirs = socket.socketpair()
    with ours, theirs:
        stream = MessageStream(ours)

        def got() -> list[list[bytes]]:
            stream.fill()
            out = [
                [bytes(f.buffer if i == 0 else f) for i, f in enumerate(m)] for m in stream.messages
            ]
            stream.messages.clear()
            return out

        small = [[b"h%d" % i, b"x" * i] for i in range(50)]
        theirs.sendall(b"".join(_raw(m) for m in small))
        assert got() == small

        wide = [[b"w%d" % i, bytes([i]) * (_CHUNK * 2 // 3)] for i in range(3)]  # > one chunk
        theirs.sendall(b"".join(_raw(m) for m in wide))
        assert got() == wide

        big = [b"big", bytes(range(256)) * (3 * _CHUNK // 256)]
        raw = _raw(big)
        step = len(raw) // 4 + 1
        for start in range(0, len(raw) - step, step):
            theirs.sendall(raw[start : start + step])
            assert got() == []  # not whole yet
        theirs.sendall(raw[start + step :])
        assert got() == [big]

        theirs.close()
        assert got() == []
        assert stream.eof


async def test_small_requests_catch_their_replies_by_polling(address: str) -> None:
    async with tq.AsyncClient.connect(address, busy_poll=0.01) as client:
        conn = client._links.controller
        assert conn is not None
        assert conn.address.startswith("uds://")
        assert conn._busy_poll is not None
        await client.put({"x": torch.arange(64)}, partition_id="poll")
        for i in range(8):
            meta = await client.get_meta(["x"], 8, "poll", "t")
            assert meta.global_indexes == list(range(8 * i, 8 * i + 8))
        assert conn._busy_poll.caught_replies >= 1


async def test_a_waiting_get_meta_parks_and_still_gets_its_rows(address: str) -> None:
    async with (
        tq.AsyncClient.connect(address, busy_poll=0.01) as consumer,
        tq.AsyncClient.connect(address) as producer,
    ):
        assert consumer._links.controller is not None
        assert consumer._links.controller._busy_poll is not None
        poll = consumer._links.controller._busy_poll
        missed = poll.missed_replies
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                td, _ = await consumer.get(["x"], 4, "late", "t")
                assert td["x"].tolist() == [5, 6, 7, 8]
                tg.cancel_scope.cancel()

            tg.start_soon(consume)
            with anyio.fail_after(20):
                while poll.missed_replies == missed:  # the get_meta polled, found nothing
                    await anyio.lowlevel.checkpoint()  # (while it polls, this loop cannot run)
            await producer.put({"x": torch.arange(5, 9)}, partition_id="late")
            await anyio.sleep_forever()


async def test_a_paused_service_times_a_polling_request_out_and_serves_after() -> None:
    with serve_role("--storage-units", "1") as (proc, address):
        async with tq.AsyncClient.connect(
            address, busy_poll=0.01, request_timeout=1.0, retry_after=None
        ) as client:
            assert client._links.controller is not None
            assert client._links.controller._busy_poll is not None
            proc.send_signal(signal.SIGSTOP)
            try:
                with anyio.fail_after(20), pytest.raises(tq.TQTimeoutError):
                    await client.list_partitions()
            finally:
                proc.send_signal(signal.SIGCONT)
            assert client._links.controller._busy_poll.missed_replies >= 1
            assert await client.list_partitions() == []


async def test_a_request_waiting_when_the_controller_moves_to_its_twin_breaks_retryably(
    address: str,
) -> None:
    """Moving the controller's connection to its same-host twin (at connect, and when the
    client finds a restarted controller again) closes the old connection: a request still
    waiting on it fails with BrokenError, which says "retry" (a chaos run caught ClosedError,
    the error of a client closed by its own program)."""
    async with tq.AsyncClient.connect(address, same_host=False) as client:
        links = client._links
        old = links.controller
        assert old is not None
        assert old.address == address
        hello = await links.refresh_units()
        failed: list[BaseException] = []
        async with anyio.create_task_group() as tg:

            async def wait() -> None:
                try:
                    await client.get_meta(["x"], 4, "never", "t", timeout=30)
                except tq.TQError as exc:
                    failed.append(exc)

            tg.start_soon(wait)
            await anyio.wait_all_tasks_blocked()  # its GetMeta went out on the TCP link
            await links.prefer_ipc(hello)
        assert links.controller is not old
        assert links.controller is not None
        assert links.controller.address.startswith("uds://@tq-")
        [exc] = failed
        assert isinstance(exc, BrokenError), repr(exc)
        assert "retry" in str(exc)
        assert await client.list_partitions() is not None  # the twin answers


async def test_a_message_over_256_mib_crosses_a_unix_socket_whole() -> None:
    """ZMQ carries a message of any size; the Unix-socket twin took one over 256 MiB for a
    malformed frame and dropped the connection (a read of a large batch through a unit's twin,
    its cells not in shared memory, broke and went again over TCP)."""
    from tq_async._transport._dealer import DealerConnection
    from tq_async._transport._router import RouterEndpoint
    from tq_async._wire._protocol import ListPartitions, ok_reply, salvage_rid

    def echo(peer: bytes, frames: list[Any]) -> None:
        rid = salvage_rid(frames[0].buffer)
        assert rid is not None
        endpoint.send(peer, [ok_reply(rid, None), *frames[1:]])

    endpoint = RouterEndpoint("tcp://127.0.0.1:0", echo, twin="uds")
    assert endpoint.ipc_address is not None
    conn = DealerConnection(endpoint.ipc_address)
    try:
        big = bytearray((256 << 20) + 1)
        big[-1] = 7
        with anyio.fail_after(60):
            _, frames = await conn.request(ListPartitions(), [big], timeout=60)
        assert len(frames) == 1
        assert memoryview(frames[0]).nbytes == len(big)
        assert memoryview(frames[0])[-1] == 7
    finally:
        conn.close()
        endpoint.close()


async def test_a_message_past_4_gib_fails_clearly_on_a_unix_socket() -> None:
    """The Unix socket's wire says a message's size in 32 bits: a bigger one raised
    struct.error from the client's request, and a reply that big was dropped by the service
    (its client waited out its timeout). Either way the connection now ends with a
    `BrokenError` at once (a client's unit request goes again over TCP, which has no limit)."""
    import mmap

    from tq_async._transport._dealer import DealerConnection
    from tq_async._transport._router import RouterEndpoint
    from tq_async._wire._protocol import ListPartitions, ok_reply, salvage_rid

    huge = mmap.mmap(-1, 1 << 32)  # address space only: never written, never sent

    def reply_huge(peer: bytes, frames: list[Any]) -> None:
        rid = salvage_rid(frames[0].buffer)
        assert rid is not None
        endpoint.send(peer, [ok_reply(rid, None), huge])

    endpoint = RouterEndpoint("tcp://127.0.0.1:0", reply_huge, twin="uds")
    assert endpoint.ipc_address is not None
    conns = [DealerConnection(endpoint.ipc_address) for _ in range(2)]
    try:
        with pytest.raises(BrokenError, match="4 GiB"):
            await conns[0].request(ListPartitions(), [huge], timeout=30)
        with anyio.fail_after(20), pytest.raises(BrokenError):
            await conns[1].request(ListPartitions(), timeout=30)
    finally:
        for conn in conns:
            conn.close()
        endpoint.close()


@pytest.mark.parametrize("same_host", [True, False])
def test_closing_a_blocking_client_from_another_thread_fails_its_waiting_call(
    address: str, same_host: bool
) -> None:
    """A blocking call waits in ``poll`` on its sockets; a ``close()`` from another thread
    released them under it: the call then failed with AttributeError or ZMQError, and only
    once its own timeout passed (a call without one hung). It fails with ClosedError, and
    its get_meta takes no rows for nobody."""
    import threading

    partition = f"closed-{same_host}"
    client = tq.Client.connect(address, same_host=same_host).open()
    conn = client._links.controller
    assert conn is not None
    parked = threading.Event()
    park = conn._park

    def parking(seconds: float | None) -> None:
        parked.set()
        park(seconds)

    conn._park = parking  # type: ignore[method-assign]
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            client.get_meta(["x"], 2, partition, "t", timeout=60)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    assert parked.wait(30)
    client.close()
    thread.join(10)
    assert not thread.is_alive(), "the waiting call did not see the close"
    assert isinstance(outcome[0], tq.ClosedError), outcome
    with tq.Client.connect(address) as other:
        other.put({"x": torch.arange(2)}, partition_id=partition)
        assert other.get_meta(["x"], 2, partition, "t", timeout=30).size == 2


#: a program that set SIGPIPE back to its default (CLIs do, to die quietly in a `| head`)
#: writes to Unix-socket peers that are gone: a reply to a killed client, a request to a
#: killed service; both the first write and the flush of what did not fit
_SIGPIPE_DEFAULT = """
import signal, socket, zmq
from tq_async._transport._unix import MessageStream
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
mine, theirs = socket.socketpair()
theirs.close()
try:
    MessageStream(mine).write([b"reply"], lambda: None)
except zmq.ZMQError as exc:
    print("write:", exc)
mine, theirs = socket.socketpair()
stream = MessageStream(mine)
stream.write([bytes(64 << 20)], lambda: None)  # more than the socket takes at once
assert stream.blocked
theirs.close()
print("flush:", stream.flush(), stream.eof)
"""


def test_a_write_to_a_peer_that_is_gone_fails_where_sigpipe_would_kill() -> None:
    """Writes to a Unix socket whose peer is gone raised SIGPIPE: in a process where it is
    not ignored (Python ignores it, a program may restore it) it killed the process, a
    service or a client, instead of failing the one connection."""
    done = subprocess.run(
        [sys.executable, "-c", _SIGPIPE_DEFAULT],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, (done.returncode, done.stderr)  # -13: killed by SIGPIPE
    assert "write: the peer went away" in done.stdout
    assert "flush: True True" in done.stdout
