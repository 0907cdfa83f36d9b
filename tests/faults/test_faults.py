"""Fault injection: storage units die mid-get and mid-put; nothing hangs, nothing half-visible."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import partial

import anyio
import pytest
import structlog
import torch

import tq_async as tq
from tq_async._controller._server import ControllerServer, Deadlines
from tq_async._core._state import ControllerState
from tq_async._storage._server import StorageServer
from tq_async._wire._protocol import StoreClear, StorePut, storage_request_decoder

UNIT_PROCESS = textwrap.dedent(
    """
    import anyio, sys
    from tq_async._storage._server import StorageServer

    async def main():
        async with anyio.create_task_group() as tg:
            address = await tg.start(StorageServer(1).serve, "tcp://127.0.0.1:0")
            print(address, flush=True)

    anyio.run(main)
    """
)

BLACK_HOLE = textwrap.dedent(
    """
    import zmq
    sock = zmq.Context().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(f"tcp://127.0.0.1:{port}", flush=True)
    while True:
        sock.recv_multipart()  # swallow every request, never answer
    """
)


@contextmanager
def process(script: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address.startswith("tcp://"), address
        yield proc, address
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


@asynccontextmanager
async def cluster_with_remote_unit(
    remote: str, deadlines: Deadlines | None = None
) -> AsyncIterator[ControllerServer]:
    """Unit 0 in this loop, unit 1 at ``remote``; the first put lands on 0, the next on 1."""
    async with anyio.create_task_group() as tg:
        local = StorageServer(0)
        addresses = {0: await tg.start(local.serve, "tcp://127.0.0.1:0"), 1: remote}
        controller = ControllerServer(ControllerState(addresses), deadlines=deadlines)
        await tg.start(controller.serve, "tcp://127.0.0.1:0")
        try:
            yield controller
        finally:
            tg.cancel_scope.cancel()


async def until(predicate: object, seconds: float = 10) -> None:
    """Yield to the loop until ``predicate()`` holds (event processing, bounded in time)."""
    with anyio.fail_after(seconds):
        while not predicate():  # type: ignore[operator]
            await anyio.lowlevel.checkpoint()


async def _put_failing(client: tq.AsyncClient, failure: list[BaseException]) -> None:
    """The second put of these tests (rows 2-3, to unit 1): its failure goes in ``failure``."""
    try:
        await client.put({"x": torch.arange(2, 4)}, "p")
    except tq.TQError as exc:
        failure.append(exc)


async def _only_the_first_put_is_visible(client: tq.AsyncClient) -> None:
    """The failed put's rows were removed, none half-visible: only the first put's two."""
    info = await client.partition_info("p")
    assert info["rows"] == 2
    got = await client.get_meta(["x"], 2, "p", "t", mode="peek")
    assert got.global_indexes == [0, 1]


async def test_unit_killed_after_it_holds_rows() -> None:
    with process(UNIT_PROCESS) as (proc, remote):
        async with (
            cluster_with_remote_unit(remote) as controller,
            tq.AsyncClient.connect(controller.address, request_timeout=5) as client,
        ):
            safe = await client.put({"x": torch.arange(4)}, "p")
            doomed = await client.put({"x": torch.arange(4, 8)}, "p")
            assert set(safe.units) == {0}
            assert set(doomed.units) == {1}
            assert (await client.get_data(doomed))["x"].tolist() == [4, 5, 6, 7]
            os.kill(proc.pid, signal.SIGKILL)
            await until(lambda: 1 in controller.state.dead_units)
            lost = await client.lost_rows("p")
            # the unit's process is gone (reconnecting is refused): lost at once, not suspended
            assert lost == {"dead_units": [1], "suspended_units": [], "rows": {"p": [4, 5, 6, 7]}}
            # reads touching the dead unit fail clearly and quickly; the rest still reads
            with anyio.fail_after(10), pytest.raises((tq.BrokenError, tq.TQTimeoutError)):
                await client.get_data(doomed)
            assert (await client.get_data(safe))["x"].tolist() == [0, 1, 2, 3]
            # lost rows are never handed out; new puts avoid the dead unit
            assert (await client.partition_info("p"))["rows"] == 4
            got = await client.get_meta(["x"], 4, "p", "t", mode="peek")
            assert got.global_indexes == [0, 1, 2, 3]
            again = await client.put({"x": torch.arange(2)}, "p")
            assert set(again.units) == {0}
            with pytest.raises(tq.RowsNotFound, match="lost with storage unit 1"):
                await client.put({"y": torch.zeros(4)}, meta=doomed)


async def test_a_read_from_a_dead_unit_names_the_unit() -> None:
    """A read of rows on a unit that died failed with "nothing listens at tcp://... check
    the address": an address the program never gave (the controller listed it), and no word
    of which unit or how to learn whether its rows are lost; now it names the storage unit
    and points at `lost_rows`."""
    with process(UNIT_PROCESS) as (proc, remote):
        async with (
            cluster_with_remote_unit(remote) as controller,
            tq.AsyncClient.connect(controller.address, request_timeout=5) as client,
        ):
            await client.put({"x": torch.arange(2)}, "p")  # unit 0
            doomed = await client.put({"x": torch.arange(2, 4)}, "p")
            assert (await client.get_data(doomed))["x"].tolist() == [2, 3]
            os.kill(proc.pid, signal.SIGKILL)
            await until(lambda: 1 in controller.state.dead_units)
            with anyio.fail_after(10), pytest.raises(tq.BrokenError) as failed:
                await client.get_data(doomed)
            message = str(failed.value)
            assert "storage unit 1" in message, message
            assert "lost_rows" in message, message


async def test_unit_killed_mid_put_leaves_nothing_half_visible() -> None:
    """The three-step put (client -> unit directly) to a unit that dies."""
    with process(BLACK_HOLE) as (proc, remote):
        async with (
            cluster_with_remote_unit(remote) as controller,
            tq.AsyncClient.connect(
                controller.address, request_timeout=30, inline_put_bytes=0
            ) as client,
        ):
            await client.put({"x": torch.arange(2)}, "p")  # unit 0
            failure: list[BaseException] = []
            doomed_put = partial(_put_failing, client, failure)  # unit 1: never answers

            async with anyio.create_task_group() as tg:
                tg.start_soon(doomed_put)
                await until(lambda: any(c.connected for c in client._links.units.values()))
                await until(lambda: 1 in client._links.units and client._links.units[1].connected)
                os.kill(proc.pid, signal.SIGKILL)
            # the put failed fast with BrokenError (well before its 30 s timeout)
            assert isinstance(failure[0], tq.BrokenError)
            await _only_the_first_put_is_visible(client)


#: accepts TCP connections (the kernel does, into its backlog) but never speaks ZMTP: a unit
#: whose process is killed before the controller's connection to it finished its handshake
SILENT_LISTENER = textwrap.dedent(
    """
    import socket, time
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    print(f"tcp://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    while True:
        time.sleep(3600)
    """
)


async def test_unit_killed_before_its_handshake_fails_the_forwarded_put_fast() -> None:
    """A unit killed before the controller's connection to it was ever up (a loaded
    machine: the handshake had not completed): reconnecting is refused, the unit is
    suspended and lost at once -- and the put the controller forwarded to it fails then
    with BrokenError, not after the unit's 30 s timeout."""
    with process(SILENT_LISTENER) as (proc, remote):
        async with (
            cluster_with_remote_unit(remote) as controller,
            tq.AsyncClient.connect(controller.address, request_timeout=30) as client,
        ):
            await client.put({"x": torch.arange(2)}, "p")  # unit 0
            failure: list[BaseException] = []
            doomed_put = partial(_put_failing, client, failure)  # unit 1: no handshake

            with anyio.fail_after(20):  # (the unit's own timeout is 30 s)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(doomed_put)
                    await until(lambda: _store_put_in_flight(controller, 1))
                    assert controller._links.conns[1]._core.handshaken is False
                    os.kill(proc.pid, signal.SIGKILL)
            assert 1 in controller.state.dead_units
            assert isinstance(failure[0], tq.BrokenError), failure
            assert "storage unit 1" in str(failure[0]), failure
            await _only_the_first_put_is_visible(client)


async def test_a_clear_with_rows_on_a_suspended_unit_answers_at_once() -> None:
    """A paused unit (SIGSTOP) is suspended; a clear of a partition with rows on it is done
    in the controller and answered at once (it failed after the unit's 30 s timeout: the
    kernel of the paused process still accepts the controller's reconnection, so the
    unit's StoreClear waited for a handshake that never came). The unit frees the cells
    when it comes back, as it frees those of any clear it missed."""
    with process(UNIT_PROCESS) as (proc, remote):
        async with (
            cluster_with_remote_unit(remote, Deadlines(unit_suspend_after=1)) as controller,
            tq.AsyncClient.connect(controller.address, request_timeout=60) as client,
        ):
            await client.put({"x": torch.arange(2)}, "p")  # unit 0
            on_1 = await client.put({"x": torch.arange(2, 4)}, "p")
            assert set(on_1.units) == {1}
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                await until(lambda: 1 in controller.state.suspended)
                with anyio.fail_after(10):  # (the unit's own timeout is 30 s)
                    await client.clear_partition("p")
                assert "p" not in await client.list_partitions()
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            await until(lambda: not controller.state.suspended)
            with anyio.fail_after(10):  # its cells are freed once it is back
                while (await client.storage_stats())[1]["rows"]:
                    await anyio.lowlevel.checkpoint()
            assert (await client.storage_stats())[0]["rows"] == 0


async def test_a_clear_whose_unit_dies_mid_way_answers_ok() -> None:
    """A unit killed while the controller's StoreClear to it is in flight: the clear is done
    in the controller, and the unit's cells are gone with it (or freed once it is back, as
    after any clear it missed). The clear failed ("freeing storage failed: unit 1: the
    connection ... broke") and the controller logged it with a traceback; now it answers
    ok, quietly."""
    with process(UNIT_PROCESS) as (proc, remote):
        async with (
            cluster_with_remote_unit(remote) as controller,
            tq.AsyncClient.connect(controller.address, request_timeout=30) as client,
        ):
            await client.put({"x": torch.arange(2)}, "p")  # unit 0
            on_1 = await client.put({"x": torch.arange(2, 4)}, "p")
            assert set(on_1.units) == {1}
            os.kill(proc.pid, signal.SIGSTOP)  # (not suspended yet: its clear goes out)
            failure: list[BaseException] = []

            async def clear() -> None:
                try:
                    await client.clear_partition("p")
                except tq.TQError as exc:
                    failure.append(exc)

            with structlog.testing.capture_logs() as logs, anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(clear)
                    await until(lambda: _in_flight(controller, 1, StoreClear) > 0)
                    os.kill(proc.pid, signal.SIGKILL)
            assert not failure, failure
            assert not [e for e in logs if e["log_level"] == "error" and "exc_info" in e], logs
            assert "p" not in await client.list_partitions()


def _store_put_in_flight(controller: ControllerServer, unit_id: int) -> bool:
    return _store_puts_in_flight(controller, unit_id) > 0


def _store_puts_in_flight(controller: ControllerServer, unit_id: int) -> int:
    return _in_flight(controller, unit_id, StorePut)


def _in_flight(controller: ControllerServer, unit_id: int, kind: type) -> int:
    conn = controller._links.conns.get(unit_id)
    if conn is None:
        return 0
    found = 0
    for frames in conn._inflight.values():
        header = frames[0]
        req = storage_request_decoder.decode(header if isinstance(header, bytes) else bytes(header))
        found += isinstance(req.body, kind)
    return found


async def test_unit_killed_mid_inline_put_leaves_nothing_half_visible() -> None:
    """The one-message put: the controller forwards to a remote unit that dies."""
    with process(BLACK_HOLE) as (proc, remote):
        async with (
            cluster_with_remote_unit(remote) as controller,
            tq.AsyncClient.connect(controller.address, request_timeout=30) as client,
        ):
            await client.put({"x": torch.arange(2)}, "p")  # unit 0
            failure: list[BaseException] = []
            doomed_put = partial(_put_failing, client, failure)  # unit 1: never answers

            async with anyio.create_task_group() as tg:
                tg.start_soon(doomed_put)
                # the controller watches every unit from the start (and asks each for its
                # instance when it connects): wait for the forwarded StorePut itself
                await until(lambda: _store_put_in_flight(controller, 1))
                os.kill(proc.pid, signal.SIGKILL)
            assert not client._links.units  # the client never talked to a unit itself
            # the put failed fast (well before its 30 s timeout), with the unit's loss
            assert isinstance(failure[0], tq.BrokenError)
            # ... and says which: the client talks to the controller, the address is a unit's,
            # and waiting for it to be "back" is not what to do (a new put goes elsewhere)
            message = str(failure[0])
            assert "storage unit 1" in message, message
            assert "put it again" in message, message
            await _only_the_first_put_is_visible(client)


async def test_puts_failed_by_a_dead_unit_log_no_traceback_flood() -> None:
    """Puts the controller forwarded to a unit that dies fail with BrokenError: an expected
    outage, not a bug. The controller logged each at ERROR with a full traceback ("controller
    request failed"), a flood during an outage; now one warning line, no traceback (the unit's
    loss has its own line), the rest counted."""
    with process(BLACK_HOLE) as (proc, remote):
        async with (
            cluster_with_remote_unit(remote) as controller,
            tq.AsyncClient.connect(controller.address, request_timeout=30) as client,
        ):
            await client.put({"x": torch.arange(2)}, "p")  # unit 0
            failures: list[BaseException] = []

            async def doomed_put(i: int) -> None:
                try:
                    await client.put({"x": torch.arange(2) + 10 * i}, "p")
                except tq.TQError as exc:
                    failures.append(exc)

            with structlog.testing.capture_logs() as logs:
                async with anyio.create_task_group() as tg:
                    for i in range(1, 7):
                        tg.start_soon(doomed_put, i)
                    await until(lambda: _store_puts_in_flight(controller, 1) >= 3)
                    os.kill(proc.pid, signal.SIGKILL)
            assert len(failures) >= 3, failures
            assert all(isinstance(exc, tq.BrokenError) for exc in failures), failures
            failed = [e for e in logs if "request failed" in e["event"]]
            assert not [e for e in logs if e.get("exc_info") is not None], failed
            assert not [e for e in logs if e["log_level"] == "error" and e in failed], failed
            assert len(failed) == 1, failed


async def test_lost_reply_is_retried_and_delivered_exactly_once() -> None:
    """A transport that loses a reply: the client retries, the server deduplicates."""
    async with tq.local_cluster(num_storage_units=1) as cluster:
        endpoint = cluster.controller._endpoint
        assert endpoint is not None
        real_send = endpoint.send
        lose_next: list[bool] = [False]
        lost: list[list[bytes]] = []

        def lossy_send(peer: bytes, frames: list[bytes]) -> None:
            if lose_next[0]:
                lose_next[0] = False
                lost.append(frames)
                return
            real_send(peer, frames)

        endpoint.send = lossy_send  # type: ignore[method-assign]
        async with tq.AsyncClient.connect(
            cluster.address, request_timeout=10, retry_after=0.2
        ) as client:
            await client.put({"x": torch.arange(8)}, "p")
            lose_next[0] = True
            got = await client.get_meta(["x"], 4, "p", "t")
            assert len(lost) == 1  # the first reply was really lost
            assert got.global_indexes == [0, 1, 2, 3]
            # the retry did not consume a second batch: the next one is the rest
            rest = await client.get_meta(["x"], 4, "p", "t", timeout=5)
            assert rest.global_indexes == [4, 5, 6, 7]
            assert await client.check_consumption_status("p", "t")


async def test_lost_reply_of_a_call_with_a_deadline_reconnects() -> None:
    async with tq.local_cluster(num_storage_units=1) as cluster:
        endpoint = cluster.controller._endpoint
        assert endpoint is not None
        real_send = endpoint.send
        lose_next = [False]

        def lossy_send(peer: bytes, frames: list[bytes]) -> None:
            if lose_next[0]:
                lose_next[0] = False
                return
            real_send(peer, frames)

        endpoint.send = lossy_send  # type: ignore[method-assign]
        async with tq.AsyncClient.connect(
            cluster.address, request_timeout=10, retry_after=0.2
        ) as client:
            await client.put({"x": torch.arange(4)}, "p")
            lose_next[0] = True
            meta = await client.put({"x": torch.arange(4, 6)}, "p")  # its PutBegin reply is lost
            assert client._links.ctl().reconnects >= 1
            assert meta.global_indexes == [4, 5]  # one allocation, not two
            assert (await client.partition_info("p"))["allocated"] == 6


async def test_a_recorded_share_never_hands_out_rows_lost_with_a_unit() -> None:
    """Rank 0 reads global batch 0 (its share on unit 0; rank 1's share, on unit 1, is
    recorded for rank 1). Unit 1's process is SIGKILLed: its rows are lost. Rank 1 then reads
    batch 0: it gets its share without the lost rows (here an empty batch, still in step with
    rank 0), never rows whose read can only fail."""
    with process(UNIT_PROCESS) as (proc, remote):
        async with (
            cluster_with_remote_unit(remote) as controller,
            tq.AsyncClient.connect(controller.address, request_timeout=5) as client,
        ):
            await client.put({"x": torch.arange(4)}, "p")  # unit 0
            doomed = await client.put({"x": torch.arange(4, 8)}, "p")  # unit 1
            assert set(doomed.units) == {1}

            def cfg(rank: int) -> dict[str, int]:
                return {"dp_rank": rank, "batch_index": 0, "dp_size": 2}

            first = await client.get_meta(["x"], 4, "p", "t", cfg(0))
            assert len(first) == 4
            other = sorted(set(range(8)) - set(first.global_indexes))
            os.kill(proc.pid, signal.SIGKILL)
            await until(lambda: 1 in controller.state.dead_units)
            lost = set((await client.lost_rows("p"))["rows"]["p"])
            assert lost == {4, 5, 6, 7}
            second = await client.get_meta(["x"], 4, "p", "t", cfg(1))
            assert not second.end_of_stream
            assert second.global_indexes == [r for r in other if r not in lost]
            with anyio.fail_after(10):
                td = await client.get_data(second)
            assert td["x"].tolist() == second.global_indexes
