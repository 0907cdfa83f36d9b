"""W5 the synchronous face: the blocking ``Client`` and the torch adapters against async.

Every comparison runs both sides in the same run, on the same cluster, one after the other:

* get_meta b8, one call in flight: blocking ``Client`` vs ``AsyncClient`` (calls/s) and their
  ratio. ``embedded``: the services run on a background thread of this process
  (``background_cluster``) and the clients on the main thread; ``process``: ``tq-async serve``.
* W1 dense batch (input_ids + attention_mask int64 [256, 2048] + reward, 8.4 MB): put and
  get_meta+get_data through the blocking client vs the async one (GB/s) and their ratios.
* ``StreamingDataLoader`` with 0 and 2 (fork) workers vs ``AsyncStreamingDataset`` reading the
  same sealed partition (one task each; batches of 32 rows): items/s and the ratios; and,
  informational, 2 workers with ``prefetch_factor=8`` (hand-offs of 8 batches).
* compat ``kv_batch_get`` of a verl-sized step (256 keys x 6 fields) through
  ``tq_async.compat.TransferQueueClient`` vs ``AsyncClient.kv_batch_get`` (calls/s), ratio.
* time to the first batch of a ``StreamingDataLoader`` with 2 workers, fork vs spawn
  (``embedded`` only: spawn pays a fresh interpreter and a torch import per worker).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter
from typing import Any

import anyio

from ._common import Config, median, result
from ._proc import ServeProcess

__all__ = ["run"]

WORKLOAD = "W5"
BATCH = 8


@contextmanager
def _cluster(cfg: Config) -> Iterator[str]:
    if cfg.mode == "embedded":
        import tq_async as tq

        with tq.background_cluster(num_storage_units=cfg.storage_units) as cluster:
            yield cluster.address
    else:
        server = ServeProcess(cfg.storage_units)
        try:
            yield server.address
        finally:
            server.stop()


def _rows(n: int) -> Any:
    import torch

    return {"x": torch.arange(n, dtype=torch.int64)}


def _ratio_rows(
    metric: str, unit: str, sync: list[float], asyn: list[float], note: str
) -> list[dict[str, Any]]:
    s, a = median(sync), median(asyn)
    return [
        result(WORKLOAD, f"{metric}, blocking Client", s, unit, best=max(sync), note=note),
        result(WORKLOAD, f"{metric}, async", a, unit, best=max(asyn)),
        result(
            WORKLOAD,
            f"{metric}, blocking/async",
            s / a,
            "x",
            best=max(sync) / min(asyn),
            note="same run, same cluster",
        ),
    ]


# ---- get_meta ----------------------------------------------------------------------------------


def _get_meta(cfg: Config, address: str) -> list[dict[str, Any]]:
    import tq_async as tq

    calls = cfg.pick(4096, 64)
    rounds = cfg.pick(3, 1)
    sync_rates, async_rates = [], []
    with tq.Client.connect(address) as client:
        for r in range(rounds):
            pid = f"w5-gm-{r}"
            client.put(_rows(calls * BATCH), partition_id=pid)
            t0 = perf_counter()
            for k in range(calls // 2):
                client.get_meta(["x"], BATCH, pid, f"sync{k // 1024}")
            sync_rates.append(calls // 2 / (perf_counter() - t0))

            async def main(pid: str = pid) -> float:
                async with tq.AsyncClient.connect(address) as ac:
                    t0 = perf_counter()
                    for k in range(calls // 2):
                        await ac.get_meta(["x"], BATCH, pid, f"async{k // 1024}")
                    return calls // 2 / (perf_counter() - t0)

            async_rates.append(anyio.run(main))
            client.clear_partition(pid)
    return _ratio_rows("get_meta b8 sequential", "calls/s", sync_rates, async_rates, "")


# ---- W1 dense ------------------------------------------------------------------------------------


def _dense(rows: int, seqlen: int) -> tuple[Any, int]:
    import torch
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(0)
    td = TensorDict(
        {
            "input_ids": torch.randint(0, 150_000, (rows, seqlen), generator=g),
            "attention_mask": (torch.rand(rows, seqlen, generator=g) > 0.1).to(torch.int64),
            "reward": torch.randn(rows, generator=g),
        },
        batch_size=[rows],
    )
    return td, sum(v.numel() * v.element_size() for v in td.values())


def _w1(cfg: Config, address: str) -> list[dict[str, Any]]:
    import tq_async as tq

    rows, seqlen = cfg.pick((256, 2048), (8, 64))
    reps = cfg.pick(40, 2)  # 12 (11 timed, ~2 ms each) left the median to one burst
    td, nbytes = _dense(rows, seqlen)
    fields = list(td.keys())
    put_s: dict[str, list[float]] = {"sync": [], "async": []}
    get_s: dict[str, list[float]] = {"sync": [], "async": []}
    with tq.Client.connect(address) as client:
        for i in range(reps):
            pid = f"w5-w1-s{i}"
            t0 = perf_counter()
            client.put(td, partition_id=pid)
            put_s["sync"].append(perf_counter() - t0)
            t0 = perf_counter()
            meta = client.get_meta(fields, rows, pid, "t")
            client.get_data(meta)
            get_s["sync"].append(perf_counter() - t0)
            client.clear_partition(pid)

    async def main() -> None:
        async with tq.AsyncClient.connect(address) as ac:
            for i in range(reps):
                pid = f"w5-w1-a{i}"
                t0 = perf_counter()
                await ac.put(td, partition_id=pid)
                put_s["async"].append(perf_counter() - t0)
                t0 = perf_counter()
                meta = await ac.get_meta(fields, rows, pid, "t")
                await ac.get_data(meta)
                get_s["async"].append(perf_counter() - t0)
                await ac.clear_partition(pid)

    anyio.run(main)

    def gbs(xs: list[float]) -> list[float]:
        return [nbytes / x / 1e9 for x in xs[1:] or xs]  # the first rep warms up

    return [
        *_ratio_rows("W1 put dense", "GB/s", gbs(put_s["sync"]), gbs(put_s["async"]), ""),
        *_ratio_rows(
            "W1 get_meta+get_data dense", "GB/s", gbs(get_s["sync"]), gbs(get_s["async"]), ""
        ),
    ]


# ---- datasets ------------------------------------------------------------------------------------


def _loader_rate(
    address: str, pid: str, task: str, workers: int, batches: int, prefetch: int | None = None
) -> float:
    import tq_async as tq

    ds = tq.StreamingDataset(address, ["x"], 32, 32, pid, task)
    kwargs: dict[str, Any] = {"multiprocessing_context": "fork"} if workers else {}
    if prefetch is not None:
        kwargs["prefetch_factor"] = prefetch
    loader = tq.StreamingDataLoader(ds, num_workers=workers, **kwargs)
    it = iter(loader)
    next(it)  # workers started, first batch in: the rate is the steady state
    t0 = perf_counter()
    n = sum(1 for _ in it)
    elapsed = perf_counter() - t0
    if n != batches - 1:
        raise AssertionError(f"the loader delivered {n + 1} batches, wanted {batches}")
    return n / elapsed


def _plain_rate(batches: int) -> float:
    """A plain torch DataLoader with 2 fork workers handing over items of the same shape
    (a 32 x 16 int64 TensorDict and a small dict): the ceiling of the worker hand-off."""
    import torch
    from tensordict import TensorDict
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info

    class Items(IterableDataset[Any]):
        def __iter__(self) -> Iterator[Any]:
            info = get_worker_info()
            w, n = (info.id, info.num_workers) if info is not None else (0, 1)
            for i in range(w, batches, n):
                td = TensorDict({"x": torch.arange(512).view(32, 16)}, batch_size=[32])
                yield [(td, {"batch_index": i, "rows": list(range(32))})]

    loader = DataLoader(
        Items(),
        batch_size=None,
        collate_fn=lambda x: x,
        num_workers=2,
        multiprocessing_context="fork",
    )
    it = iter(loader)
    next(it)
    t0 = perf_counter()
    n = sum(1 for _ in it)
    return n / (perf_counter() - t0)


def _async_rate(address: str, pid: str, task: str, batches: int) -> float:
    import tq_async as tq

    async def main() -> float:
        async with tq.AsyncStreamingDataset(address, ["x"], 32, 32, pid, task) as ds:
            it = aiter(ds)
            await anext(it)
            t0 = perf_counter()
            n = 0
            async for _ in it:
                n += 1
            if n != batches - 1:
                raise AssertionError(f"the dataset delivered {n + 1} batches, wanted {batches}")
            return n / (perf_counter() - t0)

    return anyio.run(main)


def _datasets(cfg: Config, address: str) -> list[dict[str, Any]]:
    import torch

    import tq_async as tq

    batches = cfg.pick(1600, 8)  # 400 (0.15-0.2 s a pass) left a run to one slow stretch
    rounds = cfg.pick(2, 1)
    pid = "w5-ds"
    with tq.Client.connect(address) as client:
        client.put({"x": torch.arange(batches * 32 * 16).view(-1, 16)}, partition_id=pid)
        client.seal(pid)
        out: list[dict[str, Any]] = []
        asyn: list[float] = []
        rates: dict[int, list[float]] = {0: [], 2: []}
        deep: list[float] = []
        for r in range(rounds):
            asyn.append(_async_rate(address, pid, f"a{r}", batches))
            for w in rates:
                rates[w].append(_loader_rate(address, pid, f"l{w}-{r}", w, batches))
            deep.append(_loader_rate(address, pid, f"l8-{r}", 2, batches, prefetch=8))
        plain = [_plain_rate(batches) for _ in range(rounds)]
        out.append(
            result(
                WORKLOAD,
                "plain torch DataLoader 2 workers (fork), same items",
                median(plain),
                "items/s",
                best=max(plain),
                note="the ceiling of the worker hand-off on this machine",
            )
        )
        for w, rs in rates.items():
            label = (
                f"StreamingDataLoader {w} workers{' (fork)' if w else ''} vs AsyncStreamingDataset"
            )
            out += _ratio_rows(label, "items/s", rs, asyn, "batches of 32 rows")
        out += _ratio_rows(
            "StreamingDataLoader 2 workers (fork), prefetch_factor=8 vs AsyncStreamingDataset",
            "items/s",
            deep,
            asyn,
            "informational: hand-offs of 8 batches, and 16 batches fetched ahead (not 4)",
        )
        client.clear_partition(pid)
    return out


# ---- compat kv_batch_get -----------------------------------------------------------------------


def _kv(cfg: Config, address: str) -> list[dict[str, Any]]:
    import torch

    import tq_async as tq
    import tq_async.compat as compat

    keys = [f"k{i}" for i in range(256)]
    seq = cfg.pick(512, 16)
    fields = {
        "prompts": torch.randint(0, 1000, (256, seq)),
        "responses": torch.randint(0, 1000, (256, seq)),
        "attention_mask": torch.ones(256, 2 * seq, dtype=torch.int64),
        "old_log_probs": torch.randn(256, seq),
        "advantages": torch.randn(256, seq),
        "rewards": torch.randn(256),
    }
    calls = cfg.pick(200, 3)  # ~0.25 s a sample: 60 calls (75 ms) were at a burst's mercy
    rounds = cfg.pick(3, 1)
    compat.init({"address": address})  # what a verl trainer does (attach to TQ_ADDRESS)
    compat.kv_batch_put(keys, "w5-kv", fields)
    sync_rates, async_rates, alike_rates = [], [], []
    names = sorted(fields)

    async def main(alike: bool) -> float:
        async with tq.AsyncClient.connect(address) as ac:
            t0 = perf_counter()
            for _ in range(calls):
                if alike:  # what compat does, and returns: jagged tensors
                    meta = await ac.kv_retrieve_meta(keys, "w5-kv")
                    await ac.get_data(meta, names, nested=True)
                else:
                    await ac.kv_batch_get(keys, "w5-kv")
            return calls / (perf_counter() - t0)

    for _ in range(rounds):
        t0 = perf_counter()
        for _ in range(calls):
            compat.kv_batch_get(keys, "w5-kv")
        sync_rates.append(calls / (perf_counter() - t0))
        async_rates.append(anyio.run(main, False))
        alike_rates.append(anyio.run(main, True))
    compat.get_client().client.clear_partition("w5-kv")
    compat.close()
    # compat returns jagged tensors (TransferQueue's shape), AsyncClient.kv_batch_get the
    # stored (dense) ones: the first ratio includes torch's jagged-tensor constructions, the
    # second compares the same calls with the same result (the synchronous face alone)
    return _ratio_rows(
        "compat kv_batch_get 256 keys x 6 fields", "calls/s", sync_rates, async_rates, ""
    ) + _ratio_rows(
        "compat kv_batch_get 256 x 6, same result async (kv_retrieve_meta + nested get_data)",
        "calls/s",
        sync_rates,
        alike_rates,
        "informational: the target is judged on the row above",
    )


# ---- time to the first batch ---------------------------------------------------------------------


def _first_batch(address: str, method: str, task: str) -> float:
    import tq_async as tq

    ds = tq.StreamingDataset(address, ["x"], 32, 32, "w5-first", task)
    loader = tq.StreamingDataLoader(ds, num_workers=2, multiprocessing_context=method)
    t0 = perf_counter()
    it = iter(loader)
    next(it)
    elapsed = perf_counter() - t0
    del it
    return elapsed


def _first(cfg: Config, address: str) -> list[dict[str, Any]]:
    import torch

    import tq_async as tq

    with tq.Client.connect(address) as client:
        client.put({"x": torch.arange(64 * 32)}, partition_id="w5-first")
        client.seal("w5-first")
        fork = _first_batch(address, "fork", "fork")
        spawn = _first_batch(address, "spawn", "spawn")
        client.clear_partition("w5-first")
    note = "one StreamingDataLoader, 2 workers, an open Client in the parent"
    return [
        result(
            WORKLOAD, "first batch, 2 fork workers", fork, "s", higher_is_better=False, note=note
        ),
        result(WORKLOAD, "first batch, 2 spawn workers", spawn, "s", higher_is_better=False),
    ]


def run(cfg: Config) -> list[dict[str, Any]]:
    parts: list[Callable[[Config, str], list[dict[str, Any]]]] = [_get_meta, _w1, _datasets, _kv]
    if cfg.mode == "embedded" and not cfg.smoke:  # spawn costs seconds per worker
        parts.append(_first)
    out: list[dict[str, Any]] = []
    with _cluster(cfg) as address:
        for part in parts:
            out += part(cfg, address)
    return out
