"""`KVListing`: one partition's ``kv_list`` answer, a dict decoded when first read."""

from __future__ import annotations

import json
import pickle
from typing import Any

import msgspec
import pytest

from tq_async import KVListing

KEYS = ["a", "b", "c"]
TAGS: list[dict[str, Any]] = [{"t": 1}, {}, {"u": [1, 2]}]


def _listing(keys: list[str] = KEYS, tags: Any = TAGS) -> KVListing:
    encoded_tags = tags if isinstance(tags, bytes) else msgspec.msgpack.encode(tags)
    return KVListing(n=len(keys), keys=msgspec.msgpack.encode(keys), tags=encoded_tags)


def test_len_and_the_keys_never_decode_the_tags() -> None:
    broken = _listing(tags=b"\xc1")  # not msgpack: any read of a value fails
    assert len(broken) == 3
    assert list(broken) == KEYS
    assert sorted(broken.keys()) == KEYS
    with pytest.raises(msgspec.DecodeError):
        broken["a"]


def test_it_reads_as_the_dict_it_stands_for() -> None:
    listing, plain = _listing(), dict(zip(KEYS, TAGS, strict=True))
    assert listing == plain
    assert plain == listing
    assert listing == _listing()
    assert listing != {"a": {}}
    assert repr(listing) == repr(plain)
    assert listing["c"] == {"u": [1, 2]}
    assert listing.get("zz") is None
    assert "b" in listing
    assert "zz" not in listing
    assert list(listing.items()) == list(plain.items())
    assert list(listing.values()) == TAGS
    assert dict(listing) == plain
    assert json.loads(json.dumps(dict(listing))) == plain
    assert listing.copy() == plain
    assert type(listing.copy()) is dict
    assert (listing | {"d": {}}) == {**plain, "d": {}}


def test_it_pickles_and_copies_to_a_plain_dict() -> None:
    back = pickle.loads(pickle.dumps(_listing()))
    assert type(back) is dict
    assert back == dict(zip(KEYS, TAGS, strict=True))


def test_changes_stay_in_the_listing() -> None:
    listing = _listing()
    listing["a"]["t"] = 2
    listing["d"] = {"new": True}
    del listing["b"]
    assert listing.pop("c") == {"u": [1, 2]}
    assert listing == {"a": {"t": 2}, "d": {"new": True}}
    assert len(listing) == 2
    assert list(listing) == ["a", "d"]


def test_each_key_gets_its_own_tags_dict() -> None:
    listing = _listing(["a", "b"], [{"s": 1}, {"s": 1}])
    listing["a"]["s"] = 2
    assert listing["b"] == {"s": 1}


def test_an_answer_as_a_map_reads_the_same() -> None:
    listing = KVListing({"a": {"t": 1}})
    assert len(listing) == 1
    assert listing == {"a": {"t": 1}}
    assert list(listing) == ["a"]


def test_an_empty_listing() -> None:
    assert KVListing() == {}
    assert len(KVListing()) == 0
    assert list(_listing([], [])) == []
