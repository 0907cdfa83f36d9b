"""Clients ride through a restart of the service they talk to (issue 36, item 4).

Real processes: ``tq-async serve`` (or its ``controller`` role) is killed with SIGKILL and
started again at the same ``--bind``. A client made before the kill is kept, not re-created:

* while nothing listens, its calls fail with `BrokenError` at once (no hang);
* once the service is back, it finds it at the address the program gave (a same-host client
  was on the old process's Unix socket and shared memory, which are gone);
* at ``durability="memory"`` the new service lost everything: the first calls made before the
  client learnt of it fail with `StateLostError` saying so (never a silent write into an
  empty controller), and the next ones work;
* at ``durability="process"`` the controller recovered its state on its ``--data-dir``: the
  client simply continues (the same task keeps consuming the same partition, and gets none
  of the rows it acknowledged before the kill again).
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import tq_async as tq
from _cluster_proc import free_port, serve_role, sigkill

#: the longest a call may take to fail while nothing listens (no hang)
_FAST = 5.0


def _rows(n: int, start: int, width: int = 16) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(start, start + n, dtype=torch.int64).reshape(n, 1).repeat(1, width)}


@contextmanager
def _serve(bind: str) -> Iterator[subprocess.Popen[bytes]]:
    with serve_role("--bind", bind, "--storage-units", "1") as (proc, address):
        assert address == bind
        yield proc


def _unit_arenas() -> set[str]:
    """The inodes of the storage units' arenas this process maps (``memfd:tq-unit``)."""
    with open("/proc/self/maps") as f:
        return {line.split()[4] for line in f if "memfd:tq-unit" in line}


async def _fails_fast(call: Any) -> tq.TQError:
    t0 = time.monotonic()
    with pytest.raises(tq.BrokenError) as info:
        await call()
    assert time.monotonic() - t0 < _FAST
    return info.value


@pytest.mark.parametrize("same_host", [True, False], ids=["same-host", "tcp"])
@pytest.mark.parametrize("width", [16, 64 * 1024], ids=["inline", "units"])
async def test_a_client_rides_through_a_serve_restart_at_memory(
    same_host: bool, width: int
) -> None:
    bind = f"tcp://127.0.0.1:{free_port()}"
    # arenas of other tests' embedded units this worker process may still map (a unit's
    # arena is unmapped once the last view of its cells is gone: up to the GC)
    others = _unit_arenas()
    with ExitStack() as stack:
        proc = stack.enter_context(_serve(bind))
        async with tq.AsyncClient.connect(bind, same_host=same_host, request_timeout=10) as c:
            meta = await c.put(_rows(2, 0, width), "p")
            assert (await c.get_data(meta))["x"][:, 0].tolist() == [0, 1]
            before = _unit_arenas() - others
            sigkill(proc)
            await _fails_fast(lambda: c.put(_rows(2, 2, width), "q"))
            proc = stack.enter_context(_serve(bind))
            # the first call learns that the service restarted without its state
            lost = await _fails_fast(lambda: c.put(_rows(2, 4, width), "q"))
            assert isinstance(lost, tq.StateLostError)
            assert "restarted" in str(lost)
            assert "memory" in str(lost)
            assert bind in str(lost)
            # then the client works against the new service, data path included
            again = await c.put(_rows(2, 6, width), "q")
            assert (await c.get_data(again))["x"][:, 0].tolist() == [6, 7]
            got = await c.get_meta(["x"], 2, "q", "t", timeout=5)
            assert (await c.get_data(got))["x"][:, 0].tolist() == [6, 7]
            assert await c.list_partitions() == ["q"]
            # the dead process's arena is unmapped (its memory freed); the new one mapped
            after = _unit_arenas() - others
            assert not before & after
            assert len(after) <= 1
            if not same_host:
                assert not before
                assert not after


@pytest.mark.parametrize("same_host", [True, False], ids=["same-host", "tcp"])
def test_a_blocking_client_rides_through_a_serve_restart_at_memory(same_host: bool) -> None:
    bind = f"tcp://127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        proc = stack.enter_context(_serve(bind))
        with tq.Client.connect(bind, same_host=same_host, request_timeout=10) as c:
            c.put(_rows(2, 0), "p")
            sigkill(proc)
            t0 = time.monotonic()
            with pytest.raises(tq.BrokenError):
                c.put(_rows(2, 2), "q")
            assert time.monotonic() - t0 < _FAST
            proc = stack.enter_context(_serve(bind))
            # the first call learns that the service restarted without its state (a plain
            # BrokenError came first: the blocking client reads nothing between calls, and
            # its first call found the old socket's end only as it sent)
            with pytest.raises(tq.StateLostError, match="restarted"):
                c.put(_rows(2, 4), "q")
            meta = c.put(_rows(2, 6), "q")
            assert c.get_data(meta)["x"][:, 0].tolist() == [6, 7]


@pytest.mark.parametrize("same_host", [True, False], ids=["same-host", "tcp"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill", "term"])
def test_a_blocking_client_continues_at_its_first_call_after_a_durable_serve_restart(
    tmp_path: Path, sig: signal.Signals, same_host: bool
) -> None:
    """No call while the service was down: the first call after the restart (same --bind,
    same --data-dir) goes through, as the AsyncClient's does. It failed with BrokenError
    (the connection's end, seen only then), and only the next call found the service."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    args = ("--bind", bind, "--storage-units", "1", "--durability", "process")
    args += ("--data-dir", str(tmp_path))
    with ExitStack() as stack:
        proc, _ = stack.enter_context(serve_role(*args))
        with tq.Client.connect(bind, same_host=same_host, request_timeout=10) as c:
            before = [c.put(_rows(2, 0), "p"), c.put(_rows(2, 2, 64 * 1024), "p")]
            proc.send_signal(sig)
            proc.wait(timeout=10)
            stack.enter_context(serve_role(*args))
            assert c.list_partitions() == ["p"]  # the first call
            meta = c.put(_rows(2, 4, 64 * 1024), "p")
            assert c.get_data(meta)["x"][:, 0].tolist() == [4, 5]
            for i, m in enumerate(before):
                assert c.get_data(m)["x"][:, 0].tolist() == [2 * i, 2 * i + 1]


@contextmanager
def _controller(bind: str, data_dir: Path) -> Iterator[subprocess.Popen[bytes]]:
    args = ("controller", "--bind", bind, "--durability", "process", "--data-dir", str(data_dir))
    with serve_role(*args) as (proc, _):
        yield proc


async def test_a_client_continues_after_a_durable_controller_restart(tmp_path: Path) -> None:
    bind = f"tcp://127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        ctl = stack.enter_context(_controller(bind, tmp_path))
        for unit in ("0", "1"):
            args = ("storage", "--controller", bind, "--unit-id", unit)
            stack.enter_context(serve_role(*args, line="TQ_UNIT="))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            puts = [await c.put(_rows(4, 4 * i), "p") for i in range(4)]
            first = await c.get_meta(["x"], 8, "p", "t", lease=60.0, timeout=5)
            acked = (await c.get_data(first))["x"][:, 0].tolist()
            await c.ack(first)
            sigkill(ctl)
            await _fails_fast(lambda: c.get_meta(["x"], 4, "p", "t", timeout=5))
            ctl = stack.enter_context(_controller(bind, tmp_path))
            # the same client, no StateLostError: the controller kept its state
            await c.seal("p")
            rest: list[int] = []
            while True:
                got = await c.get_meta(["x"], 4, "p", "t", lease=60.0, timeout=30)
                if got.end_of_stream:
                    break
                rest += (await c.get_data(got))["x"][:, 0].tolist()
                await c.ack(got)
            assert not set(rest) & set(acked)  # nothing acknowledged comes again
            assert sorted(rest + acked) == list(range(16))
            for i, meta in enumerate(puts):  # the puts' own metas still read
                want = list(range(4 * i, 4 * i + 4))
                assert (await c.get_data(meta))["x"][:, 0].tolist() == want


async def test_concurrent_calls_fail_only_with_broken_error_across_restarts(
    tmp_path: Path,
) -> None:
    """Many tasks on one same-host client while its durable controller is killed and
    restarted: a call fails with `BrokenError` (or works), never `ClosedError`. (The rejoin
    says Hello on a new TCP link, then moves to the controller's same-host twin and closes
    the TCP link: calls of other tasks sent on it meanwhile failed with `ClosedError`; found
    by the chaos test.)"""
    import anyio

    bind = f"tcp://127.0.0.1:{free_port()}"
    unexpected: list[BaseException] = []
    with ExitStack() as stack:
        ctl = stack.enter_context(_controller(bind, tmp_path))
        async with tq.AsyncClient.connect(bind, request_timeout=10) as c:
            answered = [0]
            more = anyio.Event()

            async def caller() -> None:
                nonlocal more
                while True:
                    try:
                        await c.list_partitions()
                    except tq.BrokenError:
                        await anyio.sleep(0.02)  # back off: nothing listens yet
                        continue
                    except Exception as exc:
                        unexpected.append(exc)
                    answered[0] += 1
                    more.set()
                    more = anyio.Event()

            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(caller)
                for _ in range(3):
                    target = answered[0] + 16  # the callers are busy on the new link
                    with anyio.fail_after(60):
                        while answered[0] < target:
                            await more.wait()
                    sigkill(ctl)
                    ctl = stack.enter_context(_controller(bind, tmp_path))
                target = answered[0] + 16
                with anyio.fail_after(60):
                    while answered[0] < target:
                        await more.wait()
                tg.cancel_scope.cancel()
    assert not unexpected, [repr(e) for e in unexpected[:3]]
