"""``tq_async.ray``: a cluster of Ray actors, fed and drained by Ray tasks over ZMQ.

Ray starts slowly on the 2-core CI box (~5 s, ~10 s more for the actors), so one local Ray
instance serves the whole module and the tests are few.
"""

from __future__ import annotations

import inspect
import os
import signal
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

import tq_async as tq  # noqa: E402
import tq_async.ray as tq_ray  # noqa: E402

#: one worker runs the whole module (pytest-xdist --dist loadgroup): one local Ray cluster, not
#: one per worker (two starting at once on 2 vCPUs can time out)
pytestmark = pytest.mark.xdist_group("ray")

NAMESPACE = "tq_async_test"
ROWS = 64


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    # num_cpus=4 even on 2 cores: with fewer, ray.init can hang here. Functions of this module
    # travel by value: Ray workers cannot import a test module.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def our_actors() -> list[dict[str, Any]]:
    named: list[dict[str, Any]] = ray.util.list_named_actors(all_namespaces=True)
    return [a for a in named if a["namespace"] == NAMESPACE]


def produce(address: str) -> int:
    """A rollout worker: blocking client, 8 puts of 8 rows, then seal."""
    import torch
    from tensordict import TensorDict

    with tq.Client.connect(address) as client:
        for k in range(ROWS // 8):
            uids = list(range(k * 8, (k + 1) * 8))
            td = TensorDict({"x": torch.tensor(uids) * 10}, batch_size=[8])
            client.put(td, partition_id="train@0", tags=[{"uid": u} for u in uids])
        client.seal("train@0")
    return ROWS


def consume(address: str) -> tuple[list[int], list[int]]:
    """A learner: async client, batches of 6 until end of stream. Returns (uids, units)."""
    import anyio

    async def run() -> tuple[list[int], list[int]]:
        uids: list[int] = []
        units: list[int] = []
        async with tq.AsyncClient.connect(address) as client:
            while True:
                td, meta = await client.get(["x"], 6, "train@0", "learner", timeout=60)
                if meta.end_of_stream:
                    return uids, units
                got = [t["uid"] for t in meta.tags]
                assert td["x"].tolist() == [u * 10 for u in got]
                uids += got
                units += meta.units

    return anyio.run(run)


def big_round_trip(address: str) -> tuple[bool, dict[int, dict[str, Any]]]:
    """A Ray task on the units' node: a 512 KiB put and get (over shared memory), exact."""
    import torch
    from tensordict import TensorDict

    x = torch.arange(64 * 1024, dtype=torch.int64).reshape(64, 1024)
    with tq.Client.connect(address) as client:
        client.put(TensorDict({"x": x}, batch_size=[64]), partition_id="big")
        td, _ = client.get(["x"], 64, "big", "reader", timeout=60)
        got = td["x"][td["x"][:, 0].argsort()]
        return bool(torch.equal(got, x)), client.storage_stats()


def test_public_names_are_documented() -> None:
    for name in tq_ray.__all__:
        assert inspect.getdoc(getattr(tq_ray, name)), name
    assert inspect.getdoc(tq_ray.RayCluster.shutdown)


def test_needs_ray_init() -> None:
    # first in the module: the shared Ray instance is not started yet
    assert not ray.is_initialized()
    with pytest.raises(tq.InvalidRequestError, match=r"ray\.init\(\)"):
        tq_ray.launch(1)


def test_shutdown_after_ray_shutdown_does_not_start_ray() -> None:
    # second in the module, Ray not started: as after `ray.shutdown()` in a driver that still
    # holds its cluster (the actors ended with the session); shutdown must not start a new one
    assert not ray.is_initialized()
    cluster = tq_ray.RayCluster("gone", NAMESPACE, "tcp://127.0.0.1:1", {}, ("gone.unit0", "gone"))
    cluster.shutdown(timeout=5)
    assert not ray.is_initialized()


def test_launch_stream_attach_shutdown(local_ray: None, monkeypatch: pytest.MonkeyPatch) -> None:
    here = ray.get_runtime_context().get_node_id()
    cluster = tq_ray.launch(
        2, name="rl", namespace=NAMESPACE, host="127.0.0.1", placement=[here], timeout=90
    )
    try:
        assert len(cluster.unit_addresses) == 2
        assert {a["name"] for a in our_actors()} == {"rl", "rl.unit0", "rl.unit1"}

        # Ray tasks talk ZMQ to the actors' endpoints; only the address goes through Ray.
        consumer = ray.remote(consume).remote(cluster.address)
        producer = ray.remote(produce).remote(cluster.address)
        assert ray.get(producer, timeout=90) == ROWS
        uids, units = ray.get(consumer, timeout=90)
        assert sorted(uids) == list(range(ROWS))  # every row exactly once
        assert set(units) == {0, 1}

        # a Ray task on the actors' node moves its columns through the unit's shared memory
        exact, stats = ray.get(ray.remote(big_round_trip).remote(cluster.address), timeout=90)
        assert exact
        assert sum(s["shm_puts"] for s in stats.values()) >= 1
        assert sum(s["shm_reads"] for s in stats.values()) >= 1

        attached = tq_ray.attach("rl", NAMESPACE)
        assert attached.address == cluster.address
        assert attached.unit_addresses == cluster.unit_addresses
        with tq.Client.connect(attached.address) as client:
            assert "train@0" in client.list_partitions()

        with pytest.raises(tq.InvalidRequestError, match="already runs"):
            tq_ray.launch(1, name="rl", namespace=NAMESPACE)
        # another driver took the name between launch's look-up and its actors' creation (two
        # drivers' compat.init() at once): the same error, and the running cluster untouched
        monkeypatch.setattr(tq_ray, "_check_name_free", lambda name, namespace: None)
        with pytest.raises(tq.InvalidRequestError, match="already runs"):
            tq_ray.launch(1, name="rl", namespace=NAMESPACE)
        assert {a["name"] for a in our_actors()} == {"rl", "rl.unit0", "rl.unit1"}
        with tq.Client.connect(cluster.address) as client:
            assert "train@0" in client.list_partitions()
    finally:
        cluster.shutdown()
    assert our_actors() == []
    cluster.shutdown()  # idempotent


def test_placement_and_attach_fail_clearly(local_ray: None) -> None:
    with pytest.raises(tq.InvalidRequestError, match="no alive Ray node has the resources"):
        tq_ray.launch(1, namespace=NAMESPACE, placement={"resources": {"tq_storage": 1}})
    with pytest.raises(tq.InvalidRequestError, match="not alive Ray nodes"):
        tq_ray.launch(1, namespace=NAMESPACE, placement=["f" * 56])
    with pytest.raises(tq.InvalidRequestError, match="unknown placement keys"):
        tq_ray.launch(1, namespace=NAMESPACE, placement={"gpus": 1})
    with pytest.raises(tq.InvalidRequestError, match="no tq_async cluster named 'nope'"):
        tq_ray.attach("nope", NAMESPACE)
    # malformed arguments: refused before any actor starts, saying what to give (not Ray's or
    # Python's own errors, nor a controller launched without a name, which attach cannot find)
    for bad, says in [
        ({"name": ""}, "name must be a non-empty string"),
        ({"name": None}, "name must be a non-empty string"),
        ({"namespace": ""}, "namespace must be a non-empty string"),
        ({"num_storage_units": 2.0}, "num_storage_units must be an int >= 1"),
        ({"num_storage_units": "2"}, "num_storage_units must be an int >= 1"),
        ({"placement": {"resources": {"CPU": "1"}}}, "must map resource names to amounts"),
        # what launch sets itself: actors in another namespace would escape shutdown/attach
        (
            {"actor_options": {"namespace": "elsewhere"}},
            r"actor_options\['namespace'\].*namespace=",
        ),
        ({"actor_options": {"name": "x"}}, r"actor_options\['name'\].*name="),
        (
            {"actor_options": {"scheduling_strategy": "SPREAD"}},
            r"\['scheduling_strategy'\].*placement=",
        ),
    ]:
        with pytest.raises(tq.InvalidRequestError, match=says):
            tq_ray.launch(**{"namespace": NAMESPACE, "host": "127.0.0.1", **bad})
    assert our_actors() == []
    # a service that cannot start: the error names it, and nothing is left running (binding an
    # address this host does not have fails at once, without sending anything)
    with pytest.raises(tq.BrokenError, match=r"controller 'bad'.*cannot bind"):
        tq_ray.launch(1, name="bad", namespace=NAMESPACE, host="203.0.113.7", timeout=60)
    assert our_actors() == []
    # a resource filter that matches this node selects it
    cpu_nodes = tq_ray.select_nodes({"resources": {"CPU": 1}})
    assert cpu_nodes == [ray.get_runtime_context().get_node_id()]


def test_launch_with_a_config(local_ray: None, tmp_path: Path) -> None:
    import anyio
    import torch

    here = ray.get_runtime_context().get_node_id()
    bad = tq.Config(task_samplers={"learner": tq.SamplerSpec("tq_async:NoSuchSampler")})
    with pytest.raises(tq.ConfigError, match=r"task_samplers\.learner\.factory"):
        tq_ray.launch(name="bad", namespace=NAMESPACE, placement=[here], config=bad)
    assert our_actors() == []  # failed before any actor started
    with pytest.raises(tq.ConfigError, match="given both"):
        tq_ray.launch(3, name="both", namespace=NAMESPACE, config=tq.Config())

    config = tq.Config(
        num_storage_units=1,
        shm_cap=8 << 20,  # reaches the units (as data_path and device_cap do)
        admission=tq.AdmissionSection(max_staleness=0),
        task_samplers={"learner": tq.SamplerSpec("tq_async:GRPOGroupNSampler", {"n": 2})},
        # at memory, cells past the cap spill under data_dir (a path on the unit's node), not
        # into the node's temporary directory (often a small tmpfs, in RAM)
        memory_cap=64 << 10,
        data_dir=str(tmp_path),
    )
    with pytest.raises(tq.ConfigError, match="unexpected keyword argument 'n'"):
        tq_ray.launch(name="cfg", namespace=NAMESPACE, placement=[here], config=config)
    config.task_samplers["learner"].kwargs = {"n_samples_per_prompt": 2}
    cluster = tq_ray.launch(
        name="cfg", namespace=NAMESPACE, host="127.0.0.1", placement=[here], config=config
    )
    try:
        assert len(cluster.unit_addresses) == 1

        async def check_admission() -> None:
            async with tq.AsyncClient.connect(cluster.address) as client:
                await client.acquire_rollout(0, 1)  # version 0 - learner 0 <= 0: admitted
                with pytest.raises(tq.TQTimeoutError):
                    await client.acquire_rollout(1, 1, timeout=0.2)  # one version ahead
                x = torch.randn(64, 1024)  # 256 KiB: past the cap
                meta = await client.put({"x": x}, "p")
                assert torch.equal((await client.get_data(meta))["x"], x)
                (stats,) = (await client.storage_stats()).values()
                assert stats["shm_cap"] == 8 << 20
                assert stats["spills"] > 0

        anyio.run(check_admission)
        assert [p.name[:14] for p in tmp_path.iterdir()] == ["tq-unit-spill-"]
    finally:
        cluster.shutdown()


def test_compat_init_attaches_to_a_launched_cluster(
    local_ray: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tq_async.compat as compat

    monkeypatch.delenv("TQ_ADDRESS", raising=False)
    cluster = tq_ray.launch(1)  # the default name and namespace, which compat.init looks up
    try:
        config = compat.init()
        assert config.address == cluster.address  # type: ignore[attr-defined]
        compat.kv_put(key="k", partition_id="p", tag={"v": 1})
        assert compat.kv_list("p") == {"p": {"k": {"v": 1}}}
    finally:
        compat.close()
        cluster.shutdown()


def test_launch_gives_each_unit_its_host_id() -> None:
    nodes = ["n1", "n2"]
    assert tq_ray._unit_host_ids(None, nodes, 3, {}) == ["ray:n1", "ray:n2", "ray:n1"]
    assert tq_ray._unit_host_ids(tq.Config(host_id="rack7"), nodes, 2, {}) == ["rack7"] * 2
    assert tq_ray._unit_host_ids(tq.Config(host_id=["a", "b"]), nodes, 2, {}) == ["a", "b"]
    env = {"runtime_env": {"env_vars": {"TQ_HOST_ID": "x"}}}
    assert tq_ray._unit_host_ids(None, nodes, 2, env) == [None, None]
    with pytest.raises(tq.ConfigError, match="one per unit"):
        tq_ray._unit_host_ids(tq.Config(host_id=["a"]), nodes, 2, {})


def _batch(n: int, seed: int) -> dict[str, Any]:
    """Random bits (a float column with NaN payloads, an int column): a round trip that is
    not bit-exact shows."""
    import torch

    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31 - 1, (n, 512), generator=g, dtype=torch.int32)
    return {"f": bits.view(torch.float32), "i": torch.randint(0, 1 << 40, (n, 3), generator=g)}


def _same(got: Any, want: dict[str, Any]) -> bool:
    import torch

    return bool(torch.equal(got["f"].view(torch.int32), want["f"].view(torch.int32))) and bool(
        torch.equal(got["i"], want["i"])
    )


def _restarted(actor: Any, old_pid: int, timeout: float = 90.0) -> dict[str, Any]:
    """Wait until Ray has restarted ``actor`` (another process) and its service serves."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = max(0.1, deadline - time.monotonic())
        try:
            ray.get(actor.ready.remote(), timeout=left)  # waits while Ray restarts it
            info: dict[str, Any] = ray.get(actor.info.remote(), timeout=left)
        except ray.exceptions.RayActorError:
            continue  # the call reached the dying process, or Ray is restarting it
        if info["pid"] != old_pid:
            return info
    pytest.fail(f"the actor was not restarted within {timeout} s")


def _durable_launch(name: str, data_dir: Path, units: int) -> Any:
    here = ray.get_runtime_context().get_node_id()
    config = tq.Config(
        num_storage_units=units,
        placement="round_robin",
        durability="process",
        data_dir=str(data_dir),
    )
    return tq_ray.launch(
        name=name,
        namespace=NAMESPACE,
        host="127.0.0.1",
        placement=[here],
        config=config,
        timeout=90,
    )


def test_a_durable_unit_killed_under_ray_comes_back_with_every_row(
    local_ray: None, tmp_path: Path
) -> None:
    import anyio

    data_dir = tmp_path / "tq"
    data_dir.mkdir()
    cluster = _durable_launch("durable", data_dir, 2)
    unit = ray.get_actor("durable.unit0", namespace=NAMESPACE)

    async def run() -> list[tuple[Any, dict[str, Any]]]:
        before = await anyio.to_thread.run_sync(lambda: ray.get(unit.info.remote(), timeout=30))
        assert before["restarted"] is False
        async with tq.AsyncClient.connect(cluster.address, request_timeout=10) as client:
            acked = []
            for i in range(12):
                batch = _batch(1 + i % 4, i)
                acked.append((await client.put(batch, "p"), batch))
            total = sum(len(meta) for meta, _ in acked)
            assert {u for meta, _ in acked for u in meta.units} == {0, 1}
            first = await client.get_meta(["f", "i"], 6, "p", "learner", timeout=10)
            consumed = list(first.global_indexes)
            os.kill(before["pid"], signal.SIGKILL)  # right after the last acknowledgement
            after = await anyio.to_thread.run_sync(partial(_restarted, unit, before["pid"]))
            assert after["restarted"] is True
            assert after["unit_id"] == 0
            # attach gives its new address (it binds a new port), not the one it died at
            attached = await anyio.to_thread.run_sync(tq_ray.attach, "durable", NAMESPACE)
            assert attached.unit_addresses[0] == after["address"] != cluster.unit_addresses[0]
            for meta, batch in acked:  # every acknowledged row, bit-exactly
                assert _same(await client.get_data(meta), batch)
            lost = await client.lost_rows()
            assert lost["dead_units"] == []
            assert not any(lost["rows"].values())
            # the task keeps consuming where it was: every other row once, then new ones
            while len(consumed) < total:
                got = await client.get_meta(["f", "i"], 6, "p", "learner", timeout=10)
                await client.get_data(got)
                consumed += got.global_indexes
            assert sorted(consumed) == sorted(i for m, _ in acked for i in m.global_indexes)
            new = await client.put(_batch(4, 1000), "p")
            assert _same(await client.get_data(new), _batch(4, 1000))
            acked.append((new, _batch(4, 1000)))
        return acked

    async def read_back(address: str, acked: list[tuple[Any, dict[str, Any]]]) -> None:
        async with tq.AsyncClient.connect(address, request_timeout=10) as client:
            for meta, batch in acked:
                assert _same(await client.get_data(meta), batch)
            assert not any((await client.lost_rows())["rows"].values())

    try:
        acked = anyio.run(run)
        assert os.listdir(data_dir / "units" / "unit-0")  # its cells were in its directory
    finally:
        cluster.shutdown()
    assert our_actors() == []
    # the whole cluster launched again on its data_dir (same nodes) has every row
    cluster = _durable_launch("durable", data_dir, 2)
    try:
        anyio.run(read_back, cluster.address, acked)
    finally:
        cluster.shutdown()


def test_a_durable_controller_killed_under_ray_comes_back_at_its_address(
    local_ray: None, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import anyio

    relative = tq.Config(durability="process", data_dir="tq/data")
    with pytest.raises(tq.ConfigError, match="absolute path"):
        tq_ray.launch(name="rel", namespace=NAMESPACE, config=relative)
    with pytest.raises(tq.ConfigError, match=r"controller 'nodir'.*not a directory"):
        _durable_launch("nodir", tmp_path / "missing", 1)
    assert our_actors() == []
    data_dir = tmp_path / "tq"
    data_dir.mkdir()
    cluster = _durable_launch("durable-ctl", data_dir, 1)
    controller = ray.get_actor("durable-ctl", namespace=NAMESPACE)
    # no constructor argument of a restartable actor is an object Ray may lose (an actor
    # handle is one: Ray logs an error, "the actor restart will fail", ray-project/ray#53727)
    assert "constructor arguments in the object store" not in capfd.readouterr().err

    async def run() -> None:
        before = await anyio.to_thread.run_sync(
            lambda: ray.get(controller.info.remote(), timeout=30)
        )
        async with tq.AsyncClient.connect(cluster.address, request_timeout=10) as client:
            acked = [(await client.put(_batch(4, i), "p"), _batch(4, i)) for i in range(4)]
            first = await client.get_meta(["f", "i"], 6, "p", "learner", lease=60.0, timeout=10)
            await client.ack(first)
            os.kill(before["pid"], signal.SIGKILL)
            after = await anyio.to_thread.run_sync(partial(_restarted, controller, before["pid"]))
            assert after["address"] == cluster.address  # the same port: clients find it
            # the same client carries on: nothing acknowledged is delivered again
            await client.seal("p")
            rest: list[int] = []
            while True:
                got = await client.get_meta(["f", "i"], 4, "p", "learner", lease=60.0, timeout=30)
                if got.end_of_stream:
                    break
                await client.get_data(got)
                rest += got.global_indexes
                await client.ack(got)
            assert not set(rest) & set(first.global_indexes)
            everything = [i for meta, _ in acked for i in meta.global_indexes]
            assert sorted(rest + list(first.global_indexes)) == sorted(everything)
            for meta, batch in acked:
                assert _same(await client.get_data(meta), batch)

    try:
        anyio.run(run)
        attached = tq_ray.attach("durable-ctl", NAMESPACE)  # its description came back too
        assert attached.address == cluster.address
    finally:
        cluster.shutdown()
    assert our_actors() == []
