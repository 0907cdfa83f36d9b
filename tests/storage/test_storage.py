"""StorageState as a plain class: cells in, views out, reads limited to a byte budget."""

from __future__ import annotations

import numpy as np
import pytest

from tq_async._storage._cells import OverBudget, StorageState
from tq_async._wire._columns import ColumnHeader, JaggedColumn, column_nbytes, column_to_frames

DENSE = ColumnHeader("x", "dense", "int64", (2,))  # 16 bytes per row
JAGGED = ColumnHeader("j", "jagged", "uint8", ())


def put(state: StorageState, rows: list[int], start: int) -> None:
    dense = np.arange(start, start + 2 * len(rows), dtype=np.int64).reshape(len(rows), 2)
    lengths = np.arange(1, len(rows) + 1)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.arange(int(offsets[-1]), dtype=np.uint8).reshape(-1, 1)
    frames = [bytearray(dense.tobytes())]
    frames += [bytearray(bytes(f)) for f in column_to_frames(JAGGED, JaggedColumn(values, offsets))]
    state.put("p", rows, [DENSE, JAGGED], frames)


def test_reads_within_a_budget_and_refuses_beyond_it_before_copying() -> None:
    state = StorageState()
    put(state, [0, 1, 2, 3], 0)  # jagged rows of 1..4 bytes
    put(state, [4, 5], 100)  # 1..2 bytes
    headers, columns = state.get("p", [1, 4], ["x", "j"])  # two chunks: copied together
    assert [h.name for h in headers] == ["x", "j"]
    assert columns[0].data.view(np.int64).tolist() == [[2, 3], [100, 101]]  # type: ignore[union-attr]
    # x: 2 rows x 16 bytes; j: 2 + 1 value bytes + 3 x 8 offset bytes
    size = 32 + 3 + 24
    assert sum(column_nbytes(c) for c in columns) == size
    state.get("p", [1, 4], ["x", "j"], max_bytes=size)
    with pytest.raises(OverBudget):
        state.get("p", [1, 4], ["x", "j"], max_bytes=size - 1)
    with pytest.raises(OverBudget):  # the first field alone is over: j is never gathered
        state.get("p", [1, 4], ["x", "j"], max_bytes=31)


def test_a_jagged_view_counts_only_its_rows() -> None:
    state = StorageState()
    put(state, [0, 1, 2, 3], 0)
    _, (col,) = state.get("p", [3], ["j"])  # a view: offsets [6, 10] into the chunk's values
    assert isinstance(col, JaggedColumn)
    assert col.values.shape[0] == 10  # the whole chunk is still referenced...
    assert column_nbytes(col) == 4 + 16  # ...but only row 3's 4 bytes (+ offsets) travel
    assert sum(memoryview(f).nbytes for f in column_to_frames(JAGGED, col)) == 4 + 16


def test_overwrites_and_clears_match_a_model_and_free_every_chunk() -> None:
    # random puts over overlapping rows, partial clears and reads in any order: every read
    # returns the latest value of each cell, and once everything is cleared no chunk and no
    # byte is held (an overwritten or cleared cell releases its chunk)
    rng = np.random.default_rng(7)
    state = StorageState()
    model: dict[int, int] = {}  # row -> the first dense value written for it last
    for step in range(300):
        action = rng.integers(0, 4)
        if action < 2 or not model:
            rows = sorted({int(r) for r in rng.integers(0, 64, size=int(rng.integers(1, 12)))})
            start = 1000 * step
            put(state, rows, start)
            for k, r in enumerate(rows):
                model[r] = start + 2 * k
        elif action == 2:
            rows = [int(r) for r in rng.choice(sorted(model), size=min(5, len(model)))]
            rows = list(dict.fromkeys(rows))
            state.clear("p", rows)
            for r in rows:
                del model[r]
        else:
            rows = [int(r) for r in rng.permutation(sorted(model))[:20]]
            _, (dense,) = state.get("p", rows, ["x"])
            assert dense.data.view(np.int64)[:, 0].tolist() == [model[r] for r in rows]  # type: ignore[union-attr]
    assert state.resident_bytes > 0
    state.clear("p", None)
    assert state.resident_bytes == 0
    assert state.cells.chunks == {}
    assert state.stats().rows == 0
