"""Tensors on devices in and out (``tq_async._paths._device_copy``).

Without a GPU the device logic runs through its seam: ``on_device`` says every tensor is on a
device and a :class:`~tq_async._paths._device_copy.HostCopier` does the copies, so what is moved,
how
jagged tensors and lists of tensors are rebuilt, that a batch may mix devices, that the copies
are waited for off the event loop and that a dataset copies in its prefetching task are all
checked here. The tests marked ``gpu`` run the CUDA copier itself (skipped without CUDA);
``benchmarks/gpu_check.py`` measures it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import pytest
import torch

import tq_async as tq
from tq_async._paths import _device_copy as _devices
from tq_async._paths._device_copy import HostCopier


def _batch(n: int = 16) -> dict[str, Any]:
    return {
        "ids": torch.arange(n * 300).reshape(n, 300),
        "bf": torch.randn(n, 3).to(torch.bfloat16),
        "mask": torch.arange(n * 5).reshape(n, 5) % 3 == 0,
        "jag": torch.nested.nested_tensor(
            [torch.arange(i % 5 + 1, dtype=torch.float32) for i in range(n)], layout=torch.jagged
        ),
        "rows": [torch.full((i % 3 + 1, 2), i) for i in range(n)],
        "s": [f"r{i}" for i in range(n)],
    }


def _check(got: Any, want: dict[str, Any]) -> None:
    for name in ("ids", "bf", "mask"):
        assert got[name].dtype == want[name].dtype
        assert torch.equal(got[name], want[name])
    assert [t.tolist() for t in got["jag"].unbind()] == [t.tolist() for t in want["jag"].unbind()]
    assert [t.tolist() for t in got["rows"].unbind()] == [t.tolist() for t in want["rows"]]
    assert got.get("s").tolist() == want["s"]


@asynccontextmanager
async def _client() -> AsyncIterator[tq.AsyncClient]:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        yield client


class _Recorder(HostCopier):
    """A HostCopier that records the threads it copied on and may hold ``finish``."""

    made: ClassVar[list[_Recorder]] = []

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__(device)
        self.threads: set[int] = set()
        self.gate: threading.Event | None = None
        _Recorder.made.append(self)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        self.threads.add(threading.get_ident())
        return super().to_host(t)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        self.threads.add(threading.get_ident())
        return super().to_device(t)

    def finish(self) -> None:
        if self.gate is not None:
            assert self.gate.wait(10), "the gate was never opened"
        super().finish()


@pytest.fixture
def seam(monkeypatch: pytest.MonkeyPatch) -> list[_Recorder]:
    """Every tensor counts as on a device; copies go through recorders."""
    made: ClassVar[list[_Recorder]] = []
    monkeypatch.setattr(_Recorder, "made", made)
    monkeypatch.setattr(_devices, "on_device", lambda t: True)
    monkeypatch.setattr(_devices, "make_copier", _Recorder)
    return made


async def test_put_stages_device_columns_off_the_loop(seam: list[_Recorder]) -> None:
    want = _batch()
    async with _client() as client:
        meta = await client.put(want, partition_id="p")
        (copier,) = seam  # one device, one copier: every column of the put through it
        # dense x3, jagged (values + offsets), 16 rows of a list: each one copy
        assert copier.copies == 3 + 2 + 16
        assert copier.finished.is_set()
        assert threading.get_ident() not in copier.threads  # copied on a worker thread
        seam.clear()
        _check(await client.get_data(meta), want)  # no device=: nothing copied
        assert seam == []


async def test_the_loop_serves_others_while_a_put_waits_for_its_copies(
    seam: list[_Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()

    def gated(device: torch.device | None = None) -> _Recorder:
        copier = _Recorder(device)
        copier.gate = gate
        return copier

    monkeypatch.setattr(_devices, "make_copier", gated)
    async with _client() as client:
        done = anyio.Event()

        async def put() -> None:
            await client.put(_batch(), partition_id="p")
            done.set()

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(put)
                # the put is waiting for its copies; the loop still answers requests
                await client.list_partitions()
                assert not done.is_set()
                gate.set()
        assert done.is_set()


async def test_get_data_and_get_deliver_on_the_device(seam: list[_Recorder]) -> None:
    want = _batch()
    async with _client() as client:
        meta = await client.put(want, partition_id="p")
        seam.clear()
        _check(await client.get_data(meta, device="cpu"), want)
        (copier,) = seam
        # dense x3 and two jagged columns (values + offsets each): 7 copies
        assert copier.copies == 7
        assert threading.get_ident() not in copier.threads
        td, _ = await client.get(list(want), 16, "p", "t", device="cpu")
        _check(td, want)
        assert len(seam) == 2


async def test_device_cpu_is_host_memory_as_before() -> None:
    want = _batch()
    async with _client() as client:
        meta = await client.put(want, partition_id="p")
        _check(await client.get_data(meta, device="cpu"), want)
        with pytest.raises(tq.InvalidRequestError, match="device must be"):
            await client.get_data(meta, device="no-such-device")


async def test_a_dataset_copies_in_its_prefetching_task(
    seam: list[_Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    second = threading.Event()
    finish = _Recorder.finish

    def note(self: _Recorder) -> None:
        finish(self)
        if len(seam) >= 2 and seam[1].finished.is_set():
            second.set()

    monkeypatch.setattr(_Recorder, "finish", note)
    async with _client() as client:
        for k in range(4):
            await client.put({"x": torch.arange(8) + 8 * k}, partition_id="p")
        await client.seal("p")
        seam.clear()
        ds = tq.AsyncStreamingDataset(client, ["x"], 8, 8, "p", "train", prefetch=2, device="cpu")
        got = []
        async with ds:
            async for td, _ in ds:
                if not got:
                    # the next batch is copied ahead, by the prefetcher, not on demand
                    assert await anyio.to_thread.run_sync(second.wait, 10)
                got.extend(td["x"].tolist())
        assert got == list(range(32))
        assert len(seam) == 4
        assert ds.device == torch.device("cpu")


def test_streaming_dataset_passes_the_device_on() -> None:
    ds = tq.StreamingDataset("tcp://127.0.0.1:1", ["x"], 8, 8, "p", "t", device="cpu")
    assert ds._kwargs["device"] == "cpu"


# ---- on a GPU -------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
async def test_cuda_columns_round_trip_with_mixed_devices() -> None:
    want = _batch()
    sent = {**want, "ids": want["ids"].cuda(), "jag": want["jag"].cuda()}  # bf, mask on host
    async with _client() as client:
        meta = await client.put(sent, partition_id="p")
        _check(await client.get_data(meta), want)
        td = await client.get_data(meta, device="cuda")
        assert td["ids"].is_cuda
        assert td["jag"].is_cuda
        _check(td.to("cpu"), want)


@pytest.mark.gpu
@needs_cuda
async def test_a_cuda_put_does_not_hold_the_loop_for_its_copies() -> None:
    x = torch.randn(256, 1 << 16, device="cuda")  # 64 MiB
    lags: list[float] = []
    async with _client() as client:
        stop = anyio.Event()

        async def probe() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                await anyio.lowlevel.checkpoint()
                lags.append(time.perf_counter() - t0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(probe)
            for _ in range(5):
                await client.put({"x": x}, partition_id="p")
            stop.set()
    # the loop-lag probe measures how long the loop was held by anything else
    assert max(lags) < 0.05, max(lags)


def test_a_cuda_device_in_a_dataloader_worker_is_refused() -> None:
    ds = tq.StreamingDataset("tcp://127.0.0.1:1", ["x"], 8, 8, "p", "t", device="cuda")
    loader = tq.StreamingDataLoader(ds, num_workers=1)
    with pytest.raises(tq.InvalidRequestError, match="CUDA does not survive a fork"):
        next(iter(loader))


def test_the_blocking_client_copies_device_columns_in_the_calling_thread(
    seam: list[_Recorder],
) -> None:
    # the same paths as the async client's, through to_host_now / to_device_now: no thread
    want = _batch()
    with (
        tq.background_cluster(num_storage_units=1) as cluster,
        tq.Client.connect(cluster.address) as client,
    ):
        meta = client.put(want, partition_id="p")
        (copier,) = seam
        assert copier.copies == 3 + 2 + 16
        assert copier.finished.is_set()
        assert copier.threads == {threading.get_ident()}
        seam.clear()
        _check(client.get_data(meta, device="cpu"), want)
        (copier,) = seam
        assert copier.copies == 7
        assert copier.threads == {threading.get_ident()}


@pytest.mark.gpu
@needs_cuda
async def test_a_dataset_on_cuda_yields_cuda_batches_in_order() -> None:
    async with _client() as client:
        for k in range(4):
            await client.put({"x": (torch.arange(8) + 8 * k).cuda()}, partition_id="p")
        await client.seal("p")
        ds = tq.AsyncStreamingDataset(client, ["x"], 8, 8, "p", "train", prefetch=2, device="cuda")
        got = []
        async with ds:
            async for td, _ in ds:
                assert td["x"].is_cuda
                got.extend(td["x"].tolist())
    assert got == list(range(32))


@pytest.mark.gpu
@needs_cuda
def test_the_blocking_client_round_trips_cuda_columns() -> None:
    want = _batch()
    sent = {**want, "ids": want["ids"].cuda(), "jag": want["jag"].cuda()}
    with (
        tq.background_cluster(num_storage_units=1) as cluster,
        tq.Client.connect(cluster.address) as client,
    ):
        meta = client.put(sent, partition_id="p")
        td = client.get_data(meta, device="cuda")
        assert td["ids"].is_cuda
        assert td["bf"].is_cuda
        _check(td.to("cpu"), want)


async def test_jagged_reads_on_a_device_keep_their_bounds_and_shared_lengths(
    seam: list[_Recorder],
) -> None:
    # what a host read gives (rows padded to the longest row, fields of equal lengths on one
    # ragged dimension) holds on the device too; the shared offsets are copied once
    want = {"a": torch.arange(64).view(16, 4), "b": torch.ones(16, 4, dtype=torch.int64)}
    want["jag"] = _batch()["jag"]
    async with _client() as client:
        meta = await client.put(want, partition_id="p")
        seam.clear()
        got = await client.get_data(meta, nested=True, device="cpu")
        (copier,) = seam
        assert copier.copies == 2 + 1 + 2  # a's and b's values, their offsets, jag's two
        assert (got["a"] + got["b"]).to_padded_tensor(0).tolist() == (want["a"] + 1).tolist()
        assert got["jag"].to_padded_tensor(-1).shape == (16, 5)  # its longest row, not all
        assert got["a"]._max_seqlen == 4


@pytest.mark.gpu
@needs_cuda
async def test_jagged_micro_batches_on_cuda_keep_values_and_offsets_together() -> None:
    lengths = [1, 9, 2, 2, 3, 1, 1, 4]
    rows = {
        "ids": torch.nested.nested_tensor(
            [torch.arange(n) + 10 * i for i, n in enumerate(lengths)], layout=torch.jagged
        )
    }
    async with _client() as client:
        await client.put(rows, partition_id="p")
        await client.seal("p")
        ds = tq.AsyncStreamingDataset(client, ["ids"], 8, 4, "p", "train", device="cuda")
        got = []
        async with ds:
            async for td, _ in ds:
                assert td["ids"].is_cuda
                assert td["ids"].offsets().is_cuda
                got.append(td["ids"].to_padded_tensor(-1).shape)
                got.extend(t.tolist() for t in td["ids"].unbind())
    want = [(torch.arange(n) + 10 * i).tolist() for i, n in enumerate(lengths)]
    assert got == [(4, 9), *want[:4], (4, 4), *want[4:]]


# ---- on a GPU: a storage unit's device arena (CUDA IPC between processes) -------------------


def _device_stats(client: tq.Client) -> dict[str, int]:
    (stats,) = client.storage_stats().values()
    return {k: v for k, v in stats.items() if k.startswith("device_")}


@pytest.mark.gpu
@needs_cuda
def test_cuda_columns_move_device_to_device_through_a_units_device_arena() -> None:
    from _cluster_proc import serve_cluster

    want = _batch(64)
    big = torch.randn(64, 4096, device="cuda")  # 1 MiB: device to device
    sent = {**want, "ids": want["ids"].cuda(), "jag": want["jag"].cuda(), "big": big}
    with (
        serve_cluster(storage_units=1, args=["--device-cap", str(64 << 20)]) as address,
        tq.Client.connect(address) as client,
    ):
        meta = client.put(sent, partition_id="ipc")
        stats = _device_stats(client)
        assert stats["device_puts"] == 1
        assert stats["device_bytes"] >= big.nbytes + want["ids"].nbytes
        td = client.get_data(meta, device="cuda")
        assert td["big"].is_cuda
        assert td["ids"].is_cuda
        assert torch.equal(td["big"], big)
        _check(td.to("cpu"), want)
        assert _device_stats(client)["device_reads"] == 1
        host = client.get_data(meta)  # host tensors: the unit copies its cells out
        assert not host["big"].is_cuda
        assert torch.equal(host["big"], big.cpu())
        _check(host, want)
        client.clear_partition("ipc")
        # (what the unit holds now: the device grant it lent ahead of the next put)
        held = client._links.same_host_units.spare_bytes(device=True)
        assert _device_stats(client)["device_bytes"] == held


@pytest.mark.gpu
@needs_cuda
def test_big_jagged_cuda_columns_move_through_a_units_device_arena() -> None:
    from _cluster_proc import serve_cluster

    rows = [torch.randn(i % 7, 1024, device="cuda").to(torch.bfloat16) for i in range(64)]
    jag = torch.nested.nested_tensor(rows, layout=torch.jagged)  # ~384 KiB of values
    with (
        serve_cluster(storage_units=2, args=["--device-cap", str(64 << 20)]) as address,
        tq.Client.connect(address) as client,
    ):
        meta = client.put({"j": jag}, partition_id="jag")
        assert sum(s["device_puts"] for s in client.storage_stats().values()) >= 1
        order = list(range(63, -1, -2)) + list(range(0, 64, 2))
        sub = meta.select_rows(order)
        want = [rows[meta.global_indexes[i]] for i in order]
        for device in ("cuda", None):
            got = client.get_data(sub, device=device)["j"]
            assert got.is_nested
            assert got.is_cuda == (device == "cuda")
            for g, w in zip(got.unbind(), want, strict=True):
                assert torch.equal(g.cpu().view(torch.int16), w.cpu().view(torch.int16))
        client.clear_partition("jag")


@pytest.mark.gpu
@needs_cuda
def test_rows_put_from_a_gpu_outlive_their_producer() -> None:
    """Unlike torch's CUDA IPC (the producer keeps the tensor alive), the unit owns the cells:
    a producer that exits after its put takes nothing with it."""
    import multiprocessing

    from _cluster_proc import put_cuda_and_exit, serve_cluster

    with serve_cluster(storage_units=1, args=["--device-cap", str(64 << 20)]) as address:
        child = multiprocessing.get_context("spawn").Process(
            target=put_cuda_and_exit, args=(address,)
        )
        child.start()
        child.join(120)
        assert child.exitcode == 0
        with tq.Client.connect(address) as client:
            assert _device_stats(client)["device_puts"] == 1
            td, _ = client.get(["x"], 64, "gone", "t", device="cuda")
            assert td["x"].is_cuda
            want = torch.arange(64 * 4096, dtype=torch.float32).reshape(64, 4096)
            assert torch.equal(td["x"].cpu(), want)


@pytest.mark.gpu
@needs_cuda
async def test_a_dataset_on_cuda_reads_out_of_a_units_device_arena() -> None:
    from _cluster_proc import serve_cluster

    x = torch.arange(64 * 4096, device="cuda").reshape(64, 4096)
    with serve_cluster(storage_units=1, args=["--device-cap", str(64 << 20)]) as address:
        async with tq.AsyncClient.connect(address) as client:
            await client.put({"x": x}, partition_id="ds")
            await client.seal("ds")
            ds = tq.AsyncStreamingDataset(client, ["x"], 16, 8, "ds", "t", device="cuda")
            got = []
            async with ds:
                async for td, _ in ds:
                    assert td["x"].is_cuda
                    got.append(td["x"])
            assert torch.equal(torch.cat(got), x)
            (stats,) = (await client.storage_stats()).values()
            assert stats["device_reads"] == 4
