"""Columns on the wire: pure functions, no sockets.

A batch is a set of *columns* (fields) over ``n`` rows. Each column has one of four kinds:

``dense``
    a tensor ``[n, *shape]``; travels as **one raw frame** (zero-copy on send, rebuilt with
    :func:`torch.frombuffer` on receive, so the receiver keeps a view of the message buffer).
``jagged``
    a jagged nested tensor (``torch.nested``, ``layout=torch.jagged``, ragged dim 1); travels as
    two raw frames, ``values [total, *shape]`` and ``offsets int64 [n + 1]``.
``object``
    a list of ``str``/``int``/``float``/``bool``/``None``/``bytes``/``list``/``dict`` values; one
    msgpack frame.
``pickle``
    any other Python objects, pickled per row; only when the deployment allows pickle.

The :class:`ColumnHeader` (dtype, per-row shape, kind) is what the controller keeps as a
field's schema and what a receiver needs to rebuild the column. Round trips are exact: dtype
(bf16, f16, bool, uint8, ...), shape and layout are preserved; a dense column comes back dense.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgspec
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from ._errors import ProtocolError, SchemaError, UnsupportedTypeError

__all__ = [
    "ColumnHeader",
    "Column",
    "DenseColumn",
    "JaggedColumn",
    "ListColumn",
    "Frame",
    "columns_from_batch",
    "column_to_frames",
    "column_from_frames",
    "column_frame_count",
    "take_rows",
    "concat_columns",
    "columns_to_tensordict",
    "column_nbytes",
]

#: Anything a frame can be read from: a ``zmq.Frame`` (has ``.buffer``), bytes or a memoryview.
Frame: TypeAlias = Any

DENSE = "dense"
JAGGED = "jagged"
OBJECT = "object"
PICKLE = "pickle"
KINDS = (DENSE, JAGGED, OBJECT, PICKLE)

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}

_DTYPE_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in _DTYPES.items()}

_msgpack_encoder = msgspec.msgpack.Encoder()
_msgpack_decoder = msgspec.msgpack.Decoder()
_bytes_list_decoder = msgspec.msgpack.Decoder(list[bytes])


class ColumnHeader(msgspec.Struct, array_like=True, frozen=True):
    """Describes one column: its name, kind, dtype and per-row trailing shape.

    For ``dense`` columns ``shape`` is the shape of one row (``tensor.shape[1:]``); for
    ``jagged`` columns it is the shape after the ragged dimension (``values.shape[1:]``); for
    ``object``/``pickle`` columns it is empty and ``dtype`` is ``""``.
    """

    name: str
    kind: str
    dtype: str = ""
    shape: tuple[int, ...] = ()

    def schema(self) -> tuple[str, str, tuple[int, ...]]:
        """What must stay the same for a field across puts: kind, dtype and trailing shape."""
        return (self.kind, self.dtype, self.shape)

    def describe(self) -> str:
        """A short human-readable description, e.g. ``dense float32[2048]``."""
        if self.kind in (OBJECT, PICKLE):
            return self.kind
        dims = ",".join(str(d) for d in self.shape)
        return f"{self.kind} {self.dtype}[{dims}]"


@dataclass(slots=True)
class DenseColumn:
    """``data`` is a tensor ``[n, *shape]``."""

    data: torch.Tensor

    def __len__(self) -> int:
        return int(self.data.shape[0])


@dataclass(slots=True)
class JaggedColumn:
    """Row ``i`` is ``values[offsets[i]:offsets[i + 1]]``; offsets need not start at 0."""

    values: torch.Tensor
    offsets: torch.Tensor

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1


@dataclass(slots=True)
class ListColumn:
    """Python values, one per row (for ``pickle`` columns: each row's pickle bytes)."""

    values: list[Any]

    def __len__(self) -> int:
        return len(self.values)


Column: TypeAlias = DenseColumn | JaggedColumn | ListColumn


# --------------------------------------------------------------------------------------------
# batch -> columns


def _dtype_name(dtype: torch.dtype, field: str) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise UnsupportedTypeError(
            f"field {field!r} has dtype {dtype}, which tq_async cannot send; "
            f"cast it to one of: {', '.join(sorted(_DTYPES))}"
        )
    return name


def _torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ProtocolError(f"unknown dtype {name!r} in a column header") from None


def _plain_value_ok(value: Any, depth: int = 0) -> bool:
    """True when msgpack carries ``value`` and gives back an equal value of the same type."""
    if value is None or isinstance(value, (str, bool, int, float, bytes)):
        return not isinstance(value, int) or -(2**63) <= value < 2**64
    if depth > 32:
        return False
    if type(value) is list:
        return all(_plain_value_ok(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(
            isinstance(k, (str, int)) and _plain_value_ok(v, depth + 1) for k, v in value.items()
        )
    return False


def _object_column(name: str, values: list[Any], allow_pickle: bool) -> tuple[ColumnHeader, Column]:
    for v in values:
        if not _plain_value_ok(v):
            if not allow_pickle:
                raise UnsupportedTypeError(
                    f"field {name!r} holds a value of type {type(v).__name__}, which travels "
                    "only with pickle; convert it to str/int/float/bool/None/bytes/list/dict, "
                    "or start the services and client with allow_pickle=True (pickle runs "
                    "code on load: only in trusted deployments)"
                )
            pickled = [pickle.dumps(x, protocol=5) for x in values]
            return ColumnHeader(name, PICKLE), ListColumn(pickled)
    return ColumnHeader(name, OBJECT), ListColumn(list(values))


def _tensor_column(name: str, t: torch.Tensor, n: int) -> tuple[ColumnHeader, Column]:
    if t.is_nested:
        return _nested_column(name, t, n)
    if t.layout != torch.strided:
        raise UnsupportedTypeError(
            f"field {name!r} has layout {t.layout}; send it dense (t.to_dense()) or as a jagged "
            "nested tensor"
        )
    if t.dim() == 0 or t.shape[0] != n:
        raise SchemaError(
            f"field {name!r} has shape {tuple(t.shape)} but the batch has {n} rows; every "
            "column's first dimension must be the batch size"
        )
    # Each torch call below is guarded: the first put after an idle spell runs with cold
    # caches on the VMs we measured, where one dispatched torch op costs 30-90 us.
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    header = ColumnHeader(name, DENSE, _dtype_name(t.dtype, name), tuple(t.shape[1:]))
    return header, DenseColumn(t)


def _nested_column(name: str, t: torch.Tensor, n: int) -> tuple[ColumnHeader, Column]:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.layout != torch.jagged:
        # strided nested tensor: rebuild as jagged (one copy; rare path)
        return _list_of_tensors_column(name, list(t.unbind()), n)
    if t.shape[0] != n:
        raise SchemaError(
            f"field {name!r} has {t.shape[0]} rows but the batch has {n}; every column must "
            "have the batch size"
        )
    ragged_idx = getattr(t, "_ragged_idx", 1)
    if ragged_idx != 1:
        raise SchemaError(
            f"field {name!r} is ragged in dimension {ragged_idx}; tq_async carries jagged "
            "tensors ragged in dimension 1 only (transpose it first)"
        )
    if getattr(t, "_lengths", None) is not None:
        return _list_of_tensors_column(name, list(t.unbind()), n)
    values = t.values().contiguous()
    offsets = t.offsets().to(torch.int64).contiguous()  # type: ignore[attr-defined]
    header = ColumnHeader(name, JAGGED, _dtype_name(values.dtype, name), tuple(values.shape[1:]))
    return header, JaggedColumn(values, offsets)


def _list_of_tensors_column(
    name: str, tensors: list[torch.Tensor], n: int
) -> tuple[ColumnHeader, Column]:
    if len(tensors) != n:
        raise SchemaError(f"field {name!r} has {len(tensors)} rows but the batch has {n}")
    if n == 0:
        raise SchemaError(f"field {name!r} is an empty list of tensors")
    first = tensors[0]
    for t in tensors:
        if t.dim() == 0 or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]:
            raise SchemaError(
                f"field {name!r} is a list of tensors that cannot form one jagged column: "
                "every row needs the same dtype and the same shape after its first dimension "
                f"(row 0 is {first.dtype}{tuple(first.shape)}, another row is "
                f"{t.dtype}{tuple(t.shape)})"
            )
    lengths = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64)
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    values = torch.cat([t.detach().cpu() for t in tensors]).contiguous()
    header = ColumnHeader(name, JAGGED, _dtype_name(values.dtype, name), tuple(values.shape[1:]))
    return header, JaggedColumn(values, offsets)


def _column_from_value(
    name: str, value: Any, n: int, allow_pickle: bool
) -> tuple[ColumnHeader, Column]:
    if isinstance(value, torch.Tensor):
        return _tensor_column(name, value, n)
    if isinstance(value, NonTensorStack):
        values = value.tolist()
    elif isinstance(value, NonTensorData):
        values = [value.data] * n
    elif isinstance(value, (list, tuple)):
        values = list(value)
    elif isinstance(value, TensorDictBase):
        raise SchemaError(
            f"field {name!r} is a nested TensorDict; flatten it first (td.flatten_keys('.'))"
        )
    else:
        raise UnsupportedTypeError(
            f"field {name!r} is a {type(value).__name__}; a column must be a tensor, a jagged "
            "nested tensor, or a list with one value per row"
        )
    if len(values) != n:
        raise SchemaError(
            f"field {name!r} has {len(values)} rows but the batch has {n}; every column must "
            "have the batch size"
        )
    if values and all(isinstance(v, torch.Tensor) for v in values):
        return _list_of_tensors_column(name, values, n)
    return _object_column(name, values, allow_pickle)


def _batch_size_of(data: Mapping[str, Any]) -> int:
    for value in data.values():
        if isinstance(value, torch.Tensor):
            return int(value.shape[0]) if value.dim() > 0 else -1
        if isinstance(value, (list, tuple, NonTensorStack)):
            return len(value)
    return -1


def columns_from_batch(
    data: TensorDictBase | Mapping[str, Any], *, allow_pickle: bool = False
) -> tuple[int, list[ColumnHeader], list[Column]]:
    """Split a batch into columns ready to send.

    Args:
        data: a :class:`~tensordict.TensorDict` with ``batch_size=[n]``, or a mapping from
            field name to a tensor ``[n, ...]``, a jagged nested tensor, a list of ``n``
            tensors (becomes jagged) or a list of ``n`` plain values.
        allow_pickle: whether values that msgpack cannot carry exactly may be pickled.

    Returns:
        ``(n, headers, columns)``.

    Raises:
        SchemaError: columns disagree on the number of rows, or the batch is empty.
        UnsupportedTypeError: a value cannot travel (names the field and the type).
    """
    if isinstance(data, TensorDictBase):
        if len(data.batch_size) != 1:
            raise SchemaError(
                f"the TensorDict has batch_size {list(data.batch_size)}; tq_async needs one "
                "batch dimension (rows), e.g. batch_size=[n]"
            )
        n = int(data.batch_size[0])
        items: Iterable[tuple[str, Any]] = ((k, data.get(k)) for k in data.keys())  # noqa: SIM118
    elif isinstance(data, Mapping):
        n = _batch_size_of(data)
        items = data.items()
    else:
        raise UnsupportedTypeError(
            f"put() takes a TensorDict or a dict of columns, not {type(data).__name__}"
        )
    if n <= 0:
        raise SchemaError("the batch has no rows; put at least one row")
    headers: list[ColumnHeader] = []
    columns: list[Column] = []
    for name, value in items:
        if not isinstance(name, str):
            raise SchemaError(f"field names must be strings, got {name!r}")
        header, column = _column_from_value(name, value, n, allow_pickle)
        headers.append(header)
        columns.append(column)
    if not headers:
        raise SchemaError("the batch has no fields; put at least one column")
    return n, headers, columns


# --------------------------------------------------------------------------------------------
# columns <-> frames


def _tensor_frame(t: torch.Tensor) -> Any:
    """A zero-copy buffer over a contiguous tensor's bytes (keeps the tensor alive)."""
    if t.numel() == 0:
        return b""
    try:
        array = t.numpy()  # one torch call (cold caches: see _tensor_column)
    except TypeError:  # bf16 and fp8 have no numpy dtype: reinterpret the bytes
        array = t.view(torch.uint8).numpy()
    return memoryview(array).cast("B")  # type: ignore[arg-type]


def _frame_buffer(frame: Frame) -> memoryview:
    buf: Any = getattr(frame, "buffer", frame)
    return buf if isinstance(buf, memoryview) else memoryview(buf)


def _tensor_from_frame(frame: Frame, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    buf = _frame_buffer(frame)
    expected = math.prod(shape) * dtype.itemsize
    if buf.nbytes != expected:
        raise ProtocolError(
            f"a {dtype} frame of shape {tuple(shape)} must hold {expected} bytes, got "
            f"{buf.nbytes}: the message is truncated or corrupt"
        )
    if expected == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    if buf.readonly:  # torch tensors are writable: copy read-only buffers (never zmq frames)
        buf = memoryview(bytearray(buf))
    flat = torch.frombuffer(buf, dtype=dtype)
    return flat if len(shape) == 1 else flat.view(tuple(shape))


def column_frame_count(header: ColumnHeader) -> int:
    """How many frames a column of this kind uses on the wire."""
    return 2 if header.kind == JAGGED else 1


def column_to_frames(header: ColumnHeader, column: Column) -> list[Any]:
    """Buffers to send for ``column``; dense and jagged data are not copied."""
    if isinstance(column, DenseColumn):
        return [_tensor_frame(column.data)]
    if isinstance(column, JaggedColumn):
        offsets = column.offsets
        start = int(offsets[0])
        end = int(offsets[-1])
        values = column.values[start:end]
        if start != 0:
            offsets = offsets - start
        return [_tensor_frame(values.contiguous()), _tensor_frame(offsets.contiguous())]
    if header.kind == PICKLE:
        return [_msgpack_encoder.encode(column.values)]
    return [_msgpack_encoder.encode(column.values)]


def column_from_frames(header: ColumnHeader, frames: Sequence[Frame], n: int) -> Column:
    """Rebuild a column of ``n`` rows from its frames (views, no copy for tensors).

    Raises:
        ProtocolError: the frames do not match the header (size, count, kind).
    """
    if len(frames) != column_frame_count(header):
        raise ProtocolError(f"column {header.name!r} needs {column_frame_count(header)} frames")
    if header.kind == DENSE:
        dtype = _torch_dtype(header.dtype)
        return DenseColumn(_tensor_from_frame(frames[0], dtype, (n, *header.shape)))
    if header.kind == JAGGED:
        dtype = _torch_dtype(header.dtype)
        offsets = _tensor_from_frame(frames[1], torch.int64, (n + 1,))
        total = int(offsets[-1]) if n >= 0 else 0
        if int(offsets[0]) != 0 or total < 0 or bool((offsets[1:] < offsets[:-1]).any()):
            raise ProtocolError(f"column {header.name!r} has invalid jagged offsets")
        values = _tensor_from_frame(frames[0], dtype, (total, *header.shape))
        return JaggedColumn(values, offsets)
    if header.kind in (OBJECT, PICKLE):
        try:
            raw = bytes(_frame_buffer(frames[0]))
            items: Any = (
                _bytes_list_decoder.decode(raw)
                if header.kind == PICKLE
                else _msgpack_decoder.decode(raw)
            )
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"column {header.name!r} is not valid msgpack") from exc
        if not isinstance(items, list) or len(items) != n:
            raise ProtocolError(f"column {header.name!r} must hold a list of {n} values")
        return ListColumn(items)
    raise ProtocolError(f"column {header.name!r} has unknown kind {header.kind!r}")


def column_nbytes(column: Column) -> int:
    """Bytes held by a column (tensors only; lists count their bytes values, if any)."""
    if isinstance(column, DenseColumn):
        return column.data.numel() * column.data.element_size()
    if isinstance(column, JaggedColumn):
        return (
            column.values.numel() * column.values.element_size()
            + column.offsets.numel() * column.offsets.element_size()
        )
    return sum(len(v) for v in column.values if isinstance(v, bytes))


# --------------------------------------------------------------------------------------------
# row selection


def take_rows(column: Column, runs: Sequence[tuple[int, int]]) -> Column:
    """Rows ``[a, b)`` for each ``(a, b)`` in ``runs``, in order.

    One run is a view (no copy); several runs are concatenated (one copy).
    """
    if isinstance(column, DenseColumn):
        if len(runs) == 1:
            a, b = runs[0]
            return DenseColumn(column.data[a:b])
        return DenseColumn(torch.cat([column.data[a:b] for a, b in runs]))
    if isinstance(column, JaggedColumn):
        offsets = column.offsets
        if len(runs) == 1:
            a, b = runs[0]
            return JaggedColumn(column.values, offsets[a : b + 1])
        pieces = []
        lengths = []
        for a, b in runs:
            pieces.append(column.values[int(offsets[a]) : int(offsets[b])])
            lengths.append(offsets[a + 1 : b + 1] - offsets[a:b])
        new_offsets = torch.zeros(sum(b - a for a, b in runs) + 1, dtype=torch.int64)
        torch.cumsum(torch.cat(lengths), 0, out=new_offsets[1:])
        return JaggedColumn(torch.cat(pieces), new_offsets)
    out: list[Any] = []
    for a, b in runs:
        out.extend(column.values[a:b])
    return ListColumn(out)


def concat_columns(parts: Sequence[Column]) -> Column:
    """Rows of ``parts`` one after another (a copy unless there is a single part)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, DenseColumn):
        return DenseColumn(torch.cat([p.data for p in parts if isinstance(p, DenseColumn)]))
    if isinstance(first, JaggedColumn):
        return take_rows(
            _stack_jagged([p for p in parts if isinstance(p, JaggedColumn)]),
            [(0, sum(len(p) for p in parts))],
        )
    out: list[Any] = []
    for p in parts:
        if isinstance(p, ListColumn):
            out.extend(p.values)
    return ListColumn(out)


def _stack_jagged(parts: Sequence[JaggedColumn]) -> JaggedColumn:
    values = []
    lengths = []
    for p in parts:
        a, b = int(p.offsets[0]), int(p.offsets[-1])
        values.append(p.values[a:b])
        lengths.append(p.offsets[1:] - p.offsets[:-1])
    all_lengths = torch.cat(lengths)
    offsets = torch.zeros(all_lengths.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(all_lengths, 0, out=offsets[1:])
    return JaggedColumn(torch.cat(values), offsets)


def position_runs(positions: Iterable[int]) -> list[tuple[int, int]]:
    """Group positions into maximal ``[a, b)`` runs of consecutive integers, in order."""
    runs: list[tuple[int, int]] = []
    for i in positions:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def positions_by_unit(units: Sequence[int]) -> dict[int, list[int]]:
    """Positions of a batch's rows grouped by the unit holding them, units in order of first
    appearance (the order in which a batch's parts travel)."""
    by_unit: dict[int, list[int]] = {}
    for pos, unit in enumerate(units):
        by_unit.setdefault(unit, []).append(pos)
    return by_unit


def reorder_column(column: Column, order: Sequence[int]) -> Column:
    """Rows in the given order (``order[i]`` is the source row of output row ``i``)."""
    return take_rows(column, position_runs(order))


# --------------------------------------------------------------------------------------------
# columns -> TensorDict


def column_value(header: ColumnHeader, column: Column) -> Any:
    """The user-facing value of a column: a tensor, a jagged nested tensor or a list."""
    if isinstance(column, DenseColumn):
        return column.data
    if isinstance(column, JaggedColumn):
        a = int(column.offsets[0])
        values = column.values[a : int(column.offsets[-1])]
        offsets = column.offsets - a if a else column.offsets
        return torch.nested.nested_tensor_from_jagged(values, offsets)
    if header.kind == PICKLE:
        return [pickle.loads(v) for v in column.values]
    return column.values


def _non_tensor_stack(values: list[Any]) -> NonTensorStack:
    """A flat ``NonTensorStack`` with one entry per row.

    ``NonTensorStack.from_list`` is 3x faster but turns list values into nested stacks, so
    rows holding lists are wrapped one by one.
    """
    if any(isinstance(v, list) for v in values):
        return NonTensorStack(*[NonTensorData(v, batch_size=[]) for v in values])
    return NonTensorStack.from_list(values)


def columns_to_tensordict(
    n: int, headers: Sequence[ColumnHeader], columns: Sequence[Column]
) -> TensorDict:
    """Assemble a ``TensorDict(batch_size=[n])``; list columns become ``NonTensorStack``."""
    fields: dict[str, Any] = {}
    for header, column in zip(headers, columns, strict=True):
        value = column_value(header, column)
        if isinstance(value, list):
            value = _non_tensor_stack(value)
        fields[header.name] = value
    return TensorDict(fields, batch_size=[n])
