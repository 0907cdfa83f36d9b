"""Whose a data_dir is: the marker file a storage unit writes in its directory, and the lock
its process holds on it (`lock_dir`, a controller's journal's too).

``tq-async-data-dir.json`` says which unit the directory belongs to, the format of its files,
and the unit's instance token (a durable unit's cells outlive its process: the controller
knows the unit by that token when it comes back). A controller's journal uses the same file
name for its own marker (`tq_async._controller._journal`).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
from typing import Any

from .._errors import ConfigError
from .._paths._dirs import sync_dir
from .._transport._inherited import close_in_children

__all__ = [
    "DISK_INSTANCE",
    "UNITS_DIR",
    "lock_dir",
    "unit_data_dir",
    "FORMAT",
    "MARKER",
    "claim_unit_dir",
    "put_marker",
    "unwritable",
    "write_marker",
]

#: the file naming what a data_dir belongs to (the controller's journal uses the same name)
MARKER = "tq-async-data-dir.json"
#: the format of a unit's directory (a unit refuses another)
FORMAT = 1
#: a durable unit's instance token starts with this: its cells outlive its process
DISK_INSTANCE = "disk-"
#: where a cluster started as a whole (``local_cluster``, ``tq-async serve``,
#: ``tq_async.ray.launch``) keeps its storage units' directories, inside the controller's
#: (``units/unit-N``)
UNITS_DIR = "units"


def claim_unit_dir(directory: str, unit_id: int | None) -> tuple[int | None, str]:
    """Check ``directory`` is a new or this unit's; mark it; its unit id and instance token.

    Args:
        directory: an existing directory: empty (a new unit), or one a unit used before.
        unit_id: the id the unit is started with (None: the controller assigns one, or the
            directory's own id is used).

    Returns:
        The unit id the directory belongs to (None: not known yet) and its instance token.

    Raises:
        ConfigError: the directory is missing, another unit's or the controller's, not empty
            and nobody's, of another format, or new and not writable.
    """
    if not os.path.isdir(directory):
        raise ConfigError(
            f"data_dir: {directory!r} is not a directory; create it (mkdir -p {directory}) for "
            "a new storage unit, or pass the directory this unit used before"
        )
    marker = os.path.join(directory, MARKER)
    if not os.path.exists(marker):
        # (a marker written aside when its unit was killed: nothing else was written yet)
        if [name for name in os.listdir(directory) if name != MARKER + ".tmp"]:
            raise ConfigError(
                f"data_dir: {directory!r} is not empty and is no storage unit's; give the unit "
                "an empty (or its own) directory"
            )
        instance = DISK_INSTANCE + secrets.token_hex(8)
        try:
            write_marker(directory, unit_id, instance)
        except OSError as exc:
            raise unwritable(directory, "storage unit", exc) from exc
        return unit_id, instance
    try:
        with open(marker) as f:
            mark = json.load(f)
    except (OSError, ValueError):
        mark = {}
    if not isinstance(mark, dict) or mark.get("kind") != "storage":
        kind = mark.get("kind", "unknown") if isinstance(mark, dict) else "unknown"
        raise ConfigError(
            f"data_dir: {directory!r} belongs to a {kind!s} (see {MARKER}); give each storage "
            "unit its own directory"
        )
    if mark.get("format") != FORMAT:
        raise ConfigError(
            f"data_dir: {directory!r} holds cells of format {mark.get('format')}, this version "
            f"reads format {FORMAT}; move it away to start an empty unit"
        )
    held = mark.get("unit_id")
    if unit_id is not None and held is not None and held != unit_id:
        raise ConfigError(
            f"data_dir: {directory!r} belongs to storage unit {held}, not {unit_id}; start "
            f"unit {held} on it (--unit-id {held}, or no --unit-id), or give unit {unit_id} "
            "its own directory"
        )
    return (unit_id if unit_id is not None else held), str(mark["instance"])


def unwritable(directory: str, user: str, exc: OSError) -> ConfigError:
    """The error of a data_dir that ``user`` (a storage unit, a controller) cannot write in at
    start (a read-only mount, a full disk, another owner's)."""
    return ConfigError(
        f"data_dir: cannot write in {directory!r} ({exc.strerror or exc}); a durable {user} "
        "keeps its state there: make it writable (mounted read-write, owned by this user) with "
        "free space on its disk, or give another directory"
    )


def write_marker(directory: str, unit_id: int | None, instance: str) -> None:
    """Write the unit's marker (see `put_marker`), unless it says so already: a unit
    restarted on a full disk has nothing to write, and comes back."""
    mark = {"kind": "storage", "format": FORMAT, "unit_id": unit_id, "instance": instance}
    try:
        with open(os.path.join(directory, MARKER)) as f:
            if json.load(f) == mark:
                return
    except (OSError, ValueError):
        pass
    put_marker(directory, mark)


def put_marker(directory: str, mark: dict[str, Any]) -> None:
    """Write ``mark`` as ``directory``'s marker: aside, synced, then renamed, the directory
    synced (a crash, of the process or the machine, leaves the old one or the new one)."""
    marker = os.path.join(directory, MARKER)
    tmp = marker + ".tmp"
    with open(tmp, "w") as f:
        json.dump(mark, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, marker)
    sync_dir(directory)


def lock_dir(data_dir: str, lock_name: str, user: str) -> int:
    """Lock ``data_dir`` (through its file ``lock_name``) for this process, used as ``user``
    (a storage unit, a controller): its file descriptor (closing it, or the process ending,
    unlocks). Held by another running process, or not writable: `ConfigError`."""
    try:
        fd = os.open(os.path.join(data_dir, lock_name), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise unwritable(data_dir, user, exc) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ConfigError(
            f"data_dir: {data_dir!r} is in use by another running {user}; give each {user} "
            "its own directory (or stop the other one first)"
        ) from None
    return close_in_children(fd)  # a forked child's copy would keep it locked


def unit_data_dir(data_dir: str, unit_id: int, *, create: bool = False) -> str:
    """Storage unit ``unit_id``'s directory in a cluster started as a whole on ``data_dir``
    (the controller's): ``data_dir/units/unit-N``, the same unit every start, so the cluster
    started again on ``data_dir`` finds each unit's cells.

    Args:
        data_dir: the controller's directory.
        unit_id: the unit's id.
        create: make the directory (and its parents) if it is missing.

    Returns:
        The unit's directory.
    """
    path = os.path.join(data_dir, UNITS_DIR, f"unit-{unit_id}")
    if create:
        os.makedirs(path, exist_ok=True)
    return path
