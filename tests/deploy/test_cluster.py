"""``local_cluster``: errors of the caller's block come out as themselves; blocking calls on
the loop that runs the services fail at once instead of deadlocking."""

from __future__ import annotations

import gc
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

import tq_async as tq
from _cluster_proc import _read_address, free_port, sigkill


async def test_an_exception_in_the_block_propagates_as_itself() -> None:
    with pytest.raises(ValueError, match="mine") as info:
        async with tq.local_cluster(num_storage_units=1):
            raise ValueError("mine")
    assert type(info.value) is ValueError  # not an ExceptionGroup around it

    class Custom(Exception):
        pass

    with pytest.raises(Custom) as custom:
        async with tq.local_cluster(num_storage_units=1):
            raise Custom("x")
    assert type(custom.value) is Custom


async def test_a_tq_error_in_the_block_propagates_as_itself() -> None:
    with pytest.raises(tq.TQTimeoutError):
        async with (
            tq.local_cluster(num_storage_units=1) as cluster,
            tq.AsyncClient.connect(cluster.address) as client,
        ):
            await client.get_meta(["x"], 1, "p", "t", timeout=0.05)


async def test_cancelling_the_block_still_cancels() -> None:
    with anyio.move_on_after(0.05) as scope:
        async with tq.local_cluster(num_storage_units=1):
            await anyio.sleep_forever()
    assert scope.cancelled_caught


async def test_a_blocking_client_on_the_services_loop_fails_at_once() -> None:
    blocking = tq.Client  # imported first: the module's import (torch, tensordict) is no I/O
    async with tq.local_cluster(num_storage_units=1) as cluster:
        t0 = time.monotonic()
        with pytest.raises(tq.InvalidRequestError, match="would block the event loop") as info:
            blocking.connect(cluster.address).open()
        assert "tq.AsyncClient.connect(address)" in str(info.value)
        assert "anyio.to_thread.run_sync" in str(info.value)
        assert time.monotonic() - t0 < 0.1  # known before any I/O

        # from another thread the same blocking client works
        def use() -> list[str]:
            with tq.Client.connect(cluster.address) as client:
                return client.list_partitions()

        assert await anyio.to_thread.run_sync(use) == []


async def test_iterating_a_streaming_loader_on_the_services_loop_fails_at_once() -> None:
    async with tq.local_cluster(num_storage_units=1) as cluster:
        dataset = tq.StreamingDataset(cluster.address, ["x"], 2, 2, "p", "learner")
        loader = tq.StreamingDataLoader(dataset)
        with pytest.raises(tq.InvalidRequestError, match="StreamingDataLoader"):
            next(iter(loader))


async def test_a_blocking_client_inside_any_running_loop_fails_at_once() -> None:
    # not this loop's services (they run on another thread's loop), so no deadlock, but every
    # other task of this loop would stop for each wait: refused at once, as on the services' loop
    with tq.background_cluster(num_storage_units=1) as cluster:
        t0 = time.monotonic()
        with (
            pytest.raises(
                tq.InvalidRequestError, match="would block the running event loop"
            ) as info,
            tq.Client.connect(cluster.address) as client,
        ):
            client.list_partitions()
        assert "tq.AsyncClient.connect(address)" in str(info.value)
        assert "anyio.to_thread.run_sync" in str(info.value)
        assert time.monotonic() - t0 < 0.1  # known before any I/O

        # from a plain thread the same blocking client works
        def use() -> list[str]:
            with tq.Client.connect(cluster.address) as client:
                return client.list_partitions()

        assert await anyio.to_thread.run_sync(use) == []

    # nothing listens there (refused at once): a BrokenError, from a plain thread
    def unreachable() -> None:
        tq.Client.connect("tcp://127.0.0.1:9", request_timeout=0.2).open()

    with pytest.raises(tq.BrokenError, match="nothing listens at"):
        await anyio.to_thread.run_sync(unreachable)


async def test_iterating_a_streaming_dataset_inside_any_running_loop_fails_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with tq.background_cluster(num_storage_units=1) as cluster:
        async with tq.AsyncClient.connect(cluster.address) as client:
            await client.put({"x": torch.arange(8)}, partition_id="p")
            await client.seal("p")

        def dataset() -> tq.StreamingDataset:
            return tq.StreamingDataset(cluster.address, ["x"], 4, 4, "p", "learner")

        for stream in (dataset(), tq.StreamingDataLoader(dataset(), num_workers=2)):
            t0 = time.monotonic()
            with pytest.raises(tq.InvalidRequestError, match=r"tq\.AsyncStreamingDataset") as info:
                next(iter(stream))
            assert "would block the running event loop" in str(info.value)
            assert "anyio.to_thread.run_sync" in str(info.value)
            assert time.monotonic() - t0 < 0.1  # known before any I/O

        # from a plain thread the same dataset reads
        def read() -> list[list[int]]:
            return [td["x"].tolist() for td, _meta in dataset()]

        assert await anyio.to_thread.run_sync(read) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert "Task was destroyed" not in caplog.text


async def test_a_taken_port_is_a_broken_error_not_an_exception_group() -> None:
    """A service that cannot start raises its own error, as the caller's block's errors do
    (it came out wrapped in the task group's ExceptionGroup)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(tq.BrokenError, match="Address already in use"):
            async with tq.local_cluster(num_storage_units=1, bind=f"tcp://127.0.0.1:{port}"):
                pass


async def test_an_ipc_path_a_service_listens_on_is_refused_and_a_stale_one_is_taken(
    tmp_path: Path,
) -> None:
    """ZMQ binds an ``ipc://`` path by replacing the file there: a second cluster bound at a
    live one's path took it over silently (new clients reached the newcomer, the first one
    served no one). It is refused now, as a taken TCP port is; the file a killed service
    left (nothing listens) is still taken."""
    path = tmp_path / "ctl"
    bind = f"ipc://{path}"
    async with tq.local_cluster(num_storage_units=1, bind=bind) as cluster:
        inode = path.stat().st_ino
        with pytest.raises(tq.BrokenError, match="a service listens there"):
            async with tq.local_cluster(num_storage_units=1, bind=bind):
                pass
        assert path.stat().st_ino == inode  # the first one's socket, still
        async with tq.AsyncClient.connect(cluster.address, request_timeout=10) as client:
            await client.put({"x": torch.arange(2)}, "p")
    with socket.socket(socket.AF_UNIX) as stale:  # a socket file nothing listens on
        path.unlink(missing_ok=True)
        stale.bind(str(path))
    async with (
        tq.local_cluster(num_storage_units=1, bind=bind) as cluster,
        tq.AsyncClient.connect(cluster.address, request_timeout=10) as client,
    ):
        assert await client.list_partitions() == []


#: a program with an ipc cluster it never leaves (killed while it runs)
_IPC_CLUSTER = """
import anyio, tq_async as tq
async def main():
    async with tq.local_cluster(num_storage_units=1, transport="ipc") as cluster:
        print("TQ_ADDRESS=" + cluster.address, flush=True)
        await anyio.sleep_forever()
anyio.run(main)
"""


def _killed_ipc_cluster() -> Path:
    """Run `_IPC_CLUSTER`, SIGKILL it once it serves: its sockets' directory."""
    proc = subprocess.Popen([sys.executable, "-c", _IPC_CLUSTER], stdout=subprocess.PIPE)
    try:
        return Path(_read_address(proc)[len("ipc://") :]).parent
    finally:
        sigkill(proc)
        assert proc.stdout is not None
        proc.stdout.close()


async def test_the_socket_directory_of_a_killed_ipc_cluster_goes_when_the_next_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``local_cluster(transport="ipc")`` keeps its sockets in a ``tq-*`` directory of the
    system's temporary directory, removed when it stops. A SIGKILLed (OOM-killed) program
    cannot: the next ipc cluster started on the host removes it (they piled up in /tmp
    forever). A running cluster's is left alone."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # this test's, the child's too
    monkeypatch.setattr(tempfile, "tempdir", None)
    killed = _killed_ipc_cluster()
    assert killed.is_dir()  # nobody removed it
    async with tq.local_cluster(num_storage_units=1, transport="ipc") as first:
        assert not killed.exists()
        mine = Path(first.address[len("ipc://") :]).parent
        async with tq.local_cluster(num_storage_units=1, transport="ipc") as second:
            assert mine.is_dir()  # a running cluster's is left alone
            async with tq.AsyncClient.connect(second.address, request_timeout=10) as client:
                await client.put({"x": torch.arange(2)}, "p")
    assert not mine.exists()


async def test_a_cancelled_cluster_still_stops_its_metrics_server() -> None:
    """A cluster whose block is cancelled (Ctrl-C in ``asyncio.run``, a timeout around it)
    stops as one that is left: its metrics server's thread was started in a scope already
    cancelled, so it was never stopped (its port stayed taken, its gauges in the registry),
    and nothing after it ran (the ipc sockets' directory stayed)."""
    registry = CollectorRegistry()
    on = f"127.0.0.1:{free_port()}"
    with anyio.CancelScope() as scope:
        async with tq.local_cluster(
            num_storage_units=1, metrics_registry=registry, serve_metrics_on=on
        ) as cluster:
            sockdir = Path(cluster.address[len("ipc://") :]).parent
            scope.cancel()
            await anyio.sleep_forever()
    assert not sockdir.exists()
    # the same port at once, with the same registry
    async with tq.local_cluster(
        num_storage_units=1, metrics_registry=registry, serve_metrics_on=on
    ) as cluster:
        assert cluster.metrics_url == f"http://{on}/metrics"


def _wait_for_a_byte(fd: int) -> None:
    os.read(fd, 1)


# Python >= 3.12 warns about fork() with threads running (the cluster's); the child only waits
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
async def test_a_forked_child_keeps_neither_the_address_nor_the_data_dir(tmp_path: Path) -> None:
    """A child forked while a cluster runs (a DataLoader worker, a pool of rollout workers)
    got copies of its services' sockets and of the data_dir's locks, and kept them after the
    cluster stopped: clients connected to a socket nobody served (and waited for their
    timeout), the cluster started again at its address could not bind it, nor lock its
    data_dir ("in use by another running storage unit"). The child closes its copies."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    options: dict[str, Any] = {"bind": bind, "durability": "process", "data_dir": str(tmp_path)}
    read, write = os.pipe()
    child = multiprocessing.get_context("fork").Process(target=_wait_for_a_byte, args=(read,))
    try:
        async with (
            tq.local_cluster(num_storage_units=1, **options) as cluster,
            tq.AsyncClient.connect(cluster.address, same_host=False) as client,
        ):
            await client.put({"x": torch.arange(2)}, "p")
            child.start()  # while a client is connected, too
        assert child.is_alive()
        with pytest.raises(tq.BrokenError, match="nothing listens"):
            async with tq.AsyncClient.connect(bind, same_host=False, connect_timeout=30):
                pass
        async with (
            tq.local_cluster(num_storage_units=1, **options) as cluster,
            tq.AsyncClient.connect(cluster.address, request_timeout=10) as client,
        ):
            td, _ = await client.get(["x"], 2, "p", "t", timeout=10)
            assert td["x"].tolist() == [0, 1]
    finally:
        os.write(write, b"x")
        if child.pid is not None:
            await anyio.to_thread.run_sync(child.join, 30)
        os.close(read)
        os.close(write)
    assert child.exitcode == 0


async def test_spilled_cells_go_under_data_dir_at_durability_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Config.memory_cap`` (and deployment.md): at ``memory``, cells past the cap spill into
    a scratch directory under ``data_dir``, or the system's temporary directory without one.
    A cluster started as a whole (``local_cluster``, ``tq-async serve``) spilled into the
    temporary directory even with a ``data_dir`` -- often a small tmpfs, in RAM -- however
    fast and large the disk the user pointed ``data_dir`` at."""
    import tempfile

    data_dir, tmp = tmp_path / "data", tmp_path / "tmp"
    data_dir.mkdir()
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    config = tq.Config(num_storage_units=2, memory_cap=64 << 10, data_dir=str(data_dir))
    async with (
        tq.local_cluster(config=config, transport="tcp") as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        x = torch.randn(64, 1024)  # 256 KiB: past the cap
        meta = await client.put({"x": x}, "p")
        assert torch.equal((await client.get_data(meta))["x"], x)
        assert sum(u.state.spills for u in cluster.units) > 0
        spills = sorted(p.name for p in data_dir.iterdir())
        assert len(spills) == 2  # one scratch directory per unit
        assert all(name.startswith("tq-unit-spill-") for name in spills)
        assert not list(tmp.glob("tq-unit-spill-*"))
    assert list(data_dir.iterdir()) == []  # removed when the units stopped


async def test_a_relative_data_dir_survives_a_change_of_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative ``data_dir`` names the directory it named at start: the program changing
    its working directory afterwards made the units look for their spilled cells (and remove
    their scratch directories) under the new one -- acknowledged rows became unreadable."""
    (tmp_path / "run" / "data").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    async with (
        tq.local_cluster(num_storage_units=1, data_dir="data", memory_cap=64 << 10) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        monkeypatch.chdir(tmp_path / "elsewhere")
        xs = [torch.full((64, 256), float(i)) for i in range(4)]  # 64 KiB each: they spill
        metas = [await client.put({"x": x}, "p") for x in xs]
        assert cluster.units[0].state.spills > 0
        for meta, x in zip(metas, xs, strict=True):
            assert torch.equal((await client.get_data(meta))["x"], x)
    assert list((tmp_path / "run" / "data").iterdir()) == []  # the scratch directory went
    assert list((tmp_path / "elsewhere").iterdir()) == []


@pytest.mark.parametrize("what", ["missing", "a file", "foreign"])
async def test_a_bad_durable_data_dir_is_refused_before_anything_is_written(
    tmp_path: Path, what: str
) -> None:
    """deployment.md: a missing directory, or one holding other files, is refused at start
    (a typo never starts an empty controller silently). A cluster started as a whole made
    the units' directories first: it created a missing ``data_dir`` and started empty in it,
    failed on a file with a traceback (NotADirectoryError), and left ``units/`` with a GiB
    arena file each in a directory of someone else's before the controller refused it."""
    data_dir = tmp_path / "d"
    if what == "a file":
        data_dir.write_text("mine")
    elif what == "foreign":
        data_dir.mkdir()
        (data_dir / "notes.txt").write_text("mine")
    config = tq.Config(num_storage_units=1, durability="process", data_dir=str(data_dir))
    with pytest.raises(tq.ConfigError, match=r"data_dir: .*(not a directory|not empty)"):
        async with tq.local_cluster(config=config):
            pass
    if what == "missing":
        assert not data_dir.exists()
    elif what == "foreign":
        assert [p.name for p in data_dir.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("bad", ["2", 2.0, True, None])
async def test_a_number_of_units_that_is_not_an_int_is_an_invalid_request(bad: object) -> None:
    """Every error derives from TQError and names the argument (it was a TypeError from a
    comparison, or a bool taken as one unit)."""
    with pytest.raises(tq.InvalidRequestError, match="num_storage_units"):
        async with tq.local_cluster(num_storage_units=bad):  # type: ignore[arg-type]
            pass


async def test_a_stopped_cluster_is_not_kept_alive_by_its_timers() -> None:
    """A local_cluster stopped while a watch was parked and a get_meta waited on a field no
    row has: the controller's loop timers (the watch's end of poll, the waiting warnings)
    stayed armed after the stop and kept the controller, its units and their cells alive
    until they fired (the poll's 30 s, or any poll a watcher asked for). They end with it."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(4)}, partition_id="p")
        ctl = cluster.controller
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                async for _ in client.watch(poll=3600):
                    pass

            tg.start_soon(watch)
            tg.start_soon(partial(client.get_meta, ["y"], 2, "p", "t"))  # no field y: waits
            with anyio.fail_after(10):  # (no event tells a request parked: the counts do)
                while not ctl.watch.parked or ctl.waiting < 1:
                    await anyio.lowlevel.checkpoint()
            tg.cancel_scope.cancel()
        alive = [weakref.ref(ctl), weakref.ref(cluster.units[0])]
        del ctl
    del cluster
    gc.collect()
    assert [ref() for ref in alive] == [None, None]


async def test_numpy_scalars_are_taken_as_the_counts_and_seconds_they_are() -> None:
    """``local_cluster(num_storage_units=np.int64(2), capacity=np.int64(10))`` was refused
    ("must be an int >= 1, got np.int64(2)"), and so were ``tq.Deadlines`` /
    ``tq.AdmissionConfig`` of numpy's scalars; a ``shm_cap`` given as a float (``1e6``) or
    a string failed inside the started unit with a TypeError wrapped in an ExceptionGroup.
    numpy's scalars are taken as Python's; a ``shm_cap`` that is no int is refused naming it."""
    deadlines = tq.Deadlines(put_lease=np.float32(30.0), unit_suspend_after=np.int64(10))
    assert type(deadlines.put_lease) is float
    admission = tq.AdmissionConfig(max_staleness=np.int64(1))
    assert type(admission.max_staleness) is int
    async with (
        tq.local_cluster(
            num_storage_units=np.int64(2),
            capacity=np.int64(10),
            shm_cap=np.int64(1 << 20),
            deadlines=deadlines,
            admission=admission,
        ) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        assert len(cluster.units) == 2
        await client.put({"x": torch.ones(2)}, "p")
        assert (await client.partition_info("p"))["rows"] == 2
    for bad in (1e6, "1M"):
        with pytest.raises(tq.InvalidRequestError, match="shm_cap must be an int"):
            async with tq.local_cluster(num_storage_units=1, shm_cap=bad):  # type: ignore[arg-type]
                pass
    with pytest.raises(tq.InvalidRequestError, match="put_lease must be a positive number"):
        tq.Deadlines(put_lease=np.float32("nan"))
