"""The group commit of a storage unit at durability ``fsync``.

A put (or clear) at ``fsync`` is answered once its cells are on the disk. Syncing each one
alone would cost a disk flush per request; instead the unit's requests wait in
`GroupCommits`, and one commit (`begin_commit`, the segment store's ``commit`` on a
thread of its own, `end_commit`) syncs what every request that arrived while the previous
commit ran wrote, then answers them all. A put from a controller in the same process is
synced on its caller's thread (`GroupCommits.now`), as is the last commit at close.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import anyio

from .._errors import TQError
from .._logging import get_logger
from .._service._loop import DEFERRED, Incoming
from ._cells import StorageState, begin_commit, commit_now, end_commit
from ._segments import SegmentStore

__all__ = ["Answers", "GroupCommits"]

log = get_logger(__name__)


class Answers(Protocol):
    """How the service answers a request and counts it (`tq_async._service._loop.Service`)."""

    def send_ok(self, peer: bytes, rid: int, payload: Any, frames: Sequence[Any] = ()) -> None: ...

    def send_error(self, peer: bytes, rid: int, exc: BaseException, op: str) -> None: ...

    def record(self, op: str, ok: bool, t0: float) -> None: ...


class GroupCommits:
    """Requests waiting for the next group commit, and the task that makes it.

    Args:
        state: the unit's cells (a commit takes what their puts and clears wrote).
        disk: their segment files (at the ``fsync`` level).
        answers: the service, which answers the requests once their commit is done.
    """

    def __init__(self, state: StorageState, disk: SegmentStore, answers: Answers) -> None:
        self.state = state
        self.disk = disk
        self.answers = answers
        self._waiters: list[tuple[Incoming, str, Any, Callable[[], None] | None]] = []
        self._wake = anyio.Event()
        #: the thread commits run in: submitted without yielding to the loop, so a commit
        #: of a put from this process (`now`, which waits for the one in flight) never
        #: waits for a thread the loop has yet to start
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="tq-unit-fsync")

    def after(
        self, msg: Incoming, op: str, reply: Any, undo: Callable[[], None] | None = None
    ) -> Any:
        """``reply``, sent once the next group commit synced what the request wrote (the
        handler returns what this returns: `DEFERRED`); ``undo`` runs instead when the
        commit fails (the request gets the error: what ``reply`` lent goes back)."""
        self._waiters.append((msg, op, reply, undo))
        self._wake.set()
        return DEFERRED

    def now(self) -> None:
        """A group commit on this thread (a put from this process; the last one at close)."""
        commit_now(self.state)

    async def run(self) -> None:
        """Sync what requests wrote, then answer them; one commit serves every request that
        arrived while the previous one ran. Runs while the unit serves."""
        answers = self.answers
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            waiters, self._waiters = self._waiters, []
            commit = begin_commit(self.state)
            future = self._committer.submit(self.disk.commit, commit)
            try:
                # a commit taken must run (the next begin_commit waits for it)
                with anyio.CancelScope(shield=True):
                    await asyncio.wrap_future(future)
            except TQError as exc:
                end_commit(self.state, commit, exc)
                for msg, op, _, undo in waiters:
                    if undo is not None:
                        undo()
                    answers.send_error(msg.peer, msg.rid, exc, op)
                    answers.record(op, False, msg.t0)
                continue
            end_commit(self.state, commit)
            for msg, op, reply, _ in waiters:
                answers.send_ok(msg.peer, msg.rid, reply)
                answers.record(op, True, msg.t0)

    def close(self) -> None:
        """Wait for the commit in flight, then make the last one (what the last requests
        wrote; they are not answered: the unit is closing)."""
        self._committer.shutdown(wait=True)
        if self.disk.pending:
            try:
                self.now()
            except TQError as exc:
                log.error("the last group commit failed at close", error=str(exc))
