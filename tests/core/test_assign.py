"""Shares of a global batch handed to the ranks by locality (issue 39): the assignment is
optimal (checked against every permutation), keeps the sampler's order when nothing is gained,
and leaves lockstep, exactly-once and whole groups as they were."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from tq_async import GRPOGroupNSampler, SeqlenBalancedSampler
from tq_async._core._assign import EXACT_UP_TO, assign, local_shares
from tq_async._core._placement import Placer
from tq_async._core._sampling import SampleCall
from tq_async._core._state import ControllerState
from tq_async._core._transitions import ControllerCore
from tq_async._wire._columns import ColumnHeader
from tq_async._wire._protocol import GetMeta, MetaReply
from tq_async.samplers import BaseSampler

X = ColumnHeader("x", "dense", "float32", ())


def _value(weights: list[list[int]], perm: list[int]) -> int:
    return sum(weights[s][r] for s, r in enumerate(perm))


def test_the_assignment_is_optimal_against_every_permutation() -> None:
    rng = random.Random(39)
    for n in range(1, 7):
        for _ in range(60):
            weights = [[rng.choice([0, 0, 1, 2, 5, 9]) for _ in range(n)] for _ in range(n)]
            perm = assign(weights)
            assert sorted(perm) == list(range(n))
            best = max(_value(weights, list(p)) for p in itertools.permutations(range(n)))
            assert _value(weights, perm) == best


def test_the_samplers_order_is_kept_when_it_is_already_optimal() -> None:
    assert assign([[3, 3], [3, 3]]) == [0, 1]
    assert assign([[0, 0, 0]] * 3) == [0, 1, 2]
    assert assign([[1, 5], [5, 1]]) == [1, 0]


def test_shares_go_to_the_ranks_on_their_rows_host() -> None:
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}  # row -> host
    shares = [[0, 1], [2, 3]]
    assert local_shares(shares, ["b", "a"], hosts.__getitem__) == [[2, 3], [0, 1]]
    assert local_shares(shares, ["a", "b"], hosts.__getitem__) == shares
    assert local_shares(shares, ["", ""], hosts.__getitem__) == shares  # hosts unknown
    uneven = [[0, 1, 2], [3]]  # the tail policy's order is kept
    assert local_shares(uneven, ["b", "a"], hosts.__getitem__) == uneven


def test_a_large_assignment_is_fast_enough() -> None:
    rng = random.Random(1)
    n = 64
    weights = [[rng.randrange(20) for _ in range(n)] for _ in range(n)]
    perm = assign(weights)
    assert sorted(perm) == list(range(n))
    assert _value(weights, perm) >= _value(weights, list(range(n)))


# ---- through the core: a global batch with dp_size ------------------------------------------


def _core(sampler: BaseSampler) -> ControllerCore:
    state = ControllerState({0: "inproc://u0", 1: "inproc://u1"})
    state.unit_hosts = {0: "a", 1: "b"}
    state.placer = Placer("local")
    return ControllerCore(state, sampler)


def _put(core: ControllerCore, n: int, host: str, tags: list[dict[str, Any]]) -> list[int]:
    placement, _ = core.put_begin("p", [X], n, None, None, 0.0, host=host)
    core.put_commit("p", placement.rows, ["x"], tags, None, placement.put_id)
    return placement.rows


def _get(core: ControllerCore, rank: int, index: int, host: str, dp: int = 2) -> list[int]:
    cfg = {"dp_size": dp, "dp_rank": rank, "batch_index": index}
    request = GetMeta("p", ["x"], 4, "learner", cfg, host=host)
    decision, _ = core.get_meta(request, 0.0)
    while isinstance(decision, SampleCall):
        decision, _ = core.sampled(request, decision, decision.run(), 0.0)
    assert isinstance(decision, MetaReply)
    return list(decision.rows)


def test_each_rank_reads_its_own_hosts_groups_and_replicas_agree() -> None:
    core = _core(SeqlenBalancedSampler(n_samples_per_prompt=4, dp_size=2))
    lengths = [10, 10, 10, 10, 11, 11, 11, 11]
    tags = [{"uid": i // 4, "total_lengths": lengths[i]} for i in range(8)]
    on_a = _put(core, 4, "a", tags[:4])  # prompt group 0, on host a
    on_b = _put(core, 4, "b", tags[4:])  # prompt group 1, on host b
    core.state.seal("p")
    # both ranks announce their hosts (rank 0 on b, rank 1 on a) by asking batch 0 first
    core.gets.rank_hosts.update({("learner", 0): "b", ("learner", 1): "a"})
    share0 = _get(core, 0, 0, "b")
    share1 = _get(core, 1, 0, "a")
    assert sorted(share0) == on_b  # rank 0 reads the group on its host
    assert sorted(share1) == on_a
    # a replica of rank 0, asking from anywhere, reads the same recorded share
    assert _get(core, 0, 0, "elsewhere") == share0


def test_the_first_asking_ranks_host_steers_its_share() -> None:
    core = _core(GRPOGroupNSampler(n_samples_per_prompt=4))
    tags = [{"uid": i // 4} for i in range(8)]
    _put(core, 4, "a", tags[:4])
    on_b = _put(core, 4, "b", tags[4:])
    assert sorted(_get(core, 0, 0, "b")) == on_b  # only rank 0's host is known: it wins
    assert core.gets.rank_hosts == {("learner", 0): "b"}


def test_beyond_the_exact_size_the_greedy_assignment_is_a_permutation_that_gains() -> None:
    n = EXACT_UP_TO + 8
    # share s lives on rank (s + 1) % n's host: greedy finds the full rotation
    weights = [[4 if r == (s + 1) % n else 0 for r in range(n)] for s in range(n)]
    perm = assign(weights)
    assert perm == [(s + 1) % n for s in range(n)]
    rng = random.Random(2)
    weights = [[rng.randrange(3) for _ in range(n)] for _ in range(n)]
    perm = assign(weights)
    assert sorted(perm) == list(range(n))
    assert _value(weights, perm) >= _value(weights, list(range(n)))


@pytest.mark.timeout(20)
def test_thousands_of_ranks_get_their_hosts_shares_without_a_square_of_weights() -> None:
    """Beyond the exact size, the shares go by host without building the ``dp_size x
    dp_size`` weights (4,096 ranks took the controller 40 s a global batch, blocking every
    other request): odd share ``s`` lives on rank ``s - 1``'s host (a rank per host) and
    goes there; the others (hosts unknown) take the ranks left, each share once."""
    n = 4096
    hosts = [f"h{r}" for r in range(n)]
    shares = [[8 * s + i for i in range(8)] for s in range(n)]

    def row_host(row: int) -> str:
        share = row // 8
        return hosts[share - 1] if share % 2 else ""

    placed = local_shares(shares, hosts, row_host)
    assert sorted(map(tuple, placed)) == sorted(map(tuple, shares))
    for s in range(1, n, 2):
        assert placed[s - 1] == shares[s], s
    identity = [[8 * s + i for i in range(8)] for s in range(n)]
    assert local_shares(identity, hosts, lambda row: hosts[row // 8]) == identity  # kept


def test_round_robin_placement_turns_the_share_assignment_off() -> None:
    core = _core(GRPOGroupNSampler(n_samples_per_prompt=4))
    core.state.placer = Placer("round_robin")
    tags = [{"uid": i // 4} for i in range(8)]
    on_a = _put(core, 4, "a", tags[:4])
    _put(core, 4, "b", tags[4:])
    assert sorted(_get(core, 0, 0, "b")) == on_a  # the sampler's order


def test_a_rank_that_moves_host_is_followed() -> None:
    core = _core(GRPOGroupNSampler(n_samples_per_prompt=4))
    tags = [{"uid": i // 4} for i in range(16)]
    _put(core, 4, "a", tags[:4])
    _put(core, 4, "b", tags[4:8])
    _get(core, 0, 0, "a")
    assert core.gets.rank_hosts[("learner", 0)] == "a"
    _put(core, 4, "a", tags[8:12])
    on_b = _put(core, 4, "b", tags[12:])
    assert sorted(_get(core, 0, 1, "b")) == on_b  # its new host's rows
    assert core.gets.rank_hosts[("learner", 0)] == "b"
