"""`CellCalls` alone: the handlers of the requests on a unit's cells, without a socket.

A put's frames are stored and its bytes counted by locality; a get is answered with frames
(shared memory off) and counted for its task too; a clear answers the rows it freed; at
``memory`` level nothing waits for a commit.
"""

from __future__ import annotations

import numpy as np

from tq_async._service._loop import Incoming, WithFrames
from tq_async._service._metrics import Metrics
from tq_async._storage._book import Book
from tq_async._storage._cell_calls import CellCalls
from tq_async._storage._cells import StorageState
from tq_async._storage._device_handlers import DevicePath
from tq_async._storage._shm_handlers import ShmPath
from tq_async._wire._columns import ColumnHeader
from tq_async._wire._protocol import StoreClear, StoreGet, StorePut, StoreStats

DENSE = ColumnHeader("x", "dense", "int64", (2,))  # 16 bytes per row


def _calls() -> CellCalls:
    state = StorageState()
    state.host = "here"
    book = Book("zmq")
    return CellCalls(
        state,
        ShmPath(state, book, cap=0, idle_bytes=0),
        DevicePath(state, book, cap=0, index=0),
        None,
        Metrics(None, "storage"),
    )


def test_puts_gets_and_clears_over_the_socket_count_their_bytes_by_locality() -> None:
    calls = _calls()
    values = np.arange(6, dtype=np.int64).reshape(3, 2)
    put = StorePut("p", [0, 1, 2], [DENSE], incarnation="i", host="here")
    msg = Incoming(b"peer", 1, [b"header", bytearray(values.tobytes())], 0.0)
    assert calls.on_store_put(msg, put) is None  # answered at once
    state = calls.state
    assert state.locality["in_same_host"] == 48

    get = StoreGet("p", [2, 0], ["x"], incarnation="i", host="there", task="train")
    got = calls.on_store_get(Incoming(b"peer", 2, [b"header"], 0.0), get)
    assert isinstance(got, WithFrames)
    data = b"".join(bytes(memoryview(f)) for f in got.frames)
    assert np.frombuffer(data, np.int64).reshape(2, 2).tolist() == [[4, 5], [0, 1]]
    assert state.locality["out_other_host"] == 32
    assert state.task_locality == {"train": {"out_same_host": 0, "out_other_host": 32}}

    stats = calls.on_store_stats(Incoming(b"peer", 3, [], 0.0), StoreStats())
    assert stats.rows == 3
    assert calls.on_store_clear(Incoming(b"peer", 4, [], 0.0), StoreClear("p", [0], "i")) == 1
    assert calls.state.stats().rows == 2


def test_stats_list_the_rows_held_only_when_asked() -> None:
    calls = _calls()
    values = np.arange(6, dtype=np.int64).reshape(3, 2)
    put = StorePut("p", [5, 2, 9], [DENSE], incarnation="i", host="here")
    calls.on_store_put(Incoming(b"peer", 1, [b"header", bytearray(values.tobytes())], 0.0), put)
    assert calls.on_store_stats(Incoming(b"peer", 2, [], 0.0), StoreStats()).held == []
    held = calls.on_store_stats(Incoming(b"peer", 3, [], 0.0), StoreStats(rows=True)).held
    assert [(h.partition_id, h.incarnation) for h in held] == [("p", "i")]
    assert np.frombuffer(held[0].rows, "<i8").tolist() == [2, 5, 9]
