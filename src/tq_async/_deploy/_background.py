"""``background_cluster``: an embedded cluster for synchronous programs.

`local_cluster` runs the services as tasks of the caller's event loop, which a
plain script, a torchrun rank or TransferQueue-style code (``tq.init()``) does not have. A
`BackgroundCluster` runs the same services on their own event loop in a daemon thread:

    with tq.background_cluster(num_storage_units=2) as cluster:
        with tq.Client.connect(cluster.address) as client:
            client.put(td, partition_id="train@0")

Other processes of the host connect to ``cluster.address`` too. Starting blocks until every
service is bound (a bind error is raised in the caller); `BackgroundCluster.close` stops
the services and waits for the thread, at most ``close_timeout`` seconds.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import queue
import threading
from types import TracebackType
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal

from .._errors import ClosedError, InvalidRequestError, TQTimeoutError
from .._logging import get_logger
from ._cluster import LocalCluster, local_cluster

__all__ = ["BackgroundCluster", "background_cluster"]

log = get_logger(__name__)

_Started = tuple[BlockingPortal, anyio.Event, LocalCluster]


class BackgroundCluster:
    """A `local_cluster` running on its own event loop in a daemon thread.

    Create it with `background_cluster`. Use it as a context manager, or call
    `close` (idempotent; also run at interpreter exit).

    Attributes:
        address: the controller's endpoint; pass it to ``Client.connect`` or to processes.
        cluster: the running `LocalCluster` (its services live on the
            background loop: inspect, do not call).
    """

    def __init__(
        self,
        *,
        start_timeout: float = 60.0,
        close_timeout: float = 10.0,
        **kwargs: Any,
    ) -> None:
        self.close_timeout = close_timeout
        self._pid = os.getpid()
        self._closed = False
        ready: queue.Queue[_Started | BaseException] = queue.Queue()
        self._thread = threading.Thread(
            target=self._run, args=(kwargs, ready), name="tq_async-background-cluster", daemon=True
        )
        self._thread.start()
        try:
            got = ready.get(timeout=start_timeout)
        except queue.Empty:
            raise TQTimeoutError(
                f"the background cluster did not start within {start_timeout} s; the machine "
                "may be overloaded: retry, or raise start_timeout"
            ) from None
        if isinstance(got, BaseException):
            self._thread.join(close_timeout)
            raise _single(got)
        self._portal, self._stop, self.cluster = got
        self.address: str = self.cluster.address
        atexit.register(self.close)

    @staticmethod
    def _run(kwargs: dict[str, Any], ready: queue.Queue[_Started | BaseException]) -> None:
        async def main() -> None:
            async with BlockingPortal() as portal:
                stop = anyio.Event()
                async with local_cluster(**kwargs) as cluster:
                    cluster.controller.watch.price_requests = True  # a loop of services only
                    ready.put((portal, stop, cluster))
                    await stop.wait()

        try:
            anyio.run(main)
        except BaseException as exc:  # reported to the caller when it happens while starting
            if ready.empty():
                ready.put(exc)
            else:
                log.error("background cluster failed", exc_info=exc)

    @property
    def closed(self) -> bool:
        """True once `close` was called."""
        return self._closed

    def close(self) -> None:
        """Stop the services and wait for their thread (at most ``close_timeout`` s).

        Idempotent. In a child process forked from the owner it only forgets the cluster
        (the thread does not exist there; the owner stops the services).
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if os.getpid() != self._pid:
            return
        with contextlib.suppress(RuntimeError):  # the loop already ended
            self._portal.call(self._stop.set)
        self._thread.join(self.close_timeout)
        if self._thread.is_alive():
            log.warning("background cluster did not stop in time", close_timeout=self.close_timeout)

    def __enter__(self) -> BackgroundCluster:
        if self._closed:
            raise ClosedError("the background cluster is closed; start a new one")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.address
        return f"BackgroundCluster({state})"


def _single(exc: BaseException) -> BaseException:
    """The one error inside (nested) exception groups, as the caller wants to catch it."""
    while True:
        inner = getattr(exc, "exceptions", None)
        if not inner or len(inner) != 1:
            return exc
        exc = inner[0]


def background_cluster(**kwargs: Any) -> BackgroundCluster:
    """Start a `local_cluster` on a background thread, for synchronous code.

    Takes exactly the keyword arguments of `local_cluster`
    (``num_storage_units``, ``sampler``, ``task_samplers``, ``capacity``, ...). Returns once
    every service is bound.

    Example:

        with tq.background_cluster(num_storage_units=2) as cluster:
            with tq.Client.connect(cluster.address) as client: ...

    Returns:
        A running `BackgroundCluster`.

    Raises:
        BrokenError: an address could not be bound.
        InvalidRequestError: an argument is invalid (as for ``local_cluster``).
        InvalidRequestError: an unknown keyword argument (the message names it).
    """
    try:  # a wrong name fails here, not in the thread
        inspect.signature(local_cluster).bind(**kwargs)
    except TypeError as exc:
        raise InvalidRequestError(
            f"background_cluster takes local_cluster's keyword arguments: {exc}"
        ) from None
    return BackgroundCluster(**kwargs)
