"""Columns as bytes: what travels and what storage units keep. Pure functions, no torch.

A batch is a set of *columns* (fields) over ``n`` rows. Each column has one of four kinds:

``dense``
    ``n`` rows of equal size; travels as **one raw frame**.
``jagged``
    rows of varying length (a jagged nested tensor, ragged in dimension 1); travels as two raw
    frames, ``values`` (the rows one after another) and ``offsets`` (int64, ``n + 1``).
``object``
    a list of ``str``/``int``/``float``/``bool``/``None``/``bytes``/``list``/``dict`` values; one
    msgpack frame.
``pickle``
    any other Python objects, pickled per row; only where the deployment allows pickle.

Below the user's edge (`tq_async._wire._codec`, which turns tensors into columns and back),
tensor data is kept as **bytes**: a dense column is a numpy ``uint8`` array ``[n, row_bytes]``,
a jagged one ``uint8 [total, item_bytes]`` plus int64 offsets. Selecting, concatenating and
reordering rows is then the same byte arithmetic for every dtype (bf16 and fp8 included, which
numpy cannot name), and the services (controller, storage units) never import torch: a
``tq-async serve`` process starts in a fraction of a second and stays small.

The `ColumnHeader` (dtype, per-row shape, kind) is what the controller keeps as a
field's schema and what a receiver needs to rebuild the column.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgspec
import numpy as np

from .._errors import ProtocolError, SchemaError

__all__ = [
    "ColumnHeader",
    "Column",
    "DenseColumn",
    "JaggedColumn",
    "ListColumn",
    "Frame",
    "ITEM_SIZES",
    "as_jagged",
    "column_frame_count",
    "column_from_frames",
    "column_nbytes",
    "column_to_frames",
    "empty_column",
    "concat_columns",
    "join_columns",
    "position_runs",
    "positions_by_unit",
    "reorder_column",
    "take_rows",
]

#: Anything a frame can be read from: a ``zmq.Frame`` (has ``.buffer``), bytes or a memoryview.
Frame: TypeAlias = Any

DENSE = "dense"
JAGGED = "jagged"
OBJECT = "object"
PICKLE = "pickle"
KINDS = (DENSE, JAGGED, OBJECT, PICKLE)

#: Bytes per element of every dtype that travels (named as torch names them).
ITEM_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex64": 8,
    "complex128": 16,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

_msgpack_encoder = msgspec.msgpack.Encoder()
_msgpack_decoder = msgspec.msgpack.Decoder()
_bytes_list_decoder = msgspec.msgpack.Decoder(list[bytes])

Bytes2D: TypeAlias = "np.ndarray[Any, np.dtype[np.uint8]]"
Int64s: TypeAlias = "np.ndarray[Any, np.dtype[np.int64]]"


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

    def row_ndim(self) -> int:
        """Dimensions of one row: ``len(shape)`` (dense), ``1 + len(shape)`` (jagged), -1
        for lists."""
        if self.kind == DENSE:
            return len(self.shape)
        if self.kind == JAGGED:
            return 1 + len(self.shape)
        return -1

    def accepts(self, other: ColumnHeader) -> bool:
        """Whether a put may write ``other`` into a field whose schema is ``self``.

        Tensor rows may change shape from put to put (a rollout padded per batch), but not
        their dtype or number of dimensions; list columns must keep their kind.
        """
        if self.kind in (DENSE, JAGGED) and other.kind in (DENSE, JAGGED):
            return self.dtype == other.dtype and self.row_ndim() == other.row_ndim()
        return self.schema() == other.schema()

    def item_bytes(self) -> int:
        """Bytes of one row (dense) or of one element along the ragged dimension (jagged)."""
        try:
            size = ITEM_SIZES[self.dtype]
        except KeyError:
            raise ProtocolError(
                f"column {self.name!r} has unknown dtype {self.dtype!r} in its header"
            ) from None
        if any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise ProtocolError(f"column {self.name!r} has an invalid shape {self.shape!r}")
        return math.prod(self.shape) * size


@dataclass(slots=True)
class DenseColumn:
    """``data`` is ``uint8 [n, row_bytes]``: row ``i`` is ``data[i]``."""

    data: Bytes2D

    def __len__(self) -> int:
        return int(self.data.shape[0])


@dataclass(slots=True)
class JaggedColumn:
    """Row ``i`` is ``values[offsets[i]:offsets[i + 1]]`` (``values`` is ``uint8 [total,
    item_bytes]``); offsets need not start at 0."""

    values: Bytes2D
    offsets: Int64s

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1


@dataclass(slots=True)
class ListColumn:
    """Python values, one per row (for ``pickle`` columns: each row's pickle bytes)."""

    values: list[Any]

    def __len__(self) -> int:
        return len(self.values)


Column: TypeAlias = DenseColumn | JaggedColumn | ListColumn


def empty_column(header: ColumnHeader) -> Column:
    """A column of 0 rows of ``header``'s kind, dtype and row shape."""
    if header.kind == DENSE:
        row_bytes = ITEM_SIZES[header.dtype] * math.prod(header.shape)
        return DenseColumn(np.zeros((0, row_bytes), np.uint8))
    if header.kind == JAGGED:
        item_bytes = ITEM_SIZES[header.dtype] * math.prod(header.shape)
        return JaggedColumn(np.zeros((0, item_bytes), np.uint8), np.zeros(1, np.int64))
    return ListColumn([])


# --------------------------------------------------------------------------------------------
# columns <-> frames


def _frame(array: np.ndarray[Any, Any]) -> Any:
    """A zero-copy, one-dimensional byte buffer over a C-contiguous array."""
    if array.size == 0:
        return b""
    return np.ascontiguousarray(array).reshape(-1).data


def frame_buffer(frame: Frame) -> memoryview:
    """The bytes of a received frame (``zmq.Frame``, bytes, memoryview, ...)."""
    buf: Any = getattr(frame, "buffer", frame)
    return buf if isinstance(buf, memoryview) else memoryview(buf)


def _bytes_rows(frame: Frame, rows: int, row_bytes: int, what: str) -> Bytes2D:
    buf = frame_buffer(frame)
    if buf.nbytes != rows * row_bytes:
        raise ProtocolError(
            f"{what} must hold {rows} x {row_bytes} bytes, got {buf.nbytes}: the message "
            "is truncated or corrupt"
        )
    if rows * row_bytes == 0:
        return np.zeros((rows, row_bytes), dtype=np.uint8)
    return np.frombuffer(buf, dtype=np.uint8).reshape(rows, row_bytes)


def column_frame_count(header: ColumnHeader) -> int:
    """How many frames a column of this kind uses on the wire."""
    return 2 if header.kind == JAGGED else 1


def column_to_frames(header: ColumnHeader, column: Column) -> list[Any]:
    """Buffers to send for ``column``; dense and jagged data are not copied."""
    if isinstance(column, DenseColumn):
        return [_frame(column.data)]
    if isinstance(column, JaggedColumn):
        offsets = column.offsets
        start, end = int(offsets[0]), int(offsets[-1])
        if start != 0:
            offsets = offsets - start
        return [_frame(column.values[start:end]), _frame(offsets)]
    return [_msgpack_encoder.encode(column.values)]


def column_from_frames(header: ColumnHeader, frames: Sequence[Frame], n: int) -> Column:
    """Rebuild a column of ``n`` rows from its frames (views of them, no copy).

    Raises:
        ProtocolError: the frames do not match the header (size, count, kind, dtype).
    """
    if len(frames) != column_frame_count(header):
        raise ProtocolError(f"column {header.name!r} needs {column_frame_count(header)} frames")
    if header.kind == DENSE:
        what = f"column {header.name!r} ({header.describe()})"
        return DenseColumn(_bytes_rows(frames[0], n, header.item_bytes(), what))
    if header.kind == JAGGED:
        item = header.item_bytes()
        raw = _bytes_rows(frames[1], n + 1, 8, f"the offsets of column {header.name!r}")
        offsets = raw.reshape(-1).view(np.int64)
        total = int(offsets[-1])
        if int(offsets[0]) != 0 or total < 0 or bool((offsets[1:] < offsets[:-1]).any()):
            raise ProtocolError(f"column {header.name!r} has invalid jagged offsets")
        values = _bytes_rows(frames[0], total, item, f"the values of column {header.name!r}")
        return JaggedColumn(values, offsets)
    if header.kind in (OBJECT, PICKLE):
        try:
            raw_bytes = bytes(frame_buffer(frames[0]))
            items: Any = (
                _bytes_list_decoder.decode(raw_bytes)
                if header.kind == PICKLE
                else _msgpack_decoder.decode(raw_bytes)
            )
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"column {header.name!r} is not valid msgpack") from exc
        if not isinstance(items, list) or len(items) != n:
            raise ProtocolError(f"column {header.name!r} must hold a list of {n} values")
        return ListColumn(items)
    raise ProtocolError(f"column {header.name!r} has unknown kind {header.kind!r}")


def column_nbytes(column: Column) -> int:
    """Bytes of a column's rows as they travel. A jagged column counts only the span of
    values its offsets select; a list column its str and bytes values by their length (a
    pickle column's rows are bytes), its lists and dicts as msgpack encodes them, and 9 bytes
    for any other value (a number, a bool, None)."""
    if isinstance(column, DenseColumn):
        return int(column.data.nbytes)
    if isinstance(column, JaggedColumn):
        offsets = column.offsets
        span = int(offsets[-1]) - int(offsets[0])
        return span * int(column.values.shape[1]) + int(offsets.nbytes)
    size = 0
    for v in column.values:
        kind = type(v)
        if kind is str or kind is bytes:
            size += len(v)
        elif kind is list or kind is dict:
            size += len(_msgpack_encoder.encode(v))
        else:
            size += 9
    return size


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
        return DenseColumn(np.concatenate([column.data[a:b] for a, b in runs]))
    if isinstance(column, JaggedColumn):
        offsets = column.offsets
        if len(runs) == 1:
            a, b = runs[0]
            return JaggedColumn(column.values, offsets[a : b + 1])
        pieces = [column.values[int(offsets[a]) : int(offsets[b])] for a, b in runs]
        lengths = [np.diff(offsets[a : b + 1]) for a, b in runs]
        return JaggedColumn(np.concatenate(pieces), _offsets_of(np.concatenate(lengths)))
    out: list[Any] = []
    for a, b in runs:
        out.extend(column.values[a:b])
    return ListColumn(out)


def _offsets_of(lengths: Int64s) -> Int64s:
    offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def concat_columns(parts: Sequence[Column]) -> Column:
    """Rows of ``parts`` one after another (a copy unless there is a single part)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, DenseColumn):
        return DenseColumn(np.concatenate([p.data for p in parts if isinstance(p, DenseColumn)]))
    if isinstance(first, JaggedColumn):
        jagged = [p for p in parts if isinstance(p, JaggedColumn)]
        values = [p.values[int(p.offsets[0]) : int(p.offsets[-1])] for p in jagged]
        lengths = np.concatenate([np.diff(p.offsets) for p in jagged])
        return JaggedColumn(np.concatenate(values), _offsets_of(lengths))
    out: list[Any] = []
    for p in parts:
        if isinstance(p, ListColumn):
            out.extend(p.values)
    return ListColumn(out)


def as_jagged(header: ColumnHeader, column: Column) -> tuple[ColumnHeader, Column]:
    """A dense column of rows ``[L, *T]`` as a jagged one (every row ``L`` long), without a
    copy; other columns unchanged."""
    if not isinstance(column, DenseColumn) or not header.shape:
        return header, column
    length, trailing = header.shape[0], header.shape[1:]
    jagged = ColumnHeader(header.name, JAGGED, header.dtype, trailing)
    n = len(column)
    values = np.ascontiguousarray(column.data).reshape(n * length, jagged.item_bytes())
    return jagged, JaggedColumn(values, np.arange(n + 1, dtype=np.int64) * length)


def join_columns(
    headers: Sequence[ColumnHeader], parts: Sequence[Column]
) -> tuple[ColumnHeader, Column]:
    """Rows of ``parts`` one after another, whose headers may differ in row shape.

    Parts of one schema concatenate as they are (a dense column stays dense). Tensor parts
    whose rows differ in shape only along their first dimension become one jagged column
    (dense parts are viewed as jagged rows of equal length). Rows that differ in a later
    dimension cannot form a jagged tensor (it has one ragged dimension).

    Raises:
        SchemaError: the parts cannot form one column.
    """
    first = headers[0]
    if all(h == first for h in headers):
        return first, concat_columns(parts)
    name = first.name
    if not all(first.accepts(h) for h in headers):
        kinds = sorted({h.describe() for h in headers})
        raise SchemaError(f"field {name!r} holds rows of incompatible types {kinds}")
    trailing = {h.shape[1:] if h.kind == DENSE else h.shape for h in headers}
    if len(trailing) != 1 or first.row_ndim() < 1:
        shapes = sorted({h.describe() for h in headers})
        raise SchemaError(
            f"rows of field {name!r} differ in more than their first dimension ({shapes}); a "
            "jagged tensor has one ragged dimension, so they cannot come back as one column: "
            "read them in separate batches, or pad them to one shape when you put them"
        )
    header = ColumnHeader(name, JAGGED, first.dtype, trailing.pop())
    return header, concat_columns([as_jagged(h, c)[1] for h, c in zip(headers, parts, strict=True)])


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
