"""Which rank reads which share of a global batch: the one that finds most of it on its host.

A global batch (``dp_size`` ranks asking together) is cut into shares by the sampler, which
balances them its own way (equal rows, equal tokens, whole prompt groups). Any permutation of
the shares keeps that balance, so the controller then hands the shares to the ranks so that
the rows each rank finds on its own host are as many as possible: an assignment problem on
``dp_size x dp_size`` (weight of share ``s`` for rank ``r``: rows of ``s`` held by units on
``r``'s host), solved exactly by the Hungarian algorithm (`assign`; O(n^3): up to
`EXACT_UP_TO` ranks, about 15 ms at 64; beyond, greedily, heaviest pairs first). The
sampler's own
order is kept whenever it is already optimal (on one host, or without known hosts, nothing
moves). The weights are rows, not bytes: the controller knows where each row lives, not its
size. No loop, no clock, no sockets.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from ..samplers._hungarian import EXACT_UP_TO, assign

__all__ = ["EXACT_UP_TO", "assign", "local_shares"]


def local_shares(
    shares: Sequence[Sequence[int]],
    rank_hosts: Sequence[str],
    row_host: Callable[[int], str],
) -> list[list[int]]:
    """``shares`` handed to ranks so that each finds most of its share on its own host.

    Args:
        shares: the sampler's shares, one per rank (equal lengths: shares of different
            lengths are returned as they are, the tail policy's order kept).
        rank_hosts: each rank's host id (``""``: unknown).
        row_host: the host id of the unit holding a row (``""``: unknown).
    """
    out = [list(s) for s in shares]
    if len({len(s) for s in shares}) > 1 or not any(rank_hosts):
        return out
    if len(shares) > EXACT_UP_TO:
        perm = _greedy_by_host(out, rank_hosts, row_host)
        if perm is None:
            return out
    else:
        weights = [
            [sum(1 for row in share if host and row_host(row) == host) for host in rank_hosts]
            for share in shares
        ]
        perm = assign(weights)
    placed: list[list[int]] = [[] for _ in shares]
    for s, rank in enumerate(perm):
        placed[rank] = out[s]
    return placed


def _greedy_by_host(
    shares: Sequence[Sequence[int]], rank_hosts: Sequence[str], row_host: Callable[[int], str]
) -> list[int] | None:
    """Beyond `EXACT_UP_TO` ranks, greedily (the heaviest share-to-host pairs first) without
    the ``dp_size x dp_size`` weights: a share's weight for a rank is its rows on the rank's
    host, so it is counted per host (linear in the rows, not quadratic in the ranks: 4,096
    ranks took the controller 40 s a global batch). ``perm[share] = rank``; None when the
    sampler's order is as good."""
    n = len(shares)
    counts = [Counter(h for h in map(row_host, share) if h) for share in shares]
    ranks_of: dict[str, list[int]] = {}
    for rank in range(n - 1, -1, -1):  # (popped lowest first)
        if rank_hosts[rank]:
            ranks_of.setdefault(rank_hosts[rank], []).append(rank)
    pairs = sorted(
        ((k, s, h) for s, c in enumerate(counts) for h, k in c.items() if h in ranks_of),
        key=lambda pair: (-pair[0], pair[1]),
    )
    perm, taken = [-1] * n, [False] * n
    for _, s, h in pairs:
        if perm[s] >= 0:
            continue
        if rank_hosts[s] == h and not taken[s]:
            rank = s  # the sampler's own rank is as good: it keeps its share
        else:
            free = ranks_of[h]
            while free and taken[free[-1]]:
                free.pop()
            if not free:
                continue
            rank = free.pop()
        perm[s], taken[rank] = rank, True
    for s in range(n):  # the shares no host claimed: their own rank when it is free
        if perm[s] < 0 and not taken[s]:
            perm[s], taken[s] = s, True
    left = iter(r for r in range(n) if not taken[r])
    perm = [r if r >= 0 else next(left) for r in perm]
    gained = sum(counts[s].get(rank_hosts[r], 0) for s, r in enumerate(perm))
    kept = sum(counts[s].get(rank_hosts[s], 0) for s in range(n))
    return perm if gained > kept else None
