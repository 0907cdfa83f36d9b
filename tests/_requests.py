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
