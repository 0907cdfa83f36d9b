"""Recycled buffers for the copies an in-process (inproc) connection makes.

inproc hands message buffers over by reference, so a client in the services' process copies
what it puts and what it reads (see `tq_async._transport._routes`). Copies of several MiB into
freshly allocated memory are slow on the machines we measured: glibc gives freed multi-MiB
blocks back to the OS, and every new block page-faults its way in at ~1.7 GB/s
(``../shared/PERF_NOTES.md``). A put of an 8.4 MB batch took 5.5 ms that way against 1.3 ms
into memory already touched.

`BufferPool` keeps freed copy buffers for reuse, bounded: at most ``max_idle_bytes``
wait in the pool, the rest is freed. A buffer returns to the pool when the last user of the
memoryview handed out lets go (a weak-reference finalizer on the numpy view behind it), from
whatever thread that happens in.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import numpy as np

__all__ = ["BufferPool", "buffer_pool"]

#: Smallest size class; copies below pyzmq's copy threshold never come here anyway.
_MIN_CLASS = 1 << 16


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to its size class: steps of 1/8 of a power of two (<= 12.5 %
    slack), at least 64 KiB."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    step = 1 << max(nbytes.bit_length() - 4, 0)
    return -(-nbytes // step) * step


class BufferPool:
    """Writable copies of buffers, in memory recycled from earlier copies.

    Args:
        max_idle_bytes: most bytes kept for reuse while nobody uses them.
    """

    def __init__(self, max_idle_bytes: int = 256 << 20) -> None:
        self.max_idle_bytes = max_idle_bytes
        #: reentrant: the garbage collector may run at an allocation made under it (a release
        #: allocates) and free a pooled view held by a reference cycle, whose finalizer
        #: releases it from within this thread's critical section
        self._lock = threading.RLock()
        self._free: dict[int, list[np.ndarray[Any, Any]]] = {}
        #: bytes waiting in the pool
        self.idle_bytes = 0

    def copy(self, source: Any) -> memoryview:
        """A writable copy of ``source`` (any buffer), as a memoryview of pooled memory.

        The memory goes back to the pool once the memoryview and everything built on it
        through the buffer protocol (a ``torch.frombuffer`` tensor, a ``zmq.Frame``) are gone.
        """
        src = memoryview(source).cast("B")
        view = self._take(src.nbytes)
        view[:] = np.frombuffer(src, dtype=np.uint8)
        return view.data

    def empty(self, nbytes: int) -> memoryview:
        """A writable buffer of ``nbytes`` (contents undefined) in pooled memory; it goes back
        to the pool like a `copy`."""
        return self._take(nbytes).data

    def _take(self, nbytes: int) -> np.ndarray[Any, Any]:
        """``nbytes`` of pooled memory (a buffer of their size class, reused when one is
        idle), given back to the pool once the returned view and all built on it are gone."""
        size = size_class(nbytes)
        base = None
        with self._lock:
            stack = self._free.get(size)
            if stack:
                base = stack.pop()
                self.idle_bytes -= size
        if base is None:
            base = np.empty(size, dtype=np.uint8)
        view = base[:nbytes]
        weakref.finalize(view, self._release, base)
        return view

    def _release(self, base: np.ndarray[Any, Any]) -> None:
        size = base.nbytes
        with self._lock:
            if self.idle_bytes + size <= self.max_idle_bytes:
                self._free.setdefault(size, []).append(base)
                self.idle_bytes += size

    def clear(self) -> None:
        """Free every idle buffer."""
        with self._lock:
            self._free.clear()
            self.idle_bytes = 0


#: The process's pool (buffers are plain memory: nothing to redo after a fork but its lock).
buffer_pool = BufferPool()


def _after_fork() -> None:
    # A thread of the parent (services on a background loop, a copy on a worker thread) may
    # have held the lock at the fork: in the child it would stay held forever, and the first
    # copy (or the release of an inherited buffer at garbage collection) would hang.
    buffer_pool._lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork)
