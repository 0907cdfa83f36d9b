"""Reply encoding, and the ``kv_list`` request across releases."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tq_async._wire._protocol import (
    ControllerRequest,
    KVColumns,
    KVList,
    Reply,
    controller_request_decoder,
    encoder,
    ok_reply,
)


@pytest.mark.parametrize(
    "payload",
    [
        None,
        7,
        "x",
        [1, 2],
        {"p": {"k": {"t": 1}}},
        KVColumns(1, memoryview(b"\x91\xa1k"), memoryview(b"\x91\x80")),
    ],
)
def test_ok_reply_is_the_payload_encoded_in_place(payload: Any) -> None:
    # one pass gives the bytes of the former two (payload encoded apart, embedded as Raw)
    two_pass = encoder.encode(Reply(3, True, msgspec.Raw(encoder.encode(payload))))
    assert ok_reply(3, payload) == two_pass


def test_a_kv_list_without_packed_asks_for_the_map() -> None:
    class OldKVList(msgspec.Struct, array_like=True, tag="KVList"):
        partition_id: str | None = None

    class OldRequest(msgspec.Struct, array_like=True):
        rid: int
        body: OldKVList

    req = controller_request_decoder.decode(encoder.encode(OldRequest(1, OldKVList("p"))))
    assert isinstance(req, ControllerRequest)
    assert req.body == KVList("p", packed=False)


def test_kv_columns_travel_as_binary_the_reply_skips() -> None:
    keys, tags = encoder.encode(["a", "b"]), encoder.encode([{}, {"t": 1}])
    payload = {"p": KVColumns(2, memoryview(keys), memoryview(tags))}
    reply = msgspec.msgpack.decode(ok_reply(1, payload), type=Reply)
    typ = dict[str, KVColumns | dict[str, dict[str, Any]]]
    got = msgspec.msgpack.decode(reply.payload, type=typ)["p"]
    assert isinstance(got, KVColumns)
    assert (got.n, bytes(got.keys), bytes(got.tags)) == (2, keys, tags)
    # a controller that does not pack answers a map: the same type reads it
    old = msgspec.msgpack.decode(encoder.encode({"p": {"a": {}}}), type=typ)
    assert old == {"p": {"a": {}}}
