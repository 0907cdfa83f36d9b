"""`UnitDir` alone: the files of a unit's cells at each durability level.

A durable directory is claimed, locked while its unit runs (a second one on it is refused,
until the first closes), records the id the controller gave, and gives its cells back to the
next unit started on it; at ``memory`` with a cap the cells spill into a scratch directory
that close removes.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest

import tq_async as tq
from tq_async._controller._journal import JournalStore
from tq_async._storage._cells import StorageState
from tq_async._storage._segments import ARENA_FILE, MARKER
from tq_async._storage._unit_dir import UnitDir
from tq_async._wire._columns import ColumnHeader

DENSE = ColumnHeader("x", "dense", "int64", (2,))


def test_memory_without_a_cap_has_no_files(tmp_path: Path) -> None:
    unit_dir = UnitDir("memory", str(tmp_path), None, 3)
    assert unit_dir.store is None
    assert unit_dir.instance is None
    assert not unit_dir.durable
    assert unit_dir.arena_file is None
    assert unit_dir.unit_id == 3
    unit_dir.registered(4, "whatever")  # nothing to record
    unit_dir.close()
    assert list(tmp_path.iterdir()) == []


def test_memory_with_a_cap_spills_into_a_scratch_directory_removed_on_close(
    tmp_path: Path,
) -> None:
    unit_dir = UnitDir("memory", str(tmp_path), 1 << 20, 0)
    assert unit_dir.store is not None
    assert not unit_dir.durable
    (scratch,) = tmp_path.iterdir()
    assert scratch.name.startswith("tq-unit-spill-")
    assert unit_dir.arena_file is None
    unit_dir.close()
    assert not scratch.exists()


@pytest.mark.parametrize("level", ["process", "fsync"])
def test_a_durable_directory_is_locked_while_its_unit_runs(tmp_path: Path, level: str) -> None:
    unit_dir = UnitDir(level, str(tmp_path), None, 0)
    assert unit_dir.durable
    assert unit_dir.store is not None
    assert unit_dir.store.sync == (level == "fsync")
    assert unit_dir.instance is not None
    assert unit_dir.instance.startswith("disk-")
    assert unit_dir.arena_file == os.path.join(str(tmp_path), ARENA_FILE)
    with pytest.raises(tq.ConfigError, match="in use by another running storage unit"):
        UnitDir(level, str(tmp_path), None, 0)
    unit_dir.close()
    again = UnitDir(level, str(tmp_path), None, 0)  # the lock went with the first
    assert again.instance == unit_dir.instance
    again.close()


def test_with_a_memory_cap_the_arena_is_no_file(tmp_path: Path) -> None:
    unit_dir = UnitDir("process", str(tmp_path), 1 << 20, 0)
    assert unit_dir.durable
    assert unit_dir.arena_file is None
    unit_dir.close()


def test_the_directory_records_its_unit_and_gives_it_back(tmp_path: Path) -> None:
    unit_dir = UnitDir("process", str(tmp_path), None, -1)  # the controller assigns one
    assert unit_dir.unit_id == -1
    assert unit_dir.instance is not None
    unit_dir.registered(7, unit_dir.instance)
    assert unit_dir.unit_id == 7
    assert json.loads((tmp_path / MARKER).read_text())["unit_id"] == 7
    state = StorageState(disk=unit_dir.store, instance=unit_dir.instance)
    unit_dir.take_back(state)  # nothing yet: a new directory
    assert state.stats().rows == 0
    state.put("p", [0, 1], [DENSE], [bytearray(32)], incarnation="i")
    unit_dir.close()

    back = UnitDir("process", str(tmp_path), None, -1)
    assert back.unit_id == 7  # the directory's unit comes back under its id
    again = StorageState(disk=back.store, instance=back.instance)
    back.take_back(again)
    assert again.stats().rows == 2
    back.close()


def test_wrong_levels_and_missing_directories_are_refused(tmp_path: Path) -> None:
    with pytest.raises(tq.ConfigError, match="expected memory, process or fsync"):
        UnitDir("disk", str(tmp_path), None, 0)
    with pytest.raises(tq.ConfigError, match="give it one"):
        UnitDir("fsync", None, None, 0)


def test_a_missing_spill_directory_is_a_config_error(tmp_path: Path) -> None:
    """At ``memory`` with a cap, ``data_dir`` is where the scratch directory goes: a missing
    one is refused with the message a durable level gives (it was a bare FileNotFoundError,
    a traceback out of ``tq-async serve storage``)."""
    with pytest.raises(tq.ConfigError, match="is not a directory; create it"):
        UnitDir("memory", str(tmp_path / "missing"), 1 << 20, 0)
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(tq.ConfigError, match="is not a directory; create it"):
        UnitDir("memory", str(tmp_path / "file"), 1 << 20, 0)


@pytest.mark.parametrize("errno_", [errno.EROFS, errno.ENOSPC])
@pytest.mark.parametrize("used", [False, True], ids=["new", "used"])
@pytest.mark.parametrize("who", ["unit", "controller"])
def test_a_data_dir_it_cannot_write_in_is_a_config_error_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, who: str, used: bool, errno_: int
) -> None:
    """A read-only mount or a full disk: a `ConfigError` naming the directory and what to do
    (not an ``OSError`` from deep inside the start)."""

    def start() -> None:
        if who == "unit":
            UnitDir("process", str(tmp_path), None, 0).close()
        else:
            JournalStore(str(tmp_path), "process").close()

    if used:
        start()
    _refuse_writes(monkeypatch, tmp_path, errno_)
    with pytest.raises(tq.ConfigError, match=r"cannot write in .*make it writable"):
        start()


def _refuse_writes(monkeypatch: pytest.MonkeyPatch, directory: Path, errno_: int) -> None:
    """Opening a file under ``directory`` for writing fails with ``errno_`` from now on."""
    real_open, real_os_open = open, os.open

    def refused(path: Any) -> None:
        if str(path).startswith(str(directory)):
            raise OSError(errno_, os.strerror(errno_), str(path))

    def fake_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if set(mode) & set("wax+"):
            refused(path)
        return real_open(path, mode, *args, **kwargs)

    def fake_os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refused(path)
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    monkeypatch.setattr(os, "open", fake_os_open)


def test_a_unit_restarted_on_a_full_disk_registers_without_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A unit restarted on its directory once its disk is full: registering under the id its
    marker records has nothing to write (it used to die of an OSError rewriting the marker;
    it comes back now: its cells can be read, its partitions cleared to make room). One that
    must record an id says so with a `ConfigError` naming the directory."""
    used, new = tmp_path / "used", tmp_path / "new"
    used.mkdir()
    new.mkdir()
    first = UnitDir("process", str(used), None, 0)
    assert first.instance is not None
    first.registered(0, first.instance)
    first.close()
    unnamed = UnitDir("process", str(new), None, -1)  # the controller gives it an id
    assert unnamed.instance is not None
    _refuse_writes(monkeypatch, new, errno.ENOSPC)
    with pytest.raises(tq.ConfigError, match=r"cannot write in .*free space"):
        unnamed.registered(3, unnamed.instance)
    unnamed.close()
    again = UnitDir("process", str(used), None, 0)  # (its lock file exists: no write)
    assert again.instance == first.instance
    _refuse_writes(monkeypatch, used, errno.ENOSPC)
    again.registered(0, again.instance)
    again.close()
