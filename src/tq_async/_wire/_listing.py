"""What ``kv_list`` returns for one partition: ``{key: tags}``, decoded when first read.

The controller answers a listing as two encoded columns (`KVColumns`): the keys and their tags,
each one msgpack array. Decoding 100k keys with their tag dicts and building the dict costs
tens of milliseconds, more than the whole request, and a poll that only counts the keys, or
lists them, never needs the tags. So `KVListing` keeps the columns as they came and decodes
each in one call, when it is first needed:

- ``len(listing)`` decodes nothing; iterating the keys (``for k in listing``, ``list(...)``,
  ``sorted(...)``) decodes the keys column only;
- anything that reads a value or looks a key up (``listing[k]``, ``k in listing``,
  ``.items()``, ``.get()``, ``==``, a change) builds the plain dict once, and from then on
  works on it.

It is a `MutableMapping` that behaves as the dict it stands for (equality with dicts, ``repr``,
``copy()`` and pickling give a plain dict); ``dict(listing)`` is the dict itself, for what
takes only real dicts (``json.dumps``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import msgspec

__all__ = ["KVListing"]

_keys_decoder = msgspec.msgpack.Decoder(list[str])
_tags_decoder = msgspec.msgpack.Decoder(list[dict[str, Any]])


class KVListing(MutableMapping[str, dict[str, Any]]):
    """One partition's ``kv_list`` answer, ``{key: tags}``, decoded when first read.

    Behaves as a ``dict`` (compares equal to one, prints as one, pickles and copies to one);
    ``len()`` and iterating the keys do not decode the tags. See `tq_async._wire._listing`.
    """

    __slots__ = ("_dict", "_keys", "_keys_raw", "_n", "_tags_raw")

    def __init__(
        self,
        data: Mapping[str, dict[str, Any]] | None = None,
        *,
        n: int = 0,
        keys: bytes | memoryview = b"\x90",
        tags: bytes | memoryview = b"\x90",
    ) -> None:
        #: the decoded dict, once something needed it (then the columns are dropped)
        self._dict: dict[str, dict[str, Any]] | None = None if data is None else dict(data)
        self._n = n
        self._keys_raw: bytes | memoryview | None = keys
        self._tags_raw: bytes | memoryview | None = tags
        self._keys: list[str] | None = None

    # ---- decoding ------------------------------------------------------------------------------

    def _key_list(self) -> list[str]:
        keys = self._keys
        if keys is None:
            keys = self._keys = _keys_decoder.decode(self._keys_raw or b"\x90")
            self._keys_raw = None
        return keys

    def _data(self) -> dict[str, dict[str, Any]]:
        data = self._dict
        if data is None:
            tags = _tags_decoder.decode(self._tags_raw or b"\x90")
            data = self._dict = dict(zip(self._key_list(), tags, strict=True))
            self._keys = self._tags_raw = None
        return data

    # ---- the mapping ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._n if self._dict is None else len(self._dict)

    def __iter__(self) -> Iterator[str]:
        if self._dict is not None:
            return iter(self._dict)
        return iter(self._key_list())

    def __getitem__(self, key: str) -> dict[str, Any]:
        return self._data()[key]

    def __contains__(self, key: object) -> bool:
        return key in self._data()

    def __setitem__(self, key: str, value: dict[str, Any]) -> None:
        self._data()[key] = value

    def __delitem__(self, key: str) -> None:
        del self._data()[key]

    def get(self, key: str, default: Any = None) -> Any:
        """The tags of ``key``, or ``default`` when the listing lacks it."""
        return self._data().get(key, default)

    def keys(self) -> Any:
        """The keys (a view of the decoded dict, or, before anything decoded it, of this)."""
        return self._dict.keys() if self._dict is not None else super().keys()

    def items(self) -> Any:
        """``(key, tags)`` pairs: a view of the decoded dict."""
        return self._data().items()

    def values(self) -> Any:
        """The tags, key by key: a view of the decoded dict."""
        return self._data().values()

    def copy(self) -> dict[str, dict[str, Any]]:
        """A plain dict of the same entries (the tag dicts shared, as ``dict.copy``)."""
        return self._data().copy()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KVListing):
            return self._data() == other._data()
        if isinstance(other, Mapping):
            return self._data() == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # (mutable, as a dict)

    def __or__(self, other: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return self._data() | dict(other)

    def __repr__(self) -> str:
        return repr(self._data())

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (self._data(),))
