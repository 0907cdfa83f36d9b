"""Requests cancelled on their way: a caller that gives up right after its request went out
(the service acts on it and answers a caller that is gone)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio

from tq_async._transport._dealer import DealerConnection


@contextmanager
def cancelled_at(kind: type) -> Iterator[tuple[anyio.CancelScope, list[Any]]]:
    """A scope cancelled as a request of ``kind`` is sent (it takes effect at the request's
    first wait: after it went out), and the bodies of those requests, while inside."""
    request = DealerConnection.request
    scope = anyio.CancelScope()
    sent: list[Any] = []

    async def cancelling(self: DealerConnection, body: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(body, kind):
            sent.append(body)
            scope.cancel()
        return await request(self, body, *args, **kwargs)

    DealerConnection.request = cancelling  # type: ignore[method-assign]
    try:
        yield scope, sent
    finally:
        DealerConnection.request = request  # type: ignore[method-assign]


class Paused:
    """Requests held before they go out (see `paused_at`): ``bodies`` in the order they
    arrived, `reached` to wait for the first ``n``, `go` to let them all go."""

    def __init__(self) -> None:
        self.bodies: list[Any] = []
        self.arrived = anyio.Event()
        self.gate = anyio.Event()

    async def reached(self, n: int) -> None:
        """Wait until ``n`` requests are held."""
        while len(self.bodies) < n:
            await self.arrived.wait()
            self.arrived = anyio.Event()

    def go(self) -> None:
        self.gate.set()


@contextmanager
def paused_at(kind: type) -> Iterator[Paused]:
    """Requests of ``kind`` wait, before they are sent, until ``go()`` (a caller cancelled
    meanwhile gives up there: nothing of it went out)."""
    request = DealerConnection.request
    paused = Paused()

    async def pausing(self: DealerConnection, body: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(body, kind):
            paused.bodies.append(body)
            paused.arrived.set()
            await paused.gate.wait()
        return await request(self, body, *args, **kwargs)

    DealerConnection.request = pausing  # type: ignore[method-assign]
    try:
        yield paused
    finally:
        DealerConnection.request = request  # type: ignore[method-assign]
