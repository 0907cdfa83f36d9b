# Generated from src/tq_async/_client/_async/_checkpoint.py by scripts/unasync.py:
# do not edit; change the source and run `python scripts/unasync.py`.
"""Checkpoints: the controller's state and every cell, in a directory written atomically.

Layout of a checkpoint directory:

    manifest.json      format name and version, the size and sha256 of every other file,
                       and the caller's ``metadata`` (JSON; `checkpoint_metadata`)
    state.msgpack      the controller snapshot (partitions, production, consumption, tags,
                       keys, recorded batches) and the sampler's state_dict
    cells-<p>-<f>.bin  one file per (partition, field): a msgpack header (rows, column header,
                       frame sizes) then the column's wire frames, exactly as the codec sends them
                       (``cells-<p>-<f>-<k>.bin`` too where a field's rows were put with
                       different shapes or kinds: one file per column header, its rows
                       read back as put)

Row placement is not saved: a restore spreads rows over whatever storage units exist. No
pickle is involved in reading a checkpoint (pickled columns stay opaque bytes).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import struct
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from ..._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    InvalidRequestError,
    RowsNotFound,
    TQError,
)
from ..._meta import BatchMeta
from ..._paths._dirs import sync_dir
from ..._sync_primitives import cleanup_scope, run_sync_off_loop
from ..._transport._inherited import remove_unheld
from ..._wire._checks import check_id
from ..._wire._columns import (
    Column,
    ColumnHeader,
    column_frame_count,
    column_from_frames,
    column_to_frames,
    position_runs,
    positions_by_unit,
    take_rows,
)
from ..._wire._protocol import (
    DumpState,
    RestoreAbort,
    RestoreBegin,
    RestoreCommit,
    StateDump,
    StoreLayout,
    StorePut,
    encoder,
)
from ._replies import decode

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "checkpoint_metadata",
    "save_checkpoint",
    "load_checkpoint",
]

FORMAT = "tq_async-checkpoint"
FORMAT_VERSION = 1
_MAGIC = b"TQCELLS1"
#: how many snapshots a save takes when rows are freed before their cells are read
_SNAPSHOT_TRIES = 3


class _CellsHeader(msgspec.Struct, array_like=True):
    partition_id: str
    rows: list[int]
    column: ColumnHeader
    frame_sizes: list[int]


def _sha256(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def _write(path: str, chunks: Sequence[Any]) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as f:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            f.write(view)
            digest.update(view)
            size += view.nbytes
        f.flush()
        os.fsync(f.fileno())
    return size, digest.hexdigest()


def _encode_cells(
    partition_id: str, rows: list[int], header: ColumnHeader, column: Column
) -> list[Any]:
    frames = column_to_frames(header, column)
    sizes = [memoryview(f).cast("B").nbytes for f in frames]
    head = encoder.encode(_CellsHeader(partition_id, rows, header, sizes))
    return [_MAGIC, struct.pack("<Q", len(head)), head, *frames]


def _decode_cells(name: str, data: bytearray) -> tuple[_CellsHeader, Column]:
    view = memoryview(data)
    try:
        if bytes(view[:8]) != _MAGIC:
            raise ValueError("bad magic")
        (hlen,) = struct.unpack("<Q", view[8:16])
        head = msgspec.msgpack.decode(view[16 : 16 + hlen], type=_CellsHeader)
        pos = 16 + hlen
        frames = []
        for size in head.frame_sizes:
            frames.append(view[pos : pos + size])
            pos += size
        if pos != len(view) or len(frames) != column_frame_count(head.column):
            raise ValueError("size mismatch")
        return head, column_from_frames(head.column, frames, len(head.rows))
    except (ValueError, struct.error, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"checkpoint file {name!r} is corrupt: {exc}") from exc


@dataclass(frozen=True)
class ClientLink:
    """The client calls a checkpoint makes; the client hands them over (no import of it here).

    Attributes:
        call: a controller request and the type of its reply.
        fetch_columns: the named columns of a batch's rows, read from every unit.
        store: a request with frames to one storage unit (by id), and its reply.
    """

    call: Callable[[msgspec.Struct, Any], Any]
    fetch_columns: Callable[[BatchMeta, list[str]], tuple[list[ColumnHeader], list[Column]]]
    store: Callable[[int, msgspec.Struct, Sequence[Any]], Any]


def save_checkpoint(
    client: ClientLink,
    path: str,
    partition_ids: Sequence[str] | None,
    metadata: Mapping[str, Any] | None = None,
) -> None:
    """See `Client.save_checkpoint`."""
    user_metadata = _user_metadata(metadata)
    if isinstance(partition_ids, str):  # (else "train" would be five one-letter partitions)
        raise InvalidRequestError(
            f"save_checkpoint takes a list of partition ids, got the string {partition_ids!r}: "
            f"pass [{partition_ids!r}]"
        )
    ids = (
        None
        if partition_ids is None
        else list(dict.fromkeys(check_id("partition_id", p) for p in partition_ids))
    )
    if not run_sync_off_loop(_replaceable, path):
        raise CheckpointError(
            f"{path!r} exists and is not a tq_async checkpoint: save_checkpoint replaces only "
            "an older checkpoint (or an empty directory); pass a new path, or move it away"
        )
    tmp = _tmp_name(path)
    lock = -1
    try:
        lock = run_sync_off_loop(_make_locked, tmp)
        for tries_left in reversed(range(_SNAPSHOT_TRIES)):
            dump: StateDump = client.call(DumpState(ids), StateDump)
            try:
                files = _write_snapshot(client, tmp, dump)
                break
            except RowsNotFound as exc:  # freed after the snapshot (auto-clear, a clear)
                for name in os.listdir(tmp):
                    os.unlink(os.path.join(tmp, name))
                if not tries_left:
                    raise CheckpointError(
                        f"rows were freed while checkpoint {path!r} read their cells, "
                        f"{_SNAPSHOT_TRIES} times in a row ({exc}); pause the consumers that "
                        "free rows (acknowledgements under auto-clear, clears) and save again"
                    ) from exc
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "files": files,
            "metadata": user_metadata,
        }
        data = [json.dumps(manifest, indent=1).encode()]
        run_sync_off_loop(_write, os.path.join(tmp, "manifest.json"), data)
        _swap_into_place(tmp, path)
    except TQError:
        raise  # (a TQTimeoutError is an OSError too: it is not the disk's)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {path!r}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if lock >= 0:
            os.close(lock)  # removed first: no sweep finds it unlocked


def _write_snapshot(client: ClientLink, tmp: str, dump: StateDump) -> dict[str, dict[str, Any]]:
    """Write ``dump`` and the cells it names into the empty directory ``tmp``; the size and
    sha256 of each file.

    Raises:
        RowsNotFound: rows of ``dump`` were freed before their cells were read.
    """
    files: dict[str, dict[str, Any]] = {}

    def add(name: str, chunks: Sequence[Any]) -> None:
        size, digest = _write(os.path.join(tmp, name), chunks)
        files[name] = {"bytes": size, "sha256": digest}

    run_sync_off_loop(add, "state.msgpack", [encoder.encode(dump)])
    for pi, pd in enumerate(dump.partitions):
        for fi, fd in enumerate(pd.fields):
            held = [i for i in range(len(pd.alive)) if pd.alive[i] and fd.produced[i]]
            if not held:
                continue
            rows = [i + pd.base for i in held]
            meta = BatchMeta(
                partition_id=pd.partition_id,
                global_indexes=rows,
                field_names=[fd.header.name],
                units=[pd.units[i] for i in held],
            )
            parts = _fetch_cells(client, meta, fd.header.name)
            for k, (part, header, column) in enumerate(parts):
                chunks = _encode_cells(pd.partition_id, part, header, column)
                name = f"cells-{pi}-{fi}-{k}.bin" if k else f"cells-{pi}-{fi}.bin"
                run_sync_off_loop(add, name, chunks)
    return files


def _fetch_cells(
    client: ClientLink, meta: BatchMeta, name: str
) -> list[tuple[list[int], ColumnHeader, Column]]:
    """Field ``name`` of ``meta``'s rows as ``(rows, header, column)`` parts, one per column
    header its rows were stored with, so that each part reads back as its rows were put (read
    together, rows put with different shapes or kinds come back joined: dense rows with
    jagged ones as one jagged column, or as no column at all). The units say which rows have
    which header (`StoreLayout`); one read per header."""
    by_header: dict[ColumnHeader, list[int]] = {}
    for unit, positions in positions_by_unit(meta.units).items():
        rows = [meta.global_indexes[i] for i in positions]
        ask = StoreLayout(meta.partition_id, rows, name, meta.incarnation)
        payload, _ = client.store(unit, ask, ())
        runs: list[tuple[ColumnHeader, int]] = decode(payload, list[tuple[ColumnHeader, int]])
        at = 0
        for header, n in runs:
            by_header.setdefault(header, []).extend(positions[at : at + n])
            at += n
    parts = []
    for positions in by_header.values():
        part = meta.select_rows(sorted(positions)) if len(by_header) > 1 else meta
        headers, columns = client.fetch_columns(part, [name])
        parts.append((list(part.global_indexes), headers[0], columns[0]))
    return parts


def _user_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidRequestError(
            f"metadata must be a dict of JSON values, got {type(metadata).__name__}"
        )
    try:
        return dict(json.loads(json.dumps(dict(metadata), default=_numpy_scalar)))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(
            f"metadata must hold JSON values only (str, int, float, bool, None, list, dict): {exc}"
        ) from None


def _numpy_scalar(value: Any) -> Any:
    """A numpy scalar in metadata (``np.int64(100)`` of a step counter) as Python's."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def checkpoint_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``metadata`` dict a checkpoint was saved with (``{}`` when none was given).

    Raises:
        CheckpointError: ``path`` is not a readable tq_async checkpoint.
    """
    _finish_swap(os.fspath(path))
    manifest_path = os.path.join(os.fspath(path), "manifest.json")
    try:
        with open(manifest_path, "rb") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        kind = CheckpointError if os.path.isdir(path) else CheckpointNotFoundError
        raise kind(
            f"{os.fspath(path)!r} is not a readable checkpoint ({exc}); pass the directory "
            "save_checkpoint wrote"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{os.fspath(path)!r} is not a tq_async checkpoint")
    metadata = manifest.get("metadata", {})
    return dict(metadata) if isinstance(metadata, dict) else {}


def _tmp_name(path: str) -> str:
    """A sibling of ``path`` (same filesystem, so the final rename is atomic)."""
    return _tmp_prefix(path) + uuid.uuid4().hex[:8]


def _tmp_prefix(path: str) -> str:
    parent = os.path.dirname(os.path.abspath(path)) or "."
    return os.path.join(parent, f".{os.path.basename(path)}.tmp-")


def _finish_swap(path: str) -> None:
    """A save killed between the two renames of `_swap_into_place` left nothing at ``path``,
    the checkpoint it held at ``<tmp>.old`` and the new one, whole, at ``<tmp>``: put the new
    one in place (the old one where the new one is gone) and drop the old one."""
    if os.path.lexists(path):
        return
    prefix = _tmp_prefix(path)
    parent, start = os.path.split(prefix)
    with contextlib.suppress(OSError):  # (else ``path`` reads as missing)
        for name in sorted(os.listdir(parent)):
            if name.startswith(start) and name.endswith(".old"):
                old = os.path.join(parent, name)
                new = old[: -len(".old")]
                os.rename(new if os.path.isdir(new) else old, path)
                shutil.rmtree(old, ignore_errors=True)
                return


def _make_locked(tmp: str) -> int:
    """Make a save's temporary directory ``tmp``, locked while the save runs (closing the
    descriptor it returns unlocks): `_sweep` leaves it alone."""
    os.makedirs(tmp)
    fd = os.open(tmp, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (new: nobody else holds it)
    return fd


def _sweep(path: str) -> None:
    """Remove what killed saves of ``path`` left beside it: temporary directories no running
    save holds (killed while writing), older checkpoints a new one replaced (killed before
    removing them)."""
    parent, start = os.path.split(_tmp_prefix(path))
    for name in os.listdir(parent):
        if not name.startswith(start):
            continue
        held = os.path.join(parent, name)
        if name.endswith(".old"):
            if os.path.lexists(path):  # (else `_finish_swap` did not find it whole)
                shutil.rmtree(held, ignore_errors=True)
            continue
        remove_unheld(held, held)  # (a running save holds its directory locked)


def _replaceable(path: str) -> bool:
    """Whether a save may put a checkpoint at ``path``: nothing there, an empty directory, or
    a checkpoint (whose manifest says so). What killed saves of it left is put right first."""
    _finish_swap(path)
    with contextlib.suppress(OSError):
        _sweep(path)
    if not os.path.lexists(path):
        return True
    if not os.path.isdir(path):
        return False
    try:
        if not os.listdir(path):
            return True
        with open(os.path.join(path, "manifest.json"), "rb") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def _swap_into_place(tmp: str, path: str) -> None:
    """Rename ``tmp`` to ``path``; an existing ``path`` is replaced only once ``tmp`` is whole.
    Both directories are synced (``tmp``'s files' names, then the rename): a save that
    returned survives a machine crash."""
    sync_dir(tmp)
    if not os.path.exists(path):
        os.rename(tmp, path)
        sync_dir(os.path.dirname(tmp))
        return
    old = f"{tmp}.old"
    os.rename(path, old)
    try:
        os.rename(tmp, path)
    except OSError:
        os.rename(old, path)
        raise
    sync_dir(os.path.dirname(tmp))
    shutil.rmtree(old, ignore_errors=True)


def _read_verified(path: str) -> tuple[StateDump, list[tuple[_CellsHeader, Column]]]:
    _finish_swap(path)
    manifest_path = os.path.join(path, "manifest.json")
    try:
        with open(manifest_path, "rb") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        if not os.path.isdir(path):
            raise CheckpointNotFoundError(
                f"checkpoint {path!r} does not exist; pass the directory save_checkpoint wrote"
            ) from None
        raise CheckpointError(
            f"{path!r} is not a checkpoint (no manifest.json): a partial or missing checkpoint"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {manifest_path!r}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not a tq_async checkpoint")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path!r} has checkpoint format version {manifest.get('format_version')!r}; this "
            f"tq_async reads version {FORMAT_VERSION}: load it with the version that wrote it"
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or "state.msgpack" not in files:
        raise CheckpointError(f"{path!r} has a manifest without state.msgpack")
    blobs: dict[str, bytearray] = {}
    for name, info in files.items():
        if name == "manifest.json":
            continue
        if os.path.basename(name) != name:
            raise CheckpointError(f"{path!r} names a file outside the checkpoint: {name!r}")
        try:
            with open(os.path.join(path, name), "rb") as f:
                data = bytearray(f.read())
        except OSError as exc:
            raise CheckpointError(f"checkpoint file {name!r} is missing: {exc}") from exc
        if len(data) != info.get("bytes") or _sha256(data) != info.get("sha256"):
            raise CheckpointError(
                f"checkpoint file {name!r} does not match its manifest (size or sha256): the "
                "checkpoint is corrupt or partial"
            )
        blobs[name] = data
    try:
        state = msgspec.msgpack.decode(blobs.pop("state.msgpack"), type=StateDump)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"state.msgpack of {path!r} is unreadable: {exc}") from exc
    counts = Counter(pd.partition_id for pd in state.partitions)
    twice = sorted(pid for pid, n in counts.items() if n > 1)
    if twice:
        raise CheckpointError(
            f"{path!r} holds partitions {twice} twice: the checkpoint is inconsistent"
        )
    cells = [_decode_cells(name, data) for name, data in sorted(blobs.items())]
    known = {
        (pd.partition_id, fd.header.name): fd.header for pd in state.partitions for fd in pd.fields
    }
    for head, _ in cells:
        saved = known.get((head.partition_id, head.column.name))
        if saved is None or not saved.accepts(head.column):
            raise CheckpointError(
                f"cells of {head.partition_id!r}/{head.column.name!r} do not match the saved "
                "schema: the checkpoint is inconsistent"
            )
    return state, cells


def load_checkpoint(client: ClientLink, path: str) -> list[str]:
    """See `Client.load_checkpoint`."""
    state, cells = run_sync_off_loop(_read_verified, path)
    ids = [pd.partition_id for pd in state.partitions]
    #: the first row of each partition's placement (the rows below were cleared)
    bases = {pd.partition_id: pd.base for pd in state.partitions}
    try:
        placement: dict[str, list[int]] = client.call(
            RestoreBegin(StateDump(state.partitions, {})), dict[str, list[int]]
        )
    except InvalidRequestError:  # refused: nothing staged (another load's staging is kept)
        raise
    except BaseException:  # given up on, maybe after the controller staged them
        _abort_restore(client, ids)
        raise
    try:
        for head, column in cells:
            units, base = placement[head.partition_id], bases[head.partition_id]
            by_unit: dict[int, list[int]] = {}
            for pos, row in enumerate(head.rows):
                by_unit.setdefault(units[row - base], []).append(pos)
            for unit, positions in by_unit.items():
                runs = position_runs(positions)
                part = take_rows(column, runs) if len(by_unit) > 1 else column
                client.store(
                    unit,
                    StorePut(head.partition_id, [head.rows[i] for i in positions], [head.column]),
                    column_to_frames(head.column, part),
                )
        client.call(RestoreCommit(ids, state.sampler_state or None), None)
    except BaseException:
        _abort_restore(client, ids)
        raise
    return ids


def _abort_restore(client: ClientLink, ids: list[str]) -> None:
    """Drop what the controller staged of ``ids`` and their cells (only partitions it is
    restoring: a live one of the same name is left alone), within a few seconds."""
    with cleanup_scope(5), contextlib.suppress(Exception):
        client.call(RestoreAbort(ids), None)
