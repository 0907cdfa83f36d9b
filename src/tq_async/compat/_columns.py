"""What compat puts and reads, as plain columns: TensorDicts, dicts and numpy values turned
into the columns a `tq_async.Client` takes, columns ragged beyond their first dimension
put and read row shape by row shape, and tensor columns cast to their partition's dtypes."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgspec
import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from .. import _meta
from .._client._async._client import AsyncClient
from .._client._sync._client import Client
from .._errors import InvalidRequestError, SchemaError
from .._logging import get_logger
from .._wire._codec import from_numpy

_log = get_logger(__name__)
_R = TypeVar("_R")


def _plain(value: Any) -> Any:
    """``value`` with numpy scalars turned into Python scalars, through lists, tuples and
    dicts (a reward function returning ``np.float64`` then travels as msgpack)."""
    if isinstance(value, np.generic):
        return value.item()
    if type(value) is list:
        return [_plain(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    if type(value) is dict:
        return {k: _plain(v) for k, v in value.items()}
    return value


def _plain_column(value: Any, rows: int | None = None) -> Any:
    if isinstance(value, NonTensorStack):
        return [_plain(v) for v in value.tolist()]
    if (
        rows is not None
        and isinstance(value, NonTensorData)
        and isinstance(value.data, np.ndarray)
        and value.data.ndim > 0
        and value.data.shape[0] == rows
    ):
        # a TensorDict keeps a numpy string/object array whole; TransferQueue puts row i =
        # element i, as for a list
        array = value.data
        return [_plain(v) for v in (array.tolist() if array.ndim == 1 else list(array))]
    if isinstance(value, (list, tuple)) and not all(isinstance(v, torch.Tensor) for v in value):
        return [_plain(v) for v in value]
    return value


def _columns_of(fields: TensorDictBase | Mapping[str, Any]) -> dict[str, Any]:
    """``{field: column}`` of a TensorDict or a dict (iterating a TensorDict gives rows)."""
    if isinstance(fields, TensorDictBase):
        return {k: fields.get(k) for k in fields.keys()}  # noqa: SIM118
    return dict(fields)


def plain_columns(fields: TensorDictBase | Mapping[str, Any], *, split: bool = True) -> Any:
    """``fields`` with non-tensor columns as lists of plain values (a TensorDict as is when
    it has none). With ``split``, a numpy array the TensorDict holds whole (strings,
    objects) with one element per row is cut into its rows."""
    columns = _columns_of(fields)
    rows = (
        int(fields.batch_size[0])
        if split and isinstance(fields, TensorDictBase) and len(fields.batch_size) == 1
        else None
    )
    plain = {k: _plain_column(v, rows) for k, v in columns.items()}
    if isinstance(fields, TensorDictBase) and all(plain[k] is v for k, v in columns.items()):
        return fields
    return plain


def one_row(fields: TensorDictBase | Mapping[str, Any]) -> Any:
    """One key's fields as a one-row batch: each value of a dict is the key's row (a
    ``NonTensorStack`` row holds its list of values, as in TransferQueue).

    Raises:
        InvalidRequestError: a value is a nested tensor (rows of several keys).
    """
    if isinstance(fields, TensorDictBase):
        if fields.batch_size == torch.Size([]):
            return plain_columns(fields.unsqueeze(0), split=False)  # the array is the row's
        return plain_columns(fields)
    row: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            raise InvalidRequestError(
                f"kv_put writes one key's row, but field {name!r} is a nested tensor (rows of "
                "several keys): put them with kv_batch_put, a key per row"
            )
        if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
            value = from_numpy(value, name)  # (a tensor: its byte order and strides resolved)
        if isinstance(value, torch.Tensor) and not value.is_nested:
            row[name] = value.unsqueeze(0)
        elif isinstance(value, NonTensorStack):
            row[name] = [[_plain(v) for v in value.tolist()]]
        elif isinstance(value, NonTensorData):
            row[name] = [_plain(value.data)]
        else:
            row[name] = [_plain(value)]
    return row


def parsed(fields: Any, data_parser: Callable[[Any], Any] | None) -> Any:
    """``data_parser({field: column})`` run here (TransferQueue runs it in the storage unit):
    the columns it returns are what is put."""
    if data_parser is None:
        return fields
    columns = _columns_of(fields)
    replaced = data_parser(columns)
    if not isinstance(replaced, Mapping) or set(replaced) != set(columns):
        raise InvalidRequestError(
            "data_parser must return the dict it was given, with the same field names and "
            "values replaced"
        )
    return {k: _plain_column(v) for k, v in replaced.items()}


def _cast_to_partition(partition_id: str, fields: Any, stored: dict[str, torch.dtype]) -> Any:
    """``fields`` with each tensor column (dense, jagged, or a list of rows) cast to the dtype
    its field has in the partition (``stored``; None when no column needs it)."""
    out: dict[str, Any] = {}
    changed = []
    for name, value in _columns_of(fields).items():
        dtype = stored.get(name)
        rows = _tensor_rows(name, value)
        if dtype is not None and rows is not None and any(r.dtype != dtype for r in rows):
            first = next(r.dtype for r in rows if r.dtype != dtype)
            if not torch.can_cast(first, dtype):
                _log.warning(
                    "a field's dtype changed between puts: the rows are cast to the field's "
                    "first dtype, which may lose precision",
                    partition_id=partition_id,
                    field=name,
                    put=str(first),
                    field_dtype=str(dtype),
                )
            cast = [r.to(dtype) for r in rows]
            value = cast if isinstance(value, (list, tuple)) else cast[0]
            changed.append(name)
        out[name] = value
    return out if changed else None


def _tensor_rows(name: str, value: Any) -> list[torch.Tensor] | None:
    """A tensor column as ``[tensor]``, a list of tensor rows as its rows (numpy arrays as
    tensors, as they go in); None for any other column."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values:
        return None
    rows = []
    for v in values:
        if isinstance(v, np.ndarray) and v.dtype.kind in "biufc":
            v = from_numpy(v, name)
        if not isinstance(v, torch.Tensor):
            return None
        rows.append(v)
    return rows


def _ragged_rows(value: Any) -> list[torch.Tensor] | None:
    """The rows of a column whose rows differ in more than their first dimension (a list of
    tensors or a strided nested tensor); None for any other column."""
    if isinstance(value, torch.Tensor) and value.is_nested and value.layout == torch.strided:
        rows = list(value.unbind())
    elif (
        isinstance(value, (list, tuple))
        and value
        and all(isinstance(v, torch.Tensor) for v in value)
    ):
        rows = list(value)
    else:
        return None
    first = rows[0]
    if first.dim() < 2 or any(r.dim() != first.dim() or r.dtype != first.dtype for r in rows):
        return None
    if all(r.shape[1:] == first.shape[1:] for r in rows):
        return None
    return rows


def _split_ragged(fields: Any) -> tuple[Any, list[tuple[list[int], dict[str, Any]]]]:
    """``(fields without the ragged columns, [(row positions, {field: rows}), ...])``: the
    rows of a column ragged beyond its first dimension, grouped so that each group's rows
    share their shape after the first dimension (each group is one jagged column)."""
    columns = _columns_of(fields)
    groups: dict[tuple[int, ...], tuple[list[int], dict[str, list[torch.Tensor]]]] = {}
    base: dict[str, Any] = {}
    for name, value in columns.items():
        rows = _ragged_rows(value)
        if rows is None:
            base[name] = value
            continue
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, row in enumerate(rows):
            by_shape.setdefault(tuple(row.shape[1:]), []).append(i)
        for positions in by_shape.values():
            key = tuple(positions)
            group = groups.setdefault(key, (positions, {}))
            group[1][name] = [rows[i] for i in positions]
    if not groups:
        return fields, []
    return base, list(groups.values())


def put_ragged(
    fields: Any,
    put_all: Callable[[Any], _meta.BatchMeta],
    put_rows: Callable[[_meta.BatchMeta, list[int], Any], object],
) -> _meta.BatchMeta:
    """Put ``fields``; columns ragged beyond their first dimension go in further puts of the
    same rows, one per row shape (TransferQueue stores each row on its own)."""
    base, groups = _split_ragged(fields)
    if not groups:
        return put_all(fields)
    if not base:
        raise SchemaError(
            "every column of this put is ragged in more than its first dimension; put one "
            "column whose rows share a shape with it (e.g. an index), or pad the rows"
        )
    meta = put_all(base)
    for positions, columns in groups:
        put_rows(meta, positions, columns)
    names = [*meta.field_names, *(n for _, c in groups for n in c)]
    return msgspec.structs.replace(meta, field_names=list(dict.fromkeys(names)))


#: the SchemaError of a field's rows that cannot form one column (its name as repr writes it)
_RAGGED_FIELD = "rows of field {!r} differ in more than their first dimension"


def ragged_field(exc: SchemaError, names: list[str]) -> str | None:
    """The field of ``names`` whose rows ``exc`` says cannot form one column, if any."""
    message = str(exc)
    return next((f for f in names if _RAGGED_FIELD.format(f) in message), None)


def _packed(rows: list[torch.Tensor]) -> torch.Tensor:
    """A field's rows as TransferQueue packs them: a jagged nested tensor when they differ
    in one dimension, else a strided one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "nested tensors are a prototype"
        try:  # ragged in one dimension (after the first): jagged, as TransferQueue packs them
            return torch.nested.as_nested_tensor(rows, layout=torch.jagged)
        except (RuntimeError, TypeError):
            return torch.nested.nested_tensor(rows)


def read(client: Client, meta: _meta.BatchMeta, fields: list[str] | None = None) -> TensorDict:
    """``client.get_data(meta, fields, nested=True)``; a field whose rows differ in more than
    their first dimension is read row by row and comes back as TransferQueue packs it: a
    jagged nested tensor when the rows differ in one dimension, else a strided one."""
    names = list(meta.field_names) if fields is None else fields
    try:
        return client.get_data(meta, names, nested=True)
    except SchemaError as exc:
        ragged = ragged_field(exc, names)
        if ragged is None:
            raise
    rest = [f for f in names if f != ragged]
    td = read(client, meta, rest) if rest else TensorDict({}, batch_size=[len(meta)])
    rows = [client.get_data(meta.select_rows([i]), [ragged])[ragged][0] for i in range(len(meta))]
    td.set(ragged, _packed(rows))
    return td


async def read_async(
    client: AsyncClient, meta: _meta.BatchMeta, fields: list[str], device: Any = None
) -> TensorDict:
    """``await client.get_data(meta, fields, device=device)``, a field whose rows differ in
    more than their first dimension read row by row as `read` reads it (the dataset's
    fetch: the other fields come as tq_async's `get` gives them)."""
    try:
        return await client.get_data(meta, fields, device=device)
    except SchemaError as exc:
        ragged = ragged_field(exc, fields)
        if ragged is None:
            raise
    rest = [f for f in fields if f != ragged]
    td = (
        await read_async(client, meta, rest, device)
        if rest
        else TensorDict({}, batch_size=[len(meta)], device=device)
    )
    rows = []
    for i in range(len(meta)):
        row = await client.get_data(meta.select_rows([i]), [ragged], device=device)
        rows.append(row[ragged][0])
    td.set(ragged, _packed(rows))
    return td


def put_retrying_dtypes(
    partition_id: str | None,
    fields: Any,
    put: Callable[[Any], _R],
    stored_dtypes: Callable[[str], dict[str, torch.dtype]],
) -> _R:
    """``put(fields)``; when the partition refuses a tensor column's dtype, the columns are
    cast to the partition's dtypes (``stored_dtypes(partition_id)``, asked only then) and put
    again (TransferQueue reads rows of several dtypes as the dtype of the field's first row)."""
    try:
        return put(fields)
    except SchemaError:
        if partition_id is None:
            raise
        cast = _cast_to_partition(partition_id, fields, stored_dtypes(partition_id))
        if cast is None:
            raise
        return put(cast)
