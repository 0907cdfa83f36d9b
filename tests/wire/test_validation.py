"""Every number from the wire is validated on the server, and by the client before sending.

One caller's bad float must never degrade another caller's service (issue 14, defect 6): a
NaN lease once corrupted the controller's timer heap, so other clients' timeouts stopped
firing. Bad input from outside the TQError tree is covered too (defect 11).
"""

from __future__ import annotations

import math
import time
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tq_async as tq
from _cluster_proc import serve_cluster
from tq_async._transport._dealer import DealerConnection
from tq_async._wire._checks import validate
from tq_async._wire._codec import tags_for_wire
from tq_async._wire._columns import ColumnHeader
from tq_async._wire._protocol import (
    AcquireRollout,
    GetMeta,
    PartitionDump,
    PutBegin,
    PutCommit,
    PutInline,
    RegisterUnit,
    ReleaseRollout,
    RestoreBegin,
    SetPolicyVersion,
    StateDump,
    StorePut,
    TakeRecycled,
    WatchNext,
)

NAN, INF = math.nan, math.inf


def _get_meta(**kw: Any) -> GetMeta:
    args: dict[str, Any] = {
        "partition_id": "p",
        "data_fields": ["x"],
        "batch_size": 1,
        "task_name": "t",
    }
    return GetMeta(**(args | kw))


_HEADER = ColumnHeader("x", "dense", "float32")

#: (request, the argument its error must name)
BAD_REQUESTS: list[tuple[msgspec.Struct, str]] = [
    (_get_meta(lease=NAN), "lease"),
    (_get_meta(lease=INF), "lease"),
    (_get_meta(lease=-1.0), "lease"),
    (_get_meta(timeout=NAN), "timeout"),
    (_get_meta(timeout=INF), "timeout"),
    (_get_meta(timeout=-1.0), "timeout"),
    (_get_meta(timeout=-0.001), "timeout"),  # 0 itself means "answer now" (test_controller)
    (_get_meta(sampling_config={"record_from": 0}), "record_from"),
    (_get_meta(sampling_config={"batch_index": 1, "record_from": -1}), "record_from"),
    (_get_meta(batch_size=0), "batch_size"),
    (_get_meta(batch_size=2**63), "batch_size"),
    (_get_meta(inline_bytes=-1), "inline_bytes"),
    (_get_meta(sampling_config={"batch_index": "3"}), "batch_index"),
    (_get_meta(sampling_config={"dp_rank": -1}), "dp_rank"),
    (_get_meta(sampling_config={"dp_size": 0}), "dp_size"),
    (_get_meta(sampling_config={"dp_size": NAN}), "dp_size"),
    (PutBegin("p", [_HEADER], n_rows=-1), "n_rows"),
    (PutBegin("p", [_HEADER], n_rows=2**40), "n_rows"),
    (PutBegin("p", [_HEADER], n_rows=1, timeout=NAN), "timeout"),
    (PutCommit("p", [0], ["x"], versions=[-1]), "policy_version"),
    (PutCommit("p", [0], ["x"], versions=[2**63]), "policy_version"),
    (PutInline("p", [_HEADER], n_rows=1, timeout=INF), "timeout"),
    (AcquireRollout(-1), "policy_version"),
    (AcquireRollout(0, 0), "n"),
    (AcquireRollout(0, 1, timeout=NAN), "timeout"),
    (SetPolicyVersion(-5), "version"),
    (ReleaseRollout(-1), "n"),
    (TakeRecycled(0), "max_rows"),
    (RegisterUnit(2**40, "tcp://127.0.0.1:1"), "unit_id"),
    (PutBegin("p", [ColumnHeader("x", "dense", "float32", (-1,))], n_rows=1), "shape"),
    (PutInline("p", [ColumnHeader("x", "dense", "nope")], n_rows=1), "dtype"),
    (PutBegin("p", [ColumnHeader("x", "sparse")], n_rows=1), "kind"),
    (StorePut("p", [0], [ColumnHeader("x", "dense", "float32", (2**40,))]), "shape"),
    (
        RestoreBegin(
            StateDump(
                [
                    PartitionDump(
                        partition_id="p",
                        n_rows=1,
                        alive=b"\x01",
                        origin=[0],
                        units=[0],
                        tags=[None],
                        row_keys=[None],
                        sealed=False,
                        fields=[],
                        consumed={},
                        deliveries=[],
                        row_version=[2**63],
                    )
                ],
                {},
            )
        ),
        "row_version",
    ),
    (WatchNext(0, watchers=0), "watchers"),
    (WatchNext(0, watchers=(1 << 16) + 1), "watchers"),
]


@pytest.mark.parametrize(("body", "argument"), BAD_REQUESTS)
def test_validate_names_the_argument(body: msgspec.Struct, argument: str) -> None:
    with pytest.raises(tq.InvalidRequestError, match=argument):
        validate(body)


async def test_server_rejects_bad_numbers_and_keeps_serving() -> None:
    async with tq.local_cluster(num_storage_units=1) as cluster:
        raw = DealerConnection(cluster.address)
        try:
            for body, argument in BAD_REQUESTS:
                if isinstance(body, (RegisterUnit, StorePut)):
                    continue  # for a unit, or would register one: the unit test covers it
                with pytest.raises(tq.InvalidRequestError, match=argument):
                    await raw.request(body, timeout=5)
        finally:
            raw.close()
        async with tq.AsyncClient.connect(cluster.address) as client:
            meta = await client.put({"x": torch.arange(4)}, "p")
            assert (await client.get_data(meta))["x"].tolist() == [0, 1, 2, 3]


async def test_storage_unit_rejects_bad_headers() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        meta = await client.put({"x": torch.arange(2)}, "p")
        raw = DealerConnection(client._links.unit_addresses[0])
        try:
            bad = StorePut("p", [0], [ColumnHeader("x", "dense", "float32", (-1,))])
            with pytest.raises(tq.InvalidRequestError, match="shape of column 'x'"):
                await raw.request(bad, [b"\0" * 4], timeout=5)
        finally:
            raw.close()
        assert (await client.get_data(meta))["x"].tolist() == [0, 1]


async def test_client_rejects_bad_numbers_before_sending() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        for kw, name in (
            ({"lease": NAN}, "lease"),
            ({"lease": -1}, "lease"),
            ({"timeout": NAN}, "timeout"),
            ({"timeout": INF}, "timeout"),
            ({"timeout": -1}, "timeout"),
            ({"sampling_config": {"batch_index": -1}}, "batch_index"),
        ):
            with pytest.raises(tq.InvalidRequestError, match=name):
                await client.get_meta(["x"], 1, "p", "t", **kw)
        with pytest.raises(tq.InvalidRequestError, match="batch_size"):
            await client.get_meta(["x"], 2**64, "p", "t")
        with pytest.raises(tq.InvalidRequestError, match="timeout"):
            await client.put({"x": torch.zeros(2)}, "p", timeout=NAN)
        with pytest.raises(tq.InvalidRequestError, match="policy_version"):
            await client.put({"x": torch.zeros(2)}, "p", policy_version=-1)
        with pytest.raises(tq.InvalidRequestError, match="policy_version"):
            await client.put({"x": torch.zeros(2)}, "p", policy_version=[0, 2**64])
        with pytest.raises(tq.InvalidRequestError, match="timeout"):
            await client.acquire_rollout(0, timeout=NAN)
        with pytest.raises(tq.InvalidRequestError, match="max_rows"):
            await client.take_recycled(NAN)  # type: ignore[arg-type]
        with pytest.raises(tq.InvalidRequestError, match="version"):
            await client.set_policy_version(NAN)  # type: ignore[arg-type]
        with pytest.raises(tq.InvalidRequestError, match="request_timeout"):
            tq.AsyncClient(cluster.address, request_timeout=NAN)
        assert await client.list_partitions() == []
        # numpy and torch integers are integers
        meta = await client.put({"x": torch.zeros(2)}, "p", policy_version=np.int64(3))
        assert meta.policy_versions["x"] == [3, 3]
        meta = await client.put({"x": torch.zeros(2)}, "p", policy_version=torch.tensor([1, 2]))
        assert meta.policy_versions["x"] == [1, 2]


async def test_a_nan_lease_does_not_delay_other_clients_timeouts() -> None:
    """Issue 14 defect 6: lease=nan once broke the controller's timer queue for everyone."""
    with serve_cluster(storage_units=1) as address:
        raw = DealerConnection(address)
        try:
            async with tq.AsyncClient.connect(address, request_timeout=4) as client:
                await client.put({"x": torch.arange(8)}, "p")
                async with anyio.create_task_group() as tg:

                    async def park(task: str) -> None:
                        with pytest.raises(tq.TQTimeoutError):
                            await client.get_meta(["never"], 1, "p", task, timeout=20)

                    tg.start_soon(park, "w0")
                    for kw, name in (
                        ({"lease": NAN, "task_name": "leaser"}, "lease"),
                        ({"lease": INF, "task_name": "leaser"}, "lease"),
                        ({"timeout": NAN}, "timeout"),
                        ({"timeout": INF}, "timeout"),
                        ({"timeout": -1.0}, "timeout"),
                    ):
                        with pytest.raises(tq.InvalidRequestError, match=name):
                            await raw.request(_get_meta(**kw), timeout=5)
                    for i in range(1, 11):
                        tg.start_soon(park, f"w{i}")

                    async def probe(i: int) -> float:
                        t0 = time.perf_counter()
                        with pytest.raises(tq.TQTimeoutError):
                            await client.get_meta(["never"], 1, "p", f"probe{i}", timeout=0.3)
                        return time.perf_counter() - t0

                    took = [await probe(i) for i in range(3)]
                    tg.cancel_scope.cancel()
                assert max(took) < 2.0, took
                # the leaser's rows were never leased: they are still there for it
                meta = await client.get_meta(["x"], 8, "p", "leaser", timeout=5)
                assert len(meta) == 8
        finally:
            raw.close()


async def test_bad_values_raise_tq_errors_before_anything_is_sent() -> None:
    """Issue 14 defect 11: each of these once escaped the TQError tree."""
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        x = {"x": torch.zeros(4)}
        cases: list[tuple[Any, type[tq.TQError], str]] = [
            (lambda: client.put({"s": torch.tensor(1.0)}, "p"), tq.SchemaError, r"'s'.*0-dim"),
            (
                lambda: client.put({"m": torch.zeros(4, device="meta")}, "p"),
                tq.UnsupportedTypeError,
                r"'m'.*meta device",
            ),
            (lambda: client.put({"": torch.zeros(4)}, "p"), tq.SchemaError, "non-empty"),
            (
                lambda: client.put(x, "p", tags=[{"uid": object()}] * 4),
                tq.UnsupportedTypeError,
                r"tags\[0\]\['uid'\].*object",
            ),
            (
                lambda: client.put(x, "p", tags=[{"uid": 2**70}] * 4),
                tq.UnsupportedTypeError,
                r"tags\[0\]\['uid'\].*64 bits",
            ),
            (
                lambda: client.put(x, "p", tags=[{1: 2}] * 4),
                tq.InvalidRequestError,
                r"tags\[0\] has key 1.*strings",
            ),
            (
                lambda: client.put(x, "p\ud800"),
                tq.InvalidRequestError,
                "partition_id.*UTF-8",
            ),
            (
                lambda: client.get_meta(["x"], 1, "p", "t\udc80"),
                tq.InvalidRequestError,
                "task_name.*UTF-8",
            ),
            (
                lambda: client.kv_put("k\ud800", "p", tag={"a": 1}),
                tq.InvalidRequestError,
                "key.*UTF-8",
            ),
            (  # among many keys, the one that cannot travel is named
                lambda: client.kv_batch_get(["a", "b", "c\udc80", "d"], "p"),
                tq.InvalidRequestError,
                r"key 'c\\udc80' is not valid UTF-8",
            ),
            (
                lambda: client.put({"x\ud800": torch.zeros(4)}, "p"),
                tq.InvalidRequestError,
                "field name.*UTF-8",
            ),
            (
                lambda: client.get_meta(["x"], 2**64, "p", "t", timeout=1),
                tq.InvalidRequestError,
                "batch_size",
            ),
            (  # (named as get_meta names it; was the encoder's "Seal cannot be sent")
                lambda: client.seal("p\ud800"),
                tq.InvalidRequestError,
                r"partition_id 'p\\ud800' is not valid UTF-8",
            ),
        ]
        for make, kind, match in cases:
            with pytest.raises(kind, match=match):
                await make()
        assert await client.list_partitions() == []  # nothing was written


async def test_numpy_and_torch_tag_scalars_become_python_numbers() -> None:
    async with (
        tq.local_cluster(num_storage_units=1) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        tags = [
            {"uid": np.int64(i), "len": torch.tensor(i + 0.5), "ok": np.bool_(True)}
            for i in range(2)
        ]
        meta = await client.put({"x": torch.zeros(2)}, "p", tags=tags)
        assert meta.tags == [{"uid": 0, "len": 0.5, "ok": True}, {"uid": 1, "len": 1.5, "ok": True}]
        got = await client.get_meta(["x"], 2, "p", "t", timeout=5)
        assert got.tags == meta.tags
        assert all(type(t["uid"]) is int for t in got.tags)
        await client.set_tags(got, [{"w": np.float32(2.0)}, {"w": [np.int32(1)]}])
        got = await client.get_meta(["x"], 2, "p", "t2", mode="peek", timeout=5)
        assert got.tags[0]["w"] == 2.0
        assert got.tags[1]["w"] == [1]
        with pytest.raises(tq.UnsupportedTypeError, match=r"tags\[0\]\['t'\]"):
            await client.set_tags(got, [{"t": torch.zeros(3)}, {}])


_seconds = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True))
#: what a sampling_config value may be (msgpack: anything)
_anything = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.text(max_size=3),
)


@settings(max_examples=300, deadline=None)
@given(
    batch_size=st.integers(min_value=-(2**63), max_value=2**64 - 1),  # what msgpack carries
    timeout=_seconds,
    lease=_seconds,
    rank=_anything,
    index=_anything,
)
def test_validate_accepts_or_names_never_crashes(
    batch_size: int, timeout: float | None, lease: float | None, rank: Any, index: Any
) -> None:
    body = _get_meta(
        batch_size=batch_size,
        timeout=timeout,
        lease=lease,
        sampling_config={"dp_rank": rank, "batch_index": index},
    )
    try:
        validate(body)
        error = ""
    except tq.InvalidRequestError as exc:
        error = str(exc)
    if error:
        assert any(n in error for n in ("batch_size", "timeout", "lease", "dp_rank", "index"))
        return
    # what passes is safe for timers, arrays and the encoder
    assert 1 <= batch_size < 2**63
    assert lease is None or (math.isfinite(lease) and lease > 0)
    # a timeout of 0 is "answer now": the controller arms no timer for it
    assert timeout is None or (math.isfinite(timeout) and timeout >= 0)
    for v in (rank, index):
        assert v is None or (type(v) is int and 0 <= v < 2**63)


_tag_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(),
        st.text(),
        st.binary(max_size=8),
        st.builds(object),
        st.integers(-5, 5).map(np.int64),
        st.floats(-5, 5).map(torch.tensor),
    ),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    tags=st.lists(
        st.one_of(
            st.none(),
            st.dictionaries(st.one_of(st.text(max_size=4), st.integers()), _tag_values, max_size=3),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_tags_travel_or_fail_with_a_tq_error(tags: list[Any]) -> None:
    try:
        out = tags_for_wire(tags)
    except tq.TQError:
        return
    msgspec.msgpack.Encoder().encode(out)  # never raises once accepted
    assert len(out) == len(tags)
