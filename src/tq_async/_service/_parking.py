"""One way for a service's requests to wait: park under a key until the key is unparked.

The shape is trio's ``ParkingLot``, keyed: a request that cannot be answered yet parks under
what it waits for (``(partition, task)`` for a get_meta, ``"room"`` for a put at the
capacity, ``"admission"`` for a rollout), and whoever changes that thing unparks the key. A
parked task costs one future; nothing polls. Cancelling a parked task leaves nothing behind.

To never miss a wake-up between looking and parking, take a `ParkingLot.ticket` before
looking and await it after; or use `ParkingLot.until` for a plain condition.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

__all__ = ["ParkingLot"]


class ParkingLot:
    """Futures parked under keys, woken per key (see the module docstring)."""

    def __init__(self) -> None:
        self._parked: dict[Hashable, dict[asyncio.Future[None], None]] = {}
        #: bumped by every unpark: a task that was not parked yet can tell whether to look again
        self.generation = 0

    def __len__(self) -> int:
        """Number of parked futures."""
        return sum(len(futs) for futs in self._parked.values())

    def parked(self, key: Hashable) -> int:
        """Number of futures parked under ``key``."""
        return len(self._parked.get(key, ()))

    @contextmanager
    def ticket(self, key: Hashable) -> Iterator[asyncio.Future[None]]:
        """A future under ``key``, done once ``key`` is unparked; dropped when the block exits."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        futs = self._parked.setdefault(key, {})
        futs[fut] = None
        try:
            yield fut
        finally:
            futs.pop(fut, None)
            if not futs and self._parked.get(key) is futs:
                del self._parked[key]

    async def park(self, key: Hashable) -> None:
        """Wait until ``key`` is unparked."""
        with self.ticket(key) as fut:
            await fut

    async def until(self, key: Hashable, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds, looking again each time ``key`` is unparked."""
        while not predicate():
            await self.park(key)

    def unpark(self, key: Hashable) -> None:
        """Wake every task parked under ``key``."""
        self.generation += 1
        futs = self._parked.pop(key, None)
        if futs:
            for fut in futs:
                if not fut.done():
                    fut.set_result(None)

    def unpark_if(self, match: Callable[[Hashable], bool]) -> None:
        """Wake every task parked under a key for which ``match(key)`` holds."""
        for key in [k for k in self._parked if match(k)]:
            self.unpark(key)
        self.generation += 1
