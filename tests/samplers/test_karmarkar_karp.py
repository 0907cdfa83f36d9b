"""Tests of :func:`karmarkar_karp` and its verl alias."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tq_async.samplers import get_seqlen_balanced_partitions, karmarkar_karp
from tq_async.samplers._kk import _greedy_parts, _kk_parts


def greedy_baseline(seqlens: list[int], k: int, equal_size: bool) -> list[list[int]]:
    """Longest first into the lightest part (that still has room when equal_size)."""
    capacity = len(seqlens) // k if equal_size else len(seqlens)
    parts: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, 0, j) for j in range(k)]
    for i in sorted(range(len(seqlens)), key=lambda i: (-seqlens[i], i)):
        total, count, j = heapq.heappop(heap)
        parts[j].append(i)
        if count + 1 < capacity:
            heapq.heappush(heap, (total + seqlens[i], count + 1, j))
    return parts


def spread(parts: list[list[int]], seqlens: list[int]) -> int:
    sums = [sum(seqlens[i] for i in p) for p in parts]
    return max(sums) - min(sums)


@st.composite
def problems(draw: st.DrawFn) -> tuple[list[int], int, bool]:
    k = draw(st.integers(1, 8))
    equal_size = draw(st.booleans())
    n = k * draw(st.integers(1, 8)) if equal_size else draw(st.integers(k, 48))
    big = draw(st.sampled_from([3, 100, 10_000]))  # small values make ties likely
    seqlens = draw(st.lists(st.integers(0, big), min_size=n, max_size=n))
    return seqlens, k, equal_size


@settings(max_examples=200, deadline=None)
@given(problems())
def test_partition_is_exact_and_no_worse_than_greedy(problem: tuple[list[int], int, bool]) -> None:
    seqlens, k, equal_size = problem
    parts = karmarkar_karp(seqlens, k, equal_size)

    assert len(parts) == k
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(len(seqlens)))  # every item in exactly one part
    assert all(p == sorted(p) and p for p in parts)  # sorted, never empty
    assert [p[0] for p in parts] == sorted(p[0] for p in parts)
    if equal_size:
        assert {len(p) for p in parts} == {len(seqlens) // k}
    assert spread(parts, seqlens) <= spread(greedy_baseline(seqlens, k, equal_size), seqlens)


@settings(max_examples=100, deadline=None)
@given(problems())
def test_inner_heuristics_are_valid_partitions(problem: tuple[list[int], int, bool]) -> None:
    # Both candidates must be complete, non-empty partitions on their own, whichever wins.
    seqlens, k, equal_size = problem
    for parts in (_kk_parts(seqlens, k, equal_size), _greedy_parts(seqlens, k, equal_size)):
        assert sorted(i for p in parts for i in p) == list(range(len(seqlens)))
        assert len(parts) == k
        assert all(parts)
        if equal_size:
            assert {len(p) for p in parts} == {len(seqlens) // k}


def test_pure_kk_can_lose_to_greedy_so_both_are_kept() -> None:
    # Why karmarkar_karp also runs greedy: on this input largest differencing alone is worse.
    seqlens, k = [18, 7, 0, 7, 16, 0, 3, 5, 17, 9], 2
    assert spread(_kk_parts(seqlens, k, True), seqlens) > spread(
        _greedy_parts(seqlens, k, True), seqlens
    )
    assert spread(karmarkar_karp(seqlens, k, True), seqlens) == spread(
        _greedy_parts(seqlens, k, True), seqlens
    )


def test_known_split() -> None:
    assert karmarkar_karp([1, 2, 3, 4, 5, 6], 2, equal_size=True) in (
        [[0, 3, 5], [1, 2, 4]],
        [[0, 2, 5], [1, 3, 4]],
    )
    # The textbook case: KK finds 16/14 (optimal is 15/15), greedy only 17/13.
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2, equal_size=False)
    assert sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts) == [14, 16]


def test_single_part_and_one_item_per_part() -> None:
    assert karmarkar_karp([5, 1, 3], 1, equal_size=True) == [[0, 1, 2]]
    assert karmarkar_karp([5, 1, 3], 3, equal_size=True) == [[0], [1], [2]]
    assert karmarkar_karp([0, 0, 0], 2, equal_size=False) in ([[0], [1, 2]], [[0, 1], [2]])


def test_verl_alias_gives_the_same_result() -> None:
    seqlens = [913, 15, 400, 401, 7, 1200, 80, 640]
    assert get_seqlen_balanced_partitions(seqlens, 4, True) == karmarkar_karp(seqlens, 4, True)
    assert get_seqlen_balanced_partitions(seqlens, 3, False) == karmarkar_karp(seqlens, 3, False)


@pytest.mark.parametrize(
    ("seqlens", "k", "equal_size", "match"),
    [
        ([1, 2], 0, False, "k must be an integer >= 1"),
        ([1, 2], 3, False, "cannot split 2 items into 3"),
        ([1, 2, 3], 2, True, "divisible by k"),
        ([1, -2], 1, False, "non-negative"),
    ],
)
def test_bad_arguments_raise_value_error(
    seqlens: list[int], k: int, equal_size: bool, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        karmarkar_karp(seqlens, k, equal_size)
