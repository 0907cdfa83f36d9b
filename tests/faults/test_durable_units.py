"""Storage units that keep their cells on disk, as real processes (issue 36, items 2, 4, 5).

A ``tq-async serve storage --durability LEVEL --data-dir DIR`` unit is killed (SIGKILL) after
acknowledged puts and started again on its directory (on a new port): it registers with the
instance token of its directory, the controller resumes it instead of declaring its rows lost,
and every acknowledged row reads back bit-exactly -- also through ``--memory-cap``, which
keeps most cells on disk. A unit pointed at another unit's directory, or at one a running
unit holds, is refused at start with a message that says what to do.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tq_async as tq
from _cluster_proc import serve_role

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
