"""What ``client.watch()`` yields: the controller's changes as typed events (msgspec structs).

Each event carries ``seq``, its place in the controller's event log (1, 2, 3, ... for one
controller incarnation), and ``kind``, a short name (``"rows_added"``). Events come in the
order the controller applied the changes, so replaying them on a model of the cluster (rows,
fields produced, rows consumed per task) gives the cluster's state. A watcher that fell too
far behind, or resumes from a position the controller no longer has (another controller
incarnation, history gone), gets one `Resync` carrying a `ClusterSnapshot`
instead of the missing events, then the events after it.

The structs travel as msgpack (tagged by ``kind``) and print as JSON with
``msgspec.json.encode(event)``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

# No ``__all__`` here: the public names are listed once, by `tq_async.events`, which
# re-exports every struct but `WatchBatch` (the reply of the wire's ``WatchNext``).


class Event(msgspec.Struct, tag_field="kind", kw_only=True):
    """What every event has: its sequence number (set when the controller logs it)."""

    seq: int = 0
    #: the event's kind, e.g. ``"rows_added"`` (what ``watch(kinds=...)`` selects): its tag,
    #: set on each kind's class below (a watcher reads it for every event; a property
    #: reading the tag cost 5x as much)
    kind: ClassVar[str] = ""


class PartitionSnapshot(msgspec.Struct, kw_only=True):
    """One partition as a `Resync` (or a restore) sees it: live rows only."""

    partition_id: str
    incarnation: str
    sealed: bool
    #: live rows (allocated and not cleared)
    rows: list[int]
    #: field -> the live rows that have it
    fields: dict[str, list[int]]
    #: task -> the live rows it consumed
    consumed: dict[str, list[int]]
    #: KV keys -> their rows
    keys: dict[str, int] = msgspec.field(default_factory=dict)
    #: open leases: lease id -> task
    leases: dict[int, str] = msgspec.field(default_factory=dict)
    #: the tags of the live rows that have any
    tags: dict[int, dict[str, Any]] = msgspec.field(default_factory=dict)


class ClusterSnapshot(msgspec.Struct, kw_only=True):
    """The partitions (the watched one only, when a watch names one) and the storage units."""

    partitions: list[PartitionSnapshot]
    #: unit id -> "up", "suspended" or "lost"
    units: dict[int, str] = msgspec.field(default_factory=dict)


class PartitionCreated(Event, tag="partition_created"):
    """A partition came to be (its first put, or a seal with ``create=True``)."""

    partition_id: str
    incarnation: str


class PartitionSealed(Event, tag="partition_sealed"):
    """No new rows will come: drained readers get end-of-stream."""

    partition_id: str


class PartitionCleared(Event, tag="partition_cleared"):
    """The partition is gone with every row (a later put creates a new incarnation)."""

    partition_id: str
    incarnation: str


class PartitionRestored(Event, tag="partition_restored"):
    """A checkpoint's partition became live: its whole state."""

    partition_id: str
    snapshot: PartitionSnapshot


class RowsAdded(Event, tag="rows_added"):
    """New rows were placed (their fields follow with `FieldsProduced`)."""

    partition_id: str
    rows: list[int]
    #: the rows' KV keys (None: put without keys)
    keys: list[str] | None = None


class RowsRemoved(Event, tag="rows_removed"):
    """Rows are gone: ``reason`` is "clear" (a lapsed put's rows too), "auto_clear" or "lost"."""

    partition_id: str
    rows: list[int]
    reason: str


class FieldsProduced(Event, tag="fields_produced"):
    """``fields`` of ``rows`` were written (a put committed): what readers wait for."""

    partition_id: str
    rows: list[int]
    fields: list[str]


class TagsChanged(Event, tag="tags_changed"):
    """Tags merged into rows (``tags[i]`` into ``rows[i]``)."""

    partition_id: str
    rows: list[int]
    tags: list[dict[str, Any]]


class RowsConsumed(Event, tag="rows_consumed"):
    """``task`` consumed ``rows`` (a fetch, or stale or dropped rows it skipped)."""

    partition_id: str
    task: str
    rows: list[int]


class RowsReleased(Event, tag="rows_released"):
    """Consumed rows went back to the task (an expired lease, a cancelled fetch)."""

    partition_id: str
    task: str
    rows: list[int]


class ConsumptionReset(Event, tag="consumption_reset"):
    """The task (every task: None) consumed nothing of the partition any more."""

    partition_id: str
    task: str | None


class LeaseGranted(Event, tag="lease_granted"):
    """A fetch holds its ``rows`` until acknowledged (or ``seconds`` pass)."""

    partition_id: str
    task: str
    lease_id: int
    rows: list[int]
    #: its length (None: held until acknowledged, no deadline)
    seconds: float | None = None


class LeaseAcked(Event, tag="lease_acked"):
    """A lease was acknowledged: its rows stay consumed for good."""

    partition_id: str
    task: str
    lease_id: int


class LeaseExpired(Event, tag="lease_expired"):
    """A lease ended unacknowledged (expired, or its fetch was cancelled)."""

    partition_id: str
    task: str
    lease_id: int


class UnitSuspended(Event, tag="unit_suspended"):
    """A storage unit went silent: its rows wait (neither handed out nor lost)."""

    unit: int


class UnitBack(Event, tag="unit_back"):
    """A suspended storage unit came back with its data, or (after `UnitLost`) a unit
    restarted under its id takes new rows: its old rows stay lost."""

    unit: int


class UnitLost(Event, tag="unit_lost"):
    """A storage unit is gone with its data (its rows follow as ``rows_removed``)."""

    unit: int


class Resync(Event, tag="resync"):
    """Events were missed (history gone, another controller incarnation, the watcher fell
    behind): ``snapshot`` is the state after event ``seq``; the events after it follow."""

    incarnation: str
    reason: str
    snapshot: ClusterSnapshot


AnyEvent = (
    PartitionCreated
    | PartitionSealed
    | PartitionCleared
    | PartitionRestored
    | RowsAdded
    | RowsRemoved
    | FieldsProduced
    | TagsChanged
    | RowsConsumed
    | RowsReleased
    | ConsumptionReset
    | LeaseGranted
    | LeaseAcked
    | LeaseExpired
    | UnitSuspended
    | UnitBack
    | UnitLost
    | Resync
)

for _kind in AnyEvent.__args__:
    _kind.kind = str(_kind.__struct_config__.tag)
del _kind

#: every kind a watch can select
EVENT_KINDS: tuple[str, ...] = tuple(t.kind for t in AnyEvent.__args__)


class WatchBatch(msgspec.Struct, array_like=True):
    """The reply to a `WatchNext`: events after its
    ``since``, and where the next call continues (``cursor``)."""

    incarnation: str
    cursor: int
    events: list[AnyEvent]
