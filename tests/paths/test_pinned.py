"""Page-locked shared memory (``tq_async._paths._pinned``): GPU columns copied by their device
straight into a unit's arena, and out of it onto a device.

Without a GPU the device side runs through its seams: ``registrar`` records which chunks a
client page-locks, ``on_device`` says every tensor is on a device and a ``HostCopier`` does
the copies. What is checked: each chunk is registered once; the unit never gives back pages
of a chunk a client holds registered (the probe on the GPU machine showed a copy into such a
page lands where the unit never looks); the locks go when the client unlocks them or exits;
a put and a read through the path are bit-exact, a full arena falls back to the socket. The
CUDA versions are in ``tests/paths/test_devices.py`` (marked ``gpu``).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

import tq_async as tq
from _cluster_proc import serve_cluster
from tq_async._paths import _device_copy as _devices
from tq_async._paths import _pinned
from tq_async._paths._device import EMULATE_ENV
from tq_async._paths._device_copy import DeviceFrame, HostCopier, write_frames
from tq_async._paths._pinned import PIN_CHUNK, PinnedChunks, chunks_of, split_at_chunks
from tq_async._paths._shm import PAGE, Arena, ArenaMap
from tq_async._storage._book import Book

pytestmark = pytest.mark.skipif(
    not hasattr(os, "memfd_create") or not hasattr(os, "pidfd_open"), reason="Linux only"
)


class _Registrar:
    """Records registrations; refuses the addresses in ``refuse``."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.refuse: set[int] = set()

    def register(self, address: int, nbytes: int) -> bool:
        if address in self.refuse:
            return False
        assert address not in self.registered, "registered twice"
        self.registered[address] = nbytes
        return True

    def unregister(self, address: int) -> None:
        del self.registered[address]
        self.unregistered.append(address)


@pytest.fixture
def registrar(monkeypatch: pytest.MonkeyPatch) -> _Registrar:
    fake = _Registrar()
    monkeypatch.setattr(_pinned, "registrar", lambda: fake)
    return fake


def test_chunks_of_a_span() -> None:
    assert list(chunks_of(0, 1)) == [0]
    assert list(chunks_of(PIN_CHUNK - 1, 2)) == [0, 1]
    assert list(chunks_of(PIN_CHUNK, PIN_CHUNK)) == [1]
    assert list(chunks_of(5, 0)) == []


def test_a_span_is_cut_at_chunk_boundaries() -> None:
    assert split_at_chunks(5, 10) == [(5, 10)]
    assert split_at_chunks(PIN_CHUNK - 4, PIN_CHUNK + 8) == [
        (PIN_CHUNK - 4, 4),
        (PIN_CHUNK, PIN_CHUNK),
        (2 * PIN_CHUNK, 4),
    ]
    assert split_at_chunks(PIN_CHUNK, 0) == []


def test_each_chunk_is_registered_once_and_unregistered_at_close(registrar: _Registrar) -> None:
    base, size = 1 << 40, 3 * PIN_CHUNK - PAGE  # the last chunk is short
    pinned = PinnedChunks(base, size)
    assert pinned.ensure(PAGE, 10)
    assert pinned.ensure(PIN_CHUNK - 8, 16)  # chunk 0 again, and chunk 1
    assert pinned.ensure(2 * PIN_CHUNK, PIN_CHUNK - PAGE)
    assert registrar.registered == {
        base: PIN_CHUNK,
        base + PIN_CHUNK: PIN_CHUNK,
        base + 2 * PIN_CHUNK: PIN_CHUNK - PAGE,
    }
    assert pinned.close() == [0, 1, 2]
    assert registrar.registered == {}
    assert not pinned.ensure(PAGE, 10)  # closed: nothing is registered any more
    assert registrar.registered == {}


def test_a_refused_chunk_is_remembered_and_copies_stay_correct(registrar: _Registrar) -> None:
    base = 1 << 40
    registrar.refuse.add(base + PIN_CHUNK)
    pinned = PinnedChunks(base, 4 * PIN_CHUNK)
    assert not pinned.ensure(PIN_CHUNK, 1)
    assert not pinned.ensure(PIN_CHUNK, 1)  # asked once only
    assert pinned.refused == {1}
    assert pinned.ensure(0, 1)


def test_a_driver_that_fails_counts_as_refusing(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        def register(self, address: int, nbytes: int) -> bool:
            raise RuntimeError("no CUDA here")

        def unregister(self, address: int) -> None:
            raise AssertionError("never registered")

    monkeypatch.setattr(_pinned, "registrar", Broken)
    pinned = PinnedChunks(1 << 40, PIN_CHUNK)
    assert not pinned.ensure(0, 1)
    assert pinned.close() == []


# ---- the unit keeps the pages of locked chunks --------------------------------------------


def _fill(arena: Arena, offset: int, size: int, value: int) -> None:
    arena.view[offset : offset + size] = value


def test_the_pages_of_a_locked_chunk_are_never_given_back() -> None:
    arena = Arena(4 * PIN_CHUNK, idle_bytes=0)  # every freed page would go back at once
    try:
        locked = arena.alloc(PIN_CHUNK // 2)
        plain = arena.alloc(2 * PIN_CHUNK)  # from the middle of chunk 0 into chunk 2
        assert locked is not None
        assert plain is not None
        _fill(arena, locked.offset, locked.size, 7)
        _fill(arena, plain.offset, plain.size, 9)
        arena.lock_chunks([0])
        assert arena.locked_bytes() == PIN_CHUNK
        assert arena.idle_bytes == 0  # chunk 0 is all in use (the token's page, two regions)
        arena.lock_chunks([3])  # registering makes a chunk's every page resident (idle)
        assert arena.idle_bytes == PIN_CHUNK
        arena.unlock_chunks([3])
        assert arena.idle_bytes == 0
        arena.release(locked)
        arena.release(plain)
        # chunk 0 (locked) kept its pages and contents; chunks 1 and 2 were given back
        assert (arena.view[locked.offset : locked.offset + locked.size] == 7).all()
        assert (arena.view[plain.offset : PIN_CHUNK] == 9).all()
        assert (arena.view[PIN_CHUNK : plain.offset + plain.size] == 0).all()
        assert arena.idle_bytes == PIN_CHUNK - PAGE
        arena.unlock_chunks([0])
        assert arena.locked_bytes() == 0
        assert arena.idle_bytes == 0
        assert (arena.view[PAGE:PIN_CHUNK] == 0).all()  # given back now
        assert arena.view[:16].tobytes() == arena.token  # the token's page is never free
    finally:
        arena.close()


def test_locked_bytes_counts_the_arena_bytes_of_a_last_chunk_cut_short() -> None:
    """An arena whose cap is no multiple of the chunk size ends in a short chunk: locking it
    keeps its own pages resident, not a whole chunk's (``shm_locked_bytes`` said a whole
    chunk's, up to 32 MiB more than the arena holds there)."""
    arena = Arena(PIN_CHUNK + 4 * PAGE, idle_bytes=0)
    try:
        arena.lock_chunks([1])
        assert arena.idle_bytes == 4 * PAGE  # what the registration makes resident
        assert arena.locked_bytes() == 4 * PAGE
        arena.lock_chunks([0])
        assert arena.locked_bytes() == arena.cap
        arena.unlock_chunks([1])
        assert arena.locked_bytes() == PIN_CHUNK
    finally:
        arena.close()


def test_two_clients_locking_a_chunk_keep_it_until_both_unlock() -> None:
    arena = Arena(2 * PIN_CHUNK, idle_bytes=0)
    try:
        region = arena.alloc(PAGE)
        assert region is not None
        _fill(arena, region.offset, PAGE, 3)
        arena.lock_chunks([0])
        arena.lock_chunks([0])
        arena.release(region)
        arena.unlock_chunks([0])
        assert (arena.view[region.offset : region.offset + PAGE] == 3).all()
        arena.unlock_chunks([0])
        assert (arena.view[region.offset : region.offset + PAGE] == 0).all()
        arena.unlock_chunks([0])  # an unlock too many changes nothing
        assert arena.locked_bytes() == 0
    finally:
        arena.close()


def test_the_book_unlocks_a_clients_chunks_when_it_frees_them_or_exits() -> None:
    book = Book()
    book.peers[b"a"] = 11
    book.peers[b"b"] = 12
    assert book.lock(b"a", [0, 1]) == [0, 1]
    assert book.lock(b"a", [1, 2]) == [2]  # each chunk once per client
    assert book.lock(b"b", [1]) == [1]
    assert book.free(b"a", [], [], [2, 5]).chunks == [2]  # 5 was never its
    assert book.free(b"b", [], [], [0]).chunks == []  # another client's
    assert sorted(book.exited(11).chunks) == [0, 1]
    assert book.exited(12).chunks == [1]
    assert book.locked == {}


# ---- a client writes device frames into its grant ------------------------------------------


class _Copier(HostCopier):
    made: ClassVar[list[_Copier]] = []

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__(device)
        self.made.append(self)


@pytest.fixture
def seam(monkeypatch: pytest.MonkeyPatch, registrar: _Registrar) -> list[_Copier]:
    made: ClassVar[list[_Copier]] = []
    monkeypatch.setattr(_Copier, "made", made)
    monkeypatch.setattr(_devices, "on_device", lambda t: True)
    monkeypatch.setattr(_devices, "make_copier", _Copier)
    return made


def test_device_frames_land_in_the_grant_with_host_frames_between(
    seam: list[_Copier], registrar: _Registrar
) -> None:
    arena = Arena(4 * PIN_CHUNK)
    mapped = ArenaMap(os.getpid(), arena.fd, arena.cap, arena.token)
    try:
        a = torch.arange(1000, dtype=torch.int64).reshape(100, 10)
        b = torch.randn(50, 3).to(torch.bfloat16)
        host = np.arange(77, dtype=np.uint8)
        frames: list[Any] = [DeviceFrame(a), memoryview(host), DeviceFrame(b)]
        offset = PIN_CHUNK - PAGE  # the grant straddles two chunks
        spans = write_frames(mapped, offset, frames)
        assert spans == ArenaMap.layout(offset, [8000, 77, 300])
        got = [bytes(arena.view[offset + o : offset + o + n]) for o, n in spans]
        assert got == [a.numpy().tobytes(), host.tobytes(), b.view(torch.int16).numpy().tobytes()]
        assert seam[0].copies == 3  # the device's part (a cut at the chunk boundary)
        assert sorted(registrar.registered) == [
            mapped.pinned_chunks().base + c * PIN_CHUNK for c in (0, 1)
        ]
        assert mapped.close() == [0, 1]
        assert registrar.registered == {}
    finally:
        arena.close()


# ---- end to end, with a unit in another process ---------------------------------------------


@pytest.fixture
def emulate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EMULATE_ENV, "1")  # big dense CPU columns count as device columns


def _batch(n: int = 64) -> dict[str, Any]:
    return {
        "ids": torch.arange(n * 4096, dtype=torch.int64).reshape(n, 4096),
        "bf": torch.randn(n, 2048).to(torch.bfloat16),
        "mask": torch.arange(n * 65536).reshape(n, 65536) % 3 == 0,
        "small": torch.arange(n, dtype=torch.float32),
        "jag": torch.nested.nested_tensor(
            [torch.arange(i % 5 + 1, dtype=torch.float32) for i in range(n)], layout=torch.jagged
        ),
        "s": [f"row-{i}" for i in range(n)],
    }


def _same(td: Any, batch: dict[str, Any]) -> None:
    for k in ("ids", "bf", "mask", "small"):
        assert td[k].dtype == batch[k].dtype
        assert torch.equal(td[k], batch[k]), k
    assert [t.tolist() for t in td["jag"].unbind()] == [t.tolist() for t in batch["jag"].unbind()]
    assert list(td["s"]) == batch["s"]


async def _locked(client: tq.AsyncClient) -> int:
    return sum(s["shm_locked_bytes"] for s in (await client.storage_stats()).values())


async def test_a_put_and_a_read_go_through_page_locked_shared_memory(
    emulate: None, seam: list[_Copier], registrar: _Registrar
) -> None:
    batch = _batch()
    with serve_cluster(storage_units=1) as addr:
        async with tq.AsyncClient.connect(addr) as client:
            meta = await client.put(batch, partition_id="p")
            assert registrar.registered  # the grant's chunks, page-locked once
            assert await _locked(client) > 0  # and the unit keeps their pages
            before = dict(registrar.registered)
            copies = sum(c.copies for c in seam)
            td = await client.get_data(meta, device="cpu")  # "a device" (the seam)
            _same(td, batch)
            # ids, bf and mask were copied straight out of the arena by "the device"
            assert sum(c.copies for c in seam) - copies >= 3
            meta2 = await client.put(batch, partition_id="p")
            _same(await client.get_data(meta2, device="cpu"), batch)
            assert set(before) <= set(registrar.registered)  # registered once, kept
            stats = (await client.storage_stats())[0]
            assert stats["shm_puts"] == 2
            assert stats["shm_reads"] == 2
        assert registrar.registered == {}  # the client closed: unregistered


async def test_a_put_that_does_not_fit_the_arena_goes_by_socket(
    emulate: None, seam: list[_Copier], registrar: _Registrar
) -> None:
    batch = _batch()
    with serve_cluster(storage_units=1, args=["--shm-cap", str(1 << 20)]) as addr:
        async with tq.AsyncClient.connect(addr) as client:
            meta = await client.put(batch, partition_id="p")
            _same(await client.get_data(meta), batch)
            stats = (await client.storage_stats())[0]
            assert stats["shm_fallbacks"] >= 1
            assert stats["shm_puts"] == 0
            assert registrar.registered == {}


# ---- on a GPU -------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
async def test_cuda_columns_go_through_page_locked_shared_memory() -> None:
    """A unit on this host without a device arena: CUDA columns copied by the GPU into the
    grant and back out of the arena; pages reused after a clear still carry the new data
    (a registration never goes stale)."""
    with serve_cluster(storage_units=1) as addr:
        async with tq.AsyncClient.connect(addr) as client:
            for round_ in range(4):
                want = _batch(64)
                sent = {k: (v.cuda() if k in ("ids", "bf", "mask") else v) for k, v in want.items()}
                meta = await client.put(sent, partition_id="p")
                assert await _locked(client) > 0
                td = await client.get_data(meta, device="cuda")
                assert td["ids"].is_cuda, round_
                assert td["bf"].is_cuda, round_
                _same(td.to("cpu"), want)
                _same(await client.get_data(meta), want)  # host readers too
                await client.clear_partition("p")


@pytest.mark.gpu
@needs_cuda
def test_the_blocking_client_puts_cuda_columns_through_page_locked_memory() -> None:
    with serve_cluster(storage_units=1) as addr, tq.Client.connect(addr) as client:
        want = _batch(64)
        meta = client.put({**want, "ids": want["ids"].cuda()}, partition_id="p")
        td = client.get_data(meta, device="cuda")
        assert td["ids"].is_cuda
        _same(td.to("cpu"), want)
        assert sum(s["shm_locked_bytes"] for s in client.storage_stats().values()) > 0


async def test_a_client_killed_holding_locked_chunks_releases_them(tmp_path: Any) -> None:
    """A real client process takes a grant to copy into with its GPU (its chunks locked at
    the unit) and is SIGKILLed: its pidfd fires, the grant and the locks go back."""
    import multiprocessing

    import anyio

    from _shm_proc import pinned_alloc_then_die
    from tq_async._storage._server import StorageServer

    server = StorageServer(0, shm_cap=4 * PIN_CHUNK, shm_idle_bytes=0)
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve, f"ipc://{tmp_path}/unit")
        arena = server.arena
        assert arena is not None
        locked: list[int] = []
        lock = arena.lock_chunks

        def recording(chunks: Any) -> None:
            chunks = list(chunks)
            locked.extend(chunks)
            lock(chunks)

        arena.lock_chunks = recording  # type: ignore[method-assign]
        child = multiprocessing.get_context("spawn").Process(
            target=pinned_alloc_then_die, args=(server.address, PIN_CHUNK + PAGE)
        )
        child.start()
        await anyio.to_thread.run_sync(child.join, 60)
        assert child.exitcode == -9
        with anyio.fail_after(20):
            while arena.live_bytes or arena.locked_bytes():  # until the pidfd fires
                await server.shm_released.wait()
        assert locked == [0, 1]  # the grant's two chunks were locked before the reply
        assert arena.idle_bytes == 0  # nothing locked: the freed pages went back
        tg.cancel_scope.cancel()
