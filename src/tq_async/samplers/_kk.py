"""Balanced k-way partitioning of sequence lengths (Karmarkar-Karp, with a greedy safety net).

Used by `SeqlenBalancedSampler` to give every data-parallel rank a
near-equal token count, and public because trainers want the same split for micro-batches
(verl calls it ``get_seqlen_balanced_partitions``; the result here is identical in shape).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from .._errors import InvalidRequestError

__all__ = ["get_seqlen_balanced_partitions", "karmarkar_karp"]


class _Bin:
    """One part of a partial partition: summed length, item count, item indices."""

    __slots__ = ("count", "items", "total")

    def __init__(self, total: int, count: int, items: list[int]) -> None:
        self.total = total
        self.count = count
        self.items = items


def karmarkar_karp(seqlens: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """Split item indices into ``k`` parts whose summed lengths are as equal as possible.

    Runs the largest differencing method (Karmarkar-Karp) generalised to ``k`` parts: a heap
    of partial partitions ordered by spread (heaviest minus lightest part); the two with the
    largest spread are merged, heaviest part of one with lightest of the other, until one
    remains. With ``equal_size`` the items are first sorted and cut into runs of ``k``
    consecutive lengths, one item per part, so every merge keeps the part sizes equal.

    Largest differencing is a heuristic and on some inputs ends up worse than the greedy
    "longest first into the lightest part" rule, so both are computed and the partition with
    the smaller spread (max part sum minus min part sum) is returned, the Karmarkar-Karp one on
    a tie. The result is therefore never worse than greedy. Cost: ``O(n log n + n k log k)``.

    Args:
        seqlens: non-negative length of every item (``seqlens[i]`` is item ``i``).
        k: number of parts, at least 1 and at most ``len(seqlens)``.
        equal_size: give every part exactly ``len(seqlens) // k`` items (then ``len(seqlens)``
            must be divisible by ``k``).

    Returns:
        ``k`` non-empty lists of item indices, each sorted ascending; the lists are ordered by
        their smallest index, so the part holding item 0 comes first.

    Raises:
        ValueError: ``k < 1``, fewer items than parts, a negative length, or ``equal_size``
            with ``len(seqlens)`` not divisible by ``k``.
    """
    lengths = _validate(seqlens, k, equal_size)
    best = _kk_parts(lengths, k, equal_size)
    greedy = _greedy_parts(lengths, k, equal_size)
    if _spread(greedy, lengths) < _spread(best, lengths):
        best = greedy
    parts = [sorted(p) for p in best]
    parts.sort(key=lambda p: p[0])
    return parts


def get_seqlen_balanced_partitions(
    seqlens: Sequence[int], k_partitions: int, equal_size: bool
) -> list[list[int]]:
    """verl's name for `karmarkar_karp`; same arguments, same result.

    Args:
        seqlens: non-negative length of every item.
        k_partitions: number of parts.
        equal_size: give every part the same number of items.

    Returns:
        ``k_partitions`` non-empty, sorted lists of item indices (see `karmarkar_karp`).

    Raises:
        ValueError: as `karmarkar_karp`.
    """
    return karmarkar_karp(seqlens, k_partitions, equal_size)


def _validate(seqlens: Sequence[int], k: int, equal_size: bool) -> list[int]:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InvalidRequestError(f"k must be an integer >= 1 (the number of parts), got {k!r}")
    lengths = list(seqlens)
    if len(lengths) < k:
        raise InvalidRequestError(
            f"cannot split {len(lengths)} items into {k} non-empty parts; "
            f"pass at least {k} items or ask for fewer parts"
        )
    if equal_size and len(lengths) % k:
        raise InvalidRequestError(
            f"equal_size needs the number of items ({len(lengths)}) to be divisible by "
            f"k ({k}); drop {len(lengths) % k} items or pass equal_size=False"
        )
    for i, n in enumerate(lengths):
        if n < 0:
            raise InvalidRequestError(f"seqlens[{i}] is {n}; lengths must be non-negative")
    return lengths


def _heaviest_first(b: _Bin) -> tuple[int, int]:
    return -b.total, -b.count


def _kk_parts(lengths: list[int], k: int, equal_size: bool) -> list[list[int]]:
    # A partial partition is k bins sorted heaviest first by (sum, count). Ordering by count
    # on equal sums keeps empty bins last, so merging a partition with a non-empty bins and
    # one with b non-empty bins yields min(k, a + b) non-empty bins: n >= k items leave none
    # empty.
    counter = itertools.count()
    heap: list[tuple[int, int, list[_Bin]]] = []
    if equal_size:
        order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
        for start in range(0, len(order), k):
            chunk = order[start : start + k]
            bins = [_Bin(lengths[i], 1, [i]) for i in reversed(chunk)]
            heap.append((lengths[chunk[0]] - lengths[chunk[-1]], next(counter), bins))
    else:
        for i, n in enumerate(lengths):
            bins = [_Bin(n, 1, [i])]
            bins.extend(_Bin(0, 0, []) for _ in range(k - 1))
            heap.append((-n, next(counter), bins))
    heapq.heapify(heap)  # a min-heap on -spread: the widest partial partition pops first
    while len(heap) > 1:
        a = heapq.heappop(heap)[2]
        b = heapq.heappop(heap)[2]
        merged: list[_Bin] = []
        for x, y in zip(a, reversed(b), strict=True):
            big, small = (x.items, y.items) if len(x.items) >= len(y.items) else (y.items, x.items)
            # Grow the longer list with the shorter one: O(n log n) copying overall.
            big.extend(small)
            merged.append(_Bin(x.total + y.total, x.count + y.count, big))
        merged.sort(key=_heaviest_first)
        heapq.heappush(heap, (merged[-1].total - merged[0].total, next(counter), merged))
    return [b.items for b in heap[0][2]]


def _greedy_parts(lengths: list[int], k: int, equal_size: bool) -> list[list[int]]:
    capacity = len(lengths) // k if equal_size else len(lengths)
    parts: list[list[int]] = [[] for _ in range(k)]
    # Lightest first by (sum, count, part): an empty part beats a part holding zero-length items.
    heap = [(0, 0, j) for j in range(k)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        total, count, j = heapq.heappop(heap)
        parts[j].append(i)
        if count + 1 < capacity:
            heapq.heappush(heap, (total + lengths[i], count + 1, j))
    return parts


def _spread(parts: list[list[int]], lengths: list[int]) -> int:
    sums = [sum(lengths[i] for i in p) for p in parts]
    return max(sums) - min(sums)
