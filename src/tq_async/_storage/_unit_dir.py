"""A storage unit's directory: where the segment files of its cells live, one unit at a time.

At durability ``process`` / ``fsync`` a unit keeps its cells in segment files under its own
``data_dir`` (`tq_async._storage._segments`): the directory is claimed (an empty one, or this
unit's: its cells are taken back), locked while the unit runs (a second process on it is
refused), and records the unit's id once the controller gave one. At ``memory`` with a
``memory_cap``, cells past the cap spill into a scratch directory, removed on close; it is
locked while its unit runs, so that the next unit started beside it removes one a killed unit
(SIGKILL, OOM) left behind.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time

from .._errors import ConfigError
from .._logging import get_logger
from .._transport._inherited import close_in_children, release, remove_unheld
from ._cells import StorageState
from ._dir_marker import claim_unit_dir, lock_dir, unwritable, write_marker
from ._segments import ARENA_FILE, SegmentStore

__all__ = ["UnitDir", "locked_dir", "sweep"]

log = get_logger(__name__)

#: the lock a running unit holds on its data_dir (a second process on it is refused)
_LOCK = "tq-async-data-dir.lock"
#: scratch directories for spilled cells (at ``memory``) are named so, under ``data_dir``
_SCRATCH = "tq-unit-spill-"
#: the lock a running unit holds in its scratch directory (one taken by nobody: a dead unit's)
_SCRATCH_LOCK = "tq-unit-spill.lock"


class UnitDir:
    """The files of one unit's cells (none at ``memory`` without ``memory_cap``).

    Args:
        durability: ``"memory"``, ``"process"`` or ``"fsync"`` (see `StorageServer`).
        data_dir: the unit's own directory (durable levels: an existing one, empty or this
            unit's; ``memory``: where the scratch directory goes).
        memory_cap: most bytes of cells kept in memory (None: no bound, nothing spills).
        unit_id: the id the unit is started with (< 0: the directory's own id, if it has one).

    Attributes:
        store: the cells' segment files (None: cells in memory only).
        instance: the token of a durable directory's cells (None: the cells are new each
            start).
        unit_id: the unit's id (``unit_id``, or the directory's own when started with < 0).

    Raises:
        ConfigError: an unknown level, a durable level without ``data_dir``, or a
            ``data_dir`` that is missing, another unit's or the controller's, or in use by a
            running unit.
    """

    def __init__(
        self, durability: str, data_dir: str | None, memory_cap: int | None, unit_id: int
    ) -> None:
        if durability not in ("memory", "process", "fsync"):
            raise ConfigError(f"durability: expected memory, process or fsync, got {durability!r}")
        # absolute now: the process may change its working directory while the unit runs
        data_dir = None if data_dir is None else os.path.abspath(data_dir)
        self.path = data_dir
        self.memory_cap = memory_cap
        self.unit_id = unit_id
        self.store: SegmentStore | None = None
        self.instance: str | None = None
        self._lock_fd = -1
        self._scratch: str | None = None
        #: the scratch directory's lock (held while the unit runs)
        self._scratch_fd = -1
        if durability == "memory":
            if memory_cap is not None:
                # spilled cells are scratch: nothing is recovered at this level
                self._scratch, self._scratch_fd = _scratch_dir(data_dir)
                self.store = SegmentStore(self._scratch, durable=False)
                self.store.load()
            return
        if data_dir is None:
            raise ConfigError(
                f"data_dir: a storage unit at durability {durability!r} keeps its cells in a "
                "directory of its own; give it one (--data-dir /var/lib/tq-async/unit-0)"
            )
        held, self.instance = claim_unit_dir(data_dir, None if unit_id < 0 else unit_id)
        if unit_id < 0 and held is not None:
            self.unit_id = held  # the directory's unit comes back under its id
        self._lock_fd = lock_dir(data_dir, _LOCK, "storage unit")
        self.store = SegmentStore(data_dir, durable=True, sync=durability == "fsync")

    @property
    def durable(self) -> bool:
        """Whether the cells outlive the process (``process`` and ``fsync`` levels)."""
        return self.store is not None and self.store.durable

    @property
    def arena_file(self) -> str | None:
        """The file a durable unit's shared-memory arena is: what a same-host client puts
        through it is in the OS's files before the put arrives (None: an anonymous memfd;
        with ``memory_cap`` too: the cells are written to segments and may leave memory)."""
        if self.path is None or not self.durable or self.memory_cap is not None:
            return None
        return os.path.join(self.path, ARENA_FILE)

    def take_back(self, state: StorageState) -> None:
        """A durable unit takes back the cells of its directory into ``state``."""
        store = self.store
        if store is None or not store.durable:
            return
        t0 = time.perf_counter()
        chunks = state.recover()
        log.info(
            "storage unit took back its cells",
            unit_id=self.unit_id,
            data_dir=self.path,
            chunks=chunks,
            bytes=store.live_bytes,
            seconds=round(time.perf_counter() - t0, 3),
        )

    def registered(self, unit_id: int, instance: str) -> None:
        """The controller gave the unit ``unit_id``: a durable directory records it.

        Raises:
            ConfigError: it cannot be recorded (a full disk).
        """
        self.unit_id = unit_id
        if self._lock_fd >= 0 and self.path is not None:
            try:
                write_marker(self.path, unit_id, instance)
            except OSError as exc:
                raise unwritable(self.path, "storage unit", exc) from exc

    def close(self) -> None:
        """Close the segment files, remove the scratch directory, give the lock back (the
        last group commit is made before: see `tq_async._storage._commits`)."""
        if self.store is None:
            return
        self.store.close()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            release(self._scratch_fd)  # removed first: no sweep finds it unlocked
            self._scratch, self._scratch_fd = None, -1
        if self._lock_fd >= 0:
            release(self._lock_fd)
            self._lock_fd = -1


def _scratch_dir(data_dir: str | None) -> tuple[str, int]:
    """A new scratch directory for spilled cells under ``data_dir`` (None: the system's
    temporary directory), locked while the unit runs: its path and the lock's file descriptor
    (closing it unlocks). Those there that no running unit holds go first (`sweep`).

    Raises:
        ConfigError: ``data_dir`` is missing, or no directory can be made in it.
    """
    parent = tempfile.gettempdir() if data_dir is None else data_dir
    try:
        return locked_dir(parent, _SCRATCH, _SCRATCH_LOCK, "the spilled cells a storage unit")
    except OSError as exc:
        if not os.path.isdir(parent):
            raise ConfigError(
                f"data_dir: {parent!r} is not a directory; create it (mkdir -p {parent}) for the "
                "cells a storage unit spills past memory_cap, or pass another one"
            ) from exc
        raise ConfigError(
            f"data_dir: cannot make a directory for spilled cells under {parent!r} "
            f"({exc.strerror}); give memory_cap a writable data_dir"
        ) from exc


def locked_dir(parent: str, prefix: str, lock_name: str, what: str) -> tuple[str, int]:
    """A new directory ``parent/prefix...`` whose file ``lock_name`` is locked while this
    process uses it: its path and the lock's file descriptor (closing it unlocks; remove the
    directory first). Those there that nobody holds go first: `sweep` (``what``: whose they
    are, for its log line).

    Raises:
        OSError: no directory could be made in ``parent``.
    """
    sweep(parent, prefix, lock_name, what)
    # made under a name sweeps skip, locked, then renamed: a sweep never sees it unlocked
    staging = tempfile.mkdtemp(prefix="." + prefix, dir=parent)
    path = os.path.join(parent, os.path.basename(staging)[1:])
    try:
        fd = os.open(os.path.join(staging, lock_name), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(staging, path)
        except OSError:
            os.close(fd)
            raise
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path, close_in_children(fd)  # a forked child's copy would keep it locked


def sweep(parent: str, prefix: str, lock_name: str, what: str) -> None:
    """Remove the directories ``parent/prefix...`` of `locked_dir` whose process is gone
    without removing its own (SIGKILL, OOM: nobody holds their lock). One without a lock
    (made by an older version, or not by `locked_dir`) or not ours to open is left alone."""
    for name in os.listdir(parent):
        if not name.startswith(prefix):
            continue
        path = os.path.join(parent, name)
        if remove_unheld(path, os.path.join(path, lock_name)):
            log.info(f"removed {what} left when it was killed", path=path)
