"""Common mistakes explain themselves: typos in field names, addresses without a scheme,
nothing listening, CURVE keys the services refuse, ``await AsyncClient.connect(...)``."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest
import torch
import zmq
from tensordict import TensorDict

import tq_async as tq
from tq_async._deploy._status import run_status


async def put_rows(client: tq.AsyncClient) -> None:
    data = TensorDict({"input_ids": torch.zeros(2, 3), "reward": torch.ones(2)}, [2])
    await client.put(data, partition_id="p")


async def test_a_typo_in_a_field_name_says_which_field_no_row_has(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        cluster.controller.waiting_warning_after = 0.05
        await put_rows(client)
        with (
            caplog.at_level(logging.WARNING, logger="tq_async"),
            pytest.raises(tq.TQTimeoutError) as info,
        ):
            await client.get_meta(["input_ids", "rewrd"], 2, "p", "learner", timeout=1.0)
        message = str(info.value)
        assert "no row of partition 'p' has the field(s) ['rewrd']" in message
        assert "it has ['input_ids', 'reward']" in message
        assert "nothing was consumed" in message
        # the warning came while it waited (after waiting_warning_after)
        [warning] = [r for r in caplog.records if "get_meta has waited" in r.getMessage()]
        assert warning.levelno == logging.WARNING
        assert "['rewrd']" in warning.getMessage()
        assert warning.tq_event["task"] == "learner"  # type: ignore[attr-defined]


async def test_get_data_checks_its_fields_as_get_meta_checks_data_fields() -> None:
    """``get_data(meta, "input_ids")`` (one name, not a list) read the fields 'i', 'n', ...
    and failed with `RowsNotFound` for field 'i'; a name that is not a string reached the
    unit and came back as a `ProtocolError` ("malformed request"). Both are refused before
    anything is sent, naming the argument, as `get_meta` refuses its ``data_fields``."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        data = TensorDict({"input_ids": torch.zeros(2, 3), "reward": torch.ones(2)}, [2])
        meta = await client.put(data, partition_id="p")
        with pytest.raises(tq.InvalidRequestError, match=r"write fields=\['input_ids'\]"):
            await client.get_data(meta, "input_ids")
        for bad in ([1], ["reward", None], [""], b"reward"):
            with pytest.raises(tq.InvalidRequestError, match="fields"):
                await client.get_data(meta, bad)  # type: ignore[arg-type]
        # what worked still works: any sequence of names, none at all, a name twice
        assert list((await client.get_data(meta, ("reward",))).keys()) == ["reward"]
        assert (await client.get_data(meta, [])).batch_size == torch.Size([2])
        td = await client.get_data(meta, ["reward", "input_ids", "reward"])
        assert sorted(td.keys()) == ["input_ids", "reward"]


async def test_a_meta_that_is_not_a_batch_meta_is_refused_naming_the_call() -> None:
    """Every call that takes a `BatchMeta` says so when it gets something else -- a
    ``tq_async.compat`` BatchMeta (a migration half done), a dict, a list, None -- instead
    of failing with ``AttributeError`` (or, for ``ack``, ignoring it)."""
    from tq_async.compat import BatchMeta as CompatMeta

    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        meta = await client.put(TensorDict({"x": torch.ones(2)}, [2]), partition_id="p")
        compat = CompatMeta.from_native(meta)
        calls: dict[str, Any] = {
            "get_data": lambda m: client.get_data(m),
            "put": lambda m: client.put(TensorDict({"y": torch.ones(2)}, [2]), meta=m),
            "put_nowait": lambda m: client.put_nowait({"y": torch.ones(2)}, meta=m),
            "clear_samples": lambda m: client.clear_samples(m),
            "set_tags": lambda m: client.set_tags(m, [{}, {}]),
            "release": lambda m: client.release(m),
            "ack": lambda m: client.ack(m),
            "ack=": lambda m: client.get_meta(["x"], 1, "p", "t", mode="peek", ack=m),
        }
        for bad in (compat, {"x": 1}, [compat], 3):
            for name, call in calls.items():
                with pytest.raises(tq.InvalidRequestError, match="BatchMeta") as info:
                    await call(bad)
                said = name.rstrip("=").removesuffix("_nowait")
                assert str(info.value).startswith(f"{said} takes a tq_async.BatchMeta")
                if bad is compat:
                    assert "to_native()" in str(info.value)
        for name in ("get_data", "clear_samples", "set_tags", "release"):
            with pytest.raises(tq.InvalidRequestError, match=f"{name} takes a"):
                await calls[name](None)
        assert (await client.partition_info("p"))["rows"] == 2  # nothing was done


async def test_a_sampling_config_that_is_not_a_dict_of_names_is_refused() -> None:
    """A ``sampling_config`` that is no mapping failed with a bare ``TypeError`` /
    ``ValueError`` (``dict()`` of it), and one with a key that is not a string reached the
    controller and came back as a `ProtocolError` (logged there as a malformed request)."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await put_rows(client)
        for bad in ([1], "dp_rank", [("dp_rank", 0)], {0: "dp_rank"}):
            with pytest.raises(tq.InvalidRequestError, match="sampling_config"):
                await client.get_meta(["reward"], 1, "p", "t", bad, timeout=0)  # type: ignore[arg-type]
        meta = await client.get_meta(["reward"], 2, "p", "t", timeout=0)
        assert meta.global_indexes == [0, 1]  # nothing was consumed by the refused calls


async def test_tags_that_are_not_a_list_of_one_dict_per_row_are_refused() -> None:
    """``tags`` given as one dict (meant for every row), as a generator or as None where a
    list is needed failed with a bare ``TypeError`` (``len()`` of it) or, for a dict of as
    many keys as rows, with an error about its first key. Each says what tags are."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        data = TensorDict({"x": torch.ones(1)}, [1])
        meta = await client.put(data, partition_id="p")
        for bad in ({"uid": 1}, ({"uid": i} for i in range(1)), "uid"):
            with pytest.raises(tq.InvalidRequestError, match="one dict per row"):
                await client.put(data, partition_id="p", tags=bad)  # type: ignore[arg-type]
            with pytest.raises(tq.InvalidRequestError, match="one dict per row"):
                await client.set_tags(meta, bad)  # type: ignore[arg-type]
            with pytest.raises(tq.InvalidRequestError, match="one dict per row"):
                await client.kv_batch_put(["k"], "kv", None, bad)  # type: ignore[arg-type]
        with pytest.raises(tq.InvalidRequestError, match="one dict per row"):
            await client.set_tags(meta, None)  # type: ignore[arg-type]
        assert (await client.partition_info("p"))["rows"] == 1  # nothing was written


async def test_waiting_on_a_partition_that_does_not_exist_says_so() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        with pytest.raises(tq.TQTimeoutError, match="partition 'trian@0' does not exist"):
            await client.get_meta(["x"], 1, "trian@0", "learner", timeout=0.1)
        await put_rows(client)
        # the fields exist, the rows are just not enough: the old message
        with pytest.raises(tq.TQTimeoutError, match="found fewer than 4 ready rows"):
            await client.get_meta(["reward"], 4, "p", "learner", timeout=0.1)


async def test_a_field_one_or_two_edits_from_a_known_one_is_said_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        assert cluster.controller.waiting_warning_after == 30  # the general warning's default
        await put_rows(client)
        with caplog.at_level(logging.WARNING, logger="tq_async"):
            with pytest.raises(tq.TQTimeoutError, match="did you mean 'input_ids'"):
                await client.get_meta(["input_id"], 2, "p", "learner", timeout=0.3)
            # said when the request started waiting, not after waiting_warning_after
            [warning] = [r for r in caplog.records if "did you mean" in r.getMessage()]
            assert "get_meta waits for field 'input_id'" in warning.getMessage()
            assert "did you mean 'input_ids'?" in warning.getMessage()
            caplog.clear()
            with pytest.raises(tq.TQTimeoutError, match="did you mean 'input_ids'"):
                await client.get_meta(["input_id"], 2, "p", "learner", timeout=0.1)
            assert not caplog.records  # said once per task and name, not on every wait
            # a field far from every known one, or a numbered sibling, is not a typo
            for field in ("values", "reward2"):
                with pytest.raises(tq.TQTimeoutError) as info:
                    await client.get_meta([field], 2, "p", "learner", timeout=0.1)
                assert "did you mean" not in str(info.value)
            assert not caplog.records


async def test_waiting_on_an_unknown_partition_lists_the_known_ones() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.zeros(2)}, partition_id="train@0")
        with pytest.raises(tq.TQTimeoutError) as info:
            await client.get_meta(["x"], 1, "trian@0", "learner", timeout=0.1)
        assert "known partitions: ['train@0']" in str(info.value)
        assert "did you mean 'train@0'?" in str(info.value)
        with pytest.raises(tq.TQTimeoutError) as info:  # the next step's, not a typo
            await client.get_meta(["x"], 1, "train@1", "learner", timeout=0.1)
        assert "known partitions: ['train@0']" in str(info.value)
        assert "did you mean" not in str(info.value)


async def test_no_warning_when_the_rows_are_only_late(caplog: pytest.LogCaptureFixture) -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        cluster.controller.waiting_warning_after = 0.05
        await put_rows(client)
        with (
            caplog.at_level(logging.WARNING, logger="tq_async"),
            pytest.raises(tq.TQTimeoutError),
        ):
            await client.get_meta(["reward"], 4, "p", "learner", timeout=0.3)
        assert not [r for r in caplog.records if "get_meta has waited" in r.getMessage()]


@pytest.mark.parametrize("connect", [tq.AsyncClient.connect, tq.Client.connect])
def test_an_address_without_a_scheme_gets_a_hint(connect: object) -> None:
    with pytest.raises(tq.InvalidRequestError, match=r"did you mean 'tcp://127\.0\.0\.1:5555'"):
        connect("127.0.0.1:5555")  # type: ignore[operator]
    with pytest.raises(tq.InvalidRequestError, match="unsupported scheme"):
        connect("http://127.0.0.1:5555")  # type: ignore[operator]


async def test_a_silent_peer_fails_within_the_connect_timeout() -> None:
    assert tq.AsyncClient("tcp://127.0.0.1:9").connect_timeout <= 10
    with socket.socket() as listener:  # accepts (the kernel does) but never speaks ZMTP
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        t0 = time.monotonic()
        client = tq.AsyncClient.connect(address, connect_timeout=0.3)
        with pytest.raises(tq.TQTimeoutError, match=f"nothing answered at {address}"):
            async with client:
                pass
        assert time.monotonic() - t0 < 5
        assert client.request_timeout == 60.0  # separate from the connect timeout


async def test_a_silent_peer_given_up_after_a_shorter_request_timeout_names_it() -> None:
    """`open` waits for the first answer ``min(connect_timeout, request_timeout)``: given up
    after a ``request_timeout`` of 0.3 s, the error named ``connect_timeout`` (10 s, never
    changed) as the limit to raise."""
    with socket.socket() as listener:  # accepts (the kernel does) but never speaks ZMTP
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        why = r"within 0\.3 s \(request_timeout, shorter than connect_timeout\)"
        with pytest.raises(tq.TQTimeoutError, match=why):
            async with tq.AsyncClient.connect(address, request_timeout=0.3):
                pass
        with pytest.raises(tq.TQTimeoutError, match=why):
            await anyio.to_thread.run_sync(
                lambda: tq.Client.connect(address, request_timeout=0.3).open()
            )
        with pytest.raises(tq.TQTimeoutError, match=r"within 0\.3 s \(connect_timeout\)"):
            async with tq.AsyncClient.connect(address, connect_timeout=0.3, request_timeout=0.3):
                pass


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), True, "5", 0, -1])
@pytest.mark.parametrize("cls", [tq.AsyncClient, tq.Client])
def test_a_connect_timeout_that_is_not_seconds_is_refused_at_once(cls: Any, bad: Any) -> None:
    """``connect_timeout`` is checked as ``request_timeout`` is: NaN passed (and with a
    silent peer `open` then waited for ever: ``min(nan, request_timeout)`` is NaN), so did
    infinity and True, and a string failed with a bare TypeError."""
    with pytest.raises(tq.InvalidRequestError, match="connect_timeout"):
        cls("tcp://127.0.0.1:9", connect_timeout=bad)


@pytest.mark.parametrize("cls", [tq.AsyncClient, tq.Client])
def test_a_host_id_or_curve_of_the_wrong_type_is_refused_at_once(cls: Any) -> None:
    """``host_id=3`` reached the controller with the first Hello and came back as a
    `ProtocolError` (a "malformed request" logged by the service); ``curve`` that is not a
    `CurveClient` failed with ``AttributeError``. Both are refused when the client is made."""
    with pytest.raises(tq.InvalidRequestError, match="host_id"):
        cls("tcp://127.0.0.1:9", host_id=3)
    with pytest.raises(tq.InvalidRequestError, match="curve"):
        cls("tcp://127.0.0.1:9", curve="server-public-key")
    assert cls("tcp://127.0.0.1:9", host_id="rack-2/node-7").host_id == "rack-2/node-7"


async def open_once(connect: Any, address: str) -> None:
    if connect == tq.Client.connect:

        def blocking() -> None:
            with connect(address):
                pass

        await anyio.to_thread.run_sync(blocking)
    else:
        async with connect(address):
            pass


@pytest.mark.parametrize("connect", [tq.AsyncClient.connect, tq.Client.connect])
async def test_a_refused_connection_fails_at_once(connect: Any) -> None:
    with socket.socket() as bound:  # bound, never listening: every connection is refused
        bound.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{bound.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(tq.BrokenError, match=f"nothing listens at {address}") as info:
            await open_once(connect, address)
        assert time.monotonic() - t0 < 3  # not the 10 s connect timeout
        assert not isinstance(info.value, tq.AuthenticationError)


async def test_a_peer_that_accepts_and_drops_is_not_an_authentication_failure() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        stop = threading.Event()

        def accept_and_drop() -> None:
            listener.settimeout(0.05)
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    listener.accept()[0].close()

        thread = threading.Thread(target=accept_and_drop, daemon=True)
        thread.start()
        try:
            client = tq.AsyncClient.connect(address, connect_timeout=5)
            with pytest.raises(tq.BrokenError, match="not a tq_async service") as info:
                async with client:
                    pass
            assert not isinstance(info.value, tq.AuthenticationError)
            assert "CURVE" not in str(info.value)
        finally:
            stop.set()
            thread.join(timeout=5)


async def test_await_connect_shows_the_right_form() -> None:
    with pytest.raises(tq.InvalidRequestError, match=r"async with tq\.AsyncClient\.connect"):
        await tq.AsyncClient.connect("tcp://127.0.0.1:9")  # type: ignore[misc]


async def test_refused_curve_keys_are_an_authentication_failure() -> None:
    server_public, server_secret = tq.curve_keypair()
    client_public, client_secret = tq.curve_keypair()
    other_public, other_secret = tq.curve_keypair()
    server = tq.CurveServer(server_public, server_secret, allowed_clients=[client_public])
    async with tq.local_cluster(num_storage_units=1, curve=server, transport="tcp") as cluster:
        cases = {
            "rejected this client's CURVE key": tq.CurveClient(
                server_public, other_public, other_secret
            ),
            "dropped the security handshake: check that server_public_key": tq.CurveClient(
                other_public, client_public, client_secret
            ),
            "connect with curve=tq.CurveClient": None,
        }
        for message, curve in cases.items():
            client = tq.AsyncClient.connect(cluster.address, curve=curve, connect_timeout=5)
            with pytest.raises(tq.AuthenticationError, match=message.replace("(", r"\(")):
                async with client:
                    pass
        good = tq.CurveClient(server_public, client_public, client_secret)
        async with tq.AsyncClient.connect(cluster.address, curve=good) as client:
            assert await client.list_partitions() == []
    assert issubclass(tq.AuthenticationError, tq.BrokenError)


def test_a_storage_unit_with_a_controller_address_without_a_scheme() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tq_async._deploy._cli",
            "serve",
            "storage",
            "--controller",
            "h:5555",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2  # a bad command line (docs/deployment.md, `tq-async serve`)
    assert "did you mean 'tcp://h:5555'?" in done.stderr


async def test_a_forgotten_seal_gets_one_warning_naming_the_partition_and_the_fix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    deadlines = tq.Deadlines(waiting_warning_after=0.1)
    async with (
        tq.local_cluster(num_storage_units=1, deadlines=deadlines) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        assert cluster.controller.waiting_warning_after == 0.1
        await put_rows(client)
        meta = await client.get_meta(["reward"], 2, "p", "learner")
        assert len(meta) == 2  # drained: every row consumed, nothing sealed
        with (
            caplog.at_level(logging.WARNING, logger="tq_async"),
            pytest.raises(tq.TQTimeoutError),
        ):
            await client.get_meta(["reward"], 2, "p", "learner", timeout=0.6)
        warnings = [r for r in caplog.records if "not sealed" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]  # one, not one a period
        message = warnings[0].getMessage()
        assert "partition 'p'" in message
        assert "the task consumed 2 of its 2 rows" in message
        assert "client.seal('p')" in message
        assert "timeout=" in message
        assert "stop_when_consumed=True" in message
        assert warnings[0].tq_event["consumed"] == 2  # type: ignore[attr-defined]
        # sealed: the same wait ends at once, with no warning
        caplog.clear()
        await client.seal("p")
        with caplog.at_level(logging.WARNING, logger="tq_async"):
            end = await client.get_meta(["reward"], 2, "p", "learner", timeout=5)
        assert end.end_of_stream
        assert not [r for r in caplog.records if "not sealed" in r.getMessage()]


async def test_no_forgotten_seal_warning_while_rows_keep_coming(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        cluster.controller.waiting_warning_after = 0.15
        await put_rows(client)
        with caplog.at_level(logging.WARNING, logger="tq_async"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.get_meta, ["reward"], 12, "p", "learner")
                for _ in range(5):  # a slow producer: a row every 0.1 s, quiet never 0.15 s
                    await anyio.sleep(0.1)
                    await put_rows(client)
            # 2 + 5 x 2 rows: the waiter got its batch of 12
        assert not [r for r in caplog.records if "not sealed" in r.getMessage()]


@pytest.mark.parametrize("blocking", [False, True])
async def test_sealing_a_partition_that_does_not_exist_names_the_known_ones(
    blocking: bool,
) -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(TensorDict({"x": torch.zeros(2)}, [2]), partition_id="train@0")

        async def seal(pid: str, **kw: bool) -> None:
            if blocking:

                def blocking_seal() -> None:
                    with tq.Client.connect(cluster.address) as sync:
                        sync.seal(pid, **kw)

                await anyio.to_thread.run_sync(blocking_seal)
            else:
                await client.seal(pid, **kw)

        with pytest.raises(tq.PartitionNotFound) as info:
            await seal("train_0")
        assert "cannot seal partition 'train_0'" in str(info.value)
        assert "known partitions: ['train@0']" in str(info.value)
        assert "create=True" in str(info.value)
        assert await client.list_partitions() == ["train@0"]  # the typo created nothing
        await seal("train@1", create=True)  # the explicit form: created empty and sealed
        assert (await client.partition_info("train@1"))["sealed"]
        end = await client.get_meta(["x"], 1, "train@1", "t", timeout=5)
        assert end.end_of_stream


async def test_curve_keys_against_services_without_curve_say_so() -> None:
    server_public, _ = tq.curve_keypair()
    client_public, client_secret = tq.curve_keypair()
    curve = tq.CurveClient(server_public, client_public, client_secret)
    async with tq.local_cluster(num_storage_units=1, transport="tcp") as cluster:
        client = tq.AsyncClient.connect(cluster.address, curve=curve, connect_timeout=5)
        with pytest.raises(tq.AuthenticationError, match="does not use CURVE encryption"):
            async with client:
                pass


async def test_register_tasks_with_its_arguments_swapped_or_one_name_says_so() -> None:
    """``register_tasks("actor")`` would have been five one-letter tasks, and the two
    arguments swapped a ProtocolError from the controller's decoder; both are named here."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await put_rows(client)
        with pytest.raises(tq.InvalidRequestError, match=r"\['actor'\]"):
            await client.register_tasks("actor", "p")
        with pytest.raises(tq.InvalidRequestError, match="partition_id"):
            await client.register_tasks("p", ["actor"])  # type: ignore[arg-type]
        with pytest.raises(tq.InvalidRequestError, match="task names"):
            await client.register_tasks([1, 2], "p")  # type: ignore[list-item]
        await client.register_tasks(("actor", "critic"), "p")  # any sequence of names
        await client.register_tasks([], "p")  # off


async def test_numpy_scalars_work_where_ints_and_seconds_are_expected() -> None:
    """Configs and arrays hand out numpy scalars: ``np.int64(2)`` as a batch size or a
    rank, ``np.float32(5.0)`` as a timeout. They were refused ("batch_size must be an int,
    got int64", "timeout must be a number of seconds, got float32") where an int or a
    float works; they are taken as the ints and floats they are (bools stay refused)."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(
            cluster.address,
            request_timeout=np.float32(30.0),
            connect_timeout=np.int64(10),
            retry_after=np.float64(5.0),
            busy_poll=np.float32(0.0),
            inline_put_bytes=np.int64(1024),
        ) as client,
    ):
        assert type(client.request_timeout) is float
        assert type(client.inline_put_bytes) is int
        meta = await client.put({"x": torch.arange(8.0)}, "p", timeout=np.float32(5.0))
        got = await client.get_meta(
            ["x"], np.int64(2), "p", "t", timeout=np.float32(5.0), lease=np.int64(30)
        )
        assert got.global_indexes == [0, 1]
        config = {"dp_rank": np.int64(1), "dp_size": np.int64(2), "batch_index": np.int64(0)}
        td, ranked = await client.get(["x"], np.int32(2), "p", "ranks", config, timeout=5)
        assert len(ranked) == 2
        assert td.batch_size == torch.Size([2])
        first = {**config, "dp_rank": np.int64(0)}
        batches = await client.get_batches(
            ["x"], 1, "p", "ahead", first, also=[np.int64(1)], timeout=5
        )
        assert [m.batch_index for _, m in batches] == [0, 1]
        keyed = await client.kv_batch_put(["a", "b"], "kv", {"x": torch.ones(2)})
        rows = np.array(keyed.global_indexes)
        assert await client.kv_retrieve_keys(rows, "kv") == ["a", "b"]
        assert await client.kv_retrieve_keys(list(rows), "kv") == ["a", "b"]
        assert await client.check_production_status("p", ["x"], list(rows))
        await client.acquire_rollout(np.int64(0), np.int64(1), timeout=np.float32(5.0))
        await client.release_rollout(np.int64(1))
        for bad in (np.bool_(True), True, np.float64(2.0), "2"):
            with pytest.raises(tq.InvalidRequestError, match="batch_size"):
                await client.get_meta(["x"], bad, "p", "t")  # type: ignore[arg-type]
        with pytest.raises(tq.InvalidRequestError, match="timeout"):
            await client.get_meta(["x"], 1, "p", "t", timeout=np.float32("nan"))
        assert len(meta) == 8


async def test_a_storage_units_address_for_the_controllers_says_which_to_give(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client (or ``tq-async status``) given a storage unit's address (the ``TQ_UNIT=``
    line) instead of the controller's failed with "malformed request: Invalid value 'Hello'
    - at `$[1][0]`"; the unit now says whose address it is and which to give. The
    controller logged its own malformed requests as a "service"'s."""
    async with tq.local_cluster(num_storage_units=1, transport="tcp") as cluster:
        unit_address = cluster.units[0].address
        with pytest.raises(tq.ProtocolError) as info:
            async with tq.AsyncClient.connect(unit_address, request_timeout=10):
                pass
        assert str(info.value) == (
            "this address is a storage unit's, and Hello is a request for the controller: "
            "give the controller's address (tq-async serve prints the controller's as "
            "TQ_ADDRESS=..., a storage unit's as TQ_UNIT=<id> ...)"
        )
        with pytest.raises(tq.ProtocolError, match="give the controller's address"):
            await run_status(unit_address)
        with caplog.at_level(logging.WARNING, logger="tq_async"):
            cluster.controller.on_message(b"peer", [zmq.Frame(b"\x93\x01\x92\xa3Bad\x00\xc0")])
        assert "malformed controller request" in caplog.text


async def test_names_kept_in_a_numpy_array_are_taken_as_a_list() -> None:
    """Field names and keys kept in a numpy array (``np.array(["x"])``, keys from a
    dataframe column) were refused, the error advising ``data_fields=[array(['x'],
    dtype='<U1')]``. A 1-D array is taken as the list of its names; anything else that is
    not a list is refused with an example of one."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        meta = await client.put({"x": torch.arange(2.0)}, "p")
        got = await client.get_meta(np.array(["x"]), 2, "p", "t", timeout=5)
        assert got.field_names == ["x"]
        td = await client.get_data(meta, np.array(["x"]))
        assert td["x"].tolist() == [0.0, 1.0]
        keys = np.array(["a", "b"])
        await client.kv_batch_put(keys, "kv", {"x": torch.ones(2)})
        assert (await client.kv_batch_get(keys, "kv")).batch_size == torch.Size([2])
        assert await client.kv_retrieve_keys([0, 1], "kv") == ["a", "b"]
        with pytest.raises(tq.InvalidRequestError) as info:
            await client.get_meta({"x"}, 1, "p", "t")  # type: ignore[arg-type]
        assert "write data_fields=['input_ids', ...]" in str(info.value)


async def test_a_field_named_twice_is_read_once_and_listed_once() -> None:
    """``get(["b", "a", "b"], ...)`` returned a BatchMeta whose ``field_names`` named b
    twice while its data had b once (and a later ``get_data(meta)`` asked for it twice):
    each name counts once now, in the order first given, for every call taking fields."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"a": torch.arange(2), "b": torch.arange(2) + 5}, "p")
        td, meta = await client.get(["b", "a", "b"], 2, "p", "t")
        assert meta.field_names == ["b", "a"]
        assert sorted(td.keys()) == ["a", "b"]
        assert td["b"].tolist() == [5, 6]
        peek = await client.get_meta(("a", "a"), 2, "p", "u", mode="peek")
        assert peek.field_names == ["a"]
        data = await client.get_data(meta, fields=["a", "a"])
        assert list(data.keys()) == ["a"]
