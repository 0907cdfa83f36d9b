"""``AsyncStreamingDataset``: stream micro-batches of one task out of a partition.

The unit of determinism is the ``batch_index``: every fetch asks the controller for
``(partition_id, task_name, dp_rank, batch_index)``, and the controller records the rows it
hands out under that key. Asking again for the same key returns the same rows without
consuming anything. Everything below leans on that:

* **Exactly once.** The dataset's position (next ``batch_index`` and micro-batch) advances only
  when a micro-batch is handed to the caller. A batch that was fetched ahead and never
  delivered (the caller left the ``async with``, was cancelled, or the process died) stays
  recorded; resuming from the position re-reads it by its ``batch_index``.
* **Replay.** `AsyncStreamingDataset.reset` goes back to ``batch_index`` 0. The
  ``replay_window`` highest batch indexes are kept in memory; older ones are re-read from
  storage by their ``batch_index`` (and are not cached again, so a replay pass never evicts
  what the next pass will find). Memory is bounded by ``replay_window + prefetch + 1``
  batches whatever the length of the stream.
* **Prefetch.** One background task, owned by the task group of the ``async with``, fetches
  batches in ``batch_index`` order into a bounded memory stream: at most ``prefetch`` batches
  are fetched ahead of the one being delivered.
* **No gaps.** Recorded batch indexes of a ``(task, dp_rank)`` form a prefix ``0..K``: one
  dataset has one ``get_meta`` in flight at a time, and DataLoader workers sharing the index
  space (worker ``w`` of ``W`` reads ``w, w + W, ...``) first make sure the other workers'
  lower indexes are recorded. Otherwise, at the sealed tail, batch ``k + 1`` could take the
  last rows while batch ``k`` ends the stream, and a replay with fewer workers would stop
  before ``k + 1``.

* **Collective-safe ranks.** With ``dp_size``, the controller decides batch ``b`` for all
  ``dp_size`` ranks at once, so every rank gets batch ``b`` and the stream ends for all of them
  at the same ``batch_index``. At the tail a rank's share may be short or empty (``tail=
  "uneven"``): an empty batch is delivered as one micro-batch of 0 rows, so every rank runs
  the same number of steps and its collectives stay in step.

End of stream is explicit: the controller answers ``end_of_stream`` once the partition is
sealed and every row has been consumed by the task. With ``stop_when_consumed=True`` the
dataset also stops when every row the partition holds has been consumed by the task (see
`AsyncStreamingDataset` for how that is detected without polling for data).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeAlias

import anyio
import torch
from anyio.abc import TaskGroup
from tensordict import NonTensorStack, TensorDict, TensorDictBase

from .._client._async._client import AsyncClient
from .._errors import (
    ClosedError,
    InvalidRequestError,
    SchemaError,
    TQError,
)
from .._meta import BatchMeta
from .._paths._device_copy import check_device, to_device
from .._wire._checks import MAX_ALSO, check_int, check_seconds
from .._wire._nested import RowWindows, tensordict_of
from ._args import check_args, checked_name, field_list, parse_state, positive_int
from ._handoff import pack, unpack
from ._holds import Holds, hold_of
from ._prefetch import Prefetcher

__all__ = [
    "AsyncStreamingDataset",
    "BatchSlice",
    "FetchBatchFn",
    "ProcessBatchFn",
    "MicroBatch",
    "chunk_batch_fn",
    "default_fetch_batch_fn",
]

#: One micro-batch: its data and the `BatchMeta` of exactly the same rows.
MicroBatch: TypeAlias = tuple[TensorDict, BatchMeta]

#: ``async fetch_batch_fn(*, client, data_fields, batch_size, partition_id, task_name,
#: sampling_config, batch_index, timeout) -> (TensorDict | None, BatchMeta)``; see
#: `default_fetch_batch_fn`.
FetchBatchFn: TypeAlias = Callable[..., Awaitable[tuple[TensorDictBase | None, BatchMeta]]]

#: ``process_batch_fn(td, meta, *, micro_batch_size) -> list[(TensorDict, BatchMeta)]``; see
#: `chunk_batch_fn`.
ProcessBatchFn: TypeAlias = Callable[..., Sequence[MicroBatch]]

#: 0 by default: storage keeps every batch, so a replay re-reads it at full speed, while
#: batches held in memory keep their receive buffers from being reused and every new batch
#: then pays first-touch page faults (measured on the W1 batch: 0.84x raw get throughput
#: with 0, 0.51x with 8; `python -m benchmarks.extra`).
_DEFAULT_REPLAY_WINDOW = 0


async def default_fetch_batch_fn(
    *,
    client: AsyncClient,
    data_fields: Sequence[str],
    batch_size: int,
    partition_id: str,
    task_name: str,
    sampling_config: Mapping[str, Any],
    batch_index: int,
    timeout: float | None = None,
    stop_when_consumed: bool = False,
    device: Any = None,
    keep_hold: bool = False,
    ack: Sequence[BatchMeta] | None = None,
    **_: Any,
) -> tuple[TensorDict | None, BatchMeta]:
    """Fetch one batch: `get` under ``sampling_config``.

    This is the default ``fetch_batch_fn``. A custom one receives the same keyword arguments
    but ``device``, ``keep_hold`` and ``ack`` (accept ``**kwargs`` to ignore those you do not
    need), and an auto-clear task's rows are acknowledged as it reads them (``get``'s
    default), so a batch it read ahead and that is never delivered loses its rows. A custom
    one that calls this function with every keyword argument it receives and returns its
    result (the batch changed or not, the same rows and meta) says so with
    ``fn.default_like = True``: it then gets these three as well, and the dataset
    acknowledges each batch once delivered, as with this one. A custom one must keep this
    contract:

    * pass ``sampling_config`` (it carries ``dp_rank`` and ``batch_index``, and ``dp_size``
      and ``tail`` when the dataset has them) to ``get`` or ``get_meta`` so the rows
      are recorded under the batch index and can be read again on replay or resume;
    * wait for rows rather than return an empty batch (``get_meta`` waits when ``timeout``
      is None), and let `TQTimeoutError` escape when ``timeout`` expires;
    * return a batch of 0 rows that is not the end of the stream (with ``dp_size``, or a
      sampler built for several ranks) as ``(empty TensorDict, meta)``: this rank's share of
      a global batch is empty, and the dataset delivers it so the ranks stay in step;
    * at the end of the stream, return ``(None, meta)`` with ``meta.end_of_stream`` set.

    Args:
        client: the dataset's connected `AsyncClient`.
        data_fields: fields to read.
        batch_size: rows per batch.
        partition_id: the partition to read.
        task_name: the consuming task.
        sampling_config: the dataset's ``sampling_config`` plus ``dp_rank`` and
            ``batch_index`` (and ``dp_size`` and ``tail`` when the dataset has them).
        batch_index: the batch being fetched (also in ``sampling_config``).
        timeout: seconds ``get_meta`` may wait for rows; None waits until rows arrive.
        stop_when_consumed: pass to ``get_meta``: end the stream once the partition holds
            rows and the task consumed all of them.
        device: read the tensors onto this device (``get(..., device=)``: columns in a
            device arena of a unit on this host move device to device). The dataset passes
            it to this default function only, when it has a ``device`` and no replay window.
        keep_hold: pass to ``get``: an auto-clear task's rows stay held once read. The
            dataset passes it to this default function only, and acknowledges each batch
            once it is delivered (a batch read ahead and never delivered keeps its rows for
            the next reader of its ``batch_index``).
        ack: pass to ``get``: batches delivered since the last fetch, acknowledged with it.

    Returns:
        ``(data, meta)`` (with ``dp_size``, possibly 0 rows of both); ``(None, meta)`` with
        ``meta.end_of_stream`` at the end of the stream.

    Raises:
        TQTimeoutError: no batch within ``timeout`` (nothing was consumed).

    Cancellation: rows already handed out stay recorded under ``batch_index`` (re-read by
    the next fetch of the same index); nothing is lost.
    """
    # ``get`` reads the cells with the metadata when the controller can send them along
    # (one round trip), and acknowledges an auto-clear hold once they are read
    data, meta = await client.get(
        data_fields,
        batch_size,
        partition_id,
        task_name,
        sampling_config,
        timeout=timeout,
        stop_when_consumed=stop_when_consumed,
        device=device,
        keep_hold=keep_hold,
        ack=ack,
    )
    if meta.end_of_stream:
        return None, meta
    return data, meta


def default_like(fn: Any) -> bool:
    """Whether ``fn`` is `default_fetch_batch_fn` or a wrapper of it marked
    ``default_like = True`` (compat's, a user's: documented there): it takes the arguments
    only the default one gets (``device``, ``keep_hold``, ``ack``), honours ``timeout=0``
    and leaves the holds to the dataset, as the default one does."""
    return fn is default_fetch_batch_fn or getattr(fn, "default_like", False) is True


def chunk_batch_fn(
    td: TensorDictBase, meta: BatchMeta, micro_batch_size: int = 1
) -> list[MicroBatch]:
    """Split a batch into micro-batches of ``micro_batch_size`` rows (the last may be short).

    This is the default ``process_batch_fn``. Data and metadata are cut at the same row
    positions, so ``len(td_i) == len(meta_i)`` and ``meta_i`` names exactly the rows of
    ``td_i`` (10 rows by 4 give ``[4, 4, 2]`` for both). Jagged nested tensors and
    ``NonTensorStack`` columns are sliced along the batch dimension like dense ones. A batch
    of 0 rows (a rank's empty share of a global batch, see ``dp_size``) gives exactly one
    micro-batch of 0 rows, so ranks that all_reduce per micro-batch stay in step.

    Args:
        td: the batch, ``batch_size=[len(meta)]``.
        meta: the batch's metadata.
        micro_batch_size: rows per micro-batch (positive).

    Returns:
        A list of ``(TensorDict, BatchMeta)`` pairs, in row order.

    Raises:
        InvalidRequestError: ``micro_batch_size`` is not positive, or ``td`` and ``meta``
            disagree on the number of rows.
    """
    micro_batch_size = positive_int("micro_batch_size", micro_batch_size)
    n = len(meta)
    rows = td.batch_size[0] if len(td.batch_size) else None
    if rows != n:
        raise InvalidRequestError(
            f"the batch has {rows} rows of data but its BatchMeta has {n}; a fetch_batch_fn "
            "must return data and metadata of the same rows"
        )
    if micro_batch_size >= n:
        return [(td, meta)]  # one micro-batch: the batch itself (nothing to cut)
    bounds = [(start, min(start + micro_batch_size, n)) for start in range(0, n, micro_batch_size)]
    return list(zip(_split_rows(td, bounds), meta.chunk_every(micro_batch_size), strict=True))


def _split_rows(td: TensorDictBase, bounds: list[tuple[int, int]]) -> list[TensorDictBase]:
    """Rows ``[a, b)`` of a flat batch for each bound, cut column by column.

    ``TensorDict.__getitem__`` costs ~0.7 ms per jagged column and micro-batch (measured:
    3.3 ms to cut a 16-row batch with 3 jagged columns into 4); here a jagged column's values
    and offsets are read once and each piece re-wraps a window of them (no copy), and dense
    columns are plain views.
    """
    if td.batch_dims != 1:
        return [td[a:b] for a, b in bounds]
    columns: list[tuple[str, str, Any, Any]] = []
    for key in td.keys():  # noqa: SIM118 - TensorDict keys()
        value = td.get(key)
        if isinstance(value, torch.Tensor) and value.is_nested:
            if value.layout == torch.strided:  # no slicing op: cut its list of rows
                columns.append((key, "strided", list(value.unbind()), None))
                continue
            holes = getattr(value, "_lengths", None) is not None
            if value.layout != torch.jagged or holes or getattr(value, "_ragged_idx", 1) != 1:
                return [td[a:b] for a, b in bounds]
            offsets = value.offsets()  # type: ignore[attr-defined]
            columns.append((key, "jagged", value.values(), (offsets, offsets.tolist())))
        elif isinstance(value, (torch.Tensor, NonTensorStack)):
            columns.append((key, "plain", value, None))
        else:
            return [td[a:b] for a, b in bounds]
    # every piece is CPU tensors of its rows when every column is (checked once, not per piece)
    cpu_tensors = all(
        kind != "strided" and isinstance(data, torch.Tensor) and data.device.type == "cpu"
        for _, kind, data, _ in columns
    )
    pieces = []
    for a, b in bounds:
        out: dict[str, Any] = {}
        windows = RowWindows(a, b)
        for key, kind, data, offsets in columns:
            if kind == "strided":
                with warnings.catch_warnings():  # torch: "strided nested tensors: prototype"
                    warnings.filterwarnings("ignore", "The PyTorch API of nested tensors")
                    out[key] = torch.nested.as_nested_tensor(data[a:b], layout=torch.strided)
            elif kind == "jagged":
                out[key] = windows.cut(data, *offsets)
            else:
                out[key] = data[a:b]
        pieces.append(tensordict_of(out, b - a, cpu_tensors=cpu_tensors))
    return pieces


@dataclass(slots=True)
class _Fetched:
    """A batch ready to be delivered (producer -> consumer)."""

    batch_index: int
    data: TensorDictBase
    meta: BatchMeta
    micro_batches: list[MicroBatch]


@dataclass(frozen=True)
class BatchSlice:
    """The rest of one batch, micro-batches from ``first_micro`` on (`next_batch`).

    What the torch adapter's DataLoader workers hand the loader (it pickles: no slots).
    ``hold``: the batch's auto-clear hold (a `BatchMeta` of no rows naming its lease), which
    whoever delivers the last micro-batch acknowledges; None when there is none.
    """

    batch_index: int
    first_micro: int
    micro_batches: list[MicroBatch]
    hold: BatchMeta | None = None

    def pin_memory(self) -> BatchSlice:
        """Pinned copies of the data (a DataLoader with ``pin_memory=True`` calls this)."""
        pinned = [(td.pin_memory(), meta) for td, meta in self.micro_batches]
        return BatchSlice(self.batch_index, self.first_micro, pinned, self.hold)

    def __reduce__(self) -> tuple[Any, ...]:
        # From a DataLoader worker to the loader: torch would move every tensor to shared
        # memory of its own and pass its file descriptor, per tensor (half a millisecond and
        # more on a VM, on both sides; a jagged field is two tensors). Plain batches travel in
        # one buffer instead: bytes inside the pickle up to _INLINE_PICKLE_BYTES, one
        # shared-memory tensor beyond (tq_async._datasets._handoff).
        packed = pack(self.micro_batches, _INLINE_PICKLE_BYTES)
        if packed is None:
            args = (self.batch_index, self.first_micro, self.micro_batches, self.hold)
            return (BatchSlice, args)
        return (_unpacked_slice, (self.batch_index, self.first_micro, *packed, self.hold))


#: a BatchSlice whose tensors take at most this many bytes pickles them as bytes (see
#: BatchSlice.__reduce__); a larger one goes as one shared-memory tensor
_INLINE_PICKLE_BYTES = 1 << 20


def _unpacked_slice(
    batch_index: int, first_micro: int, buffer: Any, packed: Any, hold: BatchMeta | None = None
) -> BatchSlice:
    """A `BatchSlice` from what `BatchSlice.__reduce__` packed."""
    return BatchSlice(batch_index, first_micro, unpack(buffer, packed), hold)


def _micro_batches(
    td: TensorDictBase, meta: BatchMeta, process_fn: ProcessBatchFn, micro_batch_size: int
) -> list[MicroBatch]:
    """A fetched batch cut by ``process_fn`` (an empty one: one micro-batch of 0 rows)."""
    if meta.is_empty:
        # exactly one micro-batch, whatever process_batch_fn would make of 0 rows: the
        # step count must not depend on which rank got the empty share
        if td.batch_size[:1] != (0,):
            raise InvalidRequestError(
                f"fetch_batch_fn returned {td.batch_size[0] if td.batch_size else 'no'} "
                "rows of data for a BatchMeta of 0 rows; data and metadata must name "
                "the same rows"
            )
        return [(td, meta)]
    parts = list(process_fn(td, meta, micro_batch_size=micro_batch_size))
    for part in parts:
        if not (isinstance(part, tuple) and len(part) == 2):
            raise InvalidRequestError(
                "process_batch_fn must return a list of (TensorDict, BatchMeta) pairs, "
                f"got an item of type {type(part).__name__}"
            )
    return parts


class AsyncStreamingDataset:
    """Micro-batches of one task, streamed from a partition in ``batch_index`` order.

    Use it as an async context manager and iterate inside:

        ds = tq.AsyncStreamingDataset(address, data_fields=["input_ids"], batch_size=64,
                                      micro_batch_size=16, partition_id="train@0",
                                      task_name="update_actor", dp_rank=rank)
        async with ds:
            for epoch in range(ppo_epochs):
                async for td, meta in ds:
                    ...
                ds.reset()

    Every rank of one data-parallel group (same ``dp_rank``) receives identical batches;
    different ``dp_rank`` values receive disjoint rows.

    **Collectives.** Give ``dp_size`` when the ranks run collectives (``all_reduce``) every
    step: then batch ``b`` is decided for all ``dp_size`` ranks at once and every rank gets
    the same number of batches, ending together. With ``tail="uneven"`` (the default unless
    the sampler was built with its own tail policy) the last global batch is shared out as it
    is: a rank may get a short batch or an **empty
    batch** (0 rows, ``meta.end_of_stream`` False), delivered as one micro-batch of 0 rows
    (``process_batch_fn`` is not called for it). Run your step anyway, with a zero
    contribution, so the collectives stay in step. ``tail="drop"`` consumes the rows that
    cannot be split evenly without delivering them (the controller warns and counts them);
    ``tail="error"`` makes such a tail an error. A sampler built for several ranks
    (``SeqlenBalancedSampler(dp_size=...)``) makes batches global without ``dp_size`` too, so
    empty batches can come then as well. The number of micro-batches per batch
    follows its rows, so a short batch may have fewer: run collectives once per batch (or use
    ``micro_batch_size=batch_size``).

    Args:
        address: the controller's address (the dataset opens and closes its own client), or
            a connected `AsyncClient` (left open).
        data_fields: fields every row must have; they are read into each micro-batch.
        batch_size: rows per batch (one ``get_meta`` per batch).
        micro_batch_size: rows per micro-batch, passed to ``process_batch_fn``.
        partition_id: the partition to read (it need not exist yet).
        task_name: the consuming task.
        dp_rank: the data-parallel rank; ranks sharing it get the same batches.
        prefetch: batches fetched ahead of the one being delivered (0: fetch on demand).
        replay_window: batches kept in memory for `reset` (the highest batch
            indexes); older ones are re-read from storage.
        stop_when_consumed: also end the stream once the partition holds at least one row
            and the task has consumed every row it holds (the controller decides, and wakes
            waiting requests when another consumer of the task takes the last row). Without
            it the stream ends only when the partition is sealed and drained.
        sampling_config: extra sampler context; ``dp_rank`` and ``batch_index`` are added.
        fetch_batch_fn: replaces `default_fetch_batch_fn` (same keyword arguments,
            same contract); it may be ``async def``.
        process_batch_fn: replaces `chunk_batch_fn`:
            ``process_batch_fn(td, meta, micro_batch_size=...) -> list[(td, meta)]``. It must
            be deterministic (replay and resume re-run it on the same rows and skip the
            micro-batches already delivered).
        request_timeout: passed to the client the dataset opens from an address.
        dp_size: the number of data-parallel ranks reading the task (``dp_rank`` in
            ``0..dp_size-1``): every rank gets the same number of batches (see above). None
            (the default): each rank reads on its own, and ranks may end at different
            batch indexes.
        tail: with ``dp_size``, what the last global batch does when it cannot be split
            evenly: ``"uneven"`` (short or empty batches, nothing lost), ``"drop"`` or
            ``"error"``. None (the default) sends none: the sampler's own policy applies
            (e.g. ``SeqlenBalancedSampler(tail=...)``), else ``"uneven"``.
        device: deliver tensor fields on this device (e.g. ``"cuda:0"``): each batch is
            copied through pinned memory in the prefetching task, so the copy of the next
            batch overlaps the work on the current one. None: host memory. Without a replay
            window, columns a unit on this host keeps in its device arena come device to
            device instead (``docs/deployment.md``, "GPU to GPU on one host").

    Raises:
        InvalidRequestError: an argument is invalid.

    Iterating yields ``(TensorDict, BatchMeta)`` micro-batches; iterate from one task at a
    time. Errors of a fetch are raised by the iteration at the position they happened;
    iterating again retries that batch. `reset`, `step` and
    `load_state_dict` may be called between or during iterations, from the event
    loop's thread; a running ``async for`` continues from the new position. Treat delivered
    tensors as read-only: batches in the replay window are handed out again as they are.

    The constructor's arguments are readable as attributes of the same names
    (``batch_size``, ``task_name``, ...); change them by building a new dataset.
    """

    def __init__(
        self,
        address: str | AsyncClient,
        data_fields: Sequence[str],
        batch_size: int,
        micro_batch_size: int,
        partition_id: str,
        task_name: str,
        dp_rank: int = 0,
        prefetch: int = 2,
        replay_window: int = _DEFAULT_REPLAY_WINDOW,
        stop_when_consumed: bool = False,
        sampling_config: Mapping[str, Any] | None = None,
        fetch_batch_fn: FetchBatchFn | None = None,
        process_batch_fn: ProcessBatchFn | None = None,
        *,
        request_timeout: float = 60.0,
        dp_size: int | None = None,
        tail: str | None = None,
        device: Any = None,
    ) -> None:
        self.device = check_device(device)
        data_fields = field_list(data_fields)
        config, dp_size, tail = check_args(
            address,
            data_fields,
            dp_rank,
            sampling_config,
            dp_size,
            tail,
            fetch_batch_fn,
            process_batch_fn,
        )
        self.address = address
        self.request_timeout = check_seconds("request_timeout", request_timeout, optional=False)
        self.data_fields: list[str] = list(data_fields)
        self.batch_size = positive_int("batch_size", batch_size)
        self.micro_batch_size = positive_int("micro_batch_size", micro_batch_size)
        self._partition_id = checked_name("partition_id", partition_id)
        self.task_name = checked_name("task_name", task_name)
        self.dp_rank = positive_int("dp_rank", dp_rank, zero=True)
        self.dp_size = dp_size
        self.tail = tail
        self.prefetch = positive_int("prefetch", prefetch, zero=True)
        self.replay_window = positive_int("replay_window", replay_window, zero=True)
        self.stop_when_consumed = bool(stop_when_consumed)
        self.sampling_config = config
        self.fetch_batch_fn: FetchBatchFn = fetch_batch_fn or default_fetch_batch_fn
        self.process_batch_fn: ProcessBatchFn = process_batch_fn or chunk_batch_fn

        # Position: the next micro-batch to deliver. Only delivery moves it forward.
        self._next_index = 0
        self._next_micro = 0
        # The torch adapter gives DataLoader worker w of W the indexes w, w + W, ...
        self._offset = 0
        self._stride = 1
        #: every batch index below this one is known to be recorded (used when stride > 1)
        self._known_recorded = 0
        #: bumped by reset/step/load_state_dict; a producer of an older generation is stale
        self._generation = 0
        #: batch_index -> (data, meta) of the most recent ``replay_window`` batch indexes
        self._cache: dict[int, tuple[TensorDictBase, BatchMeta]] = {}
        #: batch_index -> (data, meta) of batches ``next_batch(ahead=)`` took, until read
        self._taken: dict[int, tuple[TensorDictBase, BatchMeta]] = {}
        #: the batch whose micro-batches are being delivered
        self._current: _Fetched | None = None
        #: auto-clear holds of delivered batches, to acknowledge (the default fetch keeps
        #: them: a batch read ahead is acknowledged once delivered)
        self._holds = Holds()
        #: False: what `next_batch` returns is not delivered yet; its reader acknowledges it
        #: (`acknowledge_delivered`, or the torch adapter's loader in the main process)
        self._ack_on_delivery = True

        self._stack: AsyncExitStack | None = None
        self._tg: TaskGroup | None = None
        self._client: AsyncClient | None = None
        #: batches fetched ahead by a task of ``_tg`` (with ``prefetch``)
        self._prefetcher = Prefetcher(self.prefetch, self._load, self._position)

    # ---- public state ------------------------------------------------------------------------

    @property
    def partition_id(self) -> str:
        """The partition being read (changed by `step`)."""
        return self._partition_id

    @property
    def batch_index(self) -> int:
        """The ``batch_index`` of the next micro-batch to be delivered."""
        return self._next_index

    @property
    def micro_batch_index(self) -> int:
        """Micro-batches of `batch_index` already delivered."""
        return self._next_micro

    @property
    def cached_batches(self) -> int:
        """How many batches the replay window holds in memory (at most ``replay_window``)."""
        return len(self._cache)

    @property
    def cached_batch_indexes(self) -> list[int]:
        """The batch indexes held in memory for replay, ascending."""
        return sorted(self._cache)

    def reset(self) -> None:
        """Replay from ``batch_index`` 0 of the current partition.

        Batches still in the replay window come from memory; older ones are re-read from
        storage by their ``batch_index`` and are the same rows. Batches fetched ahead are
        dropped from the prefetch queue (they stay recorded and are read again in turn).
        """
        self._move(self._partition_id, self._offset, 0)

    def step(self, partition_id: str) -> None:
        """Move to another partition (e.g. the next training step), at ``batch_index`` 0.

        The replay window is emptied.

        Args:
            partition_id: the partition to read from now on.

        Raises:
            InvalidRequestError: ``partition_id`` is not a non-empty string.
        """
        self._move(checked_name("partition_id", partition_id), self._offset, 0)

    def state_dict(self) -> dict[str, Any]:
        """Where the dataset is: a plain dict (msgpack- and JSON-able) for checkpoints.

        Returns:
            ``{"version", "partition_id", "task_name", "dp_rank", "dp_size", "batch_index",
            "micro_batch_index", "micro_batch_size"}``: the next micro-batch to deliver (an
            empty batch counts as one micro-batch).
        """
        return {
            "version": 1,
            "partition_id": self._partition_id,
            "task_name": self.task_name,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "batch_index": self._next_index,
            "micro_batch_index": self._next_micro,
            "micro_batch_size": self.micro_batch_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the position a `state_dict` recorded.

        The batch at ``batch_index`` is re-read by its index (the same rows) and its first
        ``micro_batch_index`` micro-batches are skipped. The replay window is kept when the
        partition is unchanged.

        Args:
            state: what `state_dict` returned (possibly in another process).

        Raises:
            InvalidRequestError: ``state`` is malformed or was saved for another task,
                ``dp_rank`` (whose recorded batches are different rows) or ``dp_size``, or
                mid-batch with another ``micro_batch_size``.
        """
        mine = (self.task_name, self.dp_rank, self.dp_size, self.micro_batch_size)
        partition_id, index, micro = parse_state(state, *mine)
        self._move(partition_id, index, micro)

    def _move(self, partition_id: str, index: int, micro: int) -> None:
        if partition_id != self._partition_id:
            self._cache.clear()
        self._partition_id = partition_id
        self._next_index = index
        self._next_micro = micro
        self._known_recorded = 0
        self._current = None
        self._taken.clear()  # recorded: read again by their indexes
        self._generation += 1
        self._prefetcher.drop()

    def set_worker(self, worker_id: int, num_workers: int) -> None:
        """Read only batch indexes ``worker_id, worker_id + num_workers, ...`` from here on.

        For the torch adapter: DataLoader worker ``worker_id`` of ``num_workers``.
        """
        position = self._next_index
        self._offset = worker_id
        self._stride = num_workers
        if worker_id:
            self._move(self._partition_id, position + worker_id, 0)
        self._known_recorded = position  # everything below the position was delivered

    # ---- context -----------------------------------------------------------------------------

    @property
    def entered(self) -> bool:
        """Whether the dataset is inside its ``async with`` (one at a time)."""
        return self._stack is not None

    async def __aenter__(self) -> AsyncStreamingDataset:
        """Open the client (if given an address) and the task group that prefetches.

        Raises:
            InvalidRequestError: the dataset is already entered.
            TQTimeoutError: the controller did not answer.

        Cancellation: whatever was opened is closed again.
        """
        if self._stack is not None:
            raise InvalidRequestError(
                "this AsyncStreamingDataset is already entered; one `async with` at a time"
            )
        async with AsyncExitStack() as stack:
            if isinstance(self.address, str):
                client = AsyncClient(self.address, request_timeout=self.request_timeout)
                self._client = await stack.enter_async_context(client)
            else:
                if self.address.closed:
                    raise ClosedError(
                        "the AsyncClient given to the dataset is not connected; enter it with "
                        "`async with` before the dataset"
                    )
                self._client = self.address
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop prefetching and close the client the dataset opened.

        A batch fetched ahead but not delivered stays recorded under its ``batch_index``; the
        position is where delivery stopped, so the next iteration (or a dataset resumed from
        `state_dict`) re-reads it. Cancellation: the same, the undo is not interrupted.
        """
        stack, self._stack = self._stack, None
        if stack is None:
            return
        self._prefetcher.drop()
        self._current = None
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
        await self._holds.flush_on_leaving(self._client, **self.state_dict())
        try:
            # The body's exception is the caller's, not the task group's: passing it on
            # would come back wrapped in an ExceptionGroup. It propagates unchanged.
            await stack.aclose()
        finally:
            self._tg = None
            self._client = None

    # ---- iteration ---------------------------------------------------------------------------

    def __aiter__(self) -> AsyncStreamingDataset:
        return self

    async def __anext__(self) -> MicroBatch:
        """The next micro-batch, as ``(TensorDict, BatchMeta)``.

        Raises:
            StopAsyncIteration: end of stream (sealed and drained, or everything consumed
                with ``stop_when_consumed``); after `reset` or `step`, or once
                more rows can arrive, iterating again continues.
            ClosedError: the dataset is not entered with ``async with``.
            TQError: fetching failed (iterating again retries the same batch).

        Cancellation: the position does not move; the next call returns the same
        micro-batch (prefetching carries on in the background).
        """
        while True:
            cur = self._current
            if cur is not None:
                m = self._next_micro
                if m < len(cur.micro_batches):
                    self._deliver(cur, m + 1)
                    return cur.micro_batches[m]
                self._deliver(cur, len(cur.micro_batches))  # empty batch: move on
                continue
            fetched = await self._next_fetched()
            if fetched is None:
                raise StopAsyncIteration
            self._current = fetched

    async def next_batch(self, *, wait: bool | float = True, ahead: int = 0) -> BatchSlice | None:
        """The undelivered rest of the next batch, as a whole; None at the end of the stream.

        Delivering a whole batch per call keeps a DataLoader's round-robin over workers in
        ``batch_index`` order whatever the number of micro-batches per batch.

        With ``wait=False`` a batch that cannot be decided at once is not waited for:
        `TQTimeoutError`, nothing consumed and the position unchanged (batches below
        it that it decided stay recorded); ``wait=seconds`` waits that long at most. With
        ``ahead=n`` the request that fetches the batch also takes up to ``n`` of the
        following ones that can be decided at once (`get_batches`); the next calls deliver
        them without asking (a move, `reset` or `step`, drops them: they stay recorded and
        are read again by their indexes). Both need ``prefetch=0`` and the default
        ``fetch_batch_fn``.

        Raises:
            InvalidRequestError: ``wait`` other than True, or ``ahead``, with ``prefetch`` or
                a custom fetch; ``ahead`` not an int in 0..64; ``wait`` not a bool or
                positive seconds.
            TQTimeoutError: ``wait`` is not True and the batch is not ready in time.
        """
        if (wait is not True or ahead) and (self.prefetch or not self._default_fetch):
            raise InvalidRequestError(
                "next_batch(wait=False or seconds) and next_batch(ahead=) need prefetch=0 and "
                "the default fetch_batch_fn (a custom one may not honour its timeout)"
            )
        ahead = check_int("ahead", ahead, 0, MAX_ALSO)
        timeout = None if wait is True else 0 if wait is False else check_seconds("wait", wait)
        cur = self._current
        if cur is None:
            cur = await self._next_fetched(timeout, ahead)
            if cur is None:
                return None
        first = self._next_micro
        self._deliver(cur, len(cur.micro_batches))
        # (without _ack_on_delivery its caller acknowledges it, having delivered it all)
        hold = None if self._ack_on_delivery or not self._default_fetch else hold_of(cur.meta)
        return BatchSlice(cur.batch_index, first, cur.micro_batches[first:], hold)

    def acknowledge_delivered(self, meta: BatchMeta) -> None:
        """Every row of ``meta``'s batch reached the caller: its auto-clear hold is
        acknowledged with the next fetch (or at the end of the stream, or on leaving).

        For the torch adapter, which delivers what `next_batch` returned itself (its
        `BatchSlice.hold`).
        """
        if self._default_fetch:
            self._holds.delivered(meta)

    @property
    def _default_fetch(self) -> bool:
        """Whether the fetch is `default_fetch_batch_fn` (or a wrapper of it, `default_like`):
        it honours ``timeout=0``, and leaves an auto-clear task's holds for the dataset to
        acknowledge (a custom one acknowledges as it reads)."""
        return default_like(self.fetch_batch_fn)

    def _deliver(self, cur: _Fetched, delivered: int) -> None:
        """``delivered`` micro-batches of ``cur`` are now with the caller."""
        if delivered >= len(cur.micro_batches):
            if self._ack_on_delivery:
                self.acknowledge_delivered(cur.meta)
            self._next_index = cur.batch_index + self._stride
            self._next_micro = 0
            self._current = None
        else:
            self._current = cur
            self._next_micro = delivered

    async def _next_fetched(self, timeout: float | None = None, ahead: int = 0) -> _Fetched | None:
        """The batch at the position, from the prefetcher (or fetched now, waiting at most
        ``timeout``, taking up to ``ahead`` following ones); None at end."""
        if self._tg is None or self._client is None:
            raise ClosedError(
                "iterate an AsyncStreamingDataset inside `async with dataset:` (it owns the "
                "client and the prefetching task)"
            )
        if self.prefetch == 0:
            fetched = await self._load(self._next_index, self._generation, timeout, ahead)
        else:
            fetched = await self._prefetcher.next(self._tg)
        if fetched is None:
            await self._holds.flush(self._client)
        return fetched

    def _position(self) -> tuple[int, int, int]:
        """``(batch_index, generation, stride)`` of the position, for the prefetcher."""
        return self._next_index, self._generation, self._stride

    # ---- fetching ----------------------------------------------------------------------------

    async def _load(
        self, index: int, generation: int, timeout: float | None = None, ahead: int = 0
    ) -> _Fetched | None:
        """Batch ``index`` from the replay window, the batches taken ahead, or the services
        (taking up to ``ahead`` following ones); None at end."""
        cached = self._cache.get(index)
        moved = False
        if cached is None:
            got = self._taken.pop(index, None)
            if got is None:
                got = await self._fetch(index, timeout, ahead)
                if got is None:
                    return None
            moved = self._fetches_onto_device
            if generation == self._generation:
                self._remember(index, got)
            fetched = got
        else:
            fetched = cached
        td, meta = fetched
        if not moved:
            # on the device here, in the prefetching task: overlapped with the caller's work
            td = await to_device(td, self.device)
        micro = _micro_batches(td, meta, self.process_batch_fn, self.micro_batch_size)
        return _Fetched(index, td, meta, micro)

    def _remember(self, index: int, batch: tuple[TensorDictBase, BatchMeta]) -> None:
        """Keep the ``replay_window`` highest batch indexes.

        Re-reads of older batches during a replay are not cached, so one replay pass does
        not evict the batches the next pass will find in memory.
        """
        if self.replay_window == 0:
            return
        if index not in self._cache and len(self._cache) >= self.replay_window:
            lowest = min(self._cache)
            if index < lowest:
                return
            del self._cache[lowest]
        self._cache[index] = batch

    async def _fetch(
        self, index: int, timeout: float | None = None, ahead: int = 0
    ) -> tuple[TensorDictBase, BatchMeta] | None:
        config = {**self.sampling_config, "dp_rank": self.dp_rank, "batch_index": index}
        if self.dp_size is not None:
            config["dp_size"] = self.dp_size
        if self.tail is not None:
            config["tail"] = self.tail
        if self._stride > 1 and self._default_fetch:
            # Several DataLoader workers share the index space. The controller records the
            # other workers' indexes below ours first, in the same call (``record_from``), so
            # the recorded indexes of (task, dp_rank) stay a gap-free prefix: otherwise, at
            # the sealed tail, batch k+1 could take the last rows while batch k ends the
            # stream, and a replay with fewer workers would stop before k+1.
            config["record_from"] = self._known_recorded
        if ahead:
            also = [index + self._stride * i for i in range(1, ahead + 1)]
            first, *more = await self._call_fetch_ahead(config, also, timeout)
            got = self._checked(first, index)
            for j, batch in zip(also, more, strict=False):
                taken = self._checked(batch, j)
                if got is None or taken is None:
                    break  # (the controller sends no batch past the end)
                self._taken[j] = taken
                self._known_recorded = max(self._known_recorded, j + 1)
        else:
            got = self._checked(await self._call_fetch(index, config, timeout), index)
        if got is not None:
            self._known_recorded = max(self._known_recorded, index + 1)
        return got

    async def _call_fetch_ahead(
        self, config: dict[str, Any], also: list[int], timeout: float | None
    ) -> list[tuple[TensorDict, BatchMeta]]:
        """The default fetch of ``config``'s batch, with the batches of ``also`` that can be
        decided at once, in one request."""
        assert self._client is not None
        extra = self._default_fetch_extras()
        # a wrapper of the default fetch may read what get cannot (compat's: rows ragged in
        # several dimensions): on a SchemaError, the batch alone through it (the rest stay
        # recorded, read by their indexes)
        wrapped = (SchemaError,) if self.fetch_batch_fn is not default_fetch_batch_fn else ()
        try:
            got = await self._client.get_batches(
                list(self.data_fields),
                self.batch_size,
                self._partition_id,
                self.task_name,
                config,
                also=also,
                timeout=timeout,
                stop_when_consumed=self.stop_when_consumed,
                **extra,
            )
        except wrapped:
            return [await self._call_fetch(config["batch_index"], config, timeout)]
        self._holds.sent(extra)
        return got

    @property
    def _fetches_onto_device(self) -> bool:
        """Whether a fetch reads onto `device` itself (device to device from a unit's
        device arena): with the default ``fetch_batch_fn`` (a custom one gets the arguments
        it always got) and no replay window (whose batches stay in host memory)."""
        return self._default_fetch and self.device is not None and not self.replay_window

    def _default_fetch_extras(self) -> dict[str, Any]:
        """The arguments only the default fetch gets: the device it reads onto, and the
        auto-clear holds it keeps (a batch is acknowledged once delivered, with the next
        fetch: a batch read ahead and never delivered keeps its rows for its next reader)."""
        if not self._default_fetch:
            return {}
        extra = self._holds.fetch_args()
        if self._fetches_onto_device:
            extra["device"] = self.device
        return extra

    async def _call_fetch(self, index: int, config: dict[str, Any], timeout: float | None) -> Any:
        assert self._client is not None
        extra = self._default_fetch_extras()
        result: Any = self.fetch_batch_fn(
            client=self._client,
            data_fields=list(self.data_fields),
            batch_size=self.batch_size,
            partition_id=self._partition_id,
            task_name=self.task_name,
            sampling_config=config,
            batch_index=index,
            timeout=timeout,
            stop_when_consumed=self.stop_when_consumed,
            **extra,
        )
        if inspect.isawaitable(result):
            result = await result
        self._holds.sent(extra)
        return result

    def _checked(self, got: Any, index: int) -> tuple[TensorDictBase, BatchMeta] | None:
        if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], BatchMeta)):
            raise InvalidRequestError(
                f"fetch_batch_fn must return (TensorDict, BatchMeta), got {type(got).__name__}"
            )
        td, meta = got
        if meta.end_of_stream:
            return None
        if meta.is_empty and (self.dp_size is not None or meta.batch_index == index):
            # this rank's share of a global batch is empty: delivered, so ranks stay in step
            # (a sampler built for several ranks makes batches global without dp_size too)
            td = TensorDict({}, batch_size=[0]) if td is None else td
        elif meta.is_empty or td is None:
            raise TQError(
                f"fetch_batch_fn returned an empty batch for batch_index {index} of partition "
                f"{self._partition_id!r} without end_of_stream; it must wait for rows "
                "(get_meta waits when timeout is None) or return the end-of-stream BatchMeta"
            )
        if not isinstance(td, TensorDictBase):
            raise InvalidRequestError(
                f"fetch_batch_fn must return a TensorDict as data, got {type(td).__name__}"
            )
        return td, meta
