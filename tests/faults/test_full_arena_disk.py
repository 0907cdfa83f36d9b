"""A durable unit's arena file (``arena.dat``) on a disk that really fills: a tmpfs of a few
MiB (mounted by the test: skipped where that needs root it lacks; the logic is tested without
root through the arena's `fallocate` seam, ``tests/storage/test_arena_file.py``).

The arena file is sparse and mapped shared by the unit and its same-host clients: a store
into a page the full disk has no block for kills the process storing with SIGBUS. A full disk
must fail the put with `StorageFullError` instead, and kill nobody: not the client copying
a put, not the unit copying a read, not a unit making its arena.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tq_async as tq
from _cluster_proc import serve_role, sigkill, warm_python
from _tmpfs import fill, small_tmpfs

_CLIENT = r"""
import sys, torch, tq_async as tq

with tq.Client.connect(sys.argv[1], request_timeout=20, inline_put_bytes=0) as c:
    kept = []
    for i in range(64):  # 1 MiB a put through the arena, until the disk is full
        try:
            kept.append(c.put({"x": torch.full((64, 4096), i, dtype=torch.int32)}, "p"))
        except tq.StorageFullError as exc:
            print("FULL", exc, flush=True)
            break
    else:
        sys.exit("the disk never filled")
    assert c.storage_stats()[0]["shm_puts"] == len(kept) >= 2, c.storage_stats()
    sys.stdin.readline()  # the test took what room was left
    # rows of two puts: the unit gathers them into a copy, in its arena if it has room
    both = c.get_data(tq.BatchMeta.concat(kept[:2]))["x"]
    assert torch.equal(both, torch.arange(2).repeat_interleave(64)[:, None].expand(128, 4096))
    print("READ", c.storage_stats()[0]["shm_fallbacks"], flush=True)
"""


@pytest.mark.parametrize("level", ["process", "fsync"])
def test_a_full_disk_fails_a_same_host_put_and_kills_no_process(tmp_path: Path, level: str) -> None:
    """A same-host client puts until the unit's disk is full: the put that finds it full
    fails with StorageFullError (the client lives on: it died of SIGBUS at ``process`` level
    and got a raw OSError at ``fsync``), and a read the unit would copy into its arena comes
    back by socket (the unit died of SIGBUS copying it); the unit keeps serving."""
    with (
        small_tmpfs(tmp_path / "disk", 6 << 20) as disk,
        serve_role("controller") as (_, address),
    ):
        args = ("storage", "--controller", address, "--unit-id", "0")
        args += ("--durability", level, "--data-dir", str(disk), "--shm-cap", str(64 << 20))
        with serve_role(*args, line="TQ_UNIT=") as (unit, _):
            with warm_python(_CLIENT, address, stderr=True) as client:
                full = client.stdout.readline().decode()  # (EOF if it died)
                if full.startswith("FULL"):
                    fill(disk)  # not a page left for the read's copy
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # (it died)
                    client.stdin.write(b"go\n")
                    client.stdin.flush()
                code = client.wait(timeout=90)  # (what it prints is small: the socket holds it)
                assert client.stderr is not None
                out, err = client.stdout.read().decode(), client.stderr.read().decode()
            assert code == 0, (code, err[-3000:])
            assert "free space" in full
            assert out.startswith("READ")
            assert int(out.split()[1]) >= 2  # the put's grant and the read's copy: refused
            assert unit.poll() is None  # still serving


def test_an_arena_file_made_on_a_full_disk_is_an_error_not_a_sigbus(tmp_path: Path) -> None:
    """A new arena file on a full disk: its token's page has no block; writing it killed
    the process (exit 135). An OSError now (a unit starts without shared memory)."""
    with small_tmpfs(tmp_path / "disk", 1 << 20) as disk:
        fill(disk)
        make = (
            "import errno, sys\n"
            "from tq_async._paths._shm import Arena\n"
            "try:\n"
            f"    Arena(1 << 20, path={str(disk / 'arena.dat')!r})\n"
            "except OSError as exc:\n"
            "    print('ENOSPC' if exc.errno == errno.ENOSPC else exc)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", make], capture_output=True, text=True, timeout=60
        )
        assert (done.returncode, done.stdout.strip()) == (0, "ENOSPC"), done.stderr[-2000:]


@pytest.mark.parametrize("level", ["process", "fsync"])
async def test_a_unit_restarted_on_a_full_disk_comes_back(tmp_path: Path, level: str) -> None:
    """A unit SIGKILLed, its disk filled meanwhile, started again on its directory: it used
    to die at registration (rewriting its directory's marker: an OSError). It serves its
    cells now (a clear is how room comes back), and a put fails with StorageFullError. It
    came back without shared memory (rewriting ``arena.boot`` as it was failed), its arena
    file's cells read back from the disk: it keeps the arena now, the cells mapped."""
    want = torch.arange(64 * 4096).reshape(64, 4096)
    with (
        small_tmpfs(tmp_path / "disk", 6 << 20) as disk,
        serve_role("controller") as (_, address),
    ):
        args = ("storage", "--controller", address, "--unit-id", "0")
        args += ("--durability", level, "--data-dir", str(disk))
        with serve_role(*args, line="TQ_UNIT=") as (unit, _):
            async with tq.AsyncClient.connect(address, request_timeout=10) as client:
                meta = await client.put({"x": want}, "p")
            sigkill(unit)
        fill(disk)
        with serve_role(*args, line="TQ_UNIT="):
            async with tq.AsyncClient.connect(address, request_timeout=10) as client:
                assert torch.equal((await client.get_data(meta))["x"], want)
                stats = (await client.storage_stats())[0]
                assert stats["shm_cap"] > 0
                assert stats["disk_reads"] == 0  # mapped again, not read
                for m, i in await _put_until_full(client, want):
                    assert torch.equal((await client.get_data(m))["x"], want + i)


async def _put_until_full(client: tq.AsyncClient, base: torch.Tensor) -> list[tuple[Any, int]]:
    """Put ``base + i`` until a put fails with StorageFullError (the blocks an arena file's
    last boot lent are its own: they take a put or two); the puts made before, with ``i``."""
    kept = []
    for i in range(1, 9):
        try:
            kept.append((await client.put({"x": base + i}, "p"), i))
        except tq.StorageFullError:
            return kept
    raise AssertionError("the disk never filled")
