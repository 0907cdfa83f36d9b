"""The assignment problem, exactly (Hungarian algorithm) or greedily: which share goes to which
rank so that the summed weights are largest. Used by the controller to hand a global batch's
shares to ranks by host (`tq_async._core._assign`) and by the locality-aware split
(`tq_async.samplers._balance`). Pure: no loop, no clock, no sockets.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["EXACT_UP_TO", "assign"]

#: the most ranks assigned exactly; larger global batches are assigned greedily
EXACT_UP_TO = 64


def assign(weights: Sequence[Sequence[int]]) -> list[int]:
    """A permutation ``perm`` (share ``s`` goes to rank ``perm[s]``) maximising
    ``sum(weights[s][perm[s]])``; the identity whenever it is optimal.

    Args:
        weights: a square matrix of non-negative ints (``weights[share][rank]``).
    """
    n = len(weights)
    identity = list(range(n))
    if n <= 1:
        return identity
    if n > EXACT_UP_TO:
        best = _greedy(weights)
    else:
        top = max(max(row) for row in weights)
        best = _hungarian([[top - w for w in row] for row in weights])
    value = sum(weights[s][r] for s, r in enumerate(best))
    if value <= sum(weights[s][s] for s in identity):
        return identity
    return best


def _greedy(weights: Sequence[Sequence[int]]) -> list[int]:
    """A good (not always optimal) assignment: the heaviest free (share, rank) pairs first."""
    n = len(weights)
    pairs = sorted(
        ((w, s, r) for s, row in enumerate(weights) for r, w in enumerate(row) if w),
        reverse=True,
    )
    perm = [-1] * n
    taken = [False] * n
    for _, s, r in pairs:
        if perm[s] < 0 and not taken[r]:
            perm[s], taken[r] = r, True
    free = iter(r for r in range(n) if not taken[r])
    return [r if r >= 0 else next(free) for r in perm]


def _hungarian(cost: Sequence[Sequence[int]]) -> list[int]:
    """A minimum-cost perfect assignment of a square matrix: ``result[row] = column``
    (Kuhn-Munkres with potentials, O(n^3), exact on ints)."""
    n = len(cost)
    inf = float("inf")
    u = [0.0] * (n + 1)
    v = [0.0] * (n + 1)
    match = [0] * (n + 1)  # column -> row (1-based; 0: free)
    way = [0] * (n + 1)
    for i in range(1, n + 1):
        match[0] = i
        j0 = 0
        minv = [inf] * (n + 1)
        used = [False] * (n + 1)
        while True:
            used[j0] = True
            i0, delta, j1 = match[j0], inf, 0
            row = cost[i0 - 1]
            for j in range(1, n + 1):
                if not used[j]:
                    cur = row[j - 1] - u[i0] - v[j]
                    if cur < minv[j]:
                        minv[j], way[j] = cur, j0
                    if minv[j] < delta:
                        delta, j1 = minv[j], j
            for j in range(n + 1):
                if used[j]:
                    u[match[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if match[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            match[j0] = match[j1]
            j0 = j1
    result = [0] * n
    for j in range(1, n + 1):
        result[match[j] - 1] = j - 1
    return result
