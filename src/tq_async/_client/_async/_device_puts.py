"""A put's device columns, and what a unit lends with the answer to a put.

A slice of a put for a unit on this host keeps its big dense device columns out of host
memory: copied device to device into the unit's device arena (`DeviceLinks.put`) when it
has one, into a grant it lent with the answer to this client's last put when one holds
them (one round trip less: `StorePut.device_spare`, as ``spare`` for shared memory), else
copied by their device straight into its shared memory, else staged through pinned host
memory. What the unit lends with its answer (`PutSpares`) is held for the next puts
(`SameHostUnits.keep_spare`), or given back when nobody reads the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeGuard

import msgspec
import torch
import zmq

from ..._logging import get_logger
from ..._paths._device_copy import to_host
from ..._paths._pinned import pin_arena
from ..._paths._shm import ArenaMap
from ..._transport._dealer import DealerConnection
from ..._wire._codec import DeviceColumn
from ..._wire._columns import Column, ColumnHeader, positions_by_unit
from ..._wire._protocol import PutSpares, Reply, ShmAlloc, ShmFree, ShmGrant, StorePut
from ._base import Links
from ._replies import ask_grant, decode

log = get_logger(__name__)

__all__ = ["give_back_lent", "is_host", "keep_spares", "lend_ahead", "place_device_columns"]


def is_host(column: Column | DeviceColumn) -> TypeGuard[Column]:
    return not isinstance(column, DeviceColumn)


async def place_device_columns(
    links: Links,
    unit: int,
    conn: DealerConnection,
    arena: ArenaMap | None,
    store: StorePut,
    cols: list[Column | DeviceColumn],
) -> list[tuple[ColumnHeader, Column | DeviceColumn]]:
    """Move the device columns of a unit's slice into its device arena (described in
    ``store.device``, which asks for the next put's grant in ``device_spare``) when it
    has one; else, to a unit on this host, keep them for their device to copy straight
    into its shared memory (`DeviceFrame`); else copy them to host memory. The columns
    left to send, with their headers."""
    held = [(i, c.tensor) for i, c in enumerate(cols) if isinstance(c, DeviceColumn)]
    headers = store.columns
    if not held:
        return [(h, c) for h, c in zip(headers, cols, strict=True) if is_host(c)]
    devices = links.devices
    if arena is not None and devices is not None:
        timeout = links.request_timeout
        view = await devices.link(unit, conn, timeout)
        if view is not None:
            units = links.same_host_units
            # the device grant the unit lent with the last put's answer, when it holds
            # this one (one round trip less); each put asks for the next
            nbytes = devices.grant_bytes(held)
            spare = units.take_spare(unit, conn, nbytes, device=True)
            with units.copying(unit):
                put = await devices.put(conn, view, store, held, timeout, spare)
            if put:
                if units.ask_spare(unit, device=True):  # (`asked` once answered)
                    store.device_spare = nbytes
                # (a jagged column's offsets still travel: its one frame)
                return [(h, c) for h, c in zip(headers, cols, strict=True) if not _dense(c)]
    if arena is not None and pin_arena():  # dense ones: copied by their device in `_send`
        held = [(i, t) for i, t in held if not _dense(cols[i])]
        if not held:
            return list(zip(headers, cols, strict=True))
    # through host memory: pinned copies, waited for off the loop
    moved = await to_host({str(i): t for i, t in held})
    out: list[tuple[ColumnHeader, Column | DeviceColumn]] = []
    for i, (h, c) in enumerate(zip(headers, cols, strict=True)):
        values = moved.get(str(i))
        out.append((h, c if values is None else _device_column(c).on_host(h, values)))
    return out


def _first_rows(column: DeviceColumn, k: int) -> torch.Tensor:
    """The values of ``column``'s first ``k`` rows (what a slice of ``k`` rows may take)."""
    if column.offsets is None:
        return column.tensor[:k]
    return column.tensor[: int(column.offsets[min(k, len(column))])]


def _dense(column: Column | DeviceColumn) -> bool:
    """Whether ``column`` is a dense device column (one its device copies to host memory)."""
    return isinstance(column, DeviceColumn) and column.offsets is None


def _device_column(column: Column | DeviceColumn) -> DeviceColumn:
    assert isinstance(column, DeviceColumn)
    return column


async def lend_ahead(links: Links, cols: list[Column | DeviceColumn], units: list[int]) -> None:
    """Before a put of new fields of rows on ``units`` (one per row) is placed: ask each
    unit on this host whose device arena this client holds no spare of that holds its
    slice of the put's device columns ``cols`` for one now (meanwhile the placement is
    under way), kept as a spare for the put to take. Best effort: the put asks a unit
    that did not lend one."""
    devices, same_host = links.devices, links.same_host_units
    held = [c for c in cols if isinstance(c, DeviceColumn)]
    if devices is None or not held:
        return
    for unit, positions in positions_by_unit(units).items():
        view, arena, conn = devices.view(unit), same_host.arenas.get(unit), links.units.get(unit)
        nbytes = devices.grant_bytes([(0, _first_rows(c, len(positions))) for c in held])
        if view is None or arena is None or conn is None:
            continue  # not linked yet: the put links it and asks
        if same_host.has_spare(unit, conn, nbytes, device=True):
            continue
        if not same_host.ask_spare(unit, device=True):
            continue
        try:
            ask = ShmAlloc(nbytes, device=True)
            grant = await ask_grant(conn, ask, links.request_timeout, view, "a device grant")
            if grant is not None:
                same_host.keep_spare(unit, conn, arena, grant, check=view.check)
        except Exception as exc:  # the put asks again, and says what is wrong
            log.debug("a device grant asked ahead of a put failed", unit=unit, error=str(exc))
        finally:
            same_host.asked(unit, device=True)


def lent(body: StorePut, payload: msgspec.Raw) -> tuple[ShmGrant | None, ShmGrant | None]:
    """The grants a unit lent with its answer to ``body``: in its arena, in its device arena."""
    if body.device_spare:
        spares: PutSpares = decode(payload, PutSpares)
        return spares.shm, spares.device
    shm: ShmGrant | None = decode(payload, ShmGrant | None)
    return shm, None


def keep_spares(
    links: Links,
    unit: int,
    conn: DealerConnection,
    arena: ArenaMap,
    body: StorePut,
    payload: msgspec.Raw,
) -> None:
    """Hold what ``unit`` lent on ``conn`` with its answer to ``body`` for the next puts."""
    units = links.same_host_units
    shm, device = lent(body, payload)
    if shm is not None:
        units.keep_spare(unit, conn, arena, shm)
    if device is not None:
        view = links.devices.view(unit) if links.devices is not None else None
        if view is None:  # forgotten meanwhile (its connection broke): it goes back
            conn.send_best_effort(ShmFree([device.grant], []))
        else:
            units.keep_spare(unit, conn, arena, device, check=view.check)


def give_back_lent(
    conn: DealerConnection, body: StorePut
) -> Callable[[Reply, list[zmq.Frame]], None]:
    """What gives back the grants lent with an answer to ``body`` that came after its
    caller gave up (nobody else will)."""

    def on_abandon(reply: Reply, _frames: list[zmq.Frame]) -> None:
        if reply.ok:
            grants = [g.grant for g in lent(body, reply.payload) if g is not None]
            if grants:
                conn.send_best_effort(ShmFree(grants, []))

    return on_abandon
