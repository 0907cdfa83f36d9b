"""The client's plumbing: its links to the controller and the storage units.

A client *holds* its links as one object, `Links`: it opens (on first use) and pools
one connection to the controller and one per storage unit, follows units that move (a
restarted unit answers at a new address; the controller's replies carry a
``units_epoch``), finds the controller again after its connection broke, holds the same-host
path to the units as a part of its own (`SameHostUnits`: each unit's shared memory and
verified Unix-socket twin), re-creates all of it in a forked child, and sends controller
requests.
`tq_async.AsyncClient` checks its options and holds the links and three parts
built on them, to which it delegates: the put path (`tq_async._client._async._put`), the read
path (`tq_async._client._async._get`: get_meta, get_data, get) and the other controller calls
(`tq_async._client._async._calls`: status, staleness, KV, checkpoints). The helpers only one
of them uses live next to it, and the few shared ones here are public (no private name
crosses a client module).
"""

from __future__ import annotations

# unasync: async-only
# unasync: end
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import msgspec
import numpy as np
import zmq

from ..._errors import (
    BrokenError,
    ClosedError,
    InvalidRequestError,
    ProtocolError,
    StateLostError,
    TQError,
    TQTimeoutError,
)
from ..._logging import get_logger
from ..._paths._shm import ArenaMap
from ..._primitives import Event
from ..._transport._connection import process_state
from ..._transport._dealer import DealerConnection
from ..._transport._endpoints import same_host_ipc
from ..._transport._security import CurveClient
from ..._wire._checks import check_text, integral
from ..._wire._protocol import Hello, HelloReply
from ._device_links import DeviceLinks
from ._feeds import Feeds
from ._nixl_links import NixlLinks
from ._replies import decode
from ._same_host import SameHostUnits

__all__ = ["Links"]


log = get_logger(__name__)

#: field lists already checked, each to its names once each (a consumer asks for the same
#: few lists on every call)
_checked_fields: dict[tuple[str, ...], tuple[str, ...]] = {}


def check_fields(data_fields: Any, name: str = "data_fields") -> list[str]:
    """``data_fields`` as a list of field names, each once, in their first order (``name``:
    the argument, for the errors)."""
    if type(data_fields) is list or type(data_fields) is tuple:
        try:
            known = _checked_fields.get(tuple(data_fields))
        except TypeError:  # an unhashable entry: the checks below name it
            known = None
        if known is not None:
            return list(known)
    if isinstance(data_fields, np.ndarray) and data_fields.ndim == 1:  # names in an array
        data_fields = data_fields.tolist()
    if isinstance(data_fields, str) or not isinstance(data_fields, (list, tuple)):
        hint = repr(data_fields) if isinstance(data_fields, str) else "'input_ids', ..."
        raise InvalidRequestError(
            f"{name} must be a list of field names, got {type(data_fields).__name__} "
            f"{data_fields!r:.80}; write {name}=[{hint}]"
        )
    if not data_fields or not all(isinstance(f, str) and f for f in data_fields):
        raise InvalidRequestError(
            f"{name} must be a non-empty list of non-empty strings, got {data_fields!r}"
        )
    for f in data_fields:
        check_text("field name", f)
    once = tuple(dict.fromkeys(data_fields))  # ["b", "a", "b"]: the data has b once too
    if len(_checked_fields) < 1024:
        _checked_fields[tuple(data_fields)] = once
    return list(once)


def tag_rows(tags: Any, n: int, of: str = "rows") -> Sequence[Any]:
    """``tags``, checked to be one dict (or None) for each of ``n`` rows (or keys: ``of``).

    Raises:
        InvalidRequestError: it is no sequence (one dict, a generator, None), or not ``n``
            long.
    """
    if isinstance(tags, (str, bytes, Mapping)) or not isinstance(tags, Sequence):
        hint = f": the same tags on every row are [tags] * {n}" if isinstance(tags, Mapping) else ""
        raise InvalidRequestError(
            f"tags must be a list of one dict per row (or None), got {type(tags).__name__}{hint}"
        )
    if len(tags) != n:
        raise InvalidRequestError(f"got {len(tags)} tag dicts for {n} {of}")
    return tags


class Links:
    """A client's links: one connection to the controller and one per storage unit (opened
    on first use, pooled), the units' arenas mapped here, their verified same-host twins,
    and the units epoch that tells when a unit moved. Every call goes through them."""

    def __init__(
        self,
        address: str,
        *,
        request_timeout: float,
        allow_pickle: bool | None,
        curve: CurveClient | None,
        retry_after: float | None,
        shared_memory: bool,
        busy_poll: float,
        nixl: bool,
        nixl_forced: bool,
        same_host: bool = True,
    ) -> None:
        self.address = address
        #: talk to a same-host controller through its verified Unix-socket twin
        self.same_host = same_host
        self.request_timeout = request_timeout
        self.curve = curve
        self.retry_after = retry_after
        self.busy_poll = busy_poll
        self.shared_memory = shared_memory
        self._allow_pickle_opt = allow_pickle
        self.allow_pickle = bool(allow_pickle)
        self.controller: DealerConnection | None = None
        self.unit_addresses: dict[int, str] = {}
        self.units: dict[int, DealerConnection] = {}
        self.capacity: int | None = None
        #: the units epoch of the last Hello, and the newest a reply carried: when they
        #: differ a unit moved (restarted on a new address) and the units are asked again
        self._units_epoch = 0
        self._epoch_seen = 0
        self._refreshing: Event | None = None
        self._hello: HelloReply | None = None
        #: the controller's state lineage (`HelloReply.state`) from its last Hello
        self._lineage = b""
        #: the connection to the controller broke since its last Hello: the next call finds
        #: the controller again first (`_rejoin`), one rejoin at a time serving every caller
        self._must_rejoin = False
        self._rejoining: Event | None = None
        self._rejoin_failure: TQError | None = None
        #: locality: this client's host id (sent with hellos, puts and reads), and each
        #: unit's as the controller lists it
        self.host_id = ""
        self.unit_hosts: dict[int, str] = {}
        self.nixl = NixlLinks(forced=nixl_forced) if nixl else None
        #: the device arenas of units on this host (GPU columns device to device)
        self.devices = DeviceLinks() if shared_memory else None
        #: the units' arenas mapped here and their verified same-host twins
        self.same_host_units = SameHostUnits(
            self.units,
            request_timeout=request_timeout,
            dial=lambda address, **kw: self.connection(address, **kw),
            forget=lambda unit_id: self._forget_arena(unit_id),
        )
        #: unit id -> its verified arena mapping (None: that unit is reached by socket only)
        self.arenas = self.same_host_units.arenas
        #: the process that opened the connections (a forked child opens its own)
        self._pid = os.getpid()
        #: a forked child's copies of its parent's connections: never used, closed or freed
        #: (they are the parent's sockets)
        self._inherited: list[DealerConnection] = []
        #: the watchers' shared requests and answers, by filter (`tq_async._client._async._feeds`)
        self.feeds = Feeds()

    def close(self, farewell: Sequence[msgspec.Struct] = ()) -> None:
        """Close every connection; calls still waiting fail with ClosedError. ``farewell``:
        one-way messages the controller gets last (the aborts of the puts in flight)."""
        if self.controller is not None:
            self.controller.close(farewell=farewell)
            self.controller = None
        self.same_host_units.close()
        for conn in self.units.values():
            conn.close()
        self.units.clear()
        if self.devices is not None:
            self.devices.close()

    def check_process(self) -> None:
        """In a child forked from the process that opened this client, start over with
        connections of the child's own, on first use; the parent's are left untouched."""
        if self._pid == os.getpid():
            # unasync: async-only
            _on_its_loop(self.controller)
            # unasync: end
            return
        self._pid = os.getpid()
        old, self.controller = self.controller, None
        self._inherited.extend(self.units.values())
        self.units.clear()
        if self.devices is not None:
            self.devices.drop_all()  # CUDA does not survive a fork: the parent's views
        self.same_host_units.after_fork()
        self.feeds.after_fork()
        # (a Hello or a rejoin another thread of the parent was waiting for ends only there)
        self._refreshing = self._rejoining = None
        if self.nixl is not None:
            self.nixl = NixlLinks(forced=self.nixl.forced)
        if old is not None:
            self._inherited.append(old)
            self.controller = _redial(self, old)

    def connection(
        self,
        address: str,
        *,
        refused_is_broken: bool = False,
        on_disconnect: Callable[[], None] | None = None,
        known_as: str | None = None,
    ) -> DealerConnection:
        """A connection to a service with this client's keys, retries and busy polling;
        ``known_as``: the address the program gave, when ``address`` is its same-host twin
        (errors name that one first)."""
        return DealerConnection(
            address,
            curve=self.curve,
            retry_after=self.retry_after,
            busy_poll=self.busy_poll,
            refused_is_broken=refused_is_broken,
            on_disconnect=on_disconnect,
            known_as=known_as,
        )

    async def open(self, wait: float, same_host: bool, limit: str = "connect_timeout") -> None:
        """Connect to the controller (if not yet) and learn the units within ``wait``
        seconds (the option ``limit`` names); with ``same_host``, move to the services'
        same-host links (see `AsyncClient.open`, which raises what this raises)."""
        if self.controller is not None:
            return
        # a refused first attempt means nothing listens there: fail now, not at the timeout
        controller = self.controller = self.controller_connection(
            self.address, refused_is_broken=True
        )
        try:
            try:
                hello = await self.refresh_units(timeout=wait)
            except TQTimeoutError:
                raise _unanswered(self.address, wait, limit) from None
            # from now on a refusal is a restarting controller: requests wait for it
            controller.refused_is_broken = False
            if same_host:
                await self.prefer_ipc(hello)
        except BaseException:
            if self.controller is not None:
                self.controller.close()
                self.controller = None
            raise

    def controller_connection(
        self, address: str, *, refused_is_broken: bool = False, known_as: str | None = None
    ) -> DealerConnection:
        """A connection to the controller; its break makes the next call find the
        controller again (`_rejoin`)."""
        return self.connection(
            address,
            refused_is_broken=refused_is_broken,
            on_disconnect=self._controller_broke,
            known_as=known_as,
        )

    def _controller_broke(self) -> None:
        self._must_rejoin = True

    async def prefer_ipc(self, hello: HelloReply) -> None:
        """Talk to the controller through its same-host ipc twin, once proven to be the same
        controller (its instance token); otherwise keep the given address."""
        if not hello.instance or not same_host_ipc(hello.ipc) or self.controller is None:
            return
        assert hello.ipc is not None
        try:
            conn = self.controller_connection(hello.ipc, known_as=self.controller.known_as)
        except BrokenError as exc:  # its listen queue is full: TCP works
            self.same_host_units.fell_back(None, str(exc))
            return
        try:
            wait = self.same_host_units.hello_timeout
            payload, _ = await conn.request(_hello(self, conn), timeout=wait)
            again: HelloReply = decode(payload, HelloReply)
            ok = again.instance == hello.instance
        except (TQTimeoutError, BrokenError, zmq.ZMQError) as exc:  # EPIPE: ZMQError
            # refused (the controller is out of descriptors) or too busy: TCP answered
            conn.close()
            self.same_host_units.fell_back(None, str(exc))
            return
        except BaseException:
            conn.close()
            raise
        if not ok:
            conn.close()
            return
        self.controller.retire("by the controller's same-host twin")
        self.controller = conn

    async def refresh_units(self, timeout: float | bool = True) -> HelloReply:
        """Ask the controller for the units; drop connections to addresses that changed."""
        if self._refreshing is not None:  # one Hello at a time serves every caller
            await self._refreshing.wait()
            if self._hello is not None:
                return self._hello
        self._refreshing = done = Event()
        try:
            hello: HelloReply = await self.call(
                _hello(self, self.controller), HelloReply, timeout=timeout
            )
        finally:
            self._refreshing = None
            done.set()
        self._lineage = self._lineage or _lineage(hello)
        return self._adopt(hello)

    def _adopt(self, hello: HelloReply) -> HelloReply:
        """Take the units and settings a Hello reply lists."""
        self._hello = hello
        addresses = {u.unit_id: u.address for u in hello.units}
        for unit_id, conn in list(self.units.items()):
            if self.same_host_units.listed(conn.address) != addresses.get(unit_id):
                log.info(
                    "storage unit moved", unit=unit_id, old=conn.address, new=addresses.get(unit_id)
                )
                del self.units[unit_id]
                self._forget_arena(unit_id)
                conn.retire("the storage unit moved")
        self.unit_addresses = addresses
        self.unit_hosts = {u.unit_id: u.host for u in hello.units}
        self._units_epoch = self._epoch_seen = hello.units_epoch
        self.capacity = hello.capacity
        if self._allow_pickle_opt is None:
            self.allow_pickle = hello.allow_pickle
        return hello

    @property
    def lineage(self) -> bytes:
        """The controller's state lineage from its last Hello (``b""`` before the first)."""
        return self._lineage

    def note_epoch(self, epoch: int) -> None:
        """A reply's units epoch: a new one makes the next unit call ask for the units."""
        if epoch:
            self._epoch_seen = epoch

    def ctl(self) -> DealerConnection:
        """The connection to the controller as it is (see `controller_link`)."""
        self.check_process()
        if self.controller is None:
            raise ClosedError(
                "the client is not connected; use `async with AsyncClient.connect(address)`"
            )
        return self.controller

    async def controller_link(self) -> DealerConnection:
        """The connection to the controller for a request; after it broke, the controller
        found again first (`_rejoin`).

        Raises:
            BrokenError: the controller is still away (nothing listens at its address).
            StateLostError: it restarted without the state this client knew.
        """
        conn = self.ctl()
        if self._must_rejoin or conn.is_broken() or self._rejoining is not None:
            # (while a rejoin runs, its connection is not the one it ends on: a request sent
            # on it would fail with ClosedError when the same-host twin replaces it)
            return await self._rejoin()
        return conn

    async def _rejoin(self) -> DealerConnection:
        """Find the controller again after its connection broke (it restarted, paused or
        the network failed), through the address the program gave: a same-host twin
        belonged to the old process. Bounded by the request timeout; a refused connection
        fails at once (nothing listens there yet). The calls that wait for the same rejoin
        share its outcome.

        Raises:
            BrokenError: the controller did not answer (the client tries again on the next
                call).
            StateLostError: the controller answered with another state lineage: it lost
                the state this client knew. The client now talks to the new one.
        """
        if self._rejoining is not None:
            await self._rejoining.wait()
            if self._rejoin_failure is not None:
                raise _again(self._rejoin_failure)
            # (the rejoiner was cancelled: this call tries itself)
            return await self.controller_link()
        self._rejoining = done = Event()
        self._rejoin_failure = None
        try:
            lost = await self._hello_again()
        except TQError as exc:
            self._rejoin_failure = exc
            raise
        finally:
            self._rejoining = None
            done.set()
        if lost is not None:
            self._rejoin_failure = lost
            raise _again(lost)
        return await self.controller_link()

    async def _hello_again(self) -> StateLostError | None:
        """The rejoin's Hello on a new connection to the controller's given address; the
        units and the same-host twin taken again. Returns the error the waiting calls raise
        if the controller lost its state."""
        conn = self.controller
        assert conn is not None
        known_as = conn.known_as
        if conn.address != known_as or conn.is_broken():
            # a same-host twin was the old process's; a broken socket is dialled anew, so
            # that a refusal is immediate (nothing listens yet) and nothing waits on it.
            # (A TCP link that is back is kept: requests sent since then are on it.)
            # Requests still waiting on it broke with it: BrokenError, never ClosedError.
            conn.close(BrokenError(f"the connection to {known_as} broke; retry"))
            self.controller = conn = self.controller_connection(known_as, refused_is_broken=True)
        self._must_rejoin = False
        try:
            payload, _ = await conn.request(_hello(self, conn), timeout=self.request_timeout)
        except BaseException:
            self._must_rejoin = True
            raise
        hello: HelloReply = decode(payload, HelloReply)
        conn.refused_is_broken = False
        lineage = _lineage(hello)
        lost = bool(self._lineage) and bool(lineage) and lineage != self._lineage
        log.info("found the controller again", address=known_as, state_lost=lost)
        self._lineage = lineage or self._lineage
        if lost:
            self._forget_units()
        self._adopt(hello)
        if self.same_host:
            await self.prefer_ipc(hello)
        if not lost:
            return None
        return StateLostError(
            f"the service at {known_as} restarted without the state this client knew (at "
            "durability 'memory' a restart loses it; so does a controller started on a new "
            "data_dir): its partitions, rows, consumption and KV keys are gone, and this "
            "call was not sent. The next calls go to the new service: put the data again "
            "(or load a checkpoint), and run the service with --durability process "
            "--data-dir DIR where a restart must keep its state"
        )

    def _forget_units(self) -> None:
        """Drop every unit connection and arena: the units are the new service's."""
        for unit_id, conn in list(self.units.items()):
            del self.units[unit_id]
            self._forget_arena(unit_id)
            conn.retire("the service restarted without its state")
        self.same_host_units.forget_all()

    async def unit(self, unit_id: int) -> DealerConnection:
        self.ctl()  # a closed client dials nothing (a read falling back after the close)
        if self._epoch_seen != self._units_epoch:
            await self.refresh_units()
        conn = self.units.get(unit_id)
        if conn is not None and conn.is_broken() and process_state(conn.peer_pid) is None:
            # broken, its process gone (or on another host): the unit is away, or back at
            # its address while ZMQ waits to dial again. Dialled anew, as the controller's
            # is: a refusal is immediate while nothing listens, and the first call once the
            # unit is back reaches it. (A paused unit's connection stays: it says so.)
            del self.units[unit_id]
            self._forget_arena(unit_id)
            conn.retire("broken: dialled anew")
            conn = None
        if conn is None:
            if unit_id not in self.unit_addresses:
                await self.refresh_units()
            try:
                address = self.unit_addresses[unit_id]
            except KeyError:
                raise ProtocolError(
                    f"the controller placed rows on unknown unit {unit_id}"
                ) from None
            conn = self.units[unit_id] = self.connection(
                address, refused_is_broken=True, on_disconnect=lambda: self._forget_arena(unit_id)
            )
        return conn

    async def unit_request(
        self, unit_id: int, body: msgspec.Struct, frames: Sequence[Any] = ()
    ) -> tuple[msgspec.Raw, list[Any]]:
        """An idempotent request to a storage unit; if its connection broke and the unit is
        back on a new address (restarted under its id), the request is sent there once."""
        conn = await self.unit(unit_id)
        try:
            return await conn.request(body, frames, timeout=self.request_timeout)
        except (BrokenError, ClosedError) as exc:
            if self.controller is None:
                raise
            try:
                moved = await self._unit_moved(unit_id, conn)
            except TQError:
                moved = False  # the controller is not answering either: report the unit
            if not moved:
                _unit_away(unit_id, exc)
        log.info("retrying at the storage unit's new address", unit=unit_id)
        conn = await self.unit(unit_id)
        return await conn.request(body, frames, timeout=self.request_timeout)

    async def _unit_moved(self, unit_id: int, conn: DealerConnection) -> bool:
        """Whether the controller now knows ``unit_id`` at another address than ``conn``'s."""
        listed = self.same_host_units.listed(conn.address)
        current = self.units.get(unit_id)
        if (
            current is not None
            and current is not conn
            and self.same_host_units.twin_of(current.address) == listed
        ):
            return True  # ``conn`` was closed by the move to the unit's twin, which answers now
        if current is conn:  # nobody asked since this connection broke
            await self.refresh_units()
        if self.units.get(unit_id) is conn and listed != conn.address:
            # a same-host twin broke though the unit did not move: go back to its listed
            # address (the twin is verified again on the next data link)
            del self.units[unit_id]
            self._forget_arena(unit_id)
            conn.retire("the unit's listed address, its same-host twin broke")
            return True
        return self.unit_addresses.get(unit_id) not in (None, listed)

    def session_lost(self, unit_id: int, arena: ArenaMap | None = None) -> None:
        """The unit answered a data call made with ``arena`` with `SessionLostError` (it
        restarted under the connection): forget its arena here; the next `data_link` sets
        shared memory up again. A call whose arena another call replaced already (it set
        the new session up) forgets nothing: it takes the new one."""
        if arena is not None and self.arenas.get(unit_id) is not arena:
            return
        self._forget_arena(unit_id)

    def _forget_arena(self, unit_id: int) -> None:
        """The unit's connection broke: unmap its arena (a restarted unit has a new one, and
        a dead unit's memory is freed once nobody maps it)."""
        self.same_host_units.forget(unit_id)
        if self.nixl is not None:
            self.nixl.forget(unit_id)
        if self.devices is not None:
            self.devices.forget(unit_id)

    async def data_link(self, unit_id: int) -> tuple[DealerConnection, ArenaMap | None]:
        """The unit's connection and, if it is on this host (verified once per unit), its
        arena mapped here. A verified unit is then reached through its ipc twin too."""
        conn = await self.unit(unit_id)
        if not self.shared_memory or conn.inproc:
            return conn, None  # in-process connections copy once already
        arena = self.arenas.get(unit_id)
        if arena is not None or self.same_host_units.settled(unit_id):
            return conn, arena
        return await self.same_host_units.link(unit_id, conn)

    async def call(
        self,
        body: msgspec.Struct,
        typ: Any,
        *,
        timeout: float | bool | None = True,
    ) -> Any:
        conn = await self.controller_link()
        payload, _ = await conn.request(
            body, timeout=self.request_timeout if timeout is True else timeout or None
        )
        return decode(payload, typ)


def _redial(links: Links, old: DealerConnection) -> DealerConnection:
    """A forked child's connection to the controller, at the address its parent used (its
    verified same-host twin, if any), or the address the program gave when that twin's
    listen queue is full."""
    try:
        return links.controller_connection(old.address, known_as=old.known_as)
    except BrokenError:
        return links.controller_connection(old.known_as)


# unasync: async-only
def _on_its_loop(conn: DealerConnection | None) -> None:
    """Raise unless ``conn`` (the client's controller connection) belongs to the running
    event loop: a client's sockets are read by the loop that opened them (checked here too,
    as some calls reach no request of that connection)."""
    if conn is not None:
        conn.check_loop()


# unasync: end


def _lineage(hello: HelloReply) -> bytes:
    """The controller's state lineage (an older controller gives only its instance)."""
    return hello.state or hello.instance


def _again(exc: TQError) -> TQError:
    """A new error like ``exc``, for another caller (one raised again would carry the first
    caller's traceback along)."""
    return type(exc)(*exc.args)


#: integral numbers (numpy's and torch's scalars too) as an int, anything else unchanged
as_int = integral


#: copies at least this big run on a worker thread (as in the in-process path)
THREAD_COPY_BYTES = 16 << 20


def _unanswered(address: str, wait: float, limit: str) -> TQTimeoutError:
    """The error of a first contact nothing answered within ``wait`` seconds (``limit``)."""
    return TQTimeoutError(
        f"nothing answered at {address} within {wait:g} s ({limit}); check the "
        "address (the TQ_ADDRESS=... line `tq-async serve` prints), that the services run, "
        "and that this host can reach them"
    )


def _hello(links: Links, conn: DealerConnection | None) -> Hello:
    """A ``Hello`` to send on ``conn``: over ZMQ it says how often a waiting request is
    resent, so that the controller can tell one whose client was killed (a Unix socket's
    end is told: none)."""
    retry_after = links.retry_after
    zmq_link = conn is not None and not conn.address.startswith("uds://")
    refresh = retry_after if zmq_link and retry_after is not None and retry_after > 0 else None
    return Hello(host=links.host_id, refresh=refresh)


def _unit_away(unit_id: int, exc: BrokenError | ClosedError) -> NoReturn:
    """Raise a storage unit's broken connection as its caller reads it: which unit (the
    address is one the controller listed), and how to learn whether its rows wait or are
    lost (a closed connection, or a more precise error, is raised as it is)."""
    if type(exc) is not BrokenError:
        raise exc
    raise BrokenError(
        f"storage unit {unit_id}: {exc}; `lost_rows()` says whether the controller "
        "suspended it (its rows wait for it) or declared it lost (its rows are gone)"
    ) from exc
