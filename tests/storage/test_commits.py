"""`GroupCommits` alone: the ``fsync`` level's group commit over a real segment store.

Requests that wrote while a commit ran wait for the next one and are answered together once
it synced them; a commit that fails answers each of them with its error; close makes the
last commit; a put from this process is synced on its own thread.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from test_segments import FullDisk

import tq_async as tq
from tq_async._service._loop import DEFERRED, Incoming
from tq_async._storage._cells import StorageState
from tq_async._storage._commits import GroupCommits
from tq_async._storage._segments import SegmentStore, claim_unit_dir
from tq_async._wire._columns import ColumnHeader

DENSE = ColumnHeader("x", "dense", "int64", (2,))  # 16 bytes per row


class _Answers:
    """What the service would send and record, and an event once ``expect`` were answered."""

    def __init__(self, expect: int) -> None:
        self.sent: list[tuple[int, Any]] = []
        self.recorded: list[tuple[str, bool]] = []
        self.expect = expect
        self.done = anyio.Event()

    def send_ok(self, peer: bytes, rid: int, payload: Any, frames: Sequence[Any] = ()) -> None:
        self._sent(rid, payload)

    def send_error(self, peer: bytes, rid: int, exc: BaseException, op: str) -> None:
        self._sent(rid, exc)

    def record(self, op: str, ok: bool, t0: float) -> None:
        self.recorded.append((op, ok))

    def _sent(self, rid: int, what: Any) -> None:
        self.sent.append((rid, what))
        if len(self.sent) == self.expect:
            self.done.set()


def _state(path: Path, write: FullDisk | None = None) -> tuple[StorageState, SegmentStore]:
    claim_unit_dir(str(path), 0)
    disk = SegmentStore(str(path), sync=True, write=write or os.write)
    state = StorageState(disk=disk)
    state.recover()
    return state, disk


def _put(state: StorageState, rows: list[int]) -> None:
    state.put("p", rows, [DENSE], [bytearray(16 * len(rows))], incarnation="i")


def _rows(path: Path) -> int:
    state, disk = _state(path)
    try:
        return state.stats().rows
    finally:
        disk.close()


async def test_one_commit_answers_every_request_that_waited(tmp_path: Path) -> None:
    state, disk = _state(tmp_path)
    answers = _Answers(expect=2)
    commits = GroupCommits(state, disk, answers)
    made = []
    commit = disk.commit

    def counted(c: Any) -> None:
        made.append(c)
        commit(c)

    disk.commit = counted  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        tg.start_soon(commits.run)
        _put(state, [0, 1])
        assert commits.after(Incoming(b"a", 1, [], 0.0), "StorePut", None) is DEFERRED
        _put(state, [2])
        assert commits.after(Incoming(b"b", 2, [], 0.0), "StoreClear", 5) is DEFERRED
        assert disk.pending
        assert answers.sent == []
        await answers.done.wait()
        tg.cancel_scope.cancel()
    assert answers.sent == [(1, None), (2, 5)]
    assert answers.recorded == [("StorePut", True), ("StoreClear", True)]
    assert len(made) == 1
    assert not disk.pending
    commits.close()
    disk.close()
    assert _rows(tmp_path) == 3


async def test_a_failed_commit_answers_each_waiter_with_its_error(tmp_path: Path) -> None:
    write = FullDisk()
    state, disk = _state(tmp_path, write)
    answers = _Answers(expect=2)
    commits = GroupCommits(state, disk, answers)
    async with anyio.create_task_group() as tg:
        tg.start_soon(commits.run)
        _put(state, [0])
        _put(state, [1])
        write.full = True  # the data is written; its index records cannot be
        commits.after(Incoming(b"a", 1, [], 0.0), "StorePut", None)
        commits.after(Incoming(b"a", 2, [], 0.0), "StorePut", None)
        await answers.done.wait()
        tg.cancel_scope.cancel()
    assert [rid for rid, _ in answers.sent] == [1, 2]
    assert all(isinstance(exc, tq.StorageFullError) for _, exc in answers.sent)
    assert answers.recorded == [("StorePut", False), ("StorePut", False)]
    write.full = False
    commits.close()
    disk.close()


async def test_a_failed_commit_undoes_what_a_reply_would_have_lent(tmp_path: Path) -> None:
    write = FullDisk()
    state, disk = _state(tmp_path, write)
    answers = _Answers(expect=2)
    commits = GroupCommits(state, disk, answers)
    undone: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(commits.run)
        _put(state, [0])
        write.full = True
        commits.after(Incoming(b"a", 1, [], 0.0), "StorePut", "lent", lambda: undone.append("a"))
        commits.after(Incoming(b"b", 2, [], 0.0), "StorePut", None)
        await answers.done.wait()
        tg.cancel_scope.cancel()
    assert undone == ["a"]  # the reply was never sent: what it lent went back
    assert all(isinstance(exc, tq.StorageFullError) for _, exc in answers.sent)
    write.full = False
    undone.clear()
    answers = commits.answers = _Answers(expect=1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(commits.run)
        _put(state, [1])
        commits.after(Incoming(b"a", 3, [], 0.0), "StorePut", "lent", lambda: undone.append("a"))
        await answers.done.wait()
        tg.cancel_scope.cancel()
    assert answers.sent == [(3, "lent")]  # sent: nothing undone
    assert undone == []
    commits.close()
    disk.close()


def test_close_makes_the_last_commit_and_now_commits_on_this_thread(tmp_path: Path) -> None:
    state, disk = _state(tmp_path)
    commits = GroupCommits(state, disk, _Answers(expect=0))
    _put(state, [0])
    commits.now()  # a put from this process
    assert not disk.pending
    _put(state, [1, 2])  # its request never answered: the unit closes
    assert disk.pending
    commits.close()
    assert not disk.pending
    disk.close()
    assert _rows(tmp_path) == 3


def test_now_raises_what_the_commit_raised(tmp_path: Path) -> None:
    write = FullDisk()
    state, disk = _state(tmp_path, write)
    commits = GroupCommits(state, disk, _Answers(expect=0))
    _put(state, [0])
    write.full = True
    with pytest.raises(tq.StorageFullError):
        commits.now()
    write.full = False
    commits.close()
    disk.close()
