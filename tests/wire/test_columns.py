"""Columns as bytes (what travels and what storage keeps): no torch needed."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tq_async import ProtocolError
from tq_async._wire._columns import (
    ColumnHeader,
    DenseColumn,
    JaggedColumn,
    ListColumn,
    column_from_frames,
    column_nbytes,
    column_to_frames,
    concat_columns,
    reorder_column,
    take_rows,
)


def jagged(values: list[int], offsets: list[int]) -> JaggedColumn:
    """A jagged column of one-byte elements."""
    return JaggedColumn(
        np.array(values, dtype=np.uint8).reshape(-1, 1), np.array(offsets, dtype=np.int64)
    )


def jagged_rows(col: JaggedColumn) -> list[list[int]]:
    bounds = col.offsets.tolist()
    return [col.values[s:e, 0].tolist() for s, e in itertools.pairwise(bounds)]


def test_truncated_or_corrupt_frames_are_protocol_errors() -> None:
    h = ColumnHeader("x", "dense", "float32", (3,))
    with pytest.raises(ProtocolError, match="truncated"):
        column_from_frames(h, [b"\x00" * 10], 2)
    with pytest.raises(ProtocolError, match="unknown dtype"):
        column_from_frames(ColumnHeader("x", "dense", "float99", ()), [b""], 0)
    with pytest.raises(ProtocolError, match="invalid shape"):
        column_from_frames(ColumnHeader("x", "dense", "int8", (-1,)), [b""], 0)
    with pytest.raises(ProtocolError, match="msgpack"):
        column_from_frames(ColumnHeader("s", "object"), [b"\xc1"], 1)
    with pytest.raises(ProtocolError, match="unknown kind"):
        column_from_frames(ColumnHeader("s", "sparse"), [b""], 1)
    bad_offsets = np.array([0, 5, 2], dtype=np.int64).tobytes()
    with pytest.raises(ProtocolError, match="offsets"):
        column_from_frames(ColumnHeader("j", "jagged", "int64", ()), [b"\x00" * 16, bad_offsets], 2)
    offsets = np.array([0, 1, 3], dtype=np.int64).tobytes()
    with pytest.raises(ProtocolError, match="values of column 'j'"):
        column_from_frames(ColumnHeader("j", "jagged", "int64", ()), [b"\x00" * 16, offsets], 2)


def test_received_columns_are_views_of_the_frames() -> None:
    buf = bytearray(range(12))
    col = column_from_frames(ColumnHeader("x", "dense", "int16", (3,)), [buf], 2)
    assert isinstance(col, DenseColumn)
    assert col.data.shape == (2, 6)
    buf[0] = 42
    assert int(col.data[0, 0]) == 42


def test_frames_round_trip_every_kind() -> None:
    cases = [
        (
            ColumnHeader("d", "dense", "bfloat16", (2,)),
            DenseColumn(np.arange(12, dtype=np.uint8).reshape(3, 4)),
        ),
        (ColumnHeader("j", "jagged", "uint8", ()), jagged([9, 1, 2, 3, 4], [1, 2, 2, 5])),
        (ColumnHeader("o", "object"), ListColumn(["a", 1, None])),
    ]
    for header, column in cases:
        frames = [bytearray(bytes(f)) for f in column_to_frames(header, column)]
        back = column_from_frames(header, frames, len(column))
        if isinstance(column, JaggedColumn):
            assert isinstance(back, JaggedColumn)
            assert jagged_rows(back) == jagged_rows(column)  # offsets rebased to 0 on the wire
            assert back.offsets.tolist() == [0, 1, 1, 4]
        elif isinstance(column, DenseColumn):
            assert isinstance(back, DenseColumn)
            assert back.data.tolist() == column.data.tolist()
        else:
            assert back == column


def test_take_rows_views_and_gathers() -> None:
    dense = DenseColumn(np.arange(10, dtype=np.uint8).reshape(5, 2))
    one = take_rows(dense, [(1, 3)])
    assert isinstance(one, DenseColumn)
    assert np.shares_memory(one.data, dense.data)  # a view, no copy
    many = take_rows(dense, [(0, 1), (3, 5)])
    assert isinstance(many, DenseColumn)
    assert many.data[:, 0].tolist() == [0, 6, 8]

    jag = jagged(list(range(10)), [0, 2, 3, 7, 10])
    sub = take_rows(jag, [(1, 2), (3, 4)])
    assert isinstance(sub, JaggedColumn)
    assert sub.offsets.tolist() == [0, 1, 4]
    assert sub.values[:, 0].tolist() == [2, 7, 8, 9]

    lst = ListColumn(list("abcde"))
    assert take_rows(lst, [(4, 5), (0, 2)]).values == ["e", "a", "b"]  # type: ignore[union-attr]


def test_concat_and_reorder() -> None:
    a = jagged([0, 1, 2], [0, 1, 3])
    b = jagged([10, 11, 12, 13], [1, 2, 4])  # offsets not from 0
    both = concat_columns([a, b])
    assert isinstance(both, JaggedColumn)
    assert jagged_rows(both) == [[0], [1, 2], [11], [12, 13]]
    back = reorder_column(both, [3, 0, 2, 1])
    assert isinstance(back, JaggedColumn)
    assert jagged_rows(back) == [[12, 13], [0], [11], [1, 2]]
    dense = concat_columns(
        [DenseColumn(np.zeros((1, 2), np.uint8)), DenseColumn(np.ones((2, 2), np.uint8))]
    )
    assert isinstance(dense, DenseColumn)
    assert dense.data[:, 0].tolist() == [0, 1, 1]


def test_a_list_column_counts_its_strings_and_containers() -> None:
    # strings counted 0 bytes: memory_cap never spilled them, and a put (or a get) of
    # megabytes of text went through the controller as an inline message
    values = ["x" * 1000, b"y" * 500, {"k": "z" * 300}, ["w" * 200], 7, None]
    encoded = len(column_to_frames(ColumnHeader("v", "object"), ListColumn(values))[0])
    assert abs(column_nbytes(ListColumn(values)) - encoded) < 32  # about what travels
    assert column_nbytes(ListColumn([])) == 0
