"""Put leases: a pure part of the controller's core.

A put places rows first (`PutLeases.begin`) and makes their cells visible later
(`PutLeases.commit`). Meanwhile the new rows are reserved under a *put lease*, renewed
by the producer while its columns travel (`PutLeases.renew`). When a lease lapses (a
dead producer) the rows are reclaimed, never visible. No loop, no clock:
`ControllerCore` calls it with ``now`` and arms its deadlines.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import PartitionNotFound, RowsNotFound
from .._logging import get_logger
from .._wire._events import PartitionCreated
from .._wire._protocol import Placement
from ._effects import Effects
from ._events import Outbox
from ._gone import cleared_under_put
from ._state import ControllerState, Partition, PutLease, Wakeup

__all__ = ["PutLeases"]

log = get_logger(__name__)


class PutLeases:
    """The put leases of ``state``'s partitions.

    Args:
        state: the controller's state.
        seconds: the lease (``Deadlines.put_lease``).
        ids: the core's id counter (put ids and lease ids never collide).
        arm: ``arm(deadline, "put", put_id)`` schedules `lapse`.
        clear: ``clear(partition, rows)`` drops rows and returns the effects.
    """

    def __init__(
        self,
        state: ControllerState,
        seconds: float,
        ids: itertools.count[int],
        arm: Callable[[float, str, int], None],
        clear: Callable[[Partition, Sequence[int]], Effects],
    ) -> None:
        self.state = state
        self.put_lease = seconds
        self._ids = ids
        self._arm = arm
        self._clear = clear
        #: put id -> the partition holding it (gone with the partition)
        self.home: dict[int, Partition] = {}

    def live(self, put_id: int, deadline: float) -> bool:
        """Whether a put lease still ends at ``deadline`` (not committed or renewed)."""
        p = self.home.get(put_id)
        return p is not None and p.put_leases[put_id].deadline == deadline

    def begin(
        self,
        partition_id: str,
        headers: Sequence[Any],
        n_rows: int,
        rows: Sequence[int] | None,
        keys: Sequence[str] | None,
        now: float,
        *,
        lease: bool = True,
        host: str = "",
    ) -> tuple[Placement, Effects]:
        """Place a put. New rows are reserved under a put lease (unless ``lease`` is False:
        a put the controller completes itself) until `commit`. ``host``: the producer's
        host id (new rows prefer a unit there; see `tq_async._core._placement`)."""
        before = self.state.partitions.get(partition_id)
        first_new = before.n_rows if before is not None else 0
        got, units, wakeups = self.state.put_begin(partition_id, headers, n_rows, rows, keys, host)
        placement = Placement(got, units)
        p = self.state.partitions[partition_id]
        if self.state.events.on:
            _placed_events(self.state.events, p, before is None, got, first_new, rows, keys)
        placement.incarnation = p.incarnation
        if keys is not None:  # a KV put's meta names every field its keys already have
            at = [r - p.base for r in got]
            placement.fields = [f for f, fd in p.fields.items() if all(fd.produced[i] for i in at)]
        if lease and rows is None:
            new = [r for r in got if r >= first_new]
            if keys is not None and p.put_leases:
                new += _being_created(p, got, first_new)
            if new:
                placement.put_id = self.hold(p, new, now)
                placement.put_lease = self.put_lease
        return placement, Effects(wakeups=wakeups)

    def hold(self, p: Partition, rows: Sequence[int], now: float) -> int:
        """Put new ``rows`` of ``p`` under a put lease (its id): until the put commits, a
        lapse or an abort reclaims them, and a journal records them as a put to abort when
        it recovers (a controller that dies meanwhile leaves no row nobody will write)."""
        put_id = next(self._ids)
        p.put_leases[put_id] = PutLease(put_id, list(rows), now + self.put_lease)
        self.home[put_id] = p
        self._arm(now + self.put_lease, "put", put_id)
        return put_id

    def renew(self, put_ids: Sequence[int], now: float) -> None:
        """The producer is alive and still writing: push the put leases' deadlines."""
        for put_id in put_ids:
            p = self.home.get(put_id)
            if p is not None:
                put = p.put_leases[put_id]
                put.deadline = now + self.put_lease
                self._arm(put.deadline, "put", put_id)

    def commit(
        self,
        partition_id: str,
        rows: Sequence[int],
        fields: Sequence[str],
        tags: Sequence[Any] | None,
        versions: Sequence[int] | None,
        put_id: int = 0,
        incarnation: str | None = None,
    ) -> Effects:
        """Make a put visible: cells produced, tags and versions applied, put lease done.

        ``incarnation`` (from a BatchMeta or the placement) must be the partition's own.
        """
        p = self.state.partitions.get(partition_id)
        if p is None or (incarnation is not None and incarnation != p.incarnation):
            if put_id:  # its rows were placed in the partition: cleared since
                error = PartitionNotFound if p is None else RowsNotFound
                raise error(cleared_under_put(partition_id))
            p = self.state.partition(partition_id)
            p.check_incarnation(incarnation)
        if put_id and self.home.get(put_id) is not p:
            raise RowsNotFound(
                f"the put into partition {partition_id!r} was not committed within its "
                f"put lease ({self.put_lease} s without a renewal), so its rows were "
                "reclaimed; put the batch again"
            )
        try:
            gained = p.commit(rows, fields, tags, versions)
        except RowsNotFound:
            gone = p.first_missing(rows)
            if gone is None or gone in p.lost:
                raise
            # its rows existed when it was placed: removed since (a clear, kv_clear, auto-clear)
            raise RowsNotFound(
                f"row {gone} of partition {partition_id!r} was removed (a clear, kv_clear or "
                "auto-clear) while this put wrote it; nothing was committed: put again (a "
                "removed key is a new key then)"
            ) from None
        if put_id:
            del p.put_leases[put_id]
            del self.home[put_id]
        events = self.state.events
        if events.on:  # (a put's hot path: no call while nobody watches)
            events.produced(partition_id, rows, fields, tags)
        return Effects(wakeups=[Wakeup(partition_id, t) for t in gained])

    def undo(self, partition_id: str, rows: Sequence[int], incarnation: str) -> Effects:
        """A put the controller completes itself (no put lease) failed after placing new
        ``rows``: drop those still alive (unless the partition was cleared meanwhile)."""
        p = self.state.partitions.get(partition_id)
        if p is None or p.incarnation != incarnation:
            return Effects()
        # rows may be gone already: lost with their unit
        alive = [r for r in rows if p.is_alive(r)]
        return self._clear(p, alive) if alive else Effects()

    def abort(self, put_ids: Sequence[int]) -> Effects:
        """The producer gave up these puts: reclaim their rows now (never visible).

        Unknown ids (committed, lapsed, of a cleared partition) are ignored.
        """
        fx = Effects()
        for put_id in put_ids:
            p = self.home.get(put_id)
            if p is not None:
                rows = self._reclaim(p, put_id, fx)
                log.debug("put aborted: its rows reclaimed", partition=p.partition_id, rows=rows)
        return fx

    def lapse(self, put_id: int, deadline: float, fx: Effects) -> None:
        """A producer stopped renewing its put: reclaim the rows (never visible)."""
        p = self.home.get(put_id)
        if p is None or p.put_leases[put_id].deadline != deadline:
            return
        rows = self._reclaim(p, put_id, fx)
        log.warning(
            "put lease lapsed: reclaiming the rows of an uncommitted put",
            partition=p.partition_id,
            rows=rows,
        )

    def _reclaim(self, p: Partition, put_id: int, fx: Effects) -> int:
        """Drop put ``put_id`` of ``p`` and clear its new rows; how many there were."""
        put = p.put_leases.pop(put_id)
        del self.home[put_id]
        # a row with any cell produced was committed (by a client that sent no put id), and
        # one with tags was tagged by another call (a kv tag of the key this put created)
        fields = [f.produced for f in p.fields.values()]
        tags, base = p.tags, p.base
        rows = [
            r
            for r in put.rows
            if p.is_alive(r) and tags[r - base] is None and not any(f[r - base] for f in fields)
        ]
        if rows and p.put_leases and any(p.row_keys[r - base] is not None for r in rows):
            # a key another open put binds too is left to it (see `_being_created`)
            others = {r for other in p.put_leases.values() for r in other.rows}
            rows = [r for r in rows if r not in others]
        if rows:
            fx.add(self._clear(p, rows))
        return len(rows)


def _being_created(p: Partition, rows: Sequence[int], first_new: int) -> list[int]:
    """Of the existing ``rows`` a keyed put binds, those another open put is still creating
    (no cell produced, no tag): this put holds them under its own put lease too, so the
    other one's giving up leaves them to this one (and this one's, to the other)."""
    fields = [f.produced for f in p.fields.values()]
    tags, base = p.tags, p.base
    bare = [
        r
        for r in rows
        if r < first_new and tags[r - base] is None and not any(f[r - base] for f in fields)
    ]
    if not bare:
        return []
    open_rows = {r for put in p.put_leases.values() for r in put.rows}
    return [r for r in bare if r in open_rows]


def _placed_events(
    out: Outbox,
    p: Partition,
    created: bool,
    got: Sequence[int],
    first_new: int,
    rows: Sequence[int] | None,
    keys: Sequence[str] | None,
) -> None:
    """The partition created (``created``), and the new rows of a placement (with keys)."""
    if created:
        out.add(PartitionCreated(partition_id=p.partition_id, incarnation=p.incarnation))
    if rows is not None:
        return  # existing rows: nothing new
    if keys is None:
        out.rows_added(p.partition_id, [r for r in got if r >= first_new], None)
        return
    new = {r: k for k, r in zip(keys, got, strict=True) if r >= first_new}
    out.rows_added(p.partition_id, list(new), list(new.values()))
