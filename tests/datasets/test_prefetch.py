"""``tq_async._datasets._prefetch``: the dataset's prefetcher alone, with a fake owner.

The owner is a position (index, generation, stride) and a ``load`` that records what it was
asked for; no client, partition or tensor. The dataset-level behaviour (exactly once, replay,
resume) is in ``tests/datasets/test_dataset.py``.
"""

from __future__ import annotations

import anyio
import pytest

from tq_async._datasets._prefetch import Prefetcher

# A generous bound for things that must happen (never a synchronisation device).
DEADLINE = 20


class Owner:
    """A dataset's position and loader: batch ``i`` is ``"b{i}"``; the stream ends at ``end``."""

    def __init__(self, *, end: int | None = None, stride: int = 1, index: int = 0) -> None:
        self.index = index
        self.generation = 0
        self.stride = stride
        self.end = end
        self.loaded: list[tuple[int, int]] = []
        self.fail_once: set[int] = set()
        #: a load of an index in here waits for its event
        self.gates: dict[int, anyio.Event] = {}
        self.started: dict[int, anyio.Event] = {}

    async def load(self, index: int, generation: int) -> str | None:
        self.loaded.append((index, generation))
        self.started.setdefault(index, anyio.Event()).set()
        await anyio.lowlevel.checkpoint()
        if index in self.gates:
            await self.gates[index].wait()
        if index in self.fail_once:
            self.fail_once.discard(index)
            raise RuntimeError(f"load {index} failed")
        if self.end is not None and index >= self.end:
            return None
        return f"b{index}"

    def position(self) -> tuple[int, int, int]:
        return self.index, self.generation, self.stride

    def deliver(self) -> None:
        self.index += self.stride

    def move(self, prefetcher: Prefetcher[str], index: int) -> None:
        """What the dataset's reset/step/load_state_dict do."""
        self.index = index
        self.generation += 1
        prefetcher.drop()

    @property
    def indexes(self) -> list[int]:
        return [i for i, _ in self.loaded]


async def _drain(prefetcher: Prefetcher[str], owner: Owner, tg: anyio.abc.TaskGroup) -> list[str]:
    out = []
    while (batch := await prefetcher.next(tg)) is not None:
        out.append(batch)
        owner.deliver()
    return out


async def test_batches_come_in_order_and_the_end_stops_the_producer() -> None:
    owner = Owner(end=5)
    prefetcher = Prefetcher(2, owner.load, owner.position)
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            assert await _drain(prefetcher, owner, tg) == ["b0", "b1", "b2", "b3", "b4"]
            assert not prefetcher.running
    assert owner.indexes == [0, 1, 2, 3, 4, 5]  # nothing loaded past the end


@pytest.mark.parametrize("depth", [1, 2, 4])
async def test_at_most_depth_batches_are_loaded_ahead(depth: int) -> None:
    owner = Owner()
    prefetcher = Prefetcher(depth, owner.load, owner.position)
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            for position in range(3):
                assert await prefetcher.next(tg) == f"b{position}"
                await anyio.wait_all_tasks_blocked()
                # the batch being delivered, and depth more
                assert owner.indexes == list(range(position + depth + 1))
                owner.deliver()
            prefetcher.drop()  # the task group would otherwise wait for the producer


async def test_a_stride_reads_every_stride_th_index_from_the_position() -> None:
    owner = Owner(end=9, stride=3, index=1)
    prefetcher = Prefetcher(2, owner.load, owner.position)
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            assert await _drain(prefetcher, owner, tg) == ["b1", "b4", "b7"]
    assert owner.indexes == [1, 4, 7, 10]


async def test_a_failed_load_is_raised_at_its_position_then_loaded_again() -> None:
    owner = Owner(end=4)
    owner.fail_once.add(2)
    prefetcher = Prefetcher(3, owner.load, owner.position)
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            assert await prefetcher.next(tg) == "b0"
            owner.deliver()
            assert await prefetcher.next(tg) == "b1"
            owner.deliver()
            with pytest.raises(RuntimeError, match="load 2 failed"):
                await prefetcher.next(tg)
            assert not prefetcher.running
            assert owner.index == 2  # the position did not move
            assert await _drain(prefetcher, owner, tg) == ["b2", "b3"]
    assert owner.indexes == [0, 1, 2, 2, 3, 4]


async def test_a_move_while_waiting_carries_on_from_the_new_position() -> None:
    owner = Owner()
    owner.gates[1] = anyio.Event()  # batch 1 never loads: the caller waits for it
    owner.started[1] = anyio.Event()
    prefetcher = Prefetcher(2, owner.load, owner.position)
    got: list[str | None] = []

    async def consume(tg: anyio.abc.TaskGroup) -> None:
        got.append(await prefetcher.next(tg))

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            assert await prefetcher.next(tg) == "b0"
            owner.deliver()
            tg.start_soon(consume, tg)
            await owner.started[1].wait()
            await anyio.wait_all_tasks_blocked()  # the consumer waits on the stream
            owner.move(prefetcher, 7)
            await anyio.wait_all_tasks_blocked()
            assert got == ["b7"]
            prefetcher.drop()
    # the old producer's load of 1 was cancelled; the new one started at 7 in generation 1
    assert owner.loaded[:2] == [(0, 0), (1, 0)]
    assert owner.loaded[2] == (7, 1)


async def test_an_item_out_of_step_restarts_the_producer_at_the_position() -> None:
    owner = Owner(end=6)
    prefetcher = Prefetcher(2, owner.load, owner.position)
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            assert await prefetcher.next(tg) == "b0"
            await anyio.wait_all_tasks_blocked()
            # the position jumps without a drop (as a hand-off lost to a cancellation would
            # look): the queued batch 1 is not delivered, a producer starts at 4
            owner.index = 4
            assert await prefetcher.next(tg) == "b4"
            owner.deliver()
            assert await _drain(prefetcher, owner, tg) == ["b5"]
    assert owner.indexes[-3:] == [4, 5, 6]


async def test_drop_cancels_the_producer_and_forgets_the_batches_ahead() -> None:
    owner = Owner()
    prefetcher = Prefetcher(3, owner.load, owner.position)
    prefetcher.drop()  # nothing running: nothing to do
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            assert await prefetcher.next(tg) == "b0"
            await anyio.wait_all_tasks_blocked()
            assert prefetcher.running
            prefetcher.drop()
            assert not prefetcher.running
            # same position, no move: the batch is loaded again by a new producer
            assert await prefetcher.next(tg) == "b0"
            prefetcher.drop()
        # leaving the task group did not wait for a producer blocked on a full stream
    assert owner.indexes.count(0) == 2
