"""The requests on a storage unit's cells: put, get, clear, layout, stats.

A `StorePut` carries its columns in frames after its header (the socket path), or names
spans of a shared-memory grant (`tq_async._storage._shm_handlers`) and of a device grant
(`tq_async._storage._device_handlers`); a `StoreGet` asking for ``shm`` is answered with
pinned arena spans when they fit, else with frames. At durability ``fsync`` puts and clears
are answered once the next group commit synced them (`tq_async._storage._commits`).
Every byte moved is counted by locality: same host or not as the client, per reading task.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._service._loop import Incoming, WithFrames
from .._service._metrics import Metrics
from .._transport._hosts import locality_key
from .._wire._protocol import (
    HeldRows,
    PutSpares,
    ShmGrant,
    StoreClear,
    StoreGet,
    StoreLayout,
    StorePut,
    StoreStats,
    StoreStatsReply,
)
from ._cells import DevicePut, StorageState
from ._commits import GroupCommits
from ._device_handlers import DevicePath
from ._shm_handlers import ShmPath

__all__ = ["CellCalls"]


class CellCalls:
    """The handlers of the requests on a unit's cells, and the count of the bytes they move.

    Args:
        state: the unit's cells.
        shm_path: the shared-memory path (puts and reads naming arena spans).
        device_path: the device path (puts naming device spans).
        commits: the group commit at durability ``fsync`` (None: answered at once).
        metrics: where bytes moved are counted too.
    """

    def __init__(
        self,
        state: StorageState,
        shm_path: ShmPath,
        device_path: DevicePath,
        commits: GroupCommits | None,
        metrics: Metrics,
    ) -> None:
        self.state = state
        self.shm_path = shm_path
        self.device_path = device_path
        self.commits = commits
        self.metrics = metrics

    def on_store_put(self, msg: Incoming, body: StorePut) -> Any:
        if body.device is None:
            data = self._store_put(msg, body, None)
        else:
            with self.device_path.put(msg.peer, body) as device:
                data = self._store_put(msg, body, device)
        self.moved("in", body.host, data)
        # a same-host client's next put may skip asking for its grants: lend them now
        spare = self.shm_path.lend(msg.peer, body.spare) if body.spare > 0 else None
        answer: ShmGrant | PutSpares | None = spare
        lent = [spare] if spare is not None else []
        if body.device_spare > 0:
            device_spare = self.device_path.lend(msg.peer, body.device_spare)
            answer = PutSpares(spare, device_spare)
            lent += [device_spare] if device_spare is not None else []
        if self.commits is not None:  # answered once the next group commit synced it
            if not lent:
                return self.commits.after(msg, "StorePut", answer)
            return self.commits.after(
                msg, "StorePut", answer, lambda: self.shm_path.unlend(msg.peer, *lent)
            )
        return answer

    def _store_put(self, msg: Incoming, body: StorePut, device: DevicePut | None) -> list[Any]:
        """Store a put's columns (frames, shared-memory spans or device cells); its frames."""
        if body.shm is not None:
            return self.shm_path.put(msg, body, device)
        data: list[Any] = msg.frames[1:]
        self.state.put(
            body.partition_id,
            body.rows,
            body.columns,
            data,
            incarnation=body.incarnation,
            device=device,
        )
        return data

    def on_store_get(self, msg: Incoming, body: StoreGet) -> Any:
        shm = self.shm_path.read(msg.peer, body) if body.shm else None
        if shm is not None:
            self.count("out", body.host, sum(n for _, n in shm.shm_spans or ()), body.task)
            return shm
        stored, out = self.state.read(
            body.partition_id, body.rows, body.fields, incarnation=body.incarnation
        )
        self.moved("out", body.host, out, body.task)
        return WithFrames(stored, out)

    def on_store_clear(self, msg: Incoming, body: StoreClear) -> Any:
        freed = self.state.clear(body.partition_id, body.rows, incarnation=body.incarnation)
        if self.commits is not None:
            # an acknowledged clear survives too (its cells never come back)
            return self.commits.after(msg, "StoreClear", freed)
        return freed

    def on_store_layout(self, msg: Incoming, body: StoreLayout) -> Any:
        self.state.cells.check(body.partition_id, body.incarnation)
        return self.state.cells.layout(body.partition_id, body.field, body.rows)

    def on_store_stats(self, msg: Incoming, body: StoreStats) -> StoreStatsReply:
        reply = self.state.stats()
        if body.rows:
            cells = self.state.cells
            reply.held = [
                HeldRows(pid, cells.incarnations.get(pid, ""), np.asarray(rows, "<i8").tobytes())
                for pid, rows in cells.held_rows().items()
            ]
        return reply

    # ---- locality ----------------------------------------------------------------------------

    def moved(
        self, direction: str, client_host: str, frames: Sequence[Any], task: str = ""
    ) -> None:
        """Count payload bytes moved ``direction`` for a client on ``client_host`` (reading
        for ``task``, when it names one)."""
        nbytes = sum(memoryview(f).nbytes for f in frames)
        self.count(direction, client_host, nbytes, task)

    def count(self, direction: str, client_host: str, nbytes: int, task: str = "") -> None:
        """Count ``nbytes`` moved ``direction`` (``"in"``, ``"out"``) for a client on
        ``client_host``, reading for ``task`` when it names one."""
        state = self.state
        key = locality_key(direction, state.host, client_host)
        state.locality[key] += nbytes
        if task:
            by_task = state.task_locality.get(task)
            if by_task is None:
                by_task = state.task_locality[task] = {
                    f"{direction}_same_host": 0,
                    f"{direction}_other_host": 0,
                }
            by_task[key] = by_task.get(key, 0) + nbytes
        if self.metrics.enabled:
            self.metrics.transfer(direction, nbytes)
