"""`PolicyVersions`, a partition's record of which policy produced each cell, tested alone."""

from __future__ import annotations

import pytest

from tq_async import InvalidRequestError
from tq_async._core._versions import PolicyVersions


def test_new_rows_have_no_version() -> None:
    v = PolicyVersions(2)
    v.grow(3)
    assert list(v.rows) == [-1] * 5
    assert v.fields == {}


def test_a_row_keeps_its_oldest_version_and_each_field_its_own() -> None:
    v = PolicyVersions(4)
    v.record([1, 2], ["a"], [7, 5])
    v.record([2, 3], ["b"], [3, 9])
    v.record([1], ["a"], [8])  # a newer version of a field: the row keeps its oldest
    assert list(v.rows) == [-1, 7, 3, 9]
    assert list(v.fields["a"]) == [-1, 8, 5, -1]
    assert list(v.fields["b"]) == [-1, -1, 3, 9]


def test_fields_that_carried_a_version_grow_with_the_rows() -> None:
    v = PolicyVersions(1)
    v.record([0], ["a"], [2])
    v.grow(2)
    assert list(v.fields["a"]) == [2, -1, -1]
    v.record([2], ["b"], [4])  # a field's first version: an array as long as the rows
    assert list(v.fields["b"]) == [-1, -1, 4]


@pytest.mark.parametrize("versions", [[1], [1, -1], [1, 2, 3]])
def test_one_non_negative_version_per_row_or_nothing_changes(versions: list[int]) -> None:
    v = PolicyVersions(3)
    with pytest.raises(InvalidRequestError, match="one non-negative int per row"):
        v.record([0, 1], ["a"], versions)
    assert list(v.rows) == [-1, -1, -1]
    assert v.fields == {}


def test_restore_reads_a_checkpoint_with_or_without_versions() -> None:
    v = PolicyVersions.restore(3, [1, -1, 2], {"a": [1, -1, 2]})
    assert list(v.rows) == [1, -1, 2]
    assert list(v.fields["a"]) == [1, -1, 2]
    old = PolicyVersions.restore(2, [], {})  # written before rows carried versions
    assert list(old.rows) == [-1, -1]
    assert old.fields == {}
