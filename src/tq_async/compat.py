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
``controller.zmq_info``) or in the ``TQ_ADDRESS`` environment variable, or to a cluster
launched with :func:`tq_async.ray.launch` when Ray is initialised; with none of these it
starts a :func:`~tq_async.background_cluster` and publishes its address in ``TQ_ADDRESS``, so
child processes that call ``init()`` attach to it. Every remaining difference is listed, with
its reason, in ``docs/migrating.md``.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import anyio
import structlog
import torch
from tensordict import TensorDict, TensorDictBase

from . import _meta
from ._background import BackgroundCluster, background_cluster
from ._dataset import chunk_batch_fn as _chunk_batch_fn
from ._errors import ClosedError, InvalidRequestError, KeyNotFound, PartitionNotFound
from ._errors import TQTimeoutError as _TQTimeoutError
from ._sync import Client as _Client
from ._torch_dataset import StreamingDataLoader as _StreamingDataLoader
from ._torch_dataset import StreamingDataset as _StreamingDataset
from .samplers import BaseSampler as BaseSampler
from .samplers import GRPOGroupNSampler as GRPOGroupNSampler
from .samplers import RankAwareSampler as RankAwareSampler
from .samplers import SeqlenBalancedSampler as SeqlenBalancedSampler
from .samplers import SequentialSampler as SequentialSampler

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

_log = structlog.get_logger(__name__)
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


class BatchMeta(_meta.BatchMeta, frozen=True, kw_only=True):
    """:class:`tq_async.BatchMeta` with TransferQueue's names and its ``chunk(n)`` (n pieces).

    Adds ``partition_ids`` (one per row), ``custom_meta`` (the rows' tags),
    ``get_all_custom_meta`` / ``update_custom_meta``, ``select_samples``, ``is_ready``,
    indexing by row, and the ``extra_info`` helpers.
    """

    @classmethod
    def from_meta(cls, meta: _meta.BatchMeta) -> BatchMeta:
        """The same batch as a compat :class:`BatchMeta`."""
        if isinstance(meta, cls):
            return meta
        return cls(**{f: getattr(meta, f) for f in meta.__struct_fields__})

    def chunk(self, chunks: int) -> list[BatchMeta]:  # type: ignore[override]
        """``chunks`` pieces whose sizes differ by at most one (TransferQueue's meaning; 10
        rows, ``chunks=3``: 4, 3, 3), i.e. :meth:`chunk_into`."""
        return self.chunk_into(chunks)  # type: ignore[return-value]

    @property
    def partition_ids(self) -> list[str]:
        """The partition of each row (all rows of a BatchMeta share one here)."""
        return [self.partition_id] * len(self)

    @property
    def custom_meta(self) -> list[dict[str, Any]]:
        """Each row's tags (TransferQueue's ``custom_meta``); edit with
        :meth:`update_custom_meta`."""
        if not self.tags and len(self):
            self.tags.extend({} for _ in range(len(self)))
        return self.tags

    @property
    def is_ready(self) -> bool:
        """True for a non-empty batch (every row of a fetched batch has its fields)."""
        return len(self) > 0

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        """Copies of each row's tags."""
        return [dict(t) for t in self.custom_meta]

    def update_custom_meta(self, custom_meta: Sequence[Mapping[str, Any]]) -> None:
        """Merge ``custom_meta[i]`` into row ``i``'s tags (here; send them with
        ``TransferQueueClient.set_custom_meta``).

        Raises:
            InvalidRequestError: ``custom_meta`` does not have one dict per row.
        """
        if len(custom_meta) != len(self):
            raise InvalidRequestError(
                f"custom_meta has {len(custom_meta)} dicts for {len(self)} rows; give one per row"
            )
        for mine, new in zip(self.custom_meta, custom_meta, strict=True):
            mine.update(new)

    def select_samples(self, sample_indices: Sequence[int]) -> BatchMeta:
        """The rows at ``sample_indices`` (positions in this batch)."""
        return self.select_rows(list(sample_indices))  # type: ignore[return-value]

    def __getitem__(self, item: int | slice) -> BatchMeta:
        """One row (as a batch of one) or a slice of rows."""
        if isinstance(item, slice):
            return self.select_rows(item)  # type: ignore[return-value]
        index = item + len(self) if item < 0 else item
        if not 0 <= index < len(self):
            raise IndexError(f"BatchMeta index {item} out of range for {len(self)} rows")
        return self.select_rows([index])  # type: ignore[return-value]

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
        """A copy of ``extra_info``."""
        return dict(self.extra_info)

    def has_extra_info(self, key: str) -> bool:
        """Whether ``extra_info`` has ``key``."""
        return key in self.extra_info

    def remove_extra_info(self, key: str) -> Any:
        """Remove ``extra_info[key]`` and return it (None when absent)."""
        return self.extra_info.pop(key, None)

    def clear_extra_info(self) -> None:
        """Empty ``extra_info``."""
        self.extra_info.clear()


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
        self.tags = [dict(t) for t in self.tags]
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
        fields=list(meta.field_names),
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
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise InvalidRequestError(f"{name} must be a string or a list of strings, got {value!r}")
    return list(value)


def _no_parser(data_parser: Any) -> None:
    if data_parser is not None:
        raise InvalidRequestError(
            "data_parser is not supported by tq_async.compat: parse references into values "
            "before the put (see docs/migrating.md)"
        )


class _ThreadClients:
    """Stands for one blocking :class:`tq_async.Client` per thread, each opened on the
    thread's first call (the first one at once, so a bad address fails here)."""

    def __init__(self, address: str) -> None:
        self._address = address
        self._local = threading.local()
        self._all: list[_Client] = []
        self._all_lock = threading.Lock()
        self.current()

    def current(self) -> _Client:
        client: _Client | None = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = _Client.connect(self._address).open()
            with self._all_lock:
                self._all.append(client)
        return client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current(), name)

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
        calling thread's own (a Client serves one thread at a time)."""
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
        return BatchMeta.from_meta(meta)

    def put(
        self,
        data: TensorDictBase | Mapping[str, Any],
        metadata: _meta.BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> BatchMeta:
        """Write ``data``: new rows of ``partition_id``, or new fields of ``metadata``'s rows."""
        _no_parser(data_parser)
        meta = self._client.put(data, partition_id if metadata is None else None, meta=metadata)
        return BatchMeta.from_meta(meta)

    def get_data(self, metadata: _meta.BatchMeta) -> TensorDict:
        """The cells of ``metadata``'s rows and fields."""
        return self._client.get_data(metadata)

    def set_custom_meta(self, metadata: _meta.BatchMeta) -> None:
        """Store ``metadata``'s per-row tags (``custom_meta``) on the controller."""
        tags = metadata.tags or [{} for _ in range(len(metadata))]
        self._client.set_tags(metadata, tags)

    def clear_partition(self, partition_id: str) -> None:
        """Remove the partition and free its storage."""
        self._client.clear_partition(partition_id)

    def clear_samples(self, metadata: _meta.BatchMeta) -> None:
        """Remove ``metadata``'s rows and free their storage."""
        self._client.clear_samples(metadata)

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
        return torch.arange(mask.shape[0]), mask.to(torch.int8)

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
        return torch.arange(n), ready.to(torch.int8)

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
        return self._client.list_partitions()

    # -- KV --

    def kv_retrieve_meta(
        self, keys: str | Sequence[str], partition_id: str, create: bool = False
    ) -> BatchMeta:
        """A batch of ``keys``' rows (missing keys are created with ``create``)."""
        got = self._client.kv_retrieve_meta(_as_list(keys, "keys"), partition_id, create)
        return BatchMeta.from_meta(got)

    def kv_retrieve_keys(self, global_indexes: int | Sequence[int], partition_id: str) -> list[str]:
        """The key of each row in ``global_indexes``."""
        rows = [global_indexes] if isinstance(global_indexes, int) else list(global_indexes)
        return self._client.kv_retrieve_keys(rows, partition_id)

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


def _ray_address(flat: Mapping[str, Any]) -> str | None:
    """The address of a cluster launched with ``tq_async.ray.launch``, when Ray is up."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        from .ray import attach
    except ImportError:  # pragma: no cover - tq_async.ray needs the ray extra
        return None
    try:
        return attach(timeout=5.0).address
    except Exception:  # no such cluster: start one here instead
        return None


def init(conf: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    """Attach this process to a cluster, starting one if there is none; idempotent.

    Args:
        conf: TransferQueue's config shape (a dict or an OmegaConf ``DictConfig``). Honoured:
            ``address`` (or ``controller.zmq_info`` as a string), ``controller.sampler`` (an
            instance, a class or a built-in sampler's name), ``controller.polling_mode``,
            ``backend.SimpleStorage.num_data_storage_units`` (default 2),
            ``backend.SimpleStorage.total_storage_size`` (a global row capacity),
            ``metrics.enabled`` and ``metrics.port``. Other keys are ignored with a warning.
            The cluster settings apply only when this call starts the cluster.

    Returns:
        The effective config; ``config.controller.zmq_info`` and ``config.address`` hold the
        controller's address (give it to :class:`StreamingDataset`).

    Raises:
        InvalidRequestError: an honoured key has a bad value.
        BrokenError: the cluster's address could not be bound.
    """
    with _lock:
        if _state.get("pid") not in (None, os.getpid()):
            _state.clear()  # inherited through fork: this process needs its own client
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
        backend = flat.get("backend.storage_backend", "SimpleStorage")
        if backend != "SimpleStorage":
            raise InvalidRequestError(
                f"backend.storage_backend {backend!r} is not available in tq_async: its storage "
                "units hold the data (remove the key or set it to 'SimpleStorage')"
            )
        address = _address_in(flat) or _ray_address(flat)
        metrics_endpoint = os.environ.get("TQ_METRICS_ENDPOINT")
        cluster: BackgroundCluster | None = None
        settings = [k for k in flat if k.startswith(("controller.sampler", "backend.", "metrics."))]
        if address is not None and settings:
            _log.warning("attaching to a running cluster: its own settings stay", ignored=settings)
        if address is None:
            cluster = _start_cluster(flat)
            address = cluster.address
            os.environ["TQ_ADDRESS"] = address
            if cluster.cluster.metrics_url is not None:
                metrics_endpoint = cluster.cluster.metrics_url.split("//")[1].split("/")[0]
                os.environ["TQ_METRICS_ENDPOINT"] = metrics_endpoint
        try:
            client = TransferQueueClient(f"TransferQueueClient_{os.getpid()}", address)
        except BaseException:
            if cluster is not None:
                _stop(cluster)
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
        _state.update(client=client, cluster=cluster, config=config, pid=os.getpid())
        _log.info("tq_async.compat initialised", address=address, owns_cluster=bool(cluster))
        return config  # type: ignore[no-any-return]


def _start_cluster(flat: Mapping[str, Any]) -> BackgroundCluster:
    units = flat.get("backend.SimpleStorage.num_data_storage_units", 2)
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise InvalidRequestError(
            f"backend.SimpleStorage.num_data_storage_units must be an int >= 1, got {units!r}"
        )
    capacity = flat.get("backend.SimpleStorage.total_storage_size")
    kwargs: dict[str, Any] = {
        "num_storage_units": units,
        "sampler": _resolve_sampler(flat.get("controller.sampler")),
    }
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


def _stop(cluster: BackgroundCluster) -> None:
    cluster.close()
    if os.environ.get("TQ_ADDRESS") == cluster.address:
        del os.environ["TQ_ADDRESS"]
    os.environ.pop("TQ_METRICS_ENDPOINT", None)


def close() -> None:
    """Close this process's client and stop the cluster if :func:`init` started it here.

    Idempotent. Processes that attached keep running against nothing once the owner closes:
    close them first.
    """
    with _lock:
        client: TransferQueueClient | None = _state.pop("client", None)
        cluster: BackgroundCluster | None = _state.pop("cluster", None)
        pid = _state.pop("pid", None)
        _state.clear()
        if pid != os.getpid():
            return  # inherited through fork: the parent owns both
        if client is not None:
            client.close()
        if cluster is not None:
            _stop(cluster)


def get_client() -> TransferQueueClient:
    """This process's client.

    Raises:
        ClosedError: :func:`init` was not called (or :func:`close` was).
    """
    client: TransferQueueClient | None = _state.get("client")
    if client is None or _state.get("pid") != os.getpid():
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
    """Write one key's ``fields`` (a tensor per field, one row) and/or merge ``tag``.

    Raises:
        InvalidRequestError: neither ``fields`` nor ``tag`` is given.
    """
    _no_parser(data_parser)
    if not isinstance(key, str):
        raise InvalidRequestError(f"key must be a string, got {type(key).__name__}")
    meta = get_client().client.kv_put(key, partition_id, fields, tag)
    return _kv_meta(meta, [key])


def kv_batch_put(
    keys: Sequence[str],
    partition_id: str,
    fields: TensorDictBase | Mapping[str, Any] | None = None,
    tags: Sequence[Mapping[str, Any]] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    """Write ``fields`` (row ``i`` for ``keys[i]``) and/or merge ``tags`` into the keys.

    Raises:
        InvalidRequestError: neither ``fields`` nor ``tags`` is given, or their lengths do not
            match ``keys``.
    """
    _no_parser(data_parser)
    key_list = _as_list(keys, "keys")
    meta = get_client().client.kv_batch_put(key_list, partition_id, fields, tags)
    return _kv_meta(meta, key_list)


def kv_batch_get(
    keys: str | Sequence[str],
    partition_id: str,
    select_fields: str | Sequence[str] | None = None,
) -> TensorDict:
    """The fields of ``keys`` (row ``i`` for ``keys[i]``; every field when not selected).

    Raises:
        StorageKeyNotFoundError: a key is missing or lacks a selected field.
    """
    fields = None if select_fields is None else _as_list(select_fields, "select_fields")
    return get_client().client.kv_batch_get(_as_list(keys, "keys"), partition_id, fields)


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
    """``{partition_id: {key: tags}}`` for one partition, or for all when None."""
    return get_client().client.kv_list(partition_id)


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
    get_client().client.save_checkpoint(checkpoint_dir, metadata=metadata)


def load_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> None:
    """Restore a checkpoint written by :func:`save_checkpoint`.

    Raises:
        CheckpointError: the checkpoint is missing, partial or corrupt.
        InvalidRequestError: one of its partitions exists already (clear it first).
    """
    get_client().client.load_checkpoint(checkpoint_dir)


# ---- streaming dataset -----------------------------------------------------------------------


def _compat_chunks(
    process: Callable[..., Any], td: TensorDictBase, meta: _meta.BatchMeta, **kwargs: Any
) -> Any:
    """Hand ``process_batch_fn`` a compat :class:`BatchMeta` (TransferQueue's ``chunk``)."""
    return process(td, BatchMeta.from_meta(meta), **kwargs)


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
            process_batch_fn=functools.partial(_compat_chunks, process_batch_fn or _chunk_batch_fn),
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
