"""The events the core's transitions record, for ``watch`` (see `tq_async._wire._events`).

An `Outbox` lives on the `ControllerState`; a transition
that changes what a watcher can see records an event right after the change, and the shell
takes them (`Outbox.take`) when it applies the transition's effects, numbers them and
hands them to the watchers. Nothing is recorded until the first watch starts
(`Outbox.start`): a controller nobody watches builds no events.

Consumption joins the event before it when that event is the same task's consumption of the
same partition that no watcher saw yet (`Outbox.joinable`, which the shell sets): a reader
taking batch after batch between two answers makes one ``rows_consumed``, not one a batch
(each cost the controller, and every watcher, a step).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from .._wire._events import (
    ConsumptionReset,
    Event,
    FieldsProduced,
    LeaseAcked,
    LeaseExpired,
    LeaseGranted,
    PartitionSnapshot,
    RowsAdded,
    RowsConsumed,
    RowsReleased,
    RowsRemoved,
    TagsChanged,
)
from ._arrays import live_rows

__all__ = ["JOINED_ROWS", "Outbox", "partition_snapshot"]

#: the most rows a `RowsConsumed` gathers from the consumption recorded after it
JOINED_ROWS = 8192


class Outbox:
    """Events recorded by transitions, in order, until the shell takes them."""

    __slots__ = ("items", "joinable", "on")

    def __init__(self) -> None:
        #: recording (a watch started once)
        self.on = False
        self.items: list[Event] = []
        #: the last event taken, when the rows its task consumes of its partition next may
        #: join it (`let_join`: the shell's to say, as no watcher can know it yet)
        self.joinable: RowsConsumed | None = None

    def start(self) -> None:
        """Record from now on."""
        self.on = True

    def take(self) -> list[Event]:
        """The events recorded since the last call."""
        items, self.items = self.items, []
        return items

    def let_join(self, event: RowsConsumed | None) -> None:
        """Consumption recorded next may join ``event``, taken already (None: nothing may
        join: a watcher may know the last event)."""
        self.joinable = event

    def add(self, event: Event) -> None:
        """Record ``event`` (built by the caller only when `on`)."""
        if self.on:
            self.items.append(event)

    # ---- the common ones, built only when recording ---------------------------------------------

    def rows_added(self, pid: str, rows: Sequence[int], keys: Sequence[str] | None) -> None:
        if self.on and rows:
            self.items.append(RowsAdded(partition_id=pid, rows=list(rows), keys=_keys(keys)))

    def rows_removed(self, pid: str, rows: Collection[int], reason: str) -> None:
        if self.on and rows:
            self.items.append(RowsRemoved(partition_id=pid, rows=sorted(rows), reason=reason))

    def produced(
        self, pid: str, rows: Sequence[int], fields: Sequence[str], tags: Sequence[Any] | None
    ) -> None:
        if not self.on:
            return
        self.items.append(FieldsProduced(partition_id=pid, rows=list(rows), fields=list(fields)))
        if tags is not None and any(tags):
            self.tags(pid, rows, [t or {} for t in tags])

    def tags(self, pid: str, rows: Sequence[int], tags: Sequence[Mapping[str, Any]]) -> None:
        if self.on and rows:
            self.items.append(
                TagsChanged(partition_id=pid, rows=list(rows), tags=[dict(t) for t in tags])
            )

    def consumed(self, pid: str, task: str, rows: Sequence[int]) -> None:
        if self.on and rows:
            last = self.joinable
            if (
                last is not None
                and not self.items  # (nothing recorded after it)
                and last.task == task
                and last.partition_id == pid
                and len(last.rows) < JOINED_ROWS
            ):
                last.rows += rows
                return
            self.items.append(RowsConsumed(partition_id=pid, task=task, rows=list(rows)))

    def released(self, pid: str, task: str, rows: Sequence[int]) -> None:
        if self.on and rows:
            self.items.append(RowsReleased(partition_id=pid, task=task, rows=list(rows)))

    def reset(self, pid: str, task: str | None) -> None:
        if self.on:
            self.items.append(ConsumptionReset(partition_id=pid, task=task))

    def lease(
        self, pid: str, task: str, lease_id: int, rows: Sequence[int], seconds: float | None
    ) -> None:
        if self.on:
            self.items.append(
                LeaseGranted(
                    partition_id=pid, task=task, lease_id=lease_id, rows=list(rows), seconds=seconds
                )
            )

    def lease_ended(self, pid: str, task: str, lease_id: int, *, acked: bool) -> None:
        if self.on:
            kind = LeaseAcked if acked else LeaseExpired
            self.items.append(kind(partition_id=pid, task=task, lease_id=lease_id))


def _keys(keys: Sequence[str] | None) -> list[str] | None:
    return None if keys is None else list(keys)


def partition_snapshot(p: Any) -> PartitionSnapshot:
    """A `Partition`'s live rows, fields, consumption, keys
    and open leases (``p`` untyped: the state module imports this one)."""
    rows, base, tags = live_rows(p), p.base, p.tags
    fields = {name: [r for r in rows if f.produced[r - base]] for name, f in p.fields.items()}
    consumed = {task: [r for r in rows if c[r - base]] for task, c in p.consumed.items()}
    return PartitionSnapshot(
        partition_id=p.partition_id,
        incarnation=p.incarnation,
        sealed=p.sealed,
        rows=rows,
        fields=fields,
        consumed=consumed,
        keys=dict(p.keys),
        leases={lease_id: lease.task for lease_id, lease in p.leases.items()},
        tags={r: dict(tags[r - base]) for r in rows if tags[r - base]},
    )
