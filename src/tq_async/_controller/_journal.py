"""A durable controller: its state in SQLite under ``data_dir``, replies held until written.

At ``durability="process"`` or ``"fsync"`` the controller keeps, in ``data_dir/controller.db``
(SQLite in WAL mode, from the standard library), a snapshot of every partition (table
``partitions``), what changed in it since (table ``deltas``, one row per partition and commit,
in order) and the controller's own record (table ``meta``); see `tq_async._core._journal`.
A request that changes a partition marks it; its reply is held until a group commit wrote
what changed in every marked partition: many concurrent requests share one transaction (and,
at ``fsync``, one fsync). A commit writes a partition's delta (the rows it changed, the
leases and batches it gave...), or, once its deltas outgrew a share of its snapshot, a new
snapshot in their place: a commit costs what it changed, and recovery reads each partition's
snapshot and a bounded tail of deltas. So a put commit,
an ack, a clear, a seal, a tag or a KV change is acknowledged only once it is in the
operating system's files (``process``: survives SIGKILL or OOM of the controller) or on the
disk (``fsync``: survives a machine crash). A retried request's cached reply waits the same
way, and so does every reply after a change no request asked for (a storage unit lost at its
deadline, a lease run out: `Recorder.unasked`). One reply goes at once: the placement of a
put of new rows in a partition whose last written record reserved their ids
(`tq_async._core._journal.row_reservation`); its rows are written with its commit, and a
controller that crashed before recovers past them. A controller started on the same
``data_dir`` recovers through `recover`.

A torn tail is SQLite's business: a transaction is in the database whole or not at all (the
WAL's frames carry checksums; an incomplete commit is discarded when the database opens). A
damaged database file is a clear error at start.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import secrets
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import anyio
import msgspec

from .._core._journal import (
    FORMAT,
    READS,
    Tracker,
    controller_record,
    decode_controller,
    decode_delta,
    decode_partition,
    encode,
    named_samplers,
    recover,
    replay,
)
from .._core._state import Partition
from .._core._transitions import ControllerCore, Effects
from .._errors import ConfigError, TQError
from .._logging import get_logger
from .._service._loop import Handler, Incoming
from .._storage._dir_marker import UNITS_DIR, lock_dir, put_marker, unwritable
from .._transport._inherited import release
from .._wire._protocol import (
    Ack,
    AcquireRollout,
    Cancel,
    GetMeta,
    PutBegin,
    PutInline,
    RegisterTasks,
    RegisterUnit,
    ReleaseRollout,
    Reply,
    RestoreCommit,
    ReturnRecycled,
    SetPolicyVersion,
    TakeRecycled,
)
from ._gets import FETCHES_REMEMBERED
from ._shell import Sends

__all__ = [
    "DURABILITY",
    "Durability",
    "JournalStore",
    "Recorder",
    "check_controller_dir",
    "check_durability",
    "check_no_journal",
]

log = get_logger(__name__)

#: one commit: the controller's record, snapshots, dropped partitions, deltas
_Records = tuple[bytes, dict[str, bytes], list[str], list[tuple[str, bytes]]]

Durability = Literal["memory", "process", "fsync"]
DURABILITY: tuple[str, ...] = ("memory", "process", "fsync")

#: the file naming what a data_dir belongs to (a controller, a storage unit)
MARKER = "tq-async-data-dir.json"
_DB = "controller.db"
#: the lock a running controller holds on its data_dir (a second controller on it is refused)
_LOCK = "tq-async-data-dir.lock"
#: requests remembered between their arrival and their reply (older ones are forgotten:
#: a request that never answers must not grow the table)
_INFLIGHT = 65536
#: requests that change the controller's own record, not a partition's
_CONTROLLER_WIDE = (
    RegisterUnit,
    SetPolicyVersion,
    AcquireRollout,
    ReleaseRollout,
    TakeRecycled,
    ReturnRecycled,
)

_reply_decoder = msgspec.msgpack.Decoder(Reply)


def check_durability(durability: str, data_dir: str | os.PathLike[str] | None) -> None:
    """Raise `ConfigError` for a bad level, or a durable level without a data_dir."""
    if durability not in DURABILITY:
        raise ConfigError(
            f"durability: expected one of {', '.join(DURABILITY)}, got {durability!r}"
        )
    if durability != "memory" and data_dir is None:
        raise ConfigError(
            f"data_dir: durability {durability!r} keeps the controller's state in a "
            "directory; give data_dir (e.g. --data-dir /var/lib/tq-async/controller)"
        )


def check_no_journal(data_dir: str | os.PathLike[str]) -> None:
    """Raise `ConfigError` if ``data_dir``, given to a controller at ``memory``, holds a
    journal: it would start empty, and a later durable start would recover the journal as it
    was before this run."""
    try:
        with open(os.path.join(data_dir, MARKER)) as f:
            kind = json.load(f)
    except (OSError, ValueError):
        return  # no marker: no journal
    if isinstance(kind, dict) and kind.get("kind") == "controller":
        raise ConfigError(
            f"data_dir: {os.fspath(data_dir)!r} holds a controller's journal, but durability is "
            "'memory' (the default), which keeps nothing: start with the durability it was "
            "written at (--durability process or fsync) to recover its state, or move the "
            "directory away to start empty"
        )


class JournalStore:
    """The controller's records in SQLite (WAL) under ``data_dir``.

    Args:
        data_dir: an existing directory, empty or a controller's (see `MARKER`).
        durability: ``"process"`` (commit without fsync) or ``"fsync"``.

    Raises:
        ConfigError: a missing directory, one it cannot write in, one of a storage unit or
            holding other files, or a journal of another format.
        TQError: the database is damaged, or cannot be read (a full disk, an I/O error).
    """

    def __init__(self, data_dir: str | os.PathLike[str], durability: Durability) -> None:
        self.data_dir = os.fspath(data_dir)
        #: commits wait for the disk (fsync): they run in a worker thread, not on the loop
        self.slow = durability == "fsync"
        _claim(self.data_dir)
        self._lock_fd = lock_dir(self.data_dir, _LOCK, "controller")
        self.path = os.path.join(self.data_dir, _DB)
        _check_wal_tail(self.path)
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={'FULL' if durability == 'fsync' else 'OFF'}")
            db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB)")
            db.execute("CREATE TABLE IF NOT EXISTS partitions (pid TEXT PRIMARY KEY, rec BLOB)")
            db.execute(
                "CREATE TABLE IF NOT EXISTS deltas (pid TEXT, seq INTEGER, rec BLOB, "
                "PRIMARY KEY (pid, seq)) WITHOUT ROWID"
            )
            db.execute("PRAGMA quick_check").fetchall()
        except sqlite3.OperationalError as exc:  # the disk's (full, an I/O error), not the file's
            self._unlock()
            raise TQError(
                f"the controller could not open its journal {self.path} ({exc}); free space on "
                "the data_dir's disk and check that disk (and its files' permissions), then "
                "start the controller again (nothing in the journal is lost)"
            ) from exc
        except sqlite3.DatabaseError as exc:
            self._unlock()
            raise TQError(
                f"the controller's journal {self.path} is damaged ({exc}); move the data_dir "
                "away to start an empty controller, or restore it from a backup"
            ) from exc
        self.db = db
        _mark_format(self.data_dir)
        #: the next delta's sequence number (deltas replay in this order)
        self.seq = 1 + (db.execute("SELECT max(seq) FROM deltas").fetchone()[0] or 0)

    def load(self) -> tuple[bytes | None, dict[str, bytes], dict[str, list[bytes]]]:
        """The controller's record (None: a new journal), every partition's snapshot, and
        each partition's deltas since, in order."""
        row = self.db.execute("SELECT value FROM meta WHERE key = 'controller'").fetchone()
        snaps: dict[str, bytes] = dict(self.db.execute("SELECT pid, rec FROM partitions"))
        deltas: dict[str, list[bytes]] = {}
        for pid, rec in self.db.execute("SELECT pid, rec FROM deltas ORDER BY pid, seq"):
            deltas.setdefault(pid, []).append(rec)
        return (row[0] if row else None), snaps, deltas

    def write(
        self,
        ctl: bytes,
        snapshots: Mapping[str, bytes],
        deletes: Sequence[str],
        deltas: Sequence[tuple[str, bytes]] = (),
    ) -> None:
        """One transaction: the controller's record, new snapshots (each replaces the
        partition's snapshot and deltas), dropped partitions, and deltas (in order)."""
        db = self.db
        seq = self.seq
        db.execute("BEGIN")
        try:
            db.execute("INSERT OR REPLACE INTO meta VALUES ('controller', ?)", (ctl,))
            gone = [(pid,) for pid in itertools.chain(snapshots, deletes)]
            db.executemany("DELETE FROM deltas WHERE pid = ?", gone)
            db.executemany("INSERT OR REPLACE INTO partitions VALUES (?, ?)", snapshots.items())
            db.executemany("DELETE FROM partitions WHERE pid = ?", [(d,) for d in deletes])
            db.executemany(
                "INSERT INTO deltas VALUES (?, ?, ?)",
                [(pid, seq + i, rec) for i, (pid, rec) in enumerate(deltas)],
            )
        except BaseException:
            if db.in_transaction:  # (SQLite rolls back itself on a full disk, an I/O error)
                db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        self.seq = seq + len(deltas)

    def lineage(self) -> bytes:
        """A random id made once per journal: every controller that recovers this state
        gives it to its clients (``HelloReply.state``), so they know the state is kept."""
        row = self.db.execute("SELECT value FROM meta WHERE key = 'lineage'").fetchone()
        if row is not None:
            return bytes(row[0])
        made = secrets.token_bytes(16)
        self.db.execute("INSERT INTO meta VALUES ('lineage', ?)", (made,))
        return made

    def close(self) -> None:
        self.db.close()
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd >= 0:
            release(self._lock_fd)
            self._lock_fd = -1


def _check_wal_tail(path: str) -> None:
    """Log a WAL that ends in a partial frame (a write torn by a crash).

    SQLite drops it when the database opens (a frame's checksum, a commit's marker): only a
    commit whose replies were never sent can be in it.
    """
    try:
        with open(path, "rb") as db:
            header = db.read(18)
        wal_size = os.path.getsize(path + "-wal")
    except OSError:
        return  # a new journal, or no WAL left by the last run
    if len(header) < 18 or wal_size == 0:
        return
    page = int.from_bytes(header[16:18], "big")
    page = 65536 if page == 1 else page
    if (wal_size - 32) % (24 + page):
        log.warning(
            "the journal's last write was torn by a crash: SQLite discards it (it held no "
            "acknowledged change)",
            wal=path + "-wal",
            bytes=wal_size,
        )


def _claim(data_dir: str) -> None:
    """Check ``data_dir`` is an existing, empty or controller's directory; mark it ours."""
    if not check_controller_dir(data_dir):
        try:
            _write_marker(data_dir)
        except OSError as exc:
            raise unwritable(data_dir, "controller", exc) from exc


def check_controller_dir(data_dir: str | os.PathLike[str]) -> bool:
    """Whether ``data_dir`` holds a controller's journal (True) or is empty (False).

    A cluster started as a whole checks this before it makes its units' directories in it.

    Raises:
        ConfigError: a missing directory (or a file), one of a storage unit or holding other
            files, or a journal of another format.
    """
    data_dir = os.fspath(data_dir)
    if not os.path.isdir(data_dir):
        raise ConfigError(
            f"data_dir: {data_dir!r} is not a directory; create it (mkdir -p {data_dir}) for a "
            "new controller, or pass the directory an earlier controller used"
        )
    marker = os.path.join(data_dir, MARKER)
    if os.path.exists(marker):
        with open(marker) as f:
            try:
                kind = json.load(f)
            except ValueError:
                kind = {}
        if not isinstance(kind, dict):  # (JSON, but no marker's)
            kind = {}
        if kind.get("kind") != "controller":
            raise ConfigError(
                f"data_dir: {data_dir!r} belongs to a {kind.get('kind', 'unknown')!s} (see "
                f"{MARKER}); give the controller its own directory"
            )
        if kind.get("format") not in READS:
            raise ConfigError(
                f"data_dir: {data_dir!r} holds a journal of format {kind.get('format')}, this "
                f"version reads formats {', '.join(map(str, READS))}; move it away to start an "
                "empty controller"
            )
        return True
    # (a marker written aside when its controller was killed: nothing else was written yet)
    if [name for name in os.listdir(data_dir) if name not in (UNITS_DIR, MARKER + ".tmp")]:
        raise ConfigError(
            f"data_dir: {data_dir!r} is not empty and is no controller's; give the controller "
            "an empty (or its own) directory"
        )
    return False


def _mark_format(data_dir: str) -> None:
    """The journal is of `FORMAT` from now on (an older version must not read its deltas)."""
    with open(os.path.join(data_dir, MARKER)) as f:
        if json.load(f).get("format") == FORMAT:
            return
    _write_marker(data_dir)


def _write_marker(data_dir: str) -> None:
    """Mark ``data_dir`` a controller's of `FORMAT` (a crash leaves the old marker or the new
    one, never a torn one: `put_marker`)."""
    put_marker(data_dir, {"kind": "controller", "format": FORMAT})


class _HeldSends:
    """The controller's endpoint, as the shell sees it: replies wait for the journal."""

    def __init__(self, recorder: Recorder, endpoint: Sends) -> None:
        self.recorder = recorder
        self.endpoint = endpoint

    def send(self, peer: bytes, frames: Sequence[Any]) -> None:
        self.recorder.send(peer, frames)


class SamplerStates:
    """The samplers' states for each controller record. A sampler whose ``state_dict()``
    raises, or holds what msgpack cannot carry (a custom sampler's), keeps the last state of
    it that could be written, with an error (once until it can be written again): one
    sampler's state must not stop the journal, which every reply of the controller waits
    on."""

    def __init__(self) -> None:
        #: each sampler's last state that could be written, encoded (a copy: a sampler may
        #: change the objects its ``state_dict()`` returned)
        self.last: dict[str, bytes] = {}
        self.failing: set[str] = set()

    def __call__(self, core: ControllerCore) -> dict[str, Any]:
        states: dict[str, Any] = {}
        for name, smp in named_samplers(core):
            try:
                self.last[name] = msgspec.msgpack.encode(smp.state_dict())
            except Exception as exc:
                if name not in self.failing:
                    self.failing.add(name)
                    log.error(
                        f"sampler {type(smp).__name__}: its state cannot be written to the "
                        f"controller's journal ({exc}); the journal keeps its last state that "
                        "could (a restart resumes the sampler from there): make its "
                        "state_dict() / save_checkpoint() return plain values",
                        sampler=name,
                    )
            else:
                self.failing.discard(name)
            # (encoded once: the record embeds these bytes as they are; b"\x80": {})
            states[name] = msgspec.Raw(self.last.get(name, b"\x80"))
        return states


class Recorder:
    """Marks what requests change, writes it in group commits, holds replies until then.

    Args:
        store: where the records go.
        core: the controller's core.
        instances: the remote storage units' instance tokens (the links keep them up to date;
            recovery fills them in).
    """

    def __init__(self, store: JournalStore, core: ControllerCore, instances: dict[int, str]):
        self.store = store
        self.core = core
        self.instances = instances
        self.endpoint: Sends | None = None
        #: partitions changed since the last commit
        self.dirty: set[str] = set()
        self.controller_dirty = False
        #: the partitions a request noted on arrival, until its reply (a waiting get_meta
        #: changes its partition when it is answered)
        self.inflight: OrderedDict[tuple[bytes, int], tuple[str, ...]] = OrderedDict()
        #: replies waiting for the commit that covers them
        self.held: list[tuple[bytes, Sequence[Any]]] = []
        self.writing = False
        self.commits = 0
        #: what the journal holds of each partition: a commit writes what changed since
        self.tracker = Tracker()
        #: per partition, the incarnation and row reservation its last written record holds,
        #: and those of the record the commit in flight writes
        self.durable: dict[str, tuple[str, int]] = {}
        self.pending: dict[str, tuple[str, int]] = {}
        #: PutBegins of new rows (answered at once if their rows are reserved), by request
        self.early: OrderedDict[tuple[bytes, int], str] = OrderedDict()
        #: the auto-clear settings this controller starts with (its configuration's)
        self.auto_clear_start = dict(core.state.auto_clear)
        #: the partition of each recent fetch, by request: a `Cancel` that comes after its
        #: answer gives the rows back (`tq_async._controller._gets`), a change to write
        self.fetches: OrderedDict[tuple[bytes, int], str] = OrderedDict()
        #: recent acquire_rollouts, by request: a `Cancel` after an admission gives its
        #: slots back, a change to write
        self.acquires: OrderedDict[tuple[bytes, int], bool] = OrderedDict()
        #: the partitions of each recent take_recycled that took rows, put and one-message
        #: put, by request: a `Cancel` after its answer undoes it, a change to write
        self.takes: OrderedDict[tuple[bytes, int], tuple[str, ...]] = OrderedDict()
        self.sampler_states = SamplerStates()
        self._wake = asyncio.Event()

    # ---- recovery ----------------------------------------------------------------------------

    def recover(self, now: float, local_units: Mapping[int, str]) -> Effects:
        """Load the records into the (new, empty) core; nothing to do for a new journal."""
        started = time.perf_counter()
        ctl_blob, snaps, deltas = self.store.load()
        if ctl_blob is None:
            return Effects()
        ctl = decode_controller(ctl_blob)
        orphans = sorted(set(deltas) - set(snaps))
        if orphans:
            raise TQError(
                f"the controller's journal {self.store.path} is damaged (changes of partitions "
                f"{orphans[:5]} without their snapshot); move the data_dir away to start an "
                "empty controller, or restore it from a backup"
            )
        parts = []
        sizes: dict[str, tuple[int, int, int]] = {}
        for pid, blob in snaps.items():
            tail = deltas.get(pid, [])
            try:
                parts.append(replay(decode_partition(blob), map(decode_delta, tail)))
            except ValueError as exc:
                raise TQError(
                    f"the controller's journal {self.store.path} is damaged (partition {pid!r}: "
                    f"{exc}); move the data_dir away to start an empty controller, or restore "
                    "it from a backup"
                ) from exc
            sizes[pid] = (len(blob), sum(map(len, tail)), len(tail))
        self.instances.update(ctl.instances)
        self.sampler_states.last = {
            n: msgspec.msgpack.encode(s) for n, s in ctl.sampler_state.items()
        }
        tracker = self.tracker

        def follow(p: Partition) -> None:
            tracker.follow(p, *sizes[p.partition_id])

        fx = recover(self.core, ctl, parts, now, time.time(), local_units, follow)
        log.info(
            "controller recovered from its journal",
            data_dir=self.store.data_dir,
            partitions=len(parts),
            deltas=sum(map(len, deltas.values())),
            rows=sum(p.n_alive for p in self.core.state.partitions.values()),
            written_seconds_ago=round(max(0.0, time.time() - ctl.wall), 3),
            seconds=round(time.perf_counter() - started, 3),
        )
        # what recovery itself changed (leases run out, puts aborted, rows lost) is written
        # with the first commit
        self.dirty.update(sizes)
        self.controller_dirty = True
        return fx

    # ---- marking -----------------------------------------------------------------------------

    def noting(self, handler: Handler) -> Handler:
        """``handler``, marking what its request changes before it runs."""

        def noted(msg: Incoming, body: Any) -> Any:
            self.note(msg.peer, msg.rid, body)
            out = handler(msg, body)
            if type(body) is TakeRecycled and out:
                # the partitions it took rows of hold them for its caller now (known only
                # once it ran): written before the reply goes (and again if a Cancel gives
                # them back)
                pids = tuple(r.partition_id for r in out)
                self.dirty.update(pids)
                self.inflight[(msg.peer, msg.rid)] = pids
                self._undoable(msg.peer, msg.rid, pids)
            return out

        return noted

    def note(self, peer: bytes, rid: int, body: Any) -> None:
        if type(body) is Cancel:
            self._cancel(peer, body.target)
            return
        pids = tuple(_partitions_of(self.core, body))
        self.dirty.update(pids)
        if type(body) is GetMeta and body.mode == "fetch":
            fetches = self.fetches
            fetches[(peer, rid)] = body.partition_id
            if len(fetches) > FETCHES_REMEMBERED:
                fetches.popitem(last=False)
        elif type(body) is AcquireRollout:
            acquires = self.acquires
            acquires[(peer, rid)] = True
            if len(acquires) > FETCHES_REMEMBERED:
                acquires.popitem(last=False)
        if type(body) is PutBegin and body.n_rows and body.rows is None and body.keys is None:
            self.early[(peer, rid)] = body.partition_id
            if len(self.early) > _INFLIGHT:
                self.early.popitem(last=False)
        if isinstance(body, _CONTROLLER_WIDE) or (
            isinstance(body, RegisterTasks) and body.partition_id is None
        ):
            self.controller_dirty = True
        if pids:
            inflight = self.inflight
            inflight[(peer, rid)] = pids
            if len(inflight) > _INFLIGHT:
                inflight.popitem(last=False)
            if type(body) is PutBegin or type(body) is PutInline:  # (a Cancel undoes them)
                self._undoable(peer, rid, pids)

    def _undoable(self, peer: bytes, rid: int, pids: tuple[str, ...]) -> None:
        """A request a late Cancel may undo, changing ``pids`` (see `takes`)."""
        takes = self.takes
        takes[(peer, rid)] = pids
        if len(takes) > FETCHES_REMEMBERED:
            takes.popitem(last=False)

    def _cancel(self, peer: bytes, rid: int) -> None:
        """A Cancel of fetch ``rid``: once answered, it gives the rows back to the task (of an
        admitted rollout: its slots; of a take_recycled: its rows; of a put: its new rows). It
        has no reply to hold,
        so the commit that writes that is started here."""
        pid = self.fetches.pop((peer, rid), None)
        if pid is not None:
            self.dirty.add(pid)
            self._wake.set()
        if self.acquires.pop((peer, rid), False):  # an admission it may give back
            self.controller_dirty = True
            self._wake.set()
        taken = self.takes.pop((peer, rid), ())  # recycled rows, a placed or stored put
        if taken:
            self.dirty.update(taken)
            self.controller_dirty = True
            self._wake.set()

    def unasked(self, fx: Effects) -> None:
        """A transition no request asked for (a deadline, a storage unit's link) changed the
        partitions ``fx`` wakes (rows lost with a unit, leases run out): write them now, and
        hold every reply until then (slots a gone holder gave back: the controller's record)."""
        pids = {w.partition_id for w in fx.wakeups}
        if pids:
            self.dirty.update(pids)
            self._wake.set()
        if fx.admission:
            self.controller_dirty = True
            self._wake.set()

    def wrap(self, endpoint: Sends) -> _HeldSends:
        """The endpoint the shell sends through while this recorder runs."""
        self.endpoint = endpoint
        return _HeldSends(self, endpoint)

    def send(self, peer: bytes, frames: Sequence[Any]) -> None:
        """Send a reply once everything it may show is written (a placement of reserved rows:
        at once)."""
        early = None
        if self.inflight or self.early:
            rid = _reply_decoder.decode(frames[0]).rid
            self.dirty.update(self.inflight.pop((peer, rid), ()))
            early = self.early.pop((peer, rid), None)
        if (early is not None and self._reserved(early)) or not (
            self.dirty or self.controller_dirty or self.writing or self.held
        ):
            if self.endpoint is not None:
                self.endpoint.send(peer, frames)
            return
        self.held.append((peer, frames))
        self._wake.set()

    def _reserved(self, partition_id: str) -> bool:
        """Whether every row of the partition is reserved by its last written record, and by
        the one being written (which may reserve less)."""
        p = self.core.state.partitions.get(partition_id)
        if p is None:
            return False
        limit = p.n_rows
        for records in (self.durable, self.pending):
            inc, reserved = records.get(partition_id, (p.incarnation, limit))
            if inc != p.incarnation:
                return False
            limit = min(limit, reserved)
        return partition_id in self.durable and p.n_rows <= limit

    # ---- writing -----------------------------------------------------------------------------

    async def run(self, now: Callable[[], float]) -> None:
        """Commit whenever something is marked or held (until cancelled)."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self.dirty or self.controller_dirty:
                    await self.commit(now())
                elif self.held:
                    self._release(self.held)
                    self.held = []
        finally:
            try:
                if self.dirty or self.controller_dirty:
                    self.write_now(now())  # a clean shutdown leaves nothing unwritten
            except (OSError, sqlite3.Error) as exc:  # (its held replies were never sent)
                log.error(
                    "the controller's last journal write at shutdown failed: what it held was "
                    "never acknowledged; free space on the data_dir's disk",
                    data_dir=self.store.data_dir,
                    error=str(exc),
                )
            finally:
                self.store.close()

    def _records(self, now: float) -> _Records:
        wall = time.time()
        partitions = self.core.state.partitions
        tracker = self.tracker
        snapshots: dict[str, bytes] = {}
        deltas: list[tuple[str, bytes]] = []
        deletes: list[str] = []
        pending = self.pending = {}
        for pid in self.dirty:
            p = partitions.get(pid)
            if p is None:
                deletes.append(pid)
                tracker.forget(pid)
                pending[pid] = ("", 0)
                continue
            whole, blob = tracker.record(p, now, wall)
            pending[pid] = (p.incarnation, tracker.reserved)
            if whole:
                snapshots[pid] = blob
            else:
                deltas.append((pid, blob))
        samplers = self.sampler_states(self.core)
        ctl = encode(
            controller_record(self.core, self.instances, wall, self.auto_clear_start, samplers)
        )
        self.dirty = set()
        self.controller_dirty = False
        return ctl, snapshots, deletes, deltas

    async def commit(self, now: float) -> None:
        """Write what changed in every marked partition in one transaction, then send the
        replies it covers."""
        records = self._records(now)
        sends, self.held = self.held, []
        self.writing = True
        try:
            if self.store.slow:
                await anyio.to_thread.run_sync(self.store.write, *records)
            else:  # a commit without fsync only copies to the OS: cheaper than a thread hop
                self.store.write(*records)
        except (OSError, sqlite3.Error) as exc:
            # nothing written: mark it again (each partition's next record is a snapshot),
            # keep the replies for the next commit (a client that retries meanwhile gets
            # its reply from the cache, held the same way)
            _, snapshots, deletes, deltas = records
            for pid in itertools.chain(snapshots, (pid for pid, _ in deltas)):
                self.tracker.forget(pid)
                self.dirty.add(pid)
            self.dirty.update(deletes)
            self.controller_dirty = True
            self.held[:0] = sends
            self.pending = {}
            log.error(
                "writing the controller's journal failed: replies wait until a later write "
                "succeeds; free space on the data_dir's disk",
                data_dir=self.store.data_dir,
                error=str(exc),
            )
            return
        finally:
            self.writing = False
        self._written()
        self.commits += 1
        self._release(sends)
        if self.held:
            self._wake.set()

    def write_now(self, now: float) -> None:
        """Write synchronously (at shutdown, and in tests)."""
        self.store.write(*self._records(now))
        self._written()

    def _written(self) -> None:
        """The records of the last commit are written: their reservations hold."""
        for pid, (inc, reserved) in self.pending.items():
            if inc:
                self.durable[pid] = (inc, reserved)
            else:
                self.durable.pop(pid, None)
        self.pending = {}

    def _release(self, sends: Iterable[tuple[bytes, Sequence[Any]]]) -> None:
        if self.endpoint is not None:
            for peer, frames in sends:
                self.endpoint.send(peer, frames)


def _partitions_of(core: ControllerCore, body: Any) -> Iterable[str]:
    """The partitions a request may change (read before it runs: an ack forgets its lease)."""
    if isinstance(body, Ack):
        return _lease_partitions(core, body.lease_ids)
    if isinstance(body, GetMeta):
        if body.ack:
            return {body.partition_id, *_lease_partitions(core, body.ack)}
        return (body.partition_id,)
    if isinstance(body, RestoreCommit):
        return body.partition_ids
    if isinstance(body, RegisterTasks) and body.partition_id is None:
        return list(core.state.partitions)  # (it frees rows every task consumed already)
    pid = getattr(body, "partition_id", None)
    return (pid,) if isinstance(pid, str) else ()


def _lease_partitions(core: ControllerCore, lease_ids: Iterable[int]) -> set[str]:
    leases = core.leases
    out = set()
    for lease_id in lease_ids:
        p = leases.home.get(lease_id) or leases.batch_home.get(lease_id)
        if p is not None:
            out.add(p.partition_id)
    return out
