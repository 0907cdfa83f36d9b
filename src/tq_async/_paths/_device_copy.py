"""Tensors on accelerators in and out, without stalling the event loop.

A put of CUDA tensors copies each one to pinned host memory with ``non_blocking=True`` on a
side stream that first waits for the caller's stream (so the copy sees what the caller's
kernels wrote), records an event, and waits for it on a worker thread: the event loop goes on
serving other requests meanwhile, and columns on different devices (or on the CPU) travel in
one batch. A read with ``device=`` copies the received columns into pinned memory and on to the
device the same way; a streaming dataset does it in its prefetching task, so the copy of the
next batch overlaps the caller's work on the current one.

Lifetime rules: the caller's CUDA tensors must not be modified until ``put`` returns (the
copies read them); tensors delivered on a device are allocated on the caller's current stream
and complete before they are returned, so using them on that stream needs no synchronisation.

The device work sits behind a small seam, `Copier` (one per device), so that the
logic around it — which values move, jagged tensors and lists of tensors, mixed devices,
rebuilding the batch — runs in tests without a GPU (`HostCopier`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import numpy as np
import torch

from .._errors import InvalidRequestError
from .._wire._nested import jagged_from_values
from .._wire._tensordicts import is_tensordict
from ._pinned import split_at_chunks
from ._shm import ArenaMap

if TYPE_CHECKING:
    from tensordict import TensorDict, TensorDictBase

__all__ = [
    "Copier",
    "DeviceFrame",
    "HostCopier",
    "check_device",
    "copies_to",
    "copy_frames",
    "copy_frames_now",
    "frame_nbytes",
    "read_onto",
    "read_onto_async",
    "stage_frames",
    "stage_frames_now",
    "to_device",
    "to_host",
    "write_frames",
]


class Copier(Protocol):
    """Asynchronous copies between one device and pinned host memory."""

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Start copying ``t`` (on the device) to a new host tensor; return it (incomplete)."""
        ...

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Start copying ``t`` (on the host) to a new device tensor; return it (incomplete)."""
        ...

    def to_host_into(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """Start copying the bytes of ``t`` (contiguous, on the device) into host bytes
        ``out`` (``uint8``, as many bytes; page-locked for full speed)."""
        ...

    def device_bytes(self, nbytes: int) -> torch.Tensor:
        """A new ``uint8`` tensor of ``nbytes`` on the device (for `to_device_into`)."""
        ...

    def to_device_into(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """Start copying host bytes ``t`` (``uint8``) into device bytes ``out``."""
        ...

    def finish(self) -> None:
        """Block until every copy started so far is complete (called on a worker thread)."""
        ...


class _CudaCopier:
    """Copies on a side stream that waits for the caller's stream; completion by event."""

    def __init__(self, device: torch.device) -> None:
        index: int | None = device.index  # None for "cuda": the current device
        if index is None:
            device = torch.device(device.type, torch.cuda.current_device())
        self.device = device
        self.stream = _streams.get(device)
        if self.stream is None:
            self.stream = _streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._caller = torch.cuda.current_stream(device)  # the stream the caller's work is on
        self.stream.wait_stream(self._caller)
        self._event: Any = None

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
        return host

    def to_host_into(self, t: torch.Tensor, out: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            out.copy_(_as_bytes(t), non_blocking=True)

    def device_bytes(self, nbytes: int) -> torch.Tensor:
        with torch.cuda.stream(self._caller):  # freed in order with the caller's work
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def to_device_into(self, t: torch.Tensor, out: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            out.copy_(t, non_blocking=True)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        if t.device == self.device:
            return t  # there already (a fetch_batch_fn may deliver on the device)
        pinned = t if t.is_pinned() else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        if pinned is not t:
            pinned.copy_(t)
        # allocated on the caller's stream (this runs on a worker thread, whose current stream
        # is the default one): freeing it later is ordered with the caller's work
        with torch.cuda.stream(self._caller):
            out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        with torch.cuda.stream(self.stream):
            out.copy_(pinned, non_blocking=True)
        return out

    def finish(self) -> None:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        event.synchronize()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``t``, as a flat ``uint8`` view."""
    return t.detach().reshape(-1).view(torch.uint8)


#: one side stream per device, made on first use
_streams: dict[torch.device, Any] = {}


class HostCopier:
    """A `Copier` between host tensors (tests run the device logic through it)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.copies = 0
        self.finished = threading.Event()

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        self.copies += 1
        return t.detach().clone()

    def to_host_into(self, t: torch.Tensor, out: torch.Tensor) -> None:
        self.copies += 1
        out.copy_(_as_bytes(t))

    def device_bytes(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def to_device_into(self, t: torch.Tensor, out: torch.Tensor) -> None:
        self.copies += 1
        out.copy_(t)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        self.copies += 1
        return t.detach().clone()

    def finish(self) -> None:
        self.finished.set()


def _cuda_copier(device: torch.device) -> Copier:
    return _CudaCopier(device)


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on an accelerator (the seam: tests say every tensor does)."""
    return t.device.type not in ("cpu", "meta")


#: the seam: the copier for a device (tests give a `HostCopier`)
make_copier: Callable[[torch.device], Copier] = _cuda_copier


def check_device(device: Any, *, here: bool = False) -> torch.device | None:
    """``device`` as a ``torch.device`` (None: leave tensors where they are); with ``here``,
    one this process can deliver a read onto (the host, or a CUDA device it sees)."""
    if device is None:
        return None
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidRequestError(
            f"device must be a torch device or its name (e.g. 'cuda:0'), got {device!r}"
        ) from exc
    if not here or target.type == "cpu" or make_copier is not _cuda_copier:  # (tests: any)
        return target
    if target.type != "cuda" or not torch.cuda.is_available():
        why = "" if target.type != "cuda" else ", and this torch sees none (no CUDA)"
        raise InvalidRequestError(
            f"device {str(target)!r} cannot receive the data: tq_async delivers it to the host "
            f"(None or 'cpu') or onto a CUDA device{why}"
        )
    return target


# ---- host -> device (reads) ----------------------------------------------------------------


async def to_device(td: TensorDict, device: torch.device | None) -> TensorDict:
    """``td``'s tensors on ``device`` (non-tensor fields unchanged); ``td`` itself when there
    is nothing to move. The copies run and are waited for on a worker thread."""
    if device is None or (device.type == "cpu" and make_copier is _cuda_copier):
        return td
    return await anyio.to_thread.run_sync(to_device_now, td, device)


def to_device_now(td: TensorDict, device: torch.device | None) -> TensorDict:
    """`to_device` in the calling thread (the blocking client's)."""
    if device is None or (device.type == "cpu" and make_copier is _cuda_copier):
        return td  # read columns are host memory of our own already (tests swap the copier)
    keys = [str(k) for k in td.keys()]  # noqa: SIM118 - a TensorDict's keys
    if not keys:
        return td
    copier = make_copier(device)
    move = _Mover(copier.to_device, host_offsets=True)
    out: dict[str, Any] = {}
    for k in keys:
        v = td.get(k)
        out[k] = move(v) if isinstance(v, torch.Tensor) else v
    copier.finish()
    from tensordict import TensorDict

    return TensorDict(out, batch_size=td.batch_size)


class _Mover:
    """Copies of one batch's tensors; a jagged nested tensor is copied as its values and
    offsets, and jagged tensors that share offsets (fields of equal lengths: one ragged
    dimension) share the copy. With ``host_offsets`` (the offsets are host memory, reads) the
    copies keep the bounds of the rows' lengths (without them ``to_padded_tensor()`` pads
    every row to the length of all values together); device offsets (puts) are not read, as
    that would wait for the device."""

    def __init__(self, copy: Callable[[torch.Tensor], torch.Tensor], *, host_offsets: bool) -> None:
        self._copy = copy
        self._host_offsets = host_offsets
        self._offsets: dict[int, tuple[torch.Tensor, torch.Tensor, int | None, int | None]] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        copy = self._copy
        if t.is_nested and t.layout == torch.jagged and getattr(t, "_lengths", None) is None:
            offsets: torch.Tensor = t.offsets()  # type: ignore[attr-defined]
            # keyed by identity; the source is kept in the entry so the id stays its own
            entry = self._offsets.get(id(offsets))
            if entry is None:
                lo = hi = None
                if self._host_offsets:
                    lengths = offsets.diff()
                    lo, hi = (int(lengths.min()), int(lengths.max())) if len(lengths) else (0, 0)
                entry = self._offsets[id(offsets)] = (offsets, copy(offsets), lo, hi)
            _, moved, lo, hi = entry
            return jagged_from_values(copy(t.values()), moved, lo, hi)
        if t.is_nested:
            return torch.nested.as_nested_tensor([copy(r) for r in t.unbind()], layout=t.layout)
        return copy(t)


# ---- device -> host (puts) -----------------------------------------------------------------


def _device_of(value: Any) -> torch.device | None:
    if isinstance(value, torch.Tensor):
        return value.device if on_device(value) else None
    if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
        for v in value:  # a list column of tensors (a list of plain values stops above)
            if isinstance(v, torch.Tensor) and on_device(v):
                return v.device
    return None


#: which values a put leaves where they are (see `to_host`)
Keep = Callable[[Any], bool] | None


def _host_items(
    data: TensorDictBase | Mapping[str, Any], keep: Keep = None
) -> list[tuple[str, Any]] | None:
    """``data``'s columns when some tensor of it (not kept) is on a device; None when all
    are on the host (or ``data`` is not something put takes: the codec explains what is
    wrong)."""
    if is_tensordict(data):
        if len(data.batch_size) != 1:
            return None
        items = [(k, data.get(k)) for k in data.keys()]  # noqa: SIM118
    else:
        items = list(data.items()) if isinstance(data, Mapping) else []
    for _, v in items:
        if _device_of(v) is not None and (keep is None or not keep(v)):
            return items
    return None


async def to_host(
    data: TensorDictBase | Mapping[str, Any], keep: Keep = None
) -> TensorDictBase | Mapping[str, Any]:
    """``data`` with every tensor on a device copied to pinned host memory (per column, so a
    batch may mix devices); ``data`` itself when every tensor is on the host already.
    Values ``keep`` says yes to stay where they are.

    The copies are started and waited for on a worker thread: the event loop never waits.
    """
    if _host_items(data, keep) is None:
        return data
    return await anyio.to_thread.run_sync(to_host_now, data, keep)


def to_host_now(
    data: TensorDictBase | Mapping[str, Any], keep: Keep = None
) -> TensorDictBase | Mapping[str, Any]:
    """`to_host` in the calling thread (the blocking client's)."""
    items = _host_items(data, keep)
    if items is None:
        return data
    devices = {
        d for _, v in items if (d := _device_of(v)) is not None and (keep is None or not keep(v))
    }
    copiers = {d: make_copier(d) for d in devices}

    def copy(t: torch.Tensor) -> torch.Tensor:
        return copiers[t.device].to_host(t) if on_device(t) else t

    move = _Mover(copy, host_offsets=False)
    out: dict[str, Any] = {}
    for k, v in items:
        if keep is not None and keep(v):
            out[k] = v
        elif isinstance(v, torch.Tensor):
            out[k] = move(v) if on_device(v) else v
        elif isinstance(v, list) and _device_of(v) is not None:
            out[k] = [copy(x.detach()) if isinstance(x, torch.Tensor) else x for x in v]
        else:
            out[k] = v
    for copier in copiers.values():
        copier.finish()
    if is_tensordict(data):
        from tensordict import TensorDict

        return TensorDict(out, batch_size=data.batch_size)
    return out


# ---- device -> a unit's shared memory (puts to a unit on this host) -------------------------


class DeviceFrame:
    """A put's frame still on its device: the bytes of ``tensor`` (dense, contiguous: a
    `DeviceColumn`'s), copied by the device straight into a shared-memory grant."""

    __slots__ = ("nbytes", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.nbytes = tensor.numel() * tensor.element_size()


def frame_nbytes(frame: Any) -> int:
    """Bytes of a frame (a buffer or a `DeviceFrame`)."""
    return frame.nbytes if isinstance(frame, DeviceFrame) else memoryview(frame).nbytes


async def copy_frames(
    arena: ArenaMap, offset: int, frames: Sequence[Any], loop_copy_bytes: int
) -> list[tuple[int, int]]:
    """`write_frames` without blocking the event loop, and with one hand-off to a worker
    thread: when every chunk the grant touches is page-locked already, the device copies
    (asynchronous then) are started here and only the wait for them (and the host frames'
    copies, unless they are under ``loop_copy_bytes``) runs on a worker. Each hand-off of
    the GIL between the loop's thread and a worker can cost up to the interpreter's switch
    interval (5 ms) while the loop is busy, so a worker that started a dozen copies waited
    for the GIL a dozen times (on an H200, with the loop busy: 60 ms a 256 MiB put)."""
    spans = arena.layout(offset, [frame_nbytes(f) for f in frames])
    end = offset + (spans[-1][0] + spans[-1][1] if spans else 0)
    pinned = arena.pinned_chunks()
    if not pinned.covers(offset, end - offset):  # chunks to register first: all off the loop
        return await anyio.to_thread.run_sync(write_frames, arena, offset, frames)
    copiers = _start_device_copies(arena, offset, frames, spans)
    host_bytes = sum(n for f, (_, n) in zip(frames, spans, strict=True) if _by_cpu(f))
    host_on_loop = host_bytes < loop_copy_bytes

    def rest() -> None:
        _copy_host_frames(arena, offset, frames, spans)
        for copier in copiers.values():
            copier.finish()

    if host_on_loop:
        _copy_host_frames(arena, offset, frames, spans)
        if copiers:
            await anyio.to_thread.run_sync(_finish_all, list(copiers.values()))
    else:
        await anyio.to_thread.run_sync(rest)
    return spans


def copy_frames_now(
    arena: ArenaMap, offset: int, frames: Sequence[Any], loop_copy_bytes: int
) -> list[tuple[int, int]]:
    """`copy_frames` in the calling thread (the blocking client's): `write_frames`."""
    return write_frames(arena, offset, frames)


def _by_cpu(frame: Any) -> bool:
    """Whether the CPU copies ``frame`` (not a frame its device copies)."""
    return not (isinstance(frame, DeviceFrame) and on_device(frame.tensor))


def _finish_all(copiers: list[Copier]) -> None:
    for copier in copiers:
        copier.finish()


def _start_device_copies(
    arena: ArenaMap, offset: int, frames: Sequence[Any], spans: list[tuple[int, int]]
) -> dict[torch.device, Copier]:
    """Start the copies of the `DeviceFrame`s into their spans; the copiers to finish."""
    copiers: dict[torch.device, Copier] = {}
    view = arena.view
    for f, (rel, n) in zip(frames, spans, strict=True):
        if not (isinstance(f, DeviceFrame) and n and on_device(f.tensor)):
            continue
        t, pos = f.tensor, offset + rel
        copier = copiers.get(t.device)
        if copier is None:
            copier = copiers[t.device] = make_copier(t.device)
        src = _as_bytes(t)
        for a, m in split_at_chunks(pos, n):  # one copy never spans two registrations
            copier.to_host_into(src[a - pos : a - pos + m], torch.from_numpy(view[a : a + m]))
    return copiers


def _copy_host_frames(
    arena: ArenaMap, offset: int, frames: Sequence[Any], spans: list[tuple[int, int]]
) -> None:
    """Copy the frames the CPU copies (host frames; host tensors of emulated devices)."""
    view = arena.view
    for f, (rel, n) in zip(frames, spans, strict=True):
        if isinstance(f, DeviceFrame):
            if on_device(f.tensor):
                continue
            f = _as_bytes(f.tensor).numpy()  # a host tensor (emulated devices: tests)
        if n:
            pos = offset + rel
            view[pos : pos + n] = np.frombuffer(memoryview(f).cast("B"), dtype=np.uint8)


def write_frames(arena: ArenaMap, offset: int, frames: Sequence[Any]) -> list[tuple[int, int]]:
    """`ArenaMap.write`, with `DeviceFrame`s copied device to host straight into the arena:
    the chunks the grant touches are page-locked first (once per chunk and process, see
    `tq_async._paths._pinned`), the device copies start, the host frames are copied while
    they run, and it returns once all are done. Blocks: call it on a worker thread.

    Raises:
        SessionLostError: the unit restarted since the grant (`ArenaMap.check_boot`).
    """
    arena.check_boot()
    spans = arena.layout(offset, [frame_nbytes(f) for f in frames])
    if any(isinstance(f, DeviceFrame) and on_device(f.tensor) for f in frames):
        end = offset + spans[-1][0] + spans[-1][1]
        arena.pinned_chunks().ensure(offset, end - offset)
    copiers = _start_device_copies(arena, offset, frames, spans)
    _copy_host_frames(arena, offset, frames, spans)  # the CPU's part, meanwhile
    for copier in copiers.values():
        copier.finish()
    return spans


async def stage_frames(frames: Sequence[Any]) -> list[Any]:
    """``frames`` with every `DeviceFrame` copied to pinned host memory (a put that goes
    by socket after all: the arena was full). The copies are waited for off the loop."""
    if not any(isinstance(f, DeviceFrame) for f in frames):
        return list(frames)
    return await anyio.to_thread.run_sync(stage_frames_now, frames)


def stage_frames_now(frames: Sequence[Any]) -> list[Any]:
    """`stage_frames` in the calling thread (the blocking client's)."""
    held = {str(i): f.tensor for i, f in enumerate(frames) if isinstance(f, DeviceFrame)}
    if not held:
        return list(frames)
    moved = to_host_now(held)
    return [
        _as_bytes(moved[str(i)]).numpy().data if isinstance(f, DeviceFrame) else f
        for i, f in enumerate(frames)
    ]


# ---- a unit's shared memory -> device (reads by a client on the unit's host) ---------------


def copies_to(device: torch.device) -> bool:
    """Whether reads onto ``device`` copy to it (not for the host, unless tests say so)."""
    return device.type != "cpu" or make_copier is not _cuda_copier


async def read_onto_async(
    arena: ArenaMap, spans: Sequence[tuple[int, int]], device: torch.device
) -> list[torch.Tensor]:
    """`read_onto` without blocking the event loop: when the spans' chunks are page-locked
    already the copies (asynchronous then) start here and only their wait runs on a worker
    (one hand-off of the GIL; see `copy_frames`)."""
    pinned = arena.pinned_chunks()
    if not all(pinned.covers(off, n) for off, n in spans):
        return await anyio.to_thread.run_sync(read_onto, arena, spans, device)
    copier = make_copier(device)
    out = _start_reads(arena, spans, copier)
    await anyio.to_thread.run_sync(copier.finish)
    return out


def _start_reads(
    arena: ArenaMap, spans: Sequence[tuple[int, int]], copier: Copier
) -> list[torch.Tensor]:
    view = arena.view
    out = []
    for off, n in spans:
        dst = copier.device_bytes(n)
        for a, m in split_at_chunks(off, n):  # one copy never spans two registrations
            copier.to_device_into(torch.from_numpy(view[a : a + m]), dst[a - off : a - off + m])
        out.append(dst)
    return out


def read_onto(
    arena: ArenaMap, spans: Sequence[tuple[int, int]], device: torch.device
) -> list[torch.Tensor]:
    """New ``uint8`` tensors on ``device`` holding the arena's ``spans`` (checked by the
    caller), copied host to device straight out of page-locked chunks (registered on first
    use); complete when it returns. Blocks: call it on a worker thread, while the unit
    holds the spans pinned."""
    pinned = arena.pinned_chunks()
    for off, n in spans:
        pinned.ensure(off, n)
    copier = make_copier(device)
    out = _start_reads(arena, spans, copier)
    copier.finish()
    return out
