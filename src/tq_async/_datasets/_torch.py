"""PyTorch adapter: ``StreamingDataset`` (an ``IterableDataset``) and ``StreamingDataLoader``.

There is one implementation, `AsyncStreamingDataset`; this module drives it
in the iterating thread itself, over the blocking `Client` (its I/O in the
calling thread): a private event loop, run only while a batch is asked for, hosts the
dataset, and its client calls block that thread instead of suspending. No portal thread, no
hand-off: nothing of tq_async runs in the background, so a process that forks (DataLoader
workers) never forks in the middle of it. A ``StreamingDataset`` stores only its address and
arguments: the loop, the client and its sockets are created inside whichever process iterates
it, so it pickles for ``spawn`` workers and is safe to ``fork``. It fetches when asked
(``prefetch`` applies to `AsyncStreamingDataset`): DataLoader workers run
ahead of the consumer by the loader's ``prefetch_factor``.

Ordering with ``num_workers=W``: worker ``w`` takes batch indexes ``w, w + W, ...`` and yields
whole batches (each with its micro-batches), never micro-batches: yielding micro-batches
would break the order as soon as two batches have different numbers of them, e.g. a short
last batch. A loader fetches ``num_workers x prefetch_factor`` batches ahead, as any
DataLoader, and no more (every batch fetched has its rows consumed for the task: ranks sharing
the task's rows would find fewer); within that, each worker hands over its
``prefetch_factor`` batches in one item (torch is asked for one item per worker at a time):
the batch it waited for and its next ones that are ready at once (a worker never waits to
fill an item), within 1 MiB, since every item costs both processes a queue round trip and
wake-ups. They come in one request (``next_batch(ahead=)``, ``get_batches``): the controller
adds to the asked batch those it can decide at once; one that was not ready then is asked for
again with ``timeout=0``. The `StreamingDataLoader` keeps the batches it
receives ahead of the next ``batch_index`` (at most an item per worker) and yields
micro-batches strictly in ``batch_index`` order. Workers share one index space without gaps:
each fetch asks the controller to decide the lower indexes not decided yet first, in the
same request (``record_from``). A worker's last item says where its stream ended, and the
pass ends at the lowest such index: with ``stop_when_consumed``, rows that came after one
worker met the end may let another go on, deciding the batch the first never sent; those
batches stay recorded and the next pass reads them.

State lives in the main process. The loader moves the dataset's position as it hands out each
micro-batch; workers receive the position when they start (a DataLoader without persistent
workers starts new ones for every ``iter(loader)``, forked or pickled from the dataset as it
is at that moment). That is how `StreamingDataLoader.reset`, `step`
and `load_state_dict` reach the workers, and why persistent workers
are refused. An auto-clear task's batches are acknowledged where they are delivered too: the
workers keep their holds, and the loader acknowledges each batch once it handed out its last
micro-batch (over a client of its own), so a batch fetched ahead and never delivered keeps
its rows for the next reader of its ``batch_index``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import weakref
from collections.abc import Awaitable, Callable, Generator, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .._client._sync._client import Client
from .._errors import (
    ClosedError,
    InvalidRequestError,
    TQError,
    TQTimeoutError,
    UnsupportedTypeError,
)
from .._logging import get_logger
from .._portal import allow_blocking, check_blocking_allowed
from .._wire._checks import integral
from ._args import parse_state
from ._async import (
    AsyncStreamingDataset,
    BatchSlice,
    FetchBatchFn,
    MicroBatch,
    ProcessBatchFn,
    default_fetch_batch_fn,
    default_like,
)
from ._holds import LoaderAcks

__all__ = ["StreamingDataset", "StreamingDataLoader"]

log = get_logger(__name__)

R = TypeVar("R")

#: what async code iterates instead of a StreamingDataset / StreamingDataLoader
_ASYNC_DATASET = "`async with tq.AsyncStreamingDataset(...) as ds: async for td, meta in ds`"


def _identity(item: Any) -> Any:
    """The loader's collate function: items are already batches."""
    return item


class StreamingDataset(IterableDataset[MicroBatch]):
    """A ``torch.utils.data.IterableDataset`` over `AsyncStreamingDataset`.

    Iterating it directly yields ``(TensorDict, BatchMeta)`` micro-batches in ``batch_index``
    order. Read it through `StreamingDataLoader`, which keeps the order with any number
    of workers and tracks the position; a plain ``DataLoader`` needs ``batch_size=None`` and
    an identity ``collate_fn`` (its default one cannot convert a ``BatchMeta``) and is refused
    with more than one worker.

    The arguments are those of `AsyncStreamingDataset`, except that
    ``address`` must be the controller's address (a string): each process that iterates the
    dataset opens its own client. They are readable as attributes of the same names, as
    there. ``fetch_batch_fn`` and ``process_batch_fn`` run in the iterating thread
    (``fetch_batch_fn`` is awaited and receives the blocking client's `AsyncClient`-shaped
    view: the same coroutine methods, which do their I/O without suspending), and must be
    importable module-level functions when DataLoader workers are spawned.

    In the process that iterates without workers, the replay window survives between passes;
    DataLoader workers are new processes every pass, so their replays re-read from storage.

    With ``dp_size`` every data-parallel rank gets the same number of batches, and a rank
    may get an **empty batch** (0 rows) at the tail: it comes as one micro-batch of 0 rows.
    Run your step anyway so collectives stay in step (see
    `AsyncStreamingDataset` for ``dp_size`` and ``tail``).

    ``device`` (e.g. ``"cuda:0"``) delivers tensors on that device, copied in the prefetching
    task; use it without DataLoader workers (CUDA does not survive a fork: with workers, pass
    ``pin_memory=True`` to the loader and move the batch in the main process).

    Raises:
        InvalidRequestError: an argument is invalid.
    """

    def __init__(
        self,
        address: str,
        data_fields: Sequence[str],
        batch_size: int,
        micro_batch_size: int,
        partition_id: str,
        task_name: str,
        dp_rank: int = 0,
        prefetch: int = 2,
        replay_window: int = 0,
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
        super().__init__()
        if not isinstance(address, str) or not address:
            raise InvalidRequestError(
                "StreamingDataset needs the controller's address as a string (each worker "
                f"process opens its own client), got {type(address).__name__}"
            )
        self._kwargs: dict[str, Any] = {
            "address": address,
            "data_fields": list(data_fields) if not isinstance(data_fields, str) else data_fields,
            "batch_size": batch_size,
            "micro_batch_size": micro_batch_size,
            "partition_id": partition_id,
            "task_name": task_name,
            "dp_rank": dp_rank,
            "prefetch": prefetch,
            "replay_window": replay_window,
            "stop_when_consumed": stop_when_consumed,
            "sampling_config": dict(sampling_config) if sampling_config else None,
            "fetch_batch_fn": fetch_batch_fn,
            "process_batch_fn": process_batch_fn,
            "request_timeout": request_timeout,
            "dp_size": dp_size,
            "tail": tail,
            "device": device,
        }
        # Validates every argument (opens nothing: the client is created on entry).
        probe = AsyncStreamingDataset(**self._kwargs)
        # the arguments, readable under their names as on the async dataset
        self.address, self.data_fields = address, probe.data_fields
        self.batch_size, self.micro_batch_size = probe.batch_size, probe.micro_batch_size
        self.task_name, self.dp_rank, self.dp_size = probe.task_name, probe.dp_rank, probe.dp_size
        self.prefetch, self.replay_window = probe.prefetch, probe.replay_window
        self.stop_when_consumed = probe.stop_when_consumed
        self.sampling_config = probe.sampling_config
        self.fetch_batch_fn, self.process_batch_fn = probe.fetch_batch_fn, probe.process_batch_fn
        self.request_timeout, self.tail = probe.request_timeout, probe.tail
        self.device = probe.device
        self._state: dict[str, Any] = probe.state_dict()
        #: bumped by reset/step/load_state_dict (a running loader pass restarts its workers)
        self._generation = 0
        #: set by StreamingDataLoader: yield one item per batch (see the module docstring)
        self._whole_batches = False
        #: set by StreamingDataLoader: batches a worker hands over at most at once
        self._handoff_batches = 1
        self._local: AsyncStreamingDataset | None = None
        self._local_pid: int | None = None
        #: the pass over the position (this dataset's own iteration, or its loader's)
        self._pass: weakref.ref[_Pass[Any]] | None = None

    # ---- state (main process) ----------------------------------------------------------------

    @property
    def partition_id(self) -> str:
        """The partition being read."""
        return str(self._state["partition_id"])

    @property
    def batch_index(self) -> int:
        """The ``batch_index`` of the next micro-batch to be delivered."""
        return int(self._state["batch_index"])

    def reset(self) -> None:
        """Replay from ``batch_index`` 0 of the current partition (takes effect on next iter)."""
        self._set_position(self.partition_id, 0, 0)

    def step(self, partition_id: str) -> None:
        """Move to another partition at ``batch_index`` 0 (takes effect on next iter).

        Raises:
            InvalidRequestError: ``partition_id`` is not a non-empty string.
        """
        if not isinstance(partition_id, str) or not partition_id:
            raise InvalidRequestError(
                f"partition_id must be a non-empty string, got {partition_id!r}"
            )
        self._set_position(partition_id, 0, 0)

    def state_dict(self) -> dict[str, Any]:
        """The position of the next micro-batch, as a plain dict (see
        `AsyncStreamingDataset.state_dict`)."""
        return dict(self._state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a position `state_dict` recorded (takes effect on next iter).

        Raises:
            InvalidRequestError: ``state`` is malformed or belongs to another task/dp_rank,
                or was saved mid-batch with another ``micro_batch_size``.
        """
        kw = self._kwargs
        partition_id, index, micro = parse_state(
            state, kw["task_name"], kw["dp_rank"], kw["dp_size"], kw["micro_batch_size"]
        )
        self._set_position(partition_id, index, micro)

    def _set_position(self, partition_id: str, index: int, micro: int) -> None:
        self._state.update(partition_id=partition_id, batch_index=index, micro_batch_index=micro)
        self._generation += 1

    def _delivered(self, item: BatchSlice, count: int) -> None:
        """The first ``count`` micro-batches of ``item`` have been handed out."""
        if count >= len(item.micro_batches):
            self._state.update(batch_index=item.batch_index + 1, micro_batch_index=0)
        else:
            self._state.update(
                batch_index=item.batch_index, micro_batch_index=item.first_micro + count
            )

    # ---- pickling ----------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # The per-process dataset holds a loop-bound client and cached tensors: never shipped.
        state = self.__dict__.copy()
        state["_local"] = None
        state["_local_pid"] = None
        state["_pass"] = None
        return state

    def _new_pass(self, start: Callable[[], Iterator[R]]) -> _Pass[R]:
        """A pass over the position, started by ``start``; the one before, if still alive,
        ends first: both would move the one position, delivering batches twice."""
        before = self._pass() if self._pass is not None else None
        if before is not None:
            before.end()  # its workers or its client stop now
        current = _Pass(start())
        self._pass = weakref.ref(current)
        return current

    # ---- iteration ---------------------------------------------------------------------------

    def _local_dataset(self) -> AsyncStreamingDataset:
        # A dataset still entered (an abandoned pass not yet garbage-collected) is left alone.
        local = self._local
        if local is None or self._local_pid != os.getpid() or local.entered:
            client = Client(
                self._kwargs["address"], request_timeout=self._kwargs["request_timeout"]
            )
            # fetched when asked, in this thread: a prefetching task would block it too
            kwargs = {**self._kwargs, "address": _AsyncFace(client), "prefetch": 0}
            local = self._local = AsyncStreamingDataset(**kwargs)
            self._local_pid = os.getpid()
        return local

    def __iter__(self) -> Iterator[Any]:
        """Yield micro-batches (or, under `StreamingDataLoader`, one item per batch).

        Raises:
            InvalidRequestError: iterated by a plain DataLoader with several workers, in
                a DataLoader worker with a CUDA ``device``, on a thread whose event loop is
                running (async code uses `AsyncStreamingDataset`), or while another thread
                is inside a pass over it (one pass at a time: a new one ends the one before).
        """
        info = get_worker_info()
        device = self._kwargs["device"]
        if info is not None and device is not None and torch.device(device).type == "cuda":
            raise InvalidRequestError(
                "StreamingDataset(device='cuda...') in a DataLoader worker: CUDA does not "
                "survive a fork; leave device out, pass pin_memory=True to the loader, and "
                "move each batch to the GPU in the main process"
            )
        worker_id, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if num_workers > 1 and not self._whole_batches:
            raise InvalidRequestError(
                "a StreamingDataset read by several DataLoader workers must go through "
                "tq_async.StreamingDataLoader (it keeps batches in order and tracks the "
                "position); a plain DataLoader would interleave micro-batches"
            )
        if self._whole_batches:  # part of the StreamingDataLoader's pass
            return self._run(self._started(worker_id, num_workers))
        return self._new_pass(lambda: self._run(self._started(worker_id, num_workers)))

    def _started(self, worker_id: int, num_workers: int) -> AsyncStreamingDataset:
        """This process's dataset, at the position, reading worker ``worker_id``'s batches."""
        ads = self._local_dataset()
        ads.load_state_dict(self._state)
        ads.set_worker(worker_id, num_workers)
        # a batch is delivered when its last micro-batch is handed out here, or, under a
        # StreamingDataLoader, in the main process (which acknowledges it there)
        ads._ack_on_delivery = False
        return ads

    def _run(self, ads: AsyncStreamingDataset) -> Iterator[Any]:
        check_blocking_allowed("iterating a StreamingDataset / StreamingDataLoader", _ASYNC_DATASET)
        host = _InThread(ads)
        exc_info: tuple[Any, Any, Any] = (None, None, None)
        # a custom fetch_batch_fn may not honour "do not wait"
        default = default_like(self._kwargs["fetch_batch_fn"] or default_fetch_batch_fn)
        # a DataLoader worker hands over its prefetch_factor batches at once when they are
        # ready (see _ready_group)
        grouped = (
            self._whole_batches
            and self._handoff_batches > 1
            and get_worker_info() is not None
            and default
        )
        # the hand-off's batches come in one request when they are ready at once
        ahead = self._handoff_batches - 1 if grouped else 0
        # a DataLoader worker waits for rows in slices, and stops once the loader's process
        # is gone (blocked until rows come, it would outlive it, its request waiting)
        in_worker = get_worker_info() is not None and default
        loader = os.getppid() if in_worker else None
        try:
            while True:
                item = _next_batch(host, ads, ahead, loader)
                if item is None:
                    if self._whole_batches:  # the loader ends its pass at the first such end
                        yield _Group(end=ads.batch_index)
                    return
                if grouped:
                    group = _ready_group(host, ads, item, self._handoff_batches)
                    yield group
                    if group.end is not None:
                        return
                    continue
                if self._whole_batches:
                    yield item
                    continue
                generation = self._generation
                for i, micro_batch in enumerate(item.micro_batches):
                    self._delivered(item, i + 1)
                    if i + 1 == len(item.micro_batches) and item.hold is not None:
                        ads.acknowledge_delivered(item.hold)
                    yield micro_batch
                    if self._generation != generation:
                        break  # reset/step while iterating: continue from the new position
                if not item.micro_batches:
                    self._delivered(item, 0)
                    if item.hold is not None:
                        ads.acknowledge_delivered(item.hold)
                if self._generation != generation:
                    ads.load_state_dict(self._state)
        except BaseException:
            exc_info = sys.exc_info()
            raise
        finally:
            host.close(exc_info[1])


class StreamingDataLoader(DataLoader[MicroBatch]):
    """A ``torch.utils.data.DataLoader`` for a `StreamingDataset`.

    It yields ``(TensorDict, BatchMeta)`` micro-batches in ``batch_index`` order with any
    ``num_workers`` (worker ``w`` of ``W`` fetches batches ``w, w + W, ...``), fork or spawn,
    and forwards `reset`, `step`, `state_dict` and `load_state_dict`
    to the dataset. The position advances as micro-batches are handed out, so
    `state_dict` taken inside the loop resumes right after the last one received.

    Calling `reset`, `step` or `load_state_dict` inside the loop makes the
    running pass continue from the new position (its workers are replaced).

    A dataset built with ``dp_size`` gives every data-parallel rank the same number of
    batches with any ``num_workers``; a rank may receive a micro-batch of 0 rows (its empty
    share of the last global batch): run the step anyway so collectives stay in step.

    A worker that dies (SIGKILL, out of memory) ends the pass with torch's ``RuntimeError``
    ("DataLoader worker ... exited unexpectedly"). Nothing it fetched is lost: its batches
    are recorded under their ``batch_index`` (an auto-clear task's keep their rows held) and
    the position is where delivery stopped, so iterating the loader again, or a loader
    resumed from `state_dict` in a new process, reads them, every row once.

    One pass at a time: a new iterator ends the one before (its workers stop), which then
    raises `InvalidRequestError`; the new one goes on from the position.

    Args:
        dataset: the stream.
        num_workers: worker processes (0: fetch in this process, in the iterating thread).
        **kwargs: other ``DataLoader`` arguments (``multiprocessing_context``,
            ``prefetch_factor``, ``pin_memory``, ``timeout``, ``worker_init_fn``, ...).
            ``prefetch_factor`` (2 by default) is the batches each worker fetches ahead, as
            in torch; a worker hands them to the loader together (the loader's
            ``prefetch_factor`` attribute, torch's, reads 1).

    Raises:
        InvalidRequestError: ``dataset`` is not a `StreamingDataset`, or an argument
            would break batching or ordering (``batch_size``, ``collate_fn``, ``sampler``,
            ``batch_sampler``, ``shuffle``, ``drop_last``, ``in_order=False``,
            ``persistent_workers=True``, a ``prefetch_factor`` that is not a positive
            integer).
    """

    def __init__(self, dataset: StreamingDataset, num_workers: int = 0, **kwargs: Any) -> None:
        if not isinstance(dataset, StreamingDataset):
            raise InvalidRequestError(
                f"StreamingDataLoader needs a tq_async.StreamingDataset, got "
                f"{type(dataset).__name__}"
            )
        for name in ("batch_size", "collate_fn", "sampler", "batch_sampler", "shuffle"):
            if kwargs.get(name) is not None:
                raise InvalidRequestError(
                    f"StreamingDataLoader does not take {name}=: the dataset already batches "
                    "(set batch_size and micro_batch_size on the StreamingDataset)"
                )
            kwargs.pop(name, None)
        if kwargs.pop("drop_last", False):
            raise InvalidRequestError("StreamingDataLoader does not take drop_last=True")
        if not kwargs.pop("in_order", True):
            raise InvalidRequestError(
                "StreamingDataLoader needs in_order=True: batches are delivered in "
                "batch_index order"
            )
        if kwargs.get("persistent_workers"):
            raise InvalidRequestError(
                "StreamingDataLoader does not support persistent_workers=True: workers learn "
                "the position (reset/step/load_state_dict) when they start, so they must be "
                "started for every pass"
            )
        prefetch = integral(kwargs.get("prefetch_factor"))  # numpy's ints too (configs)
        if num_workers > 0 and prefetch is not None and not _positive(prefetch):
            raise InvalidRequestError(
                "prefetch_factor must be a positive integer (the batches each worker fetches "
                f"ahead), or None for 2; got {kwargs['prefetch_factor']!r}"
            )
        dataset._whole_batches = True
        if num_workers > 0:
            # A worker fetches prefetch_factor batches ahead, as with any DataLoader, and hands
            # them over together: torch is asked for one item per worker at a time, each of
            # up to prefetch_factor batches (the rows a loader takes ahead of its consumer
            # stay what torch's read-ahead would take: other ranks sharing the task's rows
            # are not starved; see _ready_group)
            dataset._handoff_batches = 2 if prefetch is None else prefetch
            kwargs["prefetch_factor"] = 1
        super().__init__(
            dataset,
            batch_size=None,
            collate_fn=_identity,
            num_workers=num_workers,
            **kwargs,
        )
        self._stream = dataset

    def __len__(self) -> int:
        """Not known: the stream has as many batches as rows come.

        Raises:
            UnsupportedTypeError: always (a `TypeError`, as ``len()`` of any object without
                a length: progress bars and trainers take it as "unknown").
        """
        raise UnsupportedTypeError(
            "a StreamingDataLoader has no len(): it streams until the partition is sealed "
            "and drained (or consumed, with stop_when_consumed), so its number of batches "
            "is not known ahead; count the steps as they come (or set your own max_steps)"
        )

    def reset(self) -> None:
        """Replay from ``batch_index`` 0 (see `StreamingDataset.reset`)."""
        self._stream.reset()

    def step(self, partition_id: str) -> None:
        """Move to another partition (see `StreamingDataset.step`)."""
        self._stream.step(partition_id)

    def state_dict(self) -> dict[str, Any]:
        """The position of the next micro-batch (see `StreamingDataset.state_dict`)."""
        return self._stream.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a recorded position (see `StreamingDataset.load_state_dict`)."""
        self._stream.load_state_dict(state)

    def __iter__(self) -> Iterator[MicroBatch]:  # type: ignore[override]
        """Yield micro-batches in ``batch_index`` order until the stream ends.

        Raises:
            InvalidRequestError: iterated on a thread whose event loop is running (it would
                block that loop): async code uses `AsyncStreamingDataset`; or while another
                thread is inside a pass over the same dataset.
        """
        return self._stream._new_pass(self._iterate)

    def _iterate(self) -> Iterator[MicroBatch]:
        """`__iter__`'s pass."""
        check_blocking_allowed("iterating a StreamingDataLoader", _ASYNC_DATASET)
        ds = self._stream
        acks = LoaderAcks(ds._kwargs["address"])
        try:
            yield from self._passes(ds, acks)
        finally:
            acks.close()

    def _passes(self, ds: StreamingDataset, acks: LoaderAcks) -> Iterator[MicroBatch]:
        """`__iter__`: a DataLoader pass, and a new one each time the position moves."""
        while True:
            generation = ds._generation
            moved = False
            # A new DataLoader iterator (new workers) sees the dataset's current position.
            items = super().__iter__()
            # batches by batch_index, until every lower one has come: a worker's hand-off
            # holds several of its batches (w, w + W, ...), the others' come in between
            waiting: dict[int, BatchSlice] = {}
            # the lowest batch index at which a worker's stream ended: the pass ends there
            # (another worker may go on once rows come, deciding that batch for nobody; its
            # later batches stay recorded and the next pass reads them)
            end: int | None = None
            try:
                for got in items:
                    for handed in _slices(got):
                        waiting[handed.batch_index] = handed
                    if isinstance(got, _Group) and got.end is not None:
                        end = got.end if end is None else min(end, got.end)
                    while not moved and (item := waiting.pop(ds.batch_index, None)) is not None:
                        for i, micro_batch in enumerate(item.micro_batches):
                            ds._delivered(item, i + 1)
                            if i + 1 == len(item.micro_batches):
                                acks.delivered(item.hold)
                            yield micro_batch
                            if ds._generation != generation:
                                moved = True
                                break
                        if not item.micro_batches:
                            ds._delivered(item, 0)
                            acks.delivered(item.hold)
                    acks.send()  # before waiting for the workers' next hand-off
                    if moved or ds.batch_index == end:
                        break
                else:
                    if waiting:
                        raise InvalidRequestError(
                            f"the StreamingDataLoader's workers ended without batch "
                            f"{ds.batch_index} but delivered {sorted(waiting)}; a bug: please "
                            "report it"
                        )
            finally:
                del items  # shuts the workers down now, not at garbage collection
            if not moved:
                return
            log.debug("position moved during a pass; restarting workers", **ds.state_dict())


#: a DataLoader worker hands the loader up to prefetch_factor of its batches at once, the
#: ones ready without waiting, while they hold at most _HANDOFF_BYTES: each hand-off costs
#: both processes a queue round trip and wake-ups (~0.2-0.3 ms on a 2-vCPU VM), which small
#: batches would otherwise pay one by one (benchmarks/RESULTS.md, W5)
_HANDOFF_BYTES = 1 << 20


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class _Group(list[BatchSlice]):
    """Batches of one worker handed over at once, in its order; ``end``: the batch index at
    which its stream ended after them (None: it goes on)."""

    def __init__(self, batches: Sequence[BatchSlice] = (), end: int | None = None) -> None:
        super().__init__(batches)
        self.end = end

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Group, (list(self), self.end))


#: seconds a DataLoader worker waits for a batch before it checks that the loader's process
#: is still there (torch's workers check every 5 s too: ``MP_STATUS_CHECK_INTERVAL``)
_LOADER_CHECK_S = 5.0


def _next_batch(
    host: _InThread, ads: AsyncStreamingDataset, ahead: int, loader: int | None
) -> BatchSlice | None:
    """The next batch (`AsyncStreamingDataset.next_batch`); None at the end of the stream,
    or, in a DataLoader worker (``loader``: the loader's pid), once the loader is gone."""
    if loader is None:
        return host.call(lambda: ads.next_batch(ahead=ahead))
    while True:
        try:
            return host.call(lambda: ads.next_batch(wait=_LOADER_CHECK_S, ahead=ahead))
        except TQTimeoutError:  # nothing taken; the position is unchanged
            if os.getppid() != loader:
                log.info("the DataLoader's process is gone: this worker stops", loader=loader)
                return None


def _ready_group(
    host: _InThread, ads: AsyncStreamingDataset, first: BatchSlice, most: int
) -> _Group:
    """``first`` and the worker's next batches that are ready at once, ``most`` in all,
    within the bytes bound. Never more: every batch fetched is a batch decided, its rows
    consumed for the task ahead of the consumer, and ranks that share the task's rows (no
    ``dp_size``) would find fewer. The request that fetched ``first`` usually took them
    already (``next_batch(ahead=)``); one that was not ready then is asked for again."""
    group = _Group([first])
    size = _slice_bytes(first)
    while len(group) < most and size < _HANDOFF_BYTES:
        try:
            item = host.call(lambda: ads.next_batch(wait=False))
        except TQError:
            # not ready (TQTimeoutError), or failed: hand over what is; the next fetch
            # waits for it, or fails again after these batches are delivered
            break
        if item is None:
            group.end = ads.batch_index
            break
        group.append(item)
        size += _slice_bytes(item)
    return group


def _slice_bytes(item: BatchSlice) -> int:
    return sum(
        v.nbytes for td, _ in item.micro_batches for v in td.values() if isinstance(v, torch.Tensor)
    )


def _slices(got: Any) -> list[BatchSlice]:
    """What a worker handed over, as batches."""
    items = got if isinstance(got, list) else [got]
    for item in items:
        if not isinstance(item, BatchSlice):
            raise InvalidRequestError(
                f"a StreamingDataLoader worker returned {type(item).__name__}; "
                "its dataset must be the StreamingDataset it was built with"
            )
    return items


class _Pass(Generic[R]):
    """One pass over a `StreamingDataset`'s position: the dataset's own iteration or its
    loader's. A newer pass ends it (`end`): its generator is closed (workers, client), and
    iterating it again raises."""

    def __init__(self, items: Iterator[R]) -> None:
        self._items = items
        self._ended = False

    def __iter__(self) -> _Pass[R]:
        return self

    def __next__(self) -> R:
        if self._ended:
            raise InvalidRequestError(
                "this iteration of the StreamingDataset / StreamingDataLoader ended when a "
                "newer one started (iter() again while it was alive): they share one "
                "position, so one pass at a time; go on with the newer iterator"
            )
        return next(self._items)

    def close(self) -> None:
        """Stop the pass now (as closing its generator)."""
        if isinstance(self._items, Generator):
            self._items.close()

    def end(self) -> None:
        """A newer pass started: stop this one, and refuse to go on.

        Raises:
            InvalidRequestError: another thread is inside this pass (it goes on).
        """
        if getattr(self._items, "gi_running", False):
            raise InvalidRequestError(
                "another thread is iterating this StreamingDataset / StreamingDataLoader: "
                "they share one position, so one pass at a time; let that pass finish (or "
                "break out of it) before starting another"
            )
        self._ended = True
        self.close()


class _AsyncFace:
    """An `AsyncClient`-shaped view of a blocking `Client`:
    each coroutine method makes the blocking call (it never suspends). The dataset (and a
    ``fetch_batch_fn``) awaits it as it would the async client."""

    def __init__(self, client: Client) -> None:
        self.client = client

    @property
    def closed(self) -> bool:
        return self.client.closed

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.client, name)
        if not callable(fn):
            return fn

        async def call(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        return call


class _InThread:
    """Hosts an `AsyncStreamingDataset` (entered with ``async with``) on a private
    event loop of the calling thread; `call` runs a coroutine there and returns its
    result. The loop runs only inside `call`: between batches nothing runs.

    The host task enters the dataset (its task group lives in that task) and waits until
    `close`; each call runs as a task of its own (``prefetch=0``: the dataset starts
    no task of its own), so a call costs one task, not a hand-off to the host and back."""

    def __init__(self, ads: AsyncStreamingDataset) -> None:
        face = ads.address
        assert isinstance(face, _AsyncFace)
        self._client = face.client
        self._client.open()
        self._loop = asyncio.new_event_loop()
        allow_blocking(self._loop)  # it runs only while this thread waits for the client
        self._entered: asyncio.Future[None] = self._loop.create_future()
        self._closing: asyncio.Future[None] = self._loop.create_future()
        self._host = self._loop.create_task(self._serve(ads))
        self._running: asyncio.Task[Any] | None = None

    async def _serve(self, ads: AsyncStreamingDataset) -> None:
        async with ads:
            self._entered.set_result(None)
            await self._closing

    def call(self, fn: Callable[[], Awaitable[R]]) -> R:
        loop = self._loop
        if not self._entered.done():
            either: list[asyncio.Future[Any]] = [self._entered, self._host]
            loop.run_until_complete(asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED))
            if not self._entered.done():  # the host ended: entering the dataset failed
                self._host.result()
                raise ClosedError("the dataset's host ended")  # pragma: no cover - raised
        task: asyncio.Task[R] = loop.create_task(_awaited(fn))
        self._running = task
        result = loop.run_until_complete(task)
        self._running = None
        return result

    def close(self, exc: BaseException | None) -> None:
        loop = self._loop
        try:
            if not loop.is_closed():
                running = self._running
                if running is not None and not running.done():  # interrupted (Ctrl-C)
                    running.cancel()
                    with contextlib.suppress(BaseException):
                        loop.run_until_complete(running)
                if not self._host.done():
                    if not self._closing.done():
                        self._closing.set_result(None)
                    with contextlib.suppress(Exception):
                        loop.run_until_complete(self._host)
        finally:
            if not loop.is_closed():
                loop.close()
            self._client.close()


async def _awaited(fn: Callable[[], Awaitable[R]]) -> R:
    return await fn()
