"""The NIXL (UCX) data path (``tq_async._paths._nixl``): exact round trips of every column kind,
fallback to the socket when a transfer fails or NIXL is missing, a unit killed mid-transfer,
and registrations that stay flat however many transfers run.

A client takes the NIXL path with a unit in another process when asked to
(``data_path="nixl"``: on one host, as here, "auto" would pick shared memory) and with a unit
on another host under ``"auto"``; ``test_nixl_between_network_namespaces`` runs the unit and
the client in two network namespaces standing for two hosts.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import structlog
import torch
import zmq
from prometheus_client import CollectorRegistry

import tq_async as tq
import tq_async._client._async._client as _nixl_base
from _cluster_proc import serve_role
from tq_async._errors import BrokenError, TQError
from tq_async._paths import _nixl
from tq_async._storage import _nixl_handlers as _storage
from tq_async._storage._server import StorageServer
from tq_async._transport._dealer import DealerConnection
from tq_async._wire._columns import ColumnHeader
from tq_async._wire._protocol import (
    NixlHello,
    NixlHelloReply,
    ShmAlloc,
    ShmFree,
    ShmGrant,
    StoredColumns,
    StoreGet,
    StoreStats,
    StoreStatsReply,
)
from tq_async.lowlevel import transfer_collector

pytestmark = pytest.mark.skipif(
    not hasattr(os, "memfd_create") or not hasattr(os, "pidfd_open"), reason="Linux only"
)


def _have_nixl() -> bool:
    for name in ("nixl_cu12", "nixl_cu13"):  # the CUDA 12 / CUDA 13 wheels
        try:
            importlib.import_module(name)
        except Exception:
            continue
        return True
    return False


needs_nixl = pytest.mark.skipif(not _have_nixl(), reason="NIXL is not installed (tq_async[nixl])")


X = ColumnHeader("x", "dense", "int64", (4,))


def _batch(n: int = 64, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "ids": torch.randint(0, 1 << 30, (n, 512), generator=g),
        "f32": torch.randn(n, 7, generator=g),
        "bf": torch.randn(n, 3, generator=g).to(torch.bfloat16),
        "mask": torch.rand(n, 33, generator=g) > 0.5,
        "jag": torch.nested.nested_tensor(
            [torch.arange(i % 7 + 1, dtype=torch.float32) * i for i in range(n)],
            layout=torch.jagged,
        ),
        "s": [f"row-{i}" * (i % 3 + 1) for i in range(n)],
    }


def _check(got: Any, want: dict[str, Any]) -> None:
    for name in ("ids", "f32", "bf", "mask"):
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name
    assert [t.tolist() for t in got["jag"].unbind()] == [t.tolist() for t in want["jag"].unbind()]
    assert got.get("s").tolist() == want["s"]


@pytest.fixture
def split_cluster() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A controller process and one storage unit process offering NIXL."""
    with ExitStack() as stack:
        _, address = stack.enter_context(serve_role("controller"))
        unit, _ = stack.enter_context(
            serve_role("storage", "--controller", address, "--data-path", "nixl", line="TQ_UNIT=")
        )
        yield address, unit


async def _nixl_stats(client: tq.AsyncClient) -> dict[str, int]:
    (stats,) = (await client.storage_stats()).values()
    return stats


@needs_nixl
async def test_round_trip_is_exact_over_nixl(
    split_cluster: tuple[str, subprocess.Popen[bytes]],
) -> None:
    address, _ = split_cluster
    async with tq.AsyncClient.connect(address, data_path="nixl", request_timeout=30) as client:
        before = dict(_nixl.fallbacks)
        want = _batch()
        meta = await client.put(want, partition_id="p")
        _check(await client.get_data(meta), want)
        td, _ = await client.get(list(want), 64, "p", "t")
        _check(td, want)
        stats = await _nixl_stats(client)
        assert stats["nixl_puts"] == 1
        assert stats["nixl_reads"] == 2
        assert stats["nixl_registered_bytes"] == stats["shm_cap"] > 0
        assert stats["shm_puts"] == stats["shm_reads"] == 0
        assert dict(_nixl.fallbacks) == before


@needs_nixl
async def test_registrations_stay_flat_over_a_thousand_transfers(
    split_cluster: tuple[str, subprocess.Popen[bytes]],
) -> None:
    address, _ = split_cluster
    async with tq.AsyncClient.connect(address, data_path="nixl", request_timeout=30) as client:
        x = torch.arange(16 * 1024, dtype=torch.int64).reshape(16, 1024)  # 128 KiB: not inline
        meta = await client.put({"x": x}, partition_id="warm")
        await client.clear_partition("warm")
        agent = _nixl.client_agent()
        assert agent is not None
        regs = agent.registrations
        base = await _nixl_stats(client)
        for i in range(500):
            meta = await client.put({"x": x + i}, partition_id="loop")
            got = await client.get_data(meta)
            assert torch.equal(got["x"], x + i)
            await client.clear_samples(meta)
        stats = await _nixl_stats(client)
        assert agent.registrations == regs <= _nixl.STAGING_SLOTS
        assert stats["nixl_puts"] - base["nixl_puts"] == 500
        assert stats["nixl_reads"] - base["nixl_reads"] == 500
        # every grant and read pin went back: the arena holds what it held before
        assert stats["shm_bytes"] == base["shm_bytes"]
        assert stats["nixl_registered_bytes"] == base["nixl_registered_bytes"]


@needs_nixl
async def test_a_unit_killed_mid_transfer_is_broken_and_shows_no_row(
    split_cluster: tuple[str, subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, unit = split_cluster
    # small staging buffers: the put below takes several WRITEs, the unit dies after the first
    monkeypatch.setattr(_nixl, "_client_agents", [])
    monkeypatch.setattr(_nixl, "STAGING_BYTES", 1 << 20)
    async with tq.AsyncClient.connect(
        address, data_path="nixl", request_timeout=10, retry_after=None
    ) as client:
        small = {"x": torch.arange(32 * 1024).reshape(32, 1024)}
        await client.put(small, partition_id="warm")
        agent = _nixl.client_agent()
        assert agent is not None
        regs = agent.registrations
        started, killed = threading.Event(), threading.Event()
        xfer = agent._xfer
        calls = 0

        def spy(*args: Any) -> None:
            nonlocal calls
            calls += 1
            if calls == 2:  # one window is in the arena; the next goes to a dead unit
                started.set()
                killed.wait(30)
            xfer(*args)

        monkeypatch.setattr(agent, "_xfer", spy)
        before = _nixl.fallbacks.copy()
        big = {"x": torch.arange(8 << 20, dtype=torch.int64).reshape(64, -1)}  # 64 MiB

        async def kill() -> None:
            await anyio.to_thread.run_sync(started.wait, 30)
            unit.send_signal(signal.SIGKILL)
            await anyio.to_thread.run_sync(unit.wait, 10)
            killed.set()

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill)
                with pytest.raises(TQError) as info:
                    await client.put(big, partition_id="p")
        # the failed WRITE is counted once, then the socket finds the unit gone: BrokenError,
        # whichever way UCX saw it (docs/deployment.md, "Data paths": "error" when UCX sees
        # the connection drop, as on loopback; "timeout" when it sees nothing before the
        # request_timeout, as with a host gone without a reset)
        assert isinstance(info.value, BrokenError), info.value
        assert calls >= 2
        counted = _nixl.fallbacks - before
        assert counted.total() == 1, counted
        assert set(counted) <= {"error", "timeout"}, counted
        assert agent.registrations == regs  # nothing registered per transfer, nothing leaked
        assert agent.busy_slots == 0  # the staging buffer went back to the pool
        assert client._links.nixl is not None
        assert not client._links.nixl._peers  # it says hello again next time
        # no row of the failed put is visible
        status = await client.production_status("p")
        assert not any(bool(mask.any()) for mask in status.values()), status


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, _nixl.UCX_DEFAULTS),  # larger TCP segments unless told otherwise
        ({"UCX_TCP_TX_SEG_SIZE": "64k"}, {"UCX_TCP_TX_SEG_SIZE": "64k"}),  # the user decides
    ],
)
def test_ucx_tcp_segments_default_to_ours_unless_set(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], want: dict[str, str]
) -> None:
    for key in _nixl.UCX_DEFAULTS:
        monkeypatch.setenv(key, "")  # so that what load() sets is undone after the test
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(_nixl, "_loaded", [])
    _nixl.load()
    assert {k: os.environ[k] for k in _nixl.UCX_DEFAULTS if k in os.environ} == want


async def test_nixl_missing_uses_the_socket_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("nixl_cu12", "nixl_cu13", "nixl"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails
    monkeypatch.setattr(_nixl, "_loaded", [])
    monkeypatch.setattr(_nixl, "_client_agents", [])
    async with tq.local_cluster(num_storage_units=1) as cluster:
        with structlog.testing.capture_logs() as logs:
            async with tq.AsyncClient.connect(cluster.address, data_path="nixl") as client:
                for k in range(3):
                    want = _batch(seed=k)
                    meta = await client.put(want, partition_id="p")
                    _check(await client.get_data(meta), want)
                stats = await _nixl_stats(client)
    assert stats["nixl_puts"] == stats["nixl_reads"] == stats["nixl_registered_bytes"] == 0
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1, warnings
    assert "NIXL is not available" in warnings[0]["event"]


@needs_nixl
async def test_a_client_agent_that_fails_to_start_uses_the_socket_with_one_warning(
    split_cluster: tuple[str, subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """NIXL imports but cannot make this process's agent (UCX missing a library, no
    resources): one warning, then every request goes through the socket."""
    address, _ = split_cluster

    def broken(*args: Any) -> Any:
        raise RuntimeError("injected: no UCX backend")

    monkeypatch.setattr(_nixl, "_loaded", [])
    monkeypatch.setattr(_nixl, "_client_agents", [])
    monkeypatch.setattr(_nixl, "_make_agent", broken)
    before = _nixl.fallbacks.copy()
    with structlog.testing.capture_logs() as logs:
        async with tq.AsyncClient.connect(address, data_path="nixl", request_timeout=30) as client:
            for k in range(3):
                want = _batch(seed=k)
                meta = await client.put(want, partition_id="p")
                _check(await client.get_data(meta), want)
            stats = await _nixl_stats(client)
    assert stats["nixl_puts"] == stats["nixl_reads"] == 0
    assert _nixl.fallbacks == before  # nothing was tried through NIXL, nothing fell back
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1, warnings
    assert "NIXL failed to start an agent" in warnings[0]["event"]


@needs_nixl
async def test_a_unit_whose_nixl_fails_to_start_serves_by_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A unit whose agent or arena registration fails offers no NIXL (one warning) and
    serves a NIXL client through the socket, exactly."""

    def broken(*args: Any) -> Any:
        raise RuntimeError("injected: registration refused")

    monkeypatch.setattr(_storage, "UnitNixl", broken)
    with structlog.testing.capture_logs() as logs:
        async with (
            tq.local_cluster(num_storage_units=1, data_path="nixl") as cluster,
            tq.AsyncClient.connect(cluster.address, data_path="nixl", request_timeout=30) as client,
        ):
            want = _batch(seed=7)
            meta = await client.put(want, partition_id="p")
            _check(await client.get_data(meta), want)
            stats = await _nixl_stats(client)
    assert stats["nixl_puts"] == stats["nixl_reads"] == stats["nixl_registered_bytes"] == 0
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1, warnings
    assert "NIXL could not register the arena" in warnings[0]["event"]


@needs_nixl
async def test_a_failed_read_falls_back_to_the_socket(
    split_cluster: tuple[str, subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, _ = split_cluster
    async with tq.AsyncClient.connect(address, data_path="nixl", request_timeout=30) as client:
        want = _batch(seed=3)
        meta = await client.put(want, partition_id="p")
        agent = _nixl.client_agent()
        assert agent is not None
        base = await _nixl_stats(client)

        def broken(*args: Any) -> None:
            raise _nixl.TransferFailed("injected")

        monkeypatch.setattr(agent, "_xfer", broken)
        registry = CollectorRegistry()
        registry.register(transfer_collector())
        before = registry.get_sample_value("tq_transfer_fallbacks_total", {"reason": "error"})
        _check(await client.get_data(meta), want)  # through the socket
        after = registry.get_sample_value("tq_transfer_fallbacks_total", {"reason": "error"})
        assert after == (before or 0) + 1
        monkeypatch.undo()
        _check(await client.get_data(meta), want)  # NIXL again (linked anew)
        stats = await _nixl_stats(client)
        assert stats["nixl_reads"] == 2  # the unit pinned spans twice; one READ failed
        assert stats["shm_bytes"] == base["shm_bytes"]  # and both pins went back


@needs_nixl
async def test_unit_nixl_counts_are_prometheus_metrics() -> None:
    registry = CollectorRegistry()
    async with tq.local_cluster(
        num_storage_units=1, data_path="nixl", metrics_registry=registry
    ) as cluster:
        assert registry.get_sample_value("tq_storage_nixl_registered_bytes", {"unit": "0"}) > 0
        async with tq.AsyncClient.connect(
            cluster.address, data_path="nixl", request_timeout=30
        ) as client:
            want = _batch(seed=5)
            meta = await client.put(want, partition_id="p")
            _check(await client.get_data(meta), want)
            stats = await _nixl_stats(client)
        sample = registry.get_sample_value
        assert sample("tq_storage_nixl_puts_total", {"unit": "0"}) == stats["nixl_puts"] == 1
        assert sample("tq_storage_nixl_reads_total", {"unit": "0"}) == stats["nixl_reads"] == 1
        assert (
            sample("tq_storage_nixl_registered_bytes", {"unit": "0"})
            == stats["nixl_registered_bytes"]
        )


@pytest.mark.parametrize(
    ("options", "rdma", "takes_nixl"),
    [
        ({}, True, True),
        ({}, False, False),  # over TCP alone the socket is faster (see rdma_present)
        ({"data_path": "nixl"}, False, True),
        ({"data_path": "shm"}, True, False),
        ({"data_path": "zmq"}, True, False),
        ({"shared_memory": False}, True, False),
        ({"curve": "keys"}, True, False),  # UCX does not encrypt
    ],
)
def test_which_clients_take_nixl(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], rdma: bool, takes_nixl: bool
) -> None:
    monkeypatch.setattr(_nixl_base, "rdma_present", lambda: rdma)
    if options.get("curve"):
        public, secret = zmq.curve_keypair()
        options = {**options, "curve": tq.CurveClient(public, public, secret)}
    client = tq.AsyncClient.connect("tcp://127.0.0.1:1", **options)
    assert (client._links.nixl is not None) == takes_nixl


@needs_nixl
async def test_a_unit_serves_while_its_first_nixl_hello_sets_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under "auto" the first NIXL hello makes the unit's agent (~0.5 s): on a worker thread,
    while the unit answers other requests; hellos that come meanwhile wait for the same agent."""
    made, release = threading.Event(), threading.Event()
    agents: list[Any] = []
    real = _storage.UnitNixl

    def held(*args: Any) -> Any:
        made.set()  # the registration is under way ...
        release.wait(30)  # ... and stays so until the test has been served
        agents.append(real(*args))
        return agents[-1]

    monkeypatch.setattr(_storage, "UnitNixl", held)
    server = StorageServer(0, data_path="auto")
    ctx: zmq.Context[Any] = zmq.Context()
    replies: list[Any] = []
    answered = anyio.Event()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve, f"ipc://{tmp_path}/unit")
            conns = [DealerConnection(server.address, context=ctx) for _ in range(3)]

            async def hello(conn: DealerConnection) -> None:
                payload, _ = await conn.request(NixlHello("tq-test"), timeout=30)
                replies.append(msgspec.msgpack.decode(payload, type=NixlHelloReply | None))
                if len(replies) == 2:
                    answered.set()

            tg.start_soon(hello, conns[0])
            await anyio.to_thread.run_sync(made.wait, 30)
            assert made.is_set()
            tg.start_soon(hello, conns[1])  # a second hello while the first one waits
            payload, _ = await conns[2].request(StoreStats(), timeout=10)  # served meanwhile
            assert msgspec.msgpack.decode(payload, type=StoreStatsReply).nixl_registered_bytes == 0
            assert not replies
            release.set()
            await answered.wait()
            assert len(agents) == 1  # one agent, one registration, for both
            assert replies[0] == replies[1]
            assert replies[0] is not None
            assert replies[0].agent == agents[0].name
            payload, _ = await conns[2].request(NixlHello("tq-test"), timeout=10)  # at once now
            assert msgspec.msgpack.decode(payload, type=NixlHelloReply | None) == replies[0]
            for conn in conns:
                conn.close()
            tg.cancel_scope.cancel()
    ctx.term()
    assert agents[0].registered_bytes == 0  # deregistered when the unit stopped


@needs_nixl
async def test_a_silent_nixl_clients_claims_are_released(tmp_path: Path) -> None:
    """A NIXL client on another host that vanishes holding a grant and a read pin: no pidfd
    tells the unit, so the claims go back once older than the unit's claim ttl."""
    server = StorageServer(0, data_path="nixl")
    now = [0.0]
    server.nixl_claims.clock = lambda: now[0]
    ctx: zmq.Context[Any] = zmq.Context()
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve, f"ipc://{tmp_path}/unit")
        arena = server.arena
        assert arena is not None
        server.state.put("p", [0], [X], [torch.arange(4).numpy().tobytes()])
        base = arena.live_bytes
        conns = []
        for _ in range(2):
            conn = DealerConnection(server.address, context=ctx)
            conns.append(conn)
            payload, _ = await conn.request(NixlHello("tq-test"), timeout=30)
            assert msgspec.msgpack.decode(payload, type=NixlHelloReply | None) is not None
        gone, alive = conns
        payload, _ = await gone.request(ShmAlloc(1 << 20), timeout=10)
        assert msgspec.msgpack.decode(payload, type=ShmGrant | None) is not None
        payload, _ = await gone.request(StoreGet("p", [0], ["x"], shm=True), timeout=10)
        assert msgspec.msgpack.decode(payload, type=StoredColumns).shm_spans
        gone.close()  # vanished: neither used nor freed
        assert arena.live_bytes > base
        now[0] = server.nixl_claims.ttl - 1  # not yet abandoned: nothing is taken back
        payload, _ = await alive.request(ShmAlloc(100), timeout=10)
        grant = msgspec.msgpack.decode(payload, type=ShmGrant)
        assert len(server._grants) == 2
        alive.send_oneway(ShmFree([grant.grant], []))
        now[0] = server.nixl_claims.ttl + 1
        payload, _ = await alive.request(ShmAlloc(100), timeout=10)
        assert len(server._grants) == 1  # only the live client's new grant
        assert server._pins == {}
        grant = msgspec.msgpack.decode(payload, type=ShmGrant)
        alive.send_oneway(ShmFree([grant.grant], []))
        with anyio.fail_after(10):
            while arena.live_bytes != base:
                await server.shm_released.wait()
        alive.close()
        unit_agent = server.nixl
        assert unit_agent is not None
        tg.cancel_scope.cancel()
    assert unit_agent.registered_bytes == 0  # the arena was deregistered before it went
    assert server.nixl is None
    ctx.term()


async def test_a_bad_data_path_is_refused_before_anything_starts() -> None:
    with pytest.raises(tq.InvalidRequestError, match="data_path must be one of"):
        tq.AsyncClient.connect("tcp://127.0.0.1:1", data_path="rdma")
    with pytest.raises(tq.InvalidRequestError, match="data_path must be one of"):
        async with tq.local_cluster(data_path="rdma"):
            pass
    with pytest.raises(tq.ConfigError, match="data_path"):
        tq.Config.from_dict({"data_path": "rdma"})
    assert tq.Config.from_toml_string('data_path = "nixl"').data_path == "nixl"


# ---- two "hosts": network namespaces (as tests/programs/test_multihost.py builds them) -----------


@needs_nixl
@pytest.mark.parametrize("tls", ["tcp", "default"])
def test_nixl_between_network_namespaces(tmp_path: Path, tls: str) -> None:
    from _netns import Lab, script_env, why_not

    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    lab = Lab(f"tqn{os.getpid() % 10000}")
    try:
        lab.build()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        lab.destroy()
        pytest.skip(f"this sandbox cannot build network namespaces: {exc}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if tls == "tcp":
        env["UCX_TLS"] = "tcp"
    procs: list[subprocess.Popen[str]] = []
    try:

        def start(host: str, *argv: str) -> subprocess.Popen[str]:
            proc = subprocess.Popen(
                [
                    *lab.exec_prefix(host),
                    sys.executable,
                    "-m",
                    "tq_async._deploy._cli",
                    "serve",
                    *argv,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
            procs.append(proc)
            return proc

        ctl = start("h1", "controller", "--bind", f"tcp://{lab.ip('h1')}:5555")
        address = _line(ctl, "TQ_ADDRESS=")
        unit = start("h2", "storage", "--controller", address, "--bind", f"tcp://{lab.ip('h2')}:0")
        _line(unit, "TQ_UNIT=")
        client = subprocess.run(
            [*lab.exec_prefix("h4"), sys.executable, __file__, address],
            capture_output=True,
            text=True,
            timeout=120,
            env=script_env(env),
        )
        assert client.returncode == 0, client.stderr
        assert client.stdout.strip().splitlines()[-1] == "OK nixl_puts=1 nixl_reads=1"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
        lab.destroy()


def _line(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:  # bounded: the service prints it at start or exits
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    raise RuntimeError(f"the service exited with {proc.wait(timeout=10)} before {prefix}")


def _client_main(address: str) -> None:
    """Run in namespace h4 ("another host"); the bytes come back exact.

    Network namespaces share the PID namespace, so the shared-memory handshake would succeed
    here: ``data_path="nixl"`` keeps the client off it (and this sandbox has no RDMA, where
    "auto" would pick NIXL).
    """

    async def run() -> None:
        async with tq.AsyncClient.connect(address, request_timeout=30, data_path="nixl") as client:
            want = _batch()
            meta = await client.put(want, partition_id="p")
            _check(await client.get_data(meta), want)
            stats = await _nixl_stats(client)
            print(f"OK nixl_puts={stats['nixl_puts']} nixl_reads={stats['nixl_reads']}")

    anyio.run(run)


if __name__ == "__main__":
    _client_main(sys.argv[1])


@needs_nixl
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_columns_round_trip_over_nixl(
    split_cluster: tuple[str, subprocess.Popen[bytes]],
) -> None:
    address, _ = split_cluster
    async with tq.AsyncClient.connect(address, data_path="nixl", request_timeout=30) as client:
        want = _batch()
        sent = {**want, "ids": want["ids"].cuda(), "bf": want["bf"].cuda()}
        meta = await client.put(sent, partition_id="p")
        td = await client.get_data(meta, device="cuda")
        assert td["ids"].is_cuda
        assert td["f32"].is_cuda
        _check(td.to("cpu"), want)
        stats = await _nixl_stats(client)
        assert stats["nixl_puts"] == 1
        assert stats["nixl_reads"] == 1


def _disconnect_error() -> type[Exception]:
    """What NIXL raises when a transfer's peer is gone (a stand-in without NIXL)."""
    for name in ("nixl_cu12", "nixl_cu13"):
        try:
            error: type[Exception] = importlib.import_module(
                f"{name}._bindings"
            ).nixlRemoteDisconnectError
        except Exception:
            continue
        return error

    class nixlRemoteDisconnectError(Exception):  # NIXL's own name
        pass

    return nixlRemoteDisconnectError


class _FailingAgent:
    """A NIXL agent whose transfers break at ``where`` (posting, or a later poll)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.released = 0

    def get_xfer_descs(self, descs: Any, mem: str) -> Any:
        return descs

    def initialize_xfer(self, op: str, ld: Any, rd: Any, peer: str) -> Any:
        agent = self

        class _Handle:
            def release(self) -> None:
                agent.released += 1

        return _Handle()

    def transfer(self, handle: Any) -> str:
        if self.where == "transfer":
            raise _disconnect_error()("remote agent disconnected")
        return "PROC"

    def check_xfer_state(self, handle: Any) -> str:
        raise _disconnect_error()("remote agent disconnected")


@pytest.mark.parametrize("where", ["transfer", "check_xfer_state"])
def test_a_transfer_whose_peer_is_gone_fails_as_transfer_failed(where: str) -> None:
    # NIXL raises nixlRemoteDisconnectError from transfer() or check_xfer_state() when the
    # unit died mid-transfer: the client falls back on TransferFailed, never sees the raw one
    agent = object.__new__(_nixl.ClientAgent)
    fake = _FailingAgent(where)
    agent.agent = fake
    with pytest.raises(_nixl.TransferFailed) as info:
        agent._xfer("READ", [(0, 8)], [(0, 8)], "peer", time.monotonic() + 30)
    assert info.value.reason == "error"
    assert isinstance(info.value, TQError)
    assert "nixlRemoteDisconnectError" in str(info.value)
    assert fake.released == 1  # the handle went back


def test_a_staging_buffer_nixl_cannot_register_fails_as_transfer_failed() -> None:
    class _Refusing(_FailingAgent):
        def register_memory(self, descs: Any, mem: str) -> Any:
            raise _disconnect_error()("registration refused")

    agent = object.__new__(_nixl.ClientAgent)
    # (the real constructor makes a NIXL agent: its fields by hand)
    agent.agent = _Refusing("transfer")
    agent.slot_bytes, agent.max_slots = 1 << 16, 2
    agent._cond, agent._free, agent._made, agent._regs = threading.Condition(), [], 0, []
    with pytest.raises(_nixl.TransferFailed) as info:
        agent.read("peer", 0, [(0, 8)], time.monotonic() + 30)
    assert info.value.reason == "error"
    assert agent.busy_slots == 0  # nothing was counted as made
