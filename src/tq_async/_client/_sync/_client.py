# Generated from src/tq_async/_client/_async/_client.py by scripts/unasync.py:
# do not edit; change the source and run `python scripts/unasync.py`.
"""``Client``: put, get_meta, get_data and every controller call, over pooled sockets.

One client holds one DEALER socket to the controller and one per storage unit, opened on
first use and shared by every concurrent call (requests are multiplexed by id). A put is
three steps — ask the controller for rows and placement, send each unit its slice, commit —
and the rows become visible to consumers only at the commit, with their tags.

The client holds its parts instead of inheriting them (httpcore's pool holds its
connections): its links (``_client_base.Links``: the pooled connections, arenas and
same-host twins), and three parts built on them — the put path (``_client_put.PutPath``),
the read path (``_client_get.GetPath``) and the other controller calls
(``_client_calls.ControlCalls``, whose KV calls write and read through the other two). This
class checks the options, opens and closes the links, and delegates each call to its part;
the public docstrings live here.

Two faces, one implementation. This module and its siblings (``_client_base``, ``_client_put``,
``_client_get``, ``_client_calls``, ``_client_nixl``, ``_checkpoint``) are the only source of
the client's logic; ``scripts/unasync.py`` generates the blocking ``tq.Client`` from them
(``_sync*.py``), as httpcore generates its sync twin, and ``tests/client/test_sync_parity.py`` fails
when the generated modules are not current. What differs between the faces is the I/O and
nothing else: the event-loop connection (``_dealer``) against one driven by the calling
thread (``_sync_dealer``), and three concurrency helpers (``_primitives`` /
``_sync_primitives``). A generated twin rather than a sans-I/O core with two shells: the
client's calls are chains of dependent requests with undo paths between them (a put asks for
placement, writes each unit through shared memory, NIXL or the socket, commits, and aborts or
clears on any failure; a read pins and unpins; a moved unit is asked again), which read as
straight-line code here and would each become an explicit state machine in a sans-I/O core,
doubling the code the two faces must agree on.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
from collections.abc import Collection, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from ..._errors import (
    InvalidRequestError,
)
from ..._logging import get_logger
from ..._meta import BatchMeta
from ..._paths._nixl import check_data_path, rdma_present
from ..._service._serve import check_address
from ..._transport._hosts import resolve_host_id
from ..._transport._security import CurveClient
from ..._transport._sync_dealer import DEFAULT_BUSY_POLL, MAX_BUSY_POLL
from ..._wire._checks import check_int, check_seconds, check_text
from ..._wire._listing import KVListing
from .._options import ClientOptions
from ._base import Links
from ._calls import ControlCalls
from ._get import GetPath
from ._put import PutPath
from ._query import meta_query
from ._watch import Watcher

if TYPE_CHECKING:  # imported when a program uses one (see `_wire._tensordicts`)
    from tensordict import TensorDict, TensorDictBase

if sys.version_info >= (3, 11):
    from typing import Self, Unpack
else:  # pragma: no cover - depends on the Python version
    from typing_extensions import Self, Unpack

__all__ = ["Client"]

log = get_logger(__name__)


class Client:
    """Talks to a tq_async controller and its storage units.

    Use it as a context manager:

        with tq.Client.connect(address) as client:
            meta = client.put(td, partition_id="train@0")

    Args:
        address: the controller's endpoint (``cluster.address``, or what ``tq-async serve``
            printed).
        connect_timeout: seconds `open` waits for the controller's first answer (at
            most ``request_timeout``) before it fails with `TQTimeoutError`
            naming the address (a host that drops the connection attempts, or a peer that
            never answers; ZMQ alone would wait forever). A refused connection (nothing
            listens at the address) fails at once with `BrokenError`. Default: 10.
        request_timeout: seconds any single non-waiting request may take before it fails with
            `TQTimeoutError` (a dead service never hangs the caller). Default: 60.
        allow_pickle: let this client pickle values msgpack cannot carry. None (the
            default) follows the controller's setting.
        curve: CURVE keys, when the services require them (see `CurveClient`; default:
            None, plain connections).
        retry_after: when a request with a deadline has no reply after this many seconds,
            reconnect (same identity) and resend it; services deduplicate retried requests,
            so nothing runs twice (default: 10). None disables retries. A same-host Unix-socket
            connection is not retried: it loses nothing without reporting its end, so a
            silent service there is a busy one, waited for up to ``request_timeout``.
        inline_put_bytes: a put of at most this many bytes whose rows sit on one storage
            unit (new rows always do) goes to the controller in one message, which stores
            and commits it (`PutInline`): one round trip instead
            of three, and the lowest put-to-consumer latency. Larger puts send their columns
            straight to the units. 0 disables it. Default: 65536 (64 KiB).
        inline_get_bytes: `get` asks the controller to send the cells along with the
            batch's metadata when they sit in storage units of the controller's own process
            (``local_cluster``, ``tq-async serve``) and take at most this many bytes: one
            round trip instead of two. Otherwise it reads them from the units. 0 disables it.
            Default: 1048576 (1 MiB).
        shared_memory: with a storage unit on this host (verified: the client must read a
            token the unit wrote into its shared memory), puts of at least 64 KiB copy their
            column bytes straight into the unit's memory and reads copy out of it, instead of
            sending them through a socket (see ``docs/deployment.md``; the default, True).
            False always uses the socket.
        same_host: False treats every service as remote: no shared memory (whatever
            ``shared_memory`` says) and the addresses exactly as given (default: True).
        busy_poll: seconds a request to a service on this host (over its Unix socket) with
            no other request in flight reads its socket for the reply before it parks in the
            event loop: waking a parked process costs 25-30 us on a VM, which this saves, at
            the price of up to this much CPU per request. After a poll that caught nothing
            (the service was waiting for data) the next 1, 2, ... 64 requests park at once.
            0 turns it off. Default: 1e-4 (100 us).
        data_path: how column bytes travel to and from the storage units: ``"auto"`` (the
            default: shared memory with a unit on this host; NIXL with one on another host when both
            have it, this host has RDMA hardware and this client does not use CURVE; the
            socket otherwise), ``"shm"`` (no
            NIXL), ``"nixl"`` (NIXL with every unit that offers it, this host's too) or
            ``"zmq"`` (always the socket). A NIXL transfer that fails falls back to the
            socket for that request (see ``docs/deployment.md``, "Data paths").
        host_id: this client's host id, sent with its puts and reads: new rows go to a
            storage unit with the same host id when there is one (default:
            ``$TQ_HOST_ID``, the Ray node id, or the machine's boot id and host name; see
            ``docs/deployment.md``, "Locality"). A preference only: any id reads correct data.

    Attributes:
        link_fallbacks: same-host switches that did not happen: a handshake with the
            controller or a storage unit that got no answer within 5 s, or a Unix socket
            that was refused. That service is then reached through the socket the handshake
            was sent on (for a unit: without shared memory, asked again 30 s later); no
            request fails for it.

    A client belongs to the event loop (and process) that opened it. It *holds* its parts
    and delegates to them: its links (`Links`: the pooled
    connections, arenas and same-host twins), the put path, the read path and the other
    controller calls, each built on the links.
    """

    def __init__(
        self,
        address: str,
        *,
        request_timeout: float = 60.0,
        connect_timeout: float = 10.0,
        allow_pickle: bool | None = None,
        curve: CurveClient | None = None,
        retry_after: float | None = 10.0,
        inline_put_bytes: int = 65536,
        inline_get_bytes: int = 1 << 20,
        shared_memory: bool = True,
        same_host: bool = True,
        busy_poll: float = DEFAULT_BUSY_POLL,
        data_path: str = "auto",
        host_id: str | None = None,
    ) -> None:
        request_timeout = check_seconds("request_timeout", request_timeout, optional=False)
        connect_timeout = check_seconds("connect_timeout", connect_timeout, optional=False)
        retry_after = check_seconds("retry_after", retry_after)
        self.data_path, self.busy_poll = _checked(address, busy_poll, data_path)
        inline_put_bytes = check_int("inline_put_bytes", inline_put_bytes)
        inline_get_bytes = check_int("inline_get_bytes", inline_get_bytes)
        _check_identity(host_id, curve)
        self.connect_timeout = connect_timeout
        self.address = address
        self.request_timeout = request_timeout
        self.curve = curve
        self.retry_after = retry_after
        self.same_host = same_host
        self.shared_memory = bool(shared_memory and same_host) and data_path in ("auto", "shm")
        #: the controller and unit connections, arenas and same-host twins
        self._links = Links(
            address,
            request_timeout=request_timeout,
            allow_pickle=allow_pickle,
            curve=curve,
            retry_after=retry_after,
            shared_memory=self.shared_memory,
            busy_poll=self.busy_poll,
            # units on other hosts reached through NIXL: forced, or under "auto" where it
            # pays (RDMA hardware here) unless the client encrypts (UCX does not) or turned
            # shared memory off (socket only)
            nixl=data_path == "nixl"
            or (data_path == "auto" and shared_memory and curve is None and rdma_present()),
            nixl_forced=data_path == "nixl",
            same_host=same_host,
        )
        self._links.host_id = resolve_host_id(host_id)
        self._puts = PutPath(self._links, inline_put_bytes=inline_put_bytes)
        self._gets = GetPath(self._links, inline_get_bytes=inline_get_bytes)
        self._calls = ControlCalls(self._links, self._puts, self._gets)

    @classmethod
    def connect(cls, address: str, **options: Unpack[ClientOptions]) -> Client:
        """A client for ``address``; enter it with ``with`` to open the connection.

        ``options`` are the constructor's (`ClientOptions`)."""
        return cls(address, **options)

    def __reduce__(self) -> NoReturn:
        # Ray and multiprocessing pickle what they ship: the sockets are this process's
        name = type(self).__name__
        raise InvalidRequestError(
            f"a tq.{name} cannot be pickled (its connections are this process's): send its "
            f"address ({self.address!r}) and open a client in the other process with "
            f"tq.{name}.connect(address)"
        )

    def __enter__(self) -> Client:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def open(self) -> Self:
        """Connect to the controller and learn the storage units; returns the client.

        Raises:
            TQTimeoutError: the controller did not answer within ``connect_timeout`` (or
                ``request_timeout``, when shorter).
            BrokenError: nothing listens at the address (the connection was refused), or
                what accepted the connection is not a tq_async service.
            AuthenticationError: the services refused this client's CURVE keys.
            InvalidRequestError: the address is malformed (e.g. ``tcp://HOST`` without a port).
        """
        wait = min(self.connect_timeout, self.request_timeout)
        limit = "connect_timeout"
        if wait < self.connect_timeout:  # (a first answer is a request's too)
            limit = "request_timeout, shorter than connect_timeout"
        self._links.open(wait, self.same_host, limit)
        return self

    def close(self) -> None:
        """Close every socket; calls still waiting fail with `ClosedError` (the puts among
        them are aborted, and the gets give back the rows they were reading)."""
        self._links.close([*self._puts.farewell(), *self._gets.farewell()])

    @property
    def closed(self) -> bool:
        return self._links.controller is None

    @property
    def host_id(self) -> str:
        """This client's host id (see the ``host_id`` option)."""
        return self._links.host_id

    @property
    def state_lineage(self) -> bytes:
        """The controller's state lineage as this client last saw it: a service restarted
        without its state gives a new one (the call that finds it raises `StateLostError`)."""
        return self._links.lineage

    @property
    def link_fallbacks(self) -> int:
        """Same-host switches that did not happen (see the class docstring)."""
        return self._links.same_host_units.fallbacks

    @property
    def allow_pickle(self) -> bool:
        """Whether this client pickles values msgpack cannot carry (the option, or else the
        controller's setting)."""
        return self._links.allow_pickle

    @property
    def inline_put_bytes(self) -> int:
        """The largest put sent to the controller in one message (the option; settable)."""
        return self._puts.inline_put_bytes

    @inline_put_bytes.setter
    def inline_put_bytes(self, value: int) -> None:
        self._puts.inline_put_bytes = check_int("inline_put_bytes", value)

    @property
    def inline_get_bytes(self) -> int:
        """The most bytes `get` asks the controller to send along (the option;
        settable)."""
        return self._gets.inline_get_bytes

    @inline_get_bytes.setter
    def inline_get_bytes(self, value: int) -> None:
        self._gets.inline_get_bytes = check_int("inline_get_bytes", value)

    def put(
        self,
        data: TensorDictBase | Mapping[str, Any],
        partition_id: str | None = None,
        *,
        meta: BatchMeta | None = None,
        tags: Sequence[Mapping[str, Any] | None] | None = None,
        policy_version: int | Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> BatchMeta:
        """Write a batch: new rows of ``partition_id``, or new fields of the rows in ``meta``.

        Args:
            data: a ``TensorDict(batch_size=[n])`` or a dict of columns (tensors ``[n, ...]``,
                jagged nested tensors, lists of ``n`` tensors, lists of ``n`` plain values).
            partition_id: where new rows go (created on first put). Omit when ``meta`` is given.
            meta: rows to add fields to (from an earlier put or get_meta); ``data`` must have
                ``len(meta)`` rows in the same order.
            tags: one dict per row (or None), merged into each row's tags atomically with the
                data becoming visible. Keys are strings; values are what msgpack carries
                (None, bool, int, float, str, bytes, lists and dicts of those; numpy and
                torch scalars become numbers). Tuples and sets are accepted and come back
                as lists (a set's in no particular order), as msgpack has one array type.
            policy_version: the policy version that produced this data (one int, or one per
                row); recorded per field, so a trajectory appended across versions keeps each
                segment's version. A row's version is its oldest field's.
            timeout: when the cluster has a capacity and it is full, wait at most this many
                seconds for room (None: until room is made or the call is cancelled).

        Returns:
            A `BatchMeta` of the written rows.

        Raises:
            SchemaError: columns disagree on rows, or contradict the partition's schema.
            UnsupportedTypeError: a value cannot travel without pickle.
            TQTimeoutError: no room within ``timeout`` (nothing was written).

        Cancellation: new rows that were allocated but not committed are cleared (best
        effort); new rows and new fields become visible only at the commit, so nothing
        half-written of them is ever seen. Overwriting a field the rows already have is not
        atomic: each unit replaces its cells as they arrive, so an overwrite cancelled (or
        failed) midway may leave some rows with the new values and some with the old; put
        again to finish it.
        """
        return self._puts.write(
            data, partition_id, meta=meta, tags=tags, policy_version=policy_version, timeout=timeout
        )

    def put_nowait(
        self,
        data: TensorDictBase | Mapping[str, Any],
        partition_id: str | None = None,
        *,
        meta: BatchMeta | None = None,
        tags: Sequence[Mapping[str, Any] | None] | None = None,
        policy_version: int | Sequence[int] | None = None,
    ) -> BatchMeta:
        """`put`, but raise `WouldBlock` instead of waiting for room."""
        return self._puts.write(
            data, partition_id, meta=meta, tags=tags, policy_version=policy_version, nowait=True
        )

    def get_meta(
        self,
        data_fields: Sequence[str],
        batch_size: int,
        partition_id: str,
        task_name: str,
        sampling_config: Mapping[str, Any] | None = None,
        *,
        mode: str = "fetch",
        timeout: float | None = None,
        stop_when_consumed: bool = False,
        lease: float | None = None,
        ack: BatchMeta | Sequence[BatchMeta] | None = None,
    ) -> BatchMeta:
        """Ask the controller for ``batch_size`` rows that have ``data_fields``, for a task.

        Waits (event-driven, no polling) until the sampler finds enough rows. In ``"fetch"``
        mode the rows are marked consumed for ``task_name``; ``"peek"`` consumes nothing.

        Args:
            data_fields: the fields the rows must have (and that ``get_data`` will read).
            batch_size: rows wanted (a sampler may return a short last batch once the
                partition is sealed).
            partition_id: the partition to read; it need not exist yet.
            task_name: the consuming task; each task consumes every row once.
            sampling_config: passed to the sampler, e.g. ``{"dp_rank": 0, "batch_index": 3}``.
                With ``batch_index``, the same ``(task, dp_rank, batch_index)`` always
                returns the same rows (replicas and replays read the recorded batch). With
                ``dp_size`` too (and optionally ``tail``: ``"uneven"``, ``"drop"`` or
                ``"error"``), batch ``b`` is decided for all ``dp_size`` ranks at once, every
                rank gets a reply for it and the stream ends for all ranks at the same
                ``batch_index``; under ``"uneven"`` a rank's share may be empty (0 rows,
                ``end_of_stream`` False). With ``record_from`` too (an int), the batch
                indexes from ``record_from`` up to ``batch_index`` not decided yet are
                decided first, lowest first, in the same call (readers sharing one index
                space, like DataLoader workers, keep the recorded indexes gap-free in one
                round trip); they stay recorded even if this call then times out.
            mode: ``"fetch"`` or ``"peek"``.
            timeout: seconds to wait for rows; None waits until data arrives or the call is
                cancelled; 0 answers only what can be answered at once (else
                `TQTimeoutError`, nothing consumed).
            stop_when_consumed: also return end-of-stream (instead of waiting) once the
                partition holds rows and the task has consumed all of them, sealed or not.
            lease: seconds the delivered rows stay leased to this caller. Unless
                acknowledged in time (`ack`, or ``ack=`` on the next request), they
                return to the task and are delivered again: at-least-once, and exactly-once
                for consumers that acknowledge.
            ack: batches this request acknowledges (typically the previous one).

        Returns:
            A `BatchMeta`; it is empty with ``end_of_stream=True`` when the partition is
            sealed and every row has been consumed by the task. With ``dp_size`` in
            ``sampling_config`` it may also be empty without ``end_of_stream``: this rank's
            share of the last global batch; run the step anyway so collectives stay in step.

        Raises:
            TQTimeoutError: not enough rows within ``timeout`` (nothing was consumed).
            InvalidRequestError: bad arguments (e.g. ``data_fields`` not a list).

        Cancellation: the controller drops the waiting request; if rows had already been
        handed out, they are released back to the task (a batch recorded under a
        ``batch_index`` stays readable by that index instead).
        """
        query = meta_query(
            data_fields,
            batch_size,
            partition_id,
            task_name,
            sampling_config,
            mode=mode,
            timeout=timeout,
            stop_when_consumed=stop_when_consumed,
            lease=lease,
            ack=ack,
        )
        meta, _, _ = self._gets.meta_call(query, 0)
        return meta

    def get_data(
        self,
        meta: BatchMeta,
        fields: Sequence[str] | None = None,
        *,
        nested: bool | Collection[str] = False,
        device: Any = None,
    ) -> TensorDict:
        """Read the cells of ``meta``'s rows (``fields`` defaults to ``meta.field_names``).

        A field whose rows were put with different shapes (a rollout padded per batch) comes
        back dense when the rows read share a shape, and as a jagged nested tensor when they
        differ in their first dimension. Rows that differ in a later dimension cannot form one
        tensor: reading them together raises `SchemaError`.

        Args:
            meta: the rows to read.
            fields: the fields to read (default: ``meta.field_names``).
            nested: ``True``, or the names of fields, to get tensor fields back as jagged
                nested tensors even when their rows share a shape (rows of at least one
                dimension; a dense ``[B, L]`` becomes a nested tensor of ``B`` rows of length
                ``L``), for code that wants one type whatever was put.
            device: deliver the tensor fields on this device (e.g. ``"cuda:0"``): copied
                through pinned memory with ``non_blocking`` copies, waited for off the event
                loop. None (or ``"cpu"``): host memory of the caller's own.

        Returns:
            ``TensorDict(batch_size=[len(meta)])``: dense columns as tensors (views of the
            received buffers when one unit holds the rows), jagged columns as jagged nested
            tensors, other columns as ``NonTensorStack``. A ``meta`` of 0 rows asks no
            storage unit: at end of stream it gives ``TensorDict(batch_size=[0])`` without
            columns; otherwise (a rank's empty share of a global batch) every field with 0
            rows and its dtype and row shape (a jagged field: an empty jagged column), as a
            non-empty batch of the same fields would have.

        Raises:
            RowsNotFound: some rows were cleared.
            SchemaError: rows of a field differ in more than their first dimension.

        Cancellation: nothing changes on the services (reads have no side effects).
        """
        return self._gets.get_data(meta, fields, nested=nested, device=device)

    def get(
        self,
        data_fields: Sequence[str],
        batch_size: int,
        partition_id: str,
        task_name: str,
        sampling_config: Mapping[str, Any] | None = None,
        *,
        mode: str = "fetch",
        timeout: float | None = None,
        stop_when_consumed: bool = False,
        lease: float | None = None,
        ack: BatchMeta | Sequence[BatchMeta] | None = None,
        nested: bool | Collection[str] = False,
        device: Any = None,
        keep_hold: bool = False,
    ) -> tuple[TensorDict, BatchMeta]:
        """``get_meta`` then ``get_data``: the rows' data and their `BatchMeta`.

        One round trip when the controller can send the cells along (they sit in storage
        units of its own process and take at most ``inline_get_bytes``); two otherwise. The
        result is the same either way. ``nested`` and ``device`` are `get_data`'s. A
        batch of 0 rows (end of stream, or with ``dp_size`` a rank's empty share) asks no
        storage unit; its ``TensorDict(batch_size=[0])`` is `get_data`'s (an empty share
        carries every field with 0 rows).

        An auto-clear task's rows are acknowledged once read, so auto-clear may free them;
        with ``keep_hold=True`` they are not: acknowledge them (`ack`, or ``ack=`` on a
        later read) once they are processed, e.g. after a batch read ahead is handed on.

        Cancellation: if the data was not delivered, fetched rows are released back to the
        task (unless recorded under a ``batch_index``, which stays replayable).
        """
        query = meta_query(
            data_fields,
            batch_size,
            partition_id,
            task_name,
            sampling_config,
            mode=mode,
            timeout=timeout,
            stop_when_consumed=stop_when_consumed,
            lease=lease,
            ack=ack,
            nested=nested,
            device=device,
            keep_hold=keep_hold,
        )
        return self._gets.get(query)

    def get_batches(
        self,
        data_fields: Sequence[str],
        batch_size: int,
        partition_id: str,
        task_name: str,
        sampling_config: Mapping[str, Any],
        *,
        also: Sequence[int],
        timeout: float | None = None,
        stop_when_consumed: bool = False,
        lease: float | None = None,
        ack: BatchMeta | Sequence[BatchMeta] | None = None,
        nested: bool | Collection[str] = False,
        device: Any = None,
        keep_hold: bool = False,
    ) -> list[tuple[TensorDict, BatchMeta]]:
        """`get` of a batch under its ``batch_index``, and of later batches that can
        be decided at once, in one round trip.

        The first item is ``sampling_config["batch_index"]``'s batch, waited for as
        `get` waits (``timeout``; it may be the end of the stream). Then come the
        batches of ``also`` (increasing indexes above it, at most 64) in order, each only if
        the controller could decide it at once when it answered: the list stops before
        the first that could not, that would end the stream, or that needs an ``async``
        sampler's answer. The indexes between are decided first, as ``record_from`` does.
        Every batch is recorded under its index (a later fetch of it re-reads the same
        rows), so a batch you do not get now is fetched again by its index, nothing lost.
        Readers sharing an index space (DataLoader workers) fetch several of their batches
        this way.
        ``keep_hold`` is `get`'s.

        Raises:
            InvalidRequestError: ``also`` is not increasing above ``batch_index``, or the
                config names no ``batch_index``.
            TQTimeoutError: the first batch did not come within ``timeout``.

        Cancellation: the batches stay recorded under their indexes (re-read by the next
        fetch of each).
        """
        query = meta_query(
            data_fields,
            batch_size,
            partition_id,
            task_name,
            sampling_config,
            also=list(also),
            timeout=timeout,
            stop_when_consumed=stop_when_consumed,
            lease=lease,
            ack=ack,
            nested=nested,
            device=device,
            keep_hold=keep_hold,
        )
        return self._gets.get_batches(query)

    def ack(self, metas: BatchMeta | Sequence[BatchMeta]) -> None:
        """Acknowledge leased batches: their rows stay consumed (no redelivery)."""
        return self._gets.ack(metas)

    def release(self, meta: BatchMeta) -> None:
        """Give rows a task fetched back to it: they become ready again for ``meta.task_name``."""
        return self._gets.release(meta)

    def lost_rows(self, partition_id: str | None = None) -> dict[str, Any]:
        """Rows lost with storage units that went away.

        A unit that stops answering is first *suspended* (its rows are neither handed out
        nor lost; end-of-stream waits for them); it is declared lost when its process is
        confirmed gone (reconnecting is refused, or another process answers at its address)
        or after ``unit_lost_after`` seconds.

        Returns:
            ``{"dead_units": [unit ids], "suspended_units": [unit ids], "rows":
            {partition_id: [rows lost]}}``.
        """
        return self._calls.lost_rows(partition_id)

    def storage_stats(self) -> dict[int, dict[str, Any]]:
        """What each storage unit holds, asked of every unit in parallel.

        Returns:
            ``{unit_id: {"partitions", "rows", "resident_bytes", "shm_bytes",
            "shm_idle_bytes", "shm_cap", "shm_fallbacks", "shm_puts", "shm_reads",
            "nixl_puts", "nixl_reads", "nixl_registered_bytes", "device_bytes",
            "device_cap", "device_puts", "device_reads", "device_fallbacks",
            "shm_locked_bytes", ...}}``:
            cells held, shared memory in use, freed shared memory kept for reuse, the cap
            (0: no shared memory), and puts/reads over the socket because the arena was full
            and through shared memory (totals); puts and reads through NIXL and the memory
            registered with it; the device arena's bytes in use and cap (0: none), puts and
            reads through it, and the times cells went through host memory instead (a put
            that did not fit, a read by a reader that wants host memory); shared memory
            clients hold page-locked for their GPU copies (kept resident).

        Raises:
            TQTimeoutError: a unit did not answer within ``request_timeout``.

        Cancellation: nothing changes on the services.
        """
        return self._calls.storage_stats()

    def register_tasks(self, tasks: Sequence[str], partition_id: str | None = None) -> None:
        """Auto-clear: free each row once every task in ``tasks`` has consumed it.

        Applies to ``partition_id``, or to every partition without its own setting when None;
        an empty ``tasks`` turns it off. Cleared rows can no longer be replayed by
        ``batch_index``: use auto-clear for streams that are read once.

        A fetch by one of these tasks holds its rows until the consumer acknowledges them,
        so they are never freed before they are read: `get` acknowledges after
        reading; after `get_meta` + `get_data`, call `ack`. A recorded batch whose lease ran
        out (its reader died), and a DP rank's share of a global batch it has not read yet,
        keep holding their rows for their reader until acknowledged.
        """
        return self._calls.register_tasks(tasks, partition_id)

    def seal(self, partition_id: str, *, create: bool = False) -> None:
        """No more rows will be added: drained consumers then see end-of-stream.

        Args:
            partition_id: the partition.
            create: create the partition empty (and sealed) if it does not exist.

        Raises:
            PartitionNotFound: the partition does not exist (a misspelled id) and
                ``create`` is False; the message lists the known partitions.

        Cancellation: the seal may or may not have happened; sealing again is harmless.
        """
        return self._calls.seal(partition_id, create=create)

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> None:
        """Make every row of the partition ready again for ``task_name`` (all tasks if None)."""
        return self._calls.reset_consumption(partition_id, task_name)

    def clear_samples(self, meta: BatchMeta) -> None:
        """Remove ``meta``'s rows from the partition and free their storage."""
        return self._calls.clear_samples(meta)

    def clear_partition(self, partition_id: str) -> None:
        """Remove the partition with all its rows, state and sampler caches; free storage."""
        return self._calls.clear_partition(partition_id)

    def check_production_status(
        self,
        partition_id: str,
        data_fields: Sequence[str],
        global_indexes: Sequence[int] | None = None,
    ) -> bool:
        """True when every given row (all rows if None) has every field in ``data_fields``."""
        return self._calls.check_production_status(partition_id, data_fields, global_indexes)

    def check_consumption_status(
        self, partition_id: str, task_name: str, global_indexes: Sequence[int] | None = None
    ) -> bool:
        """True when ``task_name`` has consumed every given row (all rows if None)."""
        return self._calls.check_consumption_status(partition_id, task_name, global_indexes)

    def production_status(
        self, partition_id: str, data_fields: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Per field, a bool tensor over row ids: is the cell produced (cleared rows: False)."""
        return self._calls.production_status(partition_id, data_fields)

    def consumption_status(self, partition_id: str, task_name: str) -> torch.Tensor:
        """A bool tensor over row ids: has ``task_name`` consumed the row."""
        return self._calls.consumption_status(partition_id, task_name)

    def list_partitions(self) -> list[str]:
        """Ids of every partition the controller knows."""
        return self._calls.list_partitions()

    def partition_info(self, partition_id: str) -> dict[str, Any]:
        """Row counts, schema, sealed flag and per-task consumed counts of a partition."""
        return self._calls.partition_info(partition_id)

    def watch(
        self,
        partition_id: str | None = None,
        kinds: Sequence[str] | None = None,
        since: int | None = None,
        *,
        incarnation: str | None = None,
        max_lag: int | None = None,
        poll: float = 30.0,
    ) -> Watcher:
        """The controller's changes as typed events, in order: ``for ev in
        client.watch()`` (see ``docs/watching.md``).

        Args:
            partition_id: only this partition's events (and the units'); it must exist.
            kinds: only these kinds (``tq_async.lowlevel.EVENT_KINDS``), e.g.
                ``["rows_added", "fields_produced"]``.
            since: go on after this event (``watcher.seq``) of ``incarnation``
                (``watcher.incarnation``): no gap, no duplicate, or one ``Resync``
                when the controller cannot tell what happened in between.
            max_lag: a watcher more events behind gets one ``Resync`` instead of them.
            poll: seconds one request waits on the controller before asking again.
        """
        return Watcher(self._links, partition_id, kinds, since, incarnation, max_lag, poll)

    def set_tags(self, meta: BatchMeta, tags: Sequence[Mapping[str, Any]]) -> None:
        """Merge ``tags[i]`` into the tags of row ``meta.global_indexes[i]`` (atomically).

        Tag values are `put`'s: tuples and sets come back as lists.
        """
        return self._calls.set_tags(meta, tags)

    def set_policy_version(self, version: int) -> None:
        """The learner announces its policy version (after each update).

        Wakes producers waiting in `acquire_rollout` and lets samplers re-check rows
        for staleness.
        """
        return self._calls.set_policy_version(version)

    def acquire_rollout(
        self, policy_version: int, n: int = 1, *, timeout: float | None = None
    ) -> None:
        """Wait until a rollout of ``policy_version`` producing ``n`` rows may start.

        Waits (event-driven) while ``policy_version - learner_version > max_staleness`` or
        while ``n`` more rows would exceed the capacity (see ``AdmissionConfig``); then
        reserves ``n`` slots, freed when the learner task consumes the rows (or by
        `release_rollout`, or when unconsumed rows are cleared). Put the rows with
        ``policy_version=``: only rows that carry one are admitted rollouts and free a slot
        (rows put without one, e.g. prompts, free none). A `put` that fails or is
        cancelled frees none, wherever it stopped: put again, or `release_rollout`. The
        slots not yet put are this client's (any client's put settles them first): it
        renews them while it holds any, so they come back when it is closed or its process
        dies (at once over the same-host Unix socket, after ``AdmissionConfig.slot_lease``
        over TCP), and stay across a restart of a durable controller. A blocking `Client`
        renews nothing (its timers fire only while it waits in a call): its connection
        holds its slots.

        Raises:
            TQTimeoutError: not admitted within ``timeout`` (nothing reserved).
            InvalidRequestError: ``n`` can never fit the capacity.
            BrokenError: the controller went away; it may have admitted the rollout before
                (a durable controller remembers). Ask again with the same arguments: the
                client names the admission in doubt, and the controller counts it once.

        Cancellation: the waiting request is dropped; nothing is reserved.
        """
        return self._calls.acquire_rollout(policy_version, n, timeout=timeout)

    def release_rollout(self, n: int) -> None:
        """Give back ``n`` admission slots of rollouts that will not be put."""
        return self._calls.release_rollout(n)

    def take_recycled(self, max_rows: int = 1024) -> list[BatchMeta]:
        """Take stale rows whose prompts must be regenerated, one BatchMeta per partition.

        Each recycled row is handed out exactly once; read its prompt fields with
        `get_data`, put the regenerated sample as a new row, and `ack` the BatchMeta. Where
        the partition auto-clears (`register_tasks`), recycled rows are held, as a fetch's
        rows are: kept until taken, then until acknowledged (``meta.lease_id``), so their
        prompts are never freed before they are read; without auto-clear the ack is a no-op.

        Raises:
            BrokenError: the controller went away while it answered (the rows may have been
                handed out: a durable controller remembers). Ask again with the same
                ``max_rows``: the client names the take in doubt, and the controller hands
                out the same rows (those still there), never losing them.

        Cancellation: rows handed out to a call cancelled (or timed out) before it returned
        are queued again for the next `take_recycled`.
        """
        return self._calls.take_recycled(max_rows)

    def staleness_status(self) -> dict[str, int]:
        """Learner version, outstanding admitted rows, and stale rows dropped/recycled/kept."""
        return self._calls.staleness_status()

    def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: TensorDictBase | Mapping[str, Any] | None,
        tags: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> BatchMeta:
        """Write ``fields`` for ``keys`` (row ``i`` of ``fields`` belongs to ``keys[i]``).

        New keys get new rows; existing keys are updated in place, field by field (fields
        not in ``fields`` keep their values). ``tags`` are merged into each key's tags
        atomically with the data becoming visible. With ``fields=None`` (or fields holding no
        field) only the tags change (missing keys are created; new keys are new rows: at the
        capacity they wait for room, as a put does). The returned `BatchMeta` names every
        field the keys have (not only this call's) and carries the keys.

        Raises:
            SchemaError: ``fields`` has a different number of rows than ``keys``.
            InvalidRequestError: a key repeats, new keys go to a sealed partition, or neither
                ``fields`` nor ``tags`` is given.
        """
        return self._calls.kv_batch_put(keys, partition_id, fields, tags)

    def kv_retrieve_meta(
        self, keys: Sequence[str], partition_id: str, create: bool = False
    ) -> BatchMeta:
        """A `BatchMeta` of ``keys``' rows, naming the fields every key has.

        Args:
            keys: the keys, in the order the rows should have.
            partition_id: their partition.
            create: create missing keys (rows without fields) instead of failing (at the
                capacity, they wait for room as a put's new rows do).

        Raises:
            KeyNotFound: a key is missing (and ``create`` is False).
            PartitionNotFound: the partition does not exist (and ``create`` is False).

        Cancellation: without ``create`` nothing changes; with it, keys may have been created
        (without fields or tags) if the controller received the request.
        """
        return self._calls.kv_retrieve_meta(keys, partition_id, create)

    def kv_put(
        self,
        key: str,
        partition_id: str,
        fields: TensorDictBase | Mapping[str, Any] | None = None,
        tag: Mapping[str, Any] | None = None,
    ) -> BatchMeta:
        """Write one key's ``fields`` and/or merge ``tag`` into its tags.

        ``fields`` is a ``TensorDict`` of batch size ``[]`` or ``[1]``, or a mapping from field
        name to the key's value (a tensor, numpy array or numpy scalar is one dense row; other
        values travel as msgpack). With ``fields=None`` (or ``{}``) only the tags change (the
        key is created if missing; at the capacity, a new key waits for room as a put does).
        """
        return self._calls.kv_put(key, partition_id, fields, tag)

    def kv_batch_get(
        self,
        keys: Sequence[str],
        partition_id: str,
        select_fields: Sequence[str] | None = None,
    ) -> TensorDict:
        """The fields of ``keys``, row ``i`` for ``keys[i]`` (every field when not selected).

        Raises:
            KeyNotFound: a key is missing, or lacks a selected field (the error names it);
                never a silently shorter result.
            RowsNotFound: a key was removed (kv_clear, a clear, auto-clear) while this call
                read its cells: call it again.
        """
        return self._calls.kv_batch_get(keys, partition_id, select_fields)

    def kv_list(self, partition_id: str | None = None) -> dict[str, KVListing]:
        """``{partition_id: {key: tags}}`` for one partition, or for all when None.

        Each partition's ``{key: tags}`` is a `KVListing`: a mapping that behaves as the
        dict, decoded when first read (``len()`` decodes nothing, iterating the keys only
        the keys), so a listing of 100k keys arrives in a few milliseconds.

        Raises:
            PartitionNotFound: ``partition_id`` does not exist.

        Cancellation: nothing changes (a read).
        """
        return self._calls.kv_list(partition_id)

    def kv_retrieve_keys(self, global_indexes: Sequence[int], partition_id: str) -> list[str]:
        """The key of each row in ``global_indexes`` (rows written with kv_put / kv_batch_put).

        Raises:
            KeyNotFound: a row was put without a key (the error names it).
            RowsNotFound: a row does not exist (never allocated, or cleared).
            InvalidRequestError: ``global_indexes`` is not a list of non-negative ints.

        Cancellation: nothing changes (a read).
        """
        return self._calls.kv_retrieve_keys(global_indexes, partition_id)

    def kv_clear(self, keys: Sequence[str], partition_id: str) -> None:
        """Remove ``keys`` and free their storage; a missing key fails the whole call."""
        return self._calls.kv_clear(keys, partition_id)

    def save_checkpoint(
        self,
        path: str | os.PathLike[str],
        partition_ids: Sequence[str] | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Write partitions (all by default), their state, tags, keys and cells to ``path``.

        ``metadata`` (a dict of JSON values, e.g. ``{"step": 10}``) is stored with the
        checkpoint; read it back with `tq_async.checkpoint_metadata`.

        The directory is written under a temporary name and renamed into place, so ``path``
        holds either a whole checkpoint or what it held before: an older checkpoint (or an
        empty directory); anything else there is never replaced. (A save killed between moving
        the older one aside and the new one into place leaves nothing at ``path`` until the
        next save, load or `tq_async.checkpoint_metadata` of it puts the new one there.) Take
        it while producers are paused: the controller state is a consistent snapshot, cells
        are read right after it (rows freed in between, by consumers under auto-clear, make it
        take a new snapshot).

        Raises:
            CheckpointError: ``path`` cannot be written (or holds what is not a checkpoint),
                a storage unit holding rows of the partitions is suspended (save again once it
                resumed), or rows were freed while their cells were read, in every one of a
                few snapshots.
            InvalidRequestError: ``metadata`` is not a dict of JSON values.
        """
        return self._calls.save_checkpoint(path, partition_ids, metadata=metadata)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> list[str]:
        """Restore a checkpoint written by `save_checkpoint`; returns the partition ids.

        Works onto any number of storage units. Every file is verified before anything is
        loaded, and the restored partitions appear all at once or not at all.

        Raises:
            CheckpointError: the checkpoint is missing, corrupt, partial or of another format
                version (nothing was loaded).
            InvalidRequestError: a partition of the checkpoint already exists.

        Cancellation: before the last step (the commit) went out, nothing is loaded (the
        staged partitions and their cells are dropped); once it went out, the load
        completes (all of it): `list_partitions` tells which.
        """
        return self._calls.load_checkpoint(path)


def _check_busy_poll(value: Any) -> float:
    """``busy_poll`` as seconds in ``[0, MAX_BUSY_POLL]``."""
    seconds = float(value) if isinstance(value, numbers.Real) else math.nan
    if isinstance(value, bool) or not 0 <= seconds <= MAX_BUSY_POLL:
        raise InvalidRequestError(
            f"busy_poll must be seconds from 0 (off) to {MAX_BUSY_POLL}, got {value!r}; the "
            f"default ({DEFAULT_BUSY_POLL}) catches a same-host reply without parking"
        )
    return seconds


def _checked(address: str, busy_poll: float, data_path: str) -> tuple[str, float]:
    """The client's address, data path and busy poll checked (a clear error for each bad
    one): the data path and the busy poll as the client keeps them."""
    check_address(address)
    return check_data_path(data_path), _check_busy_poll(busy_poll)


def _check_identity(host_id: Any, curve: Any) -> None:
    """``host_id`` (a string, or None) and ``curve`` (a `CurveClient`, or None), checked
    before anything is sent (a wrong type reached the services, or failed deep inside)."""
    if host_id is not None:
        if not isinstance(host_id, str):
            raise InvalidRequestError(
                f"host_id must be a string (or None: this host's), got "
                f"{type(host_id).__name__} {host_id!r}"
            )
        check_text("host_id", host_id)
    if curve is not None and not isinstance(curve, CurveClient):
        raise InvalidRequestError(
            f"curve must be a tq.CurveClient (the server's public key and this client's "
            f"key pair; see tq.curve_keypair), got {type(curve).__name__}"
        )
