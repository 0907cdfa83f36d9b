"""The controller's event log and its watchers: what answers ``client.watch()``.

The core's transitions record events (`tq_async._core._events`); the shell's
``_apply`` hands them to `WatchHub.drain`, which numbers them into an
`EventLog`, a bounded ring (the newest ``history`` events), and answers the parked
watchers once the loop finished its current pass (the events of every request handled in
that pass travel together).

A watcher long-polls: each `WatchNext` asks for the events
after ``since``; the controller answers at once when some match, else parks the request (an
entry in `WatchHub.parked` and a timer: no task) until they do or ``poll`` seconds pass
(an empty batch: ask again). Nothing is pushed, so a slow watcher costs the controller
nothing: the ring overwrites, and a watcher that fell behind it (or more than its
``max_lag``), or that counts in another controller incarnation, gets one
`Resync` with a snapshot instead of the missing events. A
cancelled watch (the client's ``Cancel``) leaves nothing behind. Replies skip the retry
cache: a retried ``WatchNext`` is simply answered again.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from .._core._events import partition_snapshot
from .._core._state import ControllerState
from .._errors import InvalidRequestError
from .._service._loop import SENT, Incoming
from .._wire._events import EVENT_KINDS, ClusterSnapshot, Event, Resync, WatchBatch
from .._wire._protocol import WatchNext, ok_reply

__all__ = ["DEFAULT_HISTORY", "EventLog", "WatchHub", "cluster_snapshot"]

#: events the controller keeps for watchers that resume (``since=``) or lag
DEFAULT_HISTORY = 65536


class EventLog:
    """The newest ``history`` events, numbered 1, 2, 3, ... (see the module docstring)."""

    def __init__(self, history: int = DEFAULT_HISTORY) -> None:
        if history < 1:
            raise InvalidRequestError(f"the watch history must hold >= 1 event, got {history}")
        #: this log's id: a position counted in another incarnation is not one of ours
        self.incarnation = secrets.token_hex(8)
        self.history = history
        self._ring: list[Event | None] = [None] * history
        #: the last event's number (0: none yet)
        self.last = 0

    @property
    def oldest(self) -> int:
        """The number of the oldest event still held."""
        return max(1, self.last - self.history + 1)

    def append(self, events: list[Event]) -> None:
        ring, n = self._ring, self.history
        for ev in events:
            self.last += 1
            ev.seq = self.last
            ring[self.last % n] = ev

    def get(self, seq: int) -> Event:
        """Event ``seq`` (``oldest <= seq <= last``)."""
        ev = self._ring[seq % self.history]
        assert ev is not None
        assert ev.seq == seq
        return ev


class WatchHub:
    """The event log of a controller shell and the answers to its ``WatchNext`` requests.

    ``shell`` is the `Shell` (untyped: it
    imports this module).
    """

    def __init__(self, shell: Any, history: int = DEFAULT_HISTORY) -> None:
        self.shell = shell
        self.log = EventLog(history)
        #: parked requests, by (client identity, request id): what they asked, their poll timer
        self.parked: dict[tuple[bytes, int], tuple[WatchNext, asyncio.TimerHandle]] = {}
        self._flush_due = False

    def drain(self) -> None:
        """Number the events the core recorded since the last call; the parked watchers are
        answered once the loop is done with what it is doing (events of many requests
        handled in one pass share one answer)."""
        outbox = self.shell.state.events
        if outbox.items:  # (most calls: nothing recorded, nothing to allocate)
            self.log.append(outbox.take())
            if self.parked and not self._flush_due:
                self._flush_due = True
                asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        self.drain()
        for key, (body, timer) in list(self.parked.items()):
            batch = self.answer(body)
            if batch is not None:
                del self.parked[key]
                timer.cancel()
                self._reply(*key, batch)

    def cancel(self, key: tuple[bytes, int]) -> bool:
        """The client gave up a parked request (its ``Cancel``): True if it was one."""
        parked = self.parked.pop(key, None)
        if parked is None:
            return False
        parked[1].cancel()
        return True

    def _poll_over(self, key: tuple[bytes, int]) -> None:
        parked = self.parked.pop(key, None)
        if parked is not None and not self.shell.stopping:
            body = parked[0]
            assert body.since is not None
            self._reply(*key, WatchBatch(self.log.incarnation, body.since, []))

    # ---- requests ----------------------------------------------------------------------------

    def on_watch_next(self, msg: Incoming, body: WatchNext) -> Any:
        shell = self.shell
        _check(shell.state, body)
        shell.state.events.start()  # recording from the first watch on
        self.drain()
        log = self.log
        if body.since is None:  # subscribe: where to go on from
            self._reply(msg.peer, msg.rid, WatchBatch(log.incarnation, log.last, []))
            return SENT
        batch = self.answer(body)
        if batch is not None:
            self._reply(msg.peer, msg.rid, batch)
            return SENT
        # parked without a task: answered by _flush, _poll_over, or dropped by cancel
        key = (msg.peer, msg.rid)
        timer = asyncio.get_running_loop().call_later(body.poll, self._poll_over, key)
        old = self.parked.pop(key, None)
        if old is not None:  # a retry of a parked request replaces it
            old[1].cancel()
        self.parked[key] = (body, timer)
        return SENT

    def answer(self, body: WatchNext) -> WatchBatch | None:
        """The events after ``body.since`` that match, a Resync, or None (none yet: then
        ``body.since`` moves past the events that did not match)."""
        log = self.log
        assert body.since is not None
        reason = self._lost(body)
        if reason is not None:
            snapshot = cluster_snapshot(self.shell.state, body.partition_id)
            resync = Resync(
                seq=log.last, incarnation=log.incarnation, reason=reason, snapshot=snapshot
            )
            return WatchBatch(log.incarnation, log.last, [resync])
        out: list[Any] = []
        seq = body.since
        kinds = set(body.kinds) if body.kinds is not None else None
        pid = body.partition_id
        while seq < log.last and len(out) < body.max_events:
            seq += 1
            ev = log.get(seq)
            if kinds is not None and ev.kind not in kinds:
                continue
            if pid is not None and getattr(ev, "partition_id", pid) != pid:
                continue
            out.append(ev)
        body.since = seq
        return WatchBatch(log.incarnation, seq, out) if out else None

    def _lost(self, body: WatchNext) -> str | None:
        """Why the events after ``body.since`` cannot be told (None: they can)."""
        log = self.log
        since = body.since
        assert since is not None
        if body.incarnation is not None and body.incarnation != log.incarnation:
            return (
                f"the position {body.incarnation}:{since} is of another controller "
                f"incarnation (this one is {log.incarnation}): restarted, or another controller"
            )
        if since > log.last:
            return f"the position {since} is past this controller's last event ({log.last})"
        if since < log.oldest - 1:
            return (
                f"events after {since} are gone: the controller keeps the last "
                f"{log.history} (the oldest is {log.oldest})"
            )
        if body.max_lag is not None and log.last - since > body.max_lag:
            return (
                f"the watcher fell {log.last - since} events behind, more than its "
                f"max_lag={body.max_lag}"
            )
        return None

    def _reply(self, peer: bytes, rid: int, batch: WatchBatch) -> None:
        endpoint = self.shell.endpoint
        if endpoint is not None:
            endpoint.send(peer, [ok_reply(rid, batch)])


def _check(state: ControllerState, body: WatchNext) -> None:
    """Unknown kinds, and (when subscribing) an unknown partition, are the caller's mistake."""
    if body.kinds is not None:
        unknown = [k for k in body.kinds if k not in EVENT_KINDS]
        if unknown:
            raise InvalidRequestError(
                f"unknown event kinds {unknown}; the kinds are {list(EVENT_KINDS)}"
            )
    pid = body.partition_id
    if body.since is None and pid is not None and pid not in state.partitions:
        raise InvalidRequestError(
            f"cannot watch partition {pid!r}: it does not exist; known partitions: "
            f"{sorted(state.partitions)[:20]} (watch every partition, partition_id=None, to "
            "see it created)"
        )


def cluster_snapshot(state: ControllerState, partition_id: str | None = None) -> ClusterSnapshot:
    """The partitions (only ``partition_id``, if given) and the units' states, now."""
    ids = [partition_id] if partition_id is not None else sorted(state.partitions)
    parts = [partition_snapshot(state.partitions[i]) for i in ids if i in state.partitions]
    units = {
        u: "lost" if u in state.dead_units else "suspended" if u in state.suspended else "up"
        for u in sorted(state.units)
    }
    return ClusterSnapshot(partitions=parts, units=units)
