"""`Feed` and `Feeds` alone: who asks, what is kept, what is dropped."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import anyio

from tq_async._client._async._feeds import Feed, Feeds
from tq_async._sync_primitives import Handoff as SyncHandoff
from tq_async._wire._events import WatchBatch


def _batch(cursor: int, incarnation: str = "i") -> WatchBatch:
    return WatchBatch(incarnation, cursor, [])


class _Watcher:
    pass


def _feed(watchers: int = 2, kept: int = 64) -> tuple[Feed, list[_Watcher]]:
    feed = Feed(kept)
    holders = [_Watcher() for _ in range(watchers)]
    for w in holders:
        feed.join(w)
    return feed, holders


async def test_the_first_asks_and_the_answer_is_kept_for_the_others() -> None:
    feed, _holders = _feed(3)
    assert feed.answer(("i", 0)) is None
    assert feed.in_flight(("i", 0)) is None
    done = feed.lead(("i", 0))
    assert feed.in_flight(("i", 0)) is done
    assert not done.is_set()
    answer = _batch(3)
    feed.landed(("i", 0), done, answer)
    assert done.is_set()
    assert feed.in_flight(("i", 0)) is None
    assert feed.answer(("i", 0)) is answer
    assert feed.answer(("i", 0)) is answer  # the leader took it: kept for the other two
    assert feed.answer(("i", 0)) is None
    assert feed.answer(("i", 3)) is None
    assert feed.answer((None, 0)) is None


async def test_the_watchers_waiting_take_the_answer_at_once_and_it_is_kept_for_the_rest() -> None:
    feed, _holders = _feed(4)
    done = feed.lead(("i", 0))
    got: list[WatchBatch | None] = []

    async def wait(handoff: Any = done) -> None:
        got.append(await handoff.wait())

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        tg.start_soon(wait)
        async with anyio.create_task_group() as gone:  # a waiter cancelled takes nothing
            gone.start_soon(wait)
            await anyio.wait_all_tasks_blocked()
            gone.cancel_scope.cancel()
        await anyio.wait_all_tasks_blocked()
        answer = _batch(3)
        feed.landed(("i", 0), done, answer)
    assert got == [answer, answer]
    assert feed.answer(("i", 0)) is answer  # for the one not waiting: the leader and two took it
    assert feed.answer(("i", 0)) is None
    assert await done.wait() is answer  # (a waiter coming late takes it too)
    failed = feed.lead(("i", 3))
    async with anyio.create_task_group() as tg:
        tg.start_soon(wait, failed)
        await anyio.wait_all_tasks_blocked()
        feed.landed(("i", 3), failed, None)
    assert got[-1] is None  # the request failed: nothing to take, this one asks itself


def test_the_blocking_handoff_gives_the_threads_waiting_the_value() -> None:
    handoff: SyncHandoff[int] = SyncHandoff()
    got: list[int | None] = []
    waiter = threading.Thread(target=lambda: got.append(handoff.wait()))
    waiter.start()
    deadline = time.monotonic() + 30
    while handoff._waiting < 1 and time.monotonic() < deadline:  # (until it waits)
        time.sleep(0)
    assert not handoff.is_set()
    assert handoff.give(7) == 1
    waiter.join(30)
    assert got == [7]
    assert handoff.wait() == 7  # a thread coming later takes it at once


async def test_a_failure_or_an_empty_poll_is_not_kept() -> None:
    feed, _holders = _feed()
    done = feed.lead(("i", 5))
    feed.landed(("i", 5), done, None)  # failed or cancelled: the next one asks itself
    assert done.is_set()
    assert feed.answer(("i", 5)) is None
    assert feed.in_flight(("i", 5)) is None
    done = feed.lead(("i", 5))
    feed.landed(("i", 5), done, _batch(5))  # the poll ended: nothing moved
    assert feed.answer(("i", 5)) is None
    done = feed.lead((None, 5))
    feed.landed((None, 5), done, _batch(5))  # the same position, now named: kept
    assert feed.answer((None, 5)) is not None


async def test_the_oldest_answers_are_dropped() -> None:
    feed, _holders = _feed(kept=3)
    for c in range(5):
        feed.landed(("i", c), feed.lead(("i", c)), _batch(c + 1))
    assert [feed.answer(("i", c)) is not None for c in range(5)] == [False, False, True, True, True]


async def test_a_watcher_past_its_max_lag_is_left_to_the_controller() -> None:
    feed, _holders = _feed()
    for c in range(10):
        feed.landed(("i", c), feed.lead(("i", c)), _batch(c + 1))
    assert feed.answer(("i", 2), max_lag=8) is not None  # 8 behind the newest answer (10)
    assert feed.answer(("i", 1), max_lag=8) is None  # 9 behind: the controller says Resync
    assert feed.answer(("i", 1)) is not None


async def test_a_lone_watcher_or_one_closed_keeps_nothing() -> None:
    feed, holders = _feed(1)
    assert feed.alone
    feed.landed(("i", 0), feed.lead(("i", 0)), _batch(1))
    assert feed.answer(("i", 0)) is None
    other = _Watcher()
    feed.join(other)
    assert not feed.alone
    feed.landed(("i", 1), feed.lead(("i", 1)), _batch(2))
    feed.leave(other)
    feed.landed(("i", 2), feed.lead(("i", 2)), _batch(3))
    assert feed.answer(("i", 1)) is not None
    assert feed.answer(("i", 2)) is None
    assert holders


async def test_after_a_fork_nobody_waits_on_the_parents_requests() -> None:
    feeds = Feeds()
    feed = feeds.feed(("p", None))
    assert feeds.feed(("p", None)) is feed
    assert feeds.feed(("q", None)) is not feed
    feed.lead(("i", 0))
    feeds.after_fork()
    assert feed.in_flight(("i", 0)) is None


def test_a_feed_goes_with_its_last_holder() -> None:
    feeds = Feeds()
    feed = feeds.feed("k")
    assert len(feeds) == 1
    del feed
    gc.collect()
    assert len(feeds) == 0
