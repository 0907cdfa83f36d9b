"""Storage units that keep their cells on disk, as real processes (issue 36, items 2, 4, 5).

A ``tq-async serve storage --durability LEVEL --data-dir DIR`` unit is killed (SIGKILL) after
acknowledged puts and started again on its directory (on a new port): it registers with the
instance token of its directory, the controller resumes it instead of declaring its rows lost,
and every acknowledged row reads back bit-exactly -- also through ``--memory-cap``, which
keeps most cells on disk. A unit pointed at another unit's directory, or at one a running
unit holds, is refused at start with a message that says what to do.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import tq_async as tq
from _cluster_proc import serve_role
from tq_async._controller._server import ControllerServer
from tq_async._core._state import ControllerState
from tq_async._storage._server import StorageServer

_CAP = str(256 << 10)  # most cells of this test are on disk, not in memory


def _batch(n: int, seed: int) -> dict[str, torch.Tensor]:
    """Random bits (a dense float column with NaN payloads, an int column): a round trip
    that is not bit-exact shows."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31 - 1, (n, 2048), generator=g, dtype=torch.int32)
    return {"f": bits.view(torch.float32), "i": torch.randint(0, 1 << 40, (n, 3), generator=g)}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(
        torch.equal(
            got[k].view(torch.int32) if k == "f" else got[k], v.view(torch.int32) if k == "f" else v
        )
        for k, v in want.items()
    )


def _unit(address: str, level: str, data_dir: Path, *extra: str) -> tuple[str, ...]:
    return (
        "storage",
        "--controller",
        address,
        "--unit-id",
        "0",
        "--durability",
        level,
        "--data-dir",
        str(data_dir),
        *extra,
    )


@pytest.mark.parametrize("level", ["process", "fsync"])
async def test_a_unit_killed_after_acknowledged_puts_comes_back_with_every_row(
    tmp_path: Path, level: str
) -> None:
    data_dir = tmp_path / "unit0"
    data_dir.mkdir()
    with serve_role("controller") as (_, address):
        args = _unit(address, level, data_dir, "--memory-cap", _CAP)
        with serve_role(*args, line="TQ_UNIT=") as (unit, before):
            async with tq.AsyncClient.connect(address, request_timeout=10) as client:
                acked = []
                for i in range(12):  # 8 KiB rows: big puts go straight to the unit
                    batch = _batch(1 + i % 5, i)
                    acked.append((await client.put(batch, f"p{i % 3}"), batch))
                cleared = await client.put(_batch(2, 99), "gone")
                await client.clear_partition("gone")
                unit.send_signal(signal.SIGKILL)  # right after the last acknowledgement
                unit.wait(timeout=10)
                with serve_role(*args, line="TQ_UNIT=") as (_, after):
                    assert after.split()[0] == "0"
                    assert after.split()[1] != before.split()[1]  # a new port
                    for meta, batch in acked:
                        assert _same(await client.get_data(meta), batch)
                    lost = await client.lost_rows()
                    assert lost["dead_units"] == []
                    assert not any(lost["rows"].values())
                    # consumers get every row too, and the unit takes new puts
                    got = await client.get_meta(["f", "i"], 5, "p0", "t", timeout=5)
                    assert len(got) == 5
                    new = await client.put(_batch(3, 1000), "p0")
                    assert _same(await client.get_data(new), _batch(3, 1000))
                    with pytest.raises(tq.TQError):
                        await client.get_data(cleared)
                    stats = (await client.storage_stats())[0]
                    assert stats["memory_bytes"] <= int(_CAP)
                    assert stats["disk_reads"] > 0  # read back from its segment files


@pytest.mark.parametrize("level", ["process", "fsync"])
async def test_cells_put_through_shared_memory_survive_a_sigkill_in_the_arena_file(
    tmp_path: Path, level: str
) -> None:
    """No ``--memory-cap``: the unit's arena is ``arena.dat`` in its directory, so a same-host
    client's put is in the OS's files before the unit answers it, and is not copied again
    into a segment; a SIGKILLed unit maps it again on restart, and frees nothing still live."""
    data_dir = tmp_path / "unit0"
    data_dir.mkdir()
    with serve_role("controller") as (_, address):
        args = _unit(address, level, data_dir)
        with serve_role(*args, line="TQ_UNIT=") as (unit, _):
            async with tq.AsyncClient.connect(address, request_timeout=10) as client:
                acked = []
                for i in range(12):
                    batch = _batch(10 + i % 5, i)  # >= 80 KiB: through shared memory
                    acked.append((await client.put(batch, f"p{i % 3}"), batch))
                await client.clear_partition("p2")  # its regions are free for new puts
                acked = [(m, b) for m, b in acked if m.partition_id != "p2"]
                stats = (await client.storage_stats())[0]
                assert stats["shm_puts"] >= 12
                unit.send_signal(signal.SIGKILL)  # right after the last acknowledgement
                unit.wait(timeout=10)
                segments = sum(f.stat().st_size for f in data_dir.glob("seg-*.dat"))
                assert segments == 0  # every cell is in the arena file
                assert (data_dir / "arena.dat").exists()
                with serve_role(*args, line="TQ_UNIT=") as _:
                    for meta, batch in acked:
                        assert _same(await client.get_data(meta), batch)
                    # new puts take free space only: the old rows stay as they were
                    for i in range(8):
                        await client.put(_batch(12, 100 + i), "p0")
                    for meta, batch in acked:
                        assert _same(await client.get_data(meta), batch)
                    lost = await client.lost_rows()
                    assert not any(lost["rows"].values())


@pytest.mark.parametrize("level", ["memory", "process"])
async def test_a_unit_restarted_under_a_connection_that_rode_through_sets_shared_memory_up_again(
    tmp_path: Path, level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A unit restarted at the same address while a same-host client keeps its connection
    (ZMQ reconnects by itself) has no shared-memory session with it. Found by a chaos run:
    the put failed with `InvalidRequestError` ("not set up shared memory"). The unit now
    answers `SessionLostError`, and the client sets the session up again and carries on.
    Here the client is held on the unit's TCP address (no same-host twin socket, whose end
    it notices at once) and misses the disconnect (what a quick reconnect allows)."""
    from _chaos import free_port
    from tq_async._client._async import _same_host

    monkeypatch.setattr(_same_host, "same_host_ipc", lambda address: False)
    data_dir = tmp_path / "unit0"
    data_dir.mkdir()
    with serve_role("controller") as (_, address):
        args = (*_unit(address, level, data_dir), "--bind", f"tcp://127.0.0.1:{free_port()}")
        if level == "memory":
            args = args[: args.index("--data-dir")] + args[args.index("--data-dir") + 2 :]
        async with tq.AsyncClient.connect(address, request_timeout=10) as client:
            before = _batch(12, 1)
            with serve_role(*args, line="TQ_UNIT=") as (unit, _):
                meta = await client.put(before, "p")
                assert (await client.storage_stats())[0]["shm_puts"] == 1
                conn = client._links.units[0]
                back = _kill_unnoticed(client, unit)
            with serve_role(*args, line="TQ_UNIT=") as _:
                with anyio.fail_after(30):
                    await back.wait()  # ZMQ reconnected to the new unit
                after = _batch(12, 2)
                meta2 = await client.put(after, "p")  # through a new session
                assert client._links.units[0] is conn  # the same connection, rode through
                assert _same(await client.get_data(meta2), after)
                if level == "process":  # the cells of before the restart are back
                    assert _same(await client.get_data(meta), before)


@pytest.mark.parametrize("noticed", [True, False], ids=["noticed", "rode_through"])
async def test_a_copy_held_up_past_a_unit_restart_never_lands_in_the_new_boots_cells(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, noticed: bool
) -> None:
    """A durable unit's arena is its file ``arena.dat``, and a client's mapping of it
    outlives the unit's process: a client that took a grant, then stalled past a SIGKILL and
    a restart of the unit (a GC pause, a stopped process), copied into a region the new boot
    may have lent to another put already, and overwrote its acknowledged cells. The client
    now checks the arena's token (which every boot writes anew) before it copies: the stale
    put is sent again through a new session, and the other put reads back as it was.

    ``noticed``: the client saw the unit's same-host socket end (its mapping is closed under
    the put: it failed with an `AttributeError` before); ``rode_through``: it is on the
    unit's TCP address and misses the disconnect, so its mapping stays open (the copy
    overwrote the other put's cells before)."""
    from _chaos import free_port
    from tq_async._client._async import _put, _same_host

    if not noticed:
        monkeypatch.setattr(_same_host, "same_host_ipc", lambda address: False)

    granted, resume = anyio.Event(), anyio.Event()
    offsets: list[int] = []
    ask_grant = _put.ask_grant

    async def stalled_after_the_first_grant(*args: object) -> object:
        grant = await ask_grant(*args)  # type: ignore[arg-type]
        assert grant is not None
        offsets.append(grant.offset)
        if len(offsets) == 1:  # the stale client's: held up between its grant and its copy
            granted.set()
            await resume.wait()
        return grant

    monkeypatch.setattr(_put, "ask_grant", stalled_after_the_first_grant)
    data_dir = tmp_path / "unit0"
    data_dir.mkdir()
    stale_batch, fresh_batch = _batch(12, 1), _batch(12, 2)  # same size: the same region
    with serve_role("controller") as (_, address):
        args = (*_unit(address, "process", data_dir), "--bind", f"tcp://127.0.0.1:{free_port()}")
        async with tq.AsyncClient.connect(address, request_timeout=10) as stale:
            results: dict[str, tq.BatchMeta] = {}
            stored = anyio.Event()

            async def stale_put() -> None:
                results["stale"] = await stale.put(stale_batch, "p")
                stored.set()

            with serve_role(*args, line="TQ_UNIT=") as (unit, _):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(stale_put)
                    with anyio.fail_after(30):
                        await granted.wait()
                    if not noticed:
                        stale._links.units[0]._on_disconnect = None
                    unit.send_signal(signal.SIGKILL)
                    unit.wait(timeout=10)
                    with serve_role(*args, line="TQ_UNIT=") as _:
                        async with tq.AsyncClient.connect(address, request_timeout=10) as fresh:
                            fresh_meta = await fresh.put(fresh_batch, "p")
                            assert offsets[1] == offsets[0]  # lent again by the new boot
                            resume.set()  # the stale client copies now
                            with anyio.fail_after(30):
                                await stored.wait()
                            assert _same(await fresh.get_data(fresh_meta), fresh_batch)
                            assert _same(await fresh.get_data(results["stale"]), stale_batch)


async def test_a_spare_held_across_a_unit_restart_never_lands_in_the_new_boots_cells(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A durable unit lends a same-host client the grant of its next put (a spare) with
    each answer. The unit is SIGKILLed and restarted on its arena file while the client
    rides the restart through on its connection, still holding that spare; the new boot
    takes the first put's region back and lends the spare's to another client's put. The
    stale client's next put takes its spare, sees the arena's new token, and goes through a
    new session instead: the other put's cells read back as they were."""
    from _chaos import free_port
    from tq_async._client._async import _same_host

    monkeypatch.setattr(_same_host, "same_host_ipc", lambda address: False)
    data_dir = tmp_path / "unit0"
    data_dir.mkdir()
    with serve_role("controller") as (_, address):
        args = (*_unit(address, "process", data_dir), "--bind", f"tcp://127.0.0.1:{free_port()}")
        async with tq.AsyncClient.connect(address, request_timeout=10) as stale:
            with serve_role(*args, line="TQ_UNIT=") as (unit, _):
                first_batch = _batch(12, 1)
                first = await stale.put(first_batch, "p")
                assert stale._links.same_host_units.spare_bytes() > 0  # lent ahead
                back = _kill_unnoticed(stale, unit)
            with serve_role(*args, line="TQ_UNIT=") as _:
                with anyio.fail_after(30):
                    await back.wait()
                async with tq.AsyncClient.connect(address, request_timeout=10) as fresh:
                    fresh_batch = _batch(12, 2)
                    fresh_meta = await fresh.put(fresh_batch, "q")
                    stale_batch = _batch(12, 3)
                    stale_meta = await stale.put(stale_batch, "q")  # its spare is stale
                    assert _same(await fresh.get_data(fresh_meta), fresh_batch)
                    assert _same(await fresh.get_data(stale_meta), stale_batch)
                    assert _same(await fresh.get_data(first), first_batch)  # recovered


async def test_a_grant_of_the_last_boot_never_takes_a_grant_of_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Grant ids were a per-process counter from 1, so a restarted unit lent the same ids
    again. A same-host client that rode a restart through on its connection (here: the
    unit's TCP address) took its spare of the old boot for a put whose copy was slow
    (another thread); meanwhile another put of the client set shared memory up again on
    that connection and was lent the next spare, of the same id. The slow put then named
    the old id, and the new boot took the other put's spare for it: the put was acknowledged
    with the bytes of a region it never wrote (zeros), and the other put's next one failed
    ("grant unknown"). Now every boot lends ids of its own, and a put whose arena another
    call replaced while it copied goes through the new session."""
    from _chaos import free_port
    from tq_async._client._async import _put, _same_host

    monkeypatch.setattr(_same_host, "same_host_ipc", lambda address: False)
    copied, resume = anyio.Event(), anyio.Event()
    copies: list[int] = []
    off_loop = _put.run_sync_off_loop

    async def slow_first_copy(fn: Any, *args: Any) -> Any:
        out = await off_loop(fn, *args)
        copies.append(1)
        if len(copies) == 1:  # the slow put: copied, its StorePut not sent yet
            copied.set()
            await resume.wait()
        return out

    with serve_role("controller") as (_, address):
        args = ("storage", "--controller", address, "--unit-id", "0")
        args += ("--bind", f"tcp://127.0.0.1:{free_port()}")
        async with tq.AsyncClient.connect(address, request_timeout=10) as client:
            with serve_role(*args, line="TQ_UNIT=") as (unit, _):
                await client.put(_batch(12, 1), "p")
                assert client._links.same_host_units.spare_bytes() > 0  # lent ahead
                back = _kill_unnoticed(client, unit)
            with serve_role(*args, line="TQ_UNIT=") as _:
                with anyio.fail_after(30):
                    await back.wait()  # ZMQ reconnected to the new unit
                monkeypatch.setattr(_put, "THREAD_COPY_BYTES", 0)  # every copy off the loop
                monkeypatch.setattr(_put, "run_sync_off_loop", slow_first_copy)
                slow_batch, other_batch = _batch(12, 2), _batch(12, 3)
                results: dict[str, tq.BatchMeta] = {}

                async def slow_put() -> None:
                    results["slow"] = await client.put(slow_batch, "q")

                async with anyio.create_task_group() as tg:
                    tg.start_soon(slow_put)  # takes the old boot's spare
                    with anyio.fail_after(30):
                        await copied.wait()
                        other = await client.put(other_batch, "q")  # a new session
                    resume.set()
                assert _same(await client.get_data(other), other_batch)
                assert _same(await client.get_data(results["slow"]), slow_batch)
                again = _batch(12, 4)  # takes the spare the other put was lent
                assert _same(await client.get_data(await client.put(again, "q")), again)


async def test_a_spare_answered_just_before_the_unit_died_is_never_used_in_the_next_boot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put's answer (with the spare its unit lent for the next put) arrived, but the
    client saw the unit's connection break before the put went on: it forgot the unit's
    arena and spares, then kept that spare anyway. Once the unit was back (restarted at its
    address, the connection reconnected), the next put took the spare and copied into the
    new boot's arena at its offset, which the new boot had lent to another client's put:
    that put's acknowledged cells were overwritten (and the stale put failed, "grant
    unknown"). Found by a chaos run (puts in flight while a unit is SIGKILLed and
    restarted). A spare of an arena forgotten meanwhile now goes back instead."""
    from _chaos import free_port
    from tq_async._client._async import _same_host
    from tq_async._transport._dealer import DealerConnection
    from tq_async._wire._protocol import StorePut

    monkeypatch.setattr(_same_host, "same_host_ipc", lambda address: False)
    data_dir = tmp_path / "unit0"
    data_dir.mkdir()
    request = DealerConnection.request
    killed: list[subprocess.Popen[bytes]] = []

    async def dies_after_answering(self: DealerConnection, body: Any, *a: Any, **kw: Any) -> Any:
        reply = await request(self, body, *a, **kw)
        if isinstance(body, StorePut) and killed:  # answered: the unit dies now, and the
            unit = killed.pop()  # client sees its connection break before the put goes on
            broke = anyio.Event()
            forget = self._on_disconnect
            assert forget is not None

            def noticed() -> None:
                forget()
                broke.set()

            self._on_disconnect = noticed
            unit.send_signal(signal.SIGKILL)
            unit.wait(timeout=10)
            with anyio.fail_after(20):
                await broke.wait()
            self._on_disconnect = forget
        return reply

    with serve_role("controller") as (_, address):
        args = (*_unit(address, "process", data_dir), "--bind", f"tcp://127.0.0.1:{free_port()}")
        async with tq.AsyncClient.connect(address, request_timeout=10) as stale:
            acked = []
            with serve_role(*args, line="TQ_UNIT=") as (unit, _):
                acked.append((await stale.put(_batch(12, 1), "p"), _batch(12, 1)))
                monkeypatch.setattr(DealerConnection, "request", dies_after_answering)
                killed.append(unit)
                acked.append((await stale.put(_batch(12, 2), "p"), _batch(12, 2)))
                monkeypatch.setattr(DealerConnection, "request", request)
            back = anyio.Event()
            stale._links.units[0]._on_connect = back.set
            with serve_role(*args, line="TQ_UNIT=") as _:
                with anyio.fail_after(30):
                    await back.wait()  # ZMQ reconnected the stale client to the new unit
                async with tq.AsyncClient.connect(address, request_timeout=10) as fresh:
                    fresh_batch = _batch(12, 3)  # lent the first free region of the new boot
                    fresh_meta = await fresh.put(fresh_batch, "q")
                    stale_batch = _batch(12, 4)
                    stale_meta = await stale.put(stale_batch, "q")
                    assert _same(await fresh.get_data(fresh_meta), fresh_batch)
                    assert _same(await fresh.get_data(stale_meta), stale_batch)
                    for meta, batch in acked:  # recovered
                        assert _same(await fresh.get_data(meta), batch)


@pytest.mark.parametrize("kind", ["dense", "jagged"])
async def test_a_device_spare_held_across_a_unit_restart_puts_through_a_new_session(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A unit lends a same-host client the device grant of its next put too. Restarted
    while the client rides the restart through on its connection, the new boot knows
    neither the client's session nor that grant: the put that took it sets shared memory
    and the device arena up again and goes through the new session (it failed, "grant
    unknown"), and the client's next puts take the new boot's spares."""
    from _chaos import free_port
    from tq_async._client._async import _same_host
    from tq_async._paths._device import EMULATE_ENV

    monkeypatch.setenv(EMULATE_ENV, "1")  # the units' device arenas: host memory (a test)
    monkeypatch.setattr(_same_host, "same_host_ipc", lambda address: False)
    x = torch.arange(16 * 8192).reshape(16, 8192)  # 1 MiB: device to device

    def column(i: int) -> torch.Tensor:  # rows 0..15 of x + i, row r cut to r % 5 elements
        if kind == "dense":
            return x + i
        rows = [(x[r] + i).reshape(-1, 1024)[: r % 5] for r in range(16)]
        return torch.nested.nested_tensor(rows, layout=torch.jagged)

    def same(got: torch.Tensor, want: torch.Tensor) -> bool:
        if kind == "dense":
            return torch.equal(got, want)
        pairs = zip(got.unbind(), want.unbind(), strict=True)
        return all(torch.equal(g, w) for g, w in pairs)

    with serve_role("controller") as (_, address):
        args = ("storage", "--controller", address, "--unit-id", "0", "--device-cap")
        args += (str(64 << 20), "--bind", f"tcp://127.0.0.1:{free_port()}")
        async with tq.AsyncClient.connect(address, request_timeout=10) as client:
            units = client._links.same_host_units
            with serve_role(*args, line="TQ_UNIT=") as (unit, _):
                await client.put({"x": column(0)}, "p")
                assert units.spare_bytes(device=True) > 0  # lent ahead
                back = _kill_unnoticed(client, unit)
            with serve_role(*args, line="TQ_UNIT=") as _:
                with anyio.fail_after(30):
                    await back.wait()
                metas = [await client.put({"x": column(i)}, "q") for i in range(2)]
                for i, meta in enumerate(metas):
                    assert same((await client.get_data(meta, device="cpu"))["x"], column(i))
                (stats,) = (await client.storage_stats()).values()
                assert stats["device_puts"] == 2
                assert units.spare_bytes(device=True) > 0  # the new boot's


def _kill_unnoticed(client: tq.AsyncClient, unit: subprocess.Popen[bytes]) -> anyio.Event:
    """SIGKILL ``unit`` while ``client``'s connection to it misses the disconnect (what a
    quick reconnect allows: the connection rides the restart through); the event is set
    once ZMQ has reconnected it, to the next unit at the address."""
    conn = client._links.units[0]
    conn._on_disconnect = None
    back = anyio.Event()
    conn._on_connect = back.set
    unit.send_signal(signal.SIGKILL)
    unit.wait(timeout=10)
    return back


def _refused(*argv: str) -> str:
    """Start ``tq-async serve ARGV...`` expecting it to refuse; its stderr."""
    done = subprocess.run(
        [sys.executable, "-m", "tq_async._deploy._cli", "serve", *argv],
        capture_output=True,
        timeout=60,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert done.returncode != 0
    return done.stderr.decode()


def test_a_unit_on_another_units_directory_is_refused(tmp_path: Path) -> None:
    data_dir = tmp_path / "unit0"
    data_dir.mkdir()
    with serve_role("controller") as (_, address):
        args = _unit(address, "process", data_dir)
        with serve_role(*args, line="TQ_UNIT="):
            err = _refused(*args)  # the same directory, while its unit runs
            assert "in use by another running storage unit" in err
        other = list(args)
        other[other.index("--unit-id") + 1] = "1"
        err = _refused(*other)
        assert "belongs to storage unit 0" in err
        ctl_dir = tmp_path / "ctl"
        ctl_dir.mkdir()
        (ctl_dir / "tq-async-data-dir.json").write_text('{"kind": "controller", "format": 1}')
        err = _refused(*_unit(address, "process", ctl_dir))
        assert "belongs to a controller" in err


class _FullDisk:
    """The unit's write seam: fails with ENOSPC while ``full`` (a full disk, without root)."""

    def __init__(self) -> None:
        self.full = False

    def __call__(self, fd: int, data: object) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.write(fd, data)  # type: ignore[call-overload]


@pytest.mark.parametrize("level", ["process", "fsync"])
async def test_a_full_disk_fails_the_put_and_the_unit_keeps_serving(
    tmp_path: Path, level: str
) -> None:
    """A durable unit in the controller's process (no fixed-size tmpfs here: mounting one
    needs root, so the disk fills through the store's write seam)."""
    unit = StorageServer(0, durability=level, data_dir=str(tmp_path))
    full = _FullDisk()
    assert unit.state.disk is not None
    unit.state.disk._write = full  # the seam `SegmentStore(write=...)` takes
    async with anyio.create_task_group() as tg:
        addresses = {0: await tg.start(unit.serve, "tcp://127.0.0.1:0")}
        controller = ControllerServer(ControllerState(addresses), local_units={0: unit})
        address = await tg.start(controller.serve, "tcp://127.0.0.1:0")
        async with tq.AsyncClient.connect(address, request_timeout=10) as client:
            kept = [(await client.put(_batch(4, 1), "p"), _batch(4, 1))]
            kept.append((await client.put({"k": torch.arange(3)}, "q"), {"k": torch.arange(3)}))
            full.full = True
            with pytest.raises(tq.StorageFullError, match="free space"):
                await client.put(_batch(4, 2), "p")  # through the unit
            with pytest.raises(tq.StorageFullError):
                await client.put({"k": torch.arange(2)}, "q")  # in one message, inline
            full.full = False  # space was freed
            for meta, batch in kept:
                assert _same(await client.get_data(meta), batch)
            again = await client.put(_batch(2, 3), "p")
            assert _same(await client.get_data(again), _batch(2, 3))
        tg.cancel_scope.cancel()
    restarted = StorageServer(-1, durability=level, data_dir=str(tmp_path))
    assert restarted.unit_id == 0  # the directory knows its unit
    assert restarted.state.stats().rows == 6 + 3  # p: 4 + 2 rows, q: 3; nothing of the failed


@pytest.mark.parametrize("level", ["process", "fsync"])
async def test_a_whole_serve_killed_after_acknowledged_puts_comes_back_with_every_row(
    tmp_path: Path, level: str
) -> None:
    """All-in-one ``tq-async serve`` at a durable level (its units' cells under
    ``data_dir/units/unit-N``): SIGKILLed after acknowledged puts, restarted on the same
    ``--bind`` and ``--data-dir``, every row reads back bit-exactly and consumption goes on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        bind = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    args = ("--bind", bind, "--storage-units", "2", "--durability", level)
    args += ("--data-dir", str(tmp_path), "--memory-cap", _CAP)
    batches = [_batch(16, seed) for seed in range(4)]
    with serve_role(*args) as (proc, address):
        async with tq.AsyncClient.connect(address) as c:
            metas = [await c.put(b, "p") for b in batches]
            await c.seal("p")
            first = await c.get_meta(["f", "i"], 16, "p", "t")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert sorted(os.listdir(tmp_path / "units")) == ["unit-0", "unit-1"]
    with serve_role(*args) as (_, address):
        async with tq.AsyncClient.connect(address) as c:
            for meta, want in zip(metas, batches, strict=True):
                assert _same(await c.get_data(meta), want)
            info = await c.partition_info("p")
            assert info["lost"] == 0
            rest = []
            while True:
                got = await c.get_meta(["f", "i"], 16, "p", "t", timeout=5)
                if got.end_of_stream or not len(got):
                    break
                rest.extend(got.global_indexes)
            everything = sorted(i for m in metas for i in m.global_indexes)
            assert sorted(first.global_indexes + rest) == everything


async def test_a_killed_units_spill_directory_goes_when_the_next_unit_starts(
    tmp_path: Path,
) -> None:
    """At ``memory`` with ``--memory-cap``, spilled cells go to a scratch directory under
    ``--data-dir`` that the unit removes when it stops; a SIGKILLed (OOM-killed) unit cannot,
    so the next unit started there removes it: a unit killed again and again must not fill
    the disk with the spilled cells of its former lives. A running unit's is left alone."""
    data_dir = tmp_path / "spill"
    data_dir.mkdir()
    with serve_role("controller") as (_, address):
        args = ("storage", "--controller", address, "--memory-cap", str(64 << 10))
        with serve_role(*args, "--data-dir", str(data_dir), line="TQ_UNIT=") as (unit, _):
            async with tq.AsyncClient.connect(address, request_timeout=10) as client:
                for i in range(4):
                    await client.put(_batch(4, i), "p")  # 32 KiB each: past the cap
                assert (await client.storage_stats())[0]["spills"] > 0
            (killed,) = data_dir.iterdir()
            assert any(killed.glob("seg-*.dat"))
            unit.send_signal(signal.SIGKILL)
            unit.wait(timeout=10)
        assert killed.exists()
        with (
            serve_role(*args, "--data-dir", str(data_dir), line="TQ_UNIT="),
            serve_role(*args, "--data-dir", str(data_dir), line="TQ_UNIT="),
        ):
            assert not killed.exists()
            assert len(list(data_dir.iterdir())) == 2  # the two running units' own
        assert list(data_dir.iterdir()) == []  # stopped (SIGTERM): each removed its own
