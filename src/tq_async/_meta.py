"""``BatchMeta``: which rows of which partition, where they live, and their tags."""

from __future__ import annotations

import copy
import operator
import warnings
from collections.abc import Sequence
from typing import Any

import msgspec

from ._errors import InvalidRequestError

__all__ = ["BatchMeta", "check_meta", "even_ranges"]


class BatchMeta(msgspec.Struct, frozen=True, kw_only=True):
    """A handle on rows of one partition, as returned by ``put`` and ``get_meta``.

    It carries no tensor data: pass it to ``get_data`` to read the cells, to ``put(meta=...)``
    to add fields to the same rows, or to ``clear_samples`` to free them. It pickles, and
    travels between processes as msgpack.

    Attributes:
        partition_id: the partition the rows belong to.
        global_indexes: the rows' ids inside the partition, in batch order.
        field_names: the fields this batch refers to (read by ``get_data``).
        units: the storage unit holding each row (``units[i]`` for ``global_indexes[i]``).
        tags: each row's tags (``custom_meta``), e.g. ``{"uid": 7, "total_lengths": 913}``.
        task_name: the task that fetched the rows (None for a put).
        batch_index: the ``batch_index`` the rows were fetched under, if any.
        end_of_stream: True on the empty batch that tells a consumer the partition is sealed
            and drained for its task.
        policy_versions: per field that carries policy versions, each row's version (-1:
            none); see `row_policy_versions`.
        lease_id: when fetched with ``lease=``, the lease to acknowledge (0: none).
        incarnation: the partition's incarnation when the rows were put or fetched (a
            random id, new each time a partition id is created): once the partition is
            cleared and its id reused, reads and writes through this BatchMeta fail with
            ``RowsNotFound`` instead of reaching the new rows. None (a BatchMeta built by
            hand) is not checked.
        extra_info: a per-batch dict of your own (e.g. ``{"step": 12}``); it travels with the
            batch and survives `chunk_into`, `chunk_every`, `select_rows`,
            `select_fields` and `concat`.
        keys: for rows of a KV partition, each row's key (None for a row put without one);
            empty when no row of the batch has a key.

    A BatchMeta copies the lists and dicts it is given (mutating yours afterwards changes
    nothing here), and every selection gets its own copies of the tag dicts.
    """

    partition_id: str
    global_indexes: list[int]
    field_names: list[str]
    units: list[int]
    tags: list[dict[str, Any]] = msgspec.field(default_factory=list)
    task_name: str | None = None
    batch_index: int | None = None
    end_of_stream: bool = False
    policy_versions: dict[str, list[int]] = msgspec.field(default_factory=dict)
    lease_id: int = 0
    incarnation: str | None = None
    extra_info: dict[str, Any] = msgspec.field(default_factory=dict)
    keys: list[str | None] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        # Own copies: a caller mutating its lists (or a selection's tags) must not change
        # this batch behind its back.
        own = msgspec.structs.force_setattr
        own(self, "global_indexes", _ints("global_indexes", self.global_indexes))
        names: Any = self.field_names
        if isinstance(names, str):  # (else read letter by letter)
            raise InvalidRequestError(
                f"BatchMeta's field_names is a list of names, got the string {names!r}: "
                f"write field_names=[{names!r}]"
            )
        own(self, "field_names", list(names))
        own(self, "units", _ints("units", self.units))
        own(self, "tags", [dict(t) for t in self.tags])
        own(self, "policy_versions", {f: list(v) for f, v in self.policy_versions.items()})
        own(self, "extra_info", copy.deepcopy(self.extra_info) if self.extra_info else {})
        own(self, "keys", list(self.keys))
        if len(self.units) != len(self.global_indexes):
            raise InvalidRequestError("BatchMeta needs one unit per row")
        if self.tags and len(self.tags) != len(self.global_indexes):
            raise InvalidRequestError("BatchMeta needs one tag dict per row (or none at all)")
        if self.keys and len(self.keys) != len(self.global_indexes):
            raise InvalidRequestError("BatchMeta needs one key per row (or none at all)")

    def __len__(self) -> int:
        return len(self.global_indexes)

    @property
    def size(self) -> int:
        """Number of rows."""
        return len(self.global_indexes)

    @property
    def is_empty(self) -> bool:
        """True when the batch has no rows (for example at end of stream)."""
        return not self.global_indexes

    def select_rows(self, positions: Sequence[int] | slice) -> BatchMeta:
        """A BatchMeta for the rows at ``positions`` (indexes into this batch)."""
        if isinstance(positions, slice):
            positions = range(len(self))[positions]
        idx = list(positions)
        return msgspec.structs.replace(
            self,
            global_indexes=[self.global_indexes[i] for i in idx],
            units=[self.units[i] for i in idx],
            tags=[self.tags[i] for i in idx] if self.tags else [],
            policy_versions={f: [v[i] for i in idx] for f, v in self.policy_versions.items()},
            keys=[self.keys[i] for i in idx] if self.keys else [],
        )

    def row_policy_versions(self) -> list[int]:
        """Each row's policy version: the oldest over its versioned fields (-1: none)."""
        out = [-1] * len(self)
        for versions in self.policy_versions.values():
            for i, v in enumerate(versions):
                if v >= 0 and (out[i] < 0 or v < out[i]):
                    out[i] = v
        return out

    def select_fields(self, fields: Sequence[str]) -> BatchMeta:
        """The same rows, referring to ``fields`` only."""
        return msgspec.structs.replace(self, field_names=list(fields))

    def chunk_every(self, size: int) -> list[BatchMeta]:
        """Split into consecutive pieces of ``size`` rows (the last one may be shorter).

        10 rows with ``size=3`` give pieces of 3, 3, 3 and 1 rows.
        """
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise InvalidRequestError(
                f"chunk_every(size) needs a positive number of rows, got {size!r}"
            )
        return [self.select_rows(slice(i, i + size)) for i in range(0, len(self), size)]

    def chunk_into(self, n_chunks: int) -> list[BatchMeta]:
        """Split into ``n_chunks`` consecutive pieces whose sizes differ by at most one.

        TransferQueue's ``BatchMeta.chunk(n)``: 10 rows with ``n_chunks=3`` give 4, 3 and 3
        rows; with more chunks than rows the last pieces are empty.
        """
        if isinstance(n_chunks, bool) or not isinstance(n_chunks, int) or n_chunks <= 0:
            raise InvalidRequestError(
                f"chunk_into(n_chunks) needs a positive count, got {n_chunks!r}"
            )
        return [self.select_rows(slice(r.start, r.stop)) for r in even_ranges(len(self), n_chunks)]

    def chunk(self, size: int) -> list[BatchMeta]:
        """Deprecated: pieces of ``size`` rows; use `chunk_every` (the same) or
        `chunk_into` (``n`` pieces, what TransferQueue's ``chunk(n)`` means)."""
        warnings.warn(
            "BatchMeta.chunk(size) is deprecated: it means 'pieces of size rows' here but 'size "
            "pieces' in TransferQueue; call chunk_every(size) for pieces of that many rows or "
            "chunk_into(n) for n pieces",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.chunk_every(size)

    @classmethod
    def concat(cls, metas: Sequence[BatchMeta]) -> BatchMeta:
        """Rows of several batches of one partition, one after another."""
        if not metas:
            raise InvalidRequestError("concat needs at least one BatchMeta")
        first = metas[0]
        if any(m.partition_id != first.partition_id for m in metas):
            raise InvalidRequestError("concat needs batches of one partition")
        incarnations = {m.incarnation for m in metas if m.incarnation is not None}
        if len(incarnations) > 1:
            raise InvalidRequestError(
                f"concat got batches of {len(incarnations)} incarnations of partition "
                f"{first.partition_id!r} (it was cleared and re-created in between); concat "
                "only batches fetched from one incarnation"
            )
        has_tags = any(m.tags for m in metas)
        has_keys = any(m.keys for m in metas)
        fields = {f for m in metas for f in m.policy_versions}
        extra: dict[str, Any] = {}
        for m in metas:
            for k, v in m.extra_info.items():
                if k in extra and extra[k] != v:
                    raise InvalidRequestError(
                        f"concat: extra_info[{k!r}] differs between the batches ({extra[k]!r} "
                        f"vs {v!r}); make it agree or drop it before concatenating"
                    )
                extra[k] = v
        return msgspec.structs.replace(
            first,
            global_indexes=[r for m in metas for r in m.global_indexes],
            units=[u for m in metas for u in m.units],
            tags=[t for m in metas for t in (m.tags or [{}] * len(m))] if has_tags else [],
            batch_index=first.batch_index if len(metas) == 1 else None,
            incarnation=next(iter(incarnations), None),
            policy_versions={
                f: [v for m in metas for v in m.policy_versions.get(f, [-1] * len(m))]
                for f in fields
            },
            extra_info=extra,
            keys=[k for m in metas for k in (m.keys or [None] * len(m))] if has_keys else [],
        )


def _ints(name: str, values: Any) -> list[int]:
    """A copy of ``values`` as a list of ints: a list as it is (the wire's, ours), a tensor
    or an array (a hand-built BatchMeta's) by its items.

    Raises:
        InvalidRequestError: an item is no integer (naming ``name``).
    """
    if type(values) is list:
        return list(values)
    if hasattr(values, "tolist"):  # a tensor or an array: Python numbers
        values = values.tolist()
    try:
        return [operator.index(v) for v in values]
    except TypeError:
        raise InvalidRequestError(
            f"BatchMeta's {name} must hold integers, got {values!r:.80}"
        ) from None


def check_meta(meta: Any, call: str) -> BatchMeta:
    """``meta``, when it is a `BatchMeta`.

    Raises:
        InvalidRequestError: it is not, naming ``call`` (and, for a ``tq_async.compat``
            BatchMeta, its ``to_native()``).
    """
    if isinstance(meta, BatchMeta):
        return meta
    kind = type(meta)
    name = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    hint = (
        ": convert a tq_async.compat BatchMeta with meta.to_native()"
        if callable(getattr(meta, "to_native", None))
        else ""
    )
    raise InvalidRequestError(
        f"{call} takes a tq_async.BatchMeta (what put, get_meta and get return), got {name}{hint}"
    )


def even_ranges(n: int, pieces: int) -> list[range]:
    """``range(n)`` cut into ``pieces`` consecutive ranges whose lengths differ by at most one,
    the longer first (10 in 3: 4, 3, 3)."""
    base, extra = divmod(n, pieces)
    out, start = [], 0
    for i in range(pieces):
        end = start + base + (1 if i < extra else 0)
        out.append(range(start, end))
        start = end
    return out
