"""The same-host part of a client's links (`SameHostUnits`), alone: the handshake with a unit,
the move to its verified Unix-socket twin, and the fall-backs, against stand-in connections."""

from __future__ import annotations

from typing import Any, cast

import msgspec
import pytest

from tq_async._client._async import _same_host
from tq_async._client._async._same_host import SPARES_PER_UNIT, SameHostUnits
from tq_async._client._sync import _same_host as _blocking_same_host
from tq_async._client._sync._same_host import SameHostUnits as BlockingSameHostUnits
from tq_async._errors import BrokenError, TQTimeoutError
from tq_async._wire._protocol import ShmFree, ShmGrant, ShmHello, ShmHelloReply

TOKEN = b"t" * 16
TWIN = "uds://@tq-unit-twin"


class Conn:
    """A unit connection that answers each ShmHello with ``answer`` (or raises it)."""

    def __init__(self, address: str, answer: Any = None, *, inproc: bool = False) -> None:
        self.address = address
        self.answer = answer
        self.inproc = inproc
        self.peer_pid: int | None = None
        self.closed = False
        self.sent: list[Any] = []
        self.asked: list[float | None] = []

    def reply(self, body: Any, timeout: float | None) -> tuple[bytes, list[Any]]:
        assert isinstance(body, ShmHello)
        self.asked.append(timeout)
        if isinstance(self.answer, BaseException):
            raise self.answer
        return msgspec.msgpack.encode(self.answer), []

    async def request(self, body: Any, timeout: float | None = None) -> tuple[bytes, list[Any]]:
        return self.reply(body, timeout)

    def close(self) -> None:
        self.closed = True

    def retire(self, why: str, *, farewell: Any = ()) -> None:  # replaced: closed, its
        self.sent.extend(farewell)  # waiting requests broken, the farewell sent last
        self.close()

    def send_best_effort(self, body: Any) -> None:
        self.sent.append(body)


class BlockingConn(Conn):
    def request(self, body: Any, timeout: float | None = None) -> tuple[bytes, list[Any]]:  # type: ignore[override]
        return self.reply(body, timeout)


class Arena:
    """A stand-in for the unit's arena mapped here."""

    def __init__(self, pid: int, fd: int, size: int, token: bytes, **_: Any) -> None:
        self.token = token
        self.closed = False
        self.pinned: object | None = object()

    def close(self) -> list[int]:
        self.closed = True
        return [3]  # page-locked chunks the unit may give back

    def check(self, offset: int, nbytes: int, what: str) -> None:
        if offset < 4096 or offset + nbytes > 1 << 20:
            raise ValueError(f"{what} lies outside the arena")


@pytest.fixture(autouse=True)
def _same_host_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (_same_host, _blocking_same_host):
        monkeypatch.setattr(module, "ArenaMap", Arena)
        monkeypatch.setattr(module, "same_host_ipc", lambda a: bool(a and a.startswith("uds://@")))


async def _link(part: SameHostUnits, conn: Conn) -> tuple[Any, Any]:
    """``part.link`` of unit 0 through a stand-in connection."""
    return await part.link(0, cast(Any, conn))


def _hello(ipc: str | None = TWIN, token: bytes = TOKEN) -> ShmHelloReply:
    return ShmHelloReply(pid=1234, fd=7, size=1 << 20, token=token, ipc=ipc)


def _part(
    units: dict[int, Any], dialled: dict[str, Any], request_timeout: float = 60.0
) -> tuple[SameHostUnits, list[int]]:
    forgotten: list[int] = []

    def dial(address: str, **kw: Any) -> Any:
        conn = dialled[address]
        if isinstance(conn, BaseException):
            raise conn
        conn.on_disconnect = kw["on_disconnect"]
        conn.known_as = kw["known_as"]
        return conn

    part = SameHostUnits(units, request_timeout=request_timeout, dial=dial, forget=forgotten.append)
    return part, forgotten


async def test_a_verified_unit_is_reached_through_its_twin_with_its_arena_mapped() -> None:
    tcp = Conn("tcp://10.0.0.1:5000", _hello())
    twin = Conn(TWIN, _hello())
    units: dict[int, Any] = {0: tcp}
    part, forgotten = _part(units, {TWIN: twin})
    assert not part.settled(0)  # never asked
    conn, arena = await _link(part, tcp)
    assert conn is twin
    assert units[0] is twin
    assert isinstance(arena, Arena)
    assert cast(Any, part.arenas[0]) is arena
    assert tcp.closed
    assert not twin.closed
    assert tcp.peer_pid == twin.peer_pid == 1234
    # the twin stands for the listed address: not a move of the unit
    assert part.listed(TWIN) == tcp.address
    assert part.twin_of(TWIN) == tcp.address
    assert part.listed(tcp.address) == tcp.address
    assert part.twin_of(tcp.address) is None
    assert twin.known_as == tcp.address
    twin.on_disconnect()  # the twin broke: the links forget the unit's arena
    assert forgotten == [0]
    assert part.fallbacks == 0
    # a handshake waits at most SHM_HELLO_TIMEOUT, or the request timeout when shorter
    assert tcp.asked == [_same_host.SHM_HELLO_TIMEOUT]
    assert _part({}, {}, request_timeout=1.0)[0].hello_timeout == 1.0


async def test_the_connection_a_twin_replaced_tells_the_unit_to_forget_its_session() -> None:
    """The unit keeps a shared-memory session per connection (`Book.peers`): the one the
    twin replaced says it closes, or the unit kept it until this process exited."""
    tcp = Conn("tcp://10.0.0.1:5000", _hello())
    twin = Conn(TWIN, _hello())
    part, _ = _part({0: tcp}, {TWIN: twin})
    conn, _ = await _link(part, tcp)
    assert conn is twin
    assert tcp.closed
    assert tcp.sent == [ShmFree([], [], closing=True)]
    assert twin.sent == []


async def test_a_twin_that_answers_another_token_is_not_used() -> None:
    tcp = Conn("tcp://10.0.0.1:5000", _hello())
    twin = Conn(TWIN, _hello(token=b"x" * 16))
    units: dict[int, Any] = {0: tcp}
    part, _ = _part(units, {TWIN: twin})
    conn, arena = await _link(part, tcp)
    assert conn is tcp
    assert units[0] is tcp
    assert not tcp.closed
    assert twin.closed
    assert arena is not None  # the arena was granted to the connection that said hello
    assert part.fallbacks == 0


async def test_a_refused_or_silent_twin_falls_back_to_the_socket_with_the_arena() -> None:
    for failure in (BrokenError("listen queue full"), TQTimeoutError("no answer")):
        tcp = Conn("tcp://10.0.0.1:5000", _hello())
        twin = Conn(TWIN, failure)
        dialled = {TWIN: failure if isinstance(failure, BrokenError) else twin}
        units: dict[int, Any] = {0: tcp}
        part, _ = _part(units, dialled)
        conn, arena = await _link(part, tcp)
        assert conn is tcp
        assert units[0] is tcp
        assert not tcp.closed
        assert arena is not None
        assert part.fallbacks == 1


async def test_a_unit_without_shared_memory_stays_on_the_socket() -> None:
    tcp = Conn("tcp://10.0.0.1:5000", None)  # the unit answers None: no arena to share
    units: dict[int, Any] = {0: tcp}
    part, _ = _part(units, {})
    assert await _link(part, tcp) == (tcp, None)
    assert part.settled(0)  # asked once: not again
    assert part.fallbacks == 0


async def test_a_handshake_that_times_out_is_asked_again_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tcp = Conn("tcp://10.0.0.1:5000", TQTimeoutError("busy"))
    units: dict[int, Any] = {0: tcp}
    part, _ = _part(units, {TWIN: Conn(TWIN, _hello())})
    assert await _link(part, tcp) == (tcp, None)
    assert part.fallbacks == 1
    assert part.arenas == {0: None}
    assert part.settled(0)  # within RELINK_AFTER: the socket path, no new handshake
    monkeypatch.setattr(_same_host, "RELINK_AFTER", 0.0)
    tcp.answer = TQTimeoutError("busy")
    await _link(part, tcp)  # (settled, so not asked)
    assert len(tcp.asked) == 1
    part.forget_all()  # a new service: the retry timers go too
    part.arenas.clear()
    await _link(part, tcp)
    assert len(tcp.asked) == 2
    assert part.fallbacks == 2
    assert not part.settled(0)  # due at once: forgotten here, asked again
    assert 0 not in part.arenas
    tcp.answer = _hello(ipc=None)
    conn, arena = await _link(part, tcp)
    assert conn is tcp
    assert arena is not None


async def test_a_unit_that_went_away_during_the_handshake_is_linked_next_time() -> None:
    tcp = Conn("tcp://10.0.0.1:5000", BrokenError("gone"))
    part, _ = _part({0: tcp}, {})
    assert await _link(part, tcp) == (tcp, None)
    assert not part.settled(0)
    assert part.fallbacks == 0


async def test_close_and_fork_unmap_the_arenas() -> None:
    tcp = Conn("tcp://10.0.0.1:5000", _hello(ipc=None))
    units: dict[int, Any] = {0: tcp}
    part, _ = _part(units, {})
    _, arena = await _link(part, tcp)
    assert isinstance(arena, Arena)
    part.close()
    assert arena.closed
    assert part.arenas == {}
    # the unit may give those pages back now, and all it lent this connection (also with
    # answers to calls in flight, which nobody will read)
    assert tcp.sent == [ShmFree([], [], [3], closing=True)]
    _, arena = await _link(part, tcp)
    with part.copying(0):  # a copy off the loop may still use what the unit lent: kept
        part.close()
    assert tcp.sent[-1] == ShmFree([], [], [3])
    _, arena = await _link(part, tcp)
    assert isinstance(arena, Arena)
    part.after_fork()
    assert arena.closed
    assert arena.pinned is None
    assert part.arenas == {}
    part.forget(0)  # nothing mapped: nothing to do
    _, arena = await _link(part, tcp)
    part.forget(0)
    assert isinstance(arena, Arena)
    assert arena.closed
    assert 0 not in part.arenas


async def test_a_spare_grant_serves_one_put_on_its_connection_and_goes_back_otherwise() -> None:
    conn, other = Conn("tcp://10.0.0.1:5000"), Conn("tcp://10.0.0.1:5001")
    part, _ = _part({}, {})
    arena: Any = Arena(1, 7, 1 << 20, TOKEN)
    part.arenas[0] = part.arenas[1] = arena  # the units' arena, mapped here
    spare = ShmGrant(11, 8192, 65536)
    part.keep_spare(0, cast(Any, conn), arena, spare)
    assert part.spare_bytes() == 65536
    assert part.take_spare(0, cast(Any, conn), 65536) == spare  # taken: one put uses it
    assert part.take_spare(0, cast(Any, conn), 1) is None
    small = ShmGrant(12, 8192, 4096)
    part.keep_spare(0, cast(Any, conn), arena, spare)
    part.keep_spare(0, cast(Any, conn), arena, small)
    assert conn.sent == []  # both held: concurrent puts take one each
    assert part.take_spare(0, cast(Any, conn), 4096) == small  # the last lent, if it holds it
    assert part.take_spare(0, cast(Any, conn), 65536) == spare  # else one that does
    part.keep_spare(0, cast(Any, conn), arena, small)
    part.keep_spare(0, cast(Any, conn), arena, spare)
    assert part.take_spare(0, cast(Any, conn), 65537) is None  # all too small:
    assert conn.sent[-1] == ShmFree([12], [])  # the smallest goes back (puts grew)
    assert part.spare_bytes() == 65536
    assert part.take_spare(0, cast(Any, other), 4096) is None  # lent on another connection
    assert conn.sent[-1] == ShmFree([11], [])
    part.keep_spare(0, cast(Any, conn), arena, ShmGrant(13, 0, 4096))  # outside: corrupt
    assert conn.sent[-1] == ShmFree([13], [])
    assert part.spare_bytes() == 0
    for grant in range(20, 20 + SPARES_PER_UNIT + 1):  # one past the limit goes back
        part.keep_spare(0, cast(Any, conn), arena, ShmGrant(grant, 8192, 4096))
    assert conn.sent[-1] == ShmFree([20 + SPARES_PER_UNIT], [])
    assert part.spare_bytes() == SPARES_PER_UNIT * 4096
    part.forget(0)  # the unit's connection broke or it moved: every one goes back
    assert conn.sent[-SPARES_PER_UNIT:] == [
        ShmFree([g], []) for g in range(20, 20 + SPARES_PER_UNIT)
    ]
    assert part.spare_bytes() == 0
    # lent with an answer that came as the connection broke: its arena is forgotten (a
    # unit restarted at the address may have lent its region to another put): it goes back
    part.keep_spare(0, cast(Any, conn), arena, ShmGrant(16, 8192, 4096))
    assert conn.sent[-1] == ShmFree([16], [])
    assert part.spare_bytes() == 0
    part.keep_spare(1, cast(Any, conn), arena, ShmGrant(14, 8192, 4096))
    part.close()
    assert conn.sent[-1] == ShmFree([14], [])
    sent = len(conn.sent)
    part.arenas[1] = arena  # mapped again
    part.keep_spare(1, cast(Any, conn), arena, ShmGrant(15, 8192, 4096))
    assert part.ask_spare(2)  # asked on a put's way out
    part.after_fork()  # the parent's spare: the child neither uses nor frees it
    assert part.spare_bytes() == 0
    assert len(conn.sent) == sent
    assert part.ask_spare(2)  # nor waits for the parent's answer


def test_puts_in_flight_ask_a_unit_for_spares_up_to_the_limit() -> None:
    conn = Conn("tcp://10.0.0.1:5000")
    part, _ = _part({}, {})
    arena: Any = Arena(1, 7, 1 << 20, TOKEN)
    part.arenas[0] = arena
    assert all(part.ask_spare(0) for _ in range(SPARES_PER_UNIT))  # concurrent puts
    assert not part.ask_spare(0)  # as many asked as may be held
    assert part.ask_spare(1)  # each unit its own
    part.asked(0)
    part.keep_spare(0, cast(Any, conn), arena, ShmGrant(11, 8192, 4096))
    assert not part.ask_spare(0)  # held and asked for together
    assert part.take_spare(0, cast(Any, conn), 4096) is not None
    assert part.ask_spare(0)
    for _ in range(SPARES_PER_UNIT):
        part.asked(0)
    assert part.ask_spare(0)


def test_the_blocking_twin_links_in_the_calling_thread() -> None:
    tcp = BlockingConn("tcp://10.0.0.1:5000", _hello())
    twin = BlockingConn(TWIN, _hello())
    units: dict[int, Any] = {0: tcp}
    part = BlockingSameHostUnits(
        units,
        request_timeout=60.0,
        dial=lambda address, **kw: cast(Any, twin),
        forget=lambda unit_id: None,
    )
    conn, arena = cast(Any, part.link(0, cast(Any, tcp)))
    assert conn is twin
    assert units[0] is twin
    assert isinstance(arena, Arena)


def test_device_spares_are_held_apart_and_checked_against_the_device_arena() -> None:
    """A device grant lent ahead is held apart from the arena's (a put of host columns never
    takes one, nor one of device columns a shared-memory grant), checked against the device
    arena's bounds, and goes back with the unit's arena as the others do."""
    from tq_async._errors import ProtocolError

    conn = Conn("tcp://10.0.0.1:5000")
    part, _ = _part({}, {})
    arena: Any = Arena(1, 7, 1 << 20, TOKEN)
    part.arenas[0] = arena

    def check(offset: int, nbytes: int, what: str) -> None:  # a device arena of 1 MiB
        if not (offset >= 4096 and offset + nbytes <= 1 << 20):
            raise ProtocolError(f"{what} lies outside the unit's device arena")

    part.keep_spare(0, cast(Any, conn), arena, ShmGrant(11, 8192, 65536), check=check)
    assert part.spare_bytes() == 0
    assert part.spare_bytes(device=True) == 65536
    assert part.take_spare(0, cast(Any, conn), 4096) is None  # not a shared-memory grant
    assert part.ask_spare(0, device=True)
    assert part.ask_spare(0)  # each kind its own count
    part.asked(0, device=True)
    part.asked(0)
    got = part.take_spare(0, cast(Any, conn), 4096, device=True)
    assert got == ShmGrant(11, 8192, 65536)
    part.keep_spare(0, cast(Any, conn), arena, ShmGrant(12, 0, 4096), check=check)
    assert conn.sent[-1] == ShmFree([12], [])  # outside the device arena: corrupt
    part.keep_spare(0, cast(Any, conn), arena, ShmGrant(13, 8192, 4096), check=check)
    part.keep_spare(0, cast(Any, conn), arena, ShmGrant(14, 8192, 4096))
    part.forget(0)  # both kinds go back with the unit's arena
    assert sorted(m.grants[0] for m in conn.sent[-2:]) == [13, 14]
    assert part.spare_bytes() == part.spare_bytes(device=True) == 0
