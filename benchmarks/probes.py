"""Machine probes behind the explanations in RESULTS.md (no tq_async involved, except in
``jagged-assembly`` and ``jagged-micro-batches``).

``python -m benchmarks.probes PROBE``:

* ``tcp-ceiling``: raw pyzmq, two processes, the W1 dense batch (3 frames, 8.4 MB) sent
  DEALER -> ROUTER over TCP loopback with one ack each, the receiver keeping 16 messages
  like a storage unit: the best a put over a socket can do on this box.
* ``idle-rtt``: a 100-byte round trip (blocking pyzmq, server thread) back to back and after
  1 ms / 10 ms of idleness, over ipc, tcp and inproc: what waking up costs.
* ``same-host``: the two candidates for a same-host data path, two processes, the W1 dense
  batch with one ack each: (a) the batch as zmq frames over ``ipc://`` (receiver keeps 16
  messages); (b) shared memory: the receiver owns a memfd arena, the sender maps it through
  ``/proc/PID/fd`` and copies the batch in (one copy), a 50-byte ``ipc://`` message says
  where; read back = one copy out of the arena into a recycled buffer.
* ``first-get-meta``: the first get_meta of a new task on a 1M-row partition (embedded),
  five tasks: building the task's ready set.
* ``shm-memory``: a ``tq-async serve`` holding 40 W1 batches: the unit's resident growth plus
  its shared memory in use, against the bytes stored; then after a clear and 40 more puts.
* ``socket-rtt``: a cross-process round trip of 40 bytes over a Unix socketpair (no ZMQ):
  blocking, polling, and through asyncio with and without the client polling for the reply:
  what waking a parked process costs (the client's busy polling rests on it).
* ``after-spin``: small calls (msgspec, torch, TensorDict) right after spinning 0, 1 or 10 ms
  in Python: what 10 ms of other work does to the next call's caches (W3's puts arrive every
  10 ms).
* ``cold-call``: one small torch call right after ``time.sleep(0.01)``, after spinning for
  0.2-3 ms first, and a second call right after the first: whether a slow first call is the
  clock (spinning helps) or cold caches (it does not).
* ``steady-cpu``: the same ~0.1 ms of pure Python repeated for 6 s, one process pinned to
  each CPU at once: how often, and when, this box runs it 5x slower than its median (W3's
  p99 is 1 % of its puts; a box whose CPUs slow down every second or so cannot meet it).
* ``jagged-assembly``: what turning a verl step (256 rows: 4 float/int fields of 512, a mask
  of 1024, a reward) into a TensorDict of jagged nested tensors costs, piece by piece: torch's
  ``nested_tensor_from_jagged`` against its constructor (on offsets shared or fresh), a
  ``TensorDict`` of them checked and unchecked, tq_async's ``columns_to_tensordict`` dense and
  nested, and the constructor right after 10 MiB of fresh buffers were written (what a read
  does just before): the floor under compat ``kv_batch_get`` (W5).
* ``jagged-micro-batches``: an ``AsyncStreamingDataset`` (embedded cluster), then a
  ``StreamingDataLoader`` with 0 and 2 fork workers (services on a background thread), cutting
  verl-shaped batches (256 rows x 6 jagged fields, prompts 100-1000 and responses 50-500
  tokens) into micro-batches of 64: micro-batches per second.
* ``loader-cpu``: W5's datasets (32-row batches, sealed) over 2,000 batches, services in
  ``tq-async serve`` then embedded: an ``AsyncStreamingDataset`` and a ``StreamingDataLoader``
  with 2 fork workers, items/s and the CPU a batch costs the loader's process and its
  workers (``getrusage``): where a DataLoader worker's time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
import numpy as np
import zmq

NBYTES = 256 * 2048 * 8 * 2 + 256 * 4


def _sink(address: str, keep: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    kept: list[Any] = []
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2:  # the stop message
            sock.send_multipart([frames[0].bytes, b"bye"])
            break
        kept.append(frames[2:])
        if len(kept) == keep:
            kept = []
        sock.send_multipart([frames[0].bytes, b"ok"])
    sock.close(linger=0)
    ctx.term()


def _put_ack_p50(address: str, keep: int, frames: list[Any], puts: int) -> float:
    """Median seconds of one put + ack to a :func:`_sink` process at ``address``."""
    proc = multiprocessing.get_context("spawn").Process(target=_sink, args=(address, keep))
    proc.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)  # a dead receiver fails the probe, never hangs it
    sock.setsockopt(zmq.LINGER, 0)
    times = []
    try:
        sock.connect(address)
        for _ in range(puts):
            t0 = time.perf_counter()
            sock.send_multipart([b"h", *frames], copy=False)
            sock.recv()
            times.append(time.perf_counter() - t0)
        sock.send_multipart([b"q"])
        sock.recv()
    finally:
        sock.close()
        ctx.term()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return statistics.median(times[len(times) // 8 :])  # drop the warm-up


def tcp_ceiling(puts: int = 400) -> None:
    ids = np.random.randint(0, 150_000, (256, 2048)).astype(np.int64)
    mask = np.ones((256, 2048), dtype=np.int64)
    reward = np.random.rand(256).astype(np.float32)
    for keep in (1, 16):
        with socket_port() as port:
            address = f"tcp://127.0.0.1:{port}"
        p50 = _put_ack_p50(address, keep, [ids.data, mask.data, reward.data], puts)
        print(
            f"tcp-ceiling receiver keeps {keep:2d}: put+ack p50 {p50 * 1e3:.2f} ms = "
            f"{NBYTES / p50 / 1e9:.2f} GB/s"
        )


class socket_port:
    """A free TCP port on loopback (bound and released)."""

    def __enter__(self) -> int:
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        port: int = self._sock.getsockname()[1]
        return port

    def __exit__(self, *exc: object) -> None:
        self._sock.close()


def _arena_owner(address: str, size: int) -> None:
    import mmap

    fd = os.memfd_create("tq-probe", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    arena = mmap.mmap(fd, size)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    while True:
        peer, msg = sock.recv_multipart()
        if msg == b"q":
            sock.send_multipart([peer, b"bye"])
            break
        if msg == b"hello":
            sock.send_multipart([peer, f"{os.getpid()} {fd}".encode()])
            continue
        # a put: the owner would record (offset, size) views of the arena; nothing to copy
        offset, nbytes = map(int, msg.split())
        assert offset + nbytes <= size
        sock.send_multipart([peer, b"ok"])
    sock.close(linger=0)
    ctx.term()
    arena.close()
    os.close(fd)


def same_host(puts: int = 300) -> None:
    import mmap

    ids = np.random.randint(0, 150_000, (256, 2048)).astype(np.int64)
    mask = np.ones((256, 2048), dtype=np.int64)
    reward = np.random.rand(256).astype(np.float32)
    parts = [ids.reshape(-1).view(np.uint8), mask.reshape(-1).view(np.uint8), reward.view(np.uint8)]
    with tempfile.TemporaryDirectory() as tmp:
        # (a) zmq frames over ipc://
        address = f"ipc://{tmp}/sink.sock"
        p50 = _put_ack_p50(address, 16, [ids.data, mask.data, reward.data], puts)
        print(
            f"same-host ipc:// frames, put+ack p50 {p50 * 1e3:.2f} ms = "
            f"{NBYTES / p50 / 1e9:.2f} GB/s"
        )
        # (b) shared memory owned by the receiver; 16 slots recycled like a unit's pool
        slot = -(-NBYTES // 4096) * 4096
        address = f"ipc://{tmp}/arena.sock"
        proc = multiprocessing.get_context("spawn").Process(
            target=_arena_owner, args=(address, 16 * slot)
        )
        proc.start()
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, 60_000)
        sock.setsockopt(zmq.LINGER, 0)
        puts_t, gets_t = [], []
        try:
            sock.connect(address)
            sock.send(b"hello")
            pid, fd = sock.recv().split()
            with open(f"/proc/{int(pid)}/fd/{int(fd)}", "r+b") as f:
                arena = mmap.mmap(f.fileno(), 16 * slot)
            view = np.frombuffer(arena, dtype=np.uint8)
            out = np.empty(NBYTES, dtype=np.uint8)  # a recycled read buffer
            for i in range(puts):
                offset = (i % 16) * slot
                t0 = time.perf_counter()
                pos = offset
                for part in parts:
                    view[pos : pos + part.nbytes] = part
                    pos += part.nbytes
                sock.send(f"{offset} {NBYTES}".encode())
                sock.recv()
                t1 = time.perf_counter()
                sock.send(f"{offset} {NBYTES}".encode())  # a read: same round trip
                sock.recv()
                out[:] = view[offset : offset + NBYTES]
                t2 = time.perf_counter()
                puts_t.append(t1 - t0)
                gets_t.append(t2 - t1)
            del view
            arena.close()
            sock.send(b"q")
            sock.recv()
        finally:
            sock.close()
            ctx.term()
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        for name, ts in (("put", puts_t), ("get", gets_t)):
            p50 = statistics.median(ts[len(ts) // 8 :])
            print(
                f"same-host shared memory {name}+ack p50 {p50 * 1e3:.2f} ms = "
                f"{NBYTES / p50 / 1e9:.2f} GB/s"
            )


def first_get_meta() -> None:
    import asyncio

    import torch

    import tq_async as tq

    async def run() -> None:
        async with (
            tq.local_cluster(num_storage_units=2) as cluster,
            tq.AsyncClient.connect(cluster.address) as client,
        ):
            for _ in range(16):
                await client.put({"x": torch.zeros(65536, dtype=torch.int32)}, partition_id="big")
            times = []
            for r in range(5):
                t0 = time.perf_counter()
                await client.get_meta(["x"], 8, "big", f"task{r}")
                times.append((time.perf_counter() - t0) * 1e3)
        print(
            "first-get-meta @1M rows, 5 new tasks: " + ", ".join(f"{t:.1f}" for t in times) + " ms"
        )

    asyncio.run(run())


def shm_memory() -> None:
    import subprocess
    import sys

    import torch

    import tq_async as tq

    def rss_anon(pid: int) -> int:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

    async def run(pid: int, address: str) -> None:
        from tq_async._wire._protocol import ShmHello, ShmHelloReply

        async with tq.AsyncClient.connect(address) as client:
            batch = {
                "ids": torch.randint(0, 1000, (256, 2048)),
                "mask": torch.ones(256, 2048, dtype=torch.int64),
                "r": torch.rand(256),
            }
            nbytes = sum(t.numel() * t.element_size() for t in batch.values())
            base = rss_anon(pid)

            async def measure(label: str, stored: int) -> None:
                resident = 0
                for unit in sorted(client._links.unit_addresses):
                    conn, _ = await client._links.data_link(unit)
                    payload, _ = await conn.request(ShmHello(os.getpid()), timeout=10)
                    hello = msgspec.msgpack.decode(payload, type=ShmHelloReply)
                    resident += os.stat(f"/proc/{hello.pid}/fd/{hello.fd}").st_blocks * 512
                stats = (await client.storage_stats()).values()
                live = sum(s["shm_bytes"] for s in stats)
                idle = sum(s["shm_idle_bytes"] for s in stats)
                anon = rss_anon(pid) - base
                ratio = f" = {(anon + live) / stored:.3f}x stored" if stored else ""
                print(
                    f"shm-memory {label}: stored {stored / 1e6:.0f} MB; unit anon "
                    f"+{anon / 1e6:.1f} MB; shared memory resident {resident / 1e6:.0f} MB "
                    f"(in use {live / 1e6:.0f}, idle pool {idle / 1e6:.0f}); unit + in use "
                    f"{(anon + live) / 1e6:.0f} MB{ratio}"
                )

            for _ in range(40):
                await client.put(batch, partition_id="mem")
            await measure("after 40 puts", 40 * nbytes)
            await client.clear_partition("mem")
            await measure("after clear", 0)
            for _ in range(40):
                await client.put(batch, partition_id="mem2")
            await measure("after 40 more puts", 40 * nbytes)

    proc = subprocess.Popen(
        [sys.executable, "-m", "tq_async._deploy._cli", "serve"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        address = ""
        for line in proc.stdout:  # the serve process prints its address first
            if line.startswith("TQ_ADDRESS="):
                address = line.strip().split("=", 1)[1]
                break
        asyncio.run(run(proc.pid, address))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def idle_rtt(calls: int = 300) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        with socket_port() as port:
            addresses = {
                "ipc": f"ipc://{tmp}/probe.sock",
                "tcp": f"tcp://127.0.0.1:{port}",
                "inproc": "inproc://probe",
            }
        for name, address in addresses.items():
            ctx = zmq.Context()
            server = ctx.socket(zmq.ROUTER)
            server.bind(address)

            def serve(server: Any = server) -> None:
                while True:
                    frames = server.recv_multipart()
                    server.send_multipart(frames)
                    if frames[1] == b"q":
                        break

            thread = threading.Thread(target=serve)
            thread.start()
            client = ctx.socket(zmq.DEALER)
            client.connect(address)
            for gap in (0.0, 0.001, 0.01):
                times = []
                for _ in range(calls):
                    if gap:
                        time.sleep(gap)
                    t0 = time.perf_counter()
                    client.send(b"x" * 100)
                    client.recv()
                    times.append(time.perf_counter() - t0)
                times.sort()
                print(
                    f"idle-rtt {name:6s} after {gap * 1e3:4.0f} ms idle: p50 "
                    f"{times[len(times) // 2] * 1e6:4.0f} us, p99 "
                    f"{times[int(len(times) * 0.99)] * 1e6:4.0f} us"
                )
            client.send(b"q")
            client.recv()
            thread.join()
            client.close(linger=0)
            server.close(linger=0)
            ctx.term()


def cold_call(calls: int = 100) -> None:
    import torch

    for spin in (0.0, 0.0002, 0.001, 0.003):
        times = []
        for _ in range(calls):
            time.sleep(0.01)
            end = time.perf_counter() + spin
            while time.perf_counter() < end:
                pass
            t0 = time.perf_counter()
            torch.tensor([1.0]).view(torch.uint8)
            times.append(time.perf_counter() - t0)
        print(
            f"cold-call after 10 ms idle, {spin * 1e3:.1f} ms spin: "
            f"{statistics.median(times) * 1e6:.0f} us"
        )
    firsts, seconds = [], []
    for _ in range(calls):
        time.sleep(0.01)
        t0 = time.perf_counter()
        torch.tensor([1.0]).view(torch.uint8)
        t1 = time.perf_counter()
        torch.tensor([1.0]).view(torch.uint8)
        t2 = time.perf_counter()
        firsts.append(t1 - t0)
        seconds.append(t2 - t1)
    print(
        f"cold-call first / second call after 10 ms idle: "
        f"{statistics.median(firsts) * 1e6:.0f} / {statistics.median(seconds) * 1e6:.0f} us"
    )


_RTT_MSG = b"x" * 40


def _poll_recv(sock: socket.socket, budget: float) -> bytes | None:
    """Read ``sock`` (non-blocking) for up to ``budget`` seconds; None if nothing came."""
    end = time.perf_counter() + budget
    while True:
        try:
            return sock.recv(64)
        except BlockingIOError:
            if time.perf_counter() >= end:
                return None


def _recv(sock: socket.socket, poll: float) -> bytes:
    """One message: polled for up to ``poll`` seconds, then a blocking wait."""
    if poll:
        got = _poll_recv(sock, poll)
        if got is not None:
            return got
    sock.setblocking(True)
    try:
        return sock.recv(64)
    finally:
        sock.setblocking(False)


def _echo_plain(sock: socket.socket, poll: float) -> None:
    sock.setblocking(False)
    while data := _recv(sock, poll):
        sock.send(data)


def _echo_asyncio(sock: socket.socket, poll: float) -> None:
    async def serve() -> None:
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        done = loop.create_future()

        def on_readable() -> None:
            try:
                data = sock.recv(64)
            except BlockingIOError:
                return
            if not data:
                loop.remove_reader(sock.fileno())
                done.set_result(None)
                return
            sock.send(data)

        loop.add_reader(sock.fileno(), on_readable)
        await done

    asyncio.run(serve())


def _rtt_plain(sock: socket.socket, poll: float, calls: int) -> float:
    sock.setblocking(False)
    for _ in range(1000):  # warm-up
        sock.send(_RTT_MSG)
        _recv(sock, poll)
    t0 = time.perf_counter()
    for _ in range(calls):
        sock.send(_RTT_MSG)
        _recv(sock, poll)
    return (time.perf_counter() - t0) / calls


def _rtt_asyncio(sock: socket.socket, poll: float, calls: int) -> float:
    """A request over asyncio's reader callback; with ``poll``, the reply is first polled
    for (what tq_async's clients do, :class:`tq_async._transport._dealer.BusyPoll`)."""

    async def run() -> float:
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        waiter: asyncio.Future[bytes] | None = None

        def on_readable() -> None:
            try:
                data = sock.recv(64)
            except BlockingIOError:
                return
            if waiter is not None and not waiter.done():
                waiter.set_result(data)

        loop.add_reader(sock.fileno(), on_readable)

        async def one() -> bytes:
            nonlocal waiter
            sock.send(_RTT_MSG)
            if poll and (got := _poll_recv(sock, poll)) is not None:
                return got
            waiter = loop.create_future()
            return await waiter

        for _ in range(1000):  # warm-up
            await one()
        t0 = time.perf_counter()
        for _ in range(calls):
            await one()
        loop.remove_reader(sock.fileno())
        return (time.perf_counter() - t0) / calls

    return asyncio.run(run())


def socket_rtt(calls: int = 20_000) -> None:
    """A cross-process round trip of 40 bytes over a Unix socketpair: blocking, polling for
    up to 100 us before blocking, and through asyncio event loops, with and without the
    client polling for the reply (what waking a parked process costs on this box)."""
    cases: list[tuple[str, Callable[..., None], float, Callable[..., float], float]] = [
        ("blocking <-> blocking", _echo_plain, 0.0, _rtt_plain, 0.0),
        ("polling <-> polling", _echo_plain, 1e-4, _rtt_plain, 1e-4),
        ("asyncio <-> asyncio", _echo_asyncio, 0.0, _rtt_asyncio, 0.0),
        ("asyncio <-> asyncio, the client polls", _echo_asyncio, 0.0, _rtt_asyncio, 1e-4),
    ]
    ctx = multiprocessing.get_context("fork")
    for name, echo, echo_poll, client, client_poll in cases:
        runs = []
        for _ in range(3):
            ours, theirs = socket.socketpair()
            child = ctx.Process(target=_child_echo, args=(echo, theirs, ours, echo_poll))
            child.start()
            theirs.close()
            runs.append(client(ours, client_poll, calls))
            ours.close()  # the echo sees the end of the stream and returns
            child.join(timeout=10)
        shown = " / ".join(f"{r * 1e6:.1f}" for r in runs)
        print(f"socket-rtt {name:40s} {shown} us per round trip (3 runs)")


def _child_echo(
    echo: Callable[[socket.socket, float], None],
    sock: socket.socket,
    parents: socket.socket,
    poll: float,
) -> None:
    parents.close()  # else the parent's end stays open here and the echo never sees its end
    echo(sock, poll)


def after_spin(calls: int = 300) -> None:
    """Small calls right after spinning 0 / 1 / 10 ms in Python (no idleness, no syscall)."""
    import torch
    from tensordict import TensorDict

    t = torch.tensor([1.0], dtype=torch.float64)
    cases: dict[str, Callable[[], object]] = {
        "msgspec encode": lambda: msgspec.msgpack.encode({"a": [1, 2, 3]}),
        "torch.tensor": lambda: torch.tensor([1.0], dtype=torch.float64),
        "TensorDict": lambda: TensorDict({"t": t}, batch_size=[1]),
        "20 small dicts": lambda: [{"a": i} for i in range(20)],
    }
    for name, call in cases.items():
        medians = []
        for spin in (0.0, 0.001, 0.01):
            times = []
            for _ in range(calls):
                end = time.perf_counter() + spin
                while time.perf_counter() < end:
                    pass
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            medians.append(f"{statistics.median(times) * 1e6:.1f}")
        print(f"after-spin {name:15s} after 0 / 1 / 10 ms of spinning: {' / '.join(medians)} us")


def _us(call: Callable[[], object], calls: int, prepare: Callable[[], object] | None = None) -> str:
    """The best of 5 means of ``calls`` calls, in us (``prepare`` runs before each, untimed)."""
    means = []
    for _ in range(5):
        total = 0.0
        for _ in range(calls):
            if prepare is not None:
                prepare()
            t0 = time.perf_counter()
            call()
            total += time.perf_counter() - t0
        means.append(total / calls * 1e6)
    return f"{min(means):7.1f} us"


def jagged_assembly(calls: int = 300) -> None:
    """The pieces of a jagged read's assembly (no sockets)."""
    import torch
    from tensordict import TensorDict

    from tq_async._wire import _codec, _nested

    n, length = 256, 512
    values = torch.randn(n * length)
    offsets = torch.arange(n + 1) * length
    dim = _nested.Ragged(offsets, length, length)
    direct = _nested._probed_njt_maker()
    cases: dict[str, Callable[[], object]] = {
        "nested_tensor_from_jagged, shared offsets": lambda: _nested._public_njt(values, dim),
        "nested_tensor_from_jagged, fresh offsets": lambda: _nested._public_njt(
            values, _nested.Ragged(torch.arange(n + 1) * length, length, length)
        ),
        "direct constructor, shared offsets": lambda: direct(values, dim),
        "direct constructor, fresh offsets": lambda: direct(
            values, _nested.Ragged(torch.arange(n + 1) * length, length, length)
        ),
    }
    fields: dict[str, torch.Tensor] = {f"f{i}": direct(values, dim) for i in range(5)}
    fields["reward"] = torch.randn(n)
    cases["TensorDict of 5 jagged + 1 dense, checked"] = lambda: TensorDict(fields, [n])
    unchecked = _nested._probed_tensordict_maker()
    cases["TensorDict of 5 jagged + 1 dense, unchecked"] = lambda: unchecked(fields, n)
    step = {
        "prompts": torch.zeros(n, length, dtype=torch.int64),
        "responses": torch.zeros(n, length, dtype=torch.int64),
        "attention_mask": torch.ones(n, 2 * length, dtype=torch.int64),
        "old_log_probs": torch.randn(n, length),
        "advantages": torch.randn(n, length),
        "rewards": torch.randn(n),
    }
    rows, headers, columns = _codec.columns_from_batch(step)
    for nested in (False, True):
        cases[f"columns_to_tensordict of the step, nested={nested}"] = lambda nested=nested: (
            _codec.columns_to_tensordict(rows, headers, columns, nested=nested)
        )
    for name, call in cases.items():
        print(f"jagged-assembly {name:48s} {_us(call, calls)}")
    held: list[np.ndarray[Any, Any]] = []

    def fresh_buffers() -> None:  # as a read's copies: 5 x 2 MiB written just before
        held[:] = [np.ones(n * length * 8, dtype=np.uint8) for _ in range(5)]

    after = _us(lambda: direct(values, dim), calls, prepare=fresh_buffers)
    print(f"jagged-assembly {'direct constructor after 10 MiB of fresh buffers':48s} {after}")


def jagged_micro_batches(batches: int = 16, rounds: int = 5) -> None:
    """An ``AsyncStreamingDataset``, then a ``StreamingDataLoader`` with 0 and 2 fork workers,
    cutting verl-shaped jagged batches into micro-batches:
    256 rows x 6 jagged fields (prompts 100-1000 and responses 50-500 tokens long, masks and
    float fields sharing their lengths), micro-batches of 64, embedded cluster; micro-batches
    per second, median of ``rounds`` passes over ``batches`` batches each."""
    import torch

    import tq_async as tq

    g = torch.Generator().manual_seed(0)

    def jagged(lengths: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        rows = [torch.ones(n, dtype=dtype) for n in lengths]
        return torch.nested.nested_tensor(rows, layout=torch.jagged)

    prompts = torch.randint(100, 1000, (256,), generator=g).tolist()
    responses = torch.randint(50, 500, (256,), generator=g).tolist()
    batch = {
        "prompts": jagged(prompts),
        "attention_mask": jagged(prompts),
        "responses": jagged(responses),
        "response_mask": jagged(responses),
        "old_log_probs": jagged(responses, torch.float32),
        "advantages": jagged(responses, torch.float32),
    }

    async def run() -> list[float]:
        rates = []
        async with (
            tq.local_cluster(num_storage_units=2) as cluster,
            tq.AsyncClient.connect(cluster.address) as client,
        ):
            for r in range(rounds):
                for _ in range(batches):
                    await client.put(batch, partition_id=f"p{r}")
                await client.seal(f"p{r}")
                ds = tq.AsyncStreamingDataset(client, list(batch), 256, 64, f"p{r}", "t")
                n, t0 = 0, time.perf_counter()
                async with ds:
                    async for _ in ds:
                        n += 1
                rates.append(n / (time.perf_counter() - t0))
        return rates

    def loader(workers: int) -> list[float]:
        rates = []
        with (
            tq.background_cluster(num_storage_units=2) as cluster,
            tq.Client.connect(cluster.address) as client,
        ):
            for r in range(rounds):
                for _ in range(batches):
                    client.put(batch, partition_id=f"p{r}")
                client.seal(f"p{r}")
                ds = tq.StreamingDataset(cluster.address, list(batch), 256, 64, f"p{r}", "t")
                n, t0 = 0, time.perf_counter()
                for _ in tq.StreamingDataLoader(ds, num_workers=workers):
                    n += 1
                rates.append(n / (time.perf_counter() - t0))
        return rates

    for name, rates in (
        ("AsyncStreamingDataset", anyio.run(run)),
        ("StreamingDataLoader, 0 workers", loader(0)),
        ("StreamingDataLoader, 2 fork workers", loader(2)),
    ):
        print(
            f"jagged-micro-batches {name:36s} {statistics.median(rates):5.0f} micro-batches/s "
            f"(passes: {', '.join(f'{r:.0f}' for r in rates)})"
        )


def loader_cpu(batches: int = 2000, rounds: int = 2) -> None:
    """W5's datasets over ``batches`` batches of 32 rows (a sealed partition), with the
    services in ``tq-async serve`` and then embedded: an ``AsyncStreamingDataset``, a
    ``StreamingDataLoader`` with 2 fork workers; items/s and the CPU a batch costs this
    process and (reaped) children, from ``getrusage``, and the children's context switches."""
    import resource

    import torch

    import tq_async as tq

    from ._proc import ServeProcess
    from .w5_sync_face import _async_rate, _loader_rate

    def cpu() -> tuple[float, float, float]:
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (
            me.ru_utime + me.ru_stime,
            kids.ru_utime + kids.ru_stime,
            kids.ru_nvcsw + kids.ru_nivcsw,
        )

    def measure(mode: str, address: str) -> None:
        with tq.Client.connect(address) as client:
            client.put({"x": torch.arange(batches * 32 * 16).view(-1, 16)}, partition_id="p")
            client.seal("p")
        for r in range(rounds):
            for name in ("AsyncStreamingDataset", "StreamingDataLoader, 2 fork workers"):
                before = cpu()
                if name.startswith("Async"):
                    rate = _async_rate(address, "p", f"a{r}", batches)
                else:
                    rate = _loader_rate(address, "p", f"l{r}", 2, batches)
                after = cpu()
                per = [(a - b) / batches for a, b in zip(after, before, strict=True)]
                print(
                    f"loader-cpu {mode:8s} {name:36s} {rate:6.0f} items/s, this process "
                    f"{per[0] * 1e6:4.0f} us, children {per[1] * 1e6:4.0f} us, children's "
                    f"context switches {per[2]:.1f} a batch"
                )

    server = ServeProcess(2)
    try:
        measure("serve", server.address)
    finally:
        server.stop()
    with tq.background_cluster(num_storage_units=2) as cluster:
        measure("embedded", cluster.address)


def _steady_unit() -> int:
    total = 0
    for i in range(2000):
        total += i
    return total


def _steady_worker(cpu: int, seconds: float, out: Any) -> None:
    os.sched_setaffinity(0, {cpu})
    times: list[tuple[float, float]] = []
    end = time.perf_counter() + seconds
    while (t0 := time.perf_counter()) < end:
        _steady_unit()
        times.append((t0, time.perf_counter() - t0))
    out.put((cpu, times))


def steady_cpu(seconds: float = 6.0) -> None:
    """Fixed Python work on every CPU at once: the slow stretches the box itself has."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    cpus = sorted(os.sched_getaffinity(0))
    procs = [ctx.Process(target=_steady_worker, args=(c, seconds, out)) for c in cpus]
    for proc in procs:
        proc.start()
    try:
        results = [out.get(timeout=seconds + 60) for _ in procs]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.terminate()
    for cpu, times in sorted(results):
        durations = sorted(d for _, d in times)
        median = durations[len(durations) // 2]
        slow = [t for t, d in times if d > 5 * median]
        when = sorted({round(t - times[0][0], 1) for t in slow})
        print(
            f"steady-cpu cpu{cpu}: {len(times)} units, median {median * 1e6:.0f} us, "
            f"p99 {durations[int(len(durations) * 0.99)] * 1e6:.0f} us, "
            f"max {durations[-1] * 1e6:.0f} us; {len(slow)} over 5x the median, at s "
            f"{when[:20]}"
        )


PROBES = {
    "tcp-ceiling": tcp_ceiling,
    "same-host": same_host,
    "first-get-meta": first_get_meta,
    "shm-memory": shm_memory,
    "idle-rtt": idle_rtt,
    "cold-call": cold_call,
    "socket-rtt": socket_rtt,
    "after-spin": after_spin,
    "steady-cpu": steady_cpu,
    "jagged-assembly": jagged_assembly,
    "jagged-micro-batches": jagged_micro_batches,
    "loader-cpu": loader_cpu,
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes", description=__doc__)
    parser.add_argument("probe", choices=[*PROBES, "all"])
    args = parser.parse_args()
    for name, probe in PROBES.items():
        if args.probe in (name, "all"):
            probe()


if __name__ == "__main__":
    main()
