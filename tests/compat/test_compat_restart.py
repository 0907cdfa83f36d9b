"""``tq_async.compat`` across a SIGKILL and restart of the ``tq-async serve`` it attached to
(real processes, the same ``--bind``)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

import tq_async
import tq_async.compat as tq
from _cluster_proc import free_port, serve_role, sigkill


def _put(keys: list[str], partition_id: str) -> tq.BatchMeta:
    fields = TensorDict({"x": torch.arange(len(keys)).view(-1, 1)}, batch_size=len(keys))
    tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=fields)
    return tq.get_client().kv_retrieve_meta(keys=keys, partition_id=partition_id)


def test_global_indexes_stay_unique_after_a_restart_that_lost_the_state() -> None:
    bind = f"tcp://127.0.0.1:{free_port()}"
    with serve_role("--bind", bind, "--storage-units", "1") as (proc, _):
        tq.init({"address": bind})
        _put(["a0"], "a")
        _put(["b0"], "b")
        sigkill(proc)
    with serve_role("--bind", bind, "--storage-units", "1"):
        # the calls made before the client learnt of the restart fail, saying so
        lost: list[type[BaseException]] = []
        for _ in range(3):
            try:
                tq.kv_list()
            except tq_async.BrokenError as exc:
                lost.append(type(exc))
            else:
                break
        assert tq_async.StateLostError in lost
        # the new, empty service: compat numbers its partitions anew (partition k in the
        # order compat saw them there starts at k * 2^32), as a process attaching now does;
        # global indexes stay unique across partitions
        c = _put(["c0", "c1"], "c")
        a = _put(["a0", "a1"], "a")
        assert c.global_indexes == [0, 1]
        assert a.global_indexes == [1 << 32, (1 << 32) + 1]
        client = tq.get_client()
        assert client.kv_retrieve_keys(a.global_indexes, partition_id="a") == ["a0", "a1"]
        assert client.get_data(a)["x"].to_padded_tensor(-1).tolist() == [[0], [1]]
        assert client.get_production_status(["x"], "a")[0].tolist() == a.global_indexes
        tq.close()
