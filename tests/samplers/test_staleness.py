"""Staleness control: versions, admission, StalenessSampler, recycling."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tq_async as tq
from _requests import cancelled_at
from tq_async._wire._protocol import GetMeta, PutCommit, PutInline, TakeRecycled


def test_staleness_sampler_as_a_pure_function() -> None:
    versions = {0: 0, 1: 1, 2: 2, 3: -1, 4: 3}
    for policy in ("drop", "recycle"):
        sink = tq.StaleRows()
        s = tq.StalenessSampler(max_staleness=1, on_stale=policy)
        got = s.sample(list(versions), 3, policy_version=3, versions=versions, stale=sink)
        assert got == ([2, 3, 4], [2, 3, 4])  # rows 0 (v0) and 1 (v1) lag 3 by more than 1
        assert (sink.dropped if policy == "drop" else sink.recycled) == [0, 1]
    sink = tq.StaleRows()
    kept = tq.StalenessSampler(max_staleness=1, on_stale="keep")
    assert kept.sample([0, 1], 2, policy_version=3, versions=versions, stale=sink) == (
        [0, 1],
        [0, 1],
    )
    assert sink.kept == 2
    # no learner version yet, or no context at all: nothing is stale
    assert tq.StalenessSampler(max_staleness=0).sample([0, 1], 2) == ([0, 1], [0, 1])
    with pytest.raises(ValueError, match="on_stale"):
        tq.StalenessSampler(on_stale="ignore")
    with pytest.raises(ValueError, match="max_staleness"):
        tq.StalenessSampler(max_staleness=-1)


async def test_versions_are_kept_per_field_segment() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        meta = await client.put({"prompt": torch.zeros(2)}, "p", policy_version=3)
        await client.put({"tail": torch.zeros(2)}, meta=meta, policy_version=[5, 2])
        got = await client.get_meta(["prompt", "tail"], 2, "p", "t")
        assert got.policy_versions == {"prompt": [3, 3], "tail": [5, 2]}
        assert got.row_policy_versions() == [3, 2]  # a row is as old as its oldest segment
        with pytest.raises(tq.InvalidRequestError, match="policy_version"):
            await client.put({"prompt": torch.zeros(2)}, "p", policy_version=[1])


async def test_acquire_waits_for_the_learner_and_wakes_on_set_policy_version() -> None:
    admission = tq.AdmissionConfig(max_staleness=1)
    async with (
        tq.local_cluster(num_storage_units=1, admission=admission) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.acquire_rollout(1)  # learner at 0 (none announced): lag 1 is fine
        admitted: list[int] = []

        async def producer() -> None:
            await client.acquire_rollout(3)
            admitted.append(3)

        async with anyio.create_task_group() as tg:
            tg.start_soon(producer)
            with anyio.fail_after(5):
                while cluster.controller.waiting < 1:
                    await anyio.lowlevel.checkpoint()
            await client.set_policy_version(1)  # lag 2: still too far
            assert admitted == []
            await client.set_policy_version(2)
        assert admitted == [3]
        with pytest.raises(tq.TQTimeoutError, match="nothing was reserved"):
            await client.acquire_rollout(9, timeout=0.05)


async def test_capacity_frees_when_the_learner_consumes() -> None:
    admission = tq.AdmissionConfig(capacity=4, learner_task="learn")
    async with (
        tq.local_cluster(num_storage_units=1, admission=admission) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.acquire_rollout(0, 4)
        await client.put({"x": torch.zeros(4)}, "p", policy_version=0)
        with pytest.raises(tq.TQTimeoutError):
            await client.acquire_rollout(0, 1, timeout=0.05)
        await client.get_meta(["x"], 2, "p", "learn")  # frees 2 slots
        await client.acquire_rollout(0, 2, timeout=5)
        assert (await client.staleness_status())["outstanding"] == 4
        await client.release_rollout(2)  # e.g. a generation failed
        await client.clear_partition("p")  # unconsumed rows give their slots back
        assert (await client.staleness_status())["outstanding"] == 0
        with pytest.raises(tq.InvalidRequestError, match="never fit"):
            await client.acquire_rollout(0, 5)


async def test_recycled_prompts_are_handed_out_exactly_once() -> None:
    sampler = tq.StalenessSampler(max_staleness=0, on_stale="recycle")
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"prompt": torch.arange(3)}, "p", policy_version=0)
        await client.set_policy_version(1)  # every row is now one version too old
        await client.put({"prompt": torch.arange(3, 5)}, "p", policy_version=1)
        fresh = await client.get_meta(["prompt"], 2, "p", "learn")
        assert fresh.global_indexes == [3, 4]
        taken = await client.take_recycled()
        assert [m.global_indexes for m in taken] == [[0, 1, 2]]
        assert await client.take_recycled() == []  # exactly once
        prompts = await client.get_data(taken[0].select_fields(["prompt"]))
        await client.put({"prompt": prompts["prompt"]}, "p", policy_version=1)  # regenerated
        again = await client.get_meta(["prompt"], 3, "p", "learn")
        assert again.global_indexes == [5, 6, 7]
        status = await client.staleness_status()
        assert status["recycled"] == 3
        assert status["recycled_pending"] == 0


async def test_recycled_rows_of_a_partition_made_again_are_not_handed_out() -> None:
    """Rows recycled, then their partition cleared and made again under its name: the
    queued rows are gone with it (before: ``take_recycled`` failed with an IndexError, or
    handed out rows of the new partition that were never stale)."""
    sampler = tq.StalenessSampler(max_staleness=0, on_stale="recycle")
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"prompt": torch.arange(3)}, "p", policy_version=0)
        await client.set_policy_version(1)
        await client.put({"prompt": torch.arange(3, 5)}, "p", policy_version=1)
        await client.get_meta(["prompt"], 2, "p", "learn")
        assert (await client.staleness_status())["recycled_pending"] == 3
        await client.clear_partition("p")
        await client.put({"prompt": torch.arange(1)}, "p", policy_version=1)  # fewer rows
        await client.put({"prompt": torch.arange(4)}, "p", policy_version=1)  # and more
        assert await client.take_recycled() == []
        assert (await client.staleness_status())["recycled_pending"] == 0


async def test_waiting_consumer_drops_rows_that_go_stale() -> None:
    """A learner update must not leave stale rows blocking capacity forever."""
    sampler = tq.StalenessSampler(max_staleness=0, on_stale="drop")
    admission = tq.AdmissionConfig(capacity=2, learner_task="learn")
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler, admission=admission) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.acquire_rollout(0, 2)
        await client.put({"x": torch.zeros(2)}, "p", policy_version=0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.get_meta, ["x"], 3, "p", "learn")  # waits: only 2 rows
            with anyio.fail_after(5):
                while cluster.controller.waiting < 1:
                    await anyio.lowlevel.checkpoint()
            await client.set_policy_version(1)  # both rows stale: the waiter drops them
            await client.acquire_rollout(1, 2, timeout=5)  # their slots came back
            await client.put({"x": torch.zeros(3)}, "p", policy_version=1)
        assert (await client.staleness_status())["dropped"] == 2


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    k=st.integers(0, 2),
    capacity=st.integers(2, 8),
    steps=st.lists(
        st.tuples(st.sampled_from(["produce", "learn"]), st.integers(1, 3), st.integers(0, 3)),
        min_size=1,
        max_size=25,
    ),
)
def test_property_no_row_consumed_beyond_the_bound(
    k: int, capacity: int, steps: list[tuple[str, int, int]]
) -> None:
    """Random producer/learner interleavings against a model of admission."""

    async def run() -> None:
        sampler = tq.StalenessSampler(max_staleness=k, on_stale="drop")
        admission = tq.AdmissionConfig(max_staleness=k, capacity=capacity, learner_task="learn")
        async with (
            tq.local_cluster(num_storage_units=1, sampler=sampler, admission=admission) as c,
            tq.AsyncClient.connect(c.address) as client,
        ):
            learner = 0
            outstanding = 0
            await client.set_policy_version(0)
            for action, n, lag in steps:
                if action == "produce":
                    version = max(0, learner + k + 1 - lag)  # sometimes ahead of the bound
                    should_block = version - learner > k or outstanding + n > capacity
                    if n > capacity:
                        continue
                    if should_block:
                        with pytest.raises(tq.TQTimeoutError):
                            await client.acquire_rollout(version, n, timeout=0.02)
                        continue
                    await client.acquire_rollout(version, n, timeout=5)
                    outstanding += n
                    await client.put({"x": torch.zeros(n)}, "p", policy_version=version)
                else:
                    try:
                        meta = await client.get_meta(["x"], n, "p", "learn", timeout=0.02)
                    except tq.TQTimeoutError:
                        meta = None
                    if meta is not None:
                        for v in meta.row_policy_versions():
                            assert learner - v <= k  # never beyond the bound
                    learner += 1
                    await client.set_policy_version(learner)
                    # the model: what the controller says is outstanding is what is unconsumed
                    outstanding = (await client.staleness_status())["outstanding"]
                    assert 0 <= outstanding <= capacity

    anyio.run(run)


async def test_keep_counts_rows_delivered_once_in_status_and_metrics() -> None:
    """Issue 14 defect 12: ``kept`` counted stale rows seen in the ready set (12 for 8)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    sampler = tq.StalenessSampler(max_staleness=1, on_stale="keep")
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler, metrics_registry=registry) as cl,
        tq.AsyncClient.connect(cl.address) as client,
    ):
        await client.put({"x": torch.arange(12)}, "p", policy_version=0)
        await client.set_policy_version(5)
        await client.get_meta(["x"], 4, "p", "peeker", mode="peek")  # sees, delivers nothing new
        got = await client.get_meta(["x"], 8, "p", "t")
        assert len(got) == 8
        # too few rows for a second batch: the sampler looks (and sees 4 stale rows) again
        with pytest.raises(tq.TQTimeoutError):
            await client.get_meta(["x"], 8, "p", "t", timeout=0.2)
        status = await client.staleness_status()
        assert status["kept"] == 8
        await client.seal("p")
        tail = await client.get_meta(["x"], 8, "p", "t")
        assert len(tail) == 4
        assert (await client.staleness_status())["kept"] == 12
    kept = registry.get_sample_value("tq_stale_rows_total", {"policy": "kept"})
    assert kept == 12


async def test_drop_counts_each_row_once_in_status_and_metrics() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()

    class Repeats(tq.StalenessSampler):
        """Reports every stale row twice (a sampler may): each is still one event."""

        def sample(self, ready: Any, batch_size: int, *args: Any, **kwargs: Any) -> Any:
            sink = kwargs.get("stale")
            out = super().sample(ready, batch_size, *args, **kwargs)
            if sink is not None:
                sink.drop(list(sink.dropped))
            return out

    async with (
        tq.local_cluster(
            num_storage_units=1, sampler=Repeats(max_staleness=0), metrics_registry=registry
        ) as cl,
        tq.AsyncClient.connect(cl.address) as client,
    ):
        await client.put({"x": torch.arange(3)}, "p", policy_version=0)
        await client.put({"x": torch.arange(2)}, "p", policy_version=1)
        await client.set_policy_version(1)
        got = await client.get_meta(["x"], 2, "p", "t")
        assert len(got) == 2
        assert (await client.staleness_status())["dropped"] == 3
    assert registry.get_sample_value("tq_stale_rows_total", {"policy": "dropped"}) == 3


async def test_rows_given_back_to_the_learner_take_their_slots_again() -> None:
    """Rows the learner fetched, then gave back (`release`, a fetch cancelled after its reply
    went out), are admitted and not consumed again: their slots count until the learner
    consumes them for good. Before, the slots freed at the fetch stayed free, the capacity
    admitted rows beyond it, and the second consumption freed the same rows' slots again."""
    admission = tq.AdmissionConfig(capacity=4, learner_task="learn")
    async with (
        tq.local_cluster(num_storage_units=1, admission=admission) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.acquire_rollout(0, 4)
        await client.put({"x": torch.zeros(4)}, "p", policy_version=0)
        meta = await client.get_meta(["x"], 4, "p", "learn")
        assert (await client.staleness_status())["outstanding"] == 0
        await client.release(meta)  # back to the learner, unconsumed
        assert (await client.staleness_status())["outstanding"] == 4
        with pytest.raises(tq.TQTimeoutError):
            await client.acquire_rollout(0, 1, timeout=0.05)
        with cancelled_at(GetMeta) as (scope, sent), scope:
            await client.get_meta(["x"], 4, "p", "learn")
        assert scope.cancelled_caught
        assert sent
        assert (await client.staleness_status())["outstanding"] == 4
        assert (await client.partition_info("p"))["consumed"]["learn"] == 0
        await client.get_meta(["x"], 2, "p", "learn")
        await client.acquire_rollout(0, 2, timeout=5)  # the 2 slots consumed, no more
        assert (await client.staleness_status())["outstanding"] == 4
        with pytest.raises(tq.TQTimeoutError):
            await client.acquire_rollout(0, 1, timeout=0.05)
        assert cluster.controller.waiting == 0


async def test_recycled_rows_outlive_auto_clear_until_taken_and_acknowledged() -> None:
    """With the learner auto-clearing, rows recycled as stale are consumed undelivered: they
    must stay until a producer took them (`take_recycled`), read their prompts and
    acknowledged the BatchMeta. Before, auto-clear freed them at once: `take_recycled` handed
    out nothing, the prompts were lost, while the status counted them recycled and pending."""
    sampler = tq.StalenessSampler(max_staleness=0, on_stale="recycle")
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.register_tasks(["learn"])
        await client.put({"prompt": torch.arange(3)}, "p", policy_version=0)
        await client.set_policy_version(1)  # every row is now one version too old
        await client.put({"prompt": torch.arange(3, 5)}, "p", policy_version=1)
        fresh = await client.get_meta(["prompt"], 2, "p", "learn")
        assert fresh.global_indexes == [3, 4]
        assert (await client.staleness_status())["recycled_pending"] == 3
        taken = await client.take_recycled()
        assert [m.global_indexes for m in taken] == [[0, 1, 2]]
        assert taken[0].lease_id  # held for its taker
        info = await client.partition_info("p")
        assert info["rows"] == 5
        assert info["leased"] == {"learn": 2, "take_recycled": 3}
        prompts = await client.get_data(taken[0].select_fields(["prompt"]))
        assert prompts["prompt"].tolist() == [0, 1, 2]
        assert await client.take_recycled() == []  # exactly once
        await client.ack(taken)  # read: auto-clear frees them now
        assert (await client.partition_info("p"))["rows"] == 2
        await client.ack(fresh)
        assert (await client.partition_info("p"))["rows"] == 0
        assert cluster.controller.waiting == 0


async def test_recycled_rows_without_auto_clear_carry_no_hold() -> None:
    """Without auto-clear nothing frees recycled rows but a clear: `take_recycled` gives
    them no hold (``lease_id`` 0, as a fetch's), and acknowledging is harmless."""
    sampler = tq.StalenessSampler(max_staleness=0, on_stale="recycle")
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"prompt": torch.arange(2)}, "p", policy_version=0)
        await client.set_policy_version(1)
        await client.get_meta(["prompt"], 1, "p", "learn", stop_when_consumed=True)
        taken = await client.take_recycled()
        assert [(m.global_indexes, m.lease_id) for m in taken] == [([0, 1], 0)]
        await client.ack(taken)
        info = await client.partition_info("p")
        assert (info["rows"], info["leased"]) == (2, {})
        assert cluster.controller.waiting == 0


async def test_a_take_recycled_cancelled_under_auto_clear_keeps_the_rows_held() -> None:
    """A `take_recycled` cancelled after it went out, with the learner auto-clearing: the
    rows go back to the queue, still held there (its caller's hold is dropped, not
    acknowledged: auto-clear must not free prompts nobody read), and the next taker gets
    them."""
    sampler = tq.StalenessSampler(max_staleness=0, on_stale="recycle")
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.register_tasks(["learn"])
        await client.put({"prompt": torch.arange(3)}, "p", policy_version=0)
        await client.set_policy_version(1)
        await client.get_meta(["prompt"], 1, "p", "learn", stop_when_consumed=True)
        with cancelled_at(TakeRecycled) as (scope, sent), scope:
            await client.take_recycled()
        assert scope.cancelled_caught
        assert sent
        with anyio.fail_after(10):  # the rows come back once the abandoned reply arrived
            while not (taken := await client.take_recycled()):
                pass
        assert [m.global_indexes for m in taken] == [[0, 1, 2]]
        info = await client.partition_info("p")
        assert (info["rows"], info["leased"]) == (3, {"take_recycled": 3})
        assert (await client.get_data(taken[0]))["prompt"].tolist() == [0, 1, 2]
        await client.ack(taken)
        assert (await client.partition_info("p"))["rows"] == 0
        assert cluster.controller.waiting == 0


@pytest.mark.parametrize(
    ("inline", "last"),
    [(65536, PutInline), (0, PutCommit)],
    ids=["one-message put", "three-step put"],
)
async def test_a_put_cancelled_after_it_landed_leaves_its_admission(
    inline: int, last: type
) -> None:
    """A producer's put of an admitted rollout is cancelled right after its last request went
    out: the put lands and the client undoes it (nothing was written). Its admission must stay
    as it was, as for a put cancelled earlier: the producer puts again or gives the slots back
    with `release_rollout`. Before, the undo's clear freed the slots (the rows were
    unconsumed), so the producer's `release_rollout` freed them twice and the capacity let
    more rows in than it holds."""
    admission = tq.AdmissionConfig(capacity=2, learner_task="learn")
    async with (
        tq.local_cluster(num_storage_units=1, admission=admission) as cluster,
        tq.AsyncClient.connect(cluster.address, inline_put_bytes=inline) as client,
    ):
        await client.acquire_rollout(0, 2)
        with cancelled_at(last) as (scope, sent), scope:
            await client.put({"x": torch.zeros(2)}, "p", policy_version=0)
        assert scope.cancelled_caught
        assert sent
        with anyio.fail_after(10):  # the undo is one-way: each round trip comes after it
            while (await client.partition_info("p"))["rows"]:
                pass
        assert (await client.staleness_status())["outstanding"] == 2
        with pytest.raises(tq.TQTimeoutError):
            await client.acquire_rollout(0, 1, timeout=0.05)
        await client.put({"x": torch.zeros(2)}, "p", policy_version=0)  # put again
        await client.get_meta(["x"], 2, "p", "learn")
        assert (await client.staleness_status())["outstanding"] == 0
        assert cluster.controller.waiting == 0


async def test_rows_the_learner_consumes_again_after_a_reset_free_their_slots_once() -> None:
    """`reset_consumption` of the learner makes its rows unconsumed again: they hold their
    admission slots until consumed again, so consuming them twice frees their slots once.
    Before, the replay freed the slots of rollouts admitted since, and the capacity let
    more rows in than it holds."""
    admission = tq.AdmissionConfig(capacity=4, learner_task="learn")
    async with (
        tq.local_cluster(num_storage_units=1, admission=admission) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.acquire_rollout(0, 4)
        await client.put({"x": torch.zeros(4)}, "p", policy_version=0)
        await client.get_meta(["x"], 4, "p", "learn")
        await client.reset_consumption("p", "learn")  # replay "p"
        assert (await client.staleness_status())["outstanding"] == 4
        await client.get_meta(["x"], 4, "p", "learn")
        assert (await client.staleness_status())["outstanding"] == 0
        await client.acquire_rollout(0, 4, timeout=5)
        await client.reset_consumption("p")  # every task: the learner's too
        assert (await client.staleness_status())["outstanding"] == 8
        await client.clear_partition("p")  # unconsumed again: their slots go back once
        assert (await client.staleness_status())["outstanding"] == 4
        assert cluster.controller.waiting == 0


async def test_a_take_recycled_cancelled_after_it_went_out_loses_no_prompt() -> None:
    """A producer's `take_recycled` is cancelled right after it went out: the controller
    hands the rows out to a caller that is gone. They must go back to the queue for the next
    `take_recycled` (before: they were handed out to nobody, and their prompts never
    regenerated)."""
    sampler = tq.StalenessSampler(max_staleness=0, on_stale="recycle")
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"prompt": torch.arange(3)}, "p", policy_version=0)
        await client.set_policy_version(1)  # every row is now one version too old
        await client.put({"prompt": torch.arange(3, 5)}, "p", policy_version=1)
        await client.get_meta(["prompt"], 2, "p", "learn")
        with cancelled_at(TakeRecycled) as (scope, sent), scope:
            await client.take_recycled()
        assert scope.cancelled_caught
        assert sent
        with anyio.fail_after(10):  # the rows come back once the abandoned reply arrived
            while not (taken := await client.take_recycled()):
                pass
        assert [m.global_indexes for m in taken] == [[0, 1, 2]]
        assert await client.take_recycled() == []  # exactly once
        status = await client.staleness_status()
        assert (status["recycled"], status["recycled_pending"]) == (3, 0)
        assert cluster.controller.waiting == 0


async def test_rows_auto_cleared_before_the_learner_consumed_them_free_their_slots() -> None:
    """Auto-clear runs for other tasks than the learner (here "reward" only): rows it frees
    unconsumed by the learner never reach it, and give their admission slots back as rows
    cleared by hand do. Before, the slots stayed taken for good and producers waited
    forever."""
    admission = tq.AdmissionConfig(capacity=2, learner_task="learn")
    async with (
        tq.local_cluster(num_storage_units=1, admission=admission) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.register_tasks(["reward"])
        await client.acquire_rollout(0, 2)
        await client.put({"x": torch.zeros(2)}, "p", policy_version=0)
        await client.ack(await client.get_meta(["x"], 2, "p", "reward"))
        assert (await client.partition_info("p"))["rows"] == 0  # auto-cleared
        assert (await client.staleness_status())["outstanding"] == 0
        await client.acquire_rollout(0, 2, timeout=5)
        assert cluster.controller.waiting == 0


async def test_recycled_pending_counts_only_rows_take_recycled_would_hand_out() -> None:
    """``recycled_pending`` is what the next `take_recycled` can hand out: a recycled row
    cleared (or its partition) before it was taken is no longer pending. Before, the status
    counted it until a `take_recycled` came by and found nothing."""
    sampler = tq.StalenessSampler(max_staleness=0, on_stale="recycle")
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        first = await client.put({"prompt": torch.arange(3)}, "p", policy_version=0)
        await client.put({"prompt": torch.arange(2)}, "q", policy_version=0)
        await client.set_policy_version(1)  # every row is now one version too old
        for pid in ("p", "q"):
            await client.get_meta(["prompt"], 1, pid, "learn", stop_when_consumed=True)
        assert (await client.staleness_status())["recycled_pending"] == 5
        await client.clear_samples(first.select_rows([0]))
        await client.clear_partition("q")
        assert (await client.staleness_status())["recycled_pending"] == 2
        taken = await client.take_recycled()
        assert [m.global_indexes for m in taken] == [[1, 2]]
        assert (await client.staleness_status())["recycled_pending"] == 0


async def test_an_admission_that_times_out_says_what_frees_slots() -> None:
    """A producer acquires slots and puts its rollout without ``policy_version``: the
    learner's consumption frees none (only admitted rollouts, rows that carry a version, do),
    so the next acquire waits for good. Its timeout must say how slots are freed, naming the
    learner task and ``policy_version=`` (before: only the counts, and the producer was left
    to guess)."""
    admission = tq.AdmissionConfig(capacity=2, learner_task="learn")
    async with (
        tq.local_cluster(num_storage_units=1, admission=admission) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.acquire_rollout(0, 2)
        await client.put({"x": torch.zeros(2)}, "p")  # no policy_version: not a rollout
        await client.get_meta(["x"], 2, "p", "learn")
        assert (await client.staleness_status())["outstanding"] == 2
        with pytest.raises(tq.TQTimeoutError, match=r"'learn'.*policy_version=.*release_rollout"):
            await client.acquire_rollout(0, 1, timeout=0.2)
        assert cluster.controller.waiting == 0


class _WrongOnce(tq.SequentialSampler):
    """Answers ``wrong`` the first time, then the first ready rows."""

    def __init__(self, wrong: tuple[list[int], list[int]]) -> None:
        super().__init__()
        self.wrong: tuple[list[int], list[int]] | None = wrong

    def sample(self, ready: Any, batch_size: int, *args: Any, **kwargs: Any) -> Any:
        if self.wrong is not None:
            wrong, self.wrong = self.wrong, None
            return wrong
        return super().sample(ready, batch_size, *args, **kwargs)


@pytest.mark.parametrize(
    ("wrong", "error"),
    [(([999], [999]), "row 999"), (([3, 3], [3, 3]), "same row twice")],
    ids=["missing_row", "consumed_twice"],
)
@pytest.mark.parametrize("on_stale", ["drop", "recycle"])
async def test_a_failed_answer_consumes_none_of_the_stale_rows_it_reported(
    on_stale: str, wrong: tuple[list[int], list[int]], error: str
) -> None:
    """A sampler that reported stale rows, then answered rows the controller refuses: the
    request fails and nothing happened -- no stale row consumed, counted or queued for
    regeneration. Before, the stale rows were consumed anyway (with none of what follows a
    consumption: not counted, not recycled, their admission slots kept). The next request
    drops (recycles) them once."""
    sampler = tq.StalenessSampler(_WrongOnce(wrong), max_staleness=0, on_stale=on_stale)
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(3)}, "p", policy_version=0)
        await client.set_policy_version(1)  # rows 0..2 are now one version too old
        await client.put({"x": torch.arange(2)}, "p", policy_version=1)
        with pytest.raises(tq.TQError, match=error):
            await client.get_meta(["x"], 2, "p", "t")
        assert not (await client.consumption_status("p", "t")).any()
        status = await client.staleness_status()
        assert (status["dropped"], status["recycled"], status["recycled_pending"]) == (0, 0, 0)
        got = await client.get_meta(["x"], 2, "p", "t", timeout=5)
        assert got.global_indexes == [3, 4]
        assert (await client.consumption_status("p", "t")).all()
        status = await client.staleness_status()
        assert status["dropped" if on_stale == "drop" else "recycled"] == 3
        assert status["recycled_pending"] == (3 if on_stale == "recycle" else 0)
