# Generated from src/tq_async/_client/_async/_nixl_links.py by scripts/unasync.py:
# do not edit; change the source and run `python scripts/unasync.py`.
"""A client's NIXL links to storage units on other hosts (see `tq_async._paths._nixl`).

`NixlLinks` is held by a client: it says hello to each unit once (the unit's agent
metadata and arena), and moves a put's or a read's bytes with one-sided WRITE/READ between
the process's registered staging buffers and the unit's arena, on a worker thread. A transfer
that fails gives its grant or pin back and returns ``False``/``None``: the caller sends the
request through the socket instead (counted in ``tq_transfer_fallbacks_total{reason}``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..._errors import BrokenError, ClosedError, ProtocolError
from ..._logging import get_logger
from ..._paths._nixl import ClientAgent, TransferFailed, client_agent, fallbacks
from ..._paths._shm import PAGE, align
from ..._sync_primitives import Lock, run_sync_off_loop
from ..._transport._sync_dealer import BlockingConnection
from ..._wire._protocol import (
    NixlHello,
    NixlHelloReply,
    ShmAlloc,
    ShmFrames,
    ShmFree,
    StorePut,
)
from ._replies import ask_grant, decode

__all__ = ["NixlLinks", "NixlPeer"]

log = get_logger(__name__)


class NixlPeer:
    """A unit reached through NIXL: its agent's name and its registered arena."""

    __slots__ = ("agent", "base", "name", "size")

    def __init__(self, agent: ClientAgent, name: str, base: int, size: int) -> None:
        self.agent, self.name, self.base, self.size = agent, name, base, size

    def check(self, offset: int, nbytes: int, what: str) -> None:
        """Raise ProtocolError unless ``[offset, +nbytes)`` lies inside the arena."""
        if not (offset >= PAGE and nbytes >= 0 and offset + nbytes <= self.size):
            raise ProtocolError(
                f"{what} [{offset}, +{nbytes}) lies outside the unit's arena; its reply is corrupt"
            )


def _count(exc: TransferFailed) -> None:
    fallbacks[exc.reason] += 1
    log.warning("a NIXL transfer failed: this request goes through the socket", error=str(exc))


class NixlLinks:
    """The units this client reaches through NIXL (None: the unit offers none).

    Args:
        forced: ``data_path="nixl"``: units in this process are reached through NIXL too
            (otherwise an in-process connection copies once already).
    """

    def __init__(self, *, forced: bool = False) -> None:
        self.forced = forced
        self._peers: dict[int, NixlPeer | None] = {}
        self._locks: dict[int, Lock] = {}

    def link(self, unit_id: int, conn: BlockingConnection, timeout: float) -> NixlPeer | None:
        """The unit's NIXL peer, asked once per unit (None: use the socket)."""
        if unit_id in self._peers:
            return self._peers[unit_id]
        if conn.inproc and not self.forced:
            return None
        with self._locks.setdefault(unit_id, Lock()):
            if unit_id in self._peers:
                return self._peers[unit_id]
            agent = run_sync_off_loop(client_agent)
            peer = None
            if agent is not None:
                try:
                    payload, _ = conn.request(NixlHello(agent.agent.name), timeout=timeout)
                except (BrokenError, ClosedError):
                    return None  # the socket path decides what a gone unit means
                hello: NixlHelloReply | None = decode(payload, NixlHelloReply | None)
                if hello is not None:
                    name = run_sync_off_loop(agent.add_remote, hello.metadata)
                    peer = NixlPeer(agent, name, hello.base, hello.size)
            self._peers[unit_id] = peer
            return peer

    def forget(self, unit_id: int) -> None:
        """The unit's connection broke or a transfer failed: say hello again next time."""
        peer = self._peers.pop(unit_id, None)
        if peer is not None:
            peer.agent.remove_remote(peer.name)

    def put(
        self,
        unit_id: int,
        conn: BlockingConnection,
        peer: NixlPeer,
        body: StorePut,
        frames: Sequence[Any],
        timeout: float,
    ) -> bool:
        """WRITE ``frames`` into a grant of the unit's arena, then send ``body`` naming them.
        False: no room, or the transfer failed (nothing was stored; use the socket)."""
        nbytes = sum(align(memoryview(f).nbytes) for f in frames)
        grant = ask_grant(conn, ShmAlloc(nbytes), timeout, peer, "a NIXL grant")
        if grant is None:
            return False
        try:
            deadline = time.monotonic() + timeout
            try:
                spans = run_sync_off_loop(
                    peer.agent.write, peer.name, peer.base + grant.offset, frames, deadline
                )
            except TransferFailed as exc:
                _count(exc)
                conn.send_oneway(ShmFree([grant.grant], []))
                self.forget(unit_id)
                return False
            body.shm = ShmFrames(grant.grant, spans)
            conn.request(body, timeout=timeout)
        except BaseException:
            body.shm = None
            # the unit ignores a grant it consumed already (a put that reached it)
            conn.send_oneway(ShmFree([grant.grant], []))
            raise
        return True

    def read(
        self, unit_id: int, peer: NixlPeer, spans: Sequence[tuple[int, int]], timeout: float
    ) -> list[Any] | None:
        """READ the unit's pinned ``spans`` into buffers of our own; None if the transfer
        failed (the caller unpins and reads through the socket)."""
        for off, n in spans:
            if n:
                peer.check(off, n, "a NIXL span")
        deadline = time.monotonic() + timeout
        try:
            frames: list[Any] = run_sync_off_loop(
                peer.agent.read, peer.name, peer.base, spans, deadline
            )
        except TransferFailed as exc:
            _count(exc)
            self.forget(unit_id)
            return None
        return frames
