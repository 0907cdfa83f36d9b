"""``ControllerCore.decide`` / ``resume``: a get_meta decided in one call into the core, its
look-ahead (``GetMeta.also``) a core step, its effects collected in one ``Effects``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tq_async._core._state import ControllerState, Wakeup
from tq_async._core._transitions import Awaiting, ControllerCore, Effects
from tq_async._errors import InvalidRequestError
from tq_async._wire._columns import ColumnHeader
from tq_async._wire._protocol import GetMeta, MetaReply
from tq_async.samplers import BaseSampler, SequentialSampler

X = ColumnHeader("x", "dense", "int64", ())


def new_core(sampler: BaseSampler | None = None) -> ControllerCore:
    return ControllerCore(ControllerState({0: "inproc://u0"}), sampler)


def put(core: ControllerCore, n: int) -> None:
    placement, _ = core.put_begin("p", [X], n, None, None, 0.0)
    core.put_commit("p", placement.rows, ["x"], None, None, placement.put_id)


def batch(index: int, *, also: list[int] | None = None, lease: float | None = None) -> GetMeta:
    req = GetMeta("p", ["x"], 4, "t", {"batch_index": index, "dp_rank": 0}, lease=lease)
    req.also = also
    return req


def test_decide_answers_the_batches_asked_ahead_in_the_same_call() -> None:
    core = new_core()
    put(core, 12)
    fx = Effects()
    reply = core.decide(batch(0, also=[1, 2, 3]), 0.0, fx)
    assert isinstance(reply, MetaReply)
    assert reply.rows == [0, 1, 2, 3]
    assert reply.more is not None
    assert [r.rows for r in reply.more] == [[4, 5, 6, 7], [8, 9, 10, 11]]  # batch 3: no rows
    # decided, and recorded: asking for batch 2 itself re-reads it
    again = core.decide(batch(2), 0.0, Effects())
    assert isinstance(again, MetaReply)
    assert again.rows == [8, 9, 10, 11]


def test_decide_without_ahead_decides_only_the_asked_batch() -> None:
    core = new_core()
    put(core, 8)
    reply = core.decide(batch(0, also=[1]), 0.0, Effects(), ahead=False)
    assert isinstance(reply, MetaReply)
    assert reply.more is None
    assert ("t", 0, 1) not in core.state.partitions["p"].recorded


def test_an_async_sampler_is_handed_back_and_resumed() -> None:
    class Later(SequentialSampler):
        async def sample(self, ready: Any, batch_size: int, *a: Any, **kw: Any) -> Any:  # type: ignore[override]
            rows = list(ready)[:batch_size]
            return rows, rows

    core = new_core(Later())
    put(core, 8)
    req = batch(0)
    pending = core.decide(req, 0.0, Effects())
    assert isinstance(pending, Awaiting)

    async def answer() -> Any:
        return await pending.answer

    reply = core.resume(req, pending, asyncio.run(answer()), 0.0, Effects())
    assert isinstance(reply, MetaReply)
    assert reply.rows == [0, 1, 2, 3]


def test_effects_are_collected_when_the_sampler_raises() -> None:
    class Broken(SequentialSampler):
        def sample(self, ready: Any, batch_size: int, *a: Any, **kw: Any) -> Any:  # type: ignore[override]
            if kw.get("task_name") == "bad":
                raise ValueError("no")
            return super().sample(ready, batch_size, *a, **kw)

    core = new_core(Broken())
    put(core, 8)
    got = core.decide(GetMeta("p", ["x"], 4, "t", None, lease=10.0), 0.0, Effects())
    assert isinstance(got, MetaReply)
    fx = Effects()
    with pytest.raises(InvalidRequestError, match="Broken raised ValueError"):
        core.decide(GetMeta("p", ["x"], 4, "bad", None, ack=[got.lease_id]), 1.0, fx)
    assert Wakeup("p", "t") in fx.wakeups  # the ack happened: the shell applies it anyway


def test_the_default_sampler_gets_no_row_views_and_a_subclass_reading_them_does() -> None:
    """The built-in `SequentialSampler.sample` reads no views: the core builds none for it
    (and trusts its prefix of the ready rows); a subclass with a ``sample`` (or
    ``sample_shares``) of its own may read them, and gets them all."""
    seen: list[dict[str, Any]] = []

    class Reading(SequentialSampler):
        def sample(self, ready: Any, batch_size: int, *a: Any, **kw: Any) -> Any:
            seen.append(kw)
            return super().sample(ready, batch_size, *a, **kw)

    class Shares(SequentialSampler):
        def sample_shares(self, *a: Any, **kw: Any) -> Any:
            seen.append(kw)
            return None

    class Renamed(SequentialSampler):  # the built-in sample, nothing else of its own
        pass

    for sampler, trusted in [
        (SequentialSampler(), True),
        (Renamed(), True),
        (Reading(), False),
        (Shares(), False),
    ]:
        core = new_core(sampler)
        put(core, 8)
        call = core.gets.look(batch(0), 0.0)
        assert call is not None
        assert not isinstance(call, MetaReply)
        assert call.trusted is trusted
        names = {"tags", "origin", "versions", "stale", "row_hosts"}
        assert (names <= call.ctx.keys()) is not trusted, type(sampler).__name__
        assert (call.stale is None) is trusted
        reply = core.decide(batch(0), 0.0, Effects())
        assert isinstance(reply, MetaReply)
        assert reply.rows == [0, 1, 2, 3]
    assert seen, "Reading.sample was called"
    assert {"tags", "origin", "versions", "stale", "row_hosts"} <= seen[0].keys()


class Eager(SequentialSampler):
    """An ``async`` answer computed when asked (the state may move before it is awaited)."""

    def sample(self, ready: Any, batch_size: int, *a: Any, **kw: Any) -> Any:  # type: ignore[override]
        rows = list(ready)[:batch_size]

        async def later() -> Any:
            return rows, rows

        return later()


def settle(core: ControllerCore, req: GetMeta, outcome: Any) -> Any:
    """Await ``async`` answers and resume until a reply or a wait."""

    async def answer(pending: Awaiting) -> Any:
        return await pending.answer

    while isinstance(outcome, Awaiting):
        outcome = core.resume(req, outcome, asyncio.run(answer(outcome)), 0.0, Effects())
    return outcome


def test_an_async_answer_naming_rows_of_a_unit_suspended_meanwhile_is_not_delivered() -> None:
    """A storage unit goes silent while an ``async`` sampler runs: the rows of its answer on
    that unit are not handed out (a suspended unit's rows are neither handed out nor lost);
    the request samples again, and gets them once the unit is back (before: delivered, and
    the consumer's read of them failed or hung). A plain sampler naming such a row fails."""
    core = new_core(Eager())
    put(core, 4)
    req = GetMeta("p", ["x"], 4, "t", None)
    pending = core.decide(req, 0.0, Effects())
    assert isinstance(pending, Awaiting)
    core.unit_down(0, 0.0)
    assert settle(core, req, pending) is None  # waits for the unit
    core.unit_up(0)
    reply = settle(core, req, core.decide(req, 0.0, Effects()))
    assert isinstance(reply, MetaReply)
    assert reply.rows == [0, 1, 2, 3]

    class Stubborn(BaseSampler):
        short_ready_ok = True  # asked on every look

        def sample(self, ready: Any, batch_size: int, **kw: Any) -> Any:
            return [0], [0]

    core = new_core(Stubborn())
    put(core, 1)
    core.unit_down(0, 0.0)
    with pytest.raises(InvalidRequestError, match="suspended"):
        core.decide(req, 0.0, Effects())
