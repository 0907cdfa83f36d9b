"""Unit and property tests of the built-in samplers, called as pure functions (no sockets)."""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

import tq_async as tq
from tq_async.samplers import (
    BaseSampler,
    GRPOGroupNSampler,
    RankAwareSampler,
    SampleResult,
    SeqlenBalancedSampler,
    SequentialSampler,
)

Tags = dict[int, dict[str, Any]]


def msgpack_round_trip(state: dict[str, Any]) -> dict[str, Any]:
    decoded: dict[str, Any] = msgspec.msgpack.decode(msgspec.msgpack.encode(state))
    return decoded


class CountingRows(Sequence[int]):
    """A ready list that records how many rows a sampler pulled through iteration."""

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows
        self.pulled = 0

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[int]:
        for r in self.rows:
            self.pulled += 1
            yield r

    def __getitem__(self, index: Any) -> Any:
        raise AssertionError("samplers should iterate the ready rows, not index them")


# ---- GRPOGroupNSampler ---------------------------------------------------------------------


def test_grpo_whole_groups_in_order() -> None:
    s = GRPOGroupNSampler(4)
    assert s.sample(list(range(8)), 8) == (list(range(8)), list(range(8)))
    assert s.sample([1, 2, 3, 4, 5, 6, 7], 4) == ([4, 5, 6, 7], [4, 5, 6, 7])


def test_grpo_waits_for_a_late_row_then_orders_by_first_appearance() -> None:
    s = GRPOGroupNSampler(4)
    # Row 0 is late: group 0 is incomplete, so only group 1 can go.
    assert s.sample([1, 2, 3, 4, 5, 6, 7], 8) == ([], [])
    # Row 0 arrives last; group 0 first appeared first (via row 1), so it comes first.
    rows, consumed = s.sample([1, 2, 3, 4, 5, 6, 7, 0], 8)
    assert rows == [1, 2, 3, 0, 4, 5, 6, 7]
    assert consumed == rows


def test_grpo_tag_groups_interleaved() -> None:
    tags: Tags = {r: {"uid": f"p{r % 3}"} for r in range(12)}  # 3 prompts, rows interleaved
    s = GRPOGroupNSampler(4)
    rows, consumed = s.sample(list(range(12)), 8, tags=tags)
    assert rows == [0, 3, 6, 9, 1, 4, 7, 10]
    assert consumed == rows
    # Without row 9, prompt p0 is incomplete: p1 and p2 go instead.
    ready = [r for r in range(12) if r != 9]
    assert s.sample(ready, 8, tags=tags)[0] == [1, 4, 7, 10, 2, 5, 8, 11]


def test_grpo_custom_group_key() -> None:
    tags: Tags = {r: {"prompt": r % 2} for r in range(4)}
    assert GRPOGroupNSampler(2, group_key="prompt").sample([0, 1, 2, 3], 2, tags=tags)[0] == [0, 2]


def test_grpo_origin_groups_follow_puts_not_row_ids() -> None:
    # Put A allocated rows 0..5 (one group of 4 and a stray pair), put B rows 6..13.
    origin = {r: (0, r) for r in range(6)} | {r: (6, r - 6) for r in range(6, 14)}
    s = GRPOGroupNSampler(4)
    assert s.sample(list(range(14)), 8, origin=origin)[0] == [0, 1, 2, 3, 6, 7, 8, 9]
    # Without origin, "row // n" would (wrongly, here) pair rows 4..7.
    assert s.sample(list(range(14)), 8)[0] == list(range(8))


def test_grpo_tags_win_over_origin_and_untagged_rows_fall_back() -> None:
    origin = {r: (0, r) for r in range(8)}
    tags: Tags = {0: {"uid": "a"}, 5: {"uid": "a"}}  # rows 0 and 5 are one group by tag
    s = GRPOGroupNSampler(2)
    # Untagged rows pair by put offset // 2: (2, 3) and (6, 7); rows 1 and 4 lack a partner.
    rows, _ = s.sample(list(range(8)), 8, tags=tags, origin=origin, final=True)
    assert rows == [0, 5, 2, 3, 6, 7]


def test_grpo_final_returns_whole_groups_first() -> None:
    s = GRPOGroupNSampler(4)
    ready = [0, 1, 2, 3, 4, 5]
    assert s.sample(ready, 8) == ([], [])
    assert s.sample(ready, 8, final=True) == ([0, 1, 2, 3], [0, 1, 2, 3])
    assert s.sample([], 4, final=True) == ([], [])


def test_grpo_final_incomplete_groups_follow_the_tail_policy() -> None:
    # Rows that can never complete a group once the partition is final were silently never
    # delivered (end of stream came anyway); now the tail policy decides, "uneven" by default.
    s = GRPOGroupNSampler(4)
    assert s.sample([4, 5, 6], 8, final=True) == ([4, 5, 6], [4, 5, 6])
    assert s.sample([4, 5, 6], 2 * 4, final=True, tail="uneven") == ([4, 5, 6], [4, 5, 6])
    assert s.sample([4, 5, 6], 8, final=True, tail="drop") == ([], [4, 5, 6])
    with pytest.raises(ValueError, match="groups of fewer than n_samples_per_prompt=4"):
        s.sample([4, 5, 6], 8, final=True, tail="error")
    assert s.sample([4, 5, 6], 8) == ([], [])  # not final: they may still complete


def test_grpo_partial_group_warning_says_what_and_how_to_change_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The uneven tail is a WARNING record of the sampler's logger naming the partial group,
    the partition and the other policies (it was a bare line saying rows=3)."""
    s = GRPOGroupNSampler(4)
    with caplog.at_level(logging.WARNING, logger="tq_async"):
        s.sample([4, 5, 6], 8, final=True, partition_id="p", task_name="learner")
        s.sample([4, 5, 6], 8, final=True, tail="drop", partition_id="p", task_name="learner")
    uneven, drop = caplog.records
    assert uneven.name == "tq_async.samplers._grpo"
    assert uneven.levelno == drop.levelno == logging.WARNING
    assert "GRPOGroupNSampler(4): partition 'p' is final" in uneven.getMessage()
    assert "a partial group of 3 rows" in uneven.getMessage()
    assert "sampling_config={'tail': 'drop'}" in uneven.getMessage()
    assert "dropping 3 rows" in drop.getMessage()
    assert uneven.tq_event["task"] == "learner"  # type: ignore[attr-defined]


def test_grpo_scans_lazily() -> None:
    ready = CountingRows(list(range(65536)))
    rows, _ = GRPOGroupNSampler(4).sample(ready, 32)
    assert rows == list(range(32))
    assert ready.pulled == 32


def test_grpo_batch_size_must_be_a_multiple_of_n() -> None:
    with pytest.raises(ValueError, match=r"\(6\).*\(4\)"):
        GRPOGroupNSampler(4).sample(list(range(8)), 6)
    with pytest.raises(ValueError, match="positive multiple"):
        GRPOGroupNSampler(4).sample(list(range(8)), 0)


def test_grpo_overfull_tag_group_is_reported() -> None:
    tags: Tags = {r: {"uid": "prompt-7"} for r in range(5)}
    with pytest.raises(ValueError, match="uid='prompt-7'"):
        GRPOGroupNSampler(4).sample(list(range(5)), 8, tags=tags)


def test_grpo_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="n_samples_per_prompt must be >= 1"):
        GRPOGroupNSampler(0)
    with pytest.raises(ValueError, match="unhashable"):
        GRPOGroupNSampler(2).sample([0, 1], 2, tags={0: {"uid": [1]}, 1: {"uid": [1]}})


def test_grpo_n1_is_sequential() -> None:
    tags: Tags = {r: {"uid": 0} for r in range(4)}  # ignored when n == 1
    assert GRPOGroupNSampler(1).sample([3, 1, 2], 2, tags=tags) == ([3, 1], [3, 1])


# ---- RankAwareSampler ----------------------------------------------------------------------


def ctx(dp_rank: int | None, batch_index: int | None, **extra: Any) -> dict[str, Any]:
    return {
        "partition_id": "train@0",
        "task_name": "update_actor",
        "dp_rank": dp_rank,
        "batch_index": batch_index,
        **extra,
    }


def test_rank_aware_replicas_get_identical_rows_and_consume_once() -> None:
    s = RankAwareSampler(n_replicas=2)
    ready = list(range(10))
    first = s.sample(ready, 4, **ctx(0, 0))
    assert first == ([0, 1, 2, 3], [0, 1, 2, 3])
    assert s.cache_size == 1
    # The controller consumed rows 0..3; the second replica still gets them, consuming none.
    assert s.sample(ready[4:], 4, **ctx(0, 0)) == ([0, 1, 2, 3], [])
    assert s.cache_size == 0


def test_rank_aware_order_of_ranks_does_not_matter() -> None:
    s = RankAwareSampler(n_replicas=2)
    ready = list(range(20))
    # dp_rank 1 arrives before dp_rank 0; each rank is its own key.
    r1 = s.sample(ready, 4, **ctx(1, 0))
    assert isinstance(r1, tuple)
    ready = [r for r in ready if r not in r1[1]]
    r0 = s.sample(ready, 4, **ctx(0, 0))
    assert isinstance(r0, tuple)
    assert set(r0[0]).isdisjoint(r1[0])
    assert s.sample(ready, 4, **ctx(0, 0)) == (r0[0], [])
    assert s.sample(ready, 4, **ctx(1, 0)) == (r1[0], [])
    assert s.cache_size == 0


def test_rank_aware_passes_through_without_rank_or_index() -> None:
    s = RankAwareSampler(n_replicas=2)
    assert s.sample([5, 6, 7], 2, **ctx(None, 0)) == ([5, 6], [5, 6])
    assert s.sample([5, 6, 7], 2, **ctx(0, None)) == ([5, 6], [5, 6])
    assert s.cache_size == 0


def test_rank_aware_does_not_cache_not_enough_yet() -> None:
    s = RankAwareSampler(n_replicas=2)
    assert s.sample([0, 1], 4, **ctx(0, 0)) == ([], [])
    assert s.cache_size == 0
    assert s.sample([0, 1, 2, 3], 4, **ctx(0, 0)) == ([0, 1, 2, 3], [0, 1, 2, 3])


def test_rank_aware_replays_served_needs_no_cache() -> None:
    s = RankAwareSampler(n_replicas=4)
    assert s.sample(list(range(8)), 4, **ctx(0, 0, replays_served=True)) == ([0, 1, 2, 3],) * 2
    assert s.cache_size == 0


def test_rank_aware_clear_and_reset_drop_entries() -> None:
    s = RankAwareSampler(n_replicas=2)
    s.sample(list(range(8)), 2, **ctx(0, 0))
    s.sample(list(range(8)), 2, **(ctx(0, 0) | {"task_name": "ref"}))
    s.sample(list(range(8)), 2, **(ctx(0, 0) | {"partition_id": "train@1"}))
    assert s.cache_size == 3
    s.reset_partition("train@0", "ref")
    assert s.cache_size == 2
    s.clear_partition("train@0")
    assert s.cache_size == 1
    s.reset_partition("train@1", None)
    assert s.cache_size == 0


def test_rank_aware_cache_is_bounded() -> None:
    s = RankAwareSampler(n_replicas=2, max_entries=3)
    with capture_logs() as logs:
        for b in range(5):
            s.sample(list(range(100)), 1, **ctx(0, b))
    assert s.cache_size == 3
    evicted = [e for e in logs if e["event"] == "sampler_cache_evicted"]
    assert [e["key"][3] for e in evicted] == [0, 1]
    assert all(e["log_level"] == "warning" for e in evicted)


def test_rank_aware_wraps_grpo_and_forwards_context() -> None:
    s = RankAwareSampler(GRPOGroupNSampler(4), n_replicas=2)
    tags: Tags = {r: {"uid": r % 2} for r in range(8)}
    rows, consumed = s.sample(list(range(8)), 4, **ctx(0, 0, tags=tags))  # type: ignore[misc]
    assert rows == [0, 2, 4, 6]
    assert consumed == rows
    assert s.sample([1, 3, 5, 7], 4, **ctx(0, 0, tags=tags)) == ([0, 2, 4, 6], [])


class MinimalSampler(BaseSampler):
    """A ported custom sampler that names no context keywords at all."""

    def sample(self, ready_indexes: Sequence[int], batch_size: int) -> SampleResult:
        rows = list(ready_indexes[:batch_size])
        return rows, rows


def test_rank_aware_passes_inner_only_the_keywords_it_takes() -> None:
    s = RankAwareSampler(MinimalSampler(), n_replicas=2)
    assert s.sample([4, 5, 6], 2, **ctx(0, 0, tags={}, final=False)) == ([4, 5], [4, 5])


class SlowAsyncSampler(BaseSampler):
    """An ``async def`` sampler that blocks until released, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = asyncio.Event()

    async def sample(
        self, ready_indexes: Sequence[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> SampleResult:
        self.calls += 1
        await self.release.wait()
        rows = list(ready_indexes[:batch_size])
        return rows, rows


async def resolve(result: SampleResult | Any) -> SampleResult:
    if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
        awaited: SampleResult = await result
        return awaited
    plain: SampleResult = result
    return plain


async def test_rank_aware_async_inner() -> None:
    inner = SlowAsyncSampler()
    inner.release.set()
    s = RankAwareSampler(inner, n_replicas=2)
    first = await resolve(s.sample([0, 1, 2], 2, **ctx(0, 0)))
    assert first == ([0, 1], [0, 1])
    # The cached answer comes back synchronously.
    assert s.sample([2], 2, **ctx(0, 0)) == ([0, 1], [])
    assert inner.calls == 1
    assert s.cache_size == 0


async def test_rank_aware_concurrent_first_requests_sample_once() -> None:
    inner = SlowAsyncSampler()
    s = RankAwareSampler(inner, n_replicas=3)
    ready = list(range(10))
    tasks = [asyncio.ensure_future(resolve(s.sample(ready, 4, **ctx(0, 7)))) for _ in range(3)]
    await asyncio.sleep(0)
    inner.release.set()
    results = await asyncio.gather(*tasks)
    assert inner.calls == 1
    assert results[0] == ([0, 1, 2, 3], [0, 1, 2, 3])
    assert results[1:] == [([0, 1, 2, 3], []), ([0, 1, 2, 3], [])]
    assert s.cache_size == 0


async def test_rank_aware_cancelled_first_request_lets_a_waiter_sample() -> None:
    inner = SlowAsyncSampler()
    s = RankAwareSampler(inner, n_replicas=2)
    first = asyncio.ensure_future(resolve(s.sample([0, 1, 2], 2, **ctx(0, 0))))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(resolve(s.sample([0, 1, 2], 2, **ctx(0, 0))))
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    inner.release.set()
    # Nothing was cached for the cancelled request, so the waiter sampled (and consumes) itself.
    assert await second == ([0, 1], [0, 1])
    assert inner.calls == 2
    assert s.cache_size == 1


def test_rank_aware_state_dict_round_trip() -> None:
    s = RankAwareSampler(n_replicas=3)
    s.sample(list(range(8)), 2, **ctx(0, 0))
    s.sample(list(range(8)), 2, **ctx(1, 0))
    s.sample(list(range(8)), 2, **ctx(0, 0))  # one of two further reads done
    state = msgpack_round_trip(s.state_dict())

    restored = RankAwareSampler(n_replicas=3)
    restored.load_state_dict(state)
    assert restored.cache_size == 2
    assert restored.sample([], 2, **ctx(0, 0)) == ([0, 1], [])
    assert restored.cache_size == 1  # rank 0's entry was read for the last time
    assert restored.sample([], 2, **ctx(1, 0)) == ([0, 1], [])
    assert restored.sample([], 2, **ctx(1, 0)) == ([0, 1], [])
    assert restored.cache_size == 0


def test_rank_aware_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="n_replicas must be >= 1"):
        RankAwareSampler(n_replicas=0)
    with pytest.raises(ValueError, match="max_entries must be >= 1"):
        RankAwareSampler(max_entries=0)


def test_sampler_arguments_are_checked_and_numpy_ints_taken() -> None:
    """The samplers' constructors compared their counts with ``< 1`` only: a float
    (``n_samples_per_prompt=2.5``: groups of 2.5 rows), a bool or a count past int64 was
    taken, a string or None failed with a bare TypeError ("'<' not supported"), a key that
    is no string matched no tag (every row its own group), and an ``inner`` that is no
    sampler (or its class) failed with AttributeError. Each is refused naming the argument;
    numpy's ints (configs hold them) are taken as the ints they are."""
    counts: list[tuple[Any, str]] = [
        (lambda v: GRPOGroupNSampler(v), "n_samples_per_prompt"),
        (lambda v: RankAwareSampler(n_replicas=v), "n_replicas"),
        (lambda v: RankAwareSampler(max_entries=v), "max_entries"),
        (lambda v: SeqlenBalancedSampler(n_samples_per_prompt=v), "n_samples_per_prompt"),
        (lambda v: SeqlenBalancedSampler(dp_size=v), "dp_size"),
        (lambda v: SeqlenBalancedSampler(n_replicas=v), "n_replicas"),
        (lambda v: SeqlenBalancedSampler(max_entries=v), "max_entries"),
        (lambda v: SeqlenBalancedSampler(missing_length=v), "missing_length"),
        (lambda v: tq.StalenessSampler(max_staleness=v), "max_staleness"),
    ]
    for make, name in counts:
        for bad in (2.5, "2", None, True, 2**70):
            if bad is None and name == "missing_length":
                continue  # None: a row without a length is an error
            with pytest.raises(tq.InvalidRequestError, match=name):
                make(bad)
        taken = getattr(make(np.int64(2)), name, 2)  # (max_entries is no attribute)
        assert type(taken) is int
        assert taken == 2
    assert GRPOGroupNSampler(np.int64(4)).group_tag == ("uid", 4)
    assert SeqlenBalancedSampler(dp_size=np.int32(4)).dp_size_hint == 4
    with pytest.raises(tq.InvalidRequestError, match="dp_size must be at most 65536"):
        SeqlenBalancedSampler(dp_size=1 << 20)
    for bad_key in (3, None, b"uid"):
        with pytest.raises(tq.InvalidRequestError, match="group_key must name a tag"):
            GRPOGroupNSampler(2, group_key=bad_key)  # type: ignore[arg-type]
        with pytest.raises(tq.InvalidRequestError, match="length_key must name a tag"):
            SeqlenBalancedSampler(length_key=bad_key)  # type: ignore[arg-type]
    for bad_slack in ("0.1", None, float("nan"), -0.5):
        with pytest.raises(tq.InvalidRequestError, match="locality_slack"):
            SeqlenBalancedSampler(locality_slack=bad_slack)  # type: ignore[arg-type]
    assert SeqlenBalancedSampler(locality_slack=np.float32(0.25)).locality_slack == 0.25
    for wrapper in (RankAwareSampler, tq.StalenessSampler):
        with pytest.raises(tq.InvalidRequestError, match=r"pass SequentialSampler\(\)"):
            wrapper(SequentialSampler)  # type: ignore[arg-type]
        with pytest.raises(tq.InvalidRequestError, match="takes a sampler instance"):
            wrapper("sequential")  # type: ignore[arg-type]


# ---- SeqlenBalancedSampler -----------------------------------------------------------------


def lengths_tags(lengths: Mapping[int, int], n: int = 1) -> Tags:
    return {r: {"total_lengths": length, "uid": r // n} for r, length in lengths.items()}


def share_len(rows: list[int], tags: Tags) -> int:
    return sum(tags[r]["total_lengths"] for r in rows)


def test_seqlen_balances_and_consumes_the_whole_batch_at_once() -> None:
    lengths = {0: 100, 1: 90, 2: 10, 3: 5, 4: 50, 5: 45}
    tags = lengths_tags(lengths)
    s = SeqlenBalancedSampler(dp_size=2)
    share1, consumed = s.sample(list(range(6)), 2, **ctx(1, 0, tags=tags))
    assert sorted(consumed) == [0, 1, 2, 3]  # first four ready rows: the batch
    share0, again = s.sample([4, 5], 2, **ctx(0, 0, tags=tags))
    assert again == []
    assert sorted(share0 + share1) == [0, 1, 2, 3]
    assert share_len(share0, tags) in (105, 100)  # {100, 5} vs {90, 10}
    assert share0 == sorted(share0)
    assert share1 == sorted(share1)
    assert s.cache_size == 0


def test_seqlen_split_does_not_depend_on_which_rank_asks_first() -> None:
    tags = lengths_tags({r: (r * 37) % 101 for r in range(16)})
    shares = []
    for first in range(4):
        s = SeqlenBalancedSampler(dp_size=4)
        got = {first: s.sample(list(range(16)), 4, **ctx(first, 0, tags=tags))[0]}
        for rank in range(4):
            if rank != first:
                got[rank] = s.sample([], 4, **ctx(rank, 0, tags=tags))[0]
        shares.append(got)
    assert all(g == shares[0] for g in shares)


def test_seqlen_keeps_groups_whole() -> None:
    tags = lengths_tags({r: 10 * r for r in range(16)}, n=4)
    s = SeqlenBalancedSampler(n_samples_per_prompt=4, dp_size=2)
    share, consumed = s.sample(list(range(16)), 4, **ctx(0, 0, tags=tags))
    assert sorted(consumed) == list(range(8))
    assert share in ([0, 1, 2, 3], [4, 5, 6, 7])


def test_seqlen_out_of_order_arrivals() -> None:
    tags = lengths_tags({r: 1 for r in range(12)}, n=2)
    s = SeqlenBalancedSampler(n_samples_per_prompt=2, dp_size=2)
    # Row 0 late: its group (0, 1) is incomplete, groups (2, 3) and (4, 5) are used.
    _, consumed = s.sample([1, 2, 3, 4, 5], 2, **ctx(0, 0, tags=tags))
    assert sorted(consumed) == [2, 3, 4, 5]
    assert s.sample([1, 0], 2, **ctx(0, 1, tags=tags)) == ([], [])  # batch 1 needs 2 groups


def test_seqlen_waits_then_final_uses_what_is_left() -> None:
    tags = lengths_tags({r: r + 1 for r in range(10)})
    s = SeqlenBalancedSampler(dp_size=4)
    assert s.sample(list(range(10)), 4, **ctx(0, 0, tags=tags)) == ([], [])
    share, consumed = s.sample(list(range(10)), 4, **ctx(2, 0, tags=tags, final=True))
    assert sorted(consumed) == list(range(10))
    shares = {2: share} | {r: s.sample([], 4, **ctx(r, 0, tags=tags))[0] for r in (0, 1, 3)}
    assert sorted(len(v) for v in shares.values()) == [2, 2, 3, 3]
    assert sorted(r for v in shares.values() for r in v) == list(range(10))
    assert s.cache_size == 0


def test_seqlen_final_with_fewer_groups_than_ranks_is_an_error() -> None:
    tags = lengths_tags({r: 1 for r in range(3)})
    s = SeqlenBalancedSampler(dp_size=4)
    with pytest.raises(ValueError, match=r"only 3 whole group\(s\).*dp_size=4"):
        s.sample([0, 1, 2], 4, **ctx(0, 0, tags=tags, final=True))
    assert s.sample([], 4, **ctx(0, 0, tags=tags, final=True)) == ([], [])


def test_seqlen_short_final_tail_can_be_dropped_or_uneven() -> None:
    tags = lengths_tags({r: 1 for r in range(3)})
    dropping = SeqlenBalancedSampler(dp_size=4, tail="drop")
    # every row consumed, none delivered: every rank then sees the end of the stream together
    assert dropping.sample([0, 1, 2], 4, **ctx(0, 0, tags=tags, final=True)) == ([], [0, 1, 2])
    uneven = SeqlenBalancedSampler(dp_size=4, tail="uneven")
    share, consumed = uneven.sample([0, 1, 2], 4, **ctx(3, 0, tags=tags, final=True))
    assert sorted(consumed) == [0, 1, 2]
    shares = [share] + [uneven.sample([], 4, **ctx(r, 0, tags=tags))[0] for r in (0, 1, 2)]
    assert sorted(len(s) for s in shares) == [0, 1, 1, 1]
    with pytest.raises(ValueError, match="tail must be"):
        SeqlenBalancedSampler(tail="pad")


def test_seqlen_missing_length_tag_names_row_and_key() -> None:
    tags = lengths_tags({0: 1, 1: 2, 2: 3})
    s = SeqlenBalancedSampler(dp_size=2, missing_length=None)
    with pytest.raises(ValueError, match="row 3 has no 'total_lengths' tag"):
        s.sample([0, 1, 2, 3], 2, **ctx(0, 0, tags=tags))
    with pytest.raises(ValueError, match="row 0 has no 'n_tokens' tag"):
        SeqlenBalancedSampler(dp_size=2, length_key="n_tokens", missing_length=None).sample(
            [0, 1, 2, 3], 2, **ctx(0, 0, tags=tags)
        )


@pytest.mark.parametrize("bad", ["many", [3, 4], {"n": 3}, -5])
def test_seqlen_a_length_that_is_no_token_count_names_row_and_key(bad: Any) -> None:
    """A ``total_lengths`` tag that is not a token count (a word, a list, a negative number)
    is refused naming the row, the tag and its value. Before, a word or a list failed with
    Python's bare ``int()`` message ("invalid literal for int() ...") naming neither, and a
    negative count was balanced as if a row could weigh less than nothing."""
    tags = lengths_tags({0: 1, 1: 2, 2: 3, 3: 4})
    tags[2] = {"total_lengths": bad}
    s = SeqlenBalancedSampler(dp_size=2)
    with pytest.raises(ValueError, match=r"row 2 has total_lengths=.*not a token count"):
        s.sample([0, 1, 2, 3], 2, **ctx(0, 0, tags=tags))
    assert s.cache_size == 0


def test_seqlen_a_row_without_a_length_counts_one_by_default() -> None:
    """TransferQueue's SeqlenBalancedSampler reads a missing ``total_lengths`` as 1."""
    tags = {0: {"total_lengths": 3}, 1: {}, 2: {}, 3: {}}  # 3 | 1 + 1 + 1: rows 0 vs 1-3
    s = SeqlenBalancedSampler(dp_size=2)
    share0, consumed = s.sample([0, 1, 2, 3], 2, **ctx(0, 0, tags=tags))
    share1, _ = s.sample([], 2, **ctx(1, 0, tags=tags))
    assert sorted(consumed) == [0, 1, 2, 3]
    assert sorted(share0 + share1) == [0, 1, 2, 3]
    assert len(share0) == len(share1) == 2
    untagged = SeqlenBalancedSampler(dp_size=2, missing_length=5)
    assert untagged.sample([0, 1], 1, **ctx(0, 0, tags={}))[1] == [0, 1]


@pytest.mark.parametrize(
    ("dp_rank", "batch_index", "match"),
    [(None, 0, "needs dp_rank and batch_index"), (0, None, "needs dp_rank and batch_index"),
     (2, 0, "dp_rank 2 is out of range for dp_size=2"), (-1, 0, "out of range")],
)  # fmt: skip
def test_seqlen_needs_a_valid_rank_and_index(
    dp_rank: int | None, batch_index: int | None, match: str
) -> None:
    tags = lengths_tags({r: 1 for r in range(4)})
    with pytest.raises(ValueError, match=match):
        SeqlenBalancedSampler(dp_size=2).sample(
            list(range(4)), 2, **ctx(dp_rank, batch_index, tags=tags)
        )


def test_seqlen_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        SeqlenBalancedSampler(dp_size=0)
    with pytest.raises(ValueError, match=r"\(3\).*\(2\)"):
        SeqlenBalancedSampler(2, dp_size=2).sample(list(range(12)), 3, **ctx(0, 0, tags={}))


def test_seqlen_replicas_and_over_reads() -> None:
    tags = lengths_tags({r: r for r in range(8)})
    s = SeqlenBalancedSampler(dp_size=2, n_replicas=2)
    a, _ = s.sample(list(range(8)), 2, **ctx(0, 0, tags=tags))
    assert s.sample([], 2, **ctx(0, 0, tags=tags)) == (a, [])
    with pytest.raises(ValueError, match="set n_replicas"):
        s.sample([], 2, **ctx(0, 0, tags=tags))
    b = s.sample([], 2, **ctx(1, 0, tags=tags))[0]
    assert s.sample([], 2, **ctx(1, 0, tags=tags)) == (b, [])
    assert s.cache_size == 0


def test_seqlen_replays_served_reads_each_share_once() -> None:
    tags = lengths_tags({r: r for r in range(8)})
    s = SeqlenBalancedSampler(dp_size=2, n_replicas=4)
    s.sample(list(range(8)), 2, **ctx(0, 0, tags=tags, replays_served=True))
    assert s.cache_size == 1
    s.sample([], 2, **ctx(1, 0, tags=tags, replays_served=True))
    assert s.cache_size == 0


def test_seqlen_clear_and_reset_drop_entries() -> None:
    tags = lengths_tags({r: r for r in range(16)})
    s = SeqlenBalancedSampler(dp_size=2)
    s.sample(list(range(16)), 2, **ctx(0, 0, tags=tags))
    s.sample(list(range(16)), 2, **(ctx(0, 0, tags=tags) | {"task_name": "ref"}))
    assert s.cache_size == 2
    s.reset_partition("train@0", "ref")
    assert s.cache_size == 1
    s.clear_partition("train@0")
    assert s.cache_size == 0


def test_seqlen_state_dict_round_trip() -> None:
    tags = lengths_tags({r: 7 * r % 13 for r in range(16)})
    s = SeqlenBalancedSampler(dp_size=4)
    first, _ = s.sample(list(range(16)), 2, **ctx(3, 5, tags=tags))
    expected = {r: s.sample([], 2, **ctx(r, 5, tags=tags))[0] for r in (0, 1)}
    state = msgpack_round_trip(s.state_dict())

    restored = SeqlenBalancedSampler(dp_size=4)
    restored.load_state_dict(state)
    assert restored.cache_size == 1
    rank2, consumed = restored.sample([], 2, **ctx(2, 5, tags=tags))
    assert consumed == []
    assert sorted(first + rank2 + expected[0] + expected[1]) == list(range(8))
    assert restored.cache_size == 0


# ---- SeqlenBalancedSampler under random request orders (property-based) ---------------------

DP, REPLICAS, BATCH = 4, 2, 2


def greedy_spread(group_lengths: list[int], k: int) -> int:
    """Greedy baseline with equal group counts: longest first into the lightest open part."""
    capacity = -(-len(group_lengths) // k)
    heap = [(0, 0, j) for j in range(k)]
    sums = [0] * k
    for length in sorted(group_lengths, reverse=True):
        total, count, j = heapq.heappop(heap)
        sums[j] = total + length
        if count + 1 < capacity:
            heapq.heappush(heap, (sums[j], count + 1, j))
    return max(sums) - min(sums)


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.sampled_from([1, 2]))
    n_batches = draw(st.integers(1, 4))
    n_groups = n_batches * DP * BATCH // n + draw(st.integers(0, 3))
    lengths = draw(st.lists(st.integers(1, 4096), min_size=n_groups * n, max_size=n_groups * n))
    # Rows become ready in a random order, a few at a time, interleaved with requests.
    arrival = draw(st.permutations(range(n_groups * n)))
    requests = [(b, rank, rep) for b in range(n_batches) for rank in range(DP)
                for rep in range(REPLICAS)]  # fmt: skip
    order = draw(st.permutations(requests))
    chunk = draw(st.integers(1, 8))
    return {"n": n, "lengths": lengths, "arrival": arrival, "order": order, "chunk": chunk}


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_seqlen_property_disjoint_identical_covering_balanced(scenario: dict[str, Any]) -> None:
    n, lengths = scenario["n"], scenario["lengths"]
    tags: Tags = {r: {"total_lengths": length, "uid": r // n} for r, length in enumerate(lengths)}
    sampler = SeqlenBalancedSampler(n_samples_per_prompt=n, dp_size=DP, n_replicas=REPLICAS)

    arrival: list[int] = list(scenario["arrival"])
    ready: dict[int, None] = {}
    consumed: set[int] = set()
    batch_rows: dict[int, list[int]] = {}  # batch_index -> rows consumed for it
    got: dict[tuple[int, int], list[list[int]]] = {}  # (batch, rank) -> what each replica got
    pending: list[tuple[int, int, int]] = list(scenario["order"])

    while pending:
        b, rank, _replica = pending.pop(0)
        final = not arrival
        sampled, cons = sampler.sample(list(ready), BATCH, **ctx(rank, b, tags=tags, final=final))
        if not sampled:
            assert not final, "all rows are ready: every request can be served"
            assert not cons
            pending.append((b, rank, _replica))  # the controller waits and asks again
            for r in arrival[: scenario["chunk"]]:
                ready[r] = None
            del arrival[: scenario["chunk"]]
            continue
        assert consumed.isdisjoint(cons), "a row was consumed twice"
        consumed.update(cons)
        for r in cons:
            del ready[r]
        if cons:
            assert b not in batch_rows
            batch_rows[b] = list(cons)
        got.setdefault((b, rank), []).append(sampled)

    assert sampler.cache_size == 0
    all_given: list[int] = []
    for b, rows in batch_rows.items():
        shares = []
        for rank in range(DP):
            replicas = got[(b, rank)]
            assert len(replicas) == REPLICAS
            assert all(rep == replicas[0] for rep in replicas), "replicas must be identical"
            assert len(replicas[0]) == BATCH
            shares.append(replicas[0])
        flat = [r for share in shares for r in share]
        assert sorted(flat) == sorted(rows), "the batch is exactly the rows it consumed"
        all_given.extend(flat)
        groups = {tags[r]["uid"] for r in flat}
        for share in shares:  # whole groups only
            for uid in {tags[r]["uid"] for r in share}:
                assert sum(tags[r]["uid"] == uid for r in share) == n
        group_len = {g: 0 for g in groups}
        for r in flat:
            group_len[tags[r]["uid"]] += tags[r]["total_lengths"]
        sums = [share_len(share, tags) for share in shares]
        assert max(sums) - min(sums) <= greedy_spread(list(group_len.values()), DP)
    assert len(all_given) == len(set(all_given)), "no row given to two ranks or batches"


def test_sequential_sampler_still_exported() -> None:
    assert SequentialSampler().sample([1, 2, 3], 2) == ([1, 2], [1, 2])


async def test_rank_aware_waiter_started_after_the_first_finished() -> None:
    inner = SlowAsyncSampler()
    s = RankAwareSampler(inner, n_replicas=2)
    first = s.sample([0, 1, 2], 2, **ctx(0, 0))
    late = s.sample([0, 1, 2], 2, **ctx(0, 0))  # created while the first is in flight
    inner.release.set()
    assert await resolve(first) == ([0, 1], [0, 1])
    assert await asyncio.wait_for(resolve(late), 1) == ([0, 1], [])
    assert inner.calls == 1
    assert s.cache_size == 0


@pytest.mark.parametrize(
    "make",
    [
        lambda: tq.GRPOGroupNSampler(0),
        lambda: tq.SeqlenBalancedSampler(dp_size=0),
        lambda: tq.SeqlenBalancedSampler(dp_size=2, tail="sometimes"),
        lambda: tq.RankAwareSampler(n_replicas=0),
        lambda: tq.StalenessSampler(max_staleness=-1),
        lambda: tq.StalenessSampler(max_staleness=1, on_stale="ignore"),
        lambda: tq.karmarkar_karp([3, 1], 0, equal_size=False),
        lambda: tq.karmarkar_karp([3, -1], 2, equal_size=False),
        lambda: tq.BatchMeta.concat([]),
        lambda: tq.configure_logging("loud"),
    ],
)
def test_bad_arguments_to_public_constructors_raise_a_tq_error(make: Any) -> None:
    # InvalidRequestError is also a ValueError: code that caught ValueError still does
    with pytest.raises(tq.InvalidRequestError):
        make()


@pytest.mark.parametrize("batch_size", [0, -1])
def test_built_in_samplers_called_directly_refuse_a_batch_size_below_one(batch_size: int) -> None:
    """TransferQueue's slice (0: no rows, -1: all but the last); here a ValueError naming it,
    as docs/migrating.md says."""
    ctx = {"dp_rank": 0, "batch_index": 0}
    for sampler in (
        SequentialSampler(),
        GRPOGroupNSampler(2),
        SeqlenBalancedSampler(),
        RankAwareSampler(),
        tq.StalenessSampler(),
    ):
        with pytest.raises(ValueError, match="batch_size"):
            sampler.sample([0, 1, 2], batch_size, **ctx)
