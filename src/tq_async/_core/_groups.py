"""Prompt groups by tag: which live rows of a partition share a value of a grouping tag.

A GRPO group is the rows put under one ``uid``; two prompts that reuse a ``uid`` would be
mixed into one group and train on wrong advantages. `TagGroups` keeps, per grouping tag,
``value -> live rows`` (built by one scan of the partition's tags on first use, then kept up to
date on every tag change and clear), so a put, ``set_tags`` or ``kv_put`` is checked against
the whole partition in ``O(rows it touches)``, and a sampler finds a group's rows in ``O(1)``.
Pure: no loop, no socket.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import Any

from .._errors import InvalidRequestError

_NO_ROWS: Set[int] = frozenset()
_MISSING: Any = object()
#: the usual group tag types (hashable without trying)
_PLAIN = frozenset({int, str})

Tags = Mapping[str, Any]


class TagGroups:
    """``tag -> value -> live rows`` over one partition's row tags (``source()``: each row
    with its tags)."""

    def __init__(self, source: Callable[[], Iterable[tuple[int, Tags | None]]]) -> None:
        self._source = source
        #: tag -> the most live rows one value of it may have: the prompt groups of the
        #: controller's samplers (shared with the owning ``ControllerState``)
        self.limits: Mapping[str, int] = {}
        #: tag -> value -> the live rows with it; per tag built on first use, then maintained
        self._index: dict[str, dict[Any, set[int]]] = {}

    def rows(self, tag: str, value: Any) -> Set[int]:
        """The live rows whose ``tag`` is ``value``."""
        return self._of(tag).get(value, _NO_ROWS)

    def _of(self, tag: str) -> dict[Any, set[int]]:
        index = self._index.get(tag)
        if index is None:
            index = self._index[tag] = {}
            for row, tags in self._source():  # a cleared row's tags are None
                value = _MISSING if tags is None else tags.get(tag, _MISSING)
                if value is not _MISSING and _hashable(value):
                    index.setdefault(value, set()).add(row)
        return index

    def merged(self, row: int, current: Tags | None, tags: Tags) -> None:
        """``tags`` are being merged into ``row``'s ``current`` tags: follow the change."""
        for tag, index in self._index.items():
            if tag in tags:
                if current is not None:
                    _unindex(index, current, tag, row)
                value = tags[tag]
                if type(value) in _PLAIN or _hashable(value):
                    index.setdefault(value, set()).add(row)

    def cleared(self, row: int, current: Tags | None) -> None:
        """``row`` (with tags ``current``) is being cleared."""
        for tag, index in self._index.items():
            _unindex(index, current, tag, row)

    def check(self, partition_id: str, rows: Sequence[int], tags: Sequence[Tags | None]) -> None:
        """Raise `InvalidRequestError` if merging ``tags`` into ``rows`` gives a value of
        a grouping tag (`limits`) more live rows than one prompt group holds.

        ``O(len(rows))``: the rows per value are an index kept up to date. Changes nothing.
        """
        for tag, n in self.limits.items():
            index = self._of(tag)
            joining: dict[Any, dict[int, None]] = {}
            for r, t in zip(rows, tags, strict=True):
                if not t or tag not in t:
                    continue
                value = t[tag]
                if type(value) not in _PLAIN and not _hashable(value):
                    raise InvalidRequestError(
                        f"row {r} is tagged {tag}={value!r}, an unhashable "
                        f"{type(value).__name__}, but {tag!r} names a row's prompt group; use an "
                        "int or str"
                    )
                if r not in index.get(value, _NO_ROWS):
                    joining.setdefault(value, {})[r] = None
            for value, new in joining.items():
                have = index.get(value, _NO_ROWS)
                if len(have) + len(new) > n:
                    raise InvalidRequestError(
                        f"{len(have) + len(new)} rows of partition {partition_id!r} would "
                        f"share {tag}={value!r}, but one prompt group holds "
                        f"n_samples_per_prompt={n} rows: rows {_few(sorted(have))} have it and "
                        f"this call adds rows {_few(list(new))}. Two prompts under one {tag!r} "
                        "would be mixed into one group; nothing of this call was applied. Give "
                        f"each prompt its own {tag!r} tag (e.g. a uuid, not a counter that "
                        "restarts) or set n_samples_per_prompt to the real group size"
                    )


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _unindex(index: dict[Any, set[int]], tags: Tags | None, tag: str, row: int) -> None:
    """Take ``row`` out of ``index`` under its current value of ``tag`` (if any)."""
    value = _MISSING if tags is None else tags.get(tag, _MISSING)
    if value is _MISSING or not _hashable(value):
        return
    rows = index.get(value)
    if rows is not None:
        rows.discard(row)
        if not rows:
            del index[value]


def _few(rows: Sequence[int], limit: int = 12) -> str:
    """``rows`` as a list, cut after ``limit`` (an error message stays short)."""
    if len(rows) <= limit:
        return str(list(rows))
    return f"[{', '.join(map(str, rows[:limit]))}, ... ({len(rows)} in all)]"
