"""The controller's event log and its watchers: what answers ``client.watch()``.

The core's transitions record events (`tq_async._core._events`); the shell's
``_apply`` hands them to `WatchHub.drain`, which numbers them into an
`EventLog`, a bounded ring (the newest ``history`` events), and answers the parked
watchers once the loop finished its current pass (the events of every request handled in
that pass travel together).

A watcher long-polls: each `WatchNext` asks for the events
after ``since``; the controller answers at once when some match, else parks the request (an
entry in `WatchHub.parked`, its ``poll`` deadline kept by one timer for all: no task) until
they do or ``poll`` seconds pass (an empty batch: ask again). Nothing is pushed, so a slow
watcher costs the controller nothing: the ring overwrites, and a watcher that fell behind it
(or more than its ``max_lag``), or that counts in another controller incarnation, gets one
`Resync` with a snapshot instead of the missing events. A
cancelled watch (the client's ``Cancel``) leaves nothing behind. Replies skip the retry
cache: a retried ``WatchNext`` is simply answered again.

What watchers cost the controller is bounded (`Pacer`): the CPU time spent answering them and
taking their requests is measured (the thread's: time the process waited for a core under
load is not theirs), plus what reading, decoding and dispatching each request costs beyond
its handler (`RequestCost`: that happens before the handler's clock starts, and was most of
a watcher's real cost; a request, and its answer, shared by several watchers of one client
count as theirs); once the charges pass ``WATCH_SHARE`` of the controller's time the
next answers wait, gathering every event of the wait. A request is answered after the loop's
current pass, so watchers asking in the same pass at the same position with the same filter
(those answered together ask again together) share one answer, encoded once. Events no parked
request's filter takes make no pass at all (`_Interest`: a pass that answers nobody costs
what a request does); the parked positions move past them with the next pass, which comes
before the ring or a ``max_lag`` would be outrun by them. The get_meta
path never waits on a watcher: events are numbered into the ring as transitions apply (a
list append), and answers go out after the current pass.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections import Counter
from typing import Any

import msgspec

from .._core._events import partition_snapshot
from .._core._state import ControllerState
from .._errors import InvalidRequestError
from .._service._loop import REQUESTS, SENT, Incoming, RequestStats
from .._transport._endpoints import READS, ReaderCost
from .._wire._events import (
    EVENT_KINDS,
    ClusterSnapshot,
    Event,
    Resync,
    RowsConsumed,
    WatchBatch,
)
from .._wire._protocol import WatchNext, encoder, ok_reply

__all__ = ["DEFAULT_HISTORY", "EventLog", "Pacer", "RequestCost", "WatchHub", "cluster_snapshot"]

#: events the controller keeps for watchers that resume (``since=``) or lag
DEFAULT_HISTORY = 65536
#: the share of the controller's time its watchers may take (see `Pacer`). With each request
#: priced at what reading it costs (`RequestCost`), at 0.08 a lone watcher of a `serve` taking
#: back-to-back puts was answered every ~1.2 ms (put -> event p99 2.0-6.0 ms, 1.4-4.6 ms above
#: the puts' own), at 0.15 every ~0.7 ms (1.6-5.0 ms, 0.5-2.3 above); W2 with 16 watchers
#: held at both (median of paired rounds 0.98 / 0.99 of none; RESULTS.md, twenty-first session)
WATCH_SHARE = 0.15
#: the watchers' time saved up while they are quiet: answers that go out at once
WATCH_BURST = 0.002
#: `RequestCost` averages over windows of at least this many requests (read in the sampled
#: reader calls: one in 16) ...
COST_WINDOW_REQUESTS = 32
#: ... and this many seconds of the clock
COST_WINDOW_SECONDS = 0.05


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
        #: a watcher may know the events up to this one (answered, or a position at or past
        #: them given out): they stay as they are (see `Outbox.joinable`)
        self.sealed = 0

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

    def seal(self, seq: int | None = None) -> None:
        """A watcher may know the events up to ``seq`` (None: every event)."""
        seq = self.last if seq is None else min(seq, self.last)
        if seq > self.sealed:
            self.sealed = seq

    def get(self, seq: int) -> Event:
        """Event ``seq`` (``oldest <= seq <= last``)."""
        ev = self._ring[seq % self.history]
        assert ev is not None
        assert ev.seq == seq
        return ev


class Pacer:
    """How much of the controller's time its watchers may take: a token bucket of seconds.

    Time spent on watchers (answering them, taking their requests) is `charge`d; the bucket
    refills at ``share`` seconds per second, up to ``burst``. While it holds credit, watchers
    are answered at once; once spent, the next answer waits `delay` seconds, and every event
    of that wait goes in it. So a quiet controller answers an event within the pass that made
    it, and a busy one with many watchers answers each of them less often, with more events,
    never spending more than ``share`` of its time on them. Pure: ``now`` is the caller's.
    """

    __slots__ = ("_at", "_credit", "burst", "share")

    def __init__(self, share: float = WATCH_SHARE, burst: float = WATCH_BURST) -> None:
        if not 0 < share <= 1 or burst < 0:
            raise InvalidRequestError(
                f"a watch share must be in (0, 1] and a burst >= 0, got {share} and {burst}"
            )
        self.share = share
        self.burst = burst
        self._credit = burst
        self._at: float | None = None

    def charge(self, now: float, seconds: float) -> None:
        """``seconds`` were spent on watchers."""
        self._refill(now)
        self._credit -= seconds

    def delay(self, now: float) -> float:
        """Seconds until watchers may be answered again (0: now)."""
        self._refill(now)
        return 0.0 if self._credit > 0 else -self._credit / self.share

    def _refill(self, now: float) -> None:
        if self._at is not None and now > self._at:
            self._credit = min(self.burst, self._credit + (now - self._at) * self.share)
        self._at = now if self._at is None else max(self._at, now)


class RequestCost:
    """What reading, decoding, dispatching and answering a request costs this process beyond
    its handler, in CPU seconds.

    A watcher's request costs more than its handler: the socket read, the decoding and the
    dispatch happen before the handler's clock starts, and on a small machine they were most
    of a watcher's real cost. They are about the same for every request, so they are
    estimated from all of them: the sampled reader calls' CPU time per request they handled
    (`ReaderCost`), less what the sampled handlers took (`RequestStats`), over windows of at
    least `COST_WINDOW_REQUESTS` requests read in sampled calls and `COST_WINDOW_SECONDS`.
    (The loop's CPU per request, as this was first estimated, also held the work no request's
    intake is: the replies of the units a put is forwarded to, timers, the tasks handlers
    start -- ~140 against ~30-60 us a request under a stream of puts, and the pacer charged
    every watcher's request that much.) Pure: the caller passes the clock and the figures.
    """

    __slots__ = ("_at", "_last", "seconds")

    def __init__(self) -> None:
        #: the latest window's estimate (0: no window yet)
        self.seconds = 0.0
        self._at: float | None = None
        self._last = (0.0, 0, 0, 0.0)

    def update(self, now: float, reads: ReaderCost, stats: RequestStats) -> float:
        """The estimate, taking a new window when the last one is long enough."""
        figures = (reads.seconds, reads.messages, stats.sampled, stats.handler_seconds)
        if self._at is None:
            self._at, self._last = now, figures
            return self.seconds
        read0, messages0, sampled0, handlers0 = self._last
        n, sampled = reads.messages - messages0, stats.sampled - sampled0
        if n >= COST_WINDOW_REQUESTS and sampled and now - self._at >= COST_WINDOW_SECONDS:
            handler = (stats.handler_seconds - handlers0) / sampled
            self.seconds = max(0.0, (reads.seconds - read0) / n - handler)
            self._at, self._last = now, figures
        return self.seconds


class _Parked:
    """A parked ``WatchNext``: what it asked, and when its ``poll`` is over."""

    __slots__ = ("body", "deadline")

    def __init__(self, body: WatchNext, deadline: float) -> None:
        self.body = body
        self.deadline = deadline


class WatchHub:
    """The event log of a controller shell and the answers to its ``WatchNext`` requests.

    ``shell`` is the `Shell` (untyped: it imports this module). Watchers that ask the same
    (same position, same filter: those answered together come back together) share one
    answer, encoded once. How often they are answered is the `Pacer`'s.
    """

    def __init__(
        self,
        shell: Any,
        history: int = DEFAULT_HISTORY,
        share: float = WATCH_SHARE,
        burst: float = WATCH_BURST,
    ) -> None:
        self.shell = shell
        self.log = EventLog(history)
        self.pacer = Pacer(share, burst)
        #: parked requests, by (client identity, request id)
        self.parked: dict[tuple[bytes, int], _Parked] = {}
        #: the flush to come (None: none due)
        self._flush_handle: asyncio.Handle | None = None
        #: the one timer that ends polls, and when it fires
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_at = math.inf
        #: answers sent (a batch shared by several watchers counts once per watcher)
        self.answers = 0
        #: what a request costs beyond its handler, and whether watchers pay it (not when the
        #: program's own code shares the loop: `local_cluster`)
        self.cost = RequestCost()
        self.price_requests = True
        #: the parked requests' filters, counted as they park and go (`_Interest`)
        self._interest = _Interest()
        #: events numbered since the last flush that no parked request wanted
        self._unwanted = 0
        #: the last pass answered watchers and no event was numbered since
        self._answered = False

    def drain(self) -> None:
        """Number the events the core recorded since the last call; the parked watchers are
        answered once the loop is done with what it is doing (events of many requests
        handled in one pass share one answer), or later, as the `Pacer` says."""
        outbox = self.shell.state.events
        if outbox.items:  # (most calls: nothing recorded, nothing to allocate)
            events = outbox.take()
            self.log.append(events)
            if self.parked and self._flush_handle is None:
                if self._interest.takes(events):
                    self._schedule_flush()
                else:
                    # nobody waits for these: no pass (it would cost what a request does),
                    # unless so many went by that the parked positions must move on past them
                    # before the ring forgets them (a Resync for events nobody wanted)
                    self._unwanted += len(events)
                    if self._unwanted > self._interest.lag(self.log.history // 4):
                        self._schedule_flush()
            # consumption may join the last event while a pass is due (it seals the log: an
            # event grows for a short while, and never once a watcher may know it), and the
            # first one after a pass that answered, while its watchers ask again (at most
            # one such event a pass: the ring's memory stays bounded if none comes back)
            last = events[-1]
            joins = self._flush_handle is not None or self._answered
            self._answered = False
            outbox.let_join(last if joins and type(last) is RowsConsumed else None)

    def _unpark(self, key: tuple[bytes, int]) -> _Parked | None:
        """Take a parked request out (None: none under ``key``)."""
        parked = self.parked.pop(key, None)
        if parked is not None:
            self._interest.remove(parked.body)
        return parked

    def _schedule_flush(self) -> None:
        loop = asyncio.get_running_loop()
        wait = self.pacer.delay(loop.time())
        if wait <= 0:
            self._flush_handle = loop.call_soon(self._flush)
        else:
            self._flush_handle = loop.call_later(wait, self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        loop = asyncio.get_running_loop()
        if self.pacer.delay(loop.time()) > 0:  # requests taken since spent the credit
            self._schedule_flush()
            return
        t0 = time.thread_time()
        self.drain()
        self.shell.state.events.let_join(None)  # (joined while this pass was due)
        self._unwanted = 0
        groups: dict[tuple[Any, ...], list[tuple[bytes, int]]] = {}
        for key, parked in self.parked.items():
            groups.setdefault(_position(parked.body), []).append(key)
        sent = watchers = 0
        for keys in groups.values():
            first = self.parked[keys[0]].body
            batch = self.answer(first)
            if batch is None:  # nothing matched: all of them skip what did not
                for key in keys[1:]:
                    self.parked[key].body.since = first.since
                continue
            raw = msgspec.Raw(encoder.encode(batch))  # once for every watcher of the group
            for key in keys:
                gone = self._unpark(key)
                assert gone is not None
                watchers += gone.body.watchers
                sent += 1
                self._send(*key, raw)
        self._answered = sent > 0
        spent = time.thread_time() - t0
        if not sent and self.price_requests:
            # a pass for nothing costs what taking a request does: filtered watchers must
            # not buy one after every request
            spent += self.cost.seconds
        # an answer to a request shared by a client's watchers counts as theirs, as the
        # request did (each of them takes every event of it)
        self.pacer.charge(loop.time(), spent * (watchers / sent if sent else 1))

    def close(self) -> None:
        """The controller stopped: its timers go (each keeps the hub, and the controller
        with it, alive until it fires)."""
        for handle in (self._flush_handle, self._sweep):
            if handle is not None:
                handle.cancel()
        self._flush_handle, self._sweep, self._sweep_at = None, None, math.inf

    def cancel(self, key: tuple[bytes, int]) -> bool:
        """The client gave up a parked request (its ``Cancel``): True if it was one."""
        return self._unpark(key) is not None

    def _park(self, key: tuple[bytes, int], body: WatchNext) -> None:
        loop = asyncio.get_running_loop()
        # a retry of a parked request (a client resends one silent for retry_after, which
        # may be shorter than the poll) replaces it, but its poll ends when the first one's
        # would: restarted at every resend, an idle watcher would never be answered
        retried = self._unpark(key)
        deadline = loop.time() + body.poll if retried is None else retried.deadline
        self.parked[key] = _Parked(body, deadline)
        self._interest.add(body)
        if deadline < self._sweep_at:
            if self._sweep is not None:
                self._sweep.cancel()
            self._sweep_at = deadline
            self._sweep = loop.call_at(deadline, self._end_polls)

    def _end_polls(self) -> None:
        """Answer the requests whose ``poll`` is over with an empty batch (ask again)."""
        self._sweep, self._sweep_at = None, math.inf
        loop = asyncio.get_running_loop()
        now = loop.time()
        over = [key for key, p in self.parked.items() if p.deadline <= now]
        for key in over:
            parked = self._unpark(key)
            assert parked is not None
            body = parked.body
            assert body.since is not None
            if not self.shell.stopping:
                # an empty batch moves the watcher into this incarnation: one whose position
                # is of another (its flush not yet due) gets its Resync instead
                lost = self._lost(body) is not None
                empty = WatchBatch(self.log.incarnation, body.since, [])
                self._send(*key, self.answer(body) if lost else empty)
        if self.parked:
            self._sweep_at = min(p.deadline for p in self.parked.values())
            self._sweep = loop.call_at(self._sweep_at, self._end_polls)

    # ---- requests ----------------------------------------------------------------------------

    def on_watch_next(self, msg: Incoming, body: WatchNext) -> Any:
        t0 = time.thread_time()
        try:
            return self._on_watch_next(msg, body)
        finally:
            now = asyncio.get_running_loop().time()
            spent = time.thread_time() - t0
            if self.price_requests:
                spent += self.cost.update(now, READS, REQUESTS)
            # a request a client's watchers share counts as theirs: the pacer paces watchers
            self.pacer.charge(now, spent * body.watchers)

    def _on_watch_next(self, msg: Incoming, body: WatchNext) -> Any:
        shell = self.shell
        _check(shell.state, body)
        shell.state.events.start()  # recording from the first watch on
        self.drain()
        log = self.log
        if body.since is None:  # subscribe: where to go on from
            self._seal()
            self._send(msg.peer, msg.rid, WatchBatch(log.incarnation, log.last, []))
            return SENT
        self._seal(body.since)  # (a watcher stands there: what it saw stays as it was)
        # parked without a task: answered by _flush (after this pass: the watchers asking in
        # it share one answer; later if the pacer says so), _end_polls, or dropped by cancel
        self._park((msg.peer, msg.rid), body)
        # (a position of another incarnation is answered too, even at our last number: a
        # restarted controller counts from 0 again, and its Resync is due at once)
        due = body.since != log.last or body.incarnation not in (None, log.incarnation)
        if due and self._flush_handle is None:
            self._schedule_flush()
        return SENT

    def answer(self, body: WatchNext) -> WatchBatch | None:
        """The events after ``body.since`` that match, a Resync, or None (none yet: then
        ``body.since`` moves past the events that did not match)."""
        log = self.log
        assert body.since is not None
        self._seal()  # the answer's position, and what it tells, are a watcher's now
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

    def _seal(self, seq: int | None = None) -> None:
        """A watcher may know the events up to ``seq`` (None: every event): none of them
        grows any more."""
        self.log.seal(seq)
        outbox = self.shell.state.events
        if outbox.joinable is not None and outbox.joinable.seq <= self.log.sealed:
            outbox.let_join(None)

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

    def _send(self, peer: bytes, rid: int, payload: Any) -> None:
        self.answers += 1
        endpoint = self.shell.endpoint
        if endpoint is not None:
            endpoint.send(peer, [ok_reply(rid, payload)])


class _Interest:
    """The filters of the parked requests, counted as requests park and go: which events one
    of them takes, and how many events none takes may go by before their positions must
    move on (`lag`: a quarter of the ring, and half the smallest ``max_lag``, so neither is
    reached for events nobody wanted). O(1) to keep; a check walks the distinct filters."""

    __slots__ = ("everything", "filters", "lags")

    def __init__(self) -> None:
        #: parked requests with no filter (they take every event)
        self.everything = 0
        self.filters: Counter[tuple[frozenset[str] | None, str | None]] = Counter()
        self.lags: Counter[int] = Counter()

    def add(self, body: WatchNext) -> None:
        if body.kinds is None and body.partition_id is None:
            self.everything += 1
        else:
            self.filters[_filter(body)] += 1
        if body.max_lag is not None:
            self.lags[body.max_lag] += 1

    def remove(self, body: WatchNext) -> None:
        if body.kinds is None and body.partition_id is None:
            self.everything -= 1
        else:
            _drop(self.filters, _filter(body))
        if body.max_lag is not None:
            _drop(self.lags, body.max_lag)

    def lag(self, ring: int) -> int:
        return min(ring, *(lag // 2 for lag in self.lags)) if self.lags else ring

    def takes(self, events: list[Event]) -> bool:
        """Whether a parked request's filter takes one of ``events``."""
        if self.everything:
            return True
        for ev in events:
            kind = ev.kind
            for kinds, pid in self.filters:
                if (kinds is None or kind in kinds) and (
                    pid is None or getattr(ev, "partition_id", pid) == pid
                ):
                    return True
        return False


def _filter(body: WatchNext) -> tuple[frozenset[str] | None, str | None]:
    return (None if body.kinds is None else frozenset(body.kinds), body.partition_id)


def _drop(counts: Counter[Any], key: Any) -> None:
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]


def _position(body: WatchNext) -> tuple[Any, ...]:
    """What a ``WatchNext``'s answer depends on: requests alike share one answer."""
    kinds = None if body.kinds is None else tuple(body.kinds)
    return (body.since, body.incarnation, body.partition_id, kinds, body.max_events, body.max_lag)


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
