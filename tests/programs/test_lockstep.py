"""DP ranks in lockstep (``dp_size`` in ``sampling_config``): two ranks in one process.

The in-process twin of ``tests/programs/test_distributed.py``: an embedded cluster, two DP ranks
reading batch ``b`` together (concurrently) before either reads ``b + 1``, as ranks that
all_reduce every step do. For every built-in sampler and tail policy, both ranks get the same
number of batches and the end of the stream at the same ``batch_index``, a TP peer re-reading
a batch gets the same rows, and every row reaches exactly one rank (or is reported dropped
under ``tail="drop"``). Scenarios from ``dist_repro_rankaware_uneven_steps.py`` (6 vs 5
batches; 8 vs 3 with two DataLoader workers) and ``a3_grpo_silent_drop.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import pytest
import torch

import tq_async as tq
from tq_async._portal import get_portal

DP = 2
PER_RANK = 8  # rows per rank per batch: a global batch is 16 rows
DEADLINE = 20  # a generous bound for what must happen (never a synchronisation device)

#: name -> (sampler for tail, rows per group)
SAMPLERS: dict[str, tuple[Callable[[str], tq.BaseSampler], int]] = {
    "sequential": (lambda tail: tq.SequentialSampler(), 1),
    "grpo": (lambda tail: tq.GRPOGroupNSampler(4), 4),
    "rank_aware": (lambda tail: tq.RankAwareSampler(tq.GRPOGroupNSampler(4), n_replicas=2), 4),
    "seqlen": (
        lambda tail: tq.SeqlenBalancedSampler(
            n_samples_per_prompt=4, dp_size=DP, n_replicas=2, tail=tail
        ),
        4,
    ),
    "staleness": (lambda tail: tq.StalenessSampler(tq.SequentialSampler(), max_staleness=1), 1),
}


def _config(rank: int, batch: int, tail: str) -> dict[str, Any]:
    return {"dp_rank": rank, "batch_index": batch, "dp_size": DP, "tail": tail}


def _tags(rows: range, group: int) -> list[dict[str, Any]]:
    return [{"uid": r // group, "total_lengths": 10 + (r // group * 7) % 13} for r in rows]


async def _fill(client: tq.AsyncClient, n: int, group: int, *, seal: bool = True) -> None:
    """``n`` rows (``x`` = row id) in puts of whole groups, onto both units; then seal."""
    per_put = group * 3
    for a in range(0, n, per_put):
        rows = range(a, min(a + per_put, n))
        x = torch.tensor(list(rows), dtype=torch.int64)
        await client.put({"x": x}, partition_id="p", tags=_tags(rows, group))
    if seal:
        await client.seal("p")


async def _dropped(client: tq.AsyncClient, task: str) -> int | None:
    """The controller's count of rows the tail policy dropped for ``task`` (None: absent)."""
    dropped = (await client.partition_info("p")).get("dropped")
    return int(dropped.get(task, 0)) if isinstance(dropped, dict) else None


async def _lockstep(
    client: tq.AsyncClient, tail: str, *, task: str = "t"
) -> list[list[tq.BatchMeta]]:
    """Both ranks read batch b together, until both see the end; per rank, its batches.

    A TP peer of each rank re-reads every batch: it must get the same rows.
    """
    got: list[list[tq.BatchMeta]] = [[] for _ in range(DP)]
    ended: list[int | None] = [None] * DP
    for b in itertools.count():
        metas: list[tq.BatchMeta | None] = [None] * DP

        async def read(rank: int, b: int = b, metas: list[Any] = metas) -> None:
            meta = await client.get_meta(["x"], PER_RANK, "p", task, _config(rank, b, tail))
            metas[rank] = meta

        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                for rank in range(DP):
                    if ended[rank] is None:
                        tg.start_soon(read, rank)
        for rank, meta in enumerate(metas):
            if meta is None:
                continue
            if meta.end_of_stream:
                ended[rank] = b
                continue
            peer = await client.get_meta(["x"], PER_RANK, "p", task, _config(rank, b, tail))
            assert peer.global_indexes == meta.global_indexes, f"TP peers differ at batch {b}"
            got[rank].append(meta)
        if all(e is not None for e in ended):
            break
        if b > 100:
            pytest.fail("the stream never ended")
    assert ended[0] == ended[1], (
        f"rank 0 ended at batch {ended[0]}, rank 1 at batch {ended[1]}: an all_reduce loop "
        f"hangs (rows per batch: {[[len(m) for m in metas] for metas in got]})"
    )
    return got


def _delivered(got: list[list[tq.BatchMeta]]) -> list[int]:
    return [r for metas in got for m in metas for r in m.global_indexes]


@pytest.mark.parametrize("tail", ["uneven", "drop"])
@pytest.mark.parametrize("name", list(SAMPLERS))
async def test_ranks_end_together_and_share_every_row(name: str, tail: str) -> None:
    factory, group = SAMPLERS[name]
    # 2 global batches of 16 rows, then a tail that one rank's batch could hold: 4 rows (one
    # group) or 5 single rows (odd, so no even split either)
    n = 2 * DP * PER_RANK + (4 if group > 1 else 5)
    async with (
        tq.local_cluster(num_storage_units=2, task_samplers={"t": factory(tail)}) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await _fill(client, n, group)
        got = await _lockstep(client, tail)
        delivered = _delivered(got)
        assert len(delivered) == len(set(delivered)), "a row reached two ranks (or one twice)"
        assert all(m.batch_index == b for metas in got for b, m in enumerate(metas))
        if tail == "uneven":
            assert sorted(delivered) == list(range(n))  # nothing lost
        else:
            for b, batch in enumerate(zip(*got, strict=True)):
                assert len({len(m) for m in batch}) == 1, f"batch {b} split unevenly"
            missing = set(range(n)) - set(delivered)
            assert missing, "the tail cannot split evenly: some rows must be dropped"
            dropped = await _dropped(client, "t")
            assert dropped == len(missing), (
                f"{len(missing)} rows were not delivered, the controller reports {dropped} "
                "dropped (partition_info()['dropped'][task])"
            )
            assert int((await client.consumption_status("p", "t")).sum()) == n


async def test_tail_error_refuses_an_uneven_tail() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await _fill(client, 2 * DP * PER_RANK + 3, 1)
        for b in range(2):
            for rank in range(DP):
                meta = await client.get_meta(["x"], PER_RANK, "p", "t", _config(rank, b, "error"))
                assert len(meta) == PER_RANK
        with pytest.raises(tq.InvalidRequestError, match="tail"):
            await client.get_meta(["x"], PER_RANK, "p", "t", _config(0, 2, "error"))


async def test_a_rank_gets_an_empty_share_not_the_end() -> None:
    # one group of 4 left for two ranks: one rank gets it, the other an empty batch
    async with (
        tq.local_cluster(num_storage_units=1, sampler=tq.GRPOGroupNSampler(4)) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await _fill(client, 2 * DP * PER_RANK + 4, 4)
        got = await _lockstep(client, "uneven")
        last = [metas[-1] for metas in got]
        assert sorted(len(m) for m in last) == [0, 4]
        assert not any(m.end_of_stream for m in last)
        empty = next(m for m in last if not len(m))
        td, meta = await client.get(
            ["x"], PER_RANK, "p", "t", _config(last.index(empty), empty.batch_index, "uneven")
        )
        assert len(meta) == 0
        assert td.batch_size == torch.Size([0])


async def test_ranks_wait_for_a_whole_global_batch_while_rows_arrive() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        got: list[list[int]] = [[] for _ in range(DP)]

        async def rank(r: int) -> None:
            for b in itertools.count():
                meta = await client.get_meta(["x"], PER_RANK, "p", "t", _config(r, b, "uneven"))
                if meta.end_of_stream:
                    got[r].append(-1)
                    return
                got[r].append(len(meta))

        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                for r in range(DP):
                    tg.start_soon(rank, r)
                for a in range(0, 40, 5):  # rows trickle in, 5 at a time, then the seal
                    await anyio.wait_all_tasks_blocked()
                    x = torch.arange(a, a + 5)
                    await client.put({"x": x}, partition_id="p")
                await client.seal("p")
        # 40 rows: 2 full global batches of 16, then 8 rows; both ranks end together
        assert len(got[0]) == len(got[1]), f"rows per batch (-1: end) per rank: {got}"
        assert got[0][:2] == got[1][:2] == [PER_RANK, PER_RANK]
        assert sum(got[0][2:-1]) + sum(got[1][2:-1]) == 8


async def test_grpo_rows_that_cannot_complete_a_group_follow_the_tail_policy() -> None:
    # a3: 2 rows of an incomplete group, sealed; they must not vanish without a trace
    for tail in ("uneven", "drop"):
        async with (
            tq.local_cluster(num_storage_units=1, sampler=tq.GRPOGroupNSampler(4)) as cluster,
            tq.AsyncClient.connect(cluster.address) as client,
        ):
            await client.put({"x": torch.arange(16)}, partition_id="p", tags=_tags(range(16), 4))
            await client.put(
                {"x": torch.tensor([16, 17])}, partition_id="p", tags=[{"uid": "late"}] * 2
            )
            await client.seal("p")
            got = await _lockstep(client, tail)
            delivered = _delivered(got)
            assert len(delivered) == len(set(delivered))
            if tail == "uneven":
                assert sorted(delivered) == list(range(18))
            else:
                assert await _dropped(client, "t") == 18 - len(delivered) > 0


@pytest.mark.parametrize("tail", ["uneven", "drop", "error"])
async def test_seqlen_rows_that_cannot_complete_a_group_follow_the_tail_policy(tail: str) -> None:
    """`SeqlenBalancedSampler` ended the stream over the rows of an incomplete group (not
    consumed, not counted as dropped: lost without a trace); they follow the tail policy as
    `GRPOGroupNSampler`'s do."""
    sampler = tq.SeqlenBalancedSampler(n_samples_per_prompt=4, dp_size=DP)
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(16)}, partition_id="p", tags=_tags(range(16), 4))
        await client.put(
            {"x": torch.tensor([16, 17])}, partition_id="p", tags=[{"uid": "late"}] * 2
        )
        await client.seal("p")
        if tail == "error":
            for rank in range(DP):  # the whole groups go first: one global batch
                await client.get_meta(["x"], PER_RANK, "p", "t", _config(rank, 0, tail))
            with anyio.fail_after(DEADLINE), pytest.raises(tq.InvalidRequestError, match="fewer"):
                await client.get_meta(["x"], PER_RANK, "p", "t", _config(0, 1, tail))
            assert int((await client.consumption_status("p", "t")).sum()) == 16
            return
        got = await _lockstep(client, tail)
        delivered = _delivered(got)
        assert len(delivered) == len(set(delivered))
        if tail == "uneven":
            assert sorted(delivered) == list(range(18))
            assert [16, 17] in [list(m.global_indexes) for metas in got for m in metas]
        else:
            assert sorted(delivered) == list(range(16))
            assert await _dropped(client, "t") == 2
        assert int((await client.consumption_status("p", "t")).sum()) == 18


@pytest.mark.parametrize("tail", ["uneven", "drop"])
async def test_a_per_rank_batch_that_splits_a_group_is_refused(tail: str) -> None:
    """GRPO groups of 4 and 2 rows per rank: every global batch (4 rows, one group) would
    go 4/0 to the ranks, and ``drop`` would consume a whole group undelivered at every step,
    not only at the tail. The request is refused naming the fix (as
    `SeqlenBalancedSampler` refuses it), and nothing is consumed."""
    async with (
        tq.local_cluster(num_storage_units=1, sampler=tq.GRPOGroupNSampler(4)) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await _fill(client, 4 * 4, 4)
        cfg = {"dp_rank": 0, "batch_index": 0, "dp_size": DP, "tail": tail}
        with (
            anyio.fail_after(DEADLINE),
            pytest.raises(tq.InvalidRequestError, match="multiple of n_samples_per_prompt"),
        ):
            await client.get_meta(["x"], 2, "p", "t", cfg)
        assert int((await client.consumption_status("p", "t")).sum()) == 0
        assert not await _dropped(client, "t")


# ---- the datasets in lockstep --------------------------------------------------------------


@contextmanager
def _portal_cluster(sampler: tq.BaseSampler) -> Iterator[tuple[str, tq.Client]]:
    """An embedded cluster on the portal loop, for the blocking DataLoader path."""
    cluster_cm = tq.local_cluster(num_storage_units=2, sampler=sampler, transport="tcp")
    with (
        get_portal().wrap_async_context_manager(cluster_cm) as cluster,
        tq.Client.connect(cluster.address) as client,
    ):
        yield cluster.address, client


async def test_async_datasets_end_together_with_an_empty_micro_batch() -> None:
    async with (
        tq.local_cluster(num_storage_units=2, sampler=tq.GRPOGroupNSampler(4)) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        n = 2 * DP * PER_RANK + 4  # the last group goes to one rank, the other gets 0 rows
        await _fill(client, n, 4)
        datasets = [
            tq.AsyncStreamingDataset(
                client, ["x"], PER_RANK, 4, "p", "t", dp_rank=r, dp_size=DP, prefetch=p
            )
            for r, p in ((0, 0), (1, 2))
        ]
        async with datasets[0], datasets[1]:
            steps = await _datasets_in_lockstep(datasets)
            # 16 rows per rank in micro-batches of 4, then the tail: [4 rows] or one empty one
            assert len(steps[0]) == len(steps[1]) == 5
            assert sorted(len(s[-1]) for s in steps) == [0, 4]
            rows = [r for s in steps for mb in s for r in mb]
            assert sorted(rows) == list(range(n))
            # a replay reads the recorded batches again, the empty share included
            for ds in datasets:
                ds.reset()
            assert await _datasets_in_lockstep(datasets) == steps
            # so does a rank resumed on its empty share (e.g. restarted from a checkpoint)
            empty_rank = next(r for r in range(DP) if not steps[r][-1])
            state = {**datasets[empty_rank].state_dict(), "batch_index": 2}
            resumed = tq.AsyncStreamingDataset(
                client, ["x"], PER_RANK, 4, "p", "t", dp_rank=empty_rank, dp_size=DP
            )
            resumed.load_state_dict(state)
            async with resumed:
                with anyio.fail_after(DEADLINE):
                    assert [list(m.global_indexes) async for _, m in resumed] == [[]]


async def _datasets_in_lockstep(
    datasets: list[tq.AsyncStreamingDataset],
) -> list[list[list[int]]]:
    """One micro-batch from each rank per step until all end (together); rows per step."""
    steps: list[list[list[int]]] = [[] for _ in datasets]
    with anyio.fail_after(DEADLINE):
        while True:
            items = [await anext(ds, None) for ds in datasets]
            if all(item is None for item in items):
                return steps
            assert None not in items, f"step {len(steps[0])}: a rank ended early"
            for out, (td, meta) in zip(steps, items, strict=True):  # type: ignore[misc]
                assert td.batch_size[0] == len(meta)
                if len(meta):
                    assert td["x"].tolist() == meta.global_indexes
                out.append(list(meta.global_indexes))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loaders_give_every_rank_the_same_number_of_steps(num_workers: int) -> None:
    # dist_repro_rankaware_uneven_steps: 8 vs 3 batches with two DataLoader workers
    sampler = tq.RankAwareSampler(tq.GRPOGroupNSampler(4), n_replicas=1)
    with _portal_cluster(sampler) as (address, client):
        n = 43 * 4
        for a in range(0, n, 12):
            rows = range(a, min(a + 12, n))
            client.put({"x": torch.tensor(list(rows))}, partition_id="p", tags=_tags(rows, 4))
        client.seal("p")
        loaders = [
            tq.StreamingDataLoader(
                tq.StreamingDataset(
                    address, ["x"], 16, 16, "p", "t", dp_rank=r, dp_size=DP, request_timeout=10
                ),
                num_workers=num_workers,
                multiprocessing_context="fork" if num_workers else None,
            )
            for r in range(DP)
        ]
        steps: list[list[list[int]]] = [[] for _ in range(DP)]
        # lockstep: one batch from each rank per step, as an all_reduce loop reads them
        for pair in itertools.zip_longest(*loaders):
            for rank, item in enumerate(pair):
                steps[rank].append([] if item is None else list(item[1].global_indexes))
            assert None not in pair, f"step {len(steps[0]) - 1}: a rank ended before the other"
        rows = [r for s in steps for b in s for r in b]
        assert sorted(rows) == list(range(n))


async def test_a_bad_dp_config_is_refused_before_anything_is_sent() -> None:
    client = tq.AsyncClient("tcp://127.0.0.1:1")  # never connected: nothing can be sent
    bad = [
        ({"dp_rank": 0, "batch_index": 0, "dp_size": 0}, "dp_size'\\] must be a positive"),
        ({"dp_rank": 0, "batch_index": 0, "dp_size": "2"}, "dp_size'\\] must be a positive"),
        ({"dp_rank": 0, "batch_index": 0, "tail": "drop"}, "'tail' without 'dp_size'"),
        ({"dp_rank": 0, "batch_index": 0, "dp_size": 2, "tail": "pad"}, "one of 'uneven'"),
        ({"dp_rank": 2, "batch_index": 0, "dp_size": 2}, "out of range for dp_size=2"),
        ({"dp_rank": 0, "dp_size": 2}, "needs 'batch_index'"),
        ({"batch_index": 0, "dp_size": 2}, "needs 'dp_rank'"),
    ]
    for config, match in bad:
        with pytest.raises(tq.InvalidRequestError, match=match):
            await client.get_meta(["x"], 4, "p", "t", config)
    with pytest.raises(tq.ClosedError):  # a good config gets as far as sending
        await client.get_meta(["x"], 4, "p", "t", _config(1, 0, "drop"))


async def test_a_dataset_without_tail_keeps_the_samplers_own_policy() -> None:
    sampler = tq.SeqlenBalancedSampler(n_samples_per_prompt=4, dp_size=DP, tail="drop")
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await _fill(client, 2 * DP * PER_RANK + 4, 4)  # a tail of one group: dropped
        datasets = [
            tq.AsyncStreamingDataset(
                client, ["x"], PER_RANK, PER_RANK, "p", "t", dp_rank=r, dp_size=DP
            )
            for r in range(DP)
        ]
        async with datasets[0], datasets[1]:
            steps = await _datasets_in_lockstep(datasets)
        assert [[len(b) for b in s] for s in steps] == [[PER_RANK, PER_RANK]] * DP
        assert await _dropped(client, "t") == 4


async def test_a_sampler_built_for_dp_ranks_gives_datasets_empty_shares_too() -> None:
    # no dp_size on the datasets: SeqlenBalancedSampler(dp_size=2) makes the batches global
    sampler = tq.SeqlenBalancedSampler(n_samples_per_prompt=4, dp_size=DP)
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        n = 2 * DP * PER_RANK + 4  # the last group goes to one rank, the other gets 0 rows
        await _fill(client, n, 4)
        datasets = [
            tq.AsyncStreamingDataset(client, ["x"], PER_RANK, PER_RANK, "p", "t", dp_rank=r)
            for r in range(DP)
        ]
        async with datasets[0], datasets[1]:
            steps = await _datasets_in_lockstep(datasets)
        assert sorted(len(s[-1]) for s in steps) == [0, 4]
        assert sorted(r for s in steps for b in s for r in b) == list(range(n))


async def test_stop_when_consumed_ends_every_rank_at_the_same_batch_index() -> None:
    """The end of stream one rank got at a global batch index (every row consumed, the
    partition not sealed) is told to every rank at that index, even once more rows came
    (`ControllerState.dp_ends`, journaled): a rank that stepped on alone would wait in its
    all_reduce for ever."""
    # rank 0 reaches the end (every row consumed, not sealed) at batch 1; rows arrive before
    # rank 1 asks for batch 1: rank 1 must end there too, or it steps alone and its
    # all_reduce waits for rank 0 forever
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await _fill(client, DP * PER_RANK, 1, seal=False)
        datasets = [
            tq.AsyncStreamingDataset(
                client,
                ["x"],
                PER_RANK,
                PER_RANK,
                "p",
                "t",
                dp_rank=r,
                dp_size=DP,
                prefetch=0,
                stop_when_consumed=True,
            )
            for r in range(DP)
        ]
        ends: list[int] = []
        async with datasets[0], datasets[1]:
            with anyio.fail_after(DEADLINE):
                for ds in datasets:
                    async for _ in ds:
                        pass
                    ends.append(ds.batch_index)
                    if len(ends) == 1:  # the producer puts more rows in between
                        await client.put({"x": torch.arange(DP * PER_RANK)}, partition_id="p")
        assert ends[0] == ends[1], f"rank 0 ended at batch {ends[0]}, rank 1 at {ends[1]}"


async def _swc(
    client: tq.AsyncClient, rank: int, b: int, *, record_from: int | None = None
) -> tq.BatchMeta:
    """Rank ``rank``'s stop_when_consumed fetch of global batch ``b`` (of ``PER_RANK`` rows)."""
    cfg: dict[str, Any] = {"dp_rank": rank, "batch_index": b, "dp_size": DP}
    if record_from is not None:
        cfg["record_from"] = record_from
    with anyio.fail_after(DEADLINE):
        return await client.get_meta(["x"], PER_RANK, "p", "t", cfg, stop_when_consumed=True)


async def test_an_end_met_by_a_batch_asked_ahead_is_told_to_the_rank_too() -> None:
    """A DataLoader worker asks for its next batches with its own (``get_batches(also=)``);
    one that came to the end of a ``stop_when_consumed`` stream is not handed over, but the
    end was owed to the other ranks only: the rank's own fetch of that index, once rows
    came, was decided anew, and it stepped on alone (its all_reduce waits for ever)."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await _fill(client, DP * PER_RANK, 1, seal=False)
        cfg = {"dp_rank": 0, "batch_index": 0, "dp_size": DP}
        got = await client.get_batches(
            ["x"], PER_RANK, "p", "t", cfg, also=[1], stop_when_consumed=True
        )
        assert [len(meta) for _, meta in got] == [PER_RANK]  # batch 1 would end the stream
        assert len(await _swc(client, 1, 0)) == PER_RANK
        assert (await _swc(client, 1, 1)).end_of_stream  # rank 1 ends at batch 1
        await client.put({"x": torch.arange(DP * PER_RANK)}, partition_id="p")
        assert (await _swc(client, 0, 1)).end_of_stream, "rank 0 stepped on alone at batch 1"


async def test_an_end_met_deciding_a_lower_batch_first_is_told_to_its_reader() -> None:
    """``record_from`` (DataLoader worker 1 asking batch 3 decides worker 0's batch 2
    first): an end of stream met at batch 2 is the reply to batch 3; worker 0's own fetch
    of batch 2, once rows came, was decided anew while rank 1 had ended there."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await _fill(client, 2 * DP * PER_RANK, 1, seal=False)
        for b in range(2):
            for rank in range(DP):
                assert len(await _swc(client, rank, b)) == PER_RANK
        assert (await _swc(client, 0, 3, record_from=2)).end_of_stream  # worker 1, at 2
        assert (await _swc(client, 1, 2)).end_of_stream  # rank 1 ends at batch 2
        await client.put({"x": torch.arange(DP * PER_RANK)}, partition_id="p")
        assert (await _swc(client, 0, 2, record_from=2)).end_of_stream, (
            "rank 0's worker 0 stepped on alone at batch 2"
        )


async def test_an_end_owed_at_a_lower_batch_is_not_decided_anew_by_record_from() -> None:
    """Rank 1 ended at batch 2 (owed to rank 0 there), rows came; rank 0's worker 1
    asking batch 3 decided batch 2 anew first (``record_from``): rank 0 got rows at
    batch 2, where rank 1 had ended."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await _fill(client, 2 * DP * PER_RANK, 1, seal=False)
        for b in range(2):
            for rank in range(DP):
                assert len(await _swc(client, rank, b)) == PER_RANK
        assert (await _swc(client, 1, 2)).end_of_stream  # rank 1 ends at batch 2
        await client.put({"x": torch.arange(DP * PER_RANK)}, partition_id="p")
        assert (await _swc(client, 0, 3, record_from=2)).end_of_stream  # worker 1
        assert (await _swc(client, 0, 2, record_from=2)).end_of_stream  # worker 0
