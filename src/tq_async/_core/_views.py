"""The read-only views of a partition's rows that samplers receive (``tags``, ``origin``,
``versions`` in their keyword arguments): mappings over the live rows, no copies."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence, Set
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

from ._groups import TagGroups
from ._versions import PolicyVersions

_EMPTY: Mapping[str, Any] = MappingProxyType({})
V = TypeVar("V")


class Rows(Protocol):
    """What the views read of a partition."""

    @property
    def n_rows(self) -> int: ...
    @property
    def n_alive(self) -> int: ...
    @property
    def base(self) -> int: ...
    @property
    def alive(self) -> Sequence[int]: ...
    @property
    def tags(self) -> Sequence[Mapping[str, Any] | None]: ...
    @property
    def origin(self) -> Sequence[int]: ...
    @property
    def versions(self) -> PolicyVersions: ...
    @property
    def groups(self) -> TagGroups: ...


class _LiveRows(Mapping[int, V]):
    """A read-only mapping over the live rows of a partition."""

    __slots__ = ("_p",)

    def __init__(self, partition: Rows) -> None:
        self._p = partition

    def __iter__(self) -> Iterator[int]:
        p = self._p
        alive, base = p.alive, p.base
        return (i + base for i in range(len(alive)) if alive[i])

    def __len__(self) -> int:
        return self._p.n_alive


class RowTags(_LiveRows[Mapping[str, Any]]):
    """Read-only ``row -> tags`` view of a partition (rows without tags map to ``{}``)."""

    __slots__ = ()

    def __getitem__(self, row: int) -> Mapping[str, Any]:
        if not self._p.base <= row < self._p.n_rows:
            raise KeyError(row)
        tags = self._p.tags[row - self._p.base]
        return MappingProxyType(tags) if tags else _EMPTY

    def tagged(self, tag: str, value: Any) -> Set[int]:
        """The live rows of the partition whose ``tag`` is ``value`` (ready or not).

        An index kept up to date on every tag change (built by one scan on first use), so a
        sampler checks a group against the whole partition in ``O(1)``.
        """
        return self._p.groups.rows(tag, value)


class RowOrigin(_LiveRows[tuple[int, int]]):
    """Read-only ``row -> (first row of the put that created it, offset within that put)``."""

    __slots__ = ()

    def __getitem__(self, row: int) -> tuple[int, int]:
        if not self._p.base <= row < self._p.n_rows:
            raise KeyError(row)
        first = self._p.origin[row - self._p.base]
        return first, row - first


class RowVersions(_LiveRows[int]):
    """Read-only ``row -> policy version`` view (the row's oldest field version; -1: none)."""

    __slots__ = ()

    def __getitem__(self, row: int) -> int:
        if not self._p.base <= row < self._p.n_rows:
            raise KeyError(row)
        return self._p.versions.rows[row - self._p.base]


class PlacedRows(Rows, Protocol):
    """What `RowHosts` reads of a partition: the rows and each row's unit."""

    @property
    def units(self) -> Sequence[int]: ...


class RowHosts(_LiveRows[str]):
    """Read-only ``row -> host id`` view: the host of the unit holding the row (``""``:
    unknown). Locality: a sampler may prefer rows on the asking rank's host (``rank_host``)."""

    __slots__ = ("_hosts",)
    _p: PlacedRows

    def __init__(self, partition: PlacedRows, hosts: Mapping[int, str]) -> None:
        self._p = partition
        self._hosts = hosts

    def __getitem__(self, row: int) -> str:
        if not self._p.base <= row < self._p.n_rows:
            raise KeyError(row)
        return self._hosts.get(self._p.units[row - self._p.base], "")
