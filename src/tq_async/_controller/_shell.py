"""The plumbing every part of the controller service shares.

`Shell` holds the core and what its parts use to act on the core's answers: applying
the core's effects, the one deadline timer, the reply cache that answers retried requests,
parking requests that must wait, and spawning tasks.
`ControllerServer` builds one and hands it to each of its
parts (the links to the storage units, the put path, the get path, the other calls), as the
client hands its ``Links`` to its paths.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import nullcontext
from functools import partial
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup

from .._core._state import ControllerState, Wakeup
from .._core._transitions import ControllerCore, Effects
from .._errors import ClosedError, TQError, TQTimeoutError
from .._logging import get_logger
from .._service._loop import Incoming
from .._service._metrics import Metrics
from .._service._parking import ParkingLot
from .._wire._protocol import MetaReply, Placement, error_reply, ok_reply
from ._watch import WatchHub

__all__ = ["FreeRows", "SendError", "Sends", "Shell"]

log = get_logger(__name__)

#: replies remembered for deduplicating retried requests (about 1 KiB each)
_REPLY_CACHE = 8192
#: clients whose resend period (`Hello.refresh`) is remembered (the oldest are forgotten:
#: their waiting requests are then never taken for a dead client's)
_REFRESH_CACHE = 16384
#: a waiting request of a ZMQ client not resent for this many of its resend periods is its
#: dead client's (it resends one every ``retry_after``: a live client misses no 3 in a row)
_MISSED_REFRESHES = 3

#: ``(peer, rid, exception, op)``: answer a request with an error (the service's own)
SendError = Callable[[bytes, int, BaseException, str], None]
#: ``(partition, rows by unit, incarnation)``: tell the storage units to free rows
FreeRows = Callable[[str, Mapping[int, "list[int] | None"], "str | None"], None]


class Sends(Protocol):
    """Where replies go: the ROUTER socket (a durable controller's holds them until written)."""

    def send(self, peer: bytes, frames: Sequence[Any]) -> None: ...


class Shell:
    """The controller's shared plumbing (see the module docstring).

    Args:
        core: the pure state machine every change goes through.
        metrics: where requests are counted.
        send_error: how the service answers with an error (it logs what is not the
            caller's fault).
    """

    def __init__(self, core: ControllerCore, metrics: Metrics, send_error: SendError) -> None:
        self.core = core
        self.metrics = metrics
        self.send_error = send_error
        #: requests parked under what they wait for: ``(partition, task)``, "room", "admission"
        self.lot = ParkingLot()
        #: set while shutting down: units going away then are not "lost"
        self.stopping = False
        #: the ROUTER socket, while serving
        self.endpoint: Sends | None = None
        self.tg: TaskGroup | None = None
        #: requests that are waiting, by (client identity, request id)
        self.pending: dict[tuple[bytes, int], anyio.CancelScope] = {}
        #: recent replies by (client identity, request id), for retried requests
        self.replies: OrderedDict[tuple[bytes, int], bytes] = OrderedDict()
        #: recent answers a late ``Cancel`` undoes (its caller gave up before the reply
        #: reached it: an admitted rollout, recycled rows taken), by (client identity,
        #: request id); the last ``_REPLY_CACHE``: a client cancels within a round trip
        self.undos: OrderedDict[tuple[bytes, int], Callable[[], None]] = OrderedDict()
        #: what frees rows on the storage units (the links to them, once built)
        self.free_rows: FreeRows = _nowhere
        #: the event log and its watchers (``client.watch()``)
        self.watch = WatchHub(self)
        #: told of what a transition no request asked for changed (`apply_unasked`): a
        #: durable controller's journal writes it (None: no journal)
        self.unasked: Callable[[Effects], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        #: the timers of `call_later` still to fire
        self._later: set[asyncio.TimerHandle] = set()
        #: a ZMQ client's resend period by identity (`Hello.refresh`), and when each of its
        #: waiting requests was last heard of: one not resent in time is a dead client's
        self._refresh: OrderedDict[bytes, float] = OrderedDict()
        self._heard: dict[tuple[bytes, int], float] = {}
        #: waiting requests ended as their client's (`_sweep`): answered with nothing
        self._dropped: set[tuple[bytes, int]] = set()
        #: when the ``timeout`` of each waiting request of a client that resends ends: one
        #: `_sweep` ended runs again when resent, with what is left of it (the last
        #: ``_REPLY_CACHE``)
        self._ends: OrderedDict[tuple[bytes, int], float] = OrderedDict()
        #: requests whose ``Cancel`` came before them (a ZMQ client's reconnects: each of its
        #: connections is read in its own order), not to be run (the last ``_REPLY_CACHE``)
        self._cancelled_first: OrderedDict[tuple[bytes, int], None] = OrderedDict()
        self._sweep_timer: asyncio.TimerHandle | None = None
        self._sweep_at = float("inf")

    @property
    def state(self) -> ControllerState:
        """The core's state, for reading: every change goes through a transition of
        `core` (``tests/project/test_layering.py`` checks the controller's modules)."""
        return self.core.state

    # ---- effects -----------------------------------------------------------------------------

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def apply(self, fx: Effects) -> None:
        """Do what a transition of the core left to do."""
        self.watch.drain()
        self._notify(fx.wakeups)
        for partition_id, incarnation, by_unit in fx.free:
            self.free_rows(partition_id, by_unit, incarnation)
        for policy, n in fx.stale:
            self.metrics.stale(policy, n)
        if fx.room:
            self.lot.unpark("room")
        if fx.admission:
            self.lot.unpark("admission")
        self.rearm()

    def apply_unasked(self, fx: Effects) -> None:
        """`apply` what a transition no request asked for left to do (a deadline passed, a
        storage unit's link came or went): the journal, if any, writes what it changed
        (rows lost with a unit stay lost across a restart)."""
        if self.unasked is not None:
            self.unasked(fx)
        self.apply(fx)

    def _notify(self, wakeups: Sequence[Wakeup]) -> None:
        """Wake the get_metas the wake-ups concern (a whole partition when no task is named)."""
        for w in wakeups:
            if w.task_name is not None:
                self.lot.unpark((w.partition_id, w.task_name))
            else:
                self.lot.unpark_if(partial(_of_partition, w.partition_id))

    def rearm(self) -> None:
        """Keep one timer armed at the core's next deadline."""
        at = self.core.next_deadline()
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None and not self.stopping:
            self._timer = asyncio.get_running_loop().call_at(at, self._on_deadline)

    def _on_deadline(self) -> None:
        self._timer, self._timer_at = None, None
        self.apply_unasked(self.core.advance(self.now()))

    def stop(self) -> None:
        """Shutting down: no timer fires any more, units going away are not "lost"."""
        self.stopping = True
        if self._timer is not None:
            self._timer.cancel()
        # (an armed timer keeps what it calls alive: the stopped controller, its units' cells)
        for handle in self._later:
            handle.cancel()
        self._later.clear()
        self.watch.close()
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()

    def call_later(self, delay: float, callback: Callable[..., None], *args: Any) -> None:
        """Run ``callback(*args)`` in ``delay`` seconds, unless the controller stops first."""
        if self.stopping:
            return
        later = self._later

        def fire() -> None:
            later.discard(handle)
            callback(*args)

        handle = asyncio.get_running_loop().call_later(delay, fire)
        later.add(handle)

    def peer_gone(self, peer: bytes) -> None:
        """A same-host client's connection ended (its process exited or was killed): its
        requests still waiting end as if it had cancelled them (it never reads a reply, and
        a get_meta woken later would take the task's rows for nobody), and the admission
        slots it acquired and never put go back (it will never put them), those of the
        holder it named too."""
        for key in [k for k in self.pending if k[0] == peer]:
            self.pending[key].cancel()
        for key in [k for k in self.watch.parked if k[0] == peer]:
            self.watch.cancel(key)
        if self.core.peer_gone(peer):  # (its own waiting acquire_rollout is cancelled)
            self.apply_unasked(Effects(admission=True))

    def resends_every(self, peer: bytes, refresh: float | None) -> None:
        """A client said (`Hello.refresh`) it resends a request still waiting every
        ``refresh`` seconds (None: it does not, e.g. over a Unix socket, whose end is told)."""
        self._refresh.pop(peer, None)
        if refresh is not None and refresh > 0:
            self._refresh[peer] = refresh
            if len(self._refresh) > _REFRESH_CACHE:
                self._refresh.popitem(last=False)

    def _heard_of(self, key: tuple[bytes, int]) -> None:
        """A waiting request of a client that resends was sent (again) now."""
        refresh = self._refresh.get(key[0])
        if refresh is None:
            return
        now = self.now()
        self._heard[key] = now
        self._arm_sweep(now + refresh * _MISSED_REFRESHES)

    def _time_left(self, key: tuple[bytes, int], timeout: float) -> float:
        """What is left of the ``timeout`` of a client's waiting request that resends it:
        counted from its first run (`_sweep` may end it, and its resend runs it again)."""
        now = self.now()
        ends = self._ends
        end = ends.setdefault(key, now + timeout)
        if len(ends) > _REPLY_CACHE:
            ends.popitem(last=False)
        return max(end - now, 1e-6)  # (0 would be no timeout at all)

    def _arm_sweep(self, at: float) -> None:
        """One timer for all the waiting requests that must be resent (none: no timer)."""
        if at >= self._sweep_at or self.stopping:
            return
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
        self._sweep_at = at
        self._sweep_timer = asyncio.get_running_loop().call_at(at, self._sweep)

    def _sweep(self) -> None:
        """End the waiting requests their client stopped resending (it was killed: ZMQ
        tells nothing) as a ``Cancel`` would, with no answer: a client alive after all
        (a loop blocked that long) resends it, and it runs again."""
        self._sweep_timer, self._sweep_at = None, float("inf")
        now, refresh = self.now(), self._refresh
        due = float("inf")
        for key, heard in list(self._heard.items()):
            period = refresh.get(key[0])
            if period is None:  # forgotten (`_REFRESH_CACHE`): never taken for dead
                del self._heard[key]
                continue
            end = heard + period * _MISSED_REFRESHES
            if end > now:
                due = min(due, end)
                continue
            scope = self.pending.get(key)
            if scope is not None:
                log.info("a waiting request was not resent: its client is gone", rid=key[1])
                self._dropped.add(key)
                scope.cancel()
        if due != float("inf"):
            self._arm_sweep(due)

    # ---- tasks -------------------------------------------------------------------------------

    def spawn_waiting(self, msg: Incoming, coro_fn: Any, *args: Any) -> None:
        """Spawn a request that may wait (it runs `waiting_request`). It can be
        cancelled from now on: a ``Cancel`` read before its task starts still finds it."""
        key = (msg.peer, msg.rid)
        self.pending[key] = anyio.CancelScope()
        if self._refresh:
            self._heard_of(key)
        self.spawn(coro_fn, *args)

    def spawn(self, coro_fn: Any, *args: Any) -> None:
        if self.tg is None:
            raise ClosedError(
                "the controller is not serving: start it with `await tg.start(server.serve)`"
            )
        self.tg.start_soon(coro_fn, *args)

    # ---- replies -----------------------------------------------------------------------------

    def is_retry(self, peer: bytes, rid: int) -> bool:
        """A retry of a finished request gets the same answer; one still waiting, nothing."""
        cached = self.replies.get((peer, rid))
        if cached is not None:
            if self.endpoint is not None:
                self.endpoint.send(peer, [cached])
            return True
        if (peer, rid) not in self.pending:
            first = self._cancelled_first
            if first and (peer, rid) in first:
                del first[(peer, rid)]
                # its caller gave up: it is answered (a client keeps what a reply of a
                # request it cancelled would undo until one comes), never run
                self.send(peer, rid, error_reply(rid, TQError("cancelled by its client")))
                return True
            return False
        if (peer, rid) in self._heard:  # its client is alive: it resends it
            self._heard_of((peer, rid))
        return True  # its reply will reach the retry

    def cancelled_unseen(self, key: tuple[bytes, int]) -> None:
        """A ``Cancel`` of a request neither waiting nor answered: it has not come yet (it
        travels on another connection of its client), and is not run when it does."""
        if key in self.replies:
            return
        first = self._cancelled_first
        first[key] = None
        if len(first) > _REPLY_CACHE:
            first.popitem(last=False)

    def send(self, peer: bytes, rid: int, header: bytes, frames: Sequence[Any] = ()) -> None:
        """Send a reply and remember it: a retried request gets it again, not re-executed."""
        self.remember(peer, rid, header)
        if self.endpoint is not None:
            self.endpoint.send(peer, [header, *frames])

    def send_ok(self, peer: bytes, rid: int, payload: Any, frames: Sequence[Any] = ()) -> None:
        """Answer ``rid``; a reply naming rows' units carries the units' epoch."""
        if isinstance(payload, (MetaReply, Placement)):
            payload.units_epoch = self.state.units_epoch  # the rows' units may have moved
        self.send(peer, rid, ok_reply(rid, payload), frames)

    def remember(self, peer: bytes, rid: int, header: bytes) -> None:
        replies = self.replies
        replies[(peer, rid)] = header
        if len(replies) > _REPLY_CACHE:
            replies.popitem(last=False)

    def undo_on_cancel(self, peer: bytes, rid: int, undo: Callable[[], None]) -> None:
        """What a late ``Cancel`` of the answered request ``rid`` does (see `undos`)."""
        undos = self.undos
        undos[(peer, rid)] = undo
        if len(undos) > _REPLY_CACHE:
            undos.popitem(last=False)

    def admit(
        self, peer: bytes, rid: int, n: int, holder: bytes, lease: float | None = None
    ) -> None:
        """Answer ``rid``, an admitted rollout of ``n`` rows held by ``holder`` (with the
        slot lease its client renews them under, if any); its late ``Cancel`` gives the
        slots back."""
        core = self.core
        self.undo_on_cancel(
            peer, rid, lambda: self.apply(Effects(admission=core.release_slots(n, holder)))
        )
        self.send_ok(peer, rid, lease)

    # ---- waiting -----------------------------------------------------------------------------

    async def waiting_request(
        self,
        peer: bytes,
        rid: int,
        op: str,
        t0: float,
        timeout: float | None,
        timeout_message: Callable[[], str],
        work: Callable[[], Awaitable[None]],
    ) -> None:
        """Run a request that may wait: ``work`` sends the reply.

        The request can be cancelled by the client (``Cancel``), fails with
        `TQTimeoutError` after ``timeout``, and answers any error; nothing it would
        have done happens after it ends. One its client cancelled is answered with an error
        nobody waits for: the client drops the undo it keeps in case the reply was already
        on its way (without an answer, it would keep it for as long as the connection lives).
        """
        # registered when the request was spawned (a Cancel may have come since)
        scope = self.pending.setdefault((peer, rid), anyio.CancelScope())
        if timeout and (peer, rid) in self._heard:
            timeout = self._time_left((peer, rid), timeout)
        ok = False
        try:
            with scope, anyio.fail_after(timeout) if timeout else nullcontext():
                await work()
                ok = not scope.cancel_called
        except TimeoutError:
            self.send_error(peer, rid, TQTimeoutError(timeout_message()), op)
        except Exception as exc:
            self.send_error(peer, rid, exc, op)
        finally:
            self.pending.pop((peer, rid), None)
            self._heard.pop((peer, rid), None)
            if self._ends and (peer, rid) not in self._dropped:
                self._ends.pop((peer, rid), None)
            if self.metrics.enabled:
                self.metrics.request(op, ok, time.perf_counter() - t0)
        if (peer, rid) in self._dropped:  # its client is gone (or resends it: it runs again)
            self._dropped.discard((peer, rid))
            return
        if scope.cancel_called and (peer, rid) not in self.replies:
            self.send(peer, rid, error_reply(rid, TQError(f"{op} cancelled by its client")))


def _nowhere(partition_id: str, by_unit: Mapping[int, list[int] | None], inc: str | None) -> None:
    """Freeing rows before the links to the units are built: there are no units to tell."""


def _of_partition(partition_id: str, key: object) -> bool:
    """Whether a parking key is a get_meta's on ``partition_id``."""
    return isinstance(key, tuple) and key[0] == partition_id
