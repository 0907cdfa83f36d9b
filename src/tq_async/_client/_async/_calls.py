"""The client's other controller calls: status, tags, staleness, KV and checkpoints."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch

from ..._core._gone import cleared_under_read
from ..._errors import (
    BrokenError,
    InvalidRequestError,
    RowsNotFound,
    SchemaError,
)
from ..._logging import get_logger
from ..._meta import BatchMeta, check_meta
from ..._primitives import run_each
from ..._wire._checks import check_flag, check_id, check_int, check_seconds, check_text
from ..._wire._codec import tags_for_wire
from ..._wire._listing import KVListing
from ..._wire._protocol import (
    AcquireRollout,
    CheckConsumption,
    CheckProduction,
    ClearPartition,
    ClearSamples,
    ConsumptionStatus,
    KVClear,
    KVColumns,
    KVKeys,
    KVList,
    KVLookup,
    KVTag,
    ListPartitions,
    LostRows,
    MetaReply,
    PartitionInfo,
    Placement,
    ProductionStatus,
    RecycledRows,
    RegisterTasks,
    ReleaseRollout,
    Reply,
    ResetConsumption,
    ReturnRecycled,
    Seal,
    SetPolicyVersion,
    SetTags,
    StalenessStatus,
    StoreStats,
    StoreStatsReply,
    TakeRecycled,
)
from ..._wire._tensordicts import is_tensordict
from ._base import Links, as_int, check_fields, tag_rows
from ._checkpoint import ClientLink, load_checkpoint, save_checkpoint
from ._get import GetPath
from ._put import PutPath
from ._replies import decode

if TYPE_CHECKING:  # imported when a program uses one (see `_wire._tensordicts`)
    from tensordict import TensorDict, TensorDictBase

__all__ = ["ControlCalls"]

#: a ``kv_list`` answer: each partition packed (`KVColumns`), or as a map from a controller
#: that does not pack
_KV_LISTING = dict[str, KVColumns | dict[str, dict[str, Any]]]

log = get_logger(__name__)


def _check_keys(keys: Any) -> list[str]:
    if isinstance(keys, np.ndarray) and keys.ndim == 1:  # keys kept in an array
        keys = keys.tolist()
    if isinstance(keys, str) or not isinstance(keys, (list, tuple)):
        raise InvalidRequestError(f"keys must be a list of strings, got {type(keys).__name__}")
    if not keys or not all(isinstance(k, str) for k in keys):
        raise InvalidRequestError("keys must be a non-empty list of strings")
    try:
        "".join(keys).encode("utf-8")  # one pass (a key at a time cost 3x for 256 keys)
    except UnicodeEncodeError:
        for k in keys:
            check_text("key", k)  # names the first key that cannot travel
    # a str subclass (numpy's str_, of keys kept in an array) travels as the plain str
    return [k if type(k) is str else str.__str__(k) for k in keys]


def _check_rows(rows: Any, name: str) -> list[int]:
    if isinstance(rows, (np.ndarray, torch.Tensor)):  # row ids kept in an array
        rows = rows.tolist()
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise InvalidRequestError(f"{name} must be a list of row ids, got {type(rows).__name__}")
    ids = [as_int(r) for r in rows]  # numpy's ints too
    if not all(type(r) is int and r >= 0 for r in ids):
        raise InvalidRequestError(f"{name} must hold non-negative ints, got {list(rows)[:8]!r}")
    return ids


def _optional_id(partition_id: Any) -> str | None:
    """An optional ``partition_id`` (None: all partitions), checked."""
    return None if partition_id is None else check_id("partition_id", partition_id)


def _mask(raw: bytes) -> torch.Tensor:
    if not raw:
        return torch.zeros(0, dtype=torch.bool)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.bool)


def _one_row(fields: TensorDictBase | Mapping[str, Any]) -> TensorDictBase | dict[str, Any]:
    """One key's fields as a one-row batch."""
    if is_tensordict(fields):
        if fields.batch_size == torch.Size([]):
            return fields.unsqueeze(0)
        if fields.batch_size == torch.Size([1]):
            return fields
        raise SchemaError(
            f"kv_put takes one key's fields (batch size [] or [1]), got {list(fields.batch_size)}"
            "; use kv_batch_put for several keys"
        )
    return {name: _one_cell(value) for name, value in fields.items()}


def _no_fields(fields: TensorDictBase | Mapping[str, Any]) -> bool:
    """Whether a KV call's ``fields`` hold no field (``{}``, an empty TensorDict): it writes
    tags only."""
    return fields.is_empty() if is_tensordict(fields) else not fields


def _one_cell(value: Any) -> Any:
    """One key's value of a field as a column of one row: a tensor, numpy array or numpy
    scalar gets a leading dimension (dense, as a batch of one), anything else is the list's
    one value."""
    if isinstance(value, torch.Tensor):
        return value.unsqueeze(0)
    if isinstance(value, (np.ndarray, np.generic)):
        return np.asarray(value)[np.newaxis]
    return [value]


#: ``(policy_version, n)`` pairs with admissions in doubt a client remembers (`ControlCalls`)
_UNSETTLED = 64


class ControlCalls:
    """Status, tags, staleness, KV and checkpoints of a client, over its links; the KV calls
    write through its put path and read through its get path."""

    def __init__(self, links: Links, puts: PutPath, gets: GetPath) -> None:
        self._links = links
        self._puts = puts
        self._gets = gets
        #: ``(policy_version, n)`` -> tokens of admissions whose reply never came (the
        #: controller died or the link broke): the next such acquire asks with one of them,
        #: so an admission recorded before the loss is not taken twice
        self._unsettled: dict[tuple[int, int], list[int]] = {}
        #: the same for `take_recycled`: ``max_rows`` -> tokens of takes in doubt
        self._unsettled_takes: dict[int, list[int]] = {}

    async def lost_rows(self, partition_id: str | None = None) -> dict[str, Any]:
        """Rows lost with storage units that went away."""
        body = LostRows(_optional_id(partition_id))
        return dict(await self._links.call(body, dict[str, Any]))

    async def storage_stats(self) -> dict[int, dict[str, Any]]:
        """What each storage unit holds, asked of every unit in parallel."""
        await self._links.refresh_units()
        out: dict[int, dict[str, Any]] = {}

        async def ask(unit_id: int) -> None:
            conn = await self._links.unit(unit_id)
            payload, _ = await conn.request(StoreStats(), timeout=self._links.request_timeout)
            out[unit_id] = msgspec.structs.asdict(decode(payload, StoreStatsReply))

        await run_each(ask, [(unit_id,) for unit_id in self._links.unit_addresses])
        return dict(sorted(out.items()))

    async def register_tasks(self, tasks: Sequence[str], partition_id: str | None = None) -> None:
        """Auto-clear: free each row once every task in ``tasks`` has consumed it."""
        if partition_id is not None and not isinstance(partition_id, str):
            raise InvalidRequestError(
                f"register_tasks(tasks, partition_id): partition_id must be a string or None, "
                f"got {partition_id!r} (are the two arguments swapped?)"
            )
        if isinstance(tasks, str):  # (else "actor" would be five one-letter tasks)
            raise InvalidRequestError(
                f"register_tasks takes a list of task names, got the string {tasks!r}: "
                f"pass [{tasks!r}]"
            )
        if isinstance(tasks, (bytes, Mapping)) or not isinstance(tasks, Iterable):
            raise InvalidRequestError(
                f"register_tasks takes a list of task names (an empty list turns auto-clear "
                f"off), got {type(tasks).__name__} {tasks!r:.80}"
            )
        names = list(tasks)
        if not all(isinstance(t, str) and t for t in names):
            raise InvalidRequestError(
                f"register_tasks takes task names (non-empty strings), got {names!r}"
            )
        body = RegisterTasks([check_id("task name", t) for t in names], _optional_id(partition_id))
        await self._links.call(body, None)

    async def seal(self, partition_id: str, *, create: bool = False) -> None:
        """No more rows will be added: drained consumers then see end-of-stream."""
        body = Seal(check_id("partition_id", partition_id), check_flag("create", create))
        await self._links.call(body, None)

    async def reset_consumption(self, partition_id: str, task_name: str | None = None) -> None:
        """Make every row of the partition ready again for ``task_name`` (all tasks if None)."""
        partition_id = check_id("partition_id", partition_id)
        task = None if task_name is None else check_id("task_name", task_name)
        await self._links.call(ResetConsumption(partition_id, task), None)

    async def clear_samples(self, meta: BatchMeta) -> None:
        """Remove ``meta``'s rows from the partition and free their storage."""
        meta = check_meta(meta, "clear_samples")
        body = ClearSamples(meta.partition_id, list(meta.global_indexes), meta.incarnation)
        await self._links.call(body, None)

    async def clear_partition(self, partition_id: str) -> None:
        """Remove the partition with all its rows, state and sampler caches; free storage."""
        await self._links.call(ClearPartition(check_id("partition_id", partition_id)), None)

    async def check_production_status(
        self,
        partition_id: str,
        data_fields: Sequence[str],
        global_indexes: Sequence[int] | None = None,
    ) -> bool:
        """True when every given row (all rows if None) has every field in ``data_fields``."""
        partition_id = check_id("partition_id", partition_id)
        fields = check_fields(data_fields)
        rows = None if global_indexes is None else _check_rows(global_indexes, "global_indexes")
        return bool(await self._links.call(CheckProduction(partition_id, fields, rows), bool))

    async def check_consumption_status(
        self, partition_id: str, task_name: str, global_indexes: Sequence[int] | None = None
    ) -> bool:
        """True when ``task_name`` has consumed every given row (all rows if None)."""
        partition_id = check_id("partition_id", partition_id)
        task_name = check_id("task_name", task_name)
        rows = None if global_indexes is None else _check_rows(global_indexes, "global_indexes")
        return bool(await self._links.call(CheckConsumption(partition_id, task_name, rows), bool))

    async def production_status(
        self, partition_id: str, data_fields: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Per field, a bool tensor over row ids: is the cell produced (cleared rows: False)."""
        partition_id = check_id("partition_id", partition_id)
        fields = None if data_fields is None else check_fields(data_fields)
        masks = await self._links.call(ProductionStatus(partition_id, fields), dict[str, bytes])
        return {k: _mask(v) for k, v in masks.items()}

    async def consumption_status(self, partition_id: str, task_name: str) -> torch.Tensor:
        """A bool tensor over row ids: has ``task_name`` consumed the row."""
        body = ConsumptionStatus(
            check_id("partition_id", partition_id), check_id("task_name", task_name)
        )
        return _mask(await self._links.call(body, bytes))

    async def list_partitions(self) -> list[str]:
        """Ids of every partition the controller knows."""
        return list(await self._links.call(ListPartitions(), list[str]))

    async def partition_info(self, partition_id: str) -> dict[str, Any]:
        """Row counts, schema, sealed flag and per-task consumed counts of a partition."""
        body = PartitionInfo(check_id("partition_id", partition_id))
        return dict(await self._links.call(body, dict[str, Any]))

    async def set_tags(self, meta: BatchMeta, tags: Sequence[Mapping[str, Any]]) -> None:
        """Merge ``tags[i]`` into the tags of row ``meta.global_indexes[i]`` (atomically)."""
        meta = check_meta(meta, "set_tags")
        wire_tags = [t or {} for t in tags_for_wire(tag_rows(tags, len(meta)))]
        body = SetTags(meta.partition_id, list(meta.global_indexes), wire_tags, meta.incarnation)
        await self._links.call(body, None)

    async def set_policy_version(self, version: int) -> None:
        """The learner announces its policy version (after each update)."""
        await self._links.call(SetPolicyVersion(check_int("version", as_int(version))), None)

    async def acquire_rollout(
        self, policy_version: int, n: int = 1, *, timeout: float | None = None
    ) -> None:
        """Wait until a rollout of ``policy_version`` producing ``n`` rows may start.

        Asked again after a `BrokenError` (the reply may have been lost with the
        controller), it names the lost admission, which the controller counts once."""
        key = (check_int("policy_version", as_int(policy_version)), check_int("n", as_int(n), 1))
        unsettled = self._unsettled.pop(key, None)
        token = unsettled.pop() if unsettled else secrets.randbits(62) + 1
        if unsettled:
            self._unsettled[key] = unsettled
        slots = self._puts.slots
        body = AcquireRollout(*key, check_seconds("timeout", timeout), token, slots.holder)
        deadline = None if timeout is None else timeout + self._links.request_timeout

        def on_abandon(reply: Reply, _frames: list[Any]) -> None:
            # admitted, but the caller gave up before it knew: free the slots it reserved
            # (a reply still on its way when it gave up is undone by the controller on the
            # call's Cancel, even if this client closes meanwhile)
            if reply.ok and self._links.controller is not None:
                release = ReleaseRollout(body.n, slots.holder)
                self._links.controller.send_best_effort(release)

        try:
            controller = await self._links.controller_link()
            payload, _ = await controller.request(
                body, timeout=deadline, on_abandon=on_abandon, cancel_undoes=True
            )
            # (the slot lease its holder renews; None: its connection holds them)
            slots.acquired(body.n, decode(payload, float | None))
        except BrokenError:
            self._unsettled.setdefault(key, []).append(token)
            if len(self._unsettled) > _UNSETTLED:  # versions never asked for again
                del self._unsettled[next(iter(self._unsettled))]
            raise

    async def release_rollout(self, n: int) -> None:
        """Give back ``n`` admission slots of rollouts that will not be put."""
        slots, n = self._puts.slots, check_int("n", as_int(n))
        await self._links.call(ReleaseRollout(n, slots.holder), None)
        slots.settled(n)

    async def take_recycled(self, max_rows: int = 1024) -> list[BatchMeta]:
        """Take stale rows whose prompts must be regenerated, one BatchMeta per partition.

        Asked again after a `BrokenError` (the reply may have been lost with the
        controller), it names the lost take, and the controller hands out the same rows."""
        n = check_int("max_rows", as_int(max_rows), 1)
        unsettled = self._unsettled_takes.pop(n, None)
        token = unsettled.pop() if unsettled else secrets.randbits(62) + 1
        if unsettled:
            self._unsettled_takes[n] = unsettled
        body = TakeRecycled(n, token)

        def on_abandon(reply: Reply, _frames: list[Any]) -> None:
            # handed out, but the caller gave up before it knew: queue them again (a reply
            # still on its way when it gave up is undone by the controller on the call's
            # Cancel, even if this client closes meanwhile)
            if reply.ok and self._links.controller is not None:
                taken: list[RecycledRows] = decode(reply.payload, list[RecycledRows])
                for r in taken:
                    back = ReturnRecycled(
                        r.partition_id, r.meta.incarnation, r.meta.rows, r.meta.lease_id, token
                    )
                    self._links.controller.send_best_effort(back)

        try:
            controller = await self._links.controller_link()
            payload, _ = await controller.request(
                body,
                timeout=self._links.request_timeout,
                on_abandon=on_abandon,
                cancel_undoes=True,
            )
        except BrokenError:
            self._unsettled_takes.setdefault(n, []).append(token)
            if len(self._unsettled_takes) > _UNSETTLED:  # sizes never asked for again
                del self._unsettled_takes[next(iter(self._unsettled_takes))]
            raise
        got: list[RecycledRows] = decode(payload, list[RecycledRows])
        return [
            BatchMeta(
                partition_id=r.partition_id,
                global_indexes=r.meta.rows,
                field_names=r.meta.fields,
                units=r.meta.units,
                tags=r.meta.tags,
                policy_versions=r.meta.versions,
                lease_id=r.meta.lease_id,
                incarnation=r.meta.incarnation,
            )
            for r in got
        ]

    async def staleness_status(self) -> dict[str, int]:
        """Learner version, outstanding admitted rows, and stale rows dropped/recycled/kept."""
        return dict(await self._links.call(StalenessStatus(), dict[str, int]))

    async def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: TensorDictBase | Mapping[str, Any] | None,
        tags: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> BatchMeta:
        """Write ``fields`` for ``keys`` (row ``i`` of ``fields`` belongs to ``keys[i]``)."""
        key_list = _check_keys(keys)
        partition_id = check_id("partition_id", partition_id)
        if fields is None or _no_fields(fields):
            if tags is None:
                raise InvalidRequestError("kv_batch_put needs fields, tags, or both")
            wire = [t or {} for t in tags_for_wire(tag_rows(tags, len(key_list), "keys"))]
            return await self._tag_keys(
                partition_id, key_list, wire, [dict(t) if t else {} for t in tags]
            )
        return await self._puts.write(fields, partition_id, meta=None, tags=tags, keys=key_list)

    async def kv_retrieve_meta(
        self, keys: Sequence[str], partition_id: str, create: bool = False
    ) -> BatchMeta:
        """A `BatchMeta` of ``keys``' rows, naming the fields every key has."""
        key_list = _check_keys(keys)
        partition_id = check_id("partition_id", partition_id)
        if create:
            return await self.kv_batch_put(key_list, partition_id, None, [{}] * len(key_list))
        return await self._look_up(KVLookup(partition_id, key_list, None, available=True))

    async def kv_put(
        self,
        key: str,
        partition_id: str,
        fields: TensorDictBase | Mapping[str, Any] | None = None,
        tag: Mapping[str, Any] | None = None,
    ) -> BatchMeta:
        """Write one key's ``fields`` and/or merge ``tag`` into its tags."""
        partition_id = check_id("partition_id", partition_id)
        if fields is None or _no_fields(fields):
            if tag is None:
                raise InvalidRequestError("kv_put needs fields, a tag, or both")
            keys = _check_keys([key])
            wire_tag = tags_for_wire([tag])[0] or {}
            return await self._tag_keys(partition_id, keys, [wire_tag], [dict(tag)])
        return await self.kv_batch_put([key], partition_id, _one_row(fields), [tag])

    async def _tag_keys(
        self,
        partition_id: str,
        keys: list[str],
        tags: list[dict[str, Any]],
        as_given: list[dict[str, Any]] | None = None,
    ) -> BatchMeta:
        """Merge ``tags`` into the keys' tags (missing keys are created), no fields written:
        the keys' `BatchMeta`, carrying the tags ``as_given`` (default: ``tags``)."""
        # new keys are new rows: at the capacity they wait for room, as a put does
        wait = True if self._links.capacity is None else None  # (True: the usual deadline)
        body = KVTag(partition_id, keys, tags)
        placement: Placement = await self._links.call(body, Placement, timeout=wait)
        return BatchMeta(
            partition_id=partition_id,
            global_indexes=placement.rows,
            field_names=placement.fields or [],
            units=placement.units,
            incarnation=placement.incarnation,
            tags=tags if as_given is None else as_given,
            keys=list[str | None](keys),
        )

    async def kv_batch_get(
        self,
        keys: Sequence[str],
        partition_id: str,
        select_fields: Sequence[str] | None = None,
    ) -> TensorDict:
        """The fields of ``keys``, row ``i`` for ``keys[i]`` (every field when not selected)."""
        partition_id = check_id("partition_id", partition_id)
        fields = None if select_fields is None else check_fields(select_fields)
        meta = await self._look_up(KVLookup(partition_id, _check_keys(keys), fields))
        try:
            return await self._gets.get_data(meta)
        except RowsNotFound as exc:  # removed after the look-up
            raise RowsNotFound(cleared_under_read(partition_id, "kv_batch_get")) from exc

    async def _look_up(self, body: KVLookup) -> BatchMeta:
        """The `BatchMeta` of the rows of ``body.keys``, in their order (naming the fields the
        lookup asked for)."""
        got: MetaReply = await self._links.call(body, MetaReply)
        self._links.note_epoch(got.units_epoch)
        return BatchMeta(
            partition_id=body.partition_id,
            global_indexes=got.rows,
            field_names=got.fields,
            units=got.units,
            tags=got.tags,
            incarnation=got.incarnation,
            keys=list[str | None](body.keys),
        )

    async def kv_list(self, partition_id: str | None = None) -> dict[str, KVListing]:
        """``{partition_id: {key: tags}}`` for one partition, or for all when None; each
        partition's listing decoded when first read (see `KVListing`)."""
        body = KVList(_optional_id(partition_id), packed=True)
        listing = await self._links.call(body, _KV_LISTING)
        return {
            pid: KVListing(n=got.n, keys=got.keys, tags=got.tags)
            if isinstance(got, KVColumns)
            else KVListing(got)  # a controller that does not pack
            for pid, got in listing.items()
        }

    async def kv_retrieve_keys(self, global_indexes: Sequence[int], partition_id: str) -> list[str]:
        """The key of each row in ``global_indexes`` (rows written with kv_put / kv_batch_put)."""
        rows = _check_rows(global_indexes, "global_indexes")
        body = KVKeys(check_id("partition_id", partition_id), rows)
        return list(await self._links.call(body, list[str]))

    async def kv_clear(self, keys: Sequence[str], partition_id: str) -> None:
        """Remove ``keys`` and free their storage; a missing key fails the whole call."""
        body = KVClear(check_id("partition_id", partition_id), _check_keys(keys))
        await self._links.call(body, None)

    async def save_checkpoint(
        self,
        path: str | os.PathLike[str],
        partition_ids: Sequence[str] | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Write partitions (all by default), their state, tags, keys and cells to ``path``."""
        await save_checkpoint(self._checkpoint_link(), os.fspath(path), partition_ids, metadata)

    async def load_checkpoint(self, path: str | os.PathLike[str]) -> list[str]:
        """Restore a checkpoint written by `save_checkpoint`; returns the partition ids."""
        return await load_checkpoint(self._checkpoint_link(), os.fspath(path))

    def _checkpoint_link(self) -> ClientLink:
        return ClientLink(self._links.call, self._gets.fetch_host_columns, self._links.unit_request)
