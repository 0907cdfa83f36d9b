"""TransferQueue's ``KVBatchMeta``: the handle on keyed rows that the KV calls return."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import _meta
from .._errors import InvalidRequestError
from .._wire._checks import integral


def _names(name: str, values: Any) -> list[str]:
    """``values`` (a list, tuple or array of str) as a list of plain str; a string alone
    would be split into one-letter names."""
    if isinstance(values, (str, bytes)):
        raise InvalidRequestError(
            f"KVBatchMeta {name} must be a list of str, got the string {values!r}: pass "
            f"[{values!r}]"[:200]
        )
    try:
        names = list(values)
    except TypeError:
        names = None
    if names is None or not all(isinstance(v, str) for v in names):
        raise InvalidRequestError(f"KVBatchMeta {name} must be a list of str, got {values!r}"[:200])
    return [str(v) for v in names]  # (numpy's str_ as str)


@dataclass
class KVBatchMeta:
    """The handle on keyed rows that KV calls return and workers pass around.

    Attributes:
        keys: the rows' keys.
        tags: one tag dict per key.
        partition_id: the partition of the keys.
        fields: the fields the keys have (None: unknown).
        extra_info: a per-batch dict of your own.
    """

    keys: list[str] = field(default_factory=list)
    tags: list[dict[str, Any]] = field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] | None = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.keys = _names("keys", self.keys)
        if self.fields is not None:
            self.fields = _names("fields", self.fields)
        if isinstance(self.tags, (str, bytes, Mapping)) or not isinstance(self.tags, Sequence):
            raise InvalidRequestError(
                f"KVBatchMeta tags must be a list of one tag dict per key, got "
                f"{type(self.tags).__name__}"
            )
        bad = [t for t in self.tags if not isinstance(t, Mapping)]
        if bad:
            raise InvalidRequestError(
                f"KVBatchMeta tags must be dicts (one per key; {{}} for none), got "
                f"{type(bad[0]).__name__} {bad[0]!r}"[:200]
            )
        if self.extra_info is not None and not isinstance(self.extra_info, Mapping):
            raise InvalidRequestError(
                f"KVBatchMeta extra_info must be a dict (or None), got "
                f"{type(self.extra_info).__name__}"
            )
        if len(self.keys) != len(self.tags):
            raise InvalidRequestError(
                f"KVBatchMeta needs one tag dict per key: {len(self.keys)} keys, "
                f"{len(self.tags)} tags"
            )
        if len(set(self.keys)) != len(self.keys):
            raise InvalidRequestError("KVBatchMeta keys repeat; each key may appear once")
        if self.fields is not None and len(set(self.fields)) != len(self.fields):
            raise InvalidRequestError("KVBatchMeta fields repeat; each field may appear once")
        # own copies, so chunks and selections never share mutable state
        self.tags = copy.deepcopy([dict(t) for t in self.tags])
        self.extra_info = copy.deepcopy(dict(self.extra_info or {}))

    @property
    def size(self) -> int:
        """Number of keys."""
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __str__(self) -> str:
        # TransferQueue's (what print() shows); repr() stays the dataclass's, every attribute
        return (
            f"KVBatchMeta(size={self.size}, field_names={self.fields}, "
            f"extra_info={self.extra_info})"
        )

    def select_keys(self, keys_to_select: Sequence[str]) -> KVBatchMeta:
        """The entries of ``keys_to_select``, in that order.

        Raises:
            InvalidRequestError: a key repeats or is not in this batch.
        """
        where = {k: i for i, k in enumerate(self.keys)}
        missing = [k for k in keys_to_select if k not in where]
        if missing:
            raise InvalidRequestError(f"keys {missing} are not in this KVBatchMeta")
        picked = [where[k] for k in keys_to_select]
        return self._take(picked)

    def reorder(self, indexes: Sequence[int]) -> None:
        """Put the entries in the order ``indexes`` (positions), in place.

        Raises:
            InvalidRequestError: ``indexes`` is not a permutation of the positions.
        """
        if sorted(indexes) != list(range(len(self))):
            raise InvalidRequestError(
                f"reorder needs a permutation of 0..{len(self) - 1}, got {list(indexes)}"
            )
        self.keys = [self.keys[i] for i in indexes]
        self.tags = [self.tags[i] for i in indexes]

    def chunk(self, chunks: int) -> list[KVBatchMeta]:
        """``chunks`` pieces whose sizes differ by at most one (10 keys, 3 chunks: 4, 3, 3)."""
        chunks = integral(chunks)  # (numpy's int64, a torch scalar: from a config)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0:
            raise InvalidRequestError(f"chunks must be a positive int, got {chunks!r}")
        base, extra = divmod(len(self), chunks)
        out, start = [], 0
        for i in range(chunks):
            end = start + base + (1 if i < extra else 0)
            out.append(self._take(list(range(start, end))))
            start = end
        return out

    @classmethod
    def concat(cls, data: Sequence[KVBatchMeta]) -> KVBatchMeta:
        """Entries of several batches of one partition (and one field set), in order.

        Raises:
            InvalidRequestError: the batches differ in partition, fields, or disagree on an
                ``extra_info`` key.
        """
        parts = [d for d in data if len(d)]
        if not parts:
            return cls()
        first = parts[0]
        extra: dict[str, Any] = {}
        for d in parts:
            if d.partition_id != first.partition_id:
                raise InvalidRequestError("KVBatchMeta.concat needs batches of one partition")
            if d.fields is not None and set(d.fields) != set(first.fields or d.fields):
                raise InvalidRequestError("KVBatchMeta.concat needs batches of the same fields")
            for k, v in (d.extra_info or {}).items():
                if k in extra and extra[k] != v:
                    raise InvalidRequestError(
                        f"KVBatchMeta.concat: extra_info[{k!r}] differs between the batches"
                    )
                extra[k] = v
        return cls(
            keys=[k for d in parts for k in d.keys],
            tags=[t for d in parts for t in d.tags],
            partition_id=first.partition_id,
            fields=first.fields,
            extra_info=extra,
        )

    def _take(self, positions: list[int]) -> KVBatchMeta:
        return KVBatchMeta(
            keys=[self.keys[i] for i in positions],
            tags=[self.tags[i] for i in positions],
            partition_id=self.partition_id,
            fields=self.fields,
            extra_info=self.extra_info,
        )


def kv_meta_of(meta: _meta.BatchMeta, keys: Sequence[str]) -> KVBatchMeta:
    """The `KVBatchMeta` of ``keys``, whose rows ``meta`` holds."""
    tags = meta.tags or [{} for _ in keys]
    return KVBatchMeta(
        keys=list(keys),
        tags=tags,
        partition_id=meta.partition_id,
        fields=sorted(meta.field_names),
        extra_info=meta.extra_info,
    )
