"""Device memory a storage unit owns and same-host clients open: CUDA IPC, without torch.

Measured on an H200 (``benchmarks/RESULTS.md``, "On a GPU"): moving a GPU tensor from one
process to another through host memory ran at ~2 GB/s, torch's own CUDA IPC at ~400 GB/s.
So a storage unit on a GPU host may own a **device arena** (``gpu_cap`` bytes of one GPU's
memory): a client on its host copies a put's CUDA columns straight into it (device to
device) and a read's back out of it onto the device it names, and only a small message
travels. The cells stay owned by the unit, as shared-memory cells are, so the guarantees do
not change: a producer that exits after its put takes nothing with it, and a dead unit is
a dead unit whatever memory its cells were in.

Rules (the shared-memory ones of `tq_async._paths._shm`, for device memory):

* **Only the unit allocates.** One ``cuMemAlloc`` of ``gpu_cap`` bytes when the unit
  starts; the driver frees it with the unit's process (and every client's mapping of it
  goes with the last one closed).
* **Verified, never assumed.** A client opens the arena's IPC handle (only processes on the
  unit's host can) and must read back the random token the unit wrote at its start; only a
  client the unit already shares host memory with (a verified shared-memory peer, so a
  process on its host) is offered it.
* **Never trust a client's offsets; death frees a client's claims.** Grants and read pins
  work as for shared memory (checked spans, released when the client says so or its
  process exits).
* **Readers copy.** A read copies the cells onto the reader's device before the unit's pin
  is dropped: what a read returns is memory of the reader's own.

The services never import torch: the unit talks to the CUDA driver (``libcuda``) through
`ctypes`. The device work sits behind `DeviceMemory`; `HostMemory`
stands for it in tests without a GPU (``TQ_ASYNC_GPU_EMULATE=1`` in a unit's environment:
the "device" arena is then host memory that clients map; for tests only).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import secrets
import threading
import time
from typing import Any, Protocol

import numpy as np

from .._errors import DeviceError, InvalidRequestError
from ._cuda import CudaDriver, driver
from ._shm import PAGE, TOKEN_BYTES, Extents, Region, align

__all__ = [
    "CudaDriver",
    "DeviceArena",
    "DeviceCells",
    "DeviceJaggedCells",
    "DeviceMemory",
    "EMULATE_ENV",
    "HostMemory",
    "driver",
    "open_device_arena",
]

#: set in a storage unit's environment, its device arena is host memory (tests only)
EMULATE_ENV = "TQ_ASYNC_GPU_EMULATE"
#: device arena spans start on this boundary (any dtype's view of them is aligned)
DEVICE_ALIGN = 256


class DeviceMemory(Protocol):
    """One allocation of device memory, as the unit holds it."""

    #: ``"cuda"`` (a CUDA IPC handle) or ``"host"`` (emulation: ``pid:fd`` of a memfd)
    kind: str
    size: int
    #: what a client opens: the IPC handle
    handle: bytes
    #: the device's UUID (clients find their ordinal of it)
    device: bytes

    def read(self, offset: int, out: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        """Copy ``[offset, offset + out.nbytes)`` into host array ``out``."""
        ...

    def host_buffer(self, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """A host array to `read` into at the device's full speed (page-locked)."""
        ...

    def write(self, offset: int, data: bytes) -> None:
        """Copy host bytes ``data`` to ``offset``."""
        ...

    def close(self) -> None: ...


class CudaMemory:
    """``size`` bytes of GPU ``ordinal``'s memory (``cuMemAlloc``), shared by IPC handle."""

    kind = "cuda"

    def __init__(self, ordinal: int, size: int) -> None:
        self._driver = driver()
        self.ordinal = ordinal
        self.size = size
        self.device = self._driver.uuid(ordinal)
        self._blocks: HostBlocks | None = None
        self.ptr = self._driver.alloc(ordinal, size)
        try:
            self.handle = self._driver.ipc_handle(ordinal, self.ptr)
        except BaseException:
            self._driver.free(ordinal, self.ptr)
            raise

    def read(self, offset: int, out: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        if out.nbytes:
            self._driver.to_host(self.ordinal, out.ctypes.data, self.ptr + offset, out.nbytes)

    def host_buffer(self, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        # page-locked: a copy into fresh pageable memory ran at 2.75 GiB/s (its pages
        # faulted in one by one), into page-locked memory at the copy engine's speed
        if self._blocks is None:
            self._blocks = HostBlocks(self._driver, self.ordinal)
        return self._blocks.array(nbytes)

    def write(self, offset: int, data: bytes) -> None:
        buf = ctypes.create_string_buffer(data, len(data))
        self._driver.to_device(self.ordinal, self.ptr + offset, ctypes.addressof(buf), len(data))

    def close(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            self._driver.free(self.ordinal, ptr)


class _Block:
    """One page-locked block; back to its pool when the last array over it goes."""

    __slots__ = ("pool", "ptr", "size")

    def __init__(self, pool: HostBlocks, ptr: int, size: int) -> None:
        self.pool, self.ptr, self.size = pool, ptr, size

    def __del__(self) -> None:
        self.pool.give(self.ptr, self.size)


class HostBlocks:
    """Page-locked host memory from the CUDA driver for a unit's copy-out, reused by size
    (powers of two, at least 1 MiB); at most ``idle_limit`` bytes wait for reuse, the rest
    is freed."""

    def __init__(self, driver: CudaDriver, ordinal: int, idle_limit: int = 512 << 20) -> None:
        self._driver, self._ordinal, self.idle_limit = driver, ordinal, idle_limit
        self._idle: dict[int, list[int]] = {}
        self.idle_bytes = 0
        self._lock = threading.Lock()

    def array(self, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """A new ``uint8`` array of ``nbytes`` in page-locked memory."""
        size = max(1 << 20, 1 << max(nbytes - 1, 0).bit_length())
        with self._lock:
            free = self._idle.get(size)
            ptr = free.pop() if free else 0
            if ptr:
                self.idle_bytes -= size
        if not ptr:
            ptr = self._driver.host_alloc(self._ordinal, size)
        raw = (ctypes.c_uint8 * size).from_address(ptr)
        raw.owner = _Block(self, ptr, size)  # type: ignore[attr-defined]
        return np.ctypeslib.as_array(raw)[:nbytes]

    def give(self, ptr: int, size: int) -> None:
        with self._lock:
            if self.idle_bytes + size <= self.idle_limit:
                self._idle.setdefault(size, []).append(ptr)
                self.idle_bytes += size
                return
        with contextlib.suppress(DeviceError):  # the driver is going away: nothing to do
            self._driver.host_free(self._ordinal, ptr)


class HostMemory:
    """Host memory standing in for a device (tests): a memfd clients map by ``pid:fd``."""

    kind = "host"

    def __init__(self, ordinal: int, size: int) -> None:
        self.size = size
        self.device = b"host-emulation-%d" % ordinal
        self.fd = os.memfd_create("tq-device-emulation", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.mmap = mmap.mmap(self.fd, size)
        self.view = np.frombuffer(self.mmap, dtype=np.uint8)
        self.handle = f"{os.getpid()}:{self.fd}".encode()

    def read(self, offset: int, out: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        out[...] = self.view[offset : offset + out.nbytes]

    def host_buffer(self, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        return np.empty(nbytes, dtype=np.uint8)

    def write(self, offset: int, data: bytes) -> None:
        self.view[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)

    def close(self) -> None:
        if self.fd >= 0:
            del self.view
            with contextlib.suppress(BufferError):  # a view is alive: unmapped when it goes
                self.mmap.close()
            os.close(self.fd)
            self.fd = -1


class DeviceArena:
    """The unit's device arena: one `DeviceMemory` and a first-fit allocator.

    The first ``PAGE`` bytes hold the token clients verify. Regions are freed with their
    last reference (chunks, grants, read pins), as the shared-memory arena's are.
    """

    def __init__(self, memory: DeviceMemory) -> None:
        if memory.size < 2 * PAGE:
            raise InvalidRequestError(f"gpu_cap must be at least {2 * PAGE} bytes")
        self.memory = memory
        self.cap = memory.size
        self.token = secrets.token_bytes(TOKEN_BYTES)
        memory.write(0, self.token)
        self._extents = Extents(PAGE, self.cap - PAGE)
        self.live_bytes = 0
        #: puts and reads served through the device arena, and puts that did not fit
        self.puts = 0
        self.reads = 0
        self.fallbacks = 0
        #: bytes copied out to host memory for readers that want it, and the time it took
        self.out_bytes = 0
        self.out_seconds = 0.0
        self.closed = False

    def alloc(self, nbytes: int) -> Region | None:
        region = self._extents.take_region(nbytes)
        if region is not None:
            self.live_bytes += region.size
        return region

    def trim(self, region: Region, nbytes: int) -> None:
        """Free the tail of ``region`` past its first ``nbytes`` (page-rounded, at least a
        page): a grant lent ahead of a put turned out larger than the put."""
        keep = max(PAGE, align(nbytes, PAGE))
        if keep < region.size:
            self.live_bytes -= region.size - keep
            if not self.closed:
                self._extents.give(region.offset + keep, region.size - keep)
            region.size = keep

    def release(self, region: Region) -> None:
        region.refs -= 1
        if region.refs == 0:
            self.live_bytes -= region.size
            if not self.closed:
                self._extents.give(region.offset, region.size)

    def read(self, offset: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """``[offset, offset + nbytes)`` copied to a new host array (page-locked: counted
        in ``out_bytes``/``out_seconds``, what a reader that wants host memory costs)."""
        t0 = time.perf_counter()
        out = self.memory.host_buffer(nbytes)
        self.memory.read(offset, out)
        self.out_seconds += time.perf_counter() - t0
        self.out_bytes += nbytes
        return out

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.memory.close()


def open_device_arena(ordinal: int, cap: int) -> DeviceArena:
    """A device arena of ``cap`` bytes on GPU ``ordinal`` (host memory when the environment
    says `EMULATE_ENV`).

    Raises:
        DeviceError: no CUDA driver, no such GPU, or not enough device memory.
    """
    cap = align(cap, PAGE)
    if os.environ.get(EMULATE_ENV):
        return DeviceArena(HostMemory(ordinal, cap))
    return DeviceArena(CudaMemory(ordinal, cap))


def device_span_ok(offset: int, nbytes: int, size: int) -> bool:
    """Whether ``[offset, offset + nbytes)`` lies in a region of ``size`` bytes, aligned."""
    return offset >= 0 and nbytes >= 0 and offset + nbytes <= size and offset % DEVICE_ALIGN == 0


class DeviceCells:
    """Rows ``[0, n)`` of a dense column in the device arena, from ``offset``, ``row_bytes``
    each (what a storage unit keeps for a column put from a device)."""

    __slots__ = ("n", "offset", "row_bytes")

    def __init__(self, offset: int, row_bytes: int, n: int) -> None:
        self.offset = offset
        self.row_bytes = row_bytes
        self.n = n

    def __len__(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        return self.n * self.row_bytes

    def rows(self, a: int, b: int) -> DeviceCells:
        """Rows ``[a, b)``."""
        return DeviceCells(self.offset + a * self.row_bytes, self.row_bytes, b - a)


class DeviceJaggedCells(DeviceCells):
    """Rows of a jagged column in the device arena: its values from ``offset`` (the first
    row's), ``item_bytes`` (``row_bytes``) per element along the ragged dimension; row ``i``
    is elements ``[offsets[i], offsets[i + 1])`` counted from ``offsets[0]`` (host int64)."""

    __slots__ = ("offsets",)

    def __init__(self, offset: int, item_bytes: int, offsets: np.ndarray[Any, Any]) -> None:
        super().__init__(offset, item_bytes, len(offsets) - 1)
        self.offsets = offsets

    @property
    def nbytes(self) -> int:
        return int(self.offsets[-1] - self.offsets[0]) * self.row_bytes

    def rows(self, a: int, b: int) -> DeviceJaggedCells:
        """Rows ``[a, b)``."""
        skip = int(self.offsets[a] - self.offsets[0]) * self.row_bytes
        return DeviceJaggedCells(self.offset + skip, self.row_bytes, self.offsets[a : b + 1])
