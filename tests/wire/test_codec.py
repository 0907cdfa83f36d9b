"""The wire codec as pure functions: exact round trips and clear errors."""

from __future__ import annotations

import io
import math

import msgspec
import numpy as np
import pytest
import torch
from tensordict import LazyStackedTensorDict, NonTensorStack, TensorDict

from tq_async import ProtocolError, SchemaError, UnsupportedTypeError
from tq_async._wire import _nested
from tq_async._wire._codec import columns_from_batch, columns_to_tensordict
from tq_async._wire._columns import ColumnHeader, column_from_frames, column_to_frames, empty_column

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


def test_numpy_views_of_every_layout_roundtrip() -> None:
    # a reversed view has negative strides, which torch.from_numpy refuses (a raw ValueError)
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    arrays = {
        "reversed": base[::-1],
        "reversed_cols": base[:, ::-2],
        "strided": base[:, ::2],
        "transposed": base.T[:4],
        "big_endian": base.astype(">i4")[::-1],
    }
    out = roundtrip(arrays)
    for name, a in arrays.items():
        assert out[name].dtype == torch.int32
        assert out[name].tolist() == a.tolist(), name
    rows = {"r": [base[0, ::-1], base[1, :2][::-1]]}  # a list of arrays: jagged
    assert [t.tolist() for t in roundtrip(rows)["r"].unbind()] == [a.tolist() for a in rows["r"]]


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


def test_a_list_of_tensors_that_are_not_dense_is_refused() -> None:
    # a list of sparse rows failed with torch's raw "unsupported memory format" RuntimeError
    sparse = torch.eye(2).to_sparse()
    nested = torch.nested.nested_tensor([torch.ones(2)], layout=torch.jagged)
    for rows, what in (
        ([torch.ones(2, 2), sparse], "row 1 is of layout torch.sparse_coo"),
        ([sparse, sparse], "row 0 is of layout torch.sparse_coo"),
        ([nested, nested], "row 0 is a nested tensor"),
    ):
        with pytest.raises(UnsupportedTypeError, match=rf"field 'r' is a list of tensors.*{what}"):
            columns_from_batch({"r": rows})


def test_a_list_of_scalar_tensors_says_to_stack_them() -> None:
    # the error said the rows differ: "row 0 is torch.int64(), another row is torch.int64()"
    for rows in ([torch.tensor(1), torch.tensor(2)], [np.array(1.0), np.array(2.0)]):
        with pytest.raises(SchemaError, match=r"field 'r'.*row 0 is 0-dim.*torch.stack\(rows\)"):
            columns_from_batch({"r": rows, "x": torch.zeros(2)})
    assert roundtrip({"r": torch.stack([torch.tensor(1), torch.tensor(2)])})["r"].tolist() == [1, 2]


def test_a_lazy_stack_of_rows_of_different_lengths_becomes_jagged() -> None:
    # tensordict's way to hold rows of different lengths: the put failed with tensordict's
    # raw "Failed to stack tensors" RuntimeError
    rows = [TensorDict({"r": torch.arange(k), "s": f"row{k}"}) for k in (2, 3, 1)]
    out = roundtrip(LazyStackedTensorDict.lazy_stack(rows))
    assert out["r"].is_nested
    assert [t.tolist() for t in out["r"].unbind()] == [[0, 1], [0, 1, 2], [0]]
    assert out.get("s").tolist() == ["row2", "row3", "row1"]
    same = LazyStackedTensorDict.lazy_stack([TensorDict({"r": torch.arange(2)})] * 2)
    assert roundtrip(same)["r"].tolist() == [[0, 1], [0, 1]]  # one shape: dense
    wider = LazyStackedTensorDict.lazy_stack([TensorDict({"r": torch.zeros(1, k)}) for k in (1, 2)])
    with pytest.raises(SchemaError, match="field 'r' is a list of tensors"):
        columns_from_batch(wider)


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


def test_a_masked_array_with_masked_values_is_refused() -> None:
    # its mask was dropped: the masked cells travelled as the data under them
    masked = np.ma.masked_array([1, 2, 3], mask=[0, 1, 0])
    for data in ({"m": masked}, {"m": [masked, masked[:1]]}):
        with pytest.raises(UnsupportedTypeError, match=r"field 'm' is a numpy masked array.*fill"):
            columns_from_batch(data)
    assert roundtrip({"m": masked.filled(-1)})["m"].tolist() == [1, -1, 3]
    assert roundtrip({"m": np.ma.masked_array([1, 2], mask=[0, 0])})["m"].tolist() == [1, 2]
    strings = roundtrip({"s": np.ma.masked_array(["a", "b"], mask=[0, 1])})["s"]
    assert strings.tolist() == ["a", None]  # a masked value of a list column is None


def test_a_scalar_beside_a_column_is_named() -> None:
    # a 0-dim array first made the batch "have no rows" although 'x' has 2; a 0-dim tensor
    # first was said to leave the batch without rows, and to be put as t.reshape(1)
    for scalar in (np.array(3.0), torch.tensor(3.0)):
        with pytest.raises(SchemaError, match=r"field 'z' has shape \(\) but the batch has 2 rows"):
            columns_from_batch({"z": scalar, "x": torch.zeros(2)})
    with pytest.raises(SchemaError, match=r"field 'z' is a 0-dim numpy array.*reshape\(1\)"):
        columns_from_batch({"z": np.array(3.0)})


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


def _dense_columns(
    tensors: dict[str, torch.Tensor],
) -> tuple[int, list[ColumnHeader], list[object]]:
    n, headers, columns = columns_from_batch(tensors)
    return n, headers, columns


def test_jagged_fields_of_equal_lengths_share_their_ragged_dimension() -> None:
    # fields whose rows have the same lengths come back on one offsets tensor: one ragged
    # "nested int", so they combine (prompt ids + mask, log-probs * mask) as dense ones do
    ids = torch.arange(12).view(4, 3)
    mask = torch.ones(4, 3, dtype=torch.int64)
    logp = torch.randn(4, 3)
    longer = torch.zeros(4, 5, dtype=torch.int64)
    rows = [torch.arange(k) for k in (1, 3, 0, 2)]
    fields = {"ids": ids, "mask": mask, "logp": logp, "longer": longer, "r": rows, "s": rows}
    n, headers, columns = _dense_columns(fields)  # type: ignore[arg-type]
    td = columns_to_tensordict(n, headers, columns, nested=True)  # type: ignore[arg-type]
    assert td["ids"].offsets() is td["mask"].offsets() is td["logp"].offsets()
    assert td["ids"].shape == td["mask"].shape == td["logp"].shape
    assert (td["ids"] + td["mask"]).to_padded_tensor(0).tolist() == (ids + 1).tolist()
    assert torch.equal((td["logp"] * td["mask"]).to_padded_tensor(0), logp)
    assert td["r"].offsets() is td["s"].offsets()  # jagged columns of equal lengths too
    assert (td["r"] + td["s"]).to_padded_tensor(-1).tolist() == [
        [0, -1, -1], [0, 2, 4], [-1, -1, -1], [0, 2, -1]
    ]  # fmt: skip
    with pytest.raises(RuntimeError):  # other lengths: another ragged dimension
        td["ids"] + td["longer"]
    with pytest.raises(RuntimeError):
        td["ids"] + td["r"]


def test_jagged_fields_of_separate_reads_do_not_share_offsets() -> None:
    # the offsets tensor is shared within one batch only: a user's in-place edit of one
    # batch's offsets can never reach another batch
    n, headers, columns = _dense_columns({"ids": torch.arange(6).view(2, 3)})
    a = columns_to_tensordict(n, headers, columns, nested=True)["ids"]  # type: ignore[arg-type]
    b = columns_to_tensordict(n, headers, columns, nested=True)["ids"]  # type: ignore[arg-type]
    assert a.offsets() is not b.offsets()
    assert torch.equal(a.offsets(), b.offsets())


JAGGED_CASES = [
    (torch.arange(10.0), [0, 3, 3, 10]),  # an empty row
    (torch.arange(24).view(8, 3), [0, 1, 5, 8]),  # rows [L, 3]
    (torch.randn(6, 2, 2).to(torch.bfloat16), [0, 6]),  # one row, rows [L, 2, 2]
    (torch.rand(4) > 0.5, [0, 2, 4]),
    (torch.zeros(0, 3), [0]),  # no rows
]


@pytest.mark.parametrize(("values", "offsets"), JAGGED_CASES, ids=range(len(JAGGED_CASES)))
def test_direct_jagged_constructor_builds_what_torch_builds(
    values: torch.Tensor, offsets: list[int]
) -> None:
    # _nested builds jagged tensors with torch's private constructor (3x cheaper than
    # nested_tensor_from_jagged) only because they are the same tensors: this pins it
    make = _nested._direct_njt_maker()
    assert make is not None, "torch.nested._internal moved: the jagged assembly got ~3x slower"
    assert _nested._probed_njt_maker() is not _nested._public_njt
    off = torch.tensor(offsets)
    lengths = off.diff()
    lo, hi = (int(lengths.min()), int(lengths.max())) if len(lengths) else (0, 0)
    dim = _nested.Ragged(off, lo, hi)
    ours, theirs = make(values, dim), _nested._public_njt(values, dim)
    assert _nested._same_njt(ours, theirs)
    assert [t.tolist() for t in ours.unbind()] == [t.tolist() for t in theirs.unbind()]
    assert torch.equal((ours + theirs).values(), (theirs + theirs).values())  # one nested int
    assert torch.equal(ours.to(torch.float64).values(), theirs.to(torch.float64).values())
    assert torch.equal(ours.clone().to_padded_tensor(0), theirs.to_padded_tensor(0))
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert torch.equal(loaded.to_padded_tensor(0), theirs.to_padded_tensor(0))
    assert loaded._max_seqlen == theirs._max_seqlen
    ours.values().fill_(1)  # a view of the values it was built on, as torch's is
    assert bool((values == 1).all())


def test_direct_jagged_constructor_reuses_sizes_per_dimension_and_row_layout() -> None:
    # sizes and strides (nested-int arithmetic) are computed once per ragged dimension and
    # row layout: fields of every dtype and row shape on one dimension get torch's tensors
    make = _nested._direct_njt_maker()
    assert make is not None
    off = torch.tensor([0, 2, 2, 5])
    dim, again = _nested.Ragged(off, 0, 3), _nested.Ragged(off.clone(), 0, 3)
    cases = [
        torch.arange(5.0),
        torch.arange(5),  # same layout, another dtype
        torch.arange(10).view(5, 2),  # another row shape
        torch.arange(5.0),  # same layout again
        torch.randn(5, 3)[:, 1],  # strided values
    ]
    built = [make(v, dim) for v in cases]
    assert dim.layouts is not None
    assert len(dim.layouts) == 3
    for ours, values in zip(built, cases, strict=True):
        assert _nested._same_njt(ours, _nested._public_njt(values, dim))
    assert built[0].offsets() is built[2].offsets()
    assert (built[0] + built[3]).shape[0] == 3
    other = make(torch.arange(5.0), again)  # another batch: its own dimension
    assert other.shape[1] != built[0].shape[1]
    # the bounds' tensors carry their value in their shape: shared by value across batches
    assert other._metadata_cache["max_seqlen"] is built[0]._metadata_cache["max_seqlen"]
    assert other._max_seqlen == 3
    assert other._min_seqlen == 0


def test_jagged_assembly_falls_back_to_the_public_constructors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fields = {"ids": torch.arange(12).view(4, 3), "r": [torch.arange(k) for k in (1, 3, 0, 2)]}
    n, headers, columns = _dense_columns(fields)  # type: ignore[arg-type]
    fast = columns_to_tensordict(n, headers, columns, nested=True)  # type: ignore[arg-type]
    monkeypatch.setattr(_nested, "_njt", _nested._public_njt)
    monkeypatch.setattr(_nested, "_new_tensordict", lambda f, k: TensorDict(f, batch_size=[k]))
    slow = columns_to_tensordict(n, headers, columns, nested=True)  # type: ignore[arg-type]
    assert fast.batch_size == slow.batch_size
    assert list(fast.keys()) == list(slow.keys())
    for key in fields:
        assert torch.equal(fast[key].to_padded_tensor(-1), slow[key].to_padded_tensor(-1))
        assert fast[key]._max_seqlen == slow[key]._max_seqlen


def test_jagged_probe_refuses_a_constructor_that_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    def unbounded(values: torch.Tensor, dim: _nested.Ragged) -> torch.Tensor:
        return torch.nested.nested_tensor_from_jagged(values, dim.offsets)  # no lengths' bounds

    def broken(values: torch.Tensor, dim: _nested.Ragged) -> torch.Tensor:
        raise TypeError("a changed signature")

    for maker in (unbounded, broken):
        monkeypatch.setattr(_nested, "_direct_njt_maker", lambda m=maker: m)
        assert _nested._probed_njt_maker() is _nested._public_njt


def test_tensordict_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    make = _nested._probed_tensordict_maker()
    assert make.__name__ == "make", "tensordict changed: the unchecked constructor is not used"
    td = make({"x": torch.zeros(2, 3)}, 2)
    assert td.batch_size == (2,)
    assert td.device is None
    assert not td.is_locked

    def changed(*args: object, **kwargs: object) -> TensorDict:
        raise TypeError("a changed signature")

    monkeypatch.setattr(TensorDict, "_new_unsafe", changed, raising=False)
    assert _nested._probed_tensordict_maker().__name__ == "public"


def test_a_column_of_another_row_count_is_a_protocol_error() -> None:
    _, headers, columns = columns_from_batch({"x": torch.zeros(3, 2)})
    with pytest.raises(ProtocolError, match="'x' came with 3 rows, not 4"):
        columns_to_tensordict(4, headers, columns, nested=True)
    with pytest.raises(ProtocolError, match="'x' came with 3 rows, not 2"):
        columns_to_tensordict(2, headers, columns)


def test_no_rows_read_as_jagged() -> None:
    header = ColumnHeader("x", "dense", "int64", (5,))
    td = columns_to_tensordict(0, [header], [empty_column(header)], nested=True)
    assert td["x"].is_nested
    assert td["x"]._max_seqlen == 0
    assert td.batch_size == (0,)


class _Text(str):
    pass


#: values msgpack cannot give back as they are, anywhere in a row: (value, what the error says)
UNPLAIN_VALUES = [
    (_Text("a"), r"a value of type _Text"),  # msgpack refuses str subclasses
    ("\ud800", r"a str that is not valid UTF-8 \(surrogates not allowed at position 0\)"),
    ({"ok": ["x", "y\udc80"]}, r"a str that is not valid UTF-8 \(.* at position 1\)"),
    ({"\ud800": 1}, r"a str that is not valid UTF-8"),
    ({2**70: 1}, r"an int that does not fit 64 bits"),
    ({(1, 2): 3}, r"a dict key of type tuple"),
]


@pytest.mark.parametrize(("value", "why"), UNPLAIN_VALUES, ids=range(len(UNPLAIN_VALUES)))
def test_a_value_msgpack_cannot_carry_is_refused_or_pickled(value: object, why: str) -> None:
    # each once escaped as a raw TypeError, UnicodeEncodeError or OverflowError when the
    # column was encoded: the walk accepted str subclasses, surrogates and any int key
    data = {"v": [value, "plain"]}
    with pytest.raises(UnsupportedTypeError, match=r"field 'v' holds " + why + ".*allow_pickle"):
        roundtrip(data)
    assert roundtrip(data, allow_pickle=True)["v"].tolist() == [value, "plain"]
