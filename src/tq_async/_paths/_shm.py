"""Shared memory between a storage unit and the clients on its host.

Measured on our 2-vCPU box (``python -m benchmarks.probes same-host``): an 8.4 MB batch moves
at 4.4-4.9 GB/s as zmq frames over ``ipc://`` (two kernel copies and two I/O threads), and at
9-12 GB/s when the sender copies it once into memory the receiver owns and only a 50-byte
message travels. So a client on the unit's host writes a put's column bytes once into the
unit's **arena**, and copies a read's bytes once out of it into its own recycled buffers
(`tq_async._wire._buffers`). Ownership stays what a socket gives: a put copies, a read
returns memory of your own.

Rules (see ``docs/deployment.md``):

* **Only the unit creates memory.** The arena is an anonymous ``memfd`` (no name in
  ``/dev/shm``, no ``multiprocessing.shared_memory`` resource tracker): the kernel frees it
  when the unit process is gone and every client has unmapped it, so nothing is left behind
  however the unit dies, and a unit that merely stalls keeps its data.
* **Verified, never assumed.** A client maps ``/proc/<unit pid>/fd/<fd>`` and must read back
  the random token the unit wrote at the arena's start; a client on another host, in another
  PID namespace or under another user fails to and uses the socket.
* **Never trust a client's offsets.** A client asks for a region (a *grant*), and the unit
  checks every span a put names against that grant; a read's spans are computed by the unit.
* **Death, not silence, frees a client's claims.** Grants and read pins are recorded per
  client process and released when it exits (a ``pidfd`` becomes readable: no polling) or
  when the client gives them back.
* **Bounded.** The arena has a cap (a put that does not fit goes over the socket, counted);
  freed regions keep their pages for reuse (fresh pages fault at ~1.7 GB/s), at most
  ``idle_bytes`` of them, the rest is given back to the OS.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import itertools
import mmap
import os
import secrets
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .._errors import InvalidRequestError, SessionLostError, StorageFullError, TQError
from .._logging import get_logger
from ._pinned import PIN_CHUNK, PinnedChunks, chunks_of

__all__ = [
    "Arena",
    "ArenaMap",
    "DEFAULT_SHM_CAP",
    "DEFAULT_SHM_IDLE",
    "Extents",
    "Region",
    "PAGE",
    "TOKEN_BYTES",
]

#: default shared-memory arena per storage unit (address space; pages are used only once
#: written)
DEFAULT_SHM_CAP = 1 << 30
#: default bound on freed arena pages kept for reuse
DEFAULT_SHM_IDLE = 256 << 20

log = get_logger(__name__)

PAGE = 4096
TOKEN_BYTES = 16
#: spans inside a region start on this boundary (numpy/torch views of them stay aligned)
ALIGN = 64
#: a client copying into a grant checks the unit's boot again after this many bytes
_CHECKED_BYTES = 64 << 20


#: allocates an arena file's disk blocks (a seam: tests make it fail as a full disk does)
fallocate = os.posix_fallocate


def align(n: int, to: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


class Region:
    """``[offset, offset + size)`` of the arena, freed when its last reference goes.

    ``recorded``: it holds cells a durable unit's index names (what an arena's
    ``defer_frees`` waits for); a read's copy, a grant never used, hold none."""

    __slots__ = ("offset", "recorded", "refs", "size")

    def __init__(self, offset: int, size: int) -> None:
        self.offset = offset
        self.size = size
        self.refs = 1
        self.recorded = False


class Extents:
    """Free extents of an address range, first fit, coalesced on release."""

    def __init__(self, start: int, size: int) -> None:
        # sorted by offset, coalesced: starts[i] -> sizes[i]
        self._starts: list[int] = [start]
        self._sizes: list[int] = [size]

    def take(self, size: int) -> int | None:
        """The start of ``size`` free bytes (now taken), or None when none are."""
        for i, free in enumerate(self._sizes):
            if free >= size:
                start = self._starts[i]
                if free == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] = start + size
                    self._sizes[i] = free - size
                return start
        return None

    def take_region(self, nbytes: int) -> Region | None:
        """A region of at least ``nbytes`` (whole pages; one for 0 bytes), now taken, or
        None when no free extent is that large (what an arena's ``alloc`` hands out)."""
        size = align(max(nbytes, 1), PAGE)
        start = self.take(size)
        return None if start is None else Region(start, size)

    def within(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The free extents' parts inside ``[lo, hi)``, as ``(start, size)``."""
        out = []
        for start, size in zip(self._starts, self._sizes, strict=True):
            a, b = max(start, lo), min(start + size, hi)
            if a < b:
                out.append((a, b - a))
        return out

    def take_at(self, offset: int, size: int) -> bool:
        """Take ``[offset, offset + size)`` if it is all free; whether it was."""
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            return False
        start, free = self._starts[i], self._sizes[i]
        if offset + size > start + free:
            return False
        del self._starts[i], self._sizes[i]
        if offset + size < start + free:
            self._starts.insert(i, offset + size)
            self._sizes.insert(i, start + free - offset - size)
        if start < offset:
            self._starts.insert(i, start)
            self._sizes.insert(i, offset - start)
        return True

    def give(self, offset: int, size: int) -> None:
        """``[offset, offset + size)`` is free again."""
        i = bisect.bisect_left(self._starts, offset)
        self._starts.insert(i, offset)
        self._sizes.insert(i, size)
        if i + 1 < len(self._starts) and offset + size == self._starts[i + 1]:  # merge right
            self._sizes[i] += self._sizes.pop(i + 1)
            del self._starts[i + 1]
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == offset:  # merge left
            self._sizes[i - 1] += self._sizes.pop(i)
            del self._starts[i]


class Arena:
    """The unit's side: one shared mapping and a first-fit allocator over it.

    Args:
        cap: bytes of the arena (address space; pages are only used once written).
        idle_bytes: most bytes of freed, still-resident pages kept for reuse.
        name: shows in ``/proc/PID/maps`` (``memfd:NAME``).
        path: a file to map instead of an anonymous memfd (a durable unit's arena, in its
            ``data_dir``: what clients write into it is in the operating system's files at
            once). An existing file keeps its contents (and its size, when larger than
            ``cap``); regions holding recovered cells are taken back with `reserve`. The
            file is sparse: a region's disk blocks are allocated before it is lent
            (`alloc`), since a store into a hole on a full disk is a SIGBUS.
        defer_frees: freed regions that held recorded cells (`Region.recorded`) wait in
            `deferred` until the owner releases them with `free_deferred` (``fsync`` level:
            such a region is reused only once the record that freed it is on the disk;
            others, which no record names, are reused at once).
    """

    def __init__(
        self,
        cap: int,
        *,
        idle_bytes: int = 256 << 20,
        name: str = "tq-unit",
        path: str | None = None,
        defer_frees: bool = False,
    ) -> None:
        if cap < 2 * PAGE:
            raise InvalidRequestError(f"shm_cap must be at least {2 * PAGE} bytes, got {cap}")
        self.cap = cap - cap % PAGE
        self.idle_limit = idle_bytes
        self.path = path
        if path is None:
            self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        else:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            held = os.fstat(self.fd).st_size
            if held > self.cap:  # a durable arena made larger before: its cells stay reachable
                self.cap = held - held % PAGE
            os.ftruncate(self.fd, self.cap)
            if path is not None:  # the token's page (a hole written on a full disk: SIGBUS)
                try:
                    fallocate(self.fd, 0, PAGE)
                except OSError as exc:
                    raise OSError(
                        exc.errno, f"cannot reserve the arena's first page: {exc.strerror}", path
                    ) from exc
            self.mmap = mmap.mmap(self.fd, self.cap)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = np.frombuffer(self.mmap, dtype=np.uint8)
        self.base = int(self.view.ctypes.data)
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.view[:TOKEN_BYTES] = np.frombuffer(self.token, dtype=np.uint8)
        self._extents = Extents(PAGE, self.cap - PAGE)
        # pages written since they were last given back (idle accounting)
        self._resident = np.zeros(self.cap // PAGE, dtype=np.bool_)
        self._resident[0] = True  # the token's page: never free
        #: an arena file's pages whose disk blocks are allocated (`_reserve`); None: a memfd
        self._reserved: np.ndarray[Any, np.dtype[np.bool_]] | None = None
        if path is not None:
            self._reserved = np.zeros(self.cap // PAGE, dtype=np.bool_)
            self._reserved[0] = True
        #: `_reserve` failed for another reason than a full disk (said once)
        self._refused = False
        self.live_bytes = 0
        self.idle_bytes = 0
        #: per chunk (`tq_async._paths._pinned`): how many clients hold it registered with
        #: their GPU driver; pages of such a chunk are never given back
        self._locked = np.zeros(-(-self.cap // PIN_CHUNK), dtype=np.int32)
        self.fallbacks = 0
        self.defer_frees = defer_frees
        #: regions freed while ``defer_frees``: reusable after `free_deferred`
        self.deferred: list[tuple[int, int]] = []
        #: puts and reads served through the arena (totals)
        self.puts = 0
        self.reads = 0
        self.closed = False

    # ---- allocation --------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> Region | None:
        """A region of at least ``nbytes`` (page-rounded), or None when the arena is full
        (or, for an arena file, its disk: `_reserve`)."""
        region = self._extents.take_region(nbytes)
        if region is None:
            return None
        a, b = region.offset // PAGE, (region.offset + region.size) // PAGE
        if self._reserved is not None and not self._reserve(a, b):
            self._extents.give(region.offset, region.size)
            return None
        self.idle_bytes -= int(np.count_nonzero(self._resident[a:b])) * PAGE
        self._resident[a:b] = True
        self.live_bytes += region.size
        return region

    def _reserve(self, a: int, b: int) -> bool:
        """Allocate the disk blocks of pages ``[a, b)`` of the arena file not yet allocated;
        whether they are. A store into a page of a sparse file mapped shared that the disk
        has no room for kills the process storing (SIGBUS): a unit copying a read, a client
        copying a put. Blocks reserved first, such a store cannot fail."""
        reserved = self._reserved
        assert reserved is not None
        if reserved[a:b].all():  # (the common case: pages lent before, kept idle since)
            return True
        missing = np.flatnonzero(~reserved[a:b])
        lo, hi = a + int(missing[0]), a + int(missing[-1]) + 1
        try:
            fallocate(self.fd, lo * PAGE, (hi - lo) * PAGE)
        except OSError as exc:  # by socket instead (a full disk: a put fails there, saying so)
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) and not self._refused:
                self._refused = True
                log.warning(
                    "a durable storage unit cannot reserve its arena file's disk blocks: "
                    "same-host puts and reads go over the socket; check its data_dir's disk",
                    path=self.path,
                    error=str(exc),
                )
            return False
        reserved[lo:hi] = True
        return True

    def reserve(self, offset: int, size: int) -> Region:
        """Take back ``[offset, offset + size)`` (page-aligned, free): a region of cells a
        durable unit recovered from its arena file.

        Raises:
            ValueError: the range is not page-aligned, not inside the arena, or not free.
        """
        if offset % PAGE or size % PAGE or offset < PAGE or not self._extents.take_at(offset, size):
            raise ValueError(f"arena range [{offset}, +{size}) cannot be reserved")
        self._resident[offset // PAGE : (offset + size) // PAGE] = True
        self.live_bytes += size
        region = Region(offset, size)
        region.recorded = True
        return region

    def trim(self, region: Region, nbytes: int) -> None:
        """Free the tail of ``region`` past its first ``nbytes`` (page-rounded, at least a
        page): a grant lent ahead of a put turned out larger than the put."""
        keep = max(PAGE, -(-nbytes // PAGE) * PAGE)
        if keep < region.size:
            self._free(region.offset + keep, region.size - keep)
            region.size = keep

    def release(self, region: Region) -> None:
        """Drop one reference; the region is freed with the last."""
        region.refs -= 1
        if region.refs == 0:
            self._free(region.offset, region.size, deferred=region.recorded)

    def free_deferred(self, freed: list[tuple[int, int]]) -> None:
        """Free regions taken from `deferred` (their freeing is durable now)."""
        for offset, size in freed:
            self._reuse(offset, size)

    def _free(self, offset: int, size: int, *, deferred: bool = False) -> None:
        self.live_bytes -= size
        if self.closed:
            return
        if deferred and self.defer_frees:
            self.deferred.append((offset, size))
            return
        self._reuse(offset, size)

    def _reuse(self, offset: int, size: int) -> None:
        if self.closed:
            return
        if self.idle_bytes + size > self.idle_limit:
            self.idle_bytes += size - self._give_back(offset, size)
        else:
            self.idle_bytes += size
        self._extents.give(offset, size)

    def _give_back(self, offset: int, size: int) -> int:
        """Give the pages of ``[offset, offset + size)`` back to the kernel, except those of
        locked chunks; the bytes given back (that were resident)."""
        given = 0
        for a, b in self._unlocked(offset, size):
            # MADV_REMOVE frees shmem pages (the mapping stays); on an arena file it punches
            # a hole (its disk space comes back), which some file systems cannot do: then
            # the pages stay, as idle ones would
            try:
                self.mmap.madvise(mmap.MADV_REMOVE, a, b - a)
            except OSError:
                continue
            given += int(np.count_nonzero(self._resident[a // PAGE : b // PAGE])) * PAGE
            self._resident[a // PAGE : b // PAGE] = False
            if self._reserved is not None:  # a hole again: reserved anew when next lent
                self._reserved[a // PAGE : b // PAGE] = False
        return given

    def _unlocked(self, offset: int, size: int) -> list[tuple[int, int]]:
        """The parts of ``[offset, offset + size)`` outside locked chunks, merged."""
        if not self._locked.any():
            return [(offset, offset + size)]
        out: list[tuple[int, int]] = []
        end = offset + size
        for c in chunks_of(offset, size):
            if self._locked[c]:
                continue
            a, b = max(offset, c * PIN_CHUNK), min(end, (c + 1) * PIN_CHUNK)
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        return out

    # ---- chunks clients page-lock (see tq_async._paths._pinned) ------------------------------

    def lock_chunks(self, chunks: Iterable[int]) -> None:
        """One more client holds ``chunks`` registered: their pages stay (all of them: the
        client's registration makes every page of a chunk resident, counted idle if free)."""
        for c in chunks:
            if self._locked[c] == 0:
                a, b = c * PIN_CHUNK // PAGE, min((c + 1) * PIN_CHUNK, self.cap) // PAGE
                fresh = (b - a) - int(np.count_nonzero(self._resident[a:b]))
                self._resident[a:b] = True
                self.idle_bytes += fresh * PAGE
            self._locked[c] += 1

    def unlock_chunks(self, chunks: Iterable[int]) -> None:
        """A client no longer holds ``chunks`` registered; idle pages beyond the limit in
        those no client holds any more are given back."""
        for c in chunks:
            if self._locked[c] <= 0:
                continue
            self._locked[c] -= 1
            if self._locked[c] == 0 and not self.closed and self.idle_bytes > self.idle_limit:
                lo, hi = c * PIN_CHUNK, min((c + 1) * PIN_CHUNK, self.cap)
                for start, n in self._extents.within(lo, hi):
                    self.idle_bytes -= self._give_back(start, n)

    def locked_bytes(self) -> int:
        """Bytes of chunks some client holds registered (the last chunk may be short)."""
        n = int(np.count_nonzero(self._locked)) * PIN_CHUNK
        if self._locked[-1]:
            n -= len(self._locked) * PIN_CHUNK - self.cap
        return n

    # ---- views -------------------------------------------------------------------------------

    def span(self, offset: int, nbytes: int) -> memoryview:
        """A view of ``[offset, offset + nbytes)`` (the caller checked the bounds)."""
        return self.view[offset : offset + nbytes].data

    def offset_of(self, buf: Any) -> int | None:
        """Where ``buf`` starts in the arena, or None if it lies outside it."""
        view = memoryview(buf)
        if view.nbytes == 0 or not view.c_contiguous:
            return None
        addr = int(np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data)
        off = addr - self.base
        return off if off >= 0 and off + view.nbytes <= self.cap else None

    def close(self) -> None:
        """Unmap and close; the memory goes once no client maps it any more."""
        if self.closed:
            return
        self.closed = True
        del self.view
        with contextlib.suppress(BufferError):  # views still alive: GC unmaps later
            self.mmap.close()
        os.close(self.fd)


class ArenaMap:
    """A client's mapping of a unit's arena, verified by its token.

    Raises:
        OSError: the arena cannot be opened (another host, PID namespace or user).
        ValueError: the token does not match (not the arena the unit described).
    """

    def __init__(
        self, pid: int, fd: int, size: int, token: bytes, *, write_through: bool = False
    ) -> None:
        with open(f"/proc/{pid}/fd/{fd}", "r+b", buffering=0) as f:
            if os.fstat(f.fileno()).st_size != size:
                raise ValueError("the arena's size differs from what the unit said")
            self.mmap = mmap.mmap(f.fileno(), size)
            #: `write` uses ``pwrite`` on this descriptor (see ShmHelloReply.write_through)
            self.fd = os.dup(f.fileno()) if write_through else -1
        self.size = size
        self.token = token
        self.view = np.frombuffer(self.mmap, dtype=np.uint8)
        #: the chunks registered with this process's GPU driver (made on first use)
        self.pinned: PinnedChunks | None = None
        if self.view[:TOKEN_BYTES].tobytes() != token:
            self.close()
            raise ValueError("the arena's token differs from what the unit said")

    def pinned_chunks(self) -> PinnedChunks:
        """This mapping's registered chunks (see `tq_async._paths._pinned`)."""
        if self.pinned is None:
            self.pinned = PinnedChunks(int(self.view.ctypes.data), self.size)
        return self.pinned

    def check(self, offset: int, nbytes: int, what: str) -> None:
        """Raise ValueError unless ``[offset, offset + nbytes)`` lies inside the arena."""
        if not (offset >= PAGE and nbytes >= 0 and offset + nbytes <= self.size):
            raise ValueError(f"{what} [{offset}, +{nbytes}) lies outside the arena")

    def check_boot(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The mapping's bytes, once sure the unit that lent a grant in them still runs: a
        durable unit's arena is a file, which a client's mapping outlives, and every boot
        writes a new token into it (the regions an earlier boot lent may be another put's
        now). Call it right before copying into a grant.

        Raises:
            SessionLostError: the unit restarted, or this mapping was closed (the client saw
                the unit go): nothing was written; set shared memory up again.
        """
        view: np.ndarray[Any, np.dtype[np.uint8]] | None = getattr(self, "view", None)
        if view is None or view[:TOKEN_BYTES].tobytes() != self.token:
            raise SessionLostError(
                "the storage unit restarted since this client mapped its shared memory (the "
                "grant was the old boot's): nothing was written; send the put again"
            )
        return view

    def check_copied(self, view: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        """After a read was copied out of ``view`` (this mapping's bytes, taken before the
        copy): raise SessionLostError if the unit restarted meanwhile. A durable unit's next
        boot may have lent the read's regions to another put while the copy ran, so what it
        copied may be that put's cells (a restart before the copy began is caught too)."""
        if view[:TOKEN_BYTES].tobytes() != self.token:
            raise SessionLostError(
                "the storage unit restarted while this client copied a read out of its shared "
                "memory (the copy may hold another put's cells): read again"
            )

    def write(self, offset: int, parts: Iterable[Any]) -> list[tuple[int, int]]:
        """Copy ``parts`` (buffers) one after another from ``offset``; their spans.

        The unit's boot is checked before each `_CHECKED_BYTES` copied: a durable unit
        restarted during a long copy may lend the rest of the grant to another put.

        Raises:
            SessionLostError: the unit restarted since the grant (`check_boot`); what was
                copied before it is nobody's cells.
            TQError: ``pwrite`` failed (the unit's disk: `StorageFullError` when it is full);
                nothing was stored.
        """
        spans = []
        pos = offset
        view = self.check_boot()
        since = 0  # bytes copied since the last check
        for part in parts:
            src = np.frombuffer(memoryview(part).cast("B"), dtype=np.uint8)
            n = src.nbytes
            a = 0
            while a < n:
                if since >= _CHECKED_BYTES:
                    view, since = self.check_boot(), 0
                b = min(n, a + _CHECKED_BYTES - since)
                since += b - a
                if self.fd >= 0:
                    while a < b:
                        a += self._pwrite(src[a:b], pos + a)
                else:
                    view[pos + a : pos + b] = src[a:b]
                    a = b
            spans.append((pos - offset, n))
            pos = offset + align(pos - offset + n)
        return spans

    def _pwrite(self, src: np.ndarray[Any, np.dtype[np.uint8]], at: int) -> int:
        try:
            return os.pwrite(self.fd, src.data, at)
        except OSError as exc:
            self.check_boot()  # closed meanwhile (the client saw the unit go): said so
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            raise (StorageFullError if full else TQError)(
                f"writing a put into the storage unit's shared memory (its arena file) failed "
                f"({exc}): nothing of it was stored; check the storage unit's disk"
                f"{' (free space on it)' if full else ''}, then put again"
            ) from exc

    @staticmethod
    def layout(offset: int, sizes: Iterable[int]) -> list[tuple[int, int]]:
        """The spans `write` gives parts of ``sizes`` bytes (relative to ``offset``)."""
        spans = []
        rel = 0
        for n in sizes:
            spans.append((rel, n))
            rel = align(rel + n)
        return spans

    def close(self) -> list[int]:
        """Unregister its chunks (the driver first: then the pages), then unmap; the chunks
        that were registered (to unlock at the unit)."""
        pinned: PinnedChunks | None = getattr(self, "pinned", None)  # None: failed to open
        chunks = pinned.close() if pinned is not None else []
        with contextlib.suppress(AttributeError):
            del self.view
        with contextlib.suppress(BufferError):
            self.mmap.close()
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1
        return chunks


class Watcher:
    """Calls ``on_exit(pid)`` once a process is gone (its pidfd becomes readable)."""

    def __init__(
        self,
        add_reader: Callable[[int, Callable[[], None]], None],
        remove_reader: Callable[[int], Any],
    ) -> None:
        self._add = add_reader
        self._remove = remove_reader
        self._fds: dict[int, int] = {}

    def watch(self, pid: int, on_exit: Callable[[int], None]) -> None:
        """Start watching ``pid`` (once). Raises OSError if the process is not visible."""
        if pid in self._fds:
            return
        fd = os.pidfd_open(pid)
        self._fds[pid] = fd

        def fire() -> None:
            self.unwatch(pid)
            on_exit(pid)

        self._add(fd, fire)

    def unwatch(self, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(Exception):
                self._remove(fd)
            os.close(fd)

    def close(self) -> None:
        for pid in list(self._fds):
            self.unwatch(pid)


#: random first id: a unit restarted under a client that rode the restart through (its
#: connection reconnected by itself) never lends again the ids of its last boot, which the
#: client may still name (a late put or ShmFree would take another put's grant or pin)
_ids = itertools.count(1 + secrets.randbelow(1 << 60))


def next_id() -> int:
    """A process-unique id for grants and pins (not one an earlier run of the unit gave)."""
    return next(_ids)
