"""The durable controller's store and settings (issue 36), in one process: the data_dir checks,
a damaged database, a torn WAL tail, deltas and their compaction through SQLite, a clean stop
and start of a whole ``local_cluster`` on its
data_dir, and the settings in Config, TOML and the CLI."""

from __future__ import annotations

import inspect
import os
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import structlog
import torch

import tq_async as tq
from _recovered import assert_recovered_as
from tq_async._controller._journal import JournalStore, Recorder, check_durability
from tq_async._core import _journal
from tq_async._core._state import ControllerState
from tq_async._core._transitions import ControllerCore, SampleCall
from tq_async._deploy._cli import _build_parser, config_from_args
from tq_async._wire._columns import ColumnHeader
from tq_async._wire._protocol import GetMeta, MetaReply, PutBegin, RegisterTasks, Reply


def test_a_damaged_database_is_a_clear_error(tmp_path: Path) -> None:
    JournalStore(tmp_path, "process").close()
    (tmp_path / "controller.db").write_bytes(b"not a database at all" * 100)
    with pytest.raises(tq.TQError, match="damaged"):
        JournalStore(tmp_path, "process")


def test_a_journal_the_disk_cannot_open_is_no_damaged_journal(tmp_path: Path) -> None:
    """SQLite failing for the disk's sake (full, an I/O error; here its WAL file cannot be
    opened) says so: the journal is whole, moving the data_dir away would be the wrong cure."""
    JournalStore(tmp_path, "process").close()
    (tmp_path / "controller.db-wal").mkdir()
    with pytest.raises(tq.TQError, match="could not open its journal") as info:
        JournalStore(tmp_path, "process")
    assert "damaged" not in str(info.value)
    (tmp_path / "controller.db-wal").rmdir()
    JournalStore(tmp_path, "process").close()  # the lock went back with the error


class _FullDisk:
    """A journal's connection whose next ``executemany`` fails as SQLite does on a full disk:
    the transaction rolled back by SQLite itself, then the error."""

    def __init__(self, db: Any) -> None:
        self.db = db

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)

    def executemany(self, *args: Any) -> Any:
        self.db.execute("ROLLBACK")
        raise sqlite3.OperationalError("database or disk is full")


def test_a_write_the_disk_refused_fails_with_the_disks_error(tmp_path: Path) -> None:
    """Not "cannot rollback - no transaction is active" (which the controller's log showed
    instead of the full disk), and the journal takes the next write."""
    store = JournalStore(tmp_path, "process")
    real = store.db
    store.db = _FullDisk(real)  # type: ignore[assignment]
    with pytest.raises(sqlite3.OperationalError, match="disk is full"):
        store.write(b"ctl", {"p": b"snap"}, [])
    store.db = real
    store.write(b"ctl", {"p": b"snap"}, [])
    assert store.load()[1] == {"p": b"snap"}
    store.close()


async def test_a_last_write_that_fails_at_shutdown_gives_the_data_dir_back(
    tmp_path: Path,
) -> None:
    """A full disk at shutdown: an error in the log, and the data_dir unlocked (a controller
    started again in this process is not refused as "in use by another running controller")."""
    recorder = Recorder(JournalStore(tmp_path, "process"), ControllerCore(ControllerState()), {})
    recorder.controller_dirty = True  # the last write has something to do

    def full(*args: Any) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    recorder.store.write = full  # type: ignore[method-assign]
    with structlog.testing.capture_logs() as logs, anyio.CancelScope() as scope:
        scope.cancel()  # (stopped at its first wait)
        await recorder.run(lambda: 0.0)
    assert any("last journal write" in e["event"] for e in logs)
    JournalStore(tmp_path, "process").close()


@pytest.mark.parametrize("marker", ["[1]", '"controller"', "null"])
def test_a_marker_of_json_but_no_object_is_a_config_error(tmp_path: Path, marker: str) -> None:
    (tmp_path / "tq-async-data-dir.json").write_text(marker)
    with pytest.raises(tq.ConfigError, match="belongs to a unknown"):
        JournalStore(tmp_path, "process")


def test_a_new_journals_marker_is_on_the_disk_before_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Synced aside, renamed, the directory synced: a machine crash never leaves a journal
    in a directory without its marker (refused at the next start as "no controller's")."""
    synced: list[str] = []
    fsync = os.fsync

    def record(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    JournalStore(tmp_path, "process").close()
    assert synced[:2] == [str(tmp_path / "tq-async-data-dir.json.tmp"), str(tmp_path)]


def test_a_torn_wal_tail_loses_only_the_last_unfinished_commit(tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    store = JournalStore(live, "fsync")
    store.write(b"c1", {"a": b"1" * 4000}, [])
    store.write(b"c2", {"b": b"2" * 4000}, [], [("a", b"d" * 3000)])
    wal = live / "controller.db-wal"
    size_before_last = wal.stat().st_size
    store.write(b"c3", {"c": b"3" * 40000}, [], [("a", b"e" * 30000), ("b", b"f" * 9000)])
    crashed = tmp_path / "crashed"  # the files as a crash in the middle of the last commit
    shutil.copytree(live, crashed)
    shutil.copytree(live, tmp_path / "whole")
    store.close()
    with structlog.testing.capture_logs() as logs:
        assert JournalStore(tmp_path / "whole", "fsync").load()[0] == b"c3"
    assert not logs  # a WAL of whole frames is no torn tail
    torn = crashed / "controller.db-wal"
    with torn.open("r+b") as f:
        f.truncate(size_before_last + (24 + 4096) + 1000)  # in the second frame of 4 KiB pages
    with structlog.testing.capture_logs() as logs:
        ctl, snaps, deltas = JournalStore(crashed, "fsync").load()
    assert any("torn" in e["event"] for e in logs)
    assert ctl == b"c2"
    assert snaps == {"a": b"1" * 4000, "b": b"2" * 4000}
    assert deltas == {"a": [b"d" * 3000]}


@pytest.mark.parametrize(
    ("level", "data_dir", "match"),
    [("disk", "/tmp", "durability: expected one of"), ("process", None, "data_dir")],
)
def test_bad_settings_say_what_to_do(level: str, data_dir: str | None, match: str) -> None:
    with pytest.raises(tq.ConfigError, match=match):
        check_durability(level, data_dir)


def test_config_toml_and_cli_carry_the_settings(tmp_path: Path) -> None:
    with pytest.raises(tq.ConfigError, match="data_dir"):
        tq.Config(durability="fsync")
    cfg = tq.Config(durability="fsync", data_dir=str(tmp_path))
    assert tq.Config.from_toml_string(cfg.to_toml()) == cfg
    assert cfg.controller_options()["durability"] == "fsync"
    argv = ["serve", "controller", "--durability", "process", "--data-dir", str(tmp_path)]
    parser = _build_parser()
    args = parser.parse_args(argv)
    got = config_from_args(args, {"durability", "data_dir"})
    assert (got.durability, got.data_dir) == ("process", str(tmp_path))
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--durability", "disk"])


@pytest.mark.parametrize("level", ["process", "fsync"])
async def test_a_whole_local_cluster_restarted_on_its_data_dir(tmp_path: Path, level: str) -> None:
    """The controller's state comes back, and its in-process units' cells with it (each unit
    keeps them under ``data_dir/units/unit-N``): every row reads back, consumption resumes."""
    async with (
        tq.local_cluster(durability=level, data_dir=str(tmp_path)) as cluster,
        tq.AsyncClient.connect(cluster.address) as c,
    ):
        meta = await c.put({"x": torch.arange(4)}, "p")
        await c.seal("p")
        got = await c.get_meta(["x"], 2, "p", "t")
    async with (
        tq.local_cluster(durability=level, data_dir=str(tmp_path)) as cluster,
        tq.AsyncClient.connect(cluster.address) as c,
    ):
        info = await c.partition_info("p")
        assert info["sealed"]
        assert info["lost"] == 0
        assert info["consumed"] == {"t": 2}
        assert (await c.get_data(meta))["x"].tolist() == [0, 1, 2, 3]
        rest = await c.get_meta(["x"], 2, "p", "t")
        assert sorted(rest.global_indexes + got.global_indexes) == sorted(meta.global_indexes)
        fresh = await c.put({"x": torch.arange(3)}, "q")  # the cluster works on
        assert (await c.get_data(fresh))["x"].tolist() == [0, 1, 2]


def test_local_clusters_docstring_says_its_units_keep_their_cells_too() -> None:
    """What the test above shows is what ``local_cluster``'s reference says (it said the
    units keep cells in memory only, so that a restart lost them)."""
    doc = inspect.getdoc(tq.local_cluster) or ""
    durability = doc[doc.index("durability:") : doc.index("data_dir:")]
    assert "data_dir/units/unit-N" in durability
    assert "gone" not in durability


def test_recorder_commits_deltas_compacts_and_recovers_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many incremental commits through the Recorder and SQLite: deltas accumulate, a
    snapshot replaces them, and a controller started on the directory is the live one."""
    monkeypatch.setattr(_journal, "SNAPSHOT_EVERY", 20)
    monkeypatch.setattr(_journal, "SNAPSHOT_SHARE", 1000.0)  # by count only
    x = ColumnHeader("x", "dense", "int64", ())
    core = ControllerCore(ControllerState({0: "tcp://u0", 1: "tcp://u1"}))
    recorder = Recorder(JournalStore(tmp_path, "process"), core, {})
    counts = []
    for i in range(60):
        placement, _ = core.put_begin("p", [x], 3, None, None, float(i))
        core.put_commit("p", placement.rows, ["x"], [{"i": i}] * 3, None, placement.put_id)
        req = GetMeta("p", ["x"], 2, "t", None, lease=100.0)
        got, _ = core.get_meta(req, float(i))
        while isinstance(got, SampleCall):
            got, _ = core.sampled(req, got, got.run(), float(i))
        assert isinstance(got, MetaReply)
        if i % 3:
            core.ack([got.lease_id], float(i))
        recorder.dirty.add("p")
        recorder.write_now(float(i))
        counts.append(recorder.store.db.execute("SELECT count(*) FROM deltas").fetchone()[0])
    assert max(counts) >= 10  # deltas accumulated ...
    assert 0 in counts[1:]  # ... and a snapshot replaced them
    live = core.state.partitions["p"]
    recorder.store.close()
    again = ControllerCore(ControllerState())
    Recorder(JournalStore(tmp_path, "process"), again, {}).recover(59.0, {})
    for unit in (0, 1):
        again.unit_up(unit)
    p = again.state.partitions["p"]
    assert_recovered_as(p, live)  # the live rows, then the ids its last record reserved
    assert {i: lease.rows for i, lease in p.leases.items()} == {
        i: lease.rows for i, lease in live.leases.items()
    }
    assert p.consumed_count == live.consumed_count


class _Sent:
    """The controller's endpoint: the request ids of the replies it sent, in order."""

    def __init__(self) -> None:
        self.rids: list[int] = []

    def send(self, peer: bytes, frames: list[bytes]) -> None:
        self.rids.append(msgspec.msgpack.decode(frames[0], type=Reply).rid)


def _reply(rid: int) -> list[bytes]:
    return [msgspec.msgpack.encode(Reply(rid, True, msgspec.Raw(msgspec.msgpack.encode(None))))]


def test_a_placement_of_reserved_rows_is_answered_before_its_commit(tmp_path: Path) -> None:
    """A PutBegin of new rows goes out at once when a written record of its partition
    reserved them; a new partition's, one beyond the reservation, a keyed put's, or one
    during a commit that reserves less wait for the commit as every reply does."""
    x = ColumnHeader("x", "dense", "int64", ())
    core = ControllerCore(ControllerState({0: "tcp://u0"}))
    recorder = Recorder(JournalStore(tmp_path, "process"), core, {})
    sent = _Sent()
    recorder.wrap(sent)  # type: ignore[arg-type]

    def begin(rid: int, n: int, keys: list[str] | None = None) -> Any:
        body = PutBegin("p", [x], n_rows=n, keys=keys)
        recorder.note(b"peer", rid, body)
        placement, _ = core.put_begin("p", [x], n, None, keys, 0.0)
        recorder.send(b"peer", _reply(rid))
        return placement

    first = begin(1, 4)  # the partition is new: its creation must be written first
    assert sent.rids == []
    recorder.write_now(0.0)
    recorder._release(recorder.held)
    recorder.held = []
    assert sent.rids == [1]
    assert recorder.durable["p"][1] == 4 + _journal.RESERVE_MIN  # a put is open
    begin(2, 8)  # reserved: out at once, though its allocation is not written yet
    assert sent.rids == [1, 2]
    begin(3, 2, keys=["a", "b"])  # keyed: its keys map to rows only once written
    assert sent.rids == [1, 2]
    begin(4, _journal.RESERVE_MIN)  # beyond the reservation
    assert sent.rids == [1, 2]
    recorder.write_now(0.0)
    recorder._release(recorder.held)
    recorder.held = []
    assert sent.rids == [1, 2, 3, 4]
    core.put_commit("p", first.rows, ["x"], None, None, first.put_id)
    for put_id in list(core.state.partitions["p"].put_leases):
        core.abort_puts([put_id])
    recorder.dirty.add("p")
    recorder.write_now(0.0)  # no put open, but the record before added rows: still ahead
    assert recorder.durable["p"][1] > core.state.partitions["p"].n_rows
    recorder.dirty.add("p")
    recorder._records(0.0)  # a commit in flight whose record reserves nothing ahead
    begin(5, 1)
    assert sent.rids == [1, 2, 3, 4]  # its rows are beyond what that record reserves
    recorder._written()
    assert recorder.durable["p"][1] == core.state.partitions["p"].n_rows - 1
    recorder.store.close()


def test_a_controller_that_crashed_after_an_early_placement_never_places_its_rows_again(
    tmp_path: Path,
) -> None:
    x = ColumnHeader("x", "dense", "int64", ())
    core = ControllerCore(ControllerState({0: "tcp://u0"}))
    recorder = Recorder(JournalStore(tmp_path, "process"), core, {})
    sent = _Sent()
    recorder.wrap(sent)  # type: ignore[arg-type]
    opened, _ = core.put_begin("p", [x], 4, None, None, 0.0)
    recorder.dirty.add("p")
    recorder.write_now(0.0)  # written with a put open: rows reserved ahead
    recorder.note(b"peer", 7, PutBegin("p", [x], n_rows=16))
    early, _ = core.put_begin("p", [x], 16, None, None, 0.0)
    recorder.send(b"peer", _reply(7))
    assert sent.rids == [7]  # answered; the controller dies before writing it
    recorder.store.close()
    again = ControllerCore(ControllerState())
    Recorder(JournalStore(tmp_path, "process"), again, {}).recover(1.0, {})
    again.unit_up(0)
    later, _ = again.put_begin("p", [x], 32, None, None, 1.0)
    # a late StorePut of the early placement cannot overwrite the cells of a later put
    assert set(later.rows).isdisjoint(early.rows)
    assert set(later.rows).isdisjoint(opened.rows)
    assert again.state.partitions["p"].n_alive == 32  # the open put was aborted
    # nor can its late PutCommit take another put's id (it would commit rows never written
    # and end that put's lease): ids go on past any the old controller handed out
    assert later.put_id > early.put_id
    with pytest.raises(tq.RowsNotFound):
        again.put_commit("p", early.rows, ["x"], None, None, early.put_id)
    again.put_commit("p", later.rows, ["x"], None, None, later.put_id)


def test_rows_auto_clear_frees_when_registered_for_every_partition_are_written(
    tmp_path: Path,
) -> None:
    """``register_tasks(None, ...)`` frees, in every partition without its own setting, the
    rows its tasks consumed already: the journal writes each of them, so a controller
    started on the directory does not bring back rows whose cells the units freed."""
    x = ColumnHeader("x", "dense", "int64", ())
    core = ControllerCore(ControllerState({0: "tcp://u0"}))
    recorder = Recorder(JournalStore(tmp_path, "process"), core, {})
    for pid in ("p", "q"):
        placement, _ = core.put_begin(pid, [x], 2, None, None, 0.0)
        core.put_commit(pid, placement.rows, ["x"], None, None, placement.put_id)
        req = GetMeta(pid, ["x"], 2, "t", None)
        got, _ = core.get_meta(req, 0.0)
        while isinstance(got, SampleCall):
            got, _ = core.sampled(req, got, got.run(), 0.0)
        recorder.dirty.add(pid)
    recorder.write_now(0.0)
    body = RegisterTasks(["t"], None)
    recorder.note(b"peer", 1, body)
    fx = core.catalog.register_tasks(body.partition_id, body.tasks)
    assert [pid for pid, _, _ in fx.free] == ["p", "q"]
    recorder.write_now(1.0)
    recorder.store.close()
    again = ControllerCore(ControllerState())
    Recorder(JournalStore(tmp_path, "process"), again, {}).recover(1.0, {})
    assert [again.state.partitions[pid].n_alive for pid in ("p", "q")] == [0, 0]
