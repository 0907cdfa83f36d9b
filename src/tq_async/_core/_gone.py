"""What a caller is told when the rows it names were cleared under it, or before it came:
each message says what to do for the call that got it (a caller with a BatchMeta fetches a
new one; a put, a get or a KV read that has none calls itself again)."""

from __future__ import annotations

__all__ = ["cleared_under_put", "cleared_under_read", "stale_incarnation"]


def stale_incarnation(partition_id: str) -> str:
    """The message for a BatchMeta whose partition was cleared and its id reused."""
    return (
        f"partition {partition_id!r} was cleared and re-created since this BatchMeta was "
        "made: its rows are gone (the new partition's rows are other samples); fetch a new "
        "BatchMeta with get_meta"
    )


def cleared_under_read(partition_id: str, call: str) -> str:
    """The message for a read (``call``: ``get``, ``kv_batch_get``, ...) whose rows were
    removed between the controller's answer and the read of their cells (its caller has no
    BatchMeta to fetch again)."""
    return (
        f"rows of partition {partition_id!r} were removed (a clear, kv_clear or auto-clear) "
        f"while this {call} read their cells: they are gone; call {call} again"
    )


def cleared_under_put(partition_id: str) -> str:
    """The message for a put whose new rows' partition was cleared between their placement
    and its commit (its caller has no BatchMeta to fetch again)."""
    return (
        f"partition {partition_id!r} was cleared (clear_partition) while this put wrote its "
        "rows: nothing of it was kept; put again (into the partition as it is now)"
    )
