"""The frames of a storage unit's index (``index.log``): ``[length u32][crc32 u32][payload]``.

Plain functions, no I/O: a record's payload framed (`frame`), the frames of an index's bytes
read back in order up to the first bad one (`frames`), and a bad one told apart (`check_torn`):
a torn tail, which a crash leaves (nothing whole after it), from damage (whole frames after
it: the disk's doing, bit rot), which a start must refuse rather than drop what follows.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from .._errors import TQError

__all__ = ["HEADER", "PAYLOAD", "check_torn", "frame", "frames"]

HEADER = struct.Struct("<II")  # payload length, crc32 of the payload
#: every record's payload's first byte (a msgpack array of four: tag, then the fields)
PAYLOAD = b"\x94"

#: a payload's record (raises `msgspec.DecodeError` when it is none)
Decode = Callable[[memoryview], Any]


def frame(payload: bytes) -> bytes:
    """``payload`` framed: its length and crc32 first."""
    return HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def frames(data: bytes, decode: Decode) -> Iterator[tuple[Any, int]]:
    """Each whole frame's record in ``data``, with where its frame ends, up to the first
    frame cut short, with a bad checksum or a payload that is no record."""
    view = memoryview(data)
    pos = 0
    while pos + HEADER.size <= len(data):
        n, crc = HEADER.unpack_from(data, pos)
        payload = view[pos + HEADER.size : pos + HEADER.size + n]
        if len(payload) < n or zlib.crc32(payload) != crc:
            return
        try:
            rec = decode(payload)
        except msgspec.DecodeError:
            return
        pos += HEADER.size + n
        yield rec, pos


def check_torn(data: bytes, bad: int, path: str, decode: Decode) -> None:
    """`TQError` if a whole frame follows the bad one at ``bad``: the index was damaged (bit
    rot: a crash only cuts its end), and dropping what follows would lose acknowledged puts
    silently (or serve the values they overwrote). Nothing whole follows a torn tail."""
    after = _next_frame(data, bad + 1, decode)
    if after is not None:
        raise TQError(
            f"the storage unit's index {path} is damaged at byte {bad}: a bad record followed "
            f"by whole ones (from byte {after}), which a crash cannot leave (it only cuts the "
            "end); starting would lose acknowledged puts or serve values they overwrote. Check "
            "the disk, then restore index.log from a backup, or move the data_dir away to "
            "start an empty unit (the controller then counts the rows it held lost)"
        )


def _next_frame(data: bytes, start: int, decode: Decode) -> int | None:
    """Where the first whole frame at or after ``start`` begins (None: none).

    Only the offsets before a `PAYLOAD` byte are tried (a torn record may be megabytes of
    rows)."""
    view = memoryview(data)
    at = data.find(PAYLOAD, start + HEADER.size)
    while at >= 0:
        n, crc = HEADER.unpack_from(data, at - HEADER.size)
        payload = view[at : at + n]
        if len(payload) == n and zlib.crc32(payload) == crc:
            try:
                decode(payload)
            except msgspec.DecodeError:
                pass
            else:
                return at - HEADER.size
        at = data.find(PAYLOAD, at + 1)
    return None
