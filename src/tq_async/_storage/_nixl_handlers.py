"""A storage unit's NIXL path: its agent, with the shared-memory arena registered.

Clients on other hosts (or any client, with ``data_path="nixl"``) read and write the unit's
arena by RDMA through NIXL (`tq_async._paths._nixl`), with the same grants and pins as
shared-memory clients (`tq_async._storage._shm_handlers`); a NIXL client has no pid the
unit could watch, so its claims expire instead (see `Claims`).
The agent is made once, on a worker thread (it takes ~0.5 s): when serving starts under
``"nixl"``, or on the first `NixlHello` under ``"auto"``; hellos that come meanwhile
wait for it. When NIXL is missing or fails, the unit offers the socket and shared memory only.
"""

from __future__ import annotations

import anyio

from .._logging import get_logger
from .._paths._nixl import UnitNixl
from .._paths._nixl import load as load_nixl
from .._wire._protocol import NixlHello, NixlHelloReply
from ._book import Book
from ._cells import StorageState

__all__ = ["NixlPath"]

log = get_logger(__name__)


class NixlPath:
    """The NIXL agent of one unit (``state.nixl`` once made) and its hello.

    Args:
        state: the unit's cells (their arena is the one registered).
        book: the unit's clients (NIXL clients are noted there) and what it offers.
        encrypted: the unit's socket is encrypted (UCX is not: NIXL is then offered only
            when asked for by ``data_path="nixl"``).
    """

    def __init__(self, state: StorageState, book: Book, *, encrypted: bool) -> None:
        self.state = state
        self.book = book
        self.encrypted = encrypted
        #: set once the agent is made (or failed to be): NIXL hellos that came meanwhile wait
        self._ready: anyio.Event | None = None

    def offered(self) -> bool:
        """Whether the unit offers NIXL (it may not have made its agent yet)."""
        if self.state.arena is None or self.book.data_path not in ("auto", "nixl"):
            return False
        # UCX does not encrypt: an encrypted unit offers NIXL only if told to
        return not self.encrypted or self.book.data_path == "nixl"

    def answers_now(self) -> bool:
        """Whether a hello is answered at once: the agent is made, failed, or not offered."""
        if self.state.nixl is not None or not self.offered():
            return True
        return self._ready is not None and self._ready.is_set()

    def hello(self, peer: bytes, body: NixlHello, unit: int) -> NixlHelloReply | None:
        """Offer a client the NIXL path (None: the unit offers none, or NIXL failed)."""
        arena, agent = self.state.arena, self.state.nixl
        if arena is None or agent is None or not self.offered():
            return None
        self.book.nixl_peers.add(peer)
        log.debug("a NIXL client", unit=unit, agent=body.agent)
        return NixlHelloReply(agent.metadata, agent.name, arena.base, arena.cap)

    async def hello_when_ready(
        self, peer: bytes, body: NixlHello, unit: int
    ) -> NixlHelloReply | None:
        """`hello` once the agent is made (the first hello starts making it)."""
        await self.start()  # the first hello starts it, the others find it started
        assert self._ready is not None
        await self._ready.wait()
        return self.hello(peer, body, unit)

    async def start(self) -> None:
        """Make the agent and register the arena, once, on a worker thread (the unit serves
        other requests meanwhile); without NIXL, or when it fails, the unit offers the
        socket and shared memory only."""
        arena = self.state.arena
        if self._ready is not None or arena is None:
            return
        ready = self._ready = anyio.Event()
        limit, arena.idle_limit = arena.idle_limit, arena.cap  # pages stay the registered ones

        def make() -> UnitNixl | None:
            nixl = load_nixl()
            return None if nixl is None else UnitNixl(nixl, arena.base, arena.cap)

        unit = None
        try:
            # not abandoned when cancelled: the agent is kept (and closed with the arena)
            unit = await anyio.to_thread.run_sync(make)
        except Exception as exc:
            log.warning("NIXL could not register the arena: socket only", error=str(exc))
            self.book.data_path = "shm"
        finally:
            if unit is None:
                arena.idle_limit = limit
            self.state.nixl = unit
            ready.set()

    def close(self) -> None:
        """Close the agent (before the arena is unmapped: it has it registered)."""
        if self.state.nixl is not None:
            self.state.nixl.close()
            self.state.nixl = None
        self._ready = None
