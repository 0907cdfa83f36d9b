"""The blocking client's rules and faults: threads, the services' loop, a killed controller,
Ctrl-C, and ``fork`` (a forked child's client re-creates its connections; never a hang)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tq_async as tq
from _cluster_proc import warm_python
from tq_async._wire._buffers import buffer_pool

_FORK = mp.get_context("fork")


@pytest.fixture
def served() -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``tq-async serve`` in its own process: (address, process)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tq_async._deploy._cli", "serve", "--storage-units", "1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line.startswith("TQ_ADDRESS="), line
    try:
        yield line.split("=", 1)[1], proc
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


def _until(condition: Any, what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def _waiting(client: tq.Client) -> bool:
    """A call of ``client`` is waiting on its controller connection."""
    return bool(client._links.controller is not None and client._links.controller._busy.locked())


def test_a_second_thread_is_refused_at_once_naming_the_rule() -> None:
    with (
        tq.background_cluster(num_storage_units=1) as cluster,
        tq.Client.connect(cluster.address) as client,
    ):
        got: list[Any] = []
        waiter = threading.Thread(
            target=lambda: got.append(client.get_meta(["x"], 1, "p", "t")), daemon=True
        )
        waiter.start()
        _until(lambda: _waiting(client), "the get_meta to wait")
        started = time.monotonic()
        with pytest.raises(tq.InvalidRequestError, match="one thread at a time"):
            client.list_partitions()
        assert time.monotonic() - started < 0.1
        with tq.Client.connect(cluster.address) as other:  # one client per thread works
            other.put({"x": torch.ones(1)}, partition_id="p")
        waiter.join(30)
        assert len(got[0]) == 1


async def test_a_blocking_call_on_the_services_loop_fails_at_once() -> None:
    async with tq.local_cluster(num_storage_units=1) as cluster:
        started = time.monotonic()
        with pytest.raises(tq.InvalidRequestError, match="would block the event loop"):
            tq.Client.connect(cluster.address).open()
        assert time.monotonic() - started < 0.1


@pytest.mark.parametrize("same_host", [True, False], ids=["unix-socket", "tcp"])
def test_controller_killed_during_a_blocking_call_is_broken_at_once(
    served: tuple[str, subprocess.Popen[str]], same_host: bool
) -> None:
    address, proc = served
    with tq.Client.connect(address, same_host=same_host) as client:
        killer = threading.Thread(
            target=lambda: (_until(lambda: _waiting(client), "get_meta"), proc.kill()),
            daemon=True,
        )
        killer.start()
        started = time.monotonic()
        with pytest.raises(tq.BrokenError):
            client.get_meta(["x"], 1, "p", "t")  # waits for rows that never come
        killer.join(10)
        assert time.monotonic() - started < 5.0


_CTRL_C = """
import os, signal, sys, threading, time, torch, tq_async as tq
address = sys.argv[1]
with tq.Client.connect(address) as client:
    client.list_partitions()
    conn = client._links.controller
    def interrupt():
        while not conn._busy.locked():
            time.sleep(0.001)
        time.sleep(0.05)  # the request is on the service (sent before the lock is seen)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt, daemon=True).start()
    try:
        client.get_meta(["x"], 1, "p", "t")
        print("not interrupted")
    except KeyboardInterrupt:
        print("interrupted")
    client.put({"x": torch.arange(1)}, partition_id="p")
    # the cancelled get_meta took nothing: the row is there for the same task
    print(len(client.get_meta(["x"], 1, "p", "t", timeout=10)))
"""


def test_ctrl_c_during_a_blocking_get_meta_cancels_it_on_the_service(
    served: tuple[str, subprocess.Popen[str]],
) -> None:
    out = _run_script(_CTRL_C, served[0])
    assert out.stdout.split() == ["interrupted", "1"], out.stderr


#: what every script runs first: a watchdog (one still running after 50 s prints every
#: thread's stack, which the failure shows), and Ctrl-C as in a program started from a shell.
#: A process inherits an ignored SIGINT, and then Python never installs its handler: three CI
#: runs of the full suite had the scripts' SIGINT ignored (their get_meta waited forever,
#: the thread that sent SIGINT gone); which earlier test of the same worker left SIGINT
#: ignored at the C level (where `signal.getsignal` does not see it) is not known.
_PRELUDE = """import faulthandler, signal
faulthandler.dump_traceback_later(50, exit=True)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
"""


def _run_script(script: str, address: str) -> subprocess.CompletedProcess[str]:
    """``script`` in a process of its own (`warm_python`) after `_PRELUDE`, given the
    cluster's address (bounded in time)."""
    with warm_python(_PRELUDE + script, address, stderr=True) as proc:
        code = proc.wait(timeout=60)  # (its output is a few lines: the socket holds them)
        assert proc.stderr is not None
        out = subprocess.CompletedProcess(
            script, code, proc.stdout.read().decode(), proc.stderr.read().decode()
        )
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


_CTRL_C_LOADER = """
import os, signal, sys, threading, time, torch, tq_async as tq
address = sys.argv[1]
ds = tq.StreamingDataset(address, ["x"], 2, 2, "loader-ctrl-c", "t")
loader = tq.StreamingDataLoader(ds)
def interrupt():
    while ds._local is None:
        time.sleep(0.001)
    conn = ds._local.address.client._links.controller
    while conn is None or not conn._busy.locked():
        time.sleep(0.001)
        conn = ds._local.address.client._links.controller
    time.sleep(0.05)  # the request is on the service (sent before the lock is seen)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=interrupt, daemon=True).start()
try:
    for _ in loader:  # waits for rows that are not there yet
        print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
print(ds.state_dict()["batch_index"])
with tq.Client.connect(address) as client:
    client.put({"x": torch.arange(2)}, partition_id="loader-ctrl-c")
    client.seal("loader-ctrl-c")
# the interrupted fetch took nothing, and the loader goes on where it was
print([td["x"].tolist() for td, _ in loader])
"""


def test_ctrl_c_while_a_loader_waits_cancels_the_fetch_and_the_loader_goes_on(
    served: tuple[str, subprocess.Popen[str]],
) -> None:
    out = _run_script(_CTRL_C_LOADER, served[0])
    assert out.stdout.split("\n")[:3] == ["interrupted", "0", "[[0, 1]]"], out.stderr


# ---- fork ------------------------------------------------------------------------------------


def _use_inherited(client: tq.Client, queue: Any) -> None:
    client.put({"x": torch.arange(3) + 10}, partition_id="child")
    td, _ = client.get(["x"], 3, "child", "t")
    big = client.put({"y": torch.full((64, 1024), 2.0)}, partition_id="child")  # shared memory
    assert client.get_data(big)["y"].sum().item() == 2.0 * 64 * 1024
    queue.put(td["x"].tolist())


@pytest.mark.parametrize("where", ["serve", "background"])
def test_a_client_used_in_a_forked_child_reconnects_and_the_parents_keeps_working(
    served: tuple[str, subprocess.Popen[str]], where: str
) -> None:
    def run(address: str) -> None:
        with tq.Client.connect(address) as client:
            client.put({"x": torch.arange(4)}, partition_id="p")  # sockets in use
            big = client.put({"y": torch.ones(64, 1024)}, partition_id="q")  # arenas mapped
            queue = _FORK.Queue()
            proc = _FORK.Process(target=_use_inherited, args=(client, queue))
            proc.start()
            assert queue.get(timeout=60) == [10, 11, 12]
            proc.join(30)
            assert proc.exitcode == 0
            td, _ = client.get(["x"], 4, "p", "t")  # the parent's connections are untouched
            assert td["x"].tolist() == [0, 1, 2, 3]
            assert client.get_data(big)["y"].sum().item() == 64 * 1024

    if where == "serve":
        run(served[0])
    else:  # services on a thread of this very process: the child reaches them by socket
        with tq.background_cluster(num_storage_units=1) as cluster:
            run(cluster.address)


def _copy_in_child(queue: Any) -> None:
    buffer_pool.copy(memoryview(bytearray(1 << 20)))
    queue.put("copied")


def test_a_lock_another_thread_held_at_fork_does_not_hang_the_child() -> None:
    # the hang class behind "forked DataLoader workers hang": a thread of the parent (the
    # services' loop, a copy on a worker thread) holds a lock at the instant of the fork
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with buffer_pool._lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    held.wait(10)
    queue = _FORK.Queue()
    proc = _FORK.Process(target=_copy_in_child, args=(queue,))
    proc.start()
    try:
        assert queue.get(timeout=30) == "copied"
    finally:
        release.set()
        proc.join(30)
        if proc.exitcode is None:
            os.kill(proc.pid, signal.SIGKILL)
    assert proc.exitcode == 0


def _list_in_child(client: tq.Client, queue: Any) -> None:
    try:
        client.list_partitions()
        queue.put("answered")
    except tq.TQError as exc:
        queue.put(type(exc).__name__)


def test_a_child_forked_while_a_thread_finds_the_controller_again_does_not_hang() -> None:
    """A thread of the parent was finding a restarted controller again (its rejoin waiting for
    an answer) when a DataLoader worker forked: the child's first call waited for the
    parent's rejoin to end, which never happens in the child (a hang). It finds the
    controller itself."""
    from _cluster_proc import free_port

    port = free_port()
    serve = [sys.executable, "-m", "tq_async._deploy._cli", "serve", "--storage-units", "1"]
    proc = subprocess.Popen(
        [*serve, "--bind", f"tcp://127.0.0.1:{port}"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    address = proc.stdout.readline().strip().split("=", 1)[1]
    proc.stdout.close()
    client = tq.Client.connect(address, request_timeout=1, same_host=False).open()
    client.list_partitions()
    proc.kill()
    proc.wait(10)
    with socket.socket() as silent:  # the controller's address accepts, nothing answers
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        silent.bind(("127.0.0.1", port))
        silent.listen(16)

        def call() -> None:
            for _ in range(3):  # the first may find the connection broken
                with contextlib.suppress(tq.TQError):
                    client.list_partitions()

        threading.Thread(target=call, daemon=True).start()
        _until(lambda: client._links._rejoining is not None, "the rejoin", 30)
        queue = _FORK.Queue()
        child = _FORK.Process(target=_list_in_child, args=(client, queue))
        child.start()
        try:
            assert queue.get(timeout=60) == "TQTimeoutError"  # its own rejoin: no answer
        finally:
            child.join(10)
            if child.exitcode is None:
                child.kill()
            client.close()


# ---- a forked 4-rank x 2-worker DataLoader, every rank holding an open client ---------------

_RANKS, _WORKERS, _ROWS = 4, 2, 16


def _rank(address: str, rank: int, client: tq.Client, queue: Any) -> None:
    client.list_partitions()  # the inherited client, used in the rank before its workers fork
    dataset = tq.StreamingDataset(address, ["x"], 2, 2, "p", f"task{rank}", prefetch=2)
    loader = tq.StreamingDataLoader(dataset, num_workers=_WORKERS, timeout=60)
    got = sorted(int(v) for td, _ in loader for v in td["x"].view(-1).tolist())
    client.list_partitions()
    queue.put((rank, got))


def forked_loaders(address: str) -> dict[int, list[int]]:
    """One run: 4 forked ranks, each with 2 forked DataLoader workers; rank -> rows read."""
    with tq.Client.connect(address) as client:
        client.put({"x": torch.arange(_ROWS)}, partition_id="p")
        client.seal("p")
        queue = _FORK.Queue()
        procs = [
            _FORK.Process(target=_rank, args=(address, r, client, queue)) for r in range(_RANKS)
        ]
        for p in procs:
            p.start()
        try:
            got = dict(queue.get(timeout=120) for _ in procs)
        finally:
            for p in procs:
                p.join(30)
                if p.exitcode is None:
                    p.kill()
        assert [p.exitcode for p in procs] == [0] * _RANKS
        client.clear_partition("p")
        return got


def test_forked_ranks_with_forked_loader_workers_finish() -> None:
    with tq.background_cluster(num_storage_units=2) as cluster:
        for _ in range(2):
            got = forked_loaders(cluster.address)
            assert got == {r: list(range(_ROWS)) for r in range(_RANKS)}


# ---- the same connection kinds and recoveries as the async client ---------------------------


def test_curve_through_the_blocking_client() -> None:
    server_public, server_secret = tq.curve_keypair()
    good_public, good_secret = tq.curve_keypair()
    bad_public, bad_secret = tq.curve_keypair()
    server = tq.CurveServer(server_public, server_secret, allowed_clients=[good_public])
    with tq.background_cluster(num_storage_units=2, curve=server) as cluster:
        good = tq.CurveClient(server_public, good_public, good_secret)
        with tq.Client.connect(cluster.address, curve=good) as client:
            meta = client.put({"x": torch.arange(4)}, "p")
            assert client.get_data(meta)["x"].tolist() == [0, 1, 2, 3]
            big = client.put({"y": torch.ones(64, 1024)}, "p")  # straight to the units
            assert client.get_data(big)["y"].sum().item() == 64 * 1024
        unknown = tq.CurveClient(server_public, bad_public, bad_secret)
        started = time.monotonic()
        with pytest.raises((tq.BrokenError, tq.TQTimeoutError, tq.AuthenticationError)):
            tq.Client.connect(cluster.address, curve=unknown, request_timeout=0.3).open()
        assert time.monotonic() - started < 5


def test_a_curve_mismatch_through_the_blocking_client_says_so_at_once() -> None:
    # the blocking connection once left out the monitor's mechanism-mismatch event: it
    # waited out its connect timeout and said nothing about CURVE
    server_public, server_secret = tq.curve_keypair()
    client_public, client_secret = tq.curve_keypair()
    curve = tq.CurveClient(server_public, client_public, client_secret)
    plain = tq.background_cluster(num_storage_units=1, transport="tcp")
    with plain as cluster, pytest.raises(tq.AuthenticationError, match="not use CURVE"):
        tq.Client.connect(cluster.address, curve=curve, connect_timeout=5).open()
    server = tq.CurveServer(server_public, server_secret)
    curved = tq.background_cluster(num_storage_units=1, curve=server, transport="tcp")
    with curved as cluster, pytest.raises(tq.AuthenticationError, match=r"curve=tq\.CurveClient"):
        tq.Client.connect(cluster.address, connect_timeout=5).open()


def test_the_blocking_client_follows_a_unit_restarted_on_a_new_port() -> None:
    from _cluster_proc import serve_role

    big = {"x": torch.full((64, 1024), 1.0)}  # 256 KiB: straight to the units
    with serve_role("controller") as (_, address):
        args = ("storage", "--controller", address)
        with (
            serve_role(*args, "--unit-id", "0", line="TQ_UNIT="),
            serve_role(*args, "--unit-id", "1", line="TQ_UNIT=") as (u1, _unit1),
            tq.Client.connect(address, request_timeout=10) as client,
        ):
            before = [client.put(big, "p") for _ in range(2)]
            assert sorted(m.units[0] for m in before) == [0, 1]
            u1.send_signal(signal.SIGKILL)
            u1.wait(timeout=10)
            with serve_role(*args, "--unit-id", "1", line="TQ_UNIT="):
                after = [client.put(big, "q") for _ in range(4)]
                assert sorted(m.units[0] for m in after) == [0, 0, 1, 1]
                for m in after:
                    assert client.get_data(m)["x"][0, 0].item() == 1.0
                on_1 = next(m for m in before if m.units[0] == 1)
                with pytest.raises(tq.RowsNotFound):
                    client.get_data(on_1)


def _reading(client: tq.Client) -> bool:
    """A call of ``client`` is waiting on its storage unit's connection."""
    conn = client._links.units.get(0)
    return conn is not None and conn._busy.locked()


@contextlib.contextmanager
def _closed_under_a_read(
    same_host: bool,
) -> Iterator[tuple[list[BaseException], tq.Client, str]]:
    """A get waiting for a paused storage unit's cells while another thread closes its
    client; yields what the get raised, the closed client and the cluster's address (the
    unit resumed)."""
    from _cluster_proc import serve_role

    with serve_role("controller") as (_, address):
        args = ("storage", "--controller", address, "--unit-id", "0")
        with serve_role(*args, line="TQ_UNIT=") as (unit, _):
            client = tq.Client.connect(address, inline_get_bytes=0, same_host=same_host).open()
            client.put({"x": torch.arange(4)}, partition_id="p")
            outcome: list[BaseException] = []

            def read() -> None:
                try:
                    client.get(["x"], 4, "p", "t")
                except BaseException as exc:
                    outcome.append(exc)

            unit.send_signal(signal.SIGSTOP)
            try:
                reader = threading.Thread(target=read, daemon=True)
                reader.start()
                _until(lambda: _reading(client), "the get to read from the unit")
                client.close()
                reader.join(30)
                assert not reader.is_alive(), "the get did not see the close"
            finally:
                unit.send_signal(signal.SIGCONT)
            yield outcome, client, address


def test_closing_the_client_under_a_get_reading_from_a_same_host_unit_ends_it_at_once() -> None:
    """A get waiting for a (paused) same-host unit's cells, its client closed by another
    thread: the read's fall-back to the unit's socket dialled the unit again on the closed
    client and waited there for the whole request timeout (TQTimeoutError after 60 s, a
    connection left open). It fails with ClosedError and opens nothing."""
    with _closed_under_a_read(same_host=True) as (outcome, client, _):
        assert isinstance(outcome[0], tq.ClosedError), outcome
        assert client._links.units == {}


@pytest.mark.parametrize("same_host", [True, False], ids=["unix-socket", "tcp"])
def test_a_get_whose_client_closes_while_it_reads_gives_its_rows_back(same_host: bool) -> None:
    """The get's rows were taken when its client closed under its read: its give-back, a
    request on the closed client, failed ('could not give back the rows'), and the rows
    stayed consumed for nobody. The close gives them back (as it aborts the puts in flight)."""
    with _closed_under_a_read(same_host) as (outcome, _, address):
        assert isinstance(outcome[0], tq.ClosedError), outcome
        with tq.Client.connect(address) as other:
            again = other.get_meta(["x"], 4, "p", "t", timeout=30)
            assert sorted(again.global_indexes) == [0, 1, 2, 3]


def test_a_close_under_a_same_host_reads_copy_fails_it_with_closed_error(
    served: tuple[str, subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client closed (by another thread) right as a get copied its cells out of the
    unit's shared memory: the get failed with BrokenError, 'retry once it is back', though
    nothing broke and a retry on the closed client cannot work. It fails with ClosedError."""
    from tq_async._client._sync import _get

    address, _ = served
    client = tq.Client.connect(address, inline_get_bytes=0).open()
    client.put({"y": torch.ones(64, 1024)}, partition_id="p")  # 256 KiB: shared memory
    read_arena = _get.GetPath._read_arena

    def closed_first(self: Any, *args: Any) -> Any:
        client.close()  # (as another thread's close at this instant)
        return read_arena(self, *args)

    monkeypatch.setattr(_get.GetPath, "_read_arena", closed_first)
    with pytest.raises(tq.ClosedError):
        client.get(["y"], 64, "p", "t")
    monkeypatch.undo()
    with tq.Client.connect(address) as other:  # and the close gave the rows back
        assert len(other.get_meta(["y"], 64, "p", "t", timeout=30)) == 64


def test_services_closed_under_a_waiting_in_process_call_end_it_at_once() -> None:
    # inproc has no disconnect events: the closing endpoint wakes the blocked thread itself
    cluster = tq.background_cluster(num_storage_units=1)
    try:
        with tq.Client.connect(cluster.address) as client:
            assert client._links.controller is not None
            assert client._links.controller.inproc
            closer = threading.Thread(
                target=lambda: (_until(lambda: _waiting(client), "get_meta"), cluster.close()),
                daemon=True,
            )
            closer.start()
            started = time.monotonic()
            with pytest.raises((tq.BrokenError, tq.ClosedError)):
                client.get_meta(["x"], 1, "p", "t")
            closer.join(30)
            assert time.monotonic() - started < 5.0
    finally:
        cluster.close()


@pytest.mark.parametrize(
    "same_host",
    [pytest.param(False, id="tcp"), pytest.param(True, id="unix-socket")],
)
def test_a_paused_controller_is_retried_and_answers_once_it_resumes(
    served: tuple[str, subprocess.Popen[str]], same_host: bool
) -> None:
    # retry_after: no reply yet -> over ZMQ, reconnect under the same identity and resend;
    # the service deduplicates, so the put runs once. A Unix socket loses no reply without
    # ending: the request waits (as the async connection does; reconnecting there stormed a
    # busy service's listen queue)
    address, proc = served
    with tq.Client.connect(
        address, retry_after=0.2, request_timeout=30, same_host=same_host
    ) as client:
        client.put({"x": torch.arange(2)}, partition_id="p")
        reconnects = client._links.controller.reconnects if client._links.controller else 0
        proc.send_signal(signal.SIGSTOP)
        resumer = threading.Timer(1.0, proc.send_signal, args=(signal.SIGCONT,))
        resumer.start()
        try:
            client.put({"x": torch.arange(2) + 2}, partition_id="p")  # waits out the pause
        finally:
            resumer.join()
        assert client._links.controller is not None
        if same_host:
            assert client._links.controller.address.startswith("uds://")
            assert client._links.controller.reconnects == reconnects
        else:
            assert client._links.controller.reconnects > reconnects
        td, _ = client.get(["x"], 4, "p", "t", timeout=10)
        assert sorted(td["x"].tolist()) == [0, 1, 2, 3]  # each put once
        with pytest.raises(tq.TQTimeoutError):  # and nothing more is there
            client.get_meta(["x"], 1, "p", "t", timeout=0.2)


def test_a_write_to_a_paused_controller_waits_under_a_timeout_of_years(
    served: tuple[str, subprocess.Popen[str]],
) -> None:
    # a put too big for the Unix socket's buffer waits, in the calling thread, for room
    # until its timeout: ``request_timeout=1e12`` went to ``select`` as it was and raised
    # OverflowError (not a TQError) at once; now the write waits out the pause
    address, proc = served
    tags = [{"k": "x" * 1000}] * 4000  # 4 MB of tags: one PutInline the socket cannot hold
    with tq.Client.connect(address, request_timeout=1e12) as client:
        conn = client._links.controller
        assert conn is not None
        assert conn.address.startswith("uds://")
        stream = conn._stream
        assert stream is not None
        proc.send_signal(signal.SIGSTOP)
        failed: list[BaseException] = []

        def put() -> None:
            try:
                client.put({"x": torch.arange(4000)}, partition_id="p", tags=tags)
            except BaseException as exc:
                failed.append(exc)

        putter = threading.Thread(target=put)
        putter.start()
        try:
            _until(lambda: stream.blocked or not putter.is_alive(), "the write to block")
            assert not failed, repr(failed)
        finally:
            proc.send_signal(signal.SIGCONT)
            putter.join(60)
        assert not putter.is_alive()
        assert not failed, repr(failed)
        meta = client.get_meta(["x"], 4000, "p", "t", timeout=10)
        assert meta.size == 4000


def test_a_gets_hold_ended_while_another_thread_waits_on_the_controller_is_acknowledged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two threads of one blocking Client, each call on its own: an auto-clear ``get`` ends
    its hold with a one-way ``Ack`` while the other thread's ``get_meta`` waits on the
    controller connection. The Ack was dropped (logged at debug: "in use by another
    thread"), neither call failed, and the rows stayed held for good: auto-clear never freed
    them. The thread that holds the connection sends it."""
    from tq_async._client._sync import _get

    with (
        tq.background_cluster(num_storage_units=1) as cluster,
        tq.Client.connect(cluster.address) as client,
        tq.Client.connect(cluster.address) as other,
    ):
        client.register_tasks(["t"], "p")
        client.put({"i": torch.arange(2)}, partition_id="p")
        got: list[Any] = []
        waiter = threading.Thread(
            target=lambda: got.append(client.get_meta(["x"], 1, "q", "t", timeout=30)),
            daemon=True,
        )
        read = _get.GetPath._read

        def then_wait(self: Any, *args: Any, **kwargs: Any) -> Any:
            td = read(self, *args, **kwargs)
            waiter.start()  # the other thread takes the controller connection, and waits
            _until(lambda: _waiting(client), "the other thread's get_meta to wait")
            return td

        monkeypatch.setattr(_get.GetPath, "_read", then_wait)
        td, _ = client.get(["i"], 2, "p", "t")
        monkeypatch.undo()
        assert td["i"].tolist() == [0, 1]
        other.put({"x": torch.ones(1)}, partition_id="q")
        waiter.join(30)
        assert len(got[0]) == 1
        info = client.partition_info("p")
        assert info["leased"] == {}
        assert info["rows"] == 0  # acknowledged: auto-clear freed them
