"""``tq-async status ADDRESS``: a running cluster on one screen (``--json``, ``--watch``).

It asks the controller what it knows (``ClusterStatus``, the partitions and their
``partition_info``) and each storage unit what it holds (``StoreStats``), over plain
control connections: no torch, no client. ``--watch`` redraws the screen whenever the
controller logs an event (a ``watch`` on every partition), so an idle cluster costs it one
parked request.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, TextIO

import anyio
import msgspec

from .._errors import AuthenticationError, BrokenError, TQError, TQTimeoutError
from .._service._serve import check_address
from .._transport._dealer import DealerConnection
from .._transport._security import CurveClient
from .._wire._events import WatchBatch
from .._wire._protocol import (
    ClusterStatus,
    ListPartitions,
    PartitionInfo,
    StoreStats,
    StoreStatsReply,
    WatchNext,
)

__all__ = ["cluster_status", "render", "run_status"]

#: a unit's figures before (or without) its answer
_UNKNOWN: dict[str, Any] = dict.fromkeys(f.name for f in msgspec.structs.fields(StoreStatsReply))

#: seconds each request may take
_TIMEOUT = 10.0
#: most partitions asked at once
_IN_FLIGHT = 64
#: seconds a watch waits before it asks again a controller that did not answer
_RETRY_AFTER = 1.0


async def _ask(
    conn: DealerConnection, body: msgspec.Struct, typ: Any, unit: int | None = None
) -> Any:
    """The reply to ``body`` from the controller (or storage unit ``unit``)."""
    try:
        payload, _ = await conn.request(body, timeout=_TIMEOUT)
    except TQTimeoutError as exc:  # (its advice to raise the timeout is no option here)
        who = "the controller" if unit is None else f"storage unit {unit}"
        where = " (the TQ_ADDRESS= line of tq-async serve)" if unit is None else ""
        raise TQTimeoutError(
            f"{who} at {conn.name} did not answer within {_TIMEOUT:g} s: check that it runs "
            f"at that address{where} and is not stopped"
        ) from exc
    return msgspec.msgpack.decode(payload, type=typ)


async def cluster_status(ctl: DealerConnection, curve: CurveClient | None = None) -> dict[str, Any]:
    """Everything ``tq-async status`` shows, as one JSON-able dict (``curve``: the keys the
    storage units are reached with). The partitions and the units are asked all at once: a
    stopped unit not yet suspended costs a screen one timeout, not one per unit."""
    out: dict[str, Any] = await _ask(ctl, ClusterStatus(), dict[str, Any])
    ids: list[str] = await _ask(ctl, ListPartitions(), list[str])
    infos: dict[str, dict[str, Any]] = {}

    limit = anyio.CapacityLimiter(_IN_FLIGHT)

    async def info(pid: str) -> None:
        async with limit:
            with contextlib.suppress(TQError):  # cleared meanwhile
                infos[pid] = await _ask(ctl, PartitionInfo(pid), dict[str, Any])

    async def stats(unit_id: int, unit: dict[str, Any]) -> None:
        conn = DealerConnection(unit["address"], curve=curve, refused_is_broken=True)
        try:
            reply = await _ask(conn, StoreStats(), StoreStatsReply, unit_id)
            unit.update(msgspec.structs.asdict(reply))
        except TQError as exc:
            unit["error"] = str(exc)
        finally:
            conn.close()

    units: dict[str, dict[str, Any]] = {}
    async with anyio.create_task_group() as tg:
        for pid in ids:
            tg.start_soon(info, pid)
        for unit_id, listed in out["units"].items():
            # the same keys in every state: None where unknown (not up, or not answering)
            units[str(unit_id)] = unit = {**listed, **_UNKNOWN, "error": None}
            if unit["state"] == "up":
                tg.start_soon(stats, int(unit_id), unit)
    out["partitions"] = {pid: infos[pid] for pid in ids if pid in infos}  # (listed order)
    out["units"] = units
    return out


def render(status: dict[str, Any], address: str) -> str:
    """The status as a screen of plain text."""
    lines = [f"tq-async cluster at {address}"]
    lines.append(f"partitions ({len(status['partitions'])}):")
    for pid, info in sorted(status["partitions"].items()):
        sealed = "sealed" if info["sealed"] else "open"
        fields = ", ".join(info["fields"]) or "-"
        lines.append(f"  {pid}: {info['rows']} rows, {sealed}, fields: {fields}")
        tasks = sorted(set(info["consumed"]) | set(info.get("ready", {})))
        for task in tasks:
            consumed = info["consumed"].get(task, 0)
            ready = info.get("ready", {}).get(task, 0)
            leased = info.get("leased", {}).get(task, 0)
            lines.append(f"    task {task}: consumed {consumed}, ready {ready}, leased {leased}")
        if info["lost"] or info["uncommitted_puts"]:
            lines.append(
                f"    lost rows {info['lost']}, uncommitted puts {info['uncommitted_puts']}"
            )
    lines.append(f"storage units ({len(status['units'])}):")
    for unit_id, unit in sorted(status["units"].items(), key=lambda kv: int(kv[0])):
        line = f"  unit {unit_id} [{unit['state']}] {unit['address']}"
        if unit.get("rows") is not None:
            line += (
                f": {unit['rows']} rows, {_size(unit['resident_bytes'])}, shared memory "
                f"{_size(unit['shm_bytes'])} of {_size(unit['shm_cap'])}"
            )
        if unit.get("error") is not None:
            line += f": not answering ({unit['error']})"
        lines.append(line)
    clients = status.get("clients")
    if clients is not None:
        lines.append(
            f"clients: {clients['active']} connections asked in the last "
            f"{clients['window_s']:.0f} s, {clients['watching']} watches waiting"
        )
    security = status.get("security")
    if security is not None:
        if not security["curve"]:
            lines.append("security: CURVE off (plain connections; any client on the network)")
        else:
            allowed = security["allowed_clients"]
            who = "any client with the server key" if allowed is None else f"{allowed} client keys"
            lines.append(f"security: CURVE on, server key {security['server_key']}, lets in {who}")
    adm = status["admission"]
    cap = status["capacity"]
    scope = (
        "in all partitions together" if status["capacity_scope"] == "global" else "per partition"
    )
    lines += [
        f"capacity: {'none' if cap is None else f'{cap} rows {scope}'}",
        f"policy version: {status['policy_version']}, admission: max_staleness "
        f"{adm['max_staleness']}, capacity {adm['capacity']}, outstanding {adm['outstanding']}",
        f"stale rows: {status['stale']}, recycled pending {status['recycled_pending']}",
    ]
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")  # pragma: no cover


async def run_status(
    address: str,
    *,
    as_json: bool = False,
    watch: bool = False,
    screens: int | None = None,
    out: TextIO = sys.stdout,
    curve: CurveClient | None = None,
) -> None:
    """Print the status once, or (``watch``) again after every batch of events, until
    cancelled or ``screens`` screens were printed (``curve``: the keys of a cluster that
    uses CURVE). Once a watch printed its first screen, it rides through the controller's
    restarts and outages: it says so on stderr and prints again once the controller answers.

    Raises:
        InvalidRequestError: ``address`` is no ZMQ address (e.g. no ``tcp://``).
        BrokenError: the controller does not answer (before a watch's first screen).
    """
    check_address(address)
    shown, down = 0, False
    while True:
        ctl = DealerConnection(address, curve=curve, refused_is_broken=True)
        try:
            body = WatchNext(poll=5.0)
            while True:
                if watch and body.since is None:
                    batch = await _ask(ctl, body, WatchBatch)  # subscribe before the first look
                    body.since, body.incarnation = batch.cursor, batch.incarnation
                status = await cluster_status(ctl, curve)
                if as_json:
                    out.write(msgspec.json.encode(status).decode() + "\n")
                else:
                    clear = "\x1b[2J\x1b[H" if watch and out.isatty() else ""
                    out.write(clear + render(status, address) + "\n")
                out.flush()
                shown, down = shown + 1, False
                if not watch or (screens is not None and shown >= screens):
                    return
                while True:  # until something happened
                    batch = await _ask(ctl, body, WatchBatch)
                    body.since, body.incarnation = batch.cursor, batch.incarnation
                    if batch.events:
                        break
        except (BrokenError, TQTimeoutError) as exc:
            if not (watch and shown) or isinstance(exc, AuthenticationError):
                raise
            if not down:
                print(f"tq-async status: {exc}; watching again once it answers", file=sys.stderr)
                down = True
            await anyio.sleep(_RETRY_AFTER)
        finally:
            ctl.close()
