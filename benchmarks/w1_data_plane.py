"""W1 data plane: put and get throughput of an RL batch.

``dense``: 256 rows of ``input_ids``/``attention_mask`` int64[256, 2048] and ``reward``
f32[256] (8.39 MB). ``full``: the same plus ``responses`` (a jagged nested tensor, int64, row
lengths uniform in 128..4096) and ``prompt`` (256 strings), ~13 MB.

Each round puts ``batches`` batches into one fresh partition (each put timed alone), then
reads them back in put order, each read taking fresh rows: ``get_meta`` for 256 rows, then
``get_data``. Both ``get_data`` alone and ``get_meta + get_data`` are reported. Every batch
read back is checked (outside the timing): dense columns dense and equal, the jagged column
jagged with equal values and offsets, the strings equal. The partition is cleared after each
round. Throughput is bytes of tensor/string payload per second of one sequential call.
"""

from __future__ import annotations

from typing import Any

import anyio

from ._common import Config, median, minor_faults, open_cluster_handle, percentile, result

__all__ = ["run"]

WORKLOAD = "W1"
DENSE_FIELDS = ("input_ids", "attention_mask", "reward")
FULL_FIELDS = (*DENSE_FIELDS, "responses", "prompt")


def _make_batch(
    variant: str, rows: int, seqlen: int, lengths: tuple[int, int], seed: int
) -> tuple[Any, int]:
    """A batch and its payload size in bytes."""
    import torch
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 150_000, (rows, seqlen), dtype=torch.int64, generator=g)
    attention_mask = (torch.rand(rows, seqlen, generator=g) > 0.1).to(torch.int64)
    reward = torch.randn(rows, generator=g, dtype=torch.float32)
    dense = {"input_ids": input_ids, "attention_mask": attention_mask, "reward": reward}
    nbytes = sum(t.numel() * t.element_size() for t in dense.values())
    if variant == "dense":
        return TensorDict(dense, batch_size=[rows]), nbytes
    lens = torch.randint(lengths[0], lengths[1] + 1, (rows,), generator=g)
    offsets = torch.zeros(rows + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=offsets[1:])
    values = torch.randint(0, 150_000, (int(offsets[-1]),), dtype=torch.int64, generator=g)
    responses = torch.nested.nested_tensor_from_jagged(values, offsets)
    prompt = [f"prompt {seed}/{i}: " + "lorem ipsum dolor sit amet " * 4 for i in range(rows)]
    nbytes += values.numel() * 8 + offsets.numel() * 8 + sum(len(s.encode()) for s in prompt)
    return {**dense, "responses": responses, "prompt": prompt}, nbytes


def _latencies(ms: list[float]) -> str:
    return f"ms p50 {median(ms):.2f} p99 {percentile(ms, 99):.2f} max {max(ms):.1f}"


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)


def _check(variant: str, src: Any, got: Any) -> None:
    """The batch read back equals what was put; dense columns are dense, jagged jagged."""
    import torch

    for name in DENSE_FIELDS:
        want, have = src[name], got[name]
        _expect(isinstance(have, torch.Tensor), f"{name}: got {type(have).__name__}")
        _expect(
            not have.is_nested and have.layout == torch.strided,
            f"{name}: a dense column came back as {have.layout}, nested={have.is_nested}",
        )
        _expect(have.dtype == want.dtype, f"{name}: dtype {have.dtype} != {want.dtype}")
        _expect(have.shape == want.shape, f"{name}: shape {tuple(have.shape)} != {want.shape}")
        _expect(torch.equal(have, want), f"{name}: values differ")
    if variant == "full":
        want, have = src["responses"], got["responses"]
        _expect(
            have.is_nested and have.layout == torch.jagged,
            f"responses: a jagged column came back as {have.layout}",
        )
        _expect(torch.equal(have.offsets(), want.offsets()), "responses: offsets differ")
        _expect(torch.equal(have.values(), want.values()), "responses: values differ")
        prompts = got["prompt"]
        prompts = prompts.tolist() if hasattr(prompts, "tolist") else list(prompts)
        _expect(prompts == src["prompt"], "prompt: strings differ")


async def _variant(cfg: Config, client: Any, server_pid: int, variant: str) -> list[dict[str, Any]]:
    from time import perf_counter

    rows = cfg.pick(256, 16)
    seqlen = cfg.pick(2048, 128)
    lengths = cfg.pick((128, 4096), (8, 256))
    batches = cfg.pick(16, 2)
    rounds = cfg.pick(4, 1)
    distinct = cfg.pick(4, 2)
    fields = list(FULL_FIELDS if variant == "full" else DENSE_FIELDS)
    sources = [_make_batch(variant, rows, seqlen, lengths, seed) for seed in range(distinct)]

    # warm-up: opens the sockets to every unit, first-use allocations (not timed)
    for i in range(cfg.storage_units):
        await client.put(sources[i % distinct][0], partition_id=f"w1-{variant}-warm")
    for _ in range(cfg.storage_units):
        meta = await client.get_meta(fields, rows, f"w1-{variant}-warm", "reader")
        await client.get_data(meta)
    await client.clear_partition(f"w1-{variant}-warm")

    put_rates: list[float] = []
    data_rates: list[float] = []
    get_rates: list[float] = []
    put_ms: list[float] = []
    get_ms: list[float] = []
    faults0 = minor_faults(server_pid)
    for r in range(rounds):
        pid = f"w1-{variant}-{r}"
        for i in range(batches):
            batch, _ = sources[i % distinct]
            nbytes = sources[i % distinct][1]
            t0 = perf_counter()
            await client.put(batch, partition_id=pid)
            dt = perf_counter() - t0
            put_rates.append(nbytes / dt / 1e9)
            put_ms.append(dt * 1e3)
        for i in range(batches):
            batch, nbytes = sources[i % distinct]
            t0 = perf_counter()
            meta = await client.get_meta(fields, rows, pid, "reader")
            t1 = perf_counter()
            td = await client.get_data(meta)
            t2 = perf_counter()
            _expect(len(meta) == rows, f"get_meta returned {len(meta)} rows, wanted {rows}")
            _check(variant, batch, td)
            del td
            data_rates.append(nbytes / (t2 - t1) / 1e9)
            get_rates.append(nbytes / (t2 - t0) / 1e9)
            get_ms.append((t2 - t0) * 1e3)
        await client.clear_partition(pid)
    faults = minor_faults(server_pid) - faults0

    mb = median([s[1] for s in sources]) / 1e6
    n = len(put_rates)
    note = f"{mb:.1f} MB/batch, {n} ops"
    out = [
        result(
            WORKLOAD,
            f"put {variant}",
            median(put_rates),
            "GB/s",
            best=max(put_rates),
            n=n,
            note=f"{note}, {_latencies(put_ms)}",
        ),
        result(
            WORKLOAD,
            f"get_data {variant}",
            median(data_rates),
            "GB/s",
            best=max(data_rates),
            n=n,
            note=note,
        ),
        result(
            WORKLOAD,
            f"get_meta+get_data {variant}",
            median(get_rates),
            "GB/s",
            best=max(get_rates),
            n=n,
            note=f"{note}, fresh rows, checked equal, {_latencies(get_ms)}",
        ),
    ]
    who = "this process (client + cluster)" if cfg.mode == "embedded" else "the serve process"
    out.append(
        result(
            WORKLOAD,
            f"page faults per put+get {variant}",
            faults / n,
            "faults",
            higher_is_better=False,
            n=n,
            note=f"minor faults of {who}; 4 KiB each; {mb:.1f} MB/batch = "
            f"{mb * 1e6 / 4096:.0f} pages",
        )
    )
    return out


async def _main(cfg: Config) -> list[dict[str, Any]]:
    import tq_async as tq

    out: list[dict[str, Any]] = []
    with anyio.fail_after(cfg.pick(600, 60)):
        async with (
            open_cluster_handle(cfg) as cluster,
            tq.AsyncClient.connect(cluster.address) as client,
        ):
            for variant in ("dense", "full"):
                out.extend(await _variant(cfg, client, cluster.pid, variant))
    return out


def run(cfg: Config) -> list[dict[str, Any]]:
    """Run W1 and return its results."""
    return anyio.run(_main, cfg)
