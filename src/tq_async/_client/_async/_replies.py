"""Reply payloads decoded into the types the client's calls expect: `decode`."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from ..._errors import ProtocolError

__all__ = ["decode"]

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
