"""Many clients on one ``tq-async serve``: what an idle connection costs the services, and a
same-host handshake that a stalled unit does not answer in time (it degrades to the socket
path; no request fails for it).

The full-size measurement is ``python -m benchmarks.capacity`` (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import os
import signal
import time

import anyio
import pytest
import torch

import tq_async as tq
from _cluster_proc import serve_role
from tq_async._client._async import _same_host

pytestmark = pytest.mark.skipif(
    not hasattr(os, "memfd_create") or not hasattr(os, "pidfd_open"), reason="Linux only"
)

#: the issue's target: services' memory per idle client connection
IDLE_BYTES_PER_CONNECTION = 16 << 10


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _open_linked(address: str) -> tq.AsyncClient:
    client = tq.AsyncClient.connect(address)
    await client.open()
    for unit in sorted(client._links.unit_addresses):  # every data path an active client opens
        await client._links.data_link(unit)
    return client


@pytest.mark.timeout(120)
async def test_idle_connections_cost_the_services_little() -> None:
    """Hundreds of idle clients, each linked to the controller and every unit (its Unix
    sockets, shared-memory handshake done): the services grow by at most 16 KiB and about
    one descriptor per connection."""
    n, units = 300, 2
    with serve_role("--storage-units", str(units)) as (proc, address):
        # one client first: the services' one-off costs (imports, caches) are not per client
        first = await _open_linked(address)
        rss0, fds0 = _rss(proc.pid), _fds(proc.pid)
        clients: list[tq.AsyncClient] = []
        try:
            async with anyio.create_task_group() as tg:

                async def one() -> None:
                    clients.append(await _open_linked(address))

                for _ in range(n):
                    tg.start_soon(one)
            assert all(c.link_fallbacks == 0 for c in clients)
            # the controller and every unit answer each client over its Unix socket
            assert all(c._links.ctl().address.startswith("uds://") for c in clients)
            assert all(len(c._links.units) == units for c in clients)
            assert all(
                x.address.startswith("uds://") for c in clients for x in c._links.units.values()
            )
            connections = n * (1 + units)

            def per_connection() -> tuple[float, float]:
                return (
                    (_rss(proc.pid) - rss0) / connections,
                    (_fds(proc.pid) - fds0) / connections,
                )

            # the services close the short-lived TCP connections and give their buffers back
            # to the OS shortly after a burst of connections: wait for that (bounded)
            with anyio.move_on_after(15):
                while True:
                    nbytes, fds = per_connection()
                    if nbytes <= IDLE_BYTES_PER_CONNECTION and fds <= 1.05:
                        break
                    await anyio.sleep(0.2)
        finally:
            for c in [first, *clients]:
                await c.aclose()
    assert nbytes <= IDLE_BYTES_PER_CONNECTION, nbytes
    assert 0.95 <= fds <= 1.05, fds


@pytest.mark.timeout(120)
async def test_handshake_with_a_stalled_unit_degrades_to_the_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The unit's process is paused (SIGSTOP) past the handshake's deadline while a client
    links to it for its first read: the client reads over the socket it already has once the
    unit resumes (counted in ``link_fallbacks``) instead of failing with a timeout, and
    tries the handshake again later (here: at once)."""
    monkeypatch.setattr(_same_host, "RELINK_AFTER", 0.0)
    monkeypatch.setattr(_same_host, "SHM_HELLO_TIMEOUT", 2.0)  # (5 s: the same, slower)
    data = torch.arange(4 * 256, dtype=torch.int64).view(4, 256)
    with serve_role("--storage-units", "1") as (proc, address):
        # request_timeout above the handshake's 2 s but below the pause: before the fix the
        # handshake waited request_timeout and the read failed
        async with tq.AsyncClient.connect(address, request_timeout=2.6) as client:
            await client.put({"x": data}, partition_id="p")
            meta = await client.get_meta(["x"], 4, "p", "t")
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                async with anyio.create_task_group() as tg:
                    got: dict[str, object] = {}

                    async def read() -> None:
                        got["td"] = await client.get_data(meta)

                    tg.start_soon(read)
                    await anyio.sleep(3.0)  # the fault: the unit stays stalled this long
                    os.kill(proc.pid, signal.SIGCONT)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            assert time.monotonic() - t0 < 15
            assert client.link_fallbacks == 1
            assert torch.equal(got["td"]["x"], data)  # type: ignore[index]
            assert client._links.arenas[0] is None  # the socket path
            # the next read asks again: the unit answers now, shared memory from then on
            meta = await client.get_meta(["x"], 4, "p", "t2")
            assert torch.equal((await client.get_data(meta))["x"], data)
            assert client.link_fallbacks == 1
            assert client._links.arenas[0] is not None


async def _drain(client: tq.AsyncClient, task: str) -> list[list[int]]:
    rows: list[list[int]] = []
    while True:
        meta = await client.get_meta(["x"], 8, "p", task, timeout=30)
        if meta.end_of_stream or not len(meta):
            return rows
        rows += (await client.get_data(meta))["x"].tolist()


async def _stall_and_time_out(address: str, data: torch.Tensor, proc_pid: int) -> None:
    """Acknowledge rows, pause the services, and let a get_meta and a put time out."""
    async with tq.AsyncClient.connect(address, request_timeout=1.0) as client:
        await client.put({"x": data[:4]}, partition_id="p")  # acknowledged
        os.kill(proc_pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(tq.TQTimeoutError):
                await client.get_meta(["x"], 4, "p", "t", timeout=1.0)
            with pytest.raises(tq.TQTimeoutError):
                await client.put({"x": data[4:]}, partition_id="p")
            assert time.monotonic() - t0 < 10  # bounded by the deadlines, never a hang
        finally:
            os.kill(proc_pid, signal.SIGCONT)


@pytest.mark.timeout(120)
async def test_stalled_services_make_requests_wait_and_lose_no_acknowledged_row() -> None:
    """Saturation at its worst: the services' process is paused. Requests wait up to their
    deadline and fail with TQTimeoutError; once the services resume, every acknowledged row
    is stored and read back (the timed-out put's rows may have landed, all or none)."""
    data = torch.arange(8 * 16, dtype=torch.int64).view(8, 16)
    with serve_role("--storage-units", "2") as (proc, address):
        await _stall_and_time_out(address, data, proc.pid)
        async with tq.AsyncClient.connect(address) as client:
            await client.seal("p")
            rows = await _drain(client, "another-task")
    assert {tuple(r) for r in data[:4].tolist()} <= {tuple(r) for r in rows}
    assert len(rows) in (4, 8)
    assert len({tuple(r) for r in rows}) == len(rows)


@pytest.mark.timeout(120)
async def test_a_get_meta_that_timed_out_during_a_stall_consumed_nothing() -> None:
    data = torch.arange(8 * 16, dtype=torch.int64).view(8, 16)
    with serve_role("--storage-units", "2") as (proc, address):
        await _stall_and_time_out(address, data, proc.pid)
        async with tq.AsyncClient.connect(address) as client:
            await client.seal("p")
            rows = await _drain(client, "t")  # the task whose get_meta timed out
    assert {tuple(r) for r in data[:4].tolist()} <= {tuple(r) for r in rows}


@pytest.mark.timeout(120)
async def test_a_saturated_service_over_a_unix_socket_is_waited_for_not_reconnected() -> None:
    """A service that answers later than ``retry_after`` over its Unix socket is busy, not
    gone (a Unix socket reports its end): the client waits up to its deadline on the same
    connection. Reconnecting there had thousands of waiting clients storm the saturated
    service's listen queue at 8,192 clients."""
    data = torch.arange(4 * 16, dtype=torch.int64).view(4, 16)
    with serve_role("--storage-units", "1") as (proc, address):
        async with tq.AsyncClient.connect(address, request_timeout=20, retry_after=0.5) as client:
            assert client._links.ctl().address.startswith("uds://")
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                async with anyio.create_task_group() as tg:
                    done: list[object] = []

                    async def put() -> None:
                        done.append(await client.put({"x": data}, partition_id="p"))

                    tg.start_soon(put)
                    await anyio.sleep(2.0)  # the fault: 4 x retry_after without an answer
                    assert not done
                    os.kill(proc.pid, signal.SIGCONT)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            assert client._links.ctl().reconnects == 0
            meta = await client.get_meta(["x"], 4, "p", "t", timeout=10)
            assert torch.equal((await client.get_data(meta))["x"], data)


def test_serve_raises_its_descriptor_soft_limit_to_the_hard_one() -> None:
    """A service holds a descriptor per client: ``tq-async serve`` lifts the soft limit
    (often 1,024) to the hard one at start, which needs no privilege."""
    import resource

    from tq_async._service._serve import raise_fd_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 512 if hard == resource.RLIM_INFINITY else min(512, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        got_soft, got_hard = raise_fd_limit("serve", units=4)
        assert got_hard == hard
        assert got_soft == (hard if hard != resource.RLIM_INFINITY else 1 << 20)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == got_soft
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
