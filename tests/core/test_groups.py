"""TagGroups alone: the index of prompt groups by tag, without a partition, loop or socket."""

from __future__ import annotations

from typing import Any

import pytest

from tq_async._core._groups import TagGroups
from tq_async._errors import InvalidRequestError


def _groups(tags: list[dict[str, Any] | None], limits: dict[str, int]) -> TagGroups:
    g = TagGroups(lambda: enumerate(tags))
    g.limits = limits
    return g


def test_the_index_is_built_from_the_tags_on_first_use_and_skips_cleared_rows() -> None:
    tags: list[dict[str, Any] | None] = [{"uid": 0}, None, {"uid": 0}, {"uid": 1}, {"x": 2}]
    g = _groups(tags, {"uid": 4})
    assert g.rows("uid", 0) == {0, 2}
    assert g.rows("uid", 1) == {3}
    assert g.rows("uid", 7) == set()


def test_a_put_that_overfills_a_group_is_refused_naming_the_uid_and_rows() -> None:
    tags: list[dict[str, Any] | None] = [{"uid": 0}, {"uid": 0}]
    g = _groups(tags, {"uid": 2})
    with pytest.raises(InvalidRequestError, match=r"share uid=0.*rows \[0, 1\] have it.*\[2\]"):
        g.check("p", [2], [{"uid": 0}])
    g.check("p", [2], [{"uid": 1}])  # another prompt: fine
    g.check("p", [1], [{"uid": 0}])  # a row already in the group: not counted twice


def test_merges_and_clears_keep_the_index_true() -> None:
    tags: list[dict[str, Any] | None] = [{"uid": 0}, {"uid": 0}]
    g = _groups(tags, {"uid": 2})
    assert g.rows("uid", 0) == {0, 1}
    g.merged(1, tags[1], {"uid": 5})
    tags[1] = {"uid": 5}
    assert g.rows("uid", 0) == {0}
    assert g.rows("uid", 5) == {1}
    g.cleared(0, tags[0])
    tags[0] = None
    assert g.rows("uid", 0) == set()
    g.check("p", [2, 3], [{"uid": 0}, {"uid": 0}])  # the cleared row freed its uid


def test_an_unhashable_group_value_is_refused_with_what_to_use() -> None:
    g = _groups([], {"uid": 4})
    with pytest.raises(InvalidRequestError, match=r"unhashable list.*use an int or str"):
        g.check("p", [0], [{"uid": [1, 2]}])


def test_no_grouping_tag_checks_nothing() -> None:
    g = _groups([{"uid": 0}] * 9, {})
    g.check("p", [9], [{"uid": 0}])
