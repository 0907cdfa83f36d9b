"""Who holds which of a storage unit's memory: the data paths' bookkeeping, without I/O.

A unit lends regions of its shared-memory arena (and of its device arena) to its clients: a
*grant* is a region a client writes one put into (the put consumes it), a *pin* the regions a
read's reply points into (held until the client has copied them out and frees the pin).
`Book` records who holds what, and decides what goes back when a client frees its
grants and pins, exits (its pid is watched), or -- a NIXL client, which no pid tells about --
stays silent past the claims' ttl. Each of those steps returns the regions to release
(`Released`); the unit releases them into its arenas. Nothing here touches an arena,
a socket or an event loop: like httpcore's pool (decide in ``_assign_requests_to_connections``,
then do the I/O), the book decides and the server's parts act.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .._paths._nixl import Claims
from .._paths._shm import Region, next_id

__all__ = ["Book", "Grant", "Pin", "Released"]


class Grant(NamedTuple):
    """A region lent to ``peer`` (process ``pid``; 0: a NIXL client) for one put."""

    peer: bytes
    pid: int
    region: Region


class Pin(NamedTuple):
    """The shared-memory regions a read's reply to ``peer`` points into."""

    peer: bytes
    pid: int
    regions: list[Region]


@dataclass(slots=True)
class Released:
    """What a step of the book gives back: regions of each arena to release.

    Attributes:
        shm: regions of the shared-memory arena.
        device: regions of the device arena.
        expired: the NIXL claims (``("grant" | "pin", id)``) given back as abandoned.
    """

    shm: list[Region] = field(default_factory=list)
    device: list[Region] = field(default_factory=list)
    expired: list[tuple[str, int]] = field(default_factory=list)
    #: arena chunks no longer held registered by the client (to unlock)
    chunks: list[int] = field(default_factory=list)


class Book:
    """The clients of a unit's data paths and the regions each holds.

    Args:
        data_path: what the unit offers besides the socket (see
            `StorageServer`); a unit whose NIXL agent
            fails to start offers ``"shm"`` from then on.
        claims: when NIXL clients' grants and pins were given (a new one by default).

    Attributes:
        peers: same-host clients (socket identity -> pid) that set up shared memory.
        nixl_peers: clients that use the unit's NIXL agent.
        grants: shared-memory grants by id.
        device_grants: device arena grants by id (the ids are drawn from the same counter).
        pins: read pins by id.
        device_pins: the device arena regions a read pin holds, by the pin's id.
        locked: the arena chunks each same-host client holds registered with its GPU
            driver (see `tq_async._paths._pinned`), by socket identity.
        spares: the size of each grant lent ahead of a client's next put (`lend_spare`),
            by id; ``spare_bytes`` their sum (``device_spare_bytes``: of those in the
            device arena).
    """

    def __init__(self, data_path: str = "auto", claims: Claims | None = None) -> None:
        self.data_path = data_path
        self.claims = claims if claims is not None else Claims()
        self.peers: dict[bytes, int] = {}
        self.nixl_peers: set[bytes] = set()
        self.grants: dict[int, Grant] = {}
        self.device_grants: dict[int, Grant] = {}
        self.pins: dict[int, Pin] = {}
        self.device_pins: dict[int, list[Region]] = {}
        self.locked: dict[bytes, set[int]] = {}
        self.spares: dict[int, int] = {}
        self.spare_bytes = 0
        self.device_spare_bytes = 0

    def pid(self, peer: bytes) -> int | None:
        """The pid of a same-host client, 0 for a NIXL client, None for one that set up
        neither (it uses the socket)."""
        pid = self.peers.get(peer)
        if pid is None and peer in self.nixl_peers:
            return 0
        return pid

    # ---- lending -----------------------------------------------------------------------------

    def grant(self, peer: bytes, pid: int, region: Region, *, device: bool = False) -> int:
        """Lend ``region`` (of the device arena when ``device``) for one put; its id."""
        gid = next_id()
        (self.device_grants if device else self.grants)[gid] = Grant(peer, pid, region)
        if pid == 0 and not device:
            self.claims.note("grant", gid)
        return gid

    def lend_spare(self, peer: bytes, pid: int, region: Region, *, device: bool = False) -> int:
        """Lend ``region`` (of the device arena when ``device``) ahead of ``peer``'s next
        put, with the answer to this one (a grant like any other, counted in
        ``spare_bytes`` or ``device_spare_bytes`` until used or given back)."""
        gid = self.grant(peer, pid, region, device=device)
        self.spares[gid] = region.size
        if device:
            self.device_spare_bytes += region.size
        else:
            self.spare_bytes += region.size
        return gid

    def _unspare(self, gid: int, *, device: bool = False) -> None:
        if device:
            self.device_spare_bytes -= self.spares.pop(gid, 0)
        else:
            self.spare_bytes -= self.spares.pop(gid, 0)

    def pin(
        self, peer: bytes, pid: int, regions: list[Region], device: Sequence[Region] = ()
    ) -> int:
        """Hold ``regions`` (and ``device`` regions) for a read's reply; the pin's id."""
        pin = next_id()
        self.pins[pin] = Pin(peer, pid, regions)
        if device:
            self.device_pins[pin] = list(device)
        if pid == 0:
            self.claims.note("pin", pin)
        return pin

    def lock(self, peer: bytes, chunks: Iterable[int]) -> list[int]:
        """``peer`` will hold ``chunks`` registered; those it did not hold yet (to lock)."""
        held = self.locked.setdefault(peer, set())
        new = [c for c in chunks if c not in held]
        held.update(new)
        return new

    def take_grant(self, peer: bytes, gid: int, *, device: bool = False) -> Region | None:
        """The region of ``peer``'s grant ``gid``, consumed by a put; None when the grant is
        unknown (never given, used, freed) or another client's (then it is kept)."""
        grants = self.device_grants if device else self.grants
        entry = grants.get(gid)
        if entry is None or entry.peer != peer:
            return None
        del grants[gid]
        self._unspare(gid, device=device)
        return entry.region

    # ---- giving back -------------------------------------------------------------------------

    def free(
        self, peer: bytes, grants: Iterable[int], pins: Iterable[int], chunks: Iterable[int] = ()
    ) -> Released:
        """``peer`` gives back unused grants, read pins (others' ids are ignored) and the
        registration of ``chunks``."""
        out = Released()
        held = self.locked.get(peer)
        if held is not None:
            out.chunks = [c for c in chunks if c in held]
            held.difference_update(out.chunks)
        for gid in grants:
            entry = self.grants.get(gid)
            if entry is not None and entry.peer == peer:
                del self.grants[gid]
                self._unspare(gid)
                out.shm.append(entry.region)
            entry = self.device_grants.get(gid)
            if entry is not None and entry.peer == peer:
                del self.device_grants[gid]
                self._unspare(gid, device=True)
                out.device.append(entry.region)
        for key in pins:
            pin = self.pins.get(key)
            if pin is not None and pin.peer == peer:
                del self.pins[key]
                out.shm.extend(pin.regions)
                out.device.extend(self.device_pins.pop(key, []))
        return out

    def exited(self, pid: int) -> Released:
        """Process ``pid`` is gone: it is forgotten, and all it held goes back."""
        peers = [p for p, q in self.peers.items() if q == pid]
        for peer in peers:
            del self.peers[peer]
        return self._release(lambda e: e.pid == pid, peers)

    def closed(self, peer: bytes) -> Released:
        """``peer`` closed its client (its process lives on): it is forgotten, and all it
        held goes back, also what it was lent with answers it will never read."""
        self.peers.pop(peer, None)
        self.nixl_peers.discard(peer)
        return self._release(lambda e: e.peer == peer, [peer])

    def _release(self, held: Callable[[Grant | Pin], bool], peers: list[bytes]) -> Released:
        """Everything ``held`` says is one client's, and the chunks ``peers`` locked."""
        out = Released()
        for peer in peers:
            out.chunks.extend(self.locked.pop(peer, ()))
        for gid in [g for g, e in self.grants.items() if held(e)]:
            out.shm.append(self.grants.pop(gid).region)
            self._unspare(gid)
        for key in [k for k, e in self.pins.items() if held(e)]:
            out.shm.extend(self.pins.pop(key).regions)
            out.device.extend(self.device_pins.pop(key, []))
        for gid in [g for g, e in self.device_grants.items() if held(e)]:
            out.device.append(self.device_grants.pop(gid).region)
            self._unspare(gid, device=True)
        return out

    def expire(self) -> Released | None:
        """Take back the grants and pins NIXL clients held past the claims' ttl (None: no
        NIXL claim is outstanding)."""
        if not len(self.claims):
            return None

        def live(kind: str, claim: int) -> bool:
            return claim in (self.grants if kind == "grant" else self.pins)

        out = Released()
        for kind, claim in self.claims.expired(live):
            if kind == "grant":
                out.shm.append(self.grants.pop(claim).region)
            else:
                out.shm.extend(self.pins.pop(claim).regions)
                out.device.extend(self.device_pins.pop(claim, []))
            out.expired.append((kind, claim))
        return out

    def reset(self) -> None:
        """Forget every client and loan (the arenas are closed: nothing is released)."""
        self.peers.clear()
        self.nixl_peers.clear()
        self.grants.clear()
        self.device_grants.clear()
        self.pins.clear()
        self.device_pins.clear()
        self.locked.clear()
        self.spares.clear()
        self.spare_bytes = self.device_spare_bytes = 0
