"""TransferQueue 0.1.11's top-level API, served by tq_async: migrate by changing one import.

::

    import tq_async.compat as tq          # was: import transfer_queue as tq

    tq.init()                                             # attach, or start a cluster
    meta = tq.kv_batch_put(keys, partition_id="train@0", fields=rollouts, tags=tags)
    td = tq.kv_batch_get(keys=keys, partition_id="train@0", select_fields=["responses"])
    tq.kv_clear(keys=keys, partition_id="train@0")
    tq.close()

Names, argument names and argument order follow TransferQueue 0.1.11 (``transfer_queue``'s
``__all__``): ``init``, ``close``, ``get_metrics_endpoint``, the KV functions and their
``async_`` forms, ``KVBatchMeta``, ``save_checkpoint`` / ``load_checkpoint``,
``StreamingDataset`` / ``StreamingDataLoader``, ``get_client`` / ``TransferQueueClient``,
``BatchMeta``, ``StorageKeyNotFoundError`` and the samplers.

Rendezvous: :func:`init` attaches to the address in its config (``address`` or
``controller.zmq_info``) or in the ``TQ_ADDRESS`` environment variable. When Ray is
initialised, every process of the job finds the services by name as Ray actors
(``TransferQueueController`` in namespace ``transfer_queue``, TransferQueue's names); a driver
that finds none launches them with :func:`tq_async.ray.launch`, a Ray worker that finds none
raises :class:`~tq_async.ClosedError`. Without Ray it starts a
:func:`~tq_async.background_cluster` and publishes its address in ``TQ_ADDRESS``, so child
processes that call ``init()`` attach to it. ``python -m tq_async.transfer_queue program.py``
runs a TransferQueue program unchanged. Every remaining difference is listed, with its reason,
in ``docs/migrating.md``.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, TypeVar, cast

import anyio
import msgspec
import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from .. import _meta
from .._client._sync._client import Client as _Client
from .._datasets._async import _split_rows
from .._datasets._async import chunk_batch_fn as _chunk_batch_fn
from .._datasets._torch import StreamingDataLoader as _StreamingDataLoader
from .._datasets._torch import StreamingDataset as _StreamingDataset
from .._deploy._background import BackgroundCluster, background_cluster
from .._errors import (
    ClosedError,
    InvalidRequestError,
    KeyNotFound,
    PartitionNotFound,
    SchemaError,
    UnsupportedTypeError,
)
from .._errors import TQTimeoutError as _TQTimeoutError
from .._logging import get_logger
from .._portal import tolerating_blocking
from ..samplers import BaseSampler as BaseSampler
from ..samplers import GRPOGroupNSampler as GRPOGroupNSampler
from ..samplers import RankAwareSampler as RankAwareSampler
from ..samplers import SeqlenBalancedSampler as SeqlenBalancedSampler
from ..samplers import SequentialSampler as SequentialSampler
from ._batch_meta import GLOBAL_INDEX_STRIDE
from ._batch_meta import BatchMeta as BatchMeta

__all__ = [
    "init",
    "close",
    "get_metrics_endpoint",
    "kv_put",
    "kv_batch_put",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_list",
    "kv_clear",
    "async_kv_put",
    "async_kv_batch_put",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_list",
    "async_kv_clear",
    "KVBatchMeta",
    "save_checkpoint",
    "load_checkpoint",
    "StreamingDataset",
    "StreamingDataLoader",
    "get_client",
    "BatchMeta",
    "TransferQueueClient",
    "StorageKeyNotFoundError",
    "BaseSampler",
    "GRPOGroupNSampler",
    "SequentialSampler",
    "RankAwareSampler",
    "SeqlenBalancedSampler",
]

_log = get_logger(__name__)
_R = TypeVar("_R")

#: TransferQueue's name for a missing key; here the same class as ``tq_async.KeyNotFound``.
StorageKeyNotFoundError = KeyNotFound

#: How long a ``get_meta`` in ``polling_mode`` waits for enough rows before it returns an
#: empty batch (TransferQueue answers at once; a short event-driven wait spares the caller's
#: retry loop most of its empty rounds).
POLLING_WAIT = 0.05

_SAMPLERS: dict[str, type[BaseSampler]] = {
    "SequentialSampler": SequentialSampler,
    "GRPOGroupNSampler": GRPOGroupNSampler,
    "RankAwareSampler": RankAwareSampler,
    "SeqlenBalancedSampler": SeqlenBalancedSampler,
}

#: config keys ``init`` honours (dotted paths); any other key is ignored with a warning
_HONOURED = frozenset(
    {
        "address",
        "allow_pickle",
        "controller.sampler",
        "controller.polling_mode",
        "controller.zmq_info",
        "backend.storage_backend",
        "backend.SimpleStorage.num_data_storage_units",
        "backend.SimpleStorage.total_storage_size",
        "backend.SimpleStorage.zmq_info",
        "metrics.enabled",
        "metrics.port",
        "metrics.endpoint",
    }
)


# ---- batch metadata --------------------------------------------------------------------------


@dataclass
class KVBatchMeta:
    """The handle on keyed rows that KV calls return and workers pass around.

    Attributes:
        keys: the rows' keys.
        tags: one tag dict per key.
        partition_id: the partition of the keys.
        fields: the fields the keys have (None: unknown).
        extra_info: a per-batch dict of your own.
    """

    keys: list[str] = field(default_factory=list)
    tags: list[dict[str, Any]] = field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] | None = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tags):
            raise InvalidRequestError(
                f"KVBatchMeta needs one tag dict per key: {len(self.keys)} keys, "
                f"{len(self.tags)} tags"
            )
        if len(set(self.keys)) != len(self.keys):
            raise InvalidRequestError("KVBatchMeta keys repeat; each key may appear once")
        if self.fields is not None and len(set(self.fields)) != len(self.fields):
            raise InvalidRequestError("KVBatchMeta fields repeat; each field may appear once")
        # own copies, so chunks and selections never share mutable state
        self.keys = list(self.keys)
        self.tags = copy.deepcopy([dict(t) for t in self.tags])
        self.fields = None if self.fields is None else list(self.fields)
        self.extra_info = copy.deepcopy(dict(self.extra_info or {}))

    @property
    def size(self) -> int:
        """Number of keys."""
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def select_keys(self, keys_to_select: Sequence[str]) -> KVBatchMeta:
        """The entries of ``keys_to_select``, in that order.

        Raises:
            InvalidRequestError: a key repeats or is not in this batch.
        """
        where = {k: i for i, k in enumerate(self.keys)}
        missing = [k for k in keys_to_select if k not in where]
        if missing:
            raise InvalidRequestError(f"keys {missing} are not in this KVBatchMeta")
        picked = [where[k] for k in keys_to_select]
        return self._take(picked)

    def reorder(self, indexes: Sequence[int]) -> None:
        """Put the entries in the order ``indexes`` (positions), in place.

        Raises:
            InvalidRequestError: ``indexes`` is not a permutation of the positions.
        """
        if sorted(indexes) != list(range(len(self))):
            raise InvalidRequestError(
                f"reorder needs a permutation of 0..{len(self) - 1}, got {list(indexes)}"
            )
        self.keys = [self.keys[i] for i in indexes]
        self.tags = [self.tags[i] for i in indexes]

    def chunk(self, chunks: int) -> list[KVBatchMeta]:
        """``chunks`` pieces whose sizes differ by at most one (10 keys, 3 chunks: 4, 3, 3)."""
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0:
            raise InvalidRequestError(f"chunks must be a positive int, got {chunks!r}")
        base, extra = divmod(len(self), chunks)
        out, start = [], 0
        for i in range(chunks):
            end = start + base + (1 if i < extra else 0)
            out.append(self._take(list(range(start, end))))
            start = end
        return out

    @classmethod
    def concat(cls, data: Sequence[KVBatchMeta]) -> KVBatchMeta:
        """Entries of several batches of one partition (and one field set), in order.

        Raises:
            InvalidRequestError: the batches differ in partition, fields, or disagree on an
                ``extra_info`` key.
        """
        parts = [d for d in data if len(d)]
        if not parts:
            return cls()
        first = parts[0]
        extra: dict[str, Any] = {}
        for d in parts:
            if d.partition_id != first.partition_id:
                raise InvalidRequestError("KVBatchMeta.concat needs batches of one partition")
            if d.fields is not None and set(d.fields) != set(first.fields or d.fields):
                raise InvalidRequestError("KVBatchMeta.concat needs batches of the same fields")
            for k, v in (d.extra_info or {}).items():
                if k in extra and extra[k] != v:
                    raise InvalidRequestError(
                        f"KVBatchMeta.concat: extra_info[{k!r}] differs between the batches"
                    )
                extra[k] = v
        return cls(
            keys=[k for d in parts for k in d.keys],
            tags=[t for d in parts for t in d.tags],
            partition_id=first.partition_id,
            fields=first.fields,
            extra_info=extra,
        )

    def _take(self, positions: list[int]) -> KVBatchMeta:
        return KVBatchMeta(
            keys=[self.keys[i] for i in positions],
            tags=[self.tags[i] for i in positions],
            partition_id=self.partition_id,
            fields=self.fields,
            extra_info=self.extra_info,
        )


def _kv_meta(meta: _meta.BatchMeta, keys: Sequence[str]) -> KVBatchMeta:
    tags = meta.tags or [{} for _ in keys]
    return KVBatchMeta(
        keys=list(keys),
        tags=tags,
        partition_id=meta.partition_id,
        fields=sorted(meta.field_names),
        extra_info=meta.extra_info,
    )


# ---- the client ------------------------------------------------------------------------------


def _to_thread(fn: Callable[..., _R]) -> Callable[..., Any]:
    """The ``async_`` twin of a blocking method: the same call on a worker thread."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> _R:
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))

    wrapper.__doc__ = f"Awaitable form of ``{fn.__name__}`` (runs it on a worker thread)."
    return wrapper


def _as_list(value: str | Sequence[str], name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, Sequence) or not all(map(isinstance, value, repeat(str))):
        raise InvalidRequestError(f"{name} must be a string or a list of strings, got {value!r}")
    return list(value)


#: the partition where compat numbers the partitions it has seen (one key per partition), so
#: that global indexes seen through compat are unique across partitions
_REGISTRY = "__tq_async_compat__"
#: ``(address, partition id) -> the partition's first global index``, per process
_bases: dict[tuple[str, str], int] = {}


def _base(partition_id: str) -> int:
    """The global index of the partition's row 0 as seen through compat: its ordinal in the
    cluster (the row of its key in the registry partition) times ``GLOBAL_INDEX_STRIDE``.
    0 when compat is not initialised in this process or the one it was forked from (a
    spawned DataLoader worker)."""
    client = _attached()
    if client is None or partition_id == _REGISTRY:
        return 0
    key = (client.address, partition_id)
    base = _bases.get(key)
    if base is None:
        got = client.client.kv_retrieve_meta([partition_id], _REGISTRY, create=True)
        base = _bases[key] = got.global_indexes[0] * GLOBAL_INDEX_STRIDE
    return base


def _schema(partition_id: str) -> dict[str, dict[str, Any]]:
    """The field schema of a partition, from its controller (``{}`` when unknown)."""
    client = _attached()
    if client is None:
        return {}
    try:
        info = client.client.partition_info(partition_id)
    except PartitionNotFound:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for name, described in info.get("fields", {}).items():
        kind, _, rest = str(described).partition(" ")
        dtype_name, _, dims = rest.partition("[")
        dtype = getattr(torch, dtype_name, None)
        shape = [int(d) for d in dims.rstrip("]").split(",") if d]
        out[name] = {
            "dtype": dtype if isinstance(dtype, torch.dtype) else None,
            "shape": torch.Size(shape) if kind == "dense" else None,
            "is_nested": kind == "jagged",
            "is_non_tensor": kind in ("object", "pickle"),
        }
    return out


def _compat_meta(meta: _meta.BatchMeta) -> BatchMeta:
    """The compat view of a native batch (global indexes unique across partitions)."""
    return BatchMeta.from_native(meta, _base(meta.partition_id), _schema)


def _native(meta: BatchMeta | _meta.BatchMeta) -> _meta.BatchMeta:
    """The native batch the client sends."""
    if isinstance(meta, BatchMeta):
        return meta.to_native()
    if isinstance(meta, _meta.BatchMeta):
        return meta
    raise InvalidRequestError(f"expected a BatchMeta, got {type(meta).__name__}")


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


def _plain_columns(fields: TensorDictBase | Mapping[str, Any], *, split: bool = True) -> Any:
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


def _one_row(fields: TensorDictBase | Mapping[str, Any]) -> Any:
    """One key's fields as a one-row batch: each value of a dict is the key's row (a
    ``NonTensorStack`` row holds its list of values, as in TransferQueue)."""
    if isinstance(fields, TensorDictBase):
        if fields.batch_size == torch.Size([]):
            return _plain_columns(fields.unsqueeze(0), split=False)  # the array is the row's
        return _plain_columns(fields)
    row: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
            value = torch.from_numpy(value)
        if isinstance(value, torch.Tensor) and not value.is_nested:
            row[name] = value.unsqueeze(0)
        elif isinstance(value, NonTensorStack):
            row[name] = [[_plain(v) for v in value.tolist()]]
        elif isinstance(value, NonTensorData):
            row[name] = [_plain(value.data)]
        else:
            row[name] = [_plain(value)]
    return row


def _parsed(fields: Any, data_parser: Callable[[Any], Any] | None) -> Any:
    """``data_parser({field: column})`` run here (TransferQueue runs it in the storage unit):
    the columns it returns are what is put."""
    if data_parser is None:
        return fields
    columns = _columns_of(fields)
    parsed = data_parser(columns)
    if not isinstance(parsed, Mapping) or set(parsed) != set(columns):
        raise InvalidRequestError(
            "data_parser must return the dict it was given, with the same field names and "
            "values replaced"
        )
    return {k: _plain_column(v) for k, v in parsed.items()}


def _stored_dtypes(partition_id: str) -> dict[str, torch.dtype]:
    """The dtype of each tensor field of a partition (from its schema)."""
    try:
        info = get_client().client.partition_info(partition_id)
    except PartitionNotFound:
        return {}
    out: dict[str, torch.dtype] = {}
    for name, described in info.get("fields", {}).items():
        parts = str(described).split(" ", 1)
        if len(parts) == 2 and parts[0] in ("dense", "jagged"):
            dtype = getattr(torch, parts[1].split("[", 1)[0], None)
            if isinstance(dtype, torch.dtype):
                out[name] = dtype
    return out


def _cast_to_partition(partition_id: str, fields: Any) -> Any:
    """``fields`` with each tensor column cast to the dtype its field has in the partition
    (None when no column needs it)."""
    stored = _stored_dtypes(partition_id)
    out: dict[str, Any] = {}
    changed = []
    for name, value in _columns_of(fields).items():
        dtype = stored.get(name)
        if isinstance(value, torch.Tensor) and dtype is not None and value.dtype != dtype:
            if not torch.can_cast(value.dtype, dtype):
                _log.warning(
                    "a field's dtype changed between puts: the rows are cast to the field's "
                    "first dtype, which may lose precision",
                    partition_id=partition_id,
                    field=name,
                    put=str(value.dtype),
                    field_dtype=str(dtype),
                )
            value = value.to(dtype)
            changed.append(name)
        out[name] = value
    return out if changed else None


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


def _put_ragged(
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


_RAGGED_FIELD = re.compile(r"rows of field '([^']+)' differ in more than their first dimension")


def _read(meta: _meta.BatchMeta, fields: list[str] | None = None) -> TensorDict:
    """``get_data(meta, fields, nested=True)``; a field whose rows differ in more than their
    first dimension comes back as a strided nested tensor (read row by row), as in
    TransferQueue."""
    client = get_client().client
    names = list(meta.field_names) if fields is None else fields
    try:
        return client.get_data(meta, names, nested=True)
    except SchemaError as exc:
        found = _RAGGED_FIELD.search(str(exc))
        if found is None or found.group(1) not in names:
            raise
        ragged = found.group(1)
    rest = [f for f in names if f != ragged]
    td = _read(meta, rest) if rest else TensorDict({}, batch_size=[len(meta)])
    rows = [client.get_data(meta.select_rows([i]), [ragged])[ragged][0] for i in range(len(meta))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "nested tensors are a prototype"
        td.set(ragged, torch.nested.nested_tensor(rows))
    return td


def _put_retrying_dtypes(partition_id: str | None, fields: Any, put: Callable[[Any], _R]) -> _R:
    """``put(fields)``; when the partition refuses a tensor column's dtype, the columns are
    cast to the partition's dtypes and put again (TransferQueue reads rows of several dtypes
    as the dtype of the field's first row)."""
    try:
        return put(fields)
    except SchemaError:
        if partition_id is None:
            raise
        cast = _cast_to_partition(partition_id, fields)
        if cast is None:
            raise
        return put(cast)


class _ThreadClients:
    """Stands for one blocking :class:`tq_async.Client` per thread, each opened on the
    thread's first call (the first one at once, so a bad address fails here)."""

    def __init__(self, address: str) -> None:
        self._address = address
        self._local = threading.local()
        self._all: list[_Client] = []
        self._all_lock = threading.Lock()
        tolerating_blocking(self.current)()

    def current(self) -> _Client:
        client: _Client | None = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = _Client.connect(self._address).open()
            with self._all_lock:
                self._all.append(client)
        return client

    def __getattr__(self, name: str) -> Any:
        if asyncio._get_running_loop() is None:
            return getattr(self.current(), name)
        # TransferQueue's synchronous functions work inside async code (blocking its loop):
        # programs written for it call them there
        value = getattr(tolerating_blocking(self.current)(), name)
        return tolerating_blocking(value) if callable(value) else value

    def close(self) -> None:
        with self._all_lock:
            clients, self._all = self._all, []
        for client in clients:
            client.close()


class TransferQueueClient:
    """TransferQueue's client, method for method (names and argument order), over a blocking
    :class:`tq_async.Client`.

    Get the process's client with :func:`get_client` after :func:`init`. Each ``async_``
    method runs its blocking twin on a worker thread.

    Args:
        client_id: a name for logs (unused otherwise).
        controller_info: the controller's address (a string), e.g. ``os.environ["TQ_ADDRESS"]``.
        zmq_io_threads: ignored (tq_async sockets need none).
        zmq_max_sockets: ignored.
    """

    def __init__(
        self,
        client_id: str,
        controller_info: str,
        zmq_io_threads: int | None = None,
        zmq_max_sockets: int | None = None,
    ) -> None:
        if not isinstance(controller_info, str) or not controller_info:
            raise InvalidRequestError(
                "controller_info must be the controller's address (a string such as "
                f"os.environ['TQ_ADDRESS']), got {type(controller_info).__name__}"
            )
        self.client_id = client_id
        self.address = controller_info
        self.polling_mode = False
        # one blocking Client per thread: the async_ forms run on worker threads, several at
        # once, and a Client serves one thread at a time
        self._client: _Client = cast(_Client, _ThreadClients(controller_info))

    @property
    def client(self) -> _Client:
        """The underlying blocking :class:`tq_async.Client` (every tq_async method): the
        calling thread's own (a Client serves one thread at a time). Inside async code, a
        view of it whose calls may block the running loop, as TransferQueue's do."""
        if asyncio._get_running_loop() is not None:
            return self._client  # the _ThreadClients: it forwards them so
        return cast(_ThreadClients, self._client).current()

    # -- data --

    def get_meta(
        self,
        data_fields: Sequence[str],
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: Mapping[str, Any] | None = None,
    ) -> BatchMeta:
        """Rows for ``task_name``: waits until the sampler finds them (with ``polling_mode``,
        returns an empty batch when there are not enough). ``mode="force_fetch"`` looks
        without consuming.

        Raises:
            InvalidRequestError: ``task_name`` is missing or ``mode`` is unknown.
        """
        if not task_name:
            raise InvalidRequestError(
                "get_meta needs a task_name (the consumer whose consumption is tracked)"
            )
        if mode not in ("fetch", "force_fetch"):
            raise InvalidRequestError(
                f"mode must be 'fetch' or 'force_fetch', got {mode!r} ('insert' is internal to "
                "TransferQueue: put() allocates rows here)"
            )
        ours = "fetch" if mode == "fetch" else "peek"
        timeout = POLLING_WAIT if self.polling_mode else None
        try:
            meta = self._client.get_meta(
                data_fields, batch_size, partition_id, task_name, sampling_config,
                mode=ours, timeout=timeout,
            )  # fmt: skip
        except _TQTimeoutError:
            meta = _meta.BatchMeta(
                partition_id=partition_id, global_indexes=[], field_names=[], units=[]
            )
        return _compat_meta(meta)

    def put(
        self,
        data: TensorDictBase | Mapping[str, Any],
        metadata: BatchMeta | _meta.BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> BatchMeta:
        """Write ``data``: new rows of ``partition_id``, or new fields of ``metadata``'s rows.

        ``data_parser`` runs here on ``{field: column}`` before the put; a tensor field put
        with another dtype than it has in the partition is cast to the partition's dtype.
        """
        data = _parsed(_plain_columns(data), data_parser)
        native = None if metadata is None else _native(metadata)
        pid = partition_id if native is None else native.partition_id
        meta = _put_ragged(
            data,
            lambda d: _put_retrying_dtypes(
                pid, d, lambda e: self._client.put(e, pid if native is None else None, meta=native)
            ),
            lambda m, rows, d: self._client.put(d, None, meta=m.select_rows(rows)),
        )
        out = _compat_meta(meta)
        if isinstance(metadata, BatchMeta) and metadata.size == out.size:
            out.extra_info.update(metadata.extra_info)
        return out

    def get_data(self, metadata: BatchMeta | _meta.BatchMeta) -> TensorDict:
        """The cells of ``metadata``'s rows and fields; tensor fields come back as jagged
        nested tensors, as in TransferQueue."""
        native = _native(metadata)
        if not native.field_names or not len(native):
            return TensorDict({}, batch_size=[len(native)])
        return _read(native)

    def set_custom_meta(self, metadata: BatchMeta | _meta.BatchMeta) -> None:
        """Store ``metadata``'s per-row ``custom_meta`` (tags) on the controller."""
        native = _native(metadata)
        tags = native.tags or [{} for _ in range(len(native))]
        self._client.set_tags(native, tags)

    def clear_partition(self, partition_id: str) -> None:
        """Remove the partition and free its storage."""
        self._client.clear_partition(partition_id)

    def clear_samples(self, metadata: BatchMeta | _meta.BatchMeta) -> None:
        """Remove ``metadata``'s rows and free their storage."""
        self._client.clear_samples(_native(metadata))

    # -- status --

    def get_consumption_status(
        self, task_name: str, partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(row ids, 1 where task_name consumed the row)``; ``(None, None)`` for an unknown
        partition."""
        try:
            mask = self._client.consumption_status(partition_id, task_name)
        except PartitionNotFound:
            return None, None
        return _base(partition_id) + torch.arange(mask.shape[0]), mask.to(torch.int8)

    def get_production_status(
        self, data_fields: Sequence[str], partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(row ids, 1 where every field in data_fields is written)``; ``(None, None)`` for
        an unknown partition."""
        try:
            masks = self._client.production_status(partition_id)
        except PartitionNotFound:
            return None, None
        n = max((m.shape[0] for m in masks.values()), default=0)
        ready = torch.ones(n, dtype=torch.bool)
        for name in data_fields:
            ready &= masks.get(name, torch.zeros(n, dtype=torch.bool))
        return _base(partition_id) + torch.arange(n), ready.to(torch.int8)

    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        """True when ``task_name`` consumed every row (False before the first put)."""
        return self._client.check_consumption_status(partition_id, task_name)

    def check_production_status(self, data_fields: Sequence[str], partition_id: str) -> bool:
        """True when every row has every field in ``data_fields`` (False before the first
        put)."""
        return self._client.check_production_status(partition_id, data_fields)

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        """Make the rows consumable again for ``task_name`` (all tasks when None)."""
        self._client.reset_consumption(partition_id, task_name)
        return True

    def get_partition_list(self) -> list[str]:
        """Ids of every partition."""
        return [p for p in self._client.list_partitions() if p != _REGISTRY]

    # -- KV --

    def kv_retrieve_meta(
        self, keys: str | Sequence[str], partition_id: str, create: bool = False
    ) -> BatchMeta:
        """A batch of ``keys``' rows (missing keys are created with ``create``)."""
        got = self._client.kv_retrieve_meta(_as_list(keys, "keys"), partition_id, create)
        return _compat_meta(got)

    def kv_retrieve_keys(self, global_indexes: int | Sequence[int], partition_id: str) -> list[str]:
        """The key of each row in ``global_indexes``."""
        rows = [global_indexes] if isinstance(global_indexes, int) else list(global_indexes)
        base = _base(partition_id)
        return self._client.kv_retrieve_keys([r - base for r in rows], partition_id)

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        """``{partition_id: {key: tags}}`` for one partition or all."""
        return self._client.kv_list(partition_id)

    # -- checkpoints --

    def save_controller_checkpoint(self, path: str) -> None:
        """Not separable here: use :func:`save_checkpoint` (controller state and cells)."""
        raise InvalidRequestError(
            "tq_async checkpoints hold the controller state and the cells together: call "
            "tq_async.compat.save_checkpoint(checkpoint_dir) instead"
        )

    def load_controller_checkpoint(self, path: str) -> None:
        """Not separable here: use :func:`load_checkpoint`."""
        raise InvalidRequestError(
            "call tq_async.compat.load_checkpoint(checkpoint_dir) instead (one checkpoint "
            "holds the controller state and the cells)"
        )

    save_storage_checkpoint = save_controller_checkpoint
    load_storage_checkpoint = load_controller_checkpoint

    def initialize_storage_manager(self, *args: Any, **kwargs: Any) -> None:
        """Accepted and ignored: the client finds the storage units through the controller."""

    def close(self) -> None:
        """Close the connection."""
        self._client.close()

    async_get_meta = _to_thread(get_meta)
    async_put = _to_thread(put)
    async_get_data = _to_thread(get_data)
    async_set_custom_meta = _to_thread(set_custom_meta)
    async_clear_partition = _to_thread(clear_partition)
    async_clear_samples = _to_thread(clear_samples)
    async_get_consumption_status = _to_thread(get_consumption_status)
    async_get_production_status = _to_thread(get_production_status)
    async_check_consumption_status = _to_thread(check_consumption_status)
    async_check_production_status = _to_thread(check_production_status)
    async_reset_consumption = _to_thread(reset_consumption)
    async_get_partition_list = _to_thread(get_partition_list)
    async_kv_retrieve_meta = _to_thread(kv_retrieve_meta)
    async_kv_retrieve_keys = _to_thread(kv_retrieve_keys)
    async_kv_list = _to_thread(kv_list)
    async_save_controller_checkpoint = _to_thread(save_controller_checkpoint)
    async_load_controller_checkpoint = _to_thread(load_controller_checkpoint)
    async_save_storage_checkpoint = _to_thread(save_storage_checkpoint)
    async_load_storage_checkpoint = _to_thread(load_storage_checkpoint)


# ---- init / close ----------------------------------------------------------------------------


class _Config(dict[str, Any]):
    """A nested dict whose keys are also attributes (``config.controller.zmq_info``), as with
    TransferQueue's OmegaConf config."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _as_config(value: Any) -> Any:
    if isinstance(value, Mapping):
        return _Config({str(k): _as_config(v) for k, v in value.items()})
    return value


def _flatten(conf: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in conf.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and path not in _HONOURED:
            out |= _flatten(value, path + ".")
        else:
            out[path] = value
    return out


_lock = threading.Lock()
_state: dict[str, Any] = {}
#: a forked child's copies of what its parent's init() made (client, cluster): never used,
#: closed or freed here (their sockets and threads are the parent's)
_inherited: list[Any] = []


def _after_fork_in_child() -> None:
    # another thread of the parent may have held the lock (in init or close) at the fork: the
    # child's copy stays held forever, as the thread that would release it is not copied
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _forget_parents_state() -> None:
    """In a forked child (``_lock`` held): keep the parent's objects out of reach, clear."""
    _inherited.extend(_state[k] for k in ("client", "cluster", "ray_cluster") if _state.get(k))
    _state.clear()


def _attached() -> TransferQueueClient | None:
    """This process's compat client; None when :func:`init` was not called.

    A child forked from an initialised process (a DataLoader worker, a ``worker_init_fn``,
    a helper process) gets a client of its own for the parent's cluster on first use: the
    parent's sockets are left untouched, and the cluster stays the parent's to stop.
    """
    if _state.get("pid") == os.getpid():
        return _state.get("client")
    with _lock:
        parent: TransferQueueClient | None = _state.get("client")
        if parent is None or _state.get("pid") == os.getpid():
            return parent
        client = TransferQueueClient(f"TransferQueueClient_{os.getpid()}", parent.address)
        client.polling_mode = parent.polling_mode
        config = _state.get("config")
        _forget_parents_state()
        _state.update(client=client, config=config, pid=os.getpid())
        _log.info("tq_async.compat attached a forked child", address=parent.address)
        return client


def _resolve_sampler(sampler: Any) -> BaseSampler | None:
    if sampler is None or isinstance(sampler, BaseSampler):
        return sampler
    if isinstance(sampler, type) and issubclass(sampler, BaseSampler):
        return sampler()
    if isinstance(sampler, str) and sampler in _SAMPLERS:
        return _SAMPLERS[sampler]()
    raise InvalidRequestError(
        f"controller.sampler must be a sampler instance, a BaseSampler subclass or one of "
        f"{sorted(_SAMPLERS)}, got {sampler!r}"
    )


def _address_in(flat: Mapping[str, Any]) -> str | None:
    for key in ("address", "controller.zmq_info"):
        value = flat.get(key)
        if isinstance(value, str) and value:
            return value
    return os.environ.get("TQ_ADDRESS") or None


#: the controller actor's name and Ray namespace when compat runs the services on Ray:
#: TransferQueue's, so ``ray.get_actor(RAY_CONTROLLER, namespace=RAY_NAMESPACE)`` finds it
RAY_CONTROLLER = "TransferQueueController"
RAY_NAMESPACE = "transfer_queue"


def _ray() -> Any:
    """The ``ray`` module when Ray is initialised in this process (else None)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray


def _in_ray_worker(ray: Any) -> bool:
    """True in a Ray task or actor (False in a driver)."""
    worker = getattr(ray.get_runtime_context(), "worker", None)
    return getattr(worker, "mode", None) == getattr(ray, "WORKER_MODE", 1)


def _ray_attach() -> Any:
    """The compat cluster of this Ray cluster, or one launched with ``tq_async.ray.launch``'s
    default name; None when there is neither."""
    from ..ray import attach

    for name, namespace in ((RAY_CONTROLLER, RAY_NAMESPACE), ("tq_async", "tq_async")):
        try:
            return attach(name, namespace, timeout=30.0)
        except InvalidRequestError:
            continue
    return None


def _ray_cluster(flat: Mapping[str, Any]) -> tuple[Any, bool]:
    """``(RayCluster, launched here)`` when Ray is initialised, else ``(None, False)``.

    Every process of a Ray job finds the services by name; only a driver launches them, so
    one job can never split over two clusters.

    Raises:
        ClosedError: a Ray worker found no services (the driver did not call ``init()``).
    """
    ray = _ray()
    if ray is None:
        return None, False
    found = _ray_attach()
    if found is not None:
        return found, False
    if _in_ray_worker(ray):
        raise ClosedError(
            f"tq_async.compat.init() in a Ray worker found no TransferQueue services (no Ray "
            f"actor {RAY_CONTROLLER!r} in namespace {RAY_NAMESPACE!r}): call tq.init() in the "
            "driver, after ray.init() and before starting workers, or give init() the "
            "cluster's address"
        )
    from ..ray import launch

    options = _cluster_options(flat)
    try:
        return launch(
            options["num_storage_units"],
            name=RAY_CONTROLLER,
            namespace=RAY_NAMESPACE,
            sampler=options["sampler"],
            allow_pickle=options["allow_pickle"],
            # one node: loopback only; several: each service on its node's address
            host="127.0.0.1" if len([n for n in ray.nodes() if n.get("Alive")]) == 1 else None,
        ), True
    except InvalidRequestError:  # another driver launched it in the meantime
        found = _ray_attach()
        if found is None:
            raise
        return found, False


def init(conf: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    """Attach this process to a cluster, starting one if there is none; idempotent.

    Where it attaches: the config's address or ``TQ_ADDRESS``; with Ray initialised, the
    job's services found by name (launched here when this is the driver and there are none;
    a Ray worker that finds none raises ``ClosedError``); otherwise a cluster started in this
    process. It logs where it attached.

    Args:
        conf: TransferQueue's config shape (a dict or an OmegaConf ``DictConfig``). Honoured:
            ``address`` (or ``controller.zmq_info`` as a string), ``controller.sampler`` (an
            instance, a class or a built-in sampler's name), ``controller.polling_mode``,
            ``backend.SimpleStorage.num_data_storage_units`` (default 2),
            ``backend.SimpleStorage.total_storage_size`` (a global row capacity),
            ``metrics.enabled``, ``metrics.port`` and ``allow_pickle`` (accept values that
            travel only with pickle). Other keys are ignored with a warning. The cluster
            settings apply only when this call starts the cluster.

    Returns:
        The effective config; ``config.controller.zmq_info`` and ``config.address`` hold the
        controller's address (give it to :class:`StreamingDataset`).

    Raises:
        InvalidRequestError: an honoured key has a bad value.
        BrokenError: the cluster's address could not be bound.
        ClosedError: a Ray worker found no services of its job (call ``init()`` in the
            driver first).
    """
    with _lock:
        if _state.get("pid") not in (None, os.getpid()):
            _forget_parents_state()  # inherited through fork: this process needs its own
        if "client" in _state:
            return _state["config"]  # type: ignore[no-any-return]
        flat = _flatten(conf) if conf is not None else {}
        ignored = sorted(k for k in flat if k not in _HONOURED)
        if ignored:
            warnings.warn(
                f"tq_async.compat.init ignores the config keys {ignored} (see "
                "docs/migrating.md for what each maps to)",
                UserWarning,
                stacklevel=2,
            )
        if os.environ.get("TQ_PRE_ALLOC_SAMPLE_NUM"):
            _log.warning(
                "TQ_PRE_ALLOC_SAMPLE_NUM is ignored: rows exist from their put; consumers learn "
                "that production is over from seal() / end of stream (see docs/migrating.md)"
            )
        backend = flat.get("backend.storage_backend", "SimpleStorage")
        if backend != "SimpleStorage":
            raise InvalidRequestError(
                f"backend.storage_backend {backend!r} is not available in tq_async: its storage "
                "units hold the data (remove the key or set it to 'SimpleStorage')"
            )
        address, cluster, ray_cluster, where = _locate(flat)
        metrics_endpoint = os.environ.get("TQ_METRICS_ENDPOINT")
        if cluster is not None and cluster.cluster.metrics_url is not None:
            metrics_endpoint = cluster.cluster.metrics_url.split("//")[1].split("/")[0]
            os.environ["TQ_METRICS_ENDPOINT"] = metrics_endpoint
        try:
            client = TransferQueueClient(f"TransferQueueClient_{os.getpid()}", address)
        except BaseException:
            _stop_owned(cluster, ray_cluster)
            raise
        client.polling_mode = bool(flat.get("controller.polling_mode", False))
        sampler = flat.get("controller.sampler", "SequentialSampler")
        config = _as_config(
            {
                "address": address,
                "controller": {
                    "sampler": sampler if isinstance(sampler, str) else type(sampler).__name__,
                    "polling_mode": client.polling_mode,
                    "zmq_info": address,
                },
                "backend": {
                    "storage_backend": "SimpleStorage",
                    "SimpleStorage": {
                        "num_data_storage_units": flat.get(
                            "backend.SimpleStorage.num_data_storage_units", 2
                        ),
                        "total_storage_size": flat.get("backend.SimpleStorage.total_storage_size"),
                        "zmq_info": address,
                    },
                },
                "metrics": {
                    "enabled": metrics_endpoint is not None,
                    "port": flat.get("metrics.port", 0),
                    "endpoint": metrics_endpoint,
                },
            }
        )
        _state.update(
            client=client, cluster=cluster, ray_cluster=ray_cluster, config=config, pid=os.getpid()
        )
        _log.info("tq_async.compat initialised", address=address, attached_to=where)
        return config  # type: ignore[no-any-return]


def _cluster_options(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a cluster ``init`` starts: storage units, sampler, pickle."""
    units = flat.get("backend.SimpleStorage.num_data_storage_units", 2)
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise InvalidRequestError(
            f"backend.SimpleStorage.num_data_storage_units must be an int >= 1, got {units!r}"
        )
    allow_pickle = flat.get("allow_pickle", False)
    if not isinstance(allow_pickle, bool):
        raise InvalidRequestError(f"allow_pickle must be True or False, got {allow_pickle!r}")
    return {
        "num_storage_units": units,
        "sampler": _resolve_sampler(flat.get("controller.sampler")),
        "allow_pickle": allow_pickle,
    }


def _start_cluster(flat: Mapping[str, Any]) -> BackgroundCluster:
    kwargs = _cluster_options(flat)
    capacity = flat.get("backend.SimpleStorage.total_storage_size")
    if capacity is not None:
        kwargs |= {"capacity": capacity, "capacity_scope": "global"}
    if flat.get("metrics.enabled", False):
        from prometheus_client import CollectorRegistry

        port = flat.get("metrics.port", 0)
        kwargs |= {
            "metrics_registry": CollectorRegistry(),
            "serve_metrics_on": f"127.0.0.1:{port or 0}",
        }
    return background_cluster(**kwargs)


def _locate(flat: Mapping[str, Any]) -> tuple[str, BackgroundCluster | None, Any, str]:
    """``(address, cluster started here, Ray cluster launched here, where)`` for ``init``.

    An address in the config or ``TQ_ADDRESS`` wins; with Ray initialised the job's Ray
    services (found by name, or launched by a driver); otherwise a private cluster in this
    process, whose address goes to ``TQ_ADDRESS`` for the processes it starts.
    """
    address = _address_in(flat)
    settings = [k for k in flat if k.startswith(("controller.sampler", "backend.", "metrics."))]
    settings += [k for k in flat if k == "allow_pickle"]
    if address is not None:
        if settings:
            _log.warning("attaching to a running cluster: its own settings stay", ignored=settings)
        return address, None, None, "the given address"
    ray_cluster, launched = _ray_cluster(flat)
    if ray_cluster is not None:
        # Ray workers are handed the driver's config: its settings are the cluster's already
        how = "launched" if launched else "found"
        where = f"Ray actor {ray_cluster.name!r} in namespace {ray_cluster.namespace!r} ({how})"
        # for the processes this one starts (close() takes it back)
        os.environ["TQ_ADDRESS"] = ray_cluster.address
        _state["published"] = ray_cluster.address
        return ray_cluster.address, None, ray_cluster if launched else None, where
    cluster = _start_cluster(flat)
    os.environ["TQ_ADDRESS"] = cluster.address
    return cluster.address, cluster, None, "a private cluster started in this process"


def _stop(cluster: BackgroundCluster) -> None:
    cluster.close()
    if os.environ.get("TQ_ADDRESS") == cluster.address:
        del os.environ["TQ_ADDRESS"]
    os.environ.pop("TQ_METRICS_ENDPOINT", None)


def _stop_owned(cluster: BackgroundCluster | None, ray_cluster: Any) -> None:
    if cluster is not None:
        _stop(cluster)
    if ray_cluster is not None and _ray() is not None:
        ray_cluster.shutdown()


def close() -> None:
    """Close this process's client and stop the cluster if :func:`init` started it here.

    Idempotent. Processes that attached keep running against nothing once the owner closes:
    close them first.
    """
    with _lock:
        client: TransferQueueClient | None = _state.pop("client", None)
        cluster: BackgroundCluster | None = _state.pop("cluster", None)
        ray_cluster = _state.pop("ray_cluster", None)
        published = _state.pop("published", None)
        pid = _state.pop("pid", None)
        _state.clear()
        _bases.clear()
        if published is not None and os.environ.get("TQ_ADDRESS") == published:
            del os.environ["TQ_ADDRESS"]
        if pid != os.getpid():
            return  # inherited through fork: the parent owns both
        if client is not None:
            client.close()
        _stop_owned(cluster, ray_cluster)


def get_client() -> TransferQueueClient:
    """This process's client.

    Raises:
        ClosedError: :func:`init` was not called (or :func:`close` was).
    """
    client = _attached()
    if client is None:
        raise ClosedError("tq_async.compat is not initialised: call tq.init() first")
    return client


def get_metrics_endpoint() -> str | None:
    """``host:port`` of the Prometheus endpoint, or None when metrics are off."""
    if "config" in _state:
        endpoint = _state["config"]["metrics"]["endpoint"]
        return endpoint if isinstance(endpoint, str) else None
    return os.environ.get("TQ_METRICS_ENDPOINT")


# ---- KV functions ----------------------------------------------------------------------------


def kv_put(
    key: str,
    partition_id: str,
    fields: TensorDictBase | Mapping[str, Any] | None = None,
    tag: Mapping[str, Any] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    """Write one key's ``fields`` and/or merge ``tag``.

    ``fields`` is a ``TensorDict`` of batch size ``[]`` or ``[1]``, or a dict whose values are
    the key's row: a tensor (one row), a ``NonTensorStack`` / ``NonTensorData`` (the row holds
    its values, as in TransferQueue), or a plain value. ``data_parser`` runs here, on the
    fields, before they travel (see :func:`kv_batch_put`).

    Raises:
        InvalidRequestError: neither ``fields`` nor ``tag`` is given.
    """
    if not isinstance(key, str):
        raise InvalidRequestError(f"key must be a string, got {type(key).__name__}")
    if fields is not None:
        fields = _parsed(_one_row(fields), data_parser)
    client = get_client().client
    if fields is None:
        meta = client.kv_put(key, partition_id, None, tag)
    else:
        meta = _put_retrying_dtypes(
            partition_id, fields, lambda f: client.kv_batch_put([key], partition_id, f, [tag])
        )
    return _kv_meta(meta, [key])


def kv_batch_put(
    keys: Sequence[str],
    partition_id: str,
    fields: TensorDictBase | Mapping[str, Any] | None = None,
    tags: Sequence[Mapping[str, Any]] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    """Write ``fields`` (row ``i`` for ``keys[i]``) and/or merge ``tags`` into the keys.

    ``data_parser`` (TransferQueue's hook) gets ``{field: column}`` (a ``NonTensorStack``
    column as a list) and returns it with values replaced; it runs in this process before the
    put, not in a storage unit. A tensor field put with another dtype than it has in the
    partition is cast to the partition's dtype (see docs/migrating.md).

    Raises:
        InvalidRequestError: neither ``fields`` nor ``tags`` is given, or their lengths do not
            match ``keys``.
    """
    key_list = _as_list(keys, "keys")
    client = get_client().client
    if fields is None:
        meta = client.kv_batch_put(key_list, partition_id, None, tags)
    else:
        fields = _parsed(_plain_columns(fields), data_parser)
        meta = _put_ragged(
            fields,
            lambda f: _put_retrying_dtypes(
                partition_id, f, lambda g: client.kv_batch_put(key_list, partition_id, g, tags)
            ),
            lambda _, rows, f: client.kv_batch_put([key_list[i] for i in rows], partition_id, f),
        )
    return _kv_meta(meta, key_list)


def kv_batch_get(
    keys: str | Sequence[str],
    partition_id: str,
    select_fields: str | Sequence[str] | None = None,
) -> TensorDict:
    """The fields of ``keys``, row ``i`` for ``keys[i]``.

    Without ``select_fields``: every field all the keys have. With it: the selected fields
    all the keys have (a field some key lacks is left out, as in TransferQueue). Tensor
    fields come back as jagged nested tensors (TransferQueue's shape), rows with no
    dimension as a dense ``[n]`` tensor.

    Raises:
        StorageKeyNotFoundError: a key is missing.
    """
    key_list = _as_list(keys, "keys")
    client = get_client().client
    meta = client.kv_retrieve_meta(key_list, partition_id)
    present = sorted(meta.field_names)  # TransferQueue's order
    if select_fields is not None:
        wanted = _as_list(select_fields, "select_fields")
        present = sorted(f for f in set(wanted) if f in meta.field_names)
    if not present:
        return TensorDict({}, batch_size=[len(key_list)])
    return _read(meta, present)


def kv_batch_get_by_meta(
    meta: KVBatchMeta, select_fields: str | Sequence[str] | None = None
) -> TensorDict:
    """The fields of ``meta``'s keys (``meta.fields``, or ``select_fields`` among them).

    Raises:
        InvalidRequestError: ``meta`` has no partition, or ``select_fields`` names a field
            not in ``meta.fields``.
    """
    if not isinstance(meta, KVBatchMeta) or meta.partition_id is None:
        raise InvalidRequestError("meta must be a KVBatchMeta with a partition_id")
    if select_fields is None:
        return kv_batch_get(meta.keys, meta.partition_id, meta.fields)
    wanted = _as_list(select_fields, "select_fields")
    unknown = [f for f in wanted if meta.fields is None or f not in meta.fields]
    if unknown:
        raise InvalidRequestError(
            f"select_fields {unknown} are not in the KVBatchMeta's fields {meta.fields}"
        )
    return kv_batch_get(meta.keys, meta.partition_id, wanted)


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    """``{partition_id: {key: tags}}`` for one partition (``{}`` when it does not exist yet,
    as in TransferQueue), or for all when None."""
    try:
        listing = get_client().client.kv_list(partition_id)
    except PartitionNotFound:
        return {}
    listing.pop(_REGISTRY, None)
    return listing


def kv_clear(keys: str | Sequence[str], partition_id: str) -> None:
    """Remove ``keys`` (keys that do not exist are skipped, as in TransferQueue)."""
    key_list = _as_list(keys, "keys")
    client = get_client().client
    try:
        client.kv_clear(key_list, partition_id)
    except (KeyNotFound, PartitionNotFound):
        try:
            existing = client.kv_list(partition_id).get(partition_id, {})
        except PartitionNotFound:
            return
        present = [k for k in key_list if k in existing]
        if present:
            client.kv_clear(present, partition_id)


async_kv_put = _to_thread(kv_put)
async_kv_batch_put = _to_thread(kv_batch_put)
async_kv_batch_get = _to_thread(kv_batch_get)
async_kv_batch_get_by_meta = _to_thread(kv_batch_get_by_meta)
async_kv_list = _to_thread(kv_list)
async_kv_clear = _to_thread(kv_clear)


# ---- checkpoints -----------------------------------------------------------------------------


def save_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    *,
    include_storage: bool = True,
    metadata: Mapping[str, Any] | None = None,
) -> None:
    """Save every partition (state and cells) to ``checkpoint_dir``, atomically.

    ``include_storage=False`` is ignored (cells live in memory: a checkpoint without them
    would lose data), as in TransferQueue with SimpleStorage. ``metadata`` (JSON values) is
    stored with it; read it back with :func:`tq_async.checkpoint_metadata`.
    """
    if not include_storage:
        _log.warning("include_storage=False is ignored: the cells are always saved")
    client = get_client().client
    # compat's numbering of partitions stays out: a restore goes into a cluster that has its own
    partitions = [p for p in client.list_partitions() if p != _REGISTRY]
    client.save_checkpoint(checkpoint_dir, partitions, metadata=metadata)


def load_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> None:
    """Restore a checkpoint written by :func:`save_checkpoint`.

    Raises:
        CheckpointNotFoundError: ``checkpoint_dir`` does not exist (a ``FileNotFoundError``,
            as in TransferQueue, and a ``CheckpointError``).
        CheckpointError: the checkpoint is partial or corrupt.
        InvalidRequestError: one of its partitions exists already (clear it first).
    """
    get_client().client.load_checkpoint(checkpoint_dir)


# ---- streaming dataset -----------------------------------------------------------------------


def _compat_chunks(
    process: Callable[..., Any],
    base: int,
    td: TensorDictBase,
    meta: _meta.BatchMeta,
    **kwargs: Any,
) -> Any:
    """Hand ``process_batch_fn`` a compat :class:`BatchMeta` (TransferQueue's ``chunk``).

    It runs on the dataset's event loop: the partition's first global index (``base``) was
    looked up when the dataset was made, and nothing here may block on the cluster.
    """
    if process is _chunk_batch_fn:
        return [
            (part, BatchMeta.from_native(m, base, _schema))
            for part, m in _chunk_batch_fn(td, meta, **kwargs)
        ]
    return process(td, BatchMeta.from_native(meta, base, _schema), **kwargs)


def chunk_batch_fn(
    td: TensorDictBase, batch_meta: BatchMeta, micro_batch_size: int = 1
) -> list[tuple[TensorDictBase, BatchMeta]]:
    """TransferQueue's ``transfer_queue.dataloader.streaming_dataset.chunk_batch_fn``: cut a
    batch and its compat :class:`BatchMeta` into micro-batches of ``micro_batch_size`` rows
    (the last may be short). Jagged and strided nested columns are cut like dense ones.

    Unlike TransferQueue's (whose metadata chunks are ``batch_meta.chunk(k)``: 10 rows by 4
    give data ``[4, 4, 2]`` but metadata ``[4, 3, 3]``), each metadata chunk names exactly the
    rows of its data chunk.

    Raises:
        UnsupportedTypeError: ``td`` is not a TensorDict (a ``TypeError``).
        InvalidRequestError: ``micro_batch_size`` is not a positive int or exceeds the rows,
            ``td`` has no batch dimension, or ``td`` and ``batch_meta`` differ in rows (a
            ``ValueError``).
    """
    if not isinstance(td, TensorDictBase):
        raise UnsupportedTypeError(f"chunk_batch_fn needs a TensorDict, got {type(td).__name__}")
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
        raise InvalidRequestError(
            f"micro_batch_size must be a positive integer, got {micro_batch_size!r}"
        )
    if micro_batch_size <= 0:
        raise InvalidRequestError(
            f"micro_batch_size must be a positive integer, got {micro_batch_size}"
        )
    if len(td.batch_size) == 0:
        raise InvalidRequestError("chunk_batch_fn needs a TensorDict with a batch dimension")
    total = int(td.batch_size[0])
    if micro_batch_size > total:
        raise InvalidRequestError(
            f"micro_batch_size ({micro_batch_size}) exceeds the batch's {total} rows"
        )
    if len(batch_meta) != total:
        raise InvalidRequestError(
            f"the batch has {total} rows of data but its BatchMeta has {len(batch_meta)}"
        )
    bounds = [(a, min(a + micro_batch_size, total)) for a in range(0, total, micro_batch_size)]
    parts = _split_rows(td, bounds)
    return [(part, batch_meta[a:b]) for part, (a, b) in zip(parts, bounds, strict=True)]


def _base_at(address: str, partition_id: str) -> int:
    """:func:`_base` for a cluster at ``address`` (through a short-lived client when this
    process's compat client is attached elsewhere, or not at all)."""
    client = _attached()
    if client is not None and client.address == address:
        return _base(partition_id)
    with _Client.connect(address) as other:
        got = other.kv_retrieve_meta([partition_id], _REGISTRY, create=True)
    return got.global_indexes[0] * GLOBAL_INDEX_STRIDE


class StreamingDataset(_StreamingDataset):
    """TransferQueue's ``StreamingDataset`` constructor over :class:`tq_async.StreamingDataset`.

    Args:
        config: the config :func:`init` returned (its ``address``); None: ``TQ_ADDRESS``.
        batch_size: rows per batch.
        micro_batch_size: rows per micro-batch yielded.
        data_fields: the fields to read.
        partition_id: the partition to read.
        task_name: the consumer task.
        dp_rank: the data-parallel rank; ranks of one ``dp_rank`` get the same batches.
        should_check_consumption_status: stop once every row is consumed (otherwise the
            stream ends when the partition is sealed and drained).
        fetch_batch_fn: not supported (tq_async's is ``async`` and gets an ``AsyncClient``;
            see docs/migrating.md); must be None.
        process_batch_fn: ``(td, batch_meta, micro_batch_size=...) -> [(td, meta), ...]``.

    Raises:
        InvalidRequestError: no address can be found, or an argument is invalid.
    """

    def __init__(
        self,
        config: Mapping[str, Any] | None,
        batch_size: int,
        micro_batch_size: int,
        data_fields: Sequence[str],
        partition_id: str,
        task_name: str,
        dp_rank: int,
        should_check_consumption_status: bool = False,
        fetch_batch_fn: Callable[..., Any] | None = None,
        process_batch_fn: Callable[..., Any] | None = None,
    ) -> None:
        if fetch_batch_fn is not None:
            raise InvalidRequestError(
                "fetch_batch_fn is not supported by tq_async.compat.StreamingDataset: pass an "
                "async one to tq_async.StreamingDataset (see docs/migrating.md)"
            )
        flat = _flatten(config) if config is not None else {}
        address = _address_in(flat)
        if address is None:
            raise InvalidRequestError(
                "StreamingDataset needs the cluster's address: pass the config tq.init() "
                "returned, or set TQ_ADDRESS"
            )
        super().__init__(
            address,
            data_fields,
            batch_size,
            micro_batch_size,
            partition_id,
            task_name,
            dp_rank=dp_rank,
            stop_when_consumed=should_check_consumption_status,
            process_batch_fn=functools.partial(
                _compat_chunks, process_batch_fn or _chunk_batch_fn, _base_at(address, partition_id)
            ),
        )
        self.config = config


class StreamingDataLoader(_StreamingDataLoader):
    """TransferQueue's ``StreamingDataLoader`` constructor over
    :class:`tq_async.StreamingDataLoader`.

    Yields ``(TensorDict, BatchMeta)`` micro-batches in ``batch_index`` order with any
    ``num_workers``. Workers start with the platform's default method, as torch's do
    (``fork`` on Linux), unless ``multiprocessing_context`` says otherwise: the client
    :func:`init` opened runs no thread of its own, and a worker re-creates its connections.

    Raises:
        InvalidRequestError: ``collate_fn`` is given or ``persistent_workers`` is True (the
            dataset already batches; workers restart each pass).
    """

    def __init__(
        self,
        dataset: StreamingDataset,
        num_workers: int = 0,
        collate_fn: Callable[..., Any] | None = None,
        pin_memory: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
    ) -> None:
        super().__init__(
            dataset,
            num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
        )


def __dir__() -> list[str]:
    # the public names are TransferQueue's (``__all__``); imports stay out of sight
    return sorted({n for n in globals() if n.startswith("_")} | set(__all__))
