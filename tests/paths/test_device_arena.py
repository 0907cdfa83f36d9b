"""Device arenas (``tq_async._paths._device``): a storage unit owns device memory, clients on its
host
put dense GPU columns into it and read them out device to device.

Without a GPU the arena is emulated (``TQ_ASYNC_GPU_EMULATE=1``: host memory a client maps,
and dense CPU columns count as device columns), which runs the whole protocol — grants,
spans, pins, releases on death, fallbacks — across real processes. ``tests/paths/test_devices.py``
has the CUDA versions (marked ``gpu``).
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
from collections.abc import Iterator
from functools import partial
from typing import Any

import anyio
import numpy as np
import pytest
import torch

import tq_async as tq
from _cluster_proc import serve_cluster
from _shm_proc import device_alloc_then_die, device_read_then_stop
from tq_async._paths import _cuda
from tq_async._paths._device import EMULATE_ENV, DeviceArena, DeviceCells, HostMemory
from tq_async._paths._shm import Arena
from tq_async._storage._cells import OverBudget, StorageState
from tq_async._storage._server import StorageServer
from tq_async._wire._columns import ColumnHeader
from tq_async._wire._protocol import StorePut

pytestmark = pytest.mark.skipif(
    not hasattr(os, "memfd_create") or not hasattr(os, "pidfd_open"), reason="Linux only"
)

CAP = 64 << 20


@pytest.fixture
def emulate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EMULATE_ENV, "1")


def _batch(n: int = 32) -> dict[str, Any]:
    return {
        "ids": torch.arange(n * 4096, dtype=torch.int64).reshape(n, 4096),  # 32 KiB a row
        "bf": torch.randn(n, 2048).to(torch.bfloat16),
        "mask": torch.arange(n * 65536).reshape(n, 65536) % 3 == 0,
        "small": torch.arange(n, dtype=torch.float32),  # under the device threshold
        "jag": torch.nested.nested_tensor(
            [torch.arange(i % 5 + 1, dtype=torch.float32) for i in range(n)], layout=torch.jagged
        ),
        "s": [f"row-{i}" for i in range(n)],
    }


def _same(td: Any, batch: dict[str, Any]) -> None:
    for k in ("ids", "bf", "mask", "small"):
        assert td[k].dtype == batch[k].dtype
        assert torch.equal(td[k], batch[k]), k
    assert [t.tolist() for t in td["jag"].unbind()] == [t.tolist() for t in batch["jag"].unbind()]
    assert list(td["s"]) == batch["s"]


async def _stats(client: tq.AsyncClient) -> dict[str, int]:
    total: dict[str, int] = {}
    for s in (await client.storage_stats()).values():
        for k, v in s.items():
            if k.startswith("device_"):
                total[k] = total.get(k, 0) + v
    return total


# ---- the unit's state, alone ---------------------------------------------------------------


def _state() -> StorageState:
    state = StorageState(arena=Arena(8 << 20))
    state.device = DeviceArena(HostMemory(0, 8 << 20))
    return state


def _device_put(state: StorageState, rows: list[int], values: np.ndarray) -> None:
    """Put ``values`` (int64 [n, k]) of field "x" as device cells (as a client would)."""
    device = state.device
    assert device is not None
    region = device.alloc(values.nbytes)
    assert region is not None
    device.memory.write(region.offset, values.tobytes())
    header = ColumnHeader("x", "dense", "int64", (values.shape[1],))
    state.put("p", rows, [header], [], device=(region, {0: (region.offset, values.nbytes)}))
    device.release(region)  # the grant's reference


def test_device_cells_are_read_where_they_are_or_copied_out() -> None:
    state = _state()
    values = np.arange(8 * 16, dtype=np.int64).reshape(8, 16)
    _device_put(state, list(range(8)), values)
    assert state.device is not None
    assert state.device.live_bytes > 0
    # a reader that takes device spans gets the pieces, in row order
    _, columns = state.get("p", [2, 3, 4, 0], ["x"], device_ok=True)
    pieces = columns[0]
    assert isinstance(pieces, list)
    assert all(isinstance(p, DeviceCells) for p in pieces)
    assert [(p.offset - pieces[0].offset, p.n) for p in pieces] == [(0, 3), (-2 * 128, 1)]
    # any other reader gets host bytes, copied out of the device arena (counted)
    _headers, columns = state.get("p", [2, 3, 4, 0], ["x"])
    host = columns[0]
    assert not isinstance(host, list)
    got = np.asarray(host.data).view(np.int64).reshape(4, 16)  # type: ignore[union-attr]
    assert (got == values[[2, 3, 4, 0]]).all()
    assert state.device.fallbacks == 2


def _device_put_jagged(state: StorageState, rows: list[int], values: list[np.ndarray]) -> None:
    """Put jagged field "j" (rows of float32 [len, 3]) as device cells: the values in the
    arena, the offsets as the column's one frame (as a client would)."""
    device = state.device
    assert device is not None
    flat = np.concatenate(values)
    region = device.alloc(max(flat.nbytes, 1))
    assert region is not None
    device.memory.write(region.offset, flat.tobytes())
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum([len(v) for v in values], out=offsets[1:])
    header = ColumnHeader("j", "jagged", "float32", (3,))
    try:
        state.put(
            "p",
            rows,
            [header],
            [offsets.tobytes()],
            device=(region, {0: (region.offset, flat.nbytes)}),
        )
    finally:
        device.release(region)  # the grant's reference


def _jagged_rows(n: int) -> list[np.ndarray]:
    return [np.arange((i % 4) * 3, dtype=np.float32).reshape(-1, 3) + 100 * i for i in range(n)]


def test_jagged_device_cells_are_read_where_they_are_or_copied_out() -> None:
    state = _state()
    device = state.device
    assert device is not None
    values = _jagged_rows(8)  # row 0 (and 4) is empty
    _device_put_jagged(state, list(range(8)), values)
    order = [5, 6, 7, 0, 2]
    # a reader on this host: the pieces' spans and the rows' offsets joined
    got = state.read_shm("p", order, ["j"], device_ok=True)
    assert got is not None
    stored, _pinned, on_device = got
    assert stored.device_spans is not None
    assert stored.device_offsets is not None
    offsets = np.frombuffer(stored.device_offsets[0] or b"", dtype=np.int64)
    assert np.diff(offsets).tolist() == [len(values[r]) for r in order]
    joined = np.concatenate(
        [device.read(off, n).view(np.float32) for off, n in stored.device_spans[0]]
    )
    assert (joined == np.concatenate([values[r] for r in order]).reshape(-1)).all()
    for region in on_device:
        device.release(region)
    # a reader that takes dense fields only (an older client): the unit copies it out
    got = state.read_shm("p", order, ["j"], device_ok=True, jagged_ok=False)
    assert got is not None
    assert got[0].device_spans is None
    assert got[0].device_offsets is None
    for region in got[1]:
        state.arena.release(region)  # type: ignore[union-attr]
    # any other reader: a jagged host column, copied out of the arena
    _, columns = state.get("p", order, ["j"])
    host = columns[0]
    assert not isinstance(host, list)
    rows = [
        np.asarray(host.values[a:b]).view(np.float32)  # type: ignore[union-attr]
        for a, b in itertools.pairwise(host.offsets.tolist())  # type: ignore[union-attr]
    ]
    assert all((g == values[r]).all() for g, r in zip(rows, order, strict=True))
    assert state.clear("p", None) == 8
    assert device.live_bytes == 0


@pytest.mark.parametrize("bad", ["short", "decreasing", "past the span", "not from 0"])
def test_jagged_device_offsets_that_disagree_with_the_span_are_refused(bad: str) -> None:
    from tq_async._errors import ProtocolError

    state = _state()
    device = state.device
    assert device is not None
    values = _jagged_rows(4)
    offsets = {
        "short": [0, 0, 1, 3],
        "decreasing": [0, 2, 1, 3, 6],
        "past the span": [0, 0, 1, 3, 7],
        "not from 0": [1, 1, 2, 4, 7],
    }[bad]
    region = device.alloc(4096)
    assert region is not None
    header = ColumnHeader("j", "jagged", "float32", (3,))
    frame = np.array(offsets, dtype=np.int64).tobytes()
    with pytest.raises(ProtocolError):
        state.put("p", [0, 1, 2, 3], [header], [frame], device=(region, {0: (region.offset, 72)}))
    device.release(region)
    assert sum(len(v) for v in values) * 12 == 72
    assert device.live_bytes == 0  # nothing kept a reference
    with pytest.raises(tq.RowsNotFound):
        state.get("p", [0], ["j"])


def test_device_cells_are_never_sent_inline() -> None:
    """A budgeted read (the controller sending cells along with a get_meta reply) leaves
    device cells alone: the reader then fetches them, device to device when it can."""
    state = _state()
    _device_put(state, list(range(8)), np.zeros((8, 16), dtype=np.int64))
    with pytest.raises(OverBudget):
        state.get("p", list(range(8)), ["x"], max_bytes=1 << 30)
    assert state.device is not None
    assert state.device.fallbacks == 0  # nothing was copied out


def test_a_field_partly_on_the_device_is_read_through_the_host() -> None:
    state = _state()
    _device_put(state, [0, 1], np.ones((2, 16), dtype=np.int64))
    row = np.full((1, 16), 7, dtype=np.int64)
    header = ColumnHeader("x", "dense", "int64", (16,))
    state.put("p", [2], [header], [row.tobytes()])
    _, columns = state.get("p", [0, 1, 2], ["x"], device_ok=True)
    assert not isinstance(columns[0], list)  # one host column: the unit joined the pieces


def test_read_pins_keep_device_cells_until_released() -> None:
    state = _state()
    device = state.device
    assert device is not None
    _device_put(state, list(range(4)), np.arange(64, dtype=np.int64).reshape(4, 16))
    got = state.read_shm("p", [0, 1, 2, 3], ["x"], device_ok=True)
    assert got is not None
    stored, _pinned, on_device = got
    assert stored.device_spans is not None
    assert stored.device_spans[0]
    assert len(on_device) == 1
    state.clear("p", None)
    assert device.live_bytes > 0  # the reader still copies out of it
    for region in on_device:
        device.release(region)
    assert device.live_bytes == 0


def test_overwritten_and_cleared_device_cells_are_freed() -> None:
    state = _state()
    device = state.device
    assert device is not None
    _device_put(state, [0, 1], np.zeros((2, 16), dtype=np.int64))
    first = device.live_bytes
    _device_put(state, [0, 1], np.ones((2, 16), dtype=np.int64))  # overwrites both rows
    assert device.live_bytes == first
    _, columns = state.get("p", [0, 1], ["x"])
    assert not isinstance(columns[0], list)
    assert np.asarray(columns[0].data).view(np.int64).reshape(-1).tolist() == [1] * 32  # type: ignore[union-attr]
    assert state.clear("p", None) == 2
    assert device.live_bytes == 0


# ---- across processes ----------------------------------------------------------------------


@pytest.fixture
def address(emulate: None) -> Iterator[str]:
    with serve_cluster(storage_units=2, args=["--device-cap", str(CAP)]) as addr:
        yield addr


def _rows(batches: list[dict[str, Any]], rows: list[int]) -> dict[str, Any]:
    """The batch the rows ``rows`` of ``batches`` (put one after another) make."""
    out: dict[str, Any] = {}
    for k in ("ids", "bf", "mask", "small"):
        out[k] = torch.cat([b[k] for b in batches])[rows]
    jag = [t for b in batches for t in b["jag"].unbind()]
    out["jag"] = torch.nested.nested_tensor([jag[r] for r in rows], layout=torch.jagged)
    out["s"] = [s for b in batches for s in b["s"]]
    out["s"] = [out["s"][r] for r in rows]
    return out


async def test_big_dense_columns_go_device_to_device(address: str) -> None:
    batches = [_batch(), _batch()]
    batches[1]["ids"] = batches[1]["ids"] + 1_000_000
    async with tq.AsyncClient.connect(address) as client:
        for b in batches:  # one unit each
            await client.put(b, partition_id="dev")
        stats = await _stats(client)
        assert stats["device_puts"] == 2
        assert stats["device_bytes"] > 2 * 3 * 32 * 8192  # ids, bf, mask (not small)
        assert stats["device_cap"] == 2 * CAP
        meta = await client.get_meta(list(batches[0]), 64, "dev", "t")
        assert sorted(set(meta.units)) == [0, 1]
        want = _rows(batches, meta.global_indexes)
        _same(await client.get_data(meta, device="cpu"), want)  # the arena's kind of device
        stats = await _stats(client)
        assert stats["device_reads"] == 2
        assert stats["device_fallbacks"] == 0
        # a reader that names no device gets host memory: the unit copies the cells out
        _same(await client.get_data(meta), want)
        assert (await _stats(client))["device_fallbacks"] > 0
        # rows in another order, interleaving both units
        order = [i for pair in zip(range(32), range(63, 31, -1), strict=True) for i in pair]
        sub = meta.select_rows(order)
        td = await client.get_data(sub, device="cpu")
        assert torch.equal(td["ids"], want["ids"][order])
        assert torch.equal(td["mask"], want["mask"][order])
        await client.clear_partition("dev")
        # (what the units hold now: the device grants they lent ahead of its next puts)
        held = client._links.same_host_units.spare_bytes(device=True)
        assert (await _stats(client))["device_bytes"] == held


def _jagged_batch(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A jagged column of ``n`` rows ``[len, k]`` (8 KiB an element; row 3 empty), random
    bytes, over the device threshold."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = (i * 7 + seed) % 5 * (i != 3)
        row = torch.randint(0, 256, (length, 8192), generator=g).to(torch.uint8).view(dtype)
        rows.append(row if dtype != torch.bool else row.view(torch.uint8) % 2 == 1)
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def _same_rows(got: torch.Tensor, want: list[torch.Tensor]) -> None:
    assert got.is_nested
    rows = got.unbind()
    assert len(rows) == len(want)
    for g, w in zip(rows, want, strict=True):
        assert g.dtype == w.dtype
        assert g.shape == w.shape
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))


async def test_jagged_columns_go_device_to_device(address: str) -> None:
    batches = [{"j": _jagged_batch(32, torch.float32, s)} for s in (1, 2)]
    rows = [t for b in batches for t in b["j"].unbind()]
    async with tq.AsyncClient.connect(address) as client:
        for b in batches:  # one unit each
            await client.put(b, partition_id="jag")
        stats = await _stats(client)
        assert stats["device_puts"] == 2
        meta = await client.get_meta(["j"], 64, "jag", "t")
        assert sorted(set(meta.units)) == [0, 1]
        want = [rows[r] for r in meta.global_indexes]
        _same_rows((await client.get_data(meta, device="cpu"))["j"], want)
        stats = await _stats(client)
        assert stats["device_reads"] == 2
        assert stats["device_fallbacks"] == 0
        # rows out of order, across both units
        order = [i for pair in zip(range(32), range(63, 31, -1), strict=True) for i in pair]
        _same_rows(
            (await client.get_data(meta.select_rows(order), device="cpu"))["j"],
            [want[i] for i in order],
        )
        # a reader on the host: the units copy the cells out as jagged columns
        _same_rows((await client.get_data(meta))["j"], want)
        assert (await _stats(client))["device_fallbacks"] > 0
        await client.clear_partition("jag")


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float64,
        torch.complex64,
    ],
)
async def test_jagged_device_columns_round_trip_every_dtype(
    address: str, dtype: torch.dtype
) -> None:
    j = _jagged_batch(16, dtype, 3)
    async with tq.AsyncClient.connect(address) as client:
        meta = await client.put({"j": j, "ids": torch.arange(16)}, partition_id="dt")
        assert (await _stats(client))["device_puts"] == 1
        got = meta.select_rows([5, 0, 3, 9])
        want = [j.unbind()[r] for r in got.global_indexes]
        _same_rows((await client.get_data(got, device="cpu"))["j"], want)
        _same_rows((await client.get_data(got))["j"], want)
        await client.clear_partition("dt")


async def test_columns_added_to_rows_and_read_back_together(address: str) -> None:
    async with tq.AsyncClient.connect(address) as client:
        meta = await client.put({"p": torch.arange(16 * 8192).reshape(16, 8192)}, partition_id="a")
        r = torch.randn(16, 8192)
        meta = await client.put({"r": r}, meta=meta)
        td, got = await client.get(["p", "r"], 16, "a", "t", device="cpu")
        assert torch.equal(td["r"][torch.argsort(torch.tensor(got.global_indexes))], r)
        assert (await _stats(client))["device_puts"] == 2
        await client.clear_partition("a")


@pytest.mark.parametrize("replay_window", [0, 2])
async def test_a_dataset_on_the_device_reads_device_to_device(
    address: str, replay_window: int
) -> None:
    batch = _batch()
    pid = f"ds-{replay_window}"
    async with tq.AsyncClient.connect(address) as client:
        await client.put(batch, partition_id=pid)
        await client.seal(pid)
        ds = tq.AsyncStreamingDataset(
            client, ["ids", "mask"], 16, 8, pid, "t", device="cpu", replay_window=replay_window
        )
        got = []
        async with ds:
            async for td, _ in ds:
                got.append(td["ids"])
        assert torch.equal(torch.cat(got), batch["ids"])
        # without a replay window the reads came out of the device arena; with one, the
        # batches it keeps came through host memory
        assert (await _stats(client))["device_reads"] == (2 if replay_window == 0 else 0)


async def test_a_small_get_onto_the_device_is_not_sent_inline(address: str) -> None:
    x = torch.arange(16 * 8192).reshape(16, 8192)  # 1 MiB: the controller would inline it
    async with tq.AsyncClient.connect(address) as client:
        await client.put({"x": x[:8]}, partition_id="small")
        td, _ = await client.get(["x"], 8, "small", "t", device="cpu")
        assert torch.equal(td["x"], x[:8])
        assert (await _stats(client))["device_reads"] == 1
        td, _ = await client.get(["x"], 8, "small", "u")  # host memory: through the unit
        assert torch.equal(td["x"], x[:8])
        await client.clear_partition("small")


async def test_a_put_cancelled_after_its_device_copy_leaves_nothing(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled between the copy into the device grant and the unit hearing of it: the grant
    goes back, no row is committed, nothing stays in the arena."""
    from tq_async._transport._dealer import DealerConnection

    async with tq.AsyncClient.connect(address) as client:
        entered = anyio.Event()
        real = DealerConnection.request

        async def stalled(self: DealerConnection, body: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(body, StorePut) and body.device is not None:
                entered.set()
                await anyio.sleep_forever()  # the StorePut never leaves
            return await real(self, body, *args, **kwargs)

        monkeypatch.setattr(DealerConnection, "request", stalled)
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.put, {"x": torch.zeros(16, 8192)}, "cancelled-put")
            await entered.wait()  # the grant is taken and the copy made
            monkeypatch.setattr(DealerConnection, "request", real)
            assert (await _stats(client))["device_bytes"] > 0
            tg.cancel_scope.cancel()
        assert (await _stats(client))["device_bytes"] == 0  # the grant was given back
        status = await client.production_status("cancelled-put")
        assert not any(bool(v.any()) for v in status.values())  # nothing committed
        await client.clear_partition("cancelled-put")


@pytest.mark.parametrize("nbytes", [256, (16 << 15) + 256])
async def test_a_device_span_that_disagrees_with_its_rows_is_refused(
    address: str, monkeypatch: pytest.MonkeyPatch, nbytes: int
) -> None:
    """A put naming a device span shorter (or longer) than its rows take: the unit would keep
    cells past the span (over memory it gave back, lent to the next grant); it refuses it."""
    from tq_async._transport._dealer import DealerConnection

    real = DealerConnection.request

    async def lying(self: DealerConnection, body: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(body, StorePut) and body.device is not None:
            body.device.spans = [(off, nbytes) for off, _ in body.device.spans]
        return await real(self, body, *args, **kwargs)

    async with tq.AsyncClient.connect(address) as client:
        monkeypatch.setattr(DealerConnection, "request", lying)
        with pytest.raises(tq.TQError, match="described wrongly"):
            await client.put({"x": torch.zeros(16, 8192)}, partition_id="lying")  # 512 KiB
        monkeypatch.setattr(DealerConnection, "request", real)
        status = await client.production_status("lying")
        assert not any(bool(v.any()) for v in status.values())  # nothing committed
        held = client._links.same_host_units.spare_bytes(device=True)
        assert (await _stats(client))["device_bytes"] == held  # and the grant went back
        await client.clear_partition("lying")


async def test_a_read_cancelled_during_its_device_copy_unpins_and_consumes_nothing(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.arange(16 * 8192).reshape(16, 8192)
    async with tq.AsyncClient.connect(address) as client:
        await client.put({"x": x}, partition_id="cancelled-read")
        devices = client._links.devices
        assert devices is not None
        entered = anyio.Event()
        real = devices.read

        async def stalled(*args: Any) -> Any:
            entered.set()  # the unit answered with pinned device spans
            await anyio.sleep_forever()

        monkeypatch.setattr(devices, "read", stalled)
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(client.get, ["x"], 16, "cancelled-read", "t", device="cpu"))
            await entered.wait()
            tg.cancel_scope.cancel()
        monkeypatch.setattr(devices, "read", real)
        # nothing was consumed: the task gets the same rows, device to device
        td, _ = await client.get(["x"], 16, "cancelled-read", "t", device="cpu")
        assert torch.equal(td["x"], x)
        await client.clear_partition("cancelled-read")
        # the cancelled read's pin is gone (what is held: a device grant lent ahead of a put)
        held = client._links.same_host_units.spare_bytes(device=True)
        assert (await _stats(client))["device_bytes"] == held


def test_the_blocking_client_takes_the_device_path(address: str) -> None:
    batch = _batch()
    with tq.Client.connect(address) as client:
        meta = client.put(batch, partition_id="sync-dev")
        _same(client.get_data(meta, device="cpu"), batch)
        stats = {
            k: sum(s[k] for s in client.storage_stats().values())
            for k in ("device_puts", "device_reads")
        }
        assert stats == {"device_puts": 1, "device_reads": 1}
        client.clear_partition("sync-dev")


async def test_a_client_without_the_device_path_reads_the_same_rows(address: str) -> None:
    batch = _batch()
    async with tq.AsyncClient.connect(address) as client:
        meta = await client.put(batch, partition_id="far")
    async with tq.AsyncClient.connect(address, same_host=False) as far:  # as on another host
        _same(await far.get_data(meta, device="cpu"), batch)
        await far.clear_partition("far")


@pytest.mark.parametrize("pin", ["1", "0"])  # into shared memory by their device, or staged
async def test_a_full_device_arena_puts_through_host_memory(
    emulate: None, monkeypatch: pytest.MonkeyPatch, pin: str
) -> None:
    from tq_async._paths._pinned import PIN_ENV

    monkeypatch.setenv(PIN_ENV, pin)
    with serve_cluster(storage_units=1, args=["--device-cap", str(1 << 20)]) as addr:
        async with tq.AsyncClient.connect(addr) as client:
            big = torch.arange(64 * 8192).reshape(64, 8192)  # 4 MiB: more than the arena
            jag = _jagged_batch(64, torch.bfloat16, 5)  # ~1 MiB of values, with the rest
            meta = await client.put({"x": big, "j": jag}, partition_id="full")
            stats = await _stats(client)
            assert stats["device_puts"] == 0
            assert stats["device_bytes"] == 0
            td = await client.get_data(meta, device="cpu")
            assert torch.equal(td["x"], big)
            _same_rows(td["j"], list(jag.unbind()))


async def test_a_dead_clients_device_grant_is_freed(emulate: None, tmp_path: Any) -> None:
    server = StorageServer(0, device_cap=CAP)
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve, f"ipc://{tmp_path}/unit")
        device = server.state.device
        assert device is not None
        child = multiprocessing.get_context("spawn").Process(
            target=device_alloc_then_die, args=(server.address, 1 << 20)
        )
        child.start()
        await anyio.to_thread.run_sync(child.join, 60)
        assert child.exitcode == -signal.SIGKILL
        with anyio.fail_after(20):
            while device.live_bytes:  # freed when the pidfd of the dead client fires
                await server.shm_released.wait()
        assert server._device_grants == {}
        tg.cancel_scope.cancel()


async def test_a_dead_readers_pin_on_device_cells_is_released(emulate: None, tmp_path: Any) -> None:
    server = StorageServer(0, device_cap=CAP)
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve, f"ipc://{tmp_path}/unit")
        device = server.state.device
        assert device is not None
        _device_put(server.state, list(range(8)), np.arange(128, dtype=np.int64).reshape(8, 16))
        child = multiprocessing.get_context("spawn").Process(
            target=device_read_then_stop, args=(server.address, "p", [3, 1, 2])
        )
        child.start()
        assert child.pid is not None
        # stopped, holding its pin (waitpid reports the stop; it does not reap)
        await anyio.to_thread.run_sync(os.waitpid, child.pid, os.WUNTRACED)
        assert device.reads == 1
        assert len(server._device_pins) == 1
        server.state.clear("p", None)  # the cells are gone; the reader's pin holds them
        assert device.live_bytes > 0
        os.kill(child.pid, signal.SIGKILL)
        await anyio.to_thread.run_sync(child.join, 60)
        with anyio.fail_after(20):
            while device.live_bytes:  # until the pidfd of the dead reader fires
                await server.shm_released.wait()
        assert server._device_pins == {}
        assert server._pins == {}
        tg.cancel_scope.cancel()


async def test_units_without_a_device_arena_take_host_memory(emulate: None) -> None:
    batch = _batch()
    jag = _jagged_batch(32, torch.float32, 4)  # big enough for a device arena
    with serve_cluster(storage_units=2) as addr:  # no --device-cap
        async with tq.AsyncClient.connect(addr) as client:
            meta = await client.put({**batch, "big_jag": jag}, partition_id="plain")
            td = await client.get_data(meta, device="cpu")
            _same(td, batch)
            _same_rows(td["big_jag"], [jag.unbind()[r] for r in meta.global_indexes])
            assert await _stats(client) == {
                "device_bytes": 0,
                "device_cap": 0,
                "device_puts": 0,
                "device_reads": 0,
                "device_fallbacks": 0,
                "device_out_bytes": 0,
                "device_out_us": 0,
            }


async def test_a_unit_without_a_gpu_serves_without_a_device_arena(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    monkeypatch.setattr(_cuda, "_driver", None)
    monkeypatch.setattr(_cuda, "_driver_error", "no usable CUDA driver in this process: test")
    server = StorageServer(0, device_cap=CAP)
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve, f"ipc://{tmp_path}/unit")
        assert server.state.device is None  # warned, and serves the rest
        assert server.arena is not None
        tg.cancel_scope.cancel()


def test_bad_device_settings_are_refused() -> None:
    with pytest.raises(tq.TQError, match="device_cap"):
        StorageServer(0, device_cap=-1)
    with pytest.raises(tq.ConfigError, match="device_index"):
        tq.Config(device_index=-1)


# ---- one GPU per unit ------------------------------------------------------------------------


def test_device_index_takes_one_gpu_per_unit() -> None:
    assert tq.Config(device_index=[0, 1, 3]).device_index == [0, 1, 3]
    with pytest.raises(tq.ConfigError, match="device_index"):
        tq.Config(device_index=[0, -1])
    with pytest.raises(tq.ConfigError, match="device_index"):
        tq.Config(device_index=[])


async def test_each_unit_of_a_cluster_holds_its_cells_on_its_own_gpu(emulate: None) -> None:
    config = tq.Config(num_storage_units=3, device_cap=CAP, device_index=[2, 0, 1])
    async with tq.local_cluster(config=config) as cluster:
        arenas = [u.state.device for u in cluster.units]
        assert all(a is not None for a in arenas)
        assert [a.memory.device for a in arenas if a is not None] == [
            b"host-emulation-2",
            b"host-emulation-0",
            b"host-emulation-1",
        ]


async def test_a_gpu_list_of_another_length_than_the_units_is_refused() -> None:
    config = tq.Config(num_storage_units=2, device_cap=CAP, device_index=[0, 1, 2])
    with pytest.raises(tq.ConfigError, match="3 GPU indexes for 2 storage units"):
        async with tq.local_cluster(config=config):
            pass


def test_serve_takes_a_gpu_index_per_unit() -> None:
    from tq_async._deploy._cli import _device_index_arg
    from tq_async._deploy._process import _one_device_index

    assert _device_index_arg("3") == 3
    assert _device_index_arg("0,1,2") == [0, 1, 2]
    assert _one_device_index([4]) == 4
    with pytest.raises(tq.ConfigError, match="one GPU index"):
        _one_device_index([0, 1])


def test_copy_out_blocks_are_page_locked_once_and_reused_by_size() -> None:
    import ctypes
    import gc

    from tq_async._paths._device import HostBlocks

    class Driver:
        def __init__(self) -> None:
            self.buffers: dict[int, Any] = {}
            self.freed: list[int] = []

        def host_alloc(self, ordinal: int, nbytes: int) -> int:
            buf = (ctypes.c_uint8 * nbytes)()
            self.buffers[ctypes.addressof(buf)] = buf
            return ctypes.addressof(buf)

        def host_free(self, ordinal: int, ptr: int) -> None:
            self.freed.append(ptr)

    driver = Driver()
    blocks = HostBlocks(driver, 0, idle_limit=2 << 20)  # type: ignore[arg-type]
    a = blocks.array(3 << 19)  # 1.5 MiB: a 2 MiB block
    a[:] = 7
    first = a.ctypes.data
    view = a[10:20]
    del a
    gc.collect()
    assert blocks.idle_bytes == 0  # a view keeps the block
    del view
    gc.collect()
    assert blocks.idle_bytes == 2 << 20
    b = blocks.array(2 << 20)
    assert b.ctypes.data == first  # reused, not allocated again
    assert len(driver.buffers) == 1
    c = blocks.array(100)  # a 1 MiB block of its own
    del b, c
    gc.collect()
    assert blocks.idle_bytes == 2 << 20  # the second went back to the driver
    assert len(driver.freed) == 1


# ---- round trips per call ------------------------------------------------------------------


@pytest.fixture
def requests_sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the requests this process's clients send (round trips), in order."""
    from tq_async._transport._dealer import DealerConnection

    seen: list[str] = []
    real = DealerConnection.request

    async def counted(self: DealerConnection, body: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(type(body).__name__)
        return await real(self, body, *args, **kwargs)

    monkeypatch.setattr(DealerConnection, "request", counted)
    return seen


async def test_a_steady_device_put_takes_the_grant_lent_with_the_last_answer(
    address: str, requests_sent: list[str]
) -> None:
    """A producer putting device columns again and again asks for a device grant once: the
    unit lends the next put's with each answer (three round trips a put, not four); a
    smaller put uses a larger spare (its tail goes back), a larger one asks."""
    x = torch.arange(16 * 8192).reshape(16, 8192)  # 1 MiB
    async with tq.AsyncClient.connect(address) as client:
        for _ in range(2):  # one to each unit: links, and asks for its grant
            await client.put({"x": x}, partition_id="rt")
        assert requests_sent.count("ShmAlloc") == 2
        requests_sent.clear()
        metas = [await client.put({"x": x + i}, partition_id="rt") for i in range(3)]
        metas.append(await client.put({"x": (x + 3)[:8]}, partition_id="rt"))
        assert requests_sent == ["PutBegin", "StorePut", "PutCommit"] * 4
        stats = await _stats(client)
        assert stats["device_puts"] == 6
        held = client._links.same_host_units.spare_bytes(device=True)
        assert held > 0
        for i, meta in enumerate(metas):  # (read back device to device)
            td = await client.get_data(meta, device="cpu")
            assert torch.equal(td["x"], (x + i)[: len(meta)])
        requests_sent.clear()
        await client.put({"x": torch.cat([x, x])}, partition_id="rt")  # larger: asks
        assert requests_sent == ["PutBegin", "ShmAlloc", "StorePut", "PutCommit"]
        await client.clear_partition("rt")
        # what the unit holds now is the spares it lent this client, nothing else
        held = client._links.same_host_units.spare_bytes(device=True)
        assert (await _stats(client))["device_bytes"] == held
    async with tq.AsyncClient.connect(address) as other:  # the first gave its spares back
        assert (await _stats(other))["device_bytes"] == 0


async def test_device_copies_done_already_are_not_waited_for_on_a_worker_thread(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put's and a read's device copies are waited for off the loop only while they run:
    copies complete already (host memory, here; on a GPU, an event already passed) cost no
    thread's hop."""
    from tq_async._client._async import _device_links

    hops: list[Any] = []
    off_loop = _device_links.run_sync_off_loop

    async def counted(fn: Any, *args: Any) -> Any:
        hops.append(fn)
        return await off_loop(fn, *args)

    x = torch.arange(16 * 8192).reshape(16, 8192)
    async with tq.AsyncClient.connect(address) as client:
        for b in (x, x + 1):  # one to each unit: the links open (a hop each: DeviceView)
            await client.put({"x": b}, partition_id="hops")
        hops.clear()
        monkeypatch.setattr(_device_links, "run_sync_off_loop", counted)
        meta = await client.put({"x": x + 2}, partition_id="hops")
        td = await client.get_data(meta, device="cpu")
        assert torch.equal(td["x"], x + 2)
        assert (await _stats(client))["device_reads"] == 1
        assert hops == []
        await client.clear_partition("hops")


@pytest.mark.parametrize("kind", ["dense", "jagged"])
async def test_a_put_of_new_fields_asks_for_its_device_grant_while_it_is_placed(
    address: str, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A put of new fields names its rows, so their units are known before the controller
    answers: a unit that lent no device grant for the new columns is asked for one while
    PutBegin is under way (its round trip overlaps the placement's), and the put takes it."""
    from tq_async._transport._dealer import DealerConnection

    events: list[tuple[str, str]] = []
    real = DealerConnection.request

    async def traced(self: DealerConnection, body: Any, *args: Any, **kwargs: Any) -> Any:
        name = type(body).__name__
        events.append(("start", name))
        try:
            return await real(self, body, *args, **kwargs)
        finally:
            events.append(("end", name))

    async with tq.AsyncClient.connect(address) as client:
        meta = await client.put({"a": torch.zeros(16, 8192)}, partition_id="ahead")  # linked
        monkeypatch.setattr(DealerConnection, "request", traced)
        r = torch.randn(16, 3 * 8192)  # 3 MiB: larger than the spare lent with the first put
        if kind == "jagged":  # rows of 20-27 elements of 8 KiB: ~3 MiB of values too
            r = torch.nested.nested_tensor(
                [torch.randn(20 + i % 8, 2048) for i in range(16)], layout=torch.jagged
            )
        meta = await client.put({"r": r}, meta=meta)
        starts = [n for e, n in events if e == "start"]
        assert sorted(starts) == ["PutBegin", "PutCommit", "ShmAlloc", "StorePut"]
        # the grant was asked for before the placement came back
        assert events.index(("start", "ShmAlloc")) < events.index(("end", "PutBegin"))
        got = (await client.get_data(meta, device="cpu"))["r"]
        if kind == "jagged":
            _same_rows(got, list(r.unbind()))
        else:
            assert torch.equal(got, r)
        assert (await _stats(client))["device_puts"] == 2
        await client.clear_partition("ahead")
