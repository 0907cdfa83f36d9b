"""Control messages: msgspec Structs encoded as msgpack, one tagged union per service.

A request is a multipart message ``[header, *data_frames]``. ``header`` encodes a
`Request` envelope ``[rid, body]`` whose ``body`` is one of the structs below (tagged by
class name). The reply is ``[reply_header, *data_frames]`` where ``reply_header`` is a
`Reply` ``[rid, ok, payload]``: on success ``payload`` is the op's result (msgpack), on
failure an ``[error_class_name, message]`` pair. ``rid`` is chosen by the client and unique per
connection; replies may arrive in any order.
"""

from __future__ import annotations

from typing import Any, get_args

import msgspec

from .._errors import ProtocolError
from ._columns import ColumnHeader


class _Msg(msgspec.Struct, array_like=True, tag=True):
    pass


# ---- controller ------------------------------------------------------------------------------


class Hello(_Msg):
    """Ask for the cluster's storage units and settings."""

    #: locality: the sender's host id (see tq_async._transport._hosts; "": unknown)
    host: str = ""
    #: seconds after which this connection resends a request still waiting (its
    #: ``retry_after`` over ZMQ; None: it does not): the controller ends a waiting request
    #: not resent for a few of them, its client being gone
    refresh: float | None = None


class RegisterUnit(_Msg):
    """A storage unit announces itself (process / Ray deployments).

    ``unit_id < 0`` asks the controller to choose the id. The reply is the unit's id.
    """

    unit_id: int
    address: str
    #: locality: the sender's host id (see tq_async._transport._hosts; "": unknown)
    host: str = ""
    #: the unit's instance token ("": tell it by StoreStats); a unit restarted on its
    #: data_dir comes back with the token it had, and its rows with it
    instance: str = ""


class PutBegin(_Msg):
    """Validate the schema and allocate ``n_rows`` new rows, or look up existing ``rows``."""

    partition_id: str
    columns: list[ColumnHeader]
    n_rows: int = 0
    rows: list[int] | None = None
    keys: list[str] | None = None
    #: when the capacity is full: False waits (up to ``timeout``), True fails with WouldBlock
    nowait: bool = False
    timeout: float | None = None
    #: the partition incarnation of ``rows`` (from a BatchMeta; None: not checked)
    incarnation: str | None = None
    #: locality: the sender's host id (see tq_async._transport._hosts; "": unknown)
    host: str = ""


class PutCommit(_Msg):
    """Every unit acknowledged: mark the cells produced, apply tags and versions (atomically)."""

    partition_id: str
    rows: list[int]
    fields: list[str]
    tags: list[dict[str, Any] | None] | None = None
    versions: list[int] | None = None
    #: the put lease of the new rows (``Placement.put_id``; 0: none)
    put_id: int = 0
    #: the partition incarnation of ``rows`` (from a BatchMeta; None: not checked)
    incarnation: str | None = None


class RenewPut(_Msg):
    """The producer is alive and still writing: extend these put leases (fire and forget)."""

    put_ids: list[int]


class AbortPut(_Msg):
    """The producer gave up these puts before committing them (cancelled, failed): their
    new rows are reclaimed now, as when a put lease lapses. Answered with the rows
    reclaimed (a keyed put's caller frees the cells it sent of those); usually sent one-way."""

    put_ids: list[int]


class PutInline(_Msg):
    """A small put in one request: the column frames follow the header.

    The controller allocates ``n_rows`` new rows (or looks up the existing ``rows``, which
    must sit on one unit), has the unit store the columns -- directly when the unit lives in
    its process, else with a `StorePut` -- and commits, as PutBegin + StorePut +
    PutCommit would; the reply is the `Placement`.
    """

    partition_id: str
    columns: list[ColumnHeader]
    n_rows: int = 0
    rows: list[int] | None = None
    tags: list[dict[str, Any] | None] | None = None
    versions: list[int] | None = None
    nowait: bool = False
    timeout: float | None = None
    #: the partition incarnation of ``rows`` (from a BatchMeta; None: not checked)
    incarnation: str | None = None
    #: locality: the sender's host id (see tq_async._transport._hosts; "": unknown)
    host: str = ""


class LostRows(_Msg):
    """Rows lost with dead storage units: ``{partition_id: rows}``, and the dead unit ids."""

    partition_id: str | None = None


class RegisterTasks(_Msg):
    """Rows of ``partition_id`` (every partition when None) are cleared automatically once
    every task in ``tasks`` has consumed them (an empty list turns auto-clear off)."""

    tasks: list[str]
    partition_id: str | None = None


class SetPolicyVersion(_Msg):
    """The learner announces its policy version."""

    version: int


class AcquireRollout(_Msg):
    """Wait until a rollout of ``policy_version`` producing ``n`` rows may start."""

    policy_version: int
    n: int = 1
    timeout: float | None = None
    #: the client's name for this admission (0: none): asked again with the same token after
    #: its reply was lost, it is admitted once
    token: int = 0
    #: the name the client holds its slots under, the same across its reconnects (empty:
    #: its connection holds them): it renews them (`RenewSlots`) while it holds any, and the
    #: reply is the slot lease in seconds (None: the connection holds them)
    holder: bytes = b""


class ReleaseRollout(_Msg):
    """Give back admission slots of rollouts that will not be put (e.g. generation failed)."""

    n: int
    #: the holder whose slots they are first (`AcquireRollout.holder`; empty: the sender's)
    holder: bytes = b""


class RenewSlots(_Msg):
    """The client holding admission slots under ``holder`` is alive: extend their slot
    lease (fire and forget; the connection it comes on speaks for ``holder`` from now)."""

    holder: bytes


class TakeRecycled(_Msg):
    """Take up to ``max_rows`` stale rows whose prompts must be regenerated (each once).

    ``token`` names the take (0: none): one asked again with a token the controller
    answered before (its reply was lost with the controller) gets the same rows again."""

    max_rows: int
    token: int = 0


class ReturnRecycled(_Msg):
    """Recycled rows a `TakeRecycled` handed out to a caller that had given up (cancelled,
    timed out): queued again, first, for the next `TakeRecycled` (one-way)."""

    partition_id: str
    incarnation: str | None
    rows: list[int]
    #: the hold the handed-out rows had (`RecycledRows`' ``meta.lease_id``; 0: none)
    lease_id: int = 0
    #: the `TakeRecycled` token that took them (0: none): forgotten, the rows are queued
    token: int = 0


class StalenessStatus(_Msg):
    pass


class GetMeta(_Msg):
    partition_id: str
    data_fields: list[str]
    batch_size: int
    task_name: str
    sampling_config: dict[str, Any] | None = None
    mode: str = "fetch"
    timeout: float | None = None
    #: also end the stream once the partition holds rows and the task consumed all of them
    stop_when_consumed: bool = False
    #: seconds the delivered rows stay leased: unless acknowledged, they return to the task
    lease: float | None = None
    #: leases this request acknowledges (the consumer is done with those batches)
    ack: list[int] | None = None
    #: a ``get``: if the rows' cells sit in storage units of the controller's process and
    #: take at most this many bytes, the reply carries them (one round trip, no get_data)
    inline_bytes: int = 0
    #: a fetch under a ``batch_index``: once it is answered, also decide these higher batch
    #: indexes, lowest first, each only if it can be decided at once (as with ``timeout=0``;
    #: the indexes between are decided first, as with ``record_from``), stopping at the
    #: first that cannot or that ends the stream; each rides in the reply's ``more``
    also: list[int] | None = None
    #: locality: the sender's host id (see tq_async._transport._hosts; "": unknown)
    host: str = ""


class Cancel(_Msg):
    """Cancel the caller's waiting request ``target`` (nothing it would have consumed is)."""

    target: int


class Ack(_Msg):
    """Commit leased batches: their rows stay consumed for good."""

    lease_ids: list[int]


class Release(_Msg):
    """Give back rows a cancelled fetch received: they become ready again for the task."""

    partition_id: str
    task_name: str
    rows: list[int]
    #: the partition incarnation of ``rows`` (from a BatchMeta; None: not checked)
    incarnation: str | None = None
    #: the fetch's lease or hold (0: none): dropped with the rows, never acknowledged
    lease_id: int = 0


class Seal(_Msg):
    partition_id: str
    create: bool = False


class ResetConsumption(_Msg):
    partition_id: str
    task_name: str | None = None


class ClearSamples(_Msg):
    partition_id: str
    rows: list[int]
    #: the partition incarnation of ``rows`` (from a BatchMeta; None: not checked)
    incarnation: str | None = None
    #: the rows of a put its caller gave up on: admission stays as it is (the producer puts
    #: again or calls ``release_rollout``), as for a put undone before it committed
    undo: bool = False


class ClearPartition(_Msg):
    partition_id: str


class CheckProduction(_Msg):
    partition_id: str
    data_fields: list[str]
    rows: list[int] | None = None


class CheckConsumption(_Msg):
    partition_id: str
    task_name: str
    rows: list[int] | None = None


class ProductionStatus(_Msg):
    partition_id: str
    data_fields: list[str] | None = None


class ConsumptionStatus(_Msg):
    partition_id: str
    task_name: str


class ListPartitions(_Msg):
    pass


class PartitionInfo(_Msg):
    partition_id: str


class ClusterStatus(_Msg):
    """The controller's view of the cluster for ``tq-async status``: storage units, capacity,
    admission and the learner's policy version."""


class FieldSchema(_Msg):
    """The headers (kind, dtype, row shape) of a partition's ``fields``: what an empty
    batch of them carries (unknown fields and partitions are left out)."""

    partition_id: str
    fields: list[str]


class SetTags(_Msg):
    partition_id: str
    rows: list[int]
    tags: list[dict[str, Any]]
    #: the partition incarnation of ``rows`` (from a BatchMeta; None: not checked)
    incarnation: str | None = None


class KVLookup(_Msg):
    """Rows of ``keys``; every key must exist and have every field in ``fields``.

    With ``available``, the reply names the fields every key has instead (``fields`` unused).
    """

    partition_id: str
    keys: list[str]
    fields: list[str] | None = None
    available: bool = False


class KVTag(_Msg):
    """Merge ``tags[i]`` into the tags of ``keys[i]`` (creating missing keys), atomically."""

    partition_id: str
    keys: list[str]
    tags: list[dict[str, Any]]


class KVList(_Msg):
    """Each partition's ``{key: tags}`` (every partition's when ``partition_id`` is None).

    ``packed`` (clients of this release ask for it) answers each partition as one
    `KVColumns`; else as a ``{key: tags}`` map, as before.
    """

    partition_id: str | None = None
    packed: bool = False


class KVColumns(msgspec.Struct, array_like=True):
    """One partition's ``kv_list`` answer as two columns left encoded: ``keys``, the msgpack
    array of its ``n`` keys, and ``tags``, the msgpack array of their tags in the same order.
    They travel as binary (the reply skips them in O(1) and the client keeps views into the
    received frame); the client decodes each in one call when it is first read."""

    n: int
    keys: memoryview
    tags: memoryview


class KVClear(_Msg):
    partition_id: str
    keys: list[str]


class KVKeys(_Msg):
    """The key of each of ``rows``; every row must exist and have a key."""

    partition_id: str
    rows: list[int]


class FieldDump(msgspec.Struct, array_like=True):
    header: ColumnHeader
    produced: bytes


class PartitionDump(msgspec.Struct, array_like=True):
    """Everything the controller knows of one partition (not the cells)."""

    partition_id: str
    n_rows: int
    alive: bytes
    origin: list[int]
    units: list[int]
    tags: list[dict[str, Any] | None]
    row_keys: list[str | None]
    sealed: bool
    fields: list[FieldDump]
    consumed: dict[str, bytes]
    #: the recorded batches, ``(task, dp_rank, batch_index, rows)`` (the checkpoint
    #: format's name for them)
    deliveries: list[tuple[str, int, int, list[int]]]
    row_version: list[int] = []
    field_versions: dict[str, list[int]] = {}
    #: the recorded batches acknowledged already, ``(task, dp_rank, batch_index)``: never
    #: replayed, holding no rows (a checkpoint written before this field had none)
    settled: list[tuple[str, int, int]] = []
    #: the DP ranks owed a stop_when_consumed end of stream, ``(task, batch_index, ranks)``
    #: (`ControllerState.dp_ends`; a checkpoint written before this field had none)
    dp_ends: list[tuple[str, int, list[int]]] = []
    #: its stale rows queued for ``take_recycled``, oldest first (`ControllerState.recycled`)
    recycled: list[int] = []
    #: its rows lost with a storage unit, ``(row, unit)`` (the unit's id where it was lost)
    lost: list[tuple[int, int]] = []
    #: rows each task consumed without their being delivered (a dropped tail), counted
    dropped: dict[str, int] = {}
    #: the per-row arrays hold the rows from this one on: every row below is cleared (a
    #: checkpoint written before this field holds every row)
    base: int = 0
    #: the recorded batches forgotten once their rows were all gone, ``(task, dp_rank, lo,
    #: hi)``: indexes ``lo..hi-1`` were decided (a checkpoint written before this field
    #: forgot none)
    forgotten: list[tuple[str, int, int, int]] = []


class StateDump(msgspec.Struct, array_like=True):
    partitions: list[PartitionDump]
    sampler_state: dict[str, Any]


class DumpState(_Msg):
    """A consistent snapshot of the controller's state (all partitions, or the named ones)."""

    partition_ids: list[str] | None = None


class RestoreBegin(_Msg):
    """Stage partitions from a checkpoint (invisible until RestoreCommit); returns placement."""

    state: StateDump


class RestoreCommit(_Msg):
    partition_ids: list[str]
    sampler_state: dict[str, Any] | None = None


class RestoreAbort(_Msg):
    partition_ids: list[str]


class WatchNext(_Msg):
    """The events after ``since`` (see `tq_async._wire._events`); the reply, a
    ``WatchBatch``, comes once one matches, or empty after ``poll`` seconds.

    ``since`` None subscribes: the reply comes at once, empty, with the position to go on
    from. ``incarnation`` is the controller's that ``since`` counts in (None: this one).
    """

    since: int | None = None
    incarnation: str | None = None
    partition_id: str | None = None
    kinds: list[str] | None = None
    max_events: int = 4096
    #: the most events this watcher may fall behind before it gets a ``Resync`` instead
    max_lag: int | None = None
    poll: float = 30.0
    #: the watchers of the client this request asks for (they share its answer)
    watchers: int = 1


ControllerBody = (
    Hello
    | FieldSchema
    | RegisterUnit
    | PutBegin
    | PutCommit
    | RenewPut
    | AbortPut
    | PutInline
    | GetMeta
    | Cancel
    | Release
    | Ack
    | Seal
    | ResetConsumption
    | ClearSamples
    | ClearPartition
    | CheckProduction
    | CheckConsumption
    | ProductionStatus
    | ConsumptionStatus
    | ListPartitions
    | PartitionInfo
    | SetTags
    | KVLookup
    | KVTag
    | KVList
    | KVClear
    | KVKeys
    | DumpState
    | RestoreBegin
    | RestoreCommit
    | RestoreAbort
    | RegisterTasks
    | LostRows
    | SetPolicyVersion
    | AcquireRollout
    | ReleaseRollout
    | RenewSlots
    | TakeRecycled
    | ReturnRecycled
    | StalenessStatus
    | WatchNext
    | ClusterStatus
)


# ---- storage unit ----------------------------------------------------------------------------


class StorePut(_Msg):
    """Store ``columns`` (frames follow the header, in column order) for ``rows``.

    With ``shm``, the frames are not in the message: they are spans of a shared-memory grant
    (see `tq_async._paths._shm`).
    """

    partition_id: str
    rows: list[int]
    columns: list[ColumnHeader]
    #: the partition incarnation the cells belong to (None: whichever the unit holds)
    incarnation: str | None = None
    shm: ShmFrames | None = None
    #: columns whose cells the client wrote into the unit's device arena (no frames)
    device: DeviceFrames | None = None
    #: locality: the sender's host id (see tq_async._transport._hosts; "": unknown)
    host: str = ""
    #: a same-host client asks for a grant of this many bytes for its next put, lent with
    #: the answer (a `ShmGrant`, or None when the unit keeps its arena for others)
    spare: int = 0
    #: the same for a grant of its device arena: then the answer is `PutSpares` (both)
    device_spare: int = 0


class StoreGet(_Msg):
    """Send ``fields`` of ``rows``, in that row order (through shared memory if ``shm``).

    With ``device`` (and ``shm``) fields whose cells are in the unit's device arena are
    answered with their spans there (``StoredColumns.device_spans``).
    """

    partition_id: str
    rows: list[int]
    fields: list[str]
    #: the partition incarnation the cells belong to (None: whichever the unit holds)
    incarnation: str | None = None
    shm: bool = False
    device: bool = False
    #: locality: the sender's host id (see tq_async._transport._hosts; "": unknown)
    host: str = ""
    #: (with ``shm``) the client copies the spans with its GPU driver from page-locked
    #: memory: the chunks they touch stay resident (see tq_async._paths._pinned)
    pinned: bool = False
    #: the task that fetched the rows (``BatchMeta.task_name``; "": none), for the unit's
    #: per-task byte counters
    task: str = ""
    #: (with ``device``) jagged fields' cells in the device arena are answered with their
    #: spans too (``StoredColumns.device_offsets``; older clients: copied out to the host)
    jagged: bool = False


class ShmFrames(msgspec.Struct, array_like=True):
    """Where a put's frames are: ``(offset, nbytes)`` spans relative to grant ``grant``."""

    grant: int
    spans: list[tuple[int, int]]


class DeviceFrames(msgspec.Struct, array_like=True):
    """Where a put's device columns are: column ``columns[i]`` (position among the put's
    columns) at ``spans[i] = (offset, nbytes)`` of device arena grant ``grant``."""

    grant: int
    columns: list[int]
    spans: list[tuple[int, int]]


class ShmHello(_Msg):
    """A client on this host asks for the unit's arena (it will verify the token)."""

    pid: int


class DeviceHello(_Msg):
    """A client that shares memory with the unit asks for its device arena (see
    `tq_async._paths._device`; answered with `DeviceHelloReply`, or None: no device
    arena for this client)."""

    pid: int


class ShmAlloc(_Msg):
    """Reserve ``nbytes`` of the arena (of the device arena, with ``device``) for a put
    (answered with `ShmGrant` or None when the arena is full: then the put goes
    over the socket, or through host memory)."""

    nbytes: int
    device: bool = False
    #: the client will copy into the grant with its GPU driver from page-locked memory:
    #: the chunks it touches stay resident (see tq_async._paths._pinned)
    pinned: bool = False


class ShmFree(_Msg):
    """Give back grants the client will not use, and read pins it is done with; with
    ``chunks``, the client no longer holds those arena chunks registered; with ``closing``,
    the client closes: everything the unit lent this connection goes back (also what it
    lent with answers the client will never read) and its session ends."""

    grants: list[int]
    pins: list[int]
    chunks: list[int] = msgspec.field(default_factory=list)
    closing: bool = False


class NixlHello(_Msg):
    """A client on another host asks for the unit's NIXL agent and arena (see
    `tq_async._paths._nixl`); answered with `NixlHelloReply`, or None when the unit
    offers no NIXL path (then the socket)."""

    agent: str


class StoreClear(_Msg):
    """Free ``rows`` of a partition (all rows when ``rows`` is None)."""

    partition_id: str
    rows: list[int] | None = None
    #: the partition incarnation the cells belong to (None: whichever the unit holds)
    incarnation: str | None = None


class StoreLayout(_Msg):
    """How ``field`` of ``rows`` was put: answered with ``list[tuple[ColumnHeader, int]]``,
    runs of those rows (in ``rows`` order) stored with one column header, and how many rows
    each holds. Rows of different headers read together come back joined (dense rows with
    jagged ones as one jagged column): a checkpoint reads them apart, each as it was put."""

    partition_id: str
    rows: list[int]
    field: str
    #: the partition incarnation the cells belong to (None: whichever the unit holds)
    incarnation: str | None = None


class StoreStats(_Msg):
    #: also list the rows the unit holds (`StoreStatsReply.held`): what a controller
    #: checks against its own rows when the unit comes back to it
    rows: bool = False


class HeldRows(msgspec.Struct, array_like=True):
    """The rows a storage unit holds cells of in one partition."""

    partition_id: str
    #: the partition incarnation the cells belong to ("": not known)
    incarnation: str
    #: the rows, as little-endian int64 (sorted)
    rows: bytes


StorageBody = (
    StorePut
    | StoreGet
    | StoreClear
    | StoreLayout
    | StoreStats
    | ShmHello
    | DeviceHello
    | ShmAlloc
    | ShmFree
    | NixlHello
    | Cancel
)


# ---- envelopes -------------------------------------------------------------------------------


class ControllerRequest(msgspec.Struct, array_like=True):
    rid: int
    body: ControllerBody
    #: the sending connection's identity: a message a ZMQ ROUTER read from a handed-over
    #: connection carries a routing id of its own, and this one names its client again
    client: bytes | None = None


class StorageRequest(msgspec.Struct, array_like=True):
    rid: int
    body: StorageBody
    client: bytes | None = None


class Reply(msgspec.Struct, array_like=True):
    rid: int
    ok: bool
    payload: msgspec.Raw


# ---- reply payloads --------------------------------------------------------------------------


class UnitInfo(msgspec.Struct, array_like=True):
    unit_id: int
    address: str
    #: locality: the unit's host id ("": unknown)
    host: str = ""


class HelloReply(msgspec.Struct, array_like=True):
    units: list[UnitInfo]
    allow_pickle: bool
    capacity: int | None = None
    #: changes whenever a storage unit's address does: a client seeing a new value asks
    #: for the units again (`Hello`) before it dials one
    units_epoch: int = 0
    #: the controller's same-host twin endpoint, and a token a client compares through it
    ipc: str | None = None
    instance: bytes = b""
    #: the controller's state lineage: the same after a restart that kept its state (a
    #: durable controller recovered from its data_dir), new when the state was lost; a
    #: client that sees it change raises StateLostError (empty: take ``instance``)
    state: bytes = b""


class Placement(msgspec.Struct, array_like=True):
    """Rows of a put and the unit holding each (``units[i]`` holds ``rows[i]``)."""

    rows: list[int]
    units: list[int]
    #: the put lease reserving the new rows until PutCommit (0: none), and its length:
    #: the producer renews it (RenewPut) while it writes for longer than that
    put_id: int = 0
    put_lease: float = 0.0
    #: the partition's incarnation (a random id, new whenever the partition is created)
    incarnation: str | None = None
    #: changes whenever a storage unit's address does: a client seeing a new value asks
    #: for the units again (`Hello`) before it dials one
    units_epoch: int = 0
    #: keyed puts: the fields every row of the put already has (besides the put's own)
    fields: list[str] | None = None


class MetaReply(msgspec.Struct, array_like=True):
    rows: list[int]
    units: list[int]
    tags: list[dict[str, Any]]
    fields: list[str]
    end_of_stream: bool = False
    versions: dict[str, list[int]] = {}
    lease_id: int = 0
    #: the cells, when the request asked for them inline: one part per storage unit, in
    #: order of first appearance in ``units``, each followed by its columns' frames
    inline: list[StoredColumns] | None = None
    #: the partition's incarnation (None on an end-of-stream reply)
    incarnation: str | None = None
    #: changes whenever a storage unit's address does: a client seeing a new value asks
    #: for the units again (`Hello`) before it dials one
    units_epoch: int = 0
    #: rows of a KV partition: each row's key (None without one); None when no row has one
    keys: list[str | None] | None = None
    #: the batches a request's ``also`` decided, in its order (their ``inline`` frames
    #: follow this reply's own, in the same order)
    more: list[MetaReply] | None = None


class RecycledRows(msgspec.Struct, array_like=True):
    """Stale rows of one partition whose prompts must be regenerated."""

    partition_id: str
    meta: MetaReply


class StoredColumns(msgspec.Struct, array_like=True):
    n_rows: int
    columns: list[ColumnHeader]
    #: read through shared memory: the frames are these arena spans, pinned until the client
    #: sends ``ShmFree(pins=[pin])``
    shm_spans: list[tuple[int, int]] | None = None
    pin: int = 0
    #: per column, its pieces' ``(offset, nbytes)`` in the device arena, in row order
    #: (empty: the column came as frames); pinned with ``pin``
    device_spans: list[list[tuple[int, int]]] | None = None
    #: per column read from the device arena and jagged, its rows' offsets (int64 from 0,
    #: ``n_rows + 1``) into its pieces joined; None for the others (older units: None)
    device_offsets: list[bytes | None] | None = None


class ShmHelloReply(msgspec.Struct, array_like=True):
    """The arena: ``/proc/{pid}/fd/{fd}``, ``size`` bytes, starting with ``token``."""

    pid: int
    fd: int
    size: int
    token: bytes
    #: the unit's same-host twin endpoint (verified by asking ShmHello through it)
    ipc: str | None = None
    #: write puts with ``pwrite`` rather than through the mapping: the arena is a file
    #: synced after every group commit (``fsync`` level), whose clean pages would fault on
    #: every store of a memory copy (8.4 MB: 2.8-6.7 ms mapped, 1.3 ms written)
    write_through: bool = False


class DeviceHelloReply(msgspec.Struct, array_like=True):
    """The unit's device arena: ``kind`` ``"cuda"`` (``handle`` is a CUDA IPC handle) or
    ``"host"`` (emulation, tests: ``handle`` is ``pid:fd``), ``size`` bytes on the device
    with UUID ``device``, starting with ``token``."""

    kind: str
    handle: bytes
    size: int
    device: bytes
    token: bytes


class NixlHelloReply(msgspec.Struct, array_like=True):
    """The unit's NIXL agent (its metadata, to load) and its registered arena."""

    metadata: bytes
    agent: str
    base: int
    size: int


class ShmGrant(msgspec.Struct, array_like=True):
    grant: int
    offset: int
    size: int


class PutSpares(msgspec.Struct, array_like=True):
    """The answer to a `StorePut` that asked for a device spare (``device_spare``): the
    grants lent ahead of the client's next put, in the arena and in the device arena
    (each None when the unit keeps its memory for others)."""

    shm: ShmGrant | None = None
    device: ShmGrant | None = None


class StoreStatsReply(msgspec.Struct, array_like=True):
    partitions: int
    rows: int
    resident_bytes: int
    #: random per unit process: a unit answering with another one lost what it held
    instance: str = ""
    #: shared memory: bytes in use, idle pages kept for reuse, the cap (0: off), and puts
    #: that fell back to the socket because the arena was full
    shm_bytes: int = 0
    shm_idle_bytes: int = 0
    shm_cap: int = 0
    shm_fallbacks: int = 0
    #: puts and reads served through shared memory
    shm_puts: int = 0
    shm_reads: int = 0
    #: NIXL: puts and reads served, and bytes registered with it (0: no NIXL agent)
    nixl_puts: int = 0
    nixl_reads: int = 0
    nixl_registered_bytes: int = 0
    #: device arena (GPU memory, same-host clients): bytes in use, the cap (0: none), puts
    #: and reads served through it, and cells copied to host memory for other readers
    device_bytes: int = 0
    device_cap: int = 0
    device_puts: int = 0
    device_reads: int = 0
    device_fallbacks: int = 0
    #: locality: the unit's host id, and payload bytes moved for clients of its own host
    #: and of other hosts: ``{"in_same_host", "in_other_host", "out_same_host",
    #: "out_other_host"}`` (a client that sent no host id counts as another host)
    host: str = ""
    locality: dict[str, int] = {}
    #: shared memory clients hold page-locked with their GPU driver (kept resident)
    shm_locked_bytes: int = 0
    #: device arena cells copied out to host memory for readers that want it: bytes, and
    #: the microseconds the copies took
    device_out_bytes: int = 0
    device_out_us: int = 0
    #: locality by task: payload bytes read by each task's clients on the unit's host and
    #: on others: ``{task: {"out_same_host": n, "out_other_host": n}}`` (reads that named a
    #: task: ``get``/``get_data`` of a fetched batch)
    task_locality: dict[str, dict[str, int]] = {}
    #: tiers: bytes of cells in host memory and their bound (0: none), bytes of live cells
    #: in the unit's segment files, chunks spilled from memory and read back from disk
    memory_bytes: int = 0
    memory_cap: int = 0
    disk_bytes: int = 0
    spills: int = 0
    disk_reads: int = 0
    #: with ``StoreStats(rows=True)``: the rows held, per partition
    held: list[HeldRows] = []


#: msgpack extension code of a numeric numpy array (a sampler's ``sampling_config`` entry,
#: e.g. priority scores): dtype, shape and raw bytes, so no pickle is needed
_EXT_NDARRAY = 1
_ndarray_header = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...], bytes])


def _enc_hook(obj: Any) -> Any:
    """Numeric numpy arrays travel as an extension type, numpy scalars as Python scalars
    (a ``str`` subclass, numpy's ``str_`` among them, as the plain ``str``)."""
    if isinstance(obj, str):
        return str.__str__(obj)
    import numpy as np  # here: most messages never need it

    if isinstance(obj, np.generic) and obj.dtype.kind in "biuf":
        return obj.item()
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc":
        array = np.ascontiguousarray(obj)
        payload = msgspec.msgpack.encode((array.dtype.str, array.shape, array.tobytes()))
        return msgspec.msgpack.Ext(_EXT_NDARRAY, payload)
    raise NotImplementedError(
        f"Encoding objects of type {type(obj).__module__}.{type(obj).__qualname__} is unsupported"
    )


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _EXT_NDARRAY:
        raise ProtocolError(f"unknown msgpack extension type {code}")
    import numpy as np

    dtype, shape, raw = _ndarray_header.decode(data)
    if np.dtype(dtype).kind not in "biufc":
        raise ProtocolError(f"a numpy array of dtype {dtype!r} cannot travel")
    return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()


encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
controller_request_decoder = msgspec.msgpack.Decoder(ControllerRequest, ext_hook=_ext_hook)
storage_request_decoder = msgspec.msgpack.Decoder(StorageRequest)
reply_decoder = msgspec.msgpack.Decoder(Reply)
_rid_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])


#: the request kinds (a body's tag: its class name) each service takes
_KINDS = {
    "controller": {kind.__name__ for kind in get_args(ControllerBody)},
    "storage": {kind.__name__ for kind in get_args(StorageBody)},
}


def misdirected(header: bytes | memoryview, service: str) -> str | None:
    """What to tell the sender of a request that ``service`` (``"controller"``,
    ``"storage"``) cannot decode because it is the other service's: a client given a storage
    unit's address for the controller's (or the reverse). None: not such a request."""
    try:
        body = msgspec.msgpack.decode(_rid_decoder.decode(header)[1], type=list[msgspec.Raw])
        kind = msgspec.msgpack.decode(body[0], type=str)
    except (msgspec.DecodeError, msgspec.ValidationError, IndexError):
        return None
    owner = next((name for name, kinds in _KINDS.items() if kind in kinds), None)
    if owner is None or kind in _KINDS.get(service, ()):
        return None
    unit = "a storage unit's" if service == "storage" else "the controller's"
    return (
        f"this address is {unit}, and {kind} is a request for the {owner}: give the "
        f"{owner}'s address (tq-async serve prints the controller's as TQ_ADDRESS=..., a "
        "storage unit's as TQ_UNIT=<id> ...)"
    )


def salvage_rid(header: bytes | memoryview) -> int | None:
    """The request id of a message that failed to decode, if it can be read at all."""
    try:
        rid = msgspec.msgpack.decode(_rid_decoder.decode(header)[0], type=int)
    except (msgspec.DecodeError, ValueError, TypeError, IndexError):
        return None
    return rid


def ok_reply(rid: int, payload: Any) -> bytes:
    """Encode a success reply header.

    One pass: the payload is encoded in place of ``Reply.payload`` (the same bytes as
    encoding it apart and embedding it as ``Raw``, without a second copy of a big answer).
    """
    return encoder.encode(Reply(rid, True, payload))


def error_reply(rid: int, exc: BaseException) -> bytes:
    """Encode a failure reply header carrying the error's class name and message."""
    kind = type(exc).__name__
    message = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
    return encoder.encode(Reply(rid, False, msgspec.Raw(encoder.encode([kind, message]))))


_error_payload_decoder = msgspec.msgpack.Decoder(tuple[str, str])


def decode_error_payload(payload: msgspec.Raw) -> tuple[str, str]:
    """The ``(class name, message)`` of a failure reply."""
    try:
        return _error_payload_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise ProtocolError("a failure reply had an unreadable payload") from exc
