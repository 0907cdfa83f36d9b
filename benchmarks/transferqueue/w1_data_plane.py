"""W1 data plane on TransferQueue: put and get throughput of an RL batch.

The same batches, rounds and metric names as ``benchmarks/w1_data_plane.py``: ``dense`` is
``input_ids``/``attention_mask`` int64[256, 2048] + ``reward`` f32[256] (8.39 MB); ``full`` adds
``responses`` (jagged, int64, row lengths 128..4096) and ``prompt`` (256 strings, a
``NonTensorStack`` since TransferQueue takes a TensorDict). Each put is
``async_put(batch, partition_id=...)`` (TransferQueue allocates the rows); each read is
``async_get_meta(fields, 256, partition, task_name="reader")`` then ``async_get_data``.

Every batch read back is checked outside the timing: values equal, and the layout of each dense
column is recorded -- TransferQueue 0.1.11 returns 2-D dense columns as jagged nested tensors,
which is reported (``dense columns returned jagged``) instead of failing the workload.
"""

from __future__ import annotations

import asyncio
import traceback
from time import perf_counter
from typing import Any

from ._common import (
    Config,
    async_client,
    call,
    failure,
    median,
    percentile,
    result,
    tq_session,
)

__all__ = ["run"]

WORKLOAD = "W1"
DENSE_FIELDS = ("input_ids", "attention_mask", "reward")
FULL_FIELDS = (*DENSE_FIELDS, "responses", "prompt")


def _make_batch(
    variant: str, rows: int, seqlen: int, lengths: tuple[int, int], seed: int
) -> tuple[Any, Any, int]:
    """(TensorDict to put, the source columns, payload bytes); same data as ours per seed."""
    import torch
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorStack

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 150_000, (rows, seqlen), dtype=torch.int64, generator=g)
    attention_mask = (torch.rand(rows, seqlen, generator=g) > 0.1).to(torch.int64)
    reward = torch.randn(rows, generator=g, dtype=torch.float32)
    dense = {"input_ids": input_ids, "attention_mask": attention_mask, "reward": reward}
    nbytes = sum(t.numel() * t.element_size() for t in dense.values())
    if variant == "dense":
        return TensorDict(dense, batch_size=[rows]), dense, nbytes
    lens = torch.randint(lengths[0], lengths[1] + 1, (rows,), generator=g)
    offsets = torch.zeros(rows + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=offsets[1:])
    values = torch.randint(0, 150_000, (int(offsets[-1]),), dtype=torch.int64, generator=g)
    responses = torch.nested.nested_tensor_from_jagged(values, offsets)
    prompt = [f"prompt {seed}/{i}: " + "lorem ipsum dolor sit amet " * 4 for i in range(rows)]
    nbytes += values.numel() * 8 + offsets.numel() * 8 + sum(len(s.encode()) for s in prompt)
    src = {**dense, "responses": responses, "prompt": prompt}
    td = TensorDict(
        {**dense, "responses": responses, "prompt": NonTensorStack(*prompt)}, batch_size=[rows]
    )
    return td, src, nbytes


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)


def _check(variant: str, src: dict[str, Any], got: Any) -> list[str]:
    """Values read back equal the source; returns the dense columns that came back jagged."""
    import torch

    jagged = []
    for name in DENSE_FIELDS:
        want, have = src[name], got[name]
        _expect(isinstance(have, torch.Tensor), f"{name}: got {type(have).__name__}")
        if have.is_nested:
            jagged.append(name)
            _expect(
                all(int(n) == want.shape[1] for n in have.offsets().diff()),
                f"{name}: a dense column came back with ragged rows",
            )
            have = have.values().view(want.shape)
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
        _expect(list(prompts) == src["prompt"], "prompt: strings differ")
    return jagged


def _expected(
    sources: list[tuple[Any, dict[str, Any], int]], picks: list[tuple[int, int]]
) -> tuple[dict[str, Any], int]:
    """The columns (and payload bytes) a get should return for rows ``picks`` = [(source, row)].

    TransferQueue's sampler hands out the lowest ready global indexes, and after a partition is
    cleared its indexes are reused out of put order, so a read may return another put's rows.
    """
    import torch

    first = picks[0][0]
    if all(p == (first, r) for r, p in enumerate(picks)) and len(picks) == len(
        sources[first][1]["reward"]
    ):
        return sources[first][1], sources[first][2]
    src0 = sources[first][1]
    out: dict[str, Any] = {
        name: torch.stack([sources[s][1][name][r] for s, r in picks]) for name in DENSE_FIELDS
    }
    if "responses" in src0:
        rows = [sources[s][1]["responses"].unbind()[r] for s, r in picks]
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor([len(x) for x in rows]), 0, out=offsets[1:])
        out["responses"] = torch.nested.nested_tensor_from_jagged(torch.cat(rows), offsets)
        out["prompt"] = [sources[s][1]["prompt"][r] for s, r in picks]
    nbytes = sum(sources[s][2] for s, _ in picks) // len(picks)  # approximate if mixed
    return out, nbytes


def _latencies(ms: list[float]) -> str:
    return f"ms p50 {median(ms):.2f} p99 {percentile(ms, 99):.2f} max {max(ms):.1f}"


async def _variant(cfg: Config, client: Any, variant: str) -> list[dict[str, Any]]:
    rows = cfg.pick(256, 16)
    seqlen = cfg.pick(2048, 128)
    lengths = cfg.pick((128, 4096), (8, 256))
    batches = cfg.pick(16, 2)
    rounds = cfg.pick(4, 1)
    distinct = cfg.pick(4, 2)
    fields = list(FULL_FIELDS if variant == "full" else DENSE_FIELDS)
    sources = [_make_batch(variant, rows, seqlen, lengths, seed) for seed in range(distinct)]

    # warm-up (not timed): sockets to every unit, first-use allocations
    warm = f"w1-{variant}-warm"
    for i in range(cfg.storage_units):
        await call(client.async_put(sources[i % distinct][0], partition_id=warm))
    for _ in range(cfg.storage_units):
        meta = await call(client.async_get_meta(fields, rows, warm, task_name="reader"))
        await call(client.async_get_data(meta))
    await call(client.async_clear_partition(warm))

    put_rates: list[float] = []
    data_rates: list[float] = []
    get_rates: list[float] = []
    put_ms: list[float] = []
    get_ms: list[float] = []
    jagged: set[str] = set()
    out_of_order = 0
    for r in range(rounds):
        pid = f"w1-{variant}-{r}"
        where: dict[int, tuple[int, int]] = {}  # global index -> (source, row)
        for i in range(batches):
            td, _, nbytes = sources[i % distinct]
            t0 = perf_counter()
            put_meta = await call(client.async_put(td, partition_id=pid))
            dt = perf_counter() - t0
            put_rates.append(nbytes / dt / 1e9)
            put_ms.append(dt * 1e3)
            for row, g in enumerate(put_meta.global_indexes):
                where[g] = (i % distinct, row)
        for i in range(batches):
            t0 = perf_counter()
            meta = await call(client.async_get_meta(fields, rows, pid, task_name="reader"))
            t1 = perf_counter()
            td = await call(client.async_get_data(meta))
            t2 = perf_counter()
            _expect(meta.size == rows, f"get_meta returned {meta.size} rows, wanted {rows}")
            picks = [where[g] for g in meta.global_indexes]
            if picks[0][0] != i % distinct:
                out_of_order += 1
            src, nbytes = _expected(sources, picks)
            jagged.update(_check(variant, src, td))
            del td
            data_rates.append(nbytes / (t2 - t1) / 1e9)
            get_rates.append(nbytes / (t2 - t0) / 1e9)
            get_ms.append((t2 - t0) * 1e3)
        await call(client.async_clear_partition(pid))

    mb = median([s[2] for s in sources]) / 1e6
    n = len(put_rates)
    note = f"{mb:.1f} MB/batch, {n} ops"
    if out_of_order:
        note += f", {out_of_order} reads returned another put's rows (not put order)"
    layout = (
        f"dense columns came back JAGGED: {', '.join(sorted(jagged))}"
        if jagged
        else "dense columns came back dense"
    )
    return [
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
            note=f"{note}, fresh rows, checked equal, {layout}, {_latencies(get_ms)}",
        ),
        result(
            WORKLOAD,
            f"dense columns returned jagged {variant}",
            len(jagged),
            "columns",
            higher_is_better=False,
            n=n,
            note=", ".join(sorted(jagged)) or "none",
            jagged_columns=sorted(jagged),
        ),
    ]


async def _main(cfg: Config, conf: Any) -> list[dict[str, Any]]:
    client = async_client(conf, "w1")
    try:
        out: list[dict[str, Any]] = []
        for variant in ("dense", "full"):
            try:
                out.extend(await _variant(cfg, client, variant))
            except Exception as e:  # record it, go on with the next variant
                traceback.print_exc()
                why = f"{type(e).__name__}: {e}"
                for metric in ("put", "get_data", "get_meta+get_data"):
                    out.append(failure(WORKLOAD, f"{metric} {variant}", "GB/s", why))
        return out
    finally:
        client.close()


def run(cfg: Config) -> list[dict[str, Any]]:
    """Run W1 on TransferQueue and return its results."""
    with tq_session(cfg) as conf:
        return asyncio.run(_main(cfg, conf))
