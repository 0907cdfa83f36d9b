"""A storage unit restarted under the same id on a new address (issue 14, defect 7).

The documented recovery for a dead unit is to start it again with the same ``--unit-id``;
it binds a new port and registers. Running clients must learn the new address (the
controller's replies carry a units epoch that changes when a unit's address does, and a
client whose connection to a unit broke asks the controller again) and carry on: rows put
after the restart are read back; rows the killed unit held are lost, as documented.
"""

from __future__ import annotations

import signal
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

import tq_async as tq
from _cluster_proc import serve_role

_BIG = 64 * 1024  # puts this large go straight to the units


def _x(n: int, v: float) -> dict[str, torch.Tensor]:
    return {"x": torch.full((n, 1024), v)}


async def test_clients_follow_a_unit_restarted_on_a_new_port() -> None:
    with serve_role("controller") as (_, address):
        args = ("storage", "--controller", address)
        with (
            serve_role(*args, "--unit-id", "0", line="TQ_UNIT="),
            serve_role(*args, "--unit-id", "1", line="TQ_UNIT=") as (u1, unit1),
        ):
            async with (
                tq.AsyncClient.connect(address, request_timeout=10) as a,
                tq.AsyncClient.connect(address, request_timeout=10) as b,
            ):
                before = [await a.put(_x(64, float(i)), "p") for i in range(2)]  # 256 KiB each
                assert sorted(m.units[0] for m in before) == [0, 1]
                for i, m in enumerate(before):
                    assert (await a.get_data(m))["x"][0, 0].item() == i
                on_0 = next(m for m in before if m.units[0] == 0)
                on_1 = next(m for m in before if m.units[0] == 1)
                u1.send_signal(signal.SIGKILL)
                u1.wait(timeout=10)
                with serve_role(*args, "--unit-id", "1", line="TQ_UNIT=") as (_, again):
                    assert again.split()[0] == "1"
                    assert again.split()[1] != unit1.split()[1]  # a new port
                    # client a still holds a (broken) connection to the old address
                    after = [await a.put(_x(64, 10.0 + i), "q") for i in range(4)]
                    assert sorted(m.units[0] for m in after) == [0, 0, 1, 1]
                    for i, m in enumerate(after):
                        assert (await a.get_data(m))["x"][0, 0].item() == 10 + i
                        assert (await b.get_data(m))["x"][0, 0].item() == 10 + i
                    small = await b.put({"x": torch.arange(4)}, "r")  # one-message put
                    got = await a.get_meta(["x"], 4, "r", "t", timeout=5)
                    assert len(got) == 4
                    # rows of the surviving unit are intact; the killed unit's are lost
                    assert (await b.get_data(on_0))["x"][0, 0].item() == before.index(on_0)
                    with pytest.raises(tq.RowsNotFound):
                        await a.get_data(on_1)
                    lost = await a.lost_rows("p")
                    assert lost["rows"]["p"] == on_1.global_indexes
                    assert (await a.get_data(small))["x"].tolist() == [0, 1, 2, 3]
                    # a fresh client of the same cluster works too
                    async with tq.AsyncClient.connect(address, request_timeout=10) as c:
                        for m in after:
                            await c.get_data(m)


async def test_a_broken_unit_connection_asks_the_controller_again() -> None:
    """get_data of rows the client learnt of elsewhere: no controller reply told it the
    unit moved, so the broken connection itself makes it ask the controller."""
    with serve_role("controller") as (_, address):
        args = ("storage", "--controller", address, "--unit-id", "0")
        with serve_role(*args, line="TQ_UNIT=") as (u0, _):
            async with (
                tq.AsyncClient.connect(address, request_timeout=10) as reader,
                tq.AsyncClient.connect(address, request_timeout=10) as writer,
            ):
                m = await writer.put(_x(64, 1.0), "p")
                assert (await reader.get_data(m))["x"][0, 0].item() == 1.0  # connects
                u0.send_signal(signal.SIGKILL)
                u0.wait(timeout=10)
                with serve_role(*args, line="TQ_UNIT=") as _:
                    m = await writer.put(_x(64, 2.0), "p")
                    assert (await reader.get_data(m))["x"][0, 0].item() == 2.0


async def test_a_unit_registering_under_an_unnoticed_dead_id_takes_over() -> None:
    """The controller may not have noticed the old process die (a host that vanished is
    noticed only by heartbeats): a new registration under its id, which the old unit does
    not answer for, means its cells are gone, so its rows are reported lost instead of being
    read from an empty unit. (A live holder refuses the newcomer: see test_cli.)"""
    with serve_role("controller") as (_, address):
        args = ("storage", "--controller", address, "--unit-id", "0")
        with serve_role(*args, line="TQ_UNIT=") as (old_unit, _):
            async with tq.AsyncClient.connect(address, request_timeout=10) as client:
                old = await client.put(_x(64, 1.0), "p")
                small = await client.put({"y": torch.arange(2)}, "s")
                # its host vanished: nothing answers there, and no connection is closed
                old_unit.send_signal(signal.SIGSTOP)
                stack = ExitStack()
                stack.callback(old_unit.send_signal, signal.SIGCONT)
                with stack, serve_role(*args, line="TQ_UNIT=") as _:
                    lost = await client.lost_rows()
                    assert lost["rows"]["p"] == old.global_indexes
                    assert lost["rows"]["s"] == small.global_indexes
                    with pytest.raises(tq.RowsNotFound, match="lost with storage unit 0"):
                        await client.put(_x(64, 2.0), meta=old)
                    new = await client.put(_x(64, 3.0), "p")
                    assert (await client.get_data(new))["x"][0, 0].item() == 3.0


async def test_a_unit_back_at_its_address_is_reached_by_the_next_call(tmp_path: Path) -> None:
    """A durable unit SIGKILLed and restarted on its address and directory: while it was
    away, a read through the unit's address was refused ("nothing listens"), and the client
    kept that connection, which ZMQ dials again only every ``RECONNECT_IVL``. The calls made
    once the unit was back failed at once ("nothing listens at ..."), until ZMQ's next
    attempt. A broken unit connection is now dialled anew by the next call, as the
    controller's is: the first call after the unit is back reaches it."""
    import zmq

    from _chaos import free_port

    data_dir = tmp_path / "unit0"
    data_dir.mkdir()
    ctx = zmq.Context.instance()
    with serve_role("controller") as (_, address):
        args = ("storage", "--controller", address, "--unit-id", "0")
        args += ("--bind", f"tcp://127.0.0.1:{free_port()}")
        args += ("--durability", "process", "--data-dir", str(data_dir))
        async with tq.AsyncClient.connect(address, request_timeout=10) as client:
            with serve_role(*args, line="TQ_UNIT=") as (unit, _):
                meta = await client.put(_x(64, 1.0), "p")
                unit.send_signal(signal.SIGKILL)
                unit.wait(timeout=10)
            # ZMQ's next attempt on a refused connection is far off (100 ms by default: a
            # loaded machine or a quick caller meets that window)
            ctx.setsockopt(zmq.RECONNECT_IVL, 60_000)
            try:
                with pytest.raises(tq.BrokenError):
                    await client.get_data(meta)  # nothing listens there now
                with serve_role(*args, line="TQ_UNIT=") as _:
                    assert (await client.get_data(meta))["x"][0, 0].item() == 1.0
            finally:
                ctx.setsockopt(zmq.RECONNECT_IVL, 100)


@pytest.mark.parametrize("same_host", [True, False], ids=["same-host", "tcp"])
def test_a_blocking_client_reaches_a_unit_back_at_its_address_at_its_first_call(
    tmp_path: Path, same_host: bool
) -> None:
    """A durable unit SIGKILLed and restarted on its address and directory, the controller
    alive, while a blocking client made no call: its first call reaches the unit, as an
    AsyncClient's does. Over TCP it failed with BrokenError: the blocking client reads
    nothing between calls, so it found its unit connection broken only then."""
    from _chaos import free_port

    data_dir = tmp_path / "unit0"
    data_dir.mkdir()
    with serve_role("controller") as (_, address):
        args = ("storage", "--controller", address, "--unit-id", "0")
        args += ("--bind", f"tcp://127.0.0.1:{free_port()}")
        args += ("--durability", "process", "--data-dir", str(data_dir))
        with tq.Client.connect(address, request_timeout=10, same_host=same_host) as client:
            with serve_role(*args, line="TQ_UNIT=") as (unit, _):
                meta = client.put(_x(64, 1.0), "p")
                assert client.get_data(meta)["x"][0, 0].item() == 1.0
                unit.send_signal(signal.SIGKILL)
                unit.wait(timeout=10)
            with serve_role(*args, line="TQ_UNIT=") as _:
                assert client.get_data(meta)["x"][0, 0].item() == 1.0  # the first call
                again = client.put(_x(64, 2.0), "p")
                assert client.get_data(again)["x"][0, 0].item() == 2.0


async def test_rows_lost_with_a_unit_give_their_admission_slots_back(tmp_path: Path) -> None:
    """Unconsumed rows lost with a storage unit will never reach the learner: like cleared
    rows, they give their admission slots back. Before, each loss shrank the admission
    capacity for the rest of the run (producers waited forever once it was gone)."""
    config = tmp_path / "tq.toml"
    config.write_text('[admission]\ncapacity = 4\nlearner_task = "learn"\n')
    with serve_role("controller", "--config", str(config)) as (_, address):
        args = ("storage", "--controller", address, "--unit-id", "0")
        with serve_role(*args, line="TQ_UNIT=") as (unit, _):
            async with tq.AsyncClient.connect(address, request_timeout=10) as client:
                await client.acquire_rollout(0, 4)
                meta = await client.put(_x(4, 1.0), "p", policy_version=0)
                await client.get_meta(["x"], 1, "p", "learn")  # consumed: its slot is back
                assert (await client.staleness_status())["outstanding"] == 3
                unit.send_signal(signal.SIGKILL)
                unit.wait(timeout=10)
                with serve_role(*args, line="TQ_UNIT=") as _:
                    lost = await client.lost_rows("p")
                    assert lost["rows"]["p"] == meta.global_indexes
                    assert (await client.staleness_status())["outstanding"] == 0
                    await client.acquire_rollout(0, 4, timeout=5)
