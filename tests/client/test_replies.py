"""Reply payloads as the client's calls expect them (`decode`), and the arena grant every put
path checks the same way (`ask_grant`), against a stand-in unit connection."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import msgspec
import pytest

from tq_async._client._async._replies import ask_grant, decode
from tq_async._client._sync._replies import ask_grant as ask_grant_now
from tq_async._errors import ProtocolError
from tq_async._wire._protocol import Reply, ShmAlloc, ShmFree, ShmGrant


class Unit:
    """Answers every request with ``answer``; records the one-way messages, and what a
    late reply would be handed to (``on_abandon``)."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.asked: list[tuple[Any, float | None]] = []
        self.sent: list[Any] = []
        self.on_abandon: Callable[[Reply, list[Any]], None] | None = None

    async def request(
        self,
        body: Any,
        timeout: float | None = None,
        on_abandon: Callable[[Reply, list[Any]], None] | None = None,
    ) -> tuple[bytes, list[Any]]:
        self.asked.append((body, timeout))
        self.on_abandon = on_abandon
        return msgspec.msgpack.encode(self.answer), []

    def send_best_effort(self, body: Any) -> bool:
        self.sent.append(body)
        return True


class BlockingUnit(Unit):
    def request(  # type: ignore[override]
        self,
        body: Any,
        timeout: float | None = None,
        on_abandon: Callable[[Reply, list[Any]], None] | None = None,
    ) -> tuple[bytes, list[Any]]:
        self.asked.append((body, timeout))
        self.on_abandon = on_abandon
        return msgspec.msgpack.encode(self.answer), []


class Region:
    """Memory of ``size`` bytes; ``error`` is what a span outside it raises."""

    def __init__(self, size: int, error: type[Exception] = ProtocolError) -> None:
        self.size = size
        self.error = error

    def check(self, offset: int, nbytes: int, what: str) -> None:
        if offset < 0 or offset + nbytes > self.size:
            raise self.error(f"{what} [{offset}, +{nbytes}) lies outside the arena")


async def _ask(unit: Unit, region: Region, nbytes: int = 4096) -> ShmGrant | None:
    return await ask_grant(cast(Any, unit), ShmAlloc(nbytes), 7.0, region, "a test grant")


def test_decode_names_a_payload_of_another_type() -> None:
    def raw(value: Any) -> msgspec.Raw:
        return msgspec.Raw(msgspec.msgpack.encode(value))

    assert decode(raw(ShmGrant(1, 0, 8)), ShmGrant) == ShmGrant(1, 0, 8)
    assert decode(raw(None), ShmGrant | None) is None
    with pytest.raises(ProtocolError, match="unexpected reply payload"):
        decode(raw("no"), ShmGrant)


async def test_a_grant_inside_the_region_is_taken() -> None:
    unit = Unit(ShmGrant(5, 8192, 4096))
    assert await _ask(unit, Region(1 << 20)) == ShmGrant(5, 8192, 4096)
    assert unit.asked == [(ShmAlloc(4096), 7.0)]
    assert unit.sent == []


async def test_no_room_is_none() -> None:
    unit = Unit(None)
    assert await _ask(unit, Region(1 << 20)) is None
    assert unit.sent == []


@pytest.mark.parametrize("error", [ProtocolError, ValueError])
async def test_a_grant_outside_the_region_is_given_back(error: type[Exception]) -> None:
    unit = Unit(ShmGrant(5, 1 << 20, 4096))
    with pytest.raises(ProtocolError, match=r"a test grant .* lies outside the arena"):
        await _ask(unit, Region(1 << 20, error))
    assert unit.sent == [ShmFree([5], [])]


async def test_a_grant_smaller_than_asked_is_given_back() -> None:
    unit = Unit(ShmGrant(5, 0, 1024))
    with pytest.raises(ProtocolError, match="a test grant is smaller than asked for"):
        await _ask(unit, Region(1 << 20))
    assert unit.sent == [ShmFree([5], [])]


async def test_a_grant_that_comes_after_the_caller_gave_up_is_given_back() -> None:
    """The connection hands a reply that came after its caller was cancelled (or timed out)
    to ``on_abandon``: a grant in it goes back; an error, no room, or a corrupt payload
    frees nothing."""
    unit = Unit(None)
    await _ask(unit, Region(1 << 20))
    late = unit.on_abandon
    assert late is not None

    def reply(ok: bool, payload: Any) -> Reply:
        return Reply(1, ok, msgspec.Raw(msgspec.msgpack.encode(payload)))

    late(reply(True, ShmGrant(9, 4096, 4096)), [])
    assert unit.sent == [ShmFree([9], [])]
    late(reply(True, None), [])
    late(reply(False, ["InvalidRequestError", "no"]), [])
    late(reply(True, "corrupt"), [])
    assert unit.sent == [ShmFree([9], [])]


def test_the_blocking_twin_asks_in_the_calling_thread() -> None:
    unit = BlockingUnit(ShmGrant(5, 0, 4096))
    got = ask_grant_now(cast(Any, unit), ShmAlloc(4096), 7.0, Region(1 << 20), "a test grant")
    assert got == ShmGrant(5, 0, 4096)
