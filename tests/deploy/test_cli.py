"""``tq-async serve controller`` / ``serve storage`` processes, and the helpers behind them."""

from __future__ import annotations

import argparse
import importlib.util
import os
import selectors
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import anyio
import pytest
import structlog
import torch
from tensordict import TensorDict

import tq_async as tq
from _cluster_proc import free_port
from _services import START_TIMEOUT, Service, parse_unit, refused_port, service
from tq_async._controller._server import ControllerServer
from tq_async._deploy._cli import _build_parser, load_curve, main
from tq_async._errors import InvalidRequestError, ProtocolError, TQTimeoutError
from tq_async._service._serve import (
    advertised_address,
    register_unit,
    serve_controller,
    serve_storage,
    warn_if_exposed,
)

# ---- processes ------------------------------------------------------------------------------


async def test_controller_and_two_storage_processes(tmp_path: Path) -> None:
    with ExitStack() as stack:
        ctl = stack.enter_context(
            service(["controller", "--bind", "tcp://127.0.0.1:0"], tmp_path / "ctl.err")
        )
        address = ctl.wait_line("TQ_ADDRESS=")
        assert address.startswith("tcp://127.0.0.1:")
        units = [
            stack.enter_context(
                service(
                    ["storage", "--controller", address, "--unit-id", str(i)],
                    tmp_path / f"unit{i}.err",
                )
            )
            for i in range(2)
        ]
        registered = dict(parse_unit(u.wait_line("TQ_UNIT=")) for u in units)
        assert sorted(registered) == [0, 1]
        assert len(set(registered.values())) == 2

        async with tq.AsyncClient.connect(address) as client:
            for k in range(4):  # puts go round-robin over the units
                x = torch.arange(k * 8, (k + 1) * 8)
                await client.put(TensorDict({"x": x}, batch_size=[8]), partition_id="p")
            td, meta = await client.get(["x"], 32, "p", "t", timeout=30)
        assert set(meta.units) == {0, 1}
        assert sorted(td["x"].tolist()) == list(range(32))
        order = sorted(range(32), key=lambda i: meta.global_indexes[i])
        assert td["x"][order].tolist() == list(range(32))

        # SIGTERM / SIGINT: a clean exit (status 0) for every role
        assert units[0].stop(signal.SIGINT) == 0
        assert units[1].stop() == 0
        assert ctl.stop() == 0


def unit_outcome(unit: Service) -> tuple[int, str] | str:
    """``(id, address)`` once the unit registered, or its stderr if it exited (bounded)."""
    try:
        return parse_unit(unit.wait_line("TQ_UNIT="))
    except RuntimeError:  # it exited
        return unit.stderr()


async def test_a_unit_id_is_held_by_one_live_unit(tmp_path: Path) -> None:
    with ExitStack() as stack:
        ctl = stack.enter_context(
            service(["controller", "--bind", "tcp://127.0.0.1:0"], tmp_path / "ctl.err")
        )
        address = ctl.wait_line("TQ_ADDRESS=")

        def unit(name: str, *argv: str) -> Service:
            return stack.enter_context(
                service(["storage", "--controller", address, *argv], tmp_path / f"{name}.err")
            )

        # the race: one unit with --unit-id 0 and one without, started together
        first, second = unit("a", "--unit-id", "0"), unit("b")
        outcomes = [unit_outcome(first), unit_outcome(second)]
        registered = [o for o in outcomes if isinstance(o, tuple)]
        assert len({unit_id for unit_id, _ in registered}) == len(registered)  # never shared
        for refused in [o for o in outcomes if isinstance(o, str)]:
            assert "storage unit id 0 is held by a live unit at tcp://" in refused
        holder = dict(registered)
        assert 0 in holder
        # a second live unit asking for a held id is refused, naming the id and the holder
        clash = unit("clash", "--unit-id", "0")
        assert clash.proc.wait(timeout=START_TIMEOUT) == 1
        assert f"storage unit id 0 is held by a live unit at {holder[0]}" in clash.stderr()
        assert "leave --unit-id out to get a free id" in clash.stderr()
        # without --unit-id: a free one
        free = unit_outcome(unit("free"))
        assert isinstance(free, tuple)
        assert free[0] not in holder
        async with tq.AsyncClient.connect(address) as client:
            stats = await client.storage_stats()
        assert sorted(stats) == sorted([*holder, free[0]])  # every live unit is listed
        assert ctl.stop() == 0


async def test_serve_capacity_applies_backpressure(tmp_path: Path) -> None:
    with service(["--capacity", "4"], tmp_path / "serve.err") as svc:
        address = svc.wait_line("TQ_ADDRESS=")
        async with tq.AsyncClient.connect(address) as client:
            await client.put({"x": torch.arange(4)}, "p")
            with pytest.raises(tq.WouldBlock, match="capacity of 4 rows"):
                await client.put_nowait({"x": torch.arange(1)}, "p")
            other = await client.put({"x": torch.arange(4)}, "q")  # per partition by default
            assert len(other) == 4
            await client.clear_partition("p")
            assert len(await client.put_nowait({"x": torch.arange(4)}, "p")) == 4
        assert svc.stop() == 0


def test_storage_fails_clearly_when_the_controller_does_not_answer(tmp_path: Path) -> None:
    with refused_port() as port:
        controller = f"tcp://127.0.0.1:{port}"
        argv = ["storage", "--controller", controller, "--unit-id", "0"]
        with service([*argv, "--register-timeout", "2"], tmp_path / "unit.err") as unit:
            code = unit.proc.wait(timeout=START_TIMEOUT)
            err = unit.stderr()
    assert code == 1
    assert f"the controller at {controller} did not answer within 2.0 s" in err
    assert "tq-async serve controller" in err


def test_wildcard_controller_needs_advertise(tmp_path: Path) -> None:
    with service(["controller", "--bind", "tcp://0.0.0.0:0"], tmp_path / "ctl.err") as ctl:
        code = ctl.proc.wait(timeout=START_TIMEOUT)
        err = ctl.stderr()
    assert code == 1
    assert "--advertise HOST" in err


def _logged(proc: subprocess.Popen[bytes], text: bytes) -> bytes:
    """What ``proc`` logged on stderr up to the first line that holds ``text`` (bounded)."""
    assert proc.stderr is not None
    seen = b""
    deadline = time.monotonic() + START_TIMEOUT
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stderr, selectors.EVENT_READ)
        while text not in seen.rpartition(b"\n")[0]:
            left = deadline - time.monotonic()
            assert left > 0, seen.decode()
            if sel.select(timeout=left):
                chunk = os.read(proc.stderr.fileno(), 65536)
                assert chunk, f"exited with {proc.wait(timeout=10)}: {seen.decode()}"
                seen += chunk
    return seen


@pytest.mark.parametrize("role", [[], ["controller"]], ids=["serve", "controller"])
def test_a_launcher_that_closed_stdout_does_not_stop_the_service(role: list[str]) -> None:
    """A launcher may close its end of the service's stdout once it has read the lines it
    wanted, or before (it went away): printing them failed with BrokenPipeError and the
    service died with a traceback, status 1. It serves on, and SIGTERM stops it cleanly."""
    read, write = os.pipe()
    os.close(read)  # before the service prints anything
    bind = f"tcp://127.0.0.1:{free_port()}"
    argv = [*role, "--bind", bind, "--metrics-on", "127.0.0.1:0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tq_async._deploy._cli", "serve", *argv],
        stdout=write,
        stderr=subprocess.PIPE,
    )
    os.close(write)
    try:
        _logged(proc, b"stdout is closed")  # said, as a warning, once it serves
        with tq.Client.connect(bind, request_timeout=START_TIMEOUT) as client:
            assert client.list_partitions() == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=START_TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        assert proc.stderr is not None
        proc.stderr.close()


# ---- argument parsing -----------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    return _build_parser().parse_args(argv)


def test_all_in_one_serve_keeps_its_flags() -> None:
    args = parse("serve", "--storage-units", "3", "--bind", "tcp://127.0.0.1:5555")
    assert args.role is None
    assert args.storage_units == 3
    assert args.bind == "tcp://127.0.0.1:5555"


def test_role_options_before_or_after_the_role() -> None:
    before = parse("serve", "--bind", "tcp://127.0.0.1:1", "--allow-pickle", "controller")
    after = parse("serve", "controller", "--bind", "tcp://127.0.0.1:1", "--allow-pickle")
    for args in (before, after):
        assert (args.role, args.bind, args.allow_pickle) == (
            "controller",
            "tcp://127.0.0.1:1",
            True,
        )
    unit = parse("serve", "storage", "--controller", "tcp://h:1", "--unit-id", "3")
    assert (unit.role, unit.controller, unit.unit_id, unit.bind) == (
        "storage",
        "tcp://h:1",
        3,
        None,
    )


def test_capacity_flags() -> None:
    assert parse("serve").capacity is None
    args = parse("serve", "--capacity", "8", "--capacity-scope", "global")
    assert (args.capacity, args.capacity_scope) == (8, "global")
    ctl = parse("serve", "controller", "--capacity", "8")
    assert (ctl.role, ctl.capacity, ctl.capacity_scope) == ("controller", 8, "partition")
    with pytest.raises(SystemExit):
        parse("serve", "--capacity-scope", "cluster")


def test_storage_needs_a_controller(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("serve", "storage")
    assert "--controller" in capsys.readouterr().err


@pytest.mark.parametrize("seconds", ["0", "-1", "nan"])
def test_a_register_timeout_that_is_no_time_is_a_bad_flag(
    seconds: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--register-timeout 0`` (or -1) started the unit, which then gave up at once: "did
    not answer within -1.0 s ... raise the registration timeout"; nan never gave up."""
    with pytest.raises(SystemExit) as info:
        parse("serve", "storage", "--controller", "tcp://h:1", "--register-timeout", seconds)
    assert info.value.code == 2
    assert "--register-timeout: expected a number of seconds > 0" in capsys.readouterr().err
    assert parse("serve", "storage", "--controller", "tcp://h:1").register_timeout == 30.0


@pytest.mark.parametrize("screens", ["0", "-2"])
def test_status_screens_below_one_is_a_bad_flag(
    screens: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``status --watch --screens 0`` ("stop after N screens") printed one screen."""
    with pytest.raises(SystemExit) as info:
        parse("status", "tcp://h:1", "--watch", "--screens", screens)
    assert info.value.code == 2
    assert "--screens: expected a number of screens >= 1" in capsys.readouterr().err
    assert parse("status", "tcp://h:1", "--watch", "--screens", "1").screens == 1


def test_status_screens_without_watch_is_a_bad_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """``status ADDRESS --screens 3`` (no ``--watch``) printed one screen and said nothing."""
    with pytest.raises(SystemExit) as info:
        main(["status", "tcp://127.0.0.1:1", "--screens", "3"])
    assert info.value.code == 2
    assert "--screens applies to --watch" in capsys.readouterr().err


# ---- addresses, warnings, registration (in process) -----------------------------------------


def test_advertised_address() -> None:
    assert advertised_address("ipc:///tmp/x", "ipc:///tmp/x") == "ipc:///tmp/x"
    bound = "tcp://127.0.0.1:4242"
    assert advertised_address(bound, "tcp://127.0.0.1:0") == bound
    assert advertised_address(bound, "tcp://0.0.0.0:0", "node7") == "tcp://node7:4242"
    assert advertised_address(bound, "tcp://*:0", "fd00::7") == "tcp://[fd00::7]:4242"
    # a unit publishes its address on the route to the controller (no packet is sent)
    towards = "tcp://127.0.0.1:9"
    assert advertised_address(bound, "tcp://0.0.0.0:0", towards=towards) == bound
    with pytest.raises(InvalidRequestError, match="--advertise HOST"):
        advertised_address(bound, "tcp://0.0.0.0:0")


def test_non_loopback_bind_warns() -> None:
    with structlog.testing.capture_logs() as logs:
        warn_if_exposed("tcp://127.0.0.1:0", "controller")
        warn_if_exposed("ipc:///tmp/x", "storage")
        assert logs == []
        warn_if_exposed("tcp://0.0.0.0:5555", "storage")
    assert len(logs) == 1
    assert logs[0]["log_level"] == "warning"
    assert "anyone who can reach it can read and write data" in logs[0]["event"]
    assert logs[0]["address"] == "tcp://0.0.0.0:5555"


async def test_register_unit_times_out_with_the_controller_address() -> None:
    with refused_port() as port:
        controller = f"tcp://127.0.0.1:{port}"
        with pytest.raises(TQTimeoutError, match=f"controller at {controller} did not answer"):
            await register_unit(controller, 0, "tcp://127.0.0.1:1", timeout=0.2)


async def test_a_service_that_cannot_start_raises_its_own_error() -> None:
    """`serve_controller` / `serve_storage` (tq_async.lowlevel) document BrokenError for a
    bind that fails and TQTimeoutError for a registration nobody answers; both came out in
    an ExceptionGroup, which ``except tq.BrokenError`` does not catch (``local_cluster``
    hands them out as themselves)."""
    with refused_port() as taken:
        with pytest.raises(tq.BrokenError, match="cannot bind"):
            await serve_controller(f"tcp://127.0.0.1:{taken}")
        with pytest.raises(tq.TQTimeoutError, match="did not answer"):
            await serve_storage(f"tcp://127.0.0.1:{taken}", register_timeout=0.2)


async def test_registered_units_are_announced_to_clients() -> None:
    controller = ControllerServer()
    async with anyio.create_task_group() as tg:
        address = await tg.start(controller.serve, "tcp://127.0.0.1:0")
        assert await register_unit(address, 4, "tcp://127.0.0.1:1", timeout=10) == 4
        # registering the same unit again (a retry) is harmless
        assert await register_unit(address, 4, "tcp://127.0.0.1:1", timeout=10) == 4
        assert controller.state.units == {4: "tcp://127.0.0.1:1"}
        tg.cancel_scope.cancel()


async def test_controller_assigns_unit_ids() -> None:
    controller = ControllerServer()
    supported = True
    async with anyio.create_task_group() as tg:
        address = await tg.start(controller.serve, "tcp://127.0.0.1:0")
        try:
            first = await register_unit(address, None, "tcp://127.0.0.1:1", timeout=10)
        except ProtocolError:
            supported = False
        else:
            second = await register_unit(address, None, "tcp://127.0.0.1:2", timeout=10)
            assert (first, second) == (0, 1)
            # the same address asking again (a retry, or a restart there) keeps its id
            assert await register_unit(address, None, "tcp://127.0.0.1:1", timeout=10) == 0
            assert controller.state.units == {0: "tcp://127.0.0.1:1", 1: "tcp://127.0.0.1:2"}
        tg.cancel_scope.cancel()
    if not supported:
        pytest.skip("this controller does not assign unit ids yet (RegisterUnit unit_id=-1)")


async def test_a_controller_data_dir_is_used_by_one_controller_at_a_time(tmp_path: Path) -> None:
    """Two controllers on one journal (`serve controller --data-dir D` started twice) each
    wrote their own state into it and then recovered a mix of both; the second is refused,
    as a storage unit's directory in use is, and the directory is given back on stop."""
    config = tq.Config(durability="process", data_dir=str(tmp_path))
    serve = partial(serve_controller, "tcp://127.0.0.1:0", config=config)
    async with anyio.create_task_group() as tg:
        await tg.start(serve)
        with anyio.fail_after(10), pytest.raises(tq.ConfigError, match="in use by another"):
            await serve()  # it served (until the timeout)
        tg.cancel_scope.cancel()
    with refused_port() as taken, pytest.raises(tq.BrokenError):  # a port taken
        await serve_controller(f"tcp://127.0.0.1:{taken}", config=config)
    async with anyio.create_task_group() as tg:  # both stopped: free again
        await tg.start(serve)
        tg.cancel_scope.cancel()


def test_load_curve(tmp_path: Path) -> None:
    import zmq.auth

    public, secret = zmq.auth.create_certificates(tmp_path, "service")
    (tmp_path / "clients").mkdir()
    client_public, _ = zmq.auth.create_certificates(tmp_path / "clients", "c1")
    assert load_curve(None, None) is None
    open_to_all = load_curve(secret, None)
    assert open_to_all is not None
    assert open_to_all.allowed_clients is None
    listed = load_curve(secret, [str(tmp_path / "clients")])
    assert listed is not None
    assert list(listed.allowed_clients or []) == [zmq.auth.load_certificate(client_public)[0]]
    with pytest.raises(InvalidRequestError, match="no secret key"):
        load_curve(public, None)
    with pytest.raises(InvalidRequestError, match="cannot read CURVE certificates"):
        load_curve(str(tmp_path / "missing.key_secret"), None)
    with pytest.raises(InvalidRequestError, match="--curve-allow needs --curve-cert"):
        load_curve(None, [client_public])


def test_services_never_import_torch() -> None:
    """The services handle bytes only: `tq-async serve`, its roles and the Ray actors start
    without torch or tensordict (seconds and hundreds of MB saved per service process)."""
    # tq_async.ray needs the optional `ray` extra (a host without it still checks the rest)
    ray = ", tq_async.ray" if importlib.util.find_spec("ray") is not None else ""
    probe = (
        f"import sys, tq_async, tq_async._deploy._cli{ray}\n"
        "from tq_async import local_cluster\n"
        "from tq_async.lowlevel import ControllerServer, StorageServer\n"
        "heavy = sorted({'torch', 'tensordict'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
        "tq_async.AsyncClient  # the client side does need torch: loaded on first use\n"
        "assert 'torch' in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr


#: what a service process never imports (a module, or a package and all under it): the
#: clients (torch, tensordict), the datasets, the compatibility layer, the in-process clusters'
#: thread, the CLI's other commands, the metrics' exposition when they are off
NOT_IN_SERVICES = (
    "torch",
    "tensordict",
    "tq_async._client",
    "tq_async._datasets",
    "tq_async._deploy._background",
    "tq_async._deploy._status",
    "tq_async.compat",
    "prometheus_client",  # (without --metrics-on)
    "importlib.metadata",  # (the version: for --version only)
)
#: ... and what a role's process (one service) does not import besides: the in-process cluster
NOT_IN_ROLES = (*NOT_IN_SERVICES, "tq_async._deploy._cluster", "tq_async._portal")
#: ... nor, a storage unit's, the controller, its core and the samplers; a controller's, the
#: units' code
NOT_IN_ROLE = {
    "storage": (
        *NOT_IN_ROLES,
        "tq_async._controller",
        "tq_async._core._state",
        "tq_async._core._transitions",
        "tq_async.samplers",
    ),
    "controller": (*NOT_IN_ROLES, "tq_async._storage._server", "tq_async._storage._cells"),
    "serve": NOT_IN_SERVICES,
}


def imported(err: str) -> set[str]:
    """The modules a process imported, from its ``-X importtime`` lines on stderr."""
    lines = err.splitlines()
    return {line.rpartition("|")[2].strip() for line in lines if line.startswith("import time:")}


def _unneeded(modules: set[str], unneeded: tuple[str, ...]) -> list[str]:
    return sorted(
        m for m in modules if m in unneeded or m.startswith(tuple(f"{u}." for u in unneeded))
    )


async def test_a_serve_process_imports_only_what_it_runs(tmp_path: Path) -> None:
    """A service restarted after a crash, a Ray actor, a ``tq-async serve`` start in a fraction
    of a second when they import only what they run: every ``serve`` (all-in-one, controller,
    storage) imported the clients' code, the in-process clusters' and the CLI's other
    commands at start-up, as ``import tq_async`` did, a unit the controller's and a controller
    the units'. Read from the real processes' own
    import log, through a first put and get (what serving imports on first use counts)."""
    log_imports = ["env", "PYTHONPROFILEIMPORTTIME=1"]
    with ExitStack() as stack:
        ctl = stack.enter_context(service(["controller"], tmp_path / "ctl.err", log_imports))
        address = ctl.wait_line("TQ_ADDRESS=")
        unit = stack.enter_context(
            service(["storage", "--controller", address], tmp_path / "unit.err", log_imports)
        )
        unit.wait_line("TQ_UNIT=")
        whole = stack.enter_context(service([], tmp_path / "whole.err", log_imports))
        for cluster in (address, whole.wait_line("TQ_ADDRESS=")):
            async with tq.AsyncClient.connect(cluster) as client:
                await client.put({"x": torch.arange(4)}, partition_id="p")
                td, _ = await client.get(["x"], 4, "p", "t", timeout=30)
                assert td["x"].tolist() == [0, 1, 2, 3]
        services = {"controller": ctl, "storage": unit, "serve": whole}
        for svc in services.values():
            assert svc.stop() == 0
        unneeded = {
            name: _unneeded(imported(svc.stderr()), NOT_IN_ROLE[name])
            for name, svc in services.items()
        }
    assert unneeded == {name: [] for name in services}


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the `ray` extra")
def test_the_ray_actors_import_only_what_they_run() -> None:
    """`tq_async.ray` (what a Ray actor of a service imports, whichever service) imported the
    clients' code too, and the controller's and the units' both: each actor imports its own
    service's when it starts it."""
    probe = "import sys, tq_async.ray\nprint('\\n'.join(sys.modules))\n"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    ray_imports = ("importlib.metadata",)  # (ray's own)
    services = ("tq_async._controller", "tq_async.samplers", "tq_async._storage._server")
    unneeded = [u for u in (*NOT_IN_ROLES, *services) if u not in ray_imports]
    assert _unneeded(set(done.stdout.split()), tuple(unneeded)) == []


@pytest.mark.parametrize("allowed", [False, True])
async def test_a_cluster_on_every_interface_warns_as_its_services_would(allowed: bool) -> None:
    """``local_cluster`` / ``tq-async serve`` on a non-loopback host warned "anyone who can
    reach it can read and write data" with CURVE keys and an allow-list too (untrue), and
    without any said nothing of what to do. It warns as ``serve controller`` does: nothing
    with an allow-list, the fix otherwise."""
    public, secret = tq.curve_keypair()
    clients = [tq.curve_keypair()[0]] if allowed else None
    curve = tq.CurveServer(public, secret, allowed_clients=clients)
    with structlog.testing.capture_logs() as logs:
        async with tq.local_cluster(1, host="0.0.0.0", curve=curve, transport="tcp"):
            pass
        async with tq.local_cluster(1, host="0.0.0.0", transport="tcp"):
            pass
    warnings = [e["event"] for e in logs if e["log_level"] == "warning"]
    exposed = "binding a non-loopback interface: anyone who can reach it can read and write data"
    assert [w for w in warnings if w.startswith(exposed)] == [
        f"{exposed}; bind 127.0.0.1, keep the network private, or use CURVE keys"
    ]
    assert any("without an allow-list" in w for w in warnings) is not allowed
