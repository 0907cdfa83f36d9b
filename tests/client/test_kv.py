"""The KV API: keyed rows, partial field updates, atomic tag merges, loud misses."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from tensordict import TensorDict

import tq_async as tq


async def test_kv_batch_put_get_and_partial_updates() -> None:
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        fields = TensorDict({"a": torch.arange(3), "s": ["x", "y", "z"]}, [3])
        await client.kv_batch_put(["k0", "k1", "k2"], "p", fields, tags=[{"v": 0}] * 3)
        got = await client.kv_batch_get(["k2", "k0"], "p")
        assert got["a"].tolist() == [2, 0]
        assert got.get("s").tolist() == ["z", "x"]
        # update one field of an existing key, add a new key in the same call
        await client.kv_batch_put(["k1", "k3"], "p", {"a": torch.tensor([10, 30])})
        got = await client.kv_batch_get(["k0", "k1", "k3"], "p", select_fields=["a"])
        assert got["a"].tolist() == [0, 10, 30]
        # k1 kept its other field
        assert (await client.kv_batch_get(["k1"], "p", ["s"])).get("s").tolist() == ["y"]
        # k3 has no "s": asking for it is an error naming the key, not a shorter batch
        with pytest.raises(tq.KeyNotFound, match=r"'k3'.*\['s'\]"):
            await client.kv_batch_get(["k1", "k3"], "p", select_fields=["s"])
        with pytest.raises(tq.KeyNotFound, match="nope"):
            await client.kv_batch_get(["k0", "nope"], "p")


async def test_kv_put_single_key_and_tags_merge_atomically() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.kv_put("a", "p", {"reward": torch.tensor(1.5), "note": "hi"}, tag={"x": 1})
        got = await client.kv_batch_get(["a"], "p")
        assert got["reward"].tolist() == [1.5]
        assert got.get("note").tolist() == ["hi"]

        # many concurrent tag updates of one key: none is lost
        async def tag(i: int) -> None:
            await client.kv_put("a", "p", tag={f"t{i}": i})

        async with anyio.create_task_group() as tg:
            for i in range(50):
                tg.start_soon(tag, i)
        tags = (await client.kv_list("p"))["p"]["a"]
        assert tags == {"x": 1} | {f"t{i}": i for i in range(50)}
        # a tag-only put creates the key
        await client.kv_put("b", "p", tag={"only": True})
        assert set((await client.kv_list())["p"]) == {"a", "b"}


async def test_kv_clear_and_bad_input() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.kv_batch_put(["a", "b"], "p", {"x": torch.zeros(2, 8)})
        with pytest.raises(tq.KeyNotFound, match="zzz"):
            await client.kv_clear(["a", "zzz"], "p")
        assert set((await client.kv_list("p"))["p"]) == {"a", "b"}  # nothing cleared
        await client.kv_clear(["a"], "p")
        assert set((await client.kv_list("p"))["p"]) == {"b"}
        assert cluster.units[0].state.resident_bytes == 8 * 4 * 2  # chunk freed with last row
        await client.kv_clear(["b"], "p")
        assert cluster.units[0].state.resident_bytes == 0
        with pytest.raises(tq.InvalidRequestError, match="twice"):
            await client.kv_batch_put(["c", "c"], "p", {"x": torch.zeros(2, 8)})
        with pytest.raises(tq.SchemaError, match="2 keys"):
            await client.kv_batch_put(["c", "d"], "p", {"x": torch.zeros(3, 8)})
        with pytest.raises(tq.InvalidRequestError, match="list of strings"):
            await client.kv_batch_get("c", "p")  # type: ignore[arg-type]
        with pytest.raises(tq.PartitionNotFound):
            await client.kv_list("nope")


def test_sync_kv() -> None:
    async def main() -> None:
        async with tq.local_cluster(num_storage_units=1) as cluster:

            def blocking() -> list[int]:
                with tq.Client.connect(cluster.address) as client:
                    client.kv_batch_put(["a", "b"], "p", {"x": torch.tensor([1, 2])})
                    return client.kv_batch_get(["b", "a"], "p")["x"].tolist()

            assert await anyio.to_thread.run_sync(blocking) == [2, 1]

    anyio.run(main)


async def test_kv_batch_get_names_the_first_key_lacking_a_field() -> None:
    # the lookup checks a field for all keys at once and goes key by key only to name one
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        keys = [f"k{i}" for i in range(300)]
        await client.kv_batch_put(keys, "p", {"a": torch.arange(300)})
        await client.kv_batch_put(keys[:200] + keys[201:], "p", {"b": torch.zeros(299)})
        got = await client.kv_batch_get(keys[150:250], "p", ["a"])
        assert got["a"].tolist() == list(range(150, 250))
        with pytest.raises(tq.KeyNotFound, match=r"key 'k200' .* has no fields \['b'\]"):
            await client.kv_batch_get(keys[150:250], "p")
        with pytest.raises(tq.KeyNotFound, match=r"key 'k7' .* has no fields \['zz'\]"):
            await client.kv_batch_get(["k7", "k8"], "p", ["a", "zz"])
        meta = await client.kv_retrieve_meta(keys[150:250], "p")  # the fields all keys have
        assert meta.field_names == ["a"]


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
async def test_tag_only_kv_puts_take_numpy_and_torch_scalars_like_every_put(
    transport: str,
) -> None:
    """Tags come from the user's data: numpy and torch scalars travel as Python numbers, and
    a value that cannot travel is a `TQError` naming it, for `kv_batch_put` without fields
    as for `kv_put` and a put (before, `kv_batch_put` sent its tags unconverted: over a
    socket a torch scalar raised msgspec's `NotImplementedError`)."""
    import numpy as np

    kw: dict[str, str] = {} if transport == "inproc" else {"transport": "tcp"}
    async with (
        tq.local_cluster(num_storage_units=1, **kw) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        given = [{"score": np.float32(1.5)}, {"n": np.int64(3), "t": torch.tensor(2.0)}]
        meta = await client.kv_batch_put(["a", "b"], "kv", None, given)
        assert meta.tags == given  # as given, like a put's
        listed = (await client.kv_list("kv"))["kv"]
        assert listed == {"a": {"score": 1.5}, "b": {"n": 3, "t": 2.0}}
        assert type(listed["b"]["n"]) is int
        with pytest.raises(tq.UnsupportedTypeError, match="object"):
            await client.kv_batch_put(["c"], "kv", None, [{"bad": object()}])
        assert set((await client.kv_list("kv"))["kv"]) == {"a", "b"}


async def test_a_tag_acknowledged_on_a_key_survives_the_put_that_created_it_giving_up() -> None:
    """A key a producer's kv_put is creating exists from its placement: a tag another client
    merges into it meanwhile is acknowledged, and stays when that put is given up (its
    producer cancelled, failed or died) -- before, the put's abort reclaimed the row with
    the key and the acknowledged tag."""
    from _requests import paused_at
    from tq_async._wire._protocol import StorePut

    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as a,
        tq.AsyncClient.connect(cluster.address) as b,
    ):
        with paused_at(StorePut) as paused:
            async with anyio.create_task_group() as tg:
                tg.start_soon(a.kv_put, "k", "p", {"x": torch.ones(4)})
                await paused.reached(1)  # placed: the key exists, its cells not sent
                await b.kv_put("k", "p", tag={"seen": True})
                tg.cancel_scope.cancel()  # the producer gives up: its put is aborted
        assert set(await a.kv_list("p")) == {"p"}  # (after the abort, on a's connection)
        listing = (await b.kv_list("p"))["p"]
        assert dict(listing) == {"k": {"seen": True}}
        assert (await b.kv_retrieve_meta(["k"], "p")).field_names == []


async def test_a_kv_put_of_a_key_another_put_is_creating_outlives_that_put_giving_up() -> None:
    """Two producers write fields of one new key at once (a rollout its response, a reward
    worker its score): the second binds the key the first placed. The first then gives up
    (cancelled, failed, dead) before the second commits: the second's put still lands --
    before, the first one's abort reclaimed the row under it and it failed with
    RowsNotFound."""
    from _requests import paused_at
    from tq_async._wire._protocol import StorePut

    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as a,
        tq.AsyncClient.connect(cluster.address) as b,
    ):
        with paused_at(StorePut) as paused:
            async with anyio.create_task_group() as tg:
                scope = anyio.CancelScope()

                async def first() -> None:
                    with scope:
                        await a.kv_put("k", "p", {"x": torch.ones(4)})

                tg.start_soon(first)
                await paused.reached(1)  # placed: the key exists, its cells not sent
                tg.start_soon(b.kv_put, "k", "p", {"y": torch.full((2,), 7.0)})
                await paused.reached(2)
                scope.cancel()  # the first producer gives up: its put is aborted
                await a.kv_list("p")  # (after the abort, on a's connection)
                paused.go()
        assert (await b.kv_retrieve_meta(["k"], "p")).field_names == ["y"]
        assert (await b.kv_batch_get(["k"], "p", ["y"]))["y"].tolist() == [[7.0, 7.0]]


async def test_keys_created_by_tags_alone_count_toward_the_capacity() -> None:
    """A tag-only kv_put / kv_batch_put and kv_retrieve_meta(create=True) create rows: at the
    capacity they wait for room as a put does (more keys than the capacity: refused at once)
    -- before, they created keys past it, and every later put waited."""
    async with (
        tq.local_cluster(num_storage_units=1, capacity=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        with pytest.raises(tq.InvalidRequestError, match="never fit the capacity of 2"):
            await client.kv_batch_put(["a", "b", "c"], "p", None, [{}] * 3)
        with pytest.raises(tq.InvalidRequestError, match="never fit the capacity of 2"):
            await client.kv_retrieve_meta(["a", "b", "c"], "p", create=True)
        await client.kv_batch_put(["a", "b"], "p", None, [{"i": 0}, {"i": 1}])
        await client.kv_put("a", "p", tag={"j": 0})  # existing keys: no room needed
        with anyio.move_on_after(0.5) as waited:
            await client.kv_put("c", "p", tag={"i": 2})  # waits for room
        assert waited.cancelled_caught
        assert set((await client.kv_list("p"))["p"]) == {"a", "b"}  # nothing created
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.kv_retrieve_meta, ["c"], "p", True)
            await client.kv_clear(["a"], "p")  # room: the waiting call goes on
        assert dict((await client.kv_list("p"))["p"]) == {"b": {"i": 1}, "c": {}}


async def test_kv_put_of_a_numpy_scalar_is_a_row_as_a_0_dim_array_is() -> None:
    """A numpy scalar (``np.float32(x)``, what ``arr[i]`` and ``np.mean`` give) is one dense
    row of its dtype, as ``np.array(x)`` and ``torch.tensor(x)`` are -- before, it failed
    with UnsupportedTypeError (it travels only with pickle)."""
    import numpy as np

    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        fields = {"r": np.float32(1.5), "n": np.int64(3), "ok": np.bool_(True), "s": np.str_("a")}
        await client.kv_put("a", "p", fields)
        await client.kv_put("b", "p", {"r": torch.tensor(2.5), "n": np.array(4)})
        got = await client.kv_batch_get(["a", "b"], "p", ["r", "n"])
        assert got["r"].dtype == torch.float32
        assert got["r"].tolist() == [1.5, 2.5]
        assert got["n"].tolist() == [3, 4]
        got = await client.kv_batch_get(["a"], "p", ["ok", "s"])
        assert got["ok"].tolist() == [True]
        assert got.get("s").tolist() == ["a"]


async def test_kv_puts_of_no_fields_only_tag_or_say_what_they_need() -> None:
    """Fields without a single field (``{}``, an empty TensorDict) are no fields: with tags
    the call only merges them, without it says it needs fields or tags -- before, it failed
    with 'the batch has no rows; put at least one row' for keys that are rows."""
    from tensordict import TensorDict

    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.kv_put("a", "p", {}, tag={"x": 1})
        await client.kv_batch_put(["a", "b"], "p", TensorDict({}, [2]), [{"y": 2}, {"y": 3}])
        assert dict((await client.kv_list("p"))["p"]) == {"a": {"x": 1, "y": 2}, "b": {"y": 3}}
        with pytest.raises(tq.InvalidRequestError, match="needs fields, a tag, or both"):
            await client.kv_put("a", "p", {})
        with pytest.raises(tq.InvalidRequestError, match="needs fields, tags, or both"):
            await client.kv_batch_put(["a"], "p", TensorDict({}, []))


@pytest.mark.parametrize("bad", ["", 3, None, b"p"])
async def test_kv_calls_check_the_partition_id_before_sending(bad: object) -> None:
    """A partition id that is no non-empty string is an InvalidRequestError naming it, as
    for put and get_meta -- before, the KV calls sent it: a ProtocolError the controller
    logged as a malformed request, and a tag-only kv_put created a partition ''."""
    async with (
        tq.local_cluster(num_storage_units=1, transport="tcp") as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        pid: Any = bad
        calls = [
            lambda: client.kv_put("a", pid, tag={"x": 1}),
            lambda: client.kv_put("a", pid, {"x": torch.zeros(1)}),
            lambda: client.kv_batch_put(["a"], pid, None, [{"x": 1}]),
            lambda: client.kv_batch_get(["a"], pid),
            lambda: client.kv_retrieve_meta(["a"], pid, create=True),
            lambda: client.kv_retrieve_keys([0], pid),
            lambda: client.kv_clear(["a"], pid),
        ]
        if bad is not None:
            calls.append(lambda: client.kv_list(pid))
        for call in calls:
            with pytest.raises(tq.InvalidRequestError, match="partition_id"):
                await call()
        assert await client.list_partitions() == []


async def test_a_kv_put_whose_key_is_cleared_while_it_writes_says_so() -> None:
    """A key removed (kv_clear, a clear, auto-clear) while a kv_put wrote it: the put fails
    with RowsNotFound saying the row was removed meanwhile and to put again -- before, it
    advised to 'use the BatchMeta a put or get_meta returned', which a kv_put has none of."""
    from _requests import paused_at
    from tq_async._wire._protocol import StorePut

    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.kv_put("k", "p", {"x": torch.zeros(4)})
        with paused_at(StorePut) as paused:
            async with anyio.create_task_group() as tg:

                async def clear() -> None:
                    await paused.reached(1)
                    await client.kv_clear(["k"], "p")
                    paused.go()

                tg.start_soon(clear)
                with pytest.raises(tq.RowsNotFound) as caught:
                    await client.kv_put("k", "p", {"x": torch.ones(4)})
        message = str(caught.value)
        assert "removed" in message
        assert "put again" in message
        assert "BatchMeta" not in message
        await client.kv_put("k", "p", {"x": torch.ones(4)})  # the key is new again
        assert (await client.kv_batch_get(["k"], "p"))["x"].tolist() == [[1.0] * 4]
