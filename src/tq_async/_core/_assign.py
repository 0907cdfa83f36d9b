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
    weights = [
        [sum(1 for row in share if host and row_host(row) == host) for host in rank_hosts]
        for share in shares
    ]
    perm = assign(weights)
    placed: list[list[int]] = [[] for _ in shares]
    for s, rank in enumerate(perm):
        placed[rank] = out[s]
    return placed
