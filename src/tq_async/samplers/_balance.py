"""Locality-aware balanced partitioning: a global batch's groups split across ranks so that
each rank's tokens stay balanced *and* most of them sit on the rank's own host.

Handing whole shares to ranks after the sampler has balanced them (`tq_async._core._assign`)
cannot keep bytes on their host when every share mixes rows of every host. Here the split is
made knowing where the groups live (`balance_by_host`):

1. **Within each host.** A group's home is the host holding most of its tokens. Each host's
   ranks take the largest of its home groups, up to their slots (``per_rank`` groups each);
   the groups left over (the smallest: the fewest bytes cross) and those whose home has no
   rank form a pool. A host's groups are dealt to its ranks largest first, each to the
   lightest rank with a free slot.
2. **The pool** fills the free slots, largest first, each group to the lightest rank with a
   free slot (so a rank whose host has no ready rows still gets its share: remote rows).
3. **Residual imbalance** is then repaired by swapping groups between the heaviest rank and
   one of the lightest (equal group counts are kept: a swap, never a move; a zero-length
   padding group makes a swap a move). A swap that brings both ranks under the bound is
   preferred, the one adding the fewest cross-host tokens first; otherwise the swap that
   lowers the pair's maximum most.
4. **Whole parts** are finally handed to the ranks that find most of their tokens at home
   (`tq_async.samplers._hungarian.assign`), which moves no token between parts.

The bound is the unconstrained partition's (``reference``, Karmarkar-Karp's) heaviest part
times ``1 + slack``. The reference handed to ranks by locality (what
`tq_async._core._assign` alone would do) is the fallback: it is returned when the repair
cannot reach the bound or when it leaves fewer tokens off-host, so the result is never less
balanced than the bound and never less local than permuting the unconstrained split. When the ranks
cannot tell hosts apart (all on one host, or none known: locality off) or no group has
tokens on a rank's host, the reference is returned untouched.

Everything is a pure function of its arguments (no sets of strings iterated, every tie broken
by index), so every replica of a controller decides the same split. No loop, no clock, no
sockets. It lives with the samplers (the vocabulary layer) because `SeqlenBalancedSampler`
calls it; the controller's core only passes it the hosts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ._hungarian import assign

__all__ = ["PARTNERS", "balance_by_host", "cross_tokens", "part_loads"]

#: the lightest ranks the heaviest one may swap with in one repair step (bounds the work per
#: step to ``PARTNERS * per_rank**2`` pairs)
PARTNERS = 8


def part_loads(parts: Sequence[Sequence[int]], lengths: Sequence[int]) -> list[int]:
    """The summed length of each part."""
    return [sum(lengths[g] for g in part) for part in parts]


def cross_tokens(
    parts: Sequence[Sequence[int]],
    lengths: Sequence[int],
    group_tokens: Sequence[Mapping[str, int]],
    rank_hosts: Sequence[str],
) -> int:
    """Tokens that a rank reads from another host (``parts[r]`` is rank ``r``'s)."""
    return sum(
        lengths[g] - _gain(group_tokens[g], rank_hosts[r])
        for r, part in enumerate(parts)
        for g in part
    )


def balance_by_host(
    lengths: Sequence[int],
    group_tokens: Sequence[Mapping[str, int]],
    rank_hosts: Sequence[str],
    reference: Sequence[Sequence[int]],
    slack: float = 0.05,
) -> list[list[int]]:
    """Split groups into one part per rank, balanced and local (see the module docstring).

    Args:
        lengths: each group's tokens (non-negative; zero-length padding groups allowed).
        group_tokens: for each group, its tokens held on each host (``{host: tokens}``; hosts
            ``""`` or missing: unknown).
        rank_hosts: each rank's host id (``""``: unknown), one per part.
        reference: the unconstrained balanced partition (one list of group indices per rank,
            equal sizes): what the balance is measured against, and the fallback.
        slack: how much heavier than the reference's heaviest part any part may be (0.05:
            5 %).

    Returns:
        ``len(rank_hosts)`` lists of group indices, ``parts[r]`` for rank ``r``, each as long
        as the reference's parts, every group in exactly one, each sorted ascending.
    """
    d = len(rank_hosts)
    ref = [sorted(p) for p in reference]
    if d <= 1 or len(set(rank_hosts)) == 1 or not _informative(group_tokens, rank_hosts):
        return ref  # every rank alike (one host, or none known): nothing to prefer
    per_rank = len(lengths) // d
    bound = max(part_loads(ref, lengths), default=0) * (1 + slack)
    fallback = _handed(ref, lengths, group_tokens, rank_hosts)
    parts = _by_home(lengths, group_tokens, rank_hosts, per_rank)
    parts = _repair(parts, lengths, group_tokens, rank_hosts, bound)
    if max(part_loads(parts, lengths)) > bound:
        return fallback
    parts = _handed(parts, lengths, group_tokens, rank_hosts)
    mine = cross_tokens(parts, lengths, group_tokens, rank_hosts)
    return parts if mine <= cross_tokens(fallback, lengths, group_tokens, rank_hosts) else fallback


def _gain(tokens: Mapping[str, int], host: str) -> int:
    """Tokens of a group a rank on ``host`` finds at home."""
    return tokens.get(host, 0) if host else 0


def _informative(group_tokens: Sequence[Mapping[str, int]], rank_hosts: Sequence[str]) -> bool:
    """Whether any group has tokens on a rank's known host (else locality cannot matter)."""
    known = {h for h in rank_hosts if h}
    return any(t.get(h, 0) for t in group_tokens for h in known)


def _home(tokens: Mapping[str, int], hosts_with_ranks: Mapping[str, list[int]]) -> str:
    """The host with a rank holding most of a group's tokens (``""``: none)."""
    best, most = "", 0
    for host in sorted(tokens):
        n = tokens[host]
        if host and host in hosts_with_ranks and n > most:
            best, most = host, n
    return best


def _by_home(
    lengths: Sequence[int],
    group_tokens: Sequence[Mapping[str, int]],
    rank_hosts: Sequence[str],
    per_rank: int,
) -> list[list[int]]:
    """Steps 1 and 2: each host's ranks take their largest home groups, the pool the rest."""
    ranks_of: dict[str, list[int]] = {}
    for r, host in enumerate(rank_hosts):
        if host:
            ranks_of.setdefault(host, []).append(r)
    homes: dict[str, list[int]] = {}
    pool: list[int] = []
    for g, tokens in enumerate(group_tokens):
        home = _home(tokens, ranks_of)
        if home:
            homes.setdefault(home, []).append(g)
        else:
            pool.append(g)
    parts: list[list[int]] = [[] for _ in rank_hosts]
    loads = [0] * len(rank_hosts)

    def deal(groups: list[int], ranks: list[int]) -> None:
        for g in groups:
            free = [r for r in ranks if len(parts[r]) < per_rank]
            r = min(free, key=lambda r: (loads[r], r))
            parts[r].append(g)
            loads[r] += lengths[g]

    for host in sorted(homes):
        ranks = ranks_of[host]
        groups = sorted(homes[host], key=lambda g: (-lengths[g], g))
        keep = per_rank * len(ranks)
        deal(groups[:keep], ranks)
        pool.extend(groups[keep:])
    deal(sorted(pool, key=lambda g: (-lengths[g], g)), list(range(len(rank_hosts))))
    return parts


def _repair(
    parts: list[list[int]],
    lengths: Sequence[int],
    group_tokens: Sequence[Mapping[str, int]],
    rank_hosts: Sequence[str],
    bound: float,
) -> list[list[int]]:
    """Step 3: swap groups off the heaviest rank until every rank is within ``bound``.

    Each swap strictly lowers the heaviest rank's load without raising its partner's to it,
    so the sorted loads decrease lexicographically and the loop ends; the step cap is a
    safety net only.
    """
    loads = part_loads(parts, lengths)

    def cost(g: int, r: int) -> int:
        return lengths[g] - _gain(group_tokens[g], rank_hosts[r])

    for _ in range(4 * len(lengths) + 4):
        heavy = max(range(len(parts)), key=lambda r: (loads[r], -r))
        top = loads[heavy]
        if top <= bound:
            break
        partners = sorted((r for r in range(len(parts)) if r != heavy), key=lambda r: (loads[r], r))
        best: tuple[tuple[int, float, float, int, int, int], int, int, int] | None = None
        for light in partners[:PARTNERS]:
            room = top - loads[light]
            for i, a in enumerate(parts[heavy]):
                for j, b in enumerate(parts[light]):
                    delta = lengths[a] - lengths[b]
                    if not 0 < delta < room:
                        continue
                    new_max = max(top - delta, loads[light] + delta)
                    extra = cost(a, light) + cost(b, heavy) - cost(a, heavy) - cost(b, light)
                    fits = new_max <= bound
                    key = (
                        (0, extra, new_max, light, a, b)
                        if fits
                        else (1, new_max, extra, light, a, b)
                    )
                    if best is None or key < best[0]:
                        best = (key, light, i, j)
        if best is None:
            break
        _, light, i, j = best
        a, b = parts[heavy][i], parts[light][j]
        parts[heavy][i], parts[light][j] = b, a
        delta = lengths[a] - lengths[b]
        loads[heavy] -= delta
        loads[light] += delta
    return parts


def _handed(
    parts: Sequence[Sequence[int]],
    lengths: Sequence[int],
    group_tokens: Sequence[Mapping[str, int]],
    rank_hosts: Sequence[str],
) -> list[list[int]]:
    """Step 4: whole parts handed to the ranks finding most of their tokens at home (the
    order given is kept when it is already optimal)."""
    weights = [
        [sum(_gain(group_tokens[g], host) for g in part) for host in rank_hosts] for part in parts
    ]
    perm = assign(weights)
    out: list[list[int]] = [[] for _ in parts]
    for s, rank in enumerate(perm):
        out[rank] = sorted(parts[s])
    return out
