"""The controller's read-only requests: answers computed from the state, nothing changes.

Each function takes the `ControllerCore` and a request body and
returns
the reply's payload; `QUERIES` maps request types to them.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable
from typing import Any

import msgspec

from .._core._arrays import consumption_mask, live_rows, production_mask
from .._core._dumps import partition_dump
from .._core._figures import ready_counts
from .._core._state import KV_CHUNK_BITS, Partition
from .._core._transitions import ControllerCore, meta_reply
from .._errors import CheckpointError, KeyNotFound
from .._wire._columns import ColumnHeader
from .._wire._protocol import (
    CheckConsumption,
    CheckProduction,
    ClusterStatus,
    ConsumptionStatus,
    DumpState,
    FieldSchema,
    KVKeys,
    KVList,
    KVLookup,
    ListPartitions,
    LostRows,
    MetaReply,
    PartitionInfo,
    ProductionStatus,
    StalenessStatus,
    StateDump,
    encoder,
)

__all__ = ["QUERIES"]


def check_production(core: ControllerCore, body: CheckProduction) -> bool:
    asked = _checked_rows(core, body.partition_id, body.rows)
    if asked is None:
        return False
    p, rows = asked
    return (
        bool(rows)
        and all(f in p.fields for f in body.data_fields)
        and all(p.is_produced(r, body.data_fields) for r in rows)
    )


def check_consumption(core: ControllerCore, body: CheckConsumption) -> bool:
    asked = _checked_rows(core, body.partition_id, body.rows)
    if asked is None:
        return False
    p, rows = asked
    consumed, base = p.consumed.get(body.task_name), p.base
    return bool(rows) and consumed is not None and all(consumed[r - base] for r in rows)


def _checked_rows(
    core: ControllerCore, partition_id: str, rows: list[int] | None
) -> tuple[Partition, list[int]] | None:
    """The partition a check asks about and its rows (None: every live row), checked to
    exist. None before the first put, or after a clear: the answer is "not yet" (not an
    error), as a readiness loop may start before the producers do."""
    p = core.state.partitions.get(partition_id)
    if p is None:
        return None
    rows = rows if rows is not None else _alive_rows(p)
    p.check_rows(rows)
    return p, rows


def production_status(core: ControllerCore, body: ProductionStatus) -> dict[str, Any]:
    p = core.state.partition(body.partition_id)
    names = body.data_fields if body.data_fields is not None else list(p.fields)
    return {n: production_mask(p, n) for n in names}


def consumption_status(core: ControllerCore, body: ConsumptionStatus) -> Any:
    return consumption_mask(core.state.partition(body.partition_id), body.task_name)


def list_partitions(core: ControllerCore, body: ListPartitions) -> list[str]:
    return sorted(core.state.partitions)


def partition_info(core: ControllerCore, body: PartitionInfo) -> Any:
    p = core.state.partition(body.partition_id)
    info = {
        "partition_id": p.partition_id,
        "rows": p.n_alive,
        "allocated": p.n_rows,
        "sealed": p.sealed,
        "fields": {name: f.header.describe() for name, f in p.fields.items()},
        "consumed": dict(p.consumed_count),
        "lost": len(p.lost),
        "dropped": dict(p.dropped),
        "open_leases": dict(p.open_leases),
        "uncommitted_puts": len(p.put_leases),
    }
    # per task: rows ready now and rows leased
    ready = ready_counts(p)
    leased: dict[str, int] = {}
    for lease in p.leases.values():
        n = sum(1 for r in lease.rows if p.is_alive(r))  # (rows cleared meanwhile: not held)
        if n:
            leased[lease.task] = leased.get(lease.task, 0) + n
    return info | {"ready": ready, "leased": leased}


def cluster_status(core: ControllerCore, body: ClusterStatus) -> dict[str, Any]:
    st = core.state
    adm = core.admission
    units = {
        u: {
            "address": a,
            "state": "lost" if u in st.dead_units else "suspended" if u in st.suspended else "up",
        }
        for u, a in sorted(st.units.items())
    }
    return {
        "units": units,
        "partitions": len(st.partitions),
        "capacity": st.capacity,
        "capacity_scope": "global" if st.capacity_global else "partition",
        "policy_version": st.learner_version,
        "admission": {
            "max_staleness": adm.max_staleness,
            "capacity": adm.capacity,
            "learner_task": adm.learner_task,
            "outstanding": st.outstanding,
        },
        "stale": dict(st.stale_counts),
        "recycled_pending": core.catalog.recycled_pending(),
    }


def field_schema(core: ControllerCore, body: FieldSchema) -> list[ColumnHeader]:
    p = core.state.partitions.get(body.partition_id)
    if p is None:
        return []
    return [p.fields[f].header for f in body.fields if f in p.fields]


def _all_produced(produced: bytearray, at: list[int]) -> bool:
    """Whether every row at ``at`` (indexes: rows less the partition's ``base``) has a cell."""
    return all(map(produced.__getitem__, at))


def kv_lookup(core: ControllerCore, body: KVLookup) -> MetaReply:
    p = core.state.partition(body.partition_id)
    rows = p.rows_for_keys(body.keys)
    at = [r - p.base for r in rows] if p.base else rows
    if body.available:  # the fields every key has: nothing to check key by key
        fields = [f for f, fd in p.fields.items() if _all_produced(fd.produced, at)]
        return meta_reply(p, rows, fields)
    fields = body.fields if body.fields is not None else list(p.fields)
    # one scan per field; key by key (to name the first key lacking a field) only on failure
    if all(f in p.fields and _all_produced(p.fields[f].produced, at) for f in fields):
        return meta_reply(p, rows, fields)
    for key, i in zip(body.keys, at, strict=True):
        lacking = [f for f in fields if f not in p.fields or not p.fields[f].produced[i]]
        if lacking:
            raise KeyNotFound(
                f"key {key!r} of partition {body.partition_id!r} has no fields "
                f"{lacking}; put them first or select other fields"
            )
    raise AssertionError("unreachable: a field lacks a row that no key lacks")  # pragma: no cover


def kv_list(core: ControllerCore, body: KVList) -> dict[str, msgspec.Raw]:
    st = core.state
    pids = [body.partition_id] if body.partition_id is not None else list(st.partitions)
    return {pid: _kv_answer(st.partition(pid), body.packed) for pid in pids}


#: each partition's encoded ``kv_list`` answers, kept up to date (see `KVListingCache`)
_KV_LISTINGS: weakref.WeakKeyDictionary[Partition, KVListingCache] = weakref.WeakKeyDictionary()


class KVListingCache:
    """One partition's ``kv_list`` answers, maintained rather than rebuilt.

    The packed answer (`KVColumns`) is two msgpack arrays, keys and tags in row order (the
    order keys were added: a new key gets a new row). They are kept as the encoded elements
    of each chunk of ``1 << KV_CHUNK_BITS`` rows; a change re-encodes only the chunks the
    core marked (`Partition.take_kv_dirty`), and an answer joins the chunks' bytes under one
    array header. A poll of an unchanged partition (verl's replay buffer asks every 2 s)
    reuses the whole answer; a poll after a few tags changed costs a chunk or two and a copy.
    The map answer (for clients that do not ask for ``packed``) is rebuilt per ``kv_version``.
    """

    __slots__ = ("_built", "_counts", "_keys", "_tags", "map", "packed", "version")

    def __init__(self) -> None:
        #: the kv_version the answers below were made at
        self.version = -1
        self.packed: msgspec.Raw | None = None
        self.map: msgspec.Raw | None = None
        #: chunk -> its keys' encoded elements, their tags', and how many keys it has
        self._keys: dict[int, bytes] = {}
        self._tags: dict[int, bytes] = {}
        self._counts: dict[int, int] = {}
        self._built = False

    def answer(self, p: Partition, packed: bool) -> msgspec.Raw:
        if self.version != p.kv_version:
            self.version, self.packed, self.map = p.kv_version, None, None
        if not packed:
            if self.map is None:
                tags, base = p.tags, p.base
                listing = {k: tags[r - base] or {} for k, r in p.keys.items()}
                self.map = msgspec.Raw(encoder.encode(listing))
            return self.map
        if self.packed is None:
            self.packed = self._pack(p)
        return self.packed

    def _pack(self, p: Partition) -> msgspec.Raw:
        dirty = p.take_kv_dirty()
        if not self._built:  # the first answer: every chunk
            dirty = set(range(p.base >> KV_CHUNK_BITS, (p.n_rows >> KV_CHUNK_BITS) + 1))
            self._built = True
        first = p.base >> KV_CHUNK_BITS  # (chunks below: their rows were dropped, not marked)
        dirty.update(c for c in self._counts if c < first)
        for chunk in dirty:
            self._encode_chunk(p, chunk)
        order = sorted(self._counts)
        n = sum(self._counts.values())
        head = _array_header(n)
        keys = [head, *[self._keys[c] for c in order]]
        tags = [head, *[self._tags[c] for c in order]]
        # `KVColumns(n, keys, tags)` written in one join (encoding it would copy both again):
        # a 3-array of n and two bin32
        return msgspec.Raw(
            b"".join([b"\x93", encoder.encode(n), _bin32(keys), *keys, _bin32(tags), *tags])
        )

    def _encode_chunk(self, p: Partition, chunk: int) -> None:
        lo = chunk << KV_CHUNK_BITS
        row_keys, tags, base = p.row_keys, p.tags, p.base
        hi = min(lo + (1 << KV_CHUNK_BITS), p.n_rows) - base
        lo = max(lo - base, 0)  # (indexes from here: rows below ``base`` were cleared)
        # (rows with a key: `None` is none, the key "" one like any other)
        has_key = map(operator.is_not, row_keys[lo:hi] if lo < hi else (), itertools.repeat(None))
        rows = list(itertools.compress(range(lo, hi), has_key))
        if not rows:
            self._counts.pop(chunk, None)
            self._keys.pop(chunk, None)
            self._tags.pop(chunk, None)
            return
        self._counts[chunk] = len(rows)
        self._keys[chunk] = _elements(encoder.encode([row_keys[r] for r in rows]))
        self._tags[chunk] = _elements(encoder.encode([tags[r] or {} for r in rows]))


def _array_header(n: int) -> bytes:
    """The msgpack header of an array of ``n`` elements."""
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _bin32(parts: list[bytes]) -> bytes:
    """The msgpack bin32 header of the bytes ``parts`` join to."""
    return b"\xc6" + sum(map(len, parts)).to_bytes(4, "big")


def _elements(encoded_array: bytes) -> bytes:
    """The elements of an encoded msgpack array, without its header."""
    first = encoded_array[0]
    skip = 1 if first & 0xF0 == 0x90 else 3 if first == 0xDC else 5
    return encoded_array[skip:]


def _kv_answer(p: Partition, packed: bool) -> msgspec.Raw:
    cache = _KV_LISTINGS.get(p)
    if cache is None:
        cache = _KV_LISTINGS[p] = KVListingCache()
    return cache.answer(p, packed)


def kv_keys(core: ControllerCore, body: KVKeys) -> list[str | None]:
    p = core.state.partition(body.partition_id)
    p.check_rows(body.rows)
    row_keys = [p.row_keys[r - p.base] for r in body.rows]
    if None in row_keys:
        keyless = [r for r, k in zip(body.rows, row_keys, strict=True) if k is None]
        raise KeyNotFound(
            f"rows {keyless[:8]} of partition {body.partition_id!r} have no key (put "
            "without one); pass rows written with kv_put / kv_batch_put"
        )
    return row_keys


def dump_state(core: ControllerCore, body: DumpState) -> StateDump:
    st = core.state
    ids = body.partition_ids if body.partition_ids is not None else list(st.partitions)
    parts = [st.partition(pid) for pid in ids]
    for p in parts:
        away = sorted(u for u in st.suspended if p.unit_rows.get(u))
        if away:
            raise CheckpointError(
                f"partition {p.partition_id!r} has rows on storage unit {away[0]}, suspended "
                f"(suspended units: {away}): their cells cannot be read now; save the "
                "checkpoint again once the unit resumed (or was declared lost)"
            )
    dumps = [partition_dump(p, st) for p in parts]
    sampler_state = {"default": core.sampler.state_dict()}
    sampler_state |= {f"task:{t}": smp.state_dict() for t, smp in core.task_samplers.items()}
    return StateDump(dumps, sampler_state)


def staleness_status(core: ControllerCore, body: StalenessStatus) -> dict[str, int]:
    st = core.state
    return {
        "learner_version": st.learner_version,
        "outstanding": st.outstanding,
        "recycled_pending": core.catalog.recycled_pending(),
        **st.stale_counts,
    }


def lost_rows(core: ControllerCore, body: LostRows) -> dict[str, Any]:
    st = core.state
    pids = [body.partition_id] if body.partition_id is not None else list(st.partitions)
    return {
        "dead_units": sorted(st.dead_units),
        "suspended_units": sorted(st.suspended),
        "rows": {pid: sorted(st.partition(pid).lost) for pid in pids},
    }


def _alive_rows(p: Partition) -> list[int]:
    return live_rows(p)


#: request type -> its answer
QUERIES: dict[type, Callable[[ControllerCore, Any], Any]] = {
    CheckProduction: check_production,
    CheckConsumption: check_consumption,
    ProductionStatus: production_status,
    ConsumptionStatus: consumption_status,
    ListPartitions: list_partitions,
    PartitionInfo: partition_info,
    FieldSchema: field_schema,
    KVLookup: kv_lookup,
    KVList: kv_list,
    KVKeys: kv_keys,
    DumpState: dump_state,
    StalenessStatus: staleness_status,
    LostRows: lost_rows,
    ClusterStatus: cluster_status,
}
