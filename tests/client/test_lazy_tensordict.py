"""A client process pays for tensordict only when it uses one: connecting, putting a dict of
columns, reading metadata, acking, KV calls, watching and status calls leave it unimported
(importing it costs ~2 s of CPU on top of torch: it imports ``torch._dynamo``); the first call
that builds a TensorDict (``get``) imports it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from _cluster_proc import serve_cluster

_ASYNC = """
import asyncio, sys
import numpy as np, torch
import tq_async as tq

def loaded(step):
    print(step, "tensordict" in sys.modules, flush=True)

async def main(address):
    async with tq.AsyncClient.connect(address) as client:
        loaded("connect")
        async with client.watch() as watcher:
            batch = {"x": torch.arange(4), "y": np.arange(4.0), "s": ["a", "b", "c", "d"]}
            await client.put(batch, partition_id="p")
            await client.put({"z": [[1], [2, 3]], "w": [torch.ones(2), torch.ones(3)]},
                             partition_id="p")
            loaded("put")
            event = await asyncio.wait_for(watcher.__anext__(), 30)
            loaded("watch")
        meta = await client.get_meta(["x", "s"], 4, "p", "t")
        await client.ack(meta)
        loaded("get_meta+ack")
        await client.kv_put("k", "p", {"v": torch.tensor([1.0]), "n": "note"}, tag={"a": 1})
        await client.kv_list("p")
        await client.kv_retrieve_meta(["k"], "p")
        loaded("kv")
        await client.production_status("p", ["x"])
        await client.partition_info("p")
        await client.list_partitions()
        loaded("status")
        td, _ = await client.get(["x", "s"], 4, "p", "t2")
        assert td["x"].tolist() == [0, 1, 2, 3], td
        loaded("get")

asyncio.run(main(sys.argv[1]))
"""

_SYNC = """
import sys, torch
import tq_async as tq

def loaded(step):
    print(step, "tensordict" in sys.modules, flush=True)

with tq.Client.connect(sys.argv[1]) as client:
    loaded("connect")
    client.put({"x": torch.arange(3), "s": ["a", "b", "c"]}, partition_id="q")
    loaded("put")
    client.ack(client.get_meta(["x"], 3, "q", "t"))
    client.kv_put("k", "q", {"n": 1})
    loaded("get_meta+ack+kv")
    td = client.get_data(client.get_meta(["x", "s"], 3, "q", "t2"))
    assert td["s"].tolist() == ["a", "b", "c"], td
    loaded("get_data")
"""


@pytest.mark.parametrize(
    ("script", "steps"),
    [
        (_ASYNC, ["connect", "put", "watch", "get_meta+ack", "kv", "status", "get"]),
        (_SYNC, ["connect", "put", "get_meta+ack+kv", "get_data"]),
    ],
    ids=["AsyncClient", "Client"],
)
def test_a_client_imports_tensordict_only_to_build_one(script: str, steps: list[str]) -> None:
    """A fresh interpreter (a producer, a DataLoader worker): every call before the read
    leaves ``tensordict`` out of ``sys.modules``; the read that returns a TensorDict brings
    it in."""
    with serve_cluster(1) as address:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script), address],
            capture_output=True,
            text=True,
            timeout=110,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    seen = [line.split() for line in done.stdout.splitlines()]
    assert seen == [[step, "False"] for step in steps[:-1]] + [[steps[-1], "True"]]
