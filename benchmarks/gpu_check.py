"""Every GPU path of tq_async, against torch's own pinned copies in the same run.

    python -m benchmarks.gpu_check [--mib 256] [--rounds 5]
    TQ_ASYNC_GPU_EMULATE=1 python -m benchmarks.gpu_check --emulate

``--emulate`` (no GPU needed) measures only the device arena's per-call time for one 1 MiB
column, with the arena emulated in host memory (the "device" is the CPU): the round trips
and the event-loop work of a call, without the copies' CUDA side.

On a machine without CUDA it says so and exits 0 having measured nothing. With CUDA it
prints, for a batch of ``--mib`` MiB of int64 in 4 columns:

* torch baseline: pinned ``cudaMemcpy`` D2H and H2D (``copy_(non_blocking=True)`` into/out
  of pinned memory, then synchronize) — the ceiling;
* ``to_host``: tq_async's staging of CUDA columns for a put (ratio to the D2H baseline);
* ``to_device``: tq_async's delivery of host columns on the GPU (ratio to H2D);
* ``put`` of CUDA tensors and ``get_data(device="cuda")`` end to end (``tq-async serve`` in a
  subprocess, this host: shared memory), and the event-loop stalls while they run (a
  loop-lag probe, puts and reads apart, the first round apart; target < 1 ms);
* ``AsyncStreamingDataset(device="cuda")``: batches per second;
* GPU -> GPU between two processes: torch's own CUDA IPC (a tensor sent through a
  ``torch.multiprocessing`` queue, its handle opened and copied device to device in the
  consumer: the reference) against tq_async through host memory (a put of CUDA tensors then
  ``get_data(device=)``, shared memory) and through a storage unit's **device arena**
  (``tq-async serve --device-cap``: the columns copied device to device into GPU memory the
  unit owns, and out of it, by CUDA IPC), with the event-loop stalls and the unit's
  counters;
* NIXL with GPU memory (a probe outside tq_async's data path): a client agent's registered
  CUDA buffer READ from / WRITten to another agent's registered host buffer, against the
  pinned copies: what a GPU-direct path would get;
* GPU-direct NIXL inside tq_async: reported as not implemented (across hosts GPU tensors
  travel through pinned host memory).

Targets (issue 26): ``to_host``/``to_device`` >= 0.7x the baseline; loop stall < 1 ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def _baseline(torch: Any, cols: dict[str, Any], rounds: int) -> tuple[float, float]:
    nbytes = sum(t.numel() * t.element_size() for t in cols.values())
    pinned = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in cols.items()}
    dev = {k: torch.empty_like(t) for k, t in cols.items()}
    d2h, h2d = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, t in cols.items():
            pinned[k].copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        d2h.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for k, t in pinned.items():
            dev[k].copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        h2d.append(time.perf_counter() - t0)
    return _gbps(nbytes, d2h), _gbps(nbytes, h2d)


def _ipc_consumer(queue: Any, done: Any, rounds: int) -> None:
    """The consumer of :func:`ipc_between_processes` (a spawned process): receives each
    tensor by its IPC handle, copies it into memory of its own and says when that is done."""
    import torch

    for _ in range(rounds):
        sent_at, shared = queue.get()
        own = shared.clone()  # on a GPU: a device-to-device copy out of the producer's memory
        if own.is_cuda:
            torch.cuda.synchronize(own.device)
        took = time.perf_counter() - sent_at  # CLOCK_MONOTONIC: one clock for the host
        done.put((took, int(own.sum().item())))
        del shared, own  # the producer may free it once it hears from us


def ipc_between_processes(torch: Any, device: str, nbytes: int, rounds: int) -> float:
    """GB/s of torch's own inter-process sharing of a ``device`` tensor of ``nbytes``: the
    producer puts it on a ``torch.multiprocessing`` queue (CUDA: an IPC handle; CPU: shared
    memory), a spawned consumer copies it into memory of its own. The first round (the
    consumer's CUDA context, the handle's first opening) is not counted.

    Lifetime (torch's rules for CUDA IPC): the producer keeps the tensor alive, unmodified,
    until the consumer has said it is done with it, and outlives the consumer's use."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    consumer = ctx.Process(target=_ipc_consumer, args=(queue, done, rounds + 1), daemon=True)
    consumer.start()
    x = torch.randint(0, 1 << 20, (nbytes // 8,), dtype=torch.int64, device=device)
    want = int(x.sum().item())
    times = []
    try:
        for _ in range(rounds + 1):
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            queue.put((time.perf_counter(), x))
            took, total = done.get(timeout=300)
            if total != want:
                raise RuntimeError("the consumer's copy differs from the producer's tensor")
            times.append(took)
    finally:
        consumer.join(60)
        if consumer.is_alive():
            consumer.kill()
    return _gbps(x.numel() * 8, times[1:])


def nixl_vram(torch: Any, nbytes: int, rounds: int) -> tuple[float, float] | str:
    """GB/s of NIXL (UCX) moving ``nbytes`` between GPU memory and host memory: a client agent
    with a registered CUDA buffer READs from and WRITEs to a unit agent's registered host
    buffer (another agent in this process; UCX picks its transports, e.g. ``cuda_copy``). The
    GPU-direct path a storage unit's arena would see; the first round is not counted. A string
    says why it could not run."""
    import numpy as np

    from tq_async._paths import _nixl

    nixl = _nixl.load()
    if nixl is None:
        return "NIXL is not installed here"
    try:
        unit = _nixl._make_agent(nixl, "unit", "gpu-check-unit")
        client = _nixl._make_agent(nixl, "client", "gpu-check-client")
        host = np.empty(nbytes, dtype=np.uint8)
        host[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        addr = int(host.ctypes.data)
        vram = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        regs = [
            (unit, unit.register_memory([(addr, nbytes, 0, "")], "DRAM")),
            (client, client.register_memory(vram)),
        ]
        peer = client.add_remote_agent(unit.get_agent_metadata())
        peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        local = client.get_xfer_descs(vram)
        remote = client.get_xfer_descs([(addr, nbytes, 0)], "DRAM")

        def once(op: str) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            handle = client.initialize_xfer(op, local, remote, peer)
            state = client.transfer(handle)
            while state == "PROC":
                state = client.check_xfer_state(handle)
            took = time.perf_counter() - t0
            handle.release()
            if state != "DONE":
                raise RuntimeError(f"NIXL {op} ended in state {state}")
            return took

        reads = [once("READ") for _ in range(rounds + 1)][1:]
        if not torch.equal(vram.cpu(), torch.from_numpy(host)):
            raise RuntimeError("the GPU buffer differs from the host buffer after a READ")
        vram.random_(0, 256)
        writes = [once("WRITE") for _ in range(rounds + 1)][1:]
        if not torch.equal(vram.cpu(), torch.from_numpy(host)):
            raise RuntimeError("the host buffer differs from the GPU buffer after a WRITE")
        for agent, reg in regs:
            agent.deregister_memory(reg)
        return _gbps(nbytes, reads), _gbps(nbytes, writes)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


async def _paths(torch: Any, cols: dict[str, Any], rounds: int) -> dict[str, Any]:
    from tensordict import TensorDict

    import tq_async as tq
    from tq_async._paths._device_copy import to_device, to_host

    nbytes = sum(t.numel() * t.element_size() for t in cols.values())
    rows = next(iter(cols.values())).shape[0]
    out: dict[str, Any] = {}
    staged, times = None, []
    for _ in range(rounds):
        t0 = time.perf_counter()
        staged = await to_host(cols)
        times.append(time.perf_counter() - t0)
    out["to_host"] = _gbps(nbytes, times)
    assert staged is not None
    host = TensorDict(dict(staged), batch_size=[rows])
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        back = await to_device(host, torch.device("cuda"))
        times.append(time.perf_counter() - t0)
    out["to_device"] = _gbps(nbytes, times)
    assert all(torch.equal(back[k], cols[k]) for k in cols)

    from tq_async._paths._pinned import PIN_ENV

    from ._common import Config, open_cluster

    # the services in another process (`tq-async serve`): the loop-lag probe sees only the
    # client's own work on its event loop
    async with (
        open_cluster(Config(mode="process", storage_units=1)) as address,
        tq.AsyncClient.connect(address) as client,
    ):
        out |= await _rounds(client, cols, rounds)
        # the same, the way it was before issue 40 (GPU columns staged through pinned buffers
        # of their own, then copied into shared memory by the CPU; reads the reverse)
        os.environ[PIN_ENV] = "0"
        try:
            async with tq.AsyncClient.connect(address) as staged_client:
                before = await _rounds(staged_client, cols, rounds)
        finally:
            del os.environ[PIN_ENV]
        out["staged"] = before
        out["locked_bytes"] = (await client.storage_stats())[0].get("shm_locked_bytes", 0)

        small = {k: t[: max(1, rows // 8)] for k, t in cols.items()}
        for _ in range(8):
            await client.put(small, partition_id="ds")
        await client.seal("ds")
        ds = tq.AsyncStreamingDataset(
            client, list(cols), len(small["c0"]), len(small["c0"]), "ds", "t", device="cuda"
        )
        n, t0 = 0, time.perf_counter()
        async with ds:
            async for batch, _ in ds:
                assert batch["c0"].is_cuda
                n += 1
        out["dataset_batches_per_s"] = n / (time.perf_counter() - t0)
    return out


async def device_arena(
    torch: Any, cols: dict[str, Any], rounds: int, device: str = "cuda"
) -> dict[str, Any]:
    """Put and ``get_data(device=device)`` through a storage unit's device arena (``tq-async
    serve --device-cap``, another process): CUDA IPC, device to device both ways. Reports
    GB/s of each, the event loop's longest stalls by phase, and the unit's counters. (With
    ``TQ_ASYNC_GPU_EMULATE=1`` and host ``cols``, ``device="cpu"`` runs the plumbing without
    a GPU: tests.)"""
    import anyio
    import anyio.lowlevel

    import tq_async as tq

    from ._proc import ServeProcess

    nbytes = sum(t.numel() * t.element_size() for t in cols.values())
    role = ["--storage-units", "1", "--device-cap", str(2 * nbytes + (64 << 20))]
    server = await anyio.to_thread.run_sync(lambda: ServeProcess(role=role))
    try:
        async with tq.AsyncClient.connect(server.address) as client:
            out = await _rounds(client, cols, rounds, device)
            before: dict[str, Any] = {}
            for r in range(rounds + 1):  # readers that want host memory: the unit copies out
                if r == 1:  # after a first round (the unit's page-locked blocks made)
                    before = (await client.storage_stats())[0]
                meta = await client.put(cols, partition_id="gpu")
                await client.get_data(meta)
                await client.clear_samples(meta)
            stats = (await client.storage_stats())[0]
            # what the unit holds now: the device grants it lent ahead of this client's next
            # puts (nothing else once every row is cleared)
            stats["device_spare_bytes"] = client._links.same_host_units.spare_bytes(device=True)
            moved = stats.get("device_out_bytes", 0) - before.get("device_out_bytes", 0)
            took = stats.get("device_out_us", 0) - before.get("device_out_us", 0)
            out["copy_out"] = moved / took / 1e3 if took else 0.0
    finally:
        await anyio.to_thread.run_sync(server.stop)
    return out | {"counters": {k: v for k, v in stats.items() if k.startswith("device_")}}


async def _rounds(
    client: Any, cols: dict[str, Any], rounds: int, device: str = "cuda"
) -> dict[str, Any]:
    """``rounds`` (after a first, reported apart) of a put of ``cols`` then
    ``get_data(device=device)``: GB/s of each, and the event loop's stalls by phase (a
    loop-lag probe: puts, reads and the first round, with streams, pools and arenas made)."""
    import anyio
    import anyio.lowlevel
    import torch

    nbytes = sum(t.numel() * t.element_size() for t in cols.values())
    lags: dict[str, list[float]] = {"first round": [], "put": [], "get": []}
    phase = ["first round"]
    stop = anyio.Event()

    async def probe() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await anyio.lowlevel.checkpoint()
            lags[phase[0]].append(time.perf_counter() - t0)

    async def round_trip() -> tuple[float, float, Any]:
        t0 = time.perf_counter()
        meta = await client.put(cols, partition_id="gpu")
        t1 = time.perf_counter()
        phase[0] = "get" if phase[0] == "put" else phase[0]
        td = await client.get_data(meta, device=device)
        t2 = time.perf_counter()
        await client.clear_samples(meta)
        return t1 - t0, t2 - t1, td

    # throughput: the loop otherwise idle, as in a job (a probe spinning on the loop takes
    # the GIL from the copies' worker at every hand-off: it measures stalls, apart, below)
    puts, gets = [], []
    for _ in range(rounds + 1):
        put_s, get_s, td = await round_trip()
        puts.append(put_s)
        gets.append(get_s)
    sampler = _StallSampler()
    async with anyio.create_task_group() as tg:
        tg.start_soon(probe)
        tg.start_soon(sampler.beat)
        for r in range(4):
            phase[0] = "put" if r else "first round"
            await round_trip()
        stop.set()
        sampler.stop()
    assert all(td[k].device.type == device and torch.equal(td[k], cols[k]) for k in cols)
    return {
        "put": _gbps(nbytes, puts[1:]),
        "get": _gbps(nbytes, gets[1:]),
        "stall_stacks": sampler.report(),
        "stalls": {
            k: (max(v) * 1e3, sum(x > 1e-3 for x in v), len(v)) for k, v in lags.items() if v
        },
    }


class _StallSampler:
    """Where the event loop's thread is when it stalls: a thread looks every 0.2 ms at the
    loop's heartbeat and, when it is over 1 ms old, records the loop thread's stack (its
    innermost lines). A stall caused by another thread holding the GIL shows as the loop
    thread waiting inside a call that needs it back."""

    def __init__(self) -> None:
        import threading

        self.last = time.perf_counter()
        self.loop_thread = threading.get_ident()
        self.seen: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    async def beat(self) -> None:
        import anyio

        while not self._stop.is_set():
            self.last = time.perf_counter()
            await anyio.sleep(0.0001)

    def _run(self) -> None:
        import traceback

        while not self._stop.wait(0.0002):
            if time.perf_counter() - self.last > 0.001:
                frame = sys._current_frames().get(self.loop_thread)
                if frame is None:
                    continue
                lines = traceback.format_stack(frame, limit=4)
                key = " | ".join(line.strip().splitlines()[0] for line in lines[-3:])
                self.seen[key] = self.seen.get(key, 0) + 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1)

    def report(self) -> list[tuple[int, str]]:
        return sorted(((n, k) for k, n in self.seen.items()), reverse=True)[:6]


def per_call(client_cols: dict[str, Any], torch: Any, device: str = "cuda") -> dict[str, float]:
    """Microseconds a put and a ``get_data(device=)`` of one 1 MiB CUDA column take through a
    unit's device arena (``tq-async serve --device-cap``), median of 50 after 5 (``device``
    ``"cpu"``: the emulated arena, ``TQ_ASYNC_GPU_EMULATE=1``)."""
    import anyio

    import tq_async as tq

    from ._proc import ServeProcess

    col = {"x": torch.randint(0, 1 << 30, (128, 1024), device=device)}  # 1 MiB

    async def run(address: str) -> dict[str, float]:
        async with tq.AsyncClient.connect(address) as client:
            puts, gets = [], []
            for i in range(55):
                t0 = time.perf_counter()
                meta = await client.put(col, partition_id="small")
                t1 = time.perf_counter()
                await client.get_data(meta, device=device)
                t2 = time.perf_counter()
                await client.clear_samples(meta)
                if i >= 5:
                    puts.append(t1 - t0)
                    gets.append(t2 - t1)
            return {
                "put_us": statistics.median(puts) * 1e6,
                "get_us": statistics.median(gets) * 1e6,
            }

    server = ServeProcess(role=["--storage-units", "1", "--device-cap", str(256 << 20)])
    try:
        return anyio.run(run, server.address)
    finally:
        server.stop()


def _emulated(torch: Any) -> int:
    """``--emulate``: `per_call` with the arena in host memory, and the requests of a call."""
    import collections

    from tq_async._paths._device import EMULATE_ENV
    from tq_async._transport._dealer import DealerConnection

    os.environ[EMULATE_ENV] = "1"  # the unit's arena and the client's columns: host memory
    seen: collections.Counter[str] = collections.Counter()
    real = DealerConnection.request

    async def counted(self: Any, body: Any, *args: Any, **kwargs: Any) -> Any:
        seen[type(body).__name__] += 1
        return await real(self, body, *args, **kwargs)

    DealerConnection.request = counted  # type: ignore[method-assign]
    small = per_call({}, torch, device="cpu")
    print(
        f"device arena (emulated), one 1 MiB column: put {small['put_us']:.0f} us, "
        f"get_data(device='cpu') {small['get_us']:.0f} us (median of 50)"
    )
    # 55 rounds of put, get_data, clear_samples (and the first round's links)
    print(f"requests in 55 rounds: {dict(sorted(seen.items()))}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="batch size in MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--emulate",
        action="store_true",
        help="only the device arena's per-call time, emulated in host memory (no GPU)",
    )
    args = parser.parse_args(argv)
    import torch

    if args.emulate:
        return _emulated(torch)

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing")
        print("measured; run it on a machine with a GPU")
        return 0
    import anyio

    per_col = (args.mib << 20) // 4 // 8
    rows = 256
    cols = {
        f"c{i}": torch.randint(0, 1 << 30, (rows, per_col // rows), device="cuda") for i in range(4)
    }
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.mib} MiB")
    d2h, h2d = _baseline(torch, cols, args.rounds)
    print(f"torch pinned cudaMemcpy: D2H {d2h:.2f} GB/s, H2D {h2d:.2f} GB/s")
    got = anyio.run(_paths, torch, cols, args.rounds)
    up, down = got["to_host"], got["to_device"]
    print(f"tq_async to_host (put staging): {up:.2f} GB/s = {up / d2h:.2f}x D2H")
    print(f"tq_async to_device (device= reads): {down:.2f} GB/s = {down / h2d:.2f}x H2D")
    staged = got["staged"]
    print(
        f"put of CUDA tensors (tq-async serve, page-locked shared memory): {got['put']:.2f} "
        f"GB/s = {got['put'] / d2h:.2f}x D2H; staged as before: {staged['put']:.2f} GB/s"
    )
    both_ceiling = 1 / (1 / d2h + 1 / h2d)
    host_both = 1 / (1 / got["put"] + 1 / got["get"])
    staged_both = 1 / (1 / staged["put"] + 1 / staged["get"])
    print(
        f"get_data(device='cuda') (tq-async serve): {got['get']:.2f} GB/s = "
        f"{got['get'] / h2d:.2f}x H2D; staged as before: {staged['get']:.2f} GB/s"
    )
    print(
        f"put then get_data(device=) through host memory: {host_both:.2f} GB/s = "
        f"{host_both / both_ceiling:.2f}x pinned D2H+H2D ({both_ceiling:.2f}); staged as "
        f"before: {staged_both:.2f} GB/s = {staged_both / both_ceiling:.2f}x"
    )
    print(f"shared memory the client holds page-locked at the unit: {got['locked_bytes']} bytes")
    for label, res in (("page-locked", got), ("staged", staged)):
        for phase, (most, over, n) in res["stalls"].items():
            print(
                f"event-loop stalls ({label}), {phase}: max {most:.2f} ms, {over} of {n} "
                "checkpoints over 1 ms (a stall includes this process being descheduled)"
            )
        for count, where in res["stall_stacks"]:
            print(f"  loop thread during stalls ({label}), {count} samples: {where}")
    print(f"AsyncStreamingDataset(device='cuda'): {got['dataset_batches_per_s']:.0f} batches/s")
    ipc = ipc_between_processes(torch, "cuda", args.mib << 20, args.rounds)
    print(f"GPU -> GPU between processes, torch CUDA IPC (handle + D2D copy): {ipc:.2f} GB/s")
    both = 1 / (1 / got["put"] + 1 / got["get"])
    print(
        f"GPU -> GPU between processes through tq_async, host memory (put, then "
        f"get_data(device=); shared memory): {both:.2f} GB/s = {both / ipc:.2f}x torch CUDA IPC"
    )
    arena = anyio.run(device_arena, torch, cols, args.rounds)
    both = 1 / (1 / arena["put"] + 1 / arena["get"])
    print(
        f"device arena (tq-async serve --device-cap; CUDA IPC): put {arena['put']:.2f} GB/s, "
        f"get_data(device='cuda') {arena['get']:.2f} GB/s; put then get {both:.2f} GB/s = "
        f"{both / ipc:.2f}x torch CUDA IPC"
    )
    for phase, (most, over, n) in arena["stalls"].items():
        print(
            f"device arena, event-loop stalls, {phase}: max {most:.2f} ms, {over} of {n} "
            "checkpoints over 1 ms"
        )
    print(f"device arena counters: {arena['counters']}")
    print(
        f"device arena, the unit's copy-out for host readers: {arena['copy_out']:.2f} GB/s = "
        f"{arena['copy_out'] / d2h:.2f}x D2H"
    )
    for count, where in arena["stall_stacks"]:
        print(f"  loop thread during stalls (device arena), {count} samples: {where}")
    small = per_call(cols, torch)
    print(
        f"device arena, one 1 MiB column: put {small['put_us']:.0f} us, "
        f"get_data(device='cuda') {small['get_us']:.0f} us (median of 50; target <= 100 us)"
    )
    got_nixl = nixl_vram(torch, args.mib << 20, args.rounds)
    if isinstance(got_nixl, str):
        print(f"NIXL with GPU memory (probe): could not run: {got_nixl}")
    else:
        r, w = got_nixl
        print(
            f"NIXL with GPU memory (probe, two agents): READ host->GPU {r:.2f} GB/s = "
            f"{r / h2d:.2f}x H2D, WRITE GPU->host {w:.2f} GB/s = {w / d2h:.2f}x D2H"
        )
    print("NIXL with GPU memory inside tq_async: not implemented; GPU tensors go through host")
    return 0


if __name__ == "__main__":
    sys.exit(main())
