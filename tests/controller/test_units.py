"""The controller's links to its storage units (`tq_async._controller._units.UnitLinks`)."""

from __future__ import annotations

import anyio
import torch
import zmq

import tq_async as tq
from _cluster_proc import free_port, serve_role
from tq_async._controller._server import ControllerServer
from tq_async._core._state import ControllerState
from tq_async._wire._protocol import StoreStats


async def test_a_request_waiting_on_a_unit_that_registers_again_breaks_retryably() -> None:
    """A unit that restarts registers again and the controller replaces its link: what the
    controller forwarded on the old link (a client's one-message put, a clear) fails with
    a BrokenError, which travels to the client as "retry" (the chaos test caught a
    ClosedError there, the error of a client its own program closed)."""
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # takes requests, never answers: the unit is going away
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        server = ControllerServer(ControllerState({0: f"tcp://127.0.0.1:{port}"}))
        links = server._links
        failed: list[BaseException] = []
        async with anyio.create_task_group() as tg:

            async def forwarded() -> None:
                try:
                    await links.conn(0).request(StoreStats(), timeout=30)
                except tq.TQError as exc:
                    failed.append(exc)

            tg.start_soon(forwarded)
            await anyio.wait_all_tasks_blocked()
            links._register(0, "tcp://127.0.0.1:1", "", "")  # the restarted unit, elsewhere
        [exc] = failed
        assert isinstance(exc, tq.BrokenError), repr(exc)
        assert "retry" in str(exc)
        links.close()
    finally:
        silent.close(linger=0)


async def test_a_unit_the_controller_can_never_reach_is_declared_lost() -> None:
    """A unit registers, but the controller's first connection to it is refused (here its
    advertised address is one where nothing listens; in a cluster, a unit SIGKILLed right
    after it registered, before the controller's link was up). Before, the controller was
    never told: the unit stayed "up" for good, and puts placed rows on it that failed. Now
    the refusal suspends it and, its process being gone (or unreachable), declares it lost
    at once, as a unit refused after a disconnect is."""
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    with (
        serve_role("controller", "--bind", address),
        serve_role("storage", "--controller", address, "--advertise", "127.0.0.2", line="TQ_UNIT="),
    ):
        async with (
            tq.AsyncClient.connect(address, request_timeout=10) as client,
            client.watch(kinds=["unit_lost"]) as events,  # subscribed: nothing after is missed
        ):
            with anyio.fail_after(30):
                if not (await client.lost_rows())["dead_units"]:
                    assert (await events.__anext__()).unit == 0
            assert (await client.lost_rows())["dead_units"] == [0]


async def test_a_unit_suspend_after_of_months_is_taken() -> None:
    """``unit_suspend_after`` is any positive finite number of seconds; the controller's
    links to its units carry it as ZMTP's heartbeat timeout, in milliseconds, which zmq keeps
    in a C int. Before, 3e6 s (35 days) overflowed it: the controller's first link raised
    OverflowError and the cluster never started. Now the heartbeat waits as long as zmq can
    (24.8 days)."""
    deadlines = tq.Deadlines(unit_suspend_after=3e6, unit_lost_after=1e12)
    async with (
        tq.local_cluster(2, deadlines=deadlines) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(4)}, "p")
        got, _ = await client.get(["x"], 4, "p", "t", timeout=30)
        assert got["x"].tolist() == [0, 1, 2, 3]
