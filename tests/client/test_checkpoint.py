"""Checkpoints: exact round trips, a different number of units, corrupt or partial input."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from tensordict import TensorDict

import tq_async as tq
from _requests import cancelled_at
from tq_async._core import _arrays


def sample_batch() -> TensorDict:
    return TensorDict(
        {
            "ids": torch.arange(12, dtype=torch.int64).reshape(4, 3),
            "bf": torch.randn(4, 2).to(torch.bfloat16),
            "mask": torch.tensor([True, False, True, True]),
            "resp": torch.nested.nested_tensor(
                [torch.arange(n, dtype=torch.int32) for n in (1, 5, 2, 3)], layout=torch.jagged
            ),
            "text": ["a", "bb", "ccc", "dddd"],
        },
        [4],
    )


async def fill(client: tq.AsyncClient) -> tq.BatchMeta:
    td = sample_batch()
    meta = await client.put(td, partition_id="p", tags=[{"uid": i} for i in range(4)])
    await client.put({"reward": torch.tensor([0.5, 1.5])}, meta=meta.select_rows([0, 2]))
    await client.put({"ids": torch.arange(6).reshape(2, 3)}, partition_id="p")
    await client.kv_batch_put(["k1", "k2"], "kv", {"v": torch.tensor([1.0, 2.0])})
    await client.get_meta(["ids"], 2, "p", "ref")  # consumption state to be kept
    await client.get_meta(["ids"], 2, "p", "actor", {"dp_rank": 0, "batch_index": 0})
    await client.seal("p")
    return meta


async def saved(tmp_path: Path, units: int = 1) -> Path:
    """A checkpoint of `fill`'s partitions, saved from a cluster of ``units`` units (gone)."""
    ckpt = tmp_path / "ckpt"
    async with (
        tq.local_cluster(num_storage_units=units) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await fill(client)
        await client.save_checkpoint(ckpt)
    return ckpt


@pytest.mark.parametrize(("units_before", "units_after"), [(2, 2), (2, 3), (3, 1)])
async def test_round_trip_onto_a_different_number_of_units(
    tmp_path: Path, units_before: int, units_after: int
) -> None:
    ckpt = tmp_path / "ckpt"
    async with (
        tq.local_cluster(num_storage_units=units_before) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        meta = await fill(client)
        before = await client.get_data(meta)
        await client.save_checkpoint(ckpt)
    async with (
        tq.local_cluster(num_storage_units=units_after) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        assert sorted(await client.load_checkpoint(ckpt)) == ["kv", "p"]
        info = await client.partition_info("p")
        assert info["rows"] == 6
        assert info["sealed"]
        assert info["consumed"] == {"ref": 2, "actor": 2}
        # data comes back exact, whatever unit it now lives on
        meta2 = await client.get_meta(list(before.keys()), 4, "p", "fresh", mode="peek")
        after = await client.get_data(meta2)
        for key in ("ids", "bf", "mask"):
            assert after[key].dtype == before[key].dtype
            assert torch.equal(after[key], before[key])
        assert all(
            torch.equal(a, b)
            for a, b in zip(after["resp"].unbind(), before["resp"].unbind(), strict=True)
        )
        assert after.get("text").tolist() == before.get("text").tolist()
        assert meta2.tags == [{"uid": i} for i in range(4)]
        # production, consumption and recorded deliveries survived
        status = await client.production_status("p", ["reward"])
        assert status["reward"].tolist() == [True, False, True, False, False, False]
        replay = await client.get_meta(["ids"], 2, "p", "actor", {"dp_rank": 0, "batch_index": 0})
        assert replay.global_indexes == [0, 1]
        rest = await client.get_meta(["ids"], 8, "p", "ref")
        assert rest.global_indexes == [2, 3, 4, 5]  # short tail of a sealed partition
        assert (await client.kv_batch_get(["k2", "k1"], "kv"))["v"].tolist() == [2.0, 1.0]
        if units_after > 1:
            assert len({u for u in meta2.units}) >= 1
            assert sum(u.state.resident_bytes > 0 for u in cluster.units) >= 2


async def test_existing_partition_blocks_restore_and_changes_nothing(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await fill(client)
        await client.save_checkpoint(ckpt)
        with pytest.raises(tq.InvalidRequestError, match="already exist"):
            await client.load_checkpoint(ckpt)
        assert sorted(await client.list_partitions()) == ["kv", "p"]


async def test_a_load_cancelled_while_the_controller_stages_it_leaves_nothing_staged(
    tmp_path: Path,
) -> None:
    """The caller gave up while the controller was staging the checkpoint's partitions
    (`RestoreBegin` answered after the cancel): the staged partitions are dropped, so the
    same load goes through next time (before, they stayed staged, and every later load
    said "already exist (or are being restored)" until the controller restarted)."""
    from tq_async._wire._protocol import RestoreBegin

    ckpt = tmp_path / "ckpt"
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await fill(client)
        await client.save_checkpoint(ckpt)
        await client.clear_partition("p")
        await client.clear_partition("kv")
        with cancelled_at(RestoreBegin) as (scope, _), scope:
            await client.load_checkpoint(ckpt)
        assert scope.cancelled_caught
        assert sorted(await client.load_checkpoint(ckpt)) == ["kv", "p"]
        meta = await client.get_meta(["ids"], 2, "p", "ref")
        assert (await client.get_data(meta))["ids"].shape == (2, 3)


async def test_a_load_given_up_on_while_it_stores_cells_leaves_no_cell_behind(
    tmp_path: Path,
) -> None:
    """Cancelled once some cells of the checkpoint reached a unit: the restore is aborted,
    the staged partitions go, and the units free the cells stored for them (the abort frees
    the staged incarnation's cells only, and those it stored are that one's)."""
    from tq_async._wire._protocol import StorePut

    ckpt = await saved(tmp_path, units=2)
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        with cancelled_at(StorePut) as (scope, stored), scope:
            await client.load_checkpoint(ckpt)
        assert scope.cancelled_caught
        assert len(stored) == 1
        assert await client.list_partitions() == []
        with anyio.fail_after(10):  # the units' clears are sent, not awaited
            while any(u.state.resident_bytes for u in cluster.units):
                await client.storage_stats()  # (a round trip to every unit)
        assert sorted(await client.load_checkpoint(ckpt)) == ["kv", "p"]


async def test_a_load_cancelled_while_it_commits_is_all_or_nothing(tmp_path: Path) -> None:
    """Cancelled once `RestoreCommit` went out: the controller commits, and the client's
    abort then finds nothing staged. The load is whole (every row readable), as the
    docstring says for a cancellation during the commit, never half of it."""
    from tq_async._wire._protocol import RestoreCommit

    ckpt = await saved(tmp_path, units=2)
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        with cancelled_at(RestoreCommit) as (scope, sent), scope:
            await client.load_checkpoint(ckpt)
        assert scope.cancelled_caught
        assert sent
        assert sorted(await client.list_partitions()) == ["kv", "p"]
        meta = await client.get_meta(["ids"], 4, "p", "ref")  # (`fill`'s "ref" read 0, 1)
        assert sorted(meta.global_indexes) == [2, 3, 4, 5]
        every = torch.cat([sample_batch()["ids"], torch.arange(6).reshape(2, 3)])
        assert torch.equal((await client.get_data(meta))["ids"], every[meta.global_indexes])
        assert cluster.controller.waiting == 0


async def test_aborting_a_restore_never_touches_a_live_partition_of_the_same_name(
    tmp_path: Path,
) -> None:
    """`RestoreAbort` names partitions; one that is not being restored is left alone (before,
    the controller told every unit to free that partition's cells, whatever they were)."""
    from tq_async._wire._protocol import RestoreAbort

    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        meta = await fill(client)
        await client._links.call(RestoreAbort(["p"]), None)
        got = await client.get_data(meta)
        assert torch.equal(got["ids"], sample_batch()["ids"])


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest", "version"])
async def test_corrupt_or_partial_checkpoint_is_refused(tmp_path: Path, damage: str) -> None:
    ckpt = await saved(tmp_path)
    cells = sorted(ckpt.glob("cells-*.bin"))[0]
    if damage == "flip":
        data = bytearray(cells.read_bytes())
        data[-1] ^= 0xFF
        cells.write_bytes(data)
    elif damage == "truncate":
        cells.write_bytes(cells.read_bytes()[:-3])
    elif damage == "delete":
        cells.unlink()
    elif damage == "manifest":
        (ckpt / "manifest.json").unlink()
    else:
        manifest = json.loads((ckpt / "manifest.json").read_text())
        manifest["format_version"] = 99
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        with pytest.raises(tq.CheckpointError):
            await client.load_checkpoint(ckpt)
        assert await client.list_partitions() == []  # nothing half-loaded
        assert all(u.state.resident_bytes == 0 for u in cluster.units)


async def test_save_replaces_atomically(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(3)}, partition_id="a")
        await client.save_checkpoint(ckpt)
        await client.put({"x": torch.arange(3)}, partition_id="b")
        await client.save_checkpoint(ckpt)  # replaces the old one whole
        assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temp dirs left behind
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        assert sorted(await client.load_checkpoint(ckpt)) == ["a", "b"]


_SWAP_KILLED = """
import os, shutil, signal, sys
from tq_async._client._async import _checkpoint
path = sys.argv[1]
tmp = _checkpoint._tmp_name(path)
shutil.copytree(path, tmp)  # the new checkpoint, whole: the swap starts once it is
renames = []
def rename(src, dst):
    renames.append(src)
    if len(renames) == 2:  # the old one is moved away, the new one not yet in place
        os.kill(os.getpid(), signal.SIGKILL)
    os.replace(src, dst)
os.rename = rename
_checkpoint._swap_into_place(tmp, path)
"""


async def test_a_save_killed_while_it_swaps_the_old_checkpoint_out_leaves_one_in_place(
    tmp_path: Path,
) -> None:
    """Between the save's two renames (the old checkpoint aside, the new one into place)
    ``path`` holds nothing; the next load, read or save of it finishes the swap."""
    ckpt = await saved(tmp_path)
    for read in (tq.checkpoint_metadata, "load", "save"):
        proc = await anyio.run_process([sys.executable, "-c", _SWAP_KILLED, str(ckpt)], check=False)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
        assert not ckpt.exists()
        async with (
            tq.local_cluster(num_storage_units=1) as cluster,
            tq.AsyncClient.connect(cluster.address) as client,
        ):
            if read == "load":
                assert await client.load_checkpoint(ckpt) == ["p", "kv"]
            elif read == "save":
                await client.save_checkpoint(ckpt)  # (not "exists and is not a checkpoint")
            else:
                assert tq.checkpoint_metadata(ckpt) == {}
        assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the old one dropped


_SAVE_KILLED = """
import os, signal, sys
import anyio, torch
import tq_async as tq
from tq_async._client._async import _checkpoint
path, step = sys.argv[1], sys.argv[2]
def kill(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
if step == "write":  # while it writes the cells, once state.msgpack is written
    write = _checkpoint._write
    _checkpoint._write = lambda name, chunks: (
        write(name, chunks) if name.endswith("state.msgpack") else kill()
    )
else:  # once the new checkpoint is in place, before the old one is removed
    _checkpoint.shutil.rmtree = kill
async def main():
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(3)}, partition_id="again")
        await client.save_checkpoint(path)
anyio.run(main)
"""


@pytest.mark.parametrize("step", ["write", "rmtree"])
async def test_what_a_save_killed_midway_left_beside_the_checkpoint_goes_with_the_next_save(
    tmp_path: Path, step: str
) -> None:
    """A save killed while it wrote leaves its temporary directory (a partial copy of every
    cell); one killed before it removed the older checkpoint leaves that: the next save of
    the path removes them."""
    ckpt = await saved(tmp_path)
    proc = await anyio.run_process(
        [sys.executable, "-c", _SAVE_KILLED, str(ckpt), step], check=False
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert len(os.listdir(tmp_path)) == 2  # the checkpoint and what the save left
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.save_checkpoint(ckpt)
    assert os.listdir(tmp_path) == ["ckpt"]


def test_a_save_still_running_keeps_its_temporary_directory(tmp_path: Path) -> None:
    """What `_sweep` removes beside a checkpoint: the temporary directory of a save that
    ended (its lock given back), not that of one still running."""
    from tq_async._client._async import _checkpoint

    path = str(tmp_path / "ckpt")
    ended = _checkpoint._tmp_name(path)
    os.close(_checkpoint._make_locked(ended))
    running = _checkpoint._tmp_name(path)
    lock = _checkpoint._make_locked(running)
    try:
        _checkpoint._sweep(path)
        assert os.listdir(tmp_path) == [os.path.basename(running)]
    finally:
        os.close(lock)


@pytest.mark.parametrize("again", [False, True], ids=["new", "replacing"])
async def test_a_saved_checkpoint_has_its_names_on_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, again: bool
) -> None:
    """Each file is synced, then the directory holding their names, then the one holding
    the rename into place: a save that returned survives a machine crash (a rename not
    synced may be undone by one, the files' names too)."""
    if again:
        await saved(tmp_path)
    synced: list[str] = []
    fsync = os.fsync

    def record(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    ckpt = await saved(tmp_path)
    *files, written, renamed = synced
    assert renamed == str(tmp_path)
    assert {os.path.dirname(p) for p in files} == {written}  # (the temporary name)
    assert {os.path.basename(p) for p in files} == set(os.listdir(ckpt))


async def test_global_batch_shares_survive_a_checkpoint(tmp_path: Path) -> None:
    # The controller records every rank's share of a global batch when the first rank asks;
    # the record is part of the checkpoint, so rank 1 reads its share after the restore.
    ckpt = tmp_path / "ckpt"
    sampler = tq.SeqlenBalancedSampler(dp_size=2)
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(4)}, "p", tags=[{"total_lengths": 5}] * 4)
        first = await client.get_meta(["x"], 2, "p", "t", {"dp_rank": 0, "batch_index": 0})
        await client.save_checkpoint(ckpt)
    async with (
        tq.local_cluster(num_storage_units=1, sampler=tq.SeqlenBalancedSampler(dp_size=2)) as cl,
        tq.AsyncClient.connect(cl.address) as client,
    ):
        await client.load_checkpoint(ckpt)
        share = await client.get_meta(["x"], 2, "p", "t", {"dp_rank": 1, "batch_index": 0})
        assert len(share) == 2
        assert sorted(first.global_indexes + share.global_indexes) == [0, 1, 2, 3]


class _Counting(tq.BaseSampler):
    """A stateful sampler: counts its calls, and checkpoints the count."""

    def __init__(self) -> None:
        self.calls = 0

    def sample(self, ready_indexes: Any, batch_size: int, *args: Any, **kw: Any) -> Any:
        self.calls += 1
        rows = list(ready_indexes[:batch_size])
        return rows, rows

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = int(state["calls"])


async def test_sampler_state_is_checkpointed(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    sampler = _Counting()
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(4)}, "p")
        await client.get_meta(["x"], 2, "p", "t")
        assert sampler.calls == 1
        await client.save_checkpoint(ckpt)
    restored = _Counting()
    async with (
        tq.local_cluster(num_storage_units=1, sampler=restored) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.load_checkpoint(ckpt)
        assert restored.calls == 1


async def test_an_auto_clear_jobs_waiting_batches_keep_their_rows_across_a_checkpoint(
    tmp_path: Path,
) -> None:
    """Auto-clear over "train" and "eval"; rank 0 of "train" (dp_size 2) read global batch 0,
    recording rank 1's share, when the checkpoint was taken. Restored, "eval" reads and
    acknowledges every row: the batches still owe them to "train" (before: the restored
    batches held nothing, auto-clear freed all eight rows and rank 1 got `RowsNotFound`).
    Both ranks read their shares, and acknowledging them frees every row."""
    ckpt = tmp_path / "ckpt"
    cfg = {"dp_rank": 0, "batch_index": 0, "dp_size": 2}
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.register_tasks(["train", "eval"], "p")
        await client.put({"x": torch.arange(8)}, "p")
        first = await client.get_meta(["x"], 4, "p", "train", cfg, lease=30.0)
        await client.save_checkpoint(ckpt)
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.register_tasks(["train", "eval"], "p")
        await client.load_checkpoint(ckpt)
        evaluated, _ = await client.get(["x"], 8, "p", "eval")  # read and acknowledged
        assert sorted(evaluated["x"].tolist()) == list(range(8))
        shares = [
            await client.get_meta(["x"], 4, "p", "train", cfg | {"dp_rank": rank}, lease=30.0)
            for rank in (0, 1)
        ]
        assert shares[0].global_indexes == first.global_indexes  # the same batch again
        for share in shares:
            assert (await client.get_data(share))["x"].tolist() == share.global_indexes
        for share in shares:
            await client.ack(share)
        assert (await client.partition_info("p"))["rows"] == 0


async def test_a_dp_end_of_stream_owed_to_a_rank_survives_a_checkpoint(tmp_path: Path) -> None:
    """DP rank 0 reached a stop_when_consumed end of stream at batch 1 (every row consumed,
    the partition not sealed) and more rows came before rank 1 asked batch 1, when the
    checkpoint was taken. Restored, rank 1 must end at batch 1 too (`ControllerState.dp_ends`
    is in the checkpoint), or it steps on alone and its all_reduce waits for ever; once told,
    the index is decided anew for a next round."""
    ckpt = tmp_path / "ckpt"

    async def fetch(c: tq.AsyncClient, rank: int, index: int) -> tq.BatchMeta:
        cfg = {"dp_size": 2, "dp_rank": rank, "batch_index": index}
        return await c.get_meta(["x"], 2, "p", "t", cfg, stop_when_consumed=True, timeout=10)

    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(4)}, "p")
        assert (await fetch(client, 0, 0)).global_indexes == [0, 1]
        assert (await fetch(client, 1, 0)).global_indexes == [2, 3]
        assert (await fetch(client, 0, 1)).end_of_stream
        await client.put({"x": torch.arange(4, 8)}, "p")  # more rows before rank 1 asks
        await client.save_checkpoint(ckpt)
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.load_checkpoint(ckpt)
        assert (await fetch(client, 1, 1)).end_of_stream  # in step with rank 0
        assert (await fetch(client, 0, 1)).global_indexes == [4, 5]
        assert (await fetch(client, 1, 1)).global_indexes == [6, 7]


async def test_rows_under_an_open_lease_are_not_lost_by_a_checkpoint(tmp_path: Path) -> None:
    """A consumer held rows 0 and 1 under a lease, not acknowledged, when the checkpoint was
    taken. The checkpoint holds no leases, so nobody can acknowledge them after the restore
    and no expiry gives them back: they must be ready for the task again, as the lease's
    expiry would have made them (before: consumed for good, the task never got them). Rows
    fetched without a lease, and an acknowledged lease's, stay consumed."""
    ckpt = tmp_path / "ckpt"
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(8)}, "p")
        leased = await client.get_meta(["x"], 2, "p", "t", lease=30.0)
        acked = await client.get_meta(["x"], 2, "p", "t", lease=30.0)
        await client.ack(acked)
        held = await client.get_meta(["x"], 2, "p", "t")  # no lease: never given back
        assert (leased.global_indexes, acked.global_indexes) == ([0, 1], [2, 3])
        assert held.global_indexes == [4, 5]
        await client.seal("p")
        await client.save_checkpoint(ckpt)
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.load_checkpoint(ckpt)
        assert (await client.partition_info("p"))["consumed"] == {"t": 4}
        rest = await client.get_meta(["x"], 8, "p", "t", timeout=10)
        assert sorted(rest.global_indexes) == [0, 1, 6, 7]
        assert (await client.get_data(rest))["x"].tolist() == rest.global_indexes


async def test_recycled_prompts_are_still_handed_out_after_a_checkpoint(tmp_path: Path) -> None:
    """The learner's `StalenessSampler` recycled three stale rows (consumed, queued for
    ``take_recycled``) when the checkpoint was taken. Restored, the queue must come back
    with the partition, each row handed out once (before: it was empty and the rows
    consumed, so their prompts were never regenerated)."""
    ckpt = tmp_path / "ckpt"

    def sampler() -> tq.StalenessSampler:
        return tq.StalenessSampler(max_staleness=0, on_stale="recycle")

    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler()) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(4)}, "p", policy_version=[0, 0, 0, 1])
        await client.set_policy_version(1)  # rows 0-2 are one version too old
        assert (await client.get_meta(["x"], 1, "p", "learner")).global_indexes == [3]
        assert (await client.staleness_status())["recycled_pending"] == 3
        await client.save_checkpoint(ckpt)
    async with (
        tq.local_cluster(num_storage_units=2, sampler=sampler()) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.load_checkpoint(ckpt)
        assert (await client.staleness_status())["recycled_pending"] == 3
        taken = await client.take_recycled()
        assert [m.global_indexes for m in taken] == [[0, 1, 2]]
        assert (await client.get_data(taken[0]))["x"].tolist() == [0, 1, 2]
        assert await client.take_recycled() == []  # exactly once


async def test_recycled_rows_restored_under_auto_clear_stay_until_acknowledged(
    tmp_path: Path,
) -> None:
    """As above, with the learner auto-clearing on both sides: the rows queued for
    ``take_recycled`` are consumed by every auto-clear task, yet restoring must not free
    them (before: the restore freed them at once, so the queue named rows that were gone);
    they stay held until taken and acknowledged."""
    ckpt = tmp_path / "ckpt"
    sampler = tq.StalenessSampler(max_staleness=0, on_stale="recycle")
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.register_tasks(["learner"])
        await client.put({"x": torch.arange(4)}, "p", policy_version=[0, 0, 0, 1])
        await client.set_policy_version(1)  # rows 0-2 are one version too old
        await client.ack(await client.get_meta(["x"], 1, "p", "learner"))
        assert (await client.partition_info("p"))["rows"] == 3
        await client.save_checkpoint(ckpt)
    sampler = tq.StalenessSampler(max_staleness=0, on_stale="recycle")
    async with (
        tq.local_cluster(num_storage_units=1, sampler=sampler) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.register_tasks(["learner"])
        await client.load_checkpoint(ckpt)
        assert (await client.partition_info("p"))["rows"] == 3
        taken = await client.take_recycled()
        assert [m.global_indexes for m in taken] == [[0, 1, 2]]
        assert (await client.get_data(taken[0]))["x"].tolist() == [0, 1, 2]
        await client.ack(taken)
        assert (await client.partition_info("p"))["rows"] == 0


async def test_a_partition_named_twice_is_saved_once(tmp_path: Path) -> None:
    """``save_checkpoint(path, ["p", "p"])`` writes ``p`` once, and loads back (before: the
    checkpoint held it twice, and every load of it failed with "TQError: KeyError: p"); a
    checkpoint that holds a partition twice is refused as inconsistent, loading nothing."""
    import hashlib

    import msgspec

    from tq_async._wire._protocol import StateDump

    ckpt = tmp_path / "ckpt"
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(8)}, "p")
        await client.put({"x": torch.arange(8, 12)}, "p")
        await client.save_checkpoint(ckpt, ["p", "p"])
        await client.clear_partition("p")
        assert await client.load_checkpoint(ckpt) == ["p"]
        meta = await client.get_meta(["x"], 12, "p", "t")
        assert (await client.get_data(meta))["x"].tolist() == list(range(12))
        await client.clear_partition("p")
        # a checkpoint holding "p" twice (as the old save_checkpoint wrote it)
        state_path = ckpt / "state.msgpack"
        state = msgspec.msgpack.decode(state_path.read_bytes(), type=StateDump)
        state.partitions *= 2
        blob = msgspec.msgpack.encode(state)
        state_path.write_bytes(blob)
        manifest = json.loads((ckpt / "manifest.json").read_text())
        manifest["files"]["state.msgpack"] = {
            "bytes": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(),
        }
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(tq.CheckpointError, match="twice"):
            await client.load_checkpoint(ckpt)
        assert await client.list_partitions() == []


async def test_a_partition_id_passed_as_a_string_is_refused_clearly(tmp_path: Path) -> None:
    """``save_checkpoint(path, "train")`` (a string where a list of partition ids goes) says
    to pass a list (before: "partition 't' does not exist", one letter of the id), and
    writes nothing."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(4)}, "train")
        with pytest.raises(tq.InvalidRequestError, match=r"pass \['train'\]"):
            await client.save_checkpoint(tmp_path / "ckpt", "train")
        assert os.listdir(tmp_path) == []
        await client.save_checkpoint(tmp_path / "ckpt", ["train"])
        assert (tmp_path / "ckpt" / "manifest.json").is_file()


async def test_rows_held_at_a_checkpoint_are_auto_cleared_once_restored(tmp_path: Path) -> None:
    """Under auto-clear, task "t" (the only one) fetched four of six rows, a hold not yet
    acknowledged, when the checkpoint was taken. Restored, nobody can acknowledge that hold:
    the rows every auto-clear task consumed are freed (before: they stayed for ever, taking
    capacity, since only an ack frees them)."""
    ckpt = tmp_path / "ckpt"
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.register_tasks(["t"], "p")
        await client.put({"x": torch.arange(6)}, "p")
        held = await client.get_meta(["x"], 4, "p", "t")
        assert held.lease_id  # a hold
        assert (await client.partition_info("p"))["rows"] == 6
        await client.save_checkpoint(ckpt)
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.register_tasks(["t"], "p")
        await client.load_checkpoint(ckpt)
        assert (await client.partition_info("p"))["rows"] == 2
        _, rest = await client.get(["x"], 2, "p", "t")
        assert rest.global_indexes == [4, 5]
        assert (await client.partition_info("p"))["rows"] == 0


async def test_rows_freed_while_a_checkpoint_reads_cells_do_not_fail_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Consumers go on while a checkpoint is saved (only producers pause): under auto-clear
    an acknowledgement frees rows 0 and 1 after the controller's snapshot named them, before
    their cells are read. The save takes a new snapshot and goes through, holding rows 2
    and 3 (before: it failed with "row 0 of field 'x' ... is not stored")."""
    from tq_async._transport._dealer import DealerConnection
    from tq_async._wire._protocol import StoreGet

    ckpt = tmp_path / "ckpt"
    request = DealerConnection.request
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
        tq.AsyncClient.connect(cluster.address) as consumer,
    ):
        await client.register_tasks(["t"], "p")
        await client.put({"x": torch.arange(4)}, "p")
        meta = await consumer.get_meta(["x"], 2, "p", "t")
        acked: list[int] = []

        async def acking(self: DealerConnection, body: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(body, StoreGet) and not acked:
                acked.append(1)
                await consumer.ack(meta)  # auto-clear frees rows 0 and 1 now
            return await request(self, body, *args, **kwargs)

        monkeypatch.setattr(DealerConnection, "request", acking)
        await client.save_checkpoint(ckpt)
        monkeypatch.setattr(DealerConnection, "request", request)
        assert acked
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.load_checkpoint(ckpt)
        rest = await client.get_meta(["x"], 2, "p", "t", timeout=10)
        assert rest.global_indexes == [2, 3]
        assert (await client.get_data(rest))["x"].tolist() == [2, 3]


async def test_a_dropped_tail_is_still_counted_after_a_checkpoint(tmp_path: Path) -> None:
    """``partition_info``'s ``dropped`` (rows a task consumed without their being delivered,
    an uneven tail dropped) survives a checkpoint, as it survives a durable controller's
    restart (before: the restored partition said none were dropped)."""
    ckpt = tmp_path / "ckpt"
    cfg = {"dp_size": 2, "dp_rank": 0, "tail": "drop"}
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(5)}, "p")
        await client.seal("p")
        assert len(await client.get_meta(["x"], 2, "p", "t", cfg | {"batch_index": 0})) == 2
        assert (await client.get_meta(["x"], 2, "p", "t", cfg | {"batch_index": 1})).end_of_stream
        assert (await client.partition_info("p"))["dropped"] == {"t": 1}
        await client.save_checkpoint(ckpt)
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.load_checkpoint(ckpt)
        assert (await client.partition_info("p"))["dropped"] == {"t": 1}


async def test_save_never_replaces_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    """``save_checkpoint`` replaces an older checkpoint (or an empty directory) at ``path``,
    never a file or a directory of other things: it refuses, and they stay as they were
    (before: they were replaced and deleted, a file leaving a stray ``.old`` behind)."""
    a_file, a_dir, empty = tmp_path / "file", tmp_path / "dir", tmp_path / "empty"
    a_file.write_text("mine")
    a_dir.mkdir()
    (a_dir / "notes.txt").write_text("mine too")
    empty.mkdir()
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"x": torch.arange(3)}, partition_id="a")
        for path in (a_file, a_dir):
            with pytest.raises(tq.CheckpointError, match="not a tq_async checkpoint"):
                await client.save_checkpoint(path)
        await client.save_checkpoint(empty)
    assert a_file.read_text() == "mine"
    assert (a_dir / "notes.txt").read_text() == "mine too"
    assert sorted(os.listdir(tmp_path)) == ["dir", "empty", "file"]
    assert tq.checkpoint_metadata(empty) == {}


class _Counts(tq.SequentialSampler):
    """Counts its batches in ``_states`` (what a checkpoint saves)."""

    def sample(self, ready: Any, batch_size: int, *args: Any, **kwargs: Any) -> Any:
        self._states["n"] = self._states.get("n", 0) + 1
        return super().sample(ready, batch_size, *args, **kwargs)


class _CannotLoad(tq.SequentialSampler):
    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise KeyError("rng")


async def test_a_sampler_that_cannot_load_the_saved_state_restores_nothing(
    tmp_path: Path,
) -> None:
    """A checkpoint loaded by a controller whose sampler cannot read the saved state: a
    `CheckpointError` naming the sampler and what to do, and no partition restored. Before,
    the sampler's bare ``KeyError`` came back after the partitions had been made live, the
    sampler's state half loaded."""
    ckpt = tmp_path / "ckpt"
    async with (
        tq.local_cluster(num_storage_units=1, sampler=_Counts()) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await fill(client)
        await client.get_meta(["ids"], 2, "p", "ref")
        await client.save_checkpoint(ckpt)
    async with (
        tq.local_cluster(num_storage_units=1, sampler=_CannotLoad()) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        with pytest.raises(tq.CheckpointError, match=r"sampler _CannotLoad.*KeyError.*restored"):
            await client.load_checkpoint(ckpt)
        assert await client.list_partitions() == []


async def test_rows_that_differ_in_more_than_their_first_dimension_are_saved(
    tmp_path: Path,
) -> None:
    """README: a field's rows may change shape from put to put (images of different heights
    and widths); only reading them together is refused. A checkpoint read each field's rows
    together: its save failed with that SchemaError, so a partition holding such rows could
    not be checkpointed at all. It saves them, and each put's rows read back as they were."""
    ckpt = tmp_path / "ckpt"
    images = [torch.randn(2, 3, 4), torch.randn(3, 5, 2), torch.randn(1, 3, 4)]
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        for img in images:
            await client.put({"img": img}, partition_id="p")
        await client.save_checkpoint(ckpt)
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        assert await client.load_checkpoint(ckpt) == ["p"]
        for img in images:  # rows in order, one put's at a time
            meta = await client.get_meta(["img"], len(img), "p", "t")
            assert torch.equal((await client.get_data(meta))["img"], img)


async def test_dense_rows_padded_per_put_come_back_dense_after_a_restore(tmp_path: Path) -> None:
    """A field padded per put (rollouts of 3 then 5 tokens) reads back dense, one put's rows
    at a time. A checkpoint read the field's rows together, as one jagged column, and
    restored them so: after a restore the same reads returned nested tensors."""
    ckpt = tmp_path / "ckpt"
    ids = [torch.arange(12).reshape(4, 3), torch.arange(10).reshape(2, 5)]
    scores = [torch.ones(2, 2), torch.zeros(2, 1)]  # put into rows [0, 2] and [1, 3] later
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        first = await client.put({"ids": ids[0]}, partition_id="p")
        await client.put({"ids": ids[1]}, partition_id="p")
        await client.put({"score": scores[0]}, meta=first.select_rows([0, 2]))
        await client.put({"score": scores[1]}, meta=first.select_rows([1, 3]))
        await client.save_checkpoint(ckpt)
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.load_checkpoint(ckpt)
        for want in ids:
            meta = await client.get_meta(["ids"], len(want), "p", "t")
            got = (await client.get_data(meta))["ids"]
            assert not got.is_nested
            assert torch.equal(got, want)
        meta = await client.get_meta(["score"], 4, "p", "scores")
        for rows, want in zip(([0, 2], [1, 3]), scores, strict=True):
            got = (await client.get_data(meta.select_rows(rows)))["score"]
            assert not got.is_nested
            assert torch.equal(got, want)


async def test_a_partition_whose_arrays_dropped_cleared_rows_round_trips(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller keeps no state for cleared rows at a partition's front (its arrays
    start at row ``base``): a checkpoint saves the live rows under their ids, and a load
    puts their cells back under them; new rows continue the ids."""
    monkeypatch.setattr(_arrays, "COMPACT_ROWS", 2)
    ckpt = tmp_path / "ckpt"
    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        old = await client.put({"x": torch.arange(6)}, partition_id="p")
        await client.put({"x": torch.arange(6, 9)}, partition_id="p", tags=[{"g": 1}] * 3)
        await client.clear_samples(old)
        assert cluster.controller.state.partitions["p"].base == 6
        await client.save_checkpoint(ckpt)
    async with (
        tq.local_cluster(num_storage_units=3) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        assert await client.load_checkpoint(ckpt) == ["p"]
        meta = await client.get_meta(["x"], 3, "p", "t")
        assert meta.global_indexes == [6, 7, 8]
        assert meta.tags == [{"g": 1}] * 3
        assert (await client.get_data(meta))["x"].tolist() == [6, 7, 8]
        assert (await client.put({"x": torch.arange(2)}, partition_id="p")).global_indexes == [
            9,
            10,
        ]


async def test_dense_rows_of_a_field_first_put_jagged_come_back_dense_after_a_restore(
    tmp_path: Path,
) -> None:
    """A field first put jagged (responses of 1, 5 and 2 tokens) and later dense (2 rows of 3)
    reads each put's rows back as they were put, also when both went into rows of one put
    (``late``). A checkpoint read the field's rows together (one jagged column, the field's
    kind) and restored them so: after a restore the dense rows read back as a nested tensor."""
    ckpt = tmp_path / "ckpt"
    jagged = torch.nested.nested_tensor(
        [torch.arange(n, dtype=torch.int64) for n in (1, 5, 2)], layout=torch.jagged
    )
    dense = torch.arange(6).reshape(2, 3)

    async def read_back(client: tq.AsyncClient, pid: str, field: str) -> None:
        meta = await client.get_meta([field], 3, pid, field)
        got = (await client.get_data(meta))[field]
        assert got.is_nested
        assert [r.tolist() for r in got.unbind()] == [r.tolist() for r in jagged.unbind()]
        meta = await client.get_meta([field], 2, pid, field)
        got = (await client.get_data(meta))[field]
        assert not got.is_nested
        assert torch.equal(got, dense)

    async with (
        tq.local_cluster(num_storage_units=2) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put({"resp": jagged}, partition_id="p")
        await client.put({"resp": dense}, partition_id="p")
        rows = await client.put({"x": torch.arange(5)}, partition_id="q")
        await client.put({"late": jagged}, meta=rows.select_rows([0, 1, 2]))
        await client.put({"late": dense}, meta=rows.select_rows([3, 4]))
        await client.save_checkpoint(ckpt)
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        assert sorted(await client.load_checkpoint(ckpt)) == ["p", "q"]
        await read_back(client, "p", "resp")
        await read_back(client, "q", "late")
