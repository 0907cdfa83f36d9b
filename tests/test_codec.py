"""The wire codec as pure functions: exact round trips and clear errors."""

from __future__ import annotations

import itertools
import math

import msgspec
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from tq_async import ProtocolError, SchemaError, UnsupportedTypeError
from tq_async._codec import (
    ColumnHeader,
    DenseColumn,
    JaggedColumn,
    ListColumn,
    column_from_frames,
    column_to_frames,
    columns_from_batch,
    columns_to_tensordict,
    concat_columns,
    reorder_column,
    take_rows,
)

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def roundtrip(data: object, *, allow_pickle: bool = False) -> TensorDict:
    """Encode to frames as bytes (as if over a socket) and rebuild the TensorDict."""
    n, headers, columns = columns_from_batch(data, allow_pickle=allow_pickle)  # type: ignore[arg-type]
    wire_headers = msgspec.msgpack.decode(msgspec.msgpack.encode(headers), type=list[ColumnHeader])
    rebuilt = []
    for h, c in zip(wire_headers, columns, strict=True):
        frames = [bytearray(bytes(f)) for f in column_to_frames(h, c)]
        rebuilt.append(column_from_frames(h, frames, n))
    return columns_to_tensordict(n, wire_headers, rebuilt)


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5,), (5, 3), (5, 2, 4), (1, 0)], ids=str)
def test_dense_roundtrip_is_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = make_tensor(dtype, shape)
    out = roundtrip(TensorDict({"x": t}, batch_size=[shape[0]]))
    got = out["x"]
    assert not got.is_nested
    assert got.dtype == dtype
    assert got.shape == t.shape
    assert torch.equal(got, t)


def test_non_contiguous_and_0d_rows() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    t = base[:, ::2]  # a strided view
    out = roundtrip({"x": t, "scalar": torch.arange(4)})
    assert torch.equal(out["x"], t)
    assert out["scalar"].shape == (4,)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bfloat16, torch.bool], ids=str)
def test_jagged_roundtrip_stays_jagged(dtype: torch.dtype) -> None:
    rows = [make_tensor(dtype, (n, 3)) for n in (1, 4, 0, 7)]
    njt = torch.nested.nested_tensor(rows, layout=torch.jagged)
    out = roundtrip(TensorDict({"r": njt}, batch_size=[4]))
    got = out["r"]
    assert got.is_nested
    assert got.layout == torch.jagged
    assert got.dtype == dtype
    for a, b in zip(got.unbind(), rows, strict=True):
        assert torch.equal(a, b)


def test_list_of_tensors_becomes_jagged() -> None:
    rows = [torch.arange(n) for n in (3, 1, 2)]
    out = roundtrip({"r": rows})
    assert out["r"].is_nested
    assert [t.tolist() for t in out["r"].unbind()] == [r.tolist() for r in rows]


def test_plain_values_roundtrip() -> None:
    values = ["a", 1, 2.5, True, None, b"\x00\xff", [1, "x"], {"k": [1, 2], "j": None}]
    out = roundtrip({"v": values})
    assert isinstance(out.get("v"), NonTensorStack)
    assert out.get("v").tolist() == values


def test_unsupported_object_names_field_and_type() -> None:
    class Opaque:
        pass

    with pytest.raises(UnsupportedTypeError, match=r"field 'obj'.*Opaque.*allow_pickle"):
        columns_from_batch({"obj": [Opaque(), Opaque()]})
    with pytest.raises(UnsupportedTypeError, match=r"tuple"):
        columns_from_batch({"t": [(1, 2)]})


def test_pickle_when_allowed() -> None:
    values = [(1, 2), {3, 4}]
    out = roundtrip({"t": values}, allow_pickle=True)
    assert out.get("t").tolist() == values


def test_mismatched_batch_sizes_raise() -> None:
    with pytest.raises(SchemaError, match="batch has 4 rows"):
        columns_from_batch({"a": torch.zeros(4), "b": torch.zeros(3)})
    with pytest.raises(SchemaError, match="has 2 rows"):
        columns_from_batch({"a": torch.zeros(4), "s": ["x", "y"]})


def test_empty_and_wrong_inputs_raise() -> None:
    with pytest.raises(SchemaError, match="no rows"):
        columns_from_batch({"a": torch.zeros(0)})
    with pytest.raises(UnsupportedTypeError):
        columns_from_batch([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(SchemaError, match="flatten"):
        columns_from_batch(TensorDict({"a": TensorDict({"b": torch.zeros(2)}, [2])}, [2]))


def test_truncated_frame_is_a_protocol_error() -> None:
    h = ColumnHeader("x", "dense", "float32", (3,))
    with pytest.raises(ProtocolError, match="truncated"):
        column_from_frames(h, [b"\x00" * 10], 2)
    with pytest.raises(ProtocolError, match="unknown dtype"):
        column_from_frames(ColumnHeader("x", "dense", "float99", ()), [b""], 0)
    with pytest.raises(ProtocolError, match="msgpack"):
        column_from_frames(ColumnHeader("s", "object"), [b"\xc1"], 1)
    bad_offsets = torch.tensor([0, 5, 2], dtype=torch.int64).numpy().tobytes()
    with pytest.raises(ProtocolError, match="offsets"):
        column_from_frames(ColumnHeader("j", "jagged", "int64", ()), [b"\x00" * 16, bad_offsets], 2)


def test_dense_receive_is_zero_copy() -> None:
    buf = bytearray(torch.arange(6, dtype=torch.int64).numpy().tobytes())
    col = column_from_frames(ColumnHeader("x", "dense", "int64", (3,)), [buf], 2)
    assert isinstance(col, DenseColumn)
    buf[0] = 42  # the tensor is a view of the received buffer
    assert int(col.data[0, 0]) == 42


def test_take_rows_views_and_gathers() -> None:
    dense = DenseColumn(torch.arange(10).reshape(5, 2))
    one = take_rows(dense, [(1, 3)])
    assert isinstance(one, DenseColumn)
    assert one.data.data_ptr() == dense.data[1].data_ptr()  # a view, no copy
    many = take_rows(dense, [(0, 1), (3, 5)])
    assert isinstance(many, DenseColumn)
    assert many.data[:, 0].tolist() == [0, 6, 8]

    jag = JaggedColumn(torch.arange(10), torch.tensor([0, 2, 3, 7, 10]))
    sub = take_rows(jag, [(1, 2), (3, 4)])
    assert isinstance(sub, JaggedColumn)
    assert sub.offsets.tolist() == [0, 1, 4]
    assert sub.values.tolist() == [2, 7, 8, 9]

    lst = ListColumn(list("abcde"))
    assert take_rows(lst, [(4, 5), (0, 2)]).values == ["e", "a", "b"]  # type: ignore[union-attr]


def test_concat_and_reorder() -> None:
    a = JaggedColumn(torch.arange(3), torch.tensor([0, 1, 3]))
    b = JaggedColumn(torch.arange(10, 14), torch.tensor([1, 2, 4]))  # offsets not from 0
    both = concat_columns([a, b])
    assert isinstance(both, JaggedColumn)
    assert jagged_rows(both) == [[0], [1, 2], [11], [12, 13]]
    back = reorder_column(both, [3, 0, 2, 1])
    assert isinstance(back, JaggedColumn)
    assert jagged_rows(back) == [[12, 13], [0], [11], [1, 2]]


def jagged_rows(col: JaggedColumn) -> list[list[int]]:
    bounds = col.offsets.tolist()
    return [col.values[s:e].tolist() for s, e in itertools.pairwise(bounds)]


def test_large_dense_frame_size() -> None:
    t = torch.zeros(256, 2048, dtype=torch.int64)
    _, headers, columns = columns_from_batch({"ids": t})
    (frame,) = column_to_frames(headers[0], columns[0])
    assert memoryview(frame).nbytes == math.prod(t.shape) * 8
