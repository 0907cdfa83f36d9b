"""TransferQueue's client (`TransferQueueClient`) over a blocking
`tq_async.Client` per thread, and the process-wide lookups it shares with the KV
functions: this process's client, and each partition's first global index as seen through
compat (from the registry partition, so that indexes are unique across partitions)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import operator
import threading
from collections.abc import Callable, Mapping, Sequence
from itertools import repeat
from typing import Any, TypeVar, cast

import anyio
import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from .. import _meta
from .._client._sync._base import check_fields
from .._client._sync._client import Client as _Client
from .._core._state import INTERNAL_PARTITION_PREFIX
from .._errors import ClosedError, InvalidRequestError, PartitionNotFound, RowsNotFound
from .._errors import TQTimeoutError as _TQTimeoutError
from .._portal import tolerating_blocking
from .._wire._listing import KVListing
from ._batch_meta import GLOBAL_INDEX_STRIDE, BatchMeta
from ._columns import parsed, plain_columns, put_ragged, put_retrying_dtypes, read

_R = TypeVar("_R")

#: How long a ``get_meta`` in ``polling_mode`` waits for enough rows before it returns an
#: empty batch (TransferQueue answers at once; a short event-driven wait spares the caller's
#: retry loop most of its empty rounds).
POLLING_WAIT = 0.05

#: How long one wait of an ``async_get_meta`` lasts before its worker thread looks whether
#: the caller was cancelled (and waits again if not): the longest a cancelled caller's
#: thread stays busy
ASYNC_WAIT_SLICE = 1.0

#: this process's client lookup: ``tq_async.compat`` (which owns the init/close lifecycle and
#: the fork handling) installs it when it is imported
_lookups: list[Callable[[], TransferQueueClient | None]] = []


def install_lookup(lookup: Callable[[], TransferQueueClient | None]) -> None:
    """Make ``lookup`` what `attached` answers (``tq_async.compat`` calls it once)."""
    _lookups[:] = [lookup]


def attached() -> TransferQueueClient | None:
    """This process's compat client; None when `tq_async.compat.init` was not called."""
    return _lookups[0]() if _lookups else None


def get_client() -> TransferQueueClient:
    """This process's client.

    Raises:
        ClosedError: `init` was not called (or `close` was).
    """
    client = attached()
    if client is None:
        raise ClosedError("tq_async.compat is not initialised: call tq.init() first")
    return client


def to_thread(fn: Callable[..., _R]) -> Callable[..., Any]:
    """The ``async_`` twin of a blocking method: the same call on a worker thread."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> _R:
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))

    wrapper.__doc__ = f"Awaitable form of ``{fn.__name__}`` (runs it on a worker thread)."
    return wrapper


def as_list(value: str | Sequence[str], name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, Sequence) or not all(map(isinstance, value, repeat(str))):
        raise InvalidRequestError(f"{name} must be a string or a list of strings, got {value!r}")
    return list(value)


#: the partition where compat numbers the partitions it has seen (one key per partition), so
#: that global indexes seen through compat are unique across partitions; an internal one (no
#: capacity counts its rows: ``total_storage_size`` is the program's rows)
REGISTRY = f"{INTERNAL_PARTITION_PREFIX}_compat__"
#: ``(address, the service's state lineage, partition id) -> the partition's first global
#: index``, per process (a service restarted without its state numbers its partitions anew)
first_indexes: dict[tuple[str, bytes, str], int] = {}


def first_index(partition_id: str) -> int:
    """The global index of the partition's row 0 as seen through compat: its ordinal in the
    cluster (the row of its key in the registry partition) times ``GLOBAL_INDEX_STRIDE``.
    0 when compat is not initialised in this process or the one it was forked from (a
    spawned DataLoader worker)."""
    client = attached()
    if client is None or partition_id == REGISTRY:
        return 0
    native = client.client
    base = first_indexes.get((client.address, native.state_lineage, partition_id))
    if base is None:
        got = native.kv_retrieve_meta([partition_id], REGISTRY, create=True)
        # (keyed by the lineage the registry answered under: a restart found by this
        # lookup gives the new service's numbering)
        key = (client.address, native.state_lineage, partition_id)
        base = first_indexes[key] = got.global_indexes[0] * GLOBAL_INDEX_STRIDE
    return base


def partition_schema(partition_id: str) -> dict[str, dict[str, Any]]:
    """The field schema of a partition, from its controller (``{}`` when unknown)."""
    client = attached()
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
    return BatchMeta.from_native(meta, first_index(meta.partition_id), partition_schema)


def _native(meta: BatchMeta | _meta.BatchMeta) -> _meta.BatchMeta:
    """The native batch the client sends."""
    if isinstance(meta, BatchMeta):
        return meta.to_native()
    if isinstance(meta, _meta.BatchMeta):
        return meta
    raise InvalidRequestError(f"expected a BatchMeta, got {type(meta).__name__}")


def stored_dtypes(partition_id: str) -> dict[str, torch.dtype]:
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


def _fetch_mode(mode: str, task_name: str | None) -> tuple[str, str]:
    """``(tq_async's mode, task_name)`` for TransferQueue's ``get_meta`` arguments.

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
    return ("fetch" if mode == "fetch" else "peek"), task_name


def _empty(partition_id: str) -> _meta.BatchMeta:
    """The empty batch a ``get_meta`` in ``polling_mode`` answers with too few rows."""
    return _meta.BatchMeta(partition_id=partition_id, global_indexes=[], field_names=[], units=[])


async def _undone_if_cancelled(
    work: Callable[[Callable[[], bool]], _R], undo: Callable[[_R], object]
) -> _R:
    """``work(stopped)`` on a worker thread. When the caller is cancelled first (a timeout of
    ``asyncio.wait_for``), the thread is left to end on its own (``stopped()`` turns True)
    and ``undo`` runs on what it returns, since nobody will see it: as tq_async's own client
    undoes what the reply of a cancelled request granted."""
    lock = threading.Lock()
    state: dict[str, Any] = {"stop": False, "got": None}

    def stopped() -> bool:
        return bool(state["stop"])

    def run() -> _R:
        got = work(stopped)
        with lock:
            if state["stop"]:  # (what it returns goes nowhere)
                if got is not None:
                    undo(got)
            else:
                state["got"] = got
        return got

    try:
        return await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
    except BaseException:
        with lock:  # from now on the thread undoes what it ends with
            state["stop"] = True
            late = state["got"]
        if late is not None:  # it ended just as the caller gave up
            undo(late)
        raise


class _ThreadClients:
    """Stands for one blocking `tq_async.Client` per thread, each opened on the
    thread's first call (the first one at once, so a bad address fails here); the clients
    of threads that ended are closed when another thread opens its own."""

    def __init__(self, address: str) -> None:
        self._address = address
        self._local = threading.local()
        self._all: list[tuple[threading.Thread, _Client]] = []
        self._all_lock = threading.Lock()
        tolerating_blocking(self.current)()

    def current(self) -> _Client:
        client: _Client | None = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = _Client.connect(self._address).open()
            with self._all_lock:
                ended = [c for t, c in self._all if not t.is_alive()]
                self._all = [(t, c) for t, c in self._all if t.is_alive()]
                self._all.append((threading.current_thread(), client))
            for old in ended:  # (no thread uses them any more)
                old.close()
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
        for _, client in clients:
            client.close()


class TransferQueueClient:
    """TransferQueue's client, method for method (names and argument order), over a blocking
    `tq_async.Client`.

    Get the process's client with `get_client` after `init`. Each ``async_``
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
        """The underlying blocking `tq_async.Client` (every tq_async method): the
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
        returns an empty batch when there are not enough). ``mode="force_fetch"`` answers at
        once, without consuming: every row the task has not consumed that has
        ``data_fields``, whatever ``batch_size`` (see `_force_fetch`).

        Raises:
            InvalidRequestError: ``task_name`` is missing or ``mode`` is unknown.
        """
        ours, task = _fetch_mode(mode, task_name)
        if mode == "force_fetch":
            return _compat_meta(self._force_fetch(data_fields, partition_id, task, sampling_config))
        timeout = POLLING_WAIT if self.polling_mode else None
        meta = self._fetch(data_fields, batch_size, partition_id, task, sampling_config, ours,
                           timeout)  # fmt: skip
        return _compat_meta(_empty(partition_id) if meta is None else meta)

    async def async_get_meta(
        self,
        data_fields: Sequence[str],
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: Mapping[str, Any] | None = None,
    ) -> BatchMeta:
        """Awaitable form of ``get_meta``. A caller cancelled while it waits (a timeout of
        ``asyncio.wait_for``) takes no rows: the wait runs on a worker thread in slices of
        ``ASYNC_WAIT_SLICE`` seconds, and rows found after the cancellation go back to the
        task."""
        ours, task = _fetch_mode(mode, task_name)
        if mode == "force_fetch":  # (answers at once and takes nothing)
            return await anyio.to_thread.run_sync(
                lambda: _compat_meta(
                    self._force_fetch(data_fields, partition_id, task, sampling_config)
                )
            )

        def wait(stopped: Callable[[], bool]) -> tuple[_meta.BatchMeta | None, BatchMeta]:
            while True:
                slice_ = ASYNC_WAIT_SLICE if not self.polling_mode else POLLING_WAIT
                meta = self._fetch(data_fields, batch_size, partition_id, task,
                                   sampling_config, ours, slice_)  # fmt: skip
                if meta is not None or self.polling_mode or stopped():
                    # (the compat view here too: it may ask the registry, off the loop)
                    return meta, _compat_meta(_empty(partition_id) if meta is None else meta)

        got = await _undone_if_cancelled(wait, lambda got: self._give_back(got[0], ours))
        return got[1]

    def _fetch(
        self,
        data_fields: Sequence[str],
        batch_size: int,
        partition_id: str,
        task_name: str,
        sampling_config: Mapping[str, Any] | None,
        mode: str,
        timeout: float | None,
    ) -> _meta.BatchMeta | None:
        """The native ``get_meta``; None when ``timeout`` passed first (nothing consumed)."""
        try:
            return self._client.get_meta(
                data_fields, batch_size, partition_id, task_name, sampling_config,
                mode=mode, timeout=timeout,
            )  # fmt: skip
        except _TQTimeoutError:
            return None

    def _force_fetch(
        self,
        data_fields: Sequence[str],
        partition_id: str,
        task_name: str,
        sampling_config: Mapping[str, Any] | None,
    ) -> _meta.BatchMeta:
        """TransferQueue's ``force_fetch``, as near as the sampler allows: at once, a look
        (nothing consumed) at every row that has ``data_fields`` and that ``task_name`` has
        not consumed (TransferQueue also lists consumed rows and rows without the fields);
        an empty batch when there are none, or when they change under the look."""
        data_fields = check_fields(data_fields)  # (a string is refused, as fetch refuses it)
        try:
            produced = self._client.production_status(partition_id, data_fields)
            consumed = self._client.consumption_status(partition_id, task_name)
        except PartitionNotFound:
            return _empty(partition_id)
        if any(name not in produced for name in data_fields):
            return _empty(partition_id)
        ready = functools.reduce(operator.and_, (produced[name] for name in data_fields))
        n = min(ready.shape[0], consumed.shape[0])
        count = int(ready.sum()) - int((ready[:n] & consumed[:n]).sum())
        if count <= 0:
            return _empty(partition_id)
        meta = self._fetch(data_fields, count, partition_id, task_name, sampling_config,
                           "peek", 0)  # fmt: skip
        return _empty(partition_id) if meta is None else meta

    def _give_back(self, meta: _meta.BatchMeta | None, mode: str) -> None:
        """Return a fetch's rows to its task, as tq_async does for a cancelled fetch (a look
        takes none; a recorded batch, under a ``batch_index``, keeps its rows for its next
        reader)."""
        if meta is not None and mode == "fetch" and meta.batch_index is None and len(meta):
            self._client.release(meta)

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
        ``metadata``'s ``custom_meta`` is merged into its rows' with the put, and a compat
        ``metadata`` is returned itself, with the fields written added (as in TransferQueue).
        """
        data = parsed(plain_columns(data), data_parser)
        native = None if metadata is None else _native(metadata)
        pid = partition_id if native is None else native.partition_id
        # metadata's custom_meta goes with the put, as TransferQueue's put stores it
        tags = native.tags if native is not None and native.tags else None
        meta = put_ragged(
            data,
            lambda d: put_retrying_dtypes(
                pid,
                d,
                lambda e: self._client.put(
                    e, pid if native is None else None, meta=native, tags=tags
                ),
                stored_dtypes,
            ),
            lambda m, rows, d: put_retrying_dtypes(
                pid,
                d,
                lambda e: self._client.put(e, None, meta=m.select_rows(rows)),
                stored_dtypes,
            ),
        )
        out = _compat_meta(meta)
        if isinstance(metadata, BatchMeta) and metadata.size == out.size:
            return metadata.took_put(out)  # TransferQueue's put adds the fields to metadata
        return out

    async def async_put(
        self,
        data: TensorDictBase | Mapping[str, Any],
        metadata: BatchMeta | _meta.BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> BatchMeta:
        """Awaitable form of ``put`` (on a worker thread). A caller cancelled before it
        returns leaves no new rows: those the put goes on to write are cleared (fields
        written into ``metadata``'s rows stay)."""

        def undo(meta: BatchMeta) -> None:
            if metadata is None:
                self._client.clear_samples(meta.to_native())

        return await _undone_if_cancelled(
            lambda _: self.put(data, metadata, partition_id, data_parser), undo
        )

    def get_data(self, metadata: BatchMeta | _meta.BatchMeta) -> TensorDict:
        """The cells of ``metadata``'s rows and fields; tensor fields come back as jagged
        nested tensors, as in TransferQueue (an empty batch: an empty TensorDict)."""
        if isinstance(metadata, BatchMeta) and not metadata.size:
            return TensorDict({}, batch_size=[0])  # (BatchMeta.empty() knows no partition)
        native = _native(metadata)
        if not native.field_names or not len(native):
            return TensorDict({}, batch_size=[len(native)])
        return read(get_client().client, native)

    def set_custom_meta(self, metadata: BatchMeta | _meta.BatchMeta) -> None:
        """Store ``metadata``'s per-row ``custom_meta`` (tags) on the controller."""
        if isinstance(metadata, BatchMeta) and not metadata.size:
            return
        native = _native(metadata)
        tags = native.tags or [{} for _ in range(len(native))]
        self._client.set_tags(native, tags)

    def clear_partition(self, partition_id: str) -> None:
        """Remove the partition and free its storage (nothing when it does not exist, as in
        TransferQueue)."""
        with contextlib.suppress(PartitionNotFound):
            self._client.clear_partition(partition_id)

    def clear_samples(self, metadata: BatchMeta | _meta.BatchMeta) -> None:
        """Remove ``metadata``'s rows and free their storage; rows (or a partition) cleared
        already are skipped, as in TransferQueue (none for an empty batch)."""
        if isinstance(metadata, BatchMeta) and not metadata.size:
            return
        native = _native(metadata)
        try:
            self._client.clear_samples(native)
        except PartitionNotFound:
            return
        except RowsNotFound:  # (nothing was cleared: the rows still there go one by one)
            for i in range(len(native)):
                with contextlib.suppress(RowsNotFound, PartitionNotFound):
                    self._client.clear_samples(native.select_rows([i]))

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
        return first_index(partition_id) + torch.arange(mask.shape[0]), mask.to(torch.int8)

    def get_production_status(
        self, data_fields: Sequence[str], partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(row ids, [rows, fields]: 1 where the row has the field)``, a column per field of
        ``data_fields`` in the partition's order; ``(None, None)`` for an unknown partition,
        a field it does not have, or no field (as in TransferQueue)."""
        try:
            masks = self._client.production_status(partition_id)
        except PartitionNotFound:
            return None, None
        if not data_fields or any(name not in masks for name in data_fields):
            return None, None
        status = torch.stack([m for name, m in masks.items() if name in data_fields], dim=1)
        return first_index(partition_id) + torch.arange(status.shape[0]), status.to(torch.int8)

    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        """True when ``task_name`` consumed every row (False before the first put)."""
        return self._client.check_consumption_status(partition_id, task_name)

    def check_production_status(self, data_fields: Sequence[str], partition_id: str) -> bool:
        """True when every row has every field in ``data_fields`` (False before the first
        put)."""
        return self._client.check_production_status(partition_id, data_fields)

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        """Make the rows consumable again for ``task_name`` (all tasks when None); True, also
        for a partition that does not exist (as in TransferQueue)."""
        with contextlib.suppress(PartitionNotFound):
            self._client.reset_consumption(partition_id, task_name)
        return True

    def get_partition_list(self) -> list[str]:
        """Ids of every partition."""
        return [p for p in self._client.list_partitions() if p != REGISTRY]

    # -- KV --

    def kv_retrieve_meta(
        self, keys: str | Sequence[str], partition_id: str, create: bool = False
    ) -> BatchMeta:
        """A batch of ``keys``' rows (missing keys are created with ``create``), with the
        fields they all have; not ready (``production_status`` 0) when they share none, as in
        TransferQueue."""
        got = self._client.kv_retrieve_meta(as_list(keys, "keys"), partition_id, create)
        out = _compat_meta(got)
        if not got.field_names:
            out.production_status[:] = 0
        return out

    def kv_retrieve_keys(self, global_indexes: int | Sequence[int], partition_id: str) -> list[str]:
        """The key of each row in ``global_indexes`` (ints, numpy's included).

        Raises:
            RowsNotFound: an index is not a row of ``partition_id`` (of another partition,
                or cleared).
        """
        given: Any = global_indexes
        if not isinstance(given, (Sequence, np.ndarray, torch.Tensor)) or isinstance(given, str):
            given = [given]
        try:
            indexes = [operator.index(g) for g in given]
        except TypeError:
            raise InvalidRequestError(
                f"global_indexes must be an int or a list of ints, got {global_indexes!r}"
            ) from None
        base = first_index(partition_id)
        outside = [g for g in indexes if not base <= g < base + GLOBAL_INDEX_STRIDE]
        if outside:
            raise RowsNotFound(
                f"global indexes {outside[:8]} are not rows of partition {partition_id!r} (its "
                f"global indexes start at {base}); pass the global_indexes of a BatchMeta of "
                "that partition"
            )
        return self._client.kv_retrieve_keys([g - base for g in indexes], partition_id)

    def kv_list(self, partition_id: str | None = None) -> dict[str, KVListing]:
        """``{partition_id: {key: tags}}`` for one partition (``{}`` when it does not exist
        yet, as in TransferQueue) or all (each a `tq_async.KVListing`, decoded when first
        read)."""
        try:
            listing = self._client.kv_list(partition_id)
        except PartitionNotFound:
            return {}
        listing.pop(REGISTRY, None)  # compat's numbering of partitions
        return listing

    # -- checkpoints --

    def save_controller_checkpoint(self, path: str) -> None:
        """Not separable here: use `save_checkpoint` (controller state and cells)."""
        raise InvalidRequestError(
            "tq_async checkpoints hold the controller state and the cells together: call "
            "tq_async.compat.save_checkpoint(checkpoint_dir) instead"
        )

    def load_controller_checkpoint(self, path: str) -> None:
        """Not separable here: use `load_checkpoint`."""
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

    async_get_data = to_thread(get_data)
    async_set_custom_meta = to_thread(set_custom_meta)
    async_clear_partition = to_thread(clear_partition)
    async_clear_samples = to_thread(clear_samples)
    async_get_consumption_status = to_thread(get_consumption_status)
    async_get_production_status = to_thread(get_production_status)
    async_check_consumption_status = to_thread(check_consumption_status)
    async_check_production_status = to_thread(check_production_status)
    async_reset_consumption = to_thread(reset_consumption)
    async_get_partition_list = to_thread(get_partition_list)
    async_kv_retrieve_meta = to_thread(kv_retrieve_meta)
    async_kv_retrieve_keys = to_thread(kv_retrieve_keys)
    async_kv_list = to_thread(kv_list)
    async_save_controller_checkpoint = to_thread(save_controller_checkpoint)
    async_load_controller_checkpoint = to_thread(load_controller_checkpoint)
    async_save_storage_checkpoint = to_thread(save_storage_checkpoint)
    async_load_storage_checkpoint = to_thread(load_storage_checkpoint)
