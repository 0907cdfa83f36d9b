"""``tq-async status ADDRESS``: a running ``tq-async serve`` on one screen, as JSON, live."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from prometheus_client import CollectorRegistry

import tq_async as tq
from _cluster_proc import free_port, serve_role, sigkill
from _services import START_TIMEOUT, refused_port, service
from tq_async._controller import _server
from tq_async._deploy import _status as status_module
from tq_async._deploy._status import cluster_status, render, run_status
from tq_async._transport._dealer import DealerConnection
from tq_async._wire._protocol import ClusterStatus


def _status(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tq_async._deploy._cli", "status", *argv],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


async def test_status_shows_partitions_tasks_and_units(tmp_path: Path) -> None:
    with service([], tmp_path / "serve.err") as svc:
        address = svc.wait_line("TQ_ADDRESS=")
        async with tq.AsyncClient.connect(address) as client:
            await client.put({"x": torch.arange(4)}, "p")
            await client.get_meta(["x"], 2, "p", "t", lease=60)
            await client.seal("p")

            done = _status(address)
            assert done.returncode == 0, done.stderr
            screen = done.stdout
            assert f"tq-async cluster at {address}" in screen
            assert "p: 4 rows, sealed, fields: x" in screen
            assert "task t: consumed 2, ready 2, leased 2" in screen
            assert "unit 0 [up]" in screen
            assert "unit 1 [up]" in screen
            assert "policy version: -1" in screen
            assert "security: CURVE off" in screen
            assert "connections asked in the last 60 s, 0 watches waiting" in screen

            done = _status(address, "--json")
            assert done.returncode == 0, done.stderr
            status = json.loads(done.stdout)
            info = status["partitions"]["p"]
            assert (info["rows"], info["sealed"], info["consumed"]) == (4, True, {"t": 2})
            assert (info["ready"], info["leased"]) == ({"t": 2}, {"t": 2})
            assert sum(u["rows"] for u in status["units"].values()) == 4
            assert {u["state"] for u in status["units"].values()} == {"up"}
            # this test's client and the status command's connection, at least
            assert status["clients"]["active"] >= 2
            assert status["security"] == {
                "curve": False,
                "server_key": None,
                "allowed_clients": None,
            }
        assert svc.stop() == 0


async def test_status_names_the_curve_keys_and_the_clients() -> None:
    server_public, server_secret = tq.curve_keypair()
    client_public, client_secret = tq.curve_keypair()
    server = tq.CurveServer(server_public, server_secret, allowed_clients=[client_public])
    async with tq.local_cluster(num_storage_units=1, curve=server) as cluster:
        keys = tq.CurveClient(server_public, client_public, client_secret)
        async with tq.AsyncClient.connect(cluster.address, curve=keys) as client:
            await client.list_partitions()
            async with client.watch() as w:

                async def step() -> None:
                    await w.__anext__()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(step)
                    while not cluster.controller.watch.parked:
                        await anyio.wait_all_tasks_blocked()
                    status = cluster.controller._on_cluster_status(None, ClusterStatus())  # type: ignore[arg-type]
                    tg.cancel_scope.cancel()
    assert status["security"] == {
        "curve": True,
        "server_key": server_public.decode(),
        "allowed_clients": 1,
    }
    assert status["clients"]["active"] >= 1
    assert status["clients"]["watching"] == 1
    screen = render({**status, "partitions": {}}, cluster.address)
    assert (
        f"security: CURVE on, server key {server_public.decode()}, lets in 1 client keys" in screen
    )
    assert "1 watches waiting" in screen


@pytest.mark.parametrize(
    ("scope", "line"),
    [
        ("partition", "capacity: 8 rows per partition"),
        ("global", "capacity: 8 rows in all partitions together"),
    ],
)
async def test_status_says_what_the_capacity_counts(scope: str, line: str) -> None:
    """A global capacity read "8 rows per global"."""
    async with tq.local_cluster(num_storage_units=1, capacity=8, capacity_scope=scope) as cluster:
        status = cluster.controller._on_cluster_status(None, ClusterStatus())  # type: ignore[arg-type]
    assert line in render({**status, "partitions": {}}, cluster.address).splitlines()


def test_clients_seen_counts_a_window_and_forgets_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(_server.time, "monotonic", lambda: now[0])
    seen = _server.ClientsSeen()
    for i in range(3000):  # more than a prune's threshold
        seen.seen(b"c%d" % i)
    assert seen.active() == 3000
    now[0] += _server.CLIENT_WINDOW + 1
    seen.seen(b"late")
    assert seen.active() == 1


def test_status_watch_prints_again_when_the_cluster_changes(tmp_path: Path) -> None:
    with service([], tmp_path / "serve.err") as svc:
        address = svc.wait_line("TQ_ADDRESS=")
        argv = ["status", address, "--json", "--watch", "--screens", "2"]
        with subprocess.Popen(
            [sys.executable, "-m", "tq_async._deploy._cli", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        ) as watcher:
            assert watcher.stdout is not None
            first = json.loads(watcher.stdout.readline())  # subscribed before it printed
            assert first["partitions"] == {}
            with tq.Client.connect(address) as client:
                client.put({"x": torch.arange(3)}, "p")
            second = json.loads(watcher.stdout.readline())
            assert second["partitions"]["p"]["rows"] in (0, 3)  # a screen per change
            assert watcher.wait(timeout=START_TIMEOUT) == 0
        assert svc.stop() == 0


def test_status_of_nothing_fails_clearly() -> None:
    with refused_port() as port:
        done = _status(f"tcp://127.0.0.1:{port}")
    assert done.returncode == 1
    assert "tq-async: error:" in done.stderr


async def test_status_of_an_address_without_its_scheme_says_what_to_type() -> None:
    """``tq-async status 127.0.0.1:5555`` failed with ZMQ's "cannot connect ...: Invalid
    argument"; ``serve storage --controller`` says what was meant, and so does status."""
    with pytest.raises(tq.InvalidRequestError, match=r"did you mean 'tcp://127\.0\.0\.1:5555'"):
        await run_status("127.0.0.1:5555")


def test_status_of_a_curve_cluster_with_its_certificate(tmp_path: Path) -> None:
    """A cluster that uses CURVE: ``--curve-cert`` (the services' secret certificate, as
    ``serve`` takes it) lets the command in, also past an allow-list, and the screen says
    CURVE is on (the command could not connect to such a cluster at all)."""
    import zmq.auth

    public, secret = zmq.auth.create_certificates(tmp_path, "service")
    (tmp_path / "clients").mkdir()
    zmq.auth.create_certificates(tmp_path / "clients", "c1")
    argv = ["--curve-cert", secret, "--curve-allow", str(tmp_path / "clients")]
    with service(argv, tmp_path / "serve.err") as svc:
        address = svc.wait_line("TQ_ADDRESS=")
        done = _status(address, "--json", "--curve-cert", secret)
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        server_key = zmq.auth.load_certificate(public)[0].decode()
        assert status["security"] == {
            "curve": True,
            "server_key": server_key,
            "allowed_clients": 1,
        }
        assert {u["state"] for u in status["units"].values()} == {"up"}
        assert all(u["error"] is None and u["rows"] == 0 for u in status["units"].values())
        assert "security: CURVE on" in _status(address, "--curve-cert", secret).stdout
        done = _status(address)  # (what the refusal says is the transport's)
        assert (done.returncode, done.stdout) == (1, "")
        assert svc.stop() == 0


async def test_ready_counts_rows_after_a_reset_and_a_restart(tmp_path: Path) -> None:
    """A task's ready sets are dropped by a reset_consumption, a unit's return and a
    controller restart (rebuilt at its next request): status and ``tq_rows_ready`` said
    "ready 0" (or nothing) for rows ready all along."""
    registry = CollectorRegistry()
    kw: dict[str, Any] = {"num_storage_units": 2, "durability": "process", "data_dir": tmp_path}
    async with (
        tq.local_cluster(metrics_registry=registry, **kw) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(6)}, "p")
        await client.get_meta(["x"], 2, "p", "t", lease=60)
        assert (await client.partition_info("p"))["ready"] == {"t": 4}
        await client.reset_consumption("p", "t")
        assert (await client.partition_info("p"))["ready"] == {"t": 6}
        assert registry.get_sample_value("tq_rows_ready", {"task": "t"}) == 6
        await client.get_meta(["x"], 2, "p", "t", lease=60)
    async with (
        tq.local_cluster(metrics_registry=registry, **kw) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        info = await client.partition_info("p")
        assert (info["consumed"], info["ready"], info["leased"]) == ({"t": 2}, {"t": 4}, {"t": 2})
        assert registry.get_sample_value("tq_rows_ready", {"task": "t"}) == 4


def test_status_watch_rides_through_a_controller_restart(tmp_path: Path) -> None:
    """``status --watch`` exited 1 when the controller it watched restarted (SIGKILLed and
    started again on its address and data_dir); it says so on stderr, then prints again."""
    argv = ["--bind", f"tcp://127.0.0.1:{free_port()}", "--durability", "process"]
    (tmp_path / "data").mkdir()
    argv += ["--data-dir", str(tmp_path / "data")]
    with service(argv, tmp_path / "serve1.err") as svc:
        address = svc.wait_line("TQ_ADDRESS=")
        with tq.Client.connect(address) as client:
            client.put({"x": torch.arange(3)}, "p")
        watch = ["status", address, "--json", "--watch", "--screens", "2"]
        with subprocess.Popen(
            [sys.executable, "-m", "tq_async._deploy._cli", *watch],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as watcher:
            assert watcher.stdout is not None
            assert watcher.stderr is not None
            assert json.loads(watcher.stdout.readline())["partitions"]["p"]["rows"] == 3
            sigkill(svc.proc)  # type: ignore[arg-type]
            assert "watching again once it answers" in watcher.stderr.readline()
            with service(argv, tmp_path / "serve2.err") as again:
                assert again.wait_line("TQ_ADDRESS=") == address
                second = json.loads(watcher.stdout.readline())
                assert second["partitions"]["p"]["rows"] == 3
                assert watcher.wait(timeout=START_TIMEOUT) == 0
                assert again.stop() == 0


async def test_status_of_a_silent_address_says_what_to_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A listener that never answers (no tq_async service, a stopped one) ended in "... or
    raise the timeout": the command has no timeout to raise. It says what to check."""
    monkeypatch.setattr(status_module, "_TIMEOUT", 0.5)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(tq.TQTimeoutError) as info:
            await run_status(address)
    assert str(info.value) == (
        f"the controller at {address} did not answer within 0.5 s: check that it runs at that "
        "address (the TQ_ADDRESS= line of tq-async serve) and is not stopped"
    )


async def test_status_json_gives_every_unit_the_same_keys() -> None:
    """``--json`` changed shape with a unit's state: an up unit had its figures, a lost or
    suspended one only its address and state, one not answering an ``error`` besides. Every
    unit has the same keys now (null where unknown)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    unit = ("storage", "--controller", address, "--unit-id")
    with (
        serve_role("controller", "--bind", address),
        serve_role(*unit, "0", line="TQ_UNIT="),
        serve_role(*unit, "1", "--advertise", "127.0.0.2", line="TQ_UNIT="),  # never reached
    ):
        async with (
            tq.AsyncClient.connect(address, request_timeout=10) as client,
            client.watch(kinds=["unit_lost"]) as events,  # subscribed: nothing after is missed
        ):
            with anyio.fail_after(30):
                if not (await client.lost_rows())["dead_units"]:
                    assert (await events.__anext__()).unit == 1
        ctl = DealerConnection(address, refused_is_broken=True)
        try:
            status = await cluster_status(ctl)
        finally:
            ctl.close()
    up, lost = status["units"]["0"], status["units"]["1"]
    assert (up["state"], lost["state"]) == ("up", "lost")
    assert set(up) == set(lost)
    assert (up["rows"], up["error"]) == (0, None)
    assert (lost["rows"], lost["resident_bytes"], lost["error"]) == (None, None, None)
    assert "unit 1 [lost] tcp://127.0.0.2:" in render(status, address)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["127.0.0.1:5555"], "did you mean 'tcp://127.0.0.1:5555'"),
        (["tcp://127.0.0.1:70000"], "needs a port from 1 to 65535"),  # was "nothing listens"
        (["tcp://127.0.0.1:5555", "--curve-cert", "/nonexistent"], "cannot read CURVE"),
    ],
)
def test_status_of_a_bad_command_line_exits_2(argv: list[str], said: str) -> None:
    """An address without its scheme or a certificate that cannot be read is a bad command
    line (status 2, as ``serve`` exits for one); status exited 1, as for a cluster that
    could not be reached."""
    done = _status(*argv)
    assert (done.returncode, done.stdout) == (2, "")
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("tq-async: error: ")
    assert said in line


async def test_status_asks_every_unit_and_partition_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Status asked the units one after another: a stopped unit not yet declared suspended
    cost a screen its whole timeout, and each more such unit as much again. Every unit's
    (and partition's) question is out before any answer is awaited now: here each answer
    waits until all the questions of its kind are in flight (asked in turn: never)."""
    real = status_module._ask
    waiting: dict[str, int] = {"StoreStats": 0, "PartitionInfo": 0}
    everyone = {kind: anyio.Event() for kind in waiting}

    async def ask_when_all_asked(conn: Any, body: Any, typ: Any, unit: int | None = None) -> Any:
        kind = type(body).__name__
        if kind in waiting:
            waiting[kind] += 1
            if waiting[kind] == 3:
                everyone[kind].set()
            await everyone[kind].wait()
        return await real(conn, body, typ, unit)

    monkeypatch.setattr(status_module, "_ask", ask_when_all_asked)
    async with (
        tq.local_cluster(num_storage_units=3) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        for pid in ("a", "b", "c"):
            await client.put({"x": torch.arange(3)}, pid)
        ctl = DealerConnection(cluster.address, refused_is_broken=True)
        try:
            with anyio.fail_after(30):
                status = await cluster_status(ctl)
        finally:
            ctl.close()
    assert sorted(status["partitions"]) == ["a", "b", "c"]
    assert [u["error"] for u in status["units"].values()] == [None] * 3
    assert sum(u["rows"] for u in status["units"].values()) == 9
