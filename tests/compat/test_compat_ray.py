"""Ray rendezvous through ``tq_async.compat`` (D2), in the order of TransferQueue's Ray
tutorials and recipes: ``ray.init()`` first, then ``tq.init()`` in the driver, then Ray tasks
that call ``tq.init()``. One Ray start for the whole module (it costs seconds on CI)."""

from __future__ import annotations

import os
import sys

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

import tq_async  # noqa: E402
import tq_async.compat as tq  # noqa: E402

#: on the worker of tests/deploy/test_ray.py (pytest-xdist --dist loadgroup): never two Ray
#: instances starting at once on the 2-vCPU box (one timed out this test at 158 s)
pytestmark = pytest.mark.xdist_group("ray")


def _worker_without_driver() -> str:
    try:
        tq.init()
    except tq_async.ClosedError as exc:
        return f"ClosedError: {exc}"
    tq.close()
    return "attached"


def _producer(rank: int) -> str:
    tq.init()
    client = tq.get_client()
    for i in range(3):
        row = TensorDict({"meta_idx": torch.tensor([rank * 100 + i])}, batch_size=1)
        client.put(row, partition_id="train")
    return client.address


def test_ray_init_first_never_splits_the_job() -> None:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        # a worker of a job whose driver did not call init(): a clear error, no private cluster
        lonely = ray.get(ray.remote(_worker_without_driver).remote(), timeout=120)
        assert lonely.startswith("ClosedError:")
        assert "driver" in lonely
        assert "TQ_ADDRESS" not in os.environ
        config = tq.init()  # the driver: launches the services as named Ray actors
        assert os.environ["TQ_ADDRESS"] == config.address  # for the processes it starts
        producers = [ray.remote(_producer).remote(rank) for rank in range(2)]
        addresses = ray.get(producers, timeout=120)
        assert addresses == [config.address, config.address]
        meta = tq.get_client().get_meta(
            data_fields=["meta_idx"], batch_size=6, partition_id="train", task_name="t"
        )
        data = tq.get_client().get_data(meta)
        assert sorted(int(v) for v in data["meta_idx"]) == [0, 1, 2, 100, 101, 102]
        # TransferQueue's names: tutorial 06 looks the controller up and asks for its config
        controller = ray.get_actor(tq.RAY_CONTROLLER, namespace=tq.RAY_NAMESPACE)
        assert ray.get(controller.get_config.remote(), timeout=60)["address"] == config.address
        tq.close()  # the driver launched them: close() shuts the actors down
        assert "TQ_ADDRESS" not in os.environ
        named = ray.util.list_named_actors(all_namespaces=True)
        assert not [a for a in named if a["namespace"] == tq.RAY_NAMESPACE]

        # Ray shut down and started again in this driver (its actors ended with the session):
        # init() launches the services again in the new session, not the dead cluster's client
        stale = tq.init()
        ray.shutdown()
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        config = tq.init()
        assert config.address != stale.address
        assert os.environ["TQ_ADDRESS"] == config.address
        assert _producer(7) == config.address
        meta = tq.get_client().get_meta(
            data_fields=["meta_idx"], batch_size=3, partition_id="train", task_name="t"
        )
        assert sorted(int(v) for v in tq.get_client().get_data(meta)["meta_idx"]) == [700, 701, 702]
        tq.close()
        named = ray.util.list_named_actors(all_namespaces=True)
        assert not [a for a in named if a["namespace"] == tq.RAY_NAMESPACE]
    finally:
        tq.close()
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
