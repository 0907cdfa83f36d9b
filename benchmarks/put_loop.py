"""A long loop of sequential W1 puts against ``tq-async serve`` at one durability level.

``python -m benchmarks.put_loop --level process --puts 400 --data-dir /var/tmp``

`benchmarks.durability` times 48 puts a level, which the page cache absorbs; this loop runs
long enough for the kernel's write-back of a durable unit's files (and, at ``fsync``, every
commit) to show: it prints the put's p50 / p90 and the p50's GB/s. ``tq-async serve
--storage-units 2`` in a subprocess, one client in this process, the 8.4 MB dense W1 batch,
each partition of 16 puts cleared after them. Attach ``py-spy record --pid`` to either
process to see where the time goes.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import anyio

from ._proc import ServeProcess
from .w1_data_plane import _make_batch


async def _loop(address: str, puts: int) -> list[float]:
    import tq_async as tq

    sources = [_make_batch("dense", 256, 2048, (0, 0), seed) for seed in range(4)]
    times = []
    async with tq.AsyncClient.connect(address) as client:
        await client.put(sources[0][0], partition_id="warm")
        await client.clear_partition("warm")
        for i in range(puts):
            batch, _ = sources[i % 4]
            t0 = time.perf_counter()
            await client.put(batch, partition_id=f"w{i // 16}")
            times.append(time.perf_counter() - t0)
            if i % 16 == 15:
                await client.clear_partition(f"w{i // 16}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--level", choices=("memory", "process", "fsync"), default="process")
    parser.add_argument("--puts", type=int, default=400)
    parser.add_argument("--data-dir", default=None, help="on the disk measured ($TMPDIR)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="tq-put-loop-", dir=args.data_dir)
    try:
        role = ["--storage-units", "2"]
        if args.level != "memory":
            role += ["--durability", args.level, "--data-dir", root]
        serve = ServeProcess(role=role)
        try:
            times = anyio.run(_loop, serve.address, args.puts)
        finally:
            serve.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = _make_batch("dense", 256, 2048, (0, 0), 0)[1]
    times.sort()
    p50 = statistics.median(times)
    print(
        f"{args.level}: {args.puts} puts of {nbytes / 1e6:.1f} MB, p50 {p50 * 1e3:.2f} ms, "
        f"p90 {times[len(times) * 9 // 10] * 1e3:.2f} ms -> {nbytes / p50 / 1e9:.2f} GB/s"
    )


if __name__ == "__main__":
    main()
