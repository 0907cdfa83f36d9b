# Generated from src/tq_async/_client/_async/_same_host.py by scripts/unasync.py:
# do not edit; change the source and run `python scripts/unasync.py`.
"""The same-host path to the storage units: `SameHostUnits`, a part of the client's links.

A unit on this host is proven so once (`ShmHello`: the client must map the arena the unit
names and read the token the unit wrote into it); from then on the client copies column bytes
straight into and out of that arena, and talks to the unit through its Unix-socket twin. This
part keeps what that proof established (each unit's arena, which connection address stands for
which listed one) and what happens when it does not complete in time (the socket path, asked
again `RELINK_AFTER` later, counted in `fallbacks`). The links it serves own the connections:
it reads their pool (``units``) and moves a unit's entry to its verified twin.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator

import zmq

from ..._errors import BrokenError, ClosedError, ProtocolError, TQTimeoutError
from ..._logging import get_logger
from ..._paths._shm import ArenaMap
from ..._sync_primitives import Lock
from ..._transport._endpoints import same_host_ipc
from ..._transport._sync_dealer import BlockingConnection
from ..._wire._protocol import ShmFree, ShmGrant, ShmHello, ShmHelloReply
from ._replies import decode

__all__ = ["RELINK_AFTER", "SHM_HELLO_TIMEOUT", "SPARES_PER_UNIT", "SameHostUnits"]

log = get_logger(__name__)

#: seconds a same-host handshake with a storage unit may take before the client uses the
#: socket path instead (it never fails a request for it)
SHM_HELLO_TIMEOUT = 5.0
#: seconds after a handshake timed out before the client tries it again (on its next data call)
RELINK_AFTER = 30.0
#: grants a client holds (and asks for) lent ahead by one unit: concurrent puts each take
#: one instead of asking for a grant first (the unit bounds what all spares hold)
SPARES_PER_UNIT = 32


class SameHostUnits:
    """The units' arenas mapped here, their verified same-host twins, and the handshakes that
    fell back to the socket path.

    ``units`` is the links' pool of unit connections (unit id -> connection, the same dict);
    ``dial(address, on_disconnect=..., known_as=...)`` opens a connection as the links do;
    ``forget(unit_id)`` is what a broken twin connection calls (the links forget the unit's
    arena and device links)."""

    def __init__(
        self,
        units: dict[int, BlockingConnection],
        *,
        request_timeout: float,
        dial: Callable[..., BlockingConnection],
        forget: Callable[[int], None],
    ) -> None:
        self._units = units
        self._request_timeout = request_timeout
        self._dial = dial
        self._forget = forget
        #: unit id -> its verified arena mapping (None: that unit is reached by socket only)
        self.arenas: dict[int, ArenaMap | None] = {}
        #: same-host handshakes that did not complete in time (the socket path is used)
        self.fallbacks = 0
        #: connection address -> the address the controller lists for its unit (differs
        #: for a verified same-host twin, which is not a move)
        self._stands_for: dict[str, str] = {}
        self._locks: dict[int, Lock] = {}
        #: unit id -> when to try the handshake again after one timed out
        self._relink_at: dict[int, float] = {}
        #: (unit id, in its device arena) -> grants it lent ahead of this client's next
        #: puts (`StorePut.spare`, ``device_spare``), each with the connection it belongs
        #: to: at most `SPARES_PER_UNIT` of a kind, held and asked for together
        #: (concurrent puts each take one)
        self._spares: dict[tuple[int, bool], list[tuple[BlockingConnection, ShmGrant]]] = {}
        #: (unit id, device) -> puts in flight that ask it for a spare
        self._asking: Counter[tuple[int, bool]] = Counter()
        #: unit id -> copies into or out of its memory under way off the loop (`copying`)
        self._copying: Counter[int] = Counter()

    @property
    def hello_timeout(self) -> float:
        """How long a same-host handshake may take (`SHM_HELLO_TIMEOUT`, at most the
        request timeout)."""
        return min(self._request_timeout, SHM_HELLO_TIMEOUT)

    def listed(self, address: str) -> str:
        """The address the controller lists for the unit reached at ``address``."""
        return self._stands_for.get(address, address)

    def twin_of(self, address: str) -> str | None:
        """The listed address whose verified twin ``address`` is (None: not a twin)."""
        return self._stands_for.get(address)

    def settled(self, unit_id: int) -> bool:
        """Whether a unit without an arena here stays on the socket path for now: its
        handshake found no shared memory, or timed out not long ago (`RELINK_AFTER`; after
        that the unit is forgotten here, to be asked again)."""
        if unit_id not in self.arenas:
            return False
        due = self._relink_at.get(unit_id)
        if due is None or time.monotonic() < due:
            return True
        del self._relink_at[unit_id]
        del self.arenas[unit_id]
        return False

    def link(
        self, unit_id: int, conn: BlockingConnection
    ) -> tuple[BlockingConnection, ArenaMap | None]:
        """The unit's handshake, once (concurrent callers wait for it); returns the unit's
        connection as it then is (its twin, if it moved) and its arena."""
        lock = self._locks.setdefault(unit_id, Lock())
        with lock:
            if unit_id not in self.arenas:
                try:
                    self._handshake(unit_id, conn)
                except (BrokenError, ClosedError):
                    # the unit went away: the socket path (and its retry at the unit's new
                    # address, `Links.unit_request`) decides what happens; link again next time
                    return conn, None
        return self._units.get(unit_id, conn), self.arenas.get(unit_id)

    def _handshake(self, unit_id: int, conn: BlockingConnection) -> None:
        """Set up shared memory with the unit and move to its same-host twin, if it answers
        in time; otherwise stay on the socket path (counted in `fallbacks`).

        A handshake waits at most `SHM_HELLO_TIMEOUT`: a unit too busy to answer one
        within that is better used through the socket it already answers on than waited
        for, and nothing was consumed by a handshake that timed out.
        """
        wait = self.hello_timeout
        try:
            payload, _ = conn.request(ShmHello(os.getpid()), timeout=wait)
        except TQTimeoutError:
            self.fell_back(unit_id, "the unit did not answer the handshake in time")
            self.arenas[unit_id] = None
            self._relink_at[unit_id] = time.monotonic() + RELINK_AFTER  # a busy spell passes
            return
        hello: ShmHelloReply | None = decode(payload, ShmHelloReply | None)
        arena = None
        if hello is not None:
            try:
                arena = ArenaMap(
                    hello.pid, hello.fd, hello.size, hello.token, write_through=hello.write_through
                )
            except (OSError, ValueError) as exc:  # another host, namespace or user
                log.debug("no shared memory with this unit", unit=unit_id, error=str(exc))
        if arena is None or hello is None:
            self.arenas[unit_id] = arena
            return
        conn.peer_pid = hello.pid  # verified on this host: a broken link can say more
        try:
            # the arena is known only once the move to the twin is over: until then other
            # calls wait on the link lock instead of using ``conn``, which the move closes
            self._move_to_twin(unit_id, conn, hello, wait)
        finally:
            self.arenas[unit_id] = arena

    def _move_to_twin(
        self, unit_id: int, conn: BlockingConnection, hello: ShmHelloReply, wait: float
    ) -> None:
        """Reach the verified unit through its same-host socket from now on, if it answers."""
        if not same_host_ipc(hello.ipc):
            return
        assert hello.ipc is not None
        try:
            ipc = self._dial(
                hello.ipc, on_disconnect=lambda: self._forget(unit_id), known_as=conn.address
            )
        except BrokenError as exc:  # its listen queue is full: the socket we have will do
            self.fell_back(unit_id, str(exc))
            return
        ipc.peer_pid = hello.pid
        try:
            # says hello for this connection too (shared memory is granted per connection)
            payload, _ = ipc.request(ShmHello(os.getpid()), timeout=wait)
            again: ShmHelloReply | None = decode(payload, ShmHelloReply | None)
        except (TQTimeoutError, BrokenError, zmq.ZMQError) as exc:  # EPIPE: ZMQError
            ipc.close()  # the arena stays: granted to the connection that said hello first
            self.fell_back(unit_id, f"the unit's same-host socket failed: {exc}")
            return
        except BaseException:
            ipc.close()
            raise
        if again is None or again.token != hello.token or self._units.get(unit_id) is not conn:
            ipc.close()
            return
        self._units[unit_id] = ipc
        self._stands_for[ipc.address] = conn.address
        # the unit forgets the session of the connection replaced (else kept until we exit)
        conn.retire("by the unit's same-host twin", farewell=[ShmFree([], [], closing=True)])

    def fell_back(self, unit_id: int | None, why: str) -> None:
        """Count a same-host switch that did not happen (``unit_id`` None: the controller's)."""
        self.fallbacks += 1
        log.warning(
            "a same-host handshake fell back to the socket path",
            unit="controller" if unit_id is None else unit_id,
            reason=why,
            fallbacks=self.fallbacks,
        )

    def take_spare(
        self, unit_id: int, conn: BlockingConnection, nbytes: int, *, device: bool = False
    ) -> ShmGrant | None:
        """A grant ``unit_id`` lent ahead on ``conn`` (in its device arena with ``device``)
        that holds ``nbytes`` (taken: one put uses it); held ones lent on another
        connection go back."""
        key = (unit_id, device)
        held = self._spares.get(key)
        if not held:
            return None
        owner, grant = held[-1]  # (the common case: the last one lent fits; O(1))
        if owner is conn and grant.size >= nbytes:
            held.pop()
            return grant
        taken = None
        keep = []
        for owner, grant in held:
            if owner is not conn:
                owner.send_best_effort(ShmFree([grant.grant], []))
            elif taken is None and grant.size >= nbytes:
                taken = grant
            else:
                keep.append((owner, grant))
        if taken is None and keep:  # all too small: the smallest goes (puts grew)
            owner, grant = keep.pop(min(range(len(keep)), key=lambda i: keep[i][1].size))
            owner.send_best_effort(ShmFree([grant.grant], []))
        self._spares[key] = keep
        return taken

    def has_spare(
        self, unit_id: int, conn: BlockingConnection, nbytes: int, *, device: bool = False
    ) -> bool:
        """Whether `take_spare` would find one (nothing is taken or given back)."""
        held = self._spares.get((unit_id, device), ())
        return any(owner is conn and grant.size >= nbytes for owner, grant in held)

    def ask_spare(self, unit_id: int, *, device: bool = False) -> bool:
        """Whether a put to ``unit_id`` should ask for a spare (of its device arena with
        ``device``): fewer than `SPARES_PER_UNIT` held and asked for; it counts as asked
        until `asked`."""
        key = (unit_id, device)
        if len(self._spares.get(key, ())) + self._asking[key] >= SPARES_PER_UNIT:
            return False
        self._asking[key] += 1
        return True

    def asked(self, unit_id: int, *, device: bool = False) -> None:
        """A put that asked ``unit_id`` for a spare has its answer (or failed)."""
        key = (unit_id, device)
        self._asking[key] -= 1
        if self._asking[key] <= 0:
            del self._asking[key]

    def keep_spare(
        self,
        unit_id: int,
        conn: BlockingConnection,
        arena: ArenaMap,
        spare: ShmGrant,
        check: Callable[[int, int, str], None] | None = None,
    ) -> None:
        """Hold ``spare`` (lent with a put's answer) for a next put to ``unit_id``; one past
        `SPARES_PER_UNIT`, outside the arena (a corrupt reply), or lent in an arena this
        client forgot since (the unit's connection broke while the answer waited for the
        put to go on), goes back. With ``check`` (the device arena's bounds check,
        `DeviceView.check`: it raises) it is a spare of the unit's device arena."""
        if self.arenas.get(unit_id) is not arena:
            # its offset means nothing in the arena the unit has now (maybe restarted at the
            # same address, the connection back, and the region lent to another put)
            conn.send_best_effort(ShmFree([spare.grant], []))
            return
        try:
            (check or arena.check)(spare.offset, spare.size, "a spare grant")
        except (ValueError, ProtocolError) as exc:
            log.warning("a storage unit lent a grant outside its arena", error=str(exc))
            conn.send_best_effort(ShmFree([spare.grant], []))
            return
        held = self._spares.setdefault((unit_id, check is not None), [])
        if len(held) >= SPARES_PER_UNIT:
            conn.send_best_effort(ShmFree([spare.grant], []))
        else:
            held.append((conn, spare))

    @contextlib.contextmanager
    def copying(self, unit_id: int) -> Iterator[None]:
        """A copy into or out of ``unit_id``'s memory (its arena, its device arena) that may
        run while this client closes (a worker thread, a device): see `close`."""
        self._copying[unit_id] += 1
        try:
            yield
        finally:
            self._copying[unit_id] -= 1
            if self._copying[unit_id] <= 0:
                del self._copying[unit_id]

    def spare_bytes(self, *, device: bool = False) -> int:
        """Bytes of the grants this client holds lent ahead of its next puts (in the units'
        device arenas with ``device``)."""
        return sum(
            grant.size
            for (_, on_device), held in self._spares.items()
            if on_device == device
            for _, grant in held
        )

    def _drop_spare(self, unit_id: int) -> None:
        for device in (False, True):
            for owner, grant in self._spares.pop((unit_id, device), ()):
                owner.send_best_effort(ShmFree([grant.grant], []))

    def forget(self, unit_id: int) -> None:
        """Unmap the unit's arena (its connection broke or it moved)."""
        self._drop_spare(unit_id)
        arena = self.arenas.pop(unit_id, None)
        if arena is not None:
            arena.close()

    def forget_all(self) -> None:
        """The twins and handshake retries of every unit (the units are a new service's)."""
        self._stands_for.clear()
        self._relink_at.clear()

    def close(self) -> None:
        """Unmap every arena; each unit may give the pages this client held back at once,
        and everything it lent this client: also what it lent with the answers to calls in
        flight, which nobody will read (sent after those calls on their connection, so the
        unit reads it after them). Not while a copy of this client may still use the
        memory the unit lent it (`copying`): that stays lent until this process exits."""
        for unit_id, _ in list(self._spares):
            self._drop_spare(unit_id)
        # (a send on a broken connection may forget its unit's arena: a copy of the items)
        for unit_id, arena in list(self.arenas.items()):
            chunks = arena.close() if arena is not None else []
            conn = self._units.get(unit_id)
            if conn is None or arena is None:
                continue
            closing = not self._copying[unit_id]
            if chunks or closing:
                conn.send_best_effort(ShmFree([], [], chunks, closing=closing))
        self.arenas.clear()

    def after_fork(self) -> None:
        """In a forked child: drop the parent's mappings and twins (unmapped here only; the
        parent keeps its own), and the link locks (one held by another thread at the fork
        stays held)."""
        self._stands_for.clear()
        self._locks.clear()
        self._spares.clear()  # the parent's: it writes into them, never the child
        self._asking.clear()
        self._copying.clear()  # the parent's threads: not in the child
        for arena in self.arenas.values():
            if arena is not None:
                arena.pinned = None  # the parent's registrations: CUDA is not the child's
                arena.close()  # the child's mapping only
        self.arenas.clear()
