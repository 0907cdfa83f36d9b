"""``client.watch()``: the controller's changes as typed events, replayable to its state."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import socket
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import tq_async as tq
from _cluster_proc import serve_role
from tq_async._controller import _watch
from tq_async._controller._watch import EventLog, Pacer, RequestCost
from tq_async._core._arrays import live_rows
from tq_async._service._loop import REQUESTS, SAMPLE_EVERY, Incoming, RequestStats
from tq_async._transport._endpoints import READS, SAMPLE_READS, ReaderCost
from tq_async._wire._protocol import WatchNext
from tq_async.events import (
    EVENT_KINDS,
    Event,
    PartitionSealed,
    Resync,
    UnitBack,
    UnitLost,
    UnitSuspended,
)

# ---- a model of the cluster, built from events only ------------------------------------------


class Model:
    """Partitions as the events tell them: live rows, produced fields, consumption, keys, tags."""

    def __init__(self) -> None:
        self.parts: dict[str, dict[str, Any]] = {}
        self.resyncs = 0
        self.seqs: list[int] = []
        #: the rows of each rows_consumed, by partition
        self.consumed: dict[str, list[list[int]]] = {}

    def apply(self, ev: Event) -> None:
        self.seqs.append(ev.seq)
        kind = ev.kind
        if kind == "resync":
            assert isinstance(ev, Resync)
            self.resyncs += 1
            self.parts = {s.partition_id: _from_snapshot(s) for s in ev.snapshot.partitions}
            return
        if kind.startswith("unit_"):
            return
        pid = ev.partition_id  # type: ignore[attr-defined]
        if kind == "partition_created":
            self.parts[pid] = _empty(ev.incarnation)  # type: ignore[attr-defined]
            return
        if kind == "partition_restored":
            self.parts[pid] = _from_snapshot(ev.snapshot)  # type: ignore[attr-defined]
            return
        if kind == "partition_cleared":
            del self.parts[pid]
            return
        p = self.parts[pid]
        rows = set(getattr(ev, "rows", ()))
        if kind == "partition_sealed":
            p["sealed"] = True
        elif kind == "rows_added":
            p["rows"] |= rows
            for key, r in zip(ev.keys or (), ev.rows, strict=False):  # type: ignore[attr-defined]
                p["keys"][key] = r
        elif kind == "rows_removed":
            p["rows"] -= rows
            for s in (*p["fields"].values(), *p["consumed"].values()):
                s -= rows
            p["keys"] = {k: r for k, r in p["keys"].items() if r not in rows}
            p["tags"] = {r: t for r, t in p["tags"].items() if r not in rows}
        elif kind == "fields_produced":
            for f in ev.fields:  # type: ignore[attr-defined]
                p["fields"].setdefault(f, set()).update(rows)
        elif kind == "tags_changed":
            for r, t in zip(ev.rows, ev.tags, strict=True):  # type: ignore[attr-defined]
                if t:
                    p["tags"].setdefault(r, {}).update(t)
        elif kind == "rows_consumed":
            p["consumed"].setdefault(ev.task, set()).update(rows)  # type: ignore[attr-defined]
            self.consumed.setdefault(pid, []).append(ev.rows)  # type: ignore[attr-defined]
        elif kind == "rows_released":
            p["consumed"].get(ev.task, set()).difference_update(rows)  # type: ignore[attr-defined]
        elif kind == "consumption_reset":
            task = ev.task  # type: ignore[attr-defined]
            for t in list(p["consumed"]):
                if task is None or t == task:
                    p["consumed"][t] = set()

    def state(self) -> dict[str, Any]:
        return {pid: _normal(p) for pid, p in self.parts.items()}


def _empty(incarnation: str) -> dict[str, Any]:
    return {
        "incarnation": incarnation,
        "sealed": False,
        "rows": set(),
        "fields": {},
        "consumed": {},
        "keys": {},
        "tags": {},
    }


def _from_snapshot(s: Any) -> dict[str, Any]:
    p = _empty(s.incarnation)
    p["sealed"] = s.sealed
    p["rows"] = set(s.rows)
    p["fields"] = {f: set(r) for f, r in s.fields.items()}
    p["consumed"] = {t: set(r) for t, r in s.consumed.items()}
    p["keys"] = dict(s.keys)
    p["tags"] = {r: dict(t) for r, t in s.tags.items()}
    return p


def _normal(p: dict[str, Any]) -> dict[str, Any]:
    out = dict(p)
    out["fields"] = {f: s for f, s in p["fields"].items() if s}
    out["consumed"] = {t: s for t, s in p["consumed"].items() if s}
    out["tags"] = {r: t for r, t in p["tags"].items() if t}
    return out


def truth(cluster: tq.LocalCluster) -> dict[str, Any]:
    """The controller's own state, in the model's shape."""
    out = {}
    for pid, p in cluster.controller.state.partitions.items():
        rows, b = set(live_rows(p)), p.base  # (row r at index r - b)
        fields = p.fields.items()
        out[pid] = _normal(
            {
                "incarnation": p.incarnation,
                "sealed": p.sealed,
                "rows": rows,
                "fields": {f: {r for r in rows if fd.produced[r - b]} for f, fd in fields},
                "consumed": {t: {r for r in rows if c[r - b]} for t, c in p.consumed.items()},
                "keys": dict(p.keys),
                "tags": {r: dict(p.tags[r - b]) for r in rows if p.tags[r - b]},
            }
        )
    return out


# ---- random operations -----------------------------------------------------------------------


async def random_ops(client: tq.AsyncClient, rng: random.Random, n: int, tag: str) -> None:
    """``n`` random puts, reads, acks, releases, clears, tags, KV writes and seals."""
    metas: dict[str, list[tq.BatchMeta]] = {}
    for i in range(n):
        op = rng.random()
        pid = rng.choice(["a", "b", "c"])
        if op < 0.3:
            k = rng.randint(1, 4)
            tags = [{"i": i}] * k if rng.random() < 0.3 else None
            meta = await client.put({"x": torch.arange(k)}, pid, tags=tags)
            metas.setdefault(pid, []).append(meta)
            if rng.random() < 0.3:
                await client.put({"y": torch.zeros(k)}, meta=meta)
        elif op < 0.5:
            task = rng.choice(["t1", "t2"])
            lease = 60.0 if rng.random() < 0.5 else None
            try:
                meta = await client.get_meta(["x"], 1, pid, task, timeout=0, lease=lease)
            except tq.TQTimeoutError:
                continue
            if lease is not None:
                await (client.ack(meta) if rng.random() < 0.5 else client.release(meta))
        elif op < 0.6 and metas.get(pid):
            meta = metas[pid].pop(rng.randrange(len(metas[pid])))
            with contextlib.suppress(tq.RowsNotFound):  # some rows were cleared already
                await client.clear_samples(meta)
        elif op < 0.67 and metas.get(pid):
            meta = metas[pid][-1]
            await client.set_tags(meta, [{"tag": tag, "i": i}] * len(meta))
        elif op < 0.77:
            keys = [f"k{rng.randint(0, 6)}" for _ in range(rng.randint(1, 3))]
            keys = list(dict.fromkeys(keys))
            await client.kv_batch_put(keys, "kv", {"x": torch.arange(len(keys))})
            if rng.random() < 0.3:
                await client.kv_put(keys[0], "kv", tag={"t": i})
            if rng.random() < 0.2:
                await client.kv_clear(keys[:1], "kv")
        elif op < 0.83 and pid in await client.list_partitions():
            await client.reset_consumption(pid, rng.choice(["t1", None]))
        elif op < 0.88:
            await client.seal(f"s{i % 3}", create=True)
        elif op < 0.92 and pid in await client.list_partitions():
            await client.clear_partition(pid)
            metas.pop(pid, None)


async def _replay(history: int | None, seed: int, share: float | None = None) -> Model:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        if history is not None:
            cluster.controller.watch.log = EventLog(history)
        if share is not None:  # answers held back: consumption joins events not yet answered
            cluster.controller.watch.pacer = Pacer(share=share, burst=0.0)
        rng = random.Random(seed)
        model = Model()
        async with client.watch() as events:
            if history is not None:  # the watcher is not reading yet: it falls behind
                await random_ops(client, rng, 40, "before")
            async with anyio.create_task_group() as tg:

                async def watcher() -> None:
                    async for ev in events:
                        model.apply(ev)
                        # the seal of "end" comes as its event, or in a Resync's snapshot
                        if model.parts.get("end", {}).get("sealed"):
                            return

                tg.start_soon(watcher)
                await random_ops(client, rng, 150, "during")
                if share is not None:  # a reader's batches in a row, while a pass is due
                    await client.put({"x": torch.arange(8)}, "r")
                    for _ in range(4):
                        await client.get_meta(["x"], 2, "r", "t1")
                await client.seal("end", create=True)
        assert model.state() == truth(cluster)
        return model


@pytest.mark.parametrize("seed", [1, 2])
async def test_events_replayed_give_the_final_state(seed: int) -> None:
    model = await _replay(None, seed)
    assert model.resyncs == 0
    assert model.seqs == list(range(1, len(model.seqs) + 1))  # no gap, no duplicate


async def test_events_replayed_give_the_final_state_when_answers_are_paced() -> None:
    model = await _replay(None, 4, share=0.01)
    assert model.seqs == list(range(1, len(model.seqs) + 1))
    assert len(model.consumed["r"]) < 4  # (joined)


async def test_events_replayed_across_a_forced_resync() -> None:
    model = await _replay(8, 3)
    assert model.resyncs >= 1


# ---- positions, resyncs, bounds --------------------------------------------------------------


async def _put(client: tq.AsyncClient, pid: str = "p", n: int = 2) -> tq.BatchMeta:
    return await client.put({"x": torch.arange(n)}, pid)


async def _take(events: Any, n: int) -> list[Event]:
    out = []
    async for ev in events:
        out.append(ev)
        if len(out) == n:
            break
    return out


async def test_since_resumes_with_no_gap_and_no_duplicate() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
        client.watch() as whole,
        client.watch() as first,
    ):
        for _ in range(3):
            await _put(client)  # 1 created + 3 x (rows added, fields produced)
        seen = await _take(first, 4)
        await first.aclose()
        assert [e.seq for e in seen] == [1, 2, 3, 4]
        for _ in range(2):
            await _put(client)
        # a new watch from where the first stopped: the rest, once
        rest = client.watch(since=first.seq, incarnation=first.incarnation)
        got = await _take(rest, 7)
        assert [e.seq for e in got] == list(range(5, 12))
        assert [e.seq for e in await _take(whole, 11)] == list(range(1, 12))
        assert not any(isinstance(e, Resync) for e in got)
        assert cluster.controller.waiting == 0


async def test_another_incarnation_or_lost_history_gives_one_resync() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        async with client.watch():  # starts the event log
            await _put(client, n=3)
        [ev] = await _take(client.watch(since=0, incarnation="0123456789abcdef"), 1)
        assert isinstance(ev, Resync)
        assert "another controller incarnation" in ev.reason
        [part] = ev.snapshot.partitions
        assert (part.partition_id, part.rows, part.fields) == ("p", [0, 1, 2], {"x": [0, 1, 2]})
        assert ev.seq == 3
        # a position past the last event: a Resync too, then the events after it
        later = client.watch(since=99)
        [ev] = await _take(later, 1)
        assert isinstance(ev, Resync)
        await client.seal("p")
        [ev] = await _take(later, 1)
        assert (ev.kind, ev.seq) == ("partition_sealed", 4)
        # history gone
        cluster.controller.watch.log = log = EventLog(2)
        async with client.watch() as w:
            await _put(client, "q")
            await _put(client, "q")
            assert log.oldest > 1
        [ev] = await _take(client.watch(since=0, incarnation=log.incarnation), 1)
        assert isinstance(ev, Resync)
        assert "gone" in ev.reason
        assert w.incarnation == log.incarnation


async def test_another_incarnation_at_the_last_number_resyncs_also_when_paced() -> None:
    """A position of another incarnation that happens to equal this controller's last event
    number (a restarted controller counts from 0 again) gets its Resync at once, and from the
    poll's end when the pacer holds the answers back: never an empty answer, which would move
    the watcher into this incarnation with nothing told."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        hub = cluster.controller.watch
        async with client.watch():  # starts the event log
            await _put(client, n=3)
        other = "0123456789abcdef"
        with anyio.fail_after(5):
            [ev] = await _take(client.watch(since=hub.log.last, incarnation=other, poll=0.2), 1)
        assert isinstance(ev, Resync)
        assert "another controller incarnation" in ev.reason
        hub.pacer = Pacer(share=0.001, burst=0.0)  # spent for a minute: no flush before the poll
        hub.pacer.charge(asyncio.get_running_loop().time(), 0.06)
        with anyio.fail_after(5):
            [ev] = await _take(client.watch(since=hub.log.last, incarnation=other, poll=0.2), 1)
        assert isinstance(ev, Resync)
        assert [p.partition_id for p in ev.snapshot.partitions] == ["p"]


async def test_a_watcher_that_falls_behind_its_bound_gets_a_resync() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        async with client.watch(max_lag=3) as slow, client.watch() as fast:
            for _ in range(3):
                await _put(client)  # 7 events
            [ev] = await _take(slow, 1)
            assert isinstance(ev, Resync)
            assert "max_lag=3" in ev.reason
            assert [p.rows for p in ev.snapshot.partitions] == [[0, 1, 2, 3, 4, 5]]
            await client.seal("p")
            [ev] = await _take(slow, 1)
            assert (ev.kind, ev.seq) == ("partition_sealed", 8)
            # the fast one was not slowed or cut short
            assert [e.seq for e in await _take(fast, 8)] == list(range(1, 9))
        assert cluster.controller.watch.log.last == 8


async def test_filters_by_partition_and_kind() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await _put(client, "p")
        await _put(client, "q")
        async with client.watch("q", kinds=["fields_produced"]) as w:
            await _put(client, "p")
            await _put(client, "q", 3)
            [ev] = await _take(w, 1)
            assert (ev.kind, ev.partition_id, ev.rows) == ("fields_produced", "q", [2, 3, 4])  # type: ignore[attr-defined]


async def test_cancelling_or_breaking_a_watch_leaves_nothing_behind() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        ctl = cluster.controller
        async with anyio.create_task_group() as tg:

            async def wait_forever() -> None:
                async with client.watch() as w:
                    await _take(w, 1)

            tg.start_soon(wait_forever)
            await anyio.wait_all_tasks_blocked()
            while not ctl.watch.parked:  # subscribed, then parked on the controller
                await anyio.wait_all_tasks_blocked()
            assert len(ctl.watch.parked) == 1
            tg.cancel_scope.cancel()
        await client.list_partitions()  # the Cancel went before this on the same connection
        assert (len(ctl.watch.parked), ctl.waiting) == (0, 0)
        # breaking out between steps holds nothing on the controller
        async with client.watch() as w:
            await _put(client)
            await _take(w, 1)
        assert (len(ctl.watch.parked), ctl.waiting) == (0, 0)


async def test_an_idle_watch_whose_request_is_retried_still_ends_its_poll() -> None:
    """A client resends a request silent for ``retry_after`` (10 s by default, under the
    default poll of 30 s): the resend must not start the poll again, or an idle watcher is
    never answered and fails with TQTimeoutError after poll + request_timeout."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address, retry_after=0.05, request_timeout=2) as client,
    ):
        hub = cluster.controller.watch
        async with anyio.create_task_group() as tg:

            async def idle_watch() -> None:
                async with client.watch(poll=0.4) as w:
                    await _take(w, 1)  # nothing comes: its polls end empty, asked again

            tg.start_soon(idle_watch)
            with anyio.fail_after(30):
                while hub.answers < 3:  # the subscription, then two polls ended empty
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()


async def test_bad_input_names_what_is_known() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await _put(client, "p")
        with pytest.raises(
            tq.InvalidRequestError, match=r"unknown event kinds \['rows'\].*rows_added"
        ):
            client.watch(kinds=["rows"])
        with pytest.raises(tq.InvalidRequestError, match=r"'nope'.*known partitions: \['p'\]"):
            await client.watch("nope").start()
        with pytest.raises(tq.InvalidRequestError, match="since"):
            client.watch(since=-1)
        with pytest.raises(tq.InvalidRequestError, match="poll"):
            client.watch(poll=0)
        with pytest.raises(tq.InvalidRequestError, match="max_lag"):
            client.watch(max_lag=0)
        assert cluster.controller.waiting == 0
        assert "resync" in EVENT_KINDS


def test_the_blocking_client_iterates_too() -> None:
    async def main() -> None:
        async with tq.local_cluster(num_storage_units=1) as cluster:

            def blocking() -> list[str]:
                with tq.Client.connect(cluster.address) as client:
                    with client.watch() as events:
                        client.put({"x": torch.arange(2)}, partition_id="p")
                        kinds = []
                        for ev in events:
                            kinds.append(ev.kind)
                            if ev.kind == "fields_produced":
                                break
                    return kinds

            got = await anyio.to_thread.run_sync(blocking)
            assert got == ["partition_created", "rows_added", "fields_produced"]

    anyio.run(main)


async def test_a_restarted_controller_breaks_the_watch_and_a_resume_resyncs() -> None:
    for _ in range(3):  # another test may take the freed port before the restart binds it
        if await _restart_at_the_same_bind():
            return
    pytest.fail("three free ports were taken by others before the restart could bind them")


async def _restart_at_the_same_bind() -> bool:
    """The scenario; False when the restart could not bind (the port went to another)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        bind = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    async with tq.local_cluster(num_storage_units=1, bind=bind):
        client = tq.AsyncClient.connect(bind)
        await client.open()
        watch = client.watch()
        await watch.start()
        await _put(client)
        assert [e.kind for e in await _take(watch, 3)][-1] == "fields_produced"
    try:
        try:
            restarted = tq.local_cluster(num_storage_units=1, bind=bind)
            await restarted.__aenter__()
        except tq.BrokenError as exc:
            if "Address already in use" in str(exc):
                return False
            raise
        try:
            async with tq.AsyncClient.connect(bind) as other:
                await _put(other, "q")
                with pytest.raises(tq.BrokenError):  # never a silent gap
                    await _take(watch, 1)
                again = other.watch(since=watch.seq, incarnation=watch.incarnation)
                [ev] = await _take(again, 1)
                assert isinstance(ev, Resync)
                assert [p.partition_id for p in ev.snapshot.partitions] == ["q"]
        finally:
            await restarted.__aexit__(None, None, None)
    finally:
        await client.aclose()
    return True


async def test_a_watcher_at_its_start_gets_a_resync_from_a_restarted_durable_serve(
    tmp_path: Path,
) -> None:
    """A watcher that subscribed (position 0) and read nothing while ``tq-async serve`` at
    ``durability="process"`` was SIGKILLed and restarted on its data_dir: the new controller
    numbers from 0 too, but its position is of the old incarnation. It gets a Resync with
    the recovered state at once, never an empty answer that moves it into the new numbering
    past the rows it never heard of (found by the watch hunt: it waited out its poll, then
    took the new run's events as if nothing came before)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        bind = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    argv = ("--bind", bind, "--storage-units", "1", "--durability", "process")
    argv += ("--data-dir", str(tmp_path))
    with ExitStack() as stack:
        proc, _ = stack.enter_context(serve_role(*argv))
        async with (
            tq.AsyncClient.connect(bind, request_timeout=10) as client,
            client.watch(poll=0.2) as watch,
        ):
            old = watch.incarnation
            assert watch.seq == 0
            await _put(client, "p", 4)  # the watcher reads none of it before the kill
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            stack.enter_context(serve_role(*argv))
            ev = None
            with anyio.move_on_after(5):  # (a bound: the Resync comes at once)
                try:
                    ev = await watch.__anext__()
                except tq.BrokenError:  # the client learns of the restart on this call
                    ev = await watch.__anext__()
            assert isinstance(ev, Resync), (
                f"no Resync but {ev}; the watcher moved from {old}:0 to "
                f"{watch.incarnation}:{watch.seq} with nothing told"
            )
            assert watch.incarnation != old
            [part] = ev.snapshot.partitions
            info = await client.partition_info("p")
            assert (part.partition_id, len(part.rows)) == ("p", info["rows"]) == ("p", 4)
            assert part.fields == {"x": part.rows}


async def test_a_unit_restarted_under_its_id_is_told_up_again() -> None:
    """A storage unit SIGKILLed and started again under its ``--unit-id`` (its rows lost, as
    documented) takes new rows again: the events say so (``unit_lost``, then ``unit_back``),
    so replaying them gives the units' states a Resync's snapshot and ``tq-async status``
    show, not a unit lost for good."""
    with serve_role("controller") as (_, address), ExitStack() as stack:
        args = ("storage", "--controller", address, "--unit-id")
        unit0, _ = stack.enter_context(serve_role(*args, "0", line="TQ_UNIT="))
        stack.enter_context(serve_role(*args, "1", line="TQ_UNIT="))
        async with (
            tq.AsyncClient.connect(address, request_timeout=10) as client,
            client.watch() as watch,
        ):
            for _ in range(4):  # rows on both units
                await _put(client, "p", 4)
            unit0.send_signal(signal.SIGKILL)
            unit0.wait(timeout=10)
            stack.enter_context(serve_role(*args, "0", line="TQ_UNIT="))  # (registered)
            await client.seal("marker", create=True)  # after the registration, in order
            told: dict[int, list[str]] = {}
            with anyio.fail_after(10):
                async for ev in watch:
                    if isinstance(ev, (UnitSuspended, UnitBack, UnitLost)):
                        told.setdefault(ev.unit, []).append(ev.kind)
                    if isinstance(ev, PartitionSealed) and ev.partition_id == "marker":
                        break
            [snap] = await _take(client.watch(since=0, incarnation="another"), 1)
            assert isinstance(snap, Resync)
            assert snap.snapshot.units == {0: "up", 1: "up"}
            assert "unit_lost" in told[0]  # its rows are gone
            replayed = {u: {"unit_back": "up"}.get(k[-1], "down") for u, k in told.items()}
            assert replayed == {0: "up"}, f"the events told unit 0: {told[0]}"
            assert (await client.partition_info("p"))["lost"] > 0


def test_the_pacer_answers_at_once_until_the_share_is_spent() -> None:
    pacer = Pacer(share=0.05, burst=0.002)
    assert pacer.delay(0.0) == 0.0  # a quiet controller: at once
    pacer.charge(0.0, 0.001)
    assert pacer.delay(0.0) == 0.0  # within the burst
    pacer.charge(0.0, 0.002)  # 1 ms over
    assert pacer.delay(0.0) == pytest.approx(0.001 / 0.05)
    assert pacer.delay(0.01) == pytest.approx(0.01)  # refilled at 5 % of the clock
    assert pacer.delay(0.02) == 0.0
    assert pacer.delay(100.0) == 0.0
    pacer.charge(100.0, 0.0025)  # the credit saved up is the burst, no more
    assert pacer.delay(100.0) == pytest.approx(0.0005 / 0.05)
    with pytest.raises(tq.InvalidRequestError):
        Pacer(share=0.0)


async def test_watchers_alike_share_one_answer_and_a_busy_controller_batches() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        hub = cluster.controller.watch
        got: list[list[Event]] = [[], [], []]
        async with contextlib.AsyncExitStack() as stack:
            # three clients: watchers of one client share one request before it gets here
            # (tests/client/test_watch_feeds.py)
            clients = [
                await stack.enter_async_context(tq.AsyncClient.connect(cluster.address))
                for _ in got
            ]
            watches = [await stack.enter_async_context(c.watch()) for c in clients]
            async with anyio.create_task_group() as tg:
                for w, out in zip(watches, got, strict=True):

                    async def take(w: Any = w, out: list[Event] = out) -> None:
                        out.extend(await _take(w, 2))

                    tg.start_soon(take)
                while len(hub.parked) < 3:
                    await anyio.wait_all_tasks_blocked()
                sent = hub.answers
                await _put(client, "p", 1)  # partition_created, rows_added, fields_produced
            # each watcher got its answer (one encoding for the three), nothing lost
            assert hub.answers - sent >= 3
            assert all([e.kind for e in out] == ["partition_created", "rows_added"] for out in got)

        # spent: events wait for the pacer's delay and then go out together, in order
        hub.pacer = Pacer(share=0.05, burst=0.0)
        hub.pacer.charge(asyncio.get_running_loop().time(), 0.05)  # 1 s to wait
        async with client.watch(kinds=["fields_produced"]) as w:
            for _ in range(3):
                await _put(client, "p", 1)
            answers = hub.answers
            events = await _take(w, 3)
            assert [e.rows for e in events] == [[1], [2], [3]]  # type: ignore[attr-defined]
            assert hub.answers - answers <= 2  # batched, not one answer per put


async def test_events_no_parked_watcher_wants_cost_no_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pass that answers nobody costs what taking a request does: events no parked
    watcher's filter takes schedule none (a producer's puts under a watcher of seals)."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        hub = cluster.controller.watch
        await _put(client, "p", 1)
        passes = []
        flush = hub._flush

        def counted() -> None:
            passes.append(hub.log.last)
            flush()

        monkeypatch.setattr(hub, "_flush", counted)
        async with client.watch(kinds=["partition_sealed"]) as w:
            # 5 puts: rows_added, fields_produced, unwanted
            got = await _seal_after_puts(client, hub, w, 5, lambda: passes == [])
            assert [e.kind for e in got] == ["partition_sealed"]
            assert len(passes) == 1


async def _seal_after_puts(
    client: tq.AsyncClient, hub: Any, watch: Any, puts: int, check: Any = lambda: True
) -> list[Event]:
    """One-row puts into "p" while ``watch`` (of seals) waits, then ``check()`` must hold
    and "p" is sealed: what the watch got."""
    got: list[Event] = []
    async with anyio.create_task_group() as tg:

        async def take() -> None:
            got.extend(await _take(watch, 1))

        tg.start_soon(take)
        while not hub.parked:
            await anyio.wait_all_tasks_blocked()
        for _ in range(puts):
            await _put(client, "p", 1)
        assert check()
        await client.seal("p")
    return got


@pytest.mark.parametrize("bound", ["history", "max_lag"])
async def test_events_nobody_wants_never_make_a_filtered_watcher_resync(bound: str) -> None:
    """Unwanted events pass no parked position by (no pass for them), yet a filtered watcher
    never falls out of the ring or past its ``max_lag`` for events it did not want."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        hub = cluster.controller.watch
        await _put(client, "p", 1)
        if bound == "history":
            hub.log = EventLog(64)  # (no watcher yet: nobody counts in the old one)
        max_lag = 20 if bound == "max_lag" else None
        async with client.watch(kinds=["partition_sealed"], max_lag=max_lag) as w:
            got = await _seal_after_puts(client, hub, w, 100)  # 200 unwanted events: 3 rings
            assert [e.kind for e in got] == ["partition_sealed"]


def _hold_answers(hub: Any) -> None:
    """The pacer is spent for a minute: a pass due waits (consumption joins its events)."""
    hub.pacer = Pacer(share=0.001, burst=0.0)
    hub.pacer.charge(asyncio.get_running_loop().time(), 0.06)


def _release_answers(hub: Any) -> None:
    """The pacer has credit again and the pass it held back runs now."""
    hub.pacer = Pacer()
    handle = hub._flush_handle
    assert handle is not None  # (a pass was due)
    handle.cancel()
    hub._flush()


def _consumed(events: list[Event]) -> list[tuple[int, str, list[int]]]:
    return [(e.seq, e.task, e.rows) for e in events]  # type: ignore[attr-defined]


async def test_a_readers_batches_between_two_answers_make_one_rows_consumed() -> None:
    """Consumption by the task of the event before it, of its partition, joins that event
    while no watcher can know it (a pass is due, or it is the first event after an answer):
    one ``rows_consumed`` per answer, not per batch; anything in between (another task's
    batch) ends the joining, and an event answered never grows."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        hub = cluster.controller.watch
        await _put(client, "p", 16)
        async with client.watch(kinds=["rows_consumed"]) as w:
            start = w.seq
            assert start is not None
            _hold_answers(hub)
            async with anyio.create_task_group() as tg:
                got: list[Event] = []

                async def take(n: int) -> None:
                    got.extend(await _take(w, n))

                tg.start_soon(take, 3)
                while not hub.parked:
                    await anyio.wait_all_tasks_blocked()
                for _ in range(3):
                    await client.get_meta(["x"], 2, "p", "t")
                await client.get_meta(["x"], 1, "p", "u")  # another task: its own event
                for _ in range(2):
                    await client.get_meta(["x"], 1, "p", "t")  # after it: a new one
                _release_answers(hub)
            assert _consumed(got) == [
                (start + 1, "t", [0, 1, 2, 3, 4, 5]),
                (start + 2, "u", [0]),
                (start + 3, "t", [6, 7]),
            ]
            # answered: the next batch of "t" is an event of its own, which the batches
            # after it join while the watcher asks again
            await client.get_meta(["x"], 1, "p", "t")
            await client.get_meta(["x"], 1, "p", "t")
            assert _consumed(await _take(w, 1)) == [(start + 4, "t", [8, 9])]
            # only that one: with no pass due, the batches after another event are their own
            # (a watcher that never asks again leaves no ring of big events)
            for task in ["t", "u", "t", "t"]:
                await client.get_meta(["x"], 1, "p", task)
            assert _consumed(await _take(w, 4)) == [
                (start + 5, "t", [10]),
                (start + 6, "u", [1]),
                (start + 7, "t", [11]),
                (start + 8, "t", [12]),
            ]
            # and an event answered never grows, even with a pass due
            _hold_answers(hub)
            async with anyio.create_task_group() as tg:
                got.clear()
                tg.start_soon(take, 1)
                while not hub.parked:
                    await anyio.wait_all_tasks_blocked()
                await client.get_meta(["x"], 1, "p", "t")
                await client.get_meta(["x"], 1, "p", "t")
                _release_answers(hub)
            assert _consumed(got) == [(start + 9, "t", [13, 14])]
            assert hub.log.last == start + 9


async def test_consumption_never_joins_an_event_a_watcher_stands_at() -> None:
    """A watch that subscribes, or resumes (``since=``), at an event not yet answered to
    anyone stands after it: the rows consumed next are a new event, which it gets whole."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        hub = cluster.controller.watch
        await _put(client, "p", 12)
        async with client.watch(kinds=["rows_consumed"]) as first:
            _hold_answers(hub)
            async with anyio.create_task_group() as tg:
                got: dict[str, list[Event]] = {}

                async def take(name: str, w: Any, n: int) -> None:
                    got[name] = await _take(w, n)

                tg.start_soon(take, "first", first, 3)
                while not hub.parked:
                    await anyio.wait_all_tasks_blocked()
                await client.get_meta(["x"], 2, "p", "t")  # a pass is due: joinable
                async with client.watch(kinds=["rows_consumed"]) as late:  # stands after it
                    await client.get_meta(["x"], 2, "p", "t")
                    resumed = client.watch(
                        since=hub.log.last, incarnation=hub.log.incarnation, kinds=["rows_consumed"]
                    )
                    tg.start_soon(take, "resumed", resumed, 1)
                    while len(hub.parked) < 2:
                        await anyio.wait_all_tasks_blocked()
                    await client.get_meta(["x"], 2, "p", "t")
                    tg.start_soon(take, "late", late, 2)
                    while len(hub.parked) < 3:
                        await anyio.wait_all_tasks_blocked()
                    _release_answers(hub)
        rows = {name: [e.rows for e in evs] for name, evs in got.items()}  # type: ignore[attr-defined]
        assert rows == {
            "first": [[0, 1], [2, 3], [4, 5]],
            "late": [[2, 3], [4, 5]],
            "resumed": [[4, 5]],
        }
        assert [e.seq for e in got["first"]] == [e.seq for e in got["first"]][:1] + [
            e.seq for e in got["late"]
        ]


async def test_the_parked_filters_are_counted_as_requests_park_and_go() -> None:
    """The hub keeps the parked requests' filters as counts (checking an event against them
    must not walk thousands of parked requests): parking, a retry replacing a parked
    request, an answer, a cancel and the end of a poll keep them equal to the parked ones."""
    from tq_async.events import PartitionSealed

    def counted(hub: Any) -> tuple[int, dict[Any, int]]:
        everything, filters = 0, {}
        for p in hub.parked.values():
            b = p.body
            if b.kinds is None and b.partition_id is None:
                everything += 1
            else:
                key = (None if b.kinds is None else frozenset(b.kinds), b.partition_id)
                filters[key] = filters.get(key, 0) + 1
        return everything, filters

    def check(hub: Any) -> None:
        assert (hub._interest.everything, dict(hub._interest.filters)) == counted(hub)

    async with tq.local_cluster(num_storage_units=1) as cluster:
        hub = cluster.controller.watch
        hub.price_requests = False
        last, inc = hub.log.last, hub.log.incarnation
        bodies = [
            WatchNext(last, inc),
            WatchNext(last, inc, kinds=["partition_sealed"]),
            WatchNext(last, inc, kinds=["rows_added"], max_lag=40),
            WatchNext(last, inc, partition_id="q"),
        ]
        for rid, body in enumerate(bodies):
            hub.on_watch_next(Incoming(b"peer", rid, [], 0.0), body)
            check(hub)
        assert hub._interest.lag(1000) == 20
        hub.on_watch_next(Incoming(b"peer", 1, [], 0.0), WatchNext(last, inc))  # a retry
        check(hub)
        assert hub.cancel((b"peer", 2))
        check(hub)
        assert hub._interest.lag(1000) == 1000
        hub.log.append([PartitionSealed(partition_id="p")])
        hub._flush()  # answers the unfiltered ones; "q" is not "p": it stays
        check(hub)
        assert list(hub.parked) == [(b"peer", 3)]
        hub.parked[(b"peer", 3)].deadline = 0.0  # its poll is over: the sweep answers it
        hub._end_polls()
        assert not hub.parked
        check(hub)
        assert hub._interest.everything == 0
        assert not hub._interest.filters


def test_a_reader_call_in_sample_reads_is_timed_with_the_requests_it_read() -> None:
    """`ReaderCost`: one reader call in `SAMPLE_READS` is timed, and counts the requests read
    in it (each request counts itself: ``handled``); the other calls only run."""
    reads = ReaderCost()

    def reader(n: int) -> Callable[[], None]:
        def read() -> None:
            for _ in range(n):
                reads.handled += 1

        return read

    for i in range(1, SAMPLE_READS):
        reads.read(reader(i))
    assert (reads.messages, reads.seconds) == (0, 0.0)
    reads.read(reader(5))  # the SAMPLE_READS-th
    assert reads.messages == 5
    assert reads.seconds > 0
    assert reads.handled == sum(range(1, SAMPLE_READS)) + 5


async def test_requests_over_a_socket_are_counted_by_the_services_readers() -> None:
    """A client's requests over TCP (and the same-host Unix socket) are read by the readers
    `READS` samples: the pacer's price of a request comes from them."""
    before = READS.handled
    with tq.background_cluster(num_storage_units=1) as cluster:
        async with tq.AsyncClient.connect(cluster.address) as client:
            await client.put({"x": torch.arange(4)}, "p")
            for _ in range(2 * SAMPLE_READS):
                await client.get_meta(["x"], 1, "p", "t", mode="peek")
    # (a background cluster serves in its own thread, in this process: same counters)
    assert READS.handled - before >= 2 * SAMPLE_READS
    assert READS.messages > 0


def test_a_request_is_priced_beyond_its_handler() -> None:
    """`RequestCost`: the sampled reader calls' CPU per request they read, less what the
    sampled handlers took, over windows long enough in requests and in time. The loop's other
    work (a unit's replies, timers, the hub's passes) is not in the reads: not in the price."""
    stats, reads = RequestStats(), ReaderCost()
    cost = RequestCost()
    assert cost.update(0.0, reads, stats) == 0.0  # the first call only starts a window
    reads.messages, reads.seconds = 10, 0.001
    stats.sampled, stats.handler_seconds = 3, 0.000_03
    assert cost.update(1.0, reads, stats) == 0.0  # too few requests for a window
    reads.messages, reads.seconds = 100, 0.01
    stats.sampled, stats.handler_seconds = 31, 0.000_31
    assert cost.update(0.01, reads, stats) == 0.0  # too short a window
    # 100 requests read in 0.01 s of CPU, 100 us each, of which a handler took 10 us
    assert cost.update(1.0, reads, stats) == pytest.approx(90e-6)
    reads.messages, reads.seconds = 200, 0.02
    stats.sampled, stats.handler_seconds = 62, 0.062
    assert cost.update(2.0, reads, stats) == 0.0  # handlers heavier than the average: no less


class _Charges(Pacer):
    """A pacer that records what it is charged."""

    def __init__(self) -> None:
        super().__init__()
        self.charged: list[float] = []

    def charge(self, now: float, seconds: float) -> None:
        self.charged.append(seconds)
        super().charge(now, seconds)


async def test_a_request_shared_by_a_clients_watchers_is_charged_as_theirs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pacer paces watchers: one request asking for eight is charged as eight (else a
    shared round would be answered eight times as often, each waking all eight)."""
    ticks = iter(range(1000))

    class _Clock:
        @staticmethod
        def thread_time() -> float:
            return next(ticks) * 1e-5  # every handler takes 10 us

    async with tq.local_cluster(num_storage_units=1) as cluster:
        hub = cluster.controller.watch
        hub.price_requests = False
        hub.pacer = pacer = _Charges()
        monkeypatch.setattr(_watch, "time", _Clock)
        since = hub.log.last
        for rid, watchers in enumerate((1, 8)):
            body = WatchNext(since, hub.log.incarnation, watchers=watchers)
            hub.on_watch_next(Incoming(b"peer", rid, [], 0.0), body)
            assert hub.cancel((b"peer", rid))
        assert pacer.charged == [pytest.approx(1e-5), pytest.approx(8e-5)]


async def test_an_answer_to_a_shared_request_is_charged_as_its_watchers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its answer wakes every watcher of the request, as its asking stood for them all: a
    shared round is charged as that many lone watchers' rounds, so the watchers of one client
    are answered no more often than one of them would be."""
    ticks = iter(range(1000))

    class _Clock:
        @staticmethod
        def thread_time() -> float:
            return next(ticks) * 1e-5  # every handler and every pass takes 10 us

    async with tq.local_cluster(num_storage_units=1) as cluster:
        hub = cluster.controller.watch
        hub.price_requests = False
        monkeypatch.setattr(_watch, "time", _Clock)
        for rid, watchers in enumerate((1, 8)):
            hub.pacer = pacer = _Charges()
            body = WatchNext(hub.log.last, hub.log.incarnation, watchers=watchers)
            hub.on_watch_next(Incoming(b"peer", rid, [], 0.0), body)
            hub.log.append([PartitionSealed(partition_id=f"p{rid}")])
            hub._flush()
            assert not hub.parked  # answered
            assert pacer.charged == [pytest.approx(watchers * 1e-5)] * 2


async def test_watchers_of_one_client_ask_for_all_of_them() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        hub = cluster.controller.watch
        async with contextlib.AsyncExitStack() as stack:
            watches = [await stack.enter_async_context(client.watch()) for _ in range(4)]
            async with anyio.create_task_group() as tg:
                for w in watches:
                    tg.start_soon(_take, w, 1)
                while not hub.parked:
                    await anyio.wait_all_tasks_blocked()
                assert [p.body.watchers for p in hub.parked.values()] == [4]
                await _put(client, "p", 1)
        # a lone watcher asks for itself
        async with client.watch() as alone, anyio.create_task_group() as tg:
            tg.start_soon(_take, alone, 1)
            while not hub.parked:
                await anyio.wait_all_tasks_blocked()
            assert [p.body.watchers for p in hub.parked.values()] == [1]
            await _put(client, "p", 1)


async def test_the_services_count_requests_and_time_a_sample_of_handlers() -> None:
    before = REQUESTS.requests, REQUESTS.sampled
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        for _ in range(SAMPLE_EVERY * 2):
            await client.list_partitions()
    assert REQUESTS.requests - before[0] >= SAMPLE_EVERY * 2
    assert REQUESTS.sampled - before[1] >= 2
    assert REQUESTS.handler_seconds > 0
