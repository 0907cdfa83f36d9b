"""Placement with host labels (issue 39): pure rules, no loop, no sockets.

A put's new rows go to a unit on the producer's host (the least-loaded there), unless that
host holds more than 1.2x the mean; otherwise to the least-loaded unit; lost or suspended
units take nothing; ``auto`` is ``local`` only while the live units span several hosts.
"""

from __future__ import annotations

import pytest

from tq_async._core._placement import SPILL_RATIO, Placer, check_placement
from tq_async._core._state import ControllerState
from tq_async._core._transitions import ControllerCore
from tq_async._errors import InvalidRequestError
from tq_async._transport._hosts import (
    ENV_HOST_ID,
    locality_key,
    machine_host_id,
    resolve_host_id,
    same_host,
)
from tq_async._wire._columns import ColumnHeader

HOSTS = {0: "a", 1: "a", 2: "b", 3: "b"}
LIVE = [0, 1, 2, 3]
H = [ColumnHeader("x", "dense", "float32", ())]


# ---- the Placer alone ------------------------------------------------------------------------


def test_local_prefers_the_producers_host_and_its_least_loaded_unit() -> None:
    placer = Placer("local")
    assert placer.choose(LIVE, HOSTS, {0: 10, 1: 4, 2: 8, 3: 6}, "a") == 1
    assert placer.choose(LIVE, HOSTS, {0: 5, 1: 5, 2: 9, 3: 3}, "b") == 3


def test_local_ties_go_round_robin_within_the_host() -> None:
    placer = Placer("local")
    picks = [placer.choose(LIVE, HOSTS, {}, "b") for _ in range(4)]
    assert set(picks) == {2, 3}
    assert picks[0] != picks[1]


def test_an_unknown_or_missing_host_goes_to_the_least_loaded_unit() -> None:
    placer = Placer("local")
    loads = {0: 5, 1: 7, 2: 1, 3: 6}
    assert placer.choose(LIVE, HOSTS, loads, "spoofed-host") == 2
    assert placer.choose(LIVE, HOSTS, loads, "") == 2


def test_a_host_over_its_share_spills_to_the_least_loaded_unit_elsewhere() -> None:
    placer = Placer("local")
    # mean of all units 10; host a's mean 13 > 1.2 * 10 -> elsewhere, least-loaded there
    loads = {0: 13, 1: 13, 2: 9, 3: 5}
    assert _mean([13, 13]) > SPILL_RATIO * _mean(list(loads.values()))
    assert placer.choose(LIVE, HOSTS, loads, "a") == 3
    # at exactly its share or a little over (<= 1.2x) it stays local
    loads = {0: 11, 1: 12, 2: 9, 3: 8}
    assert _mean([11, 12]) <= SPILL_RATIO * _mean(list(loads.values()))
    assert placer.choose(LIVE, HOSTS, loads, "a") == 0


def test_a_few_puts_into_a_nearly_empty_cluster_do_not_spill() -> None:
    placer = Placer("local")
    # host b holds 4 on average, the mean is 2: over 1.2x, but by less than the put's 8 rows
    assert placer.choose(LIVE, HOSTS, {2: 8}, "b", n_rows=8) == 3
    assert placer.choose(LIVE, HOSTS, {2: 8}, "b", n_rows=1) in (0, 1)


def test_a_host_whose_units_are_all_down_sends_its_puts_elsewhere() -> None:
    placer = Placer("local")
    assert placer.choose([2, 3], HOSTS, {2: 100, 3: 50}, "a") == 3


def test_round_robin_ignores_hosts_and_loads() -> None:
    placer = Placer("round_robin")
    picks = [placer.choose(LIVE, HOSTS, {0: 100}, "b") for _ in range(8)]
    assert picks == [0, 1, 2, 3, 0, 1, 2, 3]


def test_auto_is_local_only_when_the_live_units_span_several_hosts() -> None:
    placer = Placer()
    assert placer.effective_mode(LIVE, HOSTS) == "local"
    assert placer.effective_mode([0, 1], HOSTS) == "round_robin"  # one host left
    assert placer.effective_mode(LIVE, {}) == "round_robin"  # hosts unknown
    assert [placer.choose([0, 1], HOSTS, {0: 50}, "a") for _ in range(4)] == [0, 1, 0, 1]


def test_a_bad_mode_is_refused_naming_the_choices() -> None:
    with pytest.raises(InvalidRequestError, match="round_robin"):
        check_placement("nearest")


# ---- through the controller's state ----------------------------------------------------------


def _state(mode: str = "local") -> ControllerState:
    st = ControllerState({u: f"inproc://u{u}" for u in LIVE})
    st.unit_hosts = dict(HOSTS)
    st.placer = Placer(mode)
    return st


def test_a_puts_rows_stay_together_on_a_unit_of_the_producers_host() -> None:
    st = _state()
    rows, units, _ = st.put_begin("p", H, 8, None, host="b")
    assert len(rows) == 8
    assert len(set(units)) == 1
    assert HOSTS[units[0]] == "b"
    # the next put from b goes to b's other (empty) unit
    _, again, _ = st.put_begin("p", H, 8, None, host="b")
    assert HOSTS[again[0]] == "b"
    assert again[0] != units[0]


def test_loads_follow_puts_and_clears_and_steer_placement() -> None:
    st = _state()
    rows_a, units_a, _ = st.put_begin("p", H, 6, None, host="a")
    assert st.unit_loads() == {units_a[0]: 6}
    st.put_begin("q", H, 2, None, host="a")
    assert sum(st.unit_loads().values()) == 8
    st.partitions["p"].clear_rows(rows_a)
    assert st.unit_loads()[units_a[0]] == 0
    # the cleared unit is host a's least-loaded again
    _, units, _ = st.put_begin("p", H, 1, None, host="a")
    assert units == [units_a[0]]


def test_a_producer_filling_its_host_spills_and_the_cluster_stays_balanced() -> None:
    st = _state()
    for _ in range(40):
        st.put_begin("p", H, 4, None, host="a")
    loads = st.unit_loads()
    host_a = (loads.get(0, 0) + loads.get(1, 0)) / 2
    mean = sum(loads.values()) / 4
    assert loads.get(2, 0) + loads.get(3, 0) > 0  # some rows went elsewhere
    assert host_a <= max(SPILL_RATIO * mean, mean + 4) + 4  # within one put of the bound


def test_lost_and_suspended_units_take_no_rows_at_once() -> None:
    core = ControllerCore(_state())
    core.unit_lost(0)
    core.unit_down(1, now=0.0)  # host a: one lost, one suspended
    for _ in range(4):
        placement, _ = core.put_begin("p", H, 2, None, None, now=0.0, host="a")
        assert HOSTS[placement.units[0]] == "b"
    core.unit_up(1)
    placement, _ = core.put_begin("p", H, 2, None, None, now=0.0, host="a")
    assert placement.units[0] == 1


def test_a_registered_units_host_is_recorded() -> None:
    core = ControllerCore(ControllerState())
    core.unit_registered(5, "tcp://10.0.0.9:1", "host-9")
    assert core.state.unit_hosts == {5: "host-9"}


# ---- host ids --------------------------------------------------------------------------------


def test_host_ids_come_from_the_argument_then_the_environment_then_the_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_HOST_ID, raising=False)
    assert resolve_host_id() == machine_host_id() != ""
    monkeypatch.setenv(ENV_HOST_ID, "from-env")
    assert resolve_host_id() == "from-env"
    assert resolve_host_id("given") == "given"


def test_an_empty_host_id_is_never_the_same_host() -> None:
    assert same_host("a", "a")
    assert not same_host("a", "b")
    assert not same_host("", "")
    assert locality_key("in", "a", "a") == "in_same_host"
    assert locality_key("out", "a", "") == "out_other_host"


def _mean(values: list[int]) -> float:
    return sum(values) / len(values)
