"""Admission slots of a producer that dies: a same-host producer SIGKILLed between
``acquire_rollout`` and its put gives its slots back (its Unix socket's end tells the
controller), a live producer's slots stay, and a durable controller restarted with slots
held still gives them back when their holder dies afterwards."""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import pytest
import torch

import tq_async as tq
from _cluster_proc import WarmProcess, free_port, serve_role, sigkill, warm_python

#: a producer that acquires slots, says so, then waits (between acquire and put) until
#: killed; each line on its stdin makes it ask the controller something (reconnecting to a
#: restarted one) and say so again, or, for a line ``put``, put its rows and say so
_PRODUCER = """
import asyncio, sys
import torch
import tq_async as tq

async def main():
    address, n, same_host = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    async with tq.AsyncClient.connect(address, request_timeout=5, same_host=same_host) as client:
        await client.acquire_rollout(0, n)
        print("ACQUIRED", flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            while True:
                try:
                    if line.strip() == "put":
                        await client.put({"x": torch.ones(n, 1)}, "p", policy_version=0)
                    else:
                        await client.staleness_status()
                    break
                except tq.BrokenError:
                    await asyncio.sleep(0.1)
            print("PUT" if line.strip() == "put" else "SEEN", flush=True)

asyncio.run(main())
"""


def _producer(address: str, n: int, *, same_host: bool = True) -> WarmProcess:
    """A `_PRODUCER` process holding ``n`` slots, SIGKILLed on exit (if not already);
    without ``same_host`` it speaks TCP only (its death is told to nobody)."""
    return warm_python(_PRODUCER, address, str(n), "1" if same_host else "0")


def _tell(proc: WarmProcess, line: bytes) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + b"\n")
    proc.stdin.flush()


#: the slot lease of these tests (seconds): a producer renews every third of it
LEASE = 2.0


async def _said(proc: WarmProcess, word: bytes) -> None:
    assert proc.stdout is not None
    with anyio.fail_after(60):  # (a process to start)
        line = await anyio.to_thread.run_sync(proc.stdout.readline)
    assert line.strip() == word, line


async def test_a_producer_killed_holding_slots_gives_them_back() -> None:
    """Capacity 4: this producer (alive, slow) holds 2, another process acquires 2 and is
    SIGKILLed before its put. Its slots come back (before: never, and after enough such
    deaths every producer waited for ever); the live producer's 2 stay outstanding."""
    admission = tq.AdmissionConfig(capacity=4, learner_task="learn")
    async with (
        tq.local_cluster(num_storage_units=1, transport="tcp", admission=admission) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.acquire_rollout(0, 2)
        with _producer(cluster.address, 2) as proc:
            await _said(proc, b"ACQUIRED")
            sigkill(proc)
        await client.acquire_rollout(0, 2, timeout=20)  # woken when the dead one's came back
        assert (await client.staleness_status())["outstanding"] == 4
        await client.put({"x": torch.ones(4, 1)}, "p", policy_version=0)
        assert (await client.staleness_status())["outstanding"] == 4  # put: outstanding still


async def test_slots_held_across_a_durable_controller_restart_come_back_with_their_holder(
    tmp_path: Path,
) -> None:
    """A durable controller is SIGKILLed while a producer holds slots, and restarted on its
    directory: the slots are still held (journaled), and the producer dying afterwards gives
    them back there (before: never, its holder was a connection that died with the old
    controller; now it is the name its client renews them under)."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path.parent / f"{tmp_path.name}.toml"
    config.write_text(f'[admission]\ncapacity = 3\nlearner_task = "learn"\nslot_lease = {LEASE}\n')
    args = ["controller", "--bind", bind, "--durability", "process", "--data-dir"]
    args += [str(tmp_path), "--config", str(config)]
    with serve_role(*args) as (ctl, _), _producer(bind, 3) as proc:
        await _said(proc, b"ACQUIRED")
        ctl.send_signal(signal.SIGKILL)
        ctl.wait(timeout=10)
        with serve_role(*args):
            async with tq.AsyncClient.connect(bind) as client:
                assert (await client.staleness_status())["outstanding"] == 3
                _tell(proc, b"")
                await _said(proc, b"SEEN")  # it is connected to the new controller
                sigkill(proc)
                await client.acquire_rollout(0, 3, timeout=20)


async def test_a_tcp_producer_killed_holding_slots_gives_them_back_after_a_lease() -> None:
    """Over TCP nothing tells the controller that a producer died: its slots come back when
    their lease lapses, as it stopped renewing them (before: never, and after enough such
    deaths every producer waited for ever)."""
    admission = tq.AdmissionConfig(capacity=4, learner_task="learn", slot_lease=LEASE)
    async with (
        tq.local_cluster(num_storage_units=1, transport="tcp", admission=admission) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.acquire_rollout(0, 1)
        with _producer(cluster.address, 3, same_host=False) as proc:
            await _said(proc, b"ACQUIRED")
            sigkill(proc)
        await client.acquire_rollout(0, 3, timeout=20)  # woken when the dead one's lapsed
        assert (await client.staleness_status())["outstanding"] == 4


async def test_a_slow_tcp_producer_keeps_its_slots_for_many_leases_and_its_put_settles_them() -> (
    None
):
    """A live producer that generates for several leases without a call keeps its slots (its
    client renews them); its put settles them, and dying after that gives nothing back (the
    put rows wait for the learner)."""
    admission = tq.AdmissionConfig(capacity=3, learner_task="learn", slot_lease=LEASE)
    async with (
        tq.local_cluster(num_storage_units=1, transport="tcp", admission=admission) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
        tq.AsyncClient.connect(cluster.address, same_host=False) as learner,
    ):
        with _producer(cluster.address, 2, same_host=False) as proc:
            await _said(proc, b"ACQUIRED")
            with pytest.raises(tq.TQTimeoutError):
                await client.acquire_rollout(0, 2, timeout=3 * LEASE)
            _tell(proc, b"put")
            await _said(proc, b"PUT")
            sigkill(proc)
        with pytest.raises(tq.TQTimeoutError):
            await client.acquire_rollout(0, 2, timeout=2 * LEASE)
        assert (await client.staleness_status())["outstanding"] == 2
        await learner.get_meta(["x"], 2, "p", "learn", timeout=10)
        await client.acquire_rollout(0, 3, timeout=20)


async def test_a_live_producer_keeps_its_slots_across_a_durable_controller_restart(
    tmp_path: Path,
) -> None:
    """A durable controller restarted while a live TCP producer holds slots: they are its
    own still after the grace lease the restarted controller gives them (its client renewed
    them there), and its put settles them."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path.parent / f"{tmp_path.name}.toml"
    config.write_text(f'[admission]\ncapacity = 3\nlearner_task = "learn"\nslot_lease = {LEASE}\n')
    args = ["controller", "--bind", bind, "--durability", "process", "--data-dir"]
    args += [str(tmp_path), "--config", str(config)]
    unit = ("storage", "--controller", bind, "--unit-id", "0")
    with (
        serve_role(*args) as (ctl, _),
        serve_role(*unit, line="TQ_UNIT="),
        _producer(bind, 2, same_host=False) as proc,
    ):
        await _said(proc, b"ACQUIRED")
        ctl.send_signal(signal.SIGKILL)
        ctl.wait(timeout=10)
        with serve_role(*args):
            async with tq.AsyncClient.connect(bind, same_host=False) as client:
                assert (await client.staleness_status())["outstanding"] == 2
                with pytest.raises(tq.TQTimeoutError):  # the grace lease is long past
                    await client.acquire_rollout(0, 2, timeout=3 * LEASE)
                _tell(proc, b"put")
                await _said(proc, b"PUT")
                sigkill(proc)
                with pytest.raises(tq.TQTimeoutError):  # its put settled them: none back
                    await client.acquire_rollout(0, 2, timeout=2 * LEASE)
                assert (await client.staleness_status())["outstanding"] == 2


async def test_a_same_host_producer_keeps_its_slots_across_a_restart_without_a_call(
    tmp_path: Path,
) -> None:
    """A same-host producer speaks through the controller's Unix socket, which dies with it:
    generating, it makes no call after the restart, yet its renewals find the restarted
    controller, so its slots stay past the grace lease; killed, it gives them back."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path.parent / f"{tmp_path.name}.toml"
    config.write_text(f'[admission]\ncapacity = 3\nlearner_task = "learn"\nslot_lease = {LEASE}\n')
    args = ["controller", "--bind", bind, "--durability", "process", "--data-dir"]
    args += [str(tmp_path), "--config", str(config)]
    with serve_role(*args) as (ctl, _), _producer(bind, 2) as proc:
        await _said(proc, b"ACQUIRED")
        ctl.send_signal(signal.SIGKILL)
        ctl.wait(timeout=10)
        with serve_role(*args):
            async with tq.AsyncClient.connect(bind) as client:
                with pytest.raises(tq.TQTimeoutError):  # the grace lease is long past
                    await client.acquire_rollout(0, 2, timeout=3 * LEASE)
                assert (await client.staleness_status())["outstanding"] == 2
                sigkill(proc)
                await client.acquire_rollout(0, 3, timeout=20)
