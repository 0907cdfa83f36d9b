# Generated from src/tq_async/_client.py by scripts/unasync.py: do not edit; change
# the source and run `python scripts/unasync.py`.
"""``Client``: put, get_meta, get_data and every controller call, over pooled sockets.

One client holds one DEALER socket to the controller and one per storage unit, opened on
first use and shared by every concurrent call (requests are multiplexed by id). A put is
three steps — ask the controller for rows and placement, send each unit its slice, commit —
and the rows become visible to consumers only at the commit, with their tags.

Two faces, one implementation. This module and its siblings (``_client_base``, ``_client_put``,
``_client_get``, ``_client_calls``, ``_client_nixl``, ``_checkpoint``) are the only source of
the client's logic; ``scripts/unasync.py`` generates the blocking ``tq.Client`` from them
(``_sync*.py``), as httpcore generates its sync twin, and ``tests/test_sync_parity.py`` fails
when the generated modules are not current. What differs between the faces is the I/O and
nothing else: the event-loop connection (``_dealer``) against one driven by the calling
thread (``_sync_dealer``), and three concurrency helpers (``_primitives`` /
``_sync_primitives``). A generated twin rather than a sans-I/O core with two shells: the
client's calls are chains of dependent requests with undo paths between them (a put asks for
placement, writes each unit through shared memory, NIXL or the socket, commits, and aborts or
clears on any failure; a read pins and unpins; a moved unit is asked again), which read as
straight-line code here and would each become an explicit state machine in a sans-I/O core,
doubling the code the two faces must agree on.
"""

from __future__ import annotations

import sys
from types import TracebackType

from ._errors import (
    TQTimeoutError,
)
from ._logging import get_logger
from ._options import ClientOptions
from ._sync_calls import ControlCalls

if sys.version_info >= (3, 11):
    from typing import Self, Unpack
else:  # pragma: no cover - depends on the Python version
    from typing_extensions import Self, Unpack

__all__ = ["Client"]

log = get_logger(__name__)


class Client(ControlCalls):
    """Talks to a tq_async controller and its storage units.

    Use it as a context manager::

        with tq.Client.connect(address) as client:
            meta = client.put(td, partition_id="train@0")

    Args:
        address: the controller's endpoint (``cluster.address``, or what ``tq-async serve``
            printed).
        connect_timeout: seconds :meth:`open` waits for the controller's first answer (at
            most ``request_timeout``) before it fails with :class:`~tq_async.TQTimeoutError`
            naming the address (a host that drops the connection attempts, or a peer that
            never answers; ZMQ alone would wait forever). A refused connection (nothing
            listens at the address) fails at once with :class:`~tq_async.BrokenError`.
        request_timeout: seconds any single non-waiting request may take before it fails with
            :class:`~tq_async.TQTimeoutError` (a dead service never hangs the caller).
        allow_pickle: let this client pickle values msgpack cannot carry. None follows the
            controller's setting.
        curve: CURVE keys, when the services require them (see :class:`~tq_async.CurveClient`).
        retry_after: when a request with a deadline has no reply after this many seconds,
            reconnect (same identity) and resend it; services deduplicate retried requests,
            so nothing runs twice. None disables retries. A same-host Unix-socket
            connection is not retried: it loses nothing without reporting its end, so a
            silent service there is a busy one, waited for up to ``request_timeout``.
        inline_put_bytes: a put of at most this many bytes whose rows sit on one storage
            unit (new rows always do) goes to the controller in one message, which stores
            and commits it (:class:`~tq_async._protocol.PutInline`): one round trip instead
            of three, and the lowest put-to-consumer latency. Larger puts send their columns
            straight to the units. 0 disables it.
        inline_get_bytes: :meth:`get` asks the controller to send the cells along with the
            batch's metadata when they sit in storage units of the controller's own process
            (``local_cluster``, ``tq-async serve``) and take at most this many bytes: one
            round trip instead of two. Otherwise it reads them from the units. 0 disables it.
        shared_memory: with a storage unit on this host (verified: the client must read a
            token the unit wrote into its shared memory), puts of at least 64 KiB copy their
            column bytes straight into the unit's memory and reads copy out of it, instead of
            sending them through a socket (see ``docs/deployment.md``). False always uses
            the socket.
        same_host: False treats every service as remote: no shared memory (whatever
            ``shared_memory`` says) and the addresses exactly as given.
        busy_poll: seconds a request to a service on this host (over its Unix socket) with
            no other request in flight reads its socket for the reply before it parks in the
            event loop: waking a parked process costs 25-30 us on a VM, which this saves, at
            the price of up to this much CPU per request. After a poll that caught nothing
            (the service was waiting for data) the next 1, 2, ... 64 requests park at once.
            0 turns it off.
        data_path: how column bytes travel to and from the storage units: ``"auto"``
            (shared memory with a unit on this host; NIXL with one on another host when both
            have it, this host has RDMA hardware and this client does not use CURVE; the
            socket otherwise), ``"shm"`` (no
            NIXL), ``"nixl"`` (NIXL with every unit that offers it, this host's too) or
            ``"zmq"`` (always the socket). A NIXL transfer that fails falls back to the
            socket for that request (see ``docs/deployment.md``, "Data paths").

    Attributes:
        link_fallbacks: same-host switches that did not happen: a handshake with the
            controller or a storage unit that got no answer within 5 s, or a Unix socket
            that was refused. That service is then reached through the socket the handshake
            was sent on (for a unit: without shared memory, asked again 30 s later); no
            request fails for it.

    A client belongs to the event loop (and process) that opened it.
    """

    @classmethod
    def connect(cls, address: str, **options: Unpack[ClientOptions]) -> Client:
        """A client for ``address``; enter it with ``with`` to open the connection.

        ``options`` are the constructor's (:class:`~tq_async.ClientOptions`)."""
        return cls(address, **options)

    def __enter__(self) -> Client:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def open(self) -> Self:
        """Connect to the controller and learn the storage units; returns the client.

        Raises:
            TQTimeoutError: the controller did not answer within ``connect_timeout``.
            BrokenError: nothing listens at the address (the connection was refused), or
                what accepted the connection is not a tq_async service.
            AuthenticationError: the services refused this client's CURVE keys.
        """
        if self._links.controller is not None:
            return self
        # a refused first attempt means nothing listens there: fail now, not at the timeout
        controller = self._links.controller = self._links.connection(
            self.address, refused_is_broken=True
        )
        wait = min(self.connect_timeout, self.request_timeout)
        try:
            try:
                hello = self._links.refresh_units(timeout=wait)
            except TQTimeoutError:
                raise TQTimeoutError(
                    f"nothing answered at {self.address} within {wait:g} s (connect_timeout); "
                    "check the address (the TQ_ADDRESS=... line "
                    "`tq-async serve` prints), that the services run, and that this host can "
                    "reach them"
                ) from None
            # from now on a refusal is a restarting controller: requests wait for it
            controller.refused_is_broken = False
            if self.same_host:
                self._links.prefer_ipc(hello)
        except BaseException:
            if self._links.controller is not None:
                self._links.controller.close()
                self._links.controller = None
            raise
        return self

    def close(self) -> None:
        """Close every socket; calls still waiting fail with :class:`~tq_async.ClosedError`."""
        self._links.close()

    @property
    def closed(self) -> bool:
        return self._links.controller is None

    @property
    def link_fallbacks(self) -> int:
        """Same-host switches that did not happen (see the class docstring)."""
        return self._links.link_fallbacks
