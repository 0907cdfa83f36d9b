"""The wire codec as pure functions: exact round trips and clear errors."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from tq_async import SchemaError, UnsupportedTypeError
from tq_async._codec import columns_from_batch, columns_to_tensordict
from tq_async._columns import ColumnHeader, column_from_frames, column_to_frames

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


def test_dense_receive_is_zero_copy() -> None:
    buf = bytearray(torch.arange(6, dtype=torch.int64).numpy().tobytes())
    header = ColumnHeader("x", "dense", "int64", (3,))
    td = columns_to_tensordict(2, [header], [column_from_frames(header, [buf], 2)])
    buf[0] = 42  # the tensor is a view of the received buffer
    assert td["x"].tolist() == [[42, 1, 2], [3, 4, 5]]


def test_read_only_bytes_are_copied_into_a_writable_tensor() -> None:
    raw = torch.arange(6, dtype=torch.int64).numpy().tobytes()  # bytes: read-only
    header = ColumnHeader("x", "dense", "int64", (3,))
    td = columns_to_tensordict(2, [header], [column_from_frames(header, [raw], 2)])
    td["x"].add_(1)
    assert td["x"].tolist() == [[1, 2, 3], [4, 5, 6]]


def test_large_dense_frame_size() -> None:
    t = torch.zeros(256, 2048, dtype=torch.int64)
    _, headers, columns = columns_from_batch({"ids": t})
    (frame,) = column_to_frames(headers[0], columns[0])
    assert memoryview(frame).nbytes == math.prod(t.shape) * 8


def test_encoding_does_not_copy_contiguous_tensors() -> None:
    t = torch.arange(12, dtype=torch.bfloat16).reshape(4, 3)
    _, headers, columns = columns_from_batch({"x": t})
    (frame,) = column_to_frames(headers[0], columns[0])
    t[0, 0] = 7  # the frame is a view of the tensor's memory
    assert torch.frombuffer(bytearray(frame), dtype=torch.bfloat16)[0] == 7


def test_jagged_result_pads_to_its_longest_row() -> None:
    # without the lengths' bounds torch pads every row to the length of all values together
    rows = torch.nested.as_nested_tensor([torch.arange(2), torch.arange(3)], layout=torch.jagged)
    back = roundtrip(TensorDict({"r": rows}, batch_size=2))["r"]
    assert back.to_padded_tensor(-1).tolist() == [[0, 1, -1], [0, 1, 2]]


def test_numpy_scalar_inside_a_value_is_refused_or_pickled() -> None:
    # np.float64 is a float, but msgpack cannot carry it: a TQError, never a raw TypeError
    data = {"extra": [{"acc": np.float64(1.0)}, {"acc": np.float64(0.5)}]}
    with pytest.raises(UnsupportedTypeError, match="allow_pickle"):
        columns_from_batch(data)
    assert roundtrip(data, allow_pickle=True)["extra"].tolist()[1] == {"acc": 0.5}
