"""A recovered partition against the live one it was recorded from.

A controller recovering a journal record that reserved row ids ahead (see
`tq_async._core._journal.row_reservation`) has those rows too, dead: it is the live
partition followed by rows that never existed.
"""

from __future__ import annotations

import msgspec

from tq_async._core._dumps import partition_dump
from tq_async._core._state import Partition
from tq_async._wire._protocol import FieldDump, PartitionDump


def assert_recovered_as(recovered: Partition, live: Partition) -> None:
    """``recovered`` is ``live`` followed by dead rows (the ids the record reserved)."""
    n = live.n_rows
    assert recovered.n_rows >= n
    assert recovered.base == live.base
    assert not any(recovered.alive[n - live.base :]), "a reserved row is alive"
    assert _first(partition_dump(recovered), n) == partition_dump(live)


def _first(d: PartitionDump, n_rows: int) -> PartitionDump:
    """``d`` with only its rows below ``n_rows``."""
    n = n_rows - d.base  # (its arrays start at row ``d.base``)
    return msgspec.structs.replace(
        d,
        n_rows=n_rows,
        alive=d.alive[:n],
        origin=d.origin[:n],
        units=d.units[:n],
        tags=d.tags[:n],
        row_keys=d.row_keys[:n],
        fields=[FieldDump(f.header, f.produced[:n]) for f in d.fields],
        consumed={t: c[:n] for t, c in d.consumed.items()},
        row_version=d.row_version[:n],
        field_versions={f: v[:n] for f, v in d.field_versions.items()},
    )
