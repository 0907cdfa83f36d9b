"""Tensors <-> columns: the user's edge of the wire format. Pure functions, no sockets.

`tq_async._wire._columns` defines the columns (bytes, no torch) that travel and that storage
units keep; this module turns a batch (a ``TensorDict`` or a dict of tensors, jagged nested
tensors and lists) into columns and columns back into a ``TensorDict``. Round trips are exact:
dtype (bf16, f16, bool, uint8, fp8, ...), shape and layout are preserved; a dense column comes
back dense, a jagged one jagged, a list as the same Python values. A field whose rows were
put with different shapes comes back dense when the rows read share a shape and jagged when
they differ in their first dimension (`tq_async._wire._columns.join_columns`). Received
tensor data is not copied: a tensor built here is a view of the message buffer (a read-only
buffer is copied, since tensors are writable).
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch

from .._errors import InvalidRequestError, ProtocolError, SchemaError, UnsupportedTypeError
from ._checks import check_text
from ._columns import (
    DENSE,
    ITEM_SIZES,
    JAGGED,
    OBJECT,
    PICKLE,
    Column,
    ColumnHeader,
    DenseColumn,
    JaggedColumn,
    ListColumn,
)
from ._nested import Ragged, SharedOffsets, jagged_tensor, tensordict_of
from ._tensordicts import is_tensordict, is_tensordict_type

if TYPE_CHECKING:
    from tensordict import NonTensorStack, TensorDict, TensorDictBase

__all__ = [
    "columns_from_batch",
    "DeviceColumn",
    "columns_to_tensordict",
    "column_value",
    "from_numpy",
    "tags_for_wire",
    "torch_dtype",
]

_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in ITEM_SIZES}
_DTYPE_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in _DTYPES.items()}

# --------------------------------------------------------------------------------------------
# batch -> columns


def _as_bytes(t: torch.Tensor, rows: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A contiguous tensor's bytes as ``uint8 [rows, -1]``, without a copy."""
    try:
        array = t.numpy()  # one torch call: cold-cache torch calls cost 30-90 us each here
    except TypeError:  # bf16 and fp8 have no numpy dtype: reinterpret the bytes
        array = t.view(torch.uint8).numpy()
    flat = array.reshape(-1).view(np.uint8)
    return flat.reshape(rows, flat.shape[0] // rows if rows else 0)


def _dtype_name(dtype: torch.dtype, field: str) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise UnsupportedTypeError(
            f"field {field!r} has dtype {dtype}, which tq_async cannot send; "
            f"cast it to one of: {', '.join(sorted(_DTYPES))}"
        )
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a column header names."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ProtocolError(f"unknown dtype {name!r} in a column header") from None


#: scalars msgpack gives back as they are (exact types: a subclass, e.g. ``np.float64`` or a
#: ``str`` subclass, would come back as its base type, or not travel at all)
_PLAIN_SCALARS = frozenset({bool, float, bytes, type(None)})
#: dict keys msgpack gives back as they are
_PLAIN_KEYS = frozenset({str, int, bool})


def _not_plain(value: Any, depth: int = 0) -> str | None:
    """None when msgpack carries ``value`` and gives back an equal value of the same type;
    else what stops it (for the error: the value at fault, wherever it is nested)."""
    kind = type(value)
    if kind is str:
        return None if value.isascii() else _not_utf8(value)
    if kind is int:
        return None if -(2**63) <= value < 2**64 else f"an int that does not fit 64 bits ({value})"
    if kind in _PLAIN_SCALARS:
        return None
    if depth > 32:
        return "values nested more than 32 deep"
    if kind is list:
        for v in value:
            why = _not_plain(v, depth + 1)
            if why is not None:
                return why
        return None
    if kind is dict:
        for k, v in value.items():
            if type(k) not in _PLAIN_KEYS:
                return f"a dict key of type {type(k).__name__}"
            why = _not_plain(k, depth + 1) or _not_plain(v, depth + 1)
            if why is not None:
                return why
        return None
    return f"a value of type {kind.__name__}"


def _not_utf8(value: str) -> str | None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"a str that is not valid UTF-8 ({exc.reason} at position {exc.start})"
    return None


def _object_column(name: str, values: list[Any], allow_pickle: bool) -> tuple[ColumnHeader, Column]:
    for v in values:
        why = _not_plain(v)
        if why is not None:
            if not allow_pickle:
                raise UnsupportedTypeError(
                    f"field {name!r} holds {why}, which travels only with pickle; convert it "
                    "to str/int/float/bool/None/bytes/list/dict, or start the services and "
                    "client with allow_pickle=True (pickle runs code on load: only in trusted "
                    "deployments)"
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
    if not t.is_cpu:
        t = _to_cpu(name, t)
    t = _plain(t)
    header = ColumnHeader(name, DENSE, _dtype_name(t.dtype, name), tuple(t.shape[1:]))
    return header, DenseColumn(_as_bytes(t, n))


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, with conjugation and negation resolved, contiguous: its bytes are its
    values in row order (a copy only where one of these needs it).

    Each torch call is guarded: the first put after an idle spell runs with cold caches on
    the VMs we measured, where one dispatched torch op costs 30-90 us.
    """
    if t.requires_grad:
        t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t


def _to_cpu(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "meta":
        raise UnsupportedTypeError(
            f"field {name!r} is a tensor on the meta device, which has a shape but no data; "
            "materialise it first (e.g. torch.zeros_like(t, device='cpu'))"
        )
    return t.cpu()


def _nested_column(name: str, t: torch.Tensor, n: int) -> tuple[ColumnHeader, Column]:
    t = t.detach()
    if t.device.type != "cpu":
        t = _to_cpu(name, t)
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
    return _jagged(name, values, offsets)


def _jagged(name: str, values: torch.Tensor, offsets: torch.Tensor) -> tuple[ColumnHeader, Column]:
    header = ColumnHeader(name, JAGGED, _dtype_name(values.dtype, name), tuple(values.shape[1:]))
    column = JaggedColumn(_as_bytes(values, int(values.shape[0])), offsets.numpy())
    return header, column


def _list_of_tensors_column(
    name: str, tensors: list[torch.Tensor], n: int
) -> tuple[ColumnHeader, Column]:
    if len(tensors) != n:
        raise SchemaError(f"field {name!r} has {len(tensors)} rows but the batch has {n}")
    if n == 0:
        raise SchemaError(f"field {name!r} is an empty list of tensors")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.layout != torch.strided or t.is_nested:
            raise UnsupportedTypeError(
                f"field {name!r} is a list of tensors whose row {i} is "
                f"{'a nested tensor' if t.is_nested else f'of layout {t.layout}'}; the rows of "
                "a list are dense tensors (t.to_dense()), which form one jagged column"
            )
        if t.dim() == 0:
            raise SchemaError(
                f"field {name!r} is a list of tensors whose row {i} is 0-dim (one scalar); a "
                "list of tensors forms a jagged column, whose rows have a dimension: for one "
                "scalar a row put torch.stack(rows), a column [n]"
            )
        if t.dtype != first.dtype or t.shape[1:] != first.shape[1:]:
            raise SchemaError(
                f"field {name!r} is a list of tensors that cannot form one jagged column: "
                "every row needs the same dtype and the same shape after its first dimension "
                f"(row 0 is {first.dtype}{tuple(first.shape)}, another row is "
                f"{t.dtype}{tuple(t.shape)})"
            )
    lengths = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64)
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    values = torch.cat([_to_cpu(name, t.detach()) for t in tensors]).contiguous()
    return _jagged(name, values, offsets)


def from_numpy(array: np.ndarray[Any, Any], field: str) -> torch.Tensor | list[Any]:
    """A numpy column as a tensor (a view when torch can share its memory), or as a list
    of Python values when its dtype is not numeric (strings, objects)."""
    if array.dtype.kind not in "biufc":
        return list(array.tolist()) if array.ndim else [array.item()]  # masked: None
    if type(array) is not np.ndarray and np.ma.is_masked(array):
        raise UnsupportedTypeError(
            f"field {field!r} is a numpy masked array with masked values: a tensor has no mask, "
            "so they would travel as whatever data lies under them; send a.filled(value), and "
            "the mask as a field of its own (np.ma.getmaskarray(a)) if readers need it"
        )
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if not array.flags.writeable:  # torch tensors are writable: never alias a read-only buffer
        array = array.copy()
    try:
        return torch.from_numpy(array)
    except ValueError:  # negative strides (a reversed view), which a tensor cannot have
        return torch.from_numpy(array.copy())
    except TypeError:
        raise UnsupportedTypeError(
            f"field {field!r} is a numpy array of dtype {array.dtype}, which tq_async cannot "
            "send; cast it to one of: " + ", ".join(sorted(_DTYPES))
        ) from None


def _column_from_value(
    name: str, value: Any, n: int, allow_pickle: bool
) -> tuple[ColumnHeader, Column]:
    if isinstance(value, np.ndarray):
        value = from_numpy(value, name)
    if isinstance(value, torch.Tensor):
        return _tensor_column(name, value, n)
    is_list = isinstance(value, (list, tuple))
    values = list(value) if is_list else _non_tensor_values(name, value, n)
    if len(values) != n:
        raise SchemaError(
            f"field {name!r} has {len(values)} rows but the batch has {n}; every column must "
            "have the batch size"
        )
    if values and all(isinstance(v, (torch.Tensor, np.ndarray)) for v in values):
        tensors = [v if isinstance(v, torch.Tensor) else from_numpy(v, name) for v in values]
        if all(isinstance(t, torch.Tensor) for t in tensors):
            return _list_of_tensors_column(name, tensors, n)  # type: ignore[arg-type]
    return _object_column(name, values, allow_pickle)


def _non_tensor_values(name: str, value: Any, n: int) -> list[Any]:
    """The rows of a tensordict column that holds no tensor (what a TensorDict gives for its
    list columns); any other value is not a column."""
    tensordict = sys.modules.get("tensordict")  # no value is one unless the program imported it
    if tensordict is not None:
        if isinstance(value, tensordict.NonTensorStack):
            rows: list[Any] = value.tolist()
            return rows
        if isinstance(value, tensordict.NonTensorData):
            return [value.data] * n
        if isinstance(value, tensordict.TensorDictBase):
            raise SchemaError(
                f"field {name!r} is a nested TensorDict; flatten it first (td.flatten_keys('.'))"
            )
    raise _not_a_column(name, value)


def _not_a_column(name: str, value: Any, *, no_rows: bool = False) -> InvalidRequestError:
    """A field whose value is one value (``{"prompt": "hello"}``), not one value per row.

    ``no_rows``: no other column gives the batch rows either (a `SchemaError`, as for
    a 0-dim tensor); else the batch has rows and this column's type is the problem (an
    `UnsupportedTypeError`, as for any value that is not a column).
    """
    example = repr(value)
    one_row = f"; for one row put {{{name!r}: [{example}]}}" if len(example) <= 40 else ""
    kind = type(value).__name__
    then = ", so the batch has no rows" if no_rows else ""
    error = SchemaError if no_rows else UnsupportedTypeError
    return error(
        f"field {name!r} is a single {kind}, not a column{then}: a column is a tensor or a "
        f"list of n values (one per row; also a numpy array or a jagged nested tensor){one_row}"
    )


def _batch_size_of(data: Mapping[str, Any]) -> int:
    """The rows of the first column (a 0-dim tensor or array is one value, not a column)."""
    for value in data.values():
        if isinstance(value, np.ndarray):
            if value.ndim > 0:
                return int(value.shape[0])
        elif isinstance(value, torch.Tensor):
            if value.dim() > 0:  # size(0), not shape[0]: a strided nested tensor has no shape
                return int(value.size(0))
        elif isinstance(value, (list, tuple)) or is_tensordict_type(value, "NonTensorStack"):
            return len(value)
    return -1


@dataclass(slots=True, eq=False)
class DeviceColumn:
    """A dense or jagged column left on its device by a put (it moves device to device, see
    `tq_async._client._async._device_links`), or read back onto one: ``tensor`` is ``[n,
    *shape]`` (a put's: detached and contiguous, its bytes its values); of a jagged column
    (``offsets``: int64 ``[n + 1]`` from 0, on the host) its values ``[offsets[-1], *shape]``,
    row ``i`` being ``tensor[offsets[i]:offsets[i + 1]]``."""

    tensor: torch.Tensor
    offsets: torch.Tensor | None = None

    def __len__(self) -> int:
        if self.offsets is not None:
            return int(self.offsets.shape[0]) - 1
        return int(self.tensor.shape[0])

    def take(self, runs: Sequence[tuple[int, int]]) -> DeviceColumn:
        """Rows ``[a, b)`` of each run, joined on the device."""
        t, offsets = self.tensor, self.offsets
        if offsets is None:
            if len(runs) == 1:
                return DeviceColumn(t[runs[0][0] : runs[0][1]])
            return DeviceColumn(torch.cat([t[a:b] for a, b in runs]))
        values = [t[int(offsets[a]) : int(offsets[b])] for a, b in runs]
        lengths = torch.cat([offsets[a + 1 : b + 1] - offsets[a:b] for a, b in runs])
        joined = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=joined[1:])
        return DeviceColumn(values[0] if len(values) == 1 else torch.cat(values), joined)

    def value(self) -> torch.Tensor:
        """What a reader gets: the tensor, or of a jagged column a jagged nested tensor on
        the values' device."""
        if self.offsets is None:
            return self.tensor
        lengths = self.offsets[1:] - self.offsets[:-1]
        lo, hi = (int(lengths.min()), int(lengths.max())) if len(lengths) else (0, 0)
        offsets = self.offsets.to(self.tensor.device, non_blocking=True)
        return SharedOffsets(offsets, lo, hi).jagged(self.tensor)

    def on_host(self, header: ColumnHeader, values: torch.Tensor) -> Column:
        """This column as a host column, its values copied to the host already (``values``)."""
        if self.offsets is None:
            return DenseColumn(_as_bytes(values, len(self)))
        total = int(self.offsets[-1])
        return JaggedColumn(_as_bytes(values, total), self.offsets.numpy())


#: what a mapping's value may be, besides a tensordict ``NonTensorStack`` or ``NonTensorData``
#: (one value for every row: a TensorDict's)
_COLUMN_TYPES = (torch.Tensor, np.ndarray, list, tuple)


def columns_from_batch(
    data: TensorDictBase | Mapping[str, Any],
    *,
    allow_pickle: bool = False,
    keep: Callable[[Any], bool] | None = None,
) -> tuple[int, list[ColumnHeader], list[Column | DeviceColumn]]:
    """Split a batch into columns ready to send.

    Args:
        data: a `TensorDict` with ``batch_size=[n]`` (a lazy stack of rows whose tensors
            differ in length gives jagged columns), or a mapping from
            field name to a tensor ``[n, ...]``, a numpy array ``[n, ...]`` (numeric arrays
            travel as tensors, without a copy when writable; others as lists), a nested
            tensor, a list of ``n`` tensors or arrays (becomes jagged) or a list of ``n``
            plain values.
        allow_pickle: whether values that msgpack cannot carry exactly may be pickled.
        keep: which tensors stay where they are, as `DeviceColumn` (dense tensors
            only; the caller moves them).

    Returns:
        ``(n, headers, columns)``.

    Raises:
        SchemaError: columns disagree on the number of rows, or the batch is empty.
        UnsupportedTypeError: a value cannot travel (names the field and the type).
    """
    if is_tensordict(data):
        if len(data.batch_size) != 1:
            raise SchemaError(
                f"the TensorDict has batch_size {list(data.batch_size)}; tq_async needs one "
                "batch dimension (rows), e.g. batch_size=[n]"
            )
        n = int(data.batch_size[0])
        items: Iterable[tuple[str, Any]] = ((k, _field_of(data, k)) for k in data.keys())  # noqa: SIM118
    elif isinstance(data, Mapping):
        n = _batch_size_of(data)
        items = data.items()
    else:
        raise UnsupportedTypeError(
            f"put() takes a TensorDict or a dict of columns, not {type(data).__name__}"
        )
    if n <= 0:
        if isinstance(data, Mapping):
            for name, value in data.items():
                if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
                    kind = "tensor" if isinstance(value, torch.Tensor) else "numpy array"
                    raise SchemaError(
                        f"field {name!r} is a 0-dim {kind} (one scalar), so the batch has no "
                        "rows; a column needs one row per sample: put "
                        f"{{{name!r}: t.reshape(1)}} for one row"
                    )
                if not isinstance(value, _COLUMN_TYPES) and not (
                    is_tensordict_type(value, "NonTensorStack")
                    or is_tensordict_type(value, "NonTensorData")
                ):
                    raise _not_a_column(name, value, no_rows=True)
        raise SchemaError("the batch has no rows; put at least one row")
    headers: list[ColumnHeader] = []
    columns: list[Column | DeviceColumn] = []
    for name, value in items:
        if not isinstance(name, str) or not name:
            raise SchemaError(
                f"field names must be non-empty strings, got {name!r}; name the column"
            )
        check_text("field name", name)
        column: Column | DeviceColumn
        if keep is not None and keep(value):
            header, column = _kept_column(name, value, n)
        else:
            header, column = _column_from_value(name, value, n, allow_pickle)
        headers.append(header)
        columns.append(column)
    if not headers:
        raise SchemaError("the batch has no fields; put at least one column")
    return n, headers, columns


def _field_of(data: TensorDictBase, key: str) -> Any:
    """A TensorDict's field; of a lazy stack whose rows differ in shape, the rows as a list
    of tensors (one jagged column), which ``get`` cannot stack."""
    try:
        return data.get(key)
    except RuntimeError:
        from tensordict import LazyStackedTensorDict

        if not isinstance(data, LazyStackedTensorDict):
            raise
        return data.get(key, as_list=True)  # type: ignore[call-overload]


def _kept_column(name: str, t: torch.Tensor, n: int) -> tuple[ColumnHeader, DeviceColumn]:
    if t.shape[0] != n:
        raise SchemaError(
            f"field {name!r} has shape {tuple(t.shape)} but the batch has {n} rows; every "
            "column's first dimension must be the batch size"
        )
    if t.is_nested:  # jagged, ragged in dimension 1 (`keeps_on_device`)
        offsets = t.offsets().to("cpu", torch.int64)  # type: ignore[attr-defined]
        a, b = int(offsets[0]), int(offsets[-1])
        values = _plain(t.values()[a:b])
        header = ColumnHeader(
            name, JAGGED, _dtype_name(values.dtype, name), tuple(values.shape[1:])
        )
        return header, DeviceColumn(values, offsets - a)
    header = ColumnHeader(name, DENSE, _dtype_name(t.dtype, name), tuple(t.shape[1:]))
    return header, DeviceColumn(_plain(t))


#: tag values msgpack carries as they are
_TAG_PLAIN = frozenset({str, float, bool, bytes, type(None)})
_tags_encoder = msgspec.msgpack.Encoder()
_tags_decoder = msgspec.msgpack.Decoder(list[dict[str, Any] | None])


def tags_for_wire(
    tags: Sequence[Mapping[str, Any] | None], what: str = "tags"
) -> list[dict[str, Any] | None]:
    """Copies of per-row tag dicts ready to send: numpy and torch scalars become Python
    numbers, and anything msgpack cannot carry is refused before anything is sent.

    Raises:
        InvalidRequestError: a tag key is not a string (names the row and key).
        UnsupportedTypeError: a tag value cannot travel (names the row, key and type).
    """
    try:  # the common case, in C: a deep copy that msgpack carries, with str keys
        copied: list[dict[str, Any] | None] = _tags_decoder.decode(_tags_encoder.encode(tags))
        return copied
    except (TypeError, ValueError, OverflowError, msgspec.DecodeError):
        pass  # name the culprit, convert numpy/torch scalars (below)
    out: list[dict[str, Any] | None] = []
    for row, t in enumerate(tags):
        if not t:
            out.append(None)
            continue
        if not isinstance(t, Mapping):
            raise InvalidRequestError(
                f"{what}[{row}] is a {type(t).__name__}; tags are one dict per row (or None)"
            )
        copy = dict(t)
        for k, v in copy.items():
            if type(k) is not str:
                raise InvalidRequestError(
                    f"{what}[{row}] has key {k!r} of type {type(k).__name__}; tag keys must be "
                    f"strings: use {str(k)!r}"
                )
            tv = type(v)
            if tv is int:
                if not -(2**63) <= v < 2**64:
                    raise UnsupportedTypeError(
                        f"{what}[{row}][{k!r}] = {v} does not fit 64 bits; store it as a str"
                    )
            elif tv not in _TAG_PLAIN:
                copy[k] = _tag_value(v, f"{what}[{row}][{k!r}]", 0)
        out.append(copy)
    return out


def _tag_value(v: Any, where: str, depth: int) -> Any:
    """A tag value msgpack carries: scalars converted, containers converted recursively."""
    if isinstance(v, (np.generic, torch.Tensor)) and getattr(v, "ndim", 0) == 0:
        v = v.item()
    if v is None or isinstance(v, (float, bool, bytes)):
        return v
    if isinstance(v, str):
        return check_text(where, str(v))
    if isinstance(v, int):
        if not -(2**63) <= v < 2**64:
            raise UnsupportedTypeError(f"{where} = {v} does not fit 64 bits; store it as a str")
        return int(v)
    if depth < 32 and isinstance(v, (list, tuple)):
        return [_tag_value(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
    if depth < 32 and isinstance(v, Mapping):
        bad = next((k for k in v if not isinstance(k, str)), None)
        if bad is not None:
            raise InvalidRequestError(f"{where} has key {bad!r}; nested tag keys must be strings")
        return {k: _tag_value(x, f"{where}[{k!r}]", depth + 1) for k, x in v.items()}
    raise UnsupportedTypeError(
        f"{where} is of type {type(v).__name__}, which a tag cannot carry; tags hold None, bool, "
        "int, float, str, bytes and lists/dicts of those (convert it, e.g. int(x) or str(x))"
    )


def _tensor(data: np.ndarray[Any, Any], dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``data``'s bytes (a view; a copy when the bytes are read-only)."""
    if data.size == 0:
        return torch.empty(shape, dtype=dtype)
    if not data.flags.writeable or not data.flags.c_contiguous:
        data = data.copy()  # tensors are writable; never write into someone else's buffer
    flat = torch.frombuffer(data, dtype=dtype)
    return flat if len(shape) == 1 else flat.view(shape)


def column_value(header: ColumnHeader, column: Column | DeviceColumn) -> Any:
    """The user-facing value of a column: a tensor, a jagged nested tensor or a list."""
    if isinstance(column, DeviceColumn):
        return column.value()
    if isinstance(column, DenseColumn):
        return _tensor(column.data, torch_dtype(header.dtype), (len(column), *header.shape))
    if isinstance(column, JaggedColumn):
        return _RaggedDims().jagged(header, column)
    if header.kind == PICKLE:
        return [pickle.loads(v) for v in column.values]
    return column.values


# --------------------------------------------------------------------------------------------
# columns -> batch (jagged columns as nested tensors built in bulk: ``_nested``)


class _RaggedDims:
    """The ragged dimensions of one batch's jagged fields: one offsets tensor (one nested int)
    per distinct row lengths, so fields with equal lengths combine. Never shared across
    batches: a user's in-place edit of one batch's offsets stays in it."""

    __slots__ = ("_seen", "_uniform")

    def __init__(self) -> None:
        self._seen: dict[bytes, Ragged] = {}
        self._uniform: dict[tuple[int, int], Ragged] = {}

    def _dim(self, offsets: np.ndarray[Any, np.dtype[np.int64]], uniform: int | None) -> Ragged:
        key = offsets.tobytes()
        dim = self._seen.get(key)
        if dim is None:
            if len(offsets) < 2:  # no rows
                lo = hi = 0
            elif uniform is not None:
                lo = hi = uniform
            else:
                lengths = np.diff(offsets)
                lo, hi = int(lengths.min()), int(lengths.max())
            if not offsets.flags.writeable:
                offsets = offsets.copy()
            dim = self._seen[key] = Ragged(torch.from_numpy(offsets), lo, hi)
        return dim

    def jagged(self, header: ColumnHeader, column: JaggedColumn) -> torch.Tensor:
        """A jagged column as a jagged nested tensor (a view of its values)."""
        offsets = column.offsets
        a, b = int(offsets[0]), int(offsets[-1])
        values = _tensor(column.values[a:b], torch_dtype(header.dtype), (b - a, *header.shape))
        if a:
            offsets = offsets - a
        return jagged_tensor(values, self._dim(offsets, None))

    def dense(self, header: ColumnHeader, column: DenseColumn) -> torch.Tensor:
        """A dense column of rows ``[L, *T]`` as a jagged nested tensor, every row ``L`` long
        (a view of its data)."""
        n, length = len(column), header.shape[0]
        values = _tensor(column.data, torch_dtype(header.dtype), (n * length, *header.shape[1:]))
        dim = self._uniform.get((n, length))
        if dim is None:
            offsets = np.arange(n + 1, dtype=np.int64) * length
            dim = self._uniform[n, length] = self._dim(offsets, length)
        return jagged_tensor(values, dim)


def _non_tensor_stack(values: list[Any]) -> NonTensorStack:
    """A flat ``NonTensorStack`` with one entry per row.

    ``NonTensorStack.from_list`` is 3x faster but turns list values into nested stacks, so
    rows holding lists are wrapped one by one.
    """
    from tensordict import NonTensorData, NonTensorStack

    if any(isinstance(v, list) for v in values):
        return NonTensorStack(*[NonTensorData(v, batch_size=[]) for v in values])
    return NonTensorStack.from_list(values)


def columns_to_tensordict(
    n: int,
    headers: Sequence[ColumnHeader],
    columns: Sequence[Column | DeviceColumn],
    *,
    nested: bool | Collection[str] = False,
) -> TensorDict:
    """Assemble a ``TensorDict(batch_size=[n])``; list columns become ``NonTensorStack``.

    ``nested`` (True, or field names): dense columns whose rows have at least one dimension
    come back as jagged nested tensors (every row the same length).
    """
    fields: dict[str, Any] = {}
    ragged = _RaggedDims()
    tensors_only = True
    for header, column in zip(headers, columns, strict=True):
        if len(column) != n:  # the unchecked TensorDict below relies on it
            raise ProtocolError(f"field {header.name!r} came with {len(column)} rows, not {n}")
        value: Any
        if isinstance(column, JaggedColumn):
            value = ragged.jagged(header, column)
        elif (
            isinstance(column, DenseColumn)
            and header.shape
            and (nested is True or (nested and header.name in nested))
        ):
            value = ragged.dense(header, column)
        else:
            value = column_value(header, column)
            if isinstance(value, list):
                value = _non_tensor_stack(value)
                tensors_only = False
        fields[header.name] = value
    if tensors_only:
        return tensordict_of(fields, n, cpu_tensors=True)
    from tensordict import TensorDict

    return TensorDict(fields, batch_size=[n])
