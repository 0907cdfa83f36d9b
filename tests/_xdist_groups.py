"""A pytest plugin that keeps ``--dist loadgroup``'s groups on one worker under pytest >= 9.2.

pytest-xdist (3.8) groups a test by the ``@name`` it appends to the test's node id, and it
appends it by setting ``item._nodeid``; pytest 9.2 keeps the id in ``item._id``, so the
suffix went nowhere and every ``xdist_group`` was ignored: the chaos test ran beside the
benchmark runs, and two Ray instances started at once on the 2-vCPU box (what the groups are
there to prevent). Where xdist's suffix did not land, it is set here the way this pytest keeps
ids. `tests/project/test_xdist_groups.py` checks that a group runs on one worker.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give each grouped test the ``@group`` suffix xdist could not (see the module)."""
    if not config.getoption("loadgroup", default=False):
        return
    for item in items:
        names = sorted(
            {
                str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                for m in item.iter_markers("xdist_group")
            }
        )
        nodeid = item.nodeid
        if not names or nodeid.rfind("@") > nodeid.rfind("]"):
            continue  # no group, or xdist's own suffix is there (an older pytest)
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(f"{nodeid}@{'_'.join(names)}")  # type: ignore[attr-defined]
