"""A client's side of the storage units' device arenas (see `tq_async._paths._device`).

`DeviceLinks` is held by a client on the units' host: it asks each unit once for its
device arena (after the shared-memory handshake verified the unit is on this host), opens
it (a CUDA IPC handle, once per unit), and moves a put's device columns into it and a
read's out of it with device-to-device copies. The copies run on the caller's current
stream and are waited for off the event loop before the unit hears of them (puts) or its
pin is dropped (reads); what a read returns is the caller's own memory on the device it
named, complete.

A client uses the path when the column is a dense tensor on a GPU of at least
`DEVICE_MIN_BYTES` and the unit offers an arena; otherwise the column goes through
host memory as before (pinned staging, `tq_async._paths._device_copy`), which is also what a
reader on another host, or one that asks for host tensors, gets from the unit.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..._errors import BrokenError, ClosedError, DeviceError, ProtocolError
from ..._logging import get_logger
from ..._paths._device import DEVICE_ALIGN, EMULATE_ENV, driver
from ..._paths._shm import PAGE, TOKEN_BYTES, ArenaMap, align
from ..._primitives import Lock, run_sync_off_loop
from ..._transport._dealer import DealerConnection
from ..._wire._codec import DeviceColumn, torch_dtype
from ..._wire._columns import DENSE, JAGGED, ColumnHeader
from ..._wire._protocol import (
    DeviceFrames,
    DeviceHello,
    DeviceHelloReply,
    ShmAlloc,
    ShmFree,
    ShmGrant,
    StoredColumns,
    StorePut,
)
from ._replies import ask_grant, decode

__all__ = ["DEVICE_MIN_BYTES", "DeviceLinks", "DeviceView", "keeps_on_device"]

log = get_logger(__name__)

#: device columns smaller than this go through host memory (a grant's round trip costs more)
DEVICE_MIN_BYTES = 64 << 10


def _discard(_: object) -> None:
    """Drop a value (what a closer returns that nobody needs)."""


def keeps_on_device(t: Any) -> bool:
    """Whether a put may move column ``t`` device to device: a dense tensor, or a jagged
    one ragged in dimension 1, on a GPU (on the host too, in emulation: tests) of at least
    `DEVICE_MIN_BYTES` (of values)."""
    if not isinstance(t, torch.Tensor):
        return False
    kind = t.device.type  # first: a host tensor (the common case) stops here
    if kind != "cuda" and not (kind == "cpu" and os.environ.get(EMULATE_ENV)):
        return False
    if t.is_nested:
        return (
            t.layout == torch.jagged
            and getattr(t, "_ragged_idx", 1) == 1
            and getattr(t, "_lengths", None) is None  # (holes: through host memory)
            and t.values().nbytes >= DEVICE_MIN_BYTES
        )
    return t.layout == torch.strided and t.dim() > 0 and (t.nbytes >= DEVICE_MIN_BYTES)


class _CudaArray:
    """Device memory as ``__cuda_array_interface__`` (what ``torch.as_tensor`` takes)."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


class DeviceView:
    """A unit's device arena opened in this process: ``tensor`` is its bytes (uint8).

    Raises:
        DeviceError: the device is not visible here, or the handle does not open.
        OSError, ValueError: the emulated arena cannot be mapped, or the token differs.
    """

    def __init__(self, hello: DeviceHelloReply) -> None:
        self.size = hello.size
        self._close: Callable[[], None]
        if hello.kind == "cuda":
            cuda = driver()
            ordinal = cuda.ordinal_of(hello.device)
            if ordinal is None:
                raise DeviceError("the unit's GPU is not visible to this process")
            torch.empty(0, device=f"cuda:{ordinal}")  # torch's context first: it is shared
            ptr = cuda.open_handle(ordinal, hello.handle)
            self._close = lambda: cuda.close_handle(ordinal, ptr)
            self.tensor = torch.as_tensor(_CudaArray(ptr, hello.size), device=f"cuda:{ordinal}")
            if bytes(self.tensor[:TOKEN_BYTES].cpu().numpy()) != hello.token:
                self.close()
                raise ValueError("the device arena's token differs from what the unit said")
        elif hello.kind == "host":  # emulation: a memfd mapped as shared memory is
            pid, fd = hello.handle.decode().split(":")
            arena = ArenaMap(int(pid), int(fd), hello.size, hello.token)  # checks the token
            self._close = lambda: _discard(arena.close())
            self.tensor = torch.from_numpy(arena.view)
        else:
            raise ValueError(f"unknown device arena kind {hello.kind!r}")

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def check(self, offset: int, nbytes: int, what: str) -> None:
        """Raise ProtocolError unless ``[offset, +nbytes)`` lies inside the arena."""
        if not (offset >= PAGE and nbytes >= 0 and offset + nbytes <= self.size):
            raise ProtocolError(
                f"{what} [{offset}, +{nbytes}) lies outside the unit's device arena; its reply "
                "is corrupt"
            )

    def close(self) -> None:
        del self.tensor
        try:
            self._close()
        except (BufferError, DeviceError) as exc:  # a view is alive, or the context is gone
            log.debug("a device arena stays mapped", error=str(exc))


def _wait(event: Any) -> None:
    if event is not None:
        event.synchronize()


async def _copied(event: Any) -> None:
    """Once the copies before ``event`` are complete (None: host copies, complete already):
    waited for off the loop, unless they are done already (no thread's hop then)."""
    if event is not None and not event.query():
        await run_sync_off_loop(_wait, event)


def _record(device: torch.device) -> Any:
    """An event after the work queued so far on ``device``'s current stream (None: host)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event


class DeviceLinks:
    """The device arenas of units on this host (per unit: a view, or None for none)."""

    def __init__(self) -> None:
        self._views: dict[int, DeviceView | None] = {}
        self._locks: dict[int, Lock] = {}

    async def link(self, unit_id: int, conn: DealerConnection, timeout: float) -> DeviceView | None:
        """The unit's device arena opened here, asked once per unit (None: host memory)."""
        if unit_id in self._views:
            return self._views[unit_id]
        async with self._locks.setdefault(unit_id, Lock()):
            if unit_id in self._views:
                return self._views[unit_id]
            try:
                payload, _ = await conn.request(DeviceHello(os.getpid()), timeout=timeout)
            except (BrokenError, ClosedError):
                return None  # the socket path decides what a gone unit means
            hello: DeviceHelloReply | None = decode(payload, DeviceHelloReply | None)
            view = None
            if hello is not None:
                try:
                    view = await run_sync_off_loop(DeviceView, hello)
                except (DeviceError, OSError, ValueError, RuntimeError) as exc:
                    log.warning(
                        "the unit's device arena does not open here: host memory instead",
                        unit=unit_id,
                        error=str(exc),
                    )
            self._views[unit_id] = view
            return view

    def forget(self, unit_id: int) -> None:
        """The unit's connection broke: close its arena (asked again next time)."""
        view = self._views.pop(unit_id, None)
        if view is not None:
            view.close()

    def drop_all(self) -> None:
        """Forget every view without closing it (a forked child: they are the parent's)."""
        self._views.clear()
        self._locks.clear()

    def close(self) -> None:
        for unit_id in list(self._views):
            self.forget(unit_id)

    def view(self, unit_id: int) -> DeviceView | None:
        """The unit's device arena as opened here (None: not linked, or none)."""
        return self._views.get(unit_id)

    @staticmethod
    def grant_bytes(columns: Sequence[tuple[int, torch.Tensor]]) -> int:
        """The bytes of a device grant that holds ``columns`` (what `put` copies)."""
        return sum(align(t.nbytes, DEVICE_ALIGN) for _, t in columns)

    async def put(
        self,
        conn: DealerConnection,
        view: DeviceView,
        body: StorePut,
        columns: Sequence[tuple[int, torch.Tensor]],
        timeout: float,
        grant: ShmGrant | None = None,
    ) -> bool:
        """Copy ``columns`` (position in the put, tensor) into a grant of the unit's device
        arena (``grant``, one lent ahead on ``conn`` that holds `grant_bytes`, or one asked
        for now) and describe them in ``body.device``; False when the arena is full. The
        caller gives the grant back if ``body`` does not reach the unit."""
        # the codec made them plain (DeviceColumn): their bytes are their values
        flats = [(i, t.view(-1).view(torch.uint8)) for i, t in columns]
        if grant is None:
            ask = ShmAlloc(self.grant_bytes(columns), device=True)
            grant = await ask_grant(conn, ask, timeout, view, "a device arena grant")
            if grant is None:
                return False
        try:
            spans: list[tuple[int, int]] = []
            pos = 0
            for _, flat in flats:
                n = flat.numel()
                start = grant.offset + pos
                view.tensor[start : start + n].copy_(flat, non_blocking=True)
                spans.append((pos, n))
                pos += align(n, DEVICE_ALIGN)
            await _copied(_record(view.device))
        except BaseException:
            conn.send_best_effort(ShmFree([grant.grant], []))
            raise
        body.device = DeviceFrames(grant.grant, [i for i, _ in flats], spans)
        return True

    async def read(
        self, view: DeviceView, stored: StoredColumns, target: torch.device
    ) -> dict[int, DeviceColumn]:
        """The columns a read left in the device arena (``stored.device_spans``, jagged ones'
        offsets in ``stored.device_offsets``), copied onto ``target`` and complete, by
        column position (the caller then drops the pin)."""
        out: dict[int, DeviceColumn] = {}
        assert stored.device_spans is not None
        offsets = stored.device_offsets or [None] * len(stored.columns)
        if not (len(stored.device_spans) == len(offsets) == len(stored.columns)):
            raise ProtocolError("a read's device spans do not match its columns")
        for j, spans in enumerate(stored.device_spans):
            if spans:
                out[j] = _gather(view, stored.columns[j], spans, stored.n_rows, target, offsets[j])
        if out:
            await _copied(_record(target if target.type == "cuda" else view.device))
        return out


def _gather(
    view: DeviceView,
    header: ColumnHeader,
    spans: Sequence[tuple[int, int]],
    n: int,
    target: torch.device,
    raw_offsets: bytes | None = None,
) -> DeviceColumn:
    """One column out of the arena: its pieces joined into new memory on ``target`` (a
    jagged one's rows at ``raw_offsets``)."""
    dtype = torch_dtype(header.dtype or "")
    total = 0
    for off, nbytes in spans:
        view.check(off, nbytes, "a device span")
        total += nbytes
    item = dtype.itemsize * math.prod(header.shape)
    offsets = _offsets(raw_offsets, n) if header.kind == JAGGED else None
    rows = n if offsets is None else int(offsets[-1])
    if (offsets is None) != (header.kind == DENSE) or total != rows * item:
        raise ProtocolError(f"field {header.name!r} came from the device arena malformed")
    out = torch.empty(total, dtype=torch.uint8, device=target)
    pos = 0
    for off, nbytes in spans:
        out[pos : pos + nbytes].copy_(view.tensor[off : off + nbytes], non_blocking=True)
        pos += nbytes
    return DeviceColumn(out.view(dtype).view((rows, *header.shape)), offsets)


def _offsets(raw: bytes | None, n: int) -> torch.Tensor | None:
    """A jagged column's offsets as a unit sent them (None: malformed)."""
    if raw is None or len(raw) != (n + 1) * 8:
        return None
    offsets = torch.frombuffer(bytearray(raw), dtype=torch.int64)
    if int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any()):
        return None
    return offsets
