"""Locality-aware balanced partitioning (issue 39): a global batch's groups split so that each
host's groups go to its own ranks first, with token balance within a bound of the
unconstrained split's, every group whole and in one share, and the same answer on every
replica."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from tq_async import SeqlenBalancedSampler
from tq_async._core._assign import assign
from tq_async.samplers import karmarkar_karp
from tq_async.samplers._balance import balance_by_host, cross_tokens, part_loads


def _case(
    rng: random.Random, hosts: int, per_rank: int, skew: bool = False
) -> tuple[list[int], list[dict[str, int]], list[str]]:
    """Every host produces ``per_rank`` groups of 4 jagged rows (with ``skew``: host h0
    produces none, host h1 its share too)."""
    lengths: list[int] = []
    where: list[dict[str, int]] = []
    for h in range(hosts):
        n = per_rank * (0 if skew and h == 0 else 2 if skew and h == 1 else 1)
        for _ in range(n):
            length = sum(rng.randint(16, 512) for _ in range(4))
            lengths.append(length)
            where.append({f"h{h}": length})
    return lengths, where, [f"h{h}" for h in range(hosts)]


def _check(
    parts: Sequence[Sequence[int]], lengths: Sequence[int], per_rank: int, ranks: int
) -> None:
    assert len(parts) == ranks
    assert all(len(p) == per_rank for p in parts)  # nobody starves, lockstep sizes
    flat = [g for p in parts for g in p]
    assert sorted(flat) == list(range(len(lengths)))  # every group once, whole


def test_each_hosts_groups_stay_on_its_ranks_within_the_balance_bound() -> None:
    rng = random.Random(39)
    for hosts, per_rank, most in ((4, 4, 0.15), (4, 8, 0.08), (8, 8, 0.08), (4, 32, 0.02)):
        cross = total = 0
        for _ in range(40):
            lengths, where, rank_hosts = _case(rng, hosts, per_rank)
            ref = karmarkar_karp(lengths, hosts, equal_size=True)
            parts = balance_by_host(lengths, where, rank_hosts, ref, slack=0.05)
            _check(parts, lengths, per_rank, hosts)
            assert max(part_loads(parts, lengths)) <= 1.05 * max(part_loads(ref, lengths))
            cross += cross_tokens(parts, lengths, where, rank_hosts)
            total += sum(lengths)
        assert cross / total <= most, (hosts, per_rank, cross / total)


def test_a_rank_whose_host_has_no_rows_still_gets_its_share() -> None:
    rng = random.Random(1)
    lengths, where, rank_hosts = _case(rng, 4, 4, skew=True)
    ref = karmarkar_karp(lengths, 4, equal_size=True)
    parts = balance_by_host(lengths, where, rank_hosts, ref)
    _check(parts, lengths, 4, 4)
    assert all("h0" not in where[g] for g in parts[0])  # remote rows, counted as such
    assert cross_tokens([parts[0]], lengths, where, ["h0"]) == sum(lengths[g] for g in parts[0])


def test_without_distinguishable_hosts_the_reference_is_kept() -> None:
    rng = random.Random(2)
    lengths, where, _ = _case(rng, 4, 3)
    ref = karmarkar_karp(lengths, 4, equal_size=True)
    for rank_hosts in (["", "", "", ""], ["h9"] * 4, ["h0"] * 4, ["x", "y", "z", "w"]):
        assert balance_by_host(lengths, where, rank_hosts, ref) == ref
    assert balance_by_host(lengths, where, ["h0"], [list(range(len(lengths)))]) == [
        list(range(len(lengths)))
    ]


def test_zero_slack_never_loses_balance() -> None:
    rng = random.Random(3)
    for _ in range(30):
        lengths, where, rank_hosts = _case(rng, 4, 4)
        ref = karmarkar_karp(lengths, 4, equal_size=True)
        parts = balance_by_host(lengths, where, rank_hosts, ref, slack=0.0)
        assert max(part_loads(parts, lengths)) <= max(part_loads(ref, lengths))


@st.composite
def _batches(
    draw: st.DrawFn,
) -> tuple[list[int], list[dict[str, int]], list[str], float]:
    ranks = draw(st.integers(1, 6))
    per_rank = draw(st.integers(1, 5))
    hosts = [f"h{i}" for i in range(draw(st.integers(1, 4)))]
    rank_hosts = [draw(st.sampled_from(["", *hosts])) for _ in range(ranks)]
    lengths: list[int] = []
    where: list[dict[str, int]] = []
    for _ in range(ranks * per_rank):
        # a group's rows may sit on several hosts (or on none known, or be padding)
        split = draw(
            st.lists(st.tuples(st.sampled_from(["", *hosts]), st.integers(0, 900)), max_size=3)
        )
        tokens: dict[str, int] = {}
        for host, n in split:
            tokens[host] = tokens.get(host, 0) + n
        where.append(tokens)
        lengths.append(sum(tokens.values()))
    slack = draw(st.sampled_from([0.0, 0.05, 0.2]))
    return lengths, where, rank_hosts, slack


@settings(max_examples=300, deadline=None)
@given(_batches())
def test_properties_of_any_split(
    batch: tuple[list[int], list[dict[str, int]], list[str], float],
) -> None:
    lengths, where, rank_hosts, slack = batch
    ranks = len(rank_hosts)
    ref = karmarkar_karp(lengths, ranks, equal_size=True)
    parts = balance_by_host(lengths, where, rank_hosts, ref, slack)
    _check(parts, lengths, len(lengths) // ranks, ranks)
    assert max(part_loads(parts, lengths)) <= (1 + slack) * max(part_loads(ref, lengths))
    # never less local than handing the unconstrained split's parts to ranks by host
    weights = [[sum(where[g].get(h, 0) if h else 0 for g in p) for h in rank_hosts] for p in ref]
    handed: list[list[int]] = [[] for _ in ref]
    for s, r in enumerate(assign(weights)):
        handed[r] = ref[s]
    mine = cross_tokens(parts, lengths, where, rank_hosts)
    assert mine <= cross_tokens(handed, lengths, where, rank_hosts)
    # deterministic, whatever order a group's hosts were listed in (replicas agree)
    assert balance_by_host(lengths, where, rank_hosts, ref, slack) == parts
    shuffled: list[Mapping[str, int]] = [dict(reversed(list(t.items()))) for t in where]
    assert balance_by_host(lengths, shuffled, rank_hosts, ref, slack) == parts


def _grpo_rows(
    rng: random.Random, hosts: int, groups_per_host: int
) -> tuple[list[int], dict[int, dict[str, int]], dict[int, str]]:
    tags: dict[int, dict[str, int]] = {}
    row_hosts: dict[int, str] = {}
    row = uid = 0
    for _ in range(groups_per_host):
        for h in range(hosts):
            for _ in range(4):
                tags[row] = {"uid": uid, "total_lengths": rng.randint(16, 512)}
                row_hosts[row] = f"h{h}"
                row += 1
            uid += 1
    return list(range(row)), tags, row_hosts


def test_the_sampler_splits_by_host_and_takes_the_same_rows() -> None:
    rng = random.Random(5)
    ready, tags, row_hosts = _grpo_rows(rng, 4, 4)
    plain = SeqlenBalancedSampler(n_samples_per_prompt=4, dp_size=4)
    located = SeqlenBalancedSampler(n_samples_per_prompt=4, dp_size=4)
    assert located.locality_aware
    base, consumed = plain.sample_shares(ready, 16, 4, tags=tags)
    rank_hosts = ["h0", "h1", "h2", "h3"]
    shares, consumed2 = located.sample_shares(
        ready, 16, 4, tags=tags, row_hosts=row_hosts, rank_hosts=rank_hosts
    )
    assert sorted(consumed) == sorted(consumed2)  # which rows: never by host
    assert all(len(s) == 16 for s in shares)
    for share in shares:  # groups whole
        uids = [tags[r]["uid"] for r in share]
        assert all(uids.count(u) == 4 for u in uids)

    def tokens(share: list[int]) -> int:
        return sum(tags[r]["total_lengths"] for r in share)

    assert max(map(tokens, shares)) <= 1.05 * max(map(tokens, base))
    remote = sum(
        tags[r]["total_lengths"] for k, s in enumerate(shares) for r in s if row_hosts[r] != f"h{k}"
    )
    assert remote <= 0.2 * sum(map(tokens, shares))
    # the same call gives the same split (every replica of a decision agrees)
    again = SeqlenBalancedSampler(n_samples_per_prompt=4, dp_size=4).sample_shares(
        ready, 16, 4, tags=tags, row_hosts=row_hosts, rank_hosts=rank_hosts
    )
    assert again == (shares, consumed2)


def test_the_samplers_own_cache_path_splits_by_host_too() -> None:
    rng = random.Random(6)
    ready, tags, row_hosts = _grpo_rows(rng, 2, 4)
    sampler = SeqlenBalancedSampler(n_samples_per_prompt=4, dp_size=2)
    ctx = {"tags": tags, "row_hosts": row_hosts, "rank_hosts": ["h0", "h1"]}
    mine, everything = sampler.sample(ready, 16, dp_rank=1, batch_index=0, **ctx)
    other, rest = sampler.sample(ready, 16, dp_rank=0, batch_index=0, **ctx)
    assert rest == []
    assert sorted(mine + other) == sorted(everything) == ready
    assert sum(row_hosts[r] == "h1" for r in mine) >= 8
