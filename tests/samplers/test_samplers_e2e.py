"""Samplers through the controller: DP ranks x replicas, out-of-order producers."""

from __future__ import annotations

import random
from typing import Any

import anyio
import pytest
import torch

import tq_async as tq
from _samplers import Later

N, DP, REPLICAS, PER_RANK, BATCHES = 4, 4, 2, 8, 4
GROUPS = DP * PER_RANK // N * BATCHES  # 32 prompt groups of N rows


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_seqlen_balanced_dp_groups_with_replicas(seed: int) -> None:
    rng = random.Random(seed)
    sampler = tq.SeqlenBalancedSampler(n_samples_per_prompt=N, dp_size=DP, n_replicas=REPLICAS)
    async with (
        tq.local_cluster(num_storage_units=2, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        got: dict[tuple[int, int, int], list[int]] = {}  # (rank, replica, batch) -> uids

        async def produce() -> None:
            order = list(range(GROUPS))
            rng.shuffle(order)  # groups arrive out of order
            for uid in order:
                lengths = [rng.randint(10, 500) for _ in range(N)]
                await client.put(
                    {"uid_col": torch.full((N,), uid), "len": torch.tensor(lengths)},
                    partition_id="p",
                    tags=[{"uid": uid, "total_lengths": n} for n in lengths],
                )
                if rng.random() < 0.5:
                    await anyio.lowlevel.checkpoint()

        async def rank(dp_rank: int, replica: int) -> None:
            for b in range(BATCHES):
                for _ in range(rng.randint(0, 3)):  # ranks run at different speeds
                    await anyio.lowlevel.checkpoint()
                td, meta = await client.get(
                    ["uid_col", "len"],
                    PER_RANK,
                    "p",
                    "update_actor",
                    {"dp_rank": dp_rank, "batch_index": b},
                    timeout=20,
                )
                got[(dp_rank, replica, b)] = td["uid_col"].tolist()
                assert [t["uid"] for t in meta.tags] == td["uid_col"].tolist()

        async with anyio.create_task_group() as tg:
            ranks = [(r, k) for r in range(DP) for k in range(REPLICAS)]
            rng.shuffle(ranks)
            for r, k in ranks:
                tg.start_soon(rank, r, k)
            tg.start_soon(produce)

        all_uids: list[int] = []
        for b in range(BATCHES):
            for r in range(DP):
                first, second = got[(r, 0, b)], got[(r, 1, b)]
                assert first == second  # identical within a DP group
                assert len(first) == PER_RANK
                # whole groups only
                assert all(first.count(u) == N for u in set(first))
                all_uids.extend(first)
        # every row delivered to exactly one DP group, nothing lost
        assert sorted(all_uids) == sorted(u for u in range(GROUPS) for _ in range(N))
        assert await client.check_consumption_status("p", "update_actor")
        await client.clear_partition("p")
        assert sampler.cache_size == 0


async def test_grpo_groups_never_span_prompts_through_the_controller() -> None:
    async with (
        tq.local_cluster(num_storage_units=1, sampler=tq.GRPOGroupNSampler(4)) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        # two puts of one prompt group each (no uid tags: groups come from the put)
        await client.put({"x": torch.arange(4)}, partition_id="p")
        await client.put({"x": torch.arange(4, 8)}, partition_id="p")
        first = await client.get_meta(["x"], 4, "p", "t")
        second = await client.get_meta(["x"], 4, "p", "t")
        assert first.global_indexes == [0, 1, 2, 3]
        assert second.global_indexes == [4, 5, 6, 7]


@pytest.mark.parametrize("tail", ["drop", "error"])
async def test_a_pooled_grpo_consumer_can_drop_or_refuse_incomplete_groups(tail: str) -> None:
    """The GRPO sampler's partial-group warning said "pass sampling_config={'tail': 'drop'}",
    which the client refuses without ``dp_size`` (a pooled consumer has none): a learner
    that needs whole groups in every batch had no way to say so. The sampler takes its own
    ``tail`` (as `SeqlenBalancedSampler` does), which a pooled request follows."""
    sampler = tq.GRPOGroupNSampler(4, tail=tail)
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        tags = [{"uid": 0}] * 4 + [{"uid": 1}] * 2  # uid 1 never completes
        await client.put({"x": torch.arange(6)}, "p", tags=tags)
        await client.seal("p")
        assert (await client.get_meta(["x"], 4, "p", "t")).global_indexes == [0, 1, 2, 3]
        if tail == "drop":
            assert (await client.get_meta(["x"], 4, "p", "t", timeout=5)).end_of_stream
            assert (await client.partition_info("p"))["dropped"] == {"t": 2}
        else:
            with pytest.raises(tq.InvalidRequestError, match="groups of fewer than"):
                await client.get_meta(["x"], 4, "p", "t", timeout=5)
            assert (await client.partition_info("p"))["consumed"] == {"t": 4}
    with pytest.raises(tq.InvalidRequestError, match="tail must be"):
        tq.GRPOGroupNSampler(4, tail="pad")


async def test_rank_aware_sampler_through_controller_cache_stays_bounded() -> None:
    sampler = tq.RankAwareSampler(tq.GRPOGroupNSampler(2), n_replicas=2)
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(
            {"x": torch.arange(8)}, partition_id="p", tags=[{"uid": i // 2} for i in range(8)]
        )
        for b in range(2):
            a = await client.get_meta(["x"], 4, "p", "t", {"dp_rank": 0, "batch_index": b})
            c = await client.get_meta(["x"], 4, "p", "t", {"dp_rank": 0, "batch_index": b})
            assert a.global_indexes == c.global_indexes
        assert sampler.cache_size == 0  # the controller served the replicas from its log


async def test_task_samplers_pick_per_task() -> None:
    balanced = tq.SeqlenBalancedSampler(dp_size=2)
    async with (
        tq.local_cluster(num_storage_units=1, task_samplers={"learner": balanced}) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(4)}, "p", tags=[{"total_lengths": 9}] * 4)
        plain = await client.get_meta(["x"], 4, "p", "reward")  # the default sampler
        assert plain.global_indexes == [0, 1, 2, 3]
        with pytest.raises(tq.TQError, match="dp_rank"):  # the learner's needs its context
            await client.get_meta(["x"], 2, "p", "learner")
        share = await client.get_meta(["x"], 2, "p", "learner", {"dp_rank": 0, "batch_index": 0})
        assert len(share) == 2


async def test_dropped_tail_ends_every_rank_together() -> None:
    sampler = tq.SeqlenBalancedSampler(dp_size=2, tail="drop")
    async with (
        tq.local_cluster(num_storage_units=1, task_samplers={"learner": sampler}) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(5)}, "p", tags=[{"total_lengths": 3}] * 5)
        await client.seal("p")
        shares = [
            await client.get_meta(["x"], 2, "p", "learner", {"dp_rank": r, "batch_index": 0})
            for r in (0, 1)
        ]
        assert sorted(r for m in shares for r in m.global_indexes) == [0, 1, 2, 3]
        # one row is left for two ranks: it is dropped and both ranks end together
        for r in (0, 1):
            end = await client.get_meta(["x"], 2, "p", "learner", {"dp_rank": r, "batch_index": 1})
            assert end.end_of_stream
        assert await client.check_consumption_status("p", "learner")


@pytest.mark.parametrize("task", ["learner", None])
async def test_dropped_count_starts_over_with_a_reset(task: str | None) -> None:
    """``partition_info()["dropped"]`` counts the rows a task consumed undelivered: a
    ``reset_consumption`` forgets that consumption, so the count starts over with it (before,
    every replay of the partition added its dropped tail again: 1, 2, 3 ... for one row)."""
    sampler = tq.SeqlenBalancedSampler(dp_size=2, tail="drop")
    async with (
        tq.local_cluster(num_storage_units=1, task_samplers={"learner": sampler}) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(5)}, "p", tags=[{"total_lengths": 3}] * 5)
        await client.seal("p")
        for epoch in range(3):
            for b in range(2):
                for r in (0, 1):
                    cfg = {"dp_rank": r, "batch_index": b}
                    await client.get_meta(["x"], 2, "p", "learner", cfg, timeout=5)
            info = await client.partition_info("p")
            assert (info["consumed"], info["dropped"]) == ({"learner": 5}, {"learner": 1}), epoch
            await client.reset_consumption("p", task)
            assert (await client.partition_info("p"))["dropped"] == {}, epoch


@pytest.mark.parametrize("inline_put_bytes", [65536, 0])  # one message, or three steps
async def test_a_reused_grpo_uid_is_refused_at_the_put(inline_put_bytes: int) -> None:
    """Two prompts under one uid: the put that gives it a 5th row fails, nothing mixes."""
    sampler = tq.RankAwareSampler(tq.GRPOGroupNSampler(4), n_replicas=1)
    async with (
        tq.local_cluster(num_storage_units=1, task_samplers={"learner": sampler}) as cluster,
        tq.AsyncClient.connect(cluster.address, inline_put_bytes=inline_put_bytes) as client,
    ):
        for k in range(2):
            for src in ("A", "B"):
                await client.put({"x": torch.zeros(1)}, "p", tags=[{"uid": 0, "src": f"{src}{k}"}])
        with pytest.raises(tq.InvalidRequestError, match=r"uid=0.*rows \[0, 1, 2, 3\].*\[4\]"):
            await client.put({"x": torch.zeros(1)}, "p", tags=[{"uid": 0, "src": "A2"}])
        await client.put({"x": torch.zeros(4)}, "p", tags=[{"uid": 1}] * 4)
        await client.seal("p")
        info = await client.partition_info("p")
        assert (info["rows"], info["uncommitted_puts"]) == (8, 0)  # the refused row is gone
        first = await client.get_meta(["x"], 4, "p", "learner", timeout=5)
        second = await client.get_meta(["x"], 4, "p", "learner", timeout=5)
        assert [t["uid"] for t in first.tags + second.tags] == [0] * 4 + [1] * 4
        assert sorted(first.global_indexes + second.global_indexes) == [0, 1, 2, 3, 5, 6, 7, 8]


class _TwoRanks(tq.BaseSampler):
    """A TransferQueue-style custom sampler: the first call for a batch splits it between DP
    ranks 0 and 1, caches both shares in ``_states`` (TransferQueue's convention, read by
    ``has_cached_result`` and dropped by ``clear_cache``) and consumes all its rows."""

    def sample(  # type: ignore[override]
        self,
        ready_indexes: list[int],
        batch_size: int,
        *args: object,
        partition_id: str,
        task_name: str,
        dp_rank: int,
        batch_index: int,
        **kwargs: object,
    ) -> tuple[list[int], list[int]]:
        by_rank = self._states.setdefault(partition_id, {}).setdefault(task_name, {})
        cached = by_rank.get(dp_rank, {}).get(batch_index)
        if cached is not None:
            return cached, []
        rows = list(ready_indexes[: 2 * batch_size])
        for rank in (0, 1):
            share = rows[rank * batch_size : (rank + 1) * batch_size]
            by_rank.setdefault(rank, {})[batch_index] = share
        return by_rank[dp_rank][batch_index], rows


@pytest.mark.parametrize("wrap", ["bare", "staleness", "rank_aware"])
async def test_a_wrapped_custom_sampler_keeps_its_transferqueue_cache_hooks(wrap: str) -> None:
    """Wrapped (`StalenessSampler`, `RankAwareSampler`), a custom sampler's
    ``has_cached_result`` still lets rank 1 read the share rank 0's call cached for it (no
    wait for rows that were all consumed), and ``clear_partition`` still drops its
    ``_states`` (``clear_cache``): the partition's next incarnation is sampled afresh, not
    answered with the old rows unconsumed."""
    inner = _TwoRanks()
    sampler = {
        "bare": lambda: inner,
        "staleness": lambda: tq.StalenessSampler(inner, max_staleness=1),
        "rank_aware": lambda: tq.RankAwareSampler(inner),
    }[wrap]()
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        for round_ in range(2):
            await client.put({"x": torch.arange(8)}, partition_id="p")
            with anyio.fail_after(10):
                got = [
                    (await client.get_meta(["x"], 4, "p", "t", {"dp_rank": r, "batch_index": 0}))
                    for r in (0, 1)
                ]
            assert [m.global_indexes for m in got] == [[0, 1, 2, 3], [4, 5, 6, 7]], round_
            assert int((await client.consumption_status("p", "t")).sum()) == 8, round_
            await client.clear_partition("p")
        assert not inner._states


@pytest.mark.parametrize("task", ["t", None])
async def test_a_reset_forgets_the_shares_a_transferqueue_sampler_cached(task: str | None) -> None:
    """A TransferQueue-style sampler caches each rank's share in
    ``_states[partition_id][task_name]`` (the documented convention). ``reset_consumption``
    starts a new epoch: the cached shares of the old one must go with it, as a clear drops
    them. Before, the new epoch was answered from the cache with nothing consumed
    (``(share, [])``): every row stayed unconsumed, so the epoch handed the same rows out
    again batch after batch and never ended."""
    inner = _TwoRanks()
    async with (
        tq.local_cluster(num_storage_units=1, sampler=inner) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(8)}, partition_id="p")
        for epoch in range(2):
            with anyio.fail_after(10):
                got = [
                    (await client.get_meta(["x"], 4, "p", "t", {"dp_rank": r, "batch_index": 0}))
                    for r in (0, 1)
                ]
            assert [m.global_indexes for m in got] == [[0, 1, 2, 3], [4, 5, 6, 7]], epoch
            assert int((await client.consumption_status("p", "t")).sum()) == 8, epoch
            await client.reset_consumption("p", task)
            assert not inner._states.get("p", {}).get("t"), epoch


class _BrokenHooks(tq.SequentialSampler):
    """A custom sampler whose clear and reset hooks raise."""

    def clear_partition(self, partition_id: str) -> None:
        raise RuntimeError("clear hook broken")

    def reset_partition(self, partition_id: str, task_name: str | None) -> None:
        raise RuntimeError("reset hook broken")


async def test_a_sampler_hook_that_raises_changes_nothing() -> None:
    """A sampler whose ``clear_partition`` (``reset_partition``) raises fails the
    clear (the reset) with an error naming the sampler and the hook, and nothing happened:
    not a partition gone from the controller while its rows stay on the storage unit for
    ever, or consumption reset without waking the consumers waiting for its rows."""
    async with (
        tq.local_cluster(num_storage_units=1, sampler=_BrokenHooks()) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(8)}, partition_id="p")
        assert (await client.get_meta(["x"], 8, "p", "t")).global_indexes == list(range(8))
        with pytest.raises(tq.TQError, match=r"_BrokenHooks.*clear_partition.*nothing"):
            await client.clear_partition("p")
        assert (await client.partition_info("p"))["rows"] == 8
        assert [s["rows"] for s in (await client.storage_stats()).values()] == [8]
        with pytest.raises(tq.TQError, match=r"_BrokenHooks.*reset_partition.*nothing"):
            await client.reset_consumption("p", "t")
        assert int((await client.consumption_status("p", "t")).sum()) == 8


@pytest.mark.parametrize(
    "make",
    [
        lambda: tq.RankAwareSampler(n_replicas=2),
        lambda: tq.SeqlenBalancedSampler(dp_size=2, n_replicas=2),
    ],
    ids=["rank_aware", "seqlen"],
)
async def test_a_peek_with_a_dp_rank_leaves_caching_samplers_as_they_were(make: Any) -> None:
    """``mode="peek"`` consumes nothing, so it must not be remembered as handed out: a
    peek of a rank's batch, repeated, shows the same rows (no "already read" error), the
    fetch that follows consumes what it delivers (a cached peek answered it with nothing
    consumed, so the next batch got the same rows again), and no cache entry is left."""
    sampler = make()
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        tags = [{"total_lengths": i + 1} for i in range(8)]
        await client.put({"x": torch.arange(8)}, partition_id="p", tags=tags)
        cfg = {"dp_rank": 0, "batch_index": 0}
        peeks = [
            (await client.get_meta(["x"], 2, "p", "t", cfg, mode="peek")).global_indexes
            for _ in range(3)
        ]
        assert peeks[0] == peeks[1] == peeks[2]
        assert len(peeks[0]) == 2
        first = (await client.get_meta(["x"], 2, "p", "t", cfg)).global_indexes
        assert first == peeks[0]
        status = await client.consumption_status("p", "t")
        assert all(status[r] for r in first)
        second = await client.get_meta(["x"], 2, "p", "t", {"dp_rank": 0, "batch_index": 1})
        assert not set(second.global_indexes) & set(first)
        assert sampler.cache_size == 0


@pytest.mark.parametrize(
    ("built", "tail"),
    [(None, None), (None, "uneven"), (None, "drop"), ("error", "uneven"), ("error", "drop")],
)
async def test_a_peek_of_a_short_final_seqlen_batch_follows_the_fetch_tail(
    tail: str | None, built: str | None
) -> None:
    """`SeqlenBalancedSampler` built without a ``tail`` follows the caller's policy
    (``"uneven"`` by default) for a fetch; a peek of the same batch followed the sampler's
    own fallback instead (``"error"``: the peek of a final batch with fewer groups than
    ranks failed with a ``ValueError`` the fetch never raises). A peek shows what the fetch
    then hands out, and the request's ``tail`` wins over the sampler's own in both."""
    sampler = tq.SeqlenBalancedSampler(dp_size=2, tail=built)
    async with (
        tq.local_cluster(num_storage_units=1, task_samplers={"learner": sampler}) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(1)}, "p", tags=[{"total_lengths": 3}])
        await client.seal("p")
        asked = {"tail": tail, "dp_size": 2} if tail else {}
        cfgs = [{"batch_index": 0, "dp_rank": r} | asked for r in (0, 1)]
        peeks = [
            (await client.get_meta(["x"], 2, "p", "learner", cfg, mode="peek")).global_indexes
            for cfg in cfgs
        ]
        got = [(await client.get_meta(["x"], 2, "p", "learner", cfg)) for cfg in cfgs]
        assert peeks == [m.global_indexes for m in got]
        if tail == "drop":
            assert all(m.end_of_stream for m in got)
        else:
            assert [m.global_indexes for m in got] == [[0], []]


class _Answers(tq.BaseSampler):
    """A custom sampler answering ``rows`` (sampled and consumed) whatever is ready."""

    short_ready_ok = True

    def __init__(self, rows: list[int]) -> None:
        super().__init__()
        self.rows = rows

    def sample(self, ready_indexes: Any, batch_size: int, *args: Any, **kwargs: Any) -> Any:
        return list(self.rows), list(self.rows)


@pytest.mark.parametrize("row", [999, 0], ids=["never_put", "cleared"])
async def test_a_sampler_answering_a_row_that_does_not_exist_is_named(row: int) -> None:
    """A custom sampler that answers a row that does not exist (never put, or cleared): the
    error says the sampler did it and what a sampler must answer. Before, it was the
    `RowsNotFound` of a caller's bad `BatchMeta` ("use the BatchMeta a put or get_meta
    returned"): advice for a mistake the caller of get_meta never made."""
    async with (
        tq.local_cluster(num_storage_units=1, sampler=_Answers([row])) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        meta = await client.put({"x": torch.arange(4)}, "p")
        await client.clear_samples(meta.select_rows([0]))
        with pytest.raises(tq.InvalidRequestError) as err:
            await client.get_meta(["x"], 1, "p", "t", timeout=5)
        message = str(err.value)
        assert f"sampler _Answers answered row {row}: row {row} does not exist" in message
        assert "ready_indexes" in message, message
        assert "BatchMeta" not in message, message
        assert not (await client.consumption_status("p", "t")).any()


async def test_a_rank_aware_batch_asked_ahead_of_an_async_inner_is_decided_later() -> None:
    """``get_batches(also=...)`` asks for later batches only when they can be decided at
    once; an ``async`` sampler's call is dropped unawaited. `RankAwareSampler` over an
    ``async`` inner had marked that batch in flight when the call was made, and the mark
    stayed: the later request for the batch waited for ever on a first call that never ran.
    It samples the batch itself."""
    sampler = tq.RankAwareSampler(Later())
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(12)}, partition_id="p")
        cfg = {"dp_rank": 0, "batch_index": 0}
        got = await client.get_batches(["x"], 4, "p", "t", cfg, also=[1])
        assert [list(m.global_indexes) for _, m in got] == [[0, 1, 2, 3]]
        with anyio.fail_after(10):
            later = await client.get_meta(["x"], 4, "p", "t", {"dp_rank": 0, "batch_index": 1})
        assert later.global_indexes == [4, 5, 6, 7]


class _Unstorable(tq.SequentialSampler):
    """A custom sampler whose state, from its second batch on, holds what no checkpoint (and
    no journal) can store; its first batch leaves a state that can be stored."""

    def sample(self, ready_indexes: Any, batch_size: int, *args: Any, **kwargs: Any) -> Any:
        rows, consumed = super().sample(ready_indexes, batch_size, *args, **kwargs)
        if rows:
            seen = self._states.setdefault("batches", [])
            seen.append(list(rows))
            if len(seen) > 1:
                self._states["rng"] = object()
        return rows, consumed


async def test_a_sampler_state_that_cannot_be_stored_does_not_stop_a_durable_controller(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A durable controller writes the samplers' ``state_dict()`` with every commit. A custom
    sampler whose state could no longer be stored made the commit raise: the journal's task
    died and the controller with it, every client cut off. The commit writes the sampler's
    last state that could be stored, with an error naming the sampler, and goes on; a
    restart on the directory resumes from it."""
    async with (
        tq.local_cluster(
            num_storage_units=1,
            sampler=_Unstorable(),
            durability="process",
            data_dir=str(tmp_path),
        ) as cluster,
        tq.AsyncClient.connect(cluster.address, request_timeout=10) as client,
    ):
        await client.put({"x": torch.arange(6)}, "p")
        with anyio.fail_after(20):
            for _ in range(3):
                await client.get_meta(["x"], 2, "p", "t")
        assert (await client.partition_info("p"))["consumed"] == {"t": 6}
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("_Unstorable" in m and "state" in m for m in errors), errors
    restarted = _Unstorable()
    async with (
        tq.local_cluster(
            num_storage_units=1, sampler=restarted, durability="process", data_dir=str(tmp_path)
        ) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        assert (await client.partition_info("p"))["consumed"] == {"t": 6}
        assert restarted._states == {"batches": [[0, 1]]}  # the last state that could be stored
