"""A client's page-locked view of a storage unit's shared-memory arena.

A GPU copies to and from *page-locked* host memory at the speed of its copy engines (an
H200: ~55 GB/s each way) and to or from ordinary (pageable) memory at a fraction of it
(~14 GB/s into a warm shared-memory mapping, measured with ``.gpu``'s probe; see
``benchmarks/RESULTS.md``, issue 40). So a client putting CUDA tensors to a unit on its host
registers the arena's pages with the CUDA driver (``cuMemHostRegister``) and copies each
column device to host **straight into its grant**: no staging buffer, no second host copy.
A read onto a GPU copies host to device straight out of the pinned spans the same way.

Registration is by whole **chunks** of the arena (`PIN_CHUNK` bytes, aligned), made once
and kept: registering 64 MiB of resident pages costs ~3 ms, of fresh ones ~37 ms, so it is
paid the first time a chunk is used and never again while the client lives.

The one rule that keeps it correct: **a registered page must stay the page the unit sees.**
The unit gives freed pages back to the kernel (``MADV_REMOVE``) when it holds too many idle
ones; a registration made before that keeps the *old* physical page, so a later copy into it
would land where the unit never looks (the probe shows exactly that). Hence a client asks
for its grants and read spans with ``pinned=True``; before answering, the unit records that
this client holds the chunks they touch registered (`Arena.lock_chunks`) and never gives back
pages of a locked chunk. The client registers only chunks named in such answers, and the
locks go when the client unlocks them (`ShmFree.chunks`, when it closes) or exits.

The driver sits behind a seam (`registrar`) so the bookkeeping runs in tests without a GPU.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import Protocol

from .._errors import DeviceError
from .._logging import get_logger
from ._cuda import driver

__all__ = [
    "PIN_CHUNK",
    "PIN_ENV",
    "PinnedChunks",
    "Registrar",
    "chunks_of",
    "pin_arena",
    "split_at_chunks",
]

log = get_logger(__name__)

#: bytes of the arena registered at once (a multiple of the page size)
PIN_CHUNK = 32 << 20

#: ``TQ_ASYNC_PIN_ARENA=0`` turns the page-locked path off (GPU columns are then staged
#: through pinned buffers of their own and copied into the arena by the CPU, as before 0.2)
PIN_ENV = "TQ_ASYNC_PIN_ARENA"


def pin_arena() -> bool:
    """Whether GPU columns are copied straight into (out of) page-locked shared memory."""
    return os.environ.get(PIN_ENV, "1") != "0"


def chunks_of(offset: int, nbytes: int) -> range:
    """The chunks ``[offset, offset + nbytes)`` touches (none for an empty span)."""
    if nbytes <= 0:
        return range(0)
    return range(offset // PIN_CHUNK, (offset + nbytes - 1) // PIN_CHUNK + 1)


def split_at_chunks(offset: int, nbytes: int) -> list[tuple[int, int]]:
    """``[offset, offset + nbytes)`` cut at chunk boundaries, as ``(offset, nbytes)``: the
    driver copies to or from registered memory only within one registration."""
    out = []
    end = offset + nbytes
    while offset < end:
        stop = min(end, (offset // PIN_CHUNK + 1) * PIN_CHUNK)
        out.append((offset, stop - offset))
        offset = stop
    return out


class Registrar(Protocol):
    """Page-locks host memory for a device's copy engines."""

    def register(self, address: int, nbytes: int) -> bool:
        """Register ``[address, address + nbytes)``; False if the driver refused."""
        ...

    def unregister(self, address: int) -> None:
        """Undo `register` of the range starting at ``address``."""
        ...


class _CudaRegistrar:
    """Through the CUDA driver by ``ctypes``, which lets go of the GIL while the driver
    works: registering a cold chunk takes ~15 ms, and torch's ``cudart()`` binding held the
    GIL (and so every thread's event loop) all that time (82 ms stalls on the H200 with three
    chunks). Portable: every context of the process sees the pages as page-locked."""

    def __init__(self) -> None:
        import torch

        self._driver = driver()
        self._ordinal = torch.cuda.current_device()

    def register(self, address: int, nbytes: int) -> bool:
        try:
            self._driver.run(
                self._ordinal,
                "cuMemHostRegister",
                ctypes.c_void_p(address),
                ctypes.c_size_t(nbytes),
                ctypes.c_uint(_PORTABLE),
            )
        except DeviceError as exc:
            log.debug("the CUDA driver refused to page-lock shared memory", error=str(exc))
            return False
        return True

    def unregister(self, address: int) -> None:
        self._driver.run(self._ordinal, "cuMemHostUnregister", ctypes.c_void_p(address))


#: CU_MEMHOSTREGISTER_PORTABLE
_PORTABLE = 1


#: the seam: how chunks are registered (tests record the calls instead)
registrar: Callable[[], Registrar] = _CudaRegistrar


class PinnedChunks:
    """The registered chunks of one mapped arena (``base``: its address here, ``size``).

    Thread-safe: copies run on worker threads. A chunk the driver refuses is remembered as
    refused (copies into it are simply pageable: correct, slower) and logged once.
    """

    def __init__(self, base: int, size: int) -> None:
        self.base = base
        self.size = size
        self.registered: set[int] = set()
        self.refused: set[int] = set()
        self._lock = threading.Lock()
        self._registrar: Registrar | None = None
        self.closed = False

    def ensure(self, offset: int, nbytes: int) -> bool:
        """Register the chunks of ``[offset, offset + nbytes)`` not registered yet (only
        chunks the unit locked for this client: see the module's rule). True when all are."""
        with self._lock:
            if self.closed:
                return False
            ok = True
            for c in chunks_of(offset, nbytes):
                if c in self.registered:
                    continue
                if c in self.refused:
                    ok = False
                    continue
                start = c * PIN_CHUNK
                try:
                    if self._registrar is None:
                        self._registrar = registrar()
                    done = self._registrar.register(
                        self.base + start, min(PIN_CHUNK, self.size - start)
                    )
                except Exception as exc:  # no driver here after all: pageable copies
                    log.debug("could not page-lock shared memory", error=str(exc))
                    done = False
                if done:
                    self.registered.add(c)
                else:
                    self.refused.add(c)
                    ok = False
                    log.warning(
                        "the GPU driver refused to page-lock shared memory; copies to and "
                        "from it run at pageable speed",
                        chunk=c,
                    )
            return ok

    def covers(self, offset: int, nbytes: int) -> bool:
        """Whether every chunk of ``[offset, offset + nbytes)`` is registered already
        (copies to and from them are then asynchronous: they may start on any thread)."""
        registered = self.registered
        return all(c in registered for c in chunks_of(offset, nbytes))

    def close(self) -> list[int]:
        """Unregister every chunk (before the mapping goes); the chunks that were."""
        with self._lock:
            self.closed = True
            done = sorted(self.registered)
            if self._registrar is not None:
                for c in done:
                    self._registrar.unregister(self.base + c * PIN_CHUNK)
            self.registered.clear()
            return done
