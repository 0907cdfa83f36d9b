"""BufferPool: the recycled memory behind in-process copies."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tq_async._wire._buffers import BufferPool, size_class


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


@given(st.integers(min_value=1, max_value=1 << 34))
def test_size_classes_fit_with_little_slack(n: int) -> None:
    size = size_class(n)
    assert size >= n
    assert size >= 1 << 16
    if n > 1 << 16:
        assert size <= n * 1.125
    assert size_class(size) == size  # a class is its own class


def test_a_copy_is_equal_writable_and_independent() -> None:
    pool = BufferPool()
    source = bytearray(range(256)) * 1024
    copy = pool.copy(source)
    assert bytes(copy) == bytes(source)
    assert not copy.readonly
    copy[0] = 255
    source[1] = 0
    assert source[0] == 0
    assert copy[1] == 1


def test_memory_comes_back_once_nothing_uses_it() -> None:
    pool = BufferPool()
    first = pool.copy(b"a" * 100_000)
    where = address(first)
    tensor = torch.frombuffer(first, dtype=torch.uint8)  # holds the buffer, as a get does
    del first
    gc.collect()
    assert pool.idle_bytes == 0  # the tensor still reads it
    other = pool.copy(b"b" * 100_000)
    assert address(other) != where
    assert bytes(tensor[:3].tolist()) == b"aaa"
    del tensor
    gc.collect()
    assert pool.idle_bytes == size_class(100_000)
    again = pool.copy(b"c" * 99_000)  # same size class: the same memory
    assert address(again) == where
    assert bytes(again[:3]) == b"ccc"
    assert pool.idle_bytes == 0


def test_idle_memory_is_bounded() -> None:
    pool = BufferPool(max_idle_bytes=3 << 20)
    copies = [pool.copy(bytes(1 << 20)) for _ in range(5)]
    del copies
    gc.collect()
    assert pool.idle_bytes == 3 << 20
    pool.clear()
    assert pool.idle_bytes == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16, torch.bool])
def test_a_copy_carries_any_tensor(dtype: torch.dtype) -> None:
    pool = BufferPool()
    t = (torch.arange(50_000) % 3).to(dtype)
    raw = t.view(torch.uint8).numpy()
    copy = pool.copy(raw)
    back = torch.frombuffer(copy, dtype=torch.uint8).view(dtype)
    assert torch.equal(back, t)


class _Cycle:
    """An object in a reference cycle: freed only by the garbage collector."""

    def __init__(self, view: memoryview) -> None:
        self.me = self
        self.view = view


def test_a_collection_while_the_pool_holds_its_lock_does_not_hang() -> None:
    # the collector runs at an allocation of any thread, also one made while the pool holds
    # its lock (a release allocates under it): a pooled view it frees then (one a reference
    # cycle held, as a TensorDict may) is released from inside the pool's critical section.
    # The pool's lock was not reentrant: that thread (an event loop) hung for ever
    pool = BufferPool()
    _Cycle(pool.copy(bytes(100_000)))
    done = threading.Event()

    def collect_while_locked() -> None:
        with pool._lock:
            gc.collect()
        done.set()

    threading.Thread(target=collect_while_locked, daemon=True).start()
    assert done.wait(10), "a release from within the pool's lock deadlocked"
    assert pool.idle_bytes == size_class(100_000)
