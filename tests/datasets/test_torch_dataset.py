"""StreamingDataset / StreamingDataLoader: order and exactly-once across workers, fork and spawn.

DataLoader workers are other processes, so the cluster runs in a ``tq-async serve``
subprocess (one per module; every test uses its own partitions).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import pickle
import select
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from tensordict import TensorDict
from torch.utils.data import DataLoader

import tq_async as tq
from _cluster_proc import resume_and_read, serve_cluster
from tq_async._datasets._torch import StreamingDataLoader, StreamingDataset

N_ROWS = 22  # batches of 4 -> [4, 4, 4, 4, 4, 2]; micro-batches of 3 -> [3, 1] per batch


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    with serve_cluster(storage_units=2) as addr:
        yield addr


@pytest.fixture
def client(address: str) -> Iterator[tq.Client]:
    with tq.Client.connect(address) as c:
        yield c


def _put(client: tq.Client, partition_id: str, n: int = N_ROWS, *, seal: bool = True) -> None:
    ids = list(range(n))
    client.put(
        {
            "x": torch.tensor(ids),
            "jag": torch.nested.nested_tensor(
                [torch.full((i % 3 + 1,), float(i)) for i in ids], layout=torch.jagged
            ),
            "s": [f"row{i}" for i in ids],
        },
        partition_id=partition_id,
    )
    if seal:
        client.seal(partition_id)


def _dataset(address: str, partition_id: str, task: str, **kwargs: Any) -> StreamingDataset:
    return StreamingDataset(address, ["x", "jag", "s"], 4, 3, partition_id, task, **kwargs)


def _checked(items: Iterable[Any]) -> Iterator[tuple[int, list[int]]]:
    """``(batch_index, rows)`` of each micro-batch; data and metadata must agree row by row."""
    for td, meta in items:
        rows = list(meta.global_indexes)
        assert td["x"].tolist() == rows
        assert td.get("s").tolist() == [f"row{r}" for r in rows]
        assert [t.tolist() for t in td["jag"].unbind()] == [[float(r)] * (r % 3 + 1) for r in rows]
        yield meta.batch_index, rows


def _read(items: Iterable[Any]) -> list[tuple[int, list[int]]]:
    return list(_checked(items))


def _check_stream(got: list[tuple[int, list[int]]], n: int = N_ROWS) -> None:
    """Batch indexes ascend without gaps, micro-batches of a batch are adjacent, rows once."""
    indexes = [b for b, _ in got]
    assert indexes == sorted(indexes)
    assert sorted(set(indexes)) == list(range(len(set(indexes))))
    assert sorted(r for _, rows in got for r in rows) == list(range(n))
    per_batch: dict[int, int] = {}
    for b, rows in got:
        per_batch[b] = per_batch.get(b, 0) + len(rows)
        assert len(rows) <= 3
    assert all(size <= 4 for size in per_batch.values())


@pytest.mark.parametrize(
    ("num_workers", "context"),
    [(0, None), (1, "fork"), (2, "fork"), (1, "spawn"), (2, "spawn")],
)
def test_loader_yields_every_batch_once_in_order(
    address: str, client: tq.Client, num_workers: int, context: str | None
) -> None:
    pid = f"order-{num_workers}-{context}"
    _put(client, pid)
    loader = StreamingDataLoader(
        _dataset(address, pid, "train"),
        num_workers=num_workers,
        multiprocessing_context=context,
    )
    first = _read(loader)
    _check_stream(first)
    assert loader.state_dict()["batch_index"] == 6
    if context == "spawn":
        return  # spawned workers take seconds to start: one pass is enough here
    # Replay: workers are new processes, yet every batch_index resolves to the same rows.
    assert _read(loader) == []  # sealed and drained: a new pass ends at once
    loader.reset()
    assert _read(loader) == first
    assert client.partition_info(pid)["consumed"]["train"] == N_ROWS


def test_workers_hand_over_ready_batches_together_in_order(address: str, client: tq.Client) -> None:
    """A worker hands the loader its ready batches (w, w + W, ...) a few at a time; the loader
    still yields them in batch_index order. Batches over the hand-off's byte bound go alone."""
    pid = "grouped"
    client.put({"x": torch.arange(64)}, partition_id=pid)
    client.seal(pid)

    def loader(**kwargs: Any) -> StreamingDataLoader:
        ds = StreamingDataset(address, ["x"], 4, 4, pid, "train")
        return StreamingDataLoader(
            ds, num_workers=2, multiprocessing_context="fork", timeout=60, **kwargs
        )

    def hand_offs(lo: StreamingDataLoader) -> list[list[int | str]]:
        # a worker's last hand-off says where its stream ended ("end N")
        return [
            [b.batch_index for b in got] + ([] if got.end is None else [f"end {got.end}"])
            for got in DataLoader.__iter__(lo)
        ]

    # sealed: everything is ready, so a hand-off holds prefetch_factor batches (2 by default)
    default = loader()
    pairs = [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert hand_offs(default) == [*pairs, ["end 16"], ["end 17"]]
    assert default.prefetch_factor == 1  # torch's: one hand-off a worker at a time
    assert hand_offs(loader(prefetch_factor=8)) == [
        [0, 2, 4, 6, 8, 10, 12, 14],
        [1, 3, 5, 7, 9, 11, 13, 15],
        ["end 16"],
        ["end 17"],
    ]
    got = [(meta.batch_index, td["x"].tolist()) for td, meta in loader()]
    assert got == [(b, list(range(4 * b, 4 * b + 4))) for b in range(16)]

    big = "grouped-big"
    client.put({"x": torch.zeros(8, 40_000, dtype=torch.int64)}, partition_id=big)  # 1.3 MB
    client.seal(big)  # 4-row batches of 1.3 MB: over the bound, one per hand-off
    big_loader = StreamingDataLoader(
        StreamingDataset(address, ["x"], 4, 4, big, "train"),
        num_workers=2,
        multiprocessing_context="fork",
        timeout=60,
    )
    assert hand_offs(big_loader) == [[0], [1], ["end 2"], ["end 3"]]


def test_a_numpy_prefetch_factor_is_taken_as_its_int(address: str) -> None:
    """``prefetch_factor=np.int64(3)`` (a config's value) was not recognised as a count: the
    loader skipped its hand-offs and passed the numpy value on to torch's read-ahead."""
    ds = StreamingDataset(address, ["x"], 4, 4, "np-prefetch", "train")
    loader = StreamingDataLoader(
        ds, num_workers=2, multiprocessing_context="fork", prefetch_factor=np.int64(3)
    )
    assert ds._handoff_batches == 3
    assert type(ds._handoff_batches) is int
    assert loader.prefetch_factor == 1  # one hand-off a worker at a time, as for an int


def test_a_loader_takes_no_more_rows_ahead_than_torchs_read_ahead(
    address: str, client: tq.Client
) -> None:
    """Ranks sharing a task's rows (no ``dp_size``, TransferQueue's tutorial 06): one rank's
    loader that stops after 5 batches has decided at most those, what its workers fetch
    ahead (num_workers x prefetch_factor batches) and what it holds to keep the order; the
    other rank still gets its 5 batches. (Hand-offs of 8 ready batches once took all 40 rows
    here and starved the second rank.)"""
    pid = "read-ahead"
    client.put({"x": torch.arange(40)}, partition_id=pid)  # not sealed: a streaming task

    def five(dp_rank: int) -> list[int]:
        ds = StreamingDataset(address, ["x"], 2, 2, pid, "train", dp_rank=dp_rank)
        loader = StreamingDataLoader(ds, num_workers=2, multiprocessing_context="fork", timeout=60)
        got: list[int] = []
        for td, _ in loader:
            got += td["x"].tolist()
            if len(got) == 10:
                break
        del loader  # its workers stop
        return got

    first = five(0)
    consumed = client.partition_info(pid)["consumed"]["train"]
    # 5 delivered + 2 workers x 2 fetched ahead + at most 3 held for order = 12 batches
    assert len(first) == 10
    assert consumed <= 24
    second = five(1)
    assert len(second) == 10
    assert not set(first) & set(second)


def test_a_worker_fetches_its_ready_hand_off_in_one_request() -> None:
    """Two fork workers, torch's default prefetch_factor (2), 16 ready batches: each worker
    hands over 4 items of 2 batches, each fetched in one request (``get_batches``), then asks
    once more and meets the end: 10 requests, not one a batch."""
    registry = CollectorRegistry()
    labels = {"op": "GetMeta", "outcome": "ok", "service": "controller"}
    with tq.background_cluster(num_storage_units=1, metrics_registry=registry) as cluster:
        with tq.Client.connect(cluster.address) as client:
            client.put({"x": torch.arange(64)}, partition_id="p")
            client.seal("p")
        before = registry.get_sample_value("tq_requests_total", labels) or 0
        ds = StreamingDataset(cluster.address, ["x"], 4, 4, "p", "train")
        loader = StreamingDataLoader(ds, num_workers=2, multiprocessing_context="fork", timeout=60)
        got = [td["x"].tolist() for td, _ in loader]
        assert got == [list(range(i, i + 4)) for i in range(0, 64, 4)]
    # (read once the cluster's thread is joined: a request is counted after its reply went
    # out, so the last one's count may still be on its way when the loader has its answer)
    assert registry.get_sample_value("tq_requests_total", labels) == before + 10


def test_a_worker_never_waits_to_fill_a_hand_off(address: str, client: tq.Client) -> None:
    """While later batches have no rows yet, a worker hands over the batch it has: the loader
    yields batch 0 before any other row exists (a hang here would end in DataLoader's
    timeout)."""
    pid = "grouped-streaming"
    client.put({"x": torch.arange(4)}, partition_id=pid)
    loader = StreamingDataLoader(
        StreamingDataset(address, ["x"], 4, 4, pid, "train"),
        num_workers=2,
        multiprocessing_context="fork",
        timeout=60,
    )
    it = iter(loader)
    td, meta = next(it)
    assert (meta.batch_index, td["x"].tolist()) == (0, [0, 1, 2, 3])
    client.put({"x": torch.arange(4, 14)}, partition_id=pid)
    client.seal(pid)
    rest = [(meta.batch_index, td["x"].tolist()) for td, meta in it]
    assert rest == [(1, [4, 5, 6, 7]), (2, [8, 9, 10, 11]), (3, [12, 13])]
    assert client.partition_info(pid)["consumed"]["train"] == 14


def test_loader_resumes_mid_batch_with_workers(address: str, client: tq.Client) -> None:
    _put(client, "resume")
    loader = StreamingDataLoader(
        _dataset(address, "resume", "train"), num_workers=2, multiprocessing_context="fork"
    )
    taken = []
    for item in _checked(loader):
        taken.append(item)
        if len(taken) == 5:  # batches 0 and 1, then the first micro-batch of batch 2
            break
    state = msgspec.json.decode(msgspec.json.encode(loader.state_dict()))
    assert (state["batch_index"], state["micro_batch_index"]) == (2, 1)
    again = StreamingDataLoader(
        _dataset(address, "resume", "train"), num_workers=2, multiprocessing_context="fork"
    )
    again.load_state_dict(state)
    rest = _read(again)
    assert rest[0] == (2, [11])
    _check_stream(taken + rest)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_auto_clear_task_resumes_a_loader_left_mid_batch_with_every_row(
    address: str, client: tq.Client, num_workers: int
) -> None:
    """Auto-clear frees a row once the task acknowledged it. A loader left in the middle of
    batch 1 (its workers had fetched batches ahead) resumes at that micro-batch and delivers
    every row: only the batches delivered whole were acknowledged (before: every batch was
    acknowledged as a worker read it, and the resumed loader got RowsNotFound)."""
    pid = f"auto-clear-{num_workers}"
    client.register_tasks(["train"], pid)
    client.put({"x": torch.arange(32)}, partition_id=pid)
    client.seal(pid)

    def loader() -> StreamingDataLoader:
        ds = StreamingDataset(address, ["x"], 4, 2, pid, "train")
        if not num_workers:
            return StreamingDataLoader(ds)
        return StreamingDataLoader(ds, num_workers=num_workers, multiprocessing_context="fork")

    first = loader()
    got: list[int] = []
    for td, _ in first:
        got += td["x"].tolist()
        if len(got) == 6:  # batch 0, then half of batch 1
            break
    state = first.state_dict()
    del first  # its workers stop
    assert (state["batch_index"], state["micro_batch_index"]) == (1, 1)
    assert client.partition_info(pid)["rows"] == 28  # batch 0 was delivered, then freed
    again = loader()
    again.load_state_dict(state)
    got += [r for td, _ in again for r in td["x"].tolist()]
    assert got == list(range(32))
    assert client.partition_info(pid)["rows"] == 0  # every row delivered, then freed


def test_state_dict_resumes_in_a_new_process(address: str, client: tq.Client) -> None:
    _put(client, "newproc")
    ds = _dataset(address, "newproc", "train")
    taken = []
    for item in _checked(ds):  # plain iteration: no DataLoader at all
        taken.append(item)
        if len(taken) == 3:
            break
    state = msgspec.msgpack.decode(msgspec.msgpack.encode(ds.state_dict()))
    assert (state["batch_index"], state["micro_batch_index"]) == (1, 1)
    kwargs = {
        "address": address,
        "data_fields": ["x", "jag", "s"],
        "batch_size": 4,
        "micro_batch_size": 3,
        "partition_id": "newproc",
        "task_name": "train",
    }
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        out = pool.submit(resume_and_read, kwargs, state).result(timeout=90)
    *rest, (_, end_state) = out
    assert rest[0][:2] == (1, [7])
    assert all(x == rows for _, rows, x in rest)
    _check_stream(taken + [(b, rows) for b, rows, _ in rest])
    assert end_state["batch_index"] == 6


def test_step_and_reset_reach_the_workers(address: str, client: tq.Client) -> None:
    _put(client, "step@0")
    _put(client, "step@1", 8)
    loader = StreamingDataLoader(
        _dataset(address, "step@0", "train"), num_workers=2, multiprocessing_context="fork"
    )
    first = _read(loader)
    _check_stream(first)
    loader.step("step@1")
    assert [b for b, _ in _read(loader)] == [0, 0, 1, 1]
    # reset inside a pass: the pass carries on from batch 0 with new workers
    loader.step("step@0")
    seen = []
    for _, meta in loader:
        seen.append((meta.batch_index, list(meta.global_indexes)))
        if len(seen) == 3:
            loader.reset()
    assert seen[3:] == first


def test_stop_when_consumed_across_workers(address: str, client: tq.Client) -> None:
    _put(client, "unsealed", 16, seal=False)
    loader = StreamingDataLoader(
        _dataset(address, "unsealed", "train", stop_when_consumed=True),
        num_workers=2,
        multiprocessing_context="fork",
    )
    got = _read(loader)
    _check_stream(got, 16)


def test_dataset_pickles_without_its_connection(address: str, client: tq.Client) -> None:
    _put(client, "pickle", 8)
    ds = _dataset(address, "pickle", "train")
    assert len(_read(ds)) == 4
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._local is None
    assert copy.state_dict() == ds.state_dict()
    copy.reset()
    assert [b for b, _ in _read(copy)] == [0, 0, 1, 1]


def test_plain_dataloader_with_workers_is_refused(address: str, client: tq.Client) -> None:
    _put(client, "plain", 8)
    plain = DataLoader(
        _dataset(address, "plain", "train"),
        batch_size=None,
        num_workers=2,
        multiprocessing_context="fork",
    )
    with pytest.raises(tq.InvalidRequestError, match="StreamingDataLoader"):
        next(iter(plain))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_prefetch_factor_that_is_not_a_positive_count_is_refused_when_built(
    address: str, bad: Any
) -> None:
    """The loader reads ``prefetch_factor`` itself (its hand-offs' size): a value that is not
    a positive count was passed on to torch as it was, and failed only at the first batch
    (0: an AssertionError, 1.5: a TypeError) or was taken as 1 (True)."""
    ds = StreamingDataset(address, ["x"], 4, 4, "bad-prefetch", "train")
    with pytest.raises(tq.InvalidRequestError, match="prefetch_factor"):
        StreamingDataLoader(ds, num_workers=2, prefetch_factor=bad)


def test_len_of_a_loader_says_why_it_has_none(address: str) -> None:
    """``len(loader)`` (a schedule's total steps, a progress bar) failed with torch's "object
    of type 'StreamingDataset' has no len()", saying neither why nor what to do. It is still
    a TypeError (progress bars and trainers catch it: unknown length), and a TQError that
    says so."""
    loader = StreamingDataLoader(StreamingDataset(address, ["x"], 4, 4, "no-len", "train"))
    with pytest.raises(tq.TQError, match="sealed") as info:
        len(loader)
    assert isinstance(info.value, TypeError)


def test_loader_refuses_arguments_that_break_order(address: str) -> None:
    ds = _dataset(address, "any", "train")
    with pytest.raises(tq.InvalidRequestError, match="batch_size"):
        StreamingDataLoader(ds, batch_size=4)
    with pytest.raises(tq.InvalidRequestError, match="persistent_workers"):
        StreamingDataLoader(ds, num_workers=1, persistent_workers=True)
    with pytest.raises(tq.InvalidRequestError, match="in_order"):
        StreamingDataLoader(ds, num_workers=1, in_order=False)
    with pytest.raises(tq.InvalidRequestError, match="StreamingDataset"):
        StreamingDataLoader([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(tq.InvalidRequestError, match="address"):
        StreamingDataset(None, ["x"], 4, 2, "p", "t")  # type: ignore[arg-type]


def test_plain_iteration_follows_reset_mid_pass(address: str, client: tq.Client) -> None:
    _put(client, "plain-reset", 8)
    ds = _dataset(address, "plain-reset", "train")
    seen = []
    for _, meta in ds:
        seen.append(meta.batch_index)
        if len(seen) == 3:
            ds.reset()
    assert seen == [0, 0, 1, 0, 0, 1, 1]
    assert ds.state_dict()["batch_index"] == 2


_SHARES = [4, 0, 3]  # rows of this rank's batch b: batch 1 is an empty share, then the end


async def _scripted_fetch(*, batch_index: int, sampling_config: dict[str, Any], **_: Any) -> Any:
    """A fetch_batch_fn (module level: workers import it) that needs no controller."""
    assert sampling_config["dp_size"] == 2
    assert "tail" not in sampling_config  # the controller's default (or the sampler's)
    if batch_index >= len(_SHARES):
        return None, tq.BatchMeta(
            partition_id="p", global_indexes=[], field_names=[], units=[], end_of_stream=True
        )
    start = sum(_SHARES[:batch_index])
    rows = list(range(start, start + _SHARES[batch_index]))
    meta = tq.BatchMeta(
        partition_id="p",
        global_indexes=rows,
        field_names=["x"],
        units=[0] * len(rows),
        batch_index=batch_index,
    )
    return TensorDict({"x": torch.tensor(rows, dtype=torch.int64)}, [len(rows)]), meta


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_delivers_an_empty_share_as_one_micro_batch(address: str, num_workers: int) -> None:
    ds = StreamingDataset(
        address, ["x"], 4, 2, "p", "train", dp_rank=1, dp_size=2, fetch_batch_fn=_scripted_fetch
    )
    context = "fork" if num_workers else None
    loader = StreamingDataLoader(ds, num_workers=num_workers, multiprocessing_context=context)
    got = [(meta.batch_index, list(meta.global_indexes), len(td)) for td, meta in loader]
    assert got == [(0, [0, 1], 2), (0, [2, 3], 2), (1, [], 0), (2, [4, 5], 2), (2, [6], 1)]
    assert loader.state_dict()["batch_index"] == 3
    assert loader.state_dict()["dp_size"] == 2
    loader.load_state_dict({**loader.state_dict(), "batch_index": 1, "micro_batch_index": 0})
    assert [m.batch_index for _, m in loader] == [1, 2, 2]
    with pytest.raises(tq.InvalidRequestError, match="dp_rank 2 is out of range"):
        StreamingDataset(address, ["x"], 4, 2, "p", "train", dp_rank=2, dp_size=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_error_the_controller_reports_ends_the_iteration(
    address: str, client: tq.Client, num_workers: int
) -> None:
    """A permanent error (here: an uneven tail under tail='error') is raised, not waited on."""
    pid = f"tail-error-{num_workers}"
    _put(client, pid, n=21)  # global batches of 2 x 4: 8, 8, then 5 rows that do not split
    ds = _dataset(address, pid, "train", dp_rank=0, dp_size=2, tail="error")
    context = "fork" if num_workers else None
    loader = StreamingDataLoader(ds, num_workers=num_workers, multiprocessing_context=context)
    got: list[int] = []

    def read_all() -> None:
        got.extend(meta.batch_index for _, meta in loader)

    with pytest.raises(tq.InvalidRequestError, match="do not split evenly over dp_size=2"):
        read_all()
    assert sorted(set(got)) == [0, 1]  # the whole batches came first


#: set by the test in this process: a forked worker inherits it, a spawned one imports anew
_PARENT_STATE: list[str] = []


def _expect_start_method(forked: bool, _worker_id: int) -> None:
    if bool(_PARENT_STATE) != forked:
        raise AssertionError(f"the worker was {'not ' if forked else ''}forked")


def test_loader_workers_start_with_the_platforms_default_method(
    address: str, client: tq.Client
) -> None:
    """No ``multiprocessing_context``: workers start as torch's do, with the platform's
    default method (``fork`` on Linux up to Python 3.13): the worker sees the parent's state."""
    pid = "default-start"
    _put(client, pid)
    _PARENT_STATE.append("set after import")
    try:
        forked = multiprocessing.get_start_method() == "fork"
        loader = StreamingDataLoader(
            _dataset(address, pid, "train"),
            num_workers=2,
            worker_init_fn=functools.partial(_expect_start_method, forked),
            timeout=60,
        )
        _check_stream(_read(loader))
    finally:
        _PARENT_STATE.clear()


def _die_once_in_a_worker(parent: int, marker: Any) -> None:
    """SIGKILL this process if it is a DataLoader worker (not ``parent``) and no worker died
    before (``marker``, a file, is created by the one that does)."""
    import os
    import signal

    if os.getpid() == parent:
        return
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return  # one worker dies, once
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_holding_a_hand_off_of_several_batches_loses_none(
    address: str, client: tq.Client, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker SIGKILLed after fetching a hand-off of several batches (recorded, never
    delivered) ends the pass with torch's error; a loader resumed from the position reads
    every row once, in order: the dead worker's batches are re-read by their batch_index."""
    import os

    from tq_async._datasets import _torch as td_mod

    pid = "grouped-kill"
    client.put({"x": torch.arange(64)}, partition_id=pid)
    client.seal(pid)
    parent, marker = os.getpid(), tmp_path / "killed"
    ready_group = td_mod._ready_group

    def dying(host: Any, ads: Any, first: Any, most: int) -> Any:
        group = ready_group(host, ads, first, most)
        if len(group) > 1:
            _die_once_in_a_worker(parent, marker)
        return group

    monkeypatch.setattr(td_mod, "_ready_group", dying)

    def loader() -> StreamingDataLoader:
        ds = StreamingDataset(address, ["x"], 4, 4, pid, "train")
        # the loader's timeout bounds how long torch takes to see the dead worker when its
        # SIGCHLD lands on another thread than the one waiting for the worker's queue
        return StreamingDataLoader(ds, num_workers=2, multiprocessing_context="fork", timeout=10)

    first = loader()
    got: list[tuple[int, list[int]]] = []

    def drain() -> None:
        for td, meta in first:
            got.append((meta.batch_index, td["x"].tolist()))

    with pytest.raises(RuntimeError, match="DataLoader worker"):
        drain()
    assert marker.exists()
    again = loader()
    again.load_state_dict(first.state_dict())
    got += [(meta.batch_index, td["x"].tolist()) for td, meta in again]
    assert got == [(b, list(range(4 * b, 4 * b + 4))) for b in range(16)]
    assert client.partition_info(pid)["consumed"]["train"] == 64


def test_the_same_loader_iterated_again_after_a_worker_died_reads_every_row_once(
    address: str, client: tq.Client, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the loader's docstring promises of a worker that dies (SIGKILL, OOM): the pass
    ends with torch's RuntimeError, and iterating the same loader again re-reads what the
    dead worker fetched, by batch_index: every row once, in order."""
    from tq_async._datasets import _torch as td_mod

    pid = "killed-then-again"
    client.put({"x": torch.arange(32)}, partition_id=pid)
    client.seal(pid)
    parent, marker = os.getpid(), tmp_path / "killed"
    next_batch = td_mod._next_batch

    def dying(host: Any, ads: Any, ahead: int, loader: Any) -> Any:
        got = next_batch(host, ads, ahead, loader)
        if got is not None and got.batch_index >= 3:
            _die_once_in_a_worker(parent, marker)
        return got

    monkeypatch.setattr(td_mod, "_next_batch", dying)
    ds = StreamingDataset(address, ["x"], 4, 2, pid, "train")
    loader = StreamingDataLoader(ds, num_workers=2, multiprocessing_context="fork", timeout=10)
    got: list[int] = []

    def drain() -> None:
        for td, _ in loader:
            got.extend(td["x"].tolist())

    with pytest.raises(RuntimeError, match="DataLoader worker"):
        drain()
    assert marker.exists()
    drain()
    assert got == list(range(32))


def test_a_worker_killed_while_handing_over_fails_the_loader_and_a_resume_reads_every_row(
    address: str, client: tq.Client, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # batches over 1 MiB go to the loader as one shared-memory buffer (tq_async._datasets._handoff);
    # a worker SIGKILLed right after allocating it ends the pass with torch's error (no hang),
    # and a loader resumed from the position reads every row once
    import os

    from tq_async._datasets import _handoff

    n, width = 12, 70_000  # 4-row batches of ~1.1 MB
    client.put(
        {
            "x": torch.arange(n),
            "jag": torch.nested.nested_tensor(
                [torch.full((width + i,), float(i)) for i in range(n)], layout=torch.jagged
            ),
        },
        partition_id="handoff-kill",
    )
    client.seal("handoff-kill")
    parent, marker = os.getpid(), tmp_path / "killed"
    allocate = _handoff._shared_bytes

    def dying(nbytes: int) -> torch.Tensor:
        buffer = allocate(nbytes)
        _die_once_in_a_worker(parent, marker)
        return buffer

    monkeypatch.setattr(_handoff, "_shared_bytes", dying)

    def loader() -> StreamingDataLoader:
        ds = StreamingDataset(address, ["x", "jag"], 4, 4, "handoff-kill", "train")
        return StreamingDataLoader(ds, num_workers=2, multiprocessing_context="fork", timeout=60)

    first = loader()
    got: list[tuple[int, list[int]]] = []

    def drain() -> None:
        for _, meta in first:
            got.append((meta.batch_index, list(meta.global_indexes)))

    with pytest.raises(RuntimeError, match="DataLoader worker"):
        drain()
    assert marker.exists()
    again = loader()
    again.load_state_dict(first.state_dict())
    for td, meta in again:
        rows = list(meta.global_indexes)
        assert td["x"].tolist() == rows
        assert [len(t) for t in td["jag"].unbind()] == [width + r for r in rows]
        got.append((meta.batch_index, rows))
    assert [b for b, _ in got] == [0, 1, 2]
    assert sorted(r for _, rows in got for r in rows) == list(range(n))


ORPHANED_LOADER = """
    import os, sys
    from tq_async._client._sync._client import Client
    from tq_async._datasets._torch import StreamingDataLoader, StreamingDataset

    fetch = Client.get_batches

    def announced(self, *args, **kwargs):
        print("FETCHING", os.getpid(), flush=True)  # in a worker: it waits for rows now
        return fetch(self, *args, **kwargs)

    Client.get_batches = announced
    ds = StreamingDataset(sys.argv[1], ["x"], 4, 4, sys.argv[2], "train")
    for _ in StreamingDataLoader(ds, num_workers=2, multiprocessing_context="fork"):
        pass
"""


def _lines(proc: subprocess.Popen[str], prefix: str, n: int, timeout: float) -> list[str]:
    """The next ``n`` stdout lines of ``proc`` that start with ``prefix`` (bounded wait)."""
    assert proc.stdout is not None
    got: list[str] = []
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while len(got) < n:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"{len(got)} of {n} {prefix!r} lines within {timeout} s")
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the loader exited with {proc.wait(timeout=10)}")
            if line.startswith(prefix):
                got.append(line[len(prefix) :].strip())
    return got


def _exited(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` (not our child) ends within ``timeout`` (waits on its pidfd)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="waits on pidfds (Linux)")
def test_loader_workers_waiting_for_rows_stop_when_the_loader_is_killed(address: str) -> None:
    """A loader SIGKILLed while its workers wait for rows that do not come: the workers stop
    within torch's check interval (before: blocked in their fetch, they outlived it until
    rows came, or until the services went away)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(ORPHANED_LOADER), address, "orphaned"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    workers: list[int] = []
    try:
        workers = sorted({int(pid) for pid in _lines(proc, "FETCHING ", 2, 60)})
        proc.kill()
        proc.wait(timeout=10)
        assert all(_exited(pid, 15) for pid in workers), "a worker outlived its loader"
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("reader", ["dataset", "loader-0", "loader-2"])
def test_a_new_pass_ends_the_one_still_alive_and_no_row_comes_twice(
    address: str, client: tq.Client, reader: str
) -> None:
    """``iter()`` again while an older iterator is alive (kept in a variable, a loop left by an
    exception): both moved one shared position, so the older one delivered the newer one's
    batches again (rows twice to one task) or failed with "a bug: please report it". The
    newer pass ends the older one and goes on from the position; the older one says so."""
    pid = f"two-passes-{reader}"
    client.put({"x": torch.arange(24)}, partition_id=pid)
    client.seal(pid)
    ds = StreamingDataset(address, ["x"], 4, 2, pid, "train")
    if reader == "dataset":
        stream: Iterable[Any] = ds
    else:
        workers = int(reader[-1])
        stream = StreamingDataLoader(
            ds, num_workers=workers, multiprocessing_context="fork" if workers else None
        )
    first = iter(stream)
    got = [next(first) for _ in range(3)]
    second = iter(stream)
    got += list(second)
    with pytest.raises(tq.InvalidRequestError, match="newer one"):
        next(first)
    assert [r for _, meta in got for r in meta.global_indexes] == list(range(24))
    assert [td["x"].tolist() for td, _ in got] == [[r, r + 1] for r in range(0, 24, 2)]


def test_a_new_pass_while_another_thread_is_inside_the_first_is_refused_clearly(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``iter()`` while another thread is inside the first pass's ``next()`` (waiting for
    rows): ending that pass failed with Python's "generator already executing"; now
    InvalidRequestError says why, and the first pass goes on."""
    from threading import Event, Thread

    from tq_async._datasets import _torch as td_mod

    pid = "pass-in-a-thread"
    fetching = Event()
    next_batch = td_mod._next_batch

    def announced(host: Any, ads: Any, ahead: int, loader: Any) -> Any:
        fetching.set()
        return next_batch(host, ads, ahead, loader)

    monkeypatch.setattr(td_mod, "_next_batch", announced)
    loader = StreamingDataLoader(StreamingDataset(address, ["x"], 4, 4, pid, "train"))
    got: list[list[int]] = []
    first = iter(loader)
    reader = Thread(target=lambda: got.extend(td["x"].tolist() for td, _ in first))
    reader.start()
    try:
        assert fetching.wait(60)
        with pytest.raises(tq.InvalidRequestError, match="another thread"):
            iter(loader)
    finally:
        with tq.Client.connect(address) as c:
            c.put({"x": torch.arange(4)}, partition_id=pid)
            c.seal(pid)
        reader.join(timeout=60)
    assert not reader.is_alive()
    assert got == [[0, 1, 2, 3]]


def test_a_workers_end_of_stream_ends_the_pass_when_rows_come_for_another_worker(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop_when_consumed, rows arriving: worker 1 meets the end at batch 1, then rows come and
    worker 0 goes on (its batch 2, deciding batch 1 first for nobody). The loader waited for
    batch 1 while it kept worker 0's batches (unbounded as long as rows came), then failed
    with "a bug: please report it". Now the pass ends at the first end a worker met, the later
    batches stay recorded, and the next pass reads them: every row once, in order."""
    from threading import Thread

    from tq_async._datasets import _torch as td_mod

    pid = "end-then-rows"
    ctx = multiprocessing.get_context("fork")
    ended, rows_in = ctx.Event(), ctx.Event()
    next_batch = td_mod._next_batch

    def paced(host: Any, ads: Any, ahead: int, loader: Any) -> Any:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.id == 0 and ads.batch_index == 2:
            assert rows_in.wait(60), "the rows did not come"
        got = next_batch(host, ads, ahead, loader)
        if got is None and info is not None and info.id == 1:
            ended.set()
        return got

    def put_after_the_end() -> None:
        if ended.wait(60):
            with tq.Client.connect(address) as c:
                c.put({"x": torch.arange(4, 12)}, partition_id=pid)
        rows_in.set()

    monkeypatch.setattr(td_mod, "_next_batch", paced)
    with tq.Client.connect(address) as c:
        c.put({"x": torch.arange(4)}, partition_id=pid)
    ds = StreamingDataset(address, ["x"], 4, 4, pid, "train", stop_when_consumed=True)
    loader = StreamingDataLoader(
        ds, num_workers=2, multiprocessing_context="fork", prefetch_factor=1, timeout=60
    )
    putter = Thread(target=put_after_the_end)
    putter.start()
    try:
        first = [meta.batch_index for _, meta in loader]
    finally:
        rows_in.set()
        ended.set()
        putter.join(timeout=60)
    assert first == [0]
    assert ds.batch_index == 1
    got = [td["x"].tolist() for td, _ in loader]
    assert got == [[4, 5, 6, 7], [8, 9, 10, 11]]
