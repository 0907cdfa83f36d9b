"""A bounded cache of row assignments that forgets each share after its last expected read.

Shared by `RankAwareSampler` and
`SeqlenBalancedSampler`. Keys are tuples that start with
``(partition_id, task_name, ...)``; each entry holds one or more *shares* (``slot -> rows``),
each with a count of reads still expected. A share goes once its count reaches zero and the
entry goes with its last share, so a cache read as often as promised empties itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._errors import InvalidRequestError
from .._logging import get_logger

__all__ = ["ShareCache", "reads_needed"]

_log = get_logger(__name__)

Key = tuple[Any, ...]


def reads_needed(n_replicas: int, kwargs: Mapping[str, Any]) -> int:
    """How many reads a share gets before it is dropped (the first read included).

    When the controller serves repeated requests for the same key from its recorded
    batches (it passes ``replays_served=True``), only the first read reaches the sampler;
    otherwise each of the ``n_replicas`` readers of a rank reads once.
    """
    return 1 if kwargs.get("replays_served") else n_replicas


class _Entry:
    __slots__ = ("reads_left", "shares")

    def __init__(self) -> None:
        self.shares: dict[int, list[int]] = {}
        self.reads_left: dict[int, int] = {}


class ShareCache:
    """Row shares by key, each dropped after its last expected read; at most ``max_entries``."""

    def __init__(self, max_entries: int, owner: str) -> None:
        if max_entries < 1:
            raise InvalidRequestError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._owner = owner
        # Insertion-ordered, so the first key is the oldest entry (evicted first).
        self._entries: dict[Key, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def add(self, key: Key, shares: Mapping[int, list[int]], reads: Mapping[int, int]) -> None:
        """Store ``shares`` under ``key``; a share whose ``reads`` count is 0 is not kept."""
        entry = self._entries.get(key) or _Entry()
        for slot, rows in shares.items():
            if reads[slot] > 0:
                entry.shares[slot] = rows
                entry.reads_left[slot] = reads[slot]
        if not entry.shares or key in self._entries:
            return
        self._entries[key] = entry
        while len(self._entries) > self.max_entries:
            old_key = next(iter(self._entries))
            old = self._entries.pop(old_key)
            _log.warning(
                "sampler_cache_evicted",
                sampler=self._owner,
                key=list(old_key),
                unread_slots=sorted(old.shares),
                max_entries=self.max_entries,
                hint="a reader never came back for this batch; raise max_entries or check "
                "n_replicas / dp_size match the readers",
            )

    def peek(self, key: Key, slot: int) -> list[int] | None:
        """The share ``slot`` of ``key`` without counting a read, or None if there is none."""
        entry = self._entries.get(key)
        rows = None if entry is None else entry.shares.get(slot)
        return None if rows is None else list(rows)

    def read(self, key: Key, slot: int) -> list[int] | None:
        """The share ``slot`` of ``key`` (counting one read), or None if there is none."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        rows = entry.shares.get(slot)
        if rows is None:
            return None
        entry.reads_left[slot] -= 1
        if entry.reads_left[slot] <= 0:
            del entry.shares[slot], entry.reads_left[slot]
            if not entry.shares:
                del self._entries[key]
        return list(rows)

    def clear(self, partition_id: str, task_name: str | None = None) -> None:
        """Drop every entry of ``partition_id`` (only those of ``task_name`` unless None)."""
        doomed = [
            k
            for k in self._entries
            if k[0] == partition_id and (task_name is None or k[1] == task_name)
        ]
        for k in doomed:
            del self._entries[k]

    def state_dict(self) -> list[Any]:
        """Entries as msgpack-able lists: ``[[key...], [[slot, rows, reads_left], ...]]``."""
        return [
            [list(key), [[slot, list(rows), e.reads_left[slot]] for slot, rows in e.shares.items()]]
            for key, e in self._entries.items()
        ]

    def load_state_dict(self, state: list[Any]) -> None:
        """Replace the entries with those of `state_dict`."""
        self._entries.clear()
        for key, shares in state:
            entry = _Entry()
            for slot, rows, left in shares:
                entry.shares[int(slot)] = [int(r) for r in rows]
                entry.reads_left[int(slot)] = int(left)
            if entry.shares:
                self._entries[tuple(key)] = entry
