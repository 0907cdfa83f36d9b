"""Token-balanced batches across data-parallel ranks (Karmarkar-Karp over ``total_lengths``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import InvalidRequestError
from .._logging import get_logger
from .._wire._checks import MAX_DP_SIZE
from ._balance import balance_by_host
from ._base import SampleResult, SharesResult, check_context, int_arg, share_arg, tag_name
from ._cache import ShareCache, reads_needed
from ._groups import GroupingSampler, check_group_size, complete_groups, rows_by_group
from ._kk import karmarkar_karp

__all__ = ["SeqlenBalancedSampler"]

log = get_logger(__name__)


class SeqlenBalancedSampler(GroupingSampler):
    """Splits each batch across ``dp_size`` ranks so every rank gets a near-equal token count.

    The first request for a ``(partition_id, task_name, batch_index)``, from whichever rank,
    takes ``batch_size * dp_size`` rows forming whole groups of ``n_samples_per_prompt`` rows
    (grouped as by `GRPOGroupNSampler`), sums each group's ``length_key`` tag and
    splits the groups across the ranks with `karmarkar_karp` (equal group counts per
    rank). It returns the requesting rank's share and consumes **every** rank's share at once,
    so no row can reach another batch or rank; later requests for the batch by other ranks
    get ``(their_share, [])``. Within a share, groups are ordered by their smallest row, rows
    of a group kept together. Rank 0 gets the share holding the first group found, rank 1 the
    share holding the first group not in rank 0's, and so on, so the split depends only on
    which rows were taken, never on which rank asked first.

    **Locality.** When the controller says where rows live (``row_hosts``) and where each rank
    runs (``rank_hosts``, a global batch), the same groups are split by
    `tq_async.samplers._balance.balance_by_host` instead: each host's groups go to that host's
    ranks first, and the residual imbalance is repaired by swapping the fewest, smallest
    groups across hosts, as long as no rank ends heavier than ``1 + locality_slack`` times
    the heaviest share of the unconstrained split (else that split is used, handed to ranks by
    locality). Which rows form the batch never depends on hosts, only which rank gets them.

    Until enough whole groups are ready the sampler waits (``([], [])``). Once the partition
    is final it uses all the whole groups left, if there are at least ``dp_size`` of them; the
    ranks' group counts then differ by at most one. Rows of groups that can never complete
    (fewer than ``n_samples_per_prompt`` rows, the partition final) come last and follow the
    ``tail`` policy as `GRPOGroupNSampler`'s do: delivered as partial groups, each on one
    rank, up to ``batch_size`` rows per rank (``"uneven"``, a warning), consumed
    undelivered (``"drop"``, a warning and a count) or a ``ValueError`` (``"error"``).

    A rank's share is forgotten after ``n_replicas`` reads (after one read when the
    controller passes ``replays_served=True``), a batch when all its shares are, and
    everything of a partition when it is cleared or its task's consumption is reset; at most
    ``max_entries`` batches are kept (oldest dropped first, with a warning).

    Args:
        n_samples_per_prompt: rows per group; 1 makes every row its own group (tags unread).
        dp_size: number of data-parallel ranks sharing each batch.
        length_key: the tag holding a row's token count.
        n_replicas: how many readers share each ``dp_rank`` (e.g. TP size x PP size).
        max_entries: the most batches kept at once.
        group_key: the tag naming a row's group (as in `GRPOGroupNSampler`).
        missing_length: the token count of a row without a ``length_key`` tag (1, as in
            TransferQueue); None makes such a row an error (a ``ValueError`` naming it).
        tail: what a final batch with fewer whole groups than ranks does: ``"error"``
            (a ``ValueError``), ``"drop"`` (its rows are consumed without being delivered,
            with a warning, and every rank sees the end of the stream together, which keeps
            collectives in step) or ``"uneven"`` (some ranks get one group, the others an
            empty batch); a request's ``sampling_config["tail"]`` wins over it, as for
            every sampler (see "DP ranks in lockstep" in ``docs/guarantees.md``). None (the
            default): the request's, ``"uneven"`` unless it asks otherwise; called directly
            without a ``tail`` keyword, ``"error"``.
        locality_slack: how much heavier than the unconstrained split's heaviest share a
            rank's tokens may get to keep rows on their host (0.05: 5 %; 0: locality only
            where it costs no balance).

    Raises:
        InvalidRequestError: (a ValueError) a count that is no int (numpy's ints are taken)
            or is below 1 (``missing_length``: 0), a key that is no string, or ``tail`` is
            unknown.
    """

    def __init__(
        self,
        n_samples_per_prompt: int = 1,
        dp_size: int = 1,
        length_key: str = "total_lengths",
        n_replicas: int = 1,
        max_entries: int = 65536,
        group_key: str = "uid",
        tail: str | None = None,
        missing_length: int | None = 1,
        locality_slack: float = 0.05,
    ) -> None:
        self.locality_slack = share_arg("locality_slack", locality_slack)
        if tail not in (None, "error", "drop", "uneven"):
            raise InvalidRequestError(f"tail must be 'error', 'drop' or 'uneven', got {tail!r}")
        self._tail = tail
        #: the policy of a direct call without a ``tail`` keyword
        self.tail = tail or "error"
        self.n_samples_per_prompt = int_arg("n_samples_per_prompt", n_samples_per_prompt)
        self.dp_size = int_arg("dp_size", dp_size, hi=MAX_DP_SIZE)
        self.length_key = tag_name("length_key", length_key)
        self.n_replicas = int_arg("n_replicas", n_replicas)
        self.group_key = tag_name("group_key", group_key)
        self.missing_length = (
            None if missing_length is None else int_arg("missing_length", missing_length, 0)
        )
        self._cache = ShareCache(int_arg("max_entries", max_entries), type(self).__name__)

    @property
    def locality_aware(self) -> bool:
        """True: a global batch is split by locality here (see the class docstring)."""
        return True

    @property
    def dp_size_hint(self) -> int | None:
        """``dp_size``: the controller decides every batch for all ranks at once."""
        return self.dp_size

    @property
    def tail_policy(self) -> str | None:
        """``tail`` as given (None: the caller's policy, ``"uneven"`` by default)."""
        return self._tail

    def sample_shares(
        self, ready_indexes: Sequence[int], batch_size: int, dp_size: int, **kwargs: Any
    ) -> SharesResult:
        """Split ``batch_size * dp_size`` rows of whole groups into token-balanced shares.

        Used by the controller in collective-safe mode: it records every share itself (no
        cache here) and applies the tail policy when the final batch's shares differ in
        length (they differ by at most one group).

        Args:
            ready_indexes: ready rows in the order they became ready.
            batch_size: rows per rank; a multiple of ``n_samples_per_prompt``.
            dp_size: the number of ranks (the caller's ``dp_size``).
            **kwargs: controller context: ``tags``, ``origin``, ``final`` are used, and
                ``row_hosts`` with ``rank_hosts`` (locality: ``shares[r]`` is then rank
                ``r``'s, see the class docstring).

        Returns:
            ``(shares, every row of the batch)``, or ``([], [])`` while too few groups are
            ready.
        """
        check_context(batch_size, kwargs, dp_size)
        n = self.n_samples_per_prompt
        check_group_size(n, batch_size)
        tags = kwargs.get("tags")
        wanted = batch_size * dp_size // n
        groups = complete_groups(
            ready_indexes,
            n,
            wanted,
            tags=tags,
            origin=kwargs.get("origin"),
            group_key=self.group_key,
        )
        if not groups and kwargs.get("final") and len(ready_indexes):
            tail = kwargs.get("tail") or self._tail or self.tail
            where = (kwargs.get("partition_id", ""), tags, kwargs.get("origin"))
            return self._leftovers(ready_indexes, batch_size, dp_size, tail, *where)
        if not groups or (len(groups) < wanted and not kwargs.get("final")):
            return [], []
        shares, located = self._partition(
            groups, dp_size, tags, kwargs.get("row_hosts"), kwargs.get("rank_hosts")
        )
        if not located:
            shares.sort(key=lambda share: min(share, default=len(ready_indexes) + 1 << 62))
        return shares, [r for g in groups for r in g]

    def _partition(
        self,
        groups: list[list[int]],
        dp_size: int,
        tags: Mapping[int, Mapping[str, Any]] | None,
        row_hosts: Mapping[int, str] | None,
        rank_hosts: Sequence[str] | None,
    ) -> tuple[list[list[int]], bool]:
        """The groups split into ``dp_size`` token-balanced shares of rows, and whether
        they were split by locality (then ``shares[r]`` is rank ``r``'s)."""
        rows = [[self._row_length(r, tags) for r in g] for g in groups]
        lengths = [sum(g) for g in rows]
        # A short final batch may not divide evenly: pad with zero-length dummies so the
        # equal-size split still applies, then drop them (group counts differ by at most 1).
        n_real = len(groups)
        lengths.extend([0] * (-n_real % dp_size))
        parts = karmarkar_karp(lengths, dp_size, equal_size=True)
        located = False
        if row_hosts is not None and rank_hosts is not None:
            located = len(rank_hosts) == dp_size and any(rank_hosts)
        if located and row_hosts is not None and rank_hosts is not None:
            where: list[dict[str, int]] = []
            for g, row_lengths in zip(groups, rows, strict=True):
                tokens: dict[str, int] = {}
                for r, n in zip(g, row_lengths, strict=True):
                    host = row_hosts.get(r, "")
                    tokens[host] = tokens.get(host, 0) + n
                where.append(tokens)
            where.extend({} for _ in range(len(lengths) - n_real))
            parts = balance_by_host(
                lengths, where, [str(h or "") for h in rank_hosts], parts, self.locality_slack
            )
        shares = []
        for part in parts:
            chosen = sorted((groups[i] for i in part if i < n_real), key=min)
            shares.append([r for g in chosen for r in g])
        return shares, located

    @property
    def cache_size(self) -> int:
        """Number of batches with at least one share not yet fully read."""
        return len(self._cache)

    def sample(
        self,
        ready_indexes: Sequence[int],
        batch_size: int,
        *args: Any,
        partition_id: str = "",
        task_name: str = "",
        dp_rank: int | None = None,
        batch_index: int | None = None,
        tags: Mapping[int, Mapping[str, Any]] | None = None,
        origin: Mapping[int, tuple[int, int]] | None = None,
        final: bool = False,
        **kwargs: Any,
    ) -> SampleResult:
        """Return ``dp_rank``'s share of batch ``batch_index``; see the class docstring.

        Args:
            ready_indexes: ready rows in the order they became ready.
            batch_size: rows per rank; a multiple of ``n_samples_per_prompt``.
            *args: ignored (accepted for the contract).
            partition_id: from the controller.
            task_name: from the controller.
            dp_rank: the requesting rank, in ``0..dp_size-1`` (``sampling_config``).
            batch_index: which batch (``sampling_config``).
            tags: ``row -> tags`` view; every sampled row needs a ``length_key`` tag.
            origin: ``row -> (first row of its put, offset in the put)``.
            final: no more rows can become ready: split the whole groups that are left.
            **kwargs: other context; ``tail`` is the request's policy (over the sampler's
                own, as for a fetch); ``replays_served`` sets the read count; ``row_hosts``
                (``row -> host id``) and ``rank_hosts`` (each rank's host id) split the
                batch by locality (see the class docstring).

        Returns:
            ``(share, all_rows_of_the_batch)`` for the batch's first request,
            ``(share, [])`` for later ones, ``([], [])`` while too few groups are ready.

        Raises:
            ValueError: ``dp_rank`` or ``batch_index`` missing or out of range, bad
                ``batch_size``, a row without a ``length_key`` tag, a rank reading its share
                more than ``n_replicas`` times, or a final batch with fewer whole groups
                than ranks under the ``"error"`` tail.
        """
        if dp_rank is None or batch_index is None:
            raise InvalidRequestError(
                f"{type(self).__name__} needs dp_rank and batch_index; pass "
                'sampling_config={"dp_rank": ..., "batch_index": ...} to get_meta'
            )
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int):
            raise InvalidRequestError(f"dp_rank must be an int, got {dp_rank!r}")
        if not 0 <= dp_rank < self.dp_size:
            raise InvalidRequestError(
                f"dp_rank {dp_rank} is out of range for dp_size={self.dp_size}; "
                f"use a rank in 0..{self.dp_size - 1} or build the sampler with the real dp_size"
            )
        check_context(batch_size, {"dp_rank": dp_rank, "batch_index": batch_index}, self.dp_size)
        key = (partition_id, task_name, batch_index)
        tail = kwargs.get("tail") or self._tail or self.tail  # the request's wins, as in a fetch
        if kwargs.get("peek"):  # nothing is handed out: neither counted nor cached
            return self._peek(
                key, dp_rank, ready_indexes, batch_size, tags, origin, final, tail, kwargs
            )
        if key in self._cache:
            share = self._cache.read(key, dp_rank)
            if share is None:
                raise ValueError(
                    f"dp_rank {dp_rank} already read batch {batch_index} of partition "
                    f"{partition_id!r} for task {task_name!r} n_replicas={self.n_replicas} "
                    "times; set n_replicas to the number of readers per rank"
                )
            return share, []
        shares, consumed = self._split(
            ready_indexes,
            batch_size,
            tags,
            origin,
            final,
            partition_id,
            tail,
            kwargs.get("row_hosts"),
            kwargs.get("rank_hosts"),
        )
        if not shares:  # nothing yet, or a dropped tail: consumed, never delivered
            return [], consumed
        reads = reads_needed(self.n_replicas, kwargs)
        left = {rank: reads for rank in range(self.dp_size)}
        left[dp_rank] -= 1
        self._cache.add(key, dict(enumerate(shares)), left)
        return list(shares[dp_rank]), consumed

    def _peek(
        self,
        key: tuple[str, str, int],
        dp_rank: int,
        ready_indexes: Sequence[int],
        batch_size: int,
        tags: Mapping[int, Mapping[str, Any]] | None,
        origin: Mapping[int, tuple[int, int]] | None,
        final: bool,
        tail: str,
        kwargs: Mapping[str, Any],
    ) -> SampleResult:
        """What `sample` would hand ``dp_rank`` now, remembering nothing (a peek)."""
        if key in self._cache:
            share = self._cache.peek(key, dp_rank)
            return (share, []) if share is not None else ([], [])
        shares, _ = self._split(
            ready_indexes,
            batch_size,
            tags,
            origin,
            final,
            key[0],
            tail,
            kwargs.get("row_hosts"),
            kwargs.get("rank_hosts"),
        )
        if len(shares) != self.dp_size:
            return [], []
        return list(shares[dp_rank]), []

    def _split(
        self,
        ready_indexes: Sequence[int],
        batch_size: int,
        tags: Mapping[int, Mapping[str, Any]] | None,
        origin: Mapping[int, tuple[int, int]] | None,
        final: bool,
        partition_id: str,
        tail: str,
        row_hosts: Mapping[int, str] | None = None,
        rank_hosts: Sequence[str] | None = None,
    ) -> SharesResult:
        """``(shares, consumed)`` of the batch (``([], rows)``: rows dropped undelivered)."""
        n = self.n_samples_per_prompt
        check_group_size(n, batch_size)
        wanted = batch_size * self.dp_size // n
        groups = complete_groups(
            ready_indexes, n, wanted, tags=tags, origin=origin, group_key=self.group_key
        )
        if not groups and final and len(ready_indexes):
            where = (partition_id, tags, origin)
            return self._leftovers(ready_indexes, batch_size, self.dp_size, tail, *where)
        if len(groups) < wanted and not final:
            return [], []
        if not groups:
            return [], []
        if len(groups) < self.dp_size:
            if tail == "drop":
                rows = sorted(r for g in groups for r in g)
                log.warning(
                    "dropping a final batch smaller than dp_size",
                    partition_id=partition_id,
                    groups=len(groups),
                    rows=len(rows),
                    dp_size=self.dp_size,
                )
                return [], rows
            if tail == "error":
                raise ValueError(
                    f"partition {partition_id!r} is final with only {len(groups)} whole "
                    f"group(s) of {n} row(s) left, fewer than dp_size={self.dp_size}, so some "
                    "rank would get no rows; put a multiple of dp_size groups, clear the "
                    "leftover rows, or build the sampler with tail='drop' or 'uneven'"
                )
        shares = self._partition(groups, self.dp_size, tags, row_hosts, rank_hosts)[0]
        return shares, [r for share in shares for r in share]

    def _leftovers(
        self,
        ready_indexes: Sequence[int],
        batch_size: int,
        dp_size: int,
        tail: str,
        partition_id: str,
        tags: Mapping[int, Mapping[str, Any]] | None,
        origin: Mapping[int, tuple[int, int]] | None,
    ) -> SharesResult:
        """The partition is final and only rows of groups that can never complete are
        ready: the ``tail`` policy, as `GRPOGroupNSampler` follows it (``"uneven"``: up
        to ``batch_size`` rows per rank, each group's rows on one rank, with a warning)."""
        n = self.n_samples_per_prompt
        rows = list(ready_indexes)
        head = (
            f"{type(self).__name__}: partition {partition_id!r} is final and {len(rows)} "
            f"ready row(s) belong to prompt groups of fewer than {n} rows, which can never "
            "complete"
        )
        if tail == "error":
            raise ValueError(
                f"{head}; put whole groups, or build the sampler with tail='uneven' (deliver "
                "them) or 'drop'"
            )
        if tail == "drop":
            log.warning(f"{head}; dropping them undelivered (tail='drop')", rows=len(rows))
            return [], rows
        shares: list[list[int]] = [[] for _ in range(dp_size)]
        groups = rows_by_group(rows, n, tags=tags, origin=origin, group_key=self.group_key)
        for group in groups:
            share = min(shares, key=len)
            if len(share) + len(group) > batch_size:
                break
            share.extend(group)
        given = [r for share in shares for r in share]
        log.warning(
            f"{head}; delivering {len(given)} of them as partial groups (tail='uneven')",
            rows=len(given),
        )
        return shares, given

    def _row_length(self, row: int, tags: Mapping[int, Mapping[str, Any]] | None) -> int:
        row_tags = None if tags is None else tags.get(row)
        length = None if row_tags is None else row_tags.get(self.length_key)
        if length is None:
            length = self.missing_length
        if length is None:
            raise ValueError(
                f"row {row} has no {self.length_key!r} tag; put it with "
                f"tags=[{{{self.length_key!r}: <token count>}}, ...] (or set_tags) so "
                f"{type(self).__name__} can balance, or set length_key"
            )
        try:
            count = int(length)
        except (TypeError, ValueError):
            count = -1
        if count < 0:
            raise ValueError(
                f"row {row} has {self.length_key}={length!r}, which is not a token count; "
                f"tag each row with an int >= 0 (set_tags fixes a row's tags)"
            )
        return count

    def clear_partition(self, partition_id: str) -> None:
        """Forget every batch of ``partition_id``.

        Args:
            partition_id: the partition being cleared.
        """
        self._cache.clear(partition_id)

    def reset_partition(self, partition_id: str, task_name: str | None) -> None:
        """Forget the batches of ``task_name`` (all tasks when None) in ``partition_id``.

        Args:
            partition_id: the partition whose consumption was reset.
            task_name: the task reset, or None for every task.
        """
        self._cache.clear(partition_id, task_name)

    def state_dict(self) -> dict[str, Any]:
        """The unread shares of every cached batch (msgpack-able).

        Returns:
            ``{"entries": [[[partition_id, task_name, batch_index], [[rank, rows,
            reads_left], ...]], ...]}``.
        """
        return {"entries": self._cache.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned.

        Args:
            state: a previous `state_dict`.
        """
        self._cache.load_state_dict(list(state.get("entries", [])))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(n_samples_per_prompt={self.n_samples_per_prompt}, "
            f"dp_size={self.dp_size}, length_key={self.length_key!r}, "
            f"n_replicas={self.n_replicas}, max_entries={self._cache.max_entries})"
        )
