"""`ShmPath.lend` alone: when a unit lends a same-host client the grant of its next put.

A spare is lent only to a same-host client (a pid the unit watches), only while spares hold at
most an eighth of the arena and the arena is less than half full; one whose answer failed
goes back (`unlend`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from tq_async._paths._shm import PAGE, Arena
from tq_async._storage._book import Book
from tq_async._storage._cells import StorageState
from tq_async._storage._shm_handlers import SPARE_SHARE, ShmPath

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="Linux only")

CLIENT, REMOTE, STRANGER = b"client", b"nixl-client", b"stranger"


def test_spares_go_to_same_host_clients_within_their_share_of_a_roomy_arena() -> None:
    state = StorageState()
    book = Book()
    book.peers[CLIENT] = 4321
    book.nixl_peers.add(REMOTE)
    path = ShmPath(state, book, cap=64 * PAGE, idle_bytes=64 * PAGE)
    state.arena = arena = Arena(64 * PAGE, idle_bytes=64 * PAGE)
    try:
        share = arena.cap // SPARE_SHARE
        assert path.lend(STRANGER, PAGE) is None  # not a client of the shared memory
        assert path.lend(REMOTE, PAGE) is None  # NIXL: grants are claims with a ttl
        first = path.lend(CLIENT, share // 2)
        assert first is not None
        assert first.size == share // 2
        assert book.spare_bytes == share // 2
        assert path.lend(CLIENT, share // 2 + PAGE) is None  # beyond the spares' share
        second = path.lend(CLIENT, share // 2)
        assert second is not None
        assert book.spare_bytes == share
        path.unlend(CLIENT, second)  # its answer failed: back in the arena
        assert book.spare_bytes == share // 2
        assert arena.live_bytes == share // 2
        cells = arena.alloc(arena.cap // 2 - arena.live_bytes)  # the arena half full
        assert cells is not None
        assert path.lend(CLIENT, PAGE) is None  # the room is for puts that ask
        arena.release(cells)
        assert path.lend(CLIENT, PAGE) is not None
    finally:
        arena.close()


def test_a_durable_units_arena_file_lends_spares_too(tmp_path: Path) -> None:
    """A unit restarted on its arena file may lend a region to another put while a client
    that missed the restart still holds it as a spare; the client checks the arena's token
    before it copies (`tests/faults/test_durable_units.py`), so the file lends them too."""
    state = StorageState()
    book = Book()
    book.peers[CLIENT] = 4321
    path = ShmPath(state, book, cap=64 * PAGE, idle_bytes=64 * PAGE)
    state.arena = arena = Arena(64 * PAGE, idle_bytes=64 * PAGE, path=str(tmp_path / "arena"))
    try:
        assert path.lend(CLIENT, PAGE) is not None
        assert book.spare_bytes == PAGE
    finally:
        arena.close()


def test_a_connection_without_a_session_is_told_it_lost_it() -> None:
    """A unit answers a shared-memory call from a connection it holds no session of (it
    restarted under the connection) with `SessionLostError`, a `BrokenError`: nothing was
    done, and the client sets the session up again. A unit with no shared memory at all
    still says to use the socket."""
    from tq_async import BrokenError, InvalidRequestError
    from tq_async._errors import SessionLostError
    from tq_async._service._loop import Incoming
    from tq_async._wire._columns import ColumnHeader
    from tq_async._wire._protocol import ShmFrames, StorePut

    state = StorageState()
    book = Book()
    book.peers[CLIENT] = 4321
    path = ShmPath(state, book, cap=64 * PAGE, idle_bytes=64 * PAGE)
    state.arena = arena = Arena(64 * PAGE, idle_bytes=64 * PAGE)
    try:
        assert path.claimant(CLIENT) == 4321
        with pytest.raises(SessionLostError, match="restarted since"):
            path.claimant(STRANGER)
        assert issubclass(SessionLostError, BrokenError)
        header = ColumnHeader("x", "dense", "int64", (2,))
        put = StorePut("p", [0], [header], shm=ShmFrames(7, [(0, 16)]))
        with pytest.raises(SessionLostError):  # a grant of the unit's earlier boot
            path.put(Incoming(STRANGER, 1, [b""], 0.0), put, None)
        with pytest.raises(InvalidRequestError, match="unknown"):  # never given to it
            path.put(Incoming(CLIENT, 2, [b""], 0.0), put, None)
    finally:
        arena.close()
    state.arena = None  # (closed: a unit without shared memory)
    with pytest.raises(InvalidRequestError, match="no shared memory"):
        path.claimant(CLIENT)


def test_an_arena_the_disk_cannot_use_is_closed_not_leaked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A durable unit whose data_dir refuses the arena file (`use_arena` raises `OSError`)
    runs without shared memory, and the arena it had made is closed: no file descriptor or
    mapping stays behind."""
    from tq_async._storage._segments import ARENA_FILE, SegmentStore, claim_unit_dir

    claim_unit_dir(str(tmp_path), 0)
    state = StorageState(disk=SegmentStore(str(tmp_path), sync=False))
    state.recover()
    path = ShmPath(
        state, Book(), cap=64 * PAGE, idle_bytes=0, arena_file=str(tmp_path / ARENA_FILE)
    )

    def refuse() -> None:
        raise OSError(28, "No space left on device")

    assert state.disk is not None
    monkeypatch.setattr(state.disk, "use_arena", refuse)
    arena_file = str(tmp_path / ARENA_FILE)
    try:
        path.open("unit", None)
        assert state.arena is None  # runs without shared memory
        assert _fds_on(arena_file) == 0
    finally:
        path.close()
        state.disk.close()


def _fds_on(file: str) -> int:
    """How many of this process's file descriptors are open on ``file``."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own, closed by now)
            held += os.readlink(f"/proc/self/fd/{fd}") == file
    return held


def test_device_spares_go_within_their_share_of_the_device_arena() -> None:
    """A device grant is lent ahead by the same rules, counted apart from the arena's spares;
    a put that uses a larger spare gives its tail back, a spare that goes back is freed."""
    from tq_async._paths._device import DeviceArena, HostMemory
    from tq_async._storage._device_handlers import DevicePath

    state = StorageState(arena=Arena(64 * PAGE, idle_bytes=64 * PAGE))
    book = Book()
    book.peers[CLIENT] = 4321
    book.nixl_peers.add(REMOTE)
    state.device = device = DeviceArena(HostMemory(0, 65 * PAGE))
    path = DevicePath(state, book, cap=device.cap, index=0)
    shm = ShmPath(state, book, cap=64 * PAGE, idle_bytes=64 * PAGE)
    try:
        share = device.cap // SPARE_SHARE
        assert path.lend(STRANGER, PAGE) is None  # not a same-host client
        assert path.lend(REMOTE, PAGE) is None
        first = path.lend(CLIENT, share // 2)
        assert first is not None
        assert book.device_spare_bytes == first.size
        assert book.spare_bytes == 0  # the arena's spares are counted apart
        assert path.lend(CLIENT, share - first.size + PAGE) is None  # beyond the share
        second = path.lend(CLIENT, PAGE)
        assert second is not None
        shm.unlend(CLIENT, second)  # its answer failed: back in the device arena
        assert book.device_spare_bytes == first.size
        assert device.live_bytes == first.size
        # a put of one page uses the larger spare: the rest goes back at once
        region = book.take_grant(CLIENT, first.grant, device=True)
        assert region is not None
        assert book.device_spare_bytes == 0
        device.trim(region, 100)
        assert region.size == device.live_bytes == PAGE
        device.release(region)
        assert device.live_bytes == 0
        cells = device.alloc(device.cap // 2)  # the device arena half full
        assert cells is not None
        assert path.lend(CLIENT, PAGE) is None  # the room is for puts that ask
        device.release(cells)
        lent = path.lend(CLIENT, PAGE)
        assert lent is not None
        shm.give_back(book.exited(4321))  # the client died holding it
        assert book.device_spare_bytes == 0
        assert device.live_bytes == 0
    finally:
        device.close()
        state.arena.close()
