"""Reply payloads decoded into the types the client's calls expect (`decode`), and the one
reply every data path checks the same way: a unit's grant of arena space (`ask_grant`)."""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, TypeVar

import msgspec

from ..._errors import ProtocolError
from ..._transport._dealer import DealerConnection
from ..._wire._protocol import Reply, ShmAlloc, ShmFree, ShmGrant

__all__ = ["Region", "ask_grant", "decode"]

T = TypeVar("T")
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def decode(payload: msgspec.Raw, typ: type[T] | Any) -> T:
    """``payload`` as a ``typ`` (its decoder made once per type).

    Raises:
        ProtocolError: the payload is not a ``typ`` (the peer is not what it should be).
    """
    dec = _decoders.get(typ)
    if dec is None:
        dec = _decoders[typ] = msgspec.msgpack.Decoder(typ)
    try:
        return dec.decode(payload)  # type: ignore[no-any-return]
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"unexpected reply payload: {exc}") from exc


class Region(Protocol):
    """Memory of a unit's that grants are carved from (an arena mapped here, a device arena
    opened here, a NIXL peer's registered arena)."""

    def check(self, offset: int, nbytes: int, what: str) -> None:
        """Raise unless ``[offset, offset + nbytes)`` lies inside this memory."""


async def ask_grant(
    conn: DealerConnection, ask: ShmAlloc, timeout: float, region: Region, what: str
) -> ShmGrant | None:
    """The unit's grant of ``ask.nbytes`` (None: no room), checked to lie inside ``region``
    and to hold them; ``what`` names the grant in errors.

    Raises:
        ProtocolError: the grant does not (the unit's reply is corrupt); it is given back.

    Cancelled (or timed out) after the unit granted, the late grant is given back too.
    """

    def on_abandon(reply: Reply, _frames: list[Any]) -> None:
        if reply.ok:  # granted after the caller gave up: nobody will use it
            with contextlib.suppress(ProtocolError):
                late: ShmGrant | None = decode(reply.payload, ShmGrant | None)
                if late is not None:
                    conn.send_best_effort(ShmFree([late.grant], []))

    payload, _ = await conn.request(ask, timeout=timeout, on_abandon=on_abandon)
    grant: ShmGrant | None = decode(payload, ShmGrant | None)
    if grant is None:
        return None
    try:
        try:
            region.check(grant.offset, grant.size, what)
        except ValueError as exc:  # an arena mapped here says so as a ValueError
            raise ProtocolError(f"{exc}; the storage unit's reply is corrupt") from None
        if grant.size < ask.nbytes:
            raise ProtocolError(f"{what} is smaller than asked for")
    except BaseException:
        conn.send_best_effort(ShmFree([grant.grant], []))
        raise
    return grant
