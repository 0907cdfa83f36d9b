"""Finding whole prompt groups among ready rows (shared by the GRPO and seqlen samplers).

A row's group is, in order of preference:

1. ``("tag", tags[row][group_key])`` when the controller passed ``tags`` and the row has that
   tag (the group the row was put with, e.g. its prompt ``uid``);
2. ``("put", first_row_of_its_put, offset_in_the_put // n)`` when it passed ``origin``: rows
   allocated by one put are contiguous, so each run of ``n`` rows of a put is a group;
3. ``("row", row // n)`` otherwise (a pure call with no context, e.g. in a unit test).

The kind is part of the key so a tag value can never collide with a put- or row-based group.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

from ._base import BaseSampler

__all__ = ["GroupingSampler", "check_group_size", "complete_groups", "rows_by_group"]

_MISSING: Any = object()


class GroupingSampler(BaseSampler):
    """A sampler that keeps the ``n_samples_per_prompt`` rows of one prompt together (its
    groups found by `complete_groups`, its group tag ``group_key``); abstract, as
    `BaseSampler`."""

    n_samples_per_prompt: int
    group_key: str

    short_ready_ok = True
    """True: asked on every readiness event, it waits (``([], [])``) by itself."""

    @property
    def group_tag(self) -> tuple[str, int] | None:
        """``(group_key, n_samples_per_prompt)``; None when ``n_samples_per_prompt`` is 1
        (every row is its own group: tags are not read)."""
        n = self.n_samples_per_prompt
        return (self.group_key, n) if n > 1 else None

    @property
    def group_size(self) -> int:
        """``n_samples_per_prompt``: groups are never split across ranks."""
        return self.n_samples_per_prompt


def check_group_size(n: int, batch_size: int, *, what: str = "batch_size") -> None:
    """Raise ``ValueError`` unless ``batch_size`` is a positive multiple of the group size."""
    if batch_size < 1 or batch_size % n:
        raise ValueError(
            f"{what} ({batch_size}) must be a positive multiple of n_samples_per_prompt ({n}) "
            f"so every batch holds whole groups; ask for a multiple of {n}"
        )


def _key_function(
    n: int,
    tags: Mapping[int, Mapping[str, Any]] | None,
    origin: Mapping[int, tuple[int, int]] | None,
    group_key: str,
) -> Callable[[int], Hashable]:
    def fallback(row: int) -> Hashable:
        if origin is not None:
            first, offset = origin[row]
            return ("put", first, offset // n)
        return ("row", row // n)

    if tags is None:
        return fallback

    def key(row: int) -> Hashable:
        row_tags = tags.get(row)
        value = _MISSING if row_tags is None else row_tags.get(group_key, _MISSING)
        if value is _MISSING:
            return fallback(row)
        try:
            hash(value)
        except TypeError:
            raise ValueError(
                f"row {row} has {group_key}={value!r}, an unhashable "
                f"{type(value).__name__}; use an int or str group tag"
            ) from None
        return ("tag", value)

    return key


def complete_groups(
    ready_indexes: Iterable[int],
    n: int,
    limit: int | None,
    *,
    tags: Mapping[int, Mapping[str, Any]] | None = None,
    origin: Mapping[int, tuple[int, int]] | None = None,
    group_key: str = "uid",
) -> list[list[int]]:
    """Whole groups of ``n`` rows found in ``ready_indexes``.

    Scans ``ready_indexes`` lazily and stops as soon as ``limit`` groups are complete, so the
    usual in-order case costs ``O(limit * n)`` however many rows are ready. The groups found
    are returned in order of their first row's position in ``ready_indexes``; the rows of a
    group keep their ready order.

    Args:
        ready_indexes: ready rows, in the order they became ready.
        n: rows per group (``n_samples_per_prompt``); with ``n == 1`` every row is its own
            group and tags are not read.
        limit: stop after this many complete groups; ``None`` scans everything.
        tags: ``row -> tags`` view, as the controller passes it.
        origin: ``row -> (first row of its put, offset in the put)``, as the controller
            passes it.
        group_key: the tag naming a row's group.

    Returns:
        Up to ``limit`` groups, each a list of exactly ``n`` rows.

    Raises:
        ValueError: more than ``n`` ready rows share one group tag, or a tag value is not
            hashable.
    """
    if limit is not None and limit <= 0:
        return []
    if n == 1:
        return [[r] for r in itertools.islice(ready_indexes, limit)]
    key_of = _key_function(n, tags, origin, group_key)
    # key -> (position of first row, rows); a key moves to `done` when its group fills up.
    partial: dict[Hashable, tuple[int, list[int]]] = {}
    done: dict[Hashable, tuple[int, list[int]]] = {}
    for pos, row in enumerate(ready_indexes):
        key = key_of(row)
        entry = partial.get(key)
        if entry is None:
            if key in done:
                raise _overfull(key, n, group_key, done[key][1], row)
            entry = partial[key] = (pos, [])
        entry[1].append(row)
        if len(entry[1]) == n:
            done[key] = partial.pop(key)
            if limit is not None and len(done) >= limit:
                break
    _check_whole(done, n, tags, group_key)
    return [rows for _, rows in sorted(done.values(), key=lambda e: e[0])]


def rows_by_group(
    rows: Iterable[int],
    n: int,
    *,
    tags: Mapping[int, Mapping[str, Any]] | None = None,
    origin: Mapping[int, tuple[int, int]] | None = None,
    group_key: str = "uid",
) -> list[list[int]]:
    """``rows`` grouped by their group (found as by `complete_groups`, whole or not), in
    order of each group's first row, rows of a group in their order."""
    key_of = _key_function(n, tags, origin, group_key)
    groups: dict[Hashable, list[int]] = {}
    for row in rows:
        groups.setdefault(key_of(row), []).append(row)
    return list(groups.values())


def _check_whole(
    done: Mapping[Hashable, tuple[int, list[int]]],
    n: int,
    tags: Mapping[int, Mapping[str, Any]] | None,
    group_key: str,
) -> None:
    """Raise ``ValueError`` when a complete tag group's value has more than ``n`` live rows in
    the partition (ready or not): its rows are two prompts', so the group would mix them.

    Asks the controller's tags view (``tags.tagged``, an index: ``O(1)`` per group); a plain
    mapping (a unit test, a direct call) has no partition behind it and is not checked.
    """
    tagged = getattr(tags, "tagged", None)
    if tagged is None:
        return
    for key in done:
        if isinstance(key, tuple) and key[0] == "tag":
            every = tagged(group_key, key[1])
            if len(every) > n:
                raise _overfull(key, n, group_key, sorted(every), None)


def _overfull(
    key: Hashable, n: int, group_key: str, rows: list[int], extra: int | None
) -> ValueError:
    # Only tag-based groups can overfill: put- and row-based groups hold at most n rows.
    value = key[1] if isinstance(key, tuple) else key
    listed = rows if extra is None else [*rows, extra]
    return ValueError(
        f"group {group_key}={value!r} has more than n_samples_per_prompt={n} rows "
        f"(rows {listed}): two prompts share one {group_key!r}, and a group would mix them; "
        f"nothing was handed out. Give each prompt group its own {group_key!r} tag "
        "or set n_samples_per_prompt to the real group size"
    )
