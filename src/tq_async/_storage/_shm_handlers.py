"""A storage unit's shared-memory path: its arena and the requests that use it.

Clients on the unit's host put and read through the unit's shared-memory arena
(`tq_async._paths._shm`): a client says hello with its pid (watched: when the process
exits, what it held goes back), asks for a grant (`ShmAlloc`), writes its columns into
the granted region and sends a `StorePut` naming spans of it instead of frames; a read
(`StoreGet` with ``shm``) is answered with arena spans, pinned until the client frees
the pin (`ShmFree`). With a put's answer the unit may lend the grant for the client's
next put (`StorePut.spare`: one round trip less per put), while spares hold at most an
eighth of the arena and the arena is less than half full. NIXL clients on other hosts use
the same arena (registered with the unit's agent, `tq_async._storage._nixl_handlers`) and
the same grants and pins.

Who holds which region is decided by the unit's `Book`;
`ShmPath` does the arena's side of it.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import anyio

from .._errors import InvalidRequestError, ProtocolError, SessionLostError
from .._logging import get_logger
from .._paths._pinned import chunks_of
from .._paths._shm import Arena, Region, Watcher
from .._service._loop import SENT, Incoming
from .._wire._columns import column_frame_count
from .._wire._protocol import (
    ShmFree,
    ShmGrant,
    ShmHello,
    ShmHelloReply,
    StoredColumns,
    StoreGet,
    StorePut,
)
from ._book import Book, Released
from ._cells import DevicePut, StorageState, adopt_arena

__all__ = ["ShmPath"]

log = get_logger(__name__)

#: what a unit answers a shared-memory call from a connection it holds no session of
NO_SESSION = (
    "this storage unit has no shared-memory session with this connection (none was set up "
    "with ShmHello, or the unit restarted since, or the connection was replaced); nothing "
    "was done: the client sets the session up again"
)

#: spare grants (lent ahead of a put) hold at most 1/SPARE_SHARE of the arena
SPARE_SHARE = 8


def may_lend(nbytes: int, spare_bytes: int, live_bytes: int, cap: int) -> bool:
    """Whether an arena of ``cap`` bytes (``live_bytes`` in use, ``spare_bytes`` of them lent
    ahead) lends ``nbytes`` more ahead of a put: spares stay within their share of it, and
    nothing is lent once it is half full (the shared-memory and the device arenas alike)."""
    return spare_bytes + nbytes <= cap // SPARE_SHARE and live_bytes + nbytes <= cap // 2


class ShmPath:
    """The shared-memory arena of one unit and the handlers of the requests that use it.

    Args:
        state: the unit's cells (the arena is theirs while it is open: chunks are views of it).
        book: who holds which region.
        cap: bytes of address space of the arena (0: no shared memory).
        idle_bytes: most bytes of freed pages kept resident for reuse.
    """

    def __init__(
        self,
        state: StorageState,
        book: Book,
        *,
        cap: int,
        idle_bytes: int,
        arena_file: str | None = None,
    ) -> None:
        self.state = state
        self.book = book
        self.cap = cap
        self.idle_bytes = idle_bytes
        #: a durable unit's arena is this file in its data_dir (None: an anonymous memfd)
        self.arena_file = arena_file
        self._watcher: Watcher | None = None
        self._ipc: str | None = None
        #: set (and replaced) whenever shared memory is given back (tests wait on it)
        self.released = anyio.Event()

    @property
    def arena(self) -> Arena | None:
        """The arena (None when off or not serving)."""
        return self.state.arena

    def open(self, name: str, ipc: str | None) -> None:
        """Make the arena (when the unit offers shared memory and the system has it);
        ``ipc`` is told to clients (the unit's same-host socket)."""
        if self.book.data_path == "zmq":
            return
        if not self.cap or not hasattr(os, "memfd_create") or not hasattr(os, "pidfd_open"):
            return
        disk = self.state.disk
        try:
            if self.arena_file is None or disk is None:
                arena = Arena(self.cap, idle_bytes=self.idle_bytes, name=name)
            else:
                arena = Arena(
                    self.cap,
                    idle_bytes=self.idle_bytes,
                    path=self.arena_file,
                    defer_frees=disk.sync,
                )
                try:
                    disk.use_arena()
                    adopt_arena(self.state, arena)
                except BaseException:
                    arena.close()
                    raise
        except OSError as exc:
            log.warning("no shared memory for same-host clients", error=str(exc))
            return
        self.state.arena = arena
        self._ipc = ipc
        loop = asyncio.get_running_loop()
        self._watcher = Watcher(loop.add_reader, loop.remove_reader)

    def close(self) -> None:
        """Unmap the arena (the NIXL agent is closed first: it has the arena registered)."""
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        arena, self.state.arena = self.state.arena, None
        if arena is not None:
            arena.close()

    # ---- handlers ----------------------------------------------------------------------------

    def on_hello(self, msg: Incoming, body: ShmHello) -> ShmHelloReply | None:
        arena = self.arena
        if arena is None or self._watcher is None or body.pid <= 0 or self.book.data_path == "nixl":
            return None
        try:
            self._watcher.watch(body.pid, self._client_exited)
        except OSError:  # not visible from here: another host or PID namespace
            return None
        self.book.peers[msg.peer] = body.pid
        return ShmHelloReply(
            os.getpid(), arena.fd, arena.cap, arena.token, self._ipc, arena.defer_frees
        )

    def claimant(self, peer: bytes) -> int:
        """The pid of a client that may take grants and pins (0: a NIXL client); NIXL
        claims held too long are taken back on the way."""
        pid = self.book.pid(peer)
        if pid is None:
            raise SessionLostError(NO_SESSION)
        if pid > 0 and self.arena is None:
            raise InvalidRequestError(
                "this unit has no shared memory (its data path is zmq, the system offers "
                "none, or it is closing); use the socket path"
            )
        self._expire_claims()
        return pid

    def alloc(self, peer: bytes, pid: int, nbytes: int, *, pinned: bool = False) -> ShmGrant | None:
        """A grant of ``nbytes`` (None: the arena is full; the client puts by socket); with
        ``pinned`` its chunks stay resident for the client's registration."""
        arena = self.arena
        assert arena is not None
        region = arena.alloc(nbytes) if nbytes <= arena.cap else None
        if region is None:
            arena.fallbacks += 1
            return None
        if pinned:
            self._lock(peer, pid, [(region.offset, region.size)])
        return ShmGrant(self.book.grant(peer, pid, region), region.offset, region.size)

    def lend(self, peer: bytes, nbytes: int) -> ShmGrant | None:
        """A grant of ``nbytes`` lent ahead of same-host ``peer``'s next put; None when
        spares would hold more than their share of the arena or it is half full.

        (A durable unit's arena file outlives its process, and a unit restarted on it may
        lend a region to another put while a client that missed the restart still holds it
        as a spare: the client checks the arena's token before it copies, which every boot
        writes anew, `tq_async._paths._shm.ArenaMap.check_boot`.)"""
        arena, pid = self.arena, self.book.pid(peer)
        if arena is None or not pid or pid < 0:
            return None
        if not may_lend(nbytes, self.book.spare_bytes, arena.live_bytes, arena.cap):
            return None
        region = arena.alloc(nbytes)
        if region is None:
            return None
        return ShmGrant(self.book.lend_spare(peer, pid, region), region.offset, region.size)

    def unlend(self, peer: bytes, *spares: ShmGrant) -> None:
        """Take back spares whose answer failed (the client never learnt of them; those of
        the device arena too)."""
        self.give_back(self.book.free(peer, [spare.grant for spare in spares], []))

    def _lock(self, peer: bytes, pid: int, spans: list[tuple[int, int]]) -> None:
        """Before answering: the chunks of ``spans`` stay resident while ``peer`` holds them
        registered (see tq_async._paths._pinned). Same-host clients only."""
        arena = self.arena
        if pid <= 0 or arena is None:
            return
        chunks = {c for off, n in spans for c in chunks_of(off, n)}
        arena.lock_chunks(self.book.lock(peer, sorted(chunks)))

    def on_free(self, msg: Incoming, body: ShmFree) -> Any:
        if self.arena is not None:
            self.give_back(self.book.free(msg.peer, body.grants, body.pins, body.chunks))
            if body.closing:
                self.give_back(self.book.closed(msg.peer))
        return SENT  # one-way

    def put(self, msg: Incoming, body: StorePut, device: DevicePut | None) -> list[Any]:
        """Store a put whose columns are in its grant (consumed); their frames (views)."""
        if len(msg.frames) != 1:
            raise ProtocolError("a shared-memory put carries no data frames")
        data, region = self._frames(msg.peer, body)
        arena = self.arena
        assert arena is not None
        # a spare grant may be larger than the put it carried: its tail goes back now
        spans = body.shm.spans if body.shm is not None else []
        arena.trim(region, max((off + n for off, n in spans), default=0))
        try:
            self.state.put(
                body.partition_id,
                body.rows,
                body.columns,
                data,
                region,
                incarnation=body.incarnation,
                device=device,
                spans=[(region.offset + off, n) for off, n in spans],
            )
            if self.state.nixl is not None and msg.peer in self.book.nixl_peers:
                self.state.nixl.puts += 1
            else:
                arena.puts += 1
        finally:
            arena.release(region)
        return data

    def read(self, peer: bytes, body: StoreGet) -> StoredColumns | None:
        """A read answered with arena spans, pinned (None: no room; read by socket)."""
        pid = self.claimant(peer)
        device = self.state.device
        device_ok = body.device and device is not None and pid > 0
        got = self.state.read_shm(
            body.partition_id,
            body.rows,
            body.fields,
            body.incarnation,
            device_ok=device_ok,
            jagged_ok=body.jagged,
        )
        arena = self.arena
        assert arena is not None
        if got is None:
            arena.fallbacks += 1
            return None
        stored, regions, on_device = got
        stored.pin = self.book.pin(peer, pid, regions, on_device)
        if body.pinned and stored.shm_spans:
            self._lock(peer, pid, stored.shm_spans)
        if on_device:
            assert device is not None
            device.reads += 1
        if self.state.nixl is not None and peer in self.book.nixl_peers:
            self.state.nixl.reads += 1
        else:
            arena.reads += 1
        return stored

    # ---- giving back -------------------------------------------------------------------------

    def give_back(self, released: Released) -> None:
        """Release what the book gave back into the arenas; wake whoever waits for room."""
        arena, device = self.arena, self.state.device
        if arena is not None:
            for region in released.shm:
                arena.release(region)
            if released.chunks:
                arena.unlock_chunks(released.chunks)
        if device is not None:
            for region in released.device:
                device.release(region)
        self.released.set()
        self.released = anyio.Event()

    def _frames(self, peer: bytes, body: StorePut) -> tuple[list[Any], Region]:
        """The frames a shared-memory put names, checked against its grant (consumed)."""
        assert body.shm is not None
        arena = self.arena
        if self.book.pid(peer) is None:  # (a grant of an earlier boot of this unit, maybe)
            raise SessionLostError(NO_SESSION)
        region = self.book.take_grant(peer, body.shm.grant) if arena is not None else None
        if arena is None or region is None:
            raise InvalidRequestError(
                f"shared-memory grant {body.shm.grant} is unknown to this unit (never given, "
                "used already, freed, or another client's); put again"
            )
        try:
            on_device = set(body.device.columns) if body.device is not None else set()
            expected = sum(
                column_frame_count(h) for i, h in enumerate(body.columns) if i not in on_device
            )
            spans = body.shm.spans
            if len(spans) != expected:
                raise ProtocolError(
                    f"a shared-memory put names {len(spans)} spans, its columns need {expected}"
                )
            frames: list[Any] = []
            for off, n in spans:
                if off < 0 or n < 0 or off + n > region.size:
                    raise ProtocolError(
                        f"a shared-memory span [{off}, +{n}) lies outside its grant of "
                        f"{region.size} bytes; the description is corrupt"
                    )
                frames.append(arena.span(region.offset + off, n))
        except BaseException:
            self.give_back(Released(shm=[region]))
            raise
        return frames, region

    def _client_exited(self, pid: int) -> None:
        """A client process is gone: its grants and pins go back to the arenas."""
        released = self.book.exited(pid)
        log.debug("released the shared memory of an exited client", pid=pid)
        self.give_back(released)

    def _expire_claims(self) -> None:
        """Release the grants and pins of NIXL clients that held them past the claims' ttl."""
        released = self.book.expire()
        if released is None:
            return
        for kind, claim in released.expired:
            log.warning("released the claim of a silent NIXL client", kind=kind, id=claim)
        self.give_back(released)
