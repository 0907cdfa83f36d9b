"""Watchers of one client with the same filter share one request (`_client._async._feeds`)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from typing import Any

import anyio
import torch

import tq_async as tq
from tq_async.events import Event, Resync

WATCHERS = 16


async def _put(client: tq.AsyncClient, pid: str = "p", n: int = 1) -> None:
    await client.put({"x": torch.arange(n)}, pid)


async def _take(events: Any, n: int) -> list[Event]:
    out: list[Event] = []
    async for ev in events:
        out.append(ev)
        if len(out) == n:
            break
    return out


async def _parked(hub: Any, n: int) -> None:
    """Until ``n`` requests are parked on the controller (event-driven: the loop settles)."""
    while len(hub.parked) < n:
        await anyio.wait_all_tasks_blocked()


async def test_sixteen_watchers_of_one_client_share_one_request_per_round() -> None:
    rounds = 8
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
        contextlib.AsyncExitStack() as stack,
    ):
        hub = cluster.controller.watch
        watches = [await stack.enter_async_context(client.watch()) for _ in range(WATCHERS)]
        seen: list[list[tuple[int, str]]] = [[] for _ in watches]
        got_row = [0] * rounds
        round_done = [anyio.Event() for _ in range(rounds)]
        answers = hub.answers  # after the 16 subscriptions

        async def watch(w: Any, out: list[tuple[int, str]]) -> None:
            async for ev in w:
                out.append((ev.seq, ev.kind))
                if ev.kind == "fields_produced":
                    [row] = ev.rows
                    got_row[row] += 1
                    if got_row[row] == WATCHERS:
                        round_done[row].set()
                    if row == rounds - 1:
                        return

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for w, out in zip(watches, seen, strict=True):
                    tg.start_soon(watch, w, out)
                for r in range(rounds):
                    await _parked(hub, 1)
                    await _put(client)  # one row each: rows r
                    await round_done[r].wait()
        # every watcher saw every event, once, in order
        expected = [(1, "partition_created")] + [
            (2 + 2 * r + i, kind)
            for r in range(rounds)
            for i, kind in enumerate(["rows_added", "fields_produced"])
        ]
        assert all(out == expected for out in seen)
        # one answer (or two: the put's events in two passes) per round, not one per watcher
        assert hub.answers - answers <= 2 * rounds
        assert len(hub.parked) == 0
        assert cluster.controller.waiting == 0


async def test_followers_go_on_when_the_leader_is_cancelled() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
        client.watch() as leader,
        client.watch() as one,
        client.watch() as other,
    ):
        hub = cluster.controller.watch
        got: list[list[Event]] = [[], []]
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                async with anyio.create_task_group() as lead:
                    lead.start_soon(_take, leader, 1)
                    await _parked(hub, 1)

                    async def follow(w: Any, out: list[Event]) -> None:
                        out.extend(await _take(w, 3))

                    tg.start_soon(follow, one, got[0])
                    tg.start_soon(follow, other, got[1])
                    await anyio.wait_all_tasks_blocked()
                    assert len(hub.parked) == 1  # the followers wait for the leader's answer
                    lead.cancel_scope.cancel()
                await _parked(hub, 1)  # a follower asks itself
                assert len(hub.parked) == 1
                await _put(client)
        kinds = ["partition_created", "rows_added", "fields_produced"]
        assert [e.kind for e in got[0]] == [e.kind for e in got[1]] == kinds
        assert [e.seq for e in got[0]] == [1, 2, 3]
        await client.list_partitions()  # the leader's Cancel went before this
        assert (len(hub.parked), cluster.controller.waiting) == (0, 0)


async def _lock_step(client: tq.AsyncClient, fast: Any, puts: int) -> list[Event]:
    """``puts`` one-row puts into "p", ``fast`` taking each put's events before the next."""
    out: list[Event] = []
    for i in range(puts):
        await _put(client)
        out.extend(await _take(fast, 3 if i == 0 else 2))
    return out


async def test_a_watcher_behind_the_kept_answers_gets_every_event_once() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
        client.watch() as fast,
        client.watch() as slow,
    ):
        fast._feed.kept = 2  # the slow one falls behind what is kept
        with anyio.fail_after(30):
            ahead = await _lock_step(client, fast, 6)
            assert fast._feed.answer((slow.incarnation, slow.seq)) is None
            behind = await _take(slow, len(ahead))
        assert [(e.seq, e.kind) for e in behind] == [(e.seq, e.kind) for e in ahead]
        assert [e.seq for e in ahead] == list(range(1, 14))


async def test_a_watcher_past_its_max_lag_gets_a_resync_as_alone() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
        client.watch(max_lag=3) as fast,
        client.watch(max_lag=3) as slow,
    ):
        with anyio.fail_after(30):
            ahead = await _lock_step(client, fast, 3)  # 7 events, two answers kept
            [ev] = await _take(slow, 1)
            assert isinstance(ev, Resync)
            assert "max_lag=3" in ev.reason
            assert ev.seq == ahead[-1].seq == 7
            await client.seal("p")
            [ev] = await _take(slow, 1)
            [again] = await _take(fast, 1)
        assert (ev.kind, ev.seq) == (again.kind, again.seq) == ("partition_sealed", 8)


async def test_watchers_with_different_filters_each_ask() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await _put(client, "q")
        hub = cluster.controller.watch
        async with (
            client.watch() as a,
            client.watch() as b,
            client.watch(kinds=["fields_produced"]) as c,
            client.watch("q") as d,
            client.watch(max_lag=100) as e,
            anyio.create_task_group() as tg,
        ):
            assert len(client._links.feeds) == 4
            got: list[list[Event]] = [[] for _ in range(5)]
            for w, out in zip((a, b, c, d, e), got, strict=True):

                async def take(w: Any = w, out: list[Event] = out) -> None:
                    out.extend(await _take(w, 1))

                tg.start_soon(take)
            await _parked(hub, 4)
            await anyio.wait_all_tasks_blocked()
            assert len(hub.parked) == 4  # a and b share; c, d, e ask each
            await _put(client, "q")
        kinds = [out[0].kind for out in got]
        assert kinds == ["rows_added", "rows_added", "fields_produced", "rows_added", "rows_added"]


def test_blocking_watchers_read_in_turn_share_answers() -> None:
    async def main() -> None:
        async with tq.local_cluster(num_storage_units=1) as cluster:
            hub = cluster.controller.watch

            def blocking() -> tuple[list[int], list[int], int]:
                with (
                    tq.Client.connect(cluster.address) as client,
                    client.watch() as a,
                    client.watch() as b,
                ):
                    client.put({"x": torch.arange(2)}, partition_id="p")
                    client.put({"x": torch.arange(2)}, partition_id="p")
                    first = [ev.seq for ev in _take_now(a, 5)]
                    answers = hub.answers
                    second = [ev.seq for ev in _take_now(b, 5)]
                    return first, second, hub.answers - answers

            first, second, asked = await anyio.to_thread.run_sync(blocking)
            assert first == second == [1, 2, 3, 4, 5]
            assert asked == 0  # b took a's answers

    anyio.run(main)


def _take_now(events: Any, n: int) -> list[Event]:
    out: list[Event] = []
    for ev in events:
        out.append(ev)
        if len(out) == n:
            break
    return out


def test_a_forked_child_waits_on_no_request_of_the_parent() -> None:
    ctx = mp.get_context("fork")

    async def main() -> None:
        async with tq.local_cluster(num_storage_units=1) as cluster:
            queue = ctx.Queue()

            def parent() -> int:
                with (
                    tq.Client.connect(cluster.address) as client,
                    client.watch() as a,
                    client.watch() as b,
                ):
                    client.put({"x": torch.arange(2)}, partition_id="p")
                    assert a.incarnation is not None
                    assert a.seq is not None
                    # the parent's request from here is in flight as the child starts
                    a._feed.lead((a.incarnation, a.seq))

                    def child() -> None:
                        queue.put([ev.seq for ev in _take_now(b, 3)])

                    proc = ctx.Process(target=child)
                    proc.start()
                    proc.join(30)
                    if proc.exitcode is None:  # it waits on the parent's request
                        proc.kill()
                        proc.join()
                        return -1
                    return proc.exitcode

            assert await anyio.to_thread.run_sync(parent) == 0
            assert await anyio.to_thread.run_sync(queue.get, True, 10) == [1, 2, 3]

    anyio.run(main)
