"""The same-host shared-memory data path (``tq_async._paths._shm``): exact round trips, cleanup
after
a client or a unit dies, bounded memory, fallback at the cap, refusal of bad descriptions.

Clients that should take the shared-memory path live in another process than the units (a
client in the units' process takes the in-process shortcut instead): either the services run
in a ``tq-async serve`` subprocess, or the test talks to an embedded unit through a socket of
its own ZMQ context.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch
import zmq

import tq_async as tq
import tq_async._client._async._get as client_get
from _cluster_proc import _read_address, serve_cluster
from _requests import cancelled_at
from _shm_proc import alloc_then_die
from tq_async._datasets._torch import StreamingDataLoader, StreamingDataset
from tq_async._errors import InvalidRequestError, ProtocolError
from tq_async._paths import _shm
from tq_async._paths._shm import PAGE, Arena, ArenaMap, Extents
from tq_async._storage._server import StorageServer
from tq_async._transport._dealer import DealerConnection
from tq_async._wire._columns import ColumnHeader
from tq_async._wire._protocol import (
    ShmAlloc,
    ShmFrames,
    ShmGrant,
    ShmHello,
    ShmHelloReply,
    StorePut,
    StoreStatsReply,
)

pytestmark = pytest.mark.skipif(
    not hasattr(os, "memfd_create") or not hasattr(os, "pidfd_open"), reason="Linux only"
)


def _batch(n: int = 64) -> dict[str, Any]:
    return {
        "ids": torch.randint(0, 1 << 30, (n, 512)),
        "bf": torch.randn(n, 3).to(torch.bfloat16),
        "jag": torch.nested.nested_tensor(
            [torch.arange(i % 7 + 1, dtype=torch.float32) * i for i in range(n)],
            layout=torch.jagged,
        ),
        "s": [f"row-{i}" * (i % 3 + 1) for i in range(n)],
    }


def _check(got: Any, want: dict[str, Any]) -> None:
    assert torch.equal(got["ids"], want["ids"])
    assert got["bf"].dtype == torch.bfloat16
    assert torch.equal(got["bf"], want["bf"])
    assert [t.tolist() for t in got["jag"].unbind()] == [t.tolist() for t in want["jag"].unbind()]
    assert got.get("s").tolist() == want["s"]


async def _unit_stats(client: tq.AsyncClient) -> list[StoreStatsReply]:
    stats = await client.storage_stats()
    return [StoreStatsReply(**st) for st in stats.values()]


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    with serve_cluster(storage_units=2) as addr:
        yield addr


# ---- the arena alone -------------------------------------------------------------------------


def test_arena_allocates_frees_coalesces_and_bounds_idle_pages() -> None:
    arena = Arena(64 * PAGE, idle_bytes=4 * PAGE)
    try:
        a, b, c = (arena.alloc(3 * PAGE) for _ in range(3))
        assert a
        assert b
        assert c
        assert a.offset == PAGE
        assert b.offset == 4 * PAGE
        assert arena.live_bytes == 9 * PAGE
        arena.view[a.offset : a.offset + a.size] = 1  # pages written
        arena.release(a)  # 3 pages fit the idle bound: kept
        assert arena.idle_bytes == 3 * PAGE
        arena.release(b)  # 6 > 4: given back to the OS
        assert arena.idle_bytes == 3 * PAGE
        assert arena.live_bytes == 3 * PAGE
        big = arena.alloc(6 * PAGE)  # a and b coalesced into one extent
        assert big is not None
        assert big.offset == PAGE
        assert arena.idle_bytes == 0  # reusing idle pages takes them out of the idle count
        assert arena.alloc(64 * PAGE) is None  # beyond the cap
        assert arena.view[b.offset] == 0  # MADV_REMOVE dropped b's pages
    finally:
        arena.close()


def test_trim_frees_the_tail_of_a_region_past_what_a_put_used() -> None:
    arena = Arena(64 * PAGE, idle_bytes=64 * PAGE)
    try:
        region = arena.alloc(8 * PAGE)
        assert region is not None
        arena.trim(region, 2 * PAGE + 1)  # page-rounded: three pages stay
        assert (region.offset, region.size) == (PAGE, 3 * PAGE)
        assert arena.live_bytes == 3 * PAGE
        tail = arena.alloc(5 * PAGE)  # the tail is free again, right after the region
        assert tail is not None
        assert tail.offset == 4 * PAGE
        arena.trim(tail, 0)  # a region keeps at least a page
        assert tail.size == PAGE
        arena.trim(tail, 9 * PAGE)  # nothing past its end to free
        assert tail.size == PAGE
        arena.release(region)
        arena.release(tail)
        assert arena.live_bytes == 0
    finally:
        arena.close()


def test_an_arena_file_whose_file_system_cannot_punch_holes_keeps_its_pages(
    tmp_path: Path,
) -> None:
    """A durable unit's arena is a file: giving pages back punches a hole in it, which some
    file systems refuse (EOPNOTSUPP); the pages then stay resident, as idle ones would."""
    arena = Arena(16 * PAGE, idle_bytes=0, path=str(tmp_path / "arena.dat"))
    real = arena.mmap

    class NoHoles:
        def madvise(self, *args: Any) -> None:
            raise OSError(95, "Operation not supported")

        def close(self) -> None:
            real.close()

    try:
        region = arena.alloc(3 * PAGE)
        assert region is not None
        arena.view[region.offset : region.offset + region.size] = 7
        arena.mmap = NoHoles()  # type: ignore[assignment]
        arena.release(region)  # idle_bytes=0: would give every page back
        assert arena.idle_bytes == 3 * PAGE  # kept instead
        assert arena.view[region.offset] == 7
        again = arena.alloc(3 * PAGE)
        assert again is not None
        assert again.offset == region.offset
        assert arena.idle_bytes == 0
    finally:
        arena.mmap = real
        arena.close()


def test_a_region_lives_while_referenced() -> None:
    arena = Arena(16 * PAGE)
    try:
        r = arena.alloc(10)
        assert r is not None
        assert r.size == PAGE
        r.refs += 1
        arena.release(r)
        assert arena.live_bytes == PAGE
        arena.release(r)
        assert arena.live_bytes == 0
    finally:
        arena.close()


def test_a_client_verifies_the_token() -> None:
    arena = Arena(16 * PAGE)
    try:
        mapped = ArenaMap(os.getpid(), arena.fd, arena.cap, arena.token)
        mapped.close()
        with pytest.raises(ValueError, match="token"):
            ArenaMap(os.getpid(), arena.fd, arena.cap, b"x" * len(arena.token))
        with pytest.raises(ValueError, match="size"):
            ArenaMap(os.getpid(), arena.fd, arena.cap * 2, arena.token)
        with pytest.raises(FileNotFoundError):
            ArenaMap(os.getpid(), 10_000, arena.cap, arena.token)
    finally:
        arena.close()


def test_a_mapping_of_an_arena_file_writes_nothing_once_another_boot_opened_it(
    tmp_path: Path,
) -> None:
    """A durable unit's arena is a file: a client's mapping outlives the unit's process,
    and the next boot's arena is the same file, with a new token."""
    path = str(tmp_path / "arena.dat")
    first = Arena(16 * PAGE, path=path)
    mapped = ArenaMap(os.getpid(), first.fd, first.cap, first.token)
    try:
        assert mapped.write(PAGE, [b"a" * 100]) == [(0, 100)]
        first.close()  # the unit is gone; the next boot opens its file
        second = Arena(16 * PAGE, path=path)
        try:
            second.view[2 * PAGE : 3 * PAGE] = 7  # cells the new boot's puts wrote
            with pytest.raises(tq.SessionLostError, match="restarted"):
                mapped.write(2 * PAGE, [b"b" * PAGE])
            assert (second.view[2 * PAGE : 3 * PAGE] == 7).all()  # nothing was written
        finally:
            second.close()
    finally:
        mapped.close()
    with pytest.raises(tq.SessionLostError):  # a closed mapping says the same
        mapped.write(PAGE, [b"c"])


@pytest.mark.parametrize("write_through", [False, True], ids=["mapping", "pwrite"])
def test_a_copy_the_unit_restarted_under_stops_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write_through: bool
) -> None:
    """A big put's copy takes seconds: a durable unit that restarts meanwhile may lend the
    same offsets of its file to another put, whose cells the rest of the copy would then
    overwrite (the token was checked only before the copy began). The copy checks it again
    before each slice, and stops."""
    monkeypatch.setattr(_shm, "_CHECKED_BYTES", 2 * PAGE)
    path = str(tmp_path / "arena.dat")
    first = Arena(16 * PAGE, path=path)
    mapped = ArenaMap(os.getpid(), first.fd, first.cap, first.token, write_through=write_through)
    boots: list[Arena] = []

    def parts() -> Iterator[bytes]:
        yield b"a" * (2 * PAGE)
        first.close()  # the unit is gone; the next boot opens its file and lends its pages
        boots.append(Arena(16 * PAGE, path=path))
        boots[0].view[3 * PAGE : 9 * PAGE] = 7  # another put's cells
        yield b"b" * (4 * PAGE)

    try:
        with pytest.raises(tq.SessionLostError, match="restarted"):
            mapped.write(PAGE, parts())
        assert (boots[0].view[3 * PAGE : 9 * PAGE] == 7).all()  # nothing was written over them
        # and within one part: the unit restarts while a slice is copied; the next slice
        # finds the new token (the check before each slice is where a restart is seen)
        boots[0].close()
        boots.append(Arena(16 * PAGE, path=path))
        again = ArenaMap(
            os.getpid(), boots[1].fd, boots[1].cap, boots[1].token, write_through=write_through
        )
        check = ArenaMap.check_boot
        checks = []

        def restarted_during_the_first_slice(self: ArenaMap) -> Any:
            checks.append(self)
            if len(checks) == 2:  # (the copy's first, then one per slice copied)
                boots[1].close()
                boots.append(Arena(16 * PAGE, path=path))
                boots[2].view[PAGE : 9 * PAGE] = 7
            return check(self)

        monkeypatch.setattr(ArenaMap, "check_boot", restarted_during_the_first_slice)
        try:
            with pytest.raises(tq.SessionLostError, match="restarted"):
                again.write(PAGE, [b"c" * (8 * PAGE)])
        finally:
            again.close()
        assert (boots[2].view[3 * PAGE : 9 * PAGE] == 7).all()  # past the first slice
    finally:
        mapped.close()
        for arena in boots:
            arena.close()


async def test_a_read_the_unit_restarted_under_is_not_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read's copy out of a durable unit's arena file: a unit that restarted meanwhile may
    have lent the read's regions to another put, whose cells the copy then took for the
    read's. The copy checks the unit's token once done (it took them silently)."""
    path = str(tmp_path / "arena.dat")
    first = Arena(64 * PAGE, path=path)
    mapped = ArenaMap(os.getpid(), first.fd, first.cap, first.token)
    first.view[PAGE : 33 * PAGE] = 1  # the read's cells
    boots: list[Arena] = []
    real = client_get.buffer_pool

    class Restarting:
        def copy(self, source: Any) -> memoryview:
            if not boots:  # the unit restarts while the first span is copied
                first.close()
                boots.append(Arena(64 * PAGE, path=path))
                boots[0].view[17 * PAGE : 33 * PAGE] = 2  # another put's cells
            return real.copy(source)

    monkeypatch.setattr(client_get, "buffer_pool", Restarting())
    spans = [(PAGE, 16 * PAGE), (17 * PAGE, 16 * PAGE)]
    try:
        with pytest.raises(tq.SessionLostError, match="restarted"):
            await client_get._copy_spans(mapped, spans)
        monkeypatch.setattr(client_get, "buffer_pool", real)
        again = ArenaMap(os.getpid(), boots[0].fd, boots[0].cap, boots[0].token)
        try:  # the same boot all along: taken
            got = await client_get._copy_spans(again, spans)
            assert [bytes(f)[:1] for f in got] == [b"\x01", b"\x02"]
        finally:
            again.close()
    finally:
        mapped.close()
        for arena in boots:
            arena.close()


async def test_a_read_of_a_durable_unit_restarted_under_its_copy_goes_by_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client reads such a read again through the unit's socket, as it does a read the
    unit answers with SessionLostError (`docs/guarantees.md`); here the token the client
    maps changes during the copy, as a restart's would."""
    data_dir = tmp_path / "unit"
    data_dir.mkdir()
    with serve_cluster(1, ["--durability", "process", "--data-dir", str(data_dir)]) as address:
        async with tq.AsyncClient.connect(address) as client:
            want = _batch()
            meta = await client.put(want, partition_id="restart-read")
            (arena,) = [a for a in client._links.arenas.values() if a is not None]
            copy = client_get._copy_spans
            copies: list[Any] = []

            async def restarted_under(mapped: ArenaMap, spans: Any) -> list[Any]:
                copies.append(spans)
                token = mapped.view[:16].copy()
                mapped.view[:16] = 0  # (a new boot's token)
                try:
                    return await copy(mapped, spans)
                finally:
                    mapped.view[:16] = token

            monkeypatch.setattr(client_get, "_copy_spans", restarted_under)
            before = sum(s.shm_reads for s in await _unit_stats(client))
            _check(await client.get_data(meta), want)
            assert len(copies) == 1
            assert arena not in client._links.arenas.values()  # set up again next time
            monkeypatch.setattr(client_get, "_copy_spans", copy)
            _check(await client.get_data(meta), want)
            assert sum(s.shm_reads for s in await _unit_stats(client)) == before + 2
            await client.clear_partition("restart-read")


# ---- through a tq-async serve process ------------------------------------------------------


async def test_round_trip_is_exact_over_shared_memory(address: str) -> None:
    async with tq.AsyncClient.connect(address) as client:
        before = sum(s.shm_puts for s in await _unit_stats(client))
        want = _batch()
        meta = await client.put(want, partition_id="shm-rt")
        assert any(a is not None for a in client._links.arenas.values())
        _check(await client.get_data(meta), want)
        # rows of both units in one read
        more = _batch()
        await client.put(more, partition_id="shm-rt")
        got, got_meta = await client.get(["ids", "s"], 100, "shm-rt", "reader")
        assert len(set(got_meta.units)) == 2
        assert torch.equal(got["ids"], torch.cat([want["ids"], more["ids"][:36]]))
        assert got.get("s").tolist() == want["s"] + more["s"][:36]
        stats = await _unit_stats(client)
        assert sum(s.shm_puts for s in stats) >= before + 2
        assert sum(s.shm_bytes for s in stats) > 0
        await client.clear_partition("shm-rt")
        stats = await _unit_stats(client)
        # cleared rows give their regions back (reads pinned nothing: they were released);
        # what stays is the grant each unit lent this client ahead of its next put
        assert sum(s.shm_bytes for s in stats) == client._links.same_host_units.spare_bytes()
        assert all(s.shm_idle_bytes <= 256 << 20 for s in stats)


async def test_a_put_takes_the_grant_its_unit_lent_with_the_last_answer(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[tuple[str, int]] = []
    request = DealerConnection.request

    async def counted(self: DealerConnection, body: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append((type(body).__name__, getattr(body, "spare", 0)))
        return await request(self, body, *args, **kwargs)

    monkeypatch.setattr(DealerConnection, "request", counted)
    one = {"ids": torch.randint(0, 1 << 30, (64, 512))}  # 256 KiB a put, every time
    async with tq.AsyncClient.connect(address) as client:
        metas = []
        for i in range(6):
            batch = {"ids": one["ids"] + i}
            metas.append((await client.put(batch, partition_id="shm-spare"), batch))
        puts = [spare for name, spare in asked if name == "StorePut"]
        units = {u for meta, _ in metas for u in meta.units}
        assert len(puts) == 6
        assert all(spare >= 64 * 512 * 8 for spare in puts)  # each asks for the next grant
        # only each unit's first put asked for a grant: the others took the one lent ahead
        assert [name for name, _ in asked].count("ShmAlloc") == len(units)
        for meta, batch in metas:
            assert torch.equal((await client.get_data(meta))["ids"], batch["ids"])
        await client.clear_partition("shm-spare")
        held = client._links.same_host_units.spare_bytes()
        assert held >= len(units) * 64 * 512 * 8
        # the cleared rows gave their regions back; each unit still lends this client one
        assert sum(s.shm_bytes for s in await _unit_stats(client)) == held
    async with tq.AsyncClient.connect(address) as other:  # a closed client gave them back
        with anyio.fail_after(10):
            while sum(s.shm_bytes for s in await _unit_stats(other)) != 0:
                pass  # ShmFree is one-way: each stats request is a round trip later


async def test_a_spare_lent_to_a_put_whose_caller_gave_up_goes_back(address: str) -> None:
    """The StorePut reached the unit (which lends the next grant with its answer), but the
    caller was cancelled before the answer came: the late answer's spare is freed at once,
    not held for a client that never learnt of it until that client closes."""
    async with tq.AsyncClient.connect(address) as client:
        with cancelled_at(StorePut) as (scope, store_puts), scope:
            await client.put(_batch(), partition_id="shm-late-spare")
        assert scope.cancelled_caught
        assert len(store_puts) == 1
        assert store_puts[0].spare > 0  # the put asked its unit for the next grant
        assert client._links.same_host_units.spare_bytes() == 0
        with anyio.fail_after(10):
            # the put's own region and the late spare both go back (ShmFree is one-way:
            # each stats request is a round trip later)
            while sum(s.shm_bytes for s in await _unit_stats(client)) != 0:
                pass
        assert client._links.same_host_units.spare_bytes() == 0


async def test_a_grant_answered_to_a_put_whose_caller_gave_up_goes_back(address: str) -> None:
    """The put's `ShmAlloc` reached the unit, but the caller was cancelled before the grant
    came back: the late grant is freed at once (before, it stayed with the unit until the
    client closed: a region lost for each such cancel)."""
    async with tq.AsyncClient.connect(address) as client:
        with cancelled_at(ShmAlloc) as (scope, asked), scope:
            await client.put(_batch(), partition_id="shm-late-grant")
        assert scope.cancelled_caught
        assert len(asked) == 1
        with anyio.fail_after(10):  # (ShmFree is one-way: each stats request is a round trip later)
            while sum(s.shm_bytes for s in await _unit_stats(client)) != 0:
                pass
        want = _batch()
        assert torch.equal((await client.get_data(await client.put(want, "p")))["ids"], want["ids"])


async def test_a_spare_answered_after_its_client_closed_goes_back() -> None:
    """A program closes its client while a put is in flight (a task group torn down by
    another task's error): the unit lends the put's answer a spare, which nobody reads. The
    unit holds that region for the client's process until the process exits, however long
    it runs on, though the client is closed and its partition cleared ("a client gives its
    spares back when it closes", docs/deployment.md). Grants and read pins answered after the
    close stayed the same way: a program that closes clients under load lost arena space.
    A closing client now tells each unit, after its calls in flight on that connection:
    everything lent to it goes back."""
    with serve_cluster(storage_units=1) as address:
        client = await tq.AsyncClient.connect(address).__aenter__()
        try:
            await client.put(_batch(), partition_id="closed")  # same-host: a spare lent
            conn = client._links.units[0]
            read = conn._on_frames

            def closed_before_the_answer(frames: list[Any]) -> None:
                conn._on_frames = read  # type: ignore[method-assign]
                client._links.close()  # the program closed the client; the answer is unread

            conn._on_frames = closed_before_the_answer  # type: ignore[method-assign]
            with pytest.raises(tq.ClosedError):
                await client.put(_batch(), partition_id="closed")  # takes the spare, asks one
        finally:
            await client.__aexit__(None, None, None)
        async with tq.AsyncClient.connect(address, shared_memory=False) as other:
            await other.clear_partition("closed")
            with anyio.fail_after(5):
                while sum(s.shm_bytes for s in await _unit_stats(other)) != 0:
                    pass  # (ShmFree is one-way: each stats request is a round trip later)


async def test_reads_return_memory_of_our_own(address: str) -> None:
    async with tq.AsyncClient.connect(address) as client:
        want = _batch(32)
        meta = await client.put(want, partition_id="shm-own")
        got = await client.get_data(meta)
        got["ids"].zero_()  # writing what we read changes nothing stored
        again = await client.get_data(meta)
        assert torch.equal(again["ids"], want["ids"])
        want["ids"].zero_()  # nor does writing what we put
        assert not torch.equal((await client.get_data(meta))["ids"], want["ids"])
        await client.clear_partition("shm-own")


@pytest.mark.parametrize("option", ["shared_memory", "same_host"])
async def test_the_off_switches_use_the_socket(address: str, option: str) -> None:
    async with tq.AsyncClient.connect(address, **{option: False}) as client:
        before = await _unit_stats(client)
        want = _batch()
        meta = await client.put(want, partition_id=f"shm-off-{option}")
        _check(await client.get_data(meta), want)
        after = await _unit_stats(client)
        assert client._links.arenas == {}
        assert [s.shm_puts for s in after] == [s.shm_puts for s in before]
        assert [s.shm_reads for s in after] == [s.shm_reads for s in before]
        await client.clear_partition(f"shm-off-{option}")


def test_put_falls_back_to_the_socket_at_the_cap() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tq_async._deploy._cli",
            "serve",
            "--storage-units",
            "1",
            "--shm-cap",
            str(256 << 10),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        address = _read_address(proc)

        async def run() -> None:
            async with tq.AsyncClient.connect(address) as client:
                small = {"x": torch.arange(20_000)}  # 160 kB: fits
                big = {"x": torch.arange(100_000)}  # 800 kB: does not
                m1 = await client.put(small, partition_id="cap")
                m2 = await client.put(big, partition_id="cap")
                assert torch.equal((await client.get_data(m1))["x"], small["x"])
                assert torch.equal((await client.get_data(m2))["x"], big["x"])
                (stats,) = await _unit_stats(client)
                assert stats.shm_cap == 256 << 10
                assert stats.shm_puts == 1
                assert stats.shm_fallbacks >= 1
                assert stats.shm_bytes <= stats.shm_cap

        anyio.run(run)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


def _memfd_maps() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if "memfd:tq-unit" in line]


async def test_a_killed_unit_leaves_nothing_mapped() -> None:
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, read with a deadline
        [sys.executable, "-m", "tq_async._deploy._cli", "serve", "--storage-units", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        address = _read_address(proc)
        # arenas of units that ran in this process in other tests are theirs, not this one's
        # (an in-process unit's arena goes when the garbage collector frees its server)
        before = set(_memfd_maps())
        async with tq.AsyncClient.connect(address) as client:
            want = _batch()
            meta = await client.put(want, partition_id="kill-unit")
            _check(await client.get_data(meta), want)
            assert set(_memfd_maps()) - before  # we map the unit's arena
            forgotten = anyio.Event()
            forget = client._links._forget_arena

            def spy(unit_id: int) -> None:
                forget(unit_id)
                forgotten.set()

            client._links._forget_arena = spy  # type: ignore[method-assign]
            client._links.units[0]._on_disconnect = lambda: spy(0)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            with anyio.fail_after(20):
                await forgotten.wait()
            # the unit's process is gone and we unmapped: the kernel frees the memfd
            assert set(_memfd_maps()) - before == set()
            assert not [n for n in os.listdir("/dev/shm") if n.startswith("tq")]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


# ---- an embedded unit, talked to through a socket of another ZMQ context ------------------


async def _raw_unit(server: StorageServer, ctx: zmq.Context[Any]) -> DealerConnection:
    conn = DealerConnection(server.address, context=ctx)
    payload, _ = await conn.request(ShmHello(os.getpid()), timeout=10)
    assert msgspec.msgpack.decode(payload, type=ShmHelloReply | None) is not None
    return conn


async def _grant(conn: DealerConnection, nbytes: int) -> ShmGrant:
    payload, _ = await conn.request(ShmAlloc(nbytes), timeout=10)
    grant = msgspec.msgpack.decode(payload, type=ShmGrant | None)
    assert grant is not None
    return grant


X = ColumnHeader("x", "dense", "int64", (4,))
J = ColumnHeader("j", "jagged", "int64", ())


async def test_bad_segment_descriptions_are_refused(tmp_path: Any) -> None:
    server = StorageServer(0)
    ctx: zmq.Context[Any] = zmq.Context()
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve, f"ipc://{tmp_path}/unit")
        conn = await _raw_unit(server, ctx)
        other = await _raw_unit(server, ctx)
        arena = server.arena
        assert arena is not None
        cases: list[tuple[str, Any, list[ColumnHeader], Any]] = []
        g = await _grant(conn, 4 * 32)
        cases.append(("truncated", ShmFrames(g.grant, []), [X], ProtocolError))
        g = await _grant(conn, 4 * 32)
        cases.append(("too few", ShmFrames(g.grant, [(0, 10)]), [J], ProtocolError))
        g = await _grant(conn, 4 * 32)
        cases.append(("oversized", ShmFrames(g.grant, [(0, g.size + 8)]), [X], ProtocolError))
        g = await _grant(conn, 4 * 32)
        cases.append(("outside", ShmFrames(g.grant, [(g.size, 32)]), [X], ProtocolError))
        g = await _grant(conn, 4 * 32)
        cases.append(("negative", ShmFrames(g.grant, [(-PAGE, 32)]), [X], ProtocolError))
        g = await _grant(conn, 4 * 32)
        cases.append(("size mismatch", ShmFrames(g.grant, [(0, 24)]), [X], ProtocolError))
        cases.append(("unknown grant", ShmFrames(10**9, [(0, 32)]), [X], InvalidRequestError))
        g = await _grant(other, 4 * 32)
        cases.append(("another's grant", ShmFrames(g.grant, [(0, 32)]), [X], InvalidRequestError))
        for what, shm, headers, error in cases:
            body = StorePut("p", [0], headers, shm=shm)
            with pytest.raises(error):
                await conn.request(body, timeout=10)
            assert server.state.stats().rows == 0, what
        # the refused grants went back; only the other client's grant is still out
        assert arena.live_bytes == PAGE
        # a client that never said hello gets nothing (told to set a session up: the unit
        # cannot tell it from one that said hello to its earlier boot)
        stranger = DealerConnection(server.address, context=ctx)
        with pytest.raises(tq.SessionLostError, match="ShmHello"):
            await stranger.request(ShmAlloc(100), timeout=10)
        with pytest.raises(InvalidRequestError, match="nbytes"):
            await conn.request(ShmAlloc(0), timeout=10)
        payload, _ = await conn.request(ShmAlloc(arena.cap + 1), timeout=10)
        assert msgspec.msgpack.decode(payload) is None  # more than the cap: use the socket
        # and a good description is stored exactly
        g = await _grant(conn, 32)
        arena.view[g.offset : g.offset + 32] = torch.arange(4).numpy().view("uint8")
        await conn.request(StorePut("p", [0], [X], shm=ShmFrames(g.grant, [(0, 32)])), timeout=10)
        _, cols = server.state.get("p", [0], ["x"])
        assert bytes(cols[0].data) == torch.arange(4).numpy().tobytes()
        for c in (conn, other, stranger):
            c.close()
        tg.cancel_scope.cancel()
    ctx.term()


async def test_a_client_killed_mid_put_leaks_nothing(tmp_path: Any) -> None:
    server = StorageServer(0)
    before = _named_shm()
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve, f"ipc://{tmp_path}/unit")
        arena = server.arena
        assert arena is not None
        child = multiprocessing.get_context("spawn").Process(
            target=alloc_then_die, args=(server.address, 1 << 20)
        )
        child.start()
        await anyio.to_thread.run_sync(child.join, 60)
        assert child.exitcode == -signal.SIGKILL
        with anyio.fail_after(20):
            while arena.live_bytes:  # freed when the pidfd of the dead client fires
                await server.shm_released.wait()
        assert server._grants == {}
        assert server._shm_peers == {}
        assert server.state.stats().rows == 0
        tg.cancel_scope.cancel()
    assert _named_shm() == before


def _named_shm() -> set[str]:
    """What /dev/shm holds, less multiprocessing's semaphores (``sem.mp-*``): other tests
    running at the same time (pytest-xdist workers) make and free those."""
    return {n for n in os.listdir("/dev/shm") if not n.startswith("sem.mp-")}


# ---- DataLoader workers ----------------------------------------------------------------------


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_read_through_shared_memory(address: str, context: str) -> None:
    pid = f"shm-loader-{context}"
    with tq.Client.connect(address) as client:
        n = 16
        client.put({"x": torch.arange(n * 65536).reshape(n, 65536)}, partition_id=pid)
        client.seal(pid)

        async def reads() -> int:
            async with tq.AsyncClient.connect(address) as c:
                return sum(s.shm_reads for s in await _unit_stats(c))

        before = anyio.run(reads)
        ds = StreamingDataset(address, ["x"], 4, 4, pid, "train")
        loader = StreamingDataLoader(ds, num_workers=2, multiprocessing_context=context)
        rows = []
        for td, meta in loader:
            for r, row in zip(meta.global_indexes, td["x"], strict=True):
                assert torch.equal(row, torch.arange(r * 65536, (r + 1) * 65536))
                rows.append(r)
        assert sorted(rows) == list(range(n))
        assert set(client.storage_stats()) == {0, 1}  # the blocking twin
        # every batch (2 MiB: too big to ride along with get_meta) came through shared memory
        assert anyio.run(reads) >= before + 4
        client.clear_partition(pid)


def test_take_region_rounds_to_whole_pages_and_says_when_nothing_fits() -> None:
    extents = Extents(PAGE, 3 * PAGE)
    first = extents.take_region(0)
    assert first is not None
    assert (first.offset, first.size, first.refs) == (PAGE, PAGE, 1)
    second = extents.take_region(PAGE + 1)
    assert second is not None
    assert (second.offset, second.size) == (2 * PAGE, 2 * PAGE)
    assert extents.take_region(1) is None
