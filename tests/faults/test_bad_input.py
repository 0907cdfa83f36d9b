"""Bad input gets a clear TQError, changes nothing, and the service keeps answering."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio
from tensordict import TensorDict

import tq_async as tq
from tq_async._wire._protocol import GetMeta, ListPartitions, Reply, StoreGet, encoder


async def test_client_side_argument_errors() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        with pytest.raises(tq.InvalidRequestError, match=r"data_fields=\['x'\]"):
            await client.get_meta("x", 1, "p", "t")  # type: ignore[arg-type]
        for bad in (0, -3, 1.5, True):
            with pytest.raises(tq.InvalidRequestError, match="batch_size"):
                await client.get_meta(["x"], bad, "p", "t")  # type: ignore[arg-type]
        with pytest.raises(tq.InvalidRequestError, match="mode"):
            await client.get_meta(["x"], 1, "p", "t", mode="steal")
        with pytest.raises(tq.InvalidRequestError, match="partition_id"):
            await client.put({"x": torch.zeros(1)})
        assert await client.list_partitions() == []


async def test_get_data_fields_are_a_list_of_names() -> None:
    # a str was read letter by letter ("xy": fields x and y, silently); a non-str name
    # reached the unit, which logged a malformed request and answered a ProtocolError
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        meta = await client.put({"x": torch.ones(2), "y": torch.zeros(2)}, "p")
        for bad in ("xy", "x", ""):
            with pytest.raises(tq.InvalidRequestError, match=rf"write fields=\[{bad!r}\]"):
                await client.get_data(meta, bad)
        for bad_list in ([1], ["x", ""], [None]):
            with pytest.raises(tq.InvalidRequestError, match="fields must be a non-empty list"):
                await client.get_data(meta, bad_list)  # type: ignore[list-item]
        assert list((await client.get_data(meta, ("y",))).keys()) == ["y"]
        assert list((await client.get_data(meta, [])).keys()) == []


async def test_a_device_that_cannot_receive_a_read_is_refused_before_anything_is_read() -> None:
    # device="meta" (or "cuda" on a torch without CUDA) failed with torch's raw
    # AssertionError "Torch not compiled with CUDA enabled", after the rows were read
    bad = ["meta", "xpu"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:0"])
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        meta = await client.put({"x": torch.ones(2)}, "p")
        for device in bad:
            with pytest.raises(tq.InvalidRequestError, match=rf"device '{device}' cannot receive"):
                await client.get_data(meta, device=device)
            with pytest.raises(tq.InvalidRequestError, match=rf"device '{device}' cannot receive"):
                await client.get(["x"], 2, "p", "t", device=device)
        td, _ = await client.get(["x"], 2, "p", "t", timeout=5, device="cpu")  # rows still there
        assert td["x"].tolist() == [1.0, 1.0]


async def test_a_bare_value_as_a_column_says_what_a_column_is() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        what = (
            r"field 'prompt' is a single str, not a column.*: a column is a tensor or a list of n"
        )
        # alone: the batch has no rows (a SchemaError, as a 0-dim tensor); beside a column
        # of 2 rows: a value of the wrong type (UnsupportedTypeError); the same explanation
        for batch, error in (
            ({"prompt": "hello"}, tq.SchemaError),
            ({"prompt": "hello", "x": [1, 2]}, tq.UnsupportedTypeError),
        ):
            with pytest.raises(error, match=what + r".*\['hello'\]"):
                await client.put(batch, partition_id="p")
        with pytest.raises(tq.SchemaError, match="field 'n' is a single int, not a column"):
            await client.put({"n": 3}, partition_id="p")
        assert await client.list_partitions() == []


async def test_schema_violations_change_nothing() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        meta = await client.put({"x": torch.zeros(2, 3)}, partition_id="p")
        with pytest.raises(tq.SchemaError, match=r"float32.*float64.*convert"):
            await client.put({"x": torch.zeros(2, 3, dtype=torch.float64)}, partition_id="p")
        # row shapes may change from put to put (issue 16); their number of dimensions and
        # the kind of values may not
        with pytest.raises(tq.SchemaError, match=r"\[3\].*\[3,1\].*dimensions"):
            await client.put({"x": torch.zeros(2, 3, 1)}, partition_id="p")
        with pytest.raises(tq.SchemaError, match="batch has 2 rows"):
            await client.put({"x": torch.zeros(2, 3), "y": torch.zeros(3)}, partition_id="p")
        with pytest.raises(tq.SchemaError, match="object"):
            await client.put({"x": ["a", "b"]}, partition_id="p")
        with pytest.raises(tq.SchemaError, match="meta has 2"):
            await client.put({"y": torch.zeros(3)}, meta=meta)
        with pytest.raises(tq.UnsupportedTypeError, match=r"'obj'.*object"):
            await client.put({"obj": [object(), object()]}, partition_id="p")
        info = await client.partition_info("p")
        assert info["rows"] == 2
        assert set(info["fields"]) == {"x"}


async def test_unknown_partition_on_status_calls() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        # readiness checks answer "not yet" for a partition with no rows (issue 16): a loop
        # polling them may start before the first put
        assert await client.check_consumption_status("nope", "t") is False
        assert await client.check_production_status("nope", ["x"]) is False
        for call in (
            client.consumption_status("nope", "t"),
            client.production_status("nope"),
            client.partition_info("nope"),
            client.clear_partition("nope"),
            client.reset_consumption("nope"),
        ):
            with pytest.raises(tq.PartitionNotFound, match="'nope'"):
                await call
        assert await client.list_partitions() == []


async def test_pickle_needs_opt_in_on_both_sides() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address, allow_pickle=True) as client,
    ):
        with pytest.raises(tq.SchemaError, match="does not allow pickle"):
            await client.put({"t": [(1, 2)]}, partition_id="p")
        assert await client.list_partitions() == ["p"]  # created, but no rows left behind
        assert (await client.partition_info("p"))["rows"] == 0
    async with (
        tq.local_cluster(num_storage_units=1, allow_pickle=True) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        assert client.allow_pickle  # follows the deployment
        meta = await client.put({"t": [(1, 2), {3}]}, partition_id="p")
        td = await client.get_data(meta)
        assert td.get("t").tolist() == [(1, 2), {3}]


@asynccontextmanager
async def dealer(address: str) -> AsyncIterator[zmq.asyncio.Socket]:
    """A fresh DEALER connected to ``address``, closed on leaving."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close()


async def raw_request(address: str, frames: list[bytes]) -> list[bytes] | None:
    """Send raw frames on a fresh DEALER; the reply's frames, or None if none within 1 s."""
    async with dealer(address) as sock:
        await sock.send_multipart(frames)
        if await sock.poll(1000):
            return list(await sock.recv_multipart())
        return None


def _decoded(frames: list[bytes]) -> Reply:
    return msgspec.msgpack.decode(frames[0], type=Reply)


#: the request id of `replies_before_a_marker`'s marker (no frame of these tests uses it)
MARKER = 424242


async def replies_before_a_marker(address: str, frames: list[bytes]) -> list[Reply]:
    """Send raw frames on a fresh DEALER, then a `ListPartitions` marker on it: the replies
    that came before the marker's. A service answers a malformed message as it reads it, in
    the order of its connection, so its reply (if any) comes first: no fixed wait for a
    reply that may never come (a storage unit answers the marker with an error)."""
    async with dealer(address) as sock:
        await sock.send_multipart(frames)
        await sock.send_multipart([encoder.encode((MARKER, ListPartitions()))])
        replies = []
        with anyio.fail_after(10):
            while (reply := _decoded(await sock.recv_multipart())).rid != MARKER:
                replies.append(reply)
        return replies


@pytest.mark.parametrize(
    "frames",
    [
        [b"\xc1garbage"],
        [b""],
        [encoder.encode([1])],
        [encoder.encode([7, ["NoSuchRequest"]])],
        [encoder.encode([8, ["GetMeta", "p", "not-a-list", 1, "t"]])],
        [encoder.encode([9, ["GetMeta", "p", ["x"], 0, "t"]])],
        [encoder.encode(["rid", ["Hello"]])],
        [b"\x92" + b"\xff" * 64],
    ],
)
async def test_malformed_messages_get_an_error_or_are_dropped(frames: list[bytes]) -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        for address in (cluster.address, cluster.unit_addresses[0]):
            for reply in await replies_before_a_marker(address, frames):
                assert not reply.ok
        # the services still answer
        assert await client.list_partitions() == []
        good = await raw_request(cluster.address, [encoder.encode((5, ListPartitions()))])
        assert good is not None
        assert msgspec.msgpack.decode(good[0], type=Reply).ok


async def test_truncated_data_frames_are_rejected() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        header = encoder.encode(
            (
                3,
                msgspec.msgpack.decode(
                    encoder.encode(["StorePut", "p", [0, 1], [["x", "dense", "float32", [4]]]])
                ),
            )
        )
        reply = await raw_request(cluster.unit_addresses[0], [header, b"\x00" * 7])
        assert reply is not None
        decoded = msgspec.msgpack.decode(reply[0], type=Reply)
        assert not decoded.ok
        assert b"ProtocolError" in bytes(decoded.payload)
        missing = await raw_request(
            cluster.unit_addresses[0], [encoder.encode((4, StoreGet("p", [0], ["x"])))]
        )
        assert missing is not None
        assert not msgspec.msgpack.decode(missing[0], type=Reply).ok
        meta = await client.put(TensorDict({"x": torch.ones(2, 4)}, [2]), partition_id="p")
        assert (await client.get_data(meta))["x"].sum() == 8
        # a bad GetMeta over the wire is answered with InvalidRequestError
        bad = await raw_request(
            cluster.address, [encoder.encode((6, GetMeta("p", ["x"], -1, "t")))]
        )
        assert bad is not None
        assert b"InvalidRequestError" in bad[0]


async def test_an_id_of_the_wrong_type_is_refused_naming_the_argument(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A partition id or task name that is no string (an int, None) reached the
    controller's decoder in most calls: a ProtocolError "malformed request: Expected `str`,
    got `int` - at `$[1][1]`", logged by the controller as a malformed request; ``watch(3)``
    failed with AttributeError, and numpy's ``str_`` (ids kept in an array) with msgspec's
    NotImplementedError. Each is refused here naming the argument; a ``str_`` is its str."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.ones(2)}, np.str_("p"))
        await client.kv_put("k", "kv", {"x": torch.ones(1)})
        calls = {
            "seal": lambda pid: client.seal(pid),
            "reset_consumption": lambda pid: client.reset_consumption(pid),
            "clear_partition": lambda pid: client.clear_partition(pid),
            "partition_info": lambda pid: client.partition_info(pid),
            "lost_rows": lambda pid: client.lost_rows(pid),
            "production_status": lambda pid: client.production_status(pid),
            "consumption_status": lambda pid: client.consumption_status(pid, "t"),
            "check_production_status": lambda pid: client.check_production_status(pid, ["x"]),
            "check_consumption_status": lambda pid: client.check_consumption_status(pid, "t"),
            "kv_list": lambda pid: client.kv_list(pid),
            "kv_put": lambda pid: client.kv_put("k", pid, tag={"a": 1}),
            "kv_batch_get": lambda pid: client.kv_batch_get(["k"], pid),
            "kv_retrieve_meta": lambda pid: client.kv_retrieve_meta(["k"], pid),
            "kv_retrieve_keys": lambda pid: client.kv_retrieve_keys([0], pid),
            "kv_clear": lambda pid: client.kv_clear(["k"], pid),
            "register_tasks": lambda pid: client.register_tasks(["t"], pid),
            "save_checkpoint": lambda pid: client.save_checkpoint("/nonexistent/ck", [pid]),
        }
        with caplog.at_level(logging.WARNING, logger="tq_async"):
            for name, call in calls.items():
                for bad in (
                    [3, ""] if name in ("lost_rows", "kv_list", "register_tasks") else [3, None, ""]
                ):
                    with pytest.raises(tq.InvalidRequestError, match="partition_id") as info:
                        await call(bad)
                    assert "malformed" not in str(info.value), name
            for bad_task in (3, None, ""):
                with pytest.raises(tq.InvalidRequestError, match="task_name"):
                    await client.consumption_status("p", bad_task)  # type: ignore[arg-type]
                with pytest.raises(tq.InvalidRequestError, match="task_name"):
                    await client.check_consumption_status("p", bad_task)  # type: ignore[arg-type]
            with pytest.raises(tq.InvalidRequestError, match="task_name"):
                await client.reset_consumption("p", 3)  # type: ignore[arg-type]
            with pytest.raises(tq.InvalidRequestError, match="task names"):
                await client.register_tasks([""], "p")
            with pytest.raises(tq.InvalidRequestError, match="partition_id"):
                client.watch(3)  # type: ignore[arg-type]
        assert not [r for r in caplog.records if "malformed" in r.getMessage()]
        # numpy's str_ is the str it holds
        assert (await client.partition_info(np.str_("p")))["rows"] == 2
        meta = await client.get_meta(["x"], 2, np.str_("p"), np.str_("t"), timeout=5)
        assert type(meta.partition_id) is str
        await client.seal(np.str_("p"))
        assert await client.list_partitions() == ["kv", "p"]


async def test_status_calls_check_their_row_ids() -> None:
    """``check_production_status`` / ``check_consumption_status`` sent their
    ``global_indexes`` unchecked: a tensor of row ids failed with msgspec's
    NotImplementedError, a string ("01") or a float reached the controller's decoder (a
    ProtocolError it logged). Row ids are checked as kv_retrieve_keys checks them: a list,
    an array or a tensor of non-negative ints."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        meta = await client.put({"x": torch.ones(2)}, "p")
        rows = meta.global_indexes
        for given in (rows, torch.tensor(rows), np.array(rows), tuple(rows)):
            assert await client.check_production_status("p", ["x"], given)  # type: ignore[arg-type]
            assert not await client.check_consumption_status("p", "t", given)  # type: ignore[arg-type]
        for bad in ("01", [0.0], ["0"], [True], [-1], torch.ones(2)):
            with pytest.raises(tq.InvalidRequestError, match="global_indexes"):
                await client.check_production_status("p", ["x"], bad)  # type: ignore[arg-type]
            with pytest.raises(tq.InvalidRequestError, match="global_indexes"):
                await client.check_consumption_status("p", "t", bad)  # type: ignore[arg-type]


async def test_a_host_id_that_is_no_string_is_refused_before_a_unit_announces_it() -> None:
    """``local_cluster(host_id=3)`` (or a ``StorageServer``'s) started: the unit announced
    the int as its host, and every client's hello then failed to decode ("unexpected reply
    payload: Expected `str`, got `int`"): no client could use the cluster. It is refused
    before anything starts, naming host_id."""
    from tq_async.lowlevel import StorageServer

    for bad in (3, ["a", 3], b"rack7"):
        with pytest.raises(tq.InvalidRequestError, match="host_id must be a string"):
            async with tq.local_cluster(num_storage_units=2, host_id=bad):  # type: ignore[arg-type]
                pass
    with pytest.raises(tq.InvalidRequestError, match="host_id must be a string"):
        StorageServer(0, host_id=3)  # type: ignore[arg-type]
    async with (
        tq.local_cluster(num_storage_units=2, host_id=["a", "b"]) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.ones(2)}, "p")
        assert (await client.partition_info("p"))["rows"] == 2


async def test_a_sampler_that_is_no_sampler_is_refused_naming_the_argument() -> None:
    """``local_cluster(sampler="grpo")``, a sampler's class instead of an instance, or
    ``task_samplers`` that is no dict of task names to samplers failed deep in the
    controller's start: an AttributeError ('str' object has no attribute 'sample') in an
    ExceptionGroup (a task name that is no string was taken). Each is refused naming it."""
    cases: list[tuple[dict[str, Any], str]] = [
        ({"sampler": "grpo"}, "sampler must be a sampler"),
        ({"sampler": tq.SequentialSampler}, r"pass SequentialSampler\(\)"),
        ({"task_samplers": [tq.SequentialSampler()]}, "task_samplers must be a dict"),
        ({"task_samplers": {"learner": "grpo"}}, r"task_samplers\['learner'\] must be a sampler"),
        ({"task_samplers": {3: tq.SequentialSampler()}}, "keys are task names"),
    ]
    for kwargs, message in cases:
        with pytest.raises(tq.InvalidRequestError, match=message):
            async with tq.local_cluster(num_storage_units=1, **kwargs):
                pass


async def test_flags_and_task_lists_of_the_wrong_type_are_refused_naming_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``stop_when_consumed="no"`` and ``seal(..., create="yes")`` reached the controller's
    decoder (a ProtocolError "malformed request: Expected `bool`", logged there), and
    ``register_tasks(None)`` failed with a bare TypeError ('NoneType' object is not
    iterable). Each is refused naming the argument; numpy's bools are bools."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.ones(2)}, "p")
        with caplog.at_level(logging.WARNING, logger="tq_async"):
            for bad in ("no", 1, None):
                with pytest.raises(tq.InvalidRequestError, match="stop_when_consumed must be"):
                    await client.get_meta(["x"], 1, "p", "t", timeout=0, stop_when_consumed=bad)
                with pytest.raises(tq.InvalidRequestError, match="create must be True or False"):
                    await client.seal("q", create=bad)  # type: ignore[arg-type]
            for tasks in (None, 3):
                with pytest.raises(tq.InvalidRequestError, match="takes a list of task names"):
                    await client.register_tasks(tasks, "p")  # type: ignore[arg-type]
        assert not [r for r in caplog.records if "malformed" in r.getMessage()]
        await client.seal("q", create=np.bool_(True))
        await client.seal("p")
        got = await client.get_meta(["x"], 2, "p", "t", timeout=5, stop_when_consumed=np.True_)
        assert len(got) == 2
        assert sorted(await client.list_partitions()) == ["p", "q"]
