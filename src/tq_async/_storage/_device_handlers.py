"""A storage unit's device path: its device arena and the requests that use it.

A client on the unit's host that puts tensors from a GPU can write them straight into the
unit's device arena (`tq_async._paths._device`): after its shared-memory hello it says
`DeviceHello`, asks for a device grant (`ShmAlloc` with ``device``), copies its
columns device to device, and sends a `StorePut` naming spans of the grant. Reads of
those cells by such a client are answered with device spans, pinned with the read's
shared-memory pin. The book (`Book`) keeps the grants and
pins; `DevicePath` does the arena's side.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import anyio

from .._errors import DeviceError, InvalidRequestError, ProtocolError, SessionLostError
from .._logging import get_logger
from .._paths._device import device_span_ok, open_device_arena
from .._service._loop import Incoming
from .._wire._columns import DENSE, ColumnHeader
from .._wire._protocol import DeviceHello, DeviceHelloReply, ShmGrant, StorePut
from ._book import Book
from ._cells import DevicePut, StorageState
from ._shm_handlers import NO_SESSION, may_lend

__all__ = ["DevicePath"]

log = get_logger(__name__)


class DevicePath:
    """The device arena of one unit and the handlers of the requests that use it.

    Args:
        state: the unit's cells (the device arena is theirs while it is open).
        book: who holds which region.
        cap: bytes of GPU memory (0: no device arena).
        index: which GPU (its CUDA index as this process sees it).
    """

    def __init__(self, state: StorageState, book: Book, *, cap: int, index: int) -> None:
        self.state = state
        self.book = book
        self.cap = cap
        self.index = index

    async def open(self) -> None:
        """Make the device arena (on a worker thread: a CUDA context takes a while); without
        a GPU or shared memory the unit goes on without one, saying why."""
        if not self.cap or self.state.arena is None:
            if self.cap:
                log.warning("no device arena: it needs shared memory (shm_cap > 0)")
            return
        try:
            self.state.device = await anyio.to_thread.run_sync(
                open_device_arena, self.index, self.cap
            )
        except (DeviceError, OSError, InvalidRequestError) as exc:
            log.warning("no device arena: GPU cells go through host memory", error=str(exc))

    def close(self) -> None:
        device, self.state.device = self.state.device, None
        if device is not None:
            device.close()

    def on_hello(self, msg: Incoming, body: DeviceHello) -> DeviceHelloReply | None:
        device = self.state.device
        if device is None or self.book.peers.get(msg.peer) != body.pid:
            return None  # no arena, or not a verified same-host peer
        memory = device.memory
        if memory.kind == "cuda" and body.pid == os.getpid():
            return None  # CUDA opens no IPC handle in the process that made it
        return DeviceHelloReply(memory.kind, memory.handle, device.cap, memory.device, device.token)

    def alloc(self, peer: bytes, pid: int, nbytes: int) -> ShmGrant | None:
        """A device grant of ``nbytes`` (None: the arena is full; the put goes by host)."""
        device = self.state.device
        if device is None or pid == 0:
            raise InvalidRequestError(
                "this unit has no device arena for this client (DeviceHello first)"
            )
        region = device.alloc(nbytes) if nbytes <= device.cap else None
        if region is None:
            device.fallbacks += 1
            return None
        gid = self.book.grant(peer, pid, region, device=True)
        return ShmGrant(gid, region.offset, region.size)

    def lend(self, peer: bytes, nbytes: int) -> ShmGrant | None:
        """A device grant of ``nbytes`` lent ahead of same-host ``peer``'s next put; None
        when spares would hold more than their share of the arena or it is half full (the
        shared-memory arena's rules, `tq_async._storage._shm_handlers.ShmPath.lend`)."""
        device, pid = self.state.device, self.book.pid(peer)
        if device is None or not pid or pid < 0:
            return None
        if not may_lend(nbytes, self.book.device_spare_bytes, device.live_bytes, device.cap):
            return None
        region = device.alloc(nbytes)
        if region is None:
            return None
        gid = self.book.lend_spare(peer, pid, region, device=True)
        return ShmGrant(gid, region.offset, region.size)

    @contextmanager
    def put(self, peer: bytes, body: StorePut) -> Iterator[DevicePut]:
        """Where a put's device columns are (by position: arena offset, bytes), checked
        against its grant (consumed); the grant's reference is released when the put is
        done (the stored chunks hold theirs)."""
        assert body.device is not None
        if self.book.pid(peer) is None:  # (a grant of an earlier boot of this unit, maybe)
            raise SessionLostError(NO_SESSION)
        device = self.state.device
        region = self.book.take_grant(peer, body.device.grant, device=True) if device else None
        if device is None or region is None:
            raise InvalidRequestError(
                f"device arena grant {body.device.grant} is unknown to this unit (never "
                "given, used already, freed, or another client's); put again"
            )
        where: dict[int, tuple[int, int]] = {}
        cols, spans = body.device.columns, body.device.spans
        # a spare grant may be larger than the put it carried: its tail goes back now
        device.trim(region, max((off + n for off, n in spans if n >= 0), default=0))
        ok = len(cols) == len(spans) and len(set(cols)) == len(cols)
        for col, (off, n) in zip(cols, spans, strict=False):
            ok = ok and 0 <= col < len(body.columns) and device_span_ok(off, n, region.size)
            # the cells are as long as their rows: a shorter span would keep memory past it
            ok = ok and _span_holds(body.columns[col], len(body.rows), n)
            where[col] = (region.offset + off, n)
        if not ok:
            device.release(region)
            raise ProtocolError("a put's device columns are described wrongly; put again")
        try:
            yield region, where
        finally:
            device.release(region)
        device.puts += 1


def _span_holds(header: ColumnHeader, n_rows: int, nbytes: int) -> bool:
    """Whether a device span of ``nbytes`` is exactly ``n_rows`` rows of ``header``'s (a
    column that is not dense is refused when it is stored)."""
    if header.kind != DENSE:
        return True
    try:
        return header.item_bytes() * n_rows == nbytes
    except ProtocolError:
        return False
