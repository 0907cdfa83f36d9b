"""TransferQueue 0.1.11's ``BatchMeta`` for `tq_async.compat`: a mutable batch handle
with a field schema, per-row partition ids and production status, over a
`tq_async.BatchMeta` (which is what the client sends)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from .. import _meta
from .._errors import InvalidRequestError
from .._wire._checks import integral

__all__ = ["GLOBAL_INDEX_STRIDE", "BatchMeta", "field_schema_of"]

#: a compat global index is ``partition ordinal * GLOBAL_INDEX_STRIDE + row``: unique across
#: the partitions of a cluster, as TransferQueue's are (the first partition's are its rows)
GLOBAL_INDEX_STRIDE = 1 << 32


def field_schema_of(data: TensorDictBase | Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{field: {dtype, shape, is_nested, is_non_tensor}}`` of a batch's columns (a jagged
    field also has ``per_sample_shapes``)."""
    names = list(data.keys())
    schema: dict[str, dict[str, Any]] = {}
    for name in names:
        value = data.get(name) if isinstance(data, TensorDictBase) else data[name]
        if isinstance(value, torch.Tensor) and value.is_nested:
            rows = value.unbind()
            schema[name] = {
                "dtype": value.dtype,
                "shape": rows[0].shape if rows else None,
                "is_nested": True,
                "is_non_tensor": False,
                "per_sample_shapes": [tuple(r.shape) for r in rows],
            }
        elif isinstance(value, torch.Tensor):
            shape = value.shape[1:] if value.dim() > 1 else torch.Size([1])
            schema[name] = {
                "dtype": value.dtype,
                "shape": shape,
                "is_nested": False,
                "is_non_tensor": False,
            }
        else:
            schema[name] = {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
    return schema


class _SampleView:
    """One row of a `BatchMeta`, read-only (``batch.samples[i]``)."""

    def __init__(self, batch: BatchMeta, index: int) -> None:
        self._batch = batch
        self._index = index

    @property
    def global_index(self) -> int:
        """The row's global index."""
        return self._batch.global_indexes[self._index]

    @property
    def partition_id(self) -> str:
        """The row's partition."""
        return self._batch.partition_ids[self._index]

    @property
    def production_status(self) -> int:
        """1 when the row's fields are written."""
        return int(self._batch.production_status[self._index])

    @property
    def custom_meta(self) -> MappingProxyType[str, Any]:
        """The row's custom_meta (read-only)."""
        return MappingProxyType(self._batch.custom_meta[self._index])

    @property
    def fields(self) -> MappingProxyType[str, MappingProxyType[str, Any]]:
        """The field schema (read-only); a jagged field's ``shape`` is this row's."""
        out = {}
        for name, meta in self._batch.field_schema.items():
            row = {k: v for k, v in meta.items() if k != "per_sample_shapes"}
            shapes = meta.get("per_sample_shapes")
            if shapes is not None:
                row["shape"] = shapes[self._index]
            out[name] = MappingProxyType(row)
        return MappingProxyType(out)

    def __repr__(self) -> str:
        return (
            f"Sample(global_index={self.global_index}, partition_id={self.partition_id!r}, "
            f"fields={sorted(self._batch.field_schema)})"
        )


class _SampleViews(Sequence[_SampleView]):
    def __init__(self, batch: BatchMeta) -> None:
        self._batch = batch

    def __len__(self) -> int:
        return self._batch.size

    def __getitem__(self, index: int) -> _SampleView:  # type: ignore[override]
        if not -self._batch.size <= index < self._batch.size:
            raise IndexError(f"sample {index} out of range for {self._batch.size} rows")
        return _SampleView(self._batch, index % self._batch.size)

    def __iter__(self) -> Iterator[_SampleView]:
        return (_SampleView(self._batch, i) for i in range(self._batch.size))


class BatchMeta:
    """A batch of rows as TransferQueue describes it: ``global_indexes``, one partition id
    per row, a ``field_schema`` (``{field: {dtype, shape, is_nested, is_non_tensor}}``), a
    ``production_status`` (1 per written row), ``custom_meta`` (a dict per row) and
    ``extra_info`` (a dict per batch). Every attribute may be assigned.

    Batches returned by ``put`` / ``get_meta`` also know where their rows live, so
    ``get_data`` can read them; a batch built by hand describes rows but cannot be read.
    Their ``field_schema`` comes from the partition's schema (read when first used).

    Args:
        global_indexes: the rows' global indexes.
        partition_ids: each row's partition.
        field_schema: the fields and their schema.
        production_status: 1 per written row (all 0 by default).
        extra_info: a per-batch dict.
        custom_meta: a dict per row.

    Raises:
        InvalidRequestError: the per-row lists differ in length.
    """

    def __init__(
        self,
        global_indexes: Sequence[int] = (),
        partition_ids: Sequence[str] = (),
        field_schema: Mapping[str, Mapping[str, Any]] | None = None,
        production_status: Any = None,
        extra_info: Mapping[str, Any] | None = None,
        custom_meta: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        self.global_indexes = _indexes(global_indexes)
        pids = _items("partition_ids", partition_ids)
        if not all(isinstance(p, str) for p in pids):
            raise InvalidRequestError(
                f"BatchMeta partition_ids must be a list of str, got {partition_ids!r}"[:200]
            )
        self.partition_ids = [str(p) for p in pids]  # (numpy's str_ as str)
        _check_dicts(field_schema, extra_info, custom_meta)
        n = len(self.global_indexes)
        if len(self.partition_ids) != n:
            raise InvalidRequestError(
                f"BatchMeta needs one partition id per row: {n} global indexes, "
                f"{len(self.partition_ids)} partition ids"
            )
        self._schema: dict[str, dict[str, Any]] | None = (
            {k: dict(v) for k, v in field_schema.items()} if field_schema is not None else {}
        )
        self._names: list[str] = list(self._schema or {})
        status = np.zeros(n, dtype=np.int8) if production_status is None else production_status
        self.production_status = np.array(status, dtype=np.int8, copy=True)
        if len(self.production_status) != n:
            raise InvalidRequestError(
                f"production_status has {len(self.production_status)} entries for {n} rows"
            )
        self.extra_info: dict[str, Any] = dict(extra_info or {})
        self.custom_meta = [dict(c) for c in custom_meta] if custom_meta else [{} for _ in range(n)]
        if len(self.custom_meta) != n:
            raise InvalidRequestError(f"custom_meta has {len(self.custom_meta)} dicts for {n} rows")
        #: the native batch's row-level and batch-level parts (None: built by hand)
        self._units: list[int] | None = None
        self._keys: list[str | None] = []
        self._versions: dict[str, list[int]] = {}
        self._batch: dict[str, Any] = {}
        self._base = 0
        self._schema_loader: Any = None

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Ray (a task argument, ray.get) unpickles numpy arrays read-only, zero-copy over its
        # object store; this batch's arrays are written in place (add_fields)
        self.__dict__.update(state)
        status = state.get("production_status")
        if isinstance(status, np.ndarray) and not status.flags.writeable:
            self.production_status = status.copy()

    # ---- to and from tq_async's BatchMeta ----------------------------------------------------

    @classmethod
    def from_native(
        cls, meta: _meta.BatchMeta, base: int = 0, schema_loader: Any = None
    ) -> BatchMeta:
        """The compat view of a `tq_async.BatchMeta` whose partition's global indexes
        start at ``base``; ``schema_loader(partition_id)`` gives the field schema on demand."""
        n = len(meta)
        out = cls(
            [base + r for r in meta.global_indexes],
            [meta.partition_id] * n,
            None,
            np.ones(n, dtype=np.int8),
            meta.extra_info,
            meta.tags or None,
        )
        out._schema, out._names = None, list(meta.field_names)
        out._units, out._keys = list(meta.units), list(meta.keys)
        out._versions = {f: list(v) for f, v in meta.policy_versions.items()}
        out._batch = {
            "partition_id": meta.partition_id,
            "task_name": meta.task_name,
            "batch_index": meta.batch_index,
            "end_of_stream": meta.end_of_stream,
            "lease_id": meta.lease_id,
            "incarnation": meta.incarnation,
        }
        out._base, out._schema_loader = base, schema_loader
        return out

    def to_native(self) -> _meta.BatchMeta:
        """The `tq_async.BatchMeta` the client sends.

        Raises:
            InvalidRequestError: the batch was built by hand, or holds rows of several
                partitions.
        """
        if self._units is None:
            raise InvalidRequestError(
                "this BatchMeta was built by hand and does not know where its rows live; use "
                "one returned by put(), get_meta() or kv_retrieve_meta()"
            )
        pids = set(self.partition_ids) or {self._batch.get("partition_id", "")}
        if len(pids) != 1:
            raise InvalidRequestError(
                f"this BatchMeta holds rows of partitions {sorted(pids)}; split it with "
                "chunk_by_partition() and use one partition at a time"
            )
        return _meta.BatchMeta(
            partition_id=pids.pop(),
            global_indexes=[g - self._base for g in self.global_indexes],
            field_names=self.field_names,
            units=self._units,
            tags=self.custom_meta if any(self.custom_meta) else [],
            task_name=self._batch.get("task_name"),
            batch_index=self._batch.get("batch_index"),
            end_of_stream=bool(self._batch.get("end_of_stream", False)),
            policy_versions=self._versions,
            lease_id=int(self._batch.get("lease_id", 0)),
            incarnation=self._batch.get("incarnation"),
            extra_info=self.extra_info,
            keys=self._keys,
        )

    def _take(self, positions: Sequence[int], names: Sequence[str] | None = None) -> BatchMeta:
        """A new batch of the rows at ``positions`` (and the fields ``names``)."""
        keep = list(self.field_schema if names is None else names)
        schema = {}
        for name, meta in self.field_schema.items():
            if name in keep:
                meta = copy.deepcopy(meta)
                if meta.get("per_sample_shapes") is not None:
                    meta["per_sample_shapes"] = [meta["per_sample_shapes"][i] for i in positions]
                schema[name] = meta
        out = BatchMeta(
            [self.global_indexes[i] for i in positions],
            [self.partition_ids[i] for i in positions],
            schema,
            self.production_status[list(positions)] if len(positions) else None,
            copy.deepcopy(self.extra_info),
            copy.deepcopy([self.custom_meta[i] for i in positions]),
        )
        out._names = [n for n in self._names if n in keep] if self._schema is None else list(schema)
        if self._schema is None:
            out._schema, out._schema_loader = None, self._schema_loader
        if self._units is not None:
            out._units = [self._units[i] for i in positions]
        out._keys = [self._keys[i] for i in positions] if self._keys else []
        out._versions = {f: [v[i] for i in positions] for f, v in self._versions.items()}
        out._batch, out._base = dict(self._batch), self._base
        return out

    # ---- TransferQueue's attributes ----------------------------------------------------------

    @property
    def field_schema(self) -> dict[str, dict[str, Any]]:
        """``{field: {dtype, shape, is_nested, is_non_tensor}}``."""
        if self._schema is None:
            loaded = self._schema_loader(self.partition_id) if self._schema_loader else {}
            unknown = {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": False}
            self._schema = {n: dict(loaded.get(n, unknown)) for n in self._names}
        return self._schema

    @field_schema.setter
    def field_schema(self, value: Mapping[str, Mapping[str, Any]]) -> None:
        self._schema = {k: dict(v) for k, v in value.items()}
        self._names = list(self._schema)

    @property
    def size(self) -> int:
        """Number of rows."""
        return len(self.global_indexes)

    @property
    def field_names(self) -> list[str]:
        """The fields, sorted."""
        return sorted(self._names if self._schema is None else self._schema)

    @property
    def partition_id(self) -> str:
        """The partition of the rows (the first row's; ``""`` for an empty batch)."""
        if self.partition_ids:
            return self.partition_ids[0]
        return str(self._batch.get("partition_id", ""))

    @property
    def is_ready(self) -> bool:
        """True when the batch has rows and every one is written."""
        return self.size > 0 and bool(np.all(self.production_status == 1))

    @property
    def samples(self) -> Sequence[_SampleView]:
        """A read-only view per row: ``samples[i].fields``, ``.global_index``, ..."""
        return _SampleViews(self)

    @property
    def tags(self) -> list[dict[str, Any]]:
        """tq_async's name for ``custom_meta``."""
        return self.custom_meta

    @property
    def keys(self) -> list[str | None]:
        """Each row's KV key (empty when no row has one); tq_async's attribute."""
        return list(self._keys)

    @property
    def task_name(self) -> str | None:
        """The task that fetched the rows (None for a put)."""
        return self._batch.get("task_name")

    @property
    def end_of_stream(self) -> bool:
        """True on the empty batch that ends a sealed, drained partition."""
        return bool(self._batch.get("end_of_stream", False))

    def get_dtypes(self, field_name: str) -> list[Any]:
        """The field's dtype, once per row.

        Raises:
            KeyError: the batch has no such field.
        """
        return [self._field(field_name).get("dtype")] * self.size

    def get_shapes(self, field_name: str) -> list[Any]:
        """Each row's shape of the field (a jagged field's per row).

        Raises:
            KeyError: the batch has no such field.
        """
        meta = self._field(field_name)
        shapes = meta.get("per_sample_shapes")
        return list(shapes) if shapes is not None else [meta.get("shape")] * self.size

    def _field(self, name: str) -> dict[str, Any]:
        if name not in self.field_schema:
            raise KeyError(f"field {name!r} is not in this BatchMeta ({self.field_names})")
        return self.field_schema[name]

    # ---- custom_meta and extra_info ----------------------------------------------------------

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        """A deep copy of each row's custom_meta."""
        return copy.deepcopy(self.custom_meta)

    def update_custom_meta(self, custom_meta: Sequence[Mapping[str, Any]] | None) -> None:
        """Merge ``custom_meta[i]`` into row ``i``'s (send with ``set_custom_meta``).

        Raises:
            InvalidRequestError: ``custom_meta`` does not have one dict per row.
        """
        if custom_meta is None:
            return
        if len(custom_meta) != self.size:
            raise InvalidRequestError(
                f"custom_meta has {len(custom_meta)} dicts for {self.size} rows; give one per row"
            )
        for mine, new in zip(self.custom_meta, custom_meta, strict=True):
            mine.update(new)

    def clear_custom_meta(self) -> None:
        """Empty every row's custom_meta."""
        self.custom_meta = [{} for _ in range(self.size)]

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        """``extra_info[key]``, or ``default``."""
        return self.extra_info.get(key, default)

    def set_extra_info(self, key: str, value: Any) -> None:
        """Set ``extra_info[key]``."""
        self.extra_info[key] = value

    def update_extra_info(self, info_dict: Mapping[str, Any]) -> None:
        """Merge ``info_dict`` into ``extra_info``."""
        self.extra_info.update(info_dict)

    def get_all_extra_info(self) -> dict[str, Any]:
        """A deep copy of ``extra_info``."""
        return copy.deepcopy(self.extra_info)

    def has_extra_info(self, key: str) -> bool:
        """Whether ``extra_info`` has ``key``."""
        return key in self.extra_info

    def remove_extra_info(self, key: str) -> Any:
        """Remove ``extra_info[key]`` and return it (None when absent)."""
        return self.extra_info.pop(key, None)

    def clear_extra_info(self) -> None:
        """Empty ``extra_info``."""
        self.extra_info.clear()

    # ---- operations --------------------------------------------------------------------------

    def add_fields(self, tensor_dict: TensorDictBase, set_all_ready: bool = True) -> BatchMeta:
        """Describe ``tensor_dict``'s fields here too (in place); rows become written.

        Raises:
            InvalidRequestError: ``tensor_dict`` is not a TensorDict, or has another number
                of rows.
        """
        if not isinstance(tensor_dict, TensorDictBase):
            raise InvalidRequestError(
                f"add_fields takes a TensorDict, got {type(tensor_dict).__name__}: pass "
                f"TensorDict(fields, batch_size=[{self.size}])"
            )
        n = int(tensor_dict.batch_size[0]) if tensor_dict.batch_size else 0
        if n == 0:
            return self
        if n != self.size:
            raise InvalidRequestError(f"add_fields got {n} rows for a batch of {self.size}")
        self.field_schema.update(field_schema_of(tensor_dict))
        self._names = list(self.field_schema)
        if set_all_ready:
            self.production_status[:] = 1
        return self

    def took_put(self, written: BatchMeta) -> BatchMeta:
        """This batch, in place, after a put into its rows wrote ``written``'s fields (as
        TransferQueue's ``put`` updates the metadata it is given); returns it."""
        new = [n for n in written.field_names if n not in self.field_names]
        if self._schema is None:
            self._names += new
        else:
            self._schema.update({n: copy.deepcopy(written.field_schema[n]) for n in new})
            self._names = list(self._schema)
        self.production_status[:] = 1
        return self

    def select_fields(self, field_names: Sequence[str]) -> BatchMeta:
        """The same rows with only ``field_names`` (fields it does not have are skipped)."""
        names = [field_names] if isinstance(field_names, str) else list(field_names)
        present = self._names if self._schema is None else list(self._schema)
        return self._take(range(self.size), [n for n in names if n in present])

    def select_samples(self, sample_indices: Sequence[int]) -> BatchMeta:
        """The rows at ``sample_indices`` (positions in this batch).

        Raises:
            InvalidRequestError: a position is outside ``0..size - 1`` (a negative one too).
        """
        positions = list(sample_indices)
        outside = [i for i in positions if not 0 <= i < self.size]
        if outside:
            raise InvalidRequestError(
                f"select_samples positions {outside[:8]} are outside this batch's rows "
                f"0..{self.size - 1}"
            )
        return self._take(positions)

    def reorder(self, indices: Sequence[int]) -> None:
        """Put the rows in the order ``indices`` (positions), in place.

        Raises:
            InvalidRequestError: ``indices`` is not a permutation of the positions.
        """
        if sorted(indices) != list(range(self.size)):
            raise InvalidRequestError(
                f"reorder needs a permutation of 0..{self.size - 1}, got {list(indices)}"
            )
        self.__dict__.update(self._take(list(indices)).__dict__)

    def copy(self) -> BatchMeta:
        """A deep copy."""
        return self._take(range(self.size))

    def chunk(self, chunks: int) -> list[BatchMeta]:
        """``chunks`` pieces whose sizes differ by at most one (10 rows, 3 chunks: 4, 3, 3)."""
        chunks = integral(chunks)  # (numpy's int64, a torch scalar: from a config)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0:
            raise InvalidRequestError(f"chunks must be a positive int, got {chunks!r}")
        return [self._take(r) for r in _meta.even_ranges(self.size, chunks)]

    def chunk_by_partition(self) -> list[BatchMeta]:
        """One batch per partition, in order of first appearance."""
        by_pid: dict[str, list[int]] = {}
        for i, pid in enumerate(self.partition_ids):
            by_pid.setdefault(pid, []).append(i)
        return [self._take(rows) for rows in by_pid.values()]

    def union(self, other: BatchMeta) -> BatchMeta:
        """The same rows with the fields of both (``other``'s win); custom_meta and
        extra_info merged, a row written only if both say so.

        Raises:
            InvalidRequestError: the batches' rows differ.
        """
        if not other or other.size == 0:
            return self.copy()
        if self.size == 0:
            return other.copy()
        if (self.global_indexes, self.partition_ids) != (other.global_indexes, other.partition_ids):
            raise InvalidRequestError("BatchMeta.union needs two batches of the same rows")
        out = self.copy()
        out.field_schema = {**out.field_schema, **copy.deepcopy(other.field_schema)}
        out.production_status = np.bitwise_and(self.production_status, other.production_status)
        out.extra_info.update(copy.deepcopy(other.extra_info))
        for mine, theirs in zip(out.custom_meta, other.custom_meta, strict=True):
            mine.update(copy.deepcopy(theirs))
        return out

    @classmethod
    def concat(cls, data: Sequence[BatchMeta], validate: bool = True) -> BatchMeta:
        """The rows of several batches, one after another (the first batch's fields).

        Raises:
            InvalidRequestError: with ``validate``, the batches have different fields or
                disagree on an ``extra_info`` key.
        """
        parts = [d for d in data if d is not None and d.size]
        if not parts:
            return cls.empty()
        first = parts[0]
        extra: dict[str, Any] = {}
        for part in parts:
            if validate and part.field_names != first.field_names:
                raise InvalidRequestError(
                    f"BatchMeta.concat needs batches of the same fields: {first.field_names} "
                    f"vs {part.field_names}"
                )
            for key, value in part.extra_info.items():
                if validate and key in extra and not _same(extra[key], value):
                    raise InvalidRequestError(
                        f"BatchMeta.concat: extra_info[{key!r}] differs between the batches"
                    )
                extra[key] = value
        schema = copy.deepcopy(first.field_schema)
        for name, meta in schema.items():
            if meta.get("per_sample_shapes") is not None:
                meta["per_sample_shapes"] = [s for p in parts for s in p.get_shapes(name)]
        out = cls(
            [g for p in parts for g in p.global_indexes],
            [pid for p in parts for pid in p.partition_ids],
            schema,
            np.concatenate([p.production_status for p in parts]),
            extra,
            [c for p in parts for c in copy.deepcopy(p.custom_meta)],
        )
        if all(p._units is not None for p in parts) and len({p._base for p in parts}) == 1:
            out._units = [u for p in parts for u in (p._units or [])]
            out._keys = [k for p in parts for k in (p._keys or [None] * p.size)]
            if not any(out._keys):
                out._keys = []
            versions = {f for p in parts for f in p._versions}
            out._versions = {
                f: [v for p in parts for v in p._versions.get(f, [-1] * p.size)] for f in versions
            }
            kept = ("partition_id", "incarnation")
            out._batch = {k: v for k, v in first._batch.items() if k in kept}
            out._base = first._base
        return out

    @classmethod
    def empty(cls, extra_info: Mapping[str, Any] | None = None) -> BatchMeta:
        """A batch of no rows."""
        return cls(extra_info=extra_info)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, item: int | slice) -> BatchMeta:
        """One row (as a batch of one) or a slice of rows."""
        if isinstance(item, slice):
            return self._take(range(self.size)[item])
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            index = int(item) + self.size if item < 0 else int(item)
            if not 0 <= index < self.size:
                raise IndexError(f"BatchMeta index {item} out of range for {self.size} rows")
            return self._take([index])
        raise TypeError(f"BatchMeta indexes by int or slice, not {type(item).__name__}")

    def __str__(self) -> str:
        return (
            f"BatchMeta(size={self.size}, field_names={self.field_names}, "
            f"is_ready={self.is_ready}, global_indexes={self.global_indexes}, "
            f"extra_info={self.extra_info})"
        )

    __repr__ = __str__


def _items(name: str, values: Any) -> list[Any]:
    """``values`` (a list, tuple or array) as a list; a string alone (which would be split
    into one-letter items) or a non-iterable is refused."""
    if isinstance(values, (str, bytes)):
        raise InvalidRequestError(
            f"BatchMeta {name} must be a list, got the string {values!r}: pass [{values!r}]"[:200]
        )
    try:
        return list(values)
    except TypeError:
        raise InvalidRequestError(
            f"BatchMeta {name} must be a list, got {type(values).__name__}"
        ) from None


def _indexes(values: Any) -> list[int]:
    """``global_indexes`` as plain ints (numpy's too); a float or a string is refused."""
    indexes = [integral(i) for i in _items("global_indexes", values)]
    bad = [i for i in indexes if isinstance(i, bool) or not isinstance(i, int)]
    if bad:
        raise InvalidRequestError(
            f"BatchMeta global_indexes must be ints, got {type(bad[0]).__name__} {bad[0]!r}"
        )
    return indexes


def _check_dicts(field_schema: Any, extra_info: Any, custom_meta: Any) -> None:
    """The constructor's dict arguments are dicts (None: none)."""
    if field_schema is not None and (
        not isinstance(field_schema, Mapping)
        or not all(isinstance(v, Mapping) for v in field_schema.values())
    ):
        raise InvalidRequestError(
            "BatchMeta field_schema must be a dict {field: {dtype, shape, is_nested, "
            f"is_non_tensor}}, got {field_schema!r}"[:200]
        )
    if extra_info is not None and not isinstance(extra_info, Mapping):
        raise InvalidRequestError(
            f"BatchMeta extra_info must be a dict (or None), got {type(extra_info).__name__}"
        )
    if custom_meta is not None and not all(
        isinstance(c, Mapping) for c in _items("custom_meta", custom_meta)
    ):
        raise InvalidRequestError(
            f"BatchMeta custom_meta must be one dict per row, got {custom_meta!r}"[:200]
        )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    return bool(a == b)
