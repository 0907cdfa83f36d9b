"""The one waiting primitive of the services: park under a key, unpark the key."""

from __future__ import annotations

import asyncio

import pytest

from tq_async._service._parking import ParkingLot


async def test_unpark_wakes_only_its_key() -> None:
    lot = ParkingLot()
    a = asyncio.ensure_future(lot.park("a"))
    b = asyncio.ensure_future(lot.park("b"))
    await asyncio.sleep(0)  # both parked
    assert len(lot) == 2
    lot.unpark("a")
    await a
    assert not b.done()
    assert len(lot) == 1
    lot.unpark_if(lambda key: key == "b")
    await b
    assert len(lot) == 0


async def test_a_ticket_taken_before_looking_never_misses_a_wake_up() -> None:
    lot = ParkingLot()
    with lot.ticket(("p", "t")) as fut:
        lot.unpark(("p", "t"))  # happens "while looking"
        assert fut.done()
    assert len(lot) == 0


async def test_a_cancelled_parker_leaves_nothing_behind() -> None:
    lot = ParkingLot()
    task = asyncio.ensure_future(lot.park("k"))
    await asyncio.sleep(0)
    assert len(lot) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(lot) == 0
    assert not lot._parked  # no empty key left either


async def test_until_looks_again_on_every_unpark() -> None:
    lot = ParkingLot()
    state = {"n": 0}
    waiter = asyncio.ensure_future(lot.until("room", lambda: state["n"] >= 2))
    for n in (1, 2):
        await asyncio.sleep(0)
        assert not waiter.done()
        state["n"] = n
        lot.unpark("room")
    await waiter
    assert len(lot) == 0


async def test_generation_counts_unparks() -> None:
    lot = ParkingLot()
    before = lot.generation
    lot.unpark("nobody")
    assert lot.generation > before
