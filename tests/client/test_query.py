"""A read's arguments, checked once into a MetaQuery (without a cluster)."""

from __future__ import annotations

from typing import Any

import pytest

import tq_async as tq
from tq_async._client._async._query import MetaQuery, lease_ids, meta_query
from tq_async._client._sync._query import meta_query as blocking_meta_query
from tq_async._meta import BatchMeta


def _meta(lease_id: int) -> BatchMeta:
    return BatchMeta(
        partition_id="p", global_indexes=[0], field_names=["x"], units=[0], lease_id=lease_id
    )


def test_a_query_carries_what_the_controller_is_asked() -> None:
    query = meta_query(
        ("x", "y"),
        8,
        "p",
        "t",
        {"batch_index": 3},
        timeout=2.0,
        lease=5.0,
        ack=[_meta(7), _meta(0)],
        also=[4, 5],
        nested=["x"],
    )
    assert isinstance(query, MetaQuery)
    assert query.fields == ["x", "y"]
    assert query.batch_index == 3
    assert query.recorded  # a fetch under a batch_index: its rows are never released
    assert query.ack == [7]
    assert query.nested == frozenset({"x"})
    request = query.request(1024)
    assert (request.partition_id, request.task_name, request.batch_size) == ("p", "t", 8)
    assert request.also == [4, 5]
    assert request.inline_bytes == 1024
    peek = meta_query(["x"], 1, "p", "t", {"batch_index": 3}, mode="peek")
    assert not peek.recorded
    assert not meta_query(["x"], 1, "p", "t").recorded


def test_the_callers_config_is_copied() -> None:
    config: dict[str, Any] = {"dp_rank": 0}
    query = meta_query(["x"], 1, "p", "t", config)
    config["dp_rank"] = 1
    assert query.config == {"dp_rank": 0}
    assert meta_query(["x"], 1, "p", "t", {}).config is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"data_fields": "x"}, "data_fields must be a list"),
        ({"batch_size": 0}, "batch_size"),
        ({"task_name": ""}, "task_name must be a non-empty string"),
        ({"partition_id": 3}, "partition_id must be a non-empty string"),
        ({"mode": "take"}, "mode must be 'fetch' or 'peek'"),
        ({"timeout": -1}, "timeout"),
        ({"lease": True}, "lease"),
        ({"sampling_config": {"tail": "drop"}}, "'tail' without 'dp_size'"),
        ({"sampling_config": {"dp_size": 2, "dp_rank": 2, "batch_index": 0}}, "out of range"),
        ({"nested": "x"}, "nested must be True/False or a list"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_sent(
    kwargs: dict[str, Any], message: str
) -> None:
    args: dict[str, Any] = {
        "data_fields": ["x"],
        "batch_size": 1,
        "partition_id": "p",
        "task_name": "t",
    }
    args.update(kwargs)
    for check in (meta_query, blocking_meta_query):  # the blocking client's twin
        with pytest.raises(tq.InvalidRequestError, match=message):
            check(**args)


def test_a_timeout_of_zero_answers_at_once() -> None:
    assert meta_query(["x"], 1, "p", "t", timeout=0).timeout == 0


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf")])
def test_a_bad_read_timeout_says_that_zero_answers_at_once(bad: float) -> None:
    """A read's ``timeout`` takes 0 (answer only what is ready now); its error said
    "timeout must be positive", which contradicts that."""
    for check in (meta_query, blocking_meta_query):
        with pytest.raises(tq.InvalidRequestError) as info:
            check(["x"], 1, "p", "t", timeout=bad)
        assert "must be positive" not in str(info.value)
        assert "timeout=0" in str(info.value)


def test_only_leased_batches_are_acknowledged() -> None:
    assert lease_ids(None) is None
    assert lease_ids(_meta(0)) is None
    assert lease_ids(_meta(3)) == [3]
    assert lease_ids([_meta(3), _meta(0), _meta(4)]) == [3, 4]
