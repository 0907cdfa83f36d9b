"""TransferQueue's ``StreamingDataset`` / ``StreamingDataLoader`` constructors over tq_async's,
and its ``chunk_batch_fn``: micro-batches carry a compat `BatchMeta`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tensordict import TensorDict, TensorDictBase

from .. import _meta
from .._client._sync._client import Client as _Client
from .._datasets._async import _split_rows, default_fetch_batch_fn
from .._datasets._async import chunk_batch_fn as _chunk_batch_fn
from .._datasets._torch import StreamingDataLoader as _StreamingDataLoader
from .._datasets._torch import StreamingDataset as _StreamingDataset
from .._errors import InvalidRequestError, SchemaError, UnsupportedTypeError
from ._batch_meta import GLOBAL_INDEX_STRIDE, BatchMeta
from ._client import REGISTRY, attached, first_index, partition_schema
from ._columns import ragged_field, read_async
from ._config import address_in, flatten


def _compat_chunks(
    process: Callable[..., Any],
    base: int,
    td: TensorDictBase,
    meta: _meta.BatchMeta,
    **kwargs: Any,
) -> Any:
    """Hand ``process_batch_fn`` a compat `BatchMeta` (TransferQueue's ``chunk``).

    It runs on the dataset's event loop: the partition's first global index (``base``) was
    looked up when the dataset was made, and nothing here may block on the cluster.
    """
    if process is _chunk_batch_fn:
        return [
            (part, BatchMeta.from_native(m, base, partition_schema))
            for part, m in _chunk_batch_fn(td, meta, **kwargs)
        ]
    return process(td, BatchMeta.from_native(meta, base, partition_schema), **kwargs)


def chunk_batch_fn(
    td: TensorDictBase, batch_meta: BatchMeta, micro_batch_size: int = 1
) -> list[tuple[TensorDictBase, BatchMeta]]:
    """TransferQueue's ``transfer_queue.dataloader.streaming_dataset.chunk_batch_fn``: cut a
    batch and its compat `BatchMeta` into micro-batches of ``micro_batch_size`` rows
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


async def compat_fetch_batch_fn(**kwargs: Any) -> tuple[TensorDict | None, _meta.BatchMeta]:
    """compat's dataset fetch: `default_fetch_batch_fn` (with every argument the dataset
    gives it), but a field whose rows differ in more than their first dimension is read row
    by row, as compat's ``get_data`` reads it (a strided nested tensor), where tq_async's
    ``get`` refuses it: the batch, recorded under its ``batch_index``, is read again by it."""
    fields = list(kwargs["data_fields"])
    try:
        return await default_fetch_batch_fn(**kwargs)
    except SchemaError as exc:
        if ragged_field(exc, fields) is None:
            raise
    client = kwargs["client"]
    # (the recorded batch, consuming nothing; the failed get sent the acknowledgements)
    meta = await client.get_meta(
        fields,
        kwargs["batch_size"],
        kwargs["partition_id"],
        kwargs["task_name"],
        kwargs["sampling_config"],
        timeout=kwargs.get("timeout"),
        stop_when_consumed=kwargs.get("stop_when_consumed", False),
    )
    if meta.end_of_stream:
        return None, meta
    td = await read_async(client, meta, fields, kwargs.get("device"))
    if not kwargs.get("keep_hold"):
        await client.ack(meta)  # the data is read: as get drops an auto-clear hold
    return td, meta


compat_fetch_batch_fn.default_like = True  # type: ignore[attr-defined]


def _first_index_at(address: str, partition_id: str) -> int:
    """`first_index` for a cluster at ``address`` (through a short-lived client when this
    process's compat client is attached elsewhere, or not at all)."""
    client = attached()
    if client is not None and client.address == address:
        return first_index(partition_id)
    with _Client.connect(address) as other:
        got = other.kv_retrieve_meta([partition_id], REGISTRY, create=True)
    return got.global_indexes[0] * GLOBAL_INDEX_STRIDE


class StreamingDataset(_StreamingDataset):
    """TransferQueue's ``StreamingDataset`` constructor over `tq_async.StreamingDataset`.

    Args:
        config: the config `init` returned (its ``address``); None: ``TQ_ADDRESS``.
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
        flat = flatten(config) if config is not None else {}
        address = address_in(flat)
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
            fetch_batch_fn=compat_fetch_batch_fn,
            process_batch_fn=functools.partial(
                _compat_chunks,
                process_batch_fn or _chunk_batch_fn,
                _first_index_at(address, partition_id),
            ),
        )
        self.config = config


class StreamingDataLoader(_StreamingDataLoader):
    """TransferQueue's ``StreamingDataLoader`` constructor over
    `tq_async.StreamingDataLoader`.

    Yields ``(TensorDict, BatchMeta)`` micro-batches in ``batch_index`` order with any
    ``num_workers``. Workers start with the platform's default method, as torch's do
    (``fork`` on Linux), unless ``multiprocessing_context`` says otherwise: the client
    `init` opened runs no thread of its own, and a worker re-creates its connections.

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
